//! Request accounting: every request the client sends is counted by verb, for the report and
//! the benchmark (API calls per evicted pod).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Method, Request};

/// Counts of requests by `kubernetes:<verb>`.
#[derive(Clone, Debug, Default)]
pub struct ApiCalls {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl ApiCalls {
    /// A tower layer that counts each request before sending it.
    pub(crate) fn layer<B>(&self) -> tower::util::MapRequestLayer<impl Fn(Request<B>) -> Request<B> + Clone + use<B>> {
        let me = self.clone();
        tower::util::MapRequestLayer::new(move |req: Request<B>| {
            me.record(verb(req.method(), req.uri().path(), req.uri().query().unwrap_or("")));
            req
        })
    }

    /// Counts one request.
    pub(crate) fn record(&self, verb: &str) {
        // A poisoned lock only means another thread panicked mid-increment; counting on is fine.
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(format!("kubernetes:{verb}")).or_default() += 1;
    }

    /// A copy of the counts so far.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The Kubernetes verb of a request, as the API server's audit log would name it.
pub(crate) fn verb(method: &Method, path: &str, query: &str) -> &'static str {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest: &[&str] = match segs.first() {
        Some(&"api") if segs.len() >= 2 => &segs[2..],
        Some(&"apis") if segs.len() >= 3 => &segs[3..],
        _ => return "other",
    };
    // [namespaces, ns, resource, ...] for namespaced kinds, [resource, ...] otherwise
    let rest = if rest.len() >= 3 && rest[0] == "namespaces" { &rest[2..] } else { rest };
    let named = rest.len() >= 2;
    let sub = rest.get(2).copied();
    // the admission check's dry runs write nothing: they are counted apart from the writes
    if query.split('&').any(|kv| kv.starts_with("dryRun=")) {
        return "dry-run";
    }
    match *method {
        Method::GET if query.split('&').any(|kv| kv == "watch=true" || kv == "watch=1") => "watch",
        Method::GET if named => "get",
        Method::GET => "list",
        Method::POST if sub == Some("eviction") => "evict",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if named => "delete",
        Method::DELETE => "deletecollection",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_follow_the_path_shape() {
        assert_eq!(verb(&Method::GET, "/api/v1/nodes", ""), "list");
        assert_eq!(verb(&Method::GET, "/api/v1/nodes/n1", ""), "get");
        assert_eq!(verb(&Method::GET, "/api/v1/pods", "watch=true&resourceVersion=1"), "watch");
        assert_eq!(verb(&Method::GET, "/api/v1/namespaces/a/pods", "fieldSelector=x"), "list");
        assert_eq!(verb(&Method::GET, "/api/v1/namespaces/a/pods/p", ""), "get");
        assert_eq!(verb(&Method::POST, "/api/v1/namespaces/a/pods/p/eviction", ""), "evict");
        assert_eq!(verb(&Method::PATCH, "/apis/karpenter.sh/v1/nodeclaims/c", ""), "patch");
        assert_eq!(verb(&Method::DELETE, "/apis/karpenter.sh/v1/nodepools/p", ""), "delete");
        assert_eq!(verb(&Method::GET, "/apis/karpenter.sh/v1/nodepools", ""), "list");
        assert_eq!(verb(&Method::GET, "/version", ""), "other");
        assert_eq!(verb(&Method::POST, "/api/v1/namespaces/a/pods/p/eviction", "dryRun=All"), "dry-run");
        assert_eq!(verb(&Method::PATCH, "/api/v1/nodes/n", "fieldManager=x&dryRun=All"), "dry-run");
    }
}
