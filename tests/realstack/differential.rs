//! The emulator (`crates/sandbox-apiserver`) against the real kube-apiserver: the requests the
//! tool makes, sent to both, and the answers compared on what the tool reads (status codes,
//! reasons, causes, the fields it decides on), normalised for what differs by nature (uids,
//! resourceVersions, times, the identity's user name).
//!
//! Every difference is either fixed in the emulator or listed in [`KNOWN`] with why it stays: the
//! test fails on a difference not listed, and on a listed one that went away, so the list stays
//! the truth. The emulator must never be kinder than the real server: a test bed that accepts
//! what the real server refuses hides the tool's bugs.
//!
//! Neither server runs a controller-manager (the emulator's control plane is off): every status a
//! controller would compute (a PodDisruptionBudget's) is written by the test, the same on both.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret};
use k8s_openapi::api::policy::v1::{Eviction, PodDisruptionBudget};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use karpenter_teardown::k8s::objects::{
    FinalizerRemoval, delete_and_remove_finalizer, last_manager_in, remove_finalizer,
};
use karpenter_teardown::k8s::{self, Kube};
use kube::Client;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::KarpenterVersion;
use serde::Serialize;
use serde_json::{Value, json};

use crate::common;

/// Differences between the emulator and the real server that stay, each with why: `case/fact`.
const KNOWN: &[(&str, &str)] = &[
    (
        "deletes/add_finalizer_while_terminating",
        "the real server lists the cause of a finalizer added to a terminating custom resource twice (its generic \
         metadata validation and the custom resource strategy's both report it); same code, reason, field and message",
    ),
    (
        "deletes/delete_foreground",
        "no garbage collector runs on the real stack (no kube-controller-manager), so foregroundDeletion stays; the \
         emulator's store does the collector's part at once, as a real cluster does moments later",
    ),
    (
        "deletes/delete_orphan",
        "no garbage collector runs on the real stack, so the orphan finalizer stays; the emulator's store orphans the \
         dependents and deletes at once, as a real cluster does moments later",
    ),
    (
        "dry_runs/scale",
        "Scale's spec.replicas is omitempty in Go: the real server's answer to a dry-run scale to 0 has no replicas \
         field (as managed_fields/scale); both leave the Deployment's replicas as they were (dry_runs/replicas_after)",
    ),
    (
        "expiry/watch_after_compaction",
        "the real server serves a watch from its watch cache, which keeps at least 75 s of events whatever etcd has \
         compacted, so a watch from a version listed moments ago still replays; the emulator's forgotten history is \
         the cache's window passed, and it answers 410 Expired at once: stricter, never kinder",
    ),
    (
        "lists/bad_continue",
        "a continue token's encoding is each server's own: both refuse a malformed one with 400 BadRequest, in other words",
    ),
    (
        "managed_fields/after_apply",
        "the real server records ownership of a map itself (fieldsV1 `.`), so the creator keeps an entry after a \
         forced apply took its one label; the emulator records leaves only. The tool reads leaves.",
    ),
    (
        "managed_fields/scale",
        "Scale's spec.replicas is omitempty in Go: the real server's answer to a scale to 0 has no replicas field",
    ),
    (
        "managed_fields/scaled",
        "after a scale to 0 through the scale subresource the real server names no owner of spec.replicas (the zero \
         is omitted from the Scale), the emulator names the scaler; once someone scales it up again both name them \
         (managed_fields/scaled_back), which is what the tool reads",
    ),
    (
        "patches/cordon",
        "the real server's TaintNodesByCondition admission adds node.kubernetes.io/not-ready:NoSchedule to every new \
         node until the node lifecycle controller sees it Ready; the emulator's nodes are born ready",
    ),
    (
        "watches/resume_bad_rv",
        "the real server answers a non-numeric resourceVersion on a watch with a 500 (its own unhandled error, logged \
         as such); the emulator with 400 BadRequest. The tool only resumes from versions the server gave it.",
    ),
];

/// One server under test: the harness's identity (cluster-admin) and the tool's (exactly
/// `deploy/rbac.yaml`), with the tool's own client stack.
struct Side {
    admin: Client,
    tool: Client,
    /// How this server forgets its history (see [`Side::forget_history`]).
    history: History,
}

/// What makes a server forget the revisions before now.
enum History {
    /// The emulator's store.
    Emulator(sandbox_apiserver::Store),
    /// The real stack's etcd, by its client URL.
    Etcd(String),
}

impl Side {
    /// Forgets every revision before now, as a real cluster does every 5 minutes: the
    /// emulator's store drops its history; etcd compacts (kube-apiserver compacts it so itself,
    /// `--etcd-compaction-interval`), through its gRPC gateway.
    async fn forget_history(&self) {
        match &self.history {
            History::Emulator(store) => store.forget_history(),
            History::Etcd(url) => {
                let range = etcd_post(url, "/v3/kv/range", &json!({"key": "AA=="})).await;
                let revision = range["header"]["revision"].clone();
                let compacted =
                    etcd_post(url, "/v3/kv/compaction", &json!({"revision": revision, "physical": true})).await;
                assert!(compacted.get("header").is_some(), "etcd compaction: {compacted}");
            }
        }
    }
}

/// One JSON request to etcd's gRPC gateway, over plain HTTP/1.1 on loopback.
async fn etcd_post(url: &str, path: &str, body: &Value) -> Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = url.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(authority).await.unwrap();
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).await.unwrap();
    let json_start = response.find("\r\n\r\n").map_or(0, |i| i + 4);
    // the gateway may answer chunked: the JSON object is between the first `{` and the last `}`
    let text = &response[json_start..];
    let (from, to) = (text.find('{').unwrap_or(0), text.rfind('}').map_or(0, |i| i + 1));
    serde_json::from_str(&text[from..to]).unwrap_or_else(|e| panic!("etcd {path}: {e}: {response}"))
}

/// The etcd client URL of a real stack, from its etcd's command line (the stack does not
/// publish it).
fn etcd_url(stack: &realstack::RealStack) -> String {
    let etcd = stack.pids()[0];
    let cmdline = std::fs::read(format!("/proc/{etcd}/cmdline")).unwrap();
    let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let at = args.iter().position(|a| a == "--listen-client-url").expect("etcd's --listen-client-url");
    args[at + 1].clone()
}

/// What one case saw on one server: facts by name, each normalised.
type Seen = BTreeMap<String, Value>;

/// The tool's client (no silent retries, the API Priority and Fairness layer) from a kubeconfig.
async fn tool_client(kubeconfig: &Path) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    Kube::from_config(config, None).unwrap().client
}

