//! The controllers the rest of a destroy depends on, and whether the drain strands them.
//!
//! The AWS Load Balancer Controller deletes the load balancers, target groups and security
//! groups it made for Services, Ingresses, Gateways and TargetGroupBindings, and the EBS and EFS CSI
//! controllers the volumes of PersistentVolumes whose reclaim policy is `Delete`; each holds its
//! objects with a finalizer until it has cleaned up in AWS (a PV from a csi-provisioner before
//! v5 has none, and its volume still goes only through the driver). When such a controller runs only on
//! Karpenter nodes, the drain leaves it nowhere to run: its objects can then never be deleted
//! (their finalizers stay, and stripping them leaks the AWS objects, whose network interfaces
//! and security groups then block the subnets and the VPC). So before the first write the tool
//! finds each controller with objects still in its care, and refuses when the drain would
//! strand it (design §2.1).
//!
//! Everything here is a pure function of what `crate::k8s::cleanup` has read.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, PersistentVolumeSpec, Pod};
use serde::Serialize;

use crate::scheduling::tolerates;

/// A controller that cleans up in AWS behind a finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cleaner {
    /// kubernetes-sigs/aws-load-balancer-controller.
    LoadBalancerController,
    /// kubernetes-sigs/aws-ebs-csi-driver's controller (csi-provisioner, csi-attacher).
    EbsCsi,
    /// kubernetes-sigs/aws-efs-csi-driver's controller.
    EfsCsi,
}

impl Cleaner {
    /// Every cleaner, in the order reports list them.
    pub(crate) const ALL: [Cleaner; 3] = [Cleaner::LoadBalancerController, Cleaner::EbsCsi, Cleaner::EfsCsi];

    /// The `app.kubernetes.io/name` of its Helm chart and EKS add-on.
    pub(crate) fn chart_name(self) -> &'static str {
        match self {
            Cleaner::LoadBalancerController => "aws-load-balancer-controller",
            Cleaner::EbsCsi => "aws-ebs-csi-driver",
            Cleaner::EfsCsi => "aws-efs-csi-driver",
        }
    }

    /// The last path segment of its controller's image repository, in every registry it is
    /// published to or mirrored from (`public.ecr.aws/eks/aws-load-balancer-controller`,
    /// `…/ebs-csi-driver/aws-ebs-csi-driver`, `…/amazon/aws-efs-csi-driver`).
    pub(crate) fn image(self) -> &'static str {
        match self {
            Cleaner::LoadBalancerController => "aws-load-balancer-controller",
            Cleaner::EbsCsi => "aws-ebs-csi-driver",
            Cleaner::EfsCsi => "aws-efs-csi-driver",
        }
    }

    /// The suffix of its admission webhooks' names, which its chart's name does not change.
    pub(crate) fn webhook_suffix(self) -> Option<&'static str> {
        match self {
            Cleaner::LoadBalancerController => Some(".elbv2.k8s.aws"),
            Cleaner::EbsCsi | Cleaner::EfsCsi => None,
        }
    }

    /// Its `--assume-stopped` value.
    pub(crate) fn flag(self) -> &'static str {
        match self {
            Cleaner::LoadBalancerController => "load-balancer-controller",
            Cleaner::EbsCsi => "ebs-csi",
            Cleaner::EfsCsi => "efs-csi",
        }
    }

    /// The name of the Lease its leader holds (its default leader-election id; the CSI
    /// provisioner's is its driver name with `.` and `/` as `-`).
    pub(crate) fn lease(self) -> &'static str {
        match self {
            Cleaner::LoadBalancerController => "aws-load-balancer-controller-leader",
            Cleaner::EbsCsi => "ebs-csi-aws-com",
            Cleaner::EfsCsi => "efs-csi-aws-com",
        }
    }

    /// What it deletes in AWS.
    fn cleans(self) -> &'static str {
        match self {
            Cleaner::LoadBalancerController => "load balancers, target groups and security groups",
            Cleaner::EbsCsi => "EBS volumes",
            Cleaner::EfsCsi => "EFS access points",
        }
    }
}

impl std::fmt::Display for Cleaner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cleaner::LoadBalancerController => "the AWS Load Balancer Controller",
            Cleaner::EbsCsi => "the EBS CSI controller",
            Cleaner::EfsCsi => "the EFS CSI controller",
        })
    }
}

/// Whether a Deployment runs `cleaner`: its chart's label, or a container of its pods running
/// the cleaner's image (the repository's last segment, any registry, tag or digest).
pub(crate) fn deployment_is(cleaner: Cleaner, d: &k8s_openapi::api::apps::v1::Deployment) -> bool {
    let labelled = d
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get("app.kubernetes.io/name").is_some_and(|v| v == cleaner.chart_name()));
    let containers = d.spec.as_ref().and_then(|s| s.template.spec.as_ref()).map(|p| p.containers.as_slice());
    let runs_image = containers.unwrap_or_default().iter().any(|c| {
        c.image.as_deref().is_some_and(|i| {
            let repo = i.split('@').next().unwrap_or(i);
            let repo = match repo.rsplit_once(':') {
                Some((r, tag)) if !tag.contains('/') => r,
                _ => repo,
            };
            repo.rsplit('/').next() == Some(cleaner.image())
        })
    });
    labelled || runs_image
}

/// The finalizer of the Load Balancer Controller on a Service (`serviceFinalizer` in its
/// `controllers/service/service_controller.go`).
pub(crate) const FINALIZER_SERVICE: &str = "service.k8s.aws/resources";
/// On an Ingress of its own (`ingress.k8s.aws/resources`); an IngressGroup's members carry
/// `group.ingress.k8s.aws/<group>`.
pub(crate) const FINALIZER_INGRESS: &str = "ingress.k8s.aws/resources";
const FINALIZER_INGRESS_GROUP: &str = "group.ingress.k8s.aws/";
/// On a TargetGroupBinding.
pub(crate) const FINALIZER_TARGET_GROUP_BINDING: &str = "elbv2.k8s.aws/resources";
/// On a Gateway (Gateway API) of its network and application load balancer GatewayClasses
/// (`NLBGatewayFinalizer`, `ALBGatewayFinalizer` in its `pkg/shared_constants/finalizers.go`);
/// what it makes for one is tagged `gateway.k8s.aws.nlb/stack` or `gateway.k8s.aws.alb/stack`
/// with the Gateway's `namespace/name` (`pkg/gateway/constants`, `base_model_builder.go`).
pub(crate) const FINALIZER_GATEWAY_NLB: &str = "gateway.k8s.aws/nlb";
pub(crate) const FINALIZER_GATEWAY_ALB: &str = "gateway.k8s.aws/alb";
/// csi-provisioner's on a PersistentVolume it will delete.
pub(crate) const FINALIZER_PROVISIONER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// The EBS CSI driver's name, a PersistentVolume's `spec.csi.driver`.
pub(crate) const EBS_CSI_DRIVER: &str = "ebs.csi.aws.com";
/// csi-attacher's on a VolumeAttachment of the EBS driver.
pub(crate) const FINALIZER_EBS_ATTACHER: &str = "external-attacher/ebs-csi-aws-com";

/// A kind of load-balancing object in AWS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LbKind {
    /// An ELBv2 load balancer (application, network, gateway).
    LoadBalancer,
    /// A classic load balancer.
    ClassicLoadBalancer,
    /// An ELBv2 target group.
    TargetGroup,
    /// An EC2 security group.
    SecurityGroup,
}

/// The tag the Load Balancer Controller puts on every load balancer, target group, listener and
/// security group it makes, valued with the cluster's name (`pkg/deploy/tracking/provider.go`:
/// the cluster is the tag's value, not its key).
pub(crate) const TAG_LBC_CLUSTER: &str = "elbv2.k8s.aws/cluster";
/// The prefixes of its `<prefix>/stack` tag, one per kind of owner (Service, Ingress, the
/// Gateway API's NLB and ALB), naming the Kubernetes object the AWS object is for.
const LBC_STACK_PREFIXES: [&str; 4] =
    ["service.k8s.aws", "ingress.k8s.aws", "gateway.k8s.aws.nlb", "gateway.k8s.aws.alb"];
