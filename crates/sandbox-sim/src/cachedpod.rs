//! A pod as the simulated Karpenter caches it: the fields it reads and nothing else.
//!
//! kube's reflector keeps one `Arc` of every pod in the cluster, and a rehearsal's copy holds up
//! to 40,000 pods. As `k8s_openapi`'s `Pod` (every field of the spec and the status inline, most of
//! them `None`) the cache was the largest part of a rehearsal's heap after the API server's store;
//! this type deserializes only what the simulation reads.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::Deserialize;

/// The part of a pod the simulation reads: placement, owners, tolerations, priority, phase.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CachedPod {
    /// The pod's metadata (its field managers, labels and annotations other than the mirror-pod
    /// one are dropped by the cache).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What scheduling and draining read of the spec.
    pub spec: Option<CachedPodSpec>,
    /// The phase.
    pub status: Option<CachedPodStatus>,
}

/// What the simulation reads of a pod's spec.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedPodSpec {
    /// The node it is bound to.
    pub node_name: Option<String>,
    /// Labels a node must carry.
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints it tolerates.
    pub tolerations: Option<Vec<Toleration>>,
    /// Its resolved priority.
    pub priority: Option<i32>,
    /// Its priority class.
    pub priority_class_name: Option<String>,
}

/// What the simulation reads of a pod's status.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CachedPodStatus {
    /// Pending, Running, Succeeded, Failed.
    pub phase: Option<String>,
}

impl Resource for CachedPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn api_version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}
