//! Teardown plans as data: parsing, validation and the dependency graph.
//!
//! A plan is a TOML file of steps (see `plans/default.toml`). [`Plan::from_str`] and
//! [`Plan::load`] parse and validate it completely, so that every mistake in a plan is reported
//! with its line before anything touches a cluster. [`Plan::expand`] turns a valid plan and the
//! live objects into a [`TaskGraph`] for the engine; [`Plan::render`] shows the plan to a user.
//!
//! Validation stops at the first problem, in file order: a plan is short, and one precise message
//! beats a cascade of follow-on errors (an unknown action makes every param of its step suspect).

mod action;
mod error;
mod graph;
mod render;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::num::NonZeroUsize;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

pub use action::{
    Action, ActionSpec, DEFAULT_CONCURRENCY, DEFAULT_SETTLE, ForEachRule, ObjectKind, OnDeadline, ParamKey, Params,
};
pub use error::{Location, PlanError};
pub use graph::{Growth, ObjectSets, ReadyTracker, StepSummary, TaskGraph, TaskId, TaskNode, TaskSummary};
pub use render::{RenderFormat, UnknownRenderFormat};

/// The only plan format version this program reads.
pub const PLAN_VERSION: i64 = 1;

const DEFAULT_PLAN: &str = include_str!("../../plans/default.toml");
const DELEGATE_PLAN: &str = include_str!("../../plans/delegate.toml");

/// The plans compiled into the binary, by name.
pub const BUILTIN_PLANS: [&str; 2] = ["default", "delegate"];

/// A validated teardown plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    name: String,
    description: Option<String>,
    source: String,
    steps: Vec<Step>,
    /// Indices into `steps` in an order that respects every `after` (file order where free).
    order: Vec<usize>,
}

/// One validated step of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// Unique id, `[a-z0-9-]+`.
    pub id: String,
    /// What the step does.
    pub action: Action,
    /// Ids of the steps this one runs after, without duplicates, in the order written.
    pub after: Vec<String>,
    /// The kind of object the step is expanded over, one task per object; `None`: one task.
    pub for_each: Option<ObjectKind>,
    /// Free text shown in `plan` output.
    pub description: Option<String>,
    /// Params with every default resolved.
    pub params: Params,
    /// The params the plan set explicitly (the rest are defaults), for rendering.
    pub explicit_params: BTreeSet<ParamKey>,
    /// Indices of `after` in the plan's step list.
    after_idx: Vec<usize>,
}

// The file format. Spans ride along so that semantic errors can name a line; strings are parsed
// by hand (not as serde enums) so that their errors say what the valid choices are.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    version: Spanned<i64>,
    name: Spanned<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default, rename = "step")]
    steps: Vec<Spanned<RawStep>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStep {
    id: Spanned<String>,
    action: Spanned<String>,
    #[serde(default)]
    after: Vec<Spanned<String>>,
    #[serde(default)]
    for_each: Option<Spanned<String>>,
    #[serde(default)]
    description: Option<String>,
    // Keys are checked against the step's action rather than by serde, so an unknown key can be
    // told apart from a key that belongs to another action, each with its own advice.
    #[serde(default)]
    params: BTreeMap<Spanned<String>, Spanned<toml::Value>>,
}

impl Plan {
    /// Parses and validates a plan. `source_name` is how messages name the text (a path, or
    /// `builtin:default`).
    ///
    /// Named like [`std::str::FromStr::from_str`] but takes the source name too, which the trait
    /// cannot carry.
    pub fn from_str(text: &str, source_name: &str) -> Result<Plan, PlanError> {
        Parser { text, source: source_name }.parse()
    }

