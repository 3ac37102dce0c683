//! `rehearse`: the teardown played on a copy of the live cluster before it is played for real.
//!
//! A [`Snapshot`] (read-only) is loaded into the sandbox ([`load`]), the chosen plan runs against
//! the copy with the sandbox clock accelerated, and what happened becomes a [`Prediction`]: the
//! outcome and exit code, the blockers with their arithmetic, the wall time on the real clock
//! ([`predict`]), the requests, and the concrete plan. Nothing real is written: the copy is an
//! in-process API server and a private LocalStack account.

pub(crate) mod load;
pub(crate) mod predict;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::aws::{AwsClients, AwsError};
use crate::engine::context::DrainOverrides;
use crate::engine::events::{EngineEvent, Events};
use crate::engine::{self, RunSettings};
use crate::exit::Exit;
use crate::gitops::GitopsConsent;
use crate::k8s::{Kube, KubeError};
use crate::plan::Plan;
use crate::report::{BlockerKind, Outcome};
use crate::snapshot::Snapshot;

pub(crate) use predict::Timing;

/// Why a rehearsal could not be played (a prediction of a failed teardown is not an error).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RehearseError {
    /// The LocalStack that holds the copy's AWS side does not answer.
    #[error(
        "the rehearsal needs a LocalStack for its copy of the cluster's AWS side, and {endpoint} does not answer ({detail}); \
         start one with `localstack/up` of this repository (a plain `localstack start` serves no EKS or ELB, which the copy needs) or pass --localstack URL"
    )]
    LocalStack {
        /// The endpoint asked.
        endpoint: String,
        /// What went wrong.
        detail: String,
    },
    /// The copy could not be built.
    #[error("cannot load {what} into the rehearsal's copy: {detail}")]
    Load {
        /// What was being loaded.
        what: String,
        /// Why not.
        detail: String,
    },
    /// The sandbox API server could not start.
    #[error(transparent)]
    Sandbox(#[from] sandbox_apiserver::SandboxError),
    /// The teardown's clients for the copy could not be built.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// The teardown's AWS clients for the copy could not be built.
    #[error(transparent)]
    Aws(#[from] AwsError),
}

/// How to rehearse.
#[derive(Debug, Clone)]
pub(crate) struct RehearsalSettings {
    /// The plan, as the real run would use it.
    pub plan: Plan,
    /// `--drain-deadline` / `--on-drain-deadline`, on the real clock.
    pub drain: DrainOverrides,
    /// `--max-nodes`.
    pub max_nodes: Option<u32>,
    /// `--reclaim`.
    pub reclaim: bool,
    /// `--pause-gitops`, `--gitops-paused-elsewhere`.
    pub gitops: GitopsConsent,
    /// `--release`: predicted in what it refuses and the permissions it needs; not played on
    /// the copy, which holds no Services or volumes.
    pub release: std::collections::BTreeSet<crate::cleanup::Release>,
    /// `--assume-stopped`: predicted in what it lets through.
    pub assume_stopped: std::collections::BTreeSet<crate::cleanup::Cleaner>,
    /// The copy's clock (0.2: five times as fast).
    pub time_scale: f64,
    /// The LocalStack that holds the copy's AWS side.
    pub localstack: String,
}

/// A blocker the rehearsal met, named as the real run will name it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PredictedBlocker {
    /// What kind of thing it is.
    pub kind: BlockerKind,
    /// `namespace/name` or name.
    pub name: String,
    /// Why it blocks.
    pub reason: String,
    /// For a PodDisruptionBudget: its arithmetic once the fenced capacity was gone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetArithmetic>,
}

/// A PodDisruptionBudget's status when the rehearsal's drain gave up.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct BudgetArithmetic {
    /// Pods the budget covers.
    pub expected_pods: i64,
    /// Of them healthy.
    pub current_healthy: i64,
    /// Healthy pods the budget requires.
    pub desired_healthy: i64,
    /// Evictions it allows now (`current_healthy - desired_healthy`, at least 0).
    pub disruptions_allowed: i64,
}

/// What the copy was.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct CopyFacts {
    /// The Karpenter release the simulation imitated.
    pub karpenter: String,
    /// Whether the simulated controller was live (its Deployment had a ready replica).
    pub controller_live: bool,
    /// Kubernetes objects loaded.
    pub objects: usize,
    /// Instances seeded in LocalStack.
    pub instances: usize,
    /// The copy's clock.
    pub time_scale: f64,
    /// Seconds spent building the copy.
    pub load_seconds: f64,
}

