//! Node writes: the cordon, conflict-safely.
//!
//! The tool cordons Karpenter's nodes (`spec.unschedulable`) and writes no taint. The taint
//! Karpenter itself uses, `karpenter.sh/disrupted:NoSchedule`, belongs to Karpenter's disruption
//! controller: while Karpenter runs, it removes that taint from every node of its own that it is
//! not disrupting itself (`pkg/controllers/disruption/controller.go`, every 10 s), so a tool that
//! adds it fights a write war on every node. Nothing in Karpenter undoes a cordon, and the cordon
//! keeps exactly the pods off that the taint would (both are NoSchedule; a pod tolerating either
//! is handled by the drain, see `engine::drain`).
//!
//! Taints are an atomic list (design §1.5): a whole-list write from a stale read erases taints
//! another controller added meanwhile. The cordon never writes the list, and its JSON patch
//! carries a `test` of the resourceVersion it was computed from.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch};
use serde_json::{Value, json};

use super::objects::{last_manager_in, patch_params};
use super::{KubeError, status_code};

/// What cordoning a node found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CordonOutcome {
    /// The node is gone: nothing to do.
    pub gone: bool,
    /// We wrote (the node was schedulable).
    pub wrote: bool,
    /// Someone had uncordoned it after we cordoned it before: their field manager.
    pub reverted_by: Option<String>,
}

/// True if the node is cordoned.
pub fn is_cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false)
}

/// Cordons the node if it is schedulable. `seen_cordoned` says the tool cordoned it earlier in
/// this run: finding it schedulable again means something reverted the cordon, and the field
/// manager that did it is returned (design §1.6).
pub async fn cordon_node(api: &Api<Node>, name: &str, seen_cordoned: bool) -> Result<CordonOutcome, KubeError> {
    for _ in 0..8 {
        let node = match api.get_opt(name).await {
            Ok(Some(n)) => n,
            Ok(None) => return Ok(CordonOutcome { gone: true, wrote: false, reverted_by: None }),
            Err(e) => return Err(KubeError::api(format!("read node {name}"), e)),
        };
        if is_cordoned(&node) {
            return Ok(CordonOutcome { gone: false, wrote: false, reverted_by: None });
        }
        let reverted_by = if seen_cordoned {
            let managed = serde_json::to_value(&node.metadata.managed_fields).unwrap_or(Value::Null);
            Some(last_manager_in(&managed, &["spec", "unschedulable"]).unwrap_or_else(|| "unknown".into()))
        } else {
            None
        };
        let rv = node.metadata.resource_version.clone().unwrap_or_default();
        let ops = vec![
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv}),
            json!({"op": "add", "path": "/spec/unschedulable", "value": true}),
        ];
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops))
            .map_err(|e| KubeError::api(format!("build the cordon patch for {name}"), kube::Error::SerdeError(e)))?;
        match api.patch(name, &patch_params(), &Patch::<()>::Json(patch)).await {
            Ok(_) => return Ok(CordonOutcome { gone: false, wrote: true, reverted_by }),
            Err(e) if status_code(&e) == Some(404) => {
                return Ok(CordonOutcome { gone: true, wrote: false, reverted_by: None });
            }
            // the node changed since we read it (another writer): read again, never overwrite
            Err(e) if matches!(status_code(&e), Some(409 | 422)) => continue,
            Err(e) => return Err(KubeError::api(format!("cordon node {name}"), e)),
        }
    }
    Err(KubeError::api(
        format!("cordon node {name}"),
        kube::Error::Service("the node kept changing under every attempt".into()),
    ))
}
