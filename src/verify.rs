//! The EC2 proof: what of the cluster's Karpenter is still there, read through AWS with
//! Karpenter's own filter, twice, some seconds apart (design §2.7), and reclaimed when asked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::aws::ec2::{DetachedResource, InstanceScope, LaunchTemplateInfo};
use crate::aws::{AwsClients, AwsError, InstanceInfo, InstanceProfileInfo, LoadBalancing};

/// What AWS still holds of the cluster's Karpenter.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Leftovers {
    /// Live instances with Karpenter's tags for this cluster.
    pub instances: Vec<InstanceInfo>,
    /// Karpenter launch templates of the cluster.
    pub launch_templates: Vec<LaunchTemplateInfo>,
    /// Karpenter instance profiles of the cluster.
    pub instance_profiles: Vec<InstanceProfileInfo>,
    /// Detached network interfaces of the cluster that the tool may delete, each with why
    /// ([`crate::karpenter::judge_detached_interface`]).
    pub network_interfaces: Vec<DetachedResource>,
    /// Detached network interfaces tagged for the cluster that the tool leaves alone (the VPC
    /// resource controller's, the VPC CNI's inside its cool-down, ones no owner of which is
    /// known), each with why: reported, never deleted, not counted against a clean result.
    pub network_interfaces_left: Vec<DetachedResource>,
    /// Detached volumes tagged for the cluster: reported, never deleted (they may hold data),
    /// and not counted against a clean result.
    pub volumes: Vec<DetachedResource>,
    /// Load balancers, target groups and security groups this cluster's cleanup controllers
    /// made ([`crate::cleanup::judge_load_balancing`]): reported, never deleted, and not counted
    /// against a clean result (their controllers delete them with their Services and Ingresses,
    /// which outlive the compute this tool removes).
    pub load_balancing: Vec<LoadBalancing>,
    /// Karpenter objects still in the cluster (`NodeClaim/x`, `Node/y`, ...); filled by `run`.
    pub objects: Vec<String>,
}

impl Leftovers {
    /// True when nothing that counts is left (volumes and the interfaces left alone do not count,
    /// see above).
    pub fn is_clean(&self) -> bool {
        self.instances.is_empty()
            && self.launch_templates.is_empty()
            && self.instance_profiles.is_empty()
            && self.network_interfaces.is_empty()
            && self.objects.is_empty()
    }

    /// What [`reclaim`] would remove, one line per kind (everything but volumes, the interfaces
    /// left alone and the cluster's objects, which only a teardown removes).
    pub fn reclaimable(&self) -> Vec<String> {
        Leftovers {
            volumes: Vec::new(),
            network_interfaces_left: Vec::new(),
            load_balancing: Vec::new(),
            objects: Vec::new(),
            ..self.clone()
        }
        .describe()
    }

    /// Adds volumes found by id to those found by tag, once each.
    pub(crate) fn add_volumes(&mut self, found: Vec<DetachedResource>) {
        for v in found {
            match self.volumes.iter_mut().find(|known| known.id == v.id) {
                Some(known) => known.reason = known.reason.take().or(v.reason),
                None => self.volumes.push(v),
            }
        }
    }

    /// One line per kind with the ids, for the human summary.
    pub(crate) fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut line = |what: &str, ids: Vec<&str>| {
            if !ids.is_empty() {
                out.push(format!("{} {what}: {}", ids.len(), ids.join(", ")));
            }
        };
        line("instance(s)", self.instances.iter().map(|i| i.id.as_str()).collect());
        line("launch template(s)", self.launch_templates.iter().map(|l| l.name.as_str()).collect());
        line("instance profile(s)", self.instance_profiles.iter().map(|p| p.name.as_str()).collect());
        line("detached network interface(s)", self.network_interfaces.iter().map(|n| n.id.as_str()).collect());
        line("Kubernetes object(s)", self.objects.iter().map(String::as_str).collect());
        line(
            "detached network interface(s) left to their owner (never deleted)",
            self.network_interfaces_left.iter().map(|n| n.id.as_str()).collect(),
        );
        line("detached volume(s) (reported only, never deleted)", self.volumes.iter().map(|v| v.id.as_str()).collect());
        line(
            "load balancer(s), target group(s) and security group(s) of the cluster's cleanup controllers (reported only, never deleted)",
            self.load_balancing.iter().map(|l| l.name.as_str()).collect(),
        );
        out
    }
}