/// A message with what differs by nature replaced: uids, numbers of two digits or more
/// (resourceVersions, generations), and the tool identity's user name (the emulator's and the
/// real stack's differ).
fn norm(msg: &str) -> String {
    let msg = msg.replace(realstack::TOOL_USER, "<tool>").replace(sandbox_apiserver::authz::KUBECONFIG_USER, "<tool>");
    let chars: Vec<char> = msg.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let uuid_len = 36;
        if i + uuid_len <= chars.len() && is_uuid(&chars[i..i + uuid_len]) {
            out.push_str("<uid>");
            i += uuid_len;
            continue;
        }
        if chars[i].is_ascii_digit() {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            if i - start >= 2 {
                out.push('N');
            } else {
                out.extend(&chars[start..i]);
            }
            continue;
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

fn is_uuid(c: &[char]) -> bool {
    c.iter().enumerate().all(|(i, ch)| if [8, 13, 18, 23].contains(&i) { *ch == '-' } else { ch.is_ascii_hexdigit() })
}

/// A refusal as the tool reads it: code, reason, message, causes, the delay asked for.
fn refusal(e: &kube::Error) -> Value {
    match e {
        kube::Error::Api(s) => {
            let causes: Vec<Value> = s
                .details
                .iter()
                .flat_map(|d| &d.causes)
                .map(|c| json!({"reason": c.reason, "field": c.field, "message": norm(&c.message)}))
                .collect();
            json!({
                "code": s.code,
                "reason": s.reason,
                "message": norm(&s.message),
                "causes": causes,
                "retryAfterSeconds": s.details.as_ref().map_or(0, |d| d.retry_after_seconds),
            })
        }
        other => json!({"transport": other.to_string()}),
    }
}

/// An answer: `{"ok": what pick keeps of the object}` or `{"error": refusal}`.
fn answer<T: Serialize>(r: Result<T, kube::Error>, pick: impl FnOnce(&Value) -> Value) -> Value {
    match r {
        Ok(o) => json!({"ok": pick(&serde_json::to_value(o).unwrap())}),
        Err(e) => json!({"error": refusal(&e)}),
    }
}

fn code<T>(r: &Result<T, kube::Error>) -> Value {
    match r {
        Ok(_) => json!("ok"),
        Err(e) => refusal(e),
    }
}

fn pick(v: &Value, pointers: &[&str]) -> Value {
    Value::Object(pointers.iter().map(|p| (p.to_string(), v.pointer(p).cloned().unwrap_or(Value::Null))).collect())
}

fn json_patch(ops: Value) -> Patch<()> {
    Patch::Json(serde_json::from_value(ops).unwrap())
}

fn pp(manager: &str) -> PatchParams {
    PatchParams { field_manager: Some(manager.into()), ..PatchParams::default() }
}

fn release(r: Result<FinalizerRemoval, k8s::KubeError>) -> Value {
    json!(format!("{:?}", r.map_err(|e| e.to_string())))
}

/// The tool's release of `name` (held by the termination finalizer and `example.com/other`):
/// the call's answer and the finalizers the admin still sees, each also asserted on this side.
async fn released<K>(tool: &Api<K>, admin: &Api<K>, name: &str) -> (Value, Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + Serialize + std::fmt::Debug,
{
    let uid = admin.get(name).await.unwrap().meta().uid.clone();
    let r = delete_and_remove_finalizer(tool, name, "karpenter.sh/termination", uid.as_deref()).await;
    assert!(matches!(r, Ok(FinalizerRemoval::Removed)), "{r:?}");
    let left = admin.get_opt(name).await.unwrap().map(|o| o.meta().finalizers.clone());
    assert_eq!(left, Some(Some(vec!["example.com/other".to_string()])));
    (release(r), json!(left))
}

fn post(manager: &str) -> PostParams {
    PostParams { field_manager: Some(manager.into()), ..PostParams::default() }
}

fn node(name: &str, labels: Value) -> Node {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
}

fn rv_of(v: &impl kube::Resource) -> String {
    v.meta().resource_version.clone().unwrap_or_default()
}

async fn namespace(admin: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &ns).await.unwrap();
}

// ---------------------------------------------------------------- cases

/// Lists in pages as `k8s::list_pages` asks for them, and the drain's list of a node's pods.
async fn lists(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let nodes: Api<Node> = Api::all(s.admin.clone());
    for i in 0..5 {
        nodes.create(&post("harness"), &node(&format!("list-{i}"), json!({"diff": "list"}))).await.unwrap();
    }
    let tool: Api<Node> = Api::all(s.tool.clone());
    let mut lp = ListParams::default().labels("diff=list").limit(2);
    let mut pages = Vec::new();
    loop {
        let page = tool.list(&lp).await.unwrap();
        let token = page.metadata.continue_.clone().filter(|t| !t.is_empty());
        pages.push(json!({
            "names": page.items.iter().filter_map(|n| n.metadata.name.clone()).collect::<Vec<_>>(),
            "continues": token.is_some(),
            "remainingItemCount": page.metadata.remaining_item_count,
        }));
        match token {
            Some(t) => lp = lp.continue_token(&t),
            None => break,
        }
    }
    seen.insert("pages".into(), json!(pages));
    let all = k8s::list_pages(&tool, &ListParams::default().labels("diff=list"), |n: Node| n.metadata.name).await;
    seen.insert("list_pages".into(), answer(all, |v| v.clone()));
    let bad = tool.list(&ListParams::default().limit(2).continue_token("not-a-token")).await;
    seen.insert("bad_continue".into(), code(&bad));
    let selector = tool.list(&ListParams::default().labels("diff in (list),!absent")).await;
    seen.insert("set_selector".into(), answer(selector, |v| json!(v["items"].as_array().map_or(0, Vec::len))));

    // the drain lists a node's pods by field selector
    namespace(&s.admin, "lists").await;
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), "lists");
    for (name, on) in [("a", "list-0"), ("b", "list-0"), ("c", "list-1")] {
        pods.create(&post("harness"), &pod(name, on, json!({"app": "x"}))).await.unwrap();
    }
    let tool_pods: Api<Pod> = Api::all(s.tool.clone());
    let on_node = tool_pods.list(&ListParams::default().fields("spec.nodeName=list-0")).await;
    seen.insert(
        "pods_on_node".into(),
        answer(on_node, |v| {
            json!(
                v["items"].as_array().into_iter().flatten().map(|p| p["metadata"]["name"].clone()).collect::<Vec<_>>()
            )
        }),
    );
    let bad_field = tool_pods.list(&ListParams::default().fields("spec.unknownField=x")).await;
    seen.insert("unsupported_field_selector".into(), code(&bad_field));
    seen
}

/// A watch as the tool's watchers hold it (bookmarks on, a timeout), and a resume from a
/// resourceVersion the server no longer holds.
async fn watches(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let admin: Api<Node> = Api::all(s.admin.clone());
    let tool: Api<Node> = Api::all(s.tool.clone());
    let listed = tool.list(&ListParams::default().labels("diff=watch")).await.unwrap();
    let from = listed.metadata.resource_version.clone().unwrap_or_default();
    let started = Instant::now();
    let stream = tool.watch(&WatchParams::default().labels("diff=watch").timeout(5), &from).await.unwrap();
    let writer = async {
        admin.create(&post("harness"), &node("watch-0", json!({"diff": "watch"}))).await.unwrap();
        admin
            .patch("watch-0", &pp("harness"), &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}})))
            .await
            .unwrap();
        // leaving the selector is a DELETED event for this watch
        admin
            .patch("watch-0", &pp("harness"), &Patch::Merge(json!({"metadata": {"labels": {"diff": "gone"}}})))
            .await
            .unwrap();
        admin.create(&post("harness"), &node("watch-1", json!({"diff": "watch"}))).await.unwrap();
        admin.delete("watch-1", &DeleteParams::default()).await.unwrap();
    };
    let reader = stream.collect::<Vec<_>>();
    let ((), events) = tokio::join!(writer, reader);
    let ended_after = started.elapsed();
    let mut kinds = Vec::new();
    let mut bookmarks = 0;
    for ev in events {
        match ev {
            Ok(WatchEvent::Added(n)) => kinds.push(json!(["ADDED", n.metadata.name])),
            Ok(WatchEvent::Modified(n)) => kinds.push(json!(["MODIFIED", n.metadata.name])),
            Ok(WatchEvent::Deleted(n)) => kinds.push(json!(["DELETED", n.metadata.name])),
            Ok(WatchEvent::Bookmark(b)) => {
                assert!(!b.metadata.resource_version.is_empty(), "a bookmark carries a resourceVersion");
                bookmarks += 1;
            }
            Ok(WatchEvent::Error(e)) => kinds.push(json!(["ERROR", e.code, e.reason])),
            Err(e) => kinds.push(json!(["STREAM", e.to_string()])),
        }
    }
    seen.insert("events".into(), json!(kinds));
    // kube-apiserver's watch cache sends a bookmark before a watch times out (2 s before), so a
    // client resumes from the newest resourceVersion
    seen.insert("bookmark_before_timeout".into(), json!(bookmarks > 0));
    seen.insert("ends_at_timeout".into(), json!(ended_after >= Duration::from_secs(4)));

    // A resume from an old resourceVersion: on a fresh real stack the watch falls through to
    // etcd, which keeps every revision until kube-apiserver compacts it (every 5 minutes), so the
    // real server replays from "1" rather than answering 410; the emulator's history begins after
    // its own bootstrap, like a watch cache, and replays as well. (A 410 cannot be provoked on
    // the real stack within a fast suite; the emulator's is worded as the watch cache's.)
    let replayed = tool.watch(&WatchParams::default().timeout(5), "1").await.unwrap();
    let first = replayed.take(1).collect::<Vec<_>>().await;
    let first = match first.into_iter().next() {
        Some(Ok(WatchEvent::Error(e))) => json!({"code": e.code, "reason": e.reason, "message": norm(&e.message)
            .split(':').next().unwrap_or_default()}),
        Some(Ok(other)) => json!(format!("{other:?}")),
        Some(Err(e)) => json!({"stream": e.to_string()}),
        None => json!("nothing"),
    };
    seen.insert("resume_from_rv_1".into(), first);
    let bad_rv = tool.watch(&WatchParams::default().timeout(1), "not-a-number").await.map(|_| ());
    seen.insert("resume_bad_rv".into(), code(&bad_rv));
    seen
}