/// Its tag on the one security group it shares between load balancers (`k8s-traffic-…`).
const TAG_LBC_RESOURCE: &str = "elbv2.k8s.aws/resource";
const LBC_BACKEND_SG: &str = "backend-sg";
/// The in-tree service controller's (cloud-provider-aws) tag on a load balancer and its target
/// groups, next to the cluster's `kubernetes.io/cluster/<name>=owned`.
pub(crate) const TAG_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The name of the security group it makes for a classic load balancer (`k8s-elb-<lb name>`).
const INTREE_SG_PREFIX: &str = "k8s-elb-";

/// Whose an AWS load-balancing object of this cluster is, and what for, or `None` when nothing
/// on it proves it is this cluster's cleanup controllers': the Load Balancer Controller's carry
/// this cluster's name as the value of [`TAG_LBC_CLUSTER`] and its stack tag (or, the shared
/// backend security group, its resource tag); the in-tree controller's carry
/// `kubernetes.io/cluster/<cluster>=owned` and the Service's name (or, a security group, its
/// `k8s-elb-` name). The cluster tag alone proves nothing: Terraform's own security groups and
/// any user's objects carry it too.
pub(crate) fn judge_load_balancing(
    what: LbKind,
    name: &str,
    tags: &BTreeMap<String, String>,
    cluster: &str,
) -> Option<(&'static str, String)> {
    let tag = |k: &str| tags.get(k).map(String::as_str);
    if tag(TAG_LBC_CLUSTER) == Some(cluster) && what != LbKind::ClassicLoadBalancer {
        for prefix in LBC_STACK_PREFIXES {
            if let Some(stack) = tag(&format!("{prefix}/stack")) {
                return Some(("the AWS Load Balancer Controller", format!("{prefix}/stack {stack}")));
            }
        }
        if what == LbKind::SecurityGroup && tag(TAG_LBC_RESOURCE) == Some(LBC_BACKEND_SG) {
            return Some((
                "the AWS Load Balancer Controller",
                "the backend security group its load balancers share".into(),
            ));
        }
    }
    if tag(&crate::karpenter::cluster_tag_key(cluster)) != Some("owned") {
        return None;
    }
    match what {
        LbKind::SecurityGroup => name
            .strip_prefix(INTREE_SG_PREFIX)
            .filter(|lb| !lb.is_empty())
            .map(|lb| ("the in-tree service controller", format!("load balancer {lb}"))),
        _ => tag(TAG_SERVICE_NAME).map(|svc| ("the in-tree service controller", format!("Service {svc}"))),
    }
}

/// An object held by a cleaner's finalizer.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub(crate) struct Held {
    /// `Service`, `Ingress`, `Gateway`, `TargetGroupBinding`, `PersistentVolume`,
    /// `VolumeAttachment`.
    pub(crate) kind: &'static str,
    /// `namespace/name`, or the name of a cluster-scoped object.
    pub(crate) name: String,
    /// The finalizer; none for a PersistentVolume whose volume its driver deletes although no
    /// finalizer says so (csi-provisioner adds one only from v5 with `HonorPVReclaimPolicy`,
    /// on by default from Kubernetes 1.31): the volume then still goes only through its
    /// driver, and outlives the cluster if the drain strands it.
    pub(crate) finalizer: Option<String>,
    /// Who removes it.
    pub(crate) cleaner: Cleaner,
    /// The object's own annotation turns deletion protection on for its load balancer
    /// ([`annotated_protection`]).
    pub(crate) protected: bool,
    /// Its uid as surveyed: a release deletes that object only, never one made under its name
    /// since (by a GitOps controller, say, that the run does not pause).
    #[serde(skip)]
    pub(crate) uid: Option<String>,
}

/// What the user consented to release before the drain (`--release`): the objects its cleaner
/// holds are deleted while the cleaner still runs, and the run waits until they and what they
/// stand for in AWS are gone. By default only where the drain would strand the cleaner: one that
/// keeps running after the drain deletes in AWS by itself whenever its objects go, so deleting
/// them before the drain would only take load balancers or data the teardown does not need to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Release {
    /// What is released.
    pub what: Releasable,
    /// Whether it is released also when the drain leaves its cleaner running
    /// (`--release load-balancers=all`).
    pub all: bool,
}

/// The kinds of `--release`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Releasable {
    /// The Services, Ingresses, Gateways and TargetGroupBindings the Load Balancer Controller
    /// holds, and so their load balancers, target groups and security groups.
    LoadBalancers,
    /// The PersistentVolumes the EBS CSI controller deletes (reclaim policy `Delete`): the
    /// StatefulSets whose pods use their claims are scaled to zero and the claims deleted, so
    /// the controller deletes the volumes in EC2 and then the PVs.
    Volumes,
}

impl Releasable {
    /// The cleaner whose objects it is.
    pub(crate) fn cleaner(self) -> Cleaner {
        match self {
            Releasable::LoadBalancers => Cleaner::LoadBalancerController,
            Releasable::Volumes => Cleaner::EbsCsi,
        }
    }

    /// Its `--release` value.
    pub(crate) fn flag(self) -> &'static str {
        match self {
            Releasable::LoadBalancers => "load-balancers",
            Releasable::Volumes => "volumes",
        }
    }
}

impl Release {
    /// Whether the consent covers what `cleaner` holds.
    pub(crate) fn covers(self, cleaner: Cleaner) -> bool {
        self.what.cleaner() == cleaner
    }

    /// The consent given for `cleaner`'s objects, if any: `Some(true)` when given also for a
    /// cleaner the drain leaves running (the wider of two consents for one kind).
    pub(crate) fn consent(release: &std::collections::BTreeSet<Release>, cleaner: Cleaner) -> Option<bool> {
        release.iter().filter(|r| r.covers(cleaner)).map(|r| r.all).max()
    }

    /// Whether `verdict`'s objects are released under `release`: its cleaner is covered, and the
    /// drain would strand it or the consent reaches the objects of a cleaner that survives.
    pub(crate) fn releases(release: &std::collections::BTreeSet<Release>, verdict: &Verdict) -> bool {
        Release::consent(release, verdict.cleaner).is_some_and(|all| all || verdict.stranded)
    }
}

/// A pod that mounts a claim, and what owns it (`Kind/name`), as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimUser {
    /// `namespace/name`.
    pub(crate) pod: String,
    /// Its controlling owner, `Kind/name` (the owner is in the pod's namespace).
    pub(crate) owner: Option<String>,
}

/// What the EBS CSI driver's PersistentVolumes are bound to and attached as, as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct VolumeFacts {
    /// Each EBS PV with reclaim policy `Delete`: its claim (`namespace/name`), if bound to one.
    pub(crate) claims: BTreeMap<String, Option<String>>,
    /// The uid of each PV's claim, from its `claimRef`: the claim bound to it, not one made
    /// under the same name since.
    pub(crate) claim_uids: BTreeMap<String, String>,
    /// Each PV's EBS volume id.
    pub(crate) volume_ids: BTreeMap<String, String>,
    /// Each VolumeAttachment the EBS driver's attacher holds: the PV it attaches.
    pub(crate) attached: BTreeMap<String, String>,
}

