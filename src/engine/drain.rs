//! The drain of one node as an explicit state machine, in the manner of kube-runtime's `watcher`:
//! [`step`] is a pure function of the drain's state and one observation, returning the next state
//! and the actions to take; [`drain`] is the thin async driver that observes, does the I/O and
//! feeds what came of it back. Everything a drain decides (which pods to ask for and when, when
//! and how the deadline applies, when the node is done, which pods were bound after the drain
//! began) is tested here without an API server.
//!
//! The release of a node is guarded too: [`drain_before_release`] drains, before a node's instance
//! is terminated, the pods bound to it since its drain.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use tokio::time::Instant;

use super::budgets::{self, Admission};
use super::context::Ctx;
use super::events::{EngineEvent, TaskRef, Waiting};
use super::machine_node::node_read_of;
use super::task::{Outcome, TaskError, TaskOutcome};
use crate::config::DrainPolicy;
use crate::k8s::nodes::{CordonOutcome, LIFTER_NOT_RECORDED, cordon_node, cordon_read_node};
use crate::k8s::pods::{EvictionOutcome, PodRef, delete_pod, evict, eviction_wave};
use crate::k8s::{self, KubeError};
use crate::plan::{OnDeadline, Params};
use crate::report::BlockerKind;

/// How long a drain waits for the first list of the PodDisruptionBudgets.
const BUDGETS_SYNC_WAIT: Duration = Duration::from_secs(30);

/// How long a drain sleeps when nothing wakes it: budgets probed, the fence looked at.
const IDLE: Duration = Duration::from_millis(1000);

/// Where a drain is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Pods are evicted through the Eviction API, budgets respected.
    Evicting,
    /// The deadline passed under policy `delete`: the pods left were deleted, and the drain waits
    /// for them to go.
    Deleting,
}

/// Everything a drain knows between two observations.
#[derive(Debug)]
pub(crate) struct DrainState {
    node: String,
    deadline: Duration,
    policy: DrainPolicy,
    phase: Phase,
    /// When the deadline's clock started; `None` until the first wave was asked for when the
    /// deadline counts from dispatch (a rehearsal's).
    started: Option<Instant>,
    book: EvictionBook,
    /// Hashes of the UIDs of the pods the first observation found: any other pod found later was
    /// bound to the node after the drain began.
    first_seen: Option<HashSet<u64>>,
    /// Pods that tolerate the fence, already named.
    riders_noted: HashSet<String>,
    /// What the last observation found to move, and how many pods go with the node.
    left: Vec<Arc<PodRef>>,
    riders: usize,
    /// What the node watch last showed of the fence.
    fenced: Option<bool>,
    /// What the progress view was last told.
    shown: Option<(u64, Waiting)>,
    last_fence_check: Instant,
    /// How often the fence was found lifted, and by whom last.
    lifts: u32,
    last_lifter: Option<String>,
}

impl DrainState {
    /// A drain that starts `now`.
    pub(crate) fn new(
        node: &str,
        deadline: Duration,
        policy: DrainPolicy,
        from_dispatch: bool,
        now: Instant,
    ) -> DrainState {
        DrainState {
            node: node.to_string(),
            deadline,
            policy,
            phase: Phase::Evicting,
            started: (!from_dispatch).then_some(now),
            book: EvictionBook::default(),
            first_seen: None,
            riders_noted: HashSet::new(),
            left: Vec::new(),
            riders: 0,
            fenced: None,
            shown: None,
            last_fence_check: now,
            lifts: 0,
            last_lifter: None,
        }
    }

    /// Continues the deadline's clock of an earlier attempt of the same drain (one a transient
    /// error ended): a restart must not give the drain a new deadline, or repeated errors would
    /// stretch `--drain-deadline` without bound.
    pub(crate) fn resume_clock(&mut self, since: Instant) {
        self.started = Some(self.started.map_or(since, |t| t.min(since)));
    }

    /// When the deadline's clock started, once it has.
    pub(crate) fn clock(&self) -> Option<Instant> {
        self.started
    }
}

/// What the driver saw or heard, fed to [`step`].
#[derive(Debug)]
pub(crate) enum Observation {
    /// The pods on the node now, from the pod index: those that tolerate the fence and go with
    /// the node, and those to move; and whether the node watch shows the node fenced.
    Pods { riders: Vec<Arc<PodRef>>, left: Vec<Arc<PodRef>>, fenced: Option<bool> },
    /// Asked for by [`Action::Evict`]: the pod's budget allows nothing now, no request was sent.
    Held { pod: Arc<PodRef>, budget: String },
    /// Asked for by [`Action::Evict`]: the server's answer, and the budget whose allowance the
    /// request used.
    Answered { pod: Arc<PodRef>, outcome: Result<EvictionOutcome, KubeError>, reserved: Option<String> },
    /// Every eviction of the wave was asked for (or held).
    WaveSent,
    /// Asked for by [`Action::CheckFence`]: what reading (and re-fencing) the node found.
    FenceChecked(Result<CordonOutcome, KubeError>),
    /// A budget that holds pods of this drain has a new status.
    BudgetChanged,
}

