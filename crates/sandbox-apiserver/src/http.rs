//! The HTTP layer: a thin translation of Kubernetes REST paths onto [`Store`] operations.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::faults::{Faults, RequestStats};
use super::kinds::ResourceInfo;
use super::patch::{self, PatchType};
use super::select::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::store::{DeleteOptions, GroupResource, ListOptions, Store, WriteOptions};
use super::{authz, conversion, discovery, eviction, openapi, scale, table, watch};

/// State shared by every request handler.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) stats: RequestStats,
    pub(crate) faults: Mutex<Faults>,
    pub(crate) cancel: CancellationToken,
    pub(crate) time_scale: f64,
    pub(crate) url: String,
    /// Non-watch requests being served now.
    pub(crate) in_flight: std::sync::atomic::AtomicUsize,
    /// Most non-watch requests served at once; beyond it, API Priority and Fairness's 429.
    pub(crate) max_in_flight: usize,
    /// The rules that bind the kubeconfig's identity, when enforced.
    pub(crate) rbac: Option<authz::Rbac>,
}

/// A parsed resource path.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) namespace: Option<String>,
    pub(crate) resource: String,
    pub(crate) name: Option<String>,
    pub(crate) sub: Option<String>,
}

impl Target {
    pub(crate) fn gr(&self) -> GroupResource {
        GroupResource::new(&self.group, &self.resource)
    }

    fn ns(&self) -> &str {
        self.namespace.as_deref().unwrap_or_default()
    }

    pub(crate) fn api_version(&self) -> String {
        if self.group.is_empty() { self.version.clone() } else { format!("{}/{}", self.group, self.version) }
    }
}

/// What a path addresses.
enum Route {
    Discovery(discovery::Path),
    OpenApi(Vec<String>),
    Resource(Target),
}

fn parse_path(path: &str) -> Option<Route> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    let (group, version, rest) = match segs.as_slice() {
        ["version"] => return Some(Route::Discovery(discovery::Path::Version)),
        ["api"] => return Some(Route::Discovery(discovery::Path::Api)),
        ["apis"] => return Some(Route::Discovery(discovery::Path::Apis)),
        ["openapi", rest @ ..] => {
            return Some(Route::OpenApi(rest.iter().map(|s| s.to_string()).collect()));
        }
        ["api", v] => {
            return Some(Route::Discovery(discovery::Path::GroupVersion(String::new(), v.to_string())));
        }
        ["apis", g] => return Some(Route::Discovery(discovery::Path::Group(g.to_string()))),
        ["apis", g, v] => {
            return Some(Route::Discovery(discovery::Path::GroupVersion(g.to_string(), v.to_string())));
        }
        ["api", v, rest @ ..] => (String::new(), v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (g.to_string(), v.to_string(), rest),
        _ => return None,
    };
    let s = |x: &&str| x.to_string();
    let (namespace, resource, name, sub) = match rest {
        ["namespaces", ns, r, tail @ ..] if !matches!(*r, "status" | "finalize") || !tail.is_empty() => {
            (Some(s(ns)), s(r), tail.first().map(s), tail.get(1).map(s))
        }
        [r, tail @ ..] => (None, s(r), tail.first().map(s), tail.get(1).map(s)),
        [] => return None,
    };
    if rest.len() > 5 {
        return None;
    }
    Some(Route::Resource(Target { group, version, namespace, resource, name, sub }))
}

/// A JSON response.
pub(crate) fn json_response(code: u16, v: &Value) -> Response {
    let body = serde_json::to_vec(v).unwrap_or_default();
    bytes_response(code, body)
}

pub(crate) fn bytes_response(code: u16, body: Vec<u8>) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    r
}

pub(crate) fn error_response(e: &ApiError) -> Response {
    let status = e.to_status();
    let retry_after = status["details"]["retryAfterSeconds"].as_u64().filter(|s| *s > 0);
    let mut r = json_response(e.code, &status);
    // like kube-apiserver's response writer: the header only when the Status asks for a delay (a
    // PodDisruptionBudget refusal has none)
    if let Some(secs) = retry_after
        && let Ok(v) = header::HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

/// The bearer token of a request, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ").map(str::trim)
}

