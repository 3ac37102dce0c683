//! Identity and blast radius, before any write (design §2.1, §7): the evidence of which
//! cluster the kubeconfig reaches, checked against `--cluster`/`--region`/`--account`.

use std::collections::BTreeSet;

use super::inventory::Inventory;
use crate::aws::AwsClients;
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
    // the kube context, when it is an EKS ARN: arn:aws:eks:<region>:<account>:cluster/<name>
    if let Some(ctx) = &kube.context {
        if let Some(rest) = ctx.strip_prefix("arn:aws:eks:").or_else(|| ctx.strip_prefix("arn:aws-us-gov:eks:")) {
            let parts: Vec<&str> = rest.splitn(3, ':').collect();
            if let [ctx_region, ctx_account, res] = parts.as_slice() {
                let ctx_cluster = res.strip_prefix("cluster/").unwrap_or(res);
                if ctx_cluster != cluster {
                    ev.contradictions.push(format!("the kube context {ctx} is cluster {ctx_cluster}, not {cluster}"));
                }
                if *ctx_region != region {
                    ev.contradictions.push(format!("the kube context {ctx} is in region {ctx_region}, not {region}"));
                }
                if let Some(a) = account
                    && a != *ctx_account
                {
                    ev.contradictions.push(format!("the kube context {ctx} is in account {ctx_account}, not {a}"));
                }
            }
        } else {
            ev.facts.push(format!("kube context {ctx} (not an EKS ARN: no evidence either way)"));
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
