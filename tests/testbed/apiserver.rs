//! The sandbox API server through `kube::Client` over HTTP: one test per semantic the teardown
//! tool depends on (design §4).

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use kube::{Client, Error};
use sandbox_apiserver::ApiServer;
use sandbox_apiserver::{ErrorRule, FaultConfig, GroupResource, ListOptions, ServerOptions, WriteOptions};
use sandbox_sim::karpenter_crds::karpenter_crds;
use serde_json::{Value, json};

async fn server(control_plane: bool) -> (ApiServer, Client) {
    let opts = ServerOptions { time_scale: 0.01, control_plane, ..Default::default() };
    let s = ApiServer::start(opts).await.unwrap();
    let c = Client::try_from(s.kube_config()).unwrap();
    (s, c)
}

fn code(e: Error) -> (u16, String, Value) {
    match e {
        Error::Api(s) => {
            let v = serde_json::to_value(&s).unwrap();
            (s.code, s.reason.clone(), v)
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn node(name: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {"pods": "110"},
            "addresses": [{"type": "InternalIP", "address": "10.0.0.9"}], "nodeInfo": {"kubeletVersion": "v1.34.1"}}
    }))
    .unwrap()
}

fn cm(name: &str, owners: Value) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name, "ownerReferences": owners}, "data": {"k": "v"}})).unwrap()
}

fn pod(name: &str, node: Option<&str>, labels: Value) -> Pod {
    let mut p = json!({"metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], "terminationGracePeriodSeconds": 30}});
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    serde_json::from_value(p).unwrap()
}

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    // what is waited for takes well under a second here; the deadline is for a loaded machine
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

async fn install_crds(c: &Client, webhook: bool) {
    let crds: Api<CustomResourceDefinition> = Api::all(c.clone());
    for crd in karpenter_crds(webhook) {
        crds.create(&PostParams::default(), &serde_json::from_value(crd).unwrap()).await.unwrap();
    }
}

fn nodeclaims(c: &Client) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("karpenter.sh", "v1", "NodeClaim"), "nodeclaims");
    Api::all_with(c.clone(), &ar)
}

fn dynamic(v: Value) -> DynamicObject {
    serde_json::from_value(v).unwrap()
}

#[tokio::test]
async fn writes_bump_resource_version_and_stale_writes_conflict() {
    let (s, c) = server(false).await;
    let nodes: Api<Node> = Api::all(c.clone());
    let n = nodes.create(&PostParams::default(), &node("n1")).await.unwrap();
    let rv1 = n.metadata.resource_version.clone().unwrap();
    assert!(n.metadata.uid.is_some() && n.metadata.creation_timestamp.is_some());
    assert_eq!(n.metadata.generation, Some(1));
    let patched = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(json!({"spec": {"unschedulable": true}})))
        .await
        .unwrap();
    let rv2 = patched.metadata.resource_version.clone().unwrap();
    assert!(rv2.parse::<u64>().unwrap() > rv1.parse::<u64>().unwrap());
    assert_eq!(patched.metadata.generation, Some(2));
    // A stale PUT and a stale merge patch both conflict.
    let (c1, r1, _) = code(nodes.replace("n1", &PostParams::default(), &n).await.unwrap_err());
    assert_eq!((c1, r1.as_str()), (409, "Conflict"));
    let stale = json!({"metadata": {"resourceVersion": rv1}, "spec": {"unschedulable": false}});
    let (c2, _, _) = code(nodes.patch("n1", &PatchParams::default(), &Patch::Merge(stale)).await.unwrap_err());
    assert_eq!(c2, 409);
    // Errors carry the real reasons.
    let (c3, r3, st) = code(nodes.get("missing").await.unwrap_err());
    assert_eq!((c3, r3.as_str()), (404, "NotFound"));
    assert_eq!(st["message"], "nodes \"missing\" not found");
    let (c4, r4, _) = code(nodes.create(&PostParams::default(), &node("n1")).await.unwrap_err());
    assert_eq!((c4, r4.as_str()), (409, "AlreadyExists"));
    // generateName.
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let g: ConfigMap = serde_json::from_value(json!({"metadata": {"generateName": "gen-"}})).unwrap();
    let made = cms.create(&PostParams::default(), &g).await.unwrap();
    assert!(made.metadata.name.unwrap().starts_with("gen-"));
    // Namespaced create in a missing namespace.
    let other: Api<ConfigMap> = Api::namespaced(c.clone(), "nope");
    let (c5, _, _) = code(other.create(&PostParams::default(), &cm("x", json!([]))).await.unwrap_err());
    assert_eq!(c5, 404);
    s.shutdown().await;
}

#[tokio::test]
async fn json_patch_test_failure_is_422_and_changes_nothing() {
    let (s, c) = server(false).await;
    let nodes: Api<Node> = Api::all(c.clone());
    nodes.create(&PostParams::default(), &node("n1")).await.unwrap();
    let before = nodes.get("n1").await.unwrap();
    let p: json_patch::Patch = serde_json::from_value(json!([
        {"op": "add", "path": "/metadata/labels/x", "value": "y"},
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"}
    ]))
    .unwrap();
    let (code_, reason, _) = code(nodes.patch("n1", &PatchParams::default(), &Patch::<()>::Json(p)).await.unwrap_err());
    assert_eq!((code_, reason.as_str()), (422, "Invalid"));
    let after = nodes.get("n1").await.unwrap();
    assert_eq!(before.metadata.resource_version, after.metadata.resource_version);
    assert!(!after.metadata.labels.unwrap().contains_key("x"));
    s.shutdown().await;
}