/// How `--release volumes` releases the EBS CSI controller's volumes: what it scales to zero,
/// what it deletes and what it then waits for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct VolumeRelease {
    /// The StatefulSets (`namespace/name`) whose pods mount a released claim: scaled to zero
    /// first, since a StatefulSet makes its pod's claim again for as long as it wants the pod.
    pub(crate) statefulsets: std::collections::BTreeSet<String>,
    /// The claims deleted (`namespace/name`), each with the uid its PV's `claimRef` gives: only
    /// the claim bound to the PV is deleted. The PV controller then releases their PVs.
    pub(crate) claim_uids: BTreeMap<String, String>,
    /// The PVs waited for, each with its EBS volume id: the controller deletes the volume in EC2
    /// and then the PV.
    pub(crate) volumes: BTreeMap<String, String>,
    /// The held objects the release waits for: those PVs, and the VolumeAttachments of them.
    pub(crate) held: Vec<Held>,
}

/// How the EBS CSI controller's objects in `held` are released, or why some cannot be (each
/// `(object, reason)`), from what was read. A claim mounted by a pod that no StatefulSet owns
/// is refused: the release stops only StatefulSets, and deleting the claim under another
/// workload leaves it terminating until that workload stops by other means. A PV bound to no
/// claim is refused: no claim's deletion would release it. A VolumeAttachment is waited for
/// when its PV is released (the attach-detach controller deletes it when the pod goes, and the
/// attacher detaches the volume); one of another PV is refused only when the drain `stranded`
/// the controller (otherwise the controller stays to detach it). Pure.
pub(crate) fn plan_volume_release(
    held: &[Held],
    facts: &VolumeFacts,
    users: &BTreeMap<String, Vec<ClaimUser>>,
    stranded: bool,
) -> (VolumeRelease, Vec<(String, String)>) {
    let mut out = VolumeRelease::default();
    let mut refused = Vec::new();
    let mine = || held.iter().filter(|h| h.cleaner == Cleaner::EbsCsi);
    for h in mine().filter(|h| h.kind == "PersistentVolume") {
        let Some(id) = facts.volume_ids.get(&h.name) else {
            refused.push((h.object(), "its EBS volume id is not on the PV (spec.csi.volumeHandle)".to_string()));
            continue;
        };
        let Some(Some(claim)) = facts.claims.get(&h.name) else {
            refused.push((
                h.object(),
                "it is bound to no claim, so deleting a claim cannot release it; delete the PV yourself if its volume is meant to go".to_string(),
            ));
            continue;
        };
        let Some(uid) = facts.claim_uids.get(&h.name) else {
            refused.push((
                h.object(),
                format!("its claimRef names {claim} but no uid, so which claim it is bound to is unknown; delete the PV yourself if its volume is meant to go"),
            ));
            continue;
        };
        let ns = claim.split_once('/').map(|(ns, _)| ns).unwrap_or_default();
        let mut ok = true;
        for u in users.get(claim).into_iter().flatten() {
            match u.owner.as_deref().and_then(|o| o.strip_prefix("StatefulSet/")) {
                Some(sts) => {
                    out.statefulsets.insert(format!("{ns}/{sts}"));
                }
                None => {
                    ok = false;
                    refused.push((
                        h.object(),
                        format!(
                            "its claim {claim} is mounted by pod {} ({}), which no StatefulSet owns: the release stops only StatefulSets; scale that workload to zero first",
                            u.pod,
                            u.owner.as_deref().map_or("no owner".to_string(), |o| format!("owned by {o}"))
                        ),
                    ));
                }
            }
        }
        if ok {
            out.claim_uids.insert(claim.clone(), uid.clone());
            out.volumes.insert(h.name.clone(), id.clone());
            out.held.push(h.clone());
        }
    }
    for h in mine().filter(|h| h.kind == "VolumeAttachment") {
        match facts.attached.get(&h.name) {
            Some(pv) if out.volumes.contains_key(pv) => out.held.push(h.clone()),
            Some(_) if !stranded => {}
            Some(pv) => refused.push((
                h.object(),
                format!("it attaches PersistentVolume {pv}, which this release does not delete, and only the EBS CSI controller can detach it"),
            )),
            None if !stranded => {}
            None => refused.push((h.object(), "it names no PersistentVolume".to_string())),
        }
    }
    (out, refused)
}

/// The annotations that set a load balancer's attributes: the Service's (Load Balancer
/// Controller and in-tree) and the Ingress's.
const ATTRIBUTE_ANNOTATIONS: [&str; 2] =
    ["service.beta.kubernetes.io/aws-load-balancer-attributes", "alb.ingress.kubernetes.io/load-balancer-attributes"];

/// True when an object's annotations turn deletion protection on for its load balancer: the
/// controller then refuses to delete it and keeps its finalizer.
pub(crate) fn annotated_protection(annotations: &BTreeMap<String, String>) -> bool {
    ATTRIBUTE_ANNOTATIONS.iter().filter_map(|a| annotations.get(*a)).any(|v| {
        v.split(',').any(|kv| {
            kv.split_once('=').is_some_and(|(k, v)| k.trim() == "deletion_protection.enabled" && v.trim() == "true")
        })
    })
}

/// What the Load Balancer Controller's objects for a held object are tagged with, as
/// [`judge_load_balancing`] names it: its stack (`service.k8s.aws/stack <ns>/<name>`,
/// `ingress.k8s.aws/stack <ns>/<name>`, or the IngressGroup's name for a member of an explicit
/// group; a Gateway's `gateway.k8s.aws.nlb/stack` or `.alb/stack <ns>/<name>`). A
/// TargetGroupBinding makes nothing of its own.
pub(crate) fn stack_of(held: &Held) -> Option<String> {
    match (held.kind, held.finalizer.as_deref().unwrap_or_default()) {
        ("Service", FINALIZER_SERVICE) => Some(format!("service.k8s.aws/stack {}", held.name)),
        ("Ingress", FINALIZER_INGRESS) => Some(format!("ingress.k8s.aws/stack {}", held.name)),
        ("Ingress", f) => f.strip_prefix(FINALIZER_INGRESS_GROUP).map(|g| format!("ingress.k8s.aws/stack {g}")),
        ("Gateway", FINALIZER_GATEWAY_NLB) => Some(format!("gateway.k8s.aws.nlb/stack {}", held.name)),
        ("Gateway", FINALIZER_GATEWAY_ALB) => Some(format!("gateway.k8s.aws.alb/stack {}", held.name)),
        _ => None,
    }
}

impl Held {
    /// `Kind/namespace/name` (or `Kind/name`): how blockers and the release name it.
    pub(crate) fn object(&self) -> String {
        format!("{}/{}", self.kind, self.name)
    }

    /// What holds it, for messages: `finalizer <f>`, or the reclaim policy of a PV without one.
    pub(crate) fn hold(&self) -> String {
        match &self.finalizer {
            Some(f) => format!("finalizer {f}"),
            None => "reclaim policy Delete, no finalizer".to_string(),
        }
    }
}

/// Which cleaner a finalizer of an object of `kind` belongs to (a PersistentVolume's are
/// [`held_volume`]'s).
pub(crate) fn cleaner_of(kind: &str, finalizer: &str) -> Option<Cleaner> {
    match (kind, finalizer) {
        ("Service", FINALIZER_SERVICE) => Some(Cleaner::LoadBalancerController),
        ("Ingress", f) if f == FINALIZER_INGRESS || f.starts_with(FINALIZER_INGRESS_GROUP) => {
            Some(Cleaner::LoadBalancerController)
        }
        ("TargetGroupBinding", FINALIZER_TARGET_GROUP_BINDING) => Some(Cleaner::LoadBalancerController),
        ("Gateway", FINALIZER_GATEWAY_NLB | FINALIZER_GATEWAY_ALB) => Some(Cleaner::LoadBalancerController),
        ("VolumeAttachment", FINALIZER_EBS_ATTACHER) => Some(Cleaner::EbsCsi),
        _ => None,
    }
}

