//! The field reports of design §1, each as a scenario the real binary must survive:
//! objects vanishing underneath, a stale taint writer, a cordon reverter, platform-owned taints,
//! the controller removed first, a strict PodDisruptionBudget, and an instance that launched but
//! never registered.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::common::safety::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Taint};
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::k8s;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use sandbox_sim::{World, WorldSpec, generate, naming};
use serde_json::{Value, json};

const NOT_READY: &str = "node.kubernetes.io/not-ready";

/// Removes a Node object for good, finalizers included, as an autoscaler or a hand would.
async fn remove_node_underneath(client: &Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.delete(name, &DeleteParams::default()).await.unwrap();
    if nodes.get_opt(name).await.unwrap().is_some() {
        let pp = PatchParams { field_manager: Some("someone-else".into()), ..PatchParams::default() };
        nodes.patch(name, &pp, &Patch::Merge(json!({"metadata": {"finalizers": null}}))).await.unwrap();
    }
    assert!(nodes.get_opt(name).await.unwrap().is_none(), "node {name} should be gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_underneath() {
    let s = two_pool_world("fr-vanished", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    // node 0: its Node object and its instance are gone, its NodeClaim still holds the finalizer
    let gone = &world.nodes[0];
    remove_node_underneath(&b.client, &gone.node).await;
    b.aws.ec2.terminate(std::slice::from_ref(&gone.instance_id)).await.unwrap();
    // node 1: only its instance was terminated out of band
    b.aws.ec2.terminate(std::slice::from_ref(&world.nodes[1].instance_id)).await.unwrap();

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

fn taint_keys(taints: Option<&Value>) -> BTreeSet<String> {
    taints
        .and_then(Value::as_array)
        .map(|ts| {
            ts.iter()
                .map(|t| format!("{}:{}", t["key"].as_str().unwrap_or(""), t["effect"].as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default()
}

/// The node lifecycle controller of the field report: read-modify-write of the whole taint list
/// (GET, then PUT carrying the resourceVersion it read, again on 409), toggling `not-ready`.
async fn toggle_not_ready(client: Client, names: Vec<String>, stop: Arc<AtomicBool>, writes: Arc<AtomicU64>) {
    let nodes: Api<Node> = Api::all(client);
    let pp = PostParams { field_manager: Some("node-lifecycle-controller".into()), ..PostParams::default() };
    while !stop.load(Ordering::Relaxed) {
        for name in &names {
            let Ok(Some(mut node)) = nodes.get_opt(name).await else { continue };
            let spec = node.spec.get_or_insert_with(Default::default);
            let taints = spec.taints.get_or_insert_with(Vec::new);
            if let Some(i) = taints.iter().position(|t| t.key == NOT_READY) {
                taints.remove(i);
            } else {
                taints.push(Taint { key: NOT_READY.into(), effect: "NoExecute".into(), ..Taint::default() });
            }
            // 409 (someone wrote meanwhile) and 404 (gone): the next round reads again
            if nodes.replace(name, &pp, &node).await.is_ok() {
                writes.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The managedFields entry of `manager`, if any.
fn entry_of<'a>(obj: &'a Value, manager: &str) -> Option<&'a Value> {
    obj["metadata"]["managedFields"].as_array()?.iter().find(|e| e["manager"] == manager)
}

/// Whether `manager` made the write from `old` to `new`: its managedFields entry changed, other
/// than by losing fields. (The entry with the latest time cannot tell: times have one-second
/// precision, so a write of the stale writer in the same second as the tool's would be blamed on
/// the tool. And another manager's write of a field `manager` owned, such as the atomic taint
/// list, takes the field out of `manager`'s entry: that change is the other manager's write.)
fn written_by(old: &Value, new: &Value, manager: &str) -> bool {
    let (before, after) = (entry_of(old, manager), entry_of(new, manager));
    let Some(after) = after else { return false };
    let lost_fields_only =
        before.is_some_and(|b| b["fieldsV1"] != after["fieldsV1"] && fields_within(&after["fieldsV1"], &b["fieldsV1"]));
    before != Some(after) && !lost_fields_only
}

/// Whether every field of the managedFields set `inner` is in `outer`.
fn fields_within(inner: &Value, outer: &Value) -> bool {
    match (inner.as_object(), outer.as_object()) {
        (Some(i), Some(o)) => i.iter().all(|(k, v)| o.get(k).is_some_and(|ov| fields_within(v, ov))),
        _ => true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_taint_writer() {
    let s = two_pool_world("fr-stale", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let names: BTreeSet<String> = world.nodes.iter().map(|n| n.node.clone()).collect();

    // every node version the server produces, with the version before it, from the store itself
    let mut events = b.server.store().subscribe();
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    let recorder = tokio::spawn(async move {
        use tokio::sync::broadcast::error::{RecvError, TryRecvError};
        let mut seen = Vec::new();
        loop {
            tokio::select! {
                ev = events.recv() => match ev {
                    Ok(ev) => seen.push(ev),
                    Err(RecvError::Lagged(n)) => panic!("the recorder lagged by {n} events"),
                    Err(RecvError::Closed) => return seen,
                },
                _ = &mut done_rx => loop {
                    match events.try_recv() {
                        Ok(ev) => seen.push(ev),
                        Err(TryRecvError::Lagged(n)) => panic!("the recorder lagged by {n} events"),
                        Err(_) => return seen,
                    }
                },
            }
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let writer =
        tokio::spawn(toggle_not_ready(b.client.clone(), names.iter().cloned().collect(), stop.clone(), writes.clone()));

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    assert_eq!(run.code, 0, "{}", run.dump());
    assert!(writes.load(Ordering::Relaxed) > 0, "the stale writer never wrote: the test proves nothing");

    let _ = done_tx.send(());
    let seen = recorder.await.unwrap();
    let mut tool_writes = 0;
    let mut violations = Vec::new();
    for ev in seen.iter().filter(|e| e.key.gr.resource == "nodes" && names.contains(&e.key.name.to_string())) {
        let Some(old) = ev.old() else { continue };
        let object = ev.object();
        if ev.event_type.as_str() != "MODIFIED" || !written_by(&old, &object, k8s::objects::FIELD_MANAGER) {
            continue;
        }
        tool_writes += 1;
        let was = taint_keys(old["spec"].get("taints"));
        let now = taint_keys(object["spec"].get("taints"));
        let dropped: Vec<&String> = was.difference(&now).collect();
        if !dropped.is_empty() {
            violations.push(format!("{} at rv {}: dropped {dropped:?}", ev.key.name, ev.rv));
        }
    }
    assert!(tool_writes > 0, "no node write of the tool was seen");
    assert!(violations.is_empty(), "the tool's node writes dropped taints: {violations:?}");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// Lifts the fence of every fenced Karpenter node, as K3s did in the field report: uncordons it
/// and, with `strip_taint`, strips the tool's taint too, every `every`.
async fn fence_lifter(
    client: Client,
    stop: Arc<AtomicBool>,
    reverts: Arc<AtomicU64>,
    strip_taint: bool,
    every: Duration,
) {
    let nodes: Api<Node> = Api::all(client.clone());
    let pp = PatchParams { field_manager: Some("k3s-reverter".into()), ..PatchParams::default() };
    while !stop.load(Ordering::Relaxed) {
        if let Ok(list) = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await {
            for n in list.items {
                let spec = n.spec.clone().unwrap_or_default();
                let cordoned = spec.unschedulable.unwrap_or(false);
                let taints = spec.taints.unwrap_or_default();
                let tainted = taints.iter().any(|t| t.key == k8s::nodes::TAINT_DRAINING);
                let fenced = cordoned || (strip_taint && tainted);
                if !fenced {
                    continue;
                }
                let mut patch = json!({"spec": {"unschedulable": false}});
                if strip_taint {
                    let kept: Vec<&Taint> = taints.iter().filter(|t| t.key != k8s::nodes::TAINT_DRAINING).collect();
                    patch["spec"]["taints"] = json!(kept);
                }
                let name = n.metadata.name.unwrap_or_default();
                if nodes.patch(&name, &pp, &Patch::Merge(patch)).await.is_ok() {
                    reverts.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// Uncordons every cordoned Karpenter node every 200 ms, as K3s did in the field report.
async fn cordon_reverter(client: Client, stop: Arc<AtomicBool>, reverts: Arc<AtomicU64>) {
    fence_lifter(client, stop, reverts, false, Duration::from_millis(200)).await;
}

/// A pod without an owner on `node` that takes `grace` (scaled by the server's time scale) to
/// stop once evicted, so the drain lasts long enough for the tool's cordon re-check.
async fn slow_pod(client: &Client, node: &str, name: &str, grace_seconds: i64) {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "default");
    let pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": grace_seconds,
            "containers": [{"name": "slow", "image": "busybox"}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
}

/// The fence is put back and the lift reported; the machines go once it holds. Who lifted it
/// cannot be named: an uncordon (`unschedulable: false`) removes the field, and kube-apiserver
/// records no owner of a field that is not there, so `managedFields` keeps no trace of the
/// reverter (the differential suite, tests/realstack/differential.rs, shows it on the real
/// server, and the emulator does the same); the report says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifted_cordon_is_put_back_and_reported() {
    let s = two_pool_world("fr-reverter", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    // 800 s at time scale 0.01: 8 s of termination, longer than two of the tool's 3 s re-checks
    slow_pod(&b.client, &world.nodes[0].node, "slow-to-leave", 800).await;
    let stop = Arc::new(AtomicBool::new(false));
    let reverts = Arc::new(AtomicU64::new(0));
    let reverter = tokio::spawn(cordon_reverter(b.client.clone(), stop.clone(), reverts.clone()));
    // the reverter gives up a while after its first revert (its own loop, an operator who
    // notices): from then on the fences hold, and the machines go. Counted from that revert, not
    // from now, the tool's start on a loaded machine does not eat into it.
    let stopper = {
        let (stop, reverts) = (stop.clone(), reverts.clone());
        tokio::spawn(async move {
            while reverts.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_secs(12)).await;
            stop.store(true, Ordering::Relaxed);
        })
    };

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    stop.store(true, Ordering::Relaxed);
    reverter.await.unwrap();
    stopper.abort();
    assert_eq!(run.code, 0, "{}", run.dump());
    assert!(reverts.load(Ordering::Relaxed) > 0, "the reverter never reverted: the test proves nothing");
    let lifts: Vec<&Value> = run.report["blockers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| {
            b["kind"] == "field-manager" && b["reason"].as_str().is_some_and(|r| r.contains("lifted the fence"))
        })
        .collect();
    assert!(!lifts.is_empty(), "the report does not say the fence was lifted:\n{}", run.dump());
    for l in &lifts {
        assert_eq!(l["name"], k8s::nodes::LIFTER_NOT_RECORDED, "{l}");
        assert!(l["reason"].as_str().is_some_and(|r| r.contains("records no field manager")), "{l}");
    }
    assert_eq!(run.report["pods_lost"].as_u64().unwrap_or(0), 0, "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// An actor that lifts the cordon and strips the tool's taint every second never lets a fence
/// hold: no machine is released under it, so no pod can go down with one; at the drain deadline
/// the run ends blocked, naming the nodes and that their fence keeps being lifted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_that_keeps_being_lifted_holds_its_machine_back_until_the_deadline() {
    let s = two_pool_world("fr-lifter", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reverts = Arc::new(AtomicU64::new(0));
    let lifter =
        tokio::spawn(fence_lifter(b.client.clone(), stop.clone(), reverts.clone(), true, Duration::from_secs(1)));

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--drain-deadline", "15s"]).await;
    stop.store(true, Ordering::Relaxed);
    lifter.await.unwrap();
    assert!(reverts.load(Ordering::Relaxed) > 0, "the lifter never lifted a fence: the test proves nothing");
    assert_eq!(run.code, 5, "{}", run.dump());
    assert_eq!(run.report["pods_lost"].as_u64().unwrap_or(0), 0, "{}", run.dump());
    let blockers = run.report["blockers"].to_string();
    assert!(!blockers.contains("unknown"), "a lift the server kept no record of is said so: {blockers}");
    // each Karpenter node is either still fenced off by the run or named as lifted; those whose
    // fence never held are not released, and their instances still run
    let nodes: Api<Node> = Api::all(b.client.clone());
    let mut held_back = 0;
    for n in &world.nodes {
        if nodes.get_opt(&n.node).await.unwrap().is_none() {
            continue;
        }
        held_back += 1;
        assert_eq!(states(&b.aws, std::slice::from_ref(&n.instance_id)).await[&n.instance_id], InstanceState::Running);
    }
    assert_eq!(held_back, world.nodes.len(), "every node's fence was lifted, so none was released:\n{}", run.dump());
    // each held-back machine's task says why; the lifts are in the blockers, the lifter unnamed
    let held: Vec<String> = run.report["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["result"] == "blocked")
        .filter_map(|t| t["detail"].as_str().map(str::to_string))
        .collect();
    assert_eq!(held.len(), world.nodes.len(), "{held:?}\n{}", run.dump());
    for (n, why) in world.nodes.iter().zip(&held) {
        assert!(why.contains("keeps being lifted"), "the task says why the node was held back: {why}");
        assert!(held.iter().any(|h| h.contains(&n.node)), "node {} is not named: {held:?}", n.node);
    }
    assert!(blockers.contains("records no field manager for a removed field"), "{blockers}");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_owned_taints() {
    let mut s = two_pool_world("fr-platform", 2);
    s.managed_nodes = 4;
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    // taints and a cordon the platform owns (OS configuration, --register-with-taints), written
    // by their own field managers
    let nodes: Api<Node> = Api::all(b.client.clone());
    let pp = PatchParams { field_manager: Some("talos".into()), ..PatchParams::default() };
    for (i, m) in world.managed_nodes.iter().enumerate().skip(1) {
        let node = nodes.get(&m.node).await.unwrap();
        let mut taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
        taints.push(Taint {
            key: format!("platform.example.com/os-{i}"),
            effect: "NoSchedule".into(),
            ..Taint::default()
        });
        let mut patch = json!({"spec": {"taints": taints}});
        if i == 2 {
            patch["spec"]["unschedulable"] = json!(true);
        }
        nodes.patch(&m.node, &pp, &Patch::Merge(patch)).await.unwrap();
    }
    let before = untouchable_nodes(&b.client, &world).await;
    assert!(before.values().filter(|v| v["taints"].as_array().is_some_and(|t| !t.is_empty())).count() >= 4);

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    // not even a no-op write: the tool's field manager appears on none of them
    for name in untouchable_names(&world) {
        let node = nodes.get(&name).await.unwrap();
        let managers: Vec<String> =
            node.metadata.managed_fields.unwrap_or_default().into_iter().filter_map(|m| m.manager).collect();
        assert!(!managers.iter().any(|m| m == k8s::objects::FIELD_MANAGER), "the tool wrote node {name}: {managers:?}");
    }
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_gone_first() {
    let s = two_pool_world("fr-helm-uninstall", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let deployments: Api<Deployment> = Api::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE);
    deployments.delete(naming::KARPENTER_NAME, &DeleteParams::default()).await.unwrap();

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_pdb() {
    let mut s = two_pool_world("fr-strict-pdb", 3);
    s.strict_pdb = true;
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let strict = world.workloads.iter().find(|w| w.strict_pdb).unwrap();
    let pdb = format!("{}/{}", strict.namespace, strict.name);

    // no terminal here: a line every second says what the run waits for, the budget by name
    let args = ["--drain-deadline", "4s", "--progress-every", "1s"];
    let blocked = teardown(&b, &world.cluster, Consent::Yes, &args).await;
    assert_eq!(blocked.code, 5, "{}", blocked.dump());
    assert_eq!(blocked.report["outcome"], "blocked");
    // the report drawn as a timeline: the drain's blocked machines marked critical
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("report.json");
    std::fs::write(&file, blocked.report.to_string()).unwrap();
    let drawn = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["report", "timeline"])
        .arg(&file)
        .output()
        .unwrap();
    let chart = String::from_utf8_lossy(&drawn.stdout);
    assert_eq!(drawn.status.code(), Some(0), "{chart}{}", String::from_utf8_lossy(&drawn.stderr));
    assert!(chart.starts_with("gantt\n") && chart.contains("    section drain\n"), "{chart}");
    assert!(chart.lines().any(|l| l.contains(" blocked : crit, ")), "{chart}");
    std::fs::write(&file, "{\"kind\": \"Pod\"}").unwrap();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["report", "timeline"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "not a report is bad input");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("is this a report written by"));
    let waiting: Vec<&str> = blocked.stderr.lines().filter(|l| l.contains("still running")).collect();
    assert!(!waiting.is_empty(), "no line said what the run waited for:\n{}", blocked.stderr);
    assert!(
        waiting.iter().any(|l| l.contains("pod(s) to move on") && l.contains(&format!("PodDisruptionBudget(s) {pdb}"))),
        "{waiting:#?}"
    );
    assert!(
        blocked.report["blockers"].as_array().unwrap().iter().any(|b| b["kind"] == "pdb" && b["name"] == pdb),
        "the report does not name PDB {pdb}:\n{}",
        blocked.dump()
    );
    let pod_prefix = format!("{}/{}-", strict.namespace, strict.name);
    assert!(
        blocked.report["blockers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["kind"] == "pod" && b["name"].as_str().is_some_and(|n| n.starts_with(&pod_prefix))),
        "the report does not name the blocked pods:\n{}",
        blocked.dump()
    );
    // a machine whose drain was blocked keeps its instance; the others may have gone meanwhile
    let blocked_machines: Vec<&str> = blocked.report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["step"] == "drain" && r["result"] == "blocked")
        .filter_map(|r| r["object"].as_str())
        .collect();
    assert!(!blocked_machines.is_empty(), "{}", blocked.dump());
    let ours = states(&b.aws, &world.karpenter_instance_ids()).await;
    for n in world.nodes.iter().filter(|n| blocked_machines.contains(&n.nodeclaim.as_str())) {
        assert_eq!(ours[&n.instance_id], InstanceState::Running, "{}: {ours:?}", n.nodeclaim);
    }

    let run =
        teardown(&b, &world.cluster, Consent::Yes, &["--drain-deadline", "2s", "--on-drain-deadline", "delete"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

async fn launch_orphan(b: &Bed, world: &World) -> String {
    let n = &world.nodes[0];
    let tags: BTreeMap<String, String> = naming::launch_tags(&world.cluster, &n.pool, &n.class);
    let got = b.cloud.launch_tagged(naming::IMAGE_ID, naming::INSTANCE_TYPE, Some(&n.zone), 1, &tags).await.unwrap();
    got[0].id.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launched_never_registered() {
    let s = two_pool_world("fr-orphan", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let orphan = launch_orphan(&b, &world).await;

    let verify = tool(&b, "verify", &world.cluster, &Invocation::default()).await;
    assert_eq!(verify.code, 4, "{}", verify.dump());
    assert!(verify.report.to_string().contains(&orphan), "verify does not name {orphan}:\n{}", verify.dump());

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 4, "{}", run.dump());
    assert_eq!(run.report["outcome"], "leftovers");
    assert!(run.report["leftovers"].to_string().contains(&orphan), "run does not name {orphan}:\n{}", run.dump());
    assert_eq!(states(&b.aws, std::slice::from_ref(&orphan)).await[&orphan], InstanceState::Running);

    let reclaim = teardown(&b, &world.cluster, Consent::Yes, &["--reclaim"]).await;
    assert_eq!(reclaim.code, 0, "{}", reclaim.dump());
    assert!(reclaim.report["reclaimed"].to_string().contains(&orphan), "{}", reclaim.dump());
    assert_eq!(states(&b.aws, std::slice::from_ref(&orphan)).await[&orphan], InstanceState::Terminated);
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// A log shipper pinned to a NodePool that tolerates everything (`operator: Exists`).
/// A real scheduler puts an evicted replica straight back on another cordoned node of its pool
/// (it tolerates the cordon), so evicting it is a chase until the deadline (exit 5). Like
/// Karpenter, the tool leaves such pods to go with their node, and names them in the report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_tolerating_everything_go_with_their_node() {
    // room for the shipper's pods next to the workloads
    let s = WorldSpec { max_pods_per_node: Some(8), ..two_pool_world("fr-tolerate-all", 3) };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    // a pool of one node: each evicted replica comes straight back to the same cordoned node
    let pool = world.node_pools[1].clone();
    assert_eq!(world.nodes_of_pool(&pool).count(), 1, "the shipper's pool has one node");
    let shipper: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "log-shipper", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "log-shipper"}},
            "template": {
                "metadata": {"labels": {"app": "log-shipper"}},
                "spec": {
                    "nodeSelector": {"karpenter.sh/nodepool": pool},
                    "tolerations": [{"operator": "Exists"}],
                    // long enough (0.6 s at the bed's time scale) for the ReplicaSet's
                    // replacement to be bound before the evicted pod is gone, as on a real
                    // cluster: the node is never empty, so a drain that evicts it never ends
                    "terminationGracePeriodSeconds": 60,
                    "containers": [{"name": "shipper", "image": "fluent-bit"}]
                }
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(b.client.clone(), "default").create(&PostParams::default(), &shipper).await.unwrap();
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(b.client.clone(), "default");
    let scheduled = || async {
        let list = pods.list(&ListParams::default().labels("app=log-shipper")).await.unwrap();
        list.items.iter().filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()).count()
    };
    let t = std::time::Instant::now();
    while scheduled().await < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "the log shipper was never scheduled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--drain-deadline", "20s"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean");
    let named: Vec<&str> = run.report["blockers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["kind"] == "pod-goes-with-node")
        .filter_map(|b| b["name"].as_str())
        .collect();
    assert!(
        named.iter().any(|n| n.starts_with("default/log-shipper-")),
        "the report names the shipper pods:\n{}",
        run.dump()
    );
    assert!(run.stdout.contains("went with its node: pod default/log-shipper-"), "{}", run.dump());
    assert!(!run.stdout.contains("blocked by"), "a pod that went with its node blocked nothing:\n{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// A PDB-heavy cluster (every workload `maxUnavailable: 1`) with spare capacity outside
/// Karpenter, so each budget allows its next eviction once the last evicted pod's replacement is
/// ready elsewhere. The drain asks the Eviction API only when the budget's watched status allows
/// it: about one eviction request per evicted pod, where asking blindly and retrying each refusal
/// once a second sent two or more per pod (1,771 for 800 pods in a user's report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pdb_heavy_cluster_is_drained_with_one_eviction_request_per_pod() {
    let s = WorldSpec {
        pdb_max_unavailable: Some(1),
        // spare on-demand capacity outside Karpenter (no NodePool label): where replacements go
        spare_nodes: 2,
        spare_pods: 40,
        pods_per_node: 4,
        replicas_per_workload: 4,
        node_pools: 2,
        ..two_pool_world("fr-pdb-heavy", 6)
    };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let nodes: Api<Node> = Api::all(b.client.clone());
    let spare: Vec<String> = (0..s.spare_nodes).map(|i| format!("spare-{i}.{REGION}.compute.internal")).collect();
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--drain-deadline", "60s"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    let evicted: u64 = run.report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|st| st["step"] == "drain")
        .filter_map(|st| st["detail"].as_str()?.split(' ').next()?.parse::<u64>().ok())
        .sum();
    let requests = run.report["api_calls"]["kubernetes:evict"].as_u64().unwrap_or(0);
    eprintln!("{evicted} pods evicted with {requests} eviction requests; {}", run.report["api_calls"]);
    assert_eq!(evicted, (world.nodes.len() * s.pods_per_node) as u64, "{}", run.dump());
    // a refusal now and then when the watch is a status behind the server, never a retry loop
    assert!(requests <= evicted + 3, "{requests} eviction requests for {evicted} evicted pods:\n{}", run.dump());
    for name in &spare {
        let n = nodes.get(name).await.unwrap();
        assert!(n.spec.unwrap_or_default().unschedulable != Some(true), "the tool cordoned {name}, not Karpenter's");
    }
    b.server.shutdown().await;
}

/// The key of every taint the tool writes: the remediation controller below strips them with the
/// cordon, as an agent that owns a node's scheduling state undoes every fence it did not set.
const TOOL_TAINT_PREFIX: &str = "karpenter-teardown.io/";

/// Undoes every fence on Karpenter's nodes every 200 ms (the cordon, and any taint of the tool's)
/// until the Karpenter controller is scaled to zero, which the plan of the test below does after
/// every drain. It stops there because no drain can close the moment between its last look at a
/// node and the instance's termination against an actor that lifts every fence in that moment;
/// what is tested is that pods bound while the fence was down are drained before their node
/// goes, not that moment.
async fn fence_reverter(client: Client, reverts: Arc<AtomicU64>) {
    let nodes: Api<Node> = Api::all(client.clone());
    let deployments: Api<Deployment> = Api::namespaced(client, naming::KARPENTER_NAMESPACE);
    let pp = PatchParams { field_manager: Some("node-remediator".into()), ..PatchParams::default() };
    loop {
        let replicas = deployments.get_opt(naming::KARPENTER_NAME).await.ok().flatten().and_then(|d| d.spec?.replicas);
        if replicas.is_none_or(|r| r == 0) {
            return;
        }
        if let Ok(list) = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await {
            for n in list.items {
                let spec = n.spec.clone().unwrap_or_default();
                let taints = spec.taints.unwrap_or_default();
                let kept: Vec<&Taint> = taints.iter().filter(|t| !t.key.starts_with(TOOL_TAINT_PREFIX)).collect();
                if spec.unschedulable != Some(true) && kept.len() == taints.len() {
                    continue;
                }
                let patch = json!({"metadata": {"resourceVersion": n.metadata.resource_version},
                    "spec": {"unschedulable": false, "taints": kept}});
                let name = n.metadata.name.unwrap_or_default();
                if nodes.patch(&name, &pp, &Patch::Merge(patch)).await.is_ok() {
                    reverts.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether a pod is one a drain must move: not a DaemonSet's or a mirror pod, not finished, and
/// not tolerating a fence (such a pod goes with its node).
fn must_be_drained(pod: &Value) -> bool {
    let daemonset =
        pod["metadata"]["ownerReferences"].as_array().is_some_and(|os| os.iter().any(|o| o["kind"] == "DaemonSet"));
    let mirror = pod["metadata"]["annotations"].get("kubernetes.io/config.mirror").is_some();
    let finished = matches!(pod["status"]["phase"].as_str(), Some("Succeeded" | "Failed"));
    let tolerates = pod["spec"]["tolerations"].as_array().is_some_and(|ts| {
        ts.iter().any(|t| {
            t["operator"] == "Exists" && t["key"].as_str().is_none_or(str::is_empty)
                || t["key"] == "node.kubernetes.io/unschedulable"
                || t["key"] == "karpenter.sh/disrupted"
        })
    });
    !(daemonset || mirror || finished || tolerates)
}

/// What the store's history shows of pods and Karpenter nodes.
#[derive(Default)]
struct PodFates {
    /// Pods bound to a Karpenter node after the tool first fenced it.
    rebound: Vec<String>,
    /// Pods still bound to a Karpenter node (terminating or not) when it was deleted.
    died_with_node: Vec<String>,
}

fn pod_fates(events: &[Arc<sandbox_apiserver::StoreEvent>], karpenter_nodes: &BTreeSet<String>) -> PodFates {
    let mut fenced: BTreeSet<String> = BTreeSet::new();
    let mut gone: BTreeSet<String> = BTreeSet::new();
    // pod uid → (namespace/name, node), for the pods a drain must move
    let mut bound: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut fates = PodFates::default();
    for ev in events {
        let object = ev.object();
        match &*ev.key.gr.resource {
            "nodes" if karpenter_nodes.contains(&*ev.key.name) => {
                let name = ev.key.name.to_string();
                if let Some(old) = ev.old()
                    && written_by(&old, &object, k8s::objects::FIELD_MANAGER)
                {
                    fenced.insert(name.clone());
                }
                let deleting =
                    ev.event_type.as_str() == "DELETED" || !object["metadata"]["deletionTimestamp"].is_null();
                if deleting && gone.insert(name.clone()) {
                    fates.died_with_node.extend(bound.values().filter(|(_, n)| *n == name).map(|(p, _)| p.clone()));
                }
            }
            "pods" => {
                let uid = object["metadata"]["uid"].as_str().unwrap_or_default().to_string();
                let node = object["spec"]["nodeName"].as_str().unwrap_or_default().to_string();
                let key = format!("{}/{}", ev.key.namespace, ev.key.name);
                if ev.event_type.as_str() == "DELETED" || !must_be_drained(&object) || node.is_empty() {
                    bound.remove(&uid);
                    continue;
                }
                let was = ev.old().and_then(|o| o["spec"]["nodeName"].as_str().map(str::to_string)).unwrap_or_default();
                if was.is_empty() && fenced.contains(&node) {
                    fates.rebound.push(key.clone());
                }
                if karpenter_nodes.contains(&node) {
                    bound.insert(uid, (key, node));
                }
            }
            _ => {}
        }
    }
    fates
}

/// The field report: pods the scheduler bound to a node while another actor had lifted its fence
/// were never evicted; they died with their node, bypassing their budgets, in a run reported
/// clean. Every pod a drain must move has to leave its node before the node goes, however often
/// the fence was lifted, and the report counts the pods that were bound to a fenced node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_bound_after_the_fence_was_lifted_are_evicted_before_their_node_goes() {
    let s = two_pool_world("fr-rebound", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let karpenter_nodes: BTreeSet<String> = world.nodes.iter().map(|n| n.node.clone()).collect();
    // keeps one drain going (8 s at time scale 0.01) while the other nodes are drained and their
    // fences lifted, so that evicted pods' replacements are bound to them after their drain
    slow_pod(&b.client, &world.nodes[0].node, "slow-to-leave", 800).await;

    let mut events = b.server.store().subscribe();
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    let recorder = tokio::spawn(async move {
        use tokio::sync::broadcast::error::{RecvError, TryRecvError};
        let mut seen = Vec::new();
        loop {
            tokio::select! {
                ev = events.recv() => match ev {
                    Ok(ev) => seen.push(ev),
                    Err(RecvError::Lagged(n)) => panic!("the recorder lagged by {n} events"),
                    Err(RecvError::Closed) => return seen,
                },
                _ = &mut done_rx => loop {
                    match events.try_recv() {
                        Ok(ev) => seen.push(ev),
                        Err(TryRecvError::Lagged(n)) => panic!("the recorder lagged by {n} events"),
                        Err(_) => return seen,
                    }
                },
            }
        }
    });
    let reverts = Arc::new(AtomicU64::new(0));
    let reverter = tokio::spawn(fence_reverter(b.client.clone(), reverts.clone()));
    // The default plan releases a machine as soon as its own drain ends, a moment the reverter
    // cannot see from outside; with the controller removed after every drain, its scale-down
    // marks the end of the drains and the start of the releases.
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/plans/default.toml")).unwrap();
    let plan = b.dir.path().join("controller-through-the-drain.toml");
    std::fs::write(&plan, crate::common::e2e::controller_through_the_drain(&text)).unwrap();

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan.to_str().unwrap()]).await;
    reverter.abort();
    let _ = done_tx.send(());
    let seen = recorder.await.unwrap();
    assert!(reverts.load(Ordering::Relaxed) > 0, "the reverter never lifted a fence: the test proves nothing");
    let fates = pod_fates(&seen, &karpenter_nodes);
    eprintln!("{} pod(s) bound to fenced nodes; report: {}", fates.rebound.len(), run.report["pods_rebound"]);
    assert!(!fates.rebound.is_empty(), "no pod was bound to a fenced node: the test proves nothing\n{}", run.dump());
    assert!(fates.died_with_node.is_empty(), "pods died with their node: {:?}\n{}", fates.died_with_node, run.dump());
    assert_eq!(run.code, 0, "{}", run.dump());
    let counted = run.report["pods_rebound"].as_u64();
    assert!(
        counted.is_some_and(|n| n > 0 && n <= fates.rebound.len() as u64),
        "the report counts {counted:?} re-bound pods, the server bound {}:\n{}",
        fates.rebound.len(),
        run.dump()
    );
    assert_eq!(crate::common::schema::schema_errors(&run.report), Vec::<String>::new(), "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}
