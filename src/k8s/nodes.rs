//! Node writes: the fence of a node being drained, conflict-safely.
//!
//! The fence is the cordon (`spec.unschedulable`) and the tool's own taint,
//! [`TAINT_DRAINING`]`:NoSchedule`. The cordon alone does not hold: K3s agents and node
//! remediation controllers uncordon nodes, and a pod the scheduler binds meanwhile would go with
//! its node undrained. A taint holds against them, but not Karpenter's own: while Karpenter runs,
//! its disruption controller removes `karpenter.sh/disrupted:NoSchedule` from every node of its own
//! that is neither in its orchestration queue nor being deleted (`RequireNoScheduleTaint(..., false,
//! ...)` at the start of every pass, `pkg/controllers/disruption/controller.go` in
//! kubernetes-sigs/karpenter), so a tool that added it would fight a write war on every node;
//! Karpenter puts it back itself only on nodes it deletes (`pkg/controllers/node/termination/
//! controller.go`), which the tool's nodes are not until their instance is gone. That clean-up
//! matches that one taint by key and effect and no other (`pkg/controllers/state/statenode.go`), so
//! a taint of the tool's own key is left alone by Karpenter, alive or gone. Like every NoSchedule
//! taint, it keeps new pods off and evicts nothing already running (DaemonSet pods keep running:
//! the DaemonSet controller stops only pods that do not tolerate a NoExecute taint).
//!
//! Taints are an atomic list (design §1.5): a whole-list write from a stale read erases taints
//! another controller added meanwhile. The fence appends to the list with a JSON patch that
//! carries a `test` of the resourceVersion it was computed from, and never rewrites it.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch};
use serde_json::{Value, json};

use super::objects::{last_manager_in, patch_params};
use super::{KubeError, status_code};

/// The tool's own taint on the nodes it drains, with effect `NoSchedule`.
pub const TAINT_DRAINING: &str = "karpenter-teardown.io/draining";

/// The field manager named for a lift of the fence that the server kept no record of: an uncordon
/// or a stripped taint removes the field, and the server records no manager for a field that is
/// not there, so who lifted it cannot be read from `managedFields`.
pub const LIFTER_NOT_RECORDED: &str = "(not recorded)";

/// What cordoning a node found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CordonOutcome {
    /// The node is gone: nothing to do.
    pub gone: bool,
    /// We wrote (the node was not fenced).
    pub wrote: bool,
    /// Someone had lifted the fence after we set it before: their field manager.
    pub reverted_by: Option<String>,
}

/// True if the node is cordoned.
pub(crate) fn is_cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false)
}

/// True if the node carries the tool's [`TAINT_DRAINING`]`:NoSchedule`.
pub(crate) fn has_draining_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == TAINT_DRAINING && t.effect == "NoSchedule"))
}

/// True if the node is fenced: cordoned and carrying the tool's taint.
pub(crate) fn is_fenced(node: &Node) -> bool {
    is_cordoned(node) && has_draining_taint(node)
}

/// The JSON patch operations that fence `node` (after the resourceVersion `test`): none when it is
/// fenced already. The taint is appended, so that a taint someone added since the read is either
/// kept or fails the `test`.
pub(crate) fn fence_ops(node: &Node) -> Vec<Value> {
    let mut ops = Vec::new();
    if !is_cordoned(node) {
        ops.push(json!({"op": "add", "path": "/spec/unschedulable", "value": true}));
    }
    if !has_draining_taint(node) {
        let taint = json!({"key": TAINT_DRAINING, "effect": "NoSchedule"});
        if node.spec.as_ref().is_some_and(|s| s.taints.is_some()) {
            ops.push(json!({"op": "add", "path": "/spec/taints/-", "value": taint}));
        } else {
            ops.push(json!({"op": "add", "path": "/spec/taints", "value": [taint]}));
        }
    }
    ops
}

/// Fences the node (cordon and taint) unless it is fenced. `seen_cordoned` says the tool fenced
/// it earlier in this run: finding the fence lifted means something reverted it, and the field
/// manager that did it is returned (design §1.6).
pub async fn cordon_node(api: &Api<Node>, name: &str, seen_cordoned: bool) -> Result<CordonOutcome, KubeError> {
    cordon_read_node(api, name, seen_cordoned, None).await
}

/// [`cordon_node`], starting from `read` (the node as the caller has just read it) instead of a
/// read of its own; a write still carries that read's resourceVersion, so it is as safe.
pub async fn cordon_read_node(
    api: &Api<Node>,
    name: &str,
    seen_cordoned: bool,
    mut read: Option<Node>,
) -> Result<CordonOutcome, KubeError> {
    for _ in 0..8 {
        let node = match read.take() {
            Some(n) => n,
            None => match api.get_opt(name).await {
                Ok(Some(n)) => n,
                Ok(None) => return Ok(CordonOutcome { gone: true, wrote: false, reverted_by: None }),
                Err(e) => return Err(KubeError::api(format!("read node {name}"), e)),
            },
        };
        let fence = fence_ops(&node);
        if fence.is_empty() {
            return Ok(CordonOutcome { gone: false, wrote: false, reverted_by: None });
        }
        let reverted_by = if seen_cordoned {
            let managed = serde_json::to_value(&node.metadata.managed_fields).unwrap_or(Value::Null);
            let field = if is_cordoned(&node) { "taints" } else { "unschedulable" };
            Some(last_manager_in(&managed, &["spec", field]).unwrap_or_else(|| LIFTER_NOT_RECORDED.into()))
        } else {
            None
        };
        let rv = node.metadata.resource_version.clone().unwrap_or_default();
        let mut ops = vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv})];
        ops.extend(fence);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(spec: Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n"}, "spec": spec})).unwrap()
    }

    #[test]
    fn the_fence_adds_what_is_missing_and_keeps_every_other_taint() {
        let bare = node(json!({}));
        assert_eq!(
            fence_ops(&bare),
            [
                json!({"op": "add", "path": "/spec/unschedulable", "value": true}),
                json!({"op": "add", "path": "/spec/taints", "value": [{"key": TAINT_DRAINING, "effect": "NoSchedule"}]}),
            ]
        );
        // an uncordoned node whose taints someone else owns: the taint is appended, never the list written
        let uncordoned = node(json!({"unschedulable": false, "taints": [{"key": "gpu", "effect": "NoSchedule"},
            {"key": TAINT_DRAINING, "effect": "NoSchedule"}]}));
        assert_eq!(fence_ops(&uncordoned), [json!({"op": "add", "path": "/spec/unschedulable", "value": true})]);
        assert!(!is_fenced(&uncordoned));
        let untainted = node(json!({"unschedulable": true, "taints": [{"key": "gpu", "effect": "NoSchedule"}]}));
        assert_eq!(
            fence_ops(&untainted),
            [json!({"op": "add", "path": "/spec/taints/-", "value": {"key": TAINT_DRAINING, "effect": "NoSchedule"}})]
        );
        // the tool's key with another effect does not keep pods off
        let other_effect =
            node(json!({"unschedulable": true, "taints": [{"key": TAINT_DRAINING, "effect": "PreferNoSchedule"}]}));
        assert!(!is_fenced(&other_effect));
        let fenced = node(json!({"unschedulable": true, "taints": [{"key": TAINT_DRAINING, "effect": "NoSchedule"}]}));
        assert!(is_fenced(&fenced));
        assert!(fence_ops(&fenced).is_empty());
    }
}