#[tokio::test]
async fn strategic_merge_lists_and_custom_resources_refuse_it() {
    let (s, c) = server(false).await;
    let nodes: Api<Node> = Api::all(c.clone());
    nodes.create(&PostParams::default(), &node("n1")).await.unwrap();
    let first =
        json!({"metadata": {"finalizers": ["a/x"]}, "spec": {"taints": [{"key": "t1", "effect": "NoSchedule"}]}});
    nodes.patch("n1", &PatchParams::default(), &Patch::Strategic(first)).await.unwrap();
    let second =
        json!({"metadata": {"finalizers": ["b/y"]}, "spec": {"taints": [{"key": "t2", "effect": "NoSchedule"}]}});
    let n = nodes.patch("n1", &PatchParams::default(), &Patch::Strategic(second)).await.unwrap();
    assert_eq!(n.metadata.finalizers.unwrap(), vec!["a/x".to_string(), "b/y".to_string()]);
    let taints = n.spec.unwrap().taints.unwrap();
    assert_eq!(taints.len(), 1, "taints are atomic");
    assert_eq!(taints[0].key, "t2");
    install_crds(&c, false).await;
    let ncs = nodeclaims(&c);
    ncs.create(
        &PostParams::default(),
        &dynamic(json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": {"name": "nc"}, "spec": {}})),
    )
    .await
    .unwrap();
    let (code_, reason, _) = code(
        ncs.patch("nc", &PatchParams::default(), &Patch::Strategic(json!({"metadata": {"labels": {"a": "b"}}})))
            .await
            .unwrap_err(),
    );
    assert_eq!((code_, reason.as_str()), (415, "UnsupportedMediaType"));
    ncs.patch("nc", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}}))).await.unwrap();
    s.shutdown().await;
}

#[tokio::test]
async fn server_side_apply_and_managed_fields_name_the_last_writer() {
    let (s, c) = server(false).await;
    let nodes: Api<Node> = Api::all(c.clone());
    let applied = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {"a": "1"}}});
    let n = nodes.patch("n1", &PatchParams::apply("tool"), &Patch::Apply(applied)).await.unwrap();
    let mf = n.metadata.managed_fields.unwrap();
    assert!(mf.iter().any(|m| m.manager.as_deref() == Some("tool") && m.operation.as_deref() == Some("Apply")));
    let cordon = PatchParams { field_manager: Some("drainer".into()), ..Default::default() };
    nodes.patch("n1", &cordon, &Patch::Merge(json!({"spec": {"unschedulable": true}}))).await.unwrap();
    let revert = PatchParams { field_manager: Some("k3s-reverter".into()), ..Default::default() };
    let n = nodes.patch("n1", &revert, &Patch::Merge(json!({"spec": {"unschedulable": false}}))).await.unwrap();
    let owner: Vec<String> = n
        .metadata
        .managed_fields
        .unwrap()
        .iter()
        .filter(|m| m.fields_v1.as_ref().is_some_and(|f| f.0["f:spec"].get("f:unschedulable").is_some()))
        .map(|m| m.manager.clone().unwrap())
        .collect();
    // `unschedulable: false` is no field on the server (Go's omitempty), so nobody owns it after
    // an uncordon: managedFields cannot name who uncordoned, on the real server neither
    assert_eq!(owner, Vec::<String>::new());
    let n = nodes.patch("n1", &revert, &Patch::Merge(json!({"spec": {"unschedulable": true}}))).await.unwrap();
    let owner: Vec<String> = n
        .metadata
        .managed_fields
        .unwrap()
        .iter()
        .filter(|m| m.fields_v1.as_ref().is_some_and(|f| f.0["f:spec"].get("f:unschedulable").is_some()))
        .map(|m| m.manager.clone().unwrap())
        .collect();
    assert_eq!(owner, vec!["k3s-reverter".to_string()]);
    // A conflicting apply (another value) by another manager without force is refused.
    let other =
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "spec": {"unschedulable": false}});
    let (code_, _, _) =
        code(nodes.patch("n1", &PatchParams::apply("other"), &Patch::Apply(other.clone())).await.unwrap_err());
    assert_eq!(code_, 409);
    nodes.patch("n1", &PatchParams::apply("other").force(), &Patch::Apply(other)).await.unwrap();
    s.shutdown().await;
}

#[tokio::test]
async fn finalizers_hold_deletion_and_cannot_be_added_during_it() {
    let (s, c) = server(false).await;
    install_crds(&c, false).await;
    let ncs = nodeclaims(&c);
    ncs.create(
        &PostParams::default(),
        &dynamic(json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
        "metadata": {"name": "nc", "finalizers": ["karpenter.sh/termination"]}, "spec": {}})),
    )
    .await
    .unwrap();
    let del = ncs.delete("nc", &DeleteParams::default()).await.unwrap();
    let kept = del.left().expect("object kept while finalizers remain");
    assert!(kept.metadata.deletion_timestamp.is_some());
    let add = json!({"metadata": {"finalizers": ["karpenter.sh/termination", "other/new"]}});
    let (code_, reason, _) = code(ncs.patch("nc", &PatchParams::default(), &Patch::Merge(add)).await.unwrap_err());
    assert_eq!((code_, reason.as_str()), (422, "Invalid"));
    let p: json_patch::Patch =
        serde_json::from_value(json!([{"op": "remove", "path": "/metadata/finalizers/0"}])).unwrap();
    ncs.patch("nc", &PatchParams::default(), &Patch::<()>::Json(p)).await.unwrap();
    let (code_, _, _) = code(ncs.get("nc").await.unwrap_err());
    assert_eq!(code_, 404);
    s.shutdown().await;
}

