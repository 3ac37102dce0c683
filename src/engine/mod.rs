//! The engine: reads the live inventory, proves identity, expands the plan into a task graph
//! (petgraph) and runs ready tasks concurrently, bounded per step, until the graph is done, a
//! task blocks or fails, or the user interrupts. Every task runs in a span naming its object;
//! what it did becomes a record of the report.

pub mod actions;
mod admission;
pub mod batcher;
pub mod budgets;
pub mod context;
pub mod drain;
pub mod events;
mod gate;
pub mod inventory;
mod machine_node;
pub mod permissions;
mod phases;
pub mod podindex;
pub mod preflight;
mod record;
pub(crate) mod refusal;
mod release;
pub mod task;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use self::context::{Ctx, DrainOverrides};
use self::events::{EngineEvent, TaskRef};
use self::inventory::Inventory;
use self::phases::{Ended, Learnt, Phase, Stop};
use self::refusal::Refusal;
use self::task::TaskOutcome;
use crate::aws::AwsClients;
use crate::config::DrainPolicy;
use crate::exit::Exit;
use crate::gitops::{GitopsConsent, Survey};
use crate::k8s::Kube;
use crate::plan::{Action, Plan, ReadyTracker, TaskGraph, TaskId, TaskNode};
use crate::report::{Blocker, BlockerKind, StepRecord, TaskResult, rfc3339};
use crate::verify::Leftovers;

/// What a run needs beyond the clients.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// Cluster name.
    pub cluster: String,
    /// Region.
    pub region: String,
    /// `--account`.
    pub account: Option<String>,
    /// The plan.
    pub plan: Plan,
    /// Dry run (no `--yes`).
    pub dry_run: bool,
    /// Drain overrides from the command line.
    pub drain: DrainOverrides,
    /// `--max-nodes`.
    pub max_nodes: Option<u32>,
    /// `--reclaim`.
    pub reclaim: bool,
    /// `--pause-gitops`, `--gitops-paused-elsewhere`.
    pub gitops: GitopsConsent,
    /// `--release`: what the cleanup controllers hold that is deleted before the drain.
    pub release: std::collections::BTreeSet<crate::cleanup::Release>,
    /// `--assume-stopped`: the cleanup controllers taken as not running when none of their pods
    /// is found.
    pub assume_stopped: std::collections::BTreeSet<crate::cleanup::Cleaner>,
}

/// What a run produced, for the report and the exit code.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// The exit status.
    pub exit: Exit,
    /// Every task that ran.
    pub steps: Vec<StepRecord>,
    /// What blocked or fought the run.
    pub blockers: Vec<Blocker>,
    /// What verification found.
    pub leftovers: Leftovers,
    /// What `--reclaim` removed.
    pub reclaimed: Vec<String>,
    /// Pods found bound to a node after its drain began, each drained too.
    pub pods_rebound: u64,
    /// Pods that went down with their node (bound after it was checked empty).
    pub pods_lost: u64,
    /// Pods let go without an eviction (drain policies `skip` and `delete`, pods that go with
    /// their node).
    pub bypasses: Vec<crate::report::Bypass>,
    /// The error or refusal, if any.
    pub error: Option<String>,
    /// The concrete plan, for a dry run (and the log of a real one).
    pub plan_text: String,
    /// The GitOps owners of the Karpenter objects, and what the run did with them.
    pub gitops: Survey,
    /// Karpenter-kind objects that are not this cluster's self-managed Karpenter's, left alone.
    pub not_ours: Vec<crate::karpenter::Foreign>,
}

/// A refusal decided before the first write, with the blockers that explain it.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) refusal: Refusal,
    pub(crate) blockers: Vec<Blocker>,
}

/// Sends a dry run of each kind of write the plan makes through the API server's admission
/// chain and reads the webhooks the drain would strand; a write that would be refused is the
/// run's refusal (exit 2), each refusal a blocker. `rehearse` asks the live cluster the same.
pub(crate) async fn admission_verdict(
    client: &kube::Client,
    need: &std::collections::BTreeSet<permissions::KubePermission>,
    inv: &Inventory,
    pausing: Option<admission::Pausing<'_>>,
    plan_text: &mut String,
) -> Result<Option<Refused>, crate::k8s::KubeError> {
    let started = Instant::now();
    let findings = admission::check(client, inv, need, pausing).await?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        dry_runs = findings.dry_runs,
        refused = findings.blocked.len(),
        unchecked = findings.unchecked.len(),
        "admission checked before any change"
    );
    Ok(refused_by_admission(&findings, plan_text))
}

/// The refusal, if any, of what the admission chain's dry runs found; what they could not check
/// goes to the plan's text.
pub(crate) fn refused_by_admission(findings: &admission::Findings, plan_text: &mut String) -> Option<Refused> {
    for u in &findings.unchecked {
        plan_text.push_str(&format!("admission not checked before the run: {u}\n"));
    }
    if findings.blocked.is_empty() {
        return None;
    }
    let blockers = findings
        .blocked
        .iter()
        .map(|b| Blocker { kind: BlockerKind::Admission, name: b.who.clone(), reason: b.to_string() })
        .collect();
    let refusal = Refusal::Admission { blocked: findings.blocked.iter().map(ToString::to_string).collect() };
    Some(Refused { refusal, blockers })
}