/// What API Priority and Fairness answers when it rejects a request (kube-apiserver's
/// `tooManyRequests` in `server/filters/maxinflight.go`, used by the APF filter): HTTP 429 with a
/// `Retry-After` header and a plain-text body, not a `Status` object, so it carries no causes.
pub(crate) fn apf_rejection(retry_after_secs: u32) -> Response {
    let mut r = Response::new(Body::from("Too many requests, please try again later.\n"));
    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, header::HeaderValue::from_static("nosniff"));
    if let Ok(v) = header::HeaderValue::from_str(&retry_after_secs.to_string()) {
        h.insert(header::RETRY_AFTER, v);
    }
    r
}

/// Requests being served, for the in-flight limit; released when dropped.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Query parameters, last value wins.
pub(crate) type Query = HashMap<String, String>;

fn parse_query(q: Option<&str>) -> Query {
    let mut out = HashMap::new();
    for pair in q.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(decode(k), decode(v));
    }
    out
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn truthy(q: &Query, k: &str) -> bool {
    matches!(q.get(k).map(String::as_str), Some("1" | "true" | "True"))
}

/// Whether the client asked for a server-side Table.
pub(crate) fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.split(',').next().unwrap_or_default().contains("as=Table"))
}

fn field_manager(q: &Query, headers: &HeaderMap) -> String {
    if let Some(m) = q.get("fieldManager").filter(|m| !m.is_empty()) {
        return m.clone();
    }
    // The real server falls back to the user agent's prefix up to the first '/'.
    headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(|ua| ua.split('/').next().unwrap_or_default().to_string())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn verb_of(method: &Method, t: &Target, q: &Query) -> &'static str {
    match (method.as_str(), t.name.is_some(), t.sub.as_deref()) {
        ("POST", true, Some("eviction")) => "evict",
        ("GET", true, _) => "get",
        ("GET", false, _) if truthy(q, "watch") => "watch",
        ("GET", false, _) => "list",
        ("POST", _, _) => "create",
        ("PUT", _, _) => "update",
        ("PATCH", _, _) => "patch",
        ("DELETE", true, _) => "delete",
        ("DELETE", false, _) => "deletecollection",
        _ => "unknown",
    }
}

