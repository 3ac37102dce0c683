//! Patch types (JSON patch, merge patch, strategic merge patch, server-side apply) and the
//! `managedFields` bookkeeping that says which field manager last wrote which field.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use super::status::ApiError;

/// The four patch content types of kube-apiserver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    /// `application/json-patch+json` (RFC 6902).
    Json,
    /// `application/merge-patch+json` (RFC 7386).
    Merge,
    /// `application/strategic-merge-patch+json` (built-in kinds only).
    Strategic,
    /// `application/apply-patch+yaml` (server-side apply).
    Apply,
}

impl PatchType {
    /// The patch type of a `Content-Type` header.
    pub fn from_content_type(ct: &str) -> Option<Self> {
        let base = ct.split(';').next().unwrap_or_default().trim();
        match base {
            "application/json-patch+json" => Some(PatchType::Json),
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/strategic-merge-patch+json" => Some(PatchType::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Some(PatchType::Apply),
            _ => None,
        }
    }
}

/// Parses a patch body: YAML for apply, JSON otherwise.
pub fn parse_body(ty: PatchType, body: &[u8]) -> Result<Value, ApiError> {
    if ty == PatchType::Apply {
        serde_saphyr::from_slice(body).map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))
    } else {
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))
    }
}

/// Applies a JSON or merge or strategic merge patch to `doc`. Apply patches go through
/// [`apply_merge`] instead since they need ownership information.
pub fn apply_patch(ty: PatchType, doc: &Value, patch: &Value) -> Result<Value, ApiError> {
    let mut out = doc.clone();
    match ty {
        PatchType::Json => {
            let ops: json_patch::Patch =
                serde_json::from_value(patch.clone()).map_err(|e| ApiError::bad_request(e.to_string()))?;
            // json_patch::patch undoes partial work on failure; we also only commit `out`.
            // kube-apiserver answers a failed operation (a `test` that does not match, a path
            // that is not there) with a generic 422 whose message names neither
            // (`NewGenericServerResponse(422, ...)` in apiserver's endpoints/handlers/patch.go)
            json_patch::patch(&mut out, &ops).map_err(|e| {
                tracing::debug!(error = %e, "JSON patch refused");
                ApiError::unprocessable("the server rejected our request due to an error in our request")
            })?;
        }
        PatchType::Merge => json_patch::merge(&mut out, patch),
        PatchType::Strategic | PatchType::Apply => {
            if !patch.is_object() {
                return Err(ApiError::bad_request("strategic merge patch must be a JSON object"));
            }
            strategic_merge(&mut out, patch, "");
        }
    }
    Ok(out)
}

/// How a list field merges under strategic merge patch, by field name (the patch strategies of
/// the built-in types that matter here).
enum ListStrategy {
    /// Replace the whole list (no patchStrategy: taints, tolerations, args, ...).
    Atomic,
    /// Union of primitive values (finalizers).
    Set,
    /// Merge entries by a key field.
    Keyed(&'static str),
}

fn list_strategy(field: &str, parent_path: &str) -> ListStrategy {
    match field {
        "finalizers" => ListStrategy::Set,
        "containers" | "initContainers" | "ephemeralContainers" | "volumes" | "env" | "imagePullSecrets" => {
            ListStrategy::Keyed("name")
        }
        "volumeMounts" => ListStrategy::Keyed("mountPath"),
        "conditions" | "addresses" => ListStrategy::Keyed("type"),
        "ownerReferences" => ListStrategy::Keyed("uid"),
        "ports" if parent_path.ends_with("spec") => ListStrategy::Keyed("port"),
        "ports" => ListStrategy::Keyed("containerPort"),
        _ => ListStrategy::Atomic,
    }
}

/// RFC 7386 plus the strategic list semantics and the `$patch`, `$deleteFromPrimitiveList`,
/// `$setElementOrder` and `$retainKeys` directives kubectl sends.
pub fn strategic_merge(doc: &mut Value, patch: &Value, path: &str) {
    let Some(pm) = patch.as_object() else {
        *doc = patch.clone();
        return;
    };
    if pm.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut p = pm.clone();
        p.remove("$patch");
        *doc = Value::Object(p);
        return;
    }
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let Some(dm) = doc.as_object_mut() else {
        return;
    };
    if let Some(keep) = pm.get("$retainKeys").and_then(Value::as_array) {
        let keep: BTreeSet<&str> = keep.iter().filter_map(Value::as_str).collect();
        dm.retain(|k, _| keep.contains(k.as_str()));
    }
    for (k, v) in pm {
        if k.starts_with("$setElementOrder/") || k == "$retainKeys" || k == "$patch" {
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(cur)), Some(del)) = (dm.get_mut(field), v.as_array()) {
                cur.retain(|x| !del.contains(x));
            }
            continue;
        }
        let child = format!("{path}.{k}");
        if v.is_null() {
            dm.remove(k);
            continue;
        }
        if let Some(pl) = v.as_array() {
            let cur = dm.entry(k.clone()).or_insert(Value::Null);
            merge_list(cur, pl, k, path);
            continue;
        }
        if v.is_object() {
            if v.get("$patch").and_then(Value::as_str) == Some("delete") {
                dm.remove(k);
                continue;
            }
            let cur = dm.entry(k.clone()).or_insert(Value::Null);
            strategic_merge(cur, v, &child);
            continue;
        }
        dm.insert(k.clone(), v.clone());
    }
}

