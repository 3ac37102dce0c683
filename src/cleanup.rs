//! The controllers the rest of a destroy depends on, and whether the drain strands them.
//!
//! The AWS Load Balancer Controller deletes the load balancers, target groups and security
//! groups it made for Services, Ingresses and TargetGroupBindings, and the EBS and EFS CSI
//! controllers the volumes of PersistentVolumes whose reclaim policy is `Delete`; each holds its
//! objects with a finalizer until it has cleaned up in AWS. When such a controller runs only on
//! Karpenter nodes, the drain leaves it nowhere to run: its objects can then never be deleted
//! (their finalizers stay, and stripping them leaks the AWS objects, whose network interfaces
//! and security groups then block the subnets and the VPC). So before the first write the tool
//! finds each controller with objects still in its care, and refuses when the drain would
//! strand it (design §2.1).
//!
//! Everything here is a pure function of what `crate::k8s::cleanup` has read.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, Pod};
use serde::Serialize;

use crate::k8s::pods::tolerates;

/// A controller that cleans up in AWS behind a finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Cleaner {
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

/// The finalizer of the Load Balancer Controller on a Service (`serviceFinalizer` in its
/// `controllers/service/service_controller.go`).
pub(crate) const FINALIZER_SERVICE: &str = "service.k8s.aws/resources";
/// On an Ingress of its own (`ingress.k8s.aws/resources`); an IngressGroup's members carry
/// `group.ingress.k8s.aws/<group>`.
pub(crate) const FINALIZER_INGRESS: &str = "ingress.k8s.aws/resources";
const FINALIZER_INGRESS_GROUP: &str = "group.ingress.k8s.aws/";
/// On a TargetGroupBinding.
pub(crate) const FINALIZER_TARGET_GROUP_BINDING: &str = "elbv2.k8s.aws/resources";
/// csi-provisioner's on a PersistentVolume it will delete.
pub(crate) const FINALIZER_PROVISIONER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// csi-attacher's on a VolumeAttachment of the EBS driver.
pub(crate) const FINALIZER_EBS_ATTACHER: &str = "external-attacher/ebs-csi-aws-com";

/// An object held by a cleaner's finalizer.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub(crate) struct Held {
    /// `Service`, `Ingress`, `TargetGroupBinding`, `PersistentVolume`, `VolumeAttachment`.
    pub(crate) kind: &'static str,
    /// `namespace/name`, or the name of a cluster-scoped object.
    pub(crate) name: String,
    /// The finalizer.
    pub(crate) finalizer: String,
    /// Who removes it.
    pub(crate) cleaner: Cleaner,
}

/// Which cleaner a finalizer of an object of `kind` belongs to. `csi_driver` is a
/// PersistentVolume's `spec.csi.driver`; `reclaim` its reclaim policy (only `Delete` makes
/// the driver delete a volume in AWS).
pub(crate) fn cleaner_of(
    kind: &str,
    finalizer: &str,
    csi_driver: Option<&str>,
    reclaim: Option<&str>,
) -> Option<Cleaner> {
    match (kind, finalizer) {
        ("Service", FINALIZER_SERVICE) => Some(Cleaner::LoadBalancerController),
        ("Ingress", f) if f == FINALIZER_INGRESS || f.starts_with(FINALIZER_INGRESS_GROUP) => {
            Some(Cleaner::LoadBalancerController)
        }
        ("TargetGroupBinding", FINALIZER_TARGET_GROUP_BINDING) => Some(Cleaner::LoadBalancerController),
        ("PersistentVolume", FINALIZER_PROVISIONER) if reclaim == Some("Delete") => match csi_driver {
            Some("ebs.csi.aws.com") => Some(Cleaner::EbsCsi),
            Some("efs.csi.aws.com") => Some(Cleaner::EfsCsi),
            _ => None,
        },
        ("VolumeAttachment", FINALIZER_EBS_ATTACHER) => Some(Cleaner::EbsCsi),
        _ => None,
    }
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
    /// The objects it holds.
    pub(crate) held: Vec<Held>,
}