    /// Reads, parses and validates a plan file. Blocking: plans are read once, at start-up,
    /// before the runtime does anything else.
    pub fn load(path: impl AsRef<Path>) -> Result<Plan, PlanError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Read { path: path.to_owned(), source })?;
        Plan::from_str(&text, &path.display().to_string())
    }

    /// The default plan (`plans/default.toml`), compiled in.
    pub fn builtin_default() -> Plan {
        // Cannot fail: the text is compiled in, and the unit test `builtin_plans_parse` parses
        // exactly this text, so a broken `plans/default.toml` never gets past CI.
        Plan::from_str(DEFAULT_PLAN, "builtin:default").expect("plans/default.toml is valid (tested)")
    }

    /// A compiled-in plan by name: `default` or `delegate`.
    pub fn builtin(name: &str) -> Result<Plan, PlanError> {
        let text = match name {
            "default" => DEFAULT_PLAN,
            "delegate" => DELEGATE_PLAN,
            _ => {
                return Err(PlanError::UnknownBuiltin { name: name.to_owned(), known: BUILTIN_PLANS.join(", ") });
            }
        };
        Plan::from_str(text, &format!("builtin:{name}"))
    }

    /// The TOML text of a compiled-in plan, for `plan --show-source` style output or to start a
    /// custom plan from.
    pub fn builtin_text(name: &str) -> Option<&'static str> {
        match name {
            "default" => Some(DEFAULT_PLAN),
            "delegate" => Some(DELEGATE_PLAN),
            _ => None,
        }
    }

    /// The plan's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plan's description, if it has one.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// Where the plan came from (a path or `builtin:<name>`).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The steps in file order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// The step with this id.
    pub fn step(&self, id: &str) -> Option<&Step> {
        self.steps.iter().find(|s| s.id == id)
    }

    /// The same plan with its drain steps' deadlines multiplied by `factor`: a rehearsal runs
    /// grace periods on a clock `factor` times as fast as the real one, and a drain's deadline
    /// must pass at the same point of its waits as it would for real. The other steps' deadlines
    /// bound API and EC2 work, which a rehearsal does at its own speed: they stay as they are.
    pub fn with_drain_deadlines_scaled(&self, factor: f64) -> Plan {
        let mut plan = self.clone();
        for step in plan.steps.iter_mut().filter(|s| s.action == Action::Drain) {
            if let Some(d) = step.params.deadline {
                step.params.deadline = Some(d.mul_f64(factor).max(std::time::Duration::from_millis(1)));
            }
        }
        plan
    }

    /// Checks the plan for a run with `--reclaim`: a `verify` step reclaims what EC2 still holds
    /// (terminating instances without a drain), so each one must run after a `drain` step, by
    /// its `after` chain. A plan that only checks (preflight and verify) would otherwise
    /// terminate instances under nodes still running pods.
    pub fn check_reclaim(&self) -> Result<(), PlanError> {
        for (i, step) in self.steps.iter().enumerate().filter(|(_, s)| s.action == Action::Verify) {
            if !self.runs_after(i, Action::Drain) {
                return Err(PlanError::ReclaimBeforeDrain { source_name: self.source.clone(), step: step.id.clone() });
            }
        }
        Ok(())
    }

    /// Whether step `i` runs after a step of `action` (through its `after`, transitively).
    fn runs_after(&self, i: usize, action: Action) -> bool {
        let mut seen = vec![false; self.steps.len()];
        let mut stack: Vec<usize> = self.steps[i].after_idx.clone();
        while let Some(j) = stack.pop() {
            if std::mem::replace(&mut seen[j], true) {
                continue;
            }
            if self.steps[j].action == action {
                return true;
            }
            stack.extend(self.steps[j].after_idx.iter().copied());
        }
        false
    }

    /// The steps in an order that respects every `after`, keeping file order where the
    /// dependencies leave a choice.
    pub fn ordered_steps(&self) -> impl Iterator<Item = &Step> + '_ {
        self.order.iter().map(|&i| &self.steps[i])
    }
}

struct Parser<'a> {
    text: &'a str,
    source: &'a str,
}

