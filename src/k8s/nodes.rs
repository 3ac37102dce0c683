//! Node writes: cordon and the `karpenter.sh/disrupted:NoSchedule` taint, conflict-safely.
//!
//! Taints are an atomic list (design §1.5): a whole-list write from a stale read erases taints
//! another controller added meanwhile. Every write here is a JSON patch that appends and carries a
//! `test` of the resourceVersion it was computed from, so it applies to exactly the list it saw.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch};
use serde_json::{Value, json};

use super::objects::{last_manager_in, patch_params};
use super::{KubeError, status_code};
use crate::karpenter;

/// What fencing a node found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CordonOutcome {
    /// The node is gone: nothing to do.
    pub gone: bool,
    /// We wrote (the node was schedulable or untainted).
    pub wrote: bool,
    /// Someone had uncordoned it after we cordoned it before: their field manager.
    pub reverted_by: Option<String>,
}

/// True if the node carries our taint.
pub fn has_disrupted_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == karpenter::TAINT_DISRUPTED && t.effect == "NoSchedule"))
}

/// True if the node is cordoned.
pub fn is_cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false)
}

/// Cordons the node and adds the disrupted taint if either is missing. `seen_cordoned` says the
/// tool cordoned it earlier in this run: finding it schedulable again means something reverted
/// the cordon, and the field manager that did it is returned (design §1.6).
pub async fn cordon_and_taint(api: &Api<Node>, name: &str, seen_cordoned: bool) -> Result<CordonOutcome, KubeError> {
    for _ in 0..8 {
        let node = match api.get_opt(name).await {
            Ok(Some(n)) => n,
            Ok(None) => return Ok(CordonOutcome { gone: true, wrote: false, reverted_by: None }),
            Err(e) => return Err(KubeError::api(format!("read node {name}"), e)),
        };
        let cordoned = is_cordoned(&node);
        let tainted = has_disrupted_taint(&node);
        if cordoned && tainted {
            return Ok(CordonOutcome { gone: false, wrote: false, reverted_by: None });
        }
        let reverted_by = if seen_cordoned && !cordoned {
            let managed = serde_json::to_value(&node.metadata.managed_fields).unwrap_or(Value::Null);
            Some(last_manager_in(&managed, &["spec", "unschedulable"]).unwrap_or_else(|| "unknown".into()))
        } else {
            None
        };
        let rv = node.metadata.resource_version.clone().unwrap_or_default();
        let mut ops = vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv})];
        if !cordoned {
            ops.push(json!({"op": "add", "path": "/spec/unschedulable", "value": true}));
        }
        if !tainted {
            let taint = json!({"key": karpenter::TAINT_DISRUPTED, "effect": "NoSchedule"});
            let has_list = node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some();
            if has_list {
                ops.push(json!({"op": "add", "path": "/spec/taints/-", "value": taint}));
            } else {
                ops.push(json!({"op": "add", "path": "/spec/taints", "value": [taint]}));
            }
        }
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
