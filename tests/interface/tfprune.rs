//! `tf-prune` through the binary: `terraform show -json` fixtures written for the purpose,
//! checked against the sandbox API server (no LocalStack needed), and the printed
//! `terraform state rm` commands run by OpenTofu (built by the test bed) against a matching
//! local state.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Node;
use karpenter_teardown::k8s;
use kube::Client;
use kube::api::{Api, DynamicObject, PostParams};
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::KarpenterVersion;
use sandbox_sim::world::install_crds;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_karpenter-teardown");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tfstate").join(name)
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn tf_prune(args: &[&str], stdin: Option<&str>) -> Out {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(BIN)
        .arg("tf-prune")
        .args(args)
        .env_remove("KUBECONFIG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).await.unwrap();
    }
    drop(input);
    let out = child.wait_with_output().await.unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

fn state_rm_lines(stdout: &str) -> Vec<&str> {
    stdout.lines().filter(|l| l.starts_with("terraform state rm ")).collect()
}

/// A sandbox cluster holding nodes `node-live` and NodePool `default`, and nothing else.
async fn cluster(dir: &Path) -> (ApiServer, PathBuf) {
    let server = ApiServer::start(ServerOptions::default()).await.unwrap();
    let client = Client::try_from(server.kube_config()).unwrap();
    install_crds(&client, KarpenterVersion::V1_14, None).await.unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": "node-live"}})).unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let pools: Api<DynamicObject> = Api::all_with(client.clone(), &k8s::nodepool_resource());
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": "default"},
        "spec": {"template": {"spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"}, "requirements": []}}}
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    let kubeconfig = dir.join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, "tfprune").unwrap();
    (server, kubeconfig)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taint_on_a_vanished_node_yields_exactly_its_state_rm() {
    let dir = tempfile::tempdir().unwrap();
    let (server, kubeconfig) = cluster(dir.path()).await;
    let state = fixture("single-taint.json");
    let out = tf_prune(&["--state", state.to_str().unwrap(), "--kubeconfig", kubeconfig.to_str().unwrap()], None).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        state_rm_lines(&out.stdout),
        vec!["terraform state rm 'kubernetes_node_taint.gpu'  # Node node-gone"],
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("kubernetes_node_taint.system"), "node-live still exists:\n{}", out.stdout);
    assert!(
        out.stdout
            .contains("removed {\n  from = kubernetes_node_taint.gpu\n\n  lifecycle {\n    destroy = false\n  }\n}"),
        "{}",
        out.stdout
    );
    server.shutdown().await;
}

const MODULES_GONE: [&str; 4] = [
    r#"terraform state rm 'kubernetes_labels.zone[0]'  # Node node-gone"#,
    r#"terraform state rm 'kubernetes_node_taint.per_node["it'\''s-gone"]'  # Node node-gone-2"#,
    r#"terraform state rm 'module.karpenter.kubernetes_manifest.nodepool["spot"]'  # NodePool spot"#,
    r#"terraform state rm 'module.karpenter.module.classes["blue"].kubectl_manifest.class[0]'  # EC2NodeClass gone-class"#,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_and_instance_keys_are_addressed_and_quoted_correctly() {
    let dir = tempfile::tempdir().unwrap();
    let (server, kubeconfig) = cluster(dir.path()).await;
    let state = fixture("modules.json");
    let out = tf_prune(&["--state", state.to_str().unwrap(), "--kubeconfig", kubeconfig.to_str().unwrap()], None).await;
    server.shutdown().await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(state_rm_lines(&out.stdout), MODULES_GONE.to_vec(), "{}", out.stdout);
    // removed blocks name whole resources, and only those with no live instance left
    let froms: Vec<&str> = out.stdout.lines().filter_map(|l| l.trim().strip_prefix("from = ")).collect();
    assert_eq!(
        froms,
        vec!["kubernetes_labels.zone", "module.karpenter.module.classes.kubectl_manifest.class"],
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("# kubernetes_node_taint.per_node: some of its instances still point at live objects"));
    // nothing for objects that exist, nor for kinds that are not ours
    for live in ["node-live", "nodepool[\"default\"]", "kubernetes_labels.cm", "kubernetes_manifest.app", "data."] {
        assert!(!state_rm_lines(&out.stdout).iter().any(|l| l.contains(live)), "{live}:\n{}", out.stdout);
    }

    // the printed commands do exactly that to a matching state, run as printed by OpenTofu (the
    // test bed builds it: tfbed) under the name `terraform`, as a user with either would
    let tools = tfbed::tools().unwrap_or_else(|e| panic!("{e}"));
    let work = tempfile::tempdir().unwrap();
    let shims = work.path().join("bin");
    std::fs::create_dir(&shims).unwrap();
    std::os::unix::fs::symlink(&tools.tofu, shims.join("terraform")).unwrap();
    let path = format!("{}:{}", shims.display(), std::env::var("PATH").unwrap_or_default());
    std::fs::copy(fixture("modules.tfstate"), work.path().join("terraform.tfstate")).unwrap();
    let script: String = state_rm_lines(&out.stdout).join("\n");
    assert_eq!(script.lines().count(), MODULES_GONE.len());
    let run = std::process::Command::new("sh")
        .arg("-ec")
        .arg(&script)
        .current_dir(work.path())
        .env("PATH", &path)
        .env("TF_CLI_CONFIG_FILE", &tools.cli_config)
        .env("TF_IN_AUTOMATION", "1")
        .output()
        .unwrap();
    assert!(run.status.success(), "{}\n{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    let list = std::process::Command::new("terraform")
        .args(["state", "list"])
        .current_dir(work.path())
        .env("PATH", &path)
        .env("TF_CLI_CONFIG_FILE", &tools.cli_config)
        .output()
        .unwrap();
    assert!(list.status.success(), "{}", String::from_utf8_lossy(&list.stderr));
    let left = String::from_utf8_lossy(&list.stdout);
    let mut left: Vec<&str> = left.lines().collect();
    left.sort();
    assert_eq!(
        left,
        vec![
            "kubernetes_labels.cm",
            r#"kubernetes_node_taint.per_node["node-live"]"#,
            "module.karpenter.kubernetes_manifest.app",
            r#"module.karpenter.kubernetes_manifest.nodepool["default"]"#,
            r#"module.karpenter.module.classes["blue"].kubernetes_annotations.node"#,
        ]
    );
}

#[tokio::test]
async fn assume_gone_reads_stdin_and_needs_no_cluster() {
    let text = std::fs::read_to_string(fixture("modules.json")).unwrap();
    let out = tf_prune(&["--state", "-", "--assume-gone"], Some(&text)).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    // every entry of ours is proposed, including the ones the sandbox cluster above still has
    assert_eq!(state_rm_lines(&out.stdout).len(), 7, "{}", out.stdout);
    assert!(out.stdout.contains("from = module.karpenter.kubernetes_manifest.nodepool\n"), "{}", out.stdout);
}

#[tokio::test]
async fn bad_input_is_exit_2_with_the_fix() {
    let out = tf_prune(&["--state", "-", "--assume-gone"], Some("{\"version\": 4, \"resources\": []}")).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("terraform show -json"), "{}", out.stderr);
    let out = tf_prune(&["--state", "/nonexistent/state.json", "--assume-gone"], None).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    // an unreachable cluster is not taken as "everything is gone"
    let out = tf_prune(
        &["--state", fixture("single-taint.json").to_str().unwrap(), "--kubeconfig", "/nonexistent/kubeconfig"],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(state_rm_lines(&out.stdout).is_empty(), "{}", out.stdout);
}