/// What the survey of the cleanup controllers decided for a run.
#[derive(Debug, Default)]
pub(crate) struct CleanupVerdict {
    /// Why the run may not go on, if so.
    pub(crate) refused: Option<Refused>,
    /// What `--release` deletes (the Load Balancer Controller's objects) or waits for (the EBS
    /// CSI controller's PVs and attachments) before the drain.
    pub(crate) release: Vec<crate::cleanup::Held>,
    /// How `--release volumes` releases the PVs in `release`.
    pub(crate) volume_release: crate::cleanup::VolumeRelease,
    /// The EBS volumes of the cluster's PersistentVolumes, by id, each with its PV's name.
    pub(crate) volumes: std::collections::BTreeMap<String, String>,
}

/// Finds the controllers that clean up in AWS behind finalizers (load balancers, volumes) and
/// still hold objects: one the drain would leave nowhere to run is the run's refusal (exit 3),
/// one blocker per object it holds, unless `release` covers it (its objects are then deleted
/// before the drain, while it runs: it must run now). `rehearse` asks the live cluster the same.
pub(crate) async fn cleanup_verdict(
    client: &kube::Client,
    plan: &Plan,
    inv: &Inventory,
    release: &std::collections::BTreeSet<crate::cleanup::Release>,
    assume_stopped: &std::collections::BTreeSet<crate::cleanup::Cleaner>,
    plan_text: &mut String,
) -> Result<CleanupVerdict, crate::k8s::KubeError> {
    if !plan.steps().iter().any(|s| permissions::drains(s.action)) {
        return Ok(CleanupVerdict::default());
    }
    let karpenter_nodes = inv.karpenter_nodes();
    let seen = crate::k8s::retry_transient(|| crate::k8s::cleanup::read(client, &karpenter_nodes)).await?;
    let nodes: Vec<String> = karpenter_nodes.into_iter().collect();
    let verdicts = crate::cleanup::survey(&seen.held, &seen.running, &nodes, &seen.other_nodes, &seen.requested);
    let covered = |c: crate::cleanup::Cleaner| crate::cleanup::Release::consent(release, c).is_some();
    let mut out = CleanupVerdict { volumes: seen.volumes, ..CleanupVerdict::default() };
    let mut idle = Vec::new();
    let mut unreleasable: Vec<(String, String)> = Vec::new();
    for v in &verdicts {
        plan_text.push_str(&v.plan_line());
        plan_text.push('\n');
        if !covered(v.cleaner) {
            continue;
        }
        if v.runs.is_empty() {
            idle.push(v);
            continue;
        }
        if !crate::cleanup::Release::releases(release, v) {
            // it deletes in AWS by itself after the drain, whenever its objects go
            plan_text.push_str(&v.not_released_line());
            plan_text.push('\n');
            continue;
        }
        if v.cleaner == crate::cleanup::Cleaner::EbsCsi {
            let claims = seen.facts.claims.values().flatten().cloned().collect();
            let users = crate::k8s::retry_transient(|| crate::k8s::cleanup::claim_users(client, &claims)).await?;
            let (mut plan, refused) = crate::cleanup::plan_volume_release(&v.held, &seen.facts, &users, v.stranded);
            unreleasable.extend(refused);
            for sts in &plan.statefulsets {
                plan_text.push_str(&format!(
                    "release: scale StatefulSet {sts} to zero (its pods mount claims released below; it would make them again)\n"
                ));
            }
            for (pv, id) in &plan.volumes {
                let claim = seen.facts.claims.get(pv).cloned().flatten().unwrap_or_default();
                plan_text.push_str(&format!(
                    "release: delete PersistentVolumeClaim {claim} while {} runs, and wait until PersistentVolume {pv} and EBS volume {id} are gone\n",
                    v.cleaner
                ));
            }
            out.release.append(&mut plan.held);
            out.volume_release = plan;
            continue;
        }
        for h in &v.held {
            plan_text.push_str(&format!(
                "release: delete {} {} while {} runs, and wait until it and what it stands for in AWS are gone\n",
                h.kind, h.name, v.cleaner
            ));
        }
        out.release.extend(v.held.iter().cloned());
    }
    if !unreleasable.is_empty() {
        let blockers = unreleasable
            .iter()
            .map(|(name, reason)| Blocker { kind: BlockerKind::Release, name: name.clone(), reason: reason.clone() })
            .collect();
        let objects = unreleasable.iter().map(|(name, reason)| format!("{name}: {reason}")).collect();
        out.refused = Some(Refused { refusal: Refusal::VolumesInUse { objects }, blockers });
        return Ok(out);
    }
    if !idle.is_empty() {
        let objects: Vec<String> = idle
            .iter()
            .flat_map(|v| v.held.iter().map(move |h| (v.cleaner, h)))
            .map(|(c, h)| {
                format!("{} {} ({}): no pod of {c} runs, so nothing would delete it", h.kind, h.name, h.hold())
            })
            .collect();
        let blockers = idle
            .iter()
            .flat_map(|v| v.held.iter().map(move |h| (v.cleaner, h)))
            .map(|(c, h)| Blocker {
                kind: BlockerKind::Release,
                name: h.object(),
                reason: format!("held by {} until {c} deletes what it made in AWS, and no pod of {c} runs", h.hold()),
            })
            .collect();
        out.refused = Some(Refused { refusal: Refusal::Unreleasable { objects }, blockers });
        return Ok(out);
    }
    // a controller that holds objects and of which no pod is found may run anywhere, Karpenter's
    // nodes included: no evidence that the drain leaves it a place is no verdict
    let unplaced: Vec<&crate::cleanup::Verdict> =
        verdicts.iter().filter(|v| v.unplaced && !covered(v.cleaner) && !assume_stopped.contains(&v.cleaner)).collect();
    if !unplaced.is_empty() {
        let blockers = unplaced
            .iter()
            .flat_map(|v| v.held.iter().map(move |h| (v.cleaner, h)))
            .map(|(c, h)| Blocker {
                kind: BlockerKind::Stranded,
                name: h.object(),
                reason: format!("held by {} until {c} deletes what it made in AWS; no pod of {c} was found", h.hold()),
            })
            .collect();
        let refusal = Refusal::Unplaced {
            cleaners: unplaced.iter().map(|v| (v.cleaner.to_string(), v.cleaner.flag().to_string())).collect(),
            objects: unplaced
                .iter()
                .flat_map(|v| v.held.iter().map(|h| format!("{} {} ({})", h.kind, h.name, h.hold())))
                .collect(),
        };
        out.refused = Some(Refused { refusal, blockers });
        return Ok(out);
    }
    let stranded: Vec<&crate::cleanup::Verdict> =
        verdicts.iter().filter(|v| v.stranded && !covered(v.cleaner)).collect();
    if stranded.is_empty() {
        return Ok(out);
    }
    let blockers: Vec<Blocker> = stranded
        .iter()
        .flat_map(|v| v.blockers())
        .map(|(name, reason)| Blocker { kind: BlockerKind::Stranded, name, reason })
        .collect();
    let refusal = Refusal::Stranded {
        cleaners: stranded.iter().map(|v| format!("{} ({})", v.cleaner, v.runs.join(", "))).collect(),
        objects: stranded
            .iter()
            .flat_map(|v| v.held.iter().map(|h| format!("{} {} ({})", h.kind, h.name, h.hold())))
            .collect(),
    };
    out.refused = Some(Refused { refusal, blockers });
    Ok(out)
}

