//! Helpers of the safety and reliability tests (field reports, bad input, resume, faults): a test
//! bed (sandbox API server, LocalStack, kubeconfig), a runner of the real binary, and the end
//! state every successful teardown must reach. Included with `#[path]` next to `mod common;`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use karpenter_teardown::aws::{AwsClients, InstanceState};
use karpenter_teardown::k8s;
use karpenter_teardown::sandbox::sim::{World, WorldSpec};
use karpenter_teardown::sandbox::{ApiServer, ServerOptions};
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams};
use serde_json::{Value, json};

use crate::common;

pub const REGION: &str = "us-west-2";

pub struct Bed {
    pub server: ApiServer,
    pub client: Client,
    pub aws: AwsClients,
    pub dir: tempfile::TempDir,
    pub kubeconfig: PathBuf,
}

pub async fn bed(cluster: &str) -> Bed {
    bed_with(cluster, ServerOptions { time_scale: 0.01, ..ServerOptions::default() }).await
}

pub async fn bed_with(cluster: &str, opts: ServerOptions) -> Bed {
    let aws = common::localstack(REGION).await;
    let server = ApiServer::start(opts).await.unwrap();
    let client = Client::try_from(server.kube_config()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, cluster).unwrap();
    Bed { server, client, aws, dir, kubeconfig }
}

/// A small world: few nodes, one decoy, a managed node group of 2 (one tainted) and a
/// control-plane node.
pub fn spec(prefix: &str, nodes: usize) -> WorldSpec {
    WorldSpec {
        cluster: common::unique_cluster(prefix),
        nodes,
        node_pools: 2,
        node_classes: 2,
        pods_per_node: 2,
        replicas_per_workload: 2,
        managed_nodes: 2,
        taint_managed_node: true,
        control_plane_node: true,
        decoys: 1,
        concurrency: 16,
        settle_timeout: Duration::from_secs(30),
        ..WorldSpec::default()
    }
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub report: Value,
}

impl Run {
    /// Everything a user sees, for assertion messages.
    pub fn dump(&self) -> String {
        format!("exit {}\nstdout:\n{}\nstderr:\n{}\nreport:\n{:#}", self.code, self.stdout, self.stderr, self.report)
    }
}

/// How to invoke the binary beyond `<subcommand> --cluster --region --kubeconfig --report`.
#[derive(Default)]
pub struct Invocation<'a> {
    pub args: Vec<&'a str>,
    pub env: Vec<(&'a str, String)>,
    pub env_remove: Vec<&'a str>,
}

/// The command, ready to spawn: `run`/`verify` against the bed, with LocalStack's environment.
pub fn command(b: &Bed, sub: &str, cluster: &str, inv: &Invocation<'_>) -> tokio::process::Command {
    let report = b.dir.path().join(format!("report-{sub}.json"));
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args([sub, "--cluster", cluster, "--region", REGION]);
    // a test passing its own --kubeconfig (bad input) replaces the bed's
    if sub == "run" && !inv.args.contains(&"--kubeconfig") {
        cmd.arg("--kubeconfig").arg(&b.kubeconfig);
    }
    cmd.arg("--report").arg(&report).args(&inv.args).envs(common::localstack_env());
    cmd.env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    for (k, v) in &inv.env {
        cmd.env(k, v);
    }
    for k in &inv.env_remove {
        cmd.env_remove(k);
    }
    cmd.kill_on_drop(true);
    cmd
}

pub fn report_path(b: &Bed, sub: &str) -> PathBuf {
    b.dir.path().join(format!("report-{sub}.json"))
}

pub fn read_report(b: &Bed, sub: &str) -> Value {
    std::fs::read(report_path(b, sub)).ok().and_then(|r| serde_json::from_slice(&r).ok()).unwrap_or(Value::Null)
}

/// Runs the binary to the end.
pub async fn tool(b: &Bed, sub: &str, cluster: &str, inv: &Invocation<'_>) -> Run {
    let mut cmd = command(b, sub, cluster, inv);
    if std::env::var_os("KT_TEST_LOGS").is_some() {
        cmd.stderr(std::process::Stdio::inherit());
    }
    let out = cmd.output().await.unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        report: read_report(b, sub),
    }
}

/// `run --yes` plus `extra`.
pub async fn teardown(b: &Bed, cluster: &str, extra: &[&str]) -> Run {
    let mut args = vec!["--yes"];
    args.extend_from_slice(extra);
    tool(b, "run", cluster, &Invocation { args, ..Invocation::default() }).await
}

pub async fn states(aws: &AwsClients, ids: &[String]) -> BTreeMap<String, InstanceState> {
    aws.ec2.instances_by_id(ids).await.unwrap().into_iter().map(|i| (i.id, i.state)).collect()
}

pub async fn count(client: &Client, ar: &kube::core::ApiResource) -> usize {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    api.list(&ListParams::default()).await.map(|l| l.items.len()).unwrap_or(0)
}

/// Names of the nodes the tool must never touch.
pub fn untouchable_names(world: &World) -> Vec<String> {
    let mut names: Vec<String> = world.managed_nodes.iter().map(|m| m.node.clone()).collect();
    names.extend(world.control_plane_node.clone());
    names
}

/// Labels, taints and schedulability of the nodes the tool must never touch.
pub async fn untouchable_nodes(client: &Client, world: &World) -> BTreeMap<String, Value> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut out = BTreeMap::new();
    for n in untouchable_names(world) {
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
pub async fn assert_torn_down(b: &Bed, world: &World, before: &BTreeMap<String, Value>) {
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

/// True when the report's blockers name `name` (as a blocker's name or in its reason).
pub fn blockers_name(report: &Value, name: &str) -> bool {
    report["blockers"].as_array().is_some_and(|bs| {
        bs.iter().any(|b| b["name"] == name || b["reason"].as_str().is_some_and(|r| r.contains(name)))
    })
}