#[tokio::test]
async fn owner_references_drive_garbage_collection() {
    let (s, c) = server(false).await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let owner_ref = |o: &ConfigMap, block: bool| json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": o.metadata.name, "uid": o.metadata.uid, "blockOwnerDeletion": block}]);
    // Background.
    let o = cms.create(&PostParams::default(), &cm("owner", json!([]))).await.unwrap();
    cms.create(&PostParams::default(), &cm("dep", owner_ref(&o, false))).await.unwrap();
    cms.delete("owner", &DeleteParams::background()).await.unwrap();
    assert!(cms.get_opt("dep").await.unwrap().is_none());
    // Foreground: the owner waits for a blocking dependent that has a finalizer.
    let o = cms.create(&PostParams::default(), &cm("owner2", json!([]))).await.unwrap();
    let mut d = cm("dep2", owner_ref(&o, true));
    d.metadata.finalizers = Some(vec!["test/hold".into()]);
    cms.create(&PostParams::default(), &d).await.unwrap();
    cms.delete("owner2", &DeleteParams::foreground()).await.unwrap();
    let held = cms.get("owner2").await.unwrap();
    assert!(held.metadata.finalizers.unwrap().contains(&"foregroundDeletion".to_string()));
    cms.patch("dep2", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"finalizers": null}}))).await.unwrap();
    assert!(cms.get_opt("dep2").await.unwrap().is_none());
    assert!(cms.get_opt("owner2").await.unwrap().is_none());
    // Orphan.
    let o = cms.create(&PostParams::default(), &cm("owner3", json!([]))).await.unwrap();
    cms.create(&PostParams::default(), &cm("dep3", owner_ref(&o, false))).await.unwrap();
    cms.delete("owner3", &DeleteParams::orphan()).await.unwrap();
    let orphan = cms.get("dep3").await.unwrap();
    assert!(orphan.metadata.owner_references.unwrap_or_default().is_empty());
    assert!(cms.get_opt("owner3").await.unwrap().is_none());
    s.shutdown().await;
}

#[tokio::test]
async fn pods_are_removed_after_their_scaled_grace_period() {
    let (s, c) = server(true).await;
    Api::<Node>::all(c.clone()).create(&PostParams::default(), &node("n1")).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    pods.create(&PostParams::default(), &pod("p", Some("n1"), json!({}))).await.unwrap();
    eventually("pod running", || async {
        pods.get("p").await.unwrap().status.unwrap().phase.as_deref() == Some("Running")
    })
    .await;
    let del = pods.delete("p", &DeleteParams::default()).await.unwrap();
    let p = del.left().unwrap();
    assert!(p.metadata.deletion_timestamp.is_some());
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(30));
    // 30 s x 0.01 = 0.3 s.
    eventually("pod gone", || async { pods.get_opt("p").await.unwrap().is_none() }).await;
    s.shutdown().await;
}

async fn running_pods(c: &Client, names: &[&str], labels: Value) {
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    for n in names {
        pods.create(&PostParams::default(), &pod(n, Some("n1"), labels.clone())).await.unwrap();
    }
    for n in names {
        eventually("pod running", || async {
            pods.get(n).await.unwrap().status.unwrap().phase.as_deref() == Some("Running")
        })
        .await;
    }
}

/// Creates a PodDisruptionBudget in `default`; returns the API it was created through.
async fn budget(c: &Client, name: &str, spec: Value) -> Api<PodDisruptionBudget> {
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    let pdb = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    pdbs
}

fn eviction(name: &str, uid: Option<&str>) -> Value {
    let mut e =
        json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": "default"}});
    if let Some(u) = uid {
        e["deleteOptions"] = json!({"preconditions": {"uid": u}});
    }
    e
}

async fn evict(raw: &Api<DynamicObject>, n: &str, u: Option<&str>) -> Result<Value, Error> {
    raw.create_subresource::<Value, Value>("eviction", n, &PostParams::default(), &eviction(n, u)).await
}