/// What the rehearsal predicts for the real run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Prediction {
    /// The outcome the real run will have.
    pub outcome: Outcome,
    /// Its exit code.
    pub exit_code: u8,
    /// The error or refusal it will end with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What will block it.
    pub blockers: Vec<PredictedBlocker>,
    /// Its wall time, in all and by step.
    pub timing: Timing,
    /// The requests it will make, by `service:verb` (as the run report counts them).
    pub requests: BTreeMap<String, u64>,
    /// The requests the copy's run made before its first write: a run refused there makes
    /// these and no more.
    #[serde(skip)]
    pub(crate) requests_before_writes: BTreeMap<String, u64>,
    /// Whether verification will find the cluster clean.
    pub clean: bool,
    /// The concrete plan, with object names.
    pub plan: String,
    /// What of the plan's permissions the live identity lacks, asked of the live cluster and
    /// EC2 as the real run's preflight asks (the copy runs as its administrator, so it cannot
    /// tell); only with `--predict-permissions`, when the identity given is the run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permissions: Option<PermissionsSeen>,
    /// What the copy was.
    pub copy: CopyFacts,
}

/// The live identity's permissions for the plan, as the real run's preflight would find them.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub(crate) struct PermissionsSeen {
    /// `verb group/resource` the API server denies this identity.
    pub missing_kubernetes: Vec<String>,
    /// EC2 actions a dry run refused.
    pub missing_ec2: Vec<String>,
    /// Whether the API server answered access reviews at all (when it does not, the real run
    /// goes on unchecked, and so does the prediction).
    pub kubernetes_checked: bool,
}

impl Prediction {
    /// The prediction once the real run's identity's permissions are known: a run missing any is
    /// refused before its first write (exit 2), whatever the copy, run as administrator, did.
    pub(crate) fn with_permissions(mut self, seen: PermissionsSeen) -> Prediction {
        if !seen.missing_kubernetes.is_empty() || !seen.missing_ec2.is_empty() {
            let refusal = crate::engine::refusal::Refusal::MissingPermissions {
                kubernetes: seen.missing_kubernetes.clone(),
                ec2: seen.missing_ec2.clone(),
            };
            self.refused_before_the_first_step(&refusal);
            self.blockers.clear();
        }
        self.permissions = Some(seen);
        self
    }

    /// A run refused before its first write runs none of its steps: the copy's steps and their
    /// time are not the run's.
    fn refused_before_the_first_step(&mut self, refusal: &crate::engine::refusal::Refusal) {
        self.outcome = Outcome::from_exit(refusal.exit());
        self.exit_code = refusal.exit().code();
        self.error = Some(refusal.to_string());
        self.timing.steps.clear();
        self.timing.predicted_seconds = 0.0;
        self.requests = self.requests_before_writes.clone();
    }
}

impl Prediction {
    /// The prediction once the live cluster's admission chain and cleanup controllers have been
    /// asked as the real run's preflight asks them: a refusal there is the run's refusal (unless
    /// a missing permission refuses it first, as the run's order has it), with its blockers; the
    /// lines those checks plan join the plan.
    pub(crate) fn with_live_refusal(mut self, refused: Option<crate::engine::Refused>, plan: &str) -> Prediction {
        // what the live checks plan (the cleanup controllers, the release): the copy has none of it
        self.plan.push_str(plan);
        let permission_refused =
            self.permissions.as_ref().is_some_and(|p| !p.missing_kubernetes.is_empty() || !p.missing_ec2.is_empty());
        if let Some(r) = refused
            && !permission_refused
        {
            self.refused_before_the_first_step(&r.refusal);
            self.blockers = r
                .blockers
                .into_iter()
                .map(|b| PredictedBlocker { kind: b.kind, name: b.name, reason: b.reason, budget: None })
                .collect();
        }
        self
    }
}

/// The `rehearsal` section of a `rehearse` report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Rehearsal {
    /// The snapshot that was played.
    pub snapshot: crate::snapshot::SnapshotSummary,
    /// What it predicts (absent when the copy could not be played: see the report's `error`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<Prediction>,
}

