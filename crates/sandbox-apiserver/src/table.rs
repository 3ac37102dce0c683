//! Server-side tables (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`) for kubectl.

use std::time::SystemTime;

use serde_json::{Value, json};

use super::http::Query;
use super::kinds::ResourceInfo;

fn col(name: &str, ty: &str, priority: i64) -> Value {
    let format = if name == "Name" { "name" } else { "" };
    json!({"name": name, "type": ty, "format": format, "description": name, "priority": priority})
}

/// kubectl's short duration format (`45s`, `12m`, `5h`, `3d`).
pub fn age(ts: &Value) -> String {
    let Some(t) = ts.as_str().and_then(|s| humantime::parse_rfc3339(s).ok()) else {
        return "<unknown>".into();
    };
    let secs = SystemTime::now().duration_since(t).map(|d| d.as_secs()).unwrap_or(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 180 * 60 => format!("{}m", s / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

/// Evaluates the simple JSONPath forms CRDs use: `.a.b`, `.a[0].b`,
/// `.a[?(@.type=="Ready")].status`.
pub fn json_path<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let mut cur = obj;
    let mut rest = path.trim().trim_start_matches('{').trim_end_matches('}');
    while !rest.is_empty() {
        rest = rest.strip_prefix('.').unwrap_or(rest);
        if rest.is_empty() {
            break;
        }
        if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            let inner = &r[..end];
            rest = &r[end + 1..];
            if let Some(filter) = inner.strip_prefix("?(@.").and_then(|f| f.strip_suffix(')')) {
                let (k, v) = filter.split_once("==")?;
                let v = v.trim().trim_matches('"').trim_matches('\'');
                cur = cur.as_array()?.iter().find(|e| e[k.trim()].as_str() == Some(v))?;
            } else {
                cur = cur.get(inner.parse::<usize>().ok()?)?;
            }
            continue;
        }
        // Field names may escape dots: `.metadata.labels.node\\.kubernetes\\.io/zone`.
        let mut field = String::new();
        let mut end = rest.len();
        let mut chars = rest.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        field.push(n);
                    }
                }
                '.' | '[' => {
                    end = i;
                    break;
                }
                _ => field.push(c),
            }
        }
        cur = cur.get(&field)?;
        rest = &rest[end..];
    }
    Some(cur)
}

fn text(v: Option<&Value>) -> Value {
    match v {
        None | Some(Value::Null) => json!(""),
        Some(Value::String(s)) => json!(s),
        Some(other) => other.clone(),
    }
}

fn str_or<'a>(v: &'a Value, d: &'a str) -> &'a str {
    v.as_str().filter(|s| !s.is_empty()).unwrap_or(d)
}

fn cond(obj: &Value, ty: &str) -> Option<String> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == ty)
        .and_then(|c| c["status"].as_str().map(str::to_string))
}

fn node_row(o: &Value) -> Vec<Value> {
    let mut status = if cond(o, "Ready").as_deref() == Some("True") {
        "Ready".to_string()
    } else if cond(o, "Ready").is_some() {
        "NotReady".to_string()
    } else {
        "Unknown".to_string()
    };
    if o["spec"]["unschedulable"] == true {
        status.push_str(",SchedulingDisabled");
    }
    let roles: Vec<String> = o["metadata"]["labels"]
        .as_object()
        .map(|m| m.keys().filter_map(|k| k.strip_prefix("node-role.kubernetes.io/")).map(str::to_string).collect())
        .unwrap_or_default();
    let addr = |t: &str| {
        o["status"]["addresses"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["type"] == t))
            .and_then(|x| x["address"].as_str())
            .unwrap_or("<none>")
            .to_string()
    };
    let info = &o["status"]["nodeInfo"];
    vec![
        json!(status),
        json!(if roles.is_empty() { "<none>".into() } else { roles.join(",") }),
        json!(age(&o["metadata"]["creationTimestamp"])),
        json!(str_or(&info["kubeletVersion"], "")),
        json!(addr("InternalIP")),
        json!(addr("ExternalIP")),
        json!(str_or(&info["osImage"], "<unknown>")),
        json!(str_or(&info["kernelVersion"], "<unknown>")),
        json!(str_or(&info["containerRuntimeVersion"], "<unknown>")),
    ]
}

fn pod_row(o: &Value) -> Vec<Value> {
    let total = o["spec"]["containers"].as_array().map_or(0, Vec::len);
    let statuses = o["status"]["containerStatuses"].as_array();
    let ready = statuses.map_or(0, |s| s.iter().filter(|c| c["ready"] == true).count());
    let restarts: i64 = statuses.map_or(0, |s| s.iter().map(|c| c["restartCount"].as_i64().unwrap_or(0)).sum());
    let status = if !o["metadata"]["deletionTimestamp"].is_null() {
        "Terminating".to_string()
    } else {
        str_or(&o["status"]["phase"], "Pending").to_string()
    };
    vec![
        json!(format!("{ready}/{total}")),
        json!(status),
        json!(restarts),
        json!(age(&o["metadata"]["creationTimestamp"])),
        json!(str_or(&o["status"]["podIP"], "<none>")),
        json!(str_or(&o["spec"]["nodeName"], "<none>")),
        json!(str_or(&o["status"]["nominatedNodeName"], "<none>")),
        json!("<none>"),
    ]
}

fn num(v: &Value) -> i64 {
    v.as_i64().unwrap_or(0)
}