/// The load balancers of what `release` deletes that have deletion protection on, by the
/// object's annotation or by the load balancer's attribute in AWS: each is a refusal (exit 3),
/// consent or not. The controller would keep its finalizer (annotation) or switch protection
/// off (attribute alone); the tool does neither for the user.
pub(crate) async fn protected(
    aws: &AwsClients,
    cluster: &str,
    release: &[crate::cleanup::Held],
) -> Result<Option<Refused>, crate::aws::AwsError> {
    if release.is_empty() {
        return Ok(None);
    }
    let found = crate::verify::load_balancing(aws, cluster).await?;
    let mut blockers = Vec::new();
    for h in release {
        let stack = crate::cleanup::stack_of(h);
        let mut why = Vec::new();
        if h.protected {
            why.push("its annotation turns deletion protection on".to_string());
        }
        for lb in
            found.iter().filter(|l| l.kind == crate::aws::LbKind::LoadBalancer && Some(&l.made_for) == stack.as_ref())
        {
            if aws.elb.deletion_protection(&lb.id).await? {
                why.push(format!("load balancer {} has deletion protection on in AWS", lb.name));
            }
        }
        if !why.is_empty() {
            blockers.push(Blocker {
                kind: BlockerKind::Release,
                name: h.object(),
                reason: format!("{}: deleting it would leave it held by {} for ever", why.join("; "), h.hold()),
            });
        }
    }
    if blockers.is_empty() {
        return Ok(None);
    }
    let objects = blockers.iter().map(|b| format!("{} ({})", b.name, b.reason)).collect();
    Ok(Some(Refused { refusal: Refusal::Protected { objects }, blockers }))
}

/// Runs a teardown: the phases that only read ([`phases::prepare`]), then, with consent, the
/// GitOps pause and the task graph. A run that stops before its first write changes nothing;
/// `cancel` is the Ctrl-C / SIGTERM signal.
pub async fn run(
    kube: Kube,
    aws: AwsClients,
    settings: RunSettings,
    cancel: CancellationToken,
    events: events::Events,
) -> RunResult {
    // The reads before the first write are timed in the log: at thousands of nodes they are
    // minutes, and which of them is slow tells a user whether to look at the API server or EC2.
    let started = Instant::now();
    let mut learnt = Learnt::default();
    let ended = match phases::prepare(&kube, &aws, &settings, &mut learnt).await {
        Err((phase, stop)) => Ended::Stopped { phase, stop },
        Ok(_) if settings.dry_run => Ended::DryRun,
        // interrupted during the checks: nothing more is written, and the 1.0.x CRD repair the
        // reads needed is put back
        Ok(prepared) if cancel.is_cancelled() => {
            let stop = Stop {
                exit: Exit::Interrupted,
                error: "interrupted before the first write".into(),
                blockers: Vec::new(),
            };
            Ended::Stopped { phase: Phase::Inventory, stop: phases::put_back(&kube, &prepared.dropped, stop).await }
        }
        Ok(prepared) => {
            let launch = Launch { kube, aws, settings: &settings, started, cancel, events };
            launch.run(prepared, &mut learnt).await
        }
    };
    phases::conclude(ended, learnt)
}

