//! A run as typed phases. Each phase before the first write returns what the next one needs or a
//! [`Stop`]; [`conclude`] is the one place where how a run ended becomes its exit status, its
//! error and what its report shows, whichever phase it ended in.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::actions::DroppedConversion;
use super::admission;
use super::inventory::Inventory;
use super::permissions::{self, KubePermission};
use super::preflight;
use super::record::RunRecord;
use super::refusal::Refusal;
use super::{Refused, RunResult, RunSettings};
use crate::aws::AwsClients;
use crate::config::DrainPolicy;
use crate::exit::Exit;
use crate::gitops::Survey;
use crate::k8s::Kube;
use crate::karpenter::Foreign;
use crate::plan::TaskGraph;
use crate::report::{Blocker, StepRecord, TaskResult};

/// The phases of a run before its task graph, in the order they run. All but the last only read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Reach the API server and read what of Karpenter the cluster holds.
    Inventory,
    /// Prove the cluster is the one named, and hold the run to `--max-nodes`.
    Identity,
    /// Ask whether the identity may make every call the plan makes.
    Permissions,
    /// Find the GitOps owners of the Karpenter objects and hold the run to the consent given.
    Gitops,
    /// Dry-run each kind of write through admission; find the cleanup controllers the drain
    /// would strand.
    Admission,
    /// Pause the active GitOps owners: the first write. (The task graph's end is
    /// [`Ended::Executed`], told by its steps.)
    PauseGitops,
    /// Delete what `--release` covers while its controllers run, and wait until it is gone
    /// with what it stands for in AWS.
    Release,
}

impl Phase {
    /// The phase's name in the log.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Inventory => "inventory",
            Phase::Identity => "identity",
            Phase::Permissions => "permissions",
            Phase::Gitops => "gitops",
            Phase::Admission => "admission",
            Phase::PauseGitops => "pause-gitops",
            Phase::Release => "release",
        }
    }
}

/// Why a phase ended the run: its exit status, the error as the user reads it, and the blockers
/// that explain it.
#[derive(Debug)]
pub(crate) struct Stop {
    pub(crate) exit: Exit,
    pub(crate) error: String,
    pub(crate) blockers: Vec<Blocker>,
}

impl Stop {
    /// A failure: something the run could not do (exit 1).
    pub(crate) fn failed(error: impl std::fmt::Display) -> Stop {
        Stop { exit: Exit::Failure, error: error.to_string(), blockers: Vec::new() }
    }

    /// Bad input (exit 2) when the error is the user's configuration (a kubeconfig, credentials,
    /// an endpoint), else a failure.
    pub(crate) fn of(error: impl std::fmt::Display, configuration: bool) -> Stop {
        let exit = if configuration { Exit::BadInput } else { Exit::Failure };
        Stop { exit, ..Stop::failed(error) }
    }
}

impl From<Refusal> for Stop {
    fn from(refusal: Refusal) -> Stop {
        Stop { exit: refusal.exit(), error: refusal.to_string(), blockers: Vec::new() }
    }
}

impl From<Refused> for Stop {
    fn from(r: Refused) -> Stop {
        Stop { blockers: r.blockers, ..Stop::from(r.refusal) }
    }
}

/// What the run has learnt so far; its report shows it however the run ends.
#[derive(Debug, Default)]
pub(crate) struct Learnt {
    /// The concrete plan, and what each check added to it.
    pub(crate) plan_text: String,
    /// The GitOps owners of the Karpenter objects, and what the run did with them.
    pub(crate) gitops: Survey,
    /// Karpenter-kind objects that are not this controller's, left alone.
    pub(crate) not_ours: Vec<Foreign>,
    /// Steps run before the graph (the GitOps pause, the release).
    pub(crate) steps: Vec<StepRecord>,
}

impl Learnt {
    /// Adds a line to the plan text.
    pub(crate) fn line(&mut self, line: impl AsRef<str>) {
        self.plan_text.push_str(line.as_ref());
        self.plan_text.push('\n');
    }
}

/// How a run ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// A phase stopped it.
    Stopped { phase: Phase, stop: Stop },
    /// Without `--yes`, after every check: the plan text says what a real run would do.
    DryRun,
    /// The task graph ran.
    Executed {
        /// The worst end of its tasks.
        exit: Exit,
        steps: Vec<StepRecord>,
        /// The fold of the tasks' events (boxed: it is the largest of the ends by far).
        record: Box<RunRecord>,
        /// Whether the plan has a verify step: only verification proves a run clean.
        verifies: bool,
    },
}

