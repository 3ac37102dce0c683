//! Why a run refuses before its first write: one enum, its messages in one place. Each message
//! says what was found, that nothing was changed, and what to do; each kind has its exit code.

use crate::exit::Exit;

/// A refusal decided before any change (also in a dry run).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// The evidence says the kubeconfig reaches another cluster than `--cluster`/`--region`.
    #[error(
        "refusing: the kubeconfig does not reach cluster {cluster} in {region}: {}. Nothing was changed; check --cluster, --region, --context and KUBECONFIG",
        .contradictions.join("; ")
    )]
    WrongCluster { cluster: String, region: String, contradictions: Vec<String> },
    /// The same, found while reading what a dead 1.0.x conversion webhook still lets through.
    #[error("refusing: {}. Nothing was changed", .contradictions.join("; "))]
    WrongClusterStranded { contradictions: Vec<String> },
    /// More Karpenter nodes than `--max-nodes` allows.
    #[error(
        "refusing: this run would act on {nodes} Karpenter machines (nodes and live instances), more than --max-nodes {max}. Nothing was changed; raise --max-nodes if this is the right cluster"
    )]
    BlastRadius { nodes: usize, max: u32 },
    /// The identities lack permissions the plan needs: the run would stop half-way.
    #[error(
        "refusing: the run would stop half-way on missing permissions. {}. Nothing was changed; see the README, Real use against EKS",
        missing_parts(.kubernetes, .ec2)
    )]
    MissingPermissions { kubernetes: Vec<String>, ec2: Vec<String> },
    /// The API server's admission chain (a webhook, an admission policy) would refuse writes
    /// the run makes: it would stop half-way.
    #[error(
        "refusing: the API server's admission chain would refuse writes this run makes, and the run would stop half-way: {}. Nothing was changed; the tool never edits webhook configurations or admission policies",
        .blocked.join("; ")
    )]
    Admission { blocked: Vec<String> },
    /// The drain would strand a controller that still has objects to clean up in AWS.
    #[error(
        "refusing: the drain would strand {}: {}. Nothing was changed; pass --release load-balancers (Services, Ingresses) or --release volumes (StatefulSets' claims) to have this run delete those objects while the controller still runs (it then deletes what it made in AWS), or delete them yourself, or run the controller on capacity this run keeps (a managed node group or Fargate), then run again",
        .cleaners.join(" and "),
        .objects.join("; ")
    )]
    Stranded { cleaners: Vec<String>, objects: Vec<String> },
    /// A controller that holds objects cannot be placed: no pod of it was found.
    #[error(
        "refusing: cannot tell where {} run{}: {} hold objects the drain may strand ({}), and no pod of them was found by \
         their chart's label, their leader Lease, their webhooks or their image. Nothing was changed; if it really is \
         stopped, pass {} to go on (its objects then stay held), or run it where this run keeps capacity",
        .cleaners.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>().join(" and "),
        if .cleaners.len() == 1 { "s" } else { "" },
        if .cleaners.len() == 1 { "it" } else { "they" },
        .objects.join("; "),
        .cleaners.iter().map(|(_, f)| format!("--assume-stopped {f}")).collect::<Vec<_>>().join(" ")
    )]
    Unplaced { cleaners: Vec<(String, String)>, objects: Vec<String> },
    /// `--release` covers objects whose controller does not run: nothing would delete them.
    #[error(
        "refusing to release: {}. Nothing was changed; start the controller again (or delete the objects' AWS resources and then their finalizers yourself), then run again",
        .objects.join("; ")
    )]
    Unreleasable { objects: Vec<String> },
    /// `--release volumes` covers volumes that deleting a StatefulSet's claims cannot release.
    #[error(
        "refusing to release volumes: {}. Nothing was changed; scale the workloads named to zero (or delete what is named yourself, if its volume is meant to go), then run again",
        .objects.join("; ")
    )]
    VolumesInUse { objects: Vec<String> },
    /// `--release` covers objects whose load balancer has deletion protection on.
    #[error(
        "refusing to release: {}. Nothing was changed; turn deletion protection off (the annotation, or the load balancer's attribute in AWS) if the load balancer is meant to go, or delete the object yourself and keep its load balancer, then run again",
        .objects.join("; ")
    )]
    Protected { objects: Vec<String> },
    /// Active GitOps owners would put back what the run removes (the survey's own wording).
    #[error("{0}")]
    GitOps(String),
}

impl Refusal {
    /// The exit code of this refusal: a missing permission is bad input (the fix is in the
    /// caller's setup), the others are a guard's refusal.
    pub(crate) fn exit(&self) -> Exit {
        match self {
            Refusal::MissingPermissions { .. } | Refusal::Admission { .. } => Exit::BadInput,
            Refusal::WrongCluster { .. }
            | Refusal::WrongClusterStranded { .. }
            | Refusal::BlastRadius { .. }
            | Refusal::Stranded { .. }
            | Refusal::Unplaced { .. }
            | Refusal::Unreleasable { .. }
            | Refusal::VolumesInUse { .. }
            | Refusal::Protected { .. }
            | Refusal::GitOps(_) => Exit::Refused,
        }
    }
}

fn missing_parts(kubernetes: &[String], ec2: &[String]) -> String {
    let mut parts = Vec::new();
    if !kubernetes.is_empty() {
        parts.push(format!(
            "Kubernetes RBAC does not allow: {} (apply deploy/rbac.yaml and bind it to the identity of the kubeconfig)",
            kubernetes.join(", ")
        ));
    }
    if !ec2.is_empty() {
        parts.push(format!(
            "IAM does not allow: {} (attach deploy/iam-policy.json to the AWS identity)",
            ec2.join(", ")
        ));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_names_the_problem_that_nothing_changed_and_the_fix() {
        let wrong = Refusal::WrongCluster {
            cluster: "prod".into(),
            region: "eu-west-1".into(),
            contradictions: vec!["node n1 runs in us-east-1".into()],
        };
        assert_eq!(wrong.exit(), Exit::Refused);
        let text = wrong.to_string();
        assert!(
            text.contains("node n1 runs in us-east-1")
                && text.contains("Nothing was changed")
                && text.contains("--cluster")
        );
        let perms = Refusal::MissingPermissions { kubernetes: vec!["evict pods".into()], ec2: Vec::new() };
        assert_eq!(perms.exit(), Exit::BadInput);
        let text = perms.to_string();
        assert!(text.contains("evict pods") && text.contains("deploy/rbac.yaml") && !text.contains("IAM"), "{text}");
        let radius = Refusal::BlastRadius { nodes: 12, max: 10 };
        assert!(
            radius.to_string().contains("12 Karpenter machines (nodes and live instances), more than --max-nodes 10")
        );
    }
}