/// What the phases that write need beyond what the phases that read prepared.
struct Launch<'a> {
    kube: Kube,
    aws: AwsClients,
    settings: &'a RunSettings,
    started: Instant,
    cancel: CancellationToken,
    events: events::Events,
}

impl Launch<'_> {
    /// Pauses the GitOps owners, then runs the task graph with its watches and batcher.
    async fn run(self, prepared: phases::Prepared, learnt: &mut Learnt) -> Ended {
        let Launch { kube, aws, settings, started, cancel, events } = self;
        let phases::Prepared { inv, graph, owners, release, volume_release, volumes, dropped } = prepared;
        // owners already paused count too: a sync or reconcile they started may still be applying
        if !learnt.gitops.owners.is_empty() {
            let (record, stop) = pause_gitops(&kube, &owners, &mut learnt.gitops).await;
            learnt.steps.push(record);
            if let Some(stop) = stop {
                let stop = phases::put_back(&kube, &dropped, stop).await;
                return Ended::Stopped { phase: Phase::PauseGitops, stop };
            }
        }
        // before the fence and the drain: the controllers that delete in AWS must still run
        if !release.is_empty() {
            let deadline = settings
                .drain
                .deadline
                .or_else(|| settings.plan.ordered_steps().find(|s| s.action == Action::Drain)?.params.deadline)
                .unwrap_or(Duration::from_secs(600));
            let (record, stop) =
                release::release(&kube, &aws, &settings.cluster, &release, &volume_release, deadline, &cancel).await;
            learnt.steps.push(record);
            if let Some(stop) = stop {
                let stop = phases::put_back(&kube, &dropped, stop).await;
                return Ended::Stopped { phase: Phase::Release, stop };
            }
        }
        tracing::info!(
            tasks = graph.task_count(),
            machines = inv.machines.len(),
            preflight_seconds = started.elapsed().as_secs_f64(),
            "starting the teardown"
        );
        events.send(EngineEvent::RunStarted {
            tasks: graph.task_count() as u64,
            steps: graph.summary().steps.into_iter().map(|s| (s.step, s.tasks as u64)).collect(),
        });

        let mut background = JoinSet::new();
        let (pods, pod_watch) = podindex::PodIndex::start(kube.client.clone());
        background.spawn(pod_watch.instrument(tracing::info_span!("pod-watch")));
        let (budgets, budget_watch) = budgets::Budgets::start(kube.client.clone());
        background.spawn(budget_watch.instrument(tracing::info_span!("pdb-watch")));
        let (ec2, batcher) = batcher::Ec2Batcher::start(aws.ec2.clone(), settings.cluster.clone());
        background.spawn(batcher.instrument(tracing::info_span!("ec2-batcher")));
        // The tasks report what they find as events; the run's record is a fold over them, which
        // passes each on to the caller's readers (the live view, the interrupt handler).
        let (task_events, mut task_rx) = events::Events::channel();
        let (flush, flushed) = tokio::sync::oneshot::channel::<()>();
        let readers = events.clone();
        let recorder = tokio::spawn(async move {
            let mut record = record::RunRecord::default();
            let pass = |ev: EngineEvent, record: &mut record::RunRecord| {
                if record.apply(&ev) {
                    readers.send(ev);
                }
            };
            tokio::pin!(flushed);
            loop {
                tokio::select! {
                    ev = task_rx.recv() => match ev {
                        Some(ev) => pass(ev, &mut record),
                        None => break,
                    },
                    _ = &mut flushed => {
                        // every task is over: what they sent is already queued
                        while let Ok(ev) = task_rx.try_recv() {
                            pass(ev, &mut record);
                        }
                        break;
                    }
                }
            }
            record
        });
        let ctx = Arc::new(Ctx {
            kube,
            aws,
            cluster: settings.cluster.clone(),
            region: settings.region.clone(),
            pods,
            budgets,
            ec2,
            evictions: gate::PriorityGate::new(crate::k8s::MAX_REQUESTS_IN_FLIGHT),
            drain: settings.drain,
            reclaim: settings.reclaim,
            inventoried: inv.machines.keys().cloned().collect(),
            late: Mutex::new(std::collections::BTreeSet::new()),
            foreign_pools: inv.foreign_pools(),
            user_instance_profiles: inv.user_instance_profiles.clone(),
            volumes,
            cancel,
            events: task_events,
            controller_gone_at: std::sync::OnceLock::new(),
            abandoned: Mutex::new(HashSet::new()),
            drain_clocks: Mutex::new(HashMap::new()),
        });

        let (exit, steps) = execute(graph, &settings.plan, ctx.clone()).await;
        background.shutdown().await;
        drop(ctx);
        let _ = flush.send(());
        // the recorder only ends by this signal or with its senders gone; a panic in it loses the
        // record, not the run's exit status
        let record = Box::new(recorder.await.unwrap_or_default());
        let verifies = settings.plan.steps().iter().any(|s| s.action == Action::Verify);
        Ended::Executed { exit, steps, record, verifies }
    }
}

/// How long the GitOps owners' work in flight (an Argo CD sync, a Flux reconcile) may take to
/// end once they are paused, all owners together.
const GITOPS_SETTLE_WAIT: Duration = Duration::from_secs(120);

