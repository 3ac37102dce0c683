//! The actions: small, idempotent functions of the live state (observe, act, wait for the
//! condition). Each treats "already gone" as "done", so a re-run finishes what a killed run began.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, Patch};
use kube::core::DynamicObject;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::budgets::{self, Admission};
use super::context::Ctx;
use super::events::{EngineEvent, TaskRef, Waiting};
use super::inventory::{Inventory, Machine, find_controller, list_dynamic};
use crate::config::DrainPolicy;
use crate::k8s::nodes::cordon_node;
use crate::k8s::objects::{delete_if_present, last_manager_in, patch_params, remove_finalizer};
use crate::k8s::pods::{EvictionOutcome, PodRef, delete_pod, evict, eviction_wave};
use crate::k8s::{self, KubeError, status_code};
use crate::karpenter::{self, ProviderId};
use crate::plan::{OnDeadline, Params};
use crate::report::{BlockerKind, TaskResult};
use crate::verify;

/// How a task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskOutcome {
    /// Done; what was done.
    Done(String),
    /// Nothing to do, or skipped by policy.
    Skipped(String),
    /// Blocked past its deadline under policy `fail`.
    Blocked(String),
    /// Verification found leftovers.
    Leftovers(String),
    /// Failed.
    Failed(String),
    /// Failed on something that may pass (429, 5xx, a lost connection): the engine runs the
    /// task again (actions are idempotent functions of the live state) with backoff.
    Transient(String),
    /// Stopped by Ctrl-C / SIGTERM.
    Interrupted,
}

impl TaskOutcome {
    /// The report's `result`.
    pub fn result(&self) -> TaskResult {
        match self {
            TaskOutcome::Done(_) => TaskResult::Done,
            TaskOutcome::Skipped(_) => TaskResult::Skipped,
            TaskOutcome::Blocked(_) => TaskResult::Blocked,
            TaskOutcome::Leftovers(_) => TaskResult::Leftovers,
            TaskOutcome::Failed(_) | TaskOutcome::Transient(_) => TaskResult::Failed,
            TaskOutcome::Interrupted => TaskResult::Interrupted,
        }
    }

    /// The detail sentence.
    pub fn detail(&self) -> &str {
        match self {
            TaskOutcome::Done(d)
            | TaskOutcome::Skipped(d)
            | TaskOutcome::Blocked(d)
            | TaskOutcome::Leftovers(d)
            | TaskOutcome::Failed(d)
            | TaskOutcome::Transient(d) => d,
            TaskOutcome::Interrupted => "interrupted",
        }
    }

    /// Whether dependents may run after this.
    pub fn lets_dependents_run(&self) -> bool {
        matches!(self, TaskOutcome::Done(_) | TaskOutcome::Skipped(_) | TaskOutcome::Leftovers(_))
    }
}

impl From<KubeError> for TaskOutcome {
    fn from(e: KubeError) -> Self {
        match &e {
            KubeError::Api { source, .. } if k8s::is_transient(source) => TaskOutcome::Transient(e.to_string()),
            _ => TaskOutcome::Failed(e.to_string()),
        }
    }
}

impl From<crate::aws::AwsError> for TaskOutcome {
    fn from(e: crate::aws::AwsError) -> Self {
        if e.is_transient() { TaskOutcome::Transient(e.to_string()) } else { TaskOutcome::Failed(e.to_string()) }
    }
}

/// Why a task could not do its work. The engine turns it into a `failed` task, or runs the task
/// again when it is transient (actions are idempotent functions of the live state).
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A Kubernetes call failed.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// An EC2 or IAM call failed.
    #[error(transparent)]
    Aws(#[from] crate::aws::AwsError),
}

impl From<TaskError> for TaskOutcome {
    fn from(e: TaskError) -> Self {
        match e {
            TaskError::Kube(e) => e.into(),
            TaskError::Aws(e) => e.into(),
        }
    }
}

/// What an action returns: how it ended, or the error that stopped it, so that a failed call
/// propagates with `?` and the engine alone decides between `failed` and another attempt.
pub type Outcome = Result<TaskOutcome, TaskError>;

/// A batched EC2 call's failure: throttling that outlasted the SDK's retries runs the task again.
fn batch_failure(detail: String, e: &super::batcher::BatchError) -> TaskOutcome {
    if e.transient { TaskOutcome::Transient(detail) } else { TaskOutcome::Failed(detail) }
}

/// How long a drain waits for the first list of the PodDisruptionBudgets.
const BUDGETS_SYNC_WAIT: Duration = Duration::from_secs(30);

/// Annotation on a fenced NodePool holding its original limits and budgets.
pub const FENCE_ANNOTATION: &str = "karpenter-teardown.io/original-limits-and-budgets";

