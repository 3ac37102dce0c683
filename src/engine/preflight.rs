//! Identity and blast radius, before any write (design §2.1, §7): the evidence of which
//! cluster the kubeconfig reaches, checked against `--cluster`/`--region`/`--account`.
//!
//! A run goes ahead only on *positive* evidence that the cluster reached is `--cluster` (a
//! [`Evidence::proofs`] entry), and never against a contradiction: finding nothing either way
//! refuses. Reading ([`identity`]) and judging ([`verdict`]) are apart so that what refuses a run
//! can be tested without a cluster or AWS.

use std::collections::BTreeSet;

use super::inventory::Inventory;
use crate::aws::eks::same_server;
use crate::aws::{AwsClients, EksLookup, InstanceInfo};
use crate::k8s::Kube;
use crate::karpenter::{self, ProviderId};
use crate::partition::{EksClusterArn, partition_of_region};

/// What the preflight found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evidence {
    /// What agrees (or is merely observed), one line each.
    pub facts: Vec<String>,
    /// What positively shows that the cluster reached is the target, strongest first: without
    /// one the run is refused ([`verdict`]). Each is in `facts` too.
    pub proofs: Vec<String>,
    /// What contradicts the target: any entry refuses the run.
    pub contradictions: Vec<String>,
}

impl Evidence {
    fn prove(&mut self, fact: String) {
        self.proofs.push(fact.clone());
        self.facts.push(fact);
    }
}

/// Where the kubeconfig points: the API server and what it trusts for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reached {
    /// The server URL.
    pub server: String,
    /// The certificate authority the kubeconfig trusts (DER), empty without one.
    pub ca_certs: Vec<Vec<u8>>,
    /// Whether TLS is verified against it (https, and no `insecure-skip-tls-verify`).
    pub tls_verified: bool,
}

impl Reached {
    /// What a connected client points at.
    pub fn of(kube: &Kube) -> Reached {
        Reached { server: kube.server.clone(), ca_certs: kube.ca_certs.clone(), tls_verified: kube.tls_verified }
    }
}

/// What the run is asked to tear down: the evidence is judged against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    /// `--cluster`.
    pub cluster: &'a str,
    /// `--region`.
    pub region: &'a str,
    /// `--account`, when given.
    pub account: Option<&'a str>,
}

/// The Karpenter controller as far as identity goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerSeen {
    /// Its Deployment's namespace.
    pub namespace: String,
    /// Its Deployment's name.
    pub name: String,
    /// Its CLUSTER_NAME, when set.
    pub cluster_name: Option<String>,
}

/// What the preflight read, before any of it is judged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observations {
    /// The kubeconfig context in use.
    pub context: Option<String>,
    /// The API server the kubeconfig reaches.
    pub reached: Reached,
    /// What EKS said of `--cluster`; `None` when it was not asked.
    pub eks: Option<EksLookup>,
    /// The Karpenter controller, when found.
    pub controller: Option<ControllerSeen>,
    /// The instances behind the Karpenter nodes and NodeClaims, from their providerIDs.
    pub provider_ids: Vec<ProviderId>,
    /// What EC2 in the target region returned for those instances; `None` when it was not asked
    /// (see [`asks_ec2`]).
    pub instances: Option<Vec<InstanceInfo>>,
    /// The account of the AWS credentials; `None` when no `--account` asked for it.
    pub account: Option<String>,
    /// EKS Auto Mode's objects in the cluster (`Node/name`, `NodePool/name`, ...), which the
    /// inventory set aside: only a cluster with Auto Mode enabled has them.
    pub auto_mode_objects: Vec<String>,
}