/// Columns (after NAME) and cells for a resource.
fn columns(info: &ResourceInfo) -> Vec<Value> {
    match (info.group.as_str(), info.resource.as_str()) {
        ("", "nodes") => vec![
            col("Status", "string", 0),
            col("Roles", "string", 0),
            col("Age", "string", 0),
            col("Version", "string", 0),
            col("Internal-IP", "string", 1),
            col("External-IP", "string", 1),
            col("OS-Image", "string", 1),
            col("Kernel-Version", "string", 1),
            col("Container-Runtime", "string", 1),
        ],
        ("", "pods") => vec![
            col("Ready", "string", 0),
            col("Status", "string", 0),
            col("Restarts", "string", 0),
            col("Age", "string", 0),
            col("IP", "string", 1),
            col("Node", "string", 1),
            col("Nominated Node", "string", 1),
            col("Readiness Gates", "string", 1),
        ],
        ("", "namespaces") => vec![col("Status", "string", 0), col("Age", "string", 0)],
        ("apps", "deployments") => vec![
            col("Ready", "string", 0),
            col("Up-to-date", "integer", 0),
            col("Available", "integer", 0),
            col("Age", "string", 0),
        ],
        ("apps", "replicasets") => vec![
            col("Desired", "integer", 0),
            col("Current", "integer", 0),
            col("Ready", "integer", 0),
            col("Age", "string", 0),
        ],
        ("apps", "statefulsets") => vec![col("Ready", "string", 0), col("Age", "string", 0)],
        ("apps", "daemonsets") => vec![
            col("Desired", "integer", 0),
            col("Current", "integer", 0),
            col("Ready", "integer", 0),
            col("Up-to-date", "integer", 0),
            col("Available", "integer", 0),
            col("Age", "string", 0),
        ],
        ("policy", "poddisruptionbudgets") => vec![
            col("Min Available", "string", 0),
            col("Max Unavailable", "string", 0),
            col("Allowed Disruptions", "integer", 0),
            col("Age", "string", 0),
        ],
        ("apiextensions.k8s.io", "customresourcedefinitions") => vec![col("Created At", "date", 0)],
        _ if !info.printer_columns.is_empty() => {
            info.printer_columns.iter().map(|c| col(&c.name, &c.type_, c.priority)).collect()
        }
        _ => vec![col("Age", "string", 0)],
    }
}

fn cells(info: &ResourceInfo, o: &Value) -> Vec<Value> {
    let a = || json!(age(&o["metadata"]["creationTimestamp"]));
    let s = &o["status"];
    let any = |v: &Value| if v.is_null() { json!("N/A") } else { json!(v.to_string().trim_matches('"')) };
    match (info.group.as_str(), info.resource.as_str()) {
        ("", "nodes") => node_row(o),
        ("", "pods") => pod_row(o),
        ("", "namespaces") => vec![json!(str_or(&s["phase"], "Active")), a()],
        ("apps", "deployments") => vec![
            json!(format!("{}/{}", num(&s["readyReplicas"]), num(&o["spec"]["replicas"]))),
            json!(num(&s["updatedReplicas"])),
            json!(num(&s["availableReplicas"])),
            a(),
        ],
        ("apps", "replicasets") => {
            vec![json!(num(&o["spec"]["replicas"])), json!(num(&s["replicas"])), json!(num(&s["readyReplicas"])), a()]
        }
        ("apps", "statefulsets") => {
            vec![json!(format!("{}/{}", num(&s["readyReplicas"]), num(&o["spec"]["replicas"]))), a()]
        }
        ("apps", "daemonsets") => vec![
            json!(num(&s["desiredNumberScheduled"])),
            json!(num(&s["currentNumberScheduled"])),
            json!(num(&s["numberReady"])),
            json!(num(&s["updatedNumberScheduled"])),
            json!(num(&s["numberAvailable"])),
            a(),
        ],
        ("policy", "poddisruptionbudgets") => vec![
            any(&o["spec"]["minAvailable"]),
            any(&o["spec"]["maxUnavailable"]),
            json!(num(&s["disruptionsAllowed"])),
            a(),
        ],
        ("apiextensions.k8s.io", "customresourcedefinitions") => {
            vec![json!(o["metadata"]["creationTimestamp"].as_str().unwrap_or_default())]
        }
        _ if !info.printer_columns.is_empty() => info
            .printer_columns
            .iter()
            .map(|c| {
                let v = json_path(o, &c.json_path);
                if c.type_ == "date" { v.map(age).map(Value::String).unwrap_or(json!("<unknown>")) } else { text(v) }
            })
            .collect(),
        _ => vec![a()],
    }
}

/// Renders objects as a `meta.k8s.io/v1` Table.
pub fn table(info: &ResourceInfo, objs: &[Value], rv: u64, q: &Query, _single: bool) -> Value {
    let mut defs = vec![col("Name", "string", 0)];
    defs.extend(columns(info));
    let include = q.get("includeObject").map(String::as_str).unwrap_or("Metadata");
    let rows: Vec<Value> = objs
        .iter()
        .map(|o| {
            let mut c = vec![json!(o["metadata"]["name"].as_str().unwrap_or_default())];
            c.extend(cells(info, o));
            let object = match include {
                "Object" => o.clone(),
                "None" => Value::Null,
                _ => {
                    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]})
                }
            };
            json!({"cells": c, "object": object})
        })
        .collect();
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv.to_string()},
        "columnDefinitions": defs,
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_path_filters() {
        let o = json!({"status": {"conditions": [{"type": "A", "status": "x"}, {"type": "Ready", "status": "True"}]}});
        assert_eq!(json_path(&o, ".status.conditions[?(@.type==\"Ready\")].status"), Some(&json!("True")));
        assert_eq!(json_path(&o, ".status.conditions[0].type"), Some(&json!("A")));
        assert_eq!(json_path(&o, ".spec.x"), None);
        let l = json!({"metadata": {"labels": {"karpenter.sh/nodepool": "p"}}});
        assert_eq!(json_path(&l, ".metadata.labels.karpenter\\.sh/nodepool"), Some(&json!("p")));
    }
}