/// The CSI driver of a PersistentVolume and the id of its volume in AWS. An in-tree
/// `awsElasticBlockStore` volume is the EBS CSI driver's: CSI migration hands it to the driver
/// (required from EKS 1.23, and EKS's default `gp2` StorageClass still provisions through the
/// in-tree name), and its id may be the in-tree `aws://<zone>/vol-...` form
/// (`KubernetesVolumeIDToEBSVolumeID` in k8s.io/csi-translation-lib's `plugins/aws_ebs.go`).
pub(crate) fn volume_of(spec: &PersistentVolumeSpec) -> Option<(String, String)> {
    if let Some(csi) = &spec.csi {
        return Some((csi.driver.clone(), csi.volume_handle.clone()));
    }
    let id = spec.aws_elastic_block_store.as_ref()?.volume_id.as_str();
    let id = match id.strip_prefix("aws://") {
        Some(rest) => rest.split_once('/').map_or("", |(_zone, path)| path.trim_matches('/')),
        None => id,
    };
    (id.starts_with("vol-") && !id.contains('/')).then(|| (EBS_CSI_DRIVER.to_string(), id.to_string()))
}

/// What holds a PersistentVolume of `driver` whose reclaim policy is `reclaim`: only a volume
/// its driver deletes (`Delete`) counts, by csi-provisioner's finalizer or, without it, by the
/// policy alone ([`Held::finalizer`]).
pub(crate) fn held_volume(name: &str, finalizers: &[String], driver: Option<&str>, reclaim: Option<&str>) -> Vec<Held> {
    let cleaner = match (driver, reclaim) {
        (Some(EBS_CSI_DRIVER), Some("Delete")) => Cleaner::EbsCsi,
        (Some("efs.csi.aws.com"), Some("Delete")) => Cleaner::EfsCsi,
        _ => return Vec::new(),
    };
    let finalizer = finalizers.iter().find(|f| *f == FINALIZER_PROVISIONER).cloned();
    vec![Held { kind: "PersistentVolume", name: name.to_string(), finalizer, cleaner, protected: false, uid: None }]
}

/// Where a cleaner runs now: its pods (by its chart's labels, or the holder of its leader
/// Lease), each with the node it is bound to.
#[derive(Debug, Clone, Default)]
pub(crate) struct Running {
    /// The pods found, with their spec (what they may be scheduled on).
    pub(crate) pods: Vec<Pod>,
}

/// What the survey decided for one cleaner with objects in its care.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Verdict {
    pub(crate) cleaner: Cleaner,
    /// Where its pods run (`namespace/pod on node`).
    pub(crate) runs: Vec<String>,
    /// True when the drain leaves it nowhere to run.
    pub(crate) stranded: bool,
    /// True when no pod of it was found at all (by its chart's label, its leader Lease, its
    /// webhooks or its image): where it runs cannot be told, so neither can whether the drain
    /// strands it.
    pub(crate) unplaced: bool,
    /// The objects it holds.
    pub(crate) held: Vec<Held>,
}

impl Verdict {
    /// The plan's line for it.
    pub(crate) fn plan_line(&self) -> String {
        let runs = if self.runs.is_empty() { "no running pod found".to_string() } else { self.runs.join(", ") };
        let fate = if self.stranded {
            "the drain would strand it"
        } else if self.unplaced {
            "where it runs cannot be told (no pod found by its chart's label, its leader Lease, its webhooks or its image)"
        } else {
            "it keeps running through the drain"
        };
        format!(
            "cleanup: {} ({runs}) holds {} object(s) for their {}; {fate}",
            self.cleaner,
            self.held.len(),
            self.cleaner.cleans()
        )
    }

    /// The plan's line for a cleaner `--release` covers that the drain leaves running: what
    /// it holds stays, and how to release it anyway.
    pub(crate) fn not_released_line(&self) -> String {
        let flag = [Releasable::LoadBalancers, Releasable::Volumes].into_iter().find(|r| r.cleaner() == self.cleaner);
        let anyway = flag.map(|f| format!("; --release {}=all releases them anyway", f.flag())).unwrap_or_default();
        format!(
            "release: nothing of the {} object(s) {} holds: it keeps running through the drain and deletes their {} in AWS itself when they go{anyway}",
            self.held.len(),
            self.cleaner,
            self.cleaner.cleans()
        )
    }

    /// One blocker reason per held object, for a stranded cleaner.
    pub(crate) fn blockers(&self) -> Vec<(String, String)> {
        if !self.stranded {
            return Vec::new();
        }
        self.held
            .iter()
            .map(|h| {
                let why = match &h.finalizer {
                    Some(f) => format!(
                        "{} {} is held by finalizer {f} until {} has deleted its {} in AWS",
                        h.kind,
                        h.name,
                        self.cleaner,
                        self.cleaner.cleans()
                    ),
                    None => format!(
                        "{} {} has reclaim policy Delete and no finalizer: only {} deletes its volume in AWS",
                        h.kind, h.name, self.cleaner
                    ),
                };
                let fate = match h.finalizer {
                    Some(_) => "the object could never be deleted (removing the finalizer by hand leaks the AWS objects)",
                    None => "the volume would outlive the cluster",
                };
                (
                    h.object(),
                    format!(
                        "{why}; {} runs only on Karpenter nodes ({}), so the drain would leave it nowhere to run and {fate}",
                        self.cleaner,
                        self.runs.join(", ")
                    ),
                )
            })
            .collect()
    }
}

/// The verdict for each cleaner that holds objects. `karpenter_nodes` are the nodes the run
/// drains; `other_nodes` every other node, on which a cleaner's pod could be scheduled again.
pub(crate) fn survey(
    held: &[Held],
    running: &BTreeMap<Cleaner, Running>,
    karpenter_nodes: &[String],
    other_nodes: &[Node],
    requested: &BTreeMap<String, Requests>,
) -> Vec<Verdict> {
    let mut out = Vec::new();
    for cleaner in Cleaner::ALL {
        let mut mine: Vec<Held> = held.iter().filter(|h| h.cleaner == cleaner).cloned().collect();
        if mine.is_empty() {
            continue;
        }
        mine.sort();
        let pods = running.get(&cleaner).map(|r| r.pods.as_slice()).unwrap_or_default();
        let node_of = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone());
        let runs: Vec<String> = pods
            .iter()
            .map(|p| {
                let name = format!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or_default(),
                    p.metadata.name.as_deref().unwrap_or_default()
                );
                match node_of(p) {
                    Some(n) => format!("{name} on {n}"),
                    None => format!("{name} unscheduled"),
                }
            })
            .collect();
        // stranded: it has pods, none of them is on a node the run keeps, and none fits one.
        // A pod waiting unscheduled is no place it runs (it may never be placed), nor is one
        // that has ended
        let live: Vec<&Pod> = pods
            .iter()
            .filter(|p| !matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")))
            .collect();
        let on_kept_node = live.iter().any(|p| node_of(p).is_some_and(|n| !karpenter_nodes.contains(&n)));
        let room =
            |n: &Node| requested.get(n.metadata.name.as_deref().unwrap_or_default()).copied().unwrap_or_default();
        let stranded =
            !live.is_empty() && !on_kept_node && !live.iter().any(|p| other_nodes.iter().any(|n| fits(p, n, room(n))));
        out.push(Verdict { cleaner, runs, stranded, unplaced: live.is_empty(), held: mine });
    }
    out
}

/// What the pods bound to a node request, summed (CPU in millicores, memory in bytes, pods).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Requests {
    pub(crate) cpu_milli: u64,
    pub(crate) memory: u64,
    pub(crate) pods: u64,
}