/// The run's result from how it ended and what it learnt: its exit status, error and report.
pub(crate) fn conclude(ended: Ended, learnt: Learnt) -> RunResult {
    let Learnt { plan_text, gitops, not_ours, steps: early_steps } = learnt;
    let mut result = RunResult {
        exit: Exit::Clean,
        steps: early_steps,
        blockers: Vec::new(),
        leftovers: Default::default(),
        reclaimed: Vec::new(),
        pods_rebound: 0,
        pods_lost: 0,
        bypasses: Vec::new(),
        error: None,
        plan_text,
        gitops,
        not_ours,
    };
    match ended {
        Ended::Stopped { phase, stop } => {
            // the command says the error itself, once
            tracing::debug!(phase = phase.name(), exit = stop.exit.code(), "the run stopped");
            result.exit = stop.exit;
            result.error = Some(stop.error);
            result.blockers = stop.blockers;
        }
        Ended::DryRun => {}
        Ended::Executed { exit, steps, record, verifies } => {
            // clean is what verification proves: a plan without it ends unverified, never clean
            result.exit = if exit == Exit::Clean && !verifies { Exit::Unverified } else { exit };
            result.error =
                steps.iter().find(|s| s.result == TaskResult::Failed).map(|s| format!("{}: {}", label(s), s.detail));
            result.steps.extend(steps);
            result.pods_rebound = record.rebound.len() as u64;
            result.pods_lost = record.lost.len() as u64;
            let RunRecord { blockers, leftovers, reclaimed, bypasses, .. } = *record;
            result.bypasses = bypasses.into_iter().collect();
            result.blockers = blockers;
            result.leftovers = leftovers;
            result.reclaimed = reclaimed;
            // a pod that went down with its node is a failure of the run, however clean the end
            if result.pods_lost > 0 {
                result.exit = result.exit.worst(Exit::Failure);
                let lost = result.pods_lost;
                result.error.get_or_insert_with(|| {
                    format!(
                        "{lost} pod(s) went down with their node: bound to it after it was checked empty, while \
                         something lifted its fence (blockers of kind pod-lost name them; the field managers in the \
                         report name who)"
                    )
                });
            }
        }
    }
    result
}

fn label(s: &StepRecord) -> String {
    match &s.object {
        Some(o) => format!("{}[{o}]", s.step),
        None => s.step.clone(),
    }
}

// ---------------------------------------------------------------- the phases before the first write

/// Reaches the API server and reads the inventory; after `helm uninstall` of Karpenter 1.0.x,
/// with consent and identity proven first, turns the dead conversion webhook off and reads again.
pub(crate) async fn inventory(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
) -> Result<(Inventory, Vec<DroppedConversion>), Stop> {
    if let Err(e) = crate::k8s::retry_transient(|| kube.check_reachable()).await {
        return Err(Stop::of(&e, e.is_configuration()));
    }
    let started = Instant::now();
    let (inv, dropped) = match crate::k8s::retry_transient(|| Inventory::read(&kube.client)).await {
        Ok(i) => (i, Vec::new()),
        // Karpenter 1.0.x after `helm uninstall`: objects stored at v1beta1 are unreachable
        // through the dead conversion webhook. With consent, and once identity is proven from
        // what can still be read, turn the webhook off (as remove-controller would have) and
        // read again; a dry run only says so.
        Err(e @ crate::k8s::KubeError::ConversionWebhook { .. }) => match unstrand(kube, aws, settings).await? {
            Some(repaired) => repaired,
            None => return Err(Stop::failed(e)),
        },
        // a live Karpenter nothing could keep stopped: a guard's refusal, not a failure
        Err(e @ crate::k8s::KubeError::UntracedController { .. }) => {
            return Err(Stop { exit: Exit::Refused, ..Stop::failed(e) });
        }
        Err(e) => return Err(Stop::failed(e)),
    };
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        machines = inv.machines.len(),
        nodepools = inv.nodepools.len(),
        nodeclasses = inv.nodeclasses.len(),
        "inventory read"
    );
    Ok((inv, dropped))
}