/// Builds the copy, runs the plan on it and predicts. The snapshot's objects move into the copy.
pub(crate) async fn rehearse(
    mut snap: Snapshot,
    settings: &RehearsalSettings,
    cancel: CancellationToken,
) -> Result<Prediction, RehearseError> {
    let scale = settings.time_scale;
    let waits = predict::Waits::of(&snap);
    let started = Instant::now();
    let copy = load::load(
        &mut snap,
        &load::LoadOptions { time_scale: scale, localstack: settings.localstack.clone(), port: 0 },
    )
    .await?;
    let load_seconds = started.elapsed().as_secs_f64();
    let facts = CopyFacts {
        karpenter: copy.version.as_str().to_string(),
        controller_live: copy.sim.is_active(),
        objects: copy.objects,
        instances: copy.instances.len(),
        time_scale: scale,
        load_seconds,
    };
    let result = play(&snap, settings, &copy, cancel).await;
    let prediction = match result {
        Ok(Played { run, requests, requests_before_writes, run_seconds, deadline_passed }) => {
            let blockers = blockers_of(&copy, &run.blockers);
            let drain_deadline = settings
                .drain
                .deadline
                .or_else(|| {
                    settings
                        .plan
                        .steps()
                        .iter()
                        .find(|s| s.action == crate::plan::Action::Drain)
                        .and_then(|s| s.params.deadline)
                })
                .unwrap_or(Duration::from_secs(600));
            let inputs = predict::TimingInputs {
                time_scale: scale,
                drain_deadline,
                run_seconds,
                deadline_passed,
                order: predict::StepOrder::of(&settings.plan),
                fence_settle: crate::engine::drain::FENCE_SETTLE,
            };
            let timing = predict::timing(&waits, &run.steps, &inputs);
            let (mut exit, mut error) = (run.exit, run.error.as_deref().map(|e| copy.to_live_ids(e)));
            // A drain that ended in time only on the copy's clock would block the real run under
            // policy fail: predicted so, pessimistic by design.
            let policy_fails = settings.drain.policy.unwrap_or_else(|| {
                crate::engine::drain::policy_of(
                    settings
                        .plan
                        .steps()
                        .iter()
                        .find(|s| s.action == crate::plan::Action::Drain)
                        .map_or(crate::plan::OnDeadline::Fail, |s| s.params.on_deadline),
                )
            }) == crate::config::DrainPolicy::Fail;
            let late = predict::drains_past_deadline(&waits, &run.steps, &inputs);
            if policy_fails && !late.is_empty() && exit.worst(Exit::Blocked) == Exit::Blocked {
                let (machine, seconds) = &late[0];
                let deadline = humantime::format_duration(drain_deadline);
                exit = Exit::Blocked;
                error.get_or_insert_with(|| {
                    format!(
                        "{} drain(s) are predicted to reach the {deadline} drain deadline on the real clock (the longest, \
                         {machine}: its pods' evictions and grace periods, about {seconds:.0}s): the run would end blocked \
                         with them; give it a longer --drain-deadline",
                        late.len()
                    )
                });
            }
            Ok(Prediction {
                outcome: Outcome::from_exit(exit),
                exit_code: exit.code(),
                error,
                blockers,
                timing,
                requests,
                requests_before_writes,
                clean: run.leftovers.is_clean(),
                plan: copy.to_live_ids(&run.plan_text),
                permissions: None,
                copy: facts,
            })
        }
        Err(e) => Err(e),
    };
    copy.shutdown().await;
    prediction
}

/// The run on the copy: what it ended with, its requests in all and those it made before its
/// first write, its wall time, and the machines whose drain ran into its deadline.
struct Played {
    run: engine::RunResult,
    requests: BTreeMap<String, u64>,
    requests_before_writes: BTreeMap<String, u64>,
    run_seconds: f64,
    deadline_passed: std::collections::BTreeSet<String>,
}

/// The copy has no Argo CD or Flux controllers, and a run that pauses a Flux object waits until
/// the controller has handled the suspend: the sandbox's simulated ones stand in, with nothing to
/// put back (the snapshot holds no Git repository), so the copy acknowledges a suspend as the
/// live Flux would. It has a client of its own: its requests are not the run's. `None` when the
/// copy holds no GitOps owner.
async fn gitops_stand_in(copy: &load::Copy) -> Result<Option<sandbox_sim::gitops::GitopsSim>, RehearseError> {
    use sandbox_sim::gitops::{GitopsSim, GitopsWorld, OwnerId, OwnerKind};
    let kube = Kube::from_config(copy.server.kube_config(), None)?;
    let owners = crate::k8s::gitops::list_owners(&kube.client).await?;
    let owners: Vec<OwnerId> = owners
        .objects
        .iter()
        .map(|o| OwnerId {
            kind: match o.id.kind {
                crate::gitops::OwnerKind::Application => OwnerKind::Application,
                crate::gitops::OwnerKind::Kustomization => OwnerKind::Kustomization,
                crate::gitops::OwnerKind::HelmRelease => OwnerKind::HelmRelease,
            },
            namespace: o.id.namespace.clone(),
            name: o.id.name.clone(),
        })
        .collect();
    if owners.is_empty() {
        return Ok(None);
    }
    let world = GitopsWorld { owners, repo: Vec::new() };
    Ok(Some(GitopsSim::start(kube.client.clone(), &world, Default::default())))
}