impl Requests {
    /// What one pod requests: the larger of its containers' sum and its largest init
    /// container's, as the scheduler counts it (overhead left out).
    pub(crate) fn of_pod(pod: &Pod) -> Requests {
        let Some(spec) = pod.spec.as_ref() else { return Requests { pods: 1, ..Requests::default() } };
        let one = |c: &k8s_openapi::api::core::v1::Container| {
            let r = c.resources.as_ref().and_then(|r| r.requests.as_ref());
            let q = |k: &str| r.and_then(|r| r.get(k)).map(|q| q.0.as_str());
            (q("cpu").and_then(cpu_milli).unwrap_or(0), q("memory").and_then(bytes).unwrap_or(0))
        };
        let (mut cpu, mut memory) = spec.containers.iter().map(one).fold((0, 0), |(c, m), (a, b)| (c + a, m + b));
        for (c, m) in spec.init_containers.iter().flatten().map(one) {
            cpu = cpu.max(c);
            memory = memory.max(m);
        }
        Requests { cpu_milli: cpu, memory, pods: 1 }
    }

    /// The sum of two.
    pub(crate) fn plus(self, o: Requests) -> Requests {
        Requests { cpu_milli: self.cpu_milli + o.cpu_milli, memory: self.memory + o.memory, pods: self.pods + o.pods }
    }
}

/// A CPU quantity in millicores (`100m`, `2`, `0.5`).
pub(crate) fn cpu_milli(q: &str) -> Option<u64> {
    let q = q.trim();
    match q.strip_suffix('m') {
        Some(m) => m.parse::<f64>().ok().map(|v| v.ceil() as u64),
        None => q.parse::<f64>().ok().map(|v| (v * 1000.0).ceil() as u64),
    }
}

/// A memory (or any byte) quantity in bytes (`128Mi`, `1G`, `512`).
pub(crate) fn bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    const UNITS: [(&str, f64); 12] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, factor) in UNITS {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<f64>().ok().map(|v| (v * factor).ceil() as u64);
        }
    }
    if let Some(n) = q.strip_suffix('m') {
        return n.parse::<f64>().ok().map(|v| (v / 1000.0).ceil() as u64);
    }
    q.parse::<f64>().ok().map(|v| v.ceil() as u64)
}

/// Whether `pod` could be scheduled on `node` now: the node is Ready and schedulable, its
/// `NoSchedule`/`NoExecute` taints tolerated, the pod's node selector and required node
/// affinity matched by the node's labels, and its allocatable CPU, memory and pods leave room
/// for the pod's requests beside what the pods already bound to it request (`requested`). A
/// node without a Ready condition or an allocatable is no place to run: the check fails closed.
pub(crate) fn fits(pod: &Pod, node: &Node, requested: Requests) -> bool {
    let Some(spec) = pod.spec.as_ref() else { return false };
    let node_spec = node.spec.clone().unwrap_or_default();
    if node_spec.unschedulable == Some(true) {
        return false;
    }
    let status = node.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    if !ready {
        return false;
    }
    let Some(allocatable) = status.and_then(|s| s.allocatable.as_ref()) else { return false };
    let have = |k: &str, parse: fn(&str) -> Option<u64>| allocatable.get(k).and_then(|q| parse(&q.0));
    let want = requested.plus(Requests::of_pod(pod));
    let room = have("cpu", cpu_milli).is_some_and(|c| want.cpu_milli <= c)
        && have("memory", bytes).is_some_and(|m| want.memory <= m)
        && have("pods", |q| q.parse().ok()).is_some_and(|p| want.pods <= p);
    if !room {
        return false;
    }
    let tolerations = spec.tolerations.clone().unwrap_or_default();
    let tolerated = node_spec.taints.unwrap_or_default().iter().all(|t| {
        t.effect == "PreferNoSchedule"
            || tolerations.iter().any(|tol| tolerates(tol, &t.key, &t.effect, t.value.as_deref().unwrap_or_default()))
    });
    if !tolerated {
        return false;
    }
    let labels = node.metadata.labels.clone().unwrap_or_default();
    if !spec.node_selector.iter().flatten().all(|(k, v)| labels.get(k) == Some(v)) {
        return false;
    }
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref());
    match required {
        // the terms are ORed, each term's expressions ANDed
        Some(r) => r.node_selector_terms.iter().any(|term| {
            term.match_expressions.iter().flatten().all(|e| matches_expression(e, &labels))
                && term.match_fields.iter().flatten().all(|e| {
                    e.key != "metadata.name"
                        || matches_expression(
                            e,
                            &[("metadata.name".to_string(), node.metadata.name.clone().unwrap_or_default())].into(),
                        )
                })
        }),
        None => true,
    }
}

