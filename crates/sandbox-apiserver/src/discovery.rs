//! Discovery documents: `/version`, `/api`, `/apis`, `/api/v1`, `/apis/<group>/<version>`.

use axum::response::Response;
use serde_json::{Value, json};

use super::http::{Shared, error_response, json_response};
use super::kinds::{Registry, ResourceInfo};
use super::status::ApiError;

/// The Kubernetes version the sandbox reports. The machine's kubectl dispatcher picks a client
/// within one minor version of it.
pub const GIT_VERSION: &str = "v1.34.1";

/// A discovery path.
#[derive(Debug, Clone)]
pub(crate) enum Path {
    Version,
    Api,
    Apis,
    Group(String),
    GroupVersion(String, String),
}

const VERBS: [&str; 8] = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"];

fn resource_entries(r: &ResourceInfo) -> Vec<Value> {
    let mut out = vec![json!({
        "name": r.resource,
        "singularName": r.singular,
        "namespaced": r.namespaced,
        "kind": r.kind,
        "verbs": VERBS,
        "shortNames": r.short_names,
        "categories": r.categories,
    })];
    let sub = |name: &str, verbs: &[&str]| {
        json!({"name": format!("{}/{name}", r.resource), "singularName": "", "namespaced": r.namespaced,
            "kind": r.kind, "verbs": verbs})
    };
    if r.status {
        out.push(sub("status", &["get", "patch", "update"]));
    }
    if r.scale.is_some() {
        out.push(json!({"name": format!("{}/scale", r.resource), "singularName": "", "namespaced": r.namespaced,
            "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]}));
    }
    if r.builtin && r.group.is_empty() && r.resource == "pods" {
        out.push(json!({"name": "pods/eviction", "singularName": "", "namespaced": true,
            "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"]}));
        out.push(json!({"name": "pods/binding", "singularName": "", "namespaced": true,
            "kind": "Binding", "verbs": ["create"]}));
    }
    out
}

fn group_entry(reg: &Registry, group: &str) -> Value {
    let mut versions: Vec<String> = Vec::new();
    let mut preferred = String::new();
    for r in reg.all().iter().filter(|r| r.group == group) {
        for v in &r.versions {
            if !versions.contains(v) {
                versions.push(v.clone());
            }
        }
        if preferred.is_empty() {
            preferred = r.storage_version.clone();
        }
    }
    let gv = |v: &str| json!({"groupVersion": format!("{group}/{v}"), "version": v});
    json!({
        "name": group,
        "versions": versions.iter().map(|v| gv(v)).collect::<Vec<_>>(),
        "preferredVersion": gv(&preferred),
    })
}

/// Answers a discovery request.
pub(crate) fn serve(shared: &Shared, p: &Path) -> Response {
    let reg = shared.store.registry();
    match p {
        Path::Version => json_response(
            200,
            &json!({
                "major": "1", "minor": "34", "gitVersion": GIT_VERSION,
                "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                "buildDate": "2025-09-09T00:00:00Z", "goVersion": "go1.24.6", "compiler": "gc",
                "platform": "linux/amd64",
            }),
        ),
        Path::Api => json_response(
            200,
            &json!({"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": shared.url.trim_start_matches("http://")}]}),
        ),
        Path::Apis => {
            let mut groups: Vec<String> = Vec::new();
            for r in reg.all().iter().filter(|r| !r.group.is_empty()) {
                if !groups.contains(&r.group) {
                    groups.push(r.group.clone());
                }
            }
            let list: Vec<Value> = groups.iter().map(|g| group_entry(&reg, g)).collect();
            json_response(200, &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": list}))
        }
        Path::Group(g) => {
            if reg.all().iter().any(|r| r.group == *g) {
                let mut e = group_entry(&reg, g);
                e["kind"] = json!("APIGroup");
                e["apiVersion"] = json!("v1");
                json_response(200, &e)
            } else {
                error_response(&ApiError::no_route(&format!("/apis/{g}")))
            }
        }
        Path::GroupVersion(g, v) => {
            let resources: Vec<Value> = reg
                .all()
                .iter()
                .filter(|r| r.group == *g && r.versions.contains(v))
                .flat_map(resource_entries)
                .collect();
            let gv = if g.is_empty() { v.clone() } else { format!("{g}/{v}") };
            if resources.is_empty() {
                return error_response(&ApiError::no_route(&gv));
            }
            json_response(
                200,
                &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
            )
        }
    }
}
