//! The step vocabulary: actions, the kinds of object a step can expand over, and the parameters
//! each action takes. [`Action::spec`] is the single table saying which `for_each` and which
//! params every action accepts; parsing, validation, defaults and rendering all read it.

use std::fmt;
use std::num::NonZeroUsize;
use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;

/// How many tasks of one step run at once when the plan does not say.
///
/// High enough that a drain of a few hundred nodes is not serialised behind the slowest node,
/// low enough not to flood the API server with watches and evictions.
pub const DEFAULT_CONCURRENCY: NonZeroUsize = match NonZeroUsize::new(64) {
    Some(n) => n,
    // 64 is not zero; a `const` cannot call `expect`, and this arm is never taken.
    None => NonZeroUsize::MIN,
};

/// How long `verify` waits between its two empty reads when the plan does not say: long enough
/// for a launch that was in flight during the first read to show up in the second.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(5);

/// What a step does. Spelled in kebab-case in plan files (`remove-controller`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// Prove which cluster this is and take inventory; refuse if identity or blast radius is off.
    Preflight,
    /// Stop new capacity: NodePool limits and disruption budgets to zero.
    Fence,
    /// Cordon Karpenter nodes (all of them, or one per task) before any is drained.
    Cordon,
    /// Cordon one Karpenter node and evict its pods.
    Drain,
    /// Scale the Karpenter controller to zero and keep it there.
    RemoveController,
    /// Do what `karpenter.sh/termination` guards for one machine, then remove that finalizer.
    DischargeFinalizers,
    /// Delete NodePools.
    DeleteNodepools,
    /// Wait until Karpenter itself has drained and terminated every NodeClaim.
    WaitNodeclaimsGone,
    /// Delete EC2NodeClasses after removing their launch templates and instance profiles.
    DeleteNodeclasses,
    /// Prove through EC2 that nothing is left, with two empty reads some seconds apart.
    Verify,
}

/// The kinds of live object a step can be expanded over with `for_each`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ObjectKind {
    /// A Karpenter machine: a NodeClaim and the Node it registered, named by the NodeClaim.
    Machine,
    /// A `karpenter.sh/v1` NodePool.
    Nodepool,
    /// A `karpenter.k8s.aws/v1` EC2NodeClass.
    Nodeclass,
}

/// What a step does when its deadline passes. Which choices are valid depends on the action
/// (see [`ActionSpec::on_deadline`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnDeadline {
    /// The task fails, and so does everything that depends on it.
    Fail,
    /// Drain only: delete the pods that are still there, bypassing PodDisruptionBudgets. Writing
    /// this in a plan is the user's explicit consent to that.
    Delete,
    /// Drain only: leave the node as it is, report it as blocked and let the rest proceed.
    Skip,
    /// Waits only: stop waiting and let the later steps do whatever is left.
    Continue,
}

/// A key of a step's `[step.params]` table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParamKey {
    /// `deadline`: a humantime duration after which `on_deadline` applies.
    Deadline,
    /// `on_deadline`: what to do when the deadline passes.
    OnDeadline,
    /// `concurrency`: at most this many tasks of the step at once.
    Concurrency,
    /// `settle`: how long after the controller was seen gone (or after its first read, when this
    /// run did not see it go) `verify` reads a second time.
    Settle,
}

/// Whether, and over which kind, an action may be expanded with `for_each`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForEachRule {
    /// The action acts on the cluster as a whole; `for_each` is rejected.
    Never,
    /// The action acts on exactly one object of this kind; `for_each` must name it.
    Required(ObjectKind),
    /// The action can act on all objects at once or one object of this kind per task.
    Optional(ObjectKind),
}

/// What an action accepts in a plan, and the defaults of what it does not get told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActionSpec {
    /// Which `for_each` the action accepts.
    pub for_each: ForEachRule,
    /// Which keys the action accepts in `[step.params]`.
    pub params: &'static [ParamKey],
    /// Valid `on_deadline` choices; the first one is the default. Empty when the action has no
    /// `on_deadline` param.
    pub on_deadline: &'static [OnDeadline],
    /// The deadline when the plan gives none; `None` for actions without a `deadline` param.
    pub default_deadline: Option<Duration>,
}

const fn minutes(m: u64) -> Duration {
    Duration::from_secs(m * 60)
}

