//! From a rehearsal on the accelerated copy to a prediction on the real clock.
//!
//! The copy runs every grace period and every Karpenter delay `time_scale` times as fast, and the
//! drain deadline too (its clock starting once the node's evictions are asked for), so each wait
//! ends at the same point of the work as it would for real.
//! The API and EC2 work is not accelerated: it is measured as it is. So a step's real duration is
//! predicted as what the rehearsal measured, plus the part of its waits the acceleration took
//! away: `measured + (1 - time_scale) × waits`, where `waits` is the step's chain of real waits
//! read from the snapshot (the drain: the slowest node's grace periods, wave after wave, or the
//! drain deadline when the rehearsal hit it; removing the controller: its pods' grace period).
//! What a task gets back delays the tasks that run after it, and only those: the plan's order
//! says which, so a wait beside the drain (the controller's removal) is not added to it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use crate::report::{StepRecord, TaskResult};
use crate::snapshot::{RawObject, Snapshot};

/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE: i64 = 30;
/// The priority classes a drain evicts last (Karpenter's and the tool's second wave).
const CRITICAL_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];

/// One step of the plan, as predicted.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct StepPrediction {
    /// Step id.
    pub step: String,
    /// Its action.
    pub action: String,
    /// Tasks it ran in the rehearsal.
    pub tasks: usize,
    /// Of those, the tasks of machines found after the expansion (launched during the run).
    #[serde(skip_serializing_if = "is_zero")]
    pub found_late: usize,
    /// How the step ended in the rehearsal (its worst task).
    pub result: TaskResult,
    /// Wall time in the rehearsal, seconds.
    pub rehearsal_seconds: f64,
    /// Real waits on the step's critical chain, seconds (see the module documentation).
    pub waits_seconds: f64,
    /// Predicted wall time on the real clock, seconds.
    pub predicted_seconds: f64,
    /// Its share of the predicted total (0–1).
    pub share: f64,
    /// Where its waits come from.
    pub basis: String,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The per-step predictions and their total.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub(crate) struct Timing {
    /// The steps, in the order they started.
    pub steps: Vec<StepPrediction>,
    /// Predicted wall time of the whole run, seconds.
    pub predicted_seconds: f64,
    /// Wall time of the rehearsal's run, seconds.
    pub rehearsal_seconds: f64,
}

/// What the timing model needs of the run's settings.
#[derive(Debug, Clone)]
pub(crate) struct TimingInputs {
    /// The copy's clock.
    pub time_scale: f64,
    /// The drain deadline on the real clock.
    pub drain_deadline: Duration,
    /// Wall time of the rehearsal's whole run (preflight and inventory included), seconds.
    pub run_seconds: f64,
    /// The machines whose drain ran into its deadline in the rehearsal (whatever its policy did).
    pub deadline_passed: BTreeSet<String>,
    /// The plan's order: each step's id and what it runs after.
    pub order: BTreeMap<String, StepOrder>,
    /// How long a node's fence must hold before its machine is released (the engine's
    /// `FENCE_SETTLE`), on both clocks alike.
    pub fence_settle: Duration,
}

/// Where one step sits in the plan: the steps it runs after, and what it is expanded over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepOrder {
    /// Ids of the steps it runs after.
    pub after: Vec<String>,
    /// The kind of object it runs once per; a dependency expanded over the same kind is on the
    /// same object only, as the plan's expansion has it.
    pub for_each: Option<crate::plan::ObjectKind>,
    /// Its `settle` (verification's second read comes that long after the controller was seen
    /// gone).
    pub settle: Duration,
}

impl StepOrder {
    /// Every step's place in `plan`, by id.
    pub fn of(plan: &crate::plan::Plan) -> BTreeMap<String, StepOrder> {
        plan.steps()
            .iter()
            .map(|s| {
                (s.id.clone(), StepOrder { after: s.after.clone(), for_each: s.for_each, settle: s.params.settle })
            })
            .collect()
    }
}

