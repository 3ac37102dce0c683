//! EC2: finding a cluster's Karpenter instances and launch templates, terminating them in batches,
//! and the detached network interfaces and volumes that verification reports.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use aws_sdk_ec2::types::{Filter, Instance, InstanceStateName};
use futures::{StreamExt, TryStreamExt, stream};

use super::AwsError;
use super::pacing::{Clock, Pace, TerminatePacer, WallClock};
use crate::karpenter;

/// Ids per `TerminateInstances` call: AWS takes up to 1,000; 500 keeps one bad id's fallback
/// (one call per id) short (design §5).
pub(crate) const TERMINATE_BATCH: usize = 500;
/// EC2 refuses a request with more than 200 values in one filter (`FilterLimitExceeded`, "The
/// maximum number of filter values specified on a single call is 200").
pub(crate) const FILTER_VALUES_MAX: usize = 200;
/// Page sizes: the largest `MaxResults` each call accepts (DescribeInstances and
/// DescribeNetworkInterfaces 5–1000, DescribeVolumes 5–500, DescribeLaunchTemplates 1–200,
/// DescribeSecurityGroups 5–1000).
/// Always paging with filters also keeps the calls out of EC2's smaller throttling bucket for
/// unfiltered, unpaginated Describe calls.
const DESCRIBE_INSTANCES_PAGE: i32 = 1000;
const DESCRIBE_NETWORK_INTERFACES_PAGE: i32 = 1000;
const DESCRIBE_VOLUMES_PAGE: i32 = 500;
const DESCRIBE_LAUNCH_TEMPLATES_PAGE: i32 = 200;
const DESCRIBE_SECURITY_GROUPS_PAGE: i32 = 1000;
/// The EBS CSI driver's tag naming the cluster (v1.58 on, with `--k8s-tag-cluster-id`).
const TAG_EBS_CSI_CLUSTER_NAME: &str = "ebs.csi.aws.com/cluster-name";
/// Calls of 200 ids each that a lookup by id keeps in flight: 5,000 instances are 25 calls, one
/// after another a good part of a minute before the first write. Four stay well inside the
/// token bucket EC2 gives each Describe action (100 requests, refilled at 20 a second, per EC2's
/// request throttling documentation; the test bed's EC2 proxy enforces it).
const DESCRIBES_IN_FLIGHT: usize = 4;

/// The lifecycle state of an instance, as EC2 reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InstanceState {
    /// Launching.
    Pending,
    /// Running.
    Running,
    /// Stopping.
    Stopping,
    /// Stopped (still exists, still owns volumes and interfaces).
    Stopped,
    /// Terminating.
    ShuttingDown,
    /// Gone for good.
    Terminated,
}

impl InstanceState {
    fn from_sdk(s: Option<&InstanceStateName>) -> InstanceState {
        match s {
            Some(InstanceStateName::Pending) => InstanceState::Pending,
            Some(InstanceStateName::Running) => InstanceState::Running,
            Some(InstanceStateName::Stopping) => InstanceState::Stopping,
            Some(InstanceStateName::Stopped) => InstanceState::Stopped,
            Some(InstanceStateName::ShuttingDown) => InstanceState::ShuttingDown,
            // An unknown or missing state is treated as live: claiming an instance is gone when
            // it is not would be the one unforgivable mistake of this tool.
            Some(InstanceStateName::Terminated) => InstanceState::Terminated,
            _ => InstanceState::Running,
        }
    }

    /// Every state but `terminated` still costs money or holds resources.
    pub fn is_live(self) -> bool {
        self != InstanceState::Terminated
    }

    /// The states Karpenter's own garbage collection treats as live (design §2.7).
    pub(crate) const LIVE_FILTER: [&'static str; 5] = ["pending", "running", "stopping", "stopped", "shutting-down"];
}

/// What the tool needs to know of one instance.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InstanceInfo {
    /// `i-...`
    pub id: String,
    /// Lifecycle state.
    pub state: InstanceState,
    /// Availability zone.
    pub zone: String,
    /// All tags.
    pub tags: BTreeMap<String, String>,
    /// The AWS service that manages it (`Operator.Principal` of a managed instance, such as
    /// `eks.amazonaws.com` for EKS Auto Mode's): such an instance is never this tool's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub managed_by: Option<String>,
    /// When it was launched, in seconds since the epoch (not part of the report).
    #[serde(skip)]
    pub launched: Option<i64>,
    /// Its instance type (not part of the report).
    #[serde(skip)]
    pub instance_type: Option<String>,
    /// `spot` for a Spot instance, `None` on demand (EC2's `InstanceLifecycle`; not part of the
    /// report).
    #[serde(skip)]
    pub market: Option<String>,
}

