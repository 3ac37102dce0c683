//! When a Node is a NodeClaim's: the one evidence rule every step that writes to a Node through
//! its claim applies (the inventory's pairing, the cordon, the drain, the release).
//!
//! A claim's `status.nodeName` alone proves nothing. EKS names a node after its private IP and a
//! VPC reuses IPs, so a claim left behind by an uninstalled Karpenter, whose instance is long
//! gone, can name a Node that a managed node group's newer instance registered under the same
//! name. A Node is the claim's only when independent facts agree: it runs on the claim's
//! instance (`spec.providerID` equal to the claim's `status.providerID`) and carries the claim's
//! `karpenter.sh/nodepool` label, which Karpenter puts on every node it registers. (The instance's
//! own tags are the third fact, checked by the EC2 batcher right before a termination.) A claim
//! whose named Node fails the rule is handled as a claim without a node: its instance is settled
//! through EC2, and the other Node is never written.

use crate::karpenter::ProviderId;

/// What the rule reads of one side, Node or NodeClaim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Facts<'a> {
    /// The instance it names (`spec.providerID` of a Node, `status.providerID` of a claim).
    pub(crate) instance: Option<&'a ProviderId>,
    /// Its `karpenter.sh/nodepool` label.
    pub(crate) nodepool: Option<&'a str>,
}

/// Why a Node is not a NodeClaim's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Mismatch {
    /// The claim names no instance yet, so nothing ties a Node to it.
    #[error("the NodeClaim names no instance")]
    ClaimHasNoInstance,
    /// The claim has no NodePool label (Karpenter labels every claim it makes).
    #[error("the NodeClaim has no karpenter.sh/nodepool label")]
    ClaimHasNoPool,
    /// The Node names no instance.
    #[error("the Node has no spec.providerID")]
    NodeHasNoInstance,
    /// The Node runs on another instance.
    #[error("the Node runs on instance {node}, the NodeClaim's is {claim}")]
    OtherInstance {
        /// The Node's instance id.
        node: String,
        /// The claim's instance id.
        claim: String,
    },
    /// The Node is not labelled as a Karpenter node.
    #[error("the Node has no karpenter.sh/nodepool label (it is not a Karpenter node)")]
    NodeHasNoPool,
    /// The Node is labelled with another pool.
    #[error("the Node is of NodePool {node}, the NodeClaim of {claim}")]
    OtherPool {
        /// The Node's pool.
        node: String,
        /// The claim's pool.
        claim: String,
    },
}

/// Whether the Node with `node`'s facts is the machine of the NodeClaim with `claim`'s: the same
/// instance and the same NodePool, both present on both sides. Fails closed: a missing fact is a
/// mismatch, never a pass.
pub(crate) fn node_is_claims(claim: Facts<'_>, node: Facts<'_>) -> Result<(), Mismatch> {
    let claim_instance = claim.instance.ok_or(Mismatch::ClaimHasNoInstance)?;
    let claim_pool = claim.nodepool.ok_or(Mismatch::ClaimHasNoPool)?;
    let node_instance = node.instance.ok_or(Mismatch::NodeHasNoInstance)?;
    // the zone is part of the id's text but not of its identity: instance ids are unique
    if node_instance.instance_id != claim_instance.instance_id {
        return Err(Mismatch::OtherInstance {
            node: node_instance.instance_id.clone(),
            claim: claim_instance.instance_id.clone(),
        });
    }
    let node_pool = node.nodepool.ok_or(Mismatch::NodeHasNoPool)?;
    if node_pool != claim_pool {
        return Err(Mismatch::OtherPool { node: node_pool.to_string(), claim: claim_pool.to_string() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pid(id: &str) -> ProviderId {
        ProviderId { zone: "us-west-2a".into(), instance_id: id.into() }
    }

    fn facts<'a>(instance: Option<&'a ProviderId>, pool: Option<&'a str>) -> Facts<'a> {
        Facts { instance, nodepool: pool }
    }

    #[test]
    fn a_node_is_a_claims_only_on_the_same_instance_and_pool() {
        let (a, b) = (pid("i-0aaa"), pid("i-0bbb"));
        assert_eq!(node_is_claims(facts(Some(&a), Some("web")), facts(Some(&a), Some("web"))), Ok(()));
        // the reused name: a managed node group's node on another instance, without the label
        assert_eq!(
            node_is_claims(facts(Some(&a), Some("web")), facts(Some(&b), None)),
            Err(Mismatch::OtherInstance { node: "i-0bbb".into(), claim: "i-0aaa".into() })
        );
        assert_eq!(node_is_claims(facts(Some(&a), Some("web")), facts(Some(&a), None)), Err(Mismatch::NodeHasNoPool));
        assert_eq!(
            node_is_claims(facts(Some(&a), Some("web")), facts(Some(&a), Some("batch"))),
            Err(Mismatch::OtherPool { node: "batch".into(), claim: "web".into() })
        );
    }

    #[test]
    fn a_missing_fact_on_either_side_is_a_mismatch_never_a_pass() {
        let a = pid("i-0aaa");
        let node = facts(Some(&a), Some("web"));
        assert_eq!(node_is_claims(facts(None, Some("web")), node), Err(Mismatch::ClaimHasNoInstance));
        assert_eq!(node_is_claims(facts(Some(&a), None), node), Err(Mismatch::ClaimHasNoPool));
        assert_eq!(
            node_is_claims(facts(Some(&a), Some("web")), facts(None, Some("web"))),
            Err(Mismatch::NodeHasNoInstance)
        );
    }

    #[test]
    fn the_zone_in_a_provider_id_does_not_decide() {
        let a = pid("i-0aaa");
        let elsewhere = ProviderId { zone: String::new(), instance_id: "i-0aaa".into() };
        assert_eq!(node_is_claims(facts(Some(&a), Some("web")), facts(Some(&elsewhere), Some("web"))), Ok(()));
    }
}