/// The cordon's JSON patch with a resourceVersion `test`, the finalizer removal's `test` of the
/// list entry, the merge patches with `metadata.resourceVersion` (fence, GitOps pause).
async fn patches(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let admin: Api<Node> = Api::all(s.admin.clone());
    let tool: Api<Node> = Api::all(s.tool.clone());
    let mut n = node("patch-0", json!({}));
    n.spec = Some(serde_json::from_value(json!({"taints": [{"key": "gpu", "effect": "NoSchedule"}]})).unwrap());
    admin.create(&post("harness"), &n).await.unwrap();
    let read = tool.get("patch-0").await.unwrap();
    let old_rv = rv_of(&read);
    let mut fence = vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": old_rv})];
    // the operations `k8s::nodes::fence_ops` makes for a cordoned-not, tainted node
    fence.push(json!({"op": "add", "path": "/spec/unschedulable", "value": true}));
    fence.push(json!({"op": "add", "path": "/spec/taints/-",
                      "value": {"key": k8s::nodes::TAINT_DRAINING, "effect": "NoSchedule"}}));
    let cordon = tool.patch("patch-0", &k8s::objects::patch_params(), &json_patch(json!(fence))).await;
    seen.insert("cordon".into(), answer(cordon, |v| pick(v, &["/spec/unschedulable", "/spec/taints"])));
    // the same patch from the stale read: refused, never applied
    let stale = tool.patch("patch-0", &k8s::objects::patch_params(), &json_patch(json!(fence))).await;
    seen.insert("cordon_stale".into(), code(&stale));
    let outcome = k8s::nodes::cordon_node(&tool, "patch-0", true).await;
    seen.insert("cordon_again".into(), json!(format!("{:?}", outcome.map_err(|e| e.to_string()))));
    let missing = tool.patch("absent", &k8s::objects::patch_params(), &json_patch(json!(fence))).await;
    seen.insert("cordon_missing".into(), code(&missing));

    // finalizers: the `test` pins the entry the remove takes out
    admin
        .patch(
            "patch-0",
            &pp("harness"),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/a", "example.com/b"]}})),
        )
        .await
        .unwrap();
    let wrong = json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "example.com/b"},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]);
    seen.insert("finalizer_test_fails".into(), code(&tool.patch("patch-0", &pp("x"), &json_patch(wrong)).await));
    let beyond = json!([{"op": "remove", "path": "/metadata/finalizers/5"}]);
    seen.insert("finalizer_remove_beyond".into(), code(&tool.patch("patch-0", &pp("x"), &json_patch(beyond)).await));
    let removed = remove_finalizer(&tool, "patch-0", "example.com/b").await.map_err(|e| e.to_string());
    seen.insert("remove_finalizer".into(), json!(format!("{removed:?}")));
    let after = admin.get("patch-0").await.unwrap();
    seen.insert("finalizers_left".into(), json!(after.metadata.finalizers));
    let bad_path = json!([{"op": "add", "path": "/spec/nonexistent/deep", "value": 1}]);
    seen.insert("json_patch_bad_path".into(), code(&tool.patch("patch-0", &pp("x"), &json_patch(bad_path)).await));

    // merge patches carrying the resourceVersion they were computed from
    let current = rv_of(&after);
    let merge = |rv: &str| json!({"metadata": {"resourceVersion": rv, "annotations": {"example.com/fenced": "yes"}}});
    let ok = tool.patch("patch-0", &pp("x"), &Patch::Merge(merge(&current))).await;
    seen.insert("merge_current_rv".into(), answer(ok, |v| pick(v, &["/metadata/annotations"])));
    let conflict = tool.patch("patch-0", &pp("x"), &Patch::Merge(merge(&current))).await;
    seen.insert("merge_stale_rv".into(), code(&conflict));
    let gone = tool.patch("absent", &pp("x"), &Patch::Merge(merge(&current))).await;
    seen.insert("merge_missing".into(), code(&gone));
    // `null` removes a key (the Argo CD pause takes `spec.syncPolicy.automated` out so)
    let null = tool
        .patch("patch-0", &pp("x"), &Patch::Merge(json!({"metadata": {"annotations": {"example.com/fenced": null}}})))
        .await;
    seen.insert("merge_null_removes".into(), answer(null, |v| pick(v, &["/metadata/annotations"])));
    seen
}

/// `managedFields` as the tool reads them (`last_manager_in`) after its own writes and others',
/// and server-side apply's conflicts.
async fn managed_fields(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let admin: Api<Node> = Api::all(s.admin.clone());
    let tool: Api<Node> = Api::all(s.tool.clone());
    admin.create(&post("creator"), &node("managed-0", json!({"team": "a"}))).await.unwrap();
    let managers = |n: &Node| {
        let managed = serde_json::to_value(&n.metadata.managed_fields).unwrap_or(Value::Null);
        let mut entries: Vec<Value> = managed
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| json!([e["manager"], e["operation"], e["subresource"]]))
            .collect();
        entries.sort_by_key(Value::to_string);
        json!({
            "unschedulable": last_manager_in(&managed, &["spec", "unschedulable"]),
            "taints": last_manager_in(&managed, &["spec", "taints"]),
            "team": last_manager_in(&managed, &["metadata", "labels", "team"]),
            "entries": entries,
        })
    };
    seen.insert("created".into(), managers(&tool.get("managed-0").await.unwrap()));
    let read = tool.get("managed-0").await.unwrap();
    let raw = json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv_of(&read)},
        {"op": "add", "path": "/spec/unschedulable", "value": true},
        {"op": "add", "path": "/spec/taints", "value": [{"key": k8s::nodes::TAINT_DRAINING, "effect": "NoSchedule"}]},
    ]);
    let raw = tool.patch("managed-0", &k8s::objects::patch_params(), &json_patch(raw)).await;
    seen.insert("cordon_bare_node".into(), code(&raw));
    let outcome = k8s::nodes::cordon_node(&tool, "managed-0", false).await.map_err(|e| e.to_string());
    seen.insert("cordon".into(), json!(format!("{outcome:?}")));
    seen.insert("cordoned".into(), managers(&tool.get("managed-0").await.unwrap()));
    // someone uncordons: the tool names them from managedFields
    admin.patch("managed-0", &pp("reverter"), &Patch::Merge(json!({"spec": {"unschedulable": false}}))).await.unwrap();
    seen.insert("reverted".into(), managers(&tool.get("managed-0").await.unwrap()));
    let outcome = k8s::nodes::cordon_node(&tool, "managed-0", true).await.map_err(|e| e.to_string());
    seen.insert("recordon".into(), json!(format!("{outcome:?}")));

    // server-side apply: a field another manager owns is a conflict unless forced
    let apply = |team: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "managed-0", "labels": {"team": team}}});
    let applied = admin.patch("managed-0", &PatchParams::apply("applier"), &Patch::Apply(apply("b"))).await;
    seen.insert("apply_over_update".into(), code(&applied));
    let conflict = admin.patch("managed-0", &PatchParams::apply("other"), &Patch::Apply(apply("c"))).await;
    seen.insert("apply_conflict".into(), code(&conflict));
    let forced = admin.patch("managed-0", &PatchParams::apply("other").force(), &Patch::Apply(apply("c"))).await;
    seen.insert("apply_forced".into(), answer(forced, |v| pick(v, &["/metadata/labels/team"])));
    seen.insert("after_apply".into(), managers(&tool.get("managed-0").await.unwrap()));

    // the controller's Deployment scaled through its scale subresource, and scaled back by another
    namespace(&s.admin, "managed").await;
    let deployments: Api<Deployment> = Api::namespaced(s.admin.clone(), "managed");
    deployments.create(&post("helm"), &deployment("karpenter", 2)).await.unwrap();
    let tool_deps: Api<Deployment> = Api::namespaced(s.tool.clone(), "managed");
    let scaled = tool_deps
        .patch_scale("karpenter", &k8s::objects::patch_params(), &Patch::Merge(json!({"spec": {"replicas": 0}})))
        .await;
    seen.insert("scale".into(), answer(scaled, |v| pick(v, &["/kind", "/spec/replicas"])));
    let replicas_manager = |d: &Deployment| {
        let managed = serde_json::to_value(&d.metadata.managed_fields).unwrap_or(Value::Null);
        let mut entries: Vec<Value> = managed
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| json!([e["manager"], e["operation"], e["subresource"]]))
            .collect();
        entries.sort_by_key(Value::to_string);
        json!({"replicas": last_manager_in(&managed, &["spec", "replicas"]), "entries": entries,
               "value": d.spec.as_ref().and_then(|s| s.replicas)})
    };
    seen.insert("scaled".into(), replicas_manager(&tool_deps.get("karpenter").await.unwrap()));
    deployments
        .patch("karpenter", &pp("argocd-controller"), &Patch::Merge(json!({"spec": {"replicas": 1}})))
        .await
        .unwrap();
    seen.insert("scaled_back".into(), replicas_manager(&tool_deps.get("karpenter").await.unwrap()));
    seen
}

