//! A minimal OpenAPI v3 surface: the `/openapi/v3` index and one document per group-version,
//! enough for kubectl to find that the server validates fields itself (`fieldValidation`).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use axum::response::Response;
use serde_json::{Map, Value, json};

use super::discovery::GIT_VERSION;
use super::http::{Shared, error_response, json_response};
use super::kinds::ResourceInfo;
use super::status::ApiError;

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() { format!("api/{version}") } else { format!("apis/{group}/{version}") }
}

fn schema_name(r: &ResourceInfo, version: &str) -> String {
    let g = if r.group.is_empty() { "core".to_string() } else { r.group.clone() };
    format!("{g}.{version}.{}", r.kind)
}

fn doc(resources: &[&ResourceInfo], group: &str, version: &str) -> Value {
    let mut paths = Map::new();
    let mut schemas = Map::new();
    let base = format!("/{}", gv_path(group, version));
    let params = json!([
        {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
        {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
        {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
    ]);
    for r in resources {
        let gvk = json!([{"group": r.group, "version": version, "kind": r.kind}]);
        let sname = schema_name(r, version);
        let reference = json!({"$ref": format!("#/components/schemas/{sname}")});
        let ok = json!({"200": {"description": "OK", "content": {"application/json": {"schema": reference}}}});
        let op = |action: &str| json!({"x-kubernetes-action": action, "x-kubernetes-group-version-kind": gvk[0], "parameters": params, "responses": ok});
        let (coll, item) = if r.namespaced {
            (
                format!("{base}/namespaces/{{namespace}}/{}", r.resource),
                format!("{base}/namespaces/{{namespace}}/{}/{{name}}", r.resource),
            )
        } else {
            (format!("{base}/{}", r.resource), format!("{base}/{}/{{name}}", r.resource))
        };
        paths.insert(coll, json!({"get": op("list"), "post": op("post")}));
        paths.insert(
            item,
            json!({"get": op("get"), "put": op("put"),
            "patch": op("patch"), "delete": op("delete")}),
        );
        schemas.insert(
            sname,
            json!({
                "type": "object",
                "description": format!("{} (schema not modelled by the sandbox; the server validates)", r.kind),
                "x-kubernetes-group-version-kind": gvk,
                "x-kubernetes-preserve-unknown-fields": true,
            }),
        );
    }
    json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": GIT_VERSION},
        "paths": paths,
        "components": {"schemas": schemas},
    })
}

/// Answers `/openapi/...`.
pub(crate) fn serve(shared: &Shared, rest: &[String]) -> Response {
    let reg = shared.store.registry();
    match rest.first().map(String::as_str) {
        Some("v3") => {}
        _ => return error_response(&ApiError::no_route("/openapi/v2")),
    }
    let gvs = reg.group_versions();
    if rest.len() == 1 {
        let mut paths = Map::new();
        for (g, v) in &gvs {
            let mut h = DefaultHasher::new();
            for r in reg.all().iter().filter(|r| r.group == *g) {
                format!("{r:?}").hash(&mut h);
            }
            let p = gv_path(g, v);
            paths.insert(p.clone(), json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash={:016X}", h.finish())}));
        }
        return json_response(200, &json!({"paths": paths}));
    }
    let wanted = rest[1..].join("/");
    for (g, v) in &gvs {
        if gv_path(g, v) == wanted {
            let res: Vec<&ResourceInfo> =
                reg.all().iter().filter(|r| r.group == *g && r.versions.contains(v)).collect();
            return json_response(200, &doc(&res, g, v));
        }
    }
    error_response(&ApiError::no_route(&format!("/openapi/v3/{wanted}")))
}
