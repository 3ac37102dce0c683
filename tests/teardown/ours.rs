//! Every object the run writes to is proven ours by facts that agree, never by one field that
//! names it: a NodeClaim's stale node name reused by a managed node group's node, a plan that
//! would reclaim under live nodes, a Karpenter installed under another name, a fence put back.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::engine::actions::FENCE_ANNOTATION;
use karpenter_teardown::k8s;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use sandbox_sim::{SimController, SimSettings, generate, naming};
use serde_json::{Value, json};

use crate::common::e2e::{
    Bed, Consent, REGION, assert_torn_down, bed, small_world, states, teardown, untouchable_nodes,
};

fn plan_file(b: &Bed, name: &str, text: &str) -> PathBuf {
    let p = b.dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The uids of the pods bound to `node`, but the Karpenter controller's (the run scales it to
/// zero, wherever it runs).
async fn pods_on(client: &kube::Client, node: &str) -> Vec<String> {
    let pods: Api<Pod> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}")).labels(&format!(
        "{}!={}",
        naming::KARPENTER_APP_LABEL,
        naming::KARPENTER_NAME
    ));
    let mut uids: Vec<String> =
        pods.list(&lp).await.unwrap().items.into_iter().filter_map(|p| p.metadata.uid).collect();
    uids.sort();
    uids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_claim_naming_a_managed_nodes_reused_name_never_touches_that_node() {
    let spec = small_world("e2e-own-stale", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    // the managed node that runs system pods
    let mut managed = String::new();
    for m in &world.managed_nodes {
        if !pods_on(&b.client, &m.node).await.is_empty() {
            managed = m.node.clone();
            break;
        }
    }
    assert!(!managed.is_empty(), "a managed node runs system pods");
    // Karpenter was uninstalled and left a NodeClaim on its finalizer; its instance is long gone
    // (EC2 no longer knows the id), and a managed node group's newer instance registered under
    // the same name
    let claims: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodeclaim_resource());
    let model = claims.get(&world.nodes[0].nodeclaim).await.unwrap();
    let mut stale = model.clone();
    stale.metadata = kube::api::ObjectMeta {
        name: Some("stale-uninstalled".into()),
        labels: model.metadata.labels.clone(),
        finalizers: Some(vec!["karpenter.sh/termination".into()]),
        ..Default::default()
    };
    stale.data.as_object_mut().unwrap().remove("status");
    claims.create(&PostParams::default(), &stale).await.unwrap();
    let gone_instance = "i-0deadbeef00000001";
    let status = json!({"status": {"providerID": format!("aws:///{REGION}a/{gone_instance}"), "nodeName": managed}});
    claims.patch_status("stale-uninstalled", &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    let nodes: Api<Node> = Api::all(b.client.clone());
    let managed_uid = nodes.get(&managed).await.unwrap().metadata.uid;
    let managed_pods = pods_on(&b.client, &managed).await;
    let before = untouchable_nodes(&b.client, &world).await;

    // a dry run names the node it leaves alone, and why
    let dry = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    let not_ours = dry.report["not_ours"].as_array().cloned().unwrap_or_default();
    let named: Vec<&Value> = not_ours.iter().filter(|f| f["name"] == managed.as_str()).collect();
    assert_eq!(named.len(), 1, "{}", dry.dump());
    assert_eq!(named[0]["kind"], "Node");
    assert_eq!(named[0]["owner"], "claim-mismatch");
    let detail = named[0]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("stale-uninstalled") && detail.contains(gone_instance), "{detail}");

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    // the managed node: not cordoned, tainted or relabelled, not deleted, no pod evicted
    assert_eq!(untouchable_nodes(&b.client, &world).await, before, "the managed node was written");
    assert_eq!(nodes.get(&managed).await.unwrap().metadata.uid, managed_uid, "the managed node was deleted");
    assert_eq!(pods_on(&b.client, &managed).await, managed_pods, "a pod was evicted from the managed node");
    // the stale claim was finished on EC2's word that its instance is gone
    assert!(claims.get_opt("stale-uninstalled").await.unwrap().is_none(), "the stale claim is left");
    let steps = run.report["steps"].as_array().unwrap();
    let released: Vec<&Value> =
        steps.iter().filter(|s| s["object"] == "stale-uninstalled" && s["action"] == "discharge-finalizers").collect();
    assert_eq!(released.len(), 1, "{}", run.dump());
    let detail = released[0]["detail"].as_str().unwrap_or_default();
    assert!(!detail.contains(&managed), "the release names no Node of the managed group: {detail}");
    let drains: Vec<&Value> =
        steps.iter().filter(|s| s["object"] == "stale-uninstalled" && s["action"] == "drain").collect();
    assert_eq!(drains.len(), 1);
    assert_eq!(drains[0]["result"], "skipped", "a claim without its node has nothing to drain: {}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_never_terminates_under_a_node_whatever_the_plan() {
    let spec = small_world("e2e-own-reclaim", 3);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let ours = world.karpenter_instance_ids();
    assert_eq!(ours.len(), 3);

    // a plan whose verify would reclaim before any drain is refused when it is loaded
    let check = plan_file(&b, "verify-only.toml", crate::common::e2e::VERIFY_ONLY);
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", check.to_str().unwrap(), "--reclaim"]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert!(run.stderr.contains("step \"check\"") && run.stderr.contains("--reclaim"), "{}", run.dump());
    // without --reclaim the same plan only checks
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", check.to_str().unwrap()]).await;
    assert_eq!(run.code, 4, "the instances are leftovers, reported: {}", run.dump());
    assert_eq!(run.report["reclaimed"].as_array().map(Vec::len).unwrap_or(0), 0, "{}", run.dump());
    let after = states(&b.aws, &ours).await;
    assert_eq!(after.len(), 3);
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");

    // a plan that drains but releases nothing: at verify every instance still stands for a Node
    let drained = plan_file(&b, "drain-then-verify.toml", crate::common::e2e::DRAIN_THEN_VERIFY);
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", drained.to_str().unwrap(), "--reclaim"]).await;
    assert_eq!(run.code, 5, "the reclaim is refused, the run blocked: {}", run.dump());
    let verify: Vec<&Value> =
        run.report["steps"].as_array().unwrap().iter().filter(|s| s["action"] == "verify").collect();
    assert_eq!(verify.len(), 1, "{}", run.dump());
    assert_eq!(verify[0]["result"], "blocked", "{}", run.dump());
    let detail = verify[0]["detail"].as_str().unwrap_or_default();
    for id in &ours {
        assert!(detail.contains(id.as_str()), "names {id}: {detail}");
    }
    assert_eq!(run.report["reclaimed"].as_array().map(Vec::len).unwrap_or(0), 0, "{}", run.dump());
    let after = states(&b.aws, &ours).await;
    assert_eq!(after.len(), 3);
    assert!(after.values().all(|s| *s == InstanceState::Running), "nothing terminated: {after:?}");
    // the launch templates of the classes that still exist are kept too
    let templates = b.aws.ec2.launch_templates(&world.cluster).await.unwrap();
    assert_eq!(templates.len(), world.node_classes.len(), "{templates:?}");
    b.server.shutdown().await;
}