/// Pauses every active GitOps owner, parents first, then waits until no owner found (paused by
/// the run or before it) has a sync or reconcile in flight; returns the step record and what
/// stops the run, if anything. Never resumed: the cluster is going away, and a resumed owner
/// would put everything back.
async fn pause_gitops(
    kube: &Kube,
    owners: &crate::k8s::gitops::Owners,
    survey: &mut Survey,
) -> (StepRecord, Option<Stop>) {
    use crate::k8s::gitops::{PauseOutcome, mark_paused, pause, wait_settled};
    let started = SystemTime::now();
    let active: Vec<crate::gitops::OwnerId> = survey.active().map(|f| f.owner.clone()).collect();
    let mut paused = Vec::new();
    let mut requests: BTreeMap<crate::gitops::OwnerId, String> = BTreeMap::new();
    let mut stop = None;
    for id in &active {
        let span = tracing::info_span!("task", step = "pause-gitops", object = %id);
        match crate::k8s::retry_transient(|| pause(&kube.client, owners, id)).instrument(span).await {
            Ok(PauseOutcome::Paused { request }) => {
                tracing::warn!(owner = %id, "paused a GitOps owner; it is not resumed (the cluster is going away)");
                mark_paused(&mut survey.owners, id);
                paused.push(id.to_string());
                if let Some(r) = request {
                    requests.insert(id.clone(), r);
                }
            }
            Ok(o) => tracing::info!(owner = %id, outcome = ?o, "GitOps owner needed no pause"),
            Err(e) => {
                stop = Some(Stop {
                    exit: Exit::Failure,
                    error: format!("pause-gitops: {e}. The owners paused so far stay paused: {}", paused.join(", ")),
                    blockers: Vec::new(),
                });
                break;
            }
        }
    }
    let mut waited = Vec::new();
    if stop.is_none() {
        let deadline = tokio::time::Instant::now() + GITOPS_SETTLE_WAIT;
        let mut unsettled = Vec::new();
        let ids: Vec<crate::gitops::OwnerId> = survey.owners.iter().map(|f| f.owner.clone()).collect();
        for id in &ids {
            let request = requests.get(id).map(String::as_str);
            let span = tracing::info_span!("task", step = "pause-gitops", object = %id);
            let first = Instant::now();
            let settled = crate::k8s::retry_transient(|| wait_settled(&kube.client, owners, id, request, deadline));
            match settled.instrument(span).await {
                // a poll or two is the controller's ordinary latency, not work worth naming
                Ok(None) if first.elapsed() >= Duration::from_secs(1) => {
                    waited.push(format!("{id} ({:.0}s)", first.elapsed().as_secs_f64()));
                }
                Ok(None) => {}
                Ok(Some(busy)) => unsettled.push((id.clone(), busy)),
                Err(e) => {
                    stop = Some(Stop {
                        exit: Exit::Failure,
                        error: format!(
                            "pause-gitops: {e}. The owners paused so far stay paused: {}",
                            paused.join(", ")
                        ),
                        blockers: Vec::new(),
                    });
                    break;
                }
            }
        }
        if stop.is_none() && !unsettled.is_empty() {
            let list: Vec<String> = unsettled.iter().map(|(id, busy)| format!("{id}: {busy}")).collect();
            stop = Some(Stop {
                exit: Exit::Blocked,
                error: format!(
                    "pause-gitops: still in flight after {}s, and it would apply the Karpenter objects as Git has \
                     them: {}. Let it end (Argo CD: argocd app wait, or argocd app terminate-op; Flux: check that its \
                     controller runs), then run again. Nothing else was changed; the owners paused so far stay paused: \
                     {}",
                    GITOPS_SETTLE_WAIT.as_secs(),
                    list.join("; "),
                    if paused.is_empty() { "none".to_string() } else { paused.join(", ") }
                ),
                blockers: unsettled
                    .into_iter()
                    .map(|(id, busy)| Blocker {
                        kind: BlockerKind::GitopsOwner,
                        name: format!("{}/{}", id.namespace, id.name),
                        reason: format!("{} {} {busy}", id.kind.tool(), id.kind.kind()),
                    })
                    .collect(),
            });
        }
    }
    let detail = match &stop {
        Some(s) => s.error.clone(),
        None => {
            let mut d = format!("paused {} GitOps owner(s), never resumed: {}", paused.len(), paused.join(", "));
            if !waited.is_empty() {
                d.push_str(&format!("; waited for work in flight to end: {}", waited.join(", ")));
            }
            d
        }
    };
    (phase_record("pause-gitops", started, stop.as_ref(), detail), stop)
}

/// The step record of a phase run before the graph (the GitOps pause, the release): done, or
/// blocked or failed as its stop says.
fn phase_record(step: &str, started: SystemTime, stop: Option<&Stop>, detail: String) -> StepRecord {
    StepRecord {
        step: step.into(),
        action: step.into(),
        object: None,
        started: rfc3339(started),
        finished: rfc3339(SystemTime::now()),
        attempts: 1,
        result: match stop.map(|s| s.exit) {
            None => TaskResult::Done,
            Some(Exit::Blocked) => TaskResult::Blocked,
            Some(_) => TaskResult::Failed,
        },
        detail,
        found_late: None,
    }
}