/// What [`step`] asks the driver to do, in order.
#[derive(Debug)]
pub(crate) enum Action {
    /// Name a pod that tolerates the fence: it is not evicted and goes with its node.
    NoteRider { pod: String, fence: &'static str },
    /// Count pods bound to the node after the drain began (they are drained like the others).
    NoteRebound(Vec<String>),
    /// Name the field manager that lifted the fence (it was put back).
    NoteReverted(String),
    /// Tell the live view the deadline passed with this many pods on the node.
    DeadlinePassed { pods_left: u64 },
    /// Remember pods left on the node by policy `skip`.
    Abandon(Vec<String>),
    /// Record these pods (`namespace/name`) as let go without an eviction.
    NoteBypass(crate::report::BypassKind, Vec<String>),
    /// Delete these pods with their grace period (policy `delete`).
    Delete(Vec<Arc<PodRef>>),
    /// For each pod in order: ask its budget, then the Eviction API, feeding back
    /// [`Observation::Held`] or [`Observation::Answered`]; then [`Observation::WaveSent`].
    Evict(Vec<Arc<PodRef>>),
    /// Tell the live view how many pods are left and what the drain waits on.
    Progress { pods_left: u64, waiting: Waiting },
    /// Read the node, put its fence back if lifted, and feed back [`Observation::FenceChecked`].
    CheckFence,
    /// End blocked (policy `fail`): name these pods, why each is blocked and their budgets.
    Block { left: Vec<Arc<PodRef>>, blocked: BTreeMap<String, (PodRef, String)>, lifted: Option<String> },
    /// End with this outcome.
    Finish(TaskOutcome),
    /// End with an error that asking again cannot cure.
    Abort(KubeError),
}

/// The drain's transition: the next state and the actions to take, from the state and what was
/// observed `now`. Pure: no I/O, no clock but `now`.
pub(crate) fn step(mut s: DrainState, obs: Observation, now: Instant) -> (DrainState, Vec<Action>) {
    let mut actions = Vec::new();
    match obs {
        Observation::Pods { riders, left, fenced } => {
            s.fenced = fenced;
            s.riders = riders.len();
            for p in riders.iter().filter(|p| s.riders_noted.insert(p.uid.clone())) {
                actions.push(Action::NoteRider { pod: p.key(), fence: p.rides_with_node.unwrap_or_default() });
            }
            let seen = s.first_seen.get_or_insert_with(|| left.iter().map(|p| uid_hash(&p.uid)).collect());
            let rebound: Vec<String> =
                left.iter().filter(|p| seen.insert(uid_hash(&p.uid))).map(|p| p.uid.clone()).collect();
            if !rebound.is_empty() {
                actions.push(Action::NoteRebound(rebound));
            }
            if left.is_empty() {
                let riding = if riders.is_empty() {
                    String::new()
                } else {
                    format!("; {} pod(s) that tolerate the fence go with the node", riders.len())
                };
                actions.push(Action::Finish(TaskOutcome::Done(format!("{} pod(s) evicted{riding}", s.book.evicted))));
                return (s, actions);
            }
            let past_deadline = s.started.is_some_and(|t| now >= t + s.deadline);
            if s.phase == Phase::Evicting && past_deadline {
                actions.push(Action::DeadlinePassed { pods_left: left.len() as u64 });
                match s.policy {
                    DrainPolicy::Fail => {
                        let blocked = std::mem::take(&mut s.book.blocked);
                        let lifted = s.last_lifter.as_deref().map(|who| lifted(s.lifts as usize, who));
                        actions.push(Action::Block { left, blocked, lifted });
                        return (s, actions);
                    }
                    DrainPolicy::Skip => {
                        actions.push(Action::NoteBypass(
                            crate::report::BypassKind::Skip,
                            left.iter().map(|p| p.key()).collect(),
                        ));
                        actions.push(Action::Abandon(left.iter().map(|p| p.uid.clone()).collect()));
                        actions.push(Action::Finish(TaskOutcome::Skipped(format!(
                            "drain deadline passed with {} pod(s) on node {}; skipped by policy: the instance goes with them, their budgets bypassed",
                            left.len(),
                            s.node
                        ))));
                        return (s, actions);
                    }
                    DrainPolicy::Delete => {
                        s.phase = Phase::Deleting;
                        actions.push(Action::NoteBypass(
                            crate::report::BypassKind::Delete,
                            left.iter().map(|p| p.key()).collect(),
                        ));
                        actions.push(Action::Delete(left.clone()));
                    }
                }
            }
            let wave: Vec<Arc<PodRef>> = match s.phase {
                Phase::Deleting => Vec::new(),
                Phase::Evicting => eviction_wave(&left).into_iter().filter(|p| s.book.due(p, now)).cloned().collect(),
            };
            s.left = left;
            actions.push(Action::Evict(wave));
        }
        Observation::Held { pod, budget } => s.book.held(&pod, budget, now),
        Observation::Answered { pod, outcome, reserved } => {
            if let Err(e) = s.book.answer(&pod, outcome, reserved.as_deref(), now) {
                actions.push(Action::Abort(e));
            }
        }
        Observation::WaveSent => {
            s.started.get_or_insert(now);
            let shown = (s.left.len() as u64, s.book.waiting(&s.left));
            if s.shown.as_ref() != Some(&shown) {
                actions.push(Action::Progress { pods_left: shown.0, waiting: shown.1.clone() });
                s.shown = Some(shown);
            }
            // Something may lift the fence meanwhile (design §1.6). The node watch shows it as it
            // happens; a read is needed only when the watch says so (at most once a second, while
            // the watch catches up with our own write) or has nothing on the node (every 3 s).
            let recheck_after = match s.fenced {
                Some(true) => None,
                Some(false) => Some(Duration::from_secs(1)),
                None => Some(Duration::from_secs(3)),
            };
            if recheck_after.is_some_and(|after| now >= s.last_fence_check + after) {
                s.last_fence_check = now;
                actions.push(Action::CheckFence);
            }
        }
        Observation::FenceChecked(result) => match result {
            Ok(o) if o.gone => {
                actions.push(Action::Finish(TaskOutcome::Done("node went away during the drain".into())))
            }
            Ok(o) => {
                if let Some(who) = o.reverted_by {
                    s.lifts += 1;
                    s.last_lifter = Some(who.clone());
                    actions.push(Action::NoteReverted(who));
                }
            }
            Err(KubeError::Api { source, .. }) if k8s::is_transient(&source) => {}
            Err(e) => actions.push(Action::Abort(e)),
        },
        Observation::BudgetChanged => s.book.budget_changed(),
    }
    (s, actions)
}

/// A pod's UID as a drain remembers the pods it found first: every drain runs at once, and a set
/// of the UIDs themselves would hold a second copy of every pod's UID in the cluster (a collision
/// only misses a re-bound pod in the count; the pod is drained all the same).
fn uid_hash(uid: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    uid.hash(&mut h);
    h.finish()
}

/// Feeds one observation to the state machine; `state` is `None` only within this call.
fn feed(state: &mut Option<DrainState>, obs: Observation) -> Vec<Action> {
    let Some(current) = state.take() else { return Vec::new() };
    let (next, actions) = step(current, obs, Instant::now());
    *state = Some(next);
    actions
}

// ---------------------------------------------------------------- the driver

/// The drain policy a plan's `on_deadline` stands for (`--on-drain-deadline` overrides it).
pub(crate) fn policy_of(on_deadline: OnDeadline) -> DrainPolicy {
    match on_deadline {
        OnDeadline::Delete => DrainPolicy::Delete,
        OnDeadline::Skip | OnDeadline::Continue => DrainPolicy::Skip,
        OnDeadline::Fail => DrainPolicy::Fail,
    }
}

/// Fences the machine's node, evicts its pods in Karpenter's order respecting
/// PodDisruptionBudgets, waits for them by watch, and applies the deadline policy.
pub async fn drain(ctx: &Ctx, machine: &str, params: &Params, task: &TaskRef) -> Outcome {
    let outcome = Box::pin(drain_machine(ctx, machine, params, task)).await?;
    // a Node that had no claim may have one now: that machine is the plan's to run, and this
    // drain waits for it (then finds the node gone)
    if let (TaskOutcome::Done(_), Some(node)) = (&outcome, machine.strip_prefix("node/")) {
        let late = Box::pin(super::machine_node::claims_found_for_node(ctx, node)).await?;
        if !late.is_empty() {
            return Ok(TaskOutcome::FoundLate(late));
        }
    }
    Ok(outcome)
}

async fn drain_machine(ctx: &Ctx, machine: &str, params: &Params, task: &TaskRef) -> Outcome {
    // Only a NodeClaim that names no node (or is gone) means there is nothing to drain; an error
    // reading it must never be taken for that, or the instance would be terminated undrained.
    // Every machine drains at once (5,000 at the largest clusters) and a future is as large as
    // its largest await: the requests' futures are boxed, so a drain that waits holds a few
    // hundred bytes instead of kilobytes.
    let Some((node, read)) = Box::pin(node_read_of(ctx, machine)).await? else {
        return Ok(TaskOutcome::Skipped("no node".into()));
    };
    let deadline = ctx.drain.deadline.or(params.deadline).unwrap_or(Duration::from_secs(600));
    let policy = ctx.drain.policy.unwrap_or(policy_of(params.on_deadline));
    let nodes: Api<Node> = Api::all(ctx.kube.client.clone());
    // from the Node read to prove it the claim's: its patch tests that read's resourceVersion
    if Box::pin(cordon_read_node(&nodes, &node, false, read)).await?.gone {
        return Ok(TaskOutcome::Done("node already gone".into()));
    }
    ctx.pods.synced().await;
    // Without a first list of the budgets every pod goes straight to the server, which decides
    // anyway: a budget watch that cannot start must not hold the drain past its deadline.
    if tokio::time::timeout(BUDGETS_SYNC_WAIT, ctx.budgets.synced()).await.is_err() {
        tracing::warn!(node = %node, "no PodDisruptionBudget list yet; evicting without reading budgets first");
    }
    let mut changes = ctx.pods.subscribe(&node);
    // woken when a budget this drain waits on changes its status
    let budget_changed = Arc::new(tokio::sync::Notify::new());
    let mut state = Some(DrainState::new(&node, deadline, policy, ctx.drain.deadline_from_dispatch, Instant::now()));
    // the deadline counts from the first attempt of this drain, whatever restarted it since
    let clock_key = format!("{}/{node}", task.step);
    let mut clock_kept = false;
    if let Some(since) = ctx.drain_clock(&clock_key)
        && let Some(s) = state.as_mut()
    {
        s.resume_clock(since);
    }
    loop {
        if !clock_kept && let Some(since) = state.as_ref().and_then(DrainState::clock) {
            ctx.keep_drain_clock(&clock_key, since);
            clock_kept = true;
        }
        if ctx.cancel.is_cancelled() {
            return Ok(TaskOutcome::Interrupted);
        }
        let (riders, left): (Vec<Arc<PodRef>>, Vec<Arc<PodRef>>) =
            ctx.pods.pods_on(&node).into_iter().partition(|p| p.rides_with_node.is_some());
        let observed = Observation::Pods { riders, left, fenced: ctx.pods.fenced(&node) };
        let mut todo: std::collections::VecDeque<Action> = feed(&mut state, observed).into();
        while let Some(action) = todo.pop_front() {
            match action {
                Action::Evict(wave) => {
                    for p in wave {
                        let Some(heard) = Box::pin(ask_eviction(ctx, &node, p, &budget_changed)).await else {
                            return Ok(TaskOutcome::Interrupted);
                        };
                        // an answer can only end the drain (an error asking again cannot cure)
                        for a in feed(&mut state, heard) {
                            if let Some(end) = Box::pin(act(ctx, task, &node, deadline, a)).await {
                                return end;
                            }
                        }
                    }
                    todo.extend(feed(&mut state, Observation::WaveSent));
                }
                Action::CheckFence => {
                    let checked = Box::pin(cordon_node(&nodes, &node, true)).await;
                    todo.extend(feed(&mut state, Observation::FenceChecked(checked)));
                }
                other => {
                    if let Some(end) = Box::pin(act(ctx, task, &node, deadline, other)).await {
                        return end;
                    }
                }
            }
        }
        tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
            _ = changes.changed() => {}
            _ = budget_changed.notified() => {
                feed(&mut state, Observation::BudgetChanged);
            }
            _ = tokio::time::sleep(IDLE) => {}
        }
    }
}

