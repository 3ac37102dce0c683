//! What the tool knows about Karpenter (v1.0 to v1.14): kinds, labels, finalizers, tags and the
//! provider-id format (design §3). Everything else refers to these names instead of spelling them.

use std::fmt;

/// API group of NodePool and NodeClaim.
pub(crate) const KARPENTER_GROUP: &str = "karpenter.sh";
/// API group of EC2NodeClass.
pub(crate) const AWS_GROUP: &str = "karpenter.k8s.aws";
/// The version all three kinds are served at since Karpenter 1.0.
pub(crate) const VERSION: &str = "v1";
/// The CustomResourceDefinitions of the three kinds.
pub(crate) const CRDS: [&str; 3] =
    ["nodepools.karpenter.sh", "nodeclaims.karpenter.sh", "ec2nodeclasses.karpenter.k8s.aws"];
/// The label the controller's chart puts on its Deployment and pods, and its value.
pub(crate) const CONTROLLER_LABEL: (&str, &str) = ("app.kubernetes.io/name", "karpenter");

/// The controller's label as a label selector.
pub(crate) fn controller_selector() -> String {
    format!("{}={}", CONTROLLER_LABEL.0, CONTROLLER_LABEL.1)
}

/// The Lease Karpenter's leader holds: its default name in every release (1.1 and later take
/// another from `LEADER_ELECTION_NAME`), in the controller's own namespace unless
/// `LEADER_ELECTION_NAMESPACE` names one. Its holder identity is `<pod name>_<uuid>`.
pub(crate) const LEADER_LEASE: &str = "karpenter-leader-election";
/// The controller's settings that rename and relocate its Lease (Karpenter 1.1 and later).
pub(crate) const ENV_LEADER_LEASE: &str = "LEADER_ELECTION_NAME";
pub(crate) const ENV_LEADER_NAMESPACE: &str = "LEADER_ELECTION_NAMESPACE";
/// The controller's image repository in every release, 1.0 to 1.14 (the chart's
/// `controller.image.repository`); a mirror keeps its last two path segments.
pub(crate) const CONTROLLER_IMAGE: &str = "public.ecr.aws/karpenter/controller";
/// Environment the chart gives the controller in every release: the cluster it manages, and its
/// own Service (`KARPENTER_SERVICE`, the chart's full name).
pub(crate) const ENV_CLUSTER_NAME: &str = "CLUSTER_NAME";
pub(crate) const ENV_SERVICE: &str = "KARPENTER_SERVICE";

/// Why a container is Karpenter's controller, from what it runs: its image (the repository, or a
/// mirror's path ending in `karpenter/controller`) or the environment only its chart sets
/// (`CLUSTER_NAME` with `KARPENTER_SERVICE`). `None` for any other container.
pub(crate) fn controller_container(image: Option<&str>, env: &[(&str, Option<&str>)]) -> Option<&'static str> {
    let repository = image.map(|i| {
        let i = i.split('@').next().unwrap_or(i);
        // a tag follows the last ':' after the last '/' (a registry's port comes before it)
        match i.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => repo,
            _ => i,
        }
    });
    if repository.is_some_and(|r| r == CONTROLLER_IMAGE || r.ends_with("/karpenter/controller")) {
        return Some("runs Karpenter's controller image");
    }
    let has = |k: &str| env.iter().any(|(n, _)| *n == k);
    if has(ENV_CLUSTER_NAME) && has(ENV_SERVICE) {
        return Some("has the environment Karpenter's chart gives its controller");
    }
    None
}

/// The pod a leader Lease's holder identity names (`<pod name>_<uuid>`).
pub(crate) fn lease_holder_pod(holder: &str) -> Option<&str> {
    holder.rsplit_once('_').map(|(pod, _)| pod).filter(|p| !p.is_empty())
}

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
/// Instance tag naming the NodeClaim it was launched for (`v1.NodeClaimTagKey`). Not a launch
/// tag: Karpenter's tagging controller (`pkg/controllers/nodeclaim/tagging`, 1.0 to 1.14) writes
/// it once the claim's `status.providerID` names the instance.
pub const TAG_NODECLAIM: &str = "karpenter.sh/nodeclaim";
/// Instance tag naming the cluster before 1.0 (v1beta1 releases; `v1beta1.ManagedByAnnotationKey`).
pub const TAG_MANAGED_BY: &str = "karpenter.sh/managed-by";
/// Instance tag naming the Provisioner of Karpenter's alpha API (before v1beta1's NodePools).
pub const TAG_PROVISIONER: &str = "karpenter.sh/provisioner-name";
/// Launch-template tag naming the cluster in Karpenter 1.0.x (later releases use the EKS tag).
pub const TAG_LEGACY_CLUSTER: &str = "karpenter.k8s.aws/cluster";
/// Launch templates Karpenter creates are named with this prefix and a hash.
pub(crate) const LAUNCH_TEMPLATE_PREFIX: &str = "karpenter.k8s.aws/";

