//! The project's own EC2/IAM layer against LocalStack through the real SDK: create, list by tag,
//! terminate in batches, and the verification read.

mod common;

use std::collections::BTreeMap;

use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::aws::ec2::InstanceScope;
use karpenter_teardown::{karpenter, verify};

const REGION: &str = "us-west-2";

fn karpenter_tags(cluster: &str, pool: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (karpenter::TAG_EKS_CLUSTER.to_string(), cluster.to_string()),
        (karpenter::cluster_tag_key(cluster), "owned".to_string()),
        (karpenter::TAG_NODEPOOL.to_string(), pool.to_string()),
        (karpenter::TAG_NODECLASS.to_string(), "default".to_string()),
    ])
}

#[tokio::test]
async fn instances_are_listed_by_cluster_tags_and_terminated_in_batches() {
    let aws = common::localstack(REGION).await;
    let cluster = common::unique_cluster("ec2");
    let other = common::unique_cluster("decoy");
    let ours = aws
        .ec2
        .launch_tagged("ami-12c6146b", "m5.large", Some("us-west-2a"), 3, &karpenter_tags(&cluster, "general"))
        .await
        .unwrap();
    let decoys =
        aws.ec2.launch_tagged("ami-12c6146b", "m5.large", None, 2, &karpenter_tags(&other, "general")).await.unwrap();
    // an instance of the cluster without Karpenter's tags (a managed node group) must not match
    let mng_tags = BTreeMap::from([(karpenter::TAG_EKS_CLUSTER.to_string(), cluster.clone())]);
    let mng = aws.ec2.launch_tagged("ami-12c6146b", "m5.large", None, 1, &mng_tags).await.unwrap();
    assert_eq!(ours.len(), 3);

    let listed = aws.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap();
    let mut ids: Vec<String> = listed.iter().map(|i| i.id.clone()).collect();
    ids.sort();
    let mut expected: Vec<String> = ours.iter().map(|i| i.id.clone()).collect();
    expected.sort();
    assert_eq!(ids, expected, "only the cluster's Karpenter instances are listed");
    assert!(listed.iter().all(|i| i.tag(karpenter::TAG_NODEPOOL) == Some("general")));
    let any = aws.ec2.cluster_instances(&cluster, InstanceScope::ClusterAny).await.unwrap();
    assert_eq!(any.len(), 4, "ClusterAny includes the managed node group instance");

    // one id EC2 does not know makes the batch fail as a whole; the per-id fallback still
    // terminates the good ones and reports the bad one as not found
    let mut batch = expected.clone();
    batch.push("i-0000000000000dead".into());
    let out = aws.ec2.terminate(&batch).await.unwrap();
    assert_eq!(out.not_found, vec!["i-0000000000000dead".to_string()]);
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    let mut accepted = out.accepted.clone();
    accepted.sort();
    assert_eq!(accepted, expected);

    let after = aws.ec2.instances_by_id(&expected).await.unwrap();
    assert!(after.iter().all(|i| i.state == InstanceState::Terminated), "{after:?}");
    assert!(aws.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap().is_empty());

    // nothing outside the cluster was touched
    let decoy_ids: Vec<String> = decoys.iter().chain(mng.iter()).map(|i| i.id.clone()).collect();
    let untouched = aws.ec2.instances_by_id(&decoy_ids).await.unwrap();
    assert_eq!(untouched.len(), 3);
    assert!(untouched.iter().all(|i| i.state == InstanceState::Running), "{untouched:?}");
    aws.ec2.terminate(&decoy_ids).await.unwrap();
}