/// Does one action that feeds nothing back; `Some` ends the drain.
async fn act(ctx: &Ctx, task: &TaskRef, node: &str, deadline: Duration, action: Action) -> Option<Outcome> {
    match action {
        Action::NoteRider { pod, fence } => {
            tracing::info!(pod = %pod, node = %node, tolerates = fence, "not evicted: it tolerates the fence and goes with its node");
            ctx.note_bypass(crate::report::BypassKind::RidesWithNode, &pod, node);
            ctx.note(
                BlockerKind::PodGoesWithNode,
                &pod,
                format!(
                    "tolerates {fence}: evicting it would only put it back on a fenced node, so, as Karpenter does, it is not evicted and goes with node {node}"
                ),
            );
        }
        Action::NoteRebound(uids) => {
            ctx.note_rebound(node, uids.iter().map(String::as_str));
        }
        Action::NoteReverted(who) => note_lift(ctx, node, &who, "during the drain"),
        Action::DeadlinePassed { pods_left } => {
            ctx.events.send(EngineEvent::DrainDeadlinePassed { task: task.clone(), pods_left });
        }
        Action::Abandon(uids) => ctx.abandoned.lock().unwrap_or_else(|p| p.into_inner()).extend(uids),
        Action::NoteBypass(kind, pods) => {
            for pod in &pods {
                ctx.note_bypass(kind, pod, node);
            }
        }
        Action::Delete(pods) => {
            for p in &pods {
                if let Err(e) = Box::pin(delete_pod(&ctx.kube.client, p)).await {
                    return Some(Err(e.into()));
                }
            }
            tracing::warn!(node = %node, pods = pods.len(), "drain deadline passed: deleting the remaining pods (policy delete)");
        }
        Action::Progress { pods_left, waiting } => {
            ctx.events.send(EngineEvent::DrainProgress { task: task.clone(), pods_left, waiting });
        }
        Action::Block { left, blocked, lifted } => {
            let names = Box::pin(describe_blockers(ctx, &left, &blocked)).await;
            // pods that keep coming back are the lifter's doing, not their budgets'
            let lifted = lifted
                .map(|l| format!("; its fence keeps being lifted ({l}), so pods are bound to it again"))
                .unwrap_or_default();
            return Some(Ok(TaskOutcome::Blocked(format!(
                "{} pod(s) still on node {node} after {}: {names}{lifted}",
                left.len(),
                humantime::format_duration(deadline)
            ))));
        }
        Action::Finish(outcome) => return Some(Ok(outcome)),
        Action::Abort(e) => return Some(Err(e.into())),
        // fed back by the driver itself
        Action::Evict(_) | Action::CheckFence => {}
    }
    None
}

/// Waits for the eviction's turn (see [`super::gate`]), asks the pod's budget, then (unless the
/// budget holds it) the Eviction API, keeping the budget's reservation in step with the server's
/// answer. `None` when the run is interrupted first.
async fn ask_eviction(
    ctx: &Ctx,
    node: &str,
    p: Arc<PodRef>,
    budget_changed: &Arc<tokio::sync::Notify>,
) -> Option<Observation> {
    let _turn = tokio::select! {
        _ = ctx.cancel.cancelled() => return None,
        turn = ctx.evictions.acquire(node, p.grace()) => turn,
    };
    // the budget is asked once the turn has come, so it answers with what is true then
    let reserved = match ctx.budgets.admit(
        &p.namespace,
        &p.name,
        &*p.labels,
        p.ready,
        std::time::Instant::now(),
        budget_changed,
    ) {
        Admission::Ask(reserved) => reserved,
        // nothing heard of the budget for a while: the watch may be behind the server
        Admission::Probe(budget) => {
            tracing::debug!(pod = %p.key(), budget = %budget, "asking the server although the budget shows no allowance");
            None
        }
        // the budget allows nothing now: no request until its status changes
        Admission::Wait(budget) => return Some(Observation::Held { pod: p, budget }),
    };
    let outcome = Box::pin(evict(&ctx.kube.client, &p)).await;
    if let Some(key) = &reserved {
        match &outcome {
            Ok(EvictionOutcome::Evicted) => {}
            Ok(EvictionOutcome::Blocked(_)) => {
                tracing::debug!(pod = %p.key(), budget = %key, "the server refused what the watched budget allowed");
                ctx.budgets.refused(key, &p.name)
            }
            _ => ctx.budgets.release(key, &p.name),
        }
    }
    Some(Observation::Answered { pod: p, outcome, reserved })
}

// ---------------------------------------------------------------- the release of a node

/// How long a node's fence must have held, unlifted, before its machine is released. An actor
/// that lifts fences (a K3s agent, a remediation controller) does it on a loop of a second or
/// so, and shows itself within this; a fence set at the start of a drain has held this long by
/// its end almost always, so a run pays it only for nodes drained in an instant.
pub(crate) const FENCE_SETTLE: Duration = Duration::from_secs(5);

/// How long after putting a node's fence back the release waits for the node watch to show it
/// before it reads the node again.
const RELIFT_READ: Duration = Duration::from_secs(1);

/// What waiting for a node's fence to hold decides now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The fence has held, unlifted, for the settle time.
    Settled,
    /// The node watch shows the fence lifted: put it back, and start again.
    Lifted,
    /// Look again after this long (or when the watch shows a change).
    Wait(Duration),
}

/// Whether a node's fence has held long enough, from what the node watch shows: `fenced` now,
/// and since when without a break.
pub(crate) fn hold(fenced: Option<bool>, fenced_since: Option<Instant>, now: Instant, settle: Duration) -> Hold {
    match (fenced, fenced_since) {
        (_, Some(since)) if now >= since + settle => Hold::Settled,
        (_, Some(since)) => Hold::Wait(since + settle - now),
        (Some(false), None) => Hold::Lifted,
        // the watch has not shown the node (yet): only a short wait, never a pass
        _ => Hold::Wait(Duration::from_millis(250)),
    }
}

/// Whether a machine that was found ready to go still may, right before its termination is sent
/// (it may have waited its turn at EC2's termination pace meanwhile): its node's fence unbroken
/// since it was found ready (`held`), and nothing a drain moves bound to it, by the pod index.
pub(crate) fn still_clear(
    node: &str,
    fenced_since: Option<Instant>,
    held: Instant,
    on_node: &[Arc<PodRef>],
    abandoned: &HashSet<String>,
) -> Result<(), String> {
    if fenced_since != Some(held) {
        return Err(format!("the fence of node {node} was lifted while its termination waited its turn"));
    }
    let bound = on_node.iter().filter(|p| p.rides_with_node.is_none() && !abandoned.contains(&p.uid)).count();
    if bound > 0 {
        return Err(format!("{bound} pod(s) were bound to node {node} while its termination waited its turn"));
    }
    Ok(())
}

