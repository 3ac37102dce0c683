//! End to end: the `karpenter-teardown` binary, through a kubeconfig like any user, against the
//! sandbox API server with a generated Karpenter world and LocalStack.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node;
use karpenter_teardown::aws::{AwsClients, InstanceState};
use karpenter_teardown::k8s;
use karpenter_teardown::sandbox::sim::{SimController, SimSettings, World, WorldSpec, generate, naming};
use karpenter_teardown::sandbox::{ApiServer, ServerOptions};
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

const REGION: &str = "us-west-2";

struct Bed {
    server: ApiServer,
    client: Client,
    aws: AwsClients,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

async fn bed(cluster: &str) -> Bed {
    let aws = common::localstack(REGION).await;
    let server = ApiServer::start(ServerOptions { time_scale: 0.01, ..ServerOptions::default() }).await.unwrap();
    let client = Client::try_from(server.kube_config()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, cluster).unwrap();
    Bed { server, client, aws, dir, kubeconfig }
}

fn spec(prefix: &str, nodes: usize) -> WorldSpec {
    WorldSpec {
        cluster: common::unique_cluster(prefix),
        nodes,
        node_pools: 3,
        node_classes: 2,
        pods_per_node: 2,
        managed_nodes: 2,
        taint_managed_node: true,
        control_plane_node: true,
        decoys: 2,
        concurrency: 16,
        settle_timeout: Duration::from_secs(30),
        ..WorldSpec::default()
    }
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    report: Value,
}

async fn teardown(b: &Bed, cluster: &str, extra: &[&str]) -> Run {
    let report = b.dir.path().join("report.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    // KT_TEST_LOGS=1 shows the tool's logs live (with --nocapture) when a test needs debugging
    if std::env::var_os("KT_TEST_LOGS").is_some() {
        cmd.stderr(std::process::Stdio::inherit());
    }
    let out = cmd
        .args(["run", "--cluster", cluster, "--region", REGION, "--kubeconfig"])
        .arg(&b.kubeconfig)
        .arg("--report")
        .arg(&report)
        .args(extra)
        .envs(common::localstack_env())
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let report = std::fs::read(&report).ok().and_then(|r| serde_json::from_slice(&r).ok()).unwrap_or(Value::Null);
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        report,
    }
}

async fn states(aws: &AwsClients, ids: &[String]) -> BTreeMap<String, InstanceState> {
    aws.ec2.instances_by_id(ids).await.unwrap().into_iter().map(|i| (i.id, i.state)).collect()
}

async fn count(client: &Client, ar: &kube::core::ApiResource) -> usize {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    api.list(&ListParams::default()).await.map(|l| l.items.len()).unwrap_or(0)
}

/// Labels, taints and schedulability of the nodes the tool must never touch.
async fn untouchable_nodes(client: &Client, world: &World) -> BTreeMap<String, Value> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut names: Vec<String> = world.managed_nodes.iter().map(|m| m.node.clone()).collect();
    names.extend(world.control_plane_node.clone());
    let mut out = BTreeMap::new();
    for n in names {
        let node = nodes.get(&n).await.unwrap();
        let spec = node.spec.unwrap_or_default();
        out.insert(
            n,
            json!({"labels": node.metadata.labels, "taints": spec.taints, "unschedulable": spec.unschedulable}),
        );
    }
    out
}

/// The end state every successful teardown must reach.
async fn assert_torn_down(b: &Bed, world: &World, before: &BTreeMap<String, Value>) {
    let ours = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert_eq!(ours.len(), world.nodes.len());
    assert!(ours.values().all(|s| *s == InstanceState::Terminated), "Karpenter instances: {ours:?}");
    let mut keep = world.managed_instance_ids();
    keep.extend(world.decoy_instances.clone());
    let kept = states(&b.aws, &keep).await;
    assert!(kept.values().all(|s| *s == InstanceState::Running), "managed and decoy instances: {kept:?}");
    assert_eq!(count(&b.client, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
    assert_eq!(count(&b.client, &k8s::nodepool_resource()).await, 0, "NodePools left");
    assert_eq!(count(&b.client, &k8s::nodeclass_resource()).await, 0, "EC2NodeClasses left");
    let nodes: Api<Node> = Api::all(b.client.clone());
    let karpenter_nodes = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    assert!(karpenter_nodes.items.is_empty(), "Karpenter nodes left");
    assert!(b.aws.ec2.launch_templates(&world.cluster).await.unwrap().is_empty(), "launch templates left");
    assert!(
        b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap().is_empty(),
        "instance profiles left"
    );
    assert_eq!(&untouchable_nodes(&b.client, world).await, before, "non-Karpenter nodes changed");
}

async fn scale_controller(c: &Client, replicas: i32) {
    let api: Api<Deployment> = Api::namespaced(c.clone(), naming::KARPENTER_NAMESPACE);
    api.patch(naming::KARPENTER_NAME, &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": replicas}})))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_plan_tears_down_a_generated_cluster_with_a_live_controller() {
    let s = spec("e2e-default", 20);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.aws).await.unwrap();
    let sim = SimController::start(
        b.client.clone(),
        b.aws.clone(),
        SimSettings { version: world.version, time_scale: 0.02, ..SimSettings::new(&world.cluster, REGION) },
    );
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(run.code, 0, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert_eq!(run.report["outcome"], "clean");
    assert_torn_down(&b, &world, &before).await;
    assert_eq!(sim.stats().nodeclaims_launched, 0, "the fence kept Karpenter from launching replacements");

    // a second run finds nothing to do and exits 0
    let again = teardown(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    sim.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_plan_finishes_with_the_controller_gone_first() {
    let s = spec("e2e-nocontroller", 8);
    let b = bed(&s.cluster).await;
    let t = std::time::Instant::now();
    let world = generate(&s, &b.client, &b.aws).await.unwrap();
    eprintln!("generated in {:?}", t.elapsed());
    scale_controller(&b.client, 0).await;
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(run.code, 0, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_yes_nothing_changes_and_the_plan_is_shown() {
    let s = spec("e2e-dry", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.aws).await.unwrap();
    // let the control plane settle, then take the resourceVersion of the whole store
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rv = b.server.store().resource_version();
    let ids = world.karpenter_instance_ids();
    let run = teardown(&b, &world.cluster, &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.report["outcome"], "dry-run");
    assert!(run.stdout.contains("Dry run: nothing was changed"), "{}", run.stdout);
    assert!(run.stdout.contains(&world.nodes[0].nodeclaim), "the plan names the objects:\n{}", run.stdout);
    assert_eq!(b.server.store().resource_version(), rv, "a dry run wrote to the cluster");
    let after = states(&b.aws, &ids).await;
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cluster_name_is_refused_with_the_evidence_and_nothing_changes() {
    let s = spec("e2e-wrong", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.aws).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rv = b.server.store().resource_version();
    let run = teardown(&b, "some-other-cluster", &["--yes"]).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains(&world.cluster), "the evidence names the real cluster: {}", run.stderr);
    assert_eq!(run.report["outcome"], "refused");
    assert_eq!(b.server.store().resource_version(), rv, "a refused run wrote to the cluster");
    let after = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(after.values().all(|s| *s == InstanceState::Running));
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_nodes_refuses_a_larger_blast_radius() {
    let s = spec("e2e-max", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.aws).await.unwrap();
    let run = teardown(&b, &world.cluster, &["--yes", "--max-nodes", "2"]).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("--max-nodes 2"), "{}", run.stderr);
    b.server.shutdown().await;
}