/// Proves identity from the nodes and controller alone, then sets the Karpenter CRDs' conversion
/// to `None` and reads the inventory again; returns it with what was changed, for the checks that
/// follow to put back should one of them stop the run. `None` in a dry run (nothing may be
/// written).
async fn unstrand(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
) -> Result<Option<(Inventory, Vec<DroppedConversion>)>, Stop> {
    if settings.dry_run {
        return Ok(None);
    }
    let core = crate::k8s::retry_transient(|| Inventory::read_core(&kube.client)).await.map_err(Stop::failed)?;
    let evidence =
        preflight::identity(kube, aws, &settings.cluster, &settings.region, settings.account.as_deref(), &core)
            .await
            .map_err(Stop::failed)?;
    if !evidence.contradictions.is_empty() {
        return Err(Refusal::WrongClusterStranded { contradictions: evidence.contradictions }.into());
    }
    // The checks that concern this write come before it: the permission to make it and to list
    // the GitOps owners, the owners' survey, and the admission chain's answer to a dry run of
    // it. The Karpenter objects cannot be read yet, so the survey goes on what can be: the
    // controller, and the objects the owners' own records list. (The other writes' dry runs
    // need those objects, which only this write makes readable, and the full survey reads their
    // metadata: both follow it, before any other write.)
    let mut need = permissions::conversion_repair_needs();
    need.extend(permissions::gitops_survey_needs());
    let missing = permissions::missing_kubernetes(&kube.client, &need).await.map_err(Stop::failed)?.unwrap_or_default();
    if !missing.is_empty() {
        return Err(Refusal::MissingPermissions {
            kubernetes: missing.iter().map(ToString::to_string).collect(),
            ec2: Vec::new(),
        }
        .into());
    }
    let owners =
        crate::k8s::retry_transient(|| crate::k8s::gitops::list_owners(&kube.client)).await.map_err(Stop::failed)?;
    let mut subjects = core.gitops_subjects();
    subjects.extend(crate::gitops::listed_karpenter_objects(&owners.objects));
    let survey = crate::gitops::survey(&subjects, &owners.objects, &kube.server);
    if let Some(refusal) = survey.refusal(settings.gitops) {
        return Err(Refusal::GitOps(refusal).into());
    }
    let findings = super::admission::check_conversion_repair(&kube.client).await.map_err(Stop::failed)?;
    let mut text = String::new();
    if let Some(refused) = super::refused_by_admission(&findings, &mut text) {
        return Err(refused.into());
    }
    let mut changed = Vec::new();
    if let Err(e) = super::actions::drop_conversion_webhooks_into(&kube.client, &mut changed).await {
        return Err(put_back(kube, &changed, Stop::failed(e)).await);
    }
    tracing::warn!(
        crds = changed.len(),
        "the Karpenter CRDs' conversion webhook had no controller behind it; set their conversion to None to reach the objects"
    );
    match crate::k8s::retry_transient(|| Inventory::read(&kube.client)).await {
        Ok(inv) => Ok(Some((inv, changed))),
        Err(e) => Err(put_back(kube, &changed, Stop::failed(e)).await),
    }
}

/// `stop` once the CRDs' conversion the run turned off is put back: a run stopped by a check
/// after that repair (or before its graph's first task) leaves the cluster as it found it. What
/// cannot be put back is named in `stop`'s error, and the run is then a failure: something it
/// changed stays changed.
pub(crate) async fn put_back(kube: &Kube, dropped: &[DroppedConversion], mut stop: Stop) -> Stop {
    if dropped.is_empty() {
        return stop;
    }
    let failed = super::actions::restore_conversion_webhooks(&kube.client, dropped).await;
    if failed.is_empty() {
        tracing::info!(crds = dropped.len(), "the Karpenter CRDs' conversion webhook put back as it was");
        stop.error.push_str(&format!(
            ". The conversion webhook of {} Karpenter CRD(s), turned off to read their objects, was put back as it was",
            dropped.len()
        ));
    } else {
        stop.error.push_str(&format!(
            ". The conversion webhook of {} was turned off to read the Karpenter objects and could not be put back: \
             {}; the next run works with it off (Karpenter 1.1 and later turn it off too)",
            failed.len(),
            failed.join(", ")
        ));
        stop.exit = Exit::Failure;
    }
    stop
}