/// What the check before a node's release found.
pub(super) enum Release {
    /// The node is gone: nothing can be bound to it.
    Gone,
    /// The node's fence has held for [`FENCE_SETTLE`] since `fenced_since` and the server lists
    /// nothing a drain moves on it: the machine may go, if that still holds when its termination
    /// is sent ([`still_clear`]).
    Ready { fenced_since: Instant, abandoned: HashSet<String> },
    /// The release stops with this outcome.
    Stop(TaskOutcome),
}

/// Waits, before a node is released, until its fence has held unlifted for [`FENCE_SETTLE`] and
/// the server lists no pod on it that a drain must move, draining any that were bound since its
/// drain. The scheduler places pods on a node whenever something lifts its fence, and a pod
/// still bound when the instance goes dies with it, its budget bypassed; so a node whose fence
/// keeps being lifted is not released, and at the run's drain deadline (counted from the first
/// check, across retries) the release ends blocked, naming the node. The pods are listed from
/// the API server rather than from the watch, which may be a moment behind. `read` is the node
/// as the caller has just read it, which the first check starts from.
pub(super) async fn hold_before_release(
    ctx: &Ctx,
    machine: &str,
    node: &str,
    mut read: Option<Node>,
) -> Result<Release, TaskError> {
    let nodes: Api<Node> = Api::all(ctx.kube.client.clone());
    let pods: Api<Pod> = Api::all(ctx.kube.client.clone());
    // the drain step's defaults, under the run's --drain-deadline and --on-drain-deadline
    let params = Params {
        deadline: None,
        on_deadline: OnDeadline::Fail,
        concurrency: std::num::NonZeroUsize::MIN,
        settle: Duration::ZERO,
    };
    let task =
        TaskRef { step: "release-check".into(), action: crate::plan::Action::Drain, object: Some(machine.to_string()) };
    // One deadline for the whole check, the drains it runs included (they keep the same clock):
    // the run's drain deadline beyond one settle time, so that a deadline shorter than the
    // settle still lets a fence that holds pass.
    let clock_key = format!("{}/{node}", task.step);
    ctx.keep_drain_clock(&clock_key, Instant::now());
    let started = ctx.drain_clock(&clock_key).unwrap_or_else(Instant::now);
    let deadline = started + FENCE_SETTLE + ctx.drain.deadline.unwrap_or(Duration::from_secs(600));
    let mut changes = ctx.pods.subscribe(node);
    let mut lifts: Vec<String> = Vec::new();
    let mut first = true;
    'check: loop {
        if ctx.cancel.is_cancelled() {
            return Ok(Release::Stop(TaskOutcome::Interrupted));
        }
        // put the fence back (a lift found after the first look is someone else's doing)
        let fence = Box::pin(cordon_read_node(&nodes, node, !first, read.take())).await?;
        first = false;
        if fence.gone {
            return Ok(Release::Gone);
        }
        if let Some(who) = fence.reverted_by {
            note_lift(ctx, node, &who, "before its release");
            lifts.push(who);
        }
        let asserted = Instant::now();
        let held = loop {
            let now = Instant::now();
            if now >= deadline {
                return Ok(Release::Stop(TaskOutcome::Blocked(not_settled(node, &lifts))));
            }
            let wait = match hold(ctx.pods.fenced(node), ctx.pods.fenced_since(node), now, FENCE_SETTLE) {
                Hold::Settled => break ctx.pods.fenced_since(node),
                // the watch may not show the fence just put back yet (or may be relisting): read
                // the node again only once it had a moment, not in a loop of reads
                Hold::Lifted if now >= asserted + RELIFT_READ => continue 'check,
                Hold::Lifted => asserted + RELIFT_READ - now,
                Hold::Wait(d) => d,
            };
            tokio::select! {
                _ = ctx.cancel.cancelled() => return Ok(Release::Stop(TaskOutcome::Interrupted)),
                _ = changes.changed() => {}
                _ = tokio::time::sleep_until(deadline.min(now + wait)) => {}
            }
        };
        let Some(held) = held else { continue };
        let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let list =
            Box::pin(pods.list(&lp)).await.map_err(|e| KubeError::api(format!("list the pods on node {node}"), e))?;
        let abandoned = ctx.abandoned.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let bound = must_leave_before_release(&list.items, &abandoned);
        if bound.is_empty() {
            // the list came after the fence had held: if it still holds, nothing was bound since
            if ctx.pods.fenced_since(node) == Some(held) {
                return Ok(Release::Ready { fenced_since: held, abandoned });
            }
            continue;
        }
        ctx.note_rebound(node, bound.iter().map(|p| p.uid.as_str()));
        match Box::pin(drain(ctx, machine, &params, &task)).await? {
            TaskOutcome::Done(_) | TaskOutcome::Skipped(_) => {}
            TaskOutcome::Blocked(d) => {
                let lifted = lifts.last().map(|who| format!(" ({})", lifted(lifts.len(), who))).unwrap_or_default();
                return Ok(Release::Stop(TaskOutcome::Blocked(format!(
                    "node {node} not released: pods were bound to it after its drain{lifted}: {d}"
                ))));
            }
            other => return Ok(Release::Stop(other)),
        }
    }
}

/// Why a node's release ended at the deadline without its fence having held.
fn not_settled(node: &str, lifts: &[String]) -> String {
    let settle = humantime::format_duration(FENCE_SETTLE);
    if lifts.is_empty() {
        format!(
            "node {node} not released: the node watch never showed its fence holding for {settle} before the drain deadline"
        )
    } else {
        format!(
            "node {node} not released: its fence keeps being lifted ({}), and a machine goes only once its fence has held for {settle}: stop what uncordons it, then run again",
            lifted(lifts.len(), lifts.last().map_or(LIFTER_NOT_RECORDED, String::as_str))
        )
    }
}

/// "lifted N time(s), last by M", saying so when the server kept no record of who.
fn lifted(times: usize, last: &str) -> String {
    let by = if last == LIFTER_NOT_RECORDED {
        "by a writer the server keeps no record of (it records no field manager for a removed field)".to_string()
    } else {
        format!("last by field manager {last}")
    };
    format!("lifted {times} time(s), {by}")
}

/// Reports a lift of `node`'s fence, put back since; `when` says during what.
fn note_lift(ctx: &Ctx, node: &str, who: &str, when: &str) {
    tracing::warn!(node = %node, field_manager = %who, "the fence was lifted; put it back");
    let unrecorded = if who == LIFTER_NOT_RECORDED {
        " (the server records no field manager for a removed field, so who lifted it is not known)"
    } else {
        ""
    };
    ctx.note(
        BlockerKind::FieldManager,
        who,
        format!("lifted the fence of node {node} (its cordon or taint) {when}; re-asserted{unrecorded}"),
    );
}

