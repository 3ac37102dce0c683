//! Pods: which ones a drain must move, in Karpenter's order, and eviction through the policy/v1
//! Eviction API with a UID precondition (never `Api::evict`, whose options are lost, design §5).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Pod, Toleration};
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::api::{Api, DeleteParams, PostParams};

use super::{KubeError, status_code};
use crate::karpenter;
use crate::scheduling::tolerates;

/// Pod priority classes Karpenter evicts last.
const CRITICAL_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];

/// A pod's labels, held compactly: the sorted pairs in one slice. The index holds every drainable
/// pod's labels (100,000 at 5,000 nodes) and a StatefulSet's pods share no set (each carries its
/// own name and index), while a `BTreeMap` allocates a whole B-tree leaf (about 540 bytes) for
/// even one pair.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Labels(Box<[(Box<str>, Box<str>)]>);

impl Labels {
    /// The value of label `key`, if the pod carries it.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        let i = self.0.binary_search_by(|(k, _)| (**k).cmp(key)).ok()?;
        Some(&self.0[i].1)
    }
}

impl From<&BTreeMap<String, String>> for Labels {
    fn from(m: &BTreeMap<String, String>) -> Labels {
        // a BTreeMap iterates in key order: the slice is sorted for `get`'s binary search
        Labels(m.iter().map(|(k, v)| (k.as_str().into(), v.as_str().into())).collect())
    }
}

/// Label lookup, for matching a selector against either a pod read whole or a [`PodRef`].
pub trait LabelLookup {
    /// The value of label `key`, if present.
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelLookup for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key)
    }
}

impl LabelLookup for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// A pod a drain tracks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID, for the eviction precondition.
    pub uid: String,
    /// Evicted after the non-critical ones.
    pub critical: bool,
    /// Already being deleted.
    pub terminating: bool,
    /// Grace period the pod asks for.
    pub grace_seconds: Option<i64>,
    /// The fence taint the pod tolerates, when it does: such a pod is not evicted but goes with
    /// its node (see [`tolerated_fence`]).
    pub rides_with_node: Option<&'static str>,
    /// Its labels, to find the PodDisruptionBudget that selects it. Shared: the pods of one
    /// ReplicaSet carry the same labels, and the index holds one copy of them (see
    /// [`crate::engine::podindex`]).
    pub labels: Arc<Labels>,
    /// Its `Ready` condition is true: it counts as healthy for its budget.
    pub ready: bool,
}

impl PodRef {
    /// The grace period its eviction gives it, in seconds: a pod that names none gets the
    /// Kubernetes default, 30 s.
    pub(crate) fn grace(&self) -> i64 {
        self.grace_seconds.unwrap_or(30)
    }