/// Runs the graph; returns the exit status and the records. A task that finds machines the graph
/// does not know (`TaskOutcome::FoundLate`) grows it: each machine gets the plan's machine steps
/// as tasks ([`TaskGraph::grow`]), what runs after those steps waits for them, and the finder
/// runs again once they are through.
async fn execute(mut graph: TaskGraph, plan: &Plan, ctx: Arc<Ctx>) -> (Exit, Vec<StepRecord>) {
    let mut tracker = ReadyTracker::new(&graph);
    let mut ready: VecDeque<TaskId> = tracker.start(&graph).into();
    // the tasks of machines found late, with why they were
    let mut late: HashMap<TaskId, String> = HashMap::new();
    // each late machine's tasks, so that a second finder waits for the same ones
    let mut late_tasks: HashMap<String, Vec<TaskId>> = HashMap::new();
    let mut limits: HashMap<String, Arc<Semaphore>> = HashMap::new();
    let mut running: JoinSet<(TaskId, StepRecord, TaskOutcome)> = JoinSet::new();
    // what each running task is, by tokio's id: a task that panics returns nothing of its own
    let mut spawned: HashMap<tokio::task::Id, Spawned> = HashMap::new();
    let mut records = Vec::new();
    let mut exit = Exit::Clean;
    loop {
        while let Some(id) = ready.pop_front() {
            if ctx.cancel.is_cancelled() {
                break;
            }
            let node = graph[id].clone();
            let limit = limits
                .entry(node.step.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(node.params.concurrency.get())))
                .clone();
            let ctx = ctx.clone();
            let span = tracing::info_span!("task", step = %node.step, object = node.object.as_deref().unwrap_or(""));
            let task = TaskRef { step: node.step.clone(), action: node.action, object: node.object.clone() };
            let found_late = late.get(&id).cloned();
            let what = Spawned { id, task, started: SystemTime::now(), found_late: found_late.clone() };
            let handle = running.spawn(
                async move {
                    // closed only if the semaphore is dropped, which happens after every task ends
                    let _permit = limit.acquire_owned().await;
                    let started = SystemTime::now();
                    let task = TaskRef { step: node.step.clone(), action: node.action, object: node.object.clone() };
                    ctx.events.send(EngineEvent::TaskStarted(task.clone()));
                    tracing::debug!("started");
                    let (outcome, attempts) = run_with_retries(&ctx, &node).await;
                    if !matches!(outcome, TaskOutcome::FoundLate(_)) {
                        ctx.events.send(EngineEvent::TaskEnded {
                            task,
                            result: outcome.result(),
                            detail: outcome.detail().to_string(),
                        });
                    }
                    match &outcome {
                        TaskOutcome::Failed(d) => {
                            tracing::error!(result = outcome.result().as_str(), detail = %d, "task ended")
                        }
                        TaskOutcome::Blocked(d) | TaskOutcome::Leftovers(d) => {
                            tracing::warn!(result = outcome.result().as_str(), detail = %d, "task ended")
                        }
                        _ => {
                            tracing::info!(result = outcome.result().as_str(), detail = outcome.detail(), "task ended")
                        }
                    }
                    let record = StepRecord {
                        step: node.step.clone(),
                        action: node.action.name().to_string(),
                        object: node.object.clone(),
                        started: rfc3339(started),
                        finished: rfc3339(SystemTime::now()),
                        attempts,
                        result: outcome.result(),
                        detail: outcome.detail().to_string(),
                        found_late,
                    };
                    (id, record, outcome)
                }
                .instrument(span),
            );
            spawned.insert(handle.id(), what);
        }
        let Some(joined) = running.join_next_with_id().await else { break };
        let (id, record, outcome) = match joined {
            Ok((tid, r)) => {
                spawned.remove(&tid);
                r
            }
            Err(e) => match spawned.remove(&e.id()) {
                // the task's record and its end, as the task would have sent them: failed
                Some(what) => {
                    let (record, outcome) = panicked(&what, e);
                    tracing::error!(task = %what.task.label(), detail = %outcome.detail(), "task ended");
                    ctx.events.send(EngineEvent::TaskEnded {
                        task: what.task.clone(),
                        result: outcome.result(),
                        detail: outcome.detail().to_string(),
                    });
                    (what.id, record, outcome)
                }
                None => {
                    exit = exit.worst(Exit::Failure);
                    tracing::error!(error = %e, "a task panicked or was aborted");
                    continue;
                }
            },
        };
        if let TaskOutcome::FoundLate(machines) = &outcome {
            let finder = graph[id].label();
            let mut waits_for = Vec::new();
            let mut touched = vec![id];
            for m in machines {
                if !late_tasks.contains_key(&m.name) {
                    let growth = graph.grow(plan, &m.name, |t| tracker.is_open(t));
                    let why = format!("{} (found by {finder})", m.why);
                    tracing::warn!(nodeclaim = %m.name, why = %why, tasks = growth.tasks.len(), "a machine found late joins the plan");
                    ctx.know_late(&m.name);
                    ctx.events.send(EngineEvent::MachineFoundLate {
                        machine: m.name.clone(),
                        why: why.clone(),
                        tasks: growth.tasks.iter().map(|&t| task_ref(&graph[t])).collect(),
                    });
                    late.extend(growth.tasks.iter().map(|&t| (t, why.clone())));
                    touched.extend(&growth.tasks);
                    touched.extend(&growth.waiting);
                    late_tasks.insert(m.name.clone(), growth.tasks);
                }
                waits_for.extend(late_tasks[&m.name].iter().copied().filter(|&t| !tracker.is_done(t)));
            }
            graph.wait_for(id, &waits_for);
            tracker.reopen(id);
            ready.extend(tracker.resync(&graph, &touched));
            continue;
        }
        records.push(record);
        exit = exit.worst(match &outcome {
            TaskOutcome::Done(_) | TaskOutcome::Skipped(_) => Exit::Clean,
            TaskOutcome::Leftovers(_) => Exit::Leftovers,
            TaskOutcome::Blocked(_) => Exit::Blocked,
            TaskOutcome::Failed(_) | TaskOutcome::Transient(_) => Exit::Failure,
            TaskOutcome::Interrupted => Exit::Interrupted,
            TaskOutcome::FoundLate(_) => Exit::Clean,
        });
        if outcome.lets_dependents_run() {
            ready.extend(tracker.complete(&graph, id));
        } else {
            let held: Vec<String> = graph
                .descendants(id)
                .into_iter()
                .filter_map(|d| graph.get(d))
                .filter(|n| !n.barrier)
                .map(TaskNode::label)
                .collect();
            if !held.is_empty() {
                tracing::warn!(task = %graph[id].label(), held_up = held.len(), "dependents will not run");
            }
        }
    }
    if ctx.cancel.is_cancelled() {
        exit = exit.worst(Exit::Interrupted);
    }
    (exit, records)
}