/// What one read of AWS returned, before [`leftovers`] judges it. The launch templates, instance
/// profiles, interfaces and volumes are already the cluster's as they are read (by tag on EC2's
/// side, and by the checks in [`crate::karpenter`] on ours); the instances are not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Described {
    /// Every instance in a live state, of any cluster.
    pub instances: Vec<InstanceInfo>,
    /// The cluster's Karpenter launch templates.
    pub launch_templates: Vec<LaunchTemplateInfo>,
    /// The cluster's Karpenter instance profiles, the user's among them.
    pub instance_profiles: Vec<InstanceProfileInfo>,
    /// The cluster's detached network interfaces that may be reclaimed.
    pub network_interfaces: Vec<DetachedResource>,
    /// The cluster's detached network interfaces that are left alone.
    pub network_interfaces_left: Vec<DetachedResource>,
    /// The cluster's detached volumes.
    pub volumes: Vec<DetachedResource>,
    /// The cluster's cleanup controllers' load balancers, target groups and security groups.
    pub load_balancing: Vec<LoadBalancing>,
}

/// What of a read counts as left of the cluster's Karpenter: the instances Karpenter's own
/// garbage collection would take for its own ([`InstanceScope::KarpenterLive`]), and every
/// instance profile but the user's (`user_profiles`: named by an EC2NodeClass's
/// `spec.instanceProfile`, never counted even when they look like Karpenter's). The rest is
/// taken as read; volumes are kept to be reported, [`Leftovers::is_clean`] does not count them.
pub(crate) fn leftovers(described: Described, cluster: &str, user_profiles: &BTreeSet<String>) -> Leftovers {
    let Described {
        instances,
        launch_templates,
        instance_profiles,
        network_interfaces,
        network_interfaces_left,
        volumes,
        load_balancing,
    } = described;
    Leftovers {
        instances: instances.into_iter().filter(|i| InstanceScope::KarpenterLive.admits(i, cluster)).collect(),
        launch_templates,
        instance_profiles: instance_profiles.into_iter().filter(|p| !user_profiles.contains(&p.name)).collect(),
        network_interfaces,
        network_interfaces_left,
        volumes,
        load_balancing,
        objects: Vec::new(),
    }
}

/// Reads everything once and judges it with [`leftovers`].
pub async fn collect(aws: &AwsClients, cluster: &str, user_profiles: &BTreeSet<String>) -> Result<Leftovers, AwsError> {
    let (
        instances,
        launch_templates,
        instance_profiles,
        (network_interfaces, network_interfaces_left),
        volumes,
        load_balancing,
    ) = tokio::try_join!(
        aws.ec2.cluster_instances(cluster, InstanceScope::KarpenterLive),
        aws.ec2.launch_templates(cluster),
        aws.iam.cluster_instance_profiles(aws.region(), cluster),
        aws.ec2.detached_network_interfaces(cluster),
        aws.ec2.detached_volumes(cluster),
        load_balancing(aws, cluster),
    )?;
    let described = Described {
        instances,
        launch_templates,
        instance_profiles,
        network_interfaces,
        network_interfaces_left,
        volumes,
        load_balancing,
    };
    Ok(leftovers(described, cluster, user_profiles))
}

/// What this cluster's cleanup controllers left in Elastic Load Balancing and EC2: ELBv2 load
/// balancers and target groups, classic load balancers, and their security groups.
pub async fn load_balancing(aws: &AwsClients, cluster: &str) -> Result<Vec<LoadBalancing>, AwsError> {
    let (lbs, tgs, classic, sgs) = tokio::try_join!(
        aws.elb.load_balancers(cluster),
        aws.elb.target_groups(cluster),
        aws.elb.classic_load_balancers(cluster),
        aws.ec2.load_balancing_security_groups(cluster),
    )?;
    Ok([lbs, tgs, classic, sgs].concat())
}

