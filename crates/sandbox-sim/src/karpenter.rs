//! The names and shapes real Karpenter (v1.0 to v1.14) writes, as the simulation plays them.
//!
//! This is deliberately the test bed's own copy, written from Karpenter's sources
//! (`pkg/apis/v1`, `pkg/providers/launchtemplate`, `pkg/providers/instanceprofile`), not the
//! product's `karpenter` module: a fact the product gets wrong must show up as a failing test
//! against this simulation, not be mirrored by it.

use std::collections::BTreeMap;
use std::fmt;

/// API group of NodePool and NodeClaim.
pub const KARPENTER_GROUP: &str = "karpenter.sh";
/// API group of EC2NodeClass.
pub const AWS_GROUP: &str = "karpenter.k8s.aws";
/// The version all three kinds are served at since Karpenter 1.0.
pub const VERSION: &str = "v1";

/// Node label naming the NodePool.
pub const LABEL_NODEPOOL: &str = "karpenter.sh/nodepool";
/// Node label naming the EC2NodeClass (since 1.1).
pub const LABEL_NODECLASS: &str = "karpenter.k8s.aws/ec2nodeclass";
/// Finalizer on NodeClaims and Nodes.
pub const FINALIZER_TERMINATION: &str = "karpenter.sh/termination";
/// Finalizer on EC2NodeClasses.
pub const FINALIZER_NODECLASS: &str = "karpenter.k8s.aws/termination";
/// Taint on nodes being disrupted.
pub const TAINT_DISRUPTED: &str = "karpenter.sh/disrupted";

/// Instance and launch-template tag naming the EKS cluster.
pub const TAG_EKS_CLUSTER: &str = "eks:eks-cluster-name";
/// Instance tag naming the NodePool.
pub const TAG_NODEPOOL: &str = "karpenter.sh/nodepool";
/// Instance, launch-template and instance-profile tag naming the EC2NodeClass.
pub const TAG_NODECLASS: &str = "karpenter.k8s.aws/ec2nodeclass";
/// Instance tag naming the NodeClaim, added after registration.
pub const TAG_NODECLAIM: &str = "karpenter.sh/nodeclaim";
/// Launch-template tag naming the cluster in 1.0.x.
pub const TAG_LEGACY_CLUSTER: &str = "karpenter.k8s.aws/cluster";
/// Instance-profile tag naming the region.
pub const TAG_REGION: &str = "topology.kubernetes.io/region";
/// Prefix of launch-template names.
pub const LAUNCH_TEMPLATE_PREFIX: &str = "karpenter.k8s.aws/";

/// API group of EKS Auto Mode's `NodeClass` (its NodePools and NodeClaims reference it).
pub const AUTO_MODE_GROUP: &str = "eks.amazonaws.com";
/// Label EKS puts on Auto Mode's NodeClaims and Nodes, `auto`.
pub const LABEL_COMPUTE_TYPE: &str = "eks.amazonaws.com/compute-type";
/// Karpenter labels a node `<node class group>/<lower-case kind>`: Auto Mode's carry this.
pub const LABEL_AUTO_NODECLASS: &str = "eks.amazonaws.com/nodeclass";
/// Tags EKS's compute policy requires on every instance Auto Mode launches.
pub const TAG_AUTO_NODEPOOL: &str = "eks:kubernetes-node-pool-name";
/// See [`TAG_AUTO_NODEPOOL`].
pub const TAG_AUTO_NODECLASS: &str = "eks:kubernetes-node-class-name";

/// Whether a node class reference is the AWS provider's: Karpenter's `IsManaged`
/// (`pkg/utils/nodepool`, `pkg/utils/nodeclaim`) compares the reference's group and kind with
/// its cloud provider's supported node classes, and watches nothing else.
pub fn manages_node_class_ref(node_class_ref: &serde_json::Value) -> bool {
    node_class_ref["group"].as_str() == Some(AWS_GROUP) && node_class_ref["kind"].as_str() == Some("EC2NodeClass")
}

/// Whether this controller manages a NodePool ([`manages_node_class_ref`] of its template).
pub fn manages_pool(pool: &kube::core::DynamicObject) -> bool {
    manages_node_class_ref(&pool.data["spec"]["template"]["spec"]["nodeClassRef"])
}

/// Whether this controller manages a NodeClaim ([`manages_node_class_ref`]).
pub fn manages_claim(claim: &kube::core::DynamicObject) -> bool {
    manages_node_class_ref(&claim.data["spec"]["nodeClassRef"])
}

/// Whether this controller manages a Node: Karpenter's `IsManaged` (`pkg/utils/node`) asks
/// for its provider's node class label; nodes of 1.0, which had none, are told apart by the
/// NodePool label and the absence of Auto Mode's node class label.
pub fn manages_node(labels: &BTreeMap<String, String>) -> bool {
    labels.contains_key(LABEL_NODEPOOL) && !labels.contains_key(LABEL_AUTO_NODECLASS)
}

/// `kubernetes.io/cluster/<cluster>`.
pub fn cluster_tag_key(cluster: &str) -> String {
    format!("kubernetes.io/cluster/{cluster}")
}

/// The path prefix of instance profiles since 1.7: `/karpenter/<region>/<cluster>/`.
pub fn instance_profile_path_prefix(region: &str, cluster: &str) -> String {
    format!("/karpenter/{region}/{cluster}/")
}

/// The name prefix of instance profiles before 1.7 (at path `/`): `<cluster>_`.
pub fn legacy_instance_profile_prefix(cluster: &str) -> String {
    format!("{cluster}_")
}

/// The tags Karpenter puts on an instance profile it creates for an EC2NodeClass.
pub fn instance_profile_tags(cluster: &str, region: &str, class: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (cluster_tag_key(cluster), "owned".to_string()),
        (TAG_EKS_CLUSTER.to_string(), cluster.to_string()),
        (TAG_REGION.to_string(), region.to_string()),
        (TAG_NODECLASS.to_string(), class.to_string()),
    ])
}

/// `aws:///<zone>/<instance-id>`, the provider id Karpenter writes on NodeClaims and Nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderId {
    /// Availability zone.
    pub zone: String,
    /// EC2 instance id.
    pub instance_id: String,
}

impl ProviderId {
    /// Parses a provider id; `None` when it is not `aws:///<zone>/i-…`.
    pub fn parse(raw: &str) -> Option<ProviderId> {
        let (zone, id) = raw.strip_prefix("aws:///")?.split_once('/')?;
        (!zone.is_empty() && id.starts_with("i-") && !id.contains('/'))
            .then(|| ProviderId { zone: zone.to_string(), instance_id: id.to_string() })
    }
}

impl fmt::Display for ProviderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "aws:///{}/{}", self.zone, self.instance_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_round_trip_and_refuse_other_shapes() {
        let p = ProviderId::parse("aws:///us-west-2a/i-0abc").unwrap();
        assert_eq!((p.zone.as_str(), p.instance_id.as_str()), ("us-west-2a", "i-0abc"));
        assert_eq!(p.to_string(), "aws:///us-west-2a/i-0abc");
        for raw in ["", "aws:///", "aws:///z", "aws://z/i-1", "aws:///z/vol-1", "aws:///z/i-1/x"] {
            assert_eq!(ProviderId::parse(raw), None, "{raw:?}");
        }
    }
}