/// Tag the Amazon VPC CNI puts on the network interfaces it creates, naming the cluster (only
/// when the CNI's CLUSTER_NAME is set, as EKS's managed add-on sets it).
pub const TAG_VPC_CNI_CLUSTER: &str = "cluster.k8s.amazonaws.com/name";
/// Tag the VPC CNI puts on its network interfaces with their creation time (RFC 3339).
pub const TAG_VPC_CNI_CREATED_AT: &str = "node.k8s.amazonaws.com/createdAt";
/// How long the VPC CNI's own leak collector leaves a detached interface alone after creating it.
pub(crate) const VPC_CNI_COOLDOWN: std::time::Duration = std::time::Duration::from_secs(5 * 60);

/// Whether a detached VPC CNI interface is old enough to be a leak rather than one a live CNI is
/// about to attach: its `createdAt` tag is more than [`VPC_CNI_COOLDOWN`] before `now`. Without a
/// readable tag the CNI's collector tags it and waits; the tool waits too (reports nothing).
pub(crate) fn cni_interface_is_settled(created_at: Option<&str>, now: std::time::SystemTime) -> bool {
    let Some(created) = created_at.and_then(|c| humantime::parse_rfc3339_weak(c).ok()) else {
        return false;
    };
    now.duration_since(created).is_ok_and(|age| age >= VPC_CNI_COOLDOWN)
}

/// Tag both the VPC CNI and the VPC resource controller put on the network interfaces they create
/// for a node, naming its instance.
pub const TAG_VPC_CNI_NODE: &str = "node.k8s.amazonaws.com/instance_id";
/// Description prefix of every network interface the VPC CNI creates (`aws-K8S-<instance-id>`).
pub const VPC_CNI_DESCRIPTION_PREFIX: &str = "aws-K8S-";
/// Tag naming which EKS component owns a network interface.
pub const TAG_ENI_OWNER: &str = "eks:eni:owner";
/// [`TAG_ENI_OWNER`]'s value on the VPC resource controller's branch and trunk interfaces.
pub const ENI_OWNER_RESOURCE_CONTROLLER: &str = "eks-vpc-resource-controller";
/// Prefix of the VPC resource controller's own tags (`vpcresources.k8s.aws/vlan-id`,
/// `vpcresources.k8s.aws/trunk-eni-id`).
pub(crate) const RESOURCE_CONTROLLER_TAG_PREFIX: &str = "vpcresources.k8s.aws/";
/// Description prefixes of the VPC resource controller's trunk and branch interfaces.
pub(crate) const RESOURCE_CONTROLLER_DESCRIPTIONS: [&str; 2] = ["aws-k8s-trunk-eni", "aws-k8s-branch-eni"];

/// Who a detached network interface tagged for the cluster belongs to, and so what `--reclaim`
/// may do with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InterfaceVerdict {
    /// A leak of this cluster's nodes that no live owner will attach again: reclaimed, for the
    /// reason given.
    Reclaim(String),
    /// Left alone, for the reason given (reported, not counted against a clean result).
    Leave(String),
}

/// Judges one detached (`available`) network interface found by the cluster's tags, from its
/// description and tags only (so the rule is the same wherever the interface was read):
///
/// - the VPC resource controller's (Security Groups for Pods) trunk and branch interfaces
///   (`eks:eni:owner=eks-vpc-resource-controller`, a `vpcresources.k8s.aws/` tag, or the
///   `aws-k8s-trunk-eni`/`aws-k8s-branch-eni` description) are left to it: it creates a branch
///   interface before it associates it with a trunk, and its own cleaner deletes one only after
///   it stayed available across two of its cycles, 30 minutes apart (amazon-vpc-resource-controller-k8s,
///   pkg/aws/ec2/api/cleanup/eni_cleanup.go, pkg/config/type.go `ENICleanUpInterval`). It runs
///   in EKS's control plane, so it is still there after Karpenter is gone;
/// - the VPC CNI's (`cluster.k8s.amazonaws.com/name=<cluster>`, a `node.k8s.amazonaws.com/instance_id`
///   tag and an `aws-K8S-` description: exactly the CNI's own leak query) are reclaimed once
///   their `node.k8s.amazonaws.com/createdAt` tag is [`VPC_CNI_COOLDOWN`] old, as the CNI's own
///   collector does (amazon-vpc-cni-k8s, pkg/awsutils/awsutils.go `getLeakedENIs`);
/// - Karpenter's (its launch templates tag network interfaces with the node's tags:
///   `eks:eks-cluster-name=<cluster>` and `karpenter.sh/nodepool`) are created attached by the
///   launch, so a detached one outlived its instance and is reclaimed;
/// - anything else that only carries `kubernetes.io/cluster/<cluster>` has no owner the tool can
///   name, and is left alone.
pub(crate) fn judge_detached_interface(
    description: &str,
    tags: &std::collections::BTreeMap<String, String>,
    cluster: &str,
    now: std::time::SystemTime,
) -> InterfaceVerdict {
    let tag = |k: &str| tags.get(k).map(String::as_str);
    if tag(TAG_ENI_OWNER) == Some(ENI_OWNER_RESOURCE_CONTROLLER)
        || tags.keys().any(|k| k.starts_with(RESOURCE_CONTROLLER_TAG_PREFIX))
        || RESOURCE_CONTROLLER_DESCRIPTIONS.iter().any(|d| description.starts_with(d))
    {
        return InterfaceVerdict::Leave(
            "the VPC resource controller's trunk or branch interface: left to its own cleaner, which deletes it after it stayed detached across two of its 30-minute cycles".into(),
        );
    }
    if tag(TAG_VPC_CNI_CLUSTER) == Some(cluster) {
        if !tags.contains_key(TAG_VPC_CNI_NODE) || !description.starts_with(VPC_CNI_DESCRIPTION_PREFIX) {
            return InterfaceVerdict::Leave(format!(
                "tagged {TAG_VPC_CNI_CLUSTER}={cluster} but without the VPC CNI's {TAG_VPC_CNI_NODE} tag or {VPC_CNI_DESCRIPTION_PREFIX} description: not the CNI's"
            ));
        }
        return if cni_interface_is_settled(tag(TAG_VPC_CNI_CREATED_AT), now) {
            InterfaceVerdict::Reclaim(format!(
                "the VPC CNI's, detached and created more than {} ago (the CNI's own leak rule)",
                humantime::format_duration(VPC_CNI_COOLDOWN)
            ))
        } else {
            InterfaceVerdict::Leave(format!(
                "the VPC CNI's, but created less than {} ago or without a readable {TAG_VPC_CNI_CREATED_AT} tag: a live CNI may be about to attach it",
                humantime::format_duration(VPC_CNI_COOLDOWN)
            ))
        };
    }
    // Karpenter's launch templates tag interfaces with the instance's tags, its node class
    // included; EKS Auto Mode's carry its own node class tag instead and are EKS's to clean up
    if tag(TAG_EKS_CLUSTER) == Some(cluster)
        && tags.contains_key(TAG_NODEPOOL)
        && tags.contains_key(TAG_NODECLASS)
        && !tags.contains_key(TAG_AUTO_NODECLASS)
    {
        return InterfaceVerdict::Reclaim(
            "Karpenter's (tagged by its launch template with the node's NodePool and EC2NodeClass): it outlived its instance".into(),
        );
    }
    InterfaceVerdict::Leave(format!(
        "tagged {} but by no owner the tool can name (neither Karpenter's, the VPC CNI's nor the VPC resource controller's tags)",
        cluster_tag_key(cluster)
    ))
}

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
pub(crate) fn legacy_instance_profile_prefix(cluster: &str) -> String {
    format!("{cluster}_")
}