#[tokio::test]
async fn eviction_respects_pod_disruption_budgets() {
    let (s, c) = server(true).await;
    Api::<Node>::all(c.clone()).create(&PostParams::default(), &node("n1")).await.unwrap();
    running_pods(&c, &["a", "b"], json!({"app": "web"})).await;
    let raw: Api<DynamicObject> = Api::namespaced_with(c.clone(), "default", &ApiResource::erase::<Pod>(&()));
    // UID precondition mismatch: 409, from the delete. Asked before the budget exists: like
    // kube-apiserver, the server spends a budget's allowance before the delete checks the
    // precondition, so under a budget the same request would spend it (or be refused with 429).
    assert_eq!(code(evict(&raw, "a", Some("wrong-uid")).await.unwrap_err()).0, 409);
    let pdbs = budget(&c, "web", json!({"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}})).await;
    eventually("pdb status", || async {
        pdbs.get("web").await.unwrap().status.is_some_and(|s| s.disruptions_allowed == 1 && s.current_healthy == 2)
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    // Missing pod: 404.
    assert_eq!(code(evict(&raw, "missing", None).await.unwrap_err()).0, 404);
    // First eviction allowed (201 + Status Success), second blocked by the budget.
    let uid = pods.get("a").await.unwrap().metadata.uid.unwrap();
    let ok = evict(&raw, "a", Some(&uid)).await.unwrap();
    assert_eq!(ok["status"], "Success");
    assert!(pods.get("a").await.unwrap().metadata.deletion_timestamp.is_some());
    let (code_, reason, st) = code(evict(&raw, "b", None).await.unwrap_err());
    assert_eq!((code_, reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(st["details"]["causes"][0]["reason"], "DisruptionBudget");
    assert!(st["details"]["causes"][0]["message"].as_str().unwrap().contains("web"));
    // the budget answers before the UID precondition: a replaced pod under a spent budget is 429
    assert_eq!(code(evict(&raw, "b", Some("wrong-uid")).await.unwrap_err()).0, 429);
    assert_eq!(s.requests().count("evict", "pods"), 5);
    // Two budgets over one pod: 500 like the real server.
    budget(&c, "web2", json!({"maxUnavailable": "50%", "selector": {"matchLabels": {"app": "web"}}})).await;
    assert_eq!(code(evict(&raw, "b", None).await.unwrap_err()).0, 500);
    s.shutdown().await;
}

/// On the wire through the tool's own client: a PodDisruptionBudget's 429 is a
/// block, API Priority and Fairness's 429 (plain text, `Retry-After`) is throttling with the
/// server's delay, and two budgets over one pod (500) are named as such.
#[tokio::test]
async fn the_tool_tells_a_budget_from_throttling_and_from_two_budgets() {
    use karpenter_teardown::k8s::Kube;
    use karpenter_teardown::k8s::pods::{EvictionOutcome, drainable, evict as tool_evict};
    let (s, c) = server(true).await;
    let kube = Kube::from_config(s.kube_config(), None).unwrap();
    Api::<Node>::all(c.clone()).create(&PostParams::default(), &node("n1")).await.unwrap();
    running_pods(&c, &["a", "b"], json!({"app": "web"})).await;
    let pdbs = budget(&c, "web", json!({"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}})).await;
    eventually("pdb status", || async {
        pdbs.get("web").await.unwrap().status.is_some_and(|s| s.current_healthy == 2)
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let a = drainable(&pods.get("a").await.unwrap()).unwrap();
    match tool_evict(&kube.client, &a).await.unwrap() {
        EvictionOutcome::Blocked(why) => assert!(why.contains("web"), "the budget is named: {why}"),
        other => panic!("a PDB refusal is a block, got {other:?}"),
    }
    s.set_faults(FaultConfig {
        errors: vec![ErrorRule { verb: Some("evict".into()), resource: None, code: 429, rate: 1.0 }],
        ..FaultConfig::default()
    });
    assert_eq!(tool_evict(&kube.client, &a).await.unwrap(), EvictionOutcome::Throttled(Duration::from_secs(1)));
    assert_eq!(kube.calls.snapshot().get("kubernetes:throttled"), Some(&1));
    s.set_faults(FaultConfig::default());
    budget(&c, "web2", json!({"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}})).await;
    assert!(matches!(tool_evict(&kube.client, &a).await.unwrap(), EvictionOutcome::MultipleBudgets(_)));
    s.shutdown().await;
}

/// A StatefulSet recreates an evicted pod under the same name, and `disruptedPods` is keyed by
/// name: like the disruption controller, the server forgets an entry after its deletion timeout
/// (2 minutes, scaled), or the budget would count the new pod as disrupted and block for ever.
#[tokio::test]
async fn a_pod_recreated_under_an_evicted_name_counts_as_healthy_after_the_deletion_timeout() {
    let (s, c) = server(true).await;
    Api::<Node>::all(c.clone()).create(&PostParams::default(), &node("n1")).await.unwrap();
    running_pods(&c, &["db-0", "db-1"], json!({"app": "db"})).await;
    let pdbs = budget(&c, "db", json!({"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}})).await;
    eventually("pdb status", || async {
        pdbs.get("db").await.unwrap().status.is_some_and(|s| s.disruptions_allowed == 1)
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let raw: Api<DynamicObject> = Api::namespaced_with(c.clone(), "default", &ApiResource::erase::<Pod>(&()));
    evict(&raw, "db-0", None).await.unwrap();
    eventually("evicted pod gone", || async { pods.get_opt("db-0").await.unwrap().is_none() }).await;
    running_pods(&c, &["db-0"], json!({"app": "db"})).await;
    // both pods run again: once the entry has expired the budget allows one more disruption
    eventually("second eviction allowed", || async { evict(&raw, "db-1", None).await.is_ok() }).await;
    s.shutdown().await;
}

#[tokio::test]
async fn lists_filter_by_labels_and_fields_and_page() {
    let (s, c) = server(false).await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    for i in 0..7 {
        let node = if i % 2 == 0 { Some("n1") } else { None };
        pods.create(
            &PostParams::default(),
            &pod(&format!("p{i}"), node, json!({"app": if i < 3 { "a" } else { "b" }, "i": i.to_string()})),
        )
        .await
        .unwrap();
    }
    let names =
        |l: kube::core::ObjectList<Pod>| l.items.into_iter().map(|p| p.metadata.name.unwrap()).collect::<Vec<_>>();
    assert_eq!(names(pods.list(&ListParams::default().labels("app=a")).await.unwrap()), ["p0", "p1", "p2"]);
    assert_eq!(
        names(pods.list(&ListParams::default().labels("app in (a,b),i notin (0,1,2,3)")).await.unwrap()),
        ["p4", "p5", "p6"]
    );
    assert_eq!(names(pods.list(&ListParams::default().labels("app!=a,!missing")).await.unwrap()).len(), 4);
    assert_eq!(
        names(pods.list(&ListParams::default().fields("spec.nodeName=n1")).await.unwrap()),
        ["p0", "p2", "p4", "p6"]
    );
    assert_eq!(names(pods.list(&ListParams::default().fields("spec.nodeName=")).await.unwrap()), ["p1", "p3", "p5"]);
    let (code_, reason, st) = code(pods.list(&ListParams::default().fields("spec.bogus=1")).await.unwrap_err());
    assert_eq!((code_, reason.as_str()), (400, "BadRequest"));
    assert!(st["message"].as_str().unwrap().contains("field label not supported"));
    // Paging.
    let mut lp = ListParams::default().limit(3);
    let mut seen = Vec::new();
    loop {
        let page = pods.list(&lp).await.unwrap();
        assert!(page.metadata.resource_version.is_some());
        let next = page.metadata.continue_.clone();
        seen.extend(names(page));
        match next {
            Some(t) if !t.is_empty() => lp = lp.continue_token(&t),
            _ => break,
        }
    }
    assert_eq!(seen.len(), 7);
    // Cluster-wide list of a namespaced kind.
    let all: Api<Pod> = Api::all(c.clone());
    assert_eq!(all.list(&ListParams::default()).await.unwrap().items.len(), 7);
    s.shutdown().await;
}

#[tokio::test]
async fn watcher_over_paged_list_sees_added_modified_deleted() {
    use kube::runtime::watcher;
    let (s, c) = server(false).await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    for i in 0..5 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}"), json!([]))).await.unwrap();
    }
    let cfg = watcher::Config::default().page_size(2).any_semantic();
    let cfg = watcher::Config { list_semantic: kube::runtime::watcher::ListSemantic::MostRecent, ..cfg };
    let mut stream = watcher(cms.clone(), cfg).boxed();
    let mut initial = 0;
    loop {
        match stream.try_next().await.unwrap().unwrap() {
            watcher::Event::InitApply(_) => initial += 1,
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(initial, 5);
    cms.create(&PostParams::default(), &cm("new", json!([]))).await.unwrap();
    cms.patch("c1", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": "changed"}}))).await.unwrap();
    cms.delete("c2", &DeleteParams::default()).await.unwrap();
    let mut applied = Vec::new();
    let mut deleted = Vec::new();
    while deleted.is_empty() {
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await.unwrap().unwrap().unwrap() {
            watcher::Event::Apply(o) => applied.push(o.metadata.name.unwrap()),
            watcher::Event::Delete(o) => deleted.push(o.metadata.name.unwrap()),
            _ => {}
        }
    }
    assert_eq!(applied, ["new", "c1"]);
    assert_eq!(deleted, ["c2"]);
    s.shutdown().await;
}

#[tokio::test]
async fn watch_from_too_old_version_is_gone_and_bookmarks_flow() {
    let opts = ServerOptions { time_scale: 0.001, watch_history: 3, control_plane: false, ..Default::default() };
    let s = ApiServer::start(opts).await.unwrap();
    let c = Client::try_from(s.kube_config()).unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    for i in 0..6 {
        cms.create(&PostParams::default(), &cm(&format!("c{i}"), json!([]))).await.unwrap();
    }
    let mut old = cms.watch(&WatchParams::default().timeout(5), "2").await.unwrap().boxed();
    match old.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => assert_eq!(e.code, 410),
        other => panic!("expected 410, got {other:?}"),
    }
    let rv = cms.list(&ListParams::default()).await.unwrap().metadata.resource_version.unwrap();
    let mut w = cms.watch(&WatchParams::default().timeout(2).labels("keep=yes"), &rv).await.unwrap().boxed();
    cms.create(&PostParams::default(), &cm("ignored", json!([]))).await.unwrap();
    let mut kept = cm("kept", json!([]));
    kept.metadata.labels = Some([("keep".to_string(), "yes".to_string())].into());
    cms.create(&PostParams::default(), &kept).await.unwrap();
    let mut saw_added = false;
    let mut saw_bookmark = false;
    while let Some(ev) = w.try_next().await.unwrap() {
        match ev {
            WatchEvent::Added(o) => {
                assert_eq!(o.metadata.name.as_deref(), Some("kept"));
                saw_added = true;
            }
            WatchEvent::Bookmark(_) => saw_bookmark = true,
            other => panic!("unexpected {other:?}"),
        }
        if saw_added && saw_bookmark {
            break;
        }
    }
    assert!(saw_added && saw_bookmark);
    s.shutdown().await;
}

#[tokio::test]
async fn discovery_finds_builtins_subresources_and_custom_resources() {
    let (s, c) = server(false).await;
    install_crds(&c, true).await;
    let d = kube::Discovery::new(c.clone()).run().await.unwrap();
    let (ar, caps) = d.resolve_gvk(&GroupVersionKind::gvk("karpenter.sh", "v1", "NodePool")).unwrap();
    assert_eq!(ar.plural, "nodepools");
    assert_eq!(caps.scope, kube::discovery::Scope::Cluster);
    let core: Value = c.request(http::Request::get("/api/v1").body(vec![]).unwrap()).await.unwrap();
    let ev = core["resources"].as_array().unwrap().iter().find(|r| r["name"] == "pods/eviction").unwrap();
    assert_eq!(
        (ev["group"].as_str(), ev["version"].as_str(), ev["kind"].as_str()),
        (Some("policy"), Some("v1"), Some("Eviction"))
    );
    assert!(core["resources"].as_array().unwrap().iter().any(|r| r["name"] == "nodes" && r["shortNames"][0] == "no"));
    let apps: Value = c.request(http::Request::get("/apis/apps/v1").body(vec![]).unwrap()).await.unwrap();
    let sc = apps["resources"].as_array().unwrap().iter().find(|r| r["name"] == "deployments/scale").unwrap();
    assert_eq!(sc["group"], "autoscaling");
    let v = c.apiserver_version().await.unwrap();
    assert!(v.git_version.starts_with("v1.34"));
    // The 1.0.x conversion stanza is stored as given.
    let crd = Api::<CustomResourceDefinition>::all(c.clone()).get("nodeclaims.karpenter.sh").await.unwrap();
    assert_eq!(crd.spec.conversion.unwrap().strategy, "Webhook");
    // Deleting the CRD removes its objects and unregisters the kind.
    let ncs = nodeclaims(&c);
    ncs.create(
        &PostParams::default(),
        &dynamic(json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": {"name": "x"}, "spec": {}})),
    )
    .await
    .unwrap();
    Api::<CustomResourceDefinition>::all(c.clone())
        .delete("nodeclaims.karpenter.sh", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(code(ncs.list(&ListParams::default()).await.unwrap_err()).0, 404);
    s.shutdown().await;
}

#[tokio::test]
async fn status_subresource_is_separate() {
    let (s, c) = server(false).await;
    install_crds(&c, false).await;
    let ncs = nodeclaims(&c);
    let created = ncs
        .create(
            &PostParams::default(),
            &dynamic(json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": {"name": "nc"},
            "spec": {"a": 1}, "status": {"providerID": "ignored"}})),
        )
        .await
        .unwrap();
    assert!(created.data.get("status").is_none(), "status dropped on create");
    ncs.patch(
        "nc",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"providerID": "nope"}, "spec": {"a": 2}})),
    )
    .await
    .unwrap();
    let o = ncs.get("nc").await.unwrap();
    assert!(o.data.get("status").is_none() && o.data["spec"]["a"] == 2);
    ncs.patch_status(
        "nc",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"providerID": "aws:///z/i-1"}, "spec": {"a": 3}})),
    )
    .await
    .unwrap();
    let o = ncs.get("nc").await.unwrap();
    assert_eq!(o.data["status"]["providerID"], "aws:///z/i-1");
    assert_eq!(o.data["spec"]["a"], 2);
    s.shutdown().await;
}

#[tokio::test]
async fn scale_subresource_and_control_plane_workloads() {
    let (s, c) = server(true).await;
    Api::<Node>::all(c.clone()).create(&PostParams::default(), &node("n1")).await.unwrap();
    let deps: Api<Deployment> = Api::namespaced(c.clone(), "default");
    deps.create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}})).unwrap())
        .await
        .unwrap();
    eventually("deployment ready", || async {
        deps.get("web").await.unwrap().status.and_then(|s| s.ready_replicas) == Some(2)
    })
    .await;
    let sc = deps.get_scale("web").await.unwrap();
    assert_eq!(sc.spec.unwrap().replicas, Some(2));
    deps.patch_scale("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 3}}))).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    eventually("three pods running", || async {
        pods.list(&ListParams::default().labels("app=web"))
            .await
            .unwrap()
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .count()
            == 3
    })
    .await;
    // Deleting the node removes its pods (pod GC); the ReplicaSet recreates them as Pending.
    Api::<Node>::all(c.clone()).delete("n1", &DeleteParams::default()).await.unwrap();
    eventually("pods pending", || async {
        let l = pods.list(&ListParams::default().labels("app=web")).await.unwrap().items;
        l.len() == 3 && l.iter().all(|p| p.spec.as_ref().unwrap().node_name.is_none())
    })
    .await;
    assert!(s.requests().count("patch", "deployments/scale") == 1);
    s.shutdown().await;
}

#[tokio::test]
async fn injected_faults_and_request_accounting() {
    let (s, c) = server(false).await;
    let nodes: Api<Node> = Api::all(c.clone());
    nodes.list(&ListParams::default()).await.unwrap();
    s.set_faults(FaultConfig {
        errors: vec![ErrorRule { verb: Some("list".into()), resource: Some("nodes".into()), code: 503, rate: 1.0 }],
        seed: 7,
        ..Default::default()
    });
    assert_eq!(code(nodes.list(&ListParams::default()).await.unwrap_err()).0, 503);
    nodes.create(&PostParams::default(), &node("n1")).await.unwrap();
    s.set_faults(FaultConfig::default());
    nodes.list(&ListParams::default()).await.unwrap();
    assert_eq!(s.requests().count("list", "nodes"), 3);
    assert_eq!(s.requests().count("create", "nodes"), 1);
    s.shutdown().await;
}

#[tokio::test]
async fn holds_a_thousand_nodes_and_twenty_thousand_pods() {
    let (s, c) = server(false).await;
    let store = s.store();
    let wo = WriteOptions::manager("bulk");
    let start = std::time::Instant::now();
    for i in 0..1000 {
        store
            .create(&GroupResource::new("", "nodes"), "", json!({"metadata": {"name": format!("n{i}")}}), &wo)
            .unwrap();
    }
    for i in 0..20_000 {
        store
            .create(&GroupResource::new("", "pods"), "default",
                json!({"metadata": {"name": format!("p{i:05}")}, "spec": {"nodeName": format!("n{}", i % 1000), "containers": [{"name": "c"}]}}), &wo)
            .unwrap();
    }
    let created = start.elapsed();
    let pods: Api<Pod> = Api::all(c.clone());
    let t = std::time::Instant::now();
    let mut lp = ListParams::default().limit(500);
    let mut n = 0;
    loop {
        let page = pods.list(&lp).await.unwrap();
        n += page.items.len();
        match page.metadata.continue_ {
            Some(tok) if !tok.is_empty() => lp = lp.continue_token(&tok),
            _ => break,
        }
    }
    assert_eq!(n, 20_000);
    let on_node = pods.list(&ListParams::default().fields("spec.nodeName=n7")).await.unwrap();
    assert_eq!(on_node.items.len(), 20);
    // how fast is for `cargo bench --bench apiserver` to say (README), not for a test to assert
    eprintln!("created in {created:?}, paged list and field-selector list in {:?}", t.elapsed());
    assert_eq!(store.list(&GroupResource::new("", "nodes"), None, &ListOptions::default()).unwrap().items.len(), 1000);
    s.shutdown().await;
}

#[tokio::test]
async fn injected_watch_drops_and_latency() {
    let (s, c) = server(false).await;
    s.set_faults(FaultConfig {
        latency: Duration::from_millis(30),
        drop_watches_every: Some(Duration::from_millis(200)),
        ..Default::default()
    });
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let t = std::time::Instant::now();
    let mut w = cms.watch(&WatchParams::default().timeout(30), "0").await.unwrap().boxed();
    let ended =
        tokio::time::timeout(Duration::from_secs(5), async { while w.try_next().await.unwrap().is_some() {} }).await;
    assert!(ended.is_ok(), "the watch was not cut");
    assert!(t.elapsed() >= Duration::from_millis(200));
    s.shutdown().await;
}

/// A Deployment copied from another cluster (what `rehearse` loads) keeps the ReplicaSet and the
/// running pods it had there. That ReplicaSet is named after the other cluster's hash of the pod
/// template; the control plane takes it for the Deployment's current one by its template, as
/// kube-controller-manager does, instead of rolling the Deployment out and deleting the pods a
/// strict budget protects.
#[tokio::test]
async fn a_restored_deployment_keeps_its_replicaset_and_its_running_pods() {
    let (mut s, c) = server(false).await;
    let store = s.store();
    let restore = |resource: GroupResource, v: Value| {
        let ns = v["metadata"]["namespace"].as_str().unwrap_or_default().to_string();
        store.restore(&resource, &ns, v).unwrap()
    };
    restore(GroupResource::new("", "nodes"), serde_json::to_value(node("n1")).unwrap());
    let labels = json!({"app": "payments"});
    let hashed = json!({"app": "payments", "pod-template-hash": "7d4b9c8f6"});
    let template = |labels: &Value| {
        json!({"metadata": {"labels": labels}, "spec": {"terminationGracePeriodSeconds": 30,
            "containers": [{"name": "app", "image": "payments:2"}]}})
    };
    let dep = restore(
        GroupResource::new("apps", "deployments"),
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "payments", "namespace": "default"},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": template(&labels)},
            "status": {"replicas": 2, "readyReplicas": 2, "availableReplicas": 2, "updatedReplicas": 2}}),
    );
    let owner = |kind: &str, o: &Value| {
        json!([{"apiVersion": "apps/v1", "kind": kind, "name": o["metadata"]["name"], "uid": o["metadata"]["uid"],
            "controller": true, "blockOwnerDeletion": true}])
    };
    let rs = restore(
        GroupResource::new("apps", "replicasets"),
        json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "payments-7d4b9c8f6", "namespace": "default", "labels": hashed,
                "ownerReferences": owner("Deployment", &dep)},
            "spec": {"replicas": 2, "selector": {"matchLabels": hashed}, "template": template(&hashed)},
            "status": {"replicas": 2, "readyReplicas": 2, "availableReplicas": 2}}),
    );
    for name in ["payments-7d4b9c8f6-abcde", "payments-7d4b9c8f6-fghij"] {
        let mut pod = template(&hashed);
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["name"] = json!(name);
        pod["metadata"]["namespace"] = json!("default");
        pod["metadata"]["ownerReferences"] = owner("ReplicaSet", &rs);
        pod["spec"]["nodeName"] = json!("n1");
        pod["status"] = json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]});
        restore(GroupResource::new("", "pods"), pod);
    }
    restore(
        GroupResource::new("policy", "poddisruptionbudgets"),
        json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "payments-pdb", "namespace": "default"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": labels}},
            "status": {"currentHealthy": 2, "desiredHealthy": 2, "disruptionsAllowed": 0, "expectedPods": 2,
                "observedGeneration": 1}}),
    );
    s.start_control_plane();
    // a rollout would have scaled the copied ReplicaSet to zero and deleted its pods within a
    // pass, their 30 s grace period being 0.3 s here; the budget's status is recomputed meanwhile
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let left: Vec<Pod> = pods.list(&ListParams::default()).await.unwrap().items;
    let names: Vec<String> = left.iter().filter_map(|p| p.metadata.name.clone()).collect();
    assert_eq!(names, ["payments-7d4b9c8f6-abcde", "payments-7d4b9c8f6-fghij"], "the copied pods are the pods");
    assert!(left.iter().all(|p| p.metadata.deletion_timestamp.is_none()), "no copied pod is being deleted");
    let sets =
        store.list(&GroupResource::new("apps", "replicasets"), Some("default"), &ListOptions::default()).unwrap();
    let sets: Vec<Value> = sets.items.iter().map(|r| (*r.value()).clone()).collect();
    assert_eq!(sets.len(), 1, "no ReplicaSet of the control plane's own: {sets:?}");
    assert_eq!(sets[0]["spec"]["replicas"], 2);
    // and the budget blocks, as it did where the objects came from
    let raw: Api<DynamicObject> = Api::namespaced_with(c.clone(), "default", &ApiResource::erase::<Pod>(&()));
    let (status, reason, _) = code(evict(&raw, "payments-7d4b9c8f6-abcde", None).await.unwrap_err());
    assert_eq!((status, reason.as_str()), (429, "TooManyRequests"));
    s.shutdown().await;
}