impl Observations {
    /// What the cluster itself shows: the context, the controller and the providerIDs (no I/O).
    pub fn of_cluster(kube: &Kube, inv: &Inventory) -> Observations {
        Observations {
            context: kube.context.clone(),
            reached: Reached::of(kube),
            eks: None,
            controller: inv.controller.as_ref().map(|c| ControllerSeen {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                cluster_name: c.cluster_name.clone(),
            }),
            provider_ids: inv.machines.values().filter_map(|m| m.provider_id.clone()).collect(),
            instances: None,
            account: None,
            auto_mode_objects: inv
                .not_ours
                .iter()
                .filter(|f| f.why == crate::karpenter::NotOurs::EksAutoMode)
                .map(|f| format!("{}/{}", f.kind, f.name))
                .collect(),
        }
    }

    fn instance_ids(&self) -> Vec<String> {
        self.provider_ids.iter().map(|p| p.instance_id.clone()).collect()
    }
}

/// Gathers the evidence and judges it. AWS errors propagate (they are configuration problems at
/// this point).
pub async fn identity(
    kube: &Kube,
    aws: &AwsClients,
    cluster: &str,
    region: &str,
    account: Option<&str>,
    inv: &Inventory,
) -> Result<Evidence, crate::aws::AwsError> {
    let target = Target { cluster, region, account };
    let mut obs = Observations::of_cluster(kube, inv);
    obs.eks = Some(aws.eks.describe_cluster(cluster).await?);
    if asks_ec2(&obs, &target) {
        obs.instances = Some(aws.ec2.instances_by_id(&obs.instance_ids()).await?);
    }
    if account.is_some() {
        obs.account = Some(aws.account().await?);
    }
    Ok(verdict(&obs, &target))
}

/// Whether EC2 is asked about the instances: only when there are some and the cluster's own
/// evidence agrees with the target. Instances in another region cannot be found in this one, and
/// a run already refused needs no more evidence.
pub fn asks_ec2(obs: &Observations, target: &Target<'_>) -> bool {
    let mut ev = Evidence::default();
    cluster_evidence(obs, target, &mut ev);
    !obs.provider_ids.is_empty() && ev.contradictions.is_empty()
}

/// Judges what was read against the target: every contradiction refuses the run, and so does
/// the want of a proof (design §2.1: positive evidence, then action).
pub fn verdict(obs: &Observations, target: &Target<'_>) -> Evidence {
    let mut ev = Evidence::default();
    if let Some(eks) = &obs.eks {
        eks_evidence(eks, &obs.reached, target, &mut ev);
        if let EksLookup::Found(c) = eks {
            auto_mode_evidence(c.auto_mode, &obs.auto_mode_objects, target.cluster, &mut ev);
        }
    }
    cluster_evidence(obs, target, &mut ev);
    if let Some(found) = &obs.instances {
        instance_evidence(obs.provider_ids.len(), found, target, &mut ev);
    }
    if let (Some(a), Some(actual)) = (target.account, &obs.account) {
        if actual != a {
            ev.contradictions.push(format!("the AWS credentials belong to account {actual}, not {a}"));
        } else {
            ev.facts.push(format!("AWS account {actual}"));
        }
    }
    if ev.proofs.is_empty() && ev.contradictions.is_empty() {
        ev.contradictions.push(format!(
            "nothing shows that the cluster reached ({}) is {}: looked for EKS's endpoint and certificate authority of \
             {} (eks:DescribeCluster), instances behind Karpenter nodes tagged for it, and a Karpenter controller \
             configured for it",
            obs.reached.server, target.cluster, target.cluster
        ));
    }
    ev
}