fn merge_list(cur: &mut Value, patch: &[Value], field: &str, parent: &str) {
    let existing = cur.as_array().cloned().unwrap_or_default();
    match list_strategy(field, parent) {
        ListStrategy::Atomic => {
            *cur = Value::Array(patch.iter().filter(|v| !is_directive(v)).cloned().collect());
        }
        ListStrategy::Set => {
            let mut out = existing;
            for v in patch {
                if !out.contains(v) {
                    out.push(v.clone());
                }
            }
            *cur = Value::Array(out);
        }
        ListStrategy::Keyed(key) => {
            if patch.iter().any(|v| v.get("$patch").and_then(Value::as_str) == Some("replace")) {
                *cur = Value::Array(patch.iter().filter(|v| !is_directive(v)).cloned().collect());
                return;
            }
            let mut out = existing;
            for pv in patch {
                let id = pv.get(key).cloned();
                let pos = id.as_ref().and_then(|id| out.iter().position(|e| e.get(key) == Some(id)));
                let delete = pv.get("$patch").and_then(Value::as_str) == Some("delete");
                match (pos, delete) {
                    (Some(i), true) => {
                        out.remove(i);
                    }
                    (None, true) => {}
                    (Some(i), false) => strategic_merge(&mut out[i], pv, field),
                    (None, false) => {
                        let mut fresh = Value::Object(Map::new());
                        strategic_merge(&mut fresh, pv, field);
                        out.push(fresh);
                    }
                }
            }
            *cur = Value::Array(out);
        }
    }
}

fn is_directive(v: &Value) -> bool {
    v.as_object().is_some_and(|m| m.len() == 1 && m.contains_key("$patch"))
}

/// A field path (`["spec", "taints"]`), as `managedFields` records it.
pub type FieldPath = Vec<String>;

/// Metadata fields the server owns; they never appear in a manager's field set.
fn server_owned(path: &[String]) -> bool {
    matches!(
        path,
        [m, f, ..] if m == "metadata" && matches!(f.as_str(),
            "resourceVersion" | "managedFields" | "generation" | "uid" | "creationTimestamp"
            | "deletionTimestamp" | "deletionGracePeriodSeconds" | "selfLink")
    ) || matches!(path, [k] if k == "apiVersion" || k == "kind")
}

/// Leaf paths whose values differ between `old` and `new` (lists are atomic leaves).
pub fn changed_paths(old: &Value, new: &Value) -> Vec<FieldPath> {
    let mut out = Vec::new();
    diff(old, new, &mut Vec::new(), &mut out);
    out.retain(|p| !server_owned(p));
    out
}

fn diff(old: &Value, new: &Value, prefix: &mut Vec<String>, out: &mut Vec<FieldPath>) {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, bv) in b {
                prefix.push(k.clone());
                match a.get(k) {
                    Some(av) => diff(av, bv, prefix, out),
                    None => leaves(bv, prefix, out),
                }
                prefix.pop();
            }
        }
        _ if old == new => {}
        _ => out.push(prefix.clone()),
    }
}

/// Every leaf path of a value (what an applied configuration sets).
pub fn leaves(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<FieldPath>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, c) in m {
                prefix.push(k.clone());
                leaves(c, prefix, out);
                prefix.pop();
            }
        }
        _ => out.push(prefix.clone()),
    }
}