/// Evictions as the tool sends them (UID precondition), under budgets whose status the test
/// writes as the disruption controller would.
async fn evictions(s: &Side) -> Seen {
    let mut seen = Seen::new();
    namespace(&s.admin, "evict").await;
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), "evict");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(s.admin.clone(), "evict");
    let running = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
    let mut uids = BTreeMap::new();
    for (name, app, phase) in [
        ("blocked", "a", Some(&running)),
        ("pending", "a", None),
        ("two", "b", Some(&running)),
        ("allowed", "c", Some(&running)),
        ("unobserved", "d", Some(&running)),
        ("unready", "e", Some(&json!({"status": {"phase": "Running"}}))),
        ("free", "none", Some(&running)),
    ] {
        let p = pods.create(&post("harness"), &pod(name, "evict-node", json!({"app": app}))).await.unwrap();
        uids.insert(name, p.metadata.uid.unwrap());
        if let Some(status) = phase {
            pods.patch_status(name, &pp("kubelet"), &Patch::Merge(status)).await.unwrap();
        }
    }
    for (name, app, allowed, observed) in [
        ("a", "a", 0, true),
        ("b1", "b", 1, true),
        ("b2", "b", 1, true),
        ("c", "c", 1, true),
        ("d", "d", 1, false),
        ("e", "e", 0, true),
    ] {
        let pdb: PodDisruptionBudget = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}},
        }))
        .unwrap();
        let created = pdbs.create(&post("harness"), &pdb).await.unwrap();
        let generation = created.metadata.generation.unwrap_or(1);
        let status = json!({"status": {
            "observedGeneration": if observed { generation } else { 0 },
            "currentHealthy": 1 + allowed, "desiredHealthy": 1, "disruptionsAllowed": allowed, "expectedPods": 1 + allowed,
        }});
        pdbs.patch_status(name, &pp("disruption-controller"), &Patch::Merge(status)).await.unwrap();
    }
    let evict = |name: &'static str, uid: String| {
        let client = s.tool.clone();
        async move {
            let api: Api<Pod> = Api::namespaced(client, "evict");
            let eviction = Eviction {
                metadata: ObjectMeta { name: Some(name.into()), namespace: Some("evict".into()), ..Default::default() },
                delete_options: Some(DeleteOptions {
                    preconditions: Some(Preconditions { uid: Some(uid), resource_version: None }),
                    ..Default::default()
                }),
            };
            api.create_subresource::<Eviction, Value>("eviction", name, &PostParams::default(), &eviction).await
        }
    };
    for name in ["blocked", "pending", "two", "allowed", "unobserved", "unready", "free"] {
        let r = evict(name, uids[name].clone()).await;
        seen.insert(format!("evict_{name}"), answer(r, |v| pick(v, &["/kind", "/status", "/code"])));
    }
    let stale_uid = evict("blocked", "00000000-0000-0000-0000-000000000000".into()).await;
    seen.insert("evict_wrong_uid".into(), code(&stale_uid));
    let missing = evict("absent", "00000000-0000-0000-0000-000000000000".into()).await;
    seen.insert("evict_missing".into(), code(&missing));
    // an evicted pod is deleted gracefully: bound to a node, it stays until its kubelet confirms
    let after = pods.get_opt("allowed").await.unwrap();
    seen.insert(
        "evicted_pod".into(),
        json!(after.map(|p| json!({
            "terminating": p.metadata.deletion_timestamp.is_some(),
            "grace": p.metadata.deletion_grace_period_seconds,
        }))),
    );
    let again = evict("allowed", uids["allowed"].clone()).await;
    seen.insert("evict_terminating".into(), answer(again, |v| pick(v, &["/kind", "/status", "/code"])));
    let budget = pdbs.get("c").await.unwrap();
    let st = budget.status.unwrap();
    seen.insert(
        "budget_after".into(),
        json!({"disruptionsAllowed": st.disruptions_allowed,
               "disruptedPods": st.disrupted_pods.map(|d| d.into_keys().collect::<Vec<_>>())}),
    );

    // the tool's own reading of the same answers
    let tool_pods: Api<Pod> = Api::namespaced(s.tool.clone(), "evict");
    for name in ["blocked", "two", "unobserved", "free"] {
        let p = tool_pods.get_opt(name).await.unwrap();
        let outcome = match p.as_ref().and_then(k8s::pods::drainable) {
            Some(r) => format!("{:?}", k8s::pods::evict(&s.tool, &r).await.map_err(|e| e.to_string())),
            None => "gone".into(),
        };
        seen.insert(format!("tool_{name}"), json!(norm(&outcome)));
    }
    let pdb_tool: Api<PodDisruptionBudget> = Api::all(s.tool.clone());
    seen.insert(
        "list_budgets".into(),
        answer(pdb_tool.list(&ListParams::default()).await, |v| json!(v["items"].as_array().map_or(0, Vec::len))),
    );

    // the deadline's delete, with the UID precondition
    let wrong = tool_pods
        .delete(
            "blocked",
            &DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: Some("00000000-0000-0000-0000-000000000000".into()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            },
        )
        .await;
    seen.insert("delete_wrong_uid".into(), code(&wrong));
    seen
}

/// The tool's preflight: SelfSubjectAccessReview for what a plan needs, and a refused request.
async fn access_reviews(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let api: Api<SelfSubjectAccessReview> = Api::all(s.tool.clone());
    let asks = [
        ("patch", "", "nodes", "", ""),
        ("watch", "", "pods", "", ""),
        ("create", "", "pods", "eviction", ""),
        ("delete", "", "pods", "", ""),
        ("list", "policy", "poddisruptionbudgets", "", ""),
        ("patch", "apps", "deployments", "scale", ""),
        ("patch", "apps", "deployments", "", ""),
        ("patch", "apiextensions.k8s.io", "customresourcedefinitions", "", "nodepools.karpenter.sh"),
        ("patch", "apiextensions.k8s.io", "customresourcedefinitions", "", "foos.example.com"),
        ("patch", "apiextensions.k8s.io", "customresourcedefinitions", "", ""),
        ("delete", "karpenter.sh", "nodeclaims", "", ""),
        ("patch", "karpenter.k8s.aws", "ec2nodeclasses", "", ""),
        ("patch", "argoproj.io", "applications", "", ""),
        ("get", "", "secrets", "", ""),
        ("delete", "", "namespaces", "", ""),
    ];
    for (verb, group, resource, sub, name) in asks {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.into()),
                    group: Some(group.into()),
                    resource: Some(resource.into()),
                    subresource: (!sub.is_empty()).then(|| sub.into()),
                    name: (!name.is_empty()).then(|| name.into()),
                    ..ResourceAttributes::default()
                }),
                ..SelfSubjectAccessReviewSpec::default()
            },
            ..SelfSubjectAccessReview::default()
        };
        let r = api.create(&PostParams::default(), &review).await;
        seen.insert(
            format!("review {verb} {group}/{resource}/{sub}/{name}"),
            answer(r, |v| json!({"allowed": v["status"]["allowed"], "denied": v["status"]["denied"]})),
        );
    }
    let secrets: Api<Secret> = Api::namespaced(s.tool.clone(), "kube-system");
    seen.insert("forbidden_list".into(), code(&secrets.list(&ListParams::default()).await));
    let nodes: Api<Node> = Api::all(s.tool.clone());
    seen.insert("forbidden_create".into(), code(&nodes.create(&PostParams::default(), &node("nope", json!({}))).await));
    seen
}