fn task_ref(node: &TaskNode) -> TaskRef {
    TaskRef { step: node.step.clone(), action: node.action, object: node.object.clone() }
}

/// A task the executor started: what its record needs if it returns none.
struct Spawned {
    id: TaskId,
    task: TaskRef,
    started: SystemTime,
    found_late: Option<String>,
}

/// The record of a task that panicked (or was aborted): it ran and failed, and says so, rather
/// than vanishing from the report; its dependents do not run.
fn panicked(what: &Spawned, e: tokio::task::JoinError) -> (StepRecord, TaskOutcome) {
    let detail = if e.is_panic() {
        let payload = e.into_panic();
        let message = payload
            .downcast_ref::<&str>()
            .map(|m| (*m).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        format!("the task panicked ({message}); this is a bug of the tool: please report it with the log")
    } else {
        "the task was aborted".to_string()
    };
    let outcome = TaskOutcome::Failed(detail);
    let record = StepRecord {
        step: what.task.step.clone(),
        action: what.task.action.name().to_string(),
        object: what.task.object.clone(),
        started: rfc3339(what.started),
        finished: rfc3339(SystemTime::now()),
        attempts: 1,
        result: outcome.result(),
        detail: outcome.detail().to_string(),
        found_late: what.found_late.clone(),
    };
    (record, outcome)
}

/// Runs a task, and runs it again with exponential backoff (backon) while it fails on something
/// transient: every action is an idempotent function of the live state, so a second attempt
/// observes what the first did and carries on from there. Returns the outcome and the attempts.
pub(crate) async fn run_with_retries(ctx: &Ctx, node: &TaskNode) -> (TaskOutcome, u32) {
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_max_times(10)
        .with_jitter()
        .build();
    let mut attempts = 1;
    loop {
        match run_task(ctx, node).await {
            TaskOutcome::Transient(detail) => match backoff.next() {
                Some(delay) => {
                    tracing::warn!(attempt = attempts, detail = %detail, "transient failure; trying again");
                    tokio::select! {
                        _ = ctx.cancel.cancelled() => return (TaskOutcome::Interrupted, attempts),
                        _ = tokio::time::sleep(delay) => {}
                    }
                    attempts += 1;
                }
                None => {
                    return (TaskOutcome::Failed(format!("{detail} (gave up after {attempts} attempts)")), attempts);
                }
            },
            other => return (other, attempts),
        }
    }
}

pub(crate) async fn run_task(ctx: &Ctx, node: &TaskNode) -> TaskOutcome {
    let object = node.object.as_deref();
    // Each action's future is boxed: a task's state is otherwise the largest of all
    // the actions' (7 KB), held by every task from its spawn, and 5,000 drains run at once.
    let outcome = match node.action {
        // the preflight ran before the graph was expanded: identity and inventory decide what
        // the graph is, so there is nothing left for its task to do but to mark the point
        Action::Preflight => Ok(TaskOutcome::Done("identity proven and inventory taken before expansion".into())),
        Action::Fence => Box::pin(actions::fence(ctx)).await,
        Action::Cordon => Box::pin(actions::cordon(ctx, object, &node.params)).await,
        Action::Drain => match object {
            Some(m) => {
                let task = TaskRef { step: node.step.clone(), action: node.action, object: node.object.clone() };
                Box::pin(drain::drain(ctx, m, &node.params, &task)).await
            }
            None => Ok(TaskOutcome::Skipped("no machine".into())),
        },
        Action::RemoveController => Box::pin(actions::remove_controller(ctx, &node.params)).await,
        Action::DischargeFinalizers => match object {
            Some(m) => Box::pin(actions::discharge_finalizers(ctx, m, &node.params)).await,
            None => Ok(TaskOutcome::Skipped("no machine".into())),
        },
        Action::DeleteNodepools => Box::pin(actions::delete_nodepools(ctx, object)).await,
        Action::WaitNodeclaimsGone => Box::pin(actions::wait_nodeclaims_gone(ctx, &node.params)).await,
        Action::DeleteNodeclasses => Box::pin(actions::delete_nodeclasses(ctx, object, &node.params)).await,
        Action::Verify => Box::pin(actions::verify_step(ctx, &node.params)).await,
    };
    // a transient error becomes `Transient`, which the caller runs again; any other, `Failed`
    outcome.unwrap_or_else(TaskOutcome::from)
}

/// The concrete plan for this cluster: steps with their task counts and the objects they act on.
/// How many machines a run may act on: the inventory's machines with a node or an instance,
/// and every live instance EC2 tags as this cluster's Karpenter's, each instance counted once.
fn blast_radius(inv: &Inventory, live: &[crate::aws::InstanceInfo]) -> usize {
    let mut instances: std::collections::BTreeSet<&str> = live.iter().map(|i| i.id.as_str()).collect();
    let mut without_instance = 0;
    for m in inv.machines.values() {
        match &m.provider_id {
            Some(p) => {
                instances.insert(p.instance_id.as_str());
            }
            None if m.node.is_some() => without_instance += 1,
            None => {}
        }
    }
    instances.len() + without_instance
}

/// What the drain's policy at its deadline gives up, as the dry run states it: `delete` and
/// `skip` both end a drain that budgets hold with its pods' budgets bypassed.
fn drain_consent(settings: &RunSettings) -> Option<String> {
    let plan_policy = settings
        .plan
        .steps()
        .iter()
        .filter(|s| s.action == Action::Drain)
        .map(|s| drain::policy_of(s.params.on_deadline))
        .find(|p| *p != DrainPolicy::Fail);
    match settings.drain.policy.or(plan_policy)? {
        DrainPolicy::Fail => None,
        DrainPolicy::Delete => Some(
            "Consent: at the drain deadline the pods left are deleted with their grace period, their \
             PodDisruptionBudgets bypassed (--on-drain-deadline delete)"
                .into(),
        ),
        DrainPolicy::Skip => Some(
            "Consent: at the drain deadline the drain stops and the node's instance is terminated under the pods \
             left, their PodDisruptionBudgets bypassed and their grace periods not waited for (--on-drain-deadline skip)"
                .into(),
        ),
    }
}

fn describe_plan(graph: &TaskGraph, inv: &Inventory, evidence: &preflight::Evidence) -> String {
    let mut by_step: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (_, t) in graph.tasks() {
        if let Some(o) = &t.object {
            by_step.entry(t.step.as_str()).or_default().push(o.clone());
        }
    }
    let mut out = String::new();
    out.push_str(&format!(
        "Inventory: {} machine(s) ({} with a node), {} NodePool(s), {} EC2NodeClass(es), controller: {}\n",
        inv.machines.len(),
        inv.machines.values().filter(|m| m.node.is_some()).count(),
        inv.nodepools.len(),
        inv.nodeclasses.len(),
        inv.controller
            .as_ref()
            .map(|c| format!("{}/{} ({} replica(s))", c.namespace, c.name, c.replicas))
            .unwrap_or_else(|| "none".into())
    ));
    for f in &evidence.facts {
        out.push_str(&format!("Identity: {f}\n"));
    }
    if !inv.not_ours.is_empty() {
        let shown: Vec<String> = inv.not_ours.iter().take(20).map(ToString::to_string).collect();
        let more = inv.not_ours.len().saturating_sub(20);
        out.push_str(&format!(
            "Left alone (not this cluster's self-managed Karpenter's): {}{}\n",
            shown.join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        ));
    }
    out.push_str(&format!("Plan {}:\n", graph.plan_name()));
    for s in graph.summary().steps {
        let objects = by_step.get(s.step.as_str()).map(|v| {
            let shown: Vec<&str> = v.iter().take(10).map(String::as_str).collect();
            let more = v.len().saturating_sub(10);
            if more > 0 { format!(": {} and {more} more", shown.join(", ")) } else { format!(": {}", shown.join(", ")) }
        });
        out.push_str(&format!(
            "  {:<22} {:<22} {} task(s){}\n",
            s.step,
            s.action.name(),
            s.tasks,
            objects.unwrap_or_default()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_panics_is_recorded_as_failed_with_its_message() {
        let mut set: JoinSet<()> = JoinSet::new();
        let handle = set.spawn(async { panic!("the claim had no status") });
        let what = Spawned {
            id: TaskId::new(7),
            task: TaskRef {
                step: "discharge-finalizers".into(),
                action: Action::DischargeFinalizers,
                object: Some("web-a".into()),
            },
            started: SystemTime::now(),
            found_late: None,
        };
        let Some(Err(e)) = set.join_next().await else { panic!("the task did not panic") };
        assert_eq!(e.id(), handle.id());
        let (record, outcome) = panicked(&what, e);
        assert_eq!(record.result, TaskResult::Failed);
        assert_eq!(record.step, "discharge-finalizers");
        assert_eq!(record.object.as_deref(), Some("web-a"));
        assert!(record.detail.contains("the task panicked (the claim had no status)"), "{}", record.detail);
        assert!(!outcome.lets_dependents_run());
    }
}