/// Entry point of every request.
pub(crate) async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let q = parse_query(parts.uri.query());
    let (latency, drop_after) = {
        let f = shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        (f.config().latency, f.config().drop_watches_every)
    };
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let route = match parse_path(&path) {
        Some(r) => r,
        None => return error_response(&ApiError::no_route(&path)),
    };
    let t = match route {
        Route::Discovery(p) => {
            shared.stats.record("get", "discovery");
            return discovery::serve(&shared, &p);
        }
        Route::OpenApi(rest) => {
            shared.stats.record("get", "openapi");
            return openapi::serve(&shared, &rest);
        }
        Route::Resource(t) => t,
    };
    let verb = verb_of(&parts.method, &t, &q);
    let stat_resource = match (&t.sub, verb) {
        (Some(s), v) if v != "evict" => format!("{}/{s}", t.resource),
        _ => t.resource.clone(),
    };
    // a dry run is counted apart: it writes nothing, and a count of evictions or patches is a
    // count of the writes made
    if q.contains_key("dryRun") {
        shared.stats.record(&format!("dry-run {verb}"), &stat_resource);
    } else {
        shared.stats.record(verb, &stat_resource);
    }
    // API Priority and Fairness, reduced to one priority level with a fixed number of seats and
    // no queue: a request beyond them is rejected the way APF rejects (watches hold no seat once
    // started, as in kube-apiserver)
    let _seat = if verb == "watch" {
        None
    } else {
        let now = shared.in_flight.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let seat = InFlight(&shared.in_flight);
        if now >= shared.max_in_flight {
            shared.stats.record("rejected-by-apf", &stat_resource);
            return apf_rejection(1);
        }
        Some(seat)
    };
    let injected = {
        let mut f = shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        f.pick_error(verb, &t.resource)
    };
    if let Some(code) = injected {
        let e = match code {
            // a 429 that is not a PodDisruptionBudget's is API Priority and Fairness's
            429 => {
                shared.stats.record("rejected-by-apf", &stat_resource);
                return apf_rejection(1);
            }
            503 => ApiError::unavailable("the server is currently unable to handle the request (injected fault)"),
            _ => ApiError::internal(
                "an error on the server (\"injected fault\") has prevented the request from succeeding",
            ),
        };
        return error_response(&e);
    }
    // RBAC for the kubeconfig's identity; everyone else (the harness, the simulators) is admin
    let restricted = shared.rbac.as_ref().filter(|_| bearer(&parts.headers) == Some(authz::KUBECONFIG_TOKEN));
    if t.group == "authorization.k8s.io" && t.resource == "selfsubjectaccessreviews" {
        if parts.method != Method::POST {
            return error_response(&ApiError::method_not_allowed("selfsubjectaccessreviews only take create"));
        }
        // like every other request here: JSON only (kubectl auth can-i sends protobuf)
        let ct = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
        if ct.contains("protobuf") {
            return error_response(&ApiError::unsupported_media_type(ct));
        }
        let body = match axum::body::to_bytes(body, 1 << 20).await {
            Ok(b) => b,
            Err(e) => return error_response(&ApiError::bad_request(format!("reading the body: {e}"))),
        };
        let review = serde_json::from_slice::<Value>(&body)
            .map_err(|e| ApiError::bad_request(format!("the body is not a SelfSubjectAccessReview: {e}")))
            .and_then(|v| authz::review(restricted, &v));
        return match review {
            Ok(v) => json_response(201, &v),
            Err(e) => error_response(&e),
        };
    }
    if let Some(rbac) = restricted {
        let (rbac_verb, sub) = match verb {
            "evict" => ("create", "eviction".to_string()),
            v => (v, t.sub.clone().unwrap_or_default()),
        };
        let a = authz::Attributes {
            verb: rbac_verb.to_string(),
            group: t.group.clone(),
            resource: t.resource.clone(),
            subresource: sub,
            name: t.name.clone().unwrap_or_default(),
            namespace: t.namespace.clone().unwrap_or_default(),
        };
        if !rbac.allows(&a) {
            shared.stats.record("forbidden", &stat_resource);
            return error_response(&authz::forbidden(&a));
        }
    }
    let info = match shared.store.registry().served(&t.group, &t.version, &t.resource) {
        Some(i) => i.clone(),
        None => return error_response(&ApiError::no_route(&path)),
    };
    if info.namespaced != t.namespace.is_some()
        && !(t.namespace.is_none() && t.name.is_none() && parts.method == Method::GET)
    {
        return error_response(&ApiError::no_route(&path));
    }
    // Karpenter 1.0.x CRDs: a request needing conversion fails while the webhook is down
    if let Err(e) = conversion::check(&shared.store, &info, &t, matches!(verb, "list" | "watch" | "deletecollection")) {
        return error_response(&e);
    }
    let ct =
        parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("application/json").to_string();
    if ct.contains("protobuf") {
        return error_response(&ApiError::unsupported_media_type(&ct));
    }
    let dry_run = match crate::store::dry_run_value(
        &q.get("dryRun").map_or(Value::Null, |v| json!(v)),
        if parts.method == Method::DELETE { "DeleteOptions" } else { "CreateOptions" },
    ) {
        Ok(d) => d,
        Err(e) => return error_response(&e),
    };
    let body = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return error_response(&ApiError::bad_request(format!("reading the body: {e}"))),
    };
    let opts = WriteOptions {
        field_manager: field_manager(&q, &parts.headers),
        force: truthy(&q, "force"),
        api_version: t.api_version(),
        dry_run,
    };
    let table = wants_table(&parts.headers);
    if verb == "watch" {
        return watch::serve(shared.clone(), t, info, q, table, drop_after);
    }
    match serve_resource(&shared, &parts.method, &t, &info, &q, &ct, &body, &opts, table) {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("error decoding the request body: {e}")))
}

/// Sets the apiVersion the client asked for on objects stored under another version.
pub(crate) fn as_version(mut v: Value, api_version: &str) -> Value {
    if v["apiVersion"].as_str() != Some(api_version) {
        v["apiVersion"] = json!(api_version);
    }
    v
}