/// Sleeps, returning false if the run was cancelled meanwhile.
async fn pause(ctx: &Ctx, d: Duration) -> bool {
    tokio::select! {
        _ = ctx.cancel.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

// ---------------------------------------------------------------- fence

/// NodePool limits to zero and disruption budgets to zero nodes, originals kept in an
/// annotation; a NodePool already fenced is left alone. Static NodePools are fenced on
/// `limits.nodes` only (see [`karpenter::fence_limits`]); their `replicas` stay as they are.
pub async fn fence(ctx: &Ctx) -> Outcome {
    let ar = k8s::nodepool_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    let pools = list_dynamic(&ctx.kube.client, &ar).await?;
    let mut fenced = 0;
    for pool in pools {
        let name = pool.metadata.name.clone().unwrap_or_default();
        for attempt in 0..8 {
            let current = match if attempt == 0 { Ok(Some(pool.clone())) } else { api.get_opt(&name).await } {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(e) => return Err(KubeError::api(format!("read NodePool {name}"), e).into()),
            };
            if current.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(FENCE_ANNOTATION)) {
                break;
            }
            let limits = current.data.pointer("/spec/limits").cloned().unwrap_or(Value::Null);
            let budgets = current.data.pointer("/spec/disruption/budgets").cloned().unwrap_or(Value::Null);
            let zero = karpenter::fence_limits(&current.data["spec"]);
            let original = json!({"limits": limits, "budgets": budgets}).to_string();
            let patch = json!({
                "metadata": {
                    "resourceVersion": current.metadata.resource_version,
                    "annotations": {FENCE_ANNOTATION: original},
                },
                "spec": {"limits": zero, "disruption": {"budgets": [{"nodes": "0"}]}},
            });
            match api.patch(&name, &patch_params(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    fenced += 1;
                    break;
                }
                Err(e) if status_code(&e) == Some(404) => break,
                Err(e) if status_code(&e) == Some(409) => continue,
                Err(e) => return Err(KubeError::api(format!("fence NodePool {name}"), e).into()),
            }
        }
    }
    Ok(TaskOutcome::Done(format!("{fenced} NodePool(s) fenced")))
}

// ---------------------------------------------------------------- cordon

/// Cordons the nodes of every inventoried machine (or of one machine) before any is
/// drained. Drains run in parallel but not all at once: a pod evicted from one node would
/// otherwise be scheduled onto a node that is drained later and be evicted again, once per
/// node it lands on, which multiplies evictions and the makespan on a large cluster.
pub async fn cordon(ctx: &Ctx, machine: Option<&str>, params: &Params) -> Outcome {
    let nodes = match machine {
        Some(m) => match node_of(ctx, m).await? {
            Some(n) => vec![n],
            None => return Ok(TaskOutcome::Skipped("no node".into())),
        },
        None => inventoried_nodes(ctx).await?,
    };
    let api: Api<Node> = Api::all(ctx.kube.client.clone());
    let total = nodes.len();
    let mut results = stream::iter(nodes)
        .map(|node| {
            let api = &api;
            async move {
                let out = cordon_node(api, &node, false).await;
                (node, out)
            }
        })
        .buffer_unordered(params.concurrency.get());
    let (mut wrote, mut gone) = (0, 0);
    loop {
        let next = tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
            next = results.next() => next,
        };
        let Some((node, out)) = next else { break };
        // the engine runs the task again on a transient error; nodes done so far are no-ops
        let o = out?;
        if o.gone {
            gone += 1;
        } else if o.wrote {
            wrote += 1;
            tracing::debug!(node = %node, "cordoned");
        }
    }
    Ok(TaskOutcome::Done(format!(
        "{} node(s) cordoned ({wrote} written now){}",
        total - gone,
        if gone > 0 { format!(", {gone} already gone") } else { String::new() }
    )))
}

/// The nodes of the inventoried machines that still exist as NodeClaims (or bare nodes), read
/// with one list instead of one read per machine.
async fn inventoried_nodes(ctx: &Ctx) -> Result<Vec<String>, KubeError> {
    let claims = list_dynamic(&ctx.kube.client, &k8s::nodeclaim_resource()).await?;
    let by_claim: HashMap<String, String> = claims
        .into_iter()
        .filter_map(|c| {
            let node = c.data.pointer("/status/nodeName").and_then(Value::as_str)?.to_string();
            Some((c.metadata.name?, node))
        })
        .collect();
    Ok(ctx
        .inventoried
        .iter()
        .filter_map(|m| match m.strip_prefix("node/") {
            Some(n) => Some(n.to_string()),
            None => by_claim.get(m).cloned(),
        })
        .collect())
}

// ---------------------------------------------------------------- drain