/// Karpenter's real CRDs: the defaults the server fills in, the validation it does (OpenAPI and
/// CEL), the tool's fence and its CRD patch.
async fn karpenter_crds(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let pools: Api<DynamicObject> = Api::all_with(s.admin.clone(), &k8s::nodepool_resource());
    let classes: Api<DynamicObject> = Api::all_with(s.admin.clone(), &k8s::nodeclass_resource());
    let create = |api: &Api<DynamicObject>, v: Value| {
        let api = api.clone();
        async move { api.create(&post("harness"), &serde_json::from_value(v).unwrap()).await }
    };
    let minimal_pool = |name: &str| {
        json!({
            "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name},
            "spec": {"template": {"spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                "requirements": [],
            }}},
        })
    };
    let pool = create(&pools, minimal_pool("defaults")).await;
    seen.insert("nodepool_defaults".into(), answer(pool, |v| v["spec"].clone()));
    let class = create(
        &classes,
        json!({"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": "default"},
               "spec": {"role": "KarpenterNodeRole", "amiSelectorTerms": [{"alias": "al2023@latest"}],
                        "subnetSelectorTerms": [{"tags": {"k": "v"}}], "securityGroupSelectorTerms": [{"tags": {"k": "v"}}]}}),
    )
    .await;
    seen.insert("nodeclass_defaults".into(), answer(class, |v| v["spec"].clone()));

    let mut no_class = minimal_pool("no-class");
    no_class["spec"]["template"]["spec"].as_object_mut().unwrap().remove("nodeClassRef");
    seen.insert("nodepool_missing_required".into(), code(&create(&pools, no_class).await));
    let mut restricted = minimal_pool("restricted");
    restricted["spec"]["template"]["spec"]["requirements"] =
        json!([{"key": "karpenter.sh/nodepool", "operator": "In", "values": ["x"]}]);
    seen.insert("nodepool_cel_restricted_label".into(), code(&create(&pools, restricted).await));
    let mut bad_budget = minimal_pool("bad-budget");
    bad_budget["spec"]["disruption"] = json!({"budgets": [{"nodes": "many"}]});
    seen.insert("nodepool_pattern".into(), code(&create(&pools, bad_budget).await));
    let mut schedule = minimal_pool("schedule");
    schedule["spec"]["disruption"] = json!({"budgets": [{"nodes": "1", "schedule": "@daily"}]});
    seen.insert("nodepool_cel_schedule_needs_duration".into(), code(&create(&pools, schedule).await));
    let both = json!({"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": "both"},
        "spec": {"role": "r", "instanceProfile": "p", "amiSelectorTerms": [{"alias": "al2023@latest"}],
                 "subnetSelectorTerms": [{"tags": {"k": "v"}}], "securityGroupSelectorTerms": [{"tags": {"k": "v"}}]}});
    seen.insert("nodeclass_cel_role_and_profile".into(), code(&create(&classes, both).await));
    let unknown = json!({"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": "unknown"},
        "spec": {"role": "r", "amiSelectorTerms": [{"alias": "al2023@latest"}], "madeUp": true,
                 "subnetSelectorTerms": [{"tags": {"k": "v"}}], "securityGroupSelectorTerms": [{"tags": {"k": "v"}}]}});
    let pruned = create(&classes, unknown).await;
    seen.insert("nodeclass_unknown_field_pruned".into(), answer(pruned, |v| json!(v["spec"].get("madeUp").is_some())));

    // the tool's fence on a dynamic pool, and on a static one (`limits.nodes` only)
    let ctx_pools: Api<DynamicObject> = Api::all_with(s.tool.clone(), &k8s::nodepool_resource());
    let current = ctx_pools.get("defaults").await.unwrap();
    let fence = json!({
        "metadata": {"resourceVersion": current.metadata.resource_version,
                     "annotations": {"karpenter-teardown.io/fenced": "{}"}},
        "spec": {"limits": karpenter_teardown::karpenter::fence_limits(&current.data["spec"]),
                 "disruption": {"budgets": [{"nodes": "0"}]}},
    });
    let fenced = ctx_pools.patch("defaults", &k8s::objects::patch_params(), &Patch::Merge(&fence)).await;
    seen.insert("fence".into(), answer(fenced, |v| pick(v, &["/spec/limits", "/spec/disruption"])));
    let again = ctx_pools.patch("defaults", &k8s::objects::patch_params(), &Patch::Merge(&fence)).await;
    seen.insert("fence_stale".into(), code(&again));
    let mut fixed = minimal_pool("static");
    fixed["spec"]["replicas"] = json!(2);
    let created = create(&pools, fixed).await;
    seen.insert("static_pool".into(), code(&created));
    if created.is_ok() {
        let current = ctx_pools.get("static").await.unwrap();
        let wrong = json!({"spec": {"limits": {"cpu": "0"}}});
        seen.insert("static_fence_cpu".into(), code(&ctx_pools.patch("static", &pp("x"), &Patch::Merge(&wrong)).await));
        let fence = json!({"metadata": {"resourceVersion": current.metadata.resource_version},
            "spec": {"limits": karpenter_teardown::karpenter::fence_limits(&current.data["spec"]),
                     "disruption": {"budgets": [{"nodes": "0"}]}}});
        let r = ctx_pools.patch("static", &k8s::objects::patch_params(), &Patch::Merge(&fence)).await;
        seen.insert("static_fence".into(), answer(r, |v| pick(v, &["/spec/limits", "/spec/replicas"])));
    }

    // the CRD patch the tool makes before the controller goes (conversion to None)
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(s.tool.clone());
    let crd = crds.get("nodepools.karpenter.sh").await;
    seen.insert("crd_get".into(), code(&crd));
    if let Ok(crd) = crd {
        let patch = json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": crd.metadata.resource_version},
            {"op": "replace", "path": "/spec/conversion", "value": {"strategy": "None"}},
        ]);
        let r = crds.patch("nodepools.karpenter.sh", &k8s::objects::patch_params(), &json_patch(patch.clone())).await;
        seen.insert("crd_conversion_none".into(), answer(r, |v| v["spec"]["conversion"].clone()));
        let r = crds.patch("nodepools.karpenter.sh", &k8s::objects::patch_params(), &json_patch(patch)).await;
        seen.insert("crd_conversion_stale".into(), code(&r));
    }
    seen.insert("crd_not_named".into(), code(&crds.get("nodes.example.com").await));
    seen
}

