//! The Eviction subresource and PodDisruptionBudget arithmetic, as the real disruption
//! controller and eviction REST handler compute them.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::http::Shared;
use super::select::LabelSelector;
use super::status::ApiError;
use super::store::{DeleteOptions, GroupResource, Inner, ObjectKey, Propagation, now_rfc3339};
use super::stored::Stored;

pub(crate) fn pods_gr() -> GroupResource {
    GroupResource::new("", "pods")
}

pub(crate) fn pdb_gr() -> GroupResource {
    GroupResource::new("policy", "poddisruptionbudgets")
}

/// Running, Ready and not terminating.
pub fn pod_healthy(p: &Value) -> bool {
    p["metadata"]["deletionTimestamp"].is_null()
        && p["status"]["phase"] == "Running"
        && p["status"]["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

/// `5` or `"50%"` of `total`, rounded up like the real server.
fn scaled(v: &Value, total: i64) -> Option<i64> {
    if let Some(n) = v.as_i64() {
        return Some(n);
    }
    let s = v.as_str()?;
    if let Some(p) = s.strip_suffix('%') {
        let pct: i64 = p.parse().ok()?;
        return Some((pct * total + 99) / 100);
    }
    s.parse().ok()
}

/// The replica count of a pod's controller (a Deployment's for pods of its ReplicaSets), counted
/// once per controller: 0 for a pod whose controller `seen` holds already. The controller is found
/// by the owner reference's uid, as the disruption controller checks it, and parsed only the first
/// time: at 100,000 pods a refresh of every budget parsed each pod and its owners, which took the
/// sandbox's controllers 20 s at a time.
fn controller_scale(inner: &Inner, pod: &Stored, seen: &mut BTreeSet<Arc<str>>) -> i64 {
    // a bare pod, or one whose controller is gone, counts for itself
    let Some((gr, owner)) = pod.summary().controller_uid.as_deref().and_then(|u| inner.by_uid(u)) else { return 1 };
    let is = |gr: &GroupResource, resource: &str| gr.group == "apps" && gr.resource == resource;
    let ctrl = if is(gr, "replicasets") {
        owner
            .summary()
            .controller_uid
            .as_deref()
            .and_then(|u| inner.by_uid(u))
            .filter(|(gr, _)| is(gr, "deployments"))
            .map_or(owner, |(_, dep)| dep)
    } else if is(gr, "statefulsets") || is(gr, "deployments") {
        owner
    } else {
        return 1;
    };
    if !seen.insert(ctrl.summary().uid.clone()) {
        return 0;
    }
    ctrl.value()["spec"]["replicas"].as_i64().unwrap_or(1)
}

/// How long an accepted eviction keeps its pod in `disruptedPods` if the pod is not deleted:
/// the disruption controller's `DeletionTimeout`, 2 minutes, scaled by the sandbox's time scale.
/// The map is keyed by pod name, so without the expiry a StatefulSet pod recreated under the same
/// name stays "disrupted" (unhealthy) forever, and its budget blocks every later eviction.
pub(crate) fn deletion_timeout(time_scale: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64((120.0 * time_scale).max(0.0))
}

/// Recomputes a PDB's status from the pods it selects; `timeout` is [`deletion_timeout`].
pub(crate) fn pdb_status(inner: &Inner, pdb: &Value, timeout: std::time::Duration) -> Value {
    let ns = pdb["metadata"]["namespace"].as_str().unwrap_or_default();
    let sel = LabelSelector::from_object(&pdb["spec"]["selector"]);
    // selected and read from the summaries: no pod is parsed
    let pods: Vec<&Stored> = match &sel {
        None => Vec::new(),
        Some(sel) => inner.iter_ns(&pods_gr(), Some(ns)).filter(|p| p.selected_by(sel)).collect(),
    };
    let mut disrupted: Map<String, Value> = pdb["status"]["disruptedPods"].as_object().cloned().unwrap_or_default();
    let live: std::collections::HashSet<&str> =
        pods.iter().filter(|p| !p.summary().deleting).map(|p| &*p.summary().name).collect();
    let now_t = std::time::SystemTime::now();
    let fresh = |at: &Value| {
        at.as_str()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            // timestamps have whole seconds: expire after the second the timeout ends in
            .is_some_and(|t| t + timeout + std::time::Duration::from_secs(1) > now_t)
    };
    disrupted.retain(|name, at| live.contains(name.as_str()) && fresh(at));
    let healthy =
        pods.iter().filter(|p| p.summary().pod_healthy() && !disrupted.contains_key(&*p.summary().name)).count() as i64;
    let spec = &pdb["spec"];
    let (expected, desired) = if !spec["maxUnavailable"].is_null() {
        let mut seen = BTreeSet::new();
        let expected: i64 = pods.iter().map(|p| controller_scale(inner, p, &mut seen)).sum();
        let max_un = scaled(&spec["maxUnavailable"], expected).unwrap_or(0);
        (expected, (expected - max_un).max(0))
    } else if let Some(n) = spec["minAvailable"].as_i64() {
        (pods.len() as i64, n)
    } else if !spec["minAvailable"].is_null() {
        let mut seen = BTreeSet::new();
        let expected: i64 = pods.iter().map(|p| controller_scale(inner, p, &mut seen)).sum();
        (expected, scaled(&spec["minAvailable"], expected).unwrap_or(0))
    } else {
        (pods.len() as i64, pods.len() as i64)
    };
    let allowed = (healthy - desired).max(0);
    let generation = pdb["metadata"]["generation"].as_i64().unwrap_or(1);
    let now = now_rfc3339();
    let prev_cond = pdb["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "DisruptionAllowed").cloned());
    let cond_status = if allowed > 0 { "True" } else { "False" };
    let ltt = prev_cond
        .as_ref()
        .filter(|c| c["status"] == cond_status)
        .and_then(|c| c["lastTransitionTime"].as_str().map(str::to_string))
        .unwrap_or(now);
    let mut st = json!({
        "observedGeneration": generation,
        "currentHealthy": healthy,
        "desiredHealthy": desired,
        "disruptionsAllowed": allowed,
        "expectedPods": expected,
        "conditions": [{
            "type": "DisruptionAllowed", "status": cond_status,
            "reason": if allowed > 0 { "SufficientPods" } else { "InsufficientPods" },
            "message": "", "observedGeneration": generation, "lastTransitionTime": ltt,
        }],
    });
    if !disrupted.is_empty() {
        st["disruptedPods"] = Value::Object(disrupted);
    }
    st
}

/// Writes a PDB's recomputed status if it changed.
/// Recomputes one PDB's status; returns how long until its earliest `disruptedPods` entry
/// expires, when it holds one (the status must be computed again then).
pub(crate) fn refresh_pdb(
    inner: &mut Inner,
    ns: &str,
    name: &str,
    timeout: std::time::Duration,
) -> Option<std::time::Duration> {
    let pdb = inner.find(&pdb_gr(), ns, name)?;
    let st = pdb_status(inner, &pdb, timeout);
    let now = std::time::SystemTime::now();
    let recheck = st["disruptedPods"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, at)| humantime::parse_rfc3339(at.as_str()?).ok())
        .map(|at| (at + timeout + std::time::Duration::from_secs(1)).duration_since(now).unwrap_or_default())
        .min();
    if pdb["status"] != st {
        let mut o = (*pdb).clone();
        o["status"] = st;
        let key = ObjectKey { gr: pdb_gr(), namespace: ns.into(), name: name.into() };
        inner.put(&key, o, "controller-manager", "status");
    }
    recheck
}

/// kube-apiserver refuses evictions while a budget lists more disrupted pods than this.
const MAX_DISRUPTED_PODS: usize = 2000;

/// POST pods/NAME/eviction.
pub(crate) fn evict(shared: &Shared, ns: &str, name: &str, eviction: &Value, dry_run: bool) -> Result<Value, ApiError> {
    if let Some(n) = eviction["metadata"]["name"].as_str()
        && n != name
    {
        return Err(ApiError::bad_request(format!(
            "name in URL does not match name in Eviction object: {name} vs {n}"
        )));
    }
    let dopts_json = eviction.get("deleteOptions").cloned().unwrap_or(json!({}));
    let mut dopts = DeleteOptions::from_json(&dopts_json)?;
    // the query's dryRun is carried into the delete (eviction.go's propagateDryRun)
    dopts.dry_run |= dry_run;
    if dopts_json["propagationPolicy"].is_null() {
        dopts.propagation = Propagation::Background;
    }
    shared.store.with(|inner| {
        // The UID precondition is the delete's, checked after the budget (kube-apiserver's
        // eviction.go decrements the budget, then deletes with the caller's preconditions): a
        // pod replaced under the same name is refused by its budget first.
        let pod = inner.find(&pods_gr(), ns, name).ok_or_else(|| ApiError::not_found("", "pods", name))?;
        let phase = pod["status"]["phase"].as_str().unwrap_or_default();
        let ignore_pdb =
            !pod["metadata"]["deletionTimestamp"].is_null() || matches!(phase, "Succeeded" | "Failed" | "Pending");
        if !ignore_pdb {
            let pdbs: Vec<Value> = inner
                .iter_ns(&pdb_gr(), Some(ns))
                .map(Stored::value)
                .filter(|p| LabelSelector::from_object(&p["spec"]["selector"]).is_some_and(|s| s.matches(&pod)))
                .map(Arc::unwrap_or_clone)
                .collect();
            if pdbs.len() > 1 {
                // a Status of eviction.go's own, with the code and no reason
                let mut e = ApiError::internal(
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                );
                e.reason = "";
                return Err(e);
            }
            if let Some(pdb) = pdbs.first() {
                // Like kube-apiserver (`checkAndDecrement` in pkg/registry/core/pod/storage/
                // eviction.go), the decision is made on the budget's stored status, which the
                // disruption controller (the control plane here) keeps up to date asynchronously,
                // never on a fresh count of the pods: a client that reads the same status from a
                // watch sees exactly what the server will decide.
                let pdb_name = pdb["metadata"]["name"].as_str().unwrap_or_default().to_string();
                let mut st = pdb["status"].clone();
                let current = st["currentHealthy"].as_i64().unwrap_or(0);
                let desired = st["desiredHealthy"].as_i64().unwrap_or(0);
                let too_many = |cause: String, retry_after: u32| {
                    let mut e = ApiError::too_many_requests(
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                    );
                    let mut details = json!({"causes": [{"reason": "DisruptionBudget", "message": cause}]});
                    if retry_after > 0 {
                        details["retryAfterSeconds"] = json!(retry_after);
                    }
                    e.details = Some(details);
                    e
                };
                let unhealthy_may_go = !pod_healthy(&pod)
                    && (pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
                        || (current >= desired && desired > 0));
                if !unhealthy_may_go {
                    let generation = pdb["metadata"]["generation"].as_i64().unwrap_or(1);
                    if st["observedGeneration"].as_i64().unwrap_or(0) < generation {
                        // eviction.go asks for a retry in 10 s here, in none when the budget is spent
                        return Err(too_many(
                            format!("The disruption budget {pdb_name} is still being processed by the server."),
                            10,
                        ));
                    }
                    let allowed = st["disruptionsAllowed"].as_i64().unwrap_or(0);
                    if allowed < 0 {
                        return Err(ApiError::forbidden(
                            "policy",
                            "poddisruptionbudgets",
                            &pdb_name,
                            "pdb disruptions allowed is negative",
                        ));
                    }
                    if st["disruptedPods"].as_object().is_some_and(|d| d.len() > MAX_DISRUPTED_PODS) {
                        return Err(ApiError::forbidden(
                            "policy",
                            "poddisruptionbudgets",
                            &pdb_name,
                            "DisruptedPods map too big - too many evictions not confirmed by PDB controller",
                        ));
                    }
                    if allowed == 0 {
                        return Err(too_many(
                            format!(
                                "The disruption budget {pdb_name} needs {desired} healthy pods and has {current} currently"
                            ),
                            0,
                        ));
                    }
                    st["disruptionsAllowed"] = json!(allowed - 1);
                    st["disruptedPods"][name] = json!(now_rfc3339());
                    let mut o = pdb.clone();
                    o["status"] = st;
                    let key = ObjectKey { gr: pdb_gr(), namespace: ns.into(), name: pdb_name.as_str().into() };
                    // a dry run checks the budget and leaves it as it is (eviction.go skips its
                    // status update), then the delete's preconditions below
                    if !dopts.dry_run {
                        inner.put(&key, o, "kube-apiserver", "status");
                    }
                }
            }
        }
        inner.delete(&pods_gr(), ns, name, &dopts)?;
        Ok(evicted())
    })
}

/// What an accepted eviction answers.
fn evicted() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})
}