impl Verdict {
    /// The plan's line for it.
    pub(crate) fn plan_line(&self) -> String {
        let runs = if self.runs.is_empty() { "no running pod found".to_string() } else { self.runs.join(", ") };
        let fate = if self.stranded {
            "the drain would strand it"
        } else if self.runs.is_empty() {
            "already not running: its objects are stuck whatever this run does"
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

    /// One blocker reason per held object, for a stranded cleaner.
    pub(crate) fn blockers(&self) -> Vec<(String, String)> {
        if !self.stranded {
            return Vec::new();
        }
        self.held
            .iter()
            .map(|h| {
                (
                    format!("{}/{}", h.kind, h.name),
                    format!(
                        "{} {} is held by finalizer {} until {} has deleted its {} in AWS; {} runs only on Karpenter nodes ({}), so the drain would leave it nowhere to run and the object could never be deleted (removing the finalizer by hand leaks the AWS objects)",
                        h.kind,
                        h.name,
                        h.finalizer,
                        self.cleaner,
                        self.cleaner.cleans(),
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
        // stranded: it runs, every pod of it is on a node the run drains, and none of them
        // fits any node the run keeps
        let stranded = !pods.is_empty()
            && pods.iter().all(|p| node_of(p).is_some_and(|n| karpenter_nodes.contains(&n)))
            && !pods.iter().any(|p| other_nodes.iter().any(|n| fits(p, n)));
        out.push(Verdict { cleaner, runs, stranded, held: mine });
    }
    out
}

/// Whether `pod` could be scheduled on `node` by what the node itself says: schedulable, its
/// `NoSchedule`/`NoExecute` taints tolerated, the pod's node selector and required node
/// affinity matched by the node's labels. (Resources are not weighed: a node that fits by
/// these rules but is full is counted as a place to run, which errs toward running.)
pub(crate) fn fits(pod: &Pod, node: &Node) -> bool {
    let Some(spec) = pod.spec.as_ref() else { return false };
    let node_spec = node.spec.clone().unwrap_or_default();
    if node_spec.unschedulable == Some(true) {
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
    use serde_json::json;

    use super::*;

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
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec})).unwrap()
    }

    fn held(kind: &'static str, name: &str, finalizer: &str, cleaner: Cleaner) -> Held {
        Held { kind, name: name.into(), finalizer: finalizer.into(), cleaner }
    }

    #[test]
    fn finalizers_name_their_cleaner_and_only_volumes_it_deletes_count() {
        assert_eq!(cleaner_of("Service", FINALIZER_SERVICE, None, None), Some(Cleaner::LoadBalancerController));
        assert_eq!(
            cleaner_of("Ingress", "group.ingress.k8s.aws/shared", None, None),
            Some(Cleaner::LoadBalancerController)
        );
        assert_eq!(
            cleaner_of("Service", "service.kubernetes.io/load-balancer-cleanup", None, None),
            None,
            "the in-tree controller runs in EKS's control plane"
        );
        assert_eq!(
            cleaner_of("PersistentVolume", FINALIZER_PROVISIONER, Some("ebs.csi.aws.com"), Some("Delete")),
            Some(Cleaner::EbsCsi)
        );
        assert_eq!(
            cleaner_of("PersistentVolume", FINALIZER_PROVISIONER, Some("ebs.csi.aws.com"), Some("Retain")),
            None
        );
        assert_eq!(cleaner_of("VolumeAttachment", FINALIZER_EBS_ATTACHER, None, None), Some(Cleaner::EbsCsi));
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
        let v = survey(&objects, &on_karpenter(json!({})), &karpenter, std::slice::from_ref(&system));
        assert_eq!(v.len(), 1);
        assert!(!v[0].stranded, "{v:?}");
        // it requires Karpenter capacity: stranded, one blocker per object
        let only = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}}}});
        let v = survey(&objects, &on_karpenter(only), &karpenter, std::slice::from_ref(&system));
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
        assert!(survey(&objects, &on_karpenter(json!({})), &karpenter, std::slice::from_ref(&tainted))[0].stranded);
        let tolerant = json!({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}]});
        assert!(!survey(&objects, &on_karpenter(tolerant), &karpenter, std::slice::from_ref(&tainted))[0].stranded);
        // no other node at all
        assert!(survey(&objects, &on_karpenter(json!({})), &karpenter, &[])[0].stranded);
        // one replica on the system node: it keeps running
        let split = BTreeMap::from([(
            Cleaner::LoadBalancerController,
            Running { pods: vec![pod("lbc-0", "k1", json!({})), pod("lbc-1", "system-0", json!({}))] },
        )]);
        assert!(!survey(&objects, &split, &karpenter, &[])[0].stranded);
        // not running at all: its objects are stuck already; the drain changes nothing
        let none = survey(&objects, &BTreeMap::new(), &karpenter, &[]);
        assert!(!none[0].stranded && none[0].plan_line().contains("already not running"), "{none:?}");
        // a cleaner with nothing in its care is not reported
        assert!(survey(&[], &on_karpenter(json!({})), &karpenter, &[]).is_empty());
    }

    #[test]
    fn node_selectors_and_affinity_match_as_the_scheduler_reads_them() {
        let n = node("n", json!({"zone": "a", "size": "4"}), json!({}));
        assert!(fits(&pod("p", "x", json!({"nodeSelector": {"zone": "a"}})), &n));
        assert!(!fits(&pod("p", "x", json!({"nodeSelector": {"zone": "b"}})), &n));
        let expr = |op: &str, values: serde_json::Value| {
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "size", "operator": op, "values": values}]}]}}}})
        };
        assert!(fits(&pod("p", "x", expr("Gt", json!(["2"]))), &n));
        assert!(!fits(&pod("p", "x", expr("Lt", json!(["2"]))), &n));
        assert!(fits(&pod("p", "x", expr("NotIn", json!(["8"]))), &n));
        assert!(!fits(&pod("p", "x", json!({})), &node("c", json!({}), json!({"unschedulable": true}))));
    }
}