impl InstanceInfo {
    fn from_sdk(i: &Instance) -> InstanceInfo {
        InstanceInfo {
            id: i.instance_id().unwrap_or_default().to_string(),
            state: InstanceState::from_sdk(i.state().and_then(|s| s.name())),
            zone: i.placement().and_then(|p| p.availability_zone()).unwrap_or_default().to_string(),
            tags: i
                .tags()
                .iter()
                .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string())))
                .collect(),
            managed_by: i
                .operator()
                .filter(|o| o.managed() == Some(true))
                .map(|o| o.principal().unwrap_or("an AWS service").to_string()),
            launched: i.launch_time().map(|t| t.secs()),
            instance_type: i.instance_type().map(|t| t.as_str().to_string()),
            market: i.instance_lifecycle().map(|l| l.as_str().to_string()),
        }
    }

    /// Whether it is this cluster's self-managed Karpenter's, on its own tags and operator
    /// ([`karpenter::instance_owner`]).
    pub(crate) fn is_karpenters(&self, cluster: &str) -> Result<(), karpenter::NotOurs> {
        karpenter::instance_owner(&self.tags, self.managed_by.as_deref(), cluster)
    }

    /// The value of a tag.
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.tags.get(key).map(String::as_str)
    }
}

/// A launch template as verification reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LaunchTemplateInfo {
    /// `lt-...`
    pub id: String,
    /// `karpenter.k8s.aws/<hash>`
    pub name: String,
    /// The EC2NodeClass it was made for, from its tag.
    pub nodeclass: Option<String>,
    /// All its tags (what a rehearsal seeds its copy with; not part of the report).
    #[serde(skip)]
    pub tags: BTreeMap<String, String>,
    /// When it was created, in seconds since the epoch (not part of the report).
    #[serde(skip)]
    pub created: Option<i64>,
}

/// EC2's answer about one instance asked for by id ([`Ec2::lookup`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// Described.
    Shown(InstanceInfo),
    /// `InvalidInstanceID.NotFound`: EC2 does not know the id.
    Unknown,
    /// A successful answer that leaves the instance out.
    Silent,
}

/// A network interface or volume left behind, reported by verification.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DetachedResource {
    /// `eni-...` or `vol-...`
    pub id: String,
    /// EC2's status string (`available` for detached).
    pub status: String,
    /// Why a network interface is taken or left ([`karpenter::judge_detached_interface`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What EC2 said to a `DryRun` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DryRun {
    /// `DryRunOperation`: the request would have succeeded.
    Allowed,
    /// `UnauthorizedOperation` (or another access-denied code): the credentials lack the action.
    Denied(String),
    /// Anything else (an id EC2 no longer knows, ...): no answer about the permission.
    Inconclusive(String),
}

impl DryRun {
    /// EC2 answers every dry run with an error: `DryRunOperation` means yes. Throttling and
    /// configuration failures are errors of the call, not answers.
    fn judge(answer: Result<(), AwsError>) -> Result<DryRun, AwsError> {
        match answer {
            // a dry run never succeeds; an endpoint that says it did ignored DryRun
            Ok(()) => Ok(DryRun::Inconclusive("the endpoint ignored DryRun".into())),
            Err(e) if e.code() == Some("DryRunOperation") => Ok(DryRun::Allowed),
            Err(e) if matches!(e.code(), Some("UnauthorizedOperation" | "AccessDenied" | "AccessDeniedException")) => {
                Ok(DryRun::Denied(e.to_string()))
            }
            Err(e) if e.is_configuration() || e.is_transient() => Err(e),
            Err(e) => Ok(DryRun::Inconclusive(e.code().unwrap_or("unknown").to_string())),
        }
    }
}

/// Which instances of a cluster to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceScope {
    /// Karpenter's own garbage-collection filter: tagged with `karpenter.sh/nodepool`,
    /// `karpenter.k8s.aws/ec2nodeclass` and `eks:eks-cluster-name=<cluster>`, in a live state.
    KarpenterLive,
    /// Every instance tagged `eks:eks-cluster-name=<cluster>`, any state (identity evidence).
    ClusterAny,
}

impl InstanceScope {
    /// Whether a described instance is in the scope for `cluster`. Under `KarpenterLive` a
    /// `shutting-down` instance still counts: until EC2 says `terminated` it costs money and holds
    /// its volumes.
    pub(crate) fn admits(self, i: &InstanceInfo, cluster: &str) -> bool {
        i.tag(karpenter::TAG_EKS_CLUSTER) == Some(cluster)
            && (self == InstanceScope::ClusterAny || (i.is_karpenters(cluster).is_ok() && i.state.is_live()))
    }
}

/// Outcome of a batched termination.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TerminateOutcome {
    /// Ids EC2 accepted (now shutting-down or terminated).
    pub accepted: Vec<String>,
    /// Ids EC2 does not know (already gone long ago, or never launched): done.
    pub not_found: Vec<String>,
    /// Ids that failed for another reason, with the error.
    pub failed: Vec<(String, String)>,
}

/// How many refusals for throttling in a row [`paced_terminations`] takes before it gives up. Each
/// comes after the SDK's own retries and empties the model, so the next call waits for a second of
/// refill and is as small as a call gets: eight in a row mean the account's bucket is being spent
/// by someone else as fast as it refills.
const THROTTLED_IN_A_ROW: usize = 8;