/// The real waits a snapshot holds, read before its objects move into the copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Waits {
    /// Per machine (a NodeClaim's name, or `node/<name>` for a Karpenter node without one, as the
    /// plan names them): its node's chain of grace periods, seconds.
    pub drain: BTreeMap<String, f64>,
    /// The controller's pods' longest grace period, seconds (0 when it runs no pod).
    pub controller_grace: f64,
}

impl Waits {
    /// Reads them off a snapshot.
    pub(crate) fn of(snap: &Snapshot) -> Waits {
        let claim_of: BTreeMap<String, String> = snap
            .kubernetes
            .nodeclaims
            .iter()
            .map(RawObject::value)
            .filter_map(|c| {
                Some((c["status"]["nodeName"].as_str()?.to_string(), c["metadata"]["name"].as_str()?.to_string()))
            })
            .collect();
        let drain = drain_chains(snap)
            .into_iter()
            .map(|(node, secs)| {
                let machine =
                    claim_of.get(node.as_str()).map(|c| c.to_string()).unwrap_or_else(|| format!("node/{node}"));
                (machine, secs)
            })
            .collect();
        Waits { drain, controller_grace: if snap.karpenter.ready_replicas > 0 { controller_grace(snap) } else { 0.0 } }
    }
}

/// Predicts each step's and the run's wall time from the rehearsal's step records.
///
/// A drain task's real end is its end in the rehearsal plus what the acceleration took from its
/// own node's waits; the step ends with its last task. Nodes drain at once, so the queue of
/// evictions overlaps the grace periods in the real run as it does in the rehearsal: adding the
/// slowest node's waits to the whole step would count that queue twice. Every task that runs after
/// it in the plan's order starts that much later; one beside it does not.
pub(crate) fn timing(waits: &Waits, records: &[StepRecord], inputs: &TimingInputs) -> Timing {
    let scale = inputs.time_scale.clamp(0.0, 1.0);
    let mut by_step: Vec<(String, String, Vec<&StepRecord>)> = Vec::new();
    for r in records {
        match by_step.iter_mut().find(|(s, _, _)| *s == r.step) {
            Some((_, _, v)) => v.push(r),
            None => by_step.push((r.step.clone(), r.action.clone(), vec![r])),
        }
    }
    let mut steps = Vec::new();
    for (step, action, recs) in by_step {
        let span: Vec<(f64, f64, &StepRecord)> = {
            let t0 = recs.iter().filter_map(|r| parse_time(&r.started)).min();
            recs.iter()
                .filter_map(|r| {
                    let since = |t: SystemTime| t.duration_since(t0?).ok().map(|d| d.as_secs_f64());
                    Some((since(parse_time(&r.started)?)?, since(parse_time(&r.finished)?)?, *r))
                })
                .collect()
        };
        let measured = span.iter().map(|(_, e, _)| *e).fold(0.0, f64::max);
        let result = recs.iter().map(|r| r.result).max().unwrap_or(TaskResult::Done);
        let (predicted, wait, basis) = match action.as_str() {
            "drain" => drain_step(waits, &span, inputs, scale),
            "remove-controller" if waits.controller_grace > 0.0 => (
                measured + (1.0 - scale) * waits.controller_grace,
                waits.controller_grace,
                "the controller's pods' grace period".to_string(),
            ),
            _ => (measured, 0.0, "API and EC2 work only, as measured".to_string()),
        };
        steps.push(StepPrediction {
            step,
            action,
            tasks: recs.len(),
            found_late: recs.iter().filter(|r| r.found_late.is_some()).count(),
            result,
            rehearsal_seconds: measured,
            waits_seconds: wait,
            predicted_seconds: predicted,
            share: 0.0,
            basis,
        });
    }
    let predicted_seconds = inputs.run_seconds + delay_of_the_end(waits, records, inputs, scale);
    for s in &mut steps {
        s.share = if predicted_seconds > 0.0 { s.predicted_seconds / predicted_seconds } else { 0.0 };
    }
    Timing { steps, predicted_seconds, rehearsal_seconds: inputs.run_seconds }
}

