//! Drives the machine's real `kubectl` against the sandbox API server (design §5).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::KarpenterVersion;
use sandbox_sim::karpenter_crds::ReleaseFiles;
use serde_json::json;
use tokio::process::Command;

use crate::common;

const KUBECTL: &str = "/usr/bin/kubectl";

struct Kubectl {
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Kubectl {
    fn new(server: &ApiServer) -> Kubectl {
        assert!(
            Path::new(KUBECTL).exists(),
            "kubectl is missing at {KUBECTL}: these tests need the real kubectl binary"
        );
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        server.write_kubeconfig(&kubeconfig, "sandbox-test").unwrap();
        Kubectl { kubeconfig, _dir: dir }
    }

    async fn run(&self, args: &[&str]) -> Out {
        let mut cmd = Command::new(KUBECTL);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .env("HOME", self._dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .expect("kubectl hung")
            .expect("kubectl failed to start");
        Out {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    async fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args).await;
        assert!(o.ok, "kubectl {args:?} failed:\nstdout: {}\nstderr: {}", o.stdout, o.stderr);
        o.stdout
    }

    /// Applies the release's NodePool, NodeClaim and EC2NodeClass CRDs, as a user installs them
    /// (the module's CRD folder holds other kinds of later releases too, which the tests skip).
    async fn apply_crds(&self, release: &ReleaseFiles) {
        for f in
            ["karpenter.sh_nodepools.yaml", "karpenter.sh_nodeclaims.yaml", "karpenter.k8s.aws_ec2nodeclasses.yaml"]
        {
            self.ok(&["apply", "-f", release.crds().join(f).to_str().unwrap()]).await;
        }
    }

    async fn apply_json(&self, v: serde_json::Value) -> String {
        let path = self._dir.path().join(format!("obj-{}.json", rand_name()));
        std::fs::write(&path, v.to_string()).unwrap();
        self.ok(&["apply", "-f", path.to_str().unwrap()]).await
    }
}

fn rand_name() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

async fn start() -> ApiServer {
    ApiServer::start(ServerOptions { time_scale: 0.01, ..Default::default() }).await.unwrap()
}

fn node(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": "general-purpose"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {"pods": "110"},
            "addresses": [{"type": "InternalIP", "address": "10.1.2.3"}],
            "nodeInfo": {"kubeletVersion": "v1.34.1", "osImage": "Amazon Linux 2023", "kernelVersion": "6.1", "containerRuntimeVersion": "containerd://1.7"}}})
}

fn deployment(name: &str, replicas: i64) -> serde_json::Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "nginx"}],
                "terminationGracePeriodSeconds": 1}}}})
}