/// Gathers the identity evidence and takes the verdict; then holds the run to `--max-nodes`,
/// counting what EC2 holds as much as what the cluster shows.
pub(crate) async fn identity(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
    inv: &Inventory,
) -> Result<preflight::Evidence, Stop> {
    let started = Instant::now();
    let evidence =
        match preflight::identity(kube, aws, &settings.cluster, &settings.region, settings.account.as_deref(), inv)
            .await
        {
            Ok(ev) => ev,
            Err(e) if e.is_access_denied() => {
                tracing::error!(error = %e, "identity evidence");
                return Err(Refusal::MissingPermissions {
                    kubernetes: Vec::new(),
                    ec2: e.action().into_iter().collect(),
                }
                .into());
            }
            Err(e) => return Err(Stop::of(&e, e.is_configuration())),
        };
    tracing::info!(seconds = started.elapsed().as_secs_f64(), "identity evidence gathered");
    for f in &evidence.facts {
        tracing::info!(evidence = %f, "identity");
    }
    if !evidence.contradictions.is_empty() {
        return Err(Refusal::WrongCluster {
            cluster: settings.cluster.clone(),
            region: settings.region.clone(),
            contradictions: evidence.contradictions,
        }
        .into());
    }
    if let Some(max) = settings.max_nodes {
        // a machine whose Node is gone (or never joined) is terminated too, and `--reclaim`
        // takes every live one
        let live = aws
            .ec2
            .cluster_instances(&settings.cluster, crate::aws::ec2::InstanceScope::KarpenterLive)
            .await
            .map_err(|e| Stop::of(&e, e.is_configuration()))?;
        let nodes = super::blast_radius(inv, &live);
        if nodes > max as usize {
            return Err(Refusal::BlastRadius { nodes, max }.into());
        }
    }
    Ok(evidence)
}

/// Asks Kubernetes and EC2, before anything is changed (also in a dry run, which then says what
/// a real run would be refused for), whether the identity may do everything the plan does.
pub(crate) async fn permissions(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
    inv: &Inventory,
    k8s_need: &BTreeSet<KubePermission>,
) -> Result<(), Stop> {
    let started = Instant::now();
    let k8s_missing =
        permissions::missing_kubernetes(&kube.client, k8s_need).await.map_err(Stop::failed)?.unwrap_or_default();
    let instances: Vec<String> =
        inv.machines.values().filter_map(|m| m.provider_id.as_ref().map(|p| p.instance_id.clone())).collect();
    let ec2_need = permissions::ec2_needs(&settings.plan, settings.reclaim);
    let ec2_missing = permissions::missing_ec2(aws, &settings.cluster, &ec2_need, &instances)
        .await
        .map_err(|e| Stop::of(&e, e.is_configuration()))?;
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        kubernetes = k8s_need.len(),
        ec2 = ec2_need.len(),
        missing = k8s_missing.len() + ec2_missing.len(),
        "permissions checked before any change"
    );
    if k8s_missing.is_empty() && ec2_missing.is_empty() {
        return Ok(());
    }
    Err(Refusal::MissingPermissions {
        kubernetes: k8s_missing.iter().map(ToString::to_string).collect(),
        ec2: ec2_missing.iter().map(ToString::to_string).collect(),
    }
    .into())
}

/// Finds the GitOps owners of the Karpenter objects (the survey goes to `learnt`, and its lines
/// to the plan text) and holds the run to the consent given; returns the owners as listed, which
/// the pause writes to.
pub(crate) async fn gitops(
    kube: &Kube,
    settings: &RunSettings,
    inv: &Inventory,
    learnt: &mut Learnt,
) -> Result<crate::k8s::gitops::Owners, Stop> {
    let owners =
        crate::k8s::retry_transient(|| crate::k8s::gitops::list_owners(&kube.client)).await.map_err(Stop::failed)?;
    learnt.gitops = crate::gitops::survey(&inv.gitops_subjects(), &owners.objects, &kube.server);
    for line in learnt.gitops.plan_lines(settings.gitops) {
        learnt.line(line);
    }
    match learnt.gitops.refusal(settings.gitops) {
        Some(refusal) => Err(Refusal::GitOps(refusal).into()),
        None => Ok(owners),
    }
}