/// Argo CD's and Flux's own CRDs (`sandbox_sim::gitops_crds`): what the simulated controllers
/// write (valid objects, an `operationState`, a Flux condition through the status subresource),
/// what the schemas refuse (required fields, enums, patterns, CEL), and the tool's pause of each.
async fn gitops_crds(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let ar = |group: &str, version: &str, kind: &str, plural: &str| {
        kube::core::ApiResource::from_gvk_with_plural(&kube::core::GroupVersionKind::gvk(group, version, kind), plural)
    };
    let apps_ar = ar("argoproj.io", "v1alpha1", "Application", "applications");
    let ks_ar = ar("kustomize.toolkit.fluxcd.io", "v1", "Kustomization", "kustomizations");
    let hr_ar = ar("helm.toolkit.fluxcd.io", "v2", "HelmRelease", "helmreleases");
    namespace(&s.admin, "gitops").await;
    let api = |c: &Client, ar: &kube::core::ApiResource| Api::<DynamicObject>::namespaced_with(c.clone(), "gitops", ar);
    let (apps, kss, hrs) = (api(&s.admin, &apps_ar), api(&s.admin, &ks_ar), api(&s.admin, &hr_ar));
    let create = |api: &Api<DynamicObject>, v: Value| {
        let api = api.clone();
        async move { api.create(&post("harness"), &serde_json::from_value(v).unwrap()).await }
    };
    let app = |name: &str| {
        json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "Application", "metadata": {"name": name, "namespace": "gitops"},
               "spec": {"project": "default", "source": {"repoURL": "https://git.example.com/p.git", "path": "p"},
                        "destination": {"server": "https://kubernetes.default.svc", "namespace": "kube-system"},
                        "syncPolicy": {"automated": {"selfHeal": true, "prune": true}}}})
    };
    let ks = |name: &str| {
        json!({"apiVersion": "kustomize.toolkit.fluxcd.io/v1", "kind": "Kustomization",
               "metadata": {"name": name, "namespace": "gitops"},
               "spec": {"interval": "1m", "path": "./p", "prune": true, "sourceRef": {"kind": "GitRepository", "name": "p"}}})
    };
    let hr = |name: &str| {
        json!({"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease", "metadata": {"name": name, "namespace": "gitops"},
               "spec": {"interval": "5m", "driftDetection": {"mode": "enabled"},
                        "chart": {"spec": {"chart": "karpenter", "sourceRef": {"kind": "HelmRepository", "name": "k"}}}}})
    };
    let mut with_state = app("app");
    with_state["status"] = json!({"operationState": {"operation": {"sync": {"revision": "HEAD"}}, "phase": "Running",
                                                     "startedAt": "2026-01-01T00:00:00Z"},
                                  "resources": [{"group": "karpenter.sh", "kind": "NodePool", "name": "p", "status": "Synced"}]});
    let created = create(&apps, with_state).await;
    seen.insert("application".into(), answer(created, |v| pick(v, &["/spec", "/status"])));
    let mut partial = app("partial-state");
    partial["status"] = json!({"operationState": {"phase": "Running"}});
    seen.insert("application_partial_operation_state".into(), code(&create(&apps, partial).await));
    let mut no_destination = app("no-destination");
    no_destination["spec"].as_object_mut().unwrap().remove("destination");
    seen.insert("application_missing_destination".into(), code(&create(&apps, no_destination).await));
    let mut unknown = app("unknown");
    unknown["spec"]["madeUp"] = json!(true);
    let pruned = create(&apps, unknown).await;
    seen.insert(
        "application_unknown_field_pruned".into(),
        answer(pruned, |v| json!(v["spec"].get("madeUp").is_some())),
    );

    seen.insert("kustomization".into(), answer(create(&kss, ks("ks")).await, |v| v["spec"].clone()));
    let mut bad_kind = ks("bad-kind");
    bad_kind["spec"]["sourceRef"]["kind"] = json!("HelmRepository");
    seen.insert("kustomization_enum".into(), code(&create(&kss, bad_kind).await));
    let mut bad_interval = ks("bad-interval");
    bad_interval["spec"]["interval"] = json!("a minute");
    seen.insert("kustomization_pattern".into(), code(&create(&kss, bad_interval).await));
    let mut both = ks("both-refs");
    both["spec"]["kubeConfig"] = json!({"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}});
    seen.insert("kustomization_cel_kubeconfig".into(), code(&create(&kss, both).await));
    let condition = |with_time: bool| {
        let mut c = json!({"type": "Reconciling", "status": "True", "reason": "Progressing", "message": "m"});
        if with_time {
            c["lastTransitionTime"] = json!("2026-01-01T00:00:00Z");
        }
        json!({"status": {"conditions": [c]}})
    };
    let status = |patch: Value| {
        let kss = kss.clone();
        async move { kss.patch_status("ks", &pp("kustomize-controller"), &Patch::Merge(patch)).await }
    };
    seen.insert("kustomization_condition_without_time".into(), code(&status(condition(false)).await));
    seen.insert(
        "kustomization_condition".into(),
        answer(status(condition(true)).await, |v| v["status"]["conditions"].clone()),
    );

    seen.insert("helmrelease".into(), answer(create(&hrs, hr("hr")).await, |v| v["spec"].clone()));
    let mut no_source = hr("no-source");
    no_source["spec"]["chart"]["spec"].as_object_mut().unwrap().remove("sourceRef");
    seen.insert("helmrelease_missing_source".into(), code(&create(&hrs, no_source).await));
    let mut both = hr("chart-and-ref");
    both["spec"]["chartRef"] = json!({"kind": "OCIRepository", "name": "k"});
    seen.insert("helmrelease_cel_chart_or_ref".into(), code(&create(&hrs, both).await));

    // the tool's pause as it writes it (crate::k8s::gitops::pause), as the tool's identity
    for (fact, ar, name, patch) in [
        (
            "pause_application",
            &apps_ar,
            "app",
            json!({"metadata": {"annotations": {
            karpenter_teardown::gitops::PAUSED_AUTOMATED_ANNOTATION: "{}"}}, "spec": {"syncPolicy": {"automated": null}}}),
        ),
        (
            "pause_kustomization",
            &ks_ar,
            "ks",
            json!({"metadata": {"annotations": {
            "reconcile.fluxcd.io/requestedAt": "t"}}, "spec": {"suspend": true}}),
        ),
        (
            "pause_helmrelease",
            &hr_ar,
            "hr",
            json!({"metadata": {"annotations": {
            "reconcile.fluxcd.io/requestedAt": "t"}}, "spec": {"suspend": true}}),
        ),
    ] {
        let tool = api(&s.tool, ar);
        let current = tool.get(name).await;
        seen.insert(format!("{fact}_get"), code(&current));
        let Ok(current) = current else { continue };
        let mut patch = patch;
        patch["metadata"]["resourceVersion"] = json!(current.metadata.resource_version);
        let r = tool.patch(name, &k8s::objects::patch_params(), &Patch::Merge(&patch)).await;
        seen.insert(fact.into(), answer(r, |v| pick(v, &["/spec/syncPolicy", "/spec/suspend"])));
    }
    seen
}

/// A delete's answer: the object when it stays (finalizers), or the server's `Status` when it is
/// gone (kube's `Either`, whose crate the tests do not name).
macro_rules! describe {
    ($r:expr) => {
        match $r {
            Ok(e) => match e.left() {
                Some(o) => json!({"object": {
                    "terminating": o.metadata.deletion_timestamp.is_some(), "finalizers": o.metadata.finalizers}}),
                None => json!("status"),
            },
            Err(e) => json!({"error": refusal(&e)}),
        }
    };
}

/// A NodeClaim held by Karpenter's termination finalizer.
fn held_claim(name: &str) -> Value {
    json!({
        "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
        "metadata": {"name": name, "finalizers": ["karpenter.sh/termination"]},
        "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                 "requirements": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]},
    })
}

/// Deletes: of objects with finalizers (Karpenter's termination finalizer), with propagation
/// policies, of what is gone, and the writes a terminating object refuses.
async fn deletes(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let admin_claims: Api<DynamicObject> = Api::all_with(s.admin.clone(), &k8s::nodeclaim_resource());
    let claims: Api<DynamicObject> = Api::all_with(s.tool.clone(), &k8s::nodeclaim_resource());
    let claim = held_claim("claim-0");
    let created = admin_claims.create(&post("karpenter"), &serde_json::from_value(claim.clone()).unwrap()).await;
    seen.insert("nodeclaim_create".into(), answer(created, |v| v["spec"].clone()));
    let exists = admin_claims.create(&post("karpenter"), &serde_json::from_value(claim.clone()).unwrap()).await;
    seen.insert("create_existing".into(), code(&exists));
    seen.insert("delete_with_finalizer".into(), describe!(claims.delete("claim-0", &DeleteParams::default()).await));
    seen.insert("delete_again".into(), describe!(claims.delete("claim-0", &DeleteParams::default()).await));
    let add = admin_claims
        .patch(
            "claim-0",
            &pp("x"),
            &Patch::Merge(json!({"metadata": {"finalizers": ["karpenter.sh/termination", "example.com/late"]}})),
        )
        .await;
    seen.insert("add_finalizer_while_terminating".into(), code(&add));
    let removed = remove_finalizer(&claims, "claim-0", "karpenter.sh/termination").await.map_err(|e| e.to_string());
    seen.insert("remove_finalizer".into(), json!(format!("{removed:?}")));
    seen.insert("after_last_finalizer".into(), code(&claims.get("claim-0").await));
    let absent = remove_finalizer(&claims, "claim-0", "karpenter.sh/termination").await.map_err(|e| e.to_string());
    seen.insert("remove_finalizer_gone".into(), json!(format!("{:?}", absent.map(|r| r == FinalizerRemoval::Absent))));
    seen.insert("delete_missing".into(), code(&claims.delete("claim-0", &DeleteParams::default()).await));
    let if_present = k8s::objects::delete_if_present(&claims, "claim-0").await.map_err(|e| e.to_string());
    seen.insert("delete_if_present_missing".into(), json!(format!("{if_present:?}")));

    // a release's delete and finalizer removal, which starts from the object the delete answers
    // with: exactly the termination finalizer goes, another stays, and the object with it
    let held = json!(["karpenter.sh/termination", "example.com/other"]);
    let mut claim1 = claim.clone();
    claim1["metadata"] = json!({"name": "claim-1", "finalizers": held});
    admin_claims.create(&post("karpenter"), &serde_json::from_value(claim1).unwrap()).await.unwrap();
    let admin_nodes: Api<Node> = Api::all(s.admin.clone());
    let nodes: Api<Node> = Api::all(s.tool.clone());
    let node1: Node = serde_json::from_value(json!({"metadata": {"name": "release-0", "finalizers": held}})).unwrap();
    admin_nodes.create(&post("karpenter"), &node1).await.unwrap();
    let (answered, left) = released(&claims, &admin_claims, "claim-1").await;
    seen.insert("release_claim".into(), answered);
    seen.insert("release_claim_left".into(), left);
    let (answered, left) = released(&nodes, &admin_nodes, "release-0").await;
    seen.insert("release_node".into(), answered);
    seen.insert("release_node_left".into(), left);
    let again = delete_and_remove_finalizer(&nodes, "release-0", "karpenter.sh/termination", None).await;
    seen.insert("release_node_again".into(), release(again));
    let clear = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    let claim_cleared = admin_claims.patch("claim-1", &pp("x"), &clear).await.is_ok();
    seen.insert("release_claim_cleared".into(), json!(claim_cleared));
    let old_uid = admin_nodes.get("release-0").await.unwrap().metadata.uid;
    let node_cleared = admin_nodes.patch("release-0", &pp("x"), &clear).await.is_ok();
    seen.insert("release_node_cleared".into(), json!(node_cleared));
    let gone = delete_and_remove_finalizer(&nodes, "release-0", "karpenter.sh/termination", None).await;
    seen.insert("release_node_gone".into(), release(gone));
    // a Node made again under the released one's name is another machine's: a release that read
    // the old one (its UID) leaves the new one as it is
    let node_again: Node =
        serde_json::from_value(json!({"metadata": {"name": "release-0", "finalizers": held}})).unwrap();
    admin_nodes.create(&post("karpenter"), &node_again).await.unwrap();
    let replaced =
        delete_and_remove_finalizer(&nodes, "release-0", "karpenter.sh/termination", old_uid.as_deref()).await;
    assert!(matches!(replaced, Ok(FinalizerRemoval::Replaced)), "{replaced:?}");
    seen.insert("release_node_replaced".into(), release(replaced));
    let new_node = admin_nodes.get("release-0").await.unwrap();
    assert!(new_node.metadata.deletion_timestamp.is_none(), "the new Node was not deleted");
    seen.insert("release_node_replaced_left".into(), json!(new_node.metadata.finalizers));
    admin_nodes.patch("release-0", &pp("x"), &clear).await.unwrap();
    admin_nodes.delete("release-0", &Default::default()).await.unwrap();

    // propagation policies on a Deployment: the garbage collector's part (foreground and orphan
    // finalizers) is a controller's, and there is none here
    namespace(&s.admin, "deletes").await;
    let deployments: Api<Deployment> = Api::namespaced(s.admin.clone(), "deletes");
    for (name, dp) in [
        ("background", DeleteParams::background()),
        ("foreground", DeleteParams::foreground()),
        ("orphan", DeleteParams::orphan()),
    ] {
        deployments.create(&post("helm"), &deployment(name, 1)).await.unwrap();
        let r = deployments.delete(name, &dp).await;
        let first = describe!(r);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let left = deployments.get_opt(name).await.unwrap().map(|d| d.metadata.finalizers);
        seen.insert(format!("delete_{name}"), json!({"answer": first, "left": left}));
    }
    let bad = deployments
        .delete(
            "absent",
            &DeleteParams { propagation_policy: None, grace_period_seconds: Some(0), ..DeleteParams::default() },
        )
        .await;
    seen.insert("delete_missing_deployment".into(), code(&bad));
    seen
}

fn pod(name: &str, node_name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node_name, "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
    }))
    .unwrap()
}

