//! Names and tags the simulated Karpenter gives to what it creates in AWS and Kubernetes, per
//! design §3 and per release. The generator and the controller share these so a generated world
//! looks exactly like one the controller would have built.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::KarpenterVersion;
use crate::karpenter;

/// Any AMI id works on LocalStack; this one is what every sandbox instance runs.
pub const IMAGE_ID: &str = "ami-12c6146b";
/// The instance type of every simulated Karpenter node (4 vCPU, 16 GiB).
pub const INSTANCE_TYPE: &str = "m5.xlarge";
/// vCPUs of [`INSTANCE_TYPE`], what NodePool `spec.limits.cpu` is counted in.
pub const CPU_PER_NODE: u64 = 4;
/// Memory of [`INSTANCE_TYPE`] in GiB.
pub const MEMORY_GIB_PER_NODE: u64 = 16;
/// Label managed node groups put on their nodes; such nodes are never Karpenter's.
pub const LABEL_NODEGROUP: &str = "eks.amazonaws.com/nodegroup";
/// Instance tag of managed node group instances.
pub const TAG_NODEGROUP: &str = "eks:nodegroup-name";
/// Label naming the instance type.
pub const LABEL_INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";
/// Label naming the zone.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// Label naming the region.
pub const LABEL_REGION: &str = "topology.kubernetes.io/region";
/// Label naming the capacity type.
pub const LABEL_CAPACITY_TYPE: &str = "karpenter.sh/capacity-type";
/// Label Karpenter sets once the node registered.
pub const LABEL_REGISTERED: &str = "karpenter.sh/registered";
/// Label Karpenter sets once the node is initialized.
pub const LABEL_INITIALIZED: &str = "karpenter.sh/initialized";
/// Control-plane role label and taint key.
pub const CONTROL_PLANE_KEY: &str = "node-role.kubernetes.io/control-plane";
/// Namespace of the controller.
pub const KARPENTER_NAMESPACE: &str = "kube-system";
/// Name of the controller's Deployment, Service and ServiceAccount.
pub const KARPENTER_NAME: &str = "karpenter";
/// The controller's `app.kubernetes.io/name` label value.
pub const KARPENTER_APP_LABEL: &str = "app.kubernetes.io/name";

/// FNV-1a 64: a stable hash (unlike `DefaultHasher`, it never changes between Rust releases), so
/// names made by one process (the sandbox server) are recomputed identically by another.
pub fn stable_hash(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0u8)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// A short random-looking lowercase suffix like the `generateName` suffixes Karpenter's NodeClaims
/// get (`default-x7k2p`). Unique within the process; mixed with the clock across processes.
pub fn random_suffix(len: usize) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut x = stable_hash(&[&nanos.to_string(), &n.to_string(), &std::process::id().to_string()]) | 1;
    let mut out = String::with_capacity(len);
    for _ in 0..len {
        // xorshift64: enough spread for names, no extra crate
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let idx = usize::try_from(x % ALPHABET.len() as u64).unwrap_or(0);
        out.push(char::from(ALPHABET[idx]));
    }
    out
}

/// `karpenter.k8s.aws/<hash>`: the launch template Karpenter makes for a class.
pub fn launch_template_name(cluster: &str, class: &str, class_uid: &str) -> String {
    format!("{}{}", karpenter::LAUNCH_TEMPLATE_PREFIX, stable_hash(&[cluster, class, class_uid]))
}

/// Tags of a launch template, per release (1.0.x tagged `karpenter.k8s.aws/cluster`, later
/// releases `eks:eks-cluster-name`).
pub fn launch_template_tags(version: KarpenterVersion, cluster: &str, class: &str) -> BTreeMap<String, String> {
    let cluster_key = match version {
        KarpenterVersion::V1_0 => karpenter::TAG_LEGACY_CLUSTER,
        KarpenterVersion::V1_14 => karpenter::TAG_EKS_CLUSTER,
    };
    BTreeMap::from([
        (cluster_key.to_string(), cluster.to_string()),
        (karpenter::TAG_NODECLASS.to_string(), class.to_string()),
    ])
}

/// Name and path of the instance profile Karpenter makes for a class with `spec.role`.
pub fn instance_profile(version: KarpenterVersion, region: &str, cluster: &str, class_uid: &str) -> (String, String) {
    let name = format!("{}{}", karpenter::legacy_instance_profile_prefix(cluster), stable_hash(&[region, class_uid]));
    let path = match version {
        KarpenterVersion::V1_0 => "/".to_string(),
        KarpenterVersion::V1_14 => format!("{}{class_uid}/", karpenter::instance_profile_path_prefix(region, cluster)),
    };
    (name, path)
}