/// The pods among `on_node` that must leave before their node is released: those a drain moves
/// (not finished, not a DaemonSet's or a mirror, not tolerating the fence) and that no drain left
/// there by policy.
pub(super) fn must_leave_before_release(on_node: &[Pod], abandoned: &HashSet<String>) -> Vec<PodRef> {
    on_node
        .iter()
        .filter(|p| !matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")))
        .filter_map(crate::k8s::pods::drainable)
        .filter(|p| p.rides_with_node.is_none() && !abandoned.contains(&p.uid))
        .collect()
}

// ---------------------------------------------------------------- per pod

/// What a drain has heard of each pod's eviction, and what it does next about each: the part of
/// [`DrainState`] that is about single pods.
#[derive(Debug, Default)]
struct EvictionBook {
    /// Pods held back by a budget (by the watched status or the server's refusal): UID → budget.
    held_by_budget: HashMap<String, String>,
    /// UID → when to ask again.
    next_try: HashMap<String, Instant>,
    /// UIDs whose eviction the server accepted (or that were already gone).
    accepted: HashSet<String>,
    /// UID → the pod and why it is blocked, to name at the deadline.
    blocked: BTreeMap<String, (PodRef, String)>,
    /// Evictions the server accepted.
    evicted: usize,
}

impl EvictionBook {
    /// Whether to ask for the pod's eviction `now`.
    fn due(&self, p: &PodRef, now: Instant) -> bool {
        !(p.terminating || self.accepted.contains(&p.uid) || self.next_try.get(&p.uid).is_some_and(|t| *t > now))
    }

    /// The watched `budget` allows nothing now: no request until its status changes (or a probe).
    fn held(&mut self, p: &PodRef, budget: String, now: Instant) {
        // the server's own refusal, when there was one, says more than the watched status
        self.blocked.entry(p.uid.clone()).or_insert_with(|| {
            (
                p.clone(),
                format!("PodDisruptionBudget {budget} allows no disruption now (status.disruptionsAllowed is 0)"),
            )
        });
        self.next_try.insert(p.uid.clone(), now + budgets::PROBE);
        self.held_by_budget.insert(p.uid.clone(), budget);
    }

    /// Takes the server's answer to an eviction asked `now`; `reserved` is the budget whose
    /// allowance the request used. An error that asking again cannot cure is handed back.
    fn answer(
        &mut self,
        p: &PodRef,
        outcome: Result<EvictionOutcome, KubeError>,
        reserved: Option<&str>,
        now: Instant,
    ) -> Result<(), KubeError> {
        match outcome {
            // An accepted eviction is a delete of that very pod (the UID precondition): it
            // only has to leave now. Evicting it again when the watch is slow to show its
            // deletionTimestamp would double the requests on a busy API server.
            Ok(EvictionOutcome::Evicted) => {
                self.evicted += 1;
                self.blocked.remove(&p.uid);
                self.accepted.insert(p.uid.clone());
            }
            Ok(EvictionOutcome::Gone) => {
                self.accepted.insert(p.uid.clone());
            }
            // the budget's status is behind the server's: wait for the next one, probing
            Ok(EvictionOutcome::Blocked(msg)) => {
                self.blocked.insert(p.uid.clone(), (p.clone(), msg));
                self.next_try.insert(p.uid.clone(), now + budgets::PROBE);
                self.held_by_budget.insert(p.uid.clone(), reserved.unwrap_or("a PodDisruptionBudget").to_string());
            }
            // nothing changes until someone removes a budget: ask again now and then, and
            // name the pod and its budgets at the deadline
            Ok(EvictionOutcome::MultipleBudgets(msg)) => {
                self.blocked.insert(
                    p.uid.clone(),
                    (p.clone(), format!("{msg} Remove all but one of the budgets that select it.")),
                );
                self.next_try.insert(p.uid.clone(), now + Duration::from_secs(5));
            }
            // the API server is throttling, not a budget: wait as long as it asked
            Ok(EvictionOutcome::Throttled(after)) => {
                self.next_try.insert(p.uid.clone(), now + after);
            }
            Err(KubeError::Api { source, .. }) if k8s::is_transient(&source) => {
                self.next_try.insert(p.uid.clone(), now + Duration::from_secs(1));
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// A budget this drain waits on has a new status: ask again now for every pod it held.
    fn budget_changed(&mut self) {
        for (uid, _) in self.held_by_budget.drain() {
            self.next_try.remove(&uid);
        }
    }

    /// What the drain of the pods `left` waits on, for the progress view.
    fn waiting<P: std::borrow::Borrow<PodRef>>(&self, left: &[P]) -> Waiting {
        let pods = || left.iter().map(|p| p.borrow());
        match pods().find_map(|p| self.held_by_budget.get(&p.uid).filter(|_| !self.accepted.contains(&p.uid))) {
            Some(budget) => Waiting::Budget(budget.clone()),
            None if pods().all(|p| p.terminating || self.accepted.contains(&p.uid)) => Waiting::GracePeriods,
            None => Waiting::Evicting,
        }
    }
}

/// Names the pods that block and the PodDisruptionBudgets that select them, and records them.
async fn describe_blockers(ctx: &Ctx, left: &[Arc<PodRef>], blocked: &BTreeMap<String, (PodRef, String)>) -> String {
    let mut parts = Vec::new();
    for p in left {
        let why = blocked.get(&p.uid).map(|(_, m)| m.clone()).unwrap_or_else(|| "still terminating".into());
        let pdbs = match matching_pdbs(ctx, p).await {
            Ok(found) => found,
            Err(e) => {
                ctx.note(
                    BlockerKind::Pdb,
                    &format!("{}/?", p.namespace),
                    format!("could not be read for pod {}: {e}", p.key()),
                );
                Vec::new()
            }
        };
        for (pdb, allowed) in &pdbs {
            ctx.note(BlockerKind::Pdb, pdb, format!("allows {allowed} disruption(s); blocks pod {}", p.key()));
        }
        ctx.note(BlockerKind::Pod, &p.key(), why.clone());
        let pdb_names: Vec<&str> = pdbs.iter().map(|(n, _)| n.as_str()).collect();
        parts.push(if pdb_names.is_empty() { p.key() } else { format!("{} (PDB {})", p.key(), pdb_names.join(", ")) });
    }
    parts.join(", ")
}

async fn matching_pdbs(ctx: &Ctx, p: &PodRef) -> Result<Vec<(String, i32)>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.kube.client.clone(), &p.namespace);
    let labels = match pods.get_opt(&p.name).await? {
        Some(pod) => pod.metadata.labels.unwrap_or_default(),
        None => return Ok(Vec::new()),
    };
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(ctx.kube.client.clone(), &p.namespace);
    let list = pdbs.list(&ListParams::default()).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|pdb| {
            let sel = pdb.spec.as_ref().and_then(|s| s.selector.as_ref());
            sel.is_some_and(|s| budgets::selects(s, &labels))
        })
        .map(|pdb| {
            let allowed = pdb.status.as_ref().map(|s| s.disruptions_allowed).unwrap_or(0);
            (format!("{}/{}", p.namespace, pdb.metadata.name.unwrap_or_default()), allowed)
        })
        .collect())
}

#[cfg(test)]
mod book_tests {
    use kube::core::Status;

    use super::*;

    fn pod(uid: &str) -> PodRef {
        PodRef {
            namespace: "shop".into(),
            name: format!("web-{uid}"),
            uid: uid.into(),
            critical: false,
            terminating: false,
            grace_seconds: None,
            rides_with_node: None,
            labels: Default::default(),
            ready: true,
        }
    }

    fn api_error(code: u16) -> KubeError {
        KubeError::api("evict", kube::Error::Api(Status::failure("no", "Failure").with_code(code).boxed()))
    }

    fn reason(book: &EvictionBook, p: &PodRef) -> Option<String> {
        book.blocked.get(&p.uid).map(|(_, why)| why.clone())
    }