/// [`super::admission_verdict`] and [`super::cleanup_verdict`] for a run: before anything is
/// changed (also in a dry run), a refusal or a failure to ask ends the run here; returns what
/// the survey's verdict: what `--release` deletes, its load balancers checked for deletion
/// protection ([`super::protected`]), and the EBS volumes of the cluster's PersistentVolumes.
pub(crate) async fn admission(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
    inv: &Inventory,
    need: &BTreeSet<KubePermission>,
    owners: &crate::k8s::gitops::Owners,
    learnt: &mut Learnt,
) -> Result<super::CleanupVerdict, Stop> {
    // the owners a run with --pause-gitops pauses (a dry run predicts that run)
    let pausing = settings
        .gitops
        .pause
        .then(|| admission::Pausing { owners, active: learnt.gitops.active().map(|f| f.owner.clone()).collect() });
    if let Some(refused) =
        super::admission_verdict(&kube.client, need, inv, pausing, &mut learnt.plan_text).await.map_err(Stop::failed)?
    {
        return Err(refused.into());
    }
    let verdict = super::cleanup_verdict(
        &kube.client,
        &settings.plan,
        inv,
        &settings.release,
        &settings.assume_stopped,
        &mut learnt.plan_text,
    )
    .await
    .map_err(Stop::failed)?;
    if let Some(refused) = verdict.refused {
        return Err(refused.into());
    }
    // what --release writes, tried on the objects it will write to
    let findings = super::admission::check_release(&kube.client, &verdict.release, &verdict.volume_release)
        .await
        .map_err(Stop::failed)?;
    if let Some(refused) = super::refused_by_admission(&findings, &mut learnt.plan_text) {
        return Err(refused.into());
    }
    match super::protected(aws, &settings.cluster, &verdict.release).await {
        Ok(Some(refused)) => Err(refused.into()),
        Ok(None) => Ok(verdict),
        Err(e) => Err(Stop::of(&e, e.is_configuration())),
    }
}

/// What the phases before the first write hand to the execution.
pub(crate) struct Prepared {
    pub(crate) inv: Inventory,
    pub(crate) graph: TaskGraph,
    pub(crate) owners: crate::k8s::gitops::Owners,
    /// What `--release` deletes or waits for before the graph.
    pub(crate) release: Vec<crate::cleanup::Held>,
    /// How `--release volumes` releases the PVs in `release`.
    pub(crate) volume_release: crate::cleanup::VolumeRelease,
    /// The EBS volumes of the cluster's PersistentVolumes, by id, each with its PV's name.
    pub(crate) volumes: BTreeMap<String, String>,
    /// The Karpenter 1.0.x CRDs whose dead conversion webhook the inventory turned off to read
    /// the objects: put back should the run stop before its graph's first task.
    pub(crate) dropped: Vec<DroppedConversion>,
}

/// Runs the phases that only read, in order; the first that stops ends the run here, before a
/// write (the one exception, the 1.0.x CRD repair the reads need, is put back), whatever
/// consent was given.
pub(crate) async fn prepare(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
    learnt: &mut Learnt,
) -> Result<Prepared, (Phase, Stop)> {
    let (inv, dropped) = inventory(kube, aws, settings).await.map_err(|s| (Phase::Inventory, s))?;
    match checks(kube, aws, settings, inv, learnt).await {
        Ok(prepared) => Ok(Prepared { dropped, ..prepared }),
        // the 1.0.x repair came before these checks (it is what lets them read the objects):
        // one that stops the run undoes it
        Err((phase, stop)) => Err((phase, put_back(kube, &dropped, stop).await)),
    }
}