/// The pacer's model, locked: a panic elsewhere while it was held leaves a model still worth using.
fn model_of(pacer: &Mutex<TerminatePacer>) -> std::sync::MutexGuard<'_, TerminatePacer> {
    pacer.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sends `ids` to `send` in calls the pacer allows, sleeping on `clock` while the bucket refills.
/// A throttled call is sent again once the (emptied) model allows; any other error ends it.
async fn paced_terminations<C, F, Fut>(
    pacer: &Mutex<TerminatePacer>,
    ids: &[String],
    clock: &C,
    mut send: F,
) -> Result<TerminateOutcome, AwsError>
where
    C: Clock,
    F: FnMut(Vec<String>) -> Fut,
    Fut: Future<Output = Result<TerminateOutcome, AwsError>>,
{
    let model = || model_of(pacer);
    let mut outcome = TerminateOutcome::default();
    let mut rest = ids;
    let mut throttled = 0;
    while !rest.is_empty() {
        let pace = model().next(rest.len(), TERMINATE_BATCH, clock.now());
        let n = match pace {
            Pace::After(wait) => {
                clock.sleep(wait).await;
                continue;
            }
            Pace::Now(n) => n.clamp(1, rest.len()),
        };
        let (call, later) = rest.split_at(n);
        match send(call.to_vec()).await {
            Ok(out) => {
                model().spent(n, clock.now());
                throttled = 0;
                outcome.accepted.extend(out.accepted);
                outcome.not_found.extend(out.not_found);
                outcome.failed.extend(out.failed);
                rest = later;
            }
            Err(e) if e.is_throttling() && throttled + 1 < THROTTLED_IN_A_ROW => {
                model().refused(clock.now());
                throttled += 1;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(outcome)
}

/// The EC2 client of one region.
#[derive(Clone, Debug)]
pub struct Ec2 {
    client: aws_sdk_ec2::Client,
    endpoint: String,
    /// The region's `TerminateInstances` bucket as [`Ec2::terminate_paced`] models it, shared by
    /// every clone: a sweep reclaims cluster after cluster in one region from the same bucket.
    pacer: Arc<Mutex<TerminatePacer>>,
}

impl Ec2 {
    pub(crate) fn new(client: aws_sdk_ec2::Client, endpoint: String) -> Ec2 {
        let pacer = Arc::new(Mutex::new(TerminatePacer::new(WallClock.now())));
        Ec2 { client, endpoint, pacer }
    }

    fn err<E, R>(&self, op: &'static str, e: aws_sdk_ec2::error::SdkError<E, R>) -> AwsError
    where
        E: aws_sdk_ec2::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug,
    {
        AwsError::from_sdk("ec2", op, &self.endpoint, e)
    }

    /// Lists a cluster's instances, all pages. EC2 filters by the cluster's tag (and, for
    /// `KarpenterLive`, by Karpenter's NodePool tag and a live state), so an account that many
    /// clusters share is not read whole; [`InstanceScope::admits`] then checks every condition
    /// again here, because EC2 reads `*` and `?` in a filter value as wildcards.
    pub async fn cluster_instances(&self, cluster: &str, scope: InstanceScope) -> Result<Vec<InstanceInfo>, AwsError> {
        let mut filters = vec![tag_filter(karpenter::TAG_EKS_CLUSTER, cluster)];
        if scope == InstanceScope::KarpenterLive {
            filters.push(tag_key_filter(karpenter::TAG_NODEPOOL));
            filters.push(live_state_filter());
        }
        let all = self.describe(Some(filters)).await?;
        Ok(all.into_iter().filter(|i| scope.admits(i, cluster)).collect())
    }

    /// The live instances of `cluster`'s Karpenter ([`InstanceInfo::is_karpenters`]) that carry
    /// every tag of `tags`: those tagged for a NodeClaim (`karpenter.sh/nodeclaim`, which
    /// Karpenter's tagging controller writes once the claim has named its instance), or those
    /// launched for a NodePool and EC2NodeClass (the tags Karpenter launches with, the candidates
    /// for a claim that names no instance: [`crate::evidence::launch_of_claim`] decides). EC2
    /// reads `*` and `?` in a filter value as wildcards, so every tag is checked again here.
    pub async fn live_instances_tagged(
        &self,
        cluster: &str,
        tags: &[(&str, &str)],
    ) -> Result<Vec<InstanceInfo>, AwsError> {
        let mut filters = vec![tag_filter(karpenter::TAG_EKS_CLUSTER, cluster), live_state_filter()];
        filters.extend(tags.iter().map(|(k, v)| tag_filter(k, v)));
        let all = self.describe(Some(filters)).await?;
        Ok(all
            .into_iter()
            .filter(|i| {
                tags.iter().all(|(k, v)| i.tag(k) == Some(*v)) && i.state.is_live() && i.is_karpenters(cluster).is_ok()
            })
            .collect())
    }

    /// Looks up instances by id; ids EC2 no longer knows are simply absent from the result.
    pub async fn instances_by_id(&self, ids: &[String]) -> Result<Vec<InstanceInfo>, AwsError> {
        self.by_id(ids, None).await
    }

    /// Those of `ids` that are live, for a wait until they are gone: EC2 keeps a `terminated`
    /// instance in its answers for about an hour (the TerminateInstances reference), so without
    /// the state filter a poll's answer describes in full every instance whose termination it
    /// confirms. Absent means `terminated` or unknown to EC2, the same reading as
    /// [`InstanceState::is_live`] (EC2 has no state besides these five and `terminated`);
    /// verification proves the end with this filter too.
    pub async fn live_instances_by_id(&self, ids: &[String]) -> Result<Vec<InstanceInfo>, AwsError> {
        self.by_id(ids, Some(live_state_filter())).await
    }

    async fn by_id(&self, ids: &[String], state: Option<Filter>) -> Result<Vec<InstanceInfo>, AwsError> {
        // EC2 counts the values of all of a call's filters against its limit, not each filter's
        let other_values = state.as_ref().map_or(0, |f| f.values().len());
        // at least one id a call: a filter of 200 values or more would be EC2's refusal to
        // report, not a chunk size of zero (which would panic)
        let per_call = FILTER_VALUES_MAX.saturating_sub(other_values).max(1);
        // Owned chunks: a future borrowing a slice of `ids` makes the stream's type
        // lifetime-generic, which the spawned batcher's future cannot name.
        let chunks: Vec<Vec<String>> = ids.chunks(per_call).map(<[String]>::to_vec).collect();
        let pages: Vec<Vec<InstanceInfo>> = stream::iter(chunks)
            .map(|chunk| {
                // Filtering on instance-id instead of passing InstanceIds keeps one unknown id
                // from failing the whole call with InvalidInstanceID.NotFound (and InstanceIds
                // cannot be combined with MaxResults).
                let f = Filter::builder().name("instance-id").set_values(Some(chunk)).build();
                self.describe(Some([Some(f), state.clone()].into_iter().flatten().collect()))
            })
            .buffered(DESCRIBES_IN_FLIGHT)
            .try_collect()
            .await?;
        Ok(pages.into_iter().flatten().collect())
    }

    /// Asks EC2 about one instance by id (`InstanceIds`, not a filter): whether it shows the
    /// instance, says in so many words that it does not know it (`InvalidInstanceID.NotFound`),
    /// or answers without it. Only the second is EC2's word that the instance is gone.
    pub(crate) async fn lookup(&self, id: &str) -> Result<Lookup, AwsError> {
        match self.client.describe_instances().instance_ids(id).send().await {
            Ok(out) => {
                let found = out.reservations().iter().flat_map(|r| r.instances()).find(|i| i.instance_id() == Some(id));
                Ok(found.map_or(Lookup::Silent, |i| Lookup::Shown(InstanceInfo::from_sdk(i))))
            }
            Err(e) => {
                let e = self.err("DescribeInstances", e);
                if e.code() == Some("InvalidInstanceID.NotFound") { Ok(Lookup::Unknown) } else { Err(e) }
            }
        }
    }

    async fn describe(&self, filters: Option<Vec<Filter>>) -> Result<Vec<InstanceInfo>, AwsError> {
        let mut pages = self
            .client
            .describe_instances()
            .set_filters(filters)
            .max_results(DESCRIBE_INSTANCES_PAGE)
            .into_paginator()
            .send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("DescribeInstances", e))?;
            for r in page.reservations() {
                out.extend(r.instances().iter().map(InstanceInfo::from_sdk));
            }
        }
        Ok(out)
    }

    /// Terminates instances in batches of at most 500. A batch that EC2 refuses as a whole (one
    /// bad id fails the call, design §5) is retried one id at a time so the good ids still go.
    pub async fn terminate(&self, ids: &[String]) -> Result<TerminateOutcome, AwsError> {
        let mut outcome = TerminateOutcome::default();
        for chunk in ids.chunks(TERMINATE_BATCH) {
            match self.terminate_call(chunk).await {
                Ok(accepted) => outcome.accepted.extend(accepted),
                // throttling that outlasted the SDK's retries, or no access at all: one call per
                // id would only make it worse; the caller tries again later or reports it
                Err(e) if e.is_configuration() || e.is_transient() => return Err(e),
                Err(_) => {
                    for id in chunk {
                        match self.terminate_call(std::slice::from_ref(id)).await {
                            Ok(accepted) => outcome.accepted.extend(accepted),
                            Err(e) if e.code().is_some_and(is_not_found) => outcome.not_found.push(id.clone()),
                            // throttled one id at a time: the ids sent so far are terminating,
                            // and asking again for them is harmless, so the caller tries again later
                            Err(e) if e.is_configuration() || e.is_transient() => return Err(e),
                            Err(e) => outcome.failed.push((id.clone(), e.to_string())),
                        }
                    }
                }
            }
        }
        Ok(outcome)
    }

    /// Terminates any number of instances at the pace EC2's resource bucket allows (see
    /// [`super::pacing`]): what the engine's batcher does for a run, for the reclaims of `verify`
    /// and `sweep`, which may hold thousands of instances of a region at once.
    pub(crate) async fn terminate_paced(&self, ids: &[String]) -> Result<TerminateOutcome, AwsError> {
        paced_terminations(&self.pacer, ids, &WallClock, |chunk| async move { self.terminate(&chunk).await }).await
    }

    async fn terminate_call(&self, ids: &[String]) -> Result<Vec<String>, AwsError> {
        let out = self
            .client
            .terminate_instances()
            .set_instance_ids(Some(ids.to_vec()))
            .send()
            .await
            .map_err(|e| self.err("TerminateInstances", e))?;
        Ok(out.terminating_instances().iter().filter_map(|c| c.instance_id().map(str::to_string)).collect())
    }

    /// Asks EC2 whether these credentials may terminate `ids` (`DryRun`: nothing is terminated).
    /// EC2 may count a dry run's instances against its resource bucket (it does not say), so the
    /// model counts them too.
    pub(crate) async fn terminate_dry_run(&self, ids: &[String]) -> Result<DryRun, AwsError> {
        let answer = self.client.terminate_instances().set_instance_ids(Some(ids.to_vec())).dry_run(true).send().await;
        model_of(&self.pacer).spent(ids.len(), WallClock.now());
        DryRun::judge(answer.map(|_| ()).map_err(|e| self.err("TerminateInstances", e)))
    }

    /// Asks EC2 whether these credentials may delete the launch template (`DryRun`).
    pub(crate) async fn delete_launch_template_dry_run(&self, id: &str) -> Result<DryRun, AwsError> {
        let answer = self.client.delete_launch_template().launch_template_id(id).dry_run(true).send().await;
        DryRun::judge(answer.map(|_| ()).map_err(|e| self.err("DeleteLaunchTemplate", e)))
    }

    /// The cluster's Karpenter launch templates, under both tag schemes (1.1+ tags
    /// `eks:eks-cluster-name`, 1.0.x tagged `karpenter.k8s.aws/cluster`).
    pub async fn launch_templates(&self, cluster: &str) -> Result<Vec<LaunchTemplateInfo>, AwsError> {
        let mut out: BTreeMap<String, LaunchTemplateInfo> = BTreeMap::new();
        for key in [karpenter::TAG_EKS_CLUSTER, karpenter::TAG_LEGACY_CLUSTER] {
            let mut pages = self
                .client
                .describe_launch_templates()
                .filters(tag_filter(key, cluster))
                .max_results(DESCRIBE_LAUNCH_TEMPLATES_PAGE)
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| self.err("DescribeLaunchTemplates", e))?;
                // The name prefix keeps templates the cluster's other tooling made (tagged with
                // the cluster too) out of our hands.
                for info in page.launch_templates().iter().filter_map(karpenters_template) {
                    out.insert(info.id.clone(), info);
                }
            }
        }
        Ok(out.into_values().collect())
    }

    /// Every live instance (stopped ones included) of any cluster's Karpenter in the region, by
    /// the tag keys its generations launch with (`karpenter.sh/nodepool`; before 1.0
    /// `karpenter.sh/managed-by` and the alpha `karpenter.sh/provisioner-name`): what `sweep`
    /// attributes to clusters by their other tags.
    pub async fn karpenter_instances_anywhere(&self) -> Result<Vec<InstanceInfo>, AwsError> {
        let keys = [karpenter::TAG_NODEPOOL, karpenter::TAG_PROVISIONER, karpenter::TAG_MANAGED_BY];
        let by_key = Filter::builder().name("tag-key").set_values(Some(keys.map(str::to_string).to_vec())).build();
        let all = self.describe(Some(vec![by_key, live_state_filter()])).await?;
        Ok(all.into_iter().filter(|i| i.state.is_live() && keys.iter().any(|k| i.tags.contains_key(*k))).collect())
    }

    /// Every launch template of any cluster's Karpenter in the region (named
    /// `karpenter.k8s.aws/<hash>`), whichever cluster its tags name.
    pub async fn karpenter_launch_templates_anywhere(&self) -> Result<Vec<LaunchTemplateInfo>, AwsError> {
        let mut out = Vec::new();
        let mut pages =
            self.client.describe_launch_templates().max_results(DESCRIBE_LAUNCH_TEMPLATES_PAGE).into_paginator().send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("DescribeLaunchTemplates", e))?;
            out.extend(page.launch_templates().iter().filter_map(karpenters_template));
        }
        Ok(out)
    }

    /// An instance's user data, decoded (`DescribeInstanceAttribute`); `None` when it has none or
    /// EC2 no longer knows it.
    pub async fn instance_user_data(&self, id: &str) -> Result<Option<String>, AwsError> {
        let out = match self
            .client
            .describe_instance_attribute()
            .instance_id(id)
            .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) => {
                let e = self.err("DescribeInstanceAttribute", e);
                return if e.code().is_some_and(is_not_found) { Ok(None) } else { Err(e) };
            }
        };
        Ok(out.user_data().and_then(|v| v.value()).and_then(decode_user_data))
    }

    /// EC2's current spot prices of a Linux `instance_type`, as (zone, time in seconds since the
    /// epoch, hourly price in USD) per record, as Karpenter asks for them (`UpdateSpotPricing`:
    /// the Linux product descriptions, from now).
    pub(crate) async fn spot_prices(&self, instance_type: &str) -> Result<Vec<(String, i64, String)>, AwsError> {
        let out = self
            .client
            .describe_spot_price_history()
            .instance_types(aws_sdk_ec2::types::InstanceType::from(instance_type))
            .product_descriptions("Linux/UNIX")
            .product_descriptions("Linux/UNIX (Amazon VPC)")
            .start_time(aws_sdk_ec2::primitives::DateTime::from(std::time::SystemTime::now()))
            .send()
            .await
            .map_err(|e| self.err("DescribeSpotPriceHistory", e))?;
        Ok(out
            .spot_price_history()
            .iter()
            .filter_map(|r| {
                let zone = r.availability_zone()?.to_string();
                let at = r.timestamp().map_or(0, |t| t.secs());
                Some((zone, at, r.spot_price()?.to_string()))
            })
            .collect())
    }

    /// The user data of a launch template's latest version, decoded; `None` when it has none or
    /// EC2 no longer knows it.
    pub async fn launch_template_user_data(&self, id: &str) -> Result<Option<String>, AwsError> {
        let out = match self
            .client
            .describe_launch_template_versions()
            .launch_template_id(id)
            .versions("$Latest")
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) => {
                let e = self.err("DescribeLaunchTemplateVersions", e);
                return if e.code().is_some_and(is_not_found) { Ok(None) } else { Err(e) };
            }
        };
        Ok(out
            .launch_template_versions()
            .first()
            .and_then(|v| v.launch_template_data())
            .and_then(|d| d.user_data())
            .and_then(decode_user_data))
    }

    /// Deletes a launch template; one already gone counts as deleted.
    pub async fn delete_launch_template(&self, id: &str) -> Result<(), AwsError> {
        match self.client.delete_launch_template().launch_template_id(id).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = self.err("DeleteLaunchTemplate", e);
                if e.code().is_some_and(is_not_found) { Ok(()) } else { Err(e) }
            }
        }
    }

    /// The cluster's network interfaces that are detached (`available`): those tagged
    /// `kubernetes.io/cluster/<c>` (Karpenter's and the VPC resource controller's carry it) and
    /// those the VPC CNI made for the cluster's nodes, tagged `cluster.k8s.amazonaws.com/name=<c>`
    /// (it sets that tag only when its CLUSTER_NAME is set, which EKS's managed add-on does). A
    /// detached interface blocks the VPC's deletion. Each is judged by
    /// [`karpenter::judge_detached_interface`]: the first list is what `--reclaim` may delete, the
    /// second what is left to its owner (or to no one), each with its reason.
    pub(crate) async fn detached_network_interfaces(
        &self,
        cluster: &str,
    ) -> Result<(Vec<DetachedResource>, Vec<DetachedResource>), AwsError> {
        let now = std::time::SystemTime::now();
        let (mut taken, mut left) = (BTreeMap::new(), BTreeMap::new());
        let selectors =
            [tag_key_filter(&karpenter::cluster_tag_key(cluster)), tag_filter(karpenter::TAG_VPC_CNI_CLUSTER, cluster)];
        for selector in selectors {
            let mut pages = self
                .client
                .describe_network_interfaces()
                .filters(Filter::builder().name("status").values("available").build())
                .filters(selector)
                .max_results(DESCRIBE_NETWORK_INTERFACES_PAGE)
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| self.err("DescribeNetworkInterfaces", e))?;
                for ni in page.network_interfaces() {
                    let tags: BTreeMap<String, String> = ni
                        .tag_set()
                        .iter()
                        .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string())))
                        .collect();
                    let verdict =
                        karpenter::judge_detached_interface(ni.description().unwrap_or_default(), &tags, cluster, now);
                    let id = ni.network_interface_id().unwrap_or_default().to_string();
                    let status = ni.status().map(|s| s.as_str().to_string()).unwrap_or_default();
                    let (list, reason) = match verdict {
                        karpenter::InterfaceVerdict::Reclaim(r) => (&mut taken, r),
                        karpenter::InterfaceVerdict::Leave(r) => (&mut left, r),
                    };
                    list.insert(id.clone(), DetachedResource { id, status, reason: Some(reason) });
                }
            }
        }
        Ok((taken.into_values().collect(), left.into_values().collect()))
    }

    /// Asks EC2 whether these credentials may delete the network interface (`DryRun`).
    pub(crate) async fn delete_network_interface_dry_run(&self, id: &str) -> Result<DryRun, AwsError> {
        let answer = self.client.delete_network_interface().network_interface_id(id).dry_run(true).send().await;
        DryRun::judge(answer.map(|_| ()).map_err(|e| self.err("DeleteNetworkInterface", e)))
    }

    /// Deletes a detached network interface; one already gone counts as deleted.
    pub async fn delete_network_interface(&self, id: &str) -> Result<(), AwsError> {
        match self.client.delete_network_interface().network_interface_id(id).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = self.err("DeleteNetworkInterface", e);
                if e.code().is_some_and(is_not_found) { Ok(()) } else { Err(e) }
            }
        }
    }

    /// The cluster's detached (`available`) volumes, by the tags that name this cluster: its
    /// `kubernetes.io/cluster/<name>` and the EBS CSI driver's `ebs.csi.aws.com/cluster-name`
    /// (never by `ebs.csi.aws.com/cluster=true`, which every cluster's driver writes). Reported,
    /// never deleted: they may hold data.
    pub(crate) async fn detached_volumes(&self, cluster: &str) -> Result<Vec<DetachedResource>, AwsError> {
        let mut found = BTreeMap::new();
        for selector in
            [tag_key_filter(&karpenter::cluster_tag_key(cluster)), tag_filter(TAG_EBS_CSI_CLUSTER_NAME, cluster)]
        {
            let mut pages = self
                .client
                .describe_volumes()
                .filters(Filter::builder().name("status").values("available").build())
                .filters(selector)
                .max_results(DESCRIBE_VOLUMES_PAGE)
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| self.err("DescribeVolumes", e))?;
                for v in page.volumes() {
                    let id = v.volume_id().unwrap_or_default().to_string();
                    let status = v.state().map(|s| s.as_str().to_string()).unwrap_or_default();
                    found.insert(id.clone(), DetachedResource { id, status, reason: None });
                }
            }
        }
        Ok(found.into_values().collect())
    }
}