fn overlaps(a: &[String], b: &[String]) -> bool {
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

fn to_fields_v1(paths: &BTreeSet<FieldPath>) -> Value {
    let mut root = Map::new();
    for p in paths {
        let mut cur = &mut root;
        for seg in p {
            let entry = cur.entry(format!("f:{seg}")).or_insert_with(|| Value::Object(Map::new()));
            if !entry.is_object() {
                *entry = Value::Object(Map::new());
            }
            let Value::Object(next) = entry else {
                break;
            };
            cur = next;
        }
    }
    Value::Object(root)
}

fn from_fields_v1(v: &Value, prefix: &mut Vec<String>, out: &mut BTreeSet<FieldPath>) {
    match v.as_object() {
        Some(m) if !m.is_empty() => {
            for (k, c) in m {
                if let Some(seg) = k.strip_prefix("f:") {
                    prefix.push(seg.to_string());
                    from_fields_v1(c, prefix, out);
                    prefix.pop();
                } else if k == "." && !prefix.is_empty() {
                    out.insert(prefix.clone());
                }
            }
        }
        _ if !prefix.is_empty() => {
            out.insert(prefix.clone());
        }
        _ => {}
    }
}

/// One `managedFields` entry, parsed.
struct Entry {
    manager: String,
    operation: String,
    subresource: String,
    api_version: String,
    time: String,
    fields: BTreeSet<FieldPath>,
}

fn parse_entries(obj: &Value) -> Vec<Entry> {
    obj["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let mut fields = BTreeSet::new();
            from_fields_v1(&e["fieldsV1"], &mut Vec::new(), &mut fields);
            Entry {
                manager: e["manager"].as_str().unwrap_or_default().into(),
                operation: e["operation"].as_str().unwrap_or("Update").into(),
                subresource: e["subresource"].as_str().unwrap_or_default().into(),
                api_version: e["apiVersion"].as_str().unwrap_or_default().into(),
                time: e["time"].as_str().unwrap_or_default().into(),
                fields,
            }
        })
        .collect()
}

/// Who owns `path` other than `manager`, for apply conflicts.
pub fn owners_of(obj: &Value, path: &[String], manager: &str) -> Vec<String> {
    parse_entries(obj)
        .into_iter()
        .filter(|e| e.manager != manager && e.fields.iter().any(|f| overlaps(f, path)))
        .map(|e| e.manager)
        .collect()
}

/// What one write did, for the managedFields record.
pub struct WriteRecord<'a> {
    /// Field manager of the write.
    pub manager: &'a str,
    /// `Update` or `Apply`.
    pub operation: &'a str,
    /// `""` or `status` / `scale`.
    pub subresource: &'a str,
    /// apiVersion the write used.
    pub api_version: &'a str,
    /// RFC 3339 time of the write.
    pub time: &'a str,
    /// For Apply: every path of the applied configuration (the manager's whole set).
    pub applied: Option<Vec<FieldPath>>,
}

/// Updates `new.metadata.managedFields`: the writer owns the paths it changed (Update) or
/// applied (Apply), other managers lose them, and fields that no longer exist are dropped.
pub fn record_managed_fields(old: Option<&Value>, new: &mut Value, w: &WriteRecord<'_>) {
    let empty = Value::Object(Map::new());
    let base = old.unwrap_or(&empty);
    let changed = changed_paths(base, new);
    let mut entries = old.map(parse_entries).unwrap_or_default();
    let mine: Vec<FieldPath> = match &w.applied {
        Some(a) => a.iter().filter(|p| !server_owned(p)).cloned().collect(),
        None => changed.clone(),
    };
    if mine.is_empty() && old.is_some() && w.applied.is_none() {
        // a write that only removed fields (a node's `unschedulable: false`, which is no field)
        // takes them from their owners and gives the writer nothing
        drop_absent_fields(&mut entries, new);
        write_entries(new, &entries);
        return;
    }
    for e in entries.iter_mut() {
        if e.manager == w.manager && e.operation == w.operation && e.subresource == w.subresource {
            continue;
        }
        e.fields.retain(|f| !mine.iter().any(|m| overlaps(f, m)));
    }
    let pos = entries
        .iter()
        .position(|e| e.manager == w.manager && e.operation == w.operation && e.subresource == w.subresource);
    let idx = match pos {
        Some(i) => i,
        None => {
            entries.push(Entry {
                manager: w.manager.into(),
                operation: w.operation.into(),
                subresource: w.subresource.into(),
                api_version: String::new(),
                time: String::new(),
                fields: BTreeSet::new(),
            });
            entries.len() - 1
        }
    };
    let e = &mut entries[idx];
    if w.applied.is_some() {
        e.fields.clear();
    }
    e.fields.extend(mine);
    e.api_version = w.api_version.into();
    e.time = w.time.into();
    drop_absent_fields(&mut entries, new);
    write_entries(new, &entries);
}