async fn wait_for(k: &Kubectl, args: &[&str], needle: &str) {
    for _ in 0..100 {
        if k.run(args).await.stdout.contains(needle) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("kubectl {args:?} never showed {needle:?}");
}

#[tokio::test]
async fn get_nodes_cordon_taint_and_scale() {
    let s = start().await;
    let k = Kubectl::new(&s);
    k.apply_json(node("ip-10-1-2-3")).await;
    let wide = k.ok(&["get", "nodes", "-o", "wide"]).await;
    assert!(wide.contains("INTERNAL-IP") && wide.contains("10.1.2.3") && wide.contains("Ready"), "{wide}");
    k.ok(&["cordon", "ip-10-1-2-3"]).await;
    assert!(k.ok(&["get", "nodes"]).await.contains("SchedulingDisabled"));
    k.ok(&["taint", "nodes", "ip-10-1-2-3", "karpenter.sh/disrupted=:NoSchedule"]).await;
    let taints = k.ok(&["get", "node", "ip-10-1-2-3", "-o", "jsonpath={.spec.taints[*].key}"]).await;
    assert!(taints.contains("karpenter.sh/disrupted"), "{taints}");
    k.ok(&["taint", "nodes", "ip-10-1-2-3", "karpenter.sh/disrupted:NoSchedule-"]).await;
    k.ok(&["uncordon", "ip-10-1-2-3"]).await;
    k.apply_json(deployment("web", 1)).await;
    k.ok(&["scale", "deployment", "web", "--replicas=3"]).await;
    wait_for(&k, &["get", "deployment", "web"], "3/3").await;
    s.shutdown().await;
}

/// The real CRDs' schemas hold as on a real server. A NodePool applied without
/// `disruption` or `expireAfter` comes back with the defaults kube-apiserver fills in, and the
/// CEL rules refuse what they refuse on EKS: limits other than `nodes` on a static NodePool,
/// and turning a static NodePool dynamic.
#[tokio::test]
async fn real_crds_default_and_their_cel_rules_refuse_like_the_real_server() {
    let release = common::e2e::release(KarpenterVersion::V1_14);
    let s = start().await;
    let k = Kubectl::new(&s);
    let before = sandbox_apiserver::schema::unevaluated_rules();
    k.apply_crds(&release).await;
    k.ok(&["apply", "-f", release.examples().join("general-purpose.yaml").to_str().unwrap()]).await;
    let pool: serde_json::Value =
        serde_json::from_str(&k.ok(&["get", "nodepool", "general-purpose", "-o", "json"]).await).unwrap();
    assert_eq!(pool["spec"]["disruption"]["budgets"], json!([{"nodes": "10%"}]), "{pool:#}");
    assert_eq!(pool["spec"]["disruption"]["consolidationPolicy"], "WhenEmptyOrUnderutilized");
    assert_eq!(pool["spec"]["template"]["spec"]["expireAfter"], "720h");

    let static_pool = |limits: serde_json::Value| {
        json!({"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": "static"},
            "spec": {"replicas": 2, "limits": limits, "template": {"spec": {"requirements": [],
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"}}}}})
    };
    let path = |name: &str| k._dir.path().join(name).to_str().unwrap().to_string();
    std::fs::write(path("cpu.json"), static_pool(json!({"cpu": "0"})).to_string()).unwrap();
    let refused = k.run(&["apply", "-f", &path("cpu.json")]).await;
    assert!(
        !refused.ok && refused.stderr.contains("only 'limits.nodes' is supported on static NodePools"),
        "{}",
        refused.stderr
    );
    k.apply_json(static_pool(json!({"nodes": "0"}))).await;
    let to_dynamic = k
        .run(&["patch", "nodepool", "static", "--type=json", "-p", r#"[{"op":"remove","path":"/spec/replicas"}]"#])
        .await;
    assert!(!to_dynamic.ok && to_dynamic.stderr.contains("Cannot transition NodePool"), "{}", to_dynamic.stderr);
    assert_eq!(
        sandbox_apiserver::schema::unevaluated_rules(),
        before,
        "every rule of the real CRDs met here was evaluated"
    );
    s.shutdown().await;
}

#[tokio::test]
async fn apply_karpenter_crds_and_examples_then_delete_with_finalizer() {
    let release = common::e2e::release(KarpenterVersion::V1_14);
    let s = start().await;
    let k = Kubectl::new(&s);
    k.apply_crds(&release).await;
    k.ok(&["apply", "-f", release.examples().join("general-purpose.yaml").to_str().unwrap()]).await;
    let pools = k.ok(&["get", "nodepools"]).await;
    assert!(pools.contains("NODECLASS") && pools.contains("general-purpose"), "{pools}");
    k.ok(&["get", "ec2nodeclasses"]).await;
    k.apply_json(json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
        "metadata": {"name": "nc-1", "finalizers": ["karpenter.sh/termination"]},
        "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"}, "requirements": []}}))
        .await;
    k.ok(&["delete", "nodeclaim", "nc-1", "--wait=false"]).await;
    let ts = k.ok(&["get", "nodeclaim", "nc-1", "-o", "jsonpath={.metadata.deletionTimestamp}"]).await;
    assert!(!ts.trim().is_empty(), "deletionTimestamp set");
    k.ok(&["patch", "nodeclaim", "nc-1", "--type=json", "-p", r#"[{"op":"remove","path":"/metadata/finalizers"}]"#])
        .await;
    let gone = k.run(&["get", "nodeclaim", "nc-1"]).await;
    assert!(!gone.ok && gone.stderr.contains("NotFound"), "{}", gone.stderr);
    s.shutdown().await;
}

#[tokio::test]
async fn drain_succeeds_and_reports_a_blocking_budget() {
    let s = start().await;
    let k = Kubectl::new(&s);
    k.apply_json(node("n1")).await;
    k.apply_json(deployment("web", 2)).await;
    wait_for(&k, &["get", "deployment", "web"], "2/2").await;
    let out = k.ok(&["drain", "n1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=20s"]).await;
    assert!(out.contains("drained"), "{out}");
    // A budget allowing no disruption: drain reports it and gives up at its timeout.
    k.apply_json(node("n2")).await;
    k.apply_json(deployment("db", 1)).await;
    wait_for(&k, &["get", "deployment", "db"], "1/1").await;
    k.apply_json(json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "db", "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}}}))
        .await;
    wait_for(&k, &["get", "pdb", "db"], "0").await;
    let blocked = k.run(&["drain", "n2", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=5s"]).await;
    assert!(!blocked.ok, "drain must give up");
    let all = format!("{}{}", blocked.stdout, blocked.stderr);
    assert!(all.contains("disruption budget"), "{all}");
    s.shutdown().await;
}

#[tokio::test]
async fn get_watch_prints_events() {
    let s = start().await;
    let k = Kubectl::new(&s);
    let mut cmd = Command::new(KUBECTL);
    cmd.arg("--kubeconfig")
        .arg(&k.kubeconfig)
        .args(["get", "configmaps", "-w", "--request-timeout=3s"])
        .env("HOME", k._dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    k.apply_json(
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "watched", "namespace": "default"}}),
    )
    .await;
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output()).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("watched"), "stdout: {text}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    s.shutdown().await;
}
