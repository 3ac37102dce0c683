//! The field report behind `tf-prune`, with the real provider: a `kubernetes_node_taint` on a
//! Karpenter node that the teardown removes, what OpenTofu then says, and the way out that
//! `tf-prune` proposes, applied.

use crate::common::e2e::{Consent, bed, live_karpenter, small_world, teardown};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use sandbox_sim::generate;

/// The provider release the mirror holds (crates/tfbed/go/kubernetes-provider/go.mod).
const PROVIDER: &str = "3.2.1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taint_on_a_torn_down_node_is_forgotten_with_the_blocks_tf_prune_proposes() {
    let tools = crate::tools();
    let s = small_world("tf-taint", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_karpenter(&b, &world);
    let node = world.nodes[0].node.clone();

    let dir = tempfile::tempdir().unwrap();
    // The provider as an administrator of the sandbox (a request without the tool's token)
    std::fs::write(
        dir.path().join("provider.tf"),
        format!(
            "terraform {{\n  required_providers {{\n    kubernetes = {{\n      source  = \"hashicorp/kubernetes\"\n      version = \"{PROVIDER}\"\n    }}\n  }}\n}}\n\nprovider \"kubernetes\" {{\n  host = \"{}\"\n}}\n",
            b.server.url()
        ),
    )
    .unwrap();
    let taint = dir.path().join("taint.tf");
    std::fs::write(
        &taint,
        format!(
            "resource \"kubernetes_node_taint\" \"batch\" {{\n  metadata {{\n    name = \"{node}\"\n  }}\n  taint {{\n    key    = \"example.com/batch\"\n    value  = \"true\"\n    effect = \"PreferNoSchedule\"\n  }}\n}}\n"
        ),
    )
    .unwrap();
    let tofu = tfbed::Tofu::new(&tools, dir.path());

    let init = tofu.run(&["init"]).await.unwrap();
    assert_eq!(init.code, 0, "{}", init.all());
    assert!(
        init.stdout.contains(&format!("Installed hashicorp/kubernetes v{PROVIDER}")),
        "the provider comes from the mirror:\n{}",
        init.all()
    );
    let apply = tofu.run(&["apply", "-auto-approve"]).await.unwrap();
    assert_eq!(apply.code, 0, "{}", apply.all());
    let nodes: Api<Node> = Api::all(b.client.clone());
    let taints = nodes.get(&node).await.unwrap().spec.unwrap_or_default().taints.unwrap_or_default();
    assert!(taints.iter().any(|t| t.key == "example.com/batch"), "the provider tainted the node: {taints:?}");

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert!(nodes.get_opt(&node).await.unwrap().is_none(), "the node is gone");

    // What OpenTofu says about the gone node. Since provider v2.30.0 (#2402) a refresh that finds
    // the node gone warns instead of failing, so the plan passes...
    let plan = tofu.run(&["plan", "-detailed-exitcode"]).await.unwrap();
    assert_eq!(plan.code, 0, "{}", plan.all());
    assert!(plan.stdout.contains("No changes."), "{}", plan.all());
    assert!(plan.stdout.contains("Warning: Node has been deleted"), "{}", plan.all());
    // ...but the entry stays, and any change to the taint fails at apply (the provider's update
    // reads the node first)
    let text = std::fs::read_to_string(&taint).unwrap();
    std::fs::write(&taint, text.replace("value  = \"true\"", "value  = \"false\"")).unwrap();
    let changed = tofu.run(&["apply", "-auto-approve"]).await.unwrap();
    assert_ne!(changed.code, 0, "{}", changed.all());
    assert!(changed.stderr.contains(&format!("nodes \"{node}\" not found")), "{}", changed.all());

    // tf-prune on `tofu show -json`, asking the cluster with the tool's own identity
    let show = tofu.run(&["show", "-json"]).await.unwrap();
    assert_eq!(show.code, 0, "{}", show.all());
    let state = dir.path().join("state.json");
    std::fs::write(&state, &show.stdout).unwrap();
    let prune = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["tf-prune", "--state"])
        .arg(&state)
        .arg("--kubeconfig")
        .arg(&b.kubeconfig)
        .output()
        .await
        .unwrap();
    let advice = String::from_utf8_lossy(&prune.stdout).to_string();
    assert_eq!(prune.status.code(), Some(0), "{advice}\n{}", String::from_utf8_lossy(&prune.stderr));
    eprintln!("tf-prune:\n{advice}");
    let removed = removed_blocks(&advice);
    assert!(removed.contains("from = kubernetes_node_taint.batch"), "{advice}");

    // Applied as it says: the resource block deleted, the removed blocks added
    std::fs::remove_file(&taint).unwrap();
    std::fs::write(dir.path().join("prune.tf"), &removed).unwrap();
    let forget = tofu.run(&["apply", "-auto-approve"]).await.unwrap();
    eprintln!("apply with the removed blocks:\n{}", forget.all());
    assert_eq!(forget.code, 0, "{}", forget.all());
    let list = tofu.run(&["state", "list"]).await.unwrap();
    assert_eq!((list.code, list.stdout.trim()), (0, ""), "{}", list.all());
    let clean = tofu.run(&["plan", "-detailed-exitcode"]).await.unwrap();
    assert_eq!(clean.code, 0, "a clean plan (no changes):\n{}", clean.all());
    assert!(clean.stdout.contains("No changes."), "{}", clean.all());
    assert!(!clean.all().contains("Warning"), "{}", clean.all());
    sim.shutdown().await;
    b.server.shutdown().await;
}