    #[test]
    fn an_accepted_eviction_counts_once_and_is_never_asked_again() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        assert!(book.due(&p, now));
        book.answer(&p, Ok(EvictionOutcome::Evicted), None, now).unwrap();
        assert_eq!(book.evicted, 1);
        assert!(!book.due(&p, now + Duration::from_secs(3600)), "the watch only has to show it leave");
        assert_eq!(book.waiting(&[p]), Waiting::GracePeriods);
    }

    #[test]
    fn a_pod_already_gone_is_done_but_not_counted_as_evicted() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.answer(&p, Ok(EvictionOutcome::Gone), None, now).unwrap();
        assert_eq!(book.evicted, 0);
        assert!(!book.due(&p, now + Duration::from_secs(3600)));
    }

    #[test]
    fn a_terminating_pod_is_not_asked_for_and_only_waits_for_its_grace_period() {
        let book = EvictionBook::default();
        let p = PodRef { terminating: true, ..pod("a") };
        assert!(!book.due(&p, Instant::now()));
        assert_eq!(book.waiting(&[p, pod("b")]), Waiting::Evicting, "b is still to be asked for");
    }

    #[test]
    fn a_budget_refusal_waits_a_probe_interval_and_shows_the_budget() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.answer(&p, Ok(EvictionOutcome::Blocked("budget says no".into())), Some("shop/web"), now).unwrap();
        assert!(!book.due(&p, now + budgets::PROBE - Duration::from_millis(1)));
        assert!(book.due(&p, now + budgets::PROBE));
        assert_eq!(book.waiting(std::slice::from_ref(&p)), Waiting::Budget("shop/web".into()));
        assert_eq!(reason(&book, &p).as_deref(), Some("budget says no"));
        let (mut unwatched, q) = (EvictionBook::default(), pod("b"));
        unwatched.answer(&q, Ok(EvictionOutcome::Blocked("no".into())), None, now).unwrap();
        assert_eq!(unwatched.waiting(&[q]), Waiting::Budget("a PodDisruptionBudget".into()));
    }

    #[test]
    fn a_budget_that_changes_releases_the_pods_it_held_at_once() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.held(&p, "shop/web".into(), now);
        assert!(!book.due(&p, now));
        book.budget_changed();
        assert!(book.due(&p, now));
        assert_eq!(book.waiting(&[p]), Waiting::Evicting);
    }

    #[test]
    fn a_watched_budget_keeps_the_servers_reason_when_there_is_one() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.held(&p, "shop/web".into(), now);
        assert_eq!(
            reason(&book, &p).as_deref(),
            Some("PodDisruptionBudget shop/web allows no disruption now (status.disruptionsAllowed is 0)")
        );
        book.answer(&p, Ok(EvictionOutcome::Blocked("refused by shop/web".into())), Some("shop/web"), now).unwrap();
        book.held(&p, "shop/web".into(), now);
        assert_eq!(reason(&book, &p).as_deref(), Some("refused by shop/web"));
    }

    #[test]
    fn an_eviction_accepted_after_a_refusal_is_no_longer_blocked() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.answer(&p, Ok(EvictionOutcome::Blocked("no".into())), Some("shop/web"), now).unwrap();
        book.answer(&p, Ok(EvictionOutcome::Evicted), Some("shop/web"), now + budgets::PROBE).unwrap();
        assert_eq!(reason(&book, &p), None);
        assert_eq!(book.waiting(&[p]), Waiting::GracePeriods, "an accepted pod no longer waits on its budget");
    }

    #[test]
    fn a_pod_under_several_budgets_is_asked_again_every_5_s_and_says_what_to_do() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.answer(&p, Ok(EvictionOutcome::MultipleBudgets("two budgets.".into())), None, now).unwrap();
        assert!(!book.due(&p, now + Duration::from_millis(4999)));
        assert!(book.due(&p, now + Duration::from_secs(5)));
        assert_eq!(
            reason(&book, &p).as_deref(),
            Some("two budgets. Remove all but one of the budgets that select it.")
        );
        assert_eq!(book.waiting(&[p]), Waiting::Evicting, "not a budget's status to wait for");
    }

    #[test]
    fn throttling_waits_as_long_as_the_server_asked() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.answer(&p, Ok(EvictionOutcome::Throttled(Duration::from_secs(7))), None, now).unwrap();
        assert!(!book.due(&p, now + Duration::from_secs(6)));
        assert!(book.due(&p, now + Duration::from_secs(7)));
        assert_eq!(reason(&book, &p), None, "throttling blocks nothing at the deadline");
    }

    #[test]
    fn a_transient_error_is_asked_again_after_a_second_and_any_other_ends_the_drain() {
        let (mut book, p, now) = (EvictionBook::default(), pod("a"), Instant::now());
        book.answer(&p, Err(api_error(503)), None, now).unwrap();
        assert!(!book.due(&p, now + Duration::from_millis(999)));
        assert!(book.due(&p, now + Duration::from_secs(1)));
        assert!(book.answer(&p, Err(api_error(403)), None, now).is_err());
    }
}

#[cfg(test)]
mod step_tests {
    use kube::core::Status;

    use super::*;

    fn pod(uid: &str, grace: i64) -> Arc<PodRef> {
        Arc::new(PodRef {
            namespace: "shop".into(),
            name: format!("web-{uid}"),
            uid: uid.into(),
            critical: false,
            terminating: false,
            grace_seconds: Some(grace),
            rides_with_node: None,
            labels: Default::default(),
            ready: true,
        })
    }

    fn terminating(p: &Arc<PodRef>) -> Arc<PodRef> {
        Arc::new(PodRef { terminating: true, ..(**p).clone() })
    }

    const DEADLINE: Duration = Duration::from_secs(60);

    fn start(policy: DrainPolicy, now: Instant) -> DrainState {
        DrainState::new("n1", DEADLINE, policy, false, now)
    }

    /// Feeds `obs` at `now`.
    fn feed_at(s: DrainState, obs: Observation, now: Instant) -> (DrainState, Vec<Action>) {
        step(s, obs, now)
    }

    fn pods(left: &[&Arc<PodRef>]) -> Observation {
        Observation::Pods { riders: Vec::new(), left: left.iter().map(|p| Arc::clone(p)).collect(), fenced: Some(true) }
    }

    fn answered(p: &Arc<PodRef>, outcome: Result<EvictionOutcome, KubeError>) -> Observation {
        Observation::Answered { pod: p.clone(), outcome, reserved: None }
    }