impl Action {
    /// Every action, in the order a default teardown uses them.
    pub const ALL: [Action; 10] = [
        Action::Preflight,
        Action::Fence,
        Action::Cordon,
        Action::Drain,
        Action::RemoveController,
        Action::DischargeFinalizers,
        Action::DeleteNodepools,
        Action::WaitNodeclaimsGone,
        Action::DeleteNodeclasses,
        Action::Verify,
    ];

    /// The single table of what each action accepts. Everything that needs to know (parser,
    /// defaults, rendering, `--help` text) asks here, so adding a param is a one-line change.
    pub fn spec(self) -> ActionSpec {
        use ParamKey::{Concurrency, Deadline, OnDeadline as OnDl, Settle};
        let none: &'static [ParamKey] = &[];
        match self {
            Action::Preflight | Action::Fence => {
                ActionSpec { for_each: ForEachRule::Never, params: none, on_deadline: &[], default_deadline: None }
            }
            Action::Cordon => ActionSpec {
                for_each: ForEachRule::Optional(ObjectKind::Machine),
                params: &[Concurrency],
                on_deadline: &[],
                default_deadline: None,
            },
            Action::Drain => ActionSpec {
                for_each: ForEachRule::Required(ObjectKind::Machine),
                params: &[Deadline, OnDl, Concurrency],
                // `fail` first: a PDB is never bypassed without the user's explicit consent.
                on_deadline: &[OnDeadline::Fail, OnDeadline::Delete, OnDeadline::Skip],
                // Design §7: `--drain-deadline 10m`.
                default_deadline: Some(minutes(10)),
            },
            Action::RemoveController => ActionSpec {
                for_each: ForEachRule::Never,
                params: &[Deadline],
                on_deadline: &[],
                default_deadline: Some(minutes(5)),
            },
            Action::DischargeFinalizers => ActionSpec {
                for_each: ForEachRule::Required(ObjectKind::Machine),
                params: &[Deadline, Concurrency],
                on_deadline: &[],
                default_deadline: Some(minutes(10)),
            },
            Action::DeleteNodepools => ActionSpec {
                for_each: ForEachRule::Optional(ObjectKind::Nodepool),
                params: none,
                on_deadline: &[],
                default_deadline: None,
            },
            Action::WaitNodeclaimsGone => ActionSpec {
                for_each: ForEachRule::Never,
                params: &[Deadline, OnDl],
                on_deadline: &[OnDeadline::Fail, OnDeadline::Continue],
                default_deadline: Some(minutes(15)),
            },
            Action::DeleteNodeclasses => ActionSpec {
                for_each: ForEachRule::Optional(ObjectKind::Nodeclass),
                params: &[Deadline, Concurrency],
                on_deadline: &[],
                default_deadline: Some(minutes(10)),
            },
            Action::Verify => {
                ActionSpec { for_each: ForEachRule::Never, params: &[Settle], on_deadline: &[], default_deadline: None }
            }
        }
    }

    /// The name used in plan files.
    pub fn name(self) -> &'static str {
        match self {
            Action::Preflight => "preflight",
            Action::Fence => "fence",
            Action::Cordon => "cordon",
            Action::Drain => "drain",
            Action::RemoveController => "remove-controller",
            Action::DischargeFinalizers => "discharge-finalizers",
            Action::DeleteNodepools => "delete-nodepools",
            Action::WaitNodeclaimsGone => "wait-nodeclaims-gone",
            Action::DeleteNodeclasses => "delete-nodeclasses",
            Action::Verify => "verify",
        }
    }

    /// The params this action gets when the plan sets none.
    pub fn default_params(self) -> Params {
        let spec = self.spec();
        Params {
            deadline: spec.default_deadline,
            on_deadline: spec.on_deadline.first().copied().unwrap_or(OnDeadline::Fail),
            concurrency: DEFAULT_CONCURRENCY,
            settle: DEFAULT_SETTLE,
        }
    }

    /// Whether `key` may appear in this action's `[step.params]`.
    pub fn accepts(self, key: ParamKey) -> bool {
        self.spec().params.contains(&key)
    }

    /// The names of every action, comma-separated, for error messages and help text.
    pub fn known_names() -> String {
        Action::ALL.map(Action::name).join(", ")
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Action {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        Action::ALL.into_iter().find(|a| a.name() == s).ok_or(())
    }
}

impl ObjectKind {
    /// Every kind.
    pub const ALL: [ObjectKind; 3] = [ObjectKind::Machine, ObjectKind::Nodepool, ObjectKind::Nodeclass];

