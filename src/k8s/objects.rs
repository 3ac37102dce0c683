//! Conflict-safe writes on any object: removing exactly one finalizer, deleting with "already
//! gone" as success, and reading which field manager last wrote a field.

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::{KubeError, status_code};

/// The field manager the tool writes as, so others can see in `managedFields` who did what.
pub const FIELD_MANAGER: &str = "karpenter-teardown";

/// Patch parameters naming our field manager.
pub fn patch_params() -> PatchParams {
    PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() }
}

/// What removing a finalizer found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizerRemoval {
    /// It was there and is gone now.
    Removed,
    /// It was not there (or the object is gone): nothing to do.
    Absent,
    /// The name now holds another object than the one read (another UID): left alone.
    Replaced,
}

/// Removes exactly `finalizer` from the object, with a JSON patch whose `test` pins the list
/// entry it removes, so a concurrent change to the list is never overwritten (422 → re-read and
/// try again). An object that is gone counts as done.
pub async fn remove_finalizer<K>(api: &Api<K>, name: &str, finalizer: &str) -> Result<FinalizerRemoval, KubeError>
where
    K: kube::Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    remove_finalizer_seen(api, name, finalizer, None, None).await
}

/// Deletes the object, then removes exactly `finalizer` from it as [`remove_finalizer`] does.
/// While finalizers hold an object, the server answers its delete with the object itself: that
/// answer is the read the removal starts from, which saves a request per object when thousands
/// of machines are released at once. The `test` in the patch keeps it as safe as a fresh read.
/// With `uid`, both the delete (a precondition) and the removal (a `test`) act only on the object
/// of that UID: a Node or NodeClaim made since under the same name is another machine's.
pub async fn delete_and_remove_finalizer<K>(
    api: &Api<K>,
    name: &str,
    finalizer: &str,
    uid: Option<&str>,
) -> Result<FinalizerRemoval, KubeError>
where
    K: kube::Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let params = DeleteParams {
        preconditions: uid.map(|u| kube::api::Preconditions { uid: Some(u.to_string()), resource_version: None }),
        ..DeleteParams::default()
    };
    let seen = match api.delete(name, &params).await {
        // the object (`None` for a Status: gone at once, or an answer a read then settles)
        Ok(answer) => answer.left(),
        Err(e) if status_code(&e) == Some(404) => return Ok(FinalizerRemoval::Absent),
        // the precondition failed: the name holds another object now
        Err(e) if uid.is_some() && status_code(&e) == Some(409) => return Ok(FinalizerRemoval::Replaced),
        Err(e) => return Err(KubeError::api(format!("delete {name}"), e)),
    };
    remove_finalizer_seen(api, name, finalizer, seen, uid).await
}

/// [`remove_finalizer`], starting from `seen` (the object as just read) instead of a read.
async fn remove_finalizer_seen<K>(
    api: &Api<K>,
    name: &str,
    finalizer: &str,
    mut seen: Option<K>,
    uid: Option<&str>,
) -> Result<FinalizerRemoval, KubeError>
where
    K: kube::Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    for _ in 0..8 {
        let obj = match seen.take() {
            Some(o) => o,
            None => match api.get_opt(name).await {
                Ok(Some(o)) => o,
                Ok(None) => return Ok(FinalizerRemoval::Absent),
                Err(e) => return Err(KubeError::api(format!("read {name}"), e)),
            },
        };
        if let Some(u) = uid
            && obj.meta().uid.as_deref() != Some(u)
        {
            return Ok(FinalizerRemoval::Replaced);
        }
        let finalizers = obj.meta().finalizers.clone().unwrap_or_default();
        let Some(idx) = finalizers.iter().position(|f| f == finalizer) else {
            return Ok(FinalizerRemoval::Absent);
        };
        let mut ops = vec![
            json!({"op": "test", "path": format!("/metadata/finalizers/{idx}"), "value": finalizer}),
            json!({"op": "remove", "path": format!("/metadata/finalizers/{idx}")}),
        ];
        if let Some(u) = uid {
            ops.insert(0, json!({"op": "test", "path": "/metadata/uid", "value": u}));
        }
        let patch = json_patch::Patch(serde_json::from_value(Value::Array(ops)).map_err(|e| {
            KubeError::api(format!("build the finalizer patch for {name}"), kube::Error::SerdeError(e))
        })?);
        match api.patch(name, &patch_params(), &Patch::<()>::Json(patch)).await {
            Ok(_) => return Ok(FinalizerRemoval::Removed),
            Err(e) if status_code(&e) == Some(404) => return Ok(FinalizerRemoval::Absent),
            // the list changed under us: read it again
            Err(e) if matches!(status_code(&e), Some(409 | 422)) => continue,
            Err(e) => return Err(KubeError::api(format!("remove finalizer {finalizer} from {name}"), e)),
        }
    }
    Err(KubeError::api(
        format!("remove finalizer {finalizer} from {name}"),
        kube::Error::Service("the finalizer list kept changing under every attempt".into()),
    ))
}

/// Deletes an object; one already gone counts as deleted. Returns whether it existed.
pub async fn delete_if_present<K>(api: &Api<K>, name: &str) -> Result<bool, KubeError>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(e) if status_code(&e) == Some(404) => Ok(false),
        Err(e) => Err(KubeError::api(format!("delete {name}"), e)),
    }
}

/// The field manager that last wrote `path` (e.g. `["spec", "unschedulable"]`), from an object's
/// raw `managedFields` array (the entry with the latest time wins).
pub fn last_manager_in(managed: &Value, path: &[&str]) -> Option<String> {
    let mut best: Option<(String, String)> = None;
    for entry in managed.as_array()? {
        let mut node = entry.get("fieldsV1")?;
        let mut found = true;
        for seg in path {
            match node.get(format!("f:{seg}")) {
                Some(n) => node = n,
                None => {
                    found = false;
                    break;
                }
            }
        }
        if !found {
            continue;
        }
        let time = entry.get("time").and_then(Value::as_str).unwrap_or("").to_string();
        let manager = entry.get("manager").and_then(Value::as_str).unwrap_or("unknown").to_string();
        if best.as_ref().is_none_or(|(t, _)| time >= *t) {
            best = Some((time, manager));
        }
    }
    best.map(|(_, m)| m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_writer_of_a_field_is_named() {
        let managed = json!([
            {"manager": "kubectl", "time": "2026-01-01T00:00:00Z", "fieldsV1": {"f:spec": {"f:unschedulable": {}}}},
            {"manager": "k3s-reverter", "time": "2026-01-01T00:01:00Z", "fieldsV1": {"f:spec": {"f:unschedulable": {}}}},
            {"manager": "kubelet", "time": "2026-01-01T00:02:00Z", "fieldsV1": {"f:status": {}}},
        ]);
        assert_eq!(last_manager_in(&managed, &["spec", "unschedulable"]).as_deref(), Some("k3s-reverter"));
        assert_eq!(last_manager_in(&managed, &["spec", "taints"]), None);
    }
}