#[expect(
    clippy::too_many_arguments,
    reason = "the request's parts as the router hands them over; bundling them would only move the list"
)]
fn serve_resource(
    shared: &Shared,
    method: &Method,
    t: &Target,
    info: &ResourceInfo,
    q: &Query,
    ct: &str,
    body: &Bytes,
    opts: &WriteOptions,
    table: bool,
) -> Result<Response, ApiError> {
    let store = &shared.store;
    let gr = t.gr();
    let av = t.api_version();
    let sub = t.sub.as_deref().unwrap_or_default();
    match (method.as_str(), t.name.as_deref(), sub) {
        ("GET", Some(name), "scale") => scale::get(store, info, t.ns(), name).map(|v| json_response(200, &v)),
        ("GET", Some(name), "" | "status") => {
            let v = as_version(store.get(&gr, t.ns(), name)?, &av);
            if table {
                return Ok(json_response(200, &table::table(info, &[v], store.resource_version(), q, true)));
            }
            Ok(json_response(200, &v))
        }
        ("GET", None, "") => list(shared, t, info, q, table),
        ("POST", None, "") => {
            let obj = parse_json(body)?;
            let out = store.create(&gr, t.ns(), obj, opts)?;
            Ok(json_response(201, &out))
        }
        ("POST", Some(name), "eviction") if info.resource == "pods" && info.group.is_empty() => {
            let ev = parse_json(body)?;
            eviction::evict(shared, t.ns(), name, &ev, opts.dry_run).map(|v| json_response(201, &v))
        }
        ("POST", Some(name), "binding") if info.resource == "pods" && info.group.is_empty() => {
            let b = parse_json(body)?;
            scale::bind(store, t.ns(), name, &b, &opts.field_manager).map(|v| json_response(201, &v))
        }
        ("PUT", Some(name), "scale") => {
            let v = parse_json(body)?;
            scale::update(store, info, t.ns(), name, &v, opts).map(|v| json_response(200, &v))
        }
        ("PATCH", Some(name), "scale") => {
            let ty = PatchType::from_content_type(ct).ok_or_else(|| ApiError::unsupported_media_type(ct))?;
            let p = patch::parse_body(ty, body)?;
            let cur = scale::get(store, info, t.ns(), name)?;
            let next = patch::apply_patch(if ty == PatchType::Apply { PatchType::Merge } else { ty }, &cur, &p)?;
            scale::update(store, info, t.ns(), name, &next, opts).map(|v| json_response(200, &v))
        }
        ("PUT", Some(name), "" | "status") => {
            let obj = parse_json(body)?;
            let out = store.update(&gr, t.ns(), name, obj, sub, opts)?;
            Ok(json_response(200, &out))
        }
        ("PATCH", Some(name), "" | "status") => {
            let ty = PatchType::from_content_type(ct).ok_or_else(|| ApiError::unsupported_media_type(ct))?;
            let p = patch::parse_body(ty, body)?;
            let existed = ty == PatchType::Apply && store.get(&gr, t.ns(), name).is_ok();
            let out = store.patch(&gr, t.ns(), name, ty, &p, sub, opts)?;
            let code = if ty == PatchType::Apply && !existed { 201 } else { 200 };
            Ok(json_response(code, &out))
        }
        ("DELETE", Some(name), "") => {
            let mut dopts = if body.is_empty() { json!({}) } else { parse_json(body)? };
            if let Some(g) = q.get("gracePeriodSeconds").and_then(|g| g.parse::<i64>().ok()) {
                dopts["gracePeriodSeconds"] = json!(g);
            }
            if let Some(p) = q.get("propagationPolicy") {
                dopts["propagationPolicy"] = json!(p);
            }
            let mut d = DeleteOptions::from_json(&dopts)?;
            d.dry_run |= opts.dry_run;
            let (obj, gone) = store.delete(&gr, t.ns(), name, &d)?;
            if gone && !returns_deleted_object(&gr) {
                return Ok(json_response(200, &deleted_status(&gr, name, &obj)));
            }
            Ok(json_response(200, &obj))
        }
        ("DELETE", None, "") => {
            let dopts = if body.is_empty() { json!({}) } else { parse_json(body)? };
            let d = DeleteOptions::from_json(&dopts)?;
            let lo = list_options(info, q)?;
            let page =
                store.list(&gr, t.namespace.as_deref(), &ListOptions { limit: None, continue_token: None, ..lo })?;
            let mut items = Vec::new();
            for o in page.items {
                let (ns, name) = (&o.summary().namespace, &o.summary().name);
                if let Ok((v, _)) = store.delete(&gr, ns, name, &d) {
                    items.push(v);
                }
            }
            Ok(json_response(200, &json!({"kind": info.list_kind, "apiVersion": av, "metadata": {}, "items": items})))
        }
        ("GET" | "POST" | "PUT" | "PATCH" | "DELETE", _, s) if !s.is_empty() && s != "status" && s != "scale" => {
            Err(ApiError::no_route(&format!("{}/{s}", info.resource)))
        }
        _ => Err(ApiError::method_not_allowed(&format!("{} {}", method, info.resource))),
    }
}