impl Parser<'_> {
    fn at<T>(&self, spanned: &Spanned<T>) -> Location {
        Location::of_span(self.source, self.text, spanned.span())
    }

    fn parse(&self) -> Result<Plan, PlanError> {
        let raw: RawPlan = toml::from_str(self.text).map_err(|e| PlanError::from_toml(&e, self.text, self.source))?;

        if *raw.version.get_ref() != PLAN_VERSION {
            return Err(PlanError::UnsupportedVersion { at: self.at(&raw.version), found: *raw.version.get_ref() });
        }
        if raw.name.get_ref().trim().is_empty() {
            return Err(PlanError::EmptyName { at: self.at(&raw.name) });
        }
        if raw.steps.is_empty() {
            return Err(PlanError::EmptyPlan { source_name: self.source.to_owned() });
        }

        let mut first_line: HashMap<&str, usize> = HashMap::new();
        let mut steps = Vec::with_capacity(raw.steps.len());
        for raw_step in &raw.steps {
            let raw_step = raw_step.get_ref();
            let id = raw_step.id.get_ref();
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
                return Err(PlanError::InvalidId { at: self.at(&raw_step.id), id: id.clone() });
            }
            let at = self.at(&raw_step.id);
            if let Some(&line) = first_line.get(id.as_str()) {
                return Err(PlanError::DuplicateId { at, id: id.clone(), first_line: line });
            }
            first_line.insert(id, at.line);
            steps.push(self.step(raw_step)?);
        }

        self.link(&raw, &mut steps)?;
        let order = self.order(&raw, &steps)?;
        Ok(Plan {
            name: raw.name.into_inner(),
            description: raw.description,
            source: self.source.to_owned(),
            steps,
            order,
        })
    }

    /// Validates one step on its own: action, for_each, params. `after` is checked once all ids
    /// are known.
    fn step(&self, raw: &RawStep) -> Result<Step, PlanError> {
        let id = raw.id.get_ref().clone();
        let action_name = raw.action.get_ref();
        let action: Action = action_name
            .parse()
            .map_err(|()| PlanError::UnknownAction { at: self.at(&raw.action), action: action_name.clone() })?;

        let for_each = match &raw.for_each {
            None => None,
            Some(value) => Some(
                value
                    .get_ref()
                    .parse::<ObjectKind>()
                    .map_err(|()| PlanError::UnknownForEach { at: self.at(value), value: value.get_ref().clone() })?,
            ),
        };
        self.check_for_each(&id, action, raw, for_each)?;

        let (params, explicit_params) = self.params(action, &raw.params)?;

        let mut after: Vec<String> = Vec::with_capacity(raw.after.len());
        for dep in &raw.after {
            if !after.contains(dep.get_ref()) {
                after.push(dep.get_ref().clone());
            }
        }
        Ok(Step {
            id,
            action,
            after,
            for_each,
            description: raw.description.clone(),
            params,
            explicit_params,
            after_idx: Vec::new(),
        })
    }

    fn check_for_each(
        &self,
        id: &str,
        action: Action,
        raw: &RawStep,
        for_each: Option<ObjectKind>,
    ) -> Result<(), PlanError> {
        let problem = match (action.spec().for_each, for_each) {
            (ForEachRule::Never, Some(kind)) => format!(
                "action {:?} acts on the cluster as a whole and cannot run per object; remove for_each = {:?}",
                action.name(),
                kind.name()
            ),
            (ForEachRule::Required(want), None) => {
                format!("action {:?} runs once per object; add for_each = {:?}", action.name(), want.name())
            }
            (ForEachRule::Required(want), Some(kind)) if kind != want => format!(
                "action {:?} runs once per {}, not per {}; write for_each = {:?}",
                action.name(),
                want.name(),
                kind.name(),
                want.name()
            ),
            (ForEachRule::Optional(want), Some(kind)) if kind != want => format!(
                "action {:?} can run once per {}, not per {}; write for_each = {:?} or remove for_each",
                action.name(),
                want.name(),
                kind.name(),
                want.name()
            ),
            _ => return Ok(()),
        };
        let at = match &raw.for_each {
            Some(value) => self.at(value),
            None => self.at(&raw.action),
        };
        Err(PlanError::WrongForEach { at, step: id.to_owned(), problem })
    }

    fn params(
        &self,
        action: Action,
        raw: &BTreeMap<Spanned<String>, Spanned<toml::Value>>,
    ) -> Result<(Params, BTreeSet<ParamKey>), PlanError> {
        let spec = action.spec();
        let mut params = action.default_params();
        let mut explicit = BTreeSet::new();
        // The map is ordered by key name; report the first problem in file order instead.
        let mut entries: Vec<_> = raw.iter().collect();
        entries.sort_by_key(|(k, _)| k.span().start);
        for (key, value) in entries {
            let name = key.get_ref();
            let Some(param) = name.parse::<ParamKey>().ok().filter(|p| action.accepts(*p)) else {
                return Err(PlanError::ParamNotAccepted { at: self.at(key), action, param: name.clone() });
            };
            match param {
                ParamKey::Deadline => {
                    let (d, text) = self.duration(param, value)?;
                    if d.is_zero() {
                        return Err(PlanError::BadDuration {
                            at: self.at(value),
                            param,
                            value: text.to_owned(),
                            reason: "a deadline of zero would expire before the step starts".to_owned(),
                        });
                    }
                    params.deadline = Some(d);
                }
                ParamKey::Settle => params.settle = self.duration(param, value)?.0,
                ParamKey::OnDeadline => {
                    let text = self.string(param, value, "one of the choices below, e.g. \"fail\"")?;
                    params.on_deadline =
                        text.parse::<OnDeadline>().ok().filter(|o| spec.on_deadline.contains(o)).ok_or_else(|| {
                            PlanError::BadOnDeadline { at: self.at(value), action, value: text.to_owned() }
                        })?;
                }
                ParamKey::Concurrency => {
                    let toml::Value::Integer(n) = value.get_ref() else {
                        return Err(self.type_error(param, value, "a positive integer, e.g. 64"));
                    };
                    params.concurrency = usize::try_from(*n)
                        .ok()
                        .and_then(NonZeroUsize::new)
                        .ok_or_else(|| PlanError::BadConcurrency { at: self.at(value), value: *n })?;
                }
            }
            explicit.insert(param);
        }
        Ok((params, explicit))
    }

    fn string<'v>(
        &self,
        param: ParamKey,
        value: &'v Spanned<toml::Value>,
        expected: &'static str,
    ) -> Result<&'v str, PlanError> {
        match value.get_ref() {
            toml::Value::String(s) => Ok(s),
            _ => Err(self.type_error(param, value, expected)),
        }
    }

    /// The duration and the text it was parsed from.
    fn duration<'v>(&self, param: ParamKey, value: &'v Spanned<toml::Value>) -> Result<(Duration, &'v str), PlanError> {
        let text = self.string(param, value, "a duration string, e.g. \"10m\"")?;
        let duration = humantime::parse_duration(text).map_err(|e| PlanError::BadDuration {
            at: self.at(value),
            param,
            value: text.to_owned(),
            reason: e.to_string(),
        })?;
        Ok((duration, text))
    }

    fn type_error(&self, param: ParamKey, value: &Spanned<toml::Value>, expected: &'static str) -> PlanError {
        PlanError::ParamType {
            at: self.at(value),
            param,
            expected,
            found: format!("{} {}", value.get_ref().type_str(), value_text(value)),
        }
    }

    /// Resolves every `after` to a step index.
    fn link(&self, raw: &RawPlan, steps: &mut [Step]) -> Result<(), PlanError> {
        let index: HashMap<String, usize> = steps.iter().enumerate().map(|(i, s)| (s.id.clone(), i)).collect();
        for (step, raw_step) in steps.iter_mut().zip(&raw.steps) {
            for dep in &raw_step.get_ref().after {
                let Some(&i) = index.get(dep.get_ref()) else {
                    return Err(PlanError::UnknownDependency {
                        at: self.at(dep),
                        step: step.id.clone(),
                        missing: dep.get_ref().clone(),
                        known: raw.steps.iter().map(|s| s.get_ref().id.get_ref().clone()).collect(),
                    });
                };
                if !step.after_idx.contains(&i) {
                    step.after_idx.push(i);
                }
            }
        }
        Ok(())
    }

    /// A topological order of the steps (Kahn's algorithm, lowest file index first so a plan
    /// written in order keeps its order), or the first cycle.
    fn order(&self, raw: &RawPlan, steps: &[Step]) -> Result<Vec<usize>, PlanError> {
        let n = steps.len();
        let mut waiting: Vec<usize> = steps.iter().map(|s| s.after_idx.len()).collect();
        let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, s) in steps.iter().enumerate() {
            for &d in &s.after_idx {
                dependents[d].push(i);
            }
        }
        let mut ready: BTreeSet<usize> = (0..n).filter(|&i| waiting[i] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(i) = ready.pop_first() {
            order.push(i);
            for &j in &dependents[i] {
                waiting[j] -= 1;
                if waiting[j] == 0 {
                    ready.insert(j);
                }
            }
        }
        if order.len() == n {
            return Ok(order);
        }
        let (cycle, closing) = find_cycle(steps);
        let names: Vec<String> = cycle.iter().map(|&i| steps[i].id.clone()).collect();
        // Point at the `after` entry of the cycle's first step that names its predecessor.
        let (step, dep) = closing;
        let at = raw.steps[step]
            .get_ref()
            .after
            .iter()
            .find(|a| *a.get_ref() == steps[dep].id)
            .map_or_else(|| self.at(&raw.steps[step].get_ref().id), |a| self.at(a));
        Err(PlanError::Cycle { at, cycle: names })
    }
}