/// What one task gets back on the real clock: a drain its node's waits (or the whole deadline when
/// the rehearsal hit it), the controller's removal its pods' grace period, the rest nothing.
fn own_wait(waits: &Waits, r: &StepRecord, inputs: &TimingInputs, scale: f64) -> f64 {
    let wait = match r.action.as_str() {
        "drain" => {
            let machine = r.object.as_deref().unwrap_or_default();
            if inputs.deadline_passed.contains(machine) {
                inputs.drain_deadline.as_secs_f64()
            } else {
                waits.drain.get(machine).copied().unwrap_or(0.0)
            }
        }
        "remove-controller" => waits.controller_grace,
        _ => 0.0,
    };
    (1.0 - scale) * wait
}

/// How much later than in the rehearsal the run ends: each task starts as much later as the
/// latest of the tasks it runs after ends later (their own delay plus what they get back), and
/// the run ends with the task predicted to end last. The tasks a task runs after are those of the
/// steps it names (a step that ran no task passes its own on), the task on the same object only
/// where both steps are expanded over the same kind. Verification is the exception: its pause
/// before the second read ends `settle` after the controller was seen gone, however late it starts.
fn delay_of_the_end(waits: &Waits, records: &[StepRecord], inputs: &TimingInputs, scale: f64) -> f64 {
    let times: Vec<Option<(SystemTime, SystemTime)>> =
        records.iter().map(|r| Some((parse_time(&r.started)?, parse_time(&r.finished)?))).collect();
    let Some(t0) = times.iter().flatten().map(|(s, _)| *s).min() else { return 0.0 };
    let secs = |t: SystemTime| t.duration_since(t0).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let ran: BTreeSet<&str> = records.iter().map(|r| r.step.as_str()).collect();
    // the steps a step waits for, through those that ran no task
    let waited_for = |step: &str| -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut todo: Vec<String> = inputs.order.get(step).map(|o| o.after.clone()).unwrap_or_default();
        let mut seen = BTreeSet::new();
        while let Some(d) = todo.pop() {
            if !seen.insert(d.clone()) {
                continue;
            }
            if ran.contains(d.as_str()) {
                out.insert(d);
            } else if let Some(o) = inputs.order.get(&d) {
                todo.extend(o.after.iter().cloned());
            }
        }
        out
    };
    // A task's dependencies end before it starts: taken in order of their ends, every task a task
    // runs after is settled before it, so one pass with running maxima per step (and per step
    // and object) is enough, in O(n log n) at thousands of machines.
    let mut by_end: Vec<usize> = (0..records.len()).filter(|&i| times[i].is_some()).collect();
    by_end.sort_by(|&a, &b| times[a].map(|t| t.1).cmp(&times[b].map(|t| t.1)));
    let mut of_step: HashMap<&str, f64> = HashMap::new();
    let mut of_task: HashMap<(&str, &str), f64> = HashMap::new();
    let mut deps_of: HashMap<&str, BTreeSet<String>> = HashMap::new();
    let (mut measured_end, mut predicted_end) = (0.0_f64, 0.0_f64);
    // when the rehearsal saw the controller gone (its removal's end) and how much later that
    // moment comes on the real clock
    let mut controller_gone: Option<(f64, f64)> = None;
    // when the rehearsal saw every node fenced (the cordon's end) and how much later on the
    // real clock: a machine's release waits until its fence has held for the settle time
    let mut fenced: Option<(f64, f64)> = None;
    let fence_settle = inputs.fence_settle.as_secs_f64();
    for &i in &by_end {
        let r = &records[i];
        let kind = inputs.order.get(&r.step).and_then(|o| o.for_each);
        let deps = deps_of.entry(r.step.as_str()).or_insert_with(|| waited_for(&r.step));
        let start_delay = deps
            .iter()
            .map(|d| {
                let same_kind = kind.is_some() && inputs.order.get(d).and_then(|o| o.for_each) == kind;
                match r.object.as_deref() {
                    Some(o) if same_kind => of_task.get(&(d.as_str(), o)).copied().unwrap_or(0.0),
                    _ => of_step.get(d.as_str()).copied().unwrap_or(0.0),
                }
            })
            .fold(0.0, f64::max);
        let mut own = own_wait(waits, r, inputs, scale);
        if r.action == "verify"
            && let (Some(gone), Some((start, end))) = (controller_gone, times[i])
        {
            // The second read waits until `settle` after the controller was seen gone, a moment
            // that moves only as much as the controller's removal does: a verification that
            // starts later waits that much less, down to no pause at all.
            let settle = inputs.order.get(&r.step).map_or(0.0, |o| o.settle.as_secs_f64());
            let measured_pause = (gone.0 + settle - secs(start)).clamp(0.0, secs(end) - secs(start));
            own -= measured_pause.min((start_delay - gone.1).max(0.0));
        }
        if r.action == "discharge-finalizers"
            && let (Some(fence), Some((start, end))) = (fenced, times[i])
        {
            // Likewise the release's wait for its node's fence to have held a while: it ends
            // the settle time after the cordon, which the real run's longer drain has mostly
            // outlasted.
            let measured_pause = (fence.0 + fence_settle - secs(start)).clamp(0.0, secs(end) - secs(start));
            own -= measured_pause.min((start_delay - fence.1).max(0.0));
        }
        let end_delay = start_delay + own;
        if r.action == "cordon" {
            fenced = Some((times[i].map_or(0.0, |(_, e)| secs(e)), end_delay));
        }
        if r.action == "remove-controller" {
            controller_gone = Some((times[i].map_or(0.0, |(_, e)| secs(e)), end_delay));
        }
        let step_max = of_step.entry(r.step.as_str()).or_insert(0.0);
        *step_max = step_max.max(end_delay);
        if let Some(o) = r.object.as_deref() {
            of_task.insert((r.step.as_str(), o), end_delay);
        }
        if let Some((_, end)) = times[i] {
            measured_end = measured_end.max(secs(end));
            predicted_end = predicted_end.max(secs(end) + end_delay);
        }
    }
    (predicted_end - measured_end).max(0.0)
}

