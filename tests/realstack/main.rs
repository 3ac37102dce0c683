//! The test bed on a real control plane: kube-apiserver and etcd built from source
//! (`crates/realstack`), the tool's identity held to `deploy/rbac.yaml` by the real RBAC
//! authorizer, Karpenter's real CRDs with the real server's defaulting and validation.
//!
//! The first run builds the binary (many minutes cold; `crates/realstack/build-real`), later runs
//! only check that it is current. Each test starts its own etcd and kube-apiserver (and, where
//! pods must run, kube-controller-manager, kube-scheduler and kwok: `control_plane`) and kills
//! them when it ends, failing or not.

mod admission;
mod cleanup;
#[path = "../common/mod.rs"]
mod common;
mod control_plane;
mod differential;
mod evidence;
mod gitops;
mod intree;
mod karpenter;
mod matrix;
mod ours;
mod resume;

use std::time::Instant;

use kube::api::{Api, DynamicObject, PostParams};
use realstack::{KUBERNETES_VERSION, RealStack};
use sandbox_sim::KarpenterVersion;
use serde_json::json;

pub(crate) fn shipped_rbac_yaml() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml")).expect("deploy/rbac.yaml")
}

/// Makes EKS know `cluster` as the stack's API server: its endpoint and certificate authority.
pub(crate) async fn register_eks(s: &RealStack, cluster: &str) {
    common::register_eks(cluster, common::e2e::REGION, &s.server(), Some(s.ca_pem().unwrap_or_else(|e| panic!("{e}"))))
        .await;
}

/// `karpenter-teardown run --yes` against the stack as the tool's identity, with its report.
async fn teardown(s: &RealStack, cluster: &str) -> common::e2e::Run {
    teardown_with(s, cluster, &[]).await
}

/// [`teardown`] with more arguments (`--plan delegate`, a deadline).
async fn teardown_with(s: &RealStack, cluster: &str, args: &[&str]) -> common::e2e::Run {
    register_eks(s, cluster).await;
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    if std::env::var_os("KT_TEST_LOGS").is_some() {
        cmd.stderr(std::process::Stdio::inherit());
    }
    cmd.args(["run", "--cluster", cluster, "--region", common::e2e::REGION, "--yes", "--kubeconfig"])
        .arg(s.tool_kubeconfig())
        .arg("--report")
        .arg(&report)
        .args(args)
        .envs(common::localstack_env())
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    let t = Instant::now();
    let run = common::e2e::run_of(cmd, &report).await;
    eprintln!("torn down in {:?}", t.elapsed());
    run
}