/// Verifies: two reads must both be clean, the second `settle` after the last moment a launch
/// could have started, to catch a launch that was in flight during the first (the instance of a
/// `RunInstances`/`CreateFleet` call takes some seconds to show in `DescribeInstances`). That
/// moment is `quiet_since` when the run has seen Karpenter's controller gone (nothing can launch
/// after it: the pause is what is left of `settle`, often nothing once the finalizers and classes
/// have been dealt with), and the first read otherwise. Returns the leftovers of the read that
/// was not clean (or the last one).
pub async fn verify(
    aws: &AwsClients,
    cluster: &str,
    user_profiles: &BTreeSet<String>,
    settle: Duration,
    quiet_since: Option<Instant>,
) -> Result<Leftovers, AwsError> {
    let first = collect(aws, cluster, user_profiles).await?;
    if !first.is_clean() {
        return Ok(first);
    }
    tokio::time::sleep(second_read_pause(settle, quiet_since, Instant::now())).await;
    collect(aws, cluster, user_profiles).await
}

/// How long to wait, `now` that the first read is clean, before the second.
fn second_read_pause(settle: Duration, quiet_since: Option<Instant>, now: Instant) -> Duration {
    match quiet_since {
        Some(since) => (since + settle).saturating_duration_since(now),
        None => settle,
    }
}

/// What of a live cluster holds an instance, a launch template or an instance profile
/// (`engine::inventory::cluster_holders` reads it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ClusterHolders {
    /// Instance id → `Node <name>` or `NodeClaim <name>`.
    pub instances: BTreeMap<String, String>,
    /// Every NodeClaim's name.
    pub claims: BTreeSet<String>,
    /// Instance profiles named by an EC2NodeClass's `spec.instanceProfile`.
    pub user_profiles: BTreeSet<String>,
    /// The EC2NodeClasses that exist: their launch templates and instance profiles are in use.
    pub nodeclasses: BTreeSet<String>,
}

/// What `verify --reclaim` knows of the cluster before it removes anything from AWS alone
/// (design §2.7): terminating an instance without a drain is right only when no Kubernetes node
/// runs on it any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClusterSeen {
    /// EKS has no cluster of that name, or is deleting it: nothing can run on its instances.
    Gone(String),
    /// The cluster is there and its API, proven to be that cluster's, was read.
    Live(ClusterHolders),
    /// The cluster is there, but its API could not be read as that cluster's.
    Unproven(String),
}

/// Why `verify --reclaim` removes nothing (exit 3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ReclaimRefusal {
    /// Some instances are still the cluster's nodes: they need a drain.
    #[error(
        "refusing to reclaim: cluster {cluster} is live and {} of its instances still stand for its nodes ({}); \
         terminating them here would kill their pods without a drain. Nothing was changed; tear the cluster's \
         compute down with `karpenter-teardown run` (it drains first), then verify",
        .held.len(),
        .held.iter().map(|(i, h)| format!("{i}: {h}")).collect::<Vec<_>>().join(", ")
    )]
    InUse {
        /// `--cluster`.
        cluster: String,
        /// Instance id and what holds it.
        held: Vec<(String, String)>,
    },
    /// The cluster is live, and its API could not be read as that cluster's.
    #[error(
        "refusing to reclaim: EKS says cluster {cluster} exists, and its Kubernetes API could not be read as that \
         cluster's ({why}), so whether its instances still run pods is unknown. Nothing was changed; point \
         --kubeconfig/--context at the cluster (aws eks update-kubeconfig --name {cluster}), or tear it down with \
         `karpenter-teardown run`"
    )]
    Unproven {
        /// `--cluster`.
        cluster: String,
        /// What went wrong.
        why: String,
    },
    /// More instances than `--max-nodes`.
    #[error(
        "refusing to reclaim: it would terminate {instances} instances, more than --max-nodes {max}. Nothing was \
         changed; raise --max-nodes if this is the right cluster"
    )]
    BlastRadius {
        /// Instances the reclaim would terminate.
        instances: usize,
        /// `--max-nodes`.
        max: u32,
    },
}