impl Ec2 {
    /// Which of `volumes` (volume id, the PersistentVolume it was for) EC2 still has, in any
    /// state: a volume the EBS CSI driver was to delete with its PV, read by the id the run found
    /// on the PV (the driver tags a volume with its cluster only when told to).
    pub(crate) async fn volumes_of_volume_claims(
        &self,
        volumes: &BTreeMap<String, String>,
    ) -> Result<Vec<DetachedResource>, AwsError> {
        let ids: Vec<String> = volumes.keys().cloned().collect();
        let mut out = Vec::new();
        for chunk in ids.chunks(FILTER_VALUES_MAX) {
            let mut pages = self
                .client
                .describe_volumes()
                .filters(Filter::builder().name("volume-id").set_values(Some(chunk.to_vec())).build())
                .max_results(DESCRIBE_VOLUMES_PAGE)
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| self.err("DescribeVolumes", e))?;
                for v in page.volumes() {
                    let id = v.volume_id().unwrap_or_default().to_string();
                    let pv = volumes.get(&id).cloned().unwrap_or_default();
                    out.push(DetachedResource {
                        status: v.state().map(|s| s.as_str().to_string()).unwrap_or_default(),
                        reason: Some(format!("the EBS volume of PersistentVolume {pv} (reclaim policy Delete), still in EC2: the EBS CSI controller deletes it with the PV, if it runs then")),
                        id,
                    });
                }
            }
        }
        Ok(out)
    }

    /// The security groups tagged `key=value`, each as (id, name, tags), all pages.
    pub(crate) async fn security_groups_tagged(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<(String, String, BTreeMap<String, String>)>, AwsError> {
        let mut pages = self
            .client
            .describe_security_groups()
            .filters(tag_filter(key, value))
            .max_results(DESCRIBE_SECURITY_GROUPS_PAGE)
            .into_paginator()
            .send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("DescribeSecurityGroups", e))?;
            for g in page.security_groups() {
                let tags = g
                    .tags()
                    .iter()
                    .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string())));
                out.push((
                    g.group_id().unwrap_or_default().to_string(),
                    g.group_name().unwrap_or_default().to_string(),
                    tags.collect(),
                ));
            }
        }
        Ok(out)
    }
}