/// Tag Karpenter puts on the instance profiles it creates naming their region (IAM is global, so
/// this is what tells two clusters of the same name in two regions apart).
pub(crate) const TAG_REGION: &str = "topology.kubernetes.io/region";

/// Why an instance profile is taken to be this cluster's Karpenter's: where it is, and (always
/// required as well) every tag Karpenter's own IAM policy requires before Karpenter may delete it
/// (`kubernetes.io/cluster/<c>=owned`, `topology.kubernetes.io/region=<region>`,
/// `karpenter.k8s.aws/ec2nodeclass` present).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileEvidence {
    /// Under `/karpenter/<region>/<cluster>/` (Karpenter ≥ 1.7) and tagged.
    ClusterPath,
    /// At `/`, named exactly `<cluster>_<digits>` (Karpenter ≤ 1.6) and tagged.
    LegacyName,
}

/// Where an instance profile is, if that is where this cluster's Karpenter puts profiles:
/// under `/karpenter/<region>/<cluster>/` (≥ 1.7) or at `/` named exactly `<cluster>_<digits>`
/// (≤ 1.6). `None` for any other profile; such a profile is never a candidate.
///
/// A name prefix alone is never enough: `<cluster>_bastion`, or every profile of a cluster named
/// `<cluster>_eu` (EKS names allow `_`), start with `<cluster>_` too.
pub(crate) fn instance_profile_location(
    name: &str,
    path: &str,
    cluster: &str,
    region: &str,
) -> Option<ProfileEvidence> {
    if path.starts_with(&instance_profile_path_prefix(region, cluster)) {
        Some(ProfileEvidence::ClusterPath)
    } else if path == "/" && is_legacy_profile_name(name, cluster) {
        Some(ProfileEvidence::LegacyName)
    } else {
        None
    }
}

/// The tags Karpenter puts on its instance profiles that `tags` lacks, as `key=value` for the
/// log; empty when the profile carries all of them. These are the conditions of Karpenter's own
/// IAM policy for `iam:DeleteInstanceProfile`, so a profile without them is one Karpenter itself
/// could not delete.
pub(crate) fn missing_instance_profile_tags(
    tags: &std::collections::BTreeMap<String, String>,
    cluster: &str,
    region: &str,
) -> Vec<String> {
    let tag = |k: &str| tags.get(k).map(String::as_str);
    let mut missing = Vec::new();
    if tag(&cluster_tag_key(cluster)) != Some("owned") {
        missing.push(format!("{}=owned", cluster_tag_key(cluster)));
    }
    if tag(TAG_REGION) != Some(region) {
        missing.push(format!("{TAG_REGION}={region}"));
    }
    if tag(TAG_NODECLASS).is_none_or(str::is_empty) {
        missing.push(format!("{TAG_NODECLASS}=<class>"));
    }
    missing
}