/// The checks after the inventory, up to the last before the first write.
async fn checks(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RunSettings,
    inv: Inventory,
    learnt: &mut Learnt,
) -> Result<Prepared, (Phase, Stop)> {
    learnt.not_ours = inv.not_ours.clone();
    let evidence = identity(kube, aws, settings, &inv).await.map_err(|s| (Phase::Identity, s))?;
    let graph = settings.plan.expand(&inv.object_sets());
    learnt.plan_text = super::describe_plan(&graph, &inv, &evidence);
    if let Some(line) = super::drain_consent(settings) {
        learnt.line(line);
    }
    let delete_pods = settings.drain.policy == Some(DrainPolicy::Delete);
    let need = permissions::kubernetes_needs(&settings.plan, delete_pods, settings.gitops.pause);
    let mut asked = need.clone();
    if !settings.release.is_empty() {
        asked.extend(permissions::cleanup_release_needs(&settings.release));
    }
    permissions(kube, aws, settings, &inv, &asked).await.map_err(|s| (Phase::Permissions, s))?;
    let owners = gitops(kube, settings, &inv, learnt).await.map_err(|s| (Phase::Gitops, s))?;
    let verdict =
        admission(kube, aws, settings, &inv, &need, &owners, learnt).await.map_err(|s| (Phase::Admission, s))?;
    Ok(Prepared {
        inv,
        graph,
        owners,
        release: verdict.release,
        volume_release: verdict.volume_release,
        volumes: verdict.volumes,
        dropped: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::BlockerKind;

    fn record(step: &str, object: Option<&str>, result: TaskResult, detail: &str) -> StepRecord {
        StepRecord {
            step: step.into(),
            action: step.into(),
            object: object.map(str::to_string),
            started: "2026-11-29T00:00:00Z".into(),
            finished: "2026-11-29T00:00:01Z".into(),
            attempts: 1,
            result,
            detail: detail.into(),
            found_late: None,
        }
    }

    fn learnt() -> Learnt {
        Learnt { plan_text: "plan\n".into(), ..Learnt::default() }
    }

    #[test]
    fn a_refusal_keeps_its_exit_error_and_blockers_and_what_was_learnt() {
        let blocker = Blocker { kind: BlockerKind::Admission, name: "w".into(), reason: "denied".into() };
        let refused = Refused {
            refusal: Refusal::Admission { blocked: vec!["w denied".into()] },
            blockers: vec![blocker.clone()],
        };
        let r = conclude(Ended::Stopped { phase: Phase::Admission, stop: refused.into() }, learnt());
        assert_eq!(r.exit, Exit::BadInput);
        assert!(r.error.as_deref().is_some_and(|e| e.contains("w denied")), "{:?}", r.error);
        assert_eq!(r.blockers, vec![blocker]);
        assert_eq!(r.plan_text, "plan\n");
        assert!(r.steps.is_empty());
    }

    #[test]
    fn a_configuration_error_is_bad_input_and_any_other_a_failure() {
        assert_eq!(Stop::of("no such context", true).exit, Exit::BadInput);
        assert_eq!(Stop::of("connection reset", false).exit, Exit::Failure);
        let wrong = Stop::from(Refusal::BlastRadius { nodes: 12, max: 10 });
        assert_eq!(wrong.exit, Exit::Refused);
    }

    #[test]
    fn a_stop_after_the_pause_keeps_the_pause_record() {
        let mut l = learnt();
        l.steps.push(record("pause-gitops", None, TaskResult::Blocked, "still in flight"));
        let stop = Stop { exit: Exit::Blocked, error: "still in flight".into(), blockers: Vec::new() };
        let r = conclude(Ended::Stopped { phase: Phase::PauseGitops, stop }, l);
        assert_eq!(r.exit, Exit::Blocked);
        assert_eq!(r.steps.len(), 1);
        assert_eq!(r.steps[0].step, "pause-gitops");
    }

    #[test]
    fn a_dry_run_is_clean_with_no_error() {
        let r = conclude(Ended::DryRun, learnt());
        assert_eq!(r.exit, Exit::Clean);
        assert_eq!(r.error, None);
        assert_eq!(r.plan_text, "plan\n");
    }

    #[test]
    fn only_verification_makes_a_run_clean() {
        let executed = |verifies| Ended::Executed {
            exit: Exit::Clean,
            steps: vec![record("drain", Some("m"), TaskResult::Done, "")],
            record: Box::default(),
            verifies,
        };
        assert_eq!(conclude(executed(true), learnt()).exit, Exit::Clean);
        assert_eq!(conclude(executed(false), learnt()).exit, Exit::Unverified);
    }

    #[test]
    fn the_first_failed_task_is_the_error_and_early_steps_come_first() {
        let mut l = learnt();
        l.steps.push(record("pause-gitops", None, TaskResult::Done, "paused 1"));
        let steps = vec![
            record("drain", Some("a"), TaskResult::Done, ""),
            record("drain", Some("b"), TaskResult::Failed, "forbidden"),
            record("verify", None, TaskResult::Failed, "later"),
        ];
        let r = conclude(Ended::Executed { exit: Exit::Failure, steps, record: Box::default(), verifies: true }, l);
        assert_eq!(r.exit, Exit::Failure);
        assert_eq!(r.error.as_deref(), Some("drain[b]: forbidden"));
        let order: Vec<&str> = r.steps.iter().map(|s| s.step.as_str()).collect();
        assert_eq!(order, ["pause-gitops", "drain", "drain", "verify"]);
    }

    #[test]
    fn a_pod_lost_fails_a_clean_run_and_says_so() {
        let mut rec = RunRecord::default();
        rec.lost.insert("uid-1".into());
        let ended = Ended::Executed { exit: Exit::Clean, steps: Vec::new(), record: Box::new(rec), verifies: true };
        let r = conclude(ended, learnt());
        assert_eq!(r.exit, Exit::Failure);
        assert_eq!(r.pods_lost, 1);
        assert!(
            r.error.as_deref().is_some_and(|e| e.starts_with("1 pod(s) went down with their node")),
            "{:?}",
            r.error
        );
    }
}