/// The `removed` blocks of tf-prune's advice: every line after the comment that introduces them
/// (the advice ends with them, or with comments about resources they cannot name).
fn removed_blocks(advice: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in advice.lines() {
        if line.starts_with("# or ") && line.contains("add:") {
            inside = true;
            continue;
        }
        if inside && !line.starts_with('#') {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The provider's `kubernetes_manifest` needs the server's OpenAPI v2 document (its
/// manifest/provider/clients.go reads `/openapi/v2`), which the sandbox API server does not serve:
/// this one runs on the real kube-apiserver of `crates/realstack`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_pool_of_kubernetes_manifest_would_come_back_until_tf_prune_s_blocks_are_applied() {
    use crate::common::e2e::{REGION, run_of};
    use sandbox_sim::{SimController, SimSettings};

    let tools = crate::tools();
    // no kubelet runs pods on the real server's plain Node objects: no workload pods
    let spec = sandbox_sim::WorldSpec { pods_per_node: 0, ..small_world("tf-manifest", 3) };
    let rbac = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml")).unwrap();
    let s = realstack::RealStack::start(&spec.cluster, &rbac).await.unwrap_or_else(|e| panic!("{e}"));
    crate::common::register_eks(&spec.cluster, REGION, &s.server(), Some(s.ca_pem().unwrap_or_else(|e| panic!("{e}"))))
        .await;
    let admin = s.admin_client().await.unwrap();
    let cloud = crate::common::cloud(REGION).await;
    let world = generate(&spec, &admin, &cloud).await.unwrap_or_else(|e| panic!("{e}"));
    let sim = SimController::start(
        admin.clone(),
        cloud.clone(),
        SimSettings { version: world.version, time_scale: 0.02, ..SimSettings::new(&world.cluster, REGION) },
    );
    let admin_kubeconfig = s.admin_kubeconfig();

    // A NodePool as a user's configuration applies it: the generated pool's spec, another name
    let pools = Api::<kube::api::DynamicObject>::all_with(admin.clone(), &karpenter_teardown::k8s::nodepool_resource());
    let model = pools.get(&world.node_pools[0]).await.unwrap();
    let pool = serde_json::json!({
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": "terraform-pool"},
        "spec": {"template": model.data["spec"]["template"].clone()},
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("nodepool.json"), serde_json::to_string_pretty(&pool).unwrap()).unwrap();
    std::fs::write(
        dir.path().join("provider.tf"),
        format!(
            "terraform {{\n  required_providers {{\n    kubernetes = {{\n      source  = \"hashicorp/kubernetes\"\n      version = \"{PROVIDER}\"\n    }}\n  }}\n}}\n\nprovider \"kubernetes\" {{\n  config_path = \"{}\"\n}}\n",
            admin_kubeconfig.display()
        ),
    )
    .unwrap();
    let pool_tf = dir.path().join("pool.tf");
    std::fs::write(
        &pool_tf,
        "resource \"kubernetes_manifest\" \"pool\" {\n  manifest = jsondecode(file(\"${path.module}/nodepool.json\"))\n}\n",
    )
    .unwrap();
    let tofu = tfbed::Tofu::new(&tools, dir.path());
    let init = tofu.run(&["init"]).await.unwrap();
    assert_eq!(init.code, 0, "{}", init.all());
    let apply = tofu.run(&["apply", "-auto-approve"]).await.unwrap();
    assert_eq!(apply.code, 0, "{}", apply.all());
    assert!(pools.get_opt("terraform-pool").await.unwrap().is_some(), "the provider created the NodePool");

    let report = dir.path().join("report.json");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["run", "--cluster", &world.cluster, "--region", REGION, "--yes", "--kubeconfig"])
        .arg(s.tool_kubeconfig())
        .arg("--report")
        .arg(&report)
        .envs(crate::common::localstack_env())
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    let run = run_of(cmd, &report).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert!(pools.get_opt("terraform-pool").await.unwrap().is_none(), "the teardown deleted the NodePool");

    // Left as it is, the next apply re-creates the NodePool: Karpenter would launch capacity again
    let plan = tofu.run(&["plan", "-detailed-exitcode"]).await.unwrap();
    eprintln!("plan after the teardown:\n{}", plan.all());
    assert_eq!(plan.code, 2, "{}", plan.all());
    assert!(plan.stdout.contains("1 to add, 0 to change, 0 to destroy"), "{}", plan.all());

    let show = tofu.run(&["show", "-json"]).await.unwrap();
    assert_eq!(show.code, 0, "{}", show.all());
    let state = dir.path().join("state.json");
    std::fs::write(&state, &show.stdout).unwrap();
    let prune = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["tf-prune", "--state"])
        .arg(&state)
        .arg("--kubeconfig")
        .arg(s.tool_kubeconfig())
        .output()
        .await
        .unwrap();
    let advice = String::from_utf8_lossy(&prune.stdout).to_string();
    assert_eq!(prune.status.code(), Some(0), "{advice}\n{}", String::from_utf8_lossy(&prune.stderr));
    eprintln!("tf-prune:\n{advice}");
    let removed = removed_blocks(&advice);
    assert!(removed.contains("from = kubernetes_manifest.pool"), "{advice}");

    std::fs::remove_file(&pool_tf).unwrap();
    std::fs::write(dir.path().join("prune.tf"), &removed).unwrap();
    let forget = tofu.run(&["apply", "-auto-approve"]).await.unwrap();
    eprintln!("apply with the removed blocks:\n{}", forget.all());
    assert_eq!(forget.code, 0, "{}", forget.all());
    let list = tofu.run(&["state", "list"]).await.unwrap();
    assert_eq!((list.code, list.stdout.trim()), (0, ""), "{}", list.all());
    let clean = tofu.run(&["plan", "-detailed-exitcode"]).await.unwrap();
    assert_eq!(clean.code, 0, "a clean plan (no changes):\n{}", clean.all());
    assert!(pools.get_opt("terraform-pool").await.unwrap().is_none(), "nothing re-created the NodePool");
    sim.shutdown().await;
}
