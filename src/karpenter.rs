//! What the tool knows about Karpenter (v1.0 to v1.14): kinds, labels, finalizers, tags and the
//! provider-id format (design §3). Everything else refers to these names instead of spelling them.

use std::fmt;

/// API group of NodePool and NodeClaim.
pub const KARPENTER_GROUP: &str = "karpenter.sh";
/// API group of EC2NodeClass.
pub const AWS_GROUP: &str = "karpenter.k8s.aws";
/// The version all three kinds are served at since Karpenter 1.0.
pub const VERSION: &str = "v1";

/// Label on every Karpenter node naming its NodePool; nodes without it are never touched.
pub const LABEL_NODEPOOL: &str = "karpenter.sh/nodepool";
/// Label on Karpenter nodes naming their EC2NodeClass (since 1.1).
pub const LABEL_NODECLASS: &str = "karpenter.k8s.aws/ec2nodeclass";
/// Finalizer on NodeClaims and Nodes that guards instance termination.
pub const FINALIZER_TERMINATION: &str = "karpenter.sh/termination";
/// Finalizer on EC2NodeClasses that guards launch templates and instance profiles.
pub const FINALIZER_NODECLASS: &str = "karpenter.k8s.aws/termination";
/// Taint Karpenter puts on nodes it is disrupting; the tool uses it while draining.
pub const TAINT_DISRUPTED: &str = "karpenter.sh/disrupted";

/// Instance tag naming the EKS cluster.
pub const TAG_EKS_CLUSTER: &str = "eks:eks-cluster-name";
/// Instance tag naming the NodePool.
pub const TAG_NODEPOOL: &str = "karpenter.sh/nodepool";
/// Instance tag naming the EC2NodeClass.
pub const TAG_NODECLASS: &str = "karpenter.k8s.aws/ec2nodeclass";
/// Instance tag naming the NodeClaim (set after registration).
pub const TAG_NODECLAIM: &str = "karpenter.sh/nodeclaim";
/// Launch-template tag naming the cluster in Karpenter 1.0.x (later releases use the EKS tag).
pub const TAG_LEGACY_CLUSTER: &str = "karpenter.k8s.aws/cluster";
/// Launch templates Karpenter creates are named with this prefix and a hash.
pub const LAUNCH_TEMPLATE_PREFIX: &str = "karpenter.k8s.aws/";

/// The `kubernetes.io/cluster/<c>` tag key of a cluster.
pub fn cluster_tag_key(cluster: &str) -> String {
    format!("kubernetes.io/cluster/{cluster}")
}

/// The IAM path of instance profiles Karpenter ≥ 1.7 creates for a cluster in a region
/// (`/karpenter/<region>/<cluster>/<class-uid>/`); this is the cluster-wide prefix.
pub fn instance_profile_path_prefix(region: &str, cluster: &str) -> String {
    format!("/karpenter/{region}/{cluster}/")
}

/// Name prefix of instance profiles Karpenter < 1.7 created at path `/` (`<cluster>_<hash>`).
pub fn legacy_instance_profile_prefix(cluster: &str) -> String {
    format!("{cluster}_")
}

/// A parsed `aws:///<zone>/<instance-id>` provider id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderId {
    /// Availability zone, e.g. `us-west-2a`.
    pub zone: String,
    /// EC2 instance id, e.g. `i-0123456789abcdef0`.
    pub instance_id: String,
}

/// A provider id that is not of the form `aws:///<zone>/<instance-id>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("provider id {0:?} is not of the form aws:///<zone>/<instance-id>")]
pub struct BadProviderId(pub String);

impl ProviderId {
    /// Parses a provider id as Karpenter writes it on NodeClaims and Nodes.
    pub fn parse(raw: &str) -> Result<ProviderId, BadProviderId> {
        let bad = || BadProviderId(raw.to_string());
        let rest = raw.strip_prefix("aws:///").ok_or_else(bad)?;
        let (zone, id) = rest.split_once('/').ok_or_else(bad)?;
        if zone.is_empty() || !id.starts_with("i-") || id.contains('/') {
            return Err(bad());
        }
        Ok(ProviderId { zone: zone.to_string(), instance_id: id.to_string() })
    }

    /// The region the zone belongs to (`us-west-2a` → `us-west-2`, local zone
    /// `us-west-2-lax-1a` → `us-west-2`).
    pub fn region(&self) -> String {
        let parts: Vec<&str> = self.zone.split('-').collect();
        if parts.len() >= 3 {
            let third: String = parts[2].chars().take_while(|c| c.is_ascii_digit()).collect();
            format!("{}-{}-{}", parts[0], parts[1], third)
        } else {
            self.zone.trim_end_matches(|c: char| c.is_ascii_alphabetic()).to_string()
        }
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
    fn provider_ids_parse_and_name_their_region() {
        let p = ProviderId::parse("aws:///us-west-2a/i-0123456789abcdef0").unwrap();
        assert_eq!(p.zone, "us-west-2a");
        assert_eq!(p.instance_id, "i-0123456789abcdef0");
        assert_eq!(p.region(), "us-west-2");
        assert_eq!(p.to_string(), "aws:///us-west-2a/i-0123456789abcdef0");
        let local = ProviderId::parse("aws:///us-west-2-lax-1a/i-0abc").unwrap();
        assert_eq!(local.region(), "us-west-2");
        let eu = ProviderId::parse("aws:///eu-central-1b/i-1").unwrap();
        assert_eq!(eu.region(), "eu-central-1");
    }

    #[test]
    fn malformed_provider_ids_are_rejected() {
        for raw in ["", "aws:///", "aws:///us-west-2a", "aws://us-west-2a/i-1", "kind://x/y", "aws:///z/vol-1"] {
            assert!(ProviderId::parse(raw).is_err(), "{raw:?} should not parse");
        }
    }
}