/// Finds a cycle among steps known to have one. Returns the cycle in run order starting and
/// ending at its step earliest in the file, and the (step, dependency) pair whose `after` entry
/// closes it.
fn find_cycle(steps: &[Step]) -> (Vec<usize>, (usize, usize)) {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        OnPath,
        Done,
    }
    let mut mark = vec![Mark::New; steps.len()];
    // Iterative DFS along `after` (towards dependencies), so a long chain cannot overflow the
    // stack. Each frame is (step, next `after` position to look at).
    for start in 0..steps.len() {
        if mark[start] != Mark::New {
            continue;
        }
        let mut path: Vec<(usize, usize)> = vec![(start, 0)];
        mark[start] = Mark::OnPath;
        while let Some(frame) = path.last_mut() {
            let node = frame.0;
            let Some(&dep) = steps[node].after_idx.get(frame.1) else {
                mark[node] = Mark::Done;
                path.pop();
                continue;
            };
            frame.1 += 1;
            match mark[dep] {
                Mark::New => {
                    mark[dep] = Mark::OnPath;
                    path.push((dep, 0));
                }
                Mark::OnPath => {
                    // The path from `dep` to `node` follows `after`, i.e. runs backwards in time.
                    let from = path.iter().position(|&(s, _)| s == dep).unwrap_or(0);
                    let mut cycle: Vec<usize> = path[from..].iter().map(|&(s, _)| s).collect();
                    cycle.reverse();
                    let first = cycle.iter().enumerate().min_by_key(|&(_, s)| *s).map_or(0, |(i, _)| i);
                    cycle.rotate_left(first);
                    let head = cycle[0];
                    let before_head = cycle[cycle.len() - 1];
                    cycle.push(head);
                    return (cycle, (head, before_head));
                }
                Mark::Done => {}
            }
        }
    }
    // Unreachable for a plan whose topological sort failed; an empty cycle still produces a
    // readable error rather than a panic.
    (Vec::new(), (0, 0))
}