/// What EKS says of the target against the server the kubeconfig reaches. The certificate
/// authority is the strongest proof: EKS makes one per cluster, and a verified TLS handshake
/// shows the server holds a certificate it signed. The endpoint is EKS's own name for the
/// server. A cluster EKS does not know, or whose authority and endpoint both differ from the
/// kubeconfig's, is another cluster.
fn eks_evidence(eks: &EksLookup, reached: &Reached, target: &Target<'_>, ev: &mut Evidence) {
    let Target { cluster, region, .. } = *target;
    let c = match eks {
        EksLookup::NotFound => {
            ev.contradictions.push(format!(
                "EKS has no cluster named {cluster} in {region} for these AWS credentials (eks:DescribeCluster)"
            ));
            return;
        }
        EksLookup::Found(c) => c,
    };
    let ca_known = !c.certificate_authority.is_empty() && !reached.ca_certs.is_empty();
    let ca_matches = ca_known && reached.ca_certs.iter().any(|k| c.certificate_authority.contains(k));
    let endpoint_matches = c.endpoint.as_deref().is_some_and(|e| same_server(e, &reached.server));
    if ca_matches && reached.tls_verified {
        ev.prove(format!(
            "the API server's certificate authority is EKS cluster {cluster}'s (TLS verified against it)"
        ));
    }
    if endpoint_matches {
        ev.prove(format!("the kubeconfig's server {} is EKS cluster {cluster}'s endpoint", reached.server));
    }
    if ca_known && !ca_matches {
        ev.contradictions.push(format!(
            "the kubeconfig's certificate authority for {} is not EKS cluster {cluster}'s",
            reached.server
        ));
    } else if !endpoint_matches && !ca_matches {
        ev.contradictions.push(format!(
            "the kubeconfig's server {} is not EKS cluster {cluster}'s endpoint {}",
            reached.server,
            c.endpoint.as_deref().unwrap_or("(none yet)")
        ));
    }
    ev.facts.push(format!(
        "EKS cluster {cluster} is {}",
        if c.status.is_empty() { "of unknown status" } else { &c.status }
    ));
}

/// What EKS says of Auto Mode against what the inventory set aside as Auto Mode's. Only a
/// cluster with Auto Mode enabled runs Auto Mode's nodes and pools, so finding them where EKS
/// says it is off means the cluster reached is not `--cluster` (or Auto Mode was turned off and
/// its machines are not gone yet): either way, what the tool would act on is not what EKS
/// describes, and it refuses.
fn auto_mode_evidence(enabled: bool, objects: &[String], cluster: &str, ev: &mut Evidence) {
    let named = || {
        let mut shown: Vec<&str> = objects.iter().take(3).map(String::as_str).collect();
        if objects.len() > shown.len() {
            shown.push("...");
        }
        shown.join(", ")
    };
    match (enabled, objects.is_empty()) {
        (false, false) => ev.contradictions.push(format!(
            "the cluster reached holds {} object(s) of EKS Auto Mode ({}), but EKS cluster {cluster} has Auto Mode off \
             (computeConfig.enabled): it is another cluster, or Auto Mode was turned off and its machines are not \
             gone yet (run again once they are)",
            objects.len(),
            named()
        )),
        (true, false) => ev.facts.push(format!(
            "EKS Auto Mode is enabled on {cluster}: its {} object(s) ({}) are EKS's and are left alone",
            objects.len(),
            named()
        )),
        (true, true) => ev.facts.push(format!(
            "EKS Auto Mode is enabled on {cluster}: its NodePools, NodeClaims and nodes are EKS's and are left alone"
        )),
        (false, true) => {}
    }
}

/// What the cluster says of itself: the kube context, the controller's CLUSTER_NAME and the
/// regions of its nodes' instances.
fn cluster_evidence(obs: &Observations, target: &Target<'_>, ev: &mut Evidence) {
    let Target { cluster, region, .. } = *target;
    // the kube context, when it is an EKS ARN of any partition:
    // arn:<partition>:eks:<region>:<account>:cluster/<name>
    if let Some(ctx) = &obs.context {
        match EksClusterArn::parse(ctx) {
            Some(arn) => context_arn_evidence(ctx, &arn, target, ev),
            None => ev.facts.push(format!("kube context {ctx} (not an EKS ARN: no evidence either way)")),
        }
    }
    if let Some(c) = &obs.controller {
        match &c.cluster_name {
            Some(name) if name != cluster => ev.contradictions.push(format!(
                "the Karpenter controller {}/{} is configured for cluster {name}, not {cluster}",
                c.namespace, c.name
            )),
            Some(name) => ev.prove(format!("the Karpenter controller is configured for cluster {name}")),
            None => ev.facts.push("the Karpenter controller names no cluster (CLUSTER_NAME unset)".into()),
        }
    }
    let regions: BTreeSet<String> = obs.provider_ids.iter().map(ProviderId::region).collect();
    for r in &regions {
        if r != region {
            ev.contradictions.push(format!("Karpenter nodes run in region {r} (from their providerIDs), not {region}"));
        }
    }
}