/// Exactly the tags design §3 lists for a registered Karpenter instance: those of its launch and
/// those Karpenter's tagging controller adds once it is registered.
pub fn instance_tags(cluster: &str, pool: &str, class: &str, nodeclaim: &str, node: &str) -> BTreeMap<String, String> {
    let mut tags = launch_tags(cluster, pool, class);
    tags.extend(registration_tags(nodeclaim, node));
    tags
}

/// The tags an instance is launched with (`GetTags` in karpenter-provider-aws's `pkg/utils`, with
/// no tags of the class's own): they do not name the NodeClaim or the node, which are not known
/// yet, or not to EC2.
pub fn launch_tags(cluster: &str, pool: &str, class: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (karpenter::cluster_tag_key(cluster), "owned".to_string()),
        (karpenter::TAG_EKS_CLUSTER.to_string(), cluster.to_string()),
        (karpenter::TAG_NODEPOOL.to_string(), pool.to_string()),
        (karpenter::TAG_NODECLASS.to_string(), class.to_string()),
    ])
}

/// The tags Karpenter's tagging controller (`pkg/controllers/nodeclaim/tagging`) adds once the
/// NodeClaim names its node: the node's name and the NodeClaim's.
pub fn registration_tags(nodeclaim: &str, node: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (karpenter::TAG_NODECLAIM.to_string(), nodeclaim.to_string()),
        ("Name".to_string(), node.to_string()),
    ])
}

/// Tags of a managed node group instance: the cluster's, no Karpenter tag.
pub fn nodegroup_instance_tags(cluster: &str, nodegroup: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (karpenter::cluster_tag_key(cluster), "owned".to_string()),
        (karpenter::TAG_EKS_CLUSTER.to_string(), cluster.to_string()),
        (TAG_NODEGROUP.to_string(), nodegroup.to_string()),
    ])
}

/// The Node name of an instance: EKS "resource name" hostnames, unique per instance id, so the
/// generator and a controller launching later can never pick the same name.
pub fn node_name(instance_id: &str, region: &str) -> String {
    format!("{instance_id}.{region}.compute.internal")
}

/// `aws:///<zone>/<instance-id>`.
pub fn provider_id(zone: &str, instance_id: &str) -> String {
    karpenter::ProviderId { zone: zone.to_string(), instance_id: instance_id.to_string() }.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_names_neither_its_claim_nor_its_node_and_registration_adds_both() {
        let launch = launch_tags("prod", "web", "default");
        assert_eq!(launch.len(), 4, "{launch:?}");
        assert!(!launch.contains_key(karpenter::TAG_NODECLAIM) && !launch.contains_key("Name"), "{launch:?}");
        let all = instance_tags("prod", "web", "default", "web-abcde", "ip-10-0-0-1");
        assert_eq!(all.len(), 6, "{all:?}");
        assert_eq!(all[karpenter::TAG_NODECLAIM], "web-abcde");
        assert_eq!(all["Name"], "ip-10-0-0-1");
    }

    #[test]
    fn hashes_are_stable_and_separate_parts() {
        assert_eq!(stable_hash(&["a", "b"]), stable_hash(&["a", "b"]));
        assert_ne!(stable_hash(&["ab", ""]), stable_hash(&["a", "b"]));
    }

    #[test]
    fn suffixes_differ_and_use_the_alphabet() {
        let a = random_suffix(5);
        let b = random_suffix(5);
        assert_eq!(a.len(), 5);
        assert_ne!(a, b);
        assert!(a.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
    }

    #[test]
    fn names_follow_each_release() {
        let lt = launch_template_name("c", "default", "uid-1");
        assert!(lt.starts_with("karpenter.k8s.aws/"));
        let old = launch_template_tags(KarpenterVersion::V1_0, "c", "default");
        assert_eq!(old.get(karpenter::TAG_LEGACY_CLUSTER).map(String::as_str), Some("c"));
        assert!(!old.contains_key(karpenter::TAG_EKS_CLUSTER));
        let new = launch_template_tags(KarpenterVersion::V1_14, "c", "default");
        assert_eq!(new.get(karpenter::TAG_EKS_CLUSTER).map(String::as_str), Some("c"));
        let (name, path) = instance_profile(KarpenterVersion::V1_0, "us-west-2", "c", "uid-1");
        assert!(name.starts_with("c_"));
        assert_eq!(path, "/");
        let (_, path) = instance_profile(KarpenterVersion::V1_14, "us-west-2", "c", "uid-1");
        assert_eq!(path, "/karpenter/us-west-2/c/uid-1/");
        assert_eq!(provider_id("us-west-2a", "i-1"), "aws:///us-west-2a/i-1");
    }
}
