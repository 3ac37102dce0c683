//! Every object the run writes to is proven ours by facts that agree, on the real control plane
//! (the sandbox's versions are `tests/teardown/ours.rs`): a NodeClaim's stale node name reused by a
//! managed node group's node, held by the real server's NodeClaim schema and the real scheduler's
//! pods; a plan that would reclaim under live real Nodes; and the real Karpenter installed under
//! its chart's `nameOverride`, found by what it runs and stopped.

use std::time::{Duration, Instant};

use aws_sdk_ec2::types::ResourceType;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::k8s;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use realstack::RealStack;
use realstack::karpenter::{KarpenterSettings, RealKarpenter};
use sandbox_sim::{KarpenterVersion, WorldSpec, generate, naming};
use serde_json::{Value, json};

use crate::common;
use crate::common::e2e::{REGION, Run, assert_torn_down_on, count, run_of, small_world, states, untouchable_nodes};

/// `karpenter-teardown run --cluster cluster ...` as the tool's identity against `s`, with
/// `extra` (no `--yes` unless `extra` has it), and its report. EKS knows the stack as `cluster`.
async fn run(s: &RealStack, cluster: &str, extra: &[&str]) -> Run {
    super::register_eks(s, cluster).await;
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    if std::env::var_os("KT_TEST_LOGS").is_some() {
        cmd.stderr(std::process::Stdio::inherit());
    }
    cmd.args(["run", "--cluster", cluster, "--region", REGION, "--kubeconfig"])
        .arg(s.tool_kubeconfig())
        .arg("--report")
        .arg(&report)
        .args(extra)
        .envs(common::localstack_env())
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    let t = Instant::now();
    let run = run_of(cmd, &report).await;
    eprintln!("run {extra:?} ended with {} in {:?}", run.code, t.elapsed());
    run
}

/// A generated world on the full control plane: the real scheduler binds its pods, kwok runs
/// them, the real workload controllers own them.
async fn world_on_full_stack(prefix: &str, nodes: usize) -> (RealStack, kube::Client, sandbox_sim::World) {
    let spec = WorldSpec { pods_per_node: 2, settle_timeout: Duration::from_secs(120), ..small_world(prefix, nodes) };
    let s = super::control_plane::full_stack(&spec.cluster).await;
    let admin = s.admin_client().await.unwrap();
    let cloud = common::cloud(REGION).await;
    let t = Instant::now();
    let world = generate(&spec, &admin, &cloud).await.unwrap_or_else(|e| {
        panic!(
            "{e}\nkube-scheduler:\n{}\nkube-controller-manager:\n{}",
            s.log_tail("kube-scheduler"),
            s.log_tail("kube-controller-manager")
        )
    });
    eprintln!("generated in {:?}", t.elapsed());
    (s, admin, world)
}