/// The world's controller Deployment again, under the names Karpenter's chart gives it with
/// `nameOverride: karpenter-controller` (`fullnameOverride` the same), with `image` and `env`
/// for its container; the original is deleted.
async fn rename_controller(b: &Bed, image: Option<&str>, env: Option<Value>) -> String {
    let name = "karpenter-controller";
    let api: Api<Deployment> = Api::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE);
    let original = api.get(naming::KARPENTER_NAME).await.unwrap();
    let mut d = serde_json::to_value(&original).unwrap();
    let labels = json!({naming::KARPENTER_APP_LABEL: name, "app.kubernetes.io/instance": "platform"});
    d["metadata"] = json!({"name": name, "namespace": naming::KARPENTER_NAMESPACE, "labels": labels});
    d["spec"]["selector"] = json!({"matchLabels": labels});
    d["spec"]["template"]["metadata"]["labels"] = labels;
    if let Some(image) = image {
        d["spec"]["template"]["spec"]["containers"][0]["image"] = json!(image);
    }
    if let Some(env) = env {
        d["spec"]["template"]["spec"]["containers"][0]["env"] = env;
    }
    d.as_object_mut().unwrap().remove("status");
    let renamed: Deployment = serde_json::from_value(d).unwrap();
    api.create(&PostParams::default(), &renamed).await.unwrap();
    api.delete(naming::KARPENTER_NAME, &DeleteParams::default()).await.unwrap();
    name.to_string()
}