fn matches_expression(e: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&e.key);
    let values = e.values.clone().unwrap_or_default();
    match e.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) =
                (value.and_then(|v| v.parse::<i64>().ok()), values.first().and_then(|b| b.parse::<i64>().ok()))
            else {
                return false;
            };
            if e.operator == "Gt" { v > bound } else { v < bound }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn a_cleaner_is_known_by_its_image_whatever_its_chart_is_called() {
        let deployment = |labels: serde_json::Value, image: &str| -> k8s_openapi::api::apps::v1::Deployment {
            serde_json::from_value(json!({"metadata": {"name": "x", "labels": labels}, "spec": {
                "selector": {"matchLabels": {"a": "b"}},
                "template": {"spec": {"containers": [{"name": "c", "image": image}]}}}}))
            .unwrap()
        };
        let lbc = Cleaner::LoadBalancerController;
        assert!(deployment_is(
            lbc,
            &deployment(json!({"app.kubernetes.io/name": "aws-load-balancer-controller"}), "x")
        ));
        assert!(deployment_is(
            lbc,
            &deployment(
                json!({"app.kubernetes.io/name": "lb"}),
                "public.ecr.aws/eks/aws-load-balancer-controller:v2.9.0"
            )
        ));
        assert!(deployment_is(
            lbc,
            &deployment(
                json!({}),
                "602401143452.dkr.ecr.us-west-2.amazonaws.com/amazon/aws-load-balancer-controller@sha256:ab"
            )
        ));
        assert!(!deployment_is(lbc, &deployment(json!({}), "public.ecr.aws/karpenter/controller:1.5.0")));
        assert!(deployment_is(
            Cleaner::EbsCsi,
            &deployment(json!({}), "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.40.0")
        ));
        assert!(!deployment_is(
            Cleaner::EfsCsi,
            &deployment(json!({}), "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.40.0")
        ));
    }

    fn pod(name: &str, node: &str, extra: serde_json::Value) -> Pod {
        let mut spec = json!({"nodeName": node, "containers": [{"name": "c"}]});
        if let Some(o) = extra.as_object() {
            for (k, v) in o {
                spec[k] = v.clone();
            }
        }
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "kube-system"}, "spec": spec})).unwrap()
    }

    fn node(name: &str, labels: serde_json::Value, spec: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec,
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                "allocatable": {"cpu": "4", "memory": "16Gi", "pods": "110"}}}))
        .unwrap()
    }

    #[test]
    fn a_release_covers_its_cleaners_objects_and_names_their_stacks() {
        let lb = Release { what: Releasable::LoadBalancers, all: false };
        assert!(lb.covers(Cleaner::LoadBalancerController) && !lb.covers(Cleaner::EbsCsi));
        let svc = held("Service", "shop/front", FINALIZER_SERVICE, Cleaner::LoadBalancerController);
        assert_eq!(stack_of(&svc).as_deref(), Some("service.k8s.aws/stack shop/front"));
        let ing = held("Ingress", "shop/front", FINALIZER_INGRESS, Cleaner::LoadBalancerController);
        assert_eq!(stack_of(&ing).as_deref(), Some("ingress.k8s.aws/stack shop/front"));
        let grouped = held("Ingress", "shop/front", "group.ingress.k8s.aws/public", Cleaner::LoadBalancerController);
        assert_eq!(stack_of(&grouped).as_deref(), Some("ingress.k8s.aws/stack public"));
        let gw = held("Gateway", "shop/edge", FINALIZER_GATEWAY_NLB, Cleaner::LoadBalancerController);
        assert_eq!(stack_of(&gw).as_deref(), Some("gateway.k8s.aws.nlb/stack shop/edge"));
        assert_eq!(cleaner_of("Gateway", FINALIZER_GATEWAY_ALB), Some(Cleaner::LoadBalancerController));
        assert_eq!(cleaner_of("Gateway", "gateway.k8s.aws/gatewayclass"), None);
        let tgb =
            held("TargetGroupBinding", "shop/tgb", FINALIZER_TARGET_GROUP_BINDING, Cleaner::LoadBalancerController);
        assert_eq!(stack_of(&tgb), None);
        // the stack names what judge_load_balancing reports for the controller's objects
        for (h, key, value) in
            [(&svc, "service.k8s.aws/stack", "shop/front"), (&gw, "gateway.k8s.aws.nlb/stack", "shop/edge")]
        {
            let tags = BTreeMap::from([(TAG_LBC_CLUSTER.to_string(), "prod".to_string()), (key.into(), value.into())]);
            let (_, made_for) = judge_load_balancing(LbKind::LoadBalancer, "k8s-lb", &tags, "prod").unwrap();
            assert_eq!(Some(made_for), stack_of(h));
        }
    }

    #[test]
    fn deletion_protection_is_read_from_either_annotation() {
        let a = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        let svc = "service.beta.kubernetes.io/aws-load-balancer-attributes";
        assert!(annotated_protection(&a(svc, "deletion_protection.enabled=true")));
        assert!(annotated_protection(&a(
            svc,
            "load_balancing.cross_zone.enabled=true, deletion_protection.enabled = true"
        )));
        assert!(!annotated_protection(&a(svc, "deletion_protection.enabled=false")));
        assert!(annotated_protection(&a(
            "alb.ingress.kubernetes.io/load-balancer-attributes",
            "deletion_protection.enabled=true"
        )));
        assert!(!annotated_protection(&a("other", "deletion_protection.enabled=true")));
        assert!(!annotated_protection(&BTreeMap::new()));
    }

    fn held(kind: &'static str, name: &str, finalizer: &str, cleaner: Cleaner) -> Held {
        Held { kind, name: name.into(), finalizer: Some(finalizer.into()), cleaner, protected: false, uid: None }
    }

    #[test]
    fn volumes_are_released_through_their_statefulsets_claims_and_others_are_refused() {
        let pv = |name: &str| held("PersistentVolume", name, FINALIZER_PROVISIONER, Cleaner::EbsCsi);
        let va = |name: &str| held("VolumeAttachment", name, FINALIZER_EBS_ATTACHER, Cleaner::EbsCsi);
        let objects = [pv("pv-db-0"), pv("pv-db-1"), pv("pv-cache"), pv("pv-loose"), va("csi-db-0"), va("csi-other")];
        let s = |v: &str| v.to_string();
        let facts = VolumeFacts {
            claims: [
                (s("pv-db-0"), Some(s("shop/data-db-0"))),
                (s("pv-db-1"), Some(s("shop/data-db-1"))),
                (s("pv-cache"), Some(s("shop/cache"))),
                (s("pv-loose"), None),
            ]
            .into(),
            volume_ids: [
                (s("pv-db-0"), s("vol-0")),
                (s("pv-db-1"), s("vol-1")),
                (s("pv-cache"), s("vol-c")),
                (s("pv-loose"), s("vol-l")),
            ]
            .into(),
            attached: [(s("csi-db-0"), s("pv-db-0")), (s("csi-other"), s("pv-retained"))].into(),
            claim_uids: [(s("pv-db-0"), s("uid-0")), (s("pv-db-1"), s("uid-1")), (s("pv-cache"), s("uid-c"))].into(),
        };
        let user = |pod: &str, owner: Option<&str>| ClaimUser { pod: s(pod), owner: owner.map(s) };
        let users: BTreeMap<String, Vec<ClaimUser>> = [
            (s("shop/data-db-0"), vec![user("shop/db-0", Some("StatefulSet/db"))]),
            (s("shop/cache"), vec![user("shop/cache-7d9-x", Some("ReplicaSet/cache-7d9"))]),
        ]
        .into();
        let (plan, refused) = plan_volume_release(&objects, &facts, &users, true);
        // the StatefulSet's claims (one mounted, one whose pod is already gone) are released
        assert_eq!(plan.statefulsets, [s("shop/db")].into());
        // each claim is deleted as the one its PV is bound to, by uid
        assert_eq!(plan.claim_uids, [(s("shop/data-db-0"), s("uid-0")), (s("shop/data-db-1"), s("uid-1"))].into());
        assert_eq!(plan.volumes, [(s("pv-db-0"), s("vol-0")), (s("pv-db-1"), s("vol-1"))].into());
        assert_eq!(plan.held, [objects[0].clone(), objects[1].clone(), objects[4].clone()]);
        // a Deployment's claim, a PV bound to no claim and, the controller stranded, an
        // attachment of a volume not released are refused, one reason each
        assert_eq!(refused.len(), 3, "{refused:?}");
        assert_eq!(refused[0].0, "PersistentVolume/pv-cache");
        assert!(
            refused[0].1.contains("mounted by pod shop/cache-7d9-x (owned by ReplicaSet/cache-7d9)"),
            "{refused:?}"
        );
        assert_eq!(refused[1].0, "PersistentVolume/pv-loose");
        assert!(refused[1].1.contains("bound to no claim"), "{refused:?}");
        assert_eq!(refused[2].0, "VolumeAttachment/csi-other");
        assert!(refused[2].1.contains("pv-retained"), "{refused:?}");
        // the controller kept by the drain detaches what is not released: not refused
        let (_, refused) = plan_volume_release(&objects, &facts, &users, false);
        assert_eq!(
            refused.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
            ["PersistentVolume/pv-cache", "PersistentVolume/pv-loose"]
        );
        // the load balancers' objects are not this plan's
        let lb = [held("Service", "shop/front", FINALIZER_SERVICE, Cleaner::LoadBalancerController)];
        let (plan, refused) = plan_volume_release(&lb, &facts, &users, true);
        assert!(plan == VolumeRelease::default() && refused.is_empty());
        // a claimRef without a uid binds no claim for certain: refused, nothing deleted
        let mut unbound = facts.clone();
        unbound.claim_uids.remove("pv-db-1");
        let (plan, refused) = plan_volume_release(&objects, &unbound, &users, false);
        assert!(!plan.claim_uids.contains_key("shop/data-db-1"), "{plan:?}");
        assert!(
            refused.iter().any(|(o, why)| o == "PersistentVolume/pv-db-1" && why.contains("no uid")),
            "{refused:?}"
        );
        let volumes = Release { what: Releasable::Volumes, all: false };
        assert!(volumes.covers(Cleaner::EbsCsi) && !volumes.covers(Cleaner::EfsCsi));
    }

    #[test]
    fn only_this_clusters_controllers_load_balancing_objects_are_taken() {
        let t = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let lbc = t(&[
            (TAG_LBC_CLUSTER, "prod"),
            ("service.k8s.aws/stack", "default/web"),
            ("service.k8s.aws/resource", "LoadBalancer"),
        ]);
        let judge = |what, name, tags: &BTreeMap<String, String>| judge_load_balancing(what, name, tags, "prod");
        assert_eq!(
            judge(LbKind::LoadBalancer, "k8s-default-web-1", &lbc),
            Some(("the AWS Load Balancer Controller", "service.k8s.aws/stack default/web".into()))
        );
        assert!(judge(LbKind::TargetGroup, "k8s-default-web-2", &lbc).is_some());
        // another cluster's, a prefix of this one's name, and the cluster tag without the stack
        assert_eq!(judge_load_balancing(LbKind::LoadBalancer, "x", &lbc, "prod-eu"), None);
        assert_eq!(judge_load_balancing(LbKind::LoadBalancer, "x", &lbc, "pro"), None);
        assert_eq!(judge(LbKind::LoadBalancer, "x", &t(&[(TAG_LBC_CLUSTER, "prod")])), None);
        let gateway = t(&[(TAG_LBC_CLUSTER, "prod"), ("gateway.k8s.aws.alb/stack", "default/gw")]);
        assert!(judge(LbKind::LoadBalancer, "x", &gateway).is_some());
        let backend = t(&[(TAG_LBC_CLUSTER, "prod"), (TAG_LBC_RESOURCE, LBC_BACKEND_SG)]);
        assert!(judge(LbKind::SecurityGroup, "k8s-traffic-prod-1a2b", &backend).is_some());
        assert_eq!(judge(LbKind::LoadBalancer, "x", &backend), None);
        // the in-tree controller's: the cluster owned and the Service's name, or the SG's name
        let intree = t(&[("kubernetes.io/cluster/prod", "owned"), (TAG_SERVICE_NAME, "default/web")]);
        assert_eq!(
            judge(LbKind::ClassicLoadBalancer, "a1b2", &intree),
            Some(("the in-tree service controller", "Service default/web".into()))
        );
        assert!(judge(LbKind::LoadBalancer, "a1b2", &intree).is_some());
        let owned = t(&[("kubernetes.io/cluster/prod", "owned")]);
        assert_eq!(judge(LbKind::ClassicLoadBalancer, "a1b2", &owned), None);
        assert!(judge(LbKind::SecurityGroup, "k8s-elb-a1b2", &owned).is_some());
        // Terraform's cluster and node security groups carry the cluster tag too
        assert_eq!(judge(LbKind::SecurityGroup, "prod-node-2026", &owned), None);
        assert_eq!(judge(LbKind::SecurityGroup, "k8s-elb-", &owned), None);
        let shared = t(&[("kubernetes.io/cluster/prod", "shared"), (TAG_SERVICE_NAME, "default/web")]);
        assert_eq!(judge(LbKind::ClassicLoadBalancer, "a1b2", &shared), None);
        let other = t(&[("kubernetes.io/cluster/staging", "owned"), (TAG_SERVICE_NAME, "default/web")]);
        assert_eq!(judge(LbKind::ClassicLoadBalancer, "a1b2", &other), None);
    }

    #[test]
    fn finalizers_name_their_cleaner_and_only_volumes_it_deletes_count() {
        assert_eq!(cleaner_of("Service", FINALIZER_SERVICE), Some(Cleaner::LoadBalancerController));
        assert_eq!(cleaner_of("Ingress", "group.ingress.k8s.aws/shared"), Some(Cleaner::LoadBalancerController));
        assert_eq!(
            cleaner_of("Service", "service.kubernetes.io/load-balancer-cleanup"),
            None,
            "the in-tree controller runs in EKS's control plane"
        );
        assert_eq!(cleaner_of("VolumeAttachment", FINALIZER_EBS_ATTACHER), Some(Cleaner::EbsCsi));
        let fin = [FINALIZER_PROVISIONER.to_string(), "kubernetes.io/pv-protection".to_string()];
        let with = held_volume("pv-1", &fin, Some(EBS_CSI_DRIVER), Some("Delete"));
        assert_eq!(with.len(), 1);
        assert_eq!(with[0].cleaner, Cleaner::EbsCsi);
        assert_eq!(with[0].hold(), format!("finalizer {FINALIZER_PROVISIONER}"));
        assert!(held_volume("pv-1", &fin, Some(EBS_CSI_DRIVER), Some("Retain")).is_empty());
        assert!(held_volume("pv-1", &fin, Some("other.csi.example.com"), Some("Delete")).is_empty());
        assert_eq!(held_volume("pv-1", &fin, Some("efs.csi.aws.com"), Some("Delete"))[0].cleaner, Cleaner::EfsCsi);
        // before csi-provisioner v5's HonorPVReclaimPolicy no finalizer marks it, but its driver
        // still deletes the volume, and only the driver
        let bare =
            held_volume("pv-2", &["kubernetes.io/pv-protection".to_string()], Some(EBS_CSI_DRIVER), Some("Delete"));
        assert_eq!(bare.len(), 1);
        assert_eq!((bare[0].cleaner, bare[0].finalizer.as_deref()), (Cleaner::EbsCsi, None));
        assert_eq!(bare[0].hold(), "reclaim policy Delete, no finalizer");
    }

    #[test]
    fn an_in_tree_ebs_volume_is_the_ebs_drivers_by_its_volume_id() {
        let spec = |v: Value| serde_json::from_value::<PersistentVolumeSpec>(v).unwrap();
        let csi = spec(json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-0a1"}}));
        assert_eq!(volume_of(&csi), Some((EBS_CSI_DRIVER.into(), "vol-0a1".into())));
        for (id, want) in [
            ("aws://us-west-2a/vol-0b2", Some("vol-0b2")),
            ("aws:///vol-0b3", Some("vol-0b3")),
            ("vol-0b4", Some("vol-0b4")),
            ("aws://us-west-2a/", None),
            ("aws://us-west-2a/snap-1", None),
            ("aws://us-west-2a/vol-1/x", None),
        ] {
            let in_tree = spec(json!({"awsElasticBlockStore": {"volumeID": id}}));
            assert_eq!(volume_of(&in_tree), want.map(|w| (EBS_CSI_DRIVER.to_string(), w.to_string())), "{id}");
        }
        assert_eq!(volume_of(&spec(json!({"hostPath": {"path": "/data"}}))), None);
    }

    #[test]
    fn a_stranded_volume_without_a_finalizer_is_named_by_its_reclaim_policy() {
        let verdict = Verdict {
            cleaner: Cleaner::EbsCsi,
            runs: vec!["kube-system/ebs-csi-controller-0 on k1".into()],
            stranded: true,
            unplaced: false,
            held: held_volume("pv-2", &[], Some(EBS_CSI_DRIVER), Some("Delete")),
        };
        let blockers = verdict.blockers();
        assert_eq!(blockers.len(), 1);
        assert_eq!(blockers[0].0, "PersistentVolume/pv-2");
        assert!(
            blockers[0].1.starts_with(
                "PersistentVolume pv-2 has reclaim policy Delete and no finalizer: only the EBS CSI controller deletes its volume in AWS; the EBS CSI controller runs only on Karpenter nodes (kube-system/ebs-csi-controller-0 on k1)"
            ) && blockers[0].1.ends_with("the volume would outlive the cluster"),
            "{}",
            blockers[0].1
        );
    }

    #[test]
    fn a_release_reaches_a_surviving_cleaners_objects_only_when_all_is_named() {
        let objects = vec![held("Service", "web/front", FINALIZER_SERVICE, Cleaner::LoadBalancerController)];
        let verdict = |stranded| Verdict {
            cleaner: Cleaner::LoadBalancerController,
            runs: vec!["kube-system/lbc-0 on system-0".into()],
            stranded,
            unplaced: false,
            held: objects.clone(),
        };
        let lb = |all| Release { what: Releasable::LoadBalancers, all };
        let volumes = Release { what: Releasable::Volumes, all: true };
        let set = |r: &[Release]| r.iter().copied().collect::<std::collections::BTreeSet<_>>();
        // stranded: the default consent releases it
        assert!(Release::releases(&set(&[lb(false)]), &verdict(true)));
        // it survives the drain: only `=all` reaches its objects
        assert!(!Release::releases(&set(&[lb(false)]), &verdict(false)));
        assert!(Release::releases(&set(&[lb(true)]), &verdict(false)));
        assert!(Release::releases(&set(&[lb(false), lb(true)]), &verdict(false)), "the wider consent wins");
        // another kind's consent covers nothing of it
        assert!(!Release::releases(&set(&[volumes]), &verdict(true)));
        assert_eq!(Release::consent(&set(&[volumes]), Cleaner::LoadBalancerController), None);
        let line = verdict(false).not_released_line();
        assert!(line.contains("nothing of the 1 object(s)") && line.contains("--release load-balancers=all"), "{line}");
    }

    #[test]
    fn a_cleaner_only_on_karpenter_nodes_with_nowhere_else_to_go_is_stranded() {
        let karpenter = vec!["k1".to_string(), "k2".to_string()];
        let system = node("system-0", json!({"eks.amazonaws.com/nodegroup": "system"}), json!({}));
        let objects = [held("Service", "web/front", FINALIZER_SERVICE, Cleaner::LoadBalancerController)];
        let on_karpenter = |extra| {
            BTreeMap::from([(Cleaner::LoadBalancerController, Running { pods: vec![pod("lbc-0", "k1", extra)] })])
        };
        // it could move to the system node: not stranded
        let v = survey(&objects, &on_karpenter(json!({})), &karpenter, std::slice::from_ref(&system), &BTreeMap::new());
        assert_eq!(v.len(), 1);
        assert!(!v[0].stranded, "{v:?}");
        // it requires Karpenter capacity: stranded, one blocker per object
        let only = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}}}});
        let v =
            survey(&objects, &on_karpenter(only.clone()), &karpenter, std::slice::from_ref(&system), &BTreeMap::new());
        assert!(v[0].stranded, "{v:?}");
        let b = v[0].blockers();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].0, "Service/web/front");
        assert!(b[0].1.contains(FINALIZER_SERVICE) && b[0].1.contains("kube-system/lbc-0 on k1"), "{b:?}");
        // a tainted system node it does not tolerate is no place either
        let tainted = node(
            "system-1",
            json!({}),
            json!({"taints": [{"key": "dedicated", "value": "infra", "effect": "NoSchedule"}]}),
        );
        assert!(
            survey(&objects, &on_karpenter(json!({})), &karpenter, std::slice::from_ref(&tainted), &BTreeMap::new())[0]
                .stranded
        );
        let tolerant = json!({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}]});
        assert!(
            !survey(&objects, &on_karpenter(tolerant), &karpenter, std::slice::from_ref(&tainted), &BTreeMap::new())[0]
                .stranded
        );
        // no other node at all
        assert!(survey(&objects, &on_karpenter(json!({})), &karpenter, &[], &BTreeMap::new())[0].stranded);
        // one replica on the system node: it keeps running
        let split = BTreeMap::from([(
            Cleaner::LoadBalancerController,
            Running { pods: vec![pod("lbc-0", "k1", json!({})), pod("lbc-1", "system-0", json!({}))] },
        )]);
        assert!(!survey(&objects, &split, &karpenter, &[], &BTreeMap::new())[0].stranded);
        // a replica waiting unscheduled, or one that has ended on the system node, is no place it
        // runs: with nowhere else to go it is stranded all the same
        let mut pending = pod("lbc-1", "", only.clone());
        pending.spec.as_mut().unwrap().node_name = None;
        let mut ended = pod("lbc-2", "system-0", json!({}));
        ended.status =
            Some(k8s_openapi::api::core::v1::PodStatus { phase: Some("Failed".into()), ..Default::default() });
        let twins = |other| {
            BTreeMap::from([(
                Cleaner::LoadBalancerController,
                Running { pods: vec![pod("lbc-0", "k1", only.clone()), other] },
            )])
        };
        let v = survey(&objects, &twins(pending), &karpenter, std::slice::from_ref(&system), &BTreeMap::new());
        assert!(v[0].stranded, "{v:?}");
        assert!(v[0].runs.iter().any(|r| r.ends_with("unscheduled")), "{v:?}");
        assert!(survey(&objects, &twins(ended), &karpenter, &[], &BTreeMap::new())[0].stranded);
        // an unscheduled replica that would fit the system node is a place it can run
        let mut placeable = pod("lbc-1", "", json!({}));
        placeable.spec.as_mut().unwrap().node_name = None;
        assert!(
            !survey(&objects, &twins(placeable), &karpenter, std::slice::from_ref(&system), &BTreeMap::new())[0]
                .stranded
        );
        // no pod found at all: where it runs cannot be told, which is no verdict that it is safe
        let none = survey(&objects, &BTreeMap::new(), &karpenter, &[], &BTreeMap::new());
        assert!(none[0].unplaced && !none[0].stranded, "{none:?}");
        assert!(none[0].plan_line().contains("cannot be told"), "{none:?}");
        // a cleaner with nothing in its care is not reported
        assert!(survey(&[], &on_karpenter(json!({})), &karpenter, &[], &BTreeMap::new()).is_empty());
    }

    #[test]
    fn node_selectors_and_affinity_match_as_the_scheduler_reads_them() {
        let n = node("n", json!({"zone": "a", "size": "4"}), json!({}));
        assert!(fits(&pod("p", "x", json!({"nodeSelector": {"zone": "a"}})), &n, Requests::default()));
        assert!(!fits(&pod("p", "x", json!({"nodeSelector": {"zone": "b"}})), &n, Requests::default()));
        let expr = |op: &str, values: serde_json::Value| {
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "size", "operator": op, "values": values}]}]}}}})
        };
        assert!(fits(&pod("p", "x", expr("Gt", json!(["2"]))), &n, Requests::default()));
        assert!(!fits(&pod("p", "x", expr("Lt", json!(["2"]))), &n, Requests::default()));
        assert!(fits(&pod("p", "x", expr("NotIn", json!(["8"]))), &n, Requests::default()));
        assert!(!fits(
            &pod("p", "x", json!({})),
            &node("c", json!({}), json!({"unschedulable": true})),
            Requests::default()
        ));
    }

    #[test]
    fn a_node_that_is_not_ready_or_has_no_room_is_no_place_to_run() {
        let n = node("n", json!({}), json!({}));
        let wants = |cpu: &str, memory: &str| {
            pod(
                "p",
                "x",
                json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": memory}}}]}),
            )
        };
        assert!(fits(&wants("500m", "1Gi"), &n, Requests::default()));
        // the node's 4 CPUs: 3.6 requested already by its pods
        let busy = Requests { cpu_milli: 3600, memory: 0, pods: 10 };
        assert!(!fits(&wants("500m", "1Gi"), &n, busy), "a full node is no place to run");
        assert!(fits(&wants("400m", "1Gi"), &n, busy));
        assert!(!fits(&wants("100m", "17Gi"), &n, Requests::default()), "more memory than the node has");
        let crowded = Requests { cpu_milli: 0, memory: 0, pods: 110 };
        assert!(!fits(&wants("10m", "1Mi"), &n, crowded), "no pod slot left");
        let mut not_ready = n.clone();
        not_ready.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "False".into();
        assert!(!fits(&wants("10m", "1Mi"), &not_ready, Requests::default()));
        let mut unknown = n.clone();
        unknown.status = None;
        assert!(!fits(&wants("10m", "1Mi"), &unknown, Requests::default()), "no status: fails closed");
    }

    #[test]
    fn quantities_read_as_the_api_server_writes_them() {
        assert_eq!(cpu_milli("100m"), Some(100));
        assert_eq!(cpu_milli("2"), Some(2000));
        assert_eq!(cpu_milli("0.5"), Some(500));
        assert_eq!(bytes("128Mi"), Some(128 * 1024 * 1024));
        assert_eq!(bytes("1G"), Some(1_000_000_000));
        assert_eq!(bytes("16Gi"), Some(16 * 1024 * 1024 * 1024));
        assert_eq!(bytes("512"), Some(512));
        assert_eq!(bytes("x"), None);
        let init = pod(
            "p",
            "x",
            json!({
            "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "2"}}}],
            "containers": [{"name": "a", "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
                {"name": "b", "resources": {"requests": {"cpu": "200m"}}}]}),
        );
        assert_eq!(Requests::of_pod(&init), Requests { cpu_milli: 2000, memory: 64 * 1024 * 1024, pods: 1 });
    }
}