/// The tags Karpenter puts on an instance profile it creates for `class`, as the tool requires
/// them ([`missing_instance_profile_tags`]); the tests plant look-alike profiles with them.
pub fn instance_profile_tags(cluster: &str, region: &str, class: &str) -> std::collections::BTreeMap<String, String> {
    std::collections::BTreeMap::from([
        (cluster_tag_key(cluster), "owned".to_string()),
        (TAG_EKS_CLUSTER.to_string(), cluster.to_string()),
        (TAG_REGION.to_string(), region.to_string()),
        (TAG_NODECLASS.to_string(), class.to_string()),
    ])
}

/// `<cluster>_<digits>`: Karpenter names profiles with a decimal 64-bit hash after the cluster
/// name, so a suffix with anything but digits (or too many of them) is someone else's.
/// The cluster a profile at `/` named like Karpenter ≤ 1.6's (`<cluster>_<digits>`) would be
/// of: the name before its last `_`. Only a candidate: its tags decide.
pub(crate) fn legacy_profile_cluster(name: &str) -> Option<String> {
    let (cluster, _) = name.rsplit_once('_')?;
    is_legacy_profile_name(name, cluster).then(|| cluster.to_string())
}

fn is_legacy_profile_name(name: &str, cluster: &str) -> bool {
    name.strip_prefix(&legacy_instance_profile_prefix(cluster))
        .is_some_and(|h| !h.is_empty() && h.len() <= 20 && h.bytes().all(|b| b.is_ascii_digit()))
}

/// The `spec.limits` that fence a NodePool (merged over its own, so every limit it has becomes
/// zero and nothing new can launch):
///
/// - a dynamic NodePool: each of its limits and `cpu` at "0" (every node needs some cpu, so a
///   zero cpu limit stops every launch whatever else the pool limits);
/// - a static NodePool (Karpenter ≥ 1.8, `spec.replicas` set): only `nodes` at "0". The CRD's
///   CEL rule refuses any other limit on a static pool ("only 'limits.nodes' is supported on
///   static NodePools"), and `limits.nodes` is what the static provisioner reserves capacity
///   against. `replicas` is left as it is: lowering it makes the live controller's static
///   deprovisioner delete NodeClaims itself, without consulting disruption budgets, racing the
///   tool's ordered drain; with `nodes` at zero it neither adds nor removes nodes, and the tool
///   drains and terminates them in its own order.
pub fn fence_limits(nodepool_spec: &serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    let zero = || serde_json::Value::String("0".into());
    let mut limits = serde_json::Map::new();
    if nodepool_spec.get("replicas").is_some_and(|r| !r.is_null()) {
        limits.insert("nodes".into(), zero());
        return limits;
    }
    if let Some(m) = nodepool_spec["limits"].as_object() {
        for k in m.keys() {
            limits.insert(k.clone(), zero());
        }
    }
    limits.insert("cpu".into(), zero());
    limits
}

/// Whether a NodePool's spec holds the fence [`fence_limits`] and a zero disruption budget set:
/// every limit the fence zeroes is zero, and a budget of zero nodes applies at all times. The
/// fence's annotation alone proves nothing: a re-applied manifest or a resumed GitOps sync puts
/// the limits back and keeps the annotation.
pub(crate) fn holds_fence(nodepool_spec: &serde_json::Value) -> bool {
    let limits = &nodepool_spec["limits"];
    let limits_zero = fence_limits(nodepool_spec).keys().all(|k| is_zero_quantity(&limits[k]));
    let budgets = nodepool_spec.pointer("/disruption/budgets").and_then(|b| b.as_array());
    let always_zero = budgets.is_some_and(|b| {
        b.iter().any(|budget| is_zero_quantity(&budget["nodes"]) && budget.get("schedule").is_none_or(|s| s.is_null()))
    });
    limits_zero && always_zero
}

/// A resource quantity (or a budget's node count) of zero: `0`, `"0"`, `"0m"`, `"0Gi"`, `"0%"`.
fn is_zero_quantity(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Number(n) => n.as_f64() == Some(0.0),
        serde_json::Value::String(s) => {
            let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic() || c == '%');
            !digits.is_empty() && digits.chars().all(|c| c == '0' || c == '.')
        }
        _ => false,
    }
}

// ---------------------------------------------------------------- whose compute it is

/// API group of EKS Auto Mode's `NodeClass`. Auto Mode runs Karpenter inside EKS: its NodePools
/// and NodeClaims are `karpenter.sh/v1` objects too, but reference this group's NodeClass, and
/// their instances are EKS's managed instances.
pub(crate) const AUTO_MODE_GROUP: &str = "eks.amazonaws.com";
/// Label EKS puts on Auto Mode's NodeClaims and Nodes (`auto`).
pub(crate) const LABEL_COMPUTE_TYPE: &str = "eks.amazonaws.com/compute-type";
/// Label naming an Auto Mode node's NodeClass: Karpenter labels a node with
/// `<nodeClassRef group>/<lower-case kind>`, so Auto Mode's nodes carry this one and ours
/// [`LABEL_NODECLASS`].
pub(crate) const LABEL_AUTO_NODECLASS: &str = "eks.amazonaws.com/nodeclass";
/// Instance tag naming an Auto Mode instance's NodeClass (EKS's compute policy requires it on
/// every instance Auto Mode launches, where this controller tags [`TAG_NODECLASS`]).
pub const TAG_AUTO_NODECLASS: &str = "eks:kubernetes-node-class-name";
/// The kind of this controller's node class.
pub(crate) const NODECLASS_KIND: &str = "EC2NodeClass";
/// The kinds of [`KARPENTER_GROUP`].
pub(crate) const NODEPOOL_KIND: &str = "NodePool";
pub(crate) const NODECLAIM_KIND: &str = "NodeClaim";