fn deployment(name: &str, replicas: i32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "karpenter"}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}},
                         "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}},
        },
    }))
    .unwrap()
}

// ---------------------------------------------------------------- the comparison

/// What an old resourceVersion and an old continue token get once the server's history is
/// gone: 410 Expired, which the tool's watchers answer by listing again.
async fn expiry(s: &Side) -> Seen {
    let mut seen = Seen::new();
    let admin: Api<Node> = Api::all(s.admin.clone());
    let tool: Api<Node> = Api::all(s.tool.clone());
    for i in 0..3 {
        admin.create(&post("harness"), &node(&format!("expiry-{i}"), json!({"diff": "expiry"}))).await.unwrap();
    }
    let first = tool.list(&ListParams::default().labels("diff=expiry").limit(2)).await.unwrap();
    let token = first.metadata.continue_.clone().unwrap_or_default();
    let listed_at = first.metadata.resource_version.clone().unwrap_or_default();
    admin.create(&post("harness"), &node("expiry-late", json!({"diff": "expiry"}))).await.unwrap();
    s.forget_history().await;
    // kube-apiserver 1.34 continues a paged list from its watch cache's snapshot
    // (ListFromCacheSnapshot, beta and on by default since 1.34: apiserver's pkg/features), not
    // from etcd, so compaction does not expire a fresh token: the emulator must not expire it
    let continued = tool.list(&ListParams::default().labels("diff=expiry").limit(2).continue_token(&token)).await;
    seen.insert("continue_after_compaction".into(), code(&continued));
    let watch = tool.watch(&WatchParams::default().timeout(3), &listed_at).await.unwrap();
    let first = watch.take(1).collect::<Vec<_>>().await;
    let first = match first.into_iter().next() {
        Some(Ok(WatchEvent::Error(e))) => json!({"code": e.code, "reason": e.reason, "message": norm(&e.message)}),
        Some(Ok(other)) => json!(format!("{other:?}")),
        Some(Err(e)) => json!({"stream": e.to_string()}),
        None => json!("nothing"),
    };
    seen.insert("watch_after_compaction".into(), first);
    // the tool's pod index and budget watchers: kube's watcher lists again on 410
    let events = kube::runtime::watcher(tool.clone(), kube::runtime::watcher::Config::default().labels("diff=expiry"))
        .take(6)
        .map(|e| match e {
            Ok(kube::runtime::watcher::Event::Init) => "Init".to_string(),
            Ok(kube::runtime::watcher::Event::InitApply(n)) => {
                format!("InitApply {}", n.metadata.name.unwrap_or_default())
            }
            Ok(kube::runtime::watcher::Event::InitDone) => "InitDone".to_string(),
            Ok(other) => format!("{other:?}"),
            Err(e) => format!("error {e}"),
        })
        .collect::<Vec<_>>()
        .await;
    seen.insert("watcher_relists".into(), json!(events));
    seen
}

/// Every case on one server, in order.
/// The admission check's dry runs (`dryRun=All`) of each kind of write, as the tool's identity:
/// the answers, and that nothing changed (the objects, a budget's status, the replicas).
async fn dry_runs(s: &Side) -> Seen {
    let mut seen = Seen::new();
    namespace(&s.admin, "dry").await;
    let dry_patch = PatchParams { dry_run: true, ..pp("karpenter-teardown") };
    let dry_delete = DeleteParams { dry_run: true, ..DeleteParams::default() };
    // a node: cordoned, then deleted, both dry
    let nodes: Api<Node> = Api::all(s.admin.clone());
    nodes.create(&post("harness"), &node("dry-node", json!({"diff": "dry"}))).await.unwrap();
    let tool_nodes: Api<Node> = Api::all(s.tool.clone());
    let cordon = json_patch(json!([{"op": "add", "path": "/spec/unschedulable", "value": true}]));
    let r = tool_nodes.patch("dry-node", &dry_patch, &cordon).await;
    seen.insert("cordon".into(), answer(r, |v| pick(v, &["/spec/unschedulable", "/metadata/name"])));
    let after = nodes.get("dry-node").await.unwrap();
    seen.insert("cordon_stored".into(), json!(after.spec.and_then(|s| s.unschedulable)));
    let r = tool_nodes.delete("dry-node", &dry_delete).await;
    seen.insert("delete_node".into(), code(&r));
    seen.insert("node_after_delete".into(), code(&nodes.get("dry-node").await));
    // a NodeClaim with the termination finalizer: the release patch and the delete
    let admin_claims: Api<DynamicObject> = Api::all_with(s.admin.clone(), &k8s::nodeclaim_resource());
    let claims: Api<DynamicObject> = Api::all_with(s.tool.clone(), &k8s::nodeclaim_resource());
    let claim = held_claim("dry-claim");
    admin_claims.create(&post("karpenter"), &serde_json::from_value(claim).unwrap()).await.unwrap();
    let release = json_patch(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "karpenter.sh/termination"},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]));
    let r = claims.patch("dry-claim", &dry_patch, &release).await;
    seen.insert("release".into(), answer(r, |v| pick(v, &["/metadata/finalizers"])));
    let r = claims.delete("dry-claim", &dry_delete).await;
    seen.insert("delete_claim".into(), describe!(r));
    let stored = admin_claims.get("dry-claim").await.unwrap();
    seen.insert(
        "claim_stored".into(),
        json!({"finalizers": stored.metadata.finalizers, "deleting": stored.metadata.deletion_timestamp.is_some()}),
    );
    // an eviction a budget allows, and one it refuses: the budget's status is not spent
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), "dry");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(s.admin.clone(), "dry");
    let running = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
    let mut uids = BTreeMap::new();
    for (name, app) in [("free", "f"), ("held", "h")] {
        let p = pods.create(&post("harness"), &pod(name, "dry-node", json!({"app": app}))).await.unwrap();
        uids.insert(name, p.metadata.uid.unwrap());
        pods.patch_status(name, &pp("kubelet"), &Patch::Merge(&running)).await.unwrap();
    }
    for (name, app, allowed) in [("f", "f", 1), ("h", "h", 0)] {
        let pdb: PodDisruptionBudget = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"minAvailable": 0, "selector": {"matchLabels": {"app": app}}},
        }))
        .unwrap();
        let created = pdbs.create(&post("harness"), &pdb).await.unwrap();
        let status = json!({"status": {
            "observedGeneration": created.metadata.generation.unwrap_or(1),
            "currentHealthy": 1, "desiredHealthy": 1 - allowed, "disruptionsAllowed": allowed, "expectedPods": 1,
        }});
        pdbs.patch_status(name, &pp("disruption-controller"), &Patch::Merge(status)).await.unwrap();
    }
    let tool_pods: Api<Pod> = Api::namespaced(s.tool.clone(), "dry");
    for name in ["free", "held"] {
        let eviction = Eviction {
            metadata: ObjectMeta { name: Some(name.into()), namespace: Some("dry".into()), ..Default::default() },
            delete_options: Some(DeleteOptions {
                dry_run: Some(vec!["All".into()]),
                preconditions: Some(Preconditions { uid: Some(uids[name].clone()), resource_version: None }),
                ..Default::default()
            }),
        };
        let params = PostParams { dry_run: true, ..PostParams::default() };
        let r = tool_pods.create_subresource::<Eviction, Value>("eviction", name, &params, &eviction).await;
        seen.insert(format!("evict_{name}"), answer(r, |v| pick(v, &["/kind", "/status", "/code"])));
        let p = pods.get(name).await.unwrap();
        seen.insert(format!("pod_{name}_after"), json!(p.metadata.deletion_timestamp.is_some()));
    }
    let budget = pdbs.get("f").await.unwrap().status.unwrap();
    seen.insert(
        "budget_after".into(),
        json!({"disruptionsAllowed": budget.disruptions_allowed, "disrupted": budget.disrupted_pods.map_or(0, |d| d.len())}),
    );
    // the controller's scale to zero
    let deployments: Api<Deployment> = Api::namespaced(s.admin.clone(), "dry");
    deployments.create(&post("harness"), &deployment("karpenter", 2)).await.unwrap();
    let tool_deployments: Api<Deployment> = Api::namespaced(s.tool.clone(), "dry");
    let r =
        tool_deployments.patch_scale("karpenter", &dry_patch, &Patch::Merge(json!({"spec": {"replicas": 0}}))).await;
    seen.insert("scale".into(), answer(r, |v| pick(v, &["/kind", "/spec/replicas"])));
    let d = deployments.get("karpenter").await.unwrap();
    seen.insert("replicas_after".into(), json!(d.spec.and_then(|s| s.replicas)));
    seen
}