/// A param value as written, for messages.
fn value_text(value: &Spanned<toml::Value>) -> String {
    match value.get_ref() {
        toml::Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_plans_parse() {
        let default = Plan::from_str(DEFAULT_PLAN, "builtin:default");
        assert!(default.is_ok(), "plans/default.toml: {default:?}");
        assert_eq!(Plan::builtin_default().name(), "default");
        for name in BUILTIN_PLANS {
            let plan = Plan::builtin(name);
            assert!(plan.is_ok(), "builtin {name}: {plan:?}");
            assert!(Plan::builtin_text(name).is_some());
        }
        assert!(matches!(Plan::builtin("nope"), Err(PlanError::UnknownBuiltin { .. })));
    }

    fn steps(after: &[&[usize]]) -> Vec<Step> {
        after
            .iter()
            .enumerate()
            .map(|(i, deps)| Step {
                id: format!("s{i}"),
                action: Action::Fence,
                after: Vec::new(),
                for_each: None,
                description: None,
                params: Action::Fence.default_params(),
                explicit_params: BTreeSet::new(),
                after_idx: deps.to_vec(),
            })
            .collect()
    }

    #[test]
    fn find_cycle_reports_run_order_from_the_earliest_step() {
        // s0 after s2, s1 after s0, s2 after s1: s0 -> s1 -> s2 -> s0; s0's `after` closes it.
        let (cycle, closing) = find_cycle(&steps(&[&[2], &[0], &[1]]));
        assert_eq!(cycle, vec![0, 1, 2, 0]);
        assert_eq!(closing, (0, 2));
        // A self-loop.
        let (cycle, closing) = find_cycle(&steps(&[&[], &[1]]));
        assert_eq!(cycle, vec![1, 1]);
        assert_eq!(closing, (1, 1));
        // A cycle reached through a step that is not on it.
        let (cycle, _) = find_cycle(&steps(&[&[2], &[3], &[1], &[2]]));
        assert_eq!(cycle, vec![1, 2, 3, 1]);
    }
}