/// A launch template as the tool reports it, when it is named as Karpenter names its own.
fn karpenters_template(lt: &aws_sdk_ec2::types::LaunchTemplate) -> Option<LaunchTemplateInfo> {
    let name = lt.launch_template_name().unwrap_or_default();
    if !name.starts_with(karpenter::LAUNCH_TEMPLATE_PREFIX) {
        return None;
    }
    let tags: BTreeMap<String, String> = lt
        .tags()
        .iter()
        .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string())))
        .collect();
    Some(LaunchTemplateInfo {
        id: lt.launch_template_id().unwrap_or_default().to_string(),
        name: name.to_string(),
        nodeclass: tags.get(karpenter::TAG_NODECLASS).cloned(),
        tags,
        created: lt.create_time().map(|t| t.secs()),
    })
}

/// User data as EC2 returns it (base64), as text; what does not decode is none.
fn decode_user_data(b64: &str) -> Option<String> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

fn live_state_filter() -> Filter {
    Filter::builder()
        .name("instance-state-name")
        .set_values(Some(InstanceState::LIVE_FILTER.iter().map(|s| s.to_string()).collect()))
        .build()
}

fn tag_filter(key: &str, value: &str) -> Filter {
    Filter::builder().name(format!("tag:{key}")).values(value).build()
}