/// Whether `left` may be reclaimed with what is known of the cluster: every live instance must
/// stand for no Node or NodeClaim of a cluster that is still there, and there may be no more of
/// them than `max`. Checked in a dry run too, which predicts the real run.
pub(crate) fn reclaim_refusal(
    left: &Leftovers,
    seen: &ClusterSeen,
    cluster: &str,
    max: Option<u32>,
) -> Option<ReclaimRefusal> {
    if let Some(max) = max
        && left.instances.len() > max as usize
    {
        return Some(ReclaimRefusal::BlastRadius { instances: left.instances.len(), max });
    }
    match seen {
        ClusterSeen::Gone(_) => None,
        ClusterSeen::Unproven(why) => Some(ReclaimRefusal::Unproven { cluster: cluster.to_string(), why: why.clone() }),
        ClusterSeen::Live(holders) => {
            let held: Vec<(String, String)> = left
                .instances
                .iter()
                .filter_map(|i| {
                    let by_tag = || {
                        i.tag(crate::karpenter::TAG_NODECLAIM)
                            .filter(|c| holders.claims.contains(*c))
                            .map(|c| format!("NodeClaim {c} (its karpenter.sh/nodeclaim tag)"))
                    };
                    holders.instances.get(&i.id).cloned().or_else(by_tag).map(|h| (i.id.clone(), h))
                })
                .collect();
            (!held.is_empty()).then(|| ReclaimRefusal::InUse { cluster: cluster.to_string(), held })
        }
    }
}

impl Leftovers {
    /// Leaves out the launch templates and instance profiles that an EC2NodeClass of a live
    /// cluster may still launch with: those whose tags name a class that exists and, while any
    /// class exists, those whose tags name none (nothing then says they are not its).
    pub(crate) fn without_live_classes(mut self, classes: &BTreeSet<String>) -> Leftovers {
        if classes.is_empty() {
            return self;
        }
        self.launch_templates.retain(|lt| lt.nodeclass.as_ref().is_some_and(|c| !classes.contains(c)));
        self.instance_profiles.retain(|p| !p.nodeclass.is_empty() && !classes.contains(&p.nodeclass));
        self
    }

    /// Leaves out the instance profiles the user's EC2NodeClasses name.
    pub(crate) fn without_profiles(mut self, user_profiles: &BTreeSet<String>) -> Leftovers {
        self.instance_profiles.retain(|p| !user_profiles.contains(&p.name));
        self
    }
}

/// How long [`reclaim`] waits for the instances it terminated to reach `terminated`: a real
/// instance stays `shutting-down` for tens of seconds to minutes after `TerminateInstances`, and
/// a check made before it is gone would count it as left over.
pub(crate) const RECLAIM_TERMINATION_WAIT: Duration = Duration::from_secs(600);
/// How often [`reclaim`] asks EC2 about the instances still shutting down.
const RECLAIM_POLL: Duration = Duration::from_secs(2);

/// Removes what the leftovers list (never volumes, never the interfaces left alone): terminates
/// the instances and waits up to [`RECLAIM_TERMINATION_WAIT`] for EC2 to report them
/// `terminated`, then deletes the rest ([`reclaim_rest`]). Everything listed was selected by the
/// cluster's tags (instance profiles by location and tags together, interfaces by their owner's
/// evidence), so nothing outside the cluster is touched.
pub async fn reclaim(aws: &AwsClients, leftovers: &Leftovers) -> Result<Vec<String>, AwsError> {
    let ids: Vec<String> = leftovers.instances.iter().map(|i| i.id.clone()).collect();
    let mut failures: Vec<String> = reclaim_instances(aws, &ids).await?.into_iter().map(|(_, f)| f).collect();
    failures.extend(reclaim_rest(aws, leftovers).await);
    Ok(failures)
}

/// Terminates `ids` at the pace EC2 allows and waits up to [`RECLAIM_TERMINATION_WAIT`] for them
/// to reach `terminated`: each instance that did not, with why.
pub(crate) async fn reclaim_instances(aws: &AwsClients, ids: &[String]) -> Result<Vec<(String, String)>, AwsError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let out = aws.ec2.terminate_paced(ids).await?;
    let mut failures: Vec<(String, String)> =
        out.failed.into_iter().map(|(id, e)| (id.clone(), format!("{id}: {e}"))).collect();
    let still_live = wait_terminated(aws, &out.accepted, RECLAIM_TERMINATION_WAIT).await?;
    failures.extend(still_live.into_iter().map(|id| {
        let why = format!(
            "{id}: not terminated {} after TerminateInstances",
            humantime::format_duration(RECLAIM_TERMINATION_WAIT)
        );
        (id, why)
    }));
    Ok(failures)
}