async fn play(
    snap: &Snapshot,
    settings: &RehearsalSettings,
    copy: &load::Copy,
    cancel: CancellationToken,
) -> Result<Played, RehearseError> {
    let scale = settings.time_scale;
    let kube = Kube::from_config(copy.server.kube_config(), Some(snap.cluster.clone()))?;
    let aws = AwsClients::from_config(&copy.sdk).await?;
    let run_settings = RunSettings {
        cluster: snap.cluster.clone(),
        region: snap.region.clone(),
        account: Some(copy.account.clone()),
        plan: settings.plan.with_drain_deadlines_scaled(scale),
        dry_run: false,
        drain: DrainOverrides {
            deadline: settings.drain.deadline.map(|d| d.mul_f64(scale).max(Duration::from_millis(1))),
            policy: settings.drain.policy,
            deadline_from_dispatch: true,
        },
        max_nodes: settings.max_nodes,
        reclaim: settings.reclaim,
        gitops: settings.gitops,
        // `rehearse` has no --release: the copy holds no Service or Ingress to release
        release: Default::default(),
        assume_stopped: settings.assume_stopped.clone(),
    };
    let started = Instant::now();
    // every log line of the copy's run says so: it must never read as a change to the live cluster
    let span = tracing::info_span!("rehearsal", copy = %copy.server.url());
    let (events, mut rx) = Events::channel();
    // owned here and joined below: it ends when the run's last sender is dropped. The graph
    // starts (RunStarted) once every read before the first write is done: the requests counted
    // then are those of a run refused before its first write.
    let (kube_calls, aws_calls) = (kube.calls.clone(), aws.calls.clone());
    let listener = tokio::spawn(
        async move {
            let mut passed = std::collections::BTreeSet::new();
            let mut before_writes = None;
            while let Some(ev) = rx.recv().await {
                match ev {
                    EngineEvent::DrainDeadlinePassed { task, .. } => {
                        passed.insert(task.object.unwrap_or_default());
                    }
                    EngineEvent::RunStarted { .. } if before_writes.is_none() => {
                        let mut counts = kube_calls.snapshot();
                        counts.extend(aws_calls.snapshot());
                        before_writes = Some(counts);
                    }
                    _ => {}
                }
            }
            (passed, before_writes)
        }
        .instrument(span.clone()),
    );
    let stand_in = gitops_stand_in(copy).await?;
    let run = engine::run(kube.clone(), aws.clone(), run_settings, cancel, events).instrument(span).await;
    if let Some(g) = stand_in {
        g.shutdown().await;
    }
    let run_seconds = started.elapsed().as_secs_f64();
    let (deadline_passed, before_writes) = listener.await.unwrap_or_default();
    let mut requests = kube.calls.snapshot();
    requests.extend(aws.calls.snapshot());
    // a copy's run that never started its graph made nothing but reads
    let requests_before_writes = before_writes.unwrap_or_else(|| requests.clone());
    Ok(Played { run, requests, requests_before_writes, run_seconds, deadline_passed })
}

/// The run's blockers with live instance ids, and each budget's arithmetic read from the copy.
fn blockers_of(copy: &load::Copy, blockers: &[crate::report::Blocker]) -> Vec<PredictedBlocker> {
    let store = copy.server.store();
    let pdbs = sandbox_apiserver::GroupResource::new("policy", "poddisruptionbudgets");
    blockers
        .iter()
        .map(|b| {
            let budget = (b.kind == BlockerKind::Pdb)
                .then(|| b.name.split_once('/'))
                .flatten()
                .and_then(|(ns, name)| store.get(&pdbs, ns, name).ok())
                .map(|p| {
                    let st = &p["status"];
                    let n = |k: &str| st[k].as_i64().unwrap_or(0);
                    BudgetArithmetic {
                        expected_pods: n("expectedPods"),
                        current_healthy: n("currentHealthy"),
                        desired_healthy: n("desiredHealthy"),
                        disruptions_allowed: n("disruptionsAllowed"),
                    }
                });
            PredictedBlocker {
                kind: b.kind,
                name: copy.to_live_ids(&b.name),
                reason: copy.to_live_ids(&b.reason),
                budget,
            }
        })
        .collect()
}

impl Prediction {
    /// The exit status the rehearse command ends with: the one predicted for the real run.
    pub(crate) fn exit(&self) -> Exit {
        Exit::from_code(self.exit_code)
    }
}