/// Fields that no longer exist are owned by nobody, and a manager left owning nothing has no
/// entry.
fn drop_absent_fields(entries: &mut Vec<Entry>, new: &Value) {
    for e in entries.iter_mut() {
        e.fields.retain(|p| {
            let mut cur = new;
            for seg in p {
                match cur.get(seg) {
                    Some(c) => cur = c,
                    None => return false,
                }
            }
            true
        });
    }
    entries.retain(|e| !e.fields.is_empty());
}

fn write_entries(obj: &mut Value, entries: &[Entry]) {
    let list: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut m = serde_json::json!({
                "manager": e.manager,
                "operation": e.operation,
                "apiVersion": e.api_version,
                "time": e.time,
                "fieldsType": "FieldsV1",
                "fieldsV1": to_fields_v1(&e.fields),
            });
            if !e.subresource.is_empty() {
                m["subresource"] = Value::String(e.subresource.clone());
            }
            m
        })
        .collect();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        if list.is_empty() {
            meta.remove("managedFields");
        } else {
            meta.insert("managedFields".into(), Value::Array(list));
        }
    }
}

/// Server-side apply merge: the applied configuration is merged into the live object (maps
/// merged, lists by their strategic keys), and fields this manager applied before but no longer
/// applies are removed. Returns the merged object and the applied leaf paths.
pub fn apply_merge(live: &Value, applied: &Value, manager: &str) -> (Value, Vec<FieldPath>) {
    let mut out = live.clone();
    let mut paths = Vec::new();
    leaves(applied, &mut Vec::new(), &mut paths);
    paths.retain(|p| !server_owned(p));
    // Remove what this manager owned via Apply and no longer applies.
    for e in parse_entries(live) {
        if e.manager != manager || e.operation != "Apply" {
            continue;
        }
        for f in &e.fields {
            if paths.iter().any(|p| overlaps(p, f)) || f.first().is_some_and(|s| s == "status") {
                continue;
            }
            let others = owners_of(live, f, manager);
            if others.is_empty() {
                remove_path(&mut out, f);
            }
        }
    }
    let mut patch = applied.clone();
    if let Some(m) = patch.as_object_mut() {
        m.remove("status");
    }
    strategic_merge(&mut out, &patch, "");
    (out, paths)
}

fn remove_path(v: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = v;
    for seg in parents {
        match cur.get_mut(seg) {
            Some(c) => cur = c,
            None => return,
        }
    }
    if let Some(m) = cur.as_object_mut() {
        m.remove(last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strategic_semantics() {
        let doc = json!({"metadata": {"finalizers": ["a"]}, "spec": {"taints": [{"key": "x"}],
            "containers": [{"name": "c", "image": "1"}, {"name": "d", "image": "1"}]}});
        let patch = json!({"metadata": {"finalizers": ["b"]}, "spec": {"taints": [{"key": "y"}],
            "containers": [{"name": "d", "image": "2"}]}});
        let out = apply_patch(PatchType::Strategic, &doc, &patch).unwrap();
        assert_eq!(out["metadata"]["finalizers"], json!(["a", "b"]));
        assert_eq!(out["spec"]["taints"], json!([{"key": "y"}]));
        assert_eq!(out["spec"]["containers"][1]["image"], "2");
        assert_eq!(out["spec"]["containers"][0]["image"], "1");
    }

    #[test]
    fn managed_fields_transfer_ownership() {
        let old = json!({"metadata": {"name": "n"}, "spec": {"unschedulable": true}});
        let mut first = old.clone();
        let w = |m: &'static str| WriteRecord {
            manager: m,
            operation: "Update",
            subresource: "",
            api_version: "v1",
            time: "t",
            applied: None,
        };
        record_managed_fields(None, &mut first, &w("a"));
        let mut second = first.clone();
        second["spec"]["unschedulable"] = json!(false);
        record_managed_fields(Some(&first), &mut second, &w("b"));
        let owners = owners_of(&second, &["spec".into(), "unschedulable".into()], "x");
        assert_eq!(owners, vec!["b".to_string()]);
    }
}
