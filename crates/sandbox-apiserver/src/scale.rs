//! The scale subresource (autoscaling/v1 Scale) and pod binding.

use serde_json::{Value, json};

use super::kinds::ResourceInfo;
use super::select::LabelSelector;
use super::status::ApiError;
use super::store::{GroupResource, ObjectKey, Store, WriteOptions};
use super::table::json_path;

fn set_path(obj: &mut Value, path: &str, v: Value) {
    let segs: Vec<&str> = path.trim_start_matches('.').split('.').collect();
    let mut cur = obj;
    for s in &segs[..segs.len().saturating_sub(1)] {
        if !cur[*s].is_object() {
            cur[*s] = json!({});
        }
        cur = &mut cur[*s];
    }
    if let Some(last) = segs.last() {
        cur[*last] = v;
    }
}

fn to_scale(info: &ResourceInfo, o: &Value) -> Result<Value, ApiError> {
    let paths = info.scale.as_ref().ok_or_else(|| ApiError::no_route(&format!("{}/scale", info.resource)))?;
    let spec = json_path(o, &paths.spec_replicas).and_then(Value::as_i64);
    let spec = spec.unwrap_or(if info.builtin { 1 } else { 0 });
    let status = json_path(o, &paths.status_replicas).and_then(Value::as_i64).unwrap_or(0);
    let selector = match &paths.label_selector {
        Some(p) => json_path(o, p).and_then(Value::as_str).unwrap_or_default().to_string(),
        None => LabelSelector::from_object(&o["spec"]["selector"]).map(|s| s.render()).unwrap_or_default(),
    };
    let m = &o["metadata"];
    Ok(json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m["uid"],
            "resourceVersion": m["resourceVersion"], "creationTimestamp": m["creationTimestamp"]},
        "spec": {"replicas": spec},
        "status": {"replicas": status, "selector": selector},
    }))
}

/// GET .../scale.
pub(crate) fn get(store: &Store, info: &ResourceInfo, ns: &str, name: &str) -> Result<Value, ApiError> {
    let gr = GroupResource::new(&info.group, &info.resource);
    to_scale(info, &store.get(&gr, ns, name)?)
}

/// PUT .../scale (PATCH is applied to the Scale first).
pub(crate) fn update(
    store: &Store,
    info: &ResourceInfo,
    ns: &str,
    name: &str,
    scale: &Value,
    opts: &WriteOptions,
) -> Result<Value, ApiError> {
    let gr = GroupResource::new(&info.group, &info.resource);
    let replicas = scale["spec"]["replicas"].as_i64().ok_or_else(|| {
        ApiError::invalid("autoscaling", "Scale", name, "spec.replicas", "FieldValueRequired", "Required value")
    })?;
    if replicas < 0 {
        return Err(ApiError::invalid(
            "autoscaling",
            "Scale",
            name,
            "spec.replicas",
            "FieldValueInvalid",
            &format!("Invalid value: {replicas}: must be greater than or equal to 0"),
        ));
    }
    store.with(|inner| {
        let cur = inner.find(&gr, ns, name).ok_or_else(|| ApiError::not_found(&gr.group, &gr.resource, name))?;
        if let Some(rv) = scale["metadata"]["resourceVersion"].as_str()
            && !rv.is_empty()
            && cur["metadata"]["resourceVersion"].as_str() != Some(rv)
        {
            return Err(ApiError::stale(&gr.group, &gr.resource, name));
        }
        let paths = info.scale.as_ref().ok_or_else(|| ApiError::no_route("scale"))?;
        let mut o = (*cur).clone();
        set_path(&mut o, &paths.spec_replicas, json!(replicas));
        if o != *cur && opts.dry_run {
            return to_scale(info, &o);
        }
        if o != *cur {
            let g = o["metadata"]["generation"].as_i64().unwrap_or(1);
            o["metadata"]["generation"] = json!(g + 1);
            let key = ObjectKey {
                gr: gr.clone(),
                namespace: if info.namespaced { ns.into() } else { "".into() },
                name: name.into(),
            };
            let out = inner.put(&key, o, &opts.field_manager, "scale");
            return to_scale(info, &out);
        }
        to_scale(info, &cur)
    })
}

/// POST pods/NAME/binding: assigns the pod to a node once.
pub(crate) fn bind(store: &Store, ns: &str, name: &str, binding: &Value, manager: &str) -> Result<Value, ApiError> {
    let node = binding["target"]["name"].as_str().unwrap_or_default().to_string();
    if node.is_empty() {
        return Err(ApiError::invalid("", "Binding", name, "target.name", "FieldValueRequired", "Required value"));
    }
    let gr = GroupResource::new("", "pods");
    store.with(|inner| {
        let cur = inner.find(&gr, ns, name).ok_or_else(|| ApiError::not_found("", "pods", name))?;
        if !cur["metadata"]["deletionTimestamp"].is_null() {
            return Err(ApiError::conflict("", "pods", name, "pod is being deleted, cannot be assigned to a host"));
        }
        if let Some(existing) = cur["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
            return Err(ApiError::conflict(
                "",
                "pods",
                name,
                &format!("pod {name} is already assigned to node \"{existing}\""),
            ));
        }
        let mut o = (*cur).clone();
        o["spec"]["nodeName"] = json!(node);
        let conds = o["status"]["conditions"].as_array().cloned().unwrap_or_default();
        let mut conds: Vec<Value> = conds.into_iter().filter(|c| c["type"] != "PodScheduled").collect();
        conds
            .push(json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": super::store::now_rfc3339()}));
        o["status"]["conditions"] = json!(conds);
        let key = ObjectKey { gr: gr.clone(), namespace: ns.into(), name: name.into() };
        inner.put(&key, o, manager, "binding");
        Ok(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}))
    })
}