async fn stack(context: &str) -> RealStack {
    RealStack::start(context, &shipped_rbac_yaml()).await.unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_server_reports_the_pinned_version() {
    let t = Instant::now();
    let s = stack("realstack-version").await;
    eprintln!("real control plane ready in {:?}", t.elapsed());
    // as the tool: /version is open to every authenticated user (system:public-info-viewer)
    let client = s.tool_client().await.unwrap();
    let v = client.apiserver_version().await.unwrap();
    assert_eq!(v.git_version, KUBERNETES_VERSION);
    let minor = KUBERNETES_VERSION.trim_start_matches('v').split('.').nth(1).unwrap();
    assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", minor));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_test_leaves_no_process_of_the_stack_behind() {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let test = tokio::spawn(async move {
        let s = stack("realstack-panic").await;
        tx.send(s.pids()).unwrap();
        panic!("a failing test, holding the stack");
    });
    let pids = rx.await.unwrap();
    assert_eq!(pids.len(), 2, "etcd and kube-apiserver");
    assert!(test.await.unwrap_err().is_panic());
    // the stack's drop ran while the panic unwound: both are killed and reaped
    for pid in pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "process {pid} outlived the stack");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_identity_holds_exactly_the_shipped_rbac() {
    let s = stack("realstack-rbac").await;
    let tool = s.tool_client().await.unwrap();
    // granted by deploy/rbac.yaml: listing nodes
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(tool.clone());
    nodes.list(&Default::default()).await.unwrap();
    // not granted: reading Secrets
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(tool, "kube-system");
    let err = secrets.list(&Default::default()).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 403), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_crds_install_and_a_node_pool_gets_its_schema_defaults() {
    let s = stack("realstack-crds").await;
    let admin = s.admin_client().await.unwrap();
    let crds = common::e2e::real_crds(KarpenterVersion::default());
    sandbox_sim::world::install_crds(&admin, KarpenterVersion::default(), Some(&crds)).await.unwrap();
    let names: Vec<String> = sandbox_sim::karpenter_crds::karpenter_crds_from(&crds)
        .unwrap()
        .iter()
        .filter_map(|c| c["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    assert!(names.iter().any(|n| n == "nodepools.karpenter.sh"), "{names:?}");

    let pools: Api<DynamicObject> = Api::all_with(admin, &sandbox_sim::objects::nodepool_resource());
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": "defaults"},
        "spec": {"template": {"spec": {
            "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
            "requirements": [],
        }}},
    }))
    .unwrap();
    let created = pools.create(&PostParams::default(), &pool).await.unwrap();
    let spec = &created.data["spec"];
    // the defaults of Karpenter's own schema, applied by the real server's structural defaulting
    assert_eq!(spec["disruption"]["consolidateAfter"], "0s", "{spec:#}");
    assert_eq!(spec["disruption"]["consolidationPolicy"], "WhenEmptyOrUnderutilized", "{spec:#}");
    assert_eq!(spec["disruption"]["budgets"], json!([{"nodes": "10%"}]), "{spec:#}");
    assert_eq!(spec["template"]["spec"]["expireAfter"], "720h", "{spec:#}");

    // and its validation: a NodePool without a nodeClassRef is refused
    let mut bad = pool.clone();
    bad.metadata.name = Some("no-class".into());
    bad.data["spec"]["template"]["spec"].as_object_mut().unwrap().remove("nodeClassRef");
    let err = pools.create(&PostParams::default(), &bad).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 422), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_tears_down_a_generated_world_on_the_real_server() {
    use common::e2e::{REGION, assert_torn_down_on, untouchable_nodes};
    use sandbox_sim::{SimController, SimSettings, generate};

    // kube-scheduler binds the workloads' pods, kwok runs them, and the real ReplicaSet and
    // StatefulSet controllers recreate what the drain evicts. The Karpenter nodes' room fits their
    // pods and the aws-node DaemonSet's exactly, as `generate` sizes it; the scheduler may fill a
    // node before the DaemonSet's pod comes, which then preempts a workload pod to another node,
    // so the pods settle in a little longer than on the sandbox's own placement.
    let spec = sandbox_sim::WorldSpec {
        pods_per_node: 2,
        settle_timeout: std::time::Duration::from_secs(120),
        ..common::e2e::small_world("rs-e2e", 6)
    };
    let s = control_plane::full_stack(&spec.cluster).await;
    let admin = s.admin_client().await.unwrap();
    let cloud = common::cloud(REGION).await;
    let aws = common::localstack(REGION).await;
    let t = Instant::now();
    let world = generate(&spec, &admin, &cloud).await.unwrap_or_else(|e| {
        panic!(
            "{e}\nkube-scheduler:\n{}\nkube-controller-manager:\n{}",
            s.log_tail("kube-scheduler"),
            s.log_tail("kube-controller-manager")
        )
    });
    eprintln!("generated in {:?}", t.elapsed());
    let sim = SimController::start(
        admin.clone(),
        cloud.clone(),
        SimSettings { version: world.version, time_scale: 0.02, ..SimSettings::new(&world.cluster, REGION) },
    );
    let before = untouchable_nodes(&admin, &world).await;

    // the drain's evicted Deployment pods come back Pending with no node to go to: the run must
    // end anyway, not wait on them
    let run = tokio::time::timeout(std::time::Duration::from_secs(240), teardown(&s, &world.cluster))
        .await
        .unwrap_or_else(|_| panic!("the teardown did not end within 240s"));
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean", "{}", run.dump());
    assert_torn_down_on(&admin, &aws, &world, &before).await;
    assert_eq!(sim.stats().nodeclaims_launched, 0, "the fence kept Karpenter from launching replacements");
    sim.shutdown().await;
    control_plane::assert_evicted_deployments_wait_pending(&admin, &world).await;
}

#[test]
fn a_component_exits_by_itself_once_the_process_that_started_it_is_gone() {
    let bin = realstack::binary().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let port = |_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (client, peer) = (port(0), port(1));
    // a shell starts etcd in the background as its child, names itself the parent, and exits
    let script = format!(
        "REALSTACK_PARENT_PID=$$ '{}' etcd --data-dir '{}' --listen-client-url http://127.0.0.1:{client} --listen-peer-url http://127.0.0.1:{peer} >/dev/null 2>&1 & echo $!",
        bin.display(),
        dir.path().join("etcd").display()
    );
    let out = std::process::Command::new("bash").args(["-c", &script]).output().unwrap();
    let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    // gone, or a zombie its new parent has not reaped yet
    let running = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
    };
    while running() {
        if Instant::now() > deadline {
            let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            panic!("etcd ({pid}) outlived the process that started it by 10s");
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