/// Cordons the machine's node, evicts its pods in Karpenter's order respecting
/// PodDisruptionBudgets, waits for them by watch, and applies the deadline policy.
pub async fn drain(ctx: &Ctx, machine: &str, params: &Params, task: &TaskRef) -> Outcome {
    // Only a NodeClaim that names no node (or is gone) means there is nothing to drain; an error
    // reading it must never be taken for that, or the instance would be terminated undrained.
    // Every machine drains at once (5,000 at the largest clusters) and a future is as large as
    // its largest await: the requests' futures are boxed, so a drain that waits holds a few
    // hundred bytes instead of kilobytes (issue 19).
    let Some(node) = Box::pin(node_of(ctx, machine)).await? else {
        return Ok(TaskOutcome::Skipped("no node".into()));
    };
    let deadline = ctx.drain.deadline.or(params.deadline).unwrap_or(Duration::from_secs(600));
    let policy = ctx.drain.policy.unwrap_or(match params.on_deadline {
        OnDeadline::Delete => DrainPolicy::Delete,
        OnDeadline::Skip | OnDeadline::Continue => DrainPolicy::Skip,
        OnDeadline::Fail => DrainPolicy::Fail,
    });
    let nodes: Api<Node> = Api::all(ctx.kube.client.clone());
    if Box::pin(cordon_node(&nodes, &node, false)).await?.gone {
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
    let mut shown: Option<(u64, Waiting)> = None;
    let mut started = Instant::now();
    let mut dispatched = !ctx.drain.deadline_from_dispatch;
    let mut book = EvictionBook::default();
    let mut last_cordon_check = Instant::now();
    let mut deleting = false;
    let mut riders_noted: HashSet<String> = HashSet::new();
    let mut first_seen: Option<HashSet<u64>> = None;
    loop {
        if ctx.cancel.is_cancelled() {
            return Ok(TaskOutcome::Interrupted);
        }
        let (riders, left): (Vec<Arc<PodRef>>, Vec<Arc<PodRef>>) =
            ctx.pods.pods_on(&node).into_iter().partition(|p| p.rides_with_node.is_some());
        let seen = first_seen.get_or_insert_with(|| left.iter().map(|p| uid_hash(&p.uid)).collect());
        let rebound: Vec<&str> =
            left.iter().filter(|p| seen.insert(uid_hash(&p.uid))).map(|p| p.uid.as_str()).collect();
        ctx.note_rebound(&node, rebound);
        for p in riders.iter().filter(|p| riders_noted.insert(p.uid.clone())) {
            let fence = p.rides_with_node.unwrap_or_default();
            tracing::info!(pod = %p.key(), node = %node, tolerates = fence, "not evicted: it tolerates the fence and goes with its node");
            ctx.note(
                BlockerKind::PodGoesWithNode,
                &p.key(),
                format!(
                    "tolerates {fence}: evicting it would only put it back on a fenced node, so, as Karpenter does, it is not evicted and goes with node {node}"
                ),
            );
        }
        if left.is_empty() {
            let riding = if riders.is_empty() {
                String::new()
            } else {
                format!("; {} pod(s) that tolerate the fence go with the node", riders.len())
            };
            return Ok(TaskOutcome::Done(format!("{} pod(s) evicted{riding}", book.evicted)));
        }
        let now = Instant::now();
        if dispatched && now >= started + deadline && !deleting {
            ctx.events.send(EngineEvent::DrainDeadlinePassed { task: task.clone(), pods_left: left.len() as u64 });
            match policy {
                DrainPolicy::Fail => {
                    let names = Box::pin(describe_blockers(ctx, &left, &book.blocked)).await;
                    return Ok(TaskOutcome::Blocked(format!(
                        "{} pod(s) still on node {node} after {}: {names}",
                        left.len(),
                        humantime::format_duration(deadline)
                    )));
                }
                DrainPolicy::Skip => {
                    ctx.abandoned.lock().unwrap_or_else(|p| p.into_inner()).extend(left.iter().map(|p| p.uid.clone()));
                    return Ok(TaskOutcome::Skipped(format!(
                        "drain deadline passed with {} pod(s) on node {node}; skipped by policy",
                        left.len()
                    )));
                }
                DrainPolicy::Delete => {
                    deleting = true;
                    for p in &left {
                        Box::pin(delete_pod(&ctx.kube.client, p)).await?;
                    }
                    tracing::warn!(node = %node, pods = left.len(), "drain deadline passed: deleting the remaining pods (policy delete)");
                }
            }
        }
        for p in eviction_wave(&left) {
            if deleting || !book.due(p, now) {
                continue;
            }
            let reserved = match ctx.budgets.admit(&p.namespace, &p.name, &*p.labels, p.ready, &budget_changed) {
                Admission::Ask(reserved) => reserved,
                // nothing heard of the budget for a while: the watch may be behind the server
                Admission::Probe(budget) => {
                    tracing::debug!(pod = %p.key(), budget = %budget, "asking the server although the budget shows no allowance");
                    None
                }
                // the budget allows nothing now: no request until its status changes
                Admission::Wait(budget) => {
                    book.held(p, budget, now);
                    continue;
                }
            };
            let outcome = Box::pin(evict(&ctx.kube.client, p)).await;
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
            book.answer(p, outcome, reserved.as_deref(), now)?;
        }
        if !dispatched {
            dispatched = true;
            started = Instant::now();
        }
        let now_shown = (left.len() as u64, book.waiting(&left));
        if shown.as_ref() != Some(&now_shown) {
            ctx.events.send(EngineEvent::DrainProgress {
                task: task.clone(),
                pods_left: now_shown.0,
                waiting: now_shown.1.clone(),
            });
            shown = Some(now_shown);
        }
        // Something may undo the cordon meanwhile (design §1.6). The node watch shows it as it
        // happens; a read is needed only when the watch says so (at most once a second, while the
        // watch catches up with our own write) or has nothing on the node (every 3 s).
        let recheck_after = match ctx.pods.fenced(&node) {
            Some(true) => None,
            Some(false) => Some(Duration::from_secs(1)),
            None => Some(Duration::from_secs(3)),
        };
        if recheck_after.is_some_and(|after| last_cordon_check.elapsed() >= after) {
            last_cordon_check = Instant::now();
            match Box::pin(cordon_node(&nodes, &node, true)).await {
                Ok(o) if o.gone => return Ok(TaskOutcome::Done("node went away during the drain".into())),
                Ok(o) => {
                    if let Some(who) = o.reverted_by {
                        tracing::warn!(node = %node, field_manager = %who, "the cordon was reverted; re-asserted it");
                        ctx.note(
                            BlockerKind::FieldManager,
                            &who,
                            format!("uncordoned node {node} during the drain; re-asserted"),
                        );
                    }
                }
                Err(KubeError::Api { source, .. }) if k8s::is_transient(&source) => {}
                Err(e) => return Err(e.into()),
            }
        }
        tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
            _ = changes.changed() => {}
            _ = budget_changed.notified() => book.budget_changed(),
            _ = tokio::time::sleep(Duration::from_millis(1000)) => {}
        }
    }
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

/// How many times the check before a node's release drains pods bound to the node since its
/// drain before it gives up: each round is a whole drain, so only an actor that lifts the fence
/// again and again while pods wait for a place keeps it going.
const RELEASE_ROUNDS: usize = 5;

/// Drains, before a node is released, the pods bound to it since its drain: the scheduler places
/// pods on a node whenever something (a K3s agent, a remediation controller) lifts its fence, and
/// a pod still bound when the instance goes dies with it, its budget bypassed. The fence is put
/// back first, so that nothing new can be bound once the check finds the node empty; the check
/// lists the node's pods from the API server rather than from the watch, which may be a moment
/// behind. `None` when the node may go; otherwise the outcome the release stops with.
async fn drain_before_release(ctx: &Ctx, machine: &str, node: &str) -> Result<Option<TaskOutcome>, TaskError> {
    let nodes: Api<Node> = Api::all(ctx.kube.client.clone());
    let pods: Api<Pod> = Api::all(ctx.kube.client.clone());
    // the drain step's defaults, under the run's --drain-deadline and --on-drain-deadline
    let params = Params {
        deadline: None,
        on_deadline: OnDeadline::Fail,
        concurrency: std::num::NonZeroUsize::MIN,
        settle: Duration::ZERO,
    };
    let task = TaskRef { step: "release-check".into(), action: "drain", object: Some(machine.to_string()) };
    for _ in 0..RELEASE_ROUNDS {
        if ctx.cancel.is_cancelled() {
            return Ok(Some(TaskOutcome::Interrupted));
        }
        if Box::pin(cordon_node(&nodes, node, false)).await?.gone {
            return Ok(None);
        }
        let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let list =
            Box::pin(pods.list(&lp)).await.map_err(|e| KubeError::api(format!("list the pods on node {node}"), e))?;
        let bound = must_leave_before_release(&list.items, &ctx.abandoned.lock().unwrap_or_else(|p| p.into_inner()));
        if bound.is_empty() {
            return Ok(None);
        }
        ctx.note_rebound(node, bound.iter().map(|p| p.uid.as_str()));
        match Box::pin(drain(ctx, machine, &params, &task)).await? {
            TaskOutcome::Done(_) | TaskOutcome::Skipped(_) => {}
            TaskOutcome::Blocked(d) => {
                return Ok(Some(TaskOutcome::Blocked(format!(
                    "node {node} not released: pods were bound to it after its drain: {d}"
                ))));
            }
            other => return Ok(Some(other)),
        }
    }
    Ok(Some(TaskOutcome::Blocked(format!(
        "node {node} not released: pods were bound to it again after {RELEASE_ROUNDS} drains; something keeps lifting its fence (see the field managers in the report)"
    ))))
}

/// The pods among `on_node` that must leave before their node is released: those a drain moves
/// (not finished, not a DaemonSet's or a mirror, not tolerating the fence) and that no drain left
/// there by policy.
fn must_leave_before_release(on_node: &[Pod], abandoned: &HashSet<String>) -> Vec<PodRef> {
    on_node
        .iter()
        .filter(|p| !matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")))
        .filter_map(crate::k8s::pods::drainable)
        .filter(|p| p.rides_with_node.is_none() && !abandoned.contains(&p.uid))
        .collect()
}

/// What a drain has heard of each pod's eviction, and what it does next about each: the decisions
/// of [`drain`] without its requests, so that they can be tested without an API server.
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

async fn node_of(ctx: &Ctx, machine: &str) -> Result<Option<String>, KubeError> {
    if let Some(n) = machine.strip_prefix("node/") {
        return Ok(Some(n.to_string()));
    }
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &k8s::nodeclaim_resource());
    match api.get_opt(machine).await {
        Ok(Some(c)) => Ok(c.data.pointer("/status/nodeName").and_then(Value::as_str).map(str::to_string)),
        Ok(None) => Ok(None),
        Err(e) => Err(KubeError::api(format!("read NodeClaim {machine}"), e)),
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

// ---------------------------------------------------------------- remove controller

/// Makes Karpenter 1.0.x CRDs independent of the conversion webhook (served by the controller
/// about to go away), scales the controller to zero, waits for its pods to go, and scales it
/// down again (naming who) if something scaled it back meanwhile.
pub async fn remove_controller(ctx: &Ctx, params: &Params) -> Outcome {
    let mut detail = Vec::new();
    match drop_conversion_webhooks(&ctx.kube.client).await? {
        0 => {}
        n => detail.push(format!("conversion webhook removed from {n} Karpenter CRD(s)")),
    }
    let Some(controller) = find_controller(&ctx.kube.client).await? else {
        detail.push("no Karpenter controller Deployment found (already removed)".into());
        return Ok(TaskOutcome::Done(detail.join("; ")));
    };
    let deployments: Api<Deployment> = Api::namespaced(ctx.kube.client.clone(), &controller.namespace);
    let pods: Api<Pod> = Api::namespaced(ctx.kube.client.clone(), &controller.namespace);
    let deadline = Instant::now() + params.deadline.unwrap_or(Duration::from_secs(300));
    let mut scaled_once = false;
    loop {
        let dep = match deployments.get_opt(&controller.name).await {
            Ok(Some(d)) => d,
            Ok(None) => {
                detail.push(format!("Deployment {}/{} is gone", controller.namespace, controller.name));
                ctx.controller_seen_gone();
                return Ok(TaskOutcome::Done(detail.join("; ")));
            }
            Err(e) => return Err(KubeError::api("read the Karpenter Deployment", e).into()),
        };
        let replicas = dep.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        if replicas > 0 {
            if scaled_once {
                let managed = serde_json::to_value(&dep.metadata.managed_fields).unwrap_or(Value::Null);
                let who = last_manager_in(&managed, &["spec", "replicas"]).unwrap_or_else(|| "unknown".into());
                tracing::warn!(field_manager = %who, replicas, "the Karpenter controller was scaled back up; scaling it down again");
                ctx.note(
                    BlockerKind::FieldManager,
                    &who,
                    format!("scaled {}/{} back to {replicas}", controller.namespace, controller.name),
                );
            }
            let patch = json!({"spec": {"replicas": 0}});
            if let Err(e) = deployments.patch_scale(&controller.name, &patch_params(), &Patch::Merge(&patch)).await
                && status_code(&e) != Some(404)
            {
                return Err(KubeError::api("scale the Karpenter controller to zero", e).into());
            }
            scaled_once = true;
            detail.push(format!("scaled {}/{} from {replicas} to 0", controller.namespace, controller.name));
        }
        let selector = dep
            .spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.as_ref())
            .map(|m| m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","))
            .unwrap_or_else(|| "app.kubernetes.io/name=karpenter".into());
        let running = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| KubeError::api("list the Karpenter controller's pods", e))?
            .items
            .len();
        if running == 0 && replicas == 0 {
            ctx.controller_seen_gone();
            return Ok(TaskOutcome::Done(detail.join("; ")));
        }
        if Instant::now() >= deadline {
            return Ok(TaskOutcome::Failed(format!(
                "the Karpenter controller still has {running} pod(s) after {}",
                humantime::format_duration(params.deadline.unwrap_or_default())
            )));
        }
        if !pause(ctx, Duration::from_millis(500)).await {
            return Ok(TaskOutcome::Interrupted);
        }
    }
}