    /// `namespace/name`.
    pub(crate) fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The pods a drain must move off a node: everything but DaemonSet and mirror pods (which a
/// drain leaves, like kubectl and Karpenter do). `None` for pods that stay.
pub fn drainable(pod: &Pod) -> Option<PodRef> {
    let meta = &pod.metadata;
    let daemonset = meta.owner_references.as_ref().is_some_and(|os| os.iter().any(|o| o.kind == "DaemonSet"));
    let mirror = meta.annotations.as_ref().is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
    if daemonset || mirror {
        return None;
    }
    let spec = pod.spec.as_ref();
    let critical = spec.and_then(|s| s.priority_class_name.as_deref()).is_some_and(|c| CRITICAL_CLASSES.contains(&c))
        || spec.and_then(|s| s.priority).is_some_and(|p| p >= 2_000_000_000);
    Some(PodRef {
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        critical,
        terminating: meta.deletion_timestamp.is_some(),
        grace_seconds: spec.and_then(|s| s.termination_grace_period_seconds),
        rides_with_node: tolerated_fence(spec.and_then(|s| s.tolerations.as_deref()).unwrap_or_default()),
        labels: Arc::new(meta.labels.as_ref().map(Labels::from).unwrap_or_default()),
        ready: pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
    })
}

/// The taint of a cordoned node, which kube-scheduler's NodeUnschedulable plugin checks tolerations
/// against.
pub(crate) const TAINT_UNSCHEDULABLE: &str = "node.kubernetes.io/unschedulable";

/// Which fence a pod's tolerations let it through, if any: the cordon
/// (`node.kubernetes.io/unschedulable:NoSchedule`) or Karpenter's disrupted taint
/// (`karpenter.sh/disrupted:NoSchedule`), as `key:NoSchedule`.
///
/// Such a pod is not evicted; it goes with its node. Evicting it is futile: the scheduler puts its
/// replacement back on a cordoned node (every other node of its pool is cordoned too), and the
/// drain chases it from node to node until the deadline. Karpenter's own drain leaves exactly
/// these pods (`ToleratesDisruptedNoScheduleTaint` in `pkg/utils/pod/scheduling.go`), so the
/// tool does what Karpenter would do, for the cordon it uses instead of Karpenter's taint.
pub(crate) fn tolerated_fence(tolerations: &[Toleration]) -> Option<&'static str> {
    const FENCES: [(&str, &str); 2] = [
        (TAINT_UNSCHEDULABLE, "node.kubernetes.io/unschedulable:NoSchedule"),
        (karpenter::TAINT_DISRUPTED, "karpenter.sh/disrupted:NoSchedule"),
    ];
    FENCES.iter().find(|(key, _)| tolerations.iter().any(|t| tolerates(t, key, "NoSchedule", ""))).map(|(_, f)| *f)
}

/// The order a drain evicts in: Karpenter's waves (non-critical pods first, critical ones once
/// those are gone), and within the wave the longest termination grace period first. A node is
/// empty only when its slowest pod has finished, so starting that pod's clock first makes the
/// node's drain as long as its longest grace period plus one eviction, not plus all of them.
pub(crate) fn eviction_wave(left: &[Arc<PodRef>]) -> Vec<&Arc<PodRef>> {
    let non_critical = left.iter().any(|p| !p.critical);
    let mut wave: Vec<&Arc<PodRef>> = left.iter().filter(|p| !non_critical || !p.critical).collect();
    wave.sort_by_key(|p| std::cmp::Reverse(p.grace()));
    wave
}

/// What an eviction attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictionOutcome {
    /// Accepted: the pod is being deleted with its grace period.
    Evicted,
    /// The pod (with this UID) is already gone.
    Gone,
    /// A PodDisruptionBudget does not allow it now (429 whose causes name `DisruptionBudget`);
    /// the server's message and causes name the budget.
    Blocked(String),
    /// More than one PodDisruptionBudget selects the pod: the Eviction API refuses such a pod
    /// (HTTP 500) until all but one are removed.
    MultipleBudgets(String),
    /// The API server is throttling (API Priority and Fairness's 429): ask again after this long.
    Throttled(std::time::Duration),
}

/// kube-apiserver's message for a pod that more than one PodDisruptionBudget selects.
const MULTIPLE_PDBS: &str = "more than one PodDisruptionBudget";

/// The eviction API's refusal of a pod that two PodDisruptionBudgets select (HTTP 500).
pub(crate) fn is_multiple_budgets(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 500 && s.message.contains(MULTIPLE_PDBS))
}

/// Evicts one pod with a UID precondition, so a replacement with the same name is never hit.
pub async fn evict(client: &kube::Client, pod: &PodRef) -> Result<EvictionOutcome, KubeError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let eviction = Eviction {
        metadata: ObjectMeta {
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            ..Default::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: Some(Preconditions { uid: Some(pod.uid.clone()), resource_version: None }),
            ..Default::default()
        }),
    };
    match api
        .create_subresource::<Eviction, serde_json::Value>("eviction", &pod.name, &PostParams::default(), &eviction)
        .await
    {
        Ok(_) => Ok(EvictionOutcome::Evicted),
        Err(e) => match (status_code(&e), &e) {
            (Some(404), _) => Ok(EvictionOutcome::Gone),
            // the UID precondition failed: the pod we meant is gone, a new one has its name
            (Some(409), _) => Ok(EvictionOutcome::Gone),
            (Some(429), kube::Error::Api(s)) if super::apf::is_disruption_budget_refusal(&e) => {
                let causes: Vec<&str> = s
                    .details
                    .iter()
                    .flat_map(|d| &d.causes)
                    .filter(|c| !c.message.is_empty())
                    .map(|c| c.message.as_str())
                    .collect();
                let detail = if causes.is_empty() {
                    s.message.clone()
                } else {
                    format!("{} ({})", s.message, causes.join("; "))
                };
                Ok(EvictionOutcome::Blocked(detail))
            }
            (Some(429), _) => {
                Ok(EvictionOutcome::Throttled(super::apf::retry_after(&e).unwrap_or(std::time::Duration::from_secs(1))))
            }
            (Some(500), kube::Error::Api(s)) if s.message.contains(MULTIPLE_PDBS) => {
                Ok(EvictionOutcome::MultipleBudgets(s.message.clone()))
            }
            _ => Err(KubeError::api(format!("evict pod {}", pod.key()), e)),
        },
    }
}

