//! Positive evidence before every destructive call (design §7), on the real control plane: a
//! kubeconfig that reaches an empty real cluster is never taken for another cluster of the
//! account, even with `--reclaim`; and `verify --reclaim --yes` never terminates an instance
//! under a live real cluster whose API still has a Node for it.

use std::time::Instant;

use karpenter_teardown::aws::InstanceState;
use realstack::RealStack;
use sandbox_sim::{generate, naming};

use crate::common;
use crate::common::e2e::{REGION, Run, run_of, states};

/// The binary as the tool's identity against `s`: `sub --cluster cluster --region ...` and
/// `extra`, with its report.
async fn tool(s: &RealStack, sub: &str, cluster: &str, extra: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args([sub, "--cluster", cluster, "--region", REGION, "--kubeconfig"])
        .arg(s.tool_kubeconfig())
        .arg("--report")
        .arg(&report)
        .args(extra)
        .envs(common::localstack_env())
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_real_cluster_is_never_taken_for_another_cluster_of_the_account() {
    // the cluster the user means to leave alone: EKS knows it at another endpoint, and its
    // Karpenter's instances run
    let other = common::unique_cluster("rs-id-other");
    common::register_eks(&other, REGION, "https://0A1B2C3D4E5F.gr7.us-west-2.eks.amazonaws.com", None).await;
    let cloud = common::cloud(REGION).await;
    let launched = cloud
        .launch_tagged(
            naming::IMAGE_ID,
            naming::INSTANCE_TYPE,
            None,
            2,
            &naming::launch_tags(&other, "default", "default"),
        )
        .await
        .unwrap();
    let theirs: Vec<String> = launched.into_iter().map(|i| i.id).collect();
    assert_eq!(theirs.len(), 2);
    // the cluster the kubeconfig reaches: a real, empty one (no controller, no Karpenter node),
    // its certificate authority verified by TLS
    let s = super::stack("rs-id-empty").await;
    let admin = s.admin_client().await.unwrap();
    let namespaces = || async {
        let ns: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(admin.clone());
        ns.list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(|n| n.metadata.resource_version.clone())
            .collect::<Vec<_>>()
    };
    let before = namespaces().await;

    for consent in [&["--reclaim"][..], &["--reclaim", "--yes"][..]] {
        let t = Instant::now();
        let run = tool(&s, "run", &other, consent).await;
        assert_eq!(run.code, 3, "{}", run.dump());
        assert_eq!(run.report["outcome"], "refused", "{}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(&format!("is not EKS cluster {other}'s endpoint")) && error.contains("Nothing was changed"),
            "the refusal names what it compared: {error}"
        );
        assert_eq!(run.report["steps"].as_array().map(Vec::len), Some(0), "{}", run.dump());
        eprintln!("{consent:?} refused in {:?}", t.elapsed());
    }
    assert_eq!(namespaces().await, before, "a refused run wrote to the cluster it reached");
    let left = states(&common::localstack(REGION).await, &theirs).await;
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.values().all(|s| *s == InstanceState::Running), "the other cluster's instances: {left:?}");
    cloud.terminate(&theirs).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reclaim_never_terminates_under_a_live_real_cluster() {
    let spec = sandbox_sim::WorldSpec {
        pods_per_node: 2,
        settle_timeout: std::time::Duration::from_secs(120),
        ..common::e2e::small_world("rs-id-verify", 3)
    };
    let s = super::control_plane::full_stack(&spec.cluster).await;
    super::register_eks(&s, &spec.cluster).await;
    let admin = s.admin_client().await.unwrap();
    let cloud = common::cloud(REGION).await;
    let world = generate(&spec, &admin, &cloud)
        .await
        .unwrap_or_else(|e| panic!("{e}\nkube-scheduler:\n{}", s.log_tail("kube-scheduler")));
    let ours = world.karpenter_instance_ids();
    assert_eq!(ours.len(), 3);

    // EKS says the cluster runs, and its API (proven by EKS's certificate authority) has a Node
    // on each instance: nothing may be terminated without a drain
    for extra in [&["--yes"][..], &[][..]] {
        let refused = tool(&s, "verify", &world.cluster, &[&["--reclaim"][..], extra].concat()).await;
        assert_eq!(refused.code, 3, "{}", refused.dump());
        assert!(refused.stderr.contains("karpenter-teardown run"), "says what to use instead: {}", refused.dump());
        for id in &ours {
            assert!(refused.stderr.contains(id), "names {id}: {}", refused.dump());
        }
    }
    let after = states(&common::localstack(REGION).await, &ours).await;
    assert_eq!(after.len(), 3);
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");
    let all: Vec<String> =
        ours.iter().cloned().chain(world.managed_instance_ids()).chain(world.decoy_instances.clone()).collect();
    cloud.terminate(&all).await.unwrap();
}