/// Karpenter 1.0.x CRDs route conversion through the controller's webhook; with the controller
/// gone any request needing conversion fails and the objects become unreachable. Only v1 is
/// stored and used from here on, so conversion `None` is safe (Karpenter 1.1 does the same).
pub async fn drop_conversion_webhooks(client: &kube::Client) -> Result<usize, KubeError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut changed = 0;
    for name in ["nodepools.karpenter.sh", "nodeclaims.karpenter.sh", "ec2nodeclasses.karpenter.k8s.aws"] {
        let crd = match crds.get_opt(name).await {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => return Err(KubeError::api(format!("read CRD {name}"), e)),
        };
        let webhook = crd.spec.conversion.as_ref().is_some_and(|c| c.strategy == "Webhook");
        if !webhook {
            continue;
        }
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": crd.metadata.resource_version},
            {"op": "replace", "path": "/spec/conversion", "value": {"strategy": "None"}},
        ]))
        .map_err(|e| KubeError::api("build the CRD patch", kube::Error::SerdeError(e)))?;
        match crds.patch(name, &patch_params(), &Patch::<()>::Json(patch)).await {
            Ok(_) => changed += 1,
            // changed meanwhile: the next run (or the verify step) sees the new state
            Err(e) if matches!(status_code(&e), Some(404 | 409 | 422)) => {}
            Err(e) => return Err(KubeError::api(format!("remove the conversion webhook of CRD {name}"), e)),
        }
    }
    Ok(changed)
}

