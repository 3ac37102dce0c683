//! Conflict-safe writes the simulated Karpenter makes, the way the real controller makes them:
//! finalizers and taints change through JSON patches guarded by `test` operations, so a stale
//! read never erases what another writer did meanwhile (design §1.5), and evictions go through
//! the policy/v1 Eviction subresource so PodDisruptionBudgets are honoured.

use std::fmt::Debug;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// The field manager of every write the simulation makes (visible in `managedFields`).
pub const FIELD_MANAGER: &str = "karpenter";

/// The HTTP code of an API error, if the error is one.
pub fn api_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// True for 404.
pub fn is_not_found(err: &kube::Error) -> bool {
    api_code(err) == Some(404)
}

/// What became of an attempt to drop one finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizerOutcome {
    /// The finalizer was removed by this call.
    Removed,
    /// The object no longer carries it (or no longer exists).
    Absent,
    /// Someone changed the list between our read and our write; read again and retry.
    Conflict,
}

fn json_patch(ops: Value) -> Result<json_patch::Patch, kube::Error> {
    serde_json::from_value(ops).map_err(kube::Error::SerdeError)
}

/// Removes `finalizer` from the named object with `test`+`remove` at its index, so a concurrent
/// change of the list (another finalizer added or removed) makes the patch fail instead of
/// removing the wrong entry.
pub async fn remove_finalizer<K>(api: &Api<K>, name: &str, finalizer: &str) -> Result<FinalizerOutcome, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let obj = match api.get_opt(name).await? {
        Some(o) => o,
        None => return Ok(FinalizerOutcome::Absent),
    };
    let Some(idx) = obj.finalizers().iter().position(|f| f == finalizer) else {
        return Ok(FinalizerOutcome::Absent);
    };
    let patch = json_patch(json!([
        {"op": "test", "path": format!("/metadata/finalizers/{idx}"), "value": finalizer},
        {"op": "remove", "path": format!("/metadata/finalizers/{idx}")},
    ]))?;
    match api.patch(name, &PatchParams::default(), &Patch::Json::<()>(patch)).await {
        Ok(_) => Ok(FinalizerOutcome::Removed),
        Err(e) if is_not_found(&e) => Ok(FinalizerOutcome::Absent),
        Err(e) if matches!(api_code(&e), Some(409 | 422)) => Ok(FinalizerOutcome::Conflict),
        Err(e) => Err(e),
    }
}

/// Adds `finalizer` to an object that lacks it, guarded by the list it read (or the
/// resourceVersion when there is none). Returns false on a conflict (retry later).
pub async fn add_finalizer<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<bool, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let current = obj.finalizers();
    if current.iter().any(|f| f == finalizer) {
        return Ok(true);
    }
    let ops = if obj.meta().finalizers.is_some() {
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": current},
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer},
        ])
    } else {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": obj.resource_version()},
            {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]},
        ])
    };
    match api.patch(&obj.name_any(), &PatchParams::default(), &Patch::Json::<()>(json_patch(ops)?)).await {
        Ok(_) => Ok(true),
        Err(e) if matches!(api_code(&e), Some(409 | 422)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Adds a taint unless the node has it, testing the exact taint list it read (fresh, as raw
/// JSON, so no client-side type round trip can make the test spuriously fail) so a taint another
/// controller added meanwhile is never lost. Returns false on a conflict (retry later); a node
/// already gone counts as done.
pub async fn ensure_taint(client: &kube::Client, node: &str, key: &str, effect: &str) -> Result<bool, kube::Error> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ApiResource::erase::<Node>(&()));
    let Some(raw) = api.get_opt(node).await? else {
        return Ok(true);
    };
    let taints = &raw.data["spec"]["taints"];
    let has = taints.as_array().is_some_and(|ts| ts.iter().any(|t| t["key"] == key && t["effect"] == effect));
    if has {
        return Ok(true);
    }
    let taint = json!({"key": key, "effect": effect, "timeAdded": super::objects::now_rfc3339()});
    let ops = if taints.is_array() {
        json!([
            {"op": "test", "path": "/spec/taints", "value": taints},
            {"op": "add", "path": "/spec/taints/-", "value": taint},
        ])
    } else {
        // No list to test against: guard the whole write with the resourceVersion instead.
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": raw.resource_version()},
            {"op": "add", "path": "/spec/taints", "value": [taint]},
        ])
    };
    match api.patch(node, &PatchParams::default(), &Patch::Json::<()>(json_patch(ops)?)).await {
        Ok(_) => Ok(true),
        Err(e) if matches!(api_code(&e), Some(409 | 422)) => Ok(false),
        Err(e) if is_not_found(&e) => Ok(true),
        Err(e) => Err(e),
    }
}