#[tokio::test]
async fn verification_finds_leftovers_and_reclaim_removes_only_the_clusters() {
    let aws = common::localstack(REGION).await;
    let cluster = common::unique_cluster("verify");
    let other = common::unique_cluster("other");
    let lt_tags = |c: &str| {
        BTreeMap::from([
            (karpenter::TAG_EKS_CLUSTER.to_string(), c.to_string()),
            (karpenter::TAG_NODECLASS.to_string(), "default".to_string()),
        ])
    };
    let legacy_tags = BTreeMap::from([(karpenter::TAG_LEGACY_CLUSTER.to_string(), cluster.clone())]);
    aws.ec2
        .create_launch_template(&format!("karpenter.k8s.aws/{cluster}-a"), "ami-12c6146b", &lt_tags(&cluster))
        .await
        .unwrap();
    aws.ec2
        .create_launch_template(&format!("karpenter.k8s.aws/{cluster}-legacy"), "ami-12c6146b", &legacy_tags)
        .await
        .unwrap();
    let other_lt = aws
        .ec2
        .create_launch_template(&format!("karpenter.k8s.aws/{other}-a"), "ami-12c6146b", &lt_tags(&other))
        .await
        .unwrap();
    // a template of the cluster that Karpenter did not make (no prefix) is not ours
    aws.ec2.create_launch_template(&format!("eks-mng-{cluster}"), "ami-12c6146b", &lt_tags(&cluster)).await.unwrap();
    let uid = "4f1c3a2e-0000-4000-8000-000000000001";
    let path = format!("{}{uid}/", karpenter::instance_profile_path_prefix(REGION, &cluster));
    aws.iam.create_instance_profile(&format!("{cluster}_p1"), &path, None).await.unwrap();
    aws.iam.create_instance_profile(&format!("{cluster}_legacy"), "/", None).await.unwrap();
    aws.iam.create_instance_profile(&format!("{other}_keep"), "/", None).await.unwrap();
    let inst =
        aws.ec2.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&cluster, "spot")).await.unwrap();

    let left = verify::collect(&aws, &cluster).await.unwrap();
    assert!(!left.is_clean());
    assert_eq!(left.instances.len(), 1);
    assert_eq!(left.launch_templates.len(), 2, "{:?}", left.launch_templates);
    assert_eq!(left.instance_profiles.len(), 2, "{:?}", left.instance_profiles);

    let failures = verify::reclaim(&aws, &left).await.unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    let after = verify::verify(&aws, &cluster, std::time::Duration::from_millis(100)).await.unwrap();
    assert!(after.is_clean(), "{after:?}");

    // the other cluster's template and profile are still there
    assert_eq!(aws.ec2.launch_templates(&other).await.unwrap().len(), 1);
    assert_eq!(aws.iam.cluster_instance_profiles(REGION, &other).await.unwrap().len(), 1);
    assert!(inst[0].state.is_live());
    aws.ec2.delete_launch_template(&other_lt).await.unwrap();
}

#[tokio::test]
async fn verify_command_reports_a_leftover_with_exit_4_and_reclaims_it_with_exit_0() {
    let aws = common::localstack(REGION).await;
    let cluster = common::unique_cluster("verifycli");
    let other = common::unique_cluster("keep");
    let leaked =
        aws.ec2.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&cluster, "general")).await.unwrap();
    let decoy =
        aws.ec2.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&other, "general")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("report.json");
    let verify = |reclaim: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
        c.args(["verify", "--cluster", &cluster, "--region", REGION, "--report"]).arg(&report_path);
        if reclaim {
            c.arg("--reclaim");
        }
        c.envs(common::localstack_env());
        c.output().unwrap()
    };
    let out = verify(false);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["version"], 1);
    assert_eq!(report["outcome"], "leftovers");
    assert_eq!(report["leftovers"]["instances"][0]["id"], leaked[0].id.as_str());
    assert!(String::from_utf8_lossy(&out.stdout).contains(&leaked[0].id));

    let out = verify(true);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["outcome"], "clean");
    let state = aws.ec2.instances_by_id(&[leaked[0].id.clone(), decoy[0].id.clone()]).await.unwrap();
    let by_id = |id: &str| state.iter().find(|i| i.id == id).unwrap().state;
    assert_eq!(by_id(&leaked[0].id), InstanceState::Terminated);
    assert_eq!(by_id(&decoy[0].id), InstanceState::Running, "another cluster's instance survives --reclaim");
    aws.ec2.terminate(&[decoy[0].id.clone()]).await.unwrap();
}