/// The drain step: (predicted seconds, the waits of the task that ends it, why).
fn drain_step(
    waits: &Waits,
    span: &[(f64, f64, &StepRecord)],
    inputs: &TimingInputs,
    scale: f64,
) -> (f64, f64, String) {
    let deadline = inputs.drain_deadline.as_secs_f64();
    let mut last: Option<(f64, f64, String, bool)> = None;
    for (_, end, r) in span {
        let machine = r.object.clone().unwrap_or_default();
        let hit = inputs.deadline_passed.contains(&machine);
        let wait = if hit { deadline } else { waits.drain.get(&machine).copied().unwrap_or(0.0) };
        let predicted_end = end + (1.0 - scale) * wait;
        if last.as_ref().is_none_or(|(e, _, _, _)| predicted_end > *e) {
            last = Some((predicted_end, wait, machine, hit));
        }
    }
    match last {
        None => (0.0, 0.0, "no node to drain".to_string()),
        Some((end, wait, machine, true)) => (
            end,
            wait,
            format!(
                "the drain deadline: {} node(s) ran into it, the last to end {machine}",
                inputs.deadline_passed.len()
            ),
        ),
        Some((end, wait, machine, false)) => (
            end,
            wait,
            format!(
                "ends with {machine}: its evictions, then its pods' grace periods (critical pods after the others)"
            ),
        ),
    }
}