/// A pod copied while it was terminating stays terminating: the control plane's kubelet removes
/// it once the grace period it was given has passed, and one given none (stuck where it came
/// from) stays until its node goes. A budget does not count either as healthy.
#[tokio::test]
async fn a_restored_terminating_pod_keeps_terminating() {
    let (mut s, c) = server(false).await;
    let store = s.store();
    store.restore(&GroupResource::new("", "nodes"), "", serde_json::to_value(node("n1")).unwrap()).unwrap();
    for (name, grace) in [("going", 1), ("stuck", 0), ("running", -1)] {
        let mut p = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        if grace >= 0 {
            p["metadata"]["deletionTimestamp"] = json!("2026-11-25T15:00:00Z");
            p["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        }
        store.restore(&GroupResource::new("", "pods"), "default", p).unwrap();
    }
    store
        .restore(
            &GroupResource::new("policy", "poddisruptionbudgets"),
            "default",
            json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "web", "namespace": "default"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}}),
        )
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    for name in ["going", "stuck"] {
        let p = pods.get(name).await.unwrap();
        assert!(p.metadata.deletion_timestamp.is_some(), "{name} is restored terminating");
    }
    s.start_control_plane();
    // 1 s of grace is 10 ms here
    eventually("the terminating pod removed", || async { pods.get_opt("going").await.unwrap().is_none() }).await;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    eventually("the budget counts the running pod alone", || async {
        pdbs.get("web").await.unwrap().status.is_some_and(|s| s.current_healthy == 1 && s.disruptions_allowed == 0)
    })
    .await;
    let stuck = pods.get("stuck").await.unwrap();
    assert!(stuck.metadata.deletion_timestamp.is_some(), "the stuck pod is still terminating");
    s.shutdown().await;
}