/// Parses label/field selectors and paging options.
pub(crate) fn list_options(info: &ResourceInfo, q: &Query) -> Result<ListOptions, ApiError> {
    let labels = match q.get("labelSelector").filter(|s| !s.is_empty()) {
        Some(s) => Some(LabelSelector::parse(s)?),
        None => None,
    };
    let fields = match q.get("fieldSelector").filter(|s| !s.is_empty()) {
        Some(s) => Some(FieldSelector::parse(s, info)?),
        None => None,
    };
    let continue_token = q.get("continue").filter(|s| !s.is_empty()).cloned();
    if continue_token.is_some() && q.get("resourceVersion").is_some_and(|r| !r.is_empty() && r != "0") {
        return Err(ApiError::bad_request("specifying resource version is not allowed when using continue"));
    }
    Ok(ListOptions { labels, fields, limit: q.get("limit").and_then(|l| l.parse().ok()), continue_token })
}

fn list(shared: &Shared, t: &Target, info: &ResourceInfo, q: &Query, table: bool) -> Result<Response, ApiError> {
    let opts = list_options(info, q)?;
    let page = shared.store.list(&t.gr(), t.namespace.as_deref(), &opts)?;
    let av = t.api_version();
    if table {
        let items: Vec<Value> = page.items.iter().map(|o| as_version(Arc::unwrap_or_clone(o.value()), &av)).collect();
        let mut tab = table::table(info, &items, page.resource_version, q, false);
        if let Some(c) = &page.continue_token {
            tab["metadata"]["continue"] = json!(c);
        }
        return Ok(json_response(200, &tab));
    }
    let mut meta = json!({"resourceVersion": page.resource_version.to_string()});
    if let Some(c) = &page.continue_token {
        meta["continue"] = json!(c);
        // etcd counts what is left only of an unfiltered list: with a selector the real server
        // leaves the count out (apiserver's storage/etcd3 store.go, GetList)
        if opts.labels.is_none() && opts.fields.is_none() {
            meta["remainingItemCount"] = json!(page.remaining.unwrap_or(0));
        }
    }
    // Serialise item by item: cloning 20,000 pods into one Value would double the work.
    let mut out = Vec::with_capacity(256 + page.items.len() * 512);
    out.extend_from_slice(
        format!("{{\"kind\":{},\"apiVersion\":{},\"metadata\":{},\"items\":[", json!(info.list_kind), json!(av), meta)
            .as_bytes(),
    );
    for (i, item) in page.items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // stored at the version asked for: its JSON as it is
        if *item.summary().api_version == *av {
            item.json().write_into(&mut out);
        } else {
            let _ = serde_json::to_writer(&mut out, &as_version(Arc::unwrap_or_clone(item.value()), &av));
        }
    }
    out.extend_from_slice(b"]}");
    Ok(bytes_response(200, out))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(&self)
    }
}

/// Whether kube-apiserver answers a delete that removed the object with the object itself: only
/// the registries that set `ReturnDeletedObject` (kubernetes' pkg/registry: pods, namespaces,
/// services, and a few more); every other kind, custom resources included, answers with a
/// `Status` of success.
fn returns_deleted_object(gr: &GroupResource) -> bool {
    match gr.group.as_str() {
        "" => matches!(
            gr.resource.as_str(),
            "pods"
                | "namespaces"
                | "services"
                | "serviceaccounts"
                | "persistentvolumes"
                | "persistentvolumeclaims"
                | "resourcequotas"
                | "podtemplates"
        ),
        "storage.k8s.io" | "resource.k8s.io" => true,
        _ => false,
    }
}

/// The `Status` of a delete that removed the object (the generic registry's answer: its details
/// name the resource, not the kind).
fn deleted_status(gr: &GroupResource, name: &str, obj: &Value) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
        "details": {"name": name, "group": gr.group, "kind": gr.resource, "uid": obj["metadata"]["uid"]},
    })
}