/// Removes every `key:effect` taint from the node the way Karpenter's disruption controller does
/// (`RequireNoScheduleTaint(..., false, ...)`: a merge patch of the whole list guarded by the
/// resourceVersion it read, controller-runtime's `MergeFromWithOptimisticLock`). Returns whether
/// it wrote; a conflict or a node already gone is no write (the next pass tries again).
pub async fn remove_taint(client: &kube::Client, node: &str, key: &str, effect: &str) -> Result<bool, kube::Error> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ApiResource::erase::<Node>(&()));
    let Some(raw) = api.get_opt(node).await? else {
        return Ok(false);
    };
    let Some(taints) = raw.data["spec"]["taints"].as_array() else {
        return Ok(false);
    };
    let kept: Vec<&Value> = taints.iter().filter(|t| !(t["key"] == key && t["effect"] == effect)).collect();
    if kept.len() == taints.len() {
        return Ok(false);
    }
    let patch = json!({"metadata": {"resourceVersion": raw.resource_version()}, "spec": {"taints": kept}});
    let pp = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
    match api.patch(node, &pp, &Patch::Merge(&patch)).await {
        Ok(_) => Ok(true),
        Err(e) if matches!(api_code(&e), Some(409)) || is_not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What an eviction request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictOutcome {
    /// Accepted (201): the pod is being deleted.
    Evicted,
    /// Refused with 429: a PodDisruptionBudget allows no disruption now; retry later.
    Blocked(String),
    /// The pod is gone already (404) or was replaced (409 on the uid precondition).
    Gone,
}

/// Evicts a pod through `pods/eviction` (policy/v1), with the pod's uid as precondition so a
/// replacement pod of the same name is never evicted by mistake. The typed body is posted with
/// `create_subresource` because `Api::evict` sends delete options under the wrong key (design §5).
pub async fn evict(api: &Api<Pod>, name: &str, uid: Option<&str>) -> Result<EvictOutcome, kube::Error> {
    let mut delete_options = json!({});
    if let Some(uid) = uid {
        delete_options["preconditions"] = json!({"uid": uid});
    }
    // the namespace is the API's: the path carries it, and the server takes it from there
    let body = json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name},
        "deleteOptions": delete_options,
    });
    match api.create_subresource::<Value, Value>("eviction", name, &PostParams::default(), &body).await {
        Ok(_) => Ok(EvictOutcome::Evicted),
        Err(kube::Error::Api(s)) if s.code == 429 => Ok(EvictOutcome::Blocked(s.message.clone())),
        Err(e) if matches!(api_code(&e), Some(404 | 409)) => Ok(EvictOutcome::Gone),
        Err(e) => Err(e),
    }
}

/// Deletes an object; one already gone counts as deleted.
pub async fn delete_if_present<K>(api: &Api<K>, name: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Creates an object, or returns the existing one of that name (creation is idempotent so a
/// generator can be re-run against a half-built world).
pub async fn create_or_get<K>(api: &Api<K>, obj: &K) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + serde::Serialize + Debug,
{
    match api.create(&PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() }, obj).await {
        Ok(o) => Ok(o),
        Err(e) if api_code(&e) == Some(409) => api.get(&obj.name_any()).await,
        Err(e) => Err(e),
    }
}

/// Writes `.status` through the status subresource (merge patch, which custom resources accept).
pub async fn patch_status<K>(api: &Api<K>, name: &str, status: Value) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let pp = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
    api.patch_status(name, &pp, &Patch::Merge(json!({"status": status}))).await
}