    /// The name used in plan files.
    pub fn name(self) -> &'static str {
        match self {
            ObjectKind::Machine => "machine",
            ObjectKind::Nodepool => "nodepool",
            ObjectKind::Nodeclass => "nodeclass",
        }
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ObjectKind {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        ObjectKind::ALL.into_iter().find(|k| k.name() == s).ok_or(())
    }
}

impl OnDeadline {
    /// The name used in plan files.
    pub fn name(self) -> &'static str {
        match self {
            OnDeadline::Fail => "fail",
            OnDeadline::Delete => "delete",
            OnDeadline::Skip => "skip",
            OnDeadline::Continue => "continue",
        }
    }
}

impl fmt::Display for OnDeadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OnDeadline {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        [OnDeadline::Fail, OnDeadline::Delete, OnDeadline::Skip, OnDeadline::Continue]
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or(())
    }
}

impl ParamKey {
    /// Every param key.
    pub const ALL: [ParamKey; 4] = [ParamKey::Deadline, ParamKey::OnDeadline, ParamKey::Concurrency, ParamKey::Settle];

    /// The key as written in `[step.params]`.
    pub fn name(self) -> &'static str {
        match self {
            ParamKey::Deadline => "deadline",
            ParamKey::OnDeadline => "on_deadline",
            ParamKey::Concurrency => "concurrency",
            ParamKey::Settle => "settle",
        }
    }
}

impl fmt::Display for ParamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ParamKey {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        ParamKey::ALL.into_iter().find(|k| k.name() == s).ok_or(())
    }
}

/// A step's params with every default resolved. A field the action does not accept (see
/// [`ActionSpec::params`]) holds the default and means nothing for that action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// How long one task of the step may take before `on_deadline` applies; `None` for actions
    /// that take no deadline (they do a bounded amount of work).
    pub deadline: Option<Duration>,
    /// What to do when the deadline passes.
    pub on_deadline: OnDeadline,
    /// At most this many tasks of the step run at once.
    pub concurrency: NonZeroUsize,
    /// `verify`: how long after the controller was seen gone (else after the first read) it reads
    /// again.
    pub settle: Duration,
}

impl Params {
    /// The value of `key`, formatted as a plan file would spell it (`10m`, `fail`, `64`).
    pub fn display_value(&self, key: ParamKey) -> String {
        match key {
            ParamKey::Deadline => match self.deadline {
                Some(d) => humantime::format_duration(d).to_string(),
                None => "none".to_owned(),
            },
            ParamKey::OnDeadline => self.on_deadline.name().to_owned(),
            ParamKey::Concurrency => self.concurrency.to_string(),
            ParamKey::Settle => humantime::format_duration(self.settle).to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in Action::ALL {
            assert_eq!(a.name().parse::<Action>(), Ok(a));
            assert_eq!(serde_json::to_value(a).ok(), Some(serde_json::json!(a.name())));
        }
        for k in ObjectKind::ALL {
            assert_eq!(k.name().parse::<ObjectKind>(), Ok(k));
        }
        for p in ParamKey::ALL {
            assert_eq!(p.name().parse::<ParamKey>(), Ok(p));
        }
        assert_eq!("drian".parse::<Action>(), Err(()));
    }

    #[test]
    fn every_action_with_on_deadline_accepts_a_deadline() {
        for a in Action::ALL {
            let spec = a.spec();
            assert_eq!(
                a.accepts(ParamKey::OnDeadline),
                !spec.on_deadline.is_empty(),
                "{a}: on_deadline param and choices disagree"
            );
            assert_eq!(
                a.accepts(ParamKey::Deadline),
                spec.default_deadline.is_some(),
                "{a}: a deadline param needs a default deadline"
            );
            if a.accepts(ParamKey::OnDeadline) {
                assert!(a.accepts(ParamKey::Deadline), "{a}");
            }
        }
    }

    #[test]
    fn defaults_are_the_safe_ones() {
        let drain = Action::Drain.default_params();
        assert_eq!(drain.deadline, Some(Duration::from_secs(600)));
        assert_eq!(drain.on_deadline, OnDeadline::Fail);
        assert_eq!(Action::WaitNodeclaimsGone.default_params().on_deadline, OnDeadline::Fail);
        assert_eq!(Action::Verify.default_params().settle, Duration::from_secs(5));
        assert_eq!(Action::Fence.default_params().deadline, None);
        assert_eq!(DEFAULT_CONCURRENCY.get(), 64);
    }
}