/// Deletes what is left once the instances are gone, in Karpenter's own order (its EC2NodeClass
/// finalizer, 1.0 to 1.14: instance profiles, then launch templates) with the detached interfaces
/// between them. The launch templates go last on purpose: their user data is what shows that the
/// cluster ran on EKS ([`crate::sweep::eks_endpoint_in`]), so a sweep stopped anywhere before the
/// end still finds that evidence when it runs again.
pub(crate) async fn reclaim_rest(aws: &AwsClients, leftovers: &Leftovers) -> Vec<String> {
    let mut failures = Vec::new();
    for p in &leftovers.instance_profiles {
        if let Err(e) = aws.iam.delete_instance_profile(p).await {
            failures.push(format!("{}: {e}", p.name));
        }
    }
    for ni in &leftovers.network_interfaces {
        if let Err(e) = aws.ec2.delete_network_interface(&ni.id).await {
            failures.push(format!("{}: {e}", ni.id));
        }
    }
    for lt in &leftovers.launch_templates {
        if let Err(e) = aws.ec2.delete_launch_template(&lt.id).await {
            failures.push(format!("{}: {e}", lt.name));
        }
    }
    failures
}

/// Waits until EC2 reports none of `ids` live (an id EC2 no longer knows counts as gone), or
/// `limit` has passed: the ids still live then.
async fn wait_terminated(aws: &AwsClients, ids: &[String], limit: Duration) -> Result<Vec<String>, AwsError> {
    let deadline = Instant::now() + limit;
    let mut live: Vec<String> = ids.to_vec();
    while !live.is_empty() {
        let found = aws.ec2.live_instances_by_id(&live).await?;
        live = still_live(&live, &found);
        if live.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(RECLAIM_POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
    Ok(live)
}

/// Which of `ids` a read shows live: present and not `terminated` (a `running` read right after
/// the termination is EC2's eventual consistency, not a refusal, and is waited out too).
fn still_live(ids: &[String], found: &[InstanceInfo]) -> Vec<String> {
    ids.iter().filter(|id| found.iter().any(|i| &i.id == *id && i.state.is_live())).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aws::InstanceState;
    use crate::karpenter::{self, ProfileEvidence};

    fn instance(id: &str, cluster: &str, state: InstanceState) -> InstanceInfo {
        InstanceInfo {
            id: id.into(),
            state,
            zone: "us-west-2a".into(),
            tags: [
                (karpenter::TAG_EKS_CLUSTER, cluster),
                (karpenter::TAG_NODEPOOL, "default"),
                (karpenter::TAG_NODECLASS, "default"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            managed_by: None,
            launched: None,
            instance_type: None,
            market: None,
        }
    }

    fn profile(name: &str) -> InstanceProfileInfo {
        InstanceProfileInfo {
            name: name.into(),
            path: "/karpenter/us-west-2/prod/".into(),
            roles: Vec::new(),
            evidence: ProfileEvidence::ClusterPath,
            nodeclass: "default".into(),
            tags: Default::default(),
            created: None,
        }
    }

    fn detached(id: &str) -> DetachedResource {
        DetachedResource { id: id.into(), status: "available".into(), reason: None }
    }

    fn template(id: &str) -> LaunchTemplateInfo {
        LaunchTemplateInfo {
            id: id.into(),
            name: format!("karpenter.k8s.aws/{id}"),
            nodeclass: None,
            tags: Default::default(),
            created: None,
        }
    }

    fn ids(left: &Leftovers) -> Vec<&str> {
        left.instances.iter().map(|i| i.id.as_str()).collect()
    }

    #[test]
    fn every_state_but_terminated_is_a_leftover_instance() {
        let states = [
            ("i-pending", InstanceState::Pending),
            ("i-running", InstanceState::Running),
            ("i-stopping", InstanceState::Stopping),
            ("i-stopped", InstanceState::Stopped),
            ("i-shutting-down", InstanceState::ShuttingDown),
            ("i-terminated", InstanceState::Terminated),
        ];
        let described = Described {
            instances: states.iter().map(|(id, s)| instance(id, "prod", *s)).collect(),
            ..Described::default()
        };
        let left = leftovers(described, "prod", &BTreeSet::new());
        assert_eq!(ids(&left), ["i-pending", "i-running", "i-stopping", "i-stopped", "i-shutting-down"]);
        assert!(!left.is_clean());
    }

    #[test]
    fn only_instances_with_all_of_karpenters_tags_for_this_cluster_count() {
        let mut no_nodepool = instance("i-no-nodepool", "prod", InstanceState::Running);
        no_nodepool.tags.remove(karpenter::TAG_NODEPOOL);
        let mut no_nodeclass = instance("i-no-nodeclass", "prod", InstanceState::Running);
        no_nodeclass.tags.remove(karpenter::TAG_NODECLASS);
        let mut no_cluster = instance("i-no-cluster", "prod", InstanceState::Running);
        no_cluster.tags.remove(karpenter::TAG_EKS_CLUSTER);
        let described = Described {
            instances: vec![
                instance("i-ours", "prod", InstanceState::Running),
                instance("i-staging", "staging", InstanceState::Running),
                no_nodepool,
                no_nodeclass,
                no_cluster,
            ],
            ..Described::default()
        };
        assert_eq!(ids(&leftovers(described, "prod", &BTreeSet::new())), ["i-ours"]);
    }

    #[test]
    fn the_users_instance_profiles_are_never_leftovers() {
        let described =
            Described { instance_profiles: vec![profile("prod_1"), profile("mine")], ..Described::default() };
        let user = BTreeSet::from(["mine".to_string()]);
        let left = leftovers(described.clone(), "prod", &user);
        assert_eq!(left.instance_profiles, [profile("prod_1")]);
        assert_eq!(leftovers(described, "prod", &BTreeSet::new()).instance_profiles.len(), 2, "none is the user's");
    }

    #[test]
    fn templates_interfaces_and_volumes_are_kept_as_read() {
        let described = Described {
            launch_templates: vec![template("lt-1")],
            network_interfaces: vec![detached("eni-1")],
            volumes: vec![detached("vol-1")],
            ..Described::default()
        };
        let left = leftovers(described.clone(), "prod", &BTreeSet::new());
        assert_eq!(left.launch_templates, described.launch_templates);
        assert_eq!(left.network_interfaces, described.network_interfaces);
        assert_eq!(left.volumes, described.volumes);
        assert!(left.objects.is_empty(), "objects are the API's, not AWS's");
    }

    #[test]
    fn detached_volumes_alone_leave_the_result_clean_but_are_reported() {
        let left = Leftovers { volumes: vec![detached("vol-1")], ..Leftovers::default() };
        assert!(left.is_clean());
        assert_eq!(left.describe(), ["1 detached volume(s) (reported only, never deleted): vol-1"]);
        assert!(left.reclaimable().is_empty(), "volumes are never reclaimed");
    }

    #[test]
    fn any_other_kind_left_is_not_clean() {
        let unclean = [
            Leftovers { instances: vec![instance("i-1", "prod", InstanceState::Running)], ..Leftovers::default() },
            Leftovers { launch_templates: vec![template("lt-1")], ..Leftovers::default() },
            Leftovers { instance_profiles: vec![profile("prod_1")], ..Leftovers::default() },
            Leftovers { network_interfaces: vec![detached("eni-1")], ..Leftovers::default() },
            Leftovers { objects: vec!["NodeClaim/a".into()], ..Leftovers::default() },
        ];
        for left in unclean {
            assert!(!left.is_clean(), "{left:?}");
        }
        assert!(Leftovers::default().is_clean());
    }

    #[test]
    fn reclaim_lists_aws_leftovers_but_not_objects_or_volumes() {
        let left = Leftovers {
            instances: vec![
                instance("i-1", "prod", InstanceState::Running),
                instance("i-2", "prod", InstanceState::Stopped),
            ],
            network_interfaces: vec![detached("eni-1")],
            volumes: vec![detached("vol-1")],
            objects: vec!["Node/n".into()],
            ..Leftovers::default()
        };
        assert_eq!(left.reclaimable(), ["2 instance(s): i-1, i-2", "1 detached network interface(s): eni-1"]);
    }

    #[test]
    fn a_reclaim_waits_for_every_instance_it_terminated_until_ec2_says_terminated() {
        let ids: Vec<String> = ["i-1", "i-2", "i-3", "i-4"].iter().map(|s| s.to_string()).collect();
        let found = [
            instance("i-1", "prod", InstanceState::Running),
            instance("i-2", "prod", InstanceState::ShuttingDown),
            instance("i-3", "prod", InstanceState::Terminated),
        ];
        assert_eq!(still_live(&ids, &found), ["i-1", "i-2"], "i-4 is no longer known: gone");
        assert!(still_live(&ids, &found[2..]).is_empty());
    }

    fn live(instances: &[(&str, &str)], claims: &[&str]) -> ClusterSeen {
        ClusterSeen::Live(ClusterHolders {
            instances: instances.iter().map(|(i, h)| (i.to_string(), h.to_string())).collect(),
            claims: claims.iter().map(|c| c.to_string()).collect(),
            user_profiles: BTreeSet::new(),
            nodeclasses: BTreeSet::new(),
        })
    }

    fn two_instances() -> Leftovers {
        let mut fresh = instance("i-2", "prod", InstanceState::Pending);
        fresh.tags.insert(karpenter::TAG_NODECLAIM.into(), "default-abcde".into());
        Leftovers { instances: vec![instance("i-1", "prod", InstanceState::Running), fresh], ..Leftovers::default() }
    }

    #[test]
    fn a_reclaim_never_terminates_an_instance_a_node_or_claim_of_a_live_cluster_stands_for() {
        let left = two_instances();
        let refusal = reclaim_refusal(&left, &live(&[("i-1", "Node n1")], &[]), "prod", None);
        assert_eq!(
            refusal,
            Some(ReclaimRefusal::InUse { cluster: "prod".into(), held: vec![("i-1".into(), "Node n1".into())] })
        );
        let text = refusal.unwrap().to_string();
        assert!(text.contains("karpenter-teardown run") && text.contains("Nothing was changed"), "{text}");
        let by_tag = reclaim_refusal(&left, &live(&[], &["default-abcde"]), "prod", None);
        assert_eq!(
            by_tag,
            Some(ReclaimRefusal::InUse {
                cluster: "prod".into(),
                held: vec![("i-2".into(), "NodeClaim default-abcde (its karpenter.sh/nodeclaim tag)".into())]
            }),
            "a claim not yet naming its instance holds it by the instance's tag"
        );
        assert_eq!(reclaim_refusal(&left, &live(&[("i-9", "Node n9")], &["other"]), "prod", None), None);
    }

    #[test]
    fn a_reclaim_goes_ahead_once_the_cluster_is_gone_and_refuses_when_it_cannot_tell() {
        let left = two_instances();
        assert_eq!(reclaim_refusal(&left, &ClusterSeen::Gone("EKS has no cluster prod".into()), "prod", None), None);
        let unproven = ClusterSeen::Unproven("the kubeconfig's server is not EKS cluster prod's endpoint".into());
        assert!(matches!(reclaim_refusal(&left, &unproven, "prod", None), Some(ReclaimRefusal::Unproven { .. })));
    }

    #[test]
    fn a_reclaim_honours_max_nodes_whatever_the_cluster_says() {
        let left = two_instances();
        let gone = ClusterSeen::Gone("deleted".into());
        assert_eq!(
            reclaim_refusal(&left, &gone, "prod", Some(1)),
            Some(ReclaimRefusal::BlastRadius { instances: 2, max: 1 })
        );
        assert_eq!(reclaim_refusal(&left, &gone, "prod", Some(2)), None);
    }

    #[test]
    fn the_profiles_a_class_names_are_left_out_of_a_reclaim() {
        let left = Leftovers { instance_profiles: vec![profile("prod_1"), profile("mine")], ..Leftovers::default() };
        let kept = left.without_profiles(&BTreeSet::from(["mine".to_string()]));
        assert_eq!(kept.instance_profiles, [profile("prod_1")]);
    }

    #[test]
    fn the_second_read_waits_settle_after_the_controller_was_gone_or_after_the_first_read() {
        let (settle, now) = (Duration::from_secs(5), Instant::now());
        assert_eq!(second_read_pause(settle, None, now), settle, "no controller seen gone: the whole settle");
        let gone_2s_ago = now - Duration::from_secs(2);
        assert_eq!(second_read_pause(settle, Some(gone_2s_ago), now), Duration::from_secs(3));
        let gone_long_ago = now - Duration::from_secs(60);
        assert_eq!(second_read_pause(settle, Some(gone_long_ago), now), Duration::ZERO);
    }
}