/// Like the DaemonSet controller, a NoSchedule taint (a drain's fence) keeps a DaemonSet's pod
/// running on its node; only an untolerated NoExecute taint stops it.
#[tokio::test]
async fn a_daemonset_pod_stays_under_a_noschedule_taint_and_goes_under_noexecute() {
    let (s, c) = server(true).await;
    let nodes: Api<Node> = Api::all(c.clone());
    nodes.create(&PostParams::default(), &node("n1")).await.unwrap();
    let ds: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(json!({"metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}},
            "template": {"metadata": {"labels": {"app": "agent"}}, "spec": {"containers": [{"name": "c", "image": "agent"}]}}}}))
    .unwrap();
    Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(c.clone(), "default")
        .create(&PostParams::default(), &ds)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let uids = || async {
        let l = pods.list(&ListParams::default().labels("app=agent")).await.unwrap().items;
        l.into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.uid)
            .collect::<Vec<_>>()
    };
    eventually("the agent runs on n1", || async { uids().await.len() == 1 }).await;
    let first = uids().await;
    let taint = |effect: &str| json!({"spec": {"taints": [{"key": "drain", "effect": effect}]}});
    nodes.patch("n1", &PatchParams::default(), &Patch::Merge(taint("NoSchedule"))).await.unwrap();
    // several passes of the control plane
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(uids().await, first, "a NoSchedule taint stopped the DaemonSet's pod");
    nodes.patch("n1", &PatchParams::default(), &Patch::Merge(taint("NoExecute"))).await.unwrap();
    eventually("the agent is stopped", || async { uids().await.is_empty() }).await;
    s.shutdown().await;
}