async fn replicas(b: &Bed, name: &str) -> i32 {
    let api: Api<Deployment> = Api::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE);
    api.get(name).await.unwrap().spec.and_then(|s| s.replicas).unwrap_or(1)
}

fn live_karpenter_named(b: &Bed, world: &sandbox_sim::World, deployment: &str) -> SimController {
    SimController::start(
        b.client.clone(),
        b.cloud.clone(),
        SimSettings {
            version: world.version,
            time_scale: 0.02,
            deployment: deployment.into(),
            ..SimSettings::new(&world.cluster, REGION)
        },
    )
}

fn remove_controller_detail(run: &crate::common::e2e::Run) -> String {
    let steps = run.report["steps"].as_array().cloned().unwrap_or_default();
    let found: Vec<&Value> = steps.iter().filter(|s| s["action"] == "remove-controller").collect();
    assert_eq!(found.len(), 1, "{}", run.dump());
    found[0]["detail"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_installed_under_another_name_is_found_by_its_image_and_stopped() {
    let spec = small_world("e2e-own-renamed", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let name = rename_controller(&b, None, None).await;
    let mut live = live_karpenter_named(&b, &world, &name);
    assert!(live.wait_active(true, Duration::from_secs(60)).await, "the renamed controller runs");
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let detail = remove_controller_detail(&run);
    assert!(detail.contains(&format!("scaled kube-system/{name} from 1 to 0")), "{detail}");
    assert!(!detail.contains("already removed"), "{detail}");
    assert_eq!(replicas(&b, &name).await, 0);
    assert_torn_down(&b, &world, &before).await;
    live.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_known_only_by_the_lease_its_leader_holds_is_found_and_stopped() {
    let spec = small_world("e2e-own-lease", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    // a mirror under another path, and an environment without the chart's KARPENTER_SERVICE:
    // neither the label, the image nor the environment says Karpenter; its leader Lease does
    let env = json!([{"name": "CLUSTER_NAME", "value": world.cluster}]);
    let name = rename_controller(&b, Some("registry.internal/platform/kc:1.14.0"), Some(env)).await;
    let mut live = live_karpenter_named(&b, &world, &name);
    assert!(live.wait_active(true, Duration::from_secs(60)).await, "the renamed controller runs");
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE);
    let selector = format!("{}={name}", naming::KARPENTER_APP_LABEL);
    let leader = pods.list(&ListParams::default().labels(&selector)).await.unwrap().items;
    assert_eq!(leader.len(), 1, "the controller's pod");
    let leader = leader[0].metadata.name.clone().unwrap();
    // what controller-runtime's leader election writes (holder `<hostname>_<uuid>`)
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "karpenter-leader-election", "namespace": naming::KARPENTER_NAMESPACE},
        "spec": {"holderIdentity": format!("{leader}_6c0f7a8e-2f9b-4a7e-9d1c-3b5e0f1a2c3d"),
            "leaseDurationSeconds": 15},
    }))
    .unwrap();
    Api::<Lease>::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE)
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let detail = remove_controller_detail(&run);
    assert!(detail.contains(&format!("scaled kube-system/{name} from 1 to 0")), "{detail}");
    assert_eq!(replicas(&b, &name).await, 0);
    assert_torn_down(&b, &world, &before).await;
    live.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_held_by_a_pod_no_deployment_runs_stops_the_run_before_any_write() {
    let spec = small_world("e2e-own-untraced", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    // a Karpenter run as a bare pod: nothing could keep it stopped
    let bare: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "karpenter-by-hand", "namespace": "platform"},
        "spec": {"containers": [{"name": "c", "image": "registry.internal/kc:1"}]},
    }))
    .unwrap();
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "platform"}}))
            .unwrap();
    Api::<k8s_openapi::api::core::v1::Namespace>::all(b.client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    Api::<Pod>::namespaced(b.client.clone(), "platform").create(&PostParams::default(), &bare).await.unwrap();
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "karpenter-leader-election", "namespace": "platform"},
        "spec": {"holderIdentity": "karpenter-by-hand_0b7e", "leaseDurationSeconds": 15},
    }))
    .unwrap();
    Api::<Lease>::namespaced(b.client.clone(), "platform").create(&PostParams::default(), &lease).await.unwrap();
    let version = crate::common::e2e::settled_resource_version(&b.server).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 3, "refused by a guard: {}", run.dump());
    assert!(
        run.stderr.contains("cannot tell where Karpenter runs") && run.stderr.contains("platform/karpenter-by-hand"),
        "{}",
        run.dump()
    );
    assert_eq!(crate::common::e2e::settled_resource_version(&b.server).await, version, "nothing was written");
    let after = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_limits_were_put_back_under_the_fences_annotation_is_fenced_again() {
    let spec = small_world("e2e-own-refence", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let pools: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodepool_resource());
    let pool = &world.node_pools[0];
    let original = pools.get(pool).await.unwrap();
    let limits = original.data["spec"]["limits"].clone();
    // an earlier run fenced it and was stopped; a GitOps sync put the manifest's limits back
    // and kept the annotation it does not manage
    let saved = json!({"limits": limits, "budgets": original.data["spec"]["disruption"]["budgets"]}).to_string();
    let back = json!({"metadata": {"annotations": {FENCE_ANNOTATION: saved}}, "spec": {"limits": {"cpu": "1000"}}});
    pools.patch(pool, &PatchParams::default(), &Patch::Merge(&back)).await.unwrap();

    let dry = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    // fence, then stop: the run's first step, on its own
    let fence_only = plan_file(
        &b,
        "fence.toml",
        "version = 1\nname = \"fence\"\n[[step]]\nid = \"preflight\"\naction = \"preflight\"\n[[step]]\nid = \"fence\"\naction = \"fence\"\nafter = [\"preflight\"]\n",
    );
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", fence_only.to_str().unwrap()]).await;
    assert_eq!(run.code, 6, "unverified: no verify step: {}", run.dump());
    let fenced = pools.get(pool).await.unwrap();
    assert_eq!(fenced.data["spec"]["limits"]["cpu"], "0", "{:?}", fenced.data["spec"]);
    assert_eq!(fenced.data["spec"]["disruption"]["budgets"], json!([{"nodes": "0"}]));
    // the originals its first fence saved are kept, not the limits put back
    let annotation = fenced.metadata.annotations.unwrap_or_default().remove(FENCE_ANNOTATION);
    assert_eq!(annotation.as_deref(), Some(saved.as_str()));
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pod_let_go_without_an_eviction_is_named_in_the_report() {
    let s = sandbox_sim::WorldSpec { strict_pdb: true, replicas_per_workload: 2, ..small_world("e2e-own-bypass", 2) };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    // a pod that tolerates the fence rides with its node: Karpenter lets it, but it was not asked
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), "default");
    let rider: Pod = serde_json::from_value(json!({
        "metadata": {"name": "rider", "namespace": "default"},
        "spec": {"nodeName": world.nodes[0].node, "containers": [{"name": "c", "image": "x"}],
            "tolerations": [{"operator": "Exists"}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &rider).await.unwrap();

    let run =
        teardown(&b, &world.cluster, Consent::Yes, &["--drain-deadline", "5s", "--on-drain-deadline", "skip"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let bypasses = run.report["bypasses"].as_array().cloned().unwrap_or_default();
    // what the drains say they left by policy skip, node by node
    let steps = run.report["steps"].as_array().unwrap();
    let skipped: usize = steps
        .iter()
        .filter(|s| s["action"] == "drain" && s["result"] == "skipped")
        .filter_map(|s| {
            s["detail"].as_str()?.strip_prefix("drain deadline passed with ")?.split(' ').next()?.parse::<usize>().ok()
        })
        .sum();
    assert!(skipped > 0, "the strict budgets held pods past the deadline: {}", run.dump());
    let of = |kind: &str| bypasses.iter().filter(|b| b["kind"] == kind).count();
    assert_eq!(bypasses.len(), skipped + 1, "{bypasses:?}");
    assert_eq!(of("skip"), skipped, "{bypasses:?}");
    assert_eq!(of("rides-with-node"), 1, "{bypasses:?}");
    let ridden: Vec<&Value> = bypasses.iter().filter(|b| b["kind"] == "rides-with-node").collect();
    assert_eq!(ridden[0]["pod"], "default/rider");
    assert_eq!(ridden[0]["node"], world.nodes[0].node.as_str());
    let nodes: Vec<&str> = world.nodes.iter().map(|n| n.node.as_str()).collect();
    assert!(bypasses.iter().all(|b| nodes.contains(&b["node"].as_str().unwrap_or_default())), "{bypasses:?}");
    b.server.shutdown().await;
}