    /// The UIDs the actions ask to evict.
    fn evicted(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Evict(wave) => Some(wave.iter().map(|p| p.uid.clone())),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn rebound(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::NoteRebound(uids) => Some(uids.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn finished(actions: &[Action]) -> Option<&TaskOutcome> {
        actions.iter().find_map(|a| match a {
            Action::Finish(o) => Some(o),
            _ => None,
        })
    }

    /// One round of the driver: observe, answer every eviction with `answer`, send the wave.
    fn round(
        s: DrainState,
        left: &[&Arc<PodRef>],
        now: Instant,
        answer: impl Fn(&Arc<PodRef>) -> Result<EvictionOutcome, KubeError>,
    ) -> (DrainState, Vec<Action>) {
        let (mut s, mut all) = feed_at(s, pods(left), now);
        let asked: Vec<Arc<PodRef>> = all
            .iter()
            .filter_map(|a| match a {
                Action::Evict(w) => Some(w.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        if !all.iter().any(|a| matches!(a, Action::Finish(_) | Action::Block { .. })) {
            for p in &asked {
                let (next, more) = feed_at(s, answered(p, answer(p)), now);
                s = next;
                all.extend(more);
            }
            let (next, more) = feed_at(s, Observation::WaveSent, now);
            s = next;
            all.extend(more);
        }
        (s, all)
    }

    fn evicted_ok(_: &Arc<PodRef>) -> Result<EvictionOutcome, KubeError> {
        Ok(EvictionOutcome::Evicted)
    }

    #[test]
    fn a_pod_bound_after_the_drain_began_is_evicted_too_and_counted_once() {
        let (t0, a, b) = (Instant::now(), pod("a", 30), pod("b", 30));
        let (s, first) = round(start(DrainPolicy::Fail, t0), &[&a], t0, evicted_ok);
        assert_eq!(evicted(&first), ["a"]);
        assert!(rebound(&first).is_empty(), "what the drain found first was not re-bound");
        // the fence was lifted: b was bound meanwhile, while a terminates
        let t1 = t0 + Duration::from_secs(2);
        let (s, second) = round(s, &[&terminating(&a), &b], t1, evicted_ok);
        assert_eq!(rebound(&second), ["b"]);
        assert_eq!(evicted(&second), ["b"], "a was accepted already; b is asked for");
        let (s, third) = round(s, &[&terminating(&b)], t1 + Duration::from_secs(1), evicted_ok);
        assert!(rebound(&third).is_empty(), "b counts once");
        let (_, end) = round(s, &[], t1 + Duration::from_secs(2), evicted_ok);
        assert!(matches!(finished(&end), Some(TaskOutcome::Done(d)) if d == "2 pod(s) evicted"), "{end:?}");
    }

    #[test]
    fn a_budget_refusal_holds_the_pod_until_the_probe_or_a_budget_change() {
        let (t0, a) = (Instant::now(), pod("a", 30));
        let refuse = |_: &Arc<PodRef>| Ok(EvictionOutcome::Blocked("would violate shop/web".into()));
        let (s, first) = round(start(DrainPolicy::Fail, t0), &[&a], t0, refuse);
        assert_eq!(evicted(&first), ["a"]);
        assert!(
            first.iter().any(|a| matches!(a, Action::Progress { pods_left: 1, waiting: Waiting::Budget(b) } if b == "a PodDisruptionBudget")),
            "{first:?}"
        );
        let (s, held) = round(s, &[&a], t0 + Duration::from_secs(1), refuse);
        assert!(evicted(&held).is_empty(), "no request before the probe interval");
        assert!(!held.iter().any(|a| matches!(a, Action::Progress { .. })), "nothing new to show");
        let (s, _) = step(s, Observation::BudgetChanged, t0 + Duration::from_secs(2));
        let (s, asked) = round(s, &[&a], t0 + Duration::from_secs(2), evicted_ok);
        assert_eq!(evicted(&asked), ["a"], "a budget that changes lets its pods be asked for at once");
        // without a change, the probe interval alone lets it be asked again
        let b = pod("b", 30);
        let (s, _) = round(s, &[&terminating(&a), &b], t0 + Duration::from_secs(3), refuse);
        let (_, probed) = round(s, &[&terminating(&a), &b], t0 + Duration::from_secs(3) + budgets::PROBE, evicted_ok);
        assert_eq!(evicted(&probed), ["b"]);
    }

    #[test]
    fn the_held_status_of_a_budget_shows_before_any_request() {
        let (t0, a) = (Instant::now(), pod("a", 30));
        let (s, first) = step(start(DrainPolicy::Fail, t0), pods(&[&a]), t0);
        assert_eq!(evicted(&first), ["a"]);
        let (s, _) = step(s, Observation::Held { pod: a.clone(), budget: "shop/web".into() }, t0);
        let (_, sent) = step(s, Observation::WaveSent, t0);
        assert!(
            sent.iter().any(|x| matches!(x, Action::Progress { waiting: Waiting::Budget(b), .. } if b == "shop/web")),
            "{sent:?}"
        );
    }

    fn blocked_by_a_budget(policy: DrainPolicy) -> (DrainState, Arc<PodRef>, Instant) {
        let (t0, a) = (Instant::now(), pod("a", 30));
        let refuse = |_: &Arc<PodRef>| Ok(EvictionOutcome::Blocked("would violate shop/web".into()));
        let (s, _) = round(start(policy, t0), &[&a], t0, refuse);
        (s, a, t0)
    }

    #[test]
    fn a_restarted_drain_keeps_the_deadline_of_its_first_attempt() {
        let (t0, a) = (Instant::now(), pod("a", 30));
        // the first attempt started at t0; a transient error restarted the drain 50 s on
        let restart = t0 + Duration::from_secs(50);
        let mut s = start(DrainPolicy::Fail, restart);
        s.resume_clock(t0);
        assert_eq!(s.clock(), Some(t0));
        let (_, at) = step(s, pods(&[&a]), t0 + DEADLINE);
        assert!(
            matches!(at.first(), Some(Action::DeadlinePassed { pods_left: 1 })),
            "the deadline counts from the first attempt: {at:?}"
        );
        let mut later = start(DrainPolicy::Fail, t0);
        later.resume_clock(restart);
        assert_eq!(later.clock(), Some(t0), "an earlier start is never pushed later");
    }

    #[test]
    fn at_the_deadline_policy_fail_ends_blocked_naming_the_pods_and_why() {
        let (s, a, t0) = blocked_by_a_budget(DrainPolicy::Fail);
        // asked again at the probe, and refused again
        let refuse = |_: &Arc<PodRef>| Ok(EvictionOutcome::Blocked("would violate shop/web".into()));
        let (s, before) = round(s, &[&a], t0 + DEADLINE - Duration::from_millis(1), refuse);
        assert_eq!(evicted(&before), ["a"]);
        assert!(!before.iter().any(|x| matches!(x, Action::DeadlinePassed { .. } | Action::Block { .. })));
        let (_, at) = step(s, pods(&[&a]), t0 + DEADLINE);
        assert!(matches!(at[0], Action::DeadlinePassed { pods_left: 1 }), "{at:?}");
        match &at[1] {
            Action::Block { left, blocked, .. } => {
                assert_eq!(left.len(), 1);
                assert_eq!(blocked.get("a").map(|(_, why)| why.as_str()), Some("would violate shop/web"));
            }
            other => panic!("not blocked: {other:?}"),
        }
        assert_eq!(at.len(), 2, "nothing is asked for once the drain is blocked");
    }

    #[test]
    fn at_the_deadline_policy_skip_leaves_the_pods_and_says_so() {
        let (s, a, t0) = blocked_by_a_budget(DrainPolicy::Skip);
        let (_, at) = step(s, pods(&[&a]), t0 + DEADLINE);
        assert!(matches!(at[0], Action::DeadlinePassed { pods_left: 1 }));
        assert!(
            matches!(&at[1], Action::NoteBypass(crate::report::BypassKind::Skip, pods) if pods.len() == 1),
            "the skipped pod is recorded as a bypass: {at:?}"
        );
        assert!(matches!(&at[2], Action::Abandon(uids) if uids == &["a".to_string()]), "{at:?}");
        assert!(
            matches!(finished(&at), Some(TaskOutcome::Skipped(d)) if d == "drain deadline passed with 1 pod(s) on node n1; skipped by policy: the instance goes with them, their budgets bypassed"),
            "{at:?}"
        );
    }

    #[test]
    fn at_the_deadline_policy_delete_deletes_once_and_waits_for_the_pods_to_go() {
        let (s, a, t0) = blocked_by_a_budget(DrainPolicy::Delete);
        let (s, at) = round(s, &[&a], t0 + DEADLINE, evicted_ok);
        assert!(matches!(at[0], Action::DeadlinePassed { pods_left: 1 }));
        assert!(
            matches!(&at[1], Action::NoteBypass(crate::report::BypassKind::Delete, pods) if pods.len() == 1),
            "the deleted pod is recorded as a bypass: {at:?}"
        );
        assert!(matches!(&at[2], Action::Delete(pods) if pods.len() == 1), "{at:?}");
        assert!(evicted(&at).is_empty(), "no eviction once the pods are deleted");
        let (s, later) = round(s, &[&terminating(&a)], t0 + DEADLINE * 2, evicted_ok);
        assert!(
            !later.iter().any(|x| matches!(x, Action::DeadlinePassed { .. } | Action::Delete(_))),
            "the policy applies once: {later:?}"
        );
        let (_, end) = round(s, &[], t0 + DEADLINE * 2, evicted_ok);
        assert!(matches!(finished(&end), Some(TaskOutcome::Done(d)) if d == "0 pod(s) evicted"), "{end:?}");
    }

    #[test]
    fn a_deadline_counted_from_dispatch_starts_with_the_first_wave() {
        let (t0, a) = (Instant::now(), pod("a", 30));
        let s = DrainState::new("n1", DEADLINE, DrainPolicy::Fail, true, t0);
        // the queue of requests before the first wave is not the drain's time
        let late = t0 + DEADLINE * 3;
        let (s, first) = round(s, &[&a], late, |_| Ok(EvictionOutcome::Blocked("no".into())));
        assert!(!first.iter().any(|x| matches!(x, Action::DeadlinePassed { .. })));
        let (_, at) = step(s, pods(&[&a]), late + DEADLINE);
        assert!(matches!(at[0], Action::DeadlinePassed { .. }), "{at:?}");
    }

    #[test]
    fn a_pod_that_vanishes_is_done_and_only_accepted_evictions_count() {
        let (t0, a, b) = (Instant::now(), pod("a", 30), pod("b", 120));
        let (s, first) = round(start(DrainPolicy::Fail, t0), &[&a, &b], t0, |p| {
            Ok(if p.uid == "a" { EvictionOutcome::Gone } else { EvictionOutcome::Evicted })
        });
        assert_eq!(evicted(&first), ["b", "a"], "the longest grace period first");
        let (s, waiting) = round(s, &[&a, &b], t0 + Duration::from_secs(1), evicted_ok);
        assert!(evicted(&waiting).is_empty(), "neither is asked for again");
        let (_, end) = round(s, &[], t0 + Duration::from_secs(2), evicted_ok);
        assert!(matches!(finished(&end), Some(TaskOutcome::Done(d)) if d == "1 pod(s) evicted"), "{end:?}");
    }

    #[test]
    fn a_node_with_nothing_to_move_is_done_at_once_and_its_riders_are_named_once() {
        let t0 = Instant::now();
        let rider =
            Arc::new(PodRef { rides_with_node: Some("karpenter.sh/disrupted:NoSchedule"), ..(*pod("r", 30)).clone() });
        let obs = || Observation::Pods { riders: vec![rider.clone()], left: Vec::new(), fenced: Some(true) };
        let (s, actions) = step(start(DrainPolicy::Fail, t0), obs(), t0);
        assert!(matches!(&actions[0], Action::NoteRider { pod, .. } if pod == "shop/web-r"));
        assert!(
            matches!(finished(&actions), Some(TaskOutcome::Done(d)) if d == "0 pod(s) evicted; 1 pod(s) that tolerate the fence go with the node")
        );
        let (_, again) = step(s, obs(), t0);
        assert!(!again.iter().any(|a| matches!(a, Action::NoteRider { .. })), "named once");
    }

    #[test]
    fn a_node_that_goes_away_ends_the_drain_and_a_lifted_fence_names_who() {
        let t0 = Instant::now();
        let gone = CordonOutcome { gone: true, wrote: false, reverted_by: None };
        let (s, end) = step(start(DrainPolicy::Fail, t0), Observation::FenceChecked(Ok(gone)), t0);
        assert!(matches!(finished(&end), Some(TaskOutcome::Done(d)) if d == "node went away during the drain"));
        let lifted = CordonOutcome { gone: false, wrote: true, reverted_by: Some("k3s".into()) };
        let (_, named) = step(s, Observation::FenceChecked(Ok(lifted)), t0);
        assert!(matches!(&named[..], [Action::NoteReverted(who)] if who == "k3s"));
    }

    #[test]
    fn the_fence_is_read_only_when_the_watch_does_not_show_it_and_not_too_often() {
        let (t0, a) = (Instant::now(), pod("a", 30));
        let checks = |actions: &[Action]| actions.iter().filter(|x| matches!(x, Action::CheckFence)).count();
        let with_fence = |s: DrainState, fenced: Option<bool>, now: Instant| {
            let (s, _) = step(s, Observation::Pods { riders: Vec::new(), left: vec![a.clone()], fenced }, now);
            step(s, Observation::WaveSent, now)
        };
        let (s, shown) = with_fence(start(DrainPolicy::Fail, t0), Some(true), t0 + Duration::from_secs(5));
        assert_eq!(checks(&shown), 0, "the watch shows the fence: no read");
        let (s, lifted) = with_fence(s, Some(false), t0 + Duration::from_secs(5));
        assert_eq!(checks(&lifted), 1);
        let (s, soon) = with_fence(s, Some(false), t0 + Duration::from_millis(5500));
        assert_eq!(checks(&soon), 0, "at most once a second while the watch catches up");
        let (s, unknown) = with_fence(s, None, t0 + Duration::from_secs(7));
        assert_eq!(checks(&unknown), 0, "a node the watch has not seen is read every 3 s");
        let (_, later) = with_fence(s, None, t0 + Duration::from_secs(8));
        assert_eq!(checks(&later), 1);
    }

    #[test]
    fn an_error_asking_again_cannot_cure_ends_the_drain() {
        let (t0, a) = (Instant::now(), pod("a", 30));
        let forbidden =
            KubeError::api("evict", kube::Error::Api(Status::failure("no", "Forbidden").with_code(403).boxed()));
        let (s, _) = step(start(DrainPolicy::Fail, t0), pods(&[&a]), t0);
        let (_, end) = step(s, answered(&a, Err(forbidden)), t0);
        assert!(matches!(&end[..], [Action::Abort(_)]), "{end:?}");
        let unavailable = KubeError::api(
            "read",
            kube::Error::Api(Status::failure("later", "ServiceUnavailable").with_code(503).boxed()),
        );
        let (_, passing) = step(start(DrainPolicy::Fail, t0), Observation::FenceChecked(Err(unavailable)), t0);
        assert!(passing.is_empty(), "a passing error reading the node waits for the next check");
    }

    #[test]
    fn only_pods_a_drain_moves_and_no_drain_left_by_policy_hold_a_node_back() {
        let pod = |name: &str, metadata: serde_json::Value, spec: serde_json::Value, phase: &str| -> Pod {
            let mut v = serde_json::json!({
                "metadata": {"name": name, "namespace": "shop", "uid": name},
                "spec": {"nodeName": "n1", "containers": []},
                "status": {"phase": phase},
            });
            if let (Some(m), Some(extra)) = (v["metadata"].as_object_mut(), metadata.as_object()) {
                m.extend(extra.clone());
            }
            if let (Some(s), Some(extra)) = (v["spec"].as_object_mut(), spec.as_object()) {
                s.extend(extra.clone());
            }
            serde_json::from_value(v).unwrap()
        };
        let none = serde_json::json!({});
        let daemonset = serde_json::json!({"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "ds"}]});
        let tolerates_all = serde_json::json!({"tolerations": [{"operator": "Exists"}]});
        let on_node = [
            pod("web", none.clone(), none.clone(), "Running"),
            pod("pending-start", none.clone(), none.clone(), "Pending"),
            pod("done", none.clone(), none.clone(), "Succeeded"),
            pod("agent", daemonset, none.clone(), "Running"),
            pod("shipper", none.clone(), tolerates_all, "Running"),
            pod("skipped", none.clone(), none, "Running"),
        ];
        let abandoned: HashSet<String> = ["skipped".to_string()].into();
        let names: Vec<String> = must_leave_before_release(&on_node, &abandoned).into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["web", "pending-start"]);
    }
    #[test]
    fn a_machine_goes_only_once_its_fence_has_held_unlifted_for_the_settle_time() {
        let t0 = Instant::now();
        let settle = FENCE_SETTLE;
        assert_eq!(hold(Some(true), Some(t0), t0 + settle, settle), Hold::Settled);
        assert_eq!(
            hold(Some(true), Some(t0), t0 + Duration::from_secs(2), settle),
            Hold::Wait(settle - Duration::from_secs(2))
        );
        assert_eq!(hold(Some(false), None, t0, settle), Hold::Lifted, "a lifted fence is put back before any wait");
        assert_eq!(
            hold(None, None, t0 + settle * 10, settle),
            Hold::Wait(Duration::from_millis(250)),
            "unseen is never a pass"
        );
    }

    #[test]
    fn a_machine_waiting_its_turn_is_withdrawn_when_its_fence_was_lifted_or_a_pod_was_bound() {
        let t0 = Instant::now();
        let none = HashSet::new();
        assert_eq!(still_clear("n", Some(t0), t0, &[], &none), Ok(()));
        let lifted = still_clear("n", Some(t0 + Duration::from_secs(1)), t0, &[], &none);
        assert!(lifted.as_ref().is_err_and(|e| e.contains("fence of node n was lifted")), "{lifted:?}");
        assert!(still_clear("n", None, t0, &[], &none).is_err(), "lifted now");
        let bound = pod("b", 30);
        let rebound = still_clear("n", Some(t0), t0, std::slice::from_ref(&bound), &none);
        assert!(rebound.as_ref().is_err_and(|e| e.contains("1 pod(s) were bound to node n")), "{rebound:?}");
        // a pod left there by policy, and one that tolerates the fence, go with the node
        let abandoned: HashSet<String> = [bound.uid.clone()].into();
        assert_eq!(still_clear("n", Some(t0), t0, std::slice::from_ref(&bound), &abandoned), Ok(()));
        let mut rider = (*pod("r", 30)).clone();
        rider.rides_with_node = Some("node.kubernetes.io/unschedulable");
        assert_eq!(still_clear("n", Some(t0), t0, &[Arc::new(rider)], &none), Ok(()));
    }

    #[test]
    fn a_fence_that_keeps_being_lifted_is_named_with_what_the_server_recorded() {
        let unrecorded = not_settled("n-1", &[LIFTER_NOT_RECORDED.to_string(), LIFTER_NOT_RECORDED.to_string()]);
        assert!(
            unrecorded.contains("node n-1 not released: its fence keeps being lifted (lifted 2 time(s)"),
            "{unrecorded}"
        );
        assert!(unrecorded.contains("records no field manager for a removed field"), "{unrecorded}");
        assert!(!unrecorded.contains("unknown"), "{unrecorded}");
        let named = not_settled("n-1", &["k3s".to_string()]);
        assert!(named.contains("last by field manager k3s"), "{named}");
        let unseen = not_settled("n-1", &[]);
        assert!(unseen.contains("never showed its fence holding"), "{unseen}");
    }
}