// ---------------------------------------------------------------- finalizers

/// Does what `karpenter.sh/termination` guards for one machine: terminate its instance, confirm
/// `terminated` through EC2, then delete the Node and NodeClaim and remove exactly that
/// finalizer from each. Never strips a finalizer before the instance is gone.
pub async fn discharge_finalizers(ctx: &Ctx, machine: &str, params: &Params) -> Outcome {
    let claims: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &k8s::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(ctx.kube.client.clone());
    let (claim_name, mut node_name) = match machine.strip_prefix("node/") {
        Some(n) => (None, Some(n.to_string())),
        None => (Some(machine.to_string()), None),
    };
    let mut provider: Option<ProviderId> = None;
    let mut claim_exists = false;
    if let Some(c) = &claim_name {
        match claims.get_opt(c).await {
            Ok(Some(obj)) => {
                claim_exists = true;
                provider = obj
                    .data
                    .pointer("/status/providerID")
                    .and_then(Value::as_str)
                    .and_then(|p| ProviderId::parse(p).ok());
                node_name = node_name
                    .or_else(|| obj.data.pointer("/status/nodeName").and_then(Value::as_str).map(str::to_string));
            }
            Ok(None) => {}
            Err(e) => return Err(KubeError::api(format!("read NodeClaim {c}"), e).into()),
        }
    }
    if let Some(n) = &node_name {
        match nodes.get_opt(n).await {
            Ok(Some(node)) => {
                if provider.is_none() {
                    provider = node
                        .spec
                        .as_ref()
                        .and_then(|s| s.provider_id.as_deref())
                        .and_then(|p| ProviderId::parse(p).ok());
                }
            }
            Ok(None) => node_name = None,
            Err(e) => return Err(KubeError::api(format!("read Node {n}"), e).into()),
        }
    }
    if provider.is_none() && node_name.is_none() && !claim_exists {
        // Karpenter (or an earlier run) finished this machine: nothing is left to guard
        return Ok(TaskOutcome::Skipped("already gone".into()));
    }
    // A node goes only with no pod on it that a drain must move, however often its fence was
    // lifted since its drain.
    if let Some(n) = &node_name
        && let Some(stop) = Box::pin(drain_before_release(ctx, machine, n)).await?
    {
        return Ok(stop);
    }
    let mut what = Vec::new();
    if let Some(p) = &provider {
        if let Err(e) = ctx.ec2.terminate(&p.instance_id).await {
            return Ok(batch_failure(format!("terminate instance {}: {e}", p.instance_id), &e));
        }
        let limit = params.deadline.unwrap_or(Duration::from_secs(600));
        tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
            r = tokio::time::timeout(limit, ctx.ec2.wait_terminated(&p.instance_id)) => match r {
                Ok(Ok(())) => what.push(format!("instance {} terminated", p.instance_id)),
                Ok(Err(e)) => return Ok(batch_failure(format!("confirm termination of {}: {e}", p.instance_id), &e)),
                Err(_) => return Ok(TaskOutcome::Failed(format!("instance {} not terminated after {}", p.instance_id, humantime::format_duration(limit)))),
            },
        }
    } else {
        what.push("no instance (never launched)".into());
    }
    // The instance is gone: now, and only now, the objects may go.
    if let Some(n) = &node_name {
        delete_if_present(&nodes, n).await?;
        remove_finalizer(&nodes, n, karpenter::FINALIZER_TERMINATION).await?;
        what.push(format!("Node {n} released"));
    }
    if let Some(c) = &claim_name {
        delete_if_present(&claims, c).await?;
        remove_finalizer(&claims, c, karpenter::FINALIZER_TERMINATION).await?;
        what.push(format!("NodeClaim {c} released"));
    }
    Ok(TaskOutcome::Done(what.join("; ")))
}