fn tag_key_filter(key: &str) -> Filter {
    Filter::builder().name("tag-key").values(key).build()
}

/// EC2's codes for "this id does not exist (any more)".
fn is_not_found(code: &str) -> bool {
    code.starts_with("InvalidInstanceID")
        || code.starts_with("InvalidLaunchTemplateId")
        || code.starts_with("InvalidLaunchTemplateName")
        || code == "InvalidNetworkInterfaceID.NotFound"
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::aws::pacing::{TERMINATE_BUCKET, TERMINATE_REFILL_PER_SEC};

    /// Time that passes only when the code under test sleeps.
    struct TestClock(Cell<Instant>);

    impl Clock for TestClock {
        fn now(&self) -> Instant {
            self.0.get()
        }
        fn sleep(&self, d: Duration) -> impl Future<Output = ()> {
            self.0.set(self.0.get() + d);
            std::future::ready(())
        }
    }

    /// EC2's resource bucket for `TerminateInstances`: a call for more instances than it holds is
    /// refused whole, as EC2 does. `others` is what other spenders take at the start.
    struct Bucket {
        tokens: f64,
        at: Instant,
        sent: Vec<String>,
        calls: usize,
        refused: usize,
    }

    impl Bucket {
        fn new(at: Instant, others: f64) -> Bucket {
            Bucket { tokens: TERMINATE_BUCKET - others, at, sent: Vec::new(), calls: 0, refused: 0 }
        }
        fn call(&mut self, ids: Vec<String>, now: Instant) -> Result<TerminateOutcome, AwsError> {
            self.calls += 1;
            let elapsed = now.duration_since(self.at).as_secs_f64();
            self.tokens = (self.tokens + elapsed * TERMINATE_REFILL_PER_SEC).min(TERMINATE_BUCKET);
            self.at = now;
            if (ids.len() as f64) > self.tokens {
                self.refused += 1;
                return Err(throttled());
            }
            self.tokens -= ids.len() as f64;
            self.sent.extend(ids.iter().cloned());
            Ok(TerminateOutcome { accepted: ids, ..TerminateOutcome::default() })
        }
    }

    fn throttled() -> AwsError {
        AwsError::Api {
            service: "ec2",
            operation: "TerminateInstances",
            code: "RequestLimitExceeded".into(),
            message: "Request limit exceeded.".into(),
        }
    }

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("i-{i:017x}")).collect()
    }

    /// `n` instances paced into EC2's bucket, of which `others` took as much just before: the
    /// outcome, the bucket afterwards, and the seconds it took.
    async fn run(n: usize, others: f64) -> (Result<TerminateOutcome, AwsError>, Bucket, f64) {
        let t0 = Instant::now();
        let clock = TestClock(Cell::new(t0));
        let bucket = RefCell::new(Bucket::new(t0, others));
        let pacer = Mutex::new(TerminatePacer::new(t0));
        let out = paced_terminations(&pacer, &ids(n), &clock, |call| {
            let answer = bucket.borrow_mut().call(call, clock.now());
            async move { answer }
        })
        .await;
        (out, bucket.into_inner(), clock.now().duration_since(t0).as_secs_f64())
    }

    #[tokio::test]
    async fn five_thousand_instances_go_at_the_buckets_pace_without_one_refusal() {
        let (out, b, took) = run(5000, 0.0).await;
        let out = out.expect("every call accepted");
        assert_eq!(out.accepted.len(), 5000);
        assert_eq!(b.sent, ids(5000), "each instance sent once, in order");
        assert_eq!(b.refused, 0);
        // EC2's floor: 1,000 at once, the other 4,000 at 20 a second
        assert!((200.0..=201.0).contains(&took), "took {took} s");
    }

    #[tokio::test]
    async fn a_bucket_another_spender_emptied_costs_one_refusal_and_then_the_pace_holds() {
        // someone terminated 900 instances just before: the model believes the bucket full
        let (out, b, _) = run(1200, 900.0).await;
        let out = out.expect("every call accepted in the end");
        assert_eq!(out.accepted.len(), 1200);
        assert_eq!(b.sent, ids(1200), "a refused call is sent again, nothing twice");
        assert_eq!(b.refused, 1);
    }

    #[tokio::test]
    async fn throttling_that_never_ends_gives_up_after_a_bounded_number_of_calls() {
        let t0 = Instant::now();
        let clock = TestClock(Cell::new(t0));
        let calls = Cell::new(0);
        let pacer = Mutex::new(TerminatePacer::new(t0));
        let err = paced_terminations(&pacer, &ids(10), &clock, |_| {
            calls.set(calls.get() + 1);
            async { Err(throttled()) }
        })
        .await
        .expect_err("a bucket that never refills is an error");
        assert!(err.is_throttling());
        assert_eq!(calls.get(), THROTTLED_IN_A_ROW);
    }
}