async fn run_all(s: &Side) -> BTreeMap<&'static str, Seen> {
    let mut all = BTreeMap::new();
    all.insert("lists", lists(s).await);
    all.insert("patches", patches(s).await);
    all.insert("managed_fields", managed_fields(s).await);
    all.insert("evictions", evictions(s).await);
    all.insert("access_reviews", access_reviews(s).await);
    all.insert("karpenter_crds", karpenter_crds(s).await);
    all.insert("gitops_crds", gitops_crds(s).await);
    all.insert("deletes", deletes(s).await);
    all.insert("dry_runs", dry_runs(s).await);
    all.insert("watches", watches(s).await);
    // last: it makes the server forget its history
    all.insert("expiry", expiry(s).await);
    all
}

/// `case/fact` → (emulator, real) for every fact the two saw differently.
fn differences(
    emulator: &BTreeMap<&'static str, Seen>,
    real: &BTreeMap<&'static str, Seen>,
) -> BTreeMap<String, (Value, Value)> {
    let mut out = BTreeMap::new();
    for case in emulator.keys().chain(real.keys()).collect::<BTreeSet<_>>() {
        let (e, r) = (emulator.get(case), real.get(case));
        let facts: BTreeSet<&String> = e.into_iter().chain(r).flat_map(|s| s.keys()).collect();
        for fact in facts {
            let ev = e.and_then(|s| s.get(fact)).cloned().unwrap_or(Value::Null);
            let rv = r.and_then(|s| s.get(fact)).cloned().unwrap_or(Value::Null);
            if ev != rv {
                out.insert(format!("{case}/{fact}"), (ev, rv));
            }
        }
    }
    out
}

#[test]
fn the_comparison_names_each_fact_that_differs() {
    let seen = |v: Value| -> BTreeMap<&'static str, Seen> {
        BTreeMap::from([("c", v.as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect())])
    };
    let d = differences(&seen(json!({"same": 1, "other": 2, "only_e": 3})), &seen(json!({"same": 1, "other": 4})));
    assert_eq!(d.keys().collect::<Vec<_>>(), ["c/only_e", "c/other"]);
    assert_eq!(norm("uid 4c1f0b53-9a43-4f57-8e0f-6a4b1d2c3e4f at rv 12345 needs 1"), "uid <uid> at rv N needs 1");
}

async fn emulator_side(dir: &Path) -> (ApiServer, Side) {
    let server = ApiServer::start(ServerOptions {
        control_plane: false,
        rbac: Some(common::e2e::shipped_rbac()),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let kubeconfig = dir.join("emulator.kubeconfig");
    server.write_kubeconfig(&kubeconfig, "differential").unwrap();
    let admin = Client::try_from(server.kube_config()).unwrap();
    let tool = tool_client(&kubeconfig).await;
    let history = History::Emulator(server.store());
    (server, Side { admin, tool, history })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulator_answers_the_tools_requests_as_the_real_server_does() {
    let started = Instant::now();
    let rbac = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml")).unwrap();
    let real_stack = realstack::RealStack::start("differential", &rbac).await.unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let (_server, emulator) = emulator_side(dir.path()).await;
    let real = Side {
        admin: real_stack.admin_client().await.unwrap(),
        tool: tool_client(real_stack.tool_kubeconfig()).await,
        history: History::Etcd(etcd_url(&real_stack)),
    };
    let crds = common::e2e::real_crds(KarpenterVersion::default());
    let gitops_crds = common::e2e::gitops_crds();
    for s in [&emulator, &real] {
        sandbox_sim::world::install_crds(&s.admin, KarpenterVersion::default(), Some(&crds)).await.unwrap();
        sandbox_sim::world::create_crds(&s.admin, gitops_crds.clone()).await.unwrap();
    }
    eprintln!("both servers ready in {:?}", started.elapsed());

    // both at once: the suite takes as long as the slower server
    let (seen_emulator, seen_real) = tokio::join!(run_all(&emulator), run_all(&real));
    eprintln!("cases run on both in {:?}", started.elapsed());

    // the real server's answers the comparison is anchored on: were these to change (a
    // broken case, another server version), agreement would prove nothing
    let real_fact = |case: &str, fact: &str| seen_real[case].get(fact).cloned().unwrap_or(Value::Null);
    assert_eq!(real_fact("watches", "events").as_array().map(Vec::len), Some(5), "{}", real_fact("watches", "events"));
    assert_eq!(real_fact("evictions", "evict_blocked")["error"]["code"], 429);
    assert_eq!(real_fact("evictions", "evict_allowed")["ok"]["/status"], "Success");
    assert_eq!(real_fact("karpenter_crds", "static_fence_cpu")["code"], 422);
    assert_eq!(real_fact("patches", "cordon_stale")["code"], 422);
    assert_eq!(real_fact("expiry", "continue_after_compaction"), "ok");
    // a dry run answers as the write would and stores nothing
    assert_eq!(real_fact("dry_runs", "cordon")["ok"]["/spec/unschedulable"], true);
    assert_eq!(real_fact("dry_runs", "cordon_stored"), Value::Null);
    assert_eq!(real_fact("dry_runs", "node_after_delete"), "ok");
    assert_eq!(real_fact("dry_runs", "evict_held")["error"]["code"], 429);
    assert_eq!(real_fact("dry_runs", "evict_free")["ok"]["/status"], "Success");
    assert_eq!(real_fact("dry_runs", "pod_free_after"), false);
    assert_eq!(real_fact("dry_runs", "replicas_after"), 2);

    let found = differences(&seen_emulator, &seen_real);
    let known: BTreeMap<&str, &str> = KNOWN.iter().copied().collect();
    let mut report = String::new();
    for (fact, (e, r)) in &found {
        // shown when the test fails, or with --nocapture
        eprintln!("{fact}:\n  emulator: {e}\n  real:     {r}");
        if !known.contains_key(fact.as_str()) {
            report.push_str(&format!("\nnew difference {fact}:\n  emulator: {e}\n  real:     {r}\n"));
        }
    }
    for fact in known.keys() {
        if !found.contains_key(*fact) {
            report.push_str(&format!("\n{fact} is listed as a known difference but both servers now agree\n"));
        }
    }
    assert!(report.is_empty(), "{report}\nkube-apiserver:\n{}", real_stack.log_tail("kube-apiserver"));
}