// ---------------------------------------------------------------- pools, classes, waits

/// Deletes one NodePool, or all of them.
pub async fn delete_nodepools(ctx: &Ctx, object: Option<&str>) -> Outcome {
    let ar = k8s::nodepool_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    let names = match object {
        Some(o) => vec![o.to_string()],
        None => list_dynamic(&ctx.kube.client, &ar).await?.into_iter().filter_map(|o| o.metadata.name).collect(),
    };
    let mut deleted = 0;
    for n in &names {
        if delete_if_present(&api, n).await? {
            deleted += 1;
        }
    }
    Ok(TaskOutcome::Done(format!("{deleted} NodePool(s) deleted")))
}

/// Waits until no NodeClaim is left (Karpenter doing the work), up to the deadline; then
/// either fails or lets the later steps do what is left.
pub async fn wait_nodeclaims_gone(ctx: &Ctx, params: &Params) -> Outcome {
    let limit = params.deadline.unwrap_or(Duration::from_secs(900));
    let start = Instant::now();
    loop {
        let left = match list_dynamic(&ctx.kube.client, &k8s::nodeclaim_resource()).await {
            Ok(l) => l.len(),
            // a passing error must not restart the wait (and its deadline): look again shortly
            Err(KubeError::Api { source, .. }) if k8s::is_transient(&source) => {
                if !pause(ctx, Duration::from_millis(500)).await {
                    return Ok(TaskOutcome::Interrupted);
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if left == 0 {
            return Ok(TaskOutcome::Done(format!(
                "Karpenter removed every NodeClaim in {:.1}s",
                start.elapsed().as_secs_f64()
            )));
        }
        if start.elapsed() >= limit {
            let msg = format!("{left} NodeClaim(s) left after {}", humantime::format_duration(limit));
            return Ok(match params.on_deadline {
                OnDeadline::Fail => TaskOutcome::Blocked(msg),
                _ => TaskOutcome::Done(format!("{msg}; the next steps take over")),
            });
        }
        if !pause(ctx, Duration::from_secs(1)).await {
            return Ok(TaskOutcome::Interrupted);
        }
    }
}

/// Deletes one EC2NodeClass (or all): waits until no NodeClaim references it, deletes its
/// launch templates and instance profiles, then removes `karpenter.k8s.aws/termination`.
pub async fn delete_nodeclasses(ctx: &Ctx, object: Option<&str>, params: &Params) -> Outcome {
    let ar = k8s::nodeclass_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    let classes = list_dynamic(&ctx.kube.client, &ar)
        .await?
        .into_iter()
        .filter(|c| object.is_none_or(|o| c.metadata.name.as_deref() == Some(o)))
        .collect::<Vec<_>>();
    let limit = params.deadline.unwrap_or(Duration::from_secs(300));
    let mut done = Vec::new();
    let mut swept: BTreeSet<String> = BTreeSet::new();
    for class in classes {
        let name = class.metadata.name.clone().unwrap_or_default();
        let start = Instant::now();
        loop {
            let inv = Inventory::read(&ctx.kube.client).await?;
            let users: Vec<&Machine> = inv
                .machines
                .values()
                .filter(|m| m.nodeclaim.is_some() && m.nodeclass.as_deref() == Some(&name))
                .collect();
            if users.is_empty() {
                break;
            }
            for m in users.iter().filter(|m| !ctx.inventoried.contains(&m.name)) {
                if swept.insert(m.name.clone()) {
                    match sweep_machine(ctx, &m.name).await? {
                        TaskOutcome::Done(_) | TaskOutcome::Skipped(_) => {}
                        other => return Ok(other),
                    }
                }
            }
            let users = users.len();
            if start.elapsed() >= limit {
                return Ok(TaskOutcome::Failed(format!("EC2NodeClass {name} is still used by {users} NodeClaim(s)")));
            }
            if !pause(ctx, Duration::from_secs(1)).await {
                return Ok(TaskOutcome::Interrupted);
            }
        }
        delete_if_present(&api, &name).await?;
        let uid = class.metadata.uid.clone().unwrap_or_default();
        // A class with spec.instanceProfile runs on a profile the user manages: status names it
        // too, and Karpenter never deletes it, so neither does the tool.
        let user_managed = class.data.pointer("/spec/instanceProfile").and_then(Value::as_str).is_some();
        let status_profile = class.data.pointer("/status/instanceProfile").and_then(Value::as_str).map(str::to_string);
        let lts = ctx.aws.ec2.launch_templates(&ctx.cluster).await?;
        let mut removed = 0;
        for lt in lts.iter().filter(|l| l.nodeclass.as_deref() == Some(&name)) {
            ctx.aws.ec2.delete_launch_template(&lt.id).await?;
            removed += 1;
        }
        let profiles = ctx.aws.iam.cluster_instance_profiles(&ctx.region, &ctx.cluster).await?;
        let of_this_class = |p: &&crate::aws::InstanceProfileInfo| {
            !user_managed
                && !ctx.user_instance_profiles.contains(&p.name)
                && (p.nodeclass == name
                    || (!uid.is_empty() && p.path.contains(&uid))
                    || status_profile.as_deref() == Some(&p.name))
        };
        for p in profiles.iter().filter(of_this_class) {
            ctx.aws.iam.delete_instance_profile(p).await?;
            removed += 1;
        }
        remove_finalizer(&api, &name, karpenter::FINALIZER_NODECLASS).await?;
        done.push(format!("{name} ({removed} launch template(s)/instance profile(s))"));
    }
    Ok(TaskOutcome::Done(format!("EC2NodeClass(es) deleted: {}", done.join(", "))))
}

/// A NodeClaim that appeared after the inventory (launched by a controller that was not fenced,
/// or was still finishing a launch when it was removed): no task of the graph knows it, and its
/// EC2NodeClass cannot go while it exists. It gets what every inventoried machine got: a drain
/// with the default policy (PDBs respected, `--drain-deadline` / `--on-drain-deadline` apply),
/// then its instance terminated and confirmed before its finalizers are released.
async fn sweep_machine(ctx: &Ctx, machine: &str) -> Outcome {
    tracing::warn!(nodeclaim = %machine, "a NodeClaim launched during the run: draining and terminating it too");
    ctx.note(
        BlockerKind::Nodeclaim,
        machine,
        "launched during the run (not in the inventory): a controller that was not fenced chased the drain; drained and terminated it too",
    );
    let params = Params {
        deadline: None,
        on_deadline: OnDeadline::Fail,
        concurrency: std::num::NonZeroUsize::MIN,
        settle: Duration::ZERO,
    };
    // shown as a drain of its own: it is not a task of the graph
    let task = TaskRef { step: "sweep".into(), action: "drain", object: Some(machine.to_string()) };
    // An error is taken as its outcome here rather than propagated, so that a failure names the
    // NodeClaim that no task of the graph knows.
    match drain(ctx, machine, &params, &task).await.unwrap_or_else(TaskOutcome::from) {
        TaskOutcome::Done(_) | TaskOutcome::Skipped(_) => {}
        TaskOutcome::Blocked(d) => {
            return Ok(TaskOutcome::Blocked(format!("NodeClaim {machine} launched during the run: {d}")));
        }
        TaskOutcome::Failed(d) => {
            return Ok(TaskOutcome::Failed(format!("NodeClaim {machine} launched during the run: {d}")));
        }
        other => return Ok(other),
    }
    Ok(match discharge_finalizers(ctx, machine, &params).await.unwrap_or_else(TaskOutcome::from) {
        TaskOutcome::Failed(d) => TaskOutcome::Failed(format!("NodeClaim {machine} launched during the run: {d}")),
        other => other,
    })
}

// ---------------------------------------------------------------- verify

/// Proves through EC2 (two reads, the second `settle` after the controller was seen gone or after
/// the first) and the API that nothing is left; reclaims the AWS leftovers when asked and
/// verifies again.
pub async fn verify_step(ctx: &Ctx, params: &Params) -> Outcome {
    let quiet_since = *ctx.controller_gone_at.lock().unwrap_or_else(|p| p.into_inner());
    let mut left =
        verify::verify(&ctx.aws, &ctx.cluster, &ctx.user_instance_profiles, params.settle, quiet_since).await?;
    if !left.is_clean() && ctx.reclaim {
        ctx.reclaimed.lock().unwrap_or_else(|p| p.into_inner()).extend(left.describe());
        for f in verify::reclaim(&ctx.aws, &left).await? {
            ctx.note(BlockerKind::Reclaim, &f, "could not be reclaimed");
        }
        // what was just terminated must have had its time to show, whatever the controller did
        left = verify::verify(&ctx.aws, &ctx.cluster, &ctx.user_instance_profiles, params.settle, None).await?;
    }
    left.objects = Inventory::read(&ctx.kube.client).await?.object_names();
    let clean = left.is_clean();
    let lines = left.describe();
    *ctx.leftovers.lock().unwrap_or_else(|p| p.into_inner()) = Some(left);
    Ok(if clean { TaskOutcome::Done("nothing left".into()) } else { TaskOutcome::Leftovers(lines.join("; ")) })
}

#[cfg(test)]
mod tests {
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
mod future_sizes {
    use super::*;
    use crate::plan::TaskNode;

    /// The size of the future `f` returns for arguments `A`, without calling it.
    fn size<A, F: Future>(_: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every machine's drain is in flight at once, each in a task that holds its future from
    /// the moment it is spawned: at 5,000 machines a task of 7 KB (its state sized for the
    /// largest action and the largest request) cost 35 MB of the tool's peak (issue 19).
    #[test]
    fn a_drain_task_stays_small_while_it_waits() {
        // the lifetimes do not change a future's size; 'static names them without values
        let task =
            size::<(&'static Ctx, &'static TaskNode), _>(|(ctx, node)| crate::engine::run_with_retries(ctx, node));
        let drain = size::<(&'static Ctx, &'static str, &'static Params, &'static TaskRef), _>(
            |(ctx, machine, params, task)| drain(ctx, machine, params, task),
        );
        assert!(task <= 1024, "a task's future is {task} bytes: box the action it awaits");
        assert!(drain <= 2048, "a drain's future is {drain} bytes: box the request it awaits");
    }
}
