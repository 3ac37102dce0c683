//! The EC2 proof: what of the cluster's Karpenter is still there, read through AWS with
//! Karpenter's own filter, twice, some seconds apart (design §2.7), and reclaimed when asked.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::aws::ec2::{DetachedResource, InstanceScope, LaunchTemplateInfo};
use crate::aws::{AwsClients, AwsError, InstanceInfo, InstanceProfileInfo};

/// What AWS still holds of the cluster's Karpenter.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Leftovers {
    /// Live instances with Karpenter's tags for this cluster.
    pub instances: Vec<InstanceInfo>,
    /// Karpenter launch templates of the cluster.
    pub launch_templates: Vec<LaunchTemplateInfo>,
    /// Karpenter instance profiles of the cluster.
    pub instance_profiles: Vec<InstanceProfileInfo>,
    /// Detached network interfaces tagged for the cluster.
    pub network_interfaces: Vec<DetachedResource>,
    /// Detached volumes tagged for the cluster: reported, never deleted (they may hold data),
    /// and not counted against a clean result.
    pub volumes: Vec<DetachedResource>,
    /// Karpenter objects still in the cluster (`NodeClaim/x`, `Node/y`, ...); filled by `run`.
    pub objects: Vec<String>,
}

impl Leftovers {
    /// True when nothing that counts is left (volumes do not count, see above).
    pub fn is_clean(&self) -> bool {
        self.instances.is_empty()
            && self.launch_templates.is_empty()
            && self.instance_profiles.is_empty()
            && self.network_interfaces.is_empty()
            && self.objects.is_empty()
    }

    /// What [`reclaim`] would remove, one line per kind (everything but volumes and the cluster's
    /// objects, which only a teardown removes).
    pub fn reclaimable(&self) -> Vec<String> {
        Leftovers { volumes: Vec::new(), objects: Vec::new(), ..self.clone() }.describe()
    }

    /// One line per kind with the ids, for the human summary.
    pub fn describe(&self) -> Vec<String> {
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
        line("detached volume(s) (reported only, never deleted)", self.volumes.iter().map(|v| v.id.as_str()).collect());
        out
    }
}

/// Reads everything once. `user_profiles` are instance profiles that EC2NodeClasses name in
/// `spec.instanceProfile` (the user's): never counted, even when they look like Karpenter's.
pub async fn collect(aws: &AwsClients, cluster: &str, user_profiles: &BTreeSet<String>) -> Result<Leftovers, AwsError> {
    let (instances, launch_templates, instance_profiles, network_interfaces, volumes) = tokio::try_join!(
        aws.ec2.cluster_instances(cluster, InstanceScope::KarpenterLive),
        aws.ec2.launch_templates(cluster),
        aws.iam.cluster_instance_profiles(aws.region(), cluster),
        aws.ec2.detached_network_interfaces(cluster),
        aws.ec2.detached_volumes(cluster),
    )?;
    let instance_profiles = instance_profiles.into_iter().filter(|p| !user_profiles.contains(&p.name)).collect();
    Ok(Leftovers { instances, launch_templates, instance_profiles, network_interfaces, volumes, objects: Vec::new() })
}

/// Verifies: two reads `settle` apart must both be clean, to catch a launch that was in flight
/// during the first. Returns the leftovers of the read that was not clean (or the last one).
pub async fn verify(
    aws: &AwsClients,
    cluster: &str,
    user_profiles: &BTreeSet<String>,
    settle: Duration,
) -> Result<Leftovers, AwsError> {
    let first = collect(aws, cluster, user_profiles).await?;
    if !first.is_clean() {
        return Ok(first);
    }
    tokio::time::sleep(settle).await;
    collect(aws, cluster, user_profiles).await
}

/// Removes what the leftovers list (never volumes): terminates the instances, deletes launch
/// templates, instance profiles and detached network interfaces. Everything listed was selected
/// by the cluster's tags (instance profiles by location and tags together), so nothing outside
/// the cluster is touched.
pub async fn reclaim(aws: &AwsClients, leftovers: &Leftovers) -> Result<Vec<String>, AwsError> {
    let mut failures = Vec::new();
    let ids: Vec<String> = leftovers.instances.iter().map(|i| i.id.clone()).collect();
    if !ids.is_empty() {
        let out = aws.ec2.terminate(&ids).await?;
        failures.extend(out.failed.into_iter().map(|(id, e)| format!("{id}: {e}")));
    }
    for lt in &leftovers.launch_templates {
        if let Err(e) = aws.ec2.delete_launch_template(&lt.id).await {
            failures.push(format!("{}: {e}", lt.name));
        }
    }
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
    Ok(failures)
}