/// Deletes a pod with its own grace period and a UID precondition (policy `delete` at the drain
/// deadline: the user's explicit consent to bypass PodDisruptionBudgets).
pub(crate) async fn delete_pod(client: &kube::Client, pod: &PodRef) -> Result<(), KubeError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let dp = DeleteParams {
        preconditions: Some(kube::api::Preconditions { uid: Some(pod.uid.clone()), resource_version: None }),
        ..DeleteParams::default()
    };
    match api.delete(&pod.name, &dp).await {
        Ok(_) => Ok(()),
        Err(e) if matches!(status_code(&e), Some(404 | 409)) => Ok(()),
        Err(e) => Err(KubeError::api(format!("delete pod {}", pod.key()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, critical: bool, grace: Option<i64>) -> PodRef {
        PodRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: name.into(),
            critical,
            terminating: false,
            grace_seconds: grace,
            rides_with_node: None,
            labels: Default::default(),
            ready: true,
        }
    }

    fn toleration(key: Option<&str>, operator: Option<&str>, effect: Option<&str>) -> Toleration {
        Toleration {
            key: key.map(str::to_string),
            operator: operator.map(str::to_string),
            effect: effect.map(str::to_string),
            ..Toleration::default()
        }
    }

    #[test]
    fn pods_that_tolerate_the_fence_are_recognised_with_kubernetes_matching() {
        let everything = [toleration(None, Some("Exists"), None)];
        assert_eq!(tolerated_fence(&everything), Some("node.kubernetes.io/unschedulable:NoSchedule"));
        let disrupted = [toleration(Some("karpenter.sh/disrupted"), Some("Exists"), Some("NoSchedule"))];
        assert_eq!(tolerated_fence(&disrupted), Some("karpenter.sh/disrupted:NoSchedule"));
        let cordon = [toleration(Some(TAINT_UNSCHEDULABLE), None, None)];
        assert!(tolerated_fence(&cordon).is_some(), "Equal with the empty value matches the valueless taint");
        for other in [
            vec![toleration(Some("dedicated"), Some("Exists"), None)],
            vec![toleration(None, Some("Exists"), Some("NoExecute"))],
            vec![toleration(None, None, None)],
            vec![Toleration { value: Some("x".into()), ..toleration(Some(TAINT_UNSCHEDULABLE), None, None) }],
            Vec::new(),
        ] {
            assert_eq!(tolerated_fence(&other), None, "{other:?}");
        }
    }

    fn names<'a>(wave: &[&'a Arc<PodRef>]) -> Vec<&'a str> {
        wave.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn the_longest_grace_period_is_evicted_first_and_the_default_is_30s() {
        let left =
            [pod("short", false, Some(10)), pod("default", false, None), pod("long", false, Some(120))].map(Arc::new);
        assert_eq!(names(&eviction_wave(&left)), ["long", "default", "short"]);
    }

    #[test]
    fn critical_pods_wait_until_the_others_are_gone_whatever_their_grace() {
        let left = [pod("dns", true, Some(600)), pod("app", false, Some(5))].map(Arc::new);
        assert_eq!(names(&eviction_wave(&left)), ["app"]);
        let only_critical = [pod("dns", true, Some(30)), pod("proxy", true, Some(60))].map(Arc::new);
        assert_eq!(names(&eviction_wave(&only_critical)), ["proxy", "dns"]);
    }
}