/// A Karpenter object in the cluster that is not this cluster's self-managed Karpenter's (EKS
/// Auto Mode's, another provider's): named in the plan and the report, never acted on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Foreign {
    /// `NodePool`, `NodeClaim` or `Node`.
    pub kind: &'static str,
    /// Its name.
    pub name: String,
    /// Whose it is instead.
    #[serde(flatten)]
    pub why: NotOurs,
}

impl std::fmt::Display for Foreign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.kind, self.name, self.why)
    }
}

/// Why a NodePool, NodeClaim, Node or instance is not this cluster's self-managed Karpenter's.
/// Such an object is left alone: never fenced, cordoned, drained, deleted or terminated.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(tag = "owner", content = "detail", rename_all = "kebab-case")]
pub enum NotOurs {
    /// EKS Auto Mode's compute: its NodeClass, its label or its tags say so.
    EksAutoMode,
    /// Another Karpenter provider's (the node class `group/kind` it references).
    OtherProvider(String),
    /// A NodeClaim or Node of a NodePool that is not ours.
    PoolNotOurs(String),
    /// An instance without this controller's tags, or managed by an AWS service.
    Instance(String),
    /// A Node a NodeClaim names (`status.nodeName`) that is not that claim's machine: another
    /// instance, or no Karpenter node at all (a reused name); the detail names the claim and
    /// the fact that disagrees (`crate::evidence`).
    ClaimMismatch(String),
}

impl fmt::Display for NotOurs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotOurs::EksAutoMode => f.write_str("EKS Auto Mode's"),
            NotOurs::OtherProvider(gk) => write!(f, "another Karpenter provider's (node class {gk})"),
            NotOurs::PoolNotOurs(p) => write!(f, "of NodePool {p}, which is not this controller's"),
            NotOurs::Instance(why) => f.write_str(why),
            NotOurs::ClaimMismatch(why) => f.write_str(why),
        }
    }
}

/// Whether a `nodeClassRef` (of a NodePool's template or a NodeClaim) names this controller's
/// `EC2NodeClass`, decided as Karpenter decides which NodePools and NodeClaims it manages: the
/// reference's group and kind must be its provider's (`karpenter.k8s.aws`, `EC2NodeClass`).
/// Karpenter 1.0 also served v1beta1, whose reference had an `apiVersion` instead of a group,
/// and let both it and the kind default to the provider's own; those shapes are read the same.
pub(crate) fn nodeclass_ref_owner(node_class_ref: &serde_json::Value) -> Result<(), NotOurs> {
    let text = |k: &str| node_class_ref.get(k).and_then(|v| v.as_str()).filter(|s| !s.is_empty());
    let group = text("group").or_else(|| text("apiVersion").map(|v| v.split('/').next().unwrap_or(v)));
    let kind = text("kind");
    match (group, kind) {
        (Some(AWS_GROUP) | None, Some(NODECLASS_KIND) | None) => Ok(()),
        (Some(AUTO_MODE_GROUP), _) => Err(NotOurs::EksAutoMode),
        (g, k) => Err(NotOurs::OtherProvider(format!("{}/{}", g.unwrap_or(AWS_GROUP), k.unwrap_or(NODECLASS_KIND)))),
    }
}

/// What a NodeClaim's or Node's labels say against it being ours: EKS marks Auto Mode's with
/// `eks.amazonaws.com/compute-type: auto`, and Karpenter labels a node with its node class's
/// group, so an `eks.amazonaws.com/nodeclass` label is Auto Mode's too.
pub(crate) fn labels_owner(labels: &std::collections::BTreeMap<String, String>) -> Result<(), NotOurs> {
    if labels.get(LABEL_COMPUTE_TYPE).is_some_and(|v| v == "auto") || labels.contains_key(LABEL_AUTO_NODECLASS) {
        return Err(NotOurs::EksAutoMode);
    }
    Ok(())
}

/// Whether an EC2 instance is this cluster's self-managed Karpenter's, on the instance's own
/// evidence (checked again right before it is terminated, whatever the Kubernetes objects
/// said): tagged `eks:eks-cluster-name=<cluster>` and with the NodePool and EC2NodeClass tags
/// this controller puts on every instance it launches, and not a managed instance of an AWS
/// service (`managed_by`: DescribeInstances' `Operator.Principal` when `Operator.Managed`).
/// EKS Auto Mode's instances are managed by `eks.amazonaws.com` and tagged
/// `eks:kubernetes-node-class-name` instead of `karpenter.k8s.aws/ec2nodeclass`.
pub(crate) fn instance_owner(
    tags: &std::collections::BTreeMap<String, String>,
    managed_by: Option<&str>,
    cluster: &str,
) -> Result<(), NotOurs> {
    if let Some(principal) = managed_by {
        return Err(if principal == AUTO_MODE_GROUP {
            NotOurs::EksAutoMode
        } else {
            NotOurs::Instance(format!("a managed instance of {principal}"))
        });
    }
    if tags.contains_key(TAG_AUTO_NODECLASS) {
        return Err(NotOurs::EksAutoMode);
    }
    match tags.get(TAG_EKS_CLUSTER) {
        Some(c) if c == cluster => {}
        Some(c) => return Err(NotOurs::Instance(format!("tagged for cluster {c}"))),
        None => return Err(NotOurs::Instance(format!("not tagged {TAG_EKS_CLUSTER}={cluster}"))),
    }
    for key in [TAG_NODEPOOL, TAG_NODECLASS] {
        if tags.get(key).is_none_or(|v| v.is_empty()) {
            return Err(NotOurs::Instance(format!("no {key} tag, which this controller puts on its instances")));
        }
    }
    Ok(())
}