/// Terminates the world's instances the test leaves running (its managed nodes', its decoys', and
/// `more`), so that a run of the suite leaves LocalStack as it found it.
async fn terminate_the_rest(world: &sandbox_sim::World, more: &[String]) {
    let cloud = common::cloud(REGION).await;
    let rest: Vec<String> =
        world.managed_instance_ids().into_iter().chain(world.decoy_instances.clone()).chain(more.to_vec()).collect();
    cloud.terminate(&rest).await.unwrap();
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

/// The report's `not_ours` entries that name `node`.
fn not_ours_naming(run: &Run, node: &str) -> Vec<Value> {
    let all = run.report["not_ours"].as_array().cloned().unwrap_or_default();
    all.into_iter().filter(|f| f["name"] == node).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_claim_naming_a_managed_nodes_reused_name_never_touches_it_on_the_real_control_plane() {
    let (s, admin, world) = world_on_full_stack("rs-own-stale", 2).await;
    assert_eq!(world.nodes.len(), 2);
    assert_eq!(world.managed_nodes.len(), 2);
    // the managed node whose pods (system pods, placed by the real scheduler) would be evicted if
    // the run took it for the claim's
    let mut managed = String::new();
    for m in &world.managed_nodes {
        if !pods_on(&admin, &m.node).await.is_empty() {
            managed = m.node.clone();
            break;
        }
    }
    assert!(!managed.is_empty(), "a managed node runs system pods");

    // Karpenter was uninstalled and left a NodeClaim on its finalizer; its instance is long gone
    // (EC2 never knew the id here), and a managed node group's newer instance registered under the
    // same name. The real server holds the copy to Karpenter's NodeClaim schema.
    let claims: Api<DynamicObject> = Api::all_with(admin.clone(), &k8s::nodeclaim_resource());
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
    let written = claims.get("stale-uninstalled").await.unwrap();
    assert_eq!(written.data["status"]["nodeName"], managed.as_str(), "{:#}", written.data);
    assert!(
        written.data["status"]["providerID"].as_str().is_some_and(|p| p.ends_with(gone_instance)),
        "{:#}",
        written.data
    );

    let nodes: Api<Node> = Api::all(admin.clone());
    let managed_uid = nodes.get(&managed).await.unwrap().metadata.uid;
    assert!(managed_uid.is_some());
    let managed_pods = pods_on(&admin, &managed).await;
    assert!(!managed_pods.is_empty());
    let before = untouchable_nodes(&admin, &world).await;
    assert_eq!(before.len(), 3, "two managed nodes and the control-plane node: {before:?}");

    // a dry run names the node it leaves alone, and why
    let dry = run(&s, &world.cluster, &[]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    let named = not_ours_naming(&dry, &managed);
    assert_eq!(named.len(), 1, "{}", dry.dump());
    assert_eq!(named[0]["kind"], "Node", "{}", dry.dump());
    assert_eq!(named[0]["owner"], "claim-mismatch", "{}", dry.dump());
    let detail = named[0]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("NodeClaim stale-uninstalled") && detail.contains(gone_instance), "{detail}");
    assert_eq!(untouchable_nodes(&admin, &world).await, before, "the dry run wrote to a node");
    assert!(claims.get_opt("stale-uninstalled").await.unwrap().is_some(), "the dry run released the claim");

    let t = Instant::now();
    let done = run(&s, &world.cluster, &["--yes"]).await;
    assert_eq!(done.code, 0, "{}", done.dump());
    eprintln!("torn down in {:?}", t.elapsed());
    // the managed node: not cordoned, tainted or relabelled, not deleted, no pod evicted
    assert_eq!(untouchable_nodes(&admin, &world).await, before, "the managed node was written: {}", done.dump());
    assert_eq!(nodes.get(&managed).await.unwrap().metadata.uid, managed_uid, "the managed node was deleted");
    assert_eq!(pods_on(&admin, &managed).await, managed_pods, "a pod was evicted from the managed node");
    let named = not_ours_naming(&done, &managed);
    assert_eq!(named.len(), 1, "{}", done.dump());
    assert_eq!(named[0]["kind"], "Node", "{}", done.dump());
    assert_eq!(named[0]["owner"], "claim-mismatch", "{}", done.dump());
    // the stale claim was finished on EC2's word that its instance is gone
    assert!(claims.get_opt("stale-uninstalled").await.unwrap().is_none(), "the stale claim is left");
    let steps = done.report["steps"].as_array().cloned().unwrap_or_default();
    let released: Vec<&Value> =
        steps.iter().filter(|s| s["object"] == "stale-uninstalled" && s["action"] == "discharge-finalizers").collect();
    assert_eq!(released.len(), 1, "{}", done.dump());
    let detail = released[0]["detail"].as_str().unwrap_or_default();
    assert!(!detail.contains(&managed), "the release names no Node of the managed group: {detail}");
    let drains: Vec<&Value> =
        steps.iter().filter(|s| s["object"] == "stale-uninstalled" && s["action"] == "drain").collect();
    assert_eq!(drains.len(), 1, "{}", done.dump());
    assert_eq!(drains[0]["result"], "skipped", "a claim without its node has nothing to drain: {}", done.dump());
    let aws = common::localstack(REGION).await;
    assert_torn_down_on(&admin, &aws, &world, &before).await;
    terminate_the_rest(&world, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_never_terminates_under_a_real_node_whatever_the_plan() {
    let (s, admin, world) = world_on_full_stack("rs-own-reclaim", 3).await;
    let aws = common::localstack(REGION).await;
    let ours = world.karpenter_instance_ids();
    assert_eq!(ours.len(), 3);
    let nodes: Api<Node> = Api::all(admin.clone());
    let karpenter_nodes = || async {
        let list = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
        let mut names: Vec<String> = list.items.into_iter().filter_map(|n| n.metadata.name).collect();
        names.sort();
        names
    };
    let standing = karpenter_nodes().await;
    assert_eq!(standing.len(), 3, "{standing:?}");
    let dir = tempfile::tempdir().unwrap();
    let plan = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };

    // a plan whose verify would reclaim before any drain is refused when it is loaded
    let check = plan("verify-only.toml", crate::common::e2e::VERIFY_ONLY);
    let refused = run(&s, &world.cluster, &["--plan", &check, "--reclaim", "--yes"]).await;
    assert_eq!(refused.code, 2, "{}", refused.dump());
    assert!(
        refused.stderr.contains("step \"check\"") && refused.stderr.contains("--reclaim"),
        "names the step and the flag: {}",
        refused.dump()
    );
    let after = states(&aws, &ours).await;
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");
    // without --reclaim the same plan only checks: the instances are leftovers, reported
    let checked = run(&s, &world.cluster, &["--plan", &check, "--yes"]).await;
    assert_eq!(checked.code, 4, "{}", checked.dump());
    assert_eq!(checked.report["reclaimed"].as_array().map(Vec::len).unwrap_or(0), 0, "{}", checked.dump());
    let after = states(&aws, &ours).await;
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");

    // a plan that drains (the real Eviction API, the real disruption controller's budgets) but
    // releases nothing: at verify every instance still stands for a real Node
    let drained = plan("drain-then-verify.toml", crate::common::e2e::DRAIN_THEN_VERIFY);
    let blocked = run(&s, &world.cluster, &["--plan", &drained, "--reclaim", "--yes"]).await;
    assert_eq!(blocked.code, 5, "the reclaim is refused, the run blocked: {}", blocked.dump());
    let steps = blocked.report["steps"].as_array().cloned().unwrap_or_default();
    let drains: Vec<&Value> = steps.iter().filter(|s| s["action"] == "drain").collect();
    assert_eq!(drains.len(), 3, "a drain per machine: {}", blocked.dump());
    let verify: Vec<&Value> = steps.iter().filter(|s| s["action"] == "verify").collect();
    assert_eq!(verify.len(), 1, "{}", blocked.dump());
    assert_eq!(verify[0]["result"], "blocked", "{}", blocked.dump());
    let detail = verify[0]["detail"].as_str().unwrap_or_default();
    for id in &ours {
        assert!(detail.contains(id.as_str()), "names {id}: {detail}");
    }
    assert_eq!(blocked.report["reclaimed"].as_array().map(Vec::len).unwrap_or(0), 0, "{}", blocked.dump());
    let after = states(&aws, &ours).await;
    assert_eq!(after.len(), 3, "{after:?}");
    assert!(after.values().all(|s| *s == InstanceState::Running), "nothing terminated: {after:?}");
    // the Nodes are still there (cordoned by the plan), and the launch templates of the classes
    // that still exist are kept too
    assert_eq!(karpenter_nodes().await, standing, "{}", blocked.dump());
    let templates = aws.ec2.launch_templates(&world.cluster).await.unwrap();
    assert_eq!(templates.len(), world.node_classes.len(), "{templates:?}");
    terminate_the_rest(&world, &ours).await;
}

/// The name Karpenter's Helm chart gives everything with `nameOverride: karpenter-controller`
/// (`fullnameOverride` the same).
const RENAMED: &str = "karpenter-controller";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_karpenter_installed_under_another_name_is_found_by_its_image_and_stopped() {
    const PODS: usize = 2;
    let version = KarpenterVersion::V1_14;
    let cluster = common::unique_cluster("rk-renamed");
    let s = super::stack(&cluster).await;
    let admin = s.admin_client().await.unwrap();
    let config = sandbox_sim::localstack::config_as(REGION, "test").await;
    let (ec2, iam) = (aws_sdk_ec2::Client::new(&config), aws_sdk_iam::Client::new(&config));
    let aws = common::localstack(REGION).await;

    let crds = common::e2e::real_crds(version);
    sandbox_sim::world::install_crds(&admin, version, Some(&crds)).await.unwrap();
    let ami = super::karpenter::infrastructure(&ec2, &iam, &cluster).await;
    // an instance of a managed node group of the cluster: not Karpenter's
    let decoy = ec2
        .run_instances()
        .image_id(&ami)
        .instance_type(aws_sdk_ec2::types::InstanceType::M5Large)
        .min_count(1)
        .max_count(1)
        .tag_specifications(super::karpenter::spec(
            ResourceType::Instance,
            &[(&format!("kubernetes.io/cluster/{cluster}"), "owned"), ("eks:nodegroup-name", "system")],
        ))
        .send()
        .await
        .unwrap();
    let decoy = decoy.instances()[0].instance_id().unwrap().to_string();
    let classes = super::karpenter::class_and_pool(&admin, &ami, &cluster).await;

    super::karpenter::web_workload(&admin, PODS).await;

    let t = Instant::now();
    let karpenter = RealKarpenter::start_version(
        &s,
        version,
        KarpenterSettings {
            cluster_name: cluster.clone(),
            region: REGION.into(),
            aws_endpoint: sandbox_sim::localstack::endpoint(),
            name: RENAMED.into(),
        },
        ec2.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // the controller is known by no name the chart gives by default: its Deployment is
    // `karpenter-controller`, labelled so, and no `karpenter` Deployment exists
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), realstack::karpenter::NAMESPACE);
    assert!(deployments.get_opt(realstack::karpenter::NAME).await.unwrap().is_none());
    let d = deployments.get(RENAMED).await.unwrap();
    let d_labels = d.metadata.labels.clone().unwrap_or_default();
    assert_eq!(d_labels.get("app.kubernetes.io/name").map(String::as_str), Some(RENAMED), "{d_labels:?}");
    let listed = deployments.list(&ListParams::default()).await.unwrap();
    let names: Vec<String> = listed.items.iter().filter_map(|d| d.metadata.name.clone()).collect();
    assert_eq!(names, [RENAMED], "the only Deployment of {}", realstack::karpenter::NAMESPACE);

    // Karpenter launches a node per pod, and each registers
    let claims: Api<DynamicObject> = Api::all_with(admin.clone(), &k8s::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(admin.clone());
    let deadline = Instant::now() + Duration::from_secs(240);
    let instances: Vec<String> = loop {
        let Some(ids) = super::karpenter::claimed_instances(&claims, deadline).await else {
            continue;
        };
        let registered = match nodes.list(&ListParams::default().labels("karpenter.sh/registered=true")).await {
            Ok(list) => list.items.len(),
            Err(kube::Error::Api(e)) if e.code == 429 => 0,
            Err(e) => panic!("listing Nodes: {e}"),
        };
        if ids.len() >= PODS && registered >= PODS {
            break ids;
        }
        assert!(
            Instant::now() < deadline,
            "Karpenter did not launch and register {PODS} nodes ({} claims with instances, {registered} registered); its log:\n{}",
            ids.len(),
            karpenter.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("the renamed real Karpenter launched and registered {} nodes in {:?}", instances.len(), t.elapsed());
    assert_eq!(instances.len(), PODS, "{instances:?}");
    assert!(karpenter.running(), "the renamed controller runs");
    assert!(karpenter.log().contains("launched nodeclaim"), "{}", karpenter.log_tail(40));
    let running = states(&aws, &instances).await;
    assert_eq!(running.len(), PODS, "{running:?}");
    assert!(running.values().all(|s| *s == InstanceState::Running), "{running:?}");
    let class = classes.get("default").await.unwrap();
    let profile = class.data["status"]["instanceProfile"].as_str().expect("the class's instance profile").to_string();
    // the stand-in of its pod carries the renamed chart's labels
    let system_pods: Api<Pod> = Api::namespaced(admin.clone(), realstack::karpenter::NAMESPACE);
    let selector = format!("app.kubernetes.io/name={RENAMED}");
    let controller_pods = system_pods.list(&ListParams::default().labels(&selector)).await.unwrap();
    assert_eq!(controller_pods.items.len(), 1, "the controller's pod");

    // the teardown, with the renamed real Karpenter alive
    let done = super::teardown(&s, &cluster).await;
    assert_eq!(done.code, 0, "{}\nKarpenter:\n{}", done.dump(), karpenter.log_tail(40));
    assert_eq!(done.report["outcome"], "clean", "{}", done.dump());
    let steps = done.report["steps"].as_array().cloned().unwrap_or_default();
    let removed: Vec<&Value> = steps.iter().filter(|s| s["action"] == "remove-controller").collect();
    assert_eq!(removed.len(), 1, "{}", done.dump());
    let detail = removed[0]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(&format!("scaled kube-system/{RENAMED} from 1 to 0")), "{detail}");
    assert!(!detail.contains("already removed"), "{detail}");
    let d = deployments.get(RENAMED).await.unwrap();
    assert_eq!(d.spec.and_then(|s| s.replicas), Some(0), "the renamed Deployment's replicas");

    // the process is gone, and it was never restarted
    assert!(!karpenter.running(), "Karpenter still runs after the teardown");
    assert_eq!(karpenter.starts(), 1);
    let controller_pods = system_pods.list(&ListParams::default().labels(&selector)).await.unwrap();
    assert!(controller_pods.items.is_empty(), "the controller's pod is still there");
    // the end state of every real-Karpenter teardown
    let ours = states(&aws, &instances).await;
    assert_eq!(ours.len(), PODS, "{ours:?}");
    assert!(ours.values().all(|s| *s == InstanceState::Terminated), "Karpenter's instances: {ours:?}");
    assert_eq!(states(&aws, std::slice::from_ref(&decoy)).await[&decoy], InstanceState::Running, "the decoy");
    assert!(aws.ec2.launch_templates(&cluster).await.unwrap().is_empty(), "launch templates left");
    assert!(aws.iam.cluster_instance_profiles(REGION, &cluster).await.unwrap().is_empty(), "instance profiles left");
    assert!(iam.get_instance_profile().instance_profile_name(&profile).send().await.is_err(), "{profile} left");
    iam.get_role().role_name(format!("{cluster}-node")).send().await.unwrap();
    assert_eq!(count(&admin, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
    assert_eq!(count(&admin, &k8s::nodepool_resource()).await, 0, "NodePools left");
    assert_eq!(count(&admin, &k8s::nodeclass_resource()).await, 0, "EC2NodeClasses left");
    let left = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    assert!(left.items.is_empty(), "Karpenter nodes left");
    // the workload is the user's: still there, still pending
    let web: Api<Pod> = Api::namespaced(admin.clone(), "web");
    assert_eq!(web.list(&ListParams::default()).await.unwrap().items.len(), PODS);

    ec2.terminate_instances().instance_ids(&decoy).send().await.unwrap();
    drop(karpenter);
}