/// The drains the rehearsal saw end in time that, on the real clock, would run into the drain
/// deadline: (machine, predicted seconds from the drain task's start). The rehearsal's deadline
/// counts from the first eviction wave and runs on the accelerated clock; the real run's counts
/// from the task's start. A drain whose measured time plus the waits the acceleration took away
/// reaches the real deadline would block the real run: a gate must not promise more than that.
pub(crate) fn drains_past_deadline(waits: &Waits, records: &[StepRecord], inputs: &TimingInputs) -> Vec<(String, f64)> {
    let scale = inputs.time_scale.clamp(0.0, 1.0);
    let deadline = inputs.drain_deadline.as_secs_f64();
    let mut out: Vec<(String, f64)> = records
        .iter()
        .filter(|r| r.action == crate::plan::Action::Drain.name() && r.result == TaskResult::Done)
        .filter_map(|r| {
            let machine = r.object.clone()?;
            if inputs.deadline_passed.contains(&machine) {
                return None;
            }
            let took = parse_time(&r.finished)?.duration_since(parse_time(&r.started)?).ok()?.as_secs_f64();
            let predicted = took + (1.0 - scale) * waits.drain.get(&machine).copied().unwrap_or(0.0);
            (predicted >= deadline).then_some((machine, predicted))
        })
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

fn grace(pod: &Value) -> i64 {
    pod["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap_or(DEFAULT_GRACE).max(0)
}

fn is_daemon(pod: &Value) -> bool {
    pod["metadata"]["ownerReferences"].as_array().is_some_and(|r| r.iter().any(|o| o["kind"] == "DaemonSet"))
}

fn is_critical(pod: &Value) -> bool {
    pod["spec"]["priorityClassName"].as_str().is_some_and(|c| CRITICAL_CLASSES.contains(&c))
}

/// Each Karpenter node's chain of waits when nothing blocks: its non-critical pods' longest
/// grace period, then its critical pods' (they are evicted once the others are gone).
fn drain_chains(snap: &Snapshot) -> BTreeMap<String, f64> {
    let ours: std::collections::BTreeSet<String> =
        snap.karpenter_nodes().filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string)).collect();
    let mut per_node: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for p in snap.kubernetes.pods.iter().map(RawObject::value) {
        let Some(node) = p["spec"]["nodeName"].as_str().filter(|n| ours.contains(*n)) else { continue };
        if is_daemon(&p) || matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")) {
            continue;
        }
        let e = per_node.entry(node.to_string()).or_default();
        if is_critical(&p) {
            e.1 = e.1.max(grace(&p));
        } else {
            e.0 = e.0.max(grace(&p));
        }
    }
    per_node.into_iter().map(|(n, (normal, critical))| (n, (normal + critical) as f64)).collect()
}