/// A parsed `aws:///<zone>/<instance-id>` provider id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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

    /// The region the zone belongs to, in every partition and zone kind (`us-west-2a` →
    /// `us-west-2`, `us-gov-west-1a` → `us-gov-west-1`, Local Zone `us-west-2-lax-1a` →
    /// `us-west-2`); the zone itself when it names no region (it then matches no `--region`,
    /// which refuses the run rather than guessing).
    pub(crate) fn region(&self) -> String {
        crate::partition::region_of_zone(&self.zone).unwrap_or_else(|| self.zone.clone())
    }
}

impl fmt::Display for ProviderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "aws:///{}/{}", self.zone, self.instance_id)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn karpenters_controller_is_known_by_its_image_or_its_charts_environment_not_its_name() {
        let none: [(&str, Option<&str>); 0] = [];
        assert!(controller_container(Some("public.ecr.aws/karpenter/controller:1.5.0@sha256:abc"), &none).is_some());
        assert!(controller_container(Some("public.ecr.aws/karpenter/controller:1.0.8"), &none).is_some());
        assert!(
            controller_container(Some("123.dkr.ecr.us-west-2.amazonaws.com/mirror/karpenter/controller:1.3.0"), &none)
                .is_some()
        );
        assert!(controller_container(Some("registry.local:5000/karpenter/controller"), &none).is_some());
        assert!(controller_container(Some("public.ecr.aws/eks/aws-load-balancer-controller:v2.9.0"), &none).is_none());
        assert!(controller_container(Some("karpenter/controller-tools:1"), &none).is_none());
        let env = [("CLUSTER_NAME", Some("prod")), ("KARPENTER_SERVICE", Some("karpenter-controller"))];
        assert!(controller_container(Some("internal/kc:1"), &env).is_some());
        assert!(controller_container(Some("internal/kc:1"), &env[..1]).is_none(), "CLUSTER_NAME alone is common");
    }

    #[test]
    fn a_lease_holder_names_its_pod_before_the_last_underscore() {
        assert_eq!(lease_holder_pod("karpenter-7d9f8b6c5-x2x4q_3f1c2d4e-aaaa-bbbb"), Some("karpenter-7d9f8b6c5-x2x4q"));
        assert_eq!(lease_holder_pod("no-separator"), None);
        assert_eq!(lease_holder_pod("_uuid"), None);
    }

    #[test]
    fn a_fence_holds_only_while_the_limits_and_budgets_are_zero() {
        let fenced =
            serde_json::json!({"limits": {"cpu": "0", "memory": "0"}, "disruption": {"budgets": [{"nodes": "0"}]}});
        assert!(holds_fence(&fenced));
        // a re-applied manifest: the limits are back, whatever annotation the pool carries
        let restored =
            serde_json::json!({"limits": {"cpu": "1000", "memory": "0"}, "disruption": {"budgets": [{"nodes": "0"}]}});
        assert!(!holds_fence(&restored));
        let no_limits = serde_json::json!({"disruption": {"budgets": [{"nodes": "0"}]}});
        assert!(!holds_fence(&no_limits), "a pool without limits is unbounded");
        let budget_back = serde_json::json!({"limits": {"cpu": "0"}, "disruption": {"budgets": [{"nodes": "10%"}]}});
        assert!(!holds_fence(&budget_back));
        let scheduled = serde_json::json!({"limits": {"cpu": "0"},
            "disruption": {"budgets": [{"nodes": "0", "schedule": "@daily", "duration": "1h"}]}});
        assert!(!holds_fence(&scheduled), "a zero budget on a schedule does not hold at all times");
        let static_pool =
            serde_json::json!({"replicas": 3, "limits": {"nodes": "0"}, "disruption": {"budgets": [{"nodes": "0"}]}});
        assert!(holds_fence(&static_pool));
        assert!(holds_fence(&serde_json::json!({"limits": {"cpu": 0}, "disruption": {"budgets": [{"nodes": "0%"}]}})));
    }

    fn tags(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn only_the_aws_providers_node_class_references_are_ours() {
        let ours = serde_json::json!({"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"});
        assert_eq!(nodeclass_ref_owner(&ours), Ok(()));
        let auto = serde_json::json!({"group": "eks.amazonaws.com", "kind": "NodeClass", "name": "default"});
        assert_eq!(nodeclass_ref_owner(&auto), Err(NotOurs::EksAutoMode));
        let kwok = serde_json::json!({"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"});
        assert_eq!(nodeclass_ref_owner(&kwok), Err(NotOurs::OtherProvider("karpenter.kwok.sh/KWOKNodeClass".into())));
        let other_kind = serde_json::json!({"group": "karpenter.k8s.aws", "kind": "Other", "name": "x"});
        assert!(nodeclass_ref_owner(&other_kind).is_err());
        // v1beta1 shapes Karpenter 1.0 still served: apiVersion instead of group, defaults
        let beta = serde_json::json!({"apiVersion": "karpenter.k8s.aws/v1beta1", "kind": "EC2NodeClass", "name": "d"});
        assert_eq!(nodeclass_ref_owner(&beta), Ok(()));
        assert_eq!(nodeclass_ref_owner(&serde_json::json!({"name": "d"})), Ok(()));
        let auto_beta = serde_json::json!({"apiVersion": "eks.amazonaws.com/v1", "kind": "NodeClass", "name": "d"});
        assert_eq!(nodeclass_ref_owner(&auto_beta), Err(NotOurs::EksAutoMode));
    }

    #[test]
    fn auto_mode_labels_are_never_ours() {
        assert_eq!(
            labels_owner(&tags(&[(LABEL_NODEPOOL, "general-purpose"), (LABEL_COMPUTE_TYPE, "auto")])),
            Err(NotOurs::EksAutoMode)
        );
        assert_eq!(
            labels_owner(&tags(&[(LABEL_NODEPOOL, "system"), (LABEL_AUTO_NODECLASS, "default")])),
            Err(NotOurs::EksAutoMode)
        );
        assert_eq!(labels_owner(&tags(&[(LABEL_NODEPOOL, "web"), (LABEL_COMPUTE_TYPE, "ec2")])), Ok(()));
    }

    #[test]
    fn an_instance_is_ours_only_on_this_controllers_tags() {
        let ours = tags(&[(TAG_EKS_CLUSTER, "prod"), (TAG_NODEPOOL, "web"), (TAG_NODECLASS, "default")]);
        assert_eq!(instance_owner(&ours, None, "prod"), Ok(()));
        assert!(matches!(instance_owner(&ours, None, "staging"), Err(NotOurs::Instance(w)) if w.contains("prod")));
        assert_eq!(instance_owner(&ours, Some("eks.amazonaws.com"), "prod"), Err(NotOurs::EksAutoMode));
        let auto = tags(&[
            (TAG_EKS_CLUSTER, "prod"),
            (TAG_NODEPOOL, "general-purpose"),
            (TAG_AUTO_NODECLASS, "default"),
            ("eks:kubernetes-node-pool-name", "general-purpose"),
        ]);
        assert_eq!(instance_owner(&auto, None, "prod"), Err(NotOurs::EksAutoMode));
        let no_class = tags(&[(TAG_EKS_CLUSTER, "prod"), (TAG_NODEPOOL, "web")]);
        assert!(matches!(instance_owner(&no_class, None, "prod"), Err(NotOurs::Instance(_))));
    }

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
        let gov = ProviderId::parse("aws:///us-gov-west-1a/i-1").unwrap();
        assert_eq!(gov.region(), "us-gov-west-1", "GovCloud zones have four parts");
    }

    #[test]
    fn malformed_provider_ids_are_rejected() {
        for raw in ["", "aws:///", "aws:///us-west-2a", "aws://us-west-2a/i-1", "kind://x/y", "aws:///z/vol-1"] {
            assert!(ProviderId::parse(raw).is_err(), "{raw:?} should not parse");
        }
    }

    #[test]
    fn instance_profiles_are_the_clusters_only_on_location_and_tags() {
        let (c, r) = ("prod", "us-west-2");
        let tags = instance_profile_tags(c, r, "default");
        let path = format!("/karpenter/{r}/{c}/uid-1/");
        assert_eq!(instance_profile_location("prod_123", &path, c, r), Some(ProfileEvidence::ClusterPath));
        assert_eq!(instance_profile_location("prod_123", "/", c, r), Some(ProfileEvidence::LegacyName));
        assert!(missing_instance_profile_tags(&tags, c, r).is_empty());
        // shapes that share only the prefix
        for name in ["prod_bastion", "prod_eu_123", "prod_", "prod_12a", "prod_123456789012345678901", "prod-123"] {
            assert_eq!(instance_profile_location(name, "/", c, r), None, "{name}");
        }
        // the 1.7+ path of another cluster or region, and a legacy name below another path
        assert_eq!(instance_profile_location("prod_1", "/karpenter/us-west-2/prod_eu/u/", c, r), None);
        assert_eq!(instance_profile_location("prod_1", "/karpenter/eu-west-1/prod/u/", c, r), None);
        assert_eq!(instance_profile_location("prod_1", "/team/", c, r), None);
        // every tag is required, with the right values
        for key in [cluster_tag_key(c), TAG_REGION.to_string(), TAG_NODECLASS.to_string()] {
            let mut t = tags.clone();
            t.remove(&key);
            assert_eq!(missing_instance_profile_tags(&t, c, r).len(), 1, "without {key}");
        }
        let other_region = instance_profile_tags(c, "eu-west-1", "default");
        assert_eq!(missing_instance_profile_tags(&other_region, c, r), vec![format!("{TAG_REGION}={r}")]);
        let shared = BTreeMap::from([(cluster_tag_key(c), "shared".to_string())]);
        assert_eq!(missing_instance_profile_tags(&shared, c, r).len(), 3);
    }

    #[test]
    fn vpc_cni_interfaces_count_as_leaks_only_after_the_cnis_own_cooldown() {
        let now = humantime::parse_rfc3339("2026-11-23T12:00:00Z").unwrap();
        assert!(cni_interface_is_settled(Some("2026-11-23T11:50:00Z"), now));
        assert!(!cni_interface_is_settled(Some("2026-11-23T11:58:00Z"), now), "2 minutes old: the CNI may attach it");
        assert!(!cni_interface_is_settled(None, now));
        assert!(!cni_interface_is_settled(Some("yesterday"), now));
    }

    fn eni_tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn detached_interfaces_are_reclaimed_only_on_their_owners_evidence() {
        let now = humantime::parse_rfc3339("2026-11-23T12:00:00Z").unwrap();
        let (old, young) = ("2026-11-23T11:50:00Z", "2026-11-23T11:59:00Z");
        let reclaimed = |d: &str, t: &[(&str, &str)]| {
            matches!(judge_detached_interface(d, &eni_tags(t), "prod", now), InterfaceVerdict::Reclaim(_))
        };
        let cluster_tag = cluster_tag_key("prod");
        let cni = |created: &'static str| {
            vec![
                (TAG_VPC_CNI_CLUSTER, "prod"),
                (TAG_VPC_CNI_NODE, "i-0123456789abcdef0"),
                (TAG_ENI_OWNER, "amazon-vpc-cni"),
                (TAG_VPC_CNI_CREATED_AT, created),
            ]
        };
        assert!(reclaimed("aws-K8S-i-0123456789abcdef0", &cni(old)), "a settled CNI interface");
        assert!(!reclaimed("aws-K8S-i-0123456789abcdef0", &cni(young)), "inside the CNI's cool-down");
        assert!(!reclaimed("my interface", &cni(old)), "the CNI's tags without its description");
        assert!(!reclaimed("aws-K8S-i-1", &cni(old)[..1]), "the CNI's cluster tag alone");
        let mut other_cluster = cni(old);
        other_cluster[0] = (TAG_VPC_CNI_CLUSTER, "staging");
        assert!(!reclaimed("aws-K8S-i-1", &other_cluster), "another cluster's CNI");
        // the resource controller's, young or old, with any of its marks
        let branch = [
            (cluster_tag.as_str(), "owned"),
            (TAG_ENI_OWNER, ENI_OWNER_RESOURCE_CONTROLLER),
            ("vpcresources.k8s.aws/trunk-eni-id", "eni-1"),
            ("vpcresources.k8s.aws/vlan-id", "3"),
            (TAG_VPC_CNI_NODE, "i-1"),
        ];
        assert!(!reclaimed("aws-k8s-branch-eni", &branch));
        assert!(!reclaimed("", &branch[..2]), "the owner tag alone");
        assert!(!reclaimed("aws-k8s-trunk-eni", &branch[..1]), "the description alone");
        assert!(!reclaimed("", &[(cluster_tag.as_str(), "owned"), ("vpcresources.k8s.aws/vlan-id", "1")]));
        // the resource controller's mark wins over the CNI's tags
        let mut both = cni(old);
        both.push((TAG_ENI_OWNER, ENI_OWNER_RESOURCE_CONTROLLER));
        assert!(!reclaimed("aws-K8S-i-1", &both));
        // Karpenter's own, and an interface with only the cluster tag
        let karpenter = [
            (cluster_tag.as_str(), "owned"),
            (TAG_EKS_CLUSTER, "prod"),
            (TAG_NODEPOOL, "default"),
            (TAG_NODECLASS, "default"),
        ];
        assert!(reclaimed("", &karpenter));
        assert!(!reclaimed("", &[(TAG_EKS_CLUSTER, "staging"), (TAG_NODEPOOL, "default"), (TAG_NODECLASS, "d")]));
        let auto_mode = [(TAG_EKS_CLUSTER, "prod"), (TAG_NODEPOOL, "general-purpose"), (TAG_AUTO_NODECLASS, "default")];
        assert!(!reclaimed("", &auto_mode), "EKS Auto Mode's interfaces are EKS's");
        assert!(!reclaimed("", &karpenter[..1]), "the cluster tag alone names no owner");
    }

    #[test]
    fn static_nodepools_are_fenced_on_nodes_only_and_dynamic_ones_on_every_limit_and_cpu() {
        let static_pool = serde_json::json!({"replicas": 3, "limits": {"nodes": "10"}});
        assert_eq!(serde_json::Value::Object(fence_limits(&static_pool)), serde_json::json!({"nodes": "0"}));
        let zero_replicas = serde_json::json!({"replicas": 0});
        assert_eq!(serde_json::Value::Object(fence_limits(&zero_replicas)), serde_json::json!({"nodes": "0"}));
        let dynamic = serde_json::json!({"limits": {"memory": "100Gi", "nodes": "5"}});
        assert_eq!(
            serde_json::Value::Object(fence_limits(&dynamic)),
            serde_json::json!({"memory": "0", "nodes": "0", "cpu": "0"})
        );
        assert_eq!(serde_json::Value::Object(fence_limits(&serde_json::json!({}))), serde_json::json!({"cpu": "0"}));
    }
}