/// What EC2 says of the `asked` instances behind the nodes: their cluster tags.
fn instance_evidence(asked: usize, found: &[InstanceInfo], target: &Target<'_>, ev: &mut Evidence) {
    let Target { cluster, region, .. } = *target;
    let mut other: BTreeSet<String> = BTreeSet::new();
    let mut matching = 0;
    for i in found {
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
    let line = format!(
        "{matching} of {asked} instance(s) behind the Karpenter nodes are tagged for cluster {cluster} ({} unknown to EC2 in {region})",
        asked.saturating_sub(found.len())
    );
    if matching > 0 { ev.prove(line) } else { ev.facts.push(line) }
}

/// What an EKS ARN context says against the target: cluster, region, partition and account.
fn context_arn_evidence(ctx: &str, arn: &EksClusterArn, target: &Target<'_>, ev: &mut Evidence) {
    let Target { cluster, region, account } = *target;
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
    use std::collections::BTreeMap;

    use super::*;
    use crate::aws::InstanceState;

    const PROD: Target<'static> = Target { cluster: "prod", region: "us-west-2", account: None };

    /// The context's evidence, beside a controller configured for the target (a proof, so that
    /// only what the context says is judged).
    fn judge(ctx: &str, cluster: &str, region: &str, account: Option<&str>) -> Evidence {
        let obs = Observations {
            context: Some(ctx.into()),
            controller: controller(Some(cluster)),
            ..Observations::default()
        };
        verdict(&obs, &Target { cluster, region, account })
    }

    fn controller(cluster_name: Option<&str>) -> Option<ControllerSeen> {
        Some(ControllerSeen {
            namespace: "kube-system".into(),
            name: "karpenter".into(),
            cluster_name: cluster_name.map(str::to_string),
        })
    }

    fn node(zone: &str, id: &str) -> ProviderId {
        ProviderId { zone: zone.into(), instance_id: id.into() }
    }

    fn instance(id: &str, tags: &[(&str, &str)]) -> InstanceInfo {
        InstanceInfo {
            id: id.into(),
            state: InstanceState::Running,
            zone: "us-west-2a".into(),
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            managed_by: None,
            launched: None,
            instance_type: None,
            market: None,
        }
    }

    /// A cluster whose every piece of evidence names `prod` in us-west-2, account 123456789012.
    fn matching() -> Observations {
        Observations {
            context: Some("arn:aws:eks:us-west-2:123456789012:cluster/prod".into()),
            controller: controller(Some("prod")),
            provider_ids: vec![node("us-west-2a", "i-1"), node("us-west-2b", "i-2")],
            instances: Some(vec![
                instance("i-1", &[(karpenter::TAG_EKS_CLUSTER, "prod")]),
                instance("i-2", &[(karpenter::TAG_EKS_CLUSTER, "prod")]),
            ]),
            account: Some("123456789012".into()),
            ..Observations::default()
        }
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

    #[test]
    fn a_context_arn_of_another_account_and_region_names_both() {
        let ctx = "arn:aws:eks:eu-west-1:210987654321:cluster/prod";
        let ev = judge(ctx, "prod", "us-west-2", Some("123456789012"));
        assert_eq!(
            ev.contradictions,
            [
                format!("the kube context {ctx} is in region eu-west-1, not us-west-2"),
                format!("the kube context {ctx} is in account 210987654321, not 123456789012"),
            ]
        );
    }

    #[test]
    fn a_context_that_is_no_eks_arn_is_only_a_fact() {
        let ev = judge("kind-prod", "staging", "us-west-2", Some("123456789012"));
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert_eq!(
            ev.facts,
            [
                "kube context kind-prod (not an EKS ARN: no evidence either way)",
                "the Karpenter controller is configured for cluster staging"
            ]
        );
    }

    #[test]
    fn a_cluster_that_shows_nothing_either_way_is_refused() {
        let obs = Observations {
            context: Some("kind-prod".into()),
            reached: Reached { server: "https://127.0.0.1:6443".into(), ..Reached::default() },
            ..Observations::default()
        };
        let ev = verdict(&obs, &Target { cluster: "staging", region: "us-west-2", account: None });
        assert!(ev.proofs.is_empty(), "{ev:?}");
        assert_eq!(ev.contradictions.len(), 1, "{ev:?}");
        assert!(
            ev.contradictions[0]
                .starts_with("nothing shows that the cluster reached (https://127.0.0.1:6443) is staging"),
            "{ev:?}"
        );
        let arn_only = judge_alone("arn:aws:eks:us-west-2:123456789012:cluster/prod", "prod");
        assert_eq!(arn_only.contradictions.len(), 1, "a context's name is no proof: {arn_only:?}");
    }

    fn judge_alone(ctx: &str, cluster: &str) -> Evidence {
        let obs = Observations { context: Some(ctx.into()), ..Observations::default() };
        verdict(&obs, &Target { cluster, region: "us-west-2", account: None })
    }

    const SERVER: &str = "https://abc.gr7.us-west-2.eks.amazonaws.com";

    fn eks_cluster(endpoint: &str, ca: &[u8]) -> EksLookup {
        EksLookup::Found(crate::aws::EksCluster {
            arn: "arn:aws:eks:us-west-2:123456789012:cluster/prod".into(),
            status: "ACTIVE".into(),
            endpoint: Some(endpoint.into()),
            certificate_authority: vec![ca.to_vec()],
            auto_mode: false,
            created: None,
        })
    }

    fn reaching(server: &str, ca: &[u8], tls_verified: bool) -> Reached {
        Reached { server: server.into(), ca_certs: vec![ca.to_vec()], tls_verified }
    }

    #[test]
    fn auto_mode_objects_where_eks_says_auto_mode_is_off_refuse_the_run() {
        let with = |auto_mode: bool, objects: &[&str]| {
            let mut eks = eks_cluster(SERVER, b"ca-prod");
            if let EksLookup::Found(c) = &mut eks {
                c.auto_mode = auto_mode;
            }
            let obs = Observations {
                reached: reaching(SERVER, b"ca-prod", true),
                eks: Some(eks),
                auto_mode_objects: objects.iter().map(|o| o.to_string()).collect(),
                ..Observations::default()
            };
            verdict(&obs, &PROD)
        };
        let off = with(false, &["NodePool/general-purpose", "Node/i-1", "Node/i-2", "Node/i-3"]);
        assert_eq!(off.contradictions.len(), 1, "{off:?}");
        assert!(
            off.contradictions[0].starts_with(
                "the cluster reached holds 4 object(s) of EKS Auto Mode (NodePool/general-purpose, Node/i-1, Node/i-2, ...), but EKS cluster prod has Auto Mode off"
            ),
            "{off:?}"
        );
        let on = with(true, &["NodePool/general-purpose"]);
        assert!(on.contradictions.is_empty(), "{on:?}");
        assert!(on.facts.iter().any(|f| f.contains("its 1 object(s) (NodePool/general-purpose) are EKS's")), "{on:?}");
        let none = with(false, &[]);
        assert!(none.contradictions.is_empty(), "{none:?}");
        assert!(!none.facts.iter().any(|f| f.contains("Auto Mode")), "{none:?}");
    }

    #[test]
    fn eks_endpoint_and_authority_of_the_target_prove_it_alone() {
        let obs = Observations {
            reached: reaching(SERVER, b"ca-prod", true),
            eks: Some(eks_cluster(SERVER, b"ca-prod")),
            ..Observations::default()
        };
        let ev = verdict(&obs, &PROD);
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert_eq!(
            ev.proofs,
            [
                "the API server's certificate authority is EKS cluster prod's (TLS verified against it)".to_string(),
                format!("the kubeconfig's server {SERVER} is EKS cluster prod's endpoint"),
            ]
        );
    }

    #[test]
    fn the_authority_proves_a_server_reached_through_another_address() {
        let obs = Observations {
            reached: reaching("https://127.0.0.1:8443", b"ca-prod", true),
            eks: Some(eks_cluster(SERVER, b"ca-prod")),
            ..Observations::default()
        };
        let ev = verdict(&obs, &PROD);
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert_eq!(ev.proofs.len(), 1, "{ev:?}");
        let unverified = Observations { reached: reaching("https://127.0.0.1:8443", b"ca-prod", false), ..obs };
        let ev = verdict(&unverified, &PROD);
        assert!(ev.proofs.is_empty(), "an authority TLS does not check proves nothing: {ev:?}");
        assert_eq!(ev.contradictions.len(), 1, "{ev:?}");
    }

    #[test]
    fn another_clusters_authority_or_endpoint_or_no_eks_cluster_refuses() {
        let other_ca = Observations {
            reached: reaching(SERVER, b"ca-staging", true),
            eks: Some(eks_cluster(SERVER, b"ca-prod")),
            controller: controller(Some("prod")),
            ..Observations::default()
        };
        let ev = verdict(&other_ca, &PROD);
        assert_eq!(
            ev.contradictions,
            [format!("the kubeconfig's certificate authority for {SERVER} is not EKS cluster prod's")]
        );
        let other_server = Observations {
            reached: Reached { server: "https://def.gr7.us-west-2.eks.amazonaws.com".into(), ..Reached::default() },
            ..other_ca.clone()
        };
        let ev = verdict(&other_server, &PROD);
        assert_eq!(ev.contradictions.len(), 1, "{ev:?}");
        assert!(ev.contradictions[0].contains(&format!("is not EKS cluster prod's endpoint {SERVER}")), "{ev:?}");
        let gone = Observations { eks: Some(EksLookup::NotFound), ..other_ca };
        let ev = verdict(&gone, &PROD);
        assert_eq!(
            ev.contradictions,
            ["EKS has no cluster named prod in us-west-2 for these AWS credentials (eks:DescribeCluster)"]
        );
    }

    #[test]
    fn a_plain_http_server_is_proved_by_its_endpoint_alone() {
        let obs = Observations {
            reached: Reached { server: "http://127.0.0.1:38211".into(), ..Reached::default() },
            eks: Some(eks_cluster("http://127.0.0.1:38211", b"unused")),
            ..Observations::default()
        };
        let ev = verdict(&obs, &PROD);
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert_eq!(ev.proofs, ["the kubeconfig's server http://127.0.0.1:38211 is EKS cluster prod's endpoint"]);
    }

    #[test]
    fn evidence_that_all_names_the_target_has_no_contradiction() {
        let ev = verdict(&matching(), &Target { account: Some("123456789012"), ..PROD });
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert_eq!(
            ev.facts,
            [
                "the kube context is the EKS cluster prod in us-west-2",
                "the Karpenter controller is configured for cluster prod",
                "2 of 2 instance(s) behind the Karpenter nodes are tagged for cluster prod (0 unknown to EC2 in us-west-2)",
                "AWS account 123456789012",
            ]
        );
    }

    #[test]
    fn a_controller_configured_for_another_cluster_refuses() {
        let obs = Observations { controller: controller(Some("staging")), ..Observations::default() };
        let ev = verdict(&obs, &PROD);
        assert_eq!(
            ev.contradictions,
            ["the Karpenter controller kube-system/karpenter is configured for cluster staging, not prod"]
        );
    }

    #[test]
    fn a_controller_without_cluster_name_is_only_a_fact() {
        let obs = Observations { controller: controller(None), ..matching() };
        let ev = verdict(&obs, &PROD);
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert!(ev.facts.contains(&"the Karpenter controller names no cluster (CLUSTER_NAME unset)".to_string()));
        assert!(!ev.proofs.iter().any(|p| p.contains("controller")), "{ev:?}");
    }

    #[test]
    fn a_node_in_another_region_refuses_and_ec2_is_not_asked() {
        let obs = Observations {
            provider_ids: vec![node("us-west-2a", "i-1"), node("eu-west-1b", "i-2"), node("eu-west-1c", "i-3")],
            ..Observations::default()
        };
        let ev = verdict(&obs, &PROD);
        assert_eq!(
            ev.contradictions,
            ["Karpenter nodes run in region eu-west-1 (from their providerIDs), not us-west-2"],
            "one line per foreign region"
        );
        assert!(!asks_ec2(&obs, &PROD));
    }

    #[test]
    fn a_local_zone_node_of_the_target_region_agrees() {
        let obs = Observations {
            provider_ids: vec![node("us-west-2-lax-1a", "i-1")],
            controller: controller(Some("prod")),
            ..Observations::default()
        };
        assert!(verdict(&obs, &PROD).contradictions.is_empty());
    }

    #[test]
    fn ec2_is_asked_only_about_instances_of_a_cluster_that_agrees_so_far() {
        assert!(asks_ec2(&Observations { instances: None, account: None, ..matching() }, &PROD));
        assert!(!asks_ec2(&Observations { provider_ids: Vec::new(), ..matching() }, &PROD), "no instances");
        let wrong_controller = Observations { controller: controller(Some("staging")), ..matching() };
        assert!(!asks_ec2(&wrong_controller, &PROD), "already refused");
    }

    #[test]
    fn instances_tagged_for_another_cluster_refuse() {
        let obs = Observations {
            instances: Some(vec![
                instance("i-1", &[(karpenter::TAG_EKS_CLUSTER, "prod")]),
                instance("i-2", &[(karpenter::TAG_EKS_CLUSTER, "staging")]),
            ]),
            ..matching()
        };
        let ev = verdict(&obs, &PROD);
        assert_eq!(
            ev.contradictions,
            ["instances behind the Karpenter nodes are tagged eks:eks-cluster-name=staging, not prod"]
        );
        assert!(ev.facts.iter().any(|f| f.starts_with("1 of 2 instance(s)")), "{ev:?}");
    }

    #[test]
    fn an_instance_owned_through_the_kubernetes_cluster_tag_counts_for_the_target() {
        let obs = Observations {
            instances: Some(vec![
                instance("i-1", &[("kubernetes.io/cluster/prod", "owned")]),
                instance("i-2", &[("kubernetes.io/cluster/staging", "owned")]),
            ]),
            ..matching()
        };
        let ev = verdict(&obs, &PROD);
        assert!(ev.contradictions.is_empty(), "untagged is no contradiction: {ev:?}");
        assert!(ev.facts.iter().any(|f| f.starts_with("1 of 2 instance(s)")), "{ev:?}");
    }

    #[test]
    fn instances_unknown_to_ec2_are_counted_not_refused() {
        let obs = Observations {
            instances: Some(vec![instance("i-1", &[(karpenter::TAG_EKS_CLUSTER, "prod")])]),
            ..matching()
        };
        let ev = verdict(&obs, &PROD);
        assert!(ev.contradictions.is_empty(), "{ev:?}");
        assert!(
            ev.facts.contains(
                &"1 of 2 instance(s) behind the Karpenter nodes are tagged for cluster prod (1 unknown to EC2 in us-west-2)"
                    .to_string()
            ),
            "{ev:?}"
        );
    }

    #[test]
    fn credentials_of_another_account_refuse() {
        let obs = Observations {
            account: Some("210987654321".into()),
            controller: controller(Some("prod")),
            ..Observations::default()
        };
        let ev = verdict(&obs, &Target { account: Some("123456789012"), ..PROD });
        assert_eq!(ev.contradictions, ["the AWS credentials belong to account 210987654321, not 123456789012"]);
    }
}
