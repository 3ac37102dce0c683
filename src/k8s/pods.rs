//! Pods: which ones a drain must move, in Karpenter's order, and eviction through the policy/v1
//! Eviction API with a UID precondition (never `Api::evict`, whose options are lost, design §5).

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::api::{Api, DeleteParams, PostParams};

use super::{KubeError, status_code};

/// Pod priority classes Karpenter evicts last.
const CRITICAL_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];

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
}

impl PodRef {
    /// `namespace/name`.
    pub fn key(&self) -> String {
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
    })
}

/// The order a drain evicts in: Karpenter's waves (non-critical pods first, critical ones once
/// those are gone), and within the wave the longest termination grace period first. A node is
/// empty only when its slowest pod has finished, so starting that pod's clock first makes the
/// node's drain as long as its longest grace period plus one eviction, not plus all of them.
pub fn eviction_wave(left: &[PodRef]) -> Vec<&PodRef> {
    let non_critical = left.iter().any(|p| !p.critical);
    let mut wave: Vec<&PodRef> = left.iter().filter(|p| !non_critical || !p.critical).collect();
    // a pod that names no grace period gets the Kubernetes default, 30 s
    wave.sort_by_key(|p| std::cmp::Reverse(p.grace_seconds.unwrap_or(30)));
    wave
}

/// What an eviction attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictionOutcome {
    /// Accepted: the pod is being deleted with its grace period.
    Evicted,
    /// The pod (with this UID) is already gone.
    Gone,
    /// A PodDisruptionBudget does not allow it now (429); the server's message names the budget.
    Blocked(String),
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
            (Some(429), kube::Error::Api(s)) => Ok(EvictionOutcome::Blocked(s.message.clone())),
            _ => Err(KubeError::api(format!("evict pod {}", pod.key()), e)),
        },
    }
}

/// Deletes a pod with its own grace period and a UID precondition (policy `delete` at the drain
/// deadline: the user's explicit consent to bypass PodDisruptionBudgets).
pub async fn delete_pod(client: &kube::Client, pod: &PodRef) -> Result<(), KubeError> {
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
        }
    }

    fn names<'a>(wave: &[&'a PodRef]) -> Vec<&'a str> {
        wave.iter().map(|p| p.name.as_str()).collect()
    }

    #[test]
    fn the_longest_grace_period_is_evicted_first_and_the_default_is_30s() {
        let left = [pod("short", false, Some(10)), pod("default", false, None), pod("long", false, Some(120))];
        assert_eq!(names(&eviction_wave(&left)), ["long", "default", "short"]);
    }

    #[test]
    fn critical_pods_wait_until_the_others_are_gone_whatever_their_grace() {
        let left = [pod("dns", true, Some(600)), pod("app", false, Some(5))];
        assert_eq!(names(&eviction_wave(&left)), ["app"]);
        let only_critical = [pod("dns", true, Some(30)), pod("proxy", true, Some(60))];
        assert_eq!(names(&eviction_wave(&only_critical)), ["proxy", "dns"]);
    }
}