/// The longest grace period of the controller's pods.
fn controller_grace(snap: &Snapshot) -> f64 {
    let Some((ns, _)) = snap.karpenter.controller.as_deref().and_then(|c| c.split_once('/')) else { return 0.0 };
    snap.kubernetes
        .pods
        .iter()
        .map(RawObject::value)
        .filter(|p| p["metadata"]["namespace"] == ns && crate::snapshot::is_karpenter_controller(p))
        .map(|p| grace(&p))
        .max()
        .unwrap_or(0) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Plan;
    use crate::snapshot::KubeObjects;
    use serde_json::json;

    fn snap(pods: Vec<Value>) -> Snapshot {
        let node = |n: &str| json!({"metadata": {"name": n, "labels": {"karpenter.sh/nodepool": "default"}}});
        let mut s: Snapshot = serde_json::from_value(json!({
            "format": "karpenter-teardown/snapshot", "version": 1, "tool_version": "t", "taken_at": "t",
            "cluster": "c", "region": "us-west-2", "account": "1", "source": {}, "karpenter": {},
            "kubernetes": {}, "aws": {}, "reads": {}}))
        .unwrap();
        s.kubernetes = KubeObjects {
            nodes: vec![node("a").into(), node("b").into()],
            pods: pods.into_iter().map(RawObject::from).collect(),
            ..KubeObjects::default()
        };
        s
    }

    fn pod(node: &str, grace: i64, critical: bool) -> Value {
        let class = if critical { "system-cluster-critical" } else { "" };
        json!({"metadata": {"name": format!("p{grace}")}, "spec": {"nodeName": node, "terminationGracePeriodSeconds": grace,
            "priorityClassName": class}, "status": {"phase": "Running"}})
    }

    fn record(step: &str, object: Option<&str>, from: f64, to: f64, result: TaskResult) -> StepRecord {
        let t = |s: f64| crate::report::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs_f64(1_700_000_000.0 + s));
        StepRecord {
            step: step.into(),
            action: step.into(),
            object: object.map(str::to_string),
            started: t(from),
            finished: t(to),
            attempts: 1,
            result,
            detail: String::new(),
            found_late: None,
        }
    }

    fn inputs(run_seconds: f64, deadline_passed: &[&str]) -> TimingInputs {
        TimingInputs {
            time_scale: 0.05,
            drain_deadline: Duration::from_secs(600),
            run_seconds,
            deadline_passed: deadline_passed.iter().map(|m| m.to_string()).collect(),
            order: StepOrder::of(&Plan::builtin_default()),
            // the tests below that are not about the release's settle leave it out
            fence_settle: Duration::ZERO,
        }
    }

    #[test]
    fn each_node_waits_its_own_grace_periods_and_critical_pods_wait_for_the_others() {
        let s = snap(vec![pod("a", 30, false), pod("a", 10, true), pod("b", 35, false), pod("elsewhere", 600, false)]);
        let w = Waits::of(&s);
        // no NodeClaim names the nodes: the plan calls their machines node/<name>
        assert_eq!(w.drain, BTreeMap::from([("node/a".to_string(), 40.0), ("node/b".to_string(), 35.0)]));
    }

    #[test]
    fn a_step_gets_back_the_waits_the_acceleration_took_away() {
        let s = snap(vec![pod("a", 60, false)]);
        let records = [
            record("fence", None, 0.0, 1.0, TaskResult::Done),
            record("drain", Some("node/a"), 1.0, 5.0, TaskResult::Done),
        ];
        let t = timing(&Waits::of(&s), &records, &inputs(6.0, &[]));
        assert_eq!(t.steps[0].predicted_seconds, 1.0);
        // 4 s measured (3 s of them the scaled 60 s grace period) + 0.95 × 60 s
        assert!((t.steps[1].predicted_seconds - 61.0).abs() < 1e-9, "{:?}", t.steps[1]);
        assert!((t.predicted_seconds - 63.0).abs() < 1e-9);
        assert!((t.steps.iter().map(|s| s.share).sum::<f64>() - 62.0 / 63.0).abs() < 1e-9);
    }

    #[test]
    fn a_step_counts_the_tasks_of_machines_found_late() {
        let s = snap(vec![pod("a", 0, false)]);
        let late = StepRecord {
            found_late: Some("launched during the run".into()),
            ..record("drain", Some("b"), 2.0, 3.0, TaskResult::Done)
        };
        let records = [record("drain", Some("node/a"), 1.0, 2.0, TaskResult::Done), late];
        let t = timing(&Waits::of(&s), &records, &inputs(3.0, &[]));
        assert_eq!(t.steps.len(), 1);
        assert_eq!((t.steps[0].tasks, t.steps[0].found_late), (2, 1));
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["steps"][0]["found_late"], 1);
        let none = timing(&Waits::of(&s), &records[..1], &inputs(3.0, &[]));
        assert!(serde_json::to_value(&none).unwrap()["steps"][0].get("found_late").is_none(), "absent when none");
    }

    #[test]
    fn the_queue_of_evictions_is_not_counted_twice() {
        // node a's evictions are asked at once and wait 60 s; node b's wait in the queue for 30 s
        // and then 10 s: for real b ends at 40 s, long before a at 60 s
        let s = snap(vec![pod("a", 60, false), pod("b", 10, false)]);
        let records = [
            record("drain", Some("node/a"), 0.0, 3.0, TaskResult::Done),
            record("drain", Some("node/b"), 0.0, 30.5, TaskResult::Done),
        ];
        let t = timing(&Waits::of(&s), &records, &inputs(31.0, &[]));
        assert!((t.steps[0].predicted_seconds - 60.0).abs() < 1e-9, "{:?}", t.steps[0]);
        assert!(t.steps[0].basis.contains("node/a"), "{}", t.steps[0].basis);
        assert!((t.predicted_seconds - (31.0 + 60.0 - 30.5)).abs() < 1e-9);
    }

    /// The default plan removes the controller beside the drain and lets each drained machine go
    /// on to its termination: the controller's grace period is not added to the drain's, and the
    /// run ends with the slowest chain (here the drain of node a, then its machine's release).
    #[test]
    fn a_wait_beside_the_drain_does_not_delay_the_run() {
        let s = snap(vec![pod("a", 60, false), pod("b", 10, false)]);
        let waits = Waits { controller_grace: 30.0, ..Waits::of(&s) };
        let records = [
            record("preflight", None, 0.0, 1.0, TaskResult::Done),
            record("fence", None, 1.0, 1.5, TaskResult::Done),
            record("remove-controller", None, 1.5, 3.0, TaskResult::Done),
            record("cordon", None, 1.5, 2.0, TaskResult::Done),
            record("drain", Some("node/a"), 2.0, 5.0, TaskResult::Done),
            record("drain", Some("node/b"), 2.0, 2.5, TaskResult::Done),
            record("discharge-finalizers", Some("node/b"), 3.0, 3.5, TaskResult::Done),
            record("discharge-finalizers", Some("node/a"), 5.0, 5.5, TaskResult::Done),
            record("delete-nodepools", None, 5.5, 6.0, TaskResult::Done),
            record("delete-nodeclasses", None, 6.0, 8.0, TaskResult::Done),
            record("verify", None, 8.0, 8.5, TaskResult::Done),
        ];
        let t = timing(&waits, &records, &inputs(9.0, &[]));
        // node a's 60 s less the 3 s the copy waited; the controller's 28.5 s end long before
        assert!((t.predicted_seconds - (9.0 + 0.95 * 60.0)).abs() < 1e-9, "{t:?}");
        // in a plan that removes the controller after the drain, both waits add up
        let mut serial = inputs(7.5, &[]);
        serial.order.get_mut("remove-controller").unwrap().after = vec!["drain".into()];
        serial.order.get_mut("drain").unwrap().after = vec!["cordon".into()];
        let records = [
            record("drain", Some("node/a"), 0.0, 3.0, TaskResult::Done),
            record("remove-controller", None, 3.0, 4.5, TaskResult::Done),
            record("discharge-finalizers", Some("node/a"), 4.5, 5.0, TaskResult::Done),
        ];
        let t = timing(&waits, &records, &serial);
        assert!((t.predicted_seconds - (7.5 + 0.95 * 60.0 + 0.95 * 30.0)).abs() < 1e-9, "{t:?}");
    }

    /// In the copy the drain is over long before `settle` after the controller went, so
    /// verification waits; on the real clock it starts after node a's 60 s and waits no more.
    #[test]
    fn verification_does_not_wait_again_for_a_settle_the_drain_outlasted() {
        let s = snap(vec![pod("a", 60, false)]);
        let records = [
            record("fence", None, 0.0, 0.5, TaskResult::Done),
            record("remove-controller", None, 0.5, 1.0, TaskResult::Done),
            record("cordon", None, 0.5, 0.6, TaskResult::Done),
            record("drain", Some("node/a"), 0.6, 1.0, TaskResult::Done),
            record("discharge-finalizers", Some("node/a"), 1.0, 1.2, TaskResult::Done),
            record("delete-nodepools", None, 1.2, 1.3, TaskResult::Done),
            record("delete-nodeclasses", None, 1.3, 1.4, TaskResult::Done),
            // its second read came 5 s after the controller was seen gone at 1.0 s
            record("verify", None, 1.4, 6.0, TaskResult::Done),
        ];
        let t = timing(&Waits::of(&s), &records, &inputs(6.5, &[]));
        // the run ends as the drain's 57 s restored push everything after it, less the 4.6 s pause
        assert!((t.predicted_seconds - (6.5 + 0.95 * 60.0 - 4.6)).abs() < 1e-9, "{t:?}");
    }

    /// In the copy the drain is over long before the fences have held for the settle time, so
    /// each release waits; on the real clock it starts after node a's 60 s, and waits no more.
    #[test]
    fn a_release_does_not_wait_again_for_a_fence_settle_the_drain_outlasted() {
        let s = snap(vec![pod("a", 60, false)]);
        let records = [
            record("cordon", None, 0.0, 0.5, TaskResult::Done),
            record("remove-controller", None, 0.0, 1.0, TaskResult::Done),
            record("drain", Some("node/a"), 0.5, 3.5, TaskResult::Done),
            // it waited until the fence had held 5 s (at 5.5 s), then worked for 0.3 s
            record("discharge-finalizers", Some("node/a"), 3.5, 5.8, TaskResult::Done),
        ];
        let with_settle = TimingInputs { fence_settle: Duration::from_secs(5), ..inputs(6.0, &[]) };
        let t = timing(&Waits::of(&s), &records, &with_settle);
        // node a's 57 s restored, less the 2 s pause the real run does not make
        assert!((t.predicted_seconds - (6.0 + 0.95 * 60.0 - 2.0)).abs() < 1e-9, "{t:?}");
    }

    /// Node a's 60 s of grace periods ended in time on the copy, but on the real clock they
    /// run into a 30 s deadline: the run would block. Node b's 10 s do not.
    #[test]
    fn a_drain_that_the_real_deadline_would_cut_short_is_named() {
        let s = snap(vec![pod("a", 60, false), pod("b", 10, false)]);
        let records = [
            record("drain", Some("node/a"), 0.0, 3.5, TaskResult::Done),
            record("drain", Some("node/b"), 0.0, 1.0, TaskResult::Done),
        ];
        let tight = TimingInputs { drain_deadline: Duration::from_secs(30), ..inputs(4.0, &[]) };
        let late = drains_past_deadline(&Waits::of(&s), &records, &tight);
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!(late[0].0, "node/a");
        assert!((late[0].1 - (3.5 + 0.95 * 60.0)).abs() < 1e-9, "{late:?}");
        assert!(drains_past_deadline(&Waits::of(&s), &records, &inputs(4.0, &[])).is_empty(), "600 s is enough");
        // a drain the rehearsal already saw hit its deadline is the run's own blocker, not this
        assert!(
            drains_past_deadline(
                &Waits::of(&s),
                &records,
                &TimingInputs { drain_deadline: Duration::from_secs(30), ..inputs(4.0, &["node/a"]) }
            )
            .is_empty()
        );
    }

    #[test]
    fn a_drain_that_hit_its_deadline_is_predicted_to_wait_the_whole_real_deadline() {
        let s = snap(vec![pod("a", 5, false)]);
        let records = [record("drain", Some("node/a"), 0.0, 31.0, TaskResult::Blocked)];
        let t = timing(&Waits::of(&s), &records, &inputs(32.0, &["node/a"]));
        assert!((t.steps[0].predicted_seconds - (31.0 + 0.95 * 600.0)).abs() < 1e-9);
        assert!(t.steps[0].basis.contains("deadline"));
    }
}
