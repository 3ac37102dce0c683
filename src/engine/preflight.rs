//! Identity and blast radius, before any write (design §2.1, §7): the evidence of which
//! cluster the kubeconfig reaches, checked against `--cluster`/`--region`/`--account`.

use std::collections::BTreeSet;

use super::inventory::Inventory;
use crate::aws::AwsClients;
use crate::aws::partition::{EksClusterArn, partition_of_region};
use crate::k8s::Kube;
use crate::karpenter;

/// What the preflight found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evidence {
    /// What agrees (or is merely observed), one line each.
    pub facts: Vec<String>,
    /// What contradicts the target: any entry refuses the run.
    pub contradictions: Vec<String>,
}

/// Gathers the evidence. AWS errors propagate (they are configuration problems at this point).
pub async fn identity(
    kube: &Kube,
    aws: &AwsClients,
    cluster: &str,
    region: &str,
    account: Option<&str>,
    inv: &Inventory,
) -> Result<Evidence, crate::aws::AwsError> {
    let mut ev = Evidence::default();
    // the kube context, when it is an EKS ARN of any partition:
    // arn:<partition>:eks:<region>:<account>:cluster/<name>
    if let Some(ctx) = &kube.context {
        match EksClusterArn::parse(ctx) {
            Some(arn) => context_arn_evidence(ctx, &arn, cluster, region, account, &mut ev),
            None => ev.facts.push(format!("kube context {ctx} (not an EKS ARN: no evidence either way)")),
        }
    }
    if let Some(c) = &inv.controller {
        match &c.cluster_name {
            Some(name) if name != cluster => ev.contradictions.push(format!(
                "the Karpenter controller {}/{} is configured for cluster {name}, not {cluster}",
                c.namespace, c.name
            )),
            Some(name) => ev.facts.push(format!("the Karpenter controller is configured for cluster {name}")),
            None => ev.facts.push("the Karpenter controller names no cluster (CLUSTER_NAME unset)".into()),
        }
    }
    // the instances behind the Karpenter nodes and NodeClaims: their region and cluster tags
    let mut ids = Vec::new();
    let mut regions = BTreeSet::new();
    for m in inv.machines.values() {
        if let Some(p) = &m.provider_id {
            regions.insert(p.region());
            ids.push(p.instance_id.clone());
        }
    }
    for r in &regions {
        if r != region {
            ev.contradictions.push(format!("Karpenter nodes run in region {r} (from their providerIDs), not {region}"));
        }
    }
    if !ids.is_empty() && ev.contradictions.is_empty() {
        let found = aws.ec2.instances_by_id(&ids).await?;
        let mut other: BTreeSet<String> = BTreeSet::new();
        let mut matching = 0;
        for i in &found {
            let tag = i.tag(karpenter::TAG_EKS_CLUSTER);
            let owned = i.tags.contains_key(&karpenter::cluster_tag_key(cluster));
            match tag {
                Some(t) if t == cluster => matching += 1,
                Some(t) => {
                    other.insert(t.to_string());
                }
                None if owned => matching += 1,
                None => {}
            }
        }
        for o in other {
            ev.contradictions.push(format!(
                "instances behind the Karpenter nodes are tagged {}={o}, not {cluster}",
                karpenter::TAG_EKS_CLUSTER
            ));
        }
        ev.facts.push(format!(
            "{matching} of {} instance(s) behind the Karpenter nodes are tagged for cluster {cluster} ({} unknown to EC2 in {region})",
            ids.len(),
            ids.len() - found.len()
        ));
    }
    if let Some(a) = account {
        let actual = aws.account().await?;
        if actual != a {
            ev.contradictions.push(format!("the AWS credentials belong to account {actual}, not {a}"));
        } else {
            ev.facts.push(format!("AWS account {actual}"));
        }
    }
    Ok(ev)
}

/// What an EKS ARN context says against the target: cluster, region, partition and account.
fn context_arn_evidence(
    ctx: &str,
    arn: &EksClusterArn,
    cluster: &str,
    region: &str,
    account: Option<&str>,
    ev: &mut Evidence,
) {
    if arn.cluster != cluster {
        ev.contradictions.push(format!("the kube context {ctx} is cluster {}, not {cluster}", arn.cluster));
    }
    if arn.region != region {
        ev.contradictions.push(format!("the kube context {ctx} is in region {}, not {region}", arn.region));
    }
    let partition = partition_of_region(region);
    if arn.partition != partition {
        ev.contradictions.push(format!(
            "the kube context {ctx} is in partition {}, but region {region} is in {partition}",
            arn.partition
        ));
    }
    match account {
        Some(a) if a != arn.account => {
            ev.contradictions.push(format!("the kube context {ctx} is in account {}, not {a}", arn.account));
        }
        _ => ev.facts.push(format!("the kube context is the EKS cluster {} in {}", arn.cluster, arn.region)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judge(ctx: &str, cluster: &str, region: &str, account: Option<&str>) -> Evidence {
        let mut ev = Evidence::default();
        context_arn_evidence(ctx, &EksClusterArn::parse(ctx).unwrap(), cluster, region, account, &mut ev);
        ev
    }

    #[test]
    fn a_govcloud_or_china_context_arn_of_the_target_is_evidence_not_a_contradiction() {
        let gov = judge("arn:aws-us-gov:eks:us-gov-west-1:123456789012:cluster/prod", "prod", "us-gov-west-1", None);
        assert!(gov.contradictions.is_empty(), "{gov:?}");
        let cn =
            judge("arn:aws-cn:eks:cn-north-1:123456789012:cluster/prod", "prod", "cn-north-1", Some("123456789012"));
        assert!(cn.contradictions.is_empty(), "{cn:?}");
    }

    #[test]
    fn a_context_arn_of_another_cluster_region_partition_or_account_refuses() {
        let ctx = "arn:aws:eks:us-west-2:123456789012:cluster/prod";
        assert_eq!(judge(ctx, "staging", "us-west-2", None).contradictions.len(), 1);
        assert_eq!(judge(ctx, "prod", "us-east-1", None).contradictions.len(), 1);
        assert_eq!(judge(ctx, "prod", "us-west-2", Some("210987654321")).contradictions.len(), 1);
        let wrong_partition = judge("arn:aws-cn:eks:us-west-2:123456789012:cluster/prod", "prod", "us-west-2", None);
        assert_eq!(wrong_partition.contradictions.len(), 1, "{wrong_partition:?}");
    }
}
