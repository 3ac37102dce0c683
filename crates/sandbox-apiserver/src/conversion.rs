//! CRD conversion through a webhook (design §3, Karpenter 1.0.x): a custom resource whose CRD says
//! `spec.conversion.strategy: Webhook` can only be read or written at a version other than the
//! one an object is stored at while the webhook's Service has a ready pod behind it. Without one
//! the real server fails the request with 500, which is how objects become unreachable once the
//! Karpenter controller is gone. The sandbox does not run webhooks: when a ready pod backs the
//! Service, conversion "succeeds" by rewriting `apiVersion`, as it does for strategy `None`.

use serde_json::Value;

use super::eviction::pods_gr;
use super::http::Target;
use super::kinds::ResourceInfo;
use super::select::LabelSelector;
use super::status::ApiError;
use super::store::{GroupResource, ListOptions, Store};

fn crd_gr() -> GroupResource {
    GroupResource::new("apiextensions.k8s.io", "customresourcedefinitions")
}

/// Fails the request as the real server would when it needs a conversion the CRD routes through
/// a webhook whose Service has no ready endpoint. `collection`: a list, watch or deletecollection
/// (every stored object of the kind in scope is converted).
pub(crate) fn check(store: &Store, info: &ResourceInfo, t: &Target, collection: bool) -> Result<(), ApiError> {
    if info.builtin {
        return Ok(());
    }
    let Ok(crd) = store.get(&crd_gr(), "", &format!("{}.{}", info.resource, info.group)) else {
        return Ok(());
    };
    let conversion = &crd["spec"]["conversion"];
    if conversion["strategy"].as_str() != Some("Webhook") {
        return Ok(());
    }
    let Some(from) = needs_conversion(store, info, t, collection) else {
        return Ok(());
    };
    let service = &conversion["webhook"]["clientConfig"]["service"];
    let (Some(name), Some(ns)) = (service["name"].as_str(), service["namespace"].as_str()) else {
        // a webhook given by URL: outside the sandbox, so it cannot be reached
        let url = conversion["webhook"]["clientConfig"]["url"].as_str().unwrap_or_default();
        return Err(failed(&from, &info.kind, &format!("Post \"{url}\": the sandbox cannot reach webhook URLs")));
    };
    let port = service["port"].as_i64().unwrap_or(443);
    let path = service["path"].as_str().unwrap_or("/");
    let url = format!("https://{name}.{ns}.svc:{port}{path}?timeout=30s");
    let svc = match store.get(&GroupResource::new("", "services"), ns, name) {
        Ok(s) => s,
        Err(_) => return Err(failed(&from, &info.kind, &format!("Post \"{url}\": service \"{name}\" not found"))),
    };
    if has_ready_endpoint(store, ns, &svc["spec"]["selector"]) {
        return Ok(());
    }
    Err(failed(&from, &info.kind, &format!("Post \"{url}\": no endpoints available for service \"{name}\"")))
}

fn failed(from_api_version: &str, kind: &str, why: &str) -> ApiError {
    ApiError::internal(format!("conversion webhook for {from_api_version}, Kind={kind} failed: {why}"))
}

/// The apiVersion an object must be converted from, if the request needs a conversion: the
/// request's own version when it is not the storage version (what the client sends or receives
/// is converted), otherwise the version of a stored object written at another one.
fn needs_conversion(store: &Store, info: &ResourceInfo, t: &Target, collection: bool) -> Option<String> {
    let wanted = t.api_version();
    if t.version != info.storage_version {
        return Some(wanted);
    }
    let gr = t.gr();
    let stored_other = |o: &Value| o["apiVersion"].as_str().filter(|v| *v != wanted).map(str::to_string);
    match (&t.name, collection) {
        (Some(name), false) => {
            store.get(&gr, t.namespace.as_deref().unwrap_or_default(), name).ok().and_then(|o| stored_other(&o))
        }
        _ => {
            let page = store.list(&gr, t.namespace.as_deref(), &ListOptions::default()).ok()?;
            page.items.iter().find(|o| *o.summary().api_version != *wanted).map(|o| o.summary().api_version.to_string())
        }
    }
}

/// Whether a running, ready, not terminating pod matches the Service's selector (what would make
/// it an endpoint). A Service without a selector has no endpoints the sandbox manages.
fn has_ready_endpoint(store: &Store, ns: &str, selector: &Value) -> bool {
    if !selector.is_object() {
        return false;
    }
    let Some(sel) = LabelSelector::from_object(&serde_json::json!({"matchLabels": selector})) else {
        return false;
    };
    let Ok(pods) = store.list(&pods_gr(), Some(ns), &ListOptions { labels: Some(sel), ..ListOptions::default() })
    else {
        return false;
    };
    pods.items.iter().filter(|p| !p.summary().deleting && &*p.summary().phase == "Running").any(|p| {
        let p = p.value();
        p["metadata"]["deletionTimestamp"].is_null()
            && p["status"]["phase"] == "Running"
            && p["status"]["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
    })
}
