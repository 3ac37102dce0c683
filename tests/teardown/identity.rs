//! Positive identity before any write (design §7): a kubeconfig that reaches some other cluster,
//! one that shows nothing either way, and `verify --reclaim` against a cluster that still runs.

use karpenter_teardown::aws::InstanceState;
use sandbox_sim::generate;

use crate::common::e2e::{Bed, Consent, REGION, Run, bed, run_of, small_world, states, teardown};

/// `karpenter-teardown verify --reclaim` of `cluster` with the bed's kubeconfig and `extra`
/// arguments, held to the shipped IAM policy.
async fn verify_reclaim(b: &Bed, cluster: &str, extra: &[&str]) -> Run {
    let report = b.dir.path().join("verify.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["verify", "--cluster", cluster, "--region", REGION, "--reclaim", "--kubeconfig"])
        .arg(&b.kubeconfig)
        .arg("--report")
        .arg(&report)
        .args(extra)
        .envs(crate::common::localstack_env())
        .env("AWS_ACCESS_KEY_ID", crate::common::judged_key(cluster, REGION))
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_cluster_is_never_taken_for_another_cluster_of_the_account() {
    // the cluster the user means to leave alone: live, with its Karpenter instances running
    let spec = small_world("e2e-id-other", 3);
    let other = bed(&spec.cluster).await;
    let world = generate(&spec, &other.client, &other.cloud).await.unwrap();
    let theirs = world.karpenter_instance_ids();
    assert_eq!(theirs.len(), 3);
    // the cluster the kubeconfig reaches: empty, no controller, no Karpenter node, a plain context
    let empty = bed(&crate::common::unique_cluster("e2e-id-empty")).await;

    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&empty, &world.cluster, consent, &["--reclaim"]).await;
        assert_eq!(run.code, 3, "{}", run.dump());
        assert_eq!(run.report["outcome"], "refused", "{}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(&format!("is not EKS cluster {}'s endpoint", world.cluster))
                && error.contains("Nothing was changed"),
            "the refusal names what it compared: {error}"
        );
        assert_eq!(run.report["steps"].as_array().map(Vec::len), Some(0), "{}", run.dump());
    }
    // a cluster EKS does not know at all is refused the same way
    let unknown = crate::common::unique_cluster("e2e-id-unknown");
    let run = teardown(&empty, &unknown, Consent::Yes, &["--reclaim"]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    assert!(run.stderr.contains(&format!("EKS has no cluster named {unknown}")), "{}", run.dump());

    let left = states(&other.aws, &theirs).await;
    assert_eq!(left.len(), 3, "{left:?}");
    assert!(left.values().all(|s| *s == InstanceState::Running), "the other cluster's instances: {left:?}");
    empty.server.shutdown().await;
    other.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reclaim_never_terminates_under_a_live_cluster_and_finishes_once_it_is_gone() {
    let spec = small_world("e2e-id-verify", 3);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let ours = world.karpenter_instance_ids();
    let keep: Vec<String> = world.managed_instance_ids().into_iter().chain(world.decoy_instances.clone()).collect();
    assert_eq!(ours.len(), 3);
    assert!(!keep.is_empty(), "the world has managed and decoy instances");

    // EKS says the cluster runs, and its API (proven by EKS's endpoint) has a Node on each
    let refused = verify_reclaim(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(refused.code, 3, "{}", refused.dump());
    assert!(refused.stderr.contains("karpenter-teardown run"), "says what to use instead: {}", refused.dump());
    for id in &ours {
        assert!(refused.stderr.contains(id), "names {id}: {}", refused.dump());
    }
    let dry = verify_reclaim(&b, &world.cluster, &[]).await;
    assert_eq!(dry.code, 3, "a dry run predicts the refusal: {}", dry.dump());
    let after = states(&b.aws, &ours).await;
    assert_eq!(after.len(), 3);
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");

    // once EKS no longer knows the cluster, nothing can run on its instances: they may go, as
    // many as --max-nodes allows
    b.cloud.deregister_eks_cluster(&world.cluster).await.unwrap();
    let too_many = verify_reclaim(&b, &world.cluster, &["--yes", "--max-nodes", "2"]).await;
    assert_eq!(too_many.code, 3, "{}", too_many.dump());
    assert!(too_many.stderr.contains("more than --max-nodes 2"), "{}", too_many.dump());
    assert!(states(&b.aws, &ours).await.values().all(|s| *s == InstanceState::Running));
    let reclaimed = verify_reclaim(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(reclaimed.code, 0, "{}", reclaimed.dump());
    let gone = states(&b.aws, &ours).await;
    assert_eq!(gone.len(), 3);
    assert!(gone.values().all(|s| *s == InstanceState::Terminated), "{gone:?}");
    let kept = states(&b.aws, &keep).await;
    assert_eq!(kept.len(), keep.len());
    assert!(kept.values().all(|s| *s == InstanceState::Running), "managed and decoy instances: {kept:?}");
    b.server.shutdown().await;
}
