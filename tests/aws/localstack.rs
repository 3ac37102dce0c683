//! The project's own EC2/IAM layer against LocalStack through the real SDK: create, list by tag,
//! terminate in batches, and the verification read.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};

use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::aws::ec2::InstanceScope;
use karpenter_teardown::engine::batcher::Ec2Batcher;
use karpenter_teardown::{karpenter, verify};
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};

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
    let cloud = common::cloud(REGION).await;
    let tool = common::localstack_as_aws(REGION).await;
    let cluster = common::unique_cluster("ec2");
    let other = common::unique_cluster("decoy");
    let ours = cloud
        .launch_tagged("ami-12c6146b", "m5.large", Some("us-west-2a"), 3, &karpenter_tags(&cluster, "general"))
        .await
        .unwrap();
    let decoys =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 2, &karpenter_tags(&other, "general")).await.unwrap();
    // an instance of the cluster without Karpenter's tags (a managed node group) must not match
    let mng_tags = BTreeMap::from([(karpenter::TAG_EKS_CLUSTER.to_string(), cluster.clone())]);
    let mng = cloud.launch_tagged("ami-12c6146b", "m5.large", None, 1, &mng_tags).await.unwrap();
    assert_eq!(ours.len(), 3);

    let listed = tool.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap();
    let mut ids: Vec<String> = listed.iter().map(|i| i.id.clone()).collect();
    ids.sort();
    let mut expected: Vec<String> = ours.iter().map(|i| i.id.clone()).collect();
    expected.sort();
    assert_eq!(ids, expected, "only the cluster's Karpenter instances are listed");
    assert!(listed.iter().all(|i| i.tag(karpenter::TAG_NODEPOOL) == Some("general")));
    let any = tool.ec2.cluster_instances(&cluster, InstanceScope::ClusterAny).await.unwrap();
    assert_eq!(any.len(), 4, "ClusterAny includes the managed node group instance");

    // one id EC2 does not know makes the batch fail as a whole; the per-id fallback still
    // terminates the good ones and reports the bad one as not found
    let mut batch = expected.clone();
    batch.push("i-0000000000000dead".into());
    let out = tool.ec2.terminate(&batch).await.unwrap();
    assert_eq!(out.not_found, vec!["i-0000000000000dead".to_string()]);
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    let mut accepted = out.accepted.clone();
    accepted.sort();
    assert_eq!(accepted, expected);

    let after = tool.ec2.instances_by_id(&expected).await.unwrap();
    assert!(after.iter().all(|i| i.state == InstanceState::Terminated), "{after:?}");
    assert!(tool.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap().is_empty());

    // nothing outside the cluster was touched
    let decoy_ids: Vec<String> = decoys.iter().chain(mng.iter()).map(|i| i.id.clone()).collect();
    let untouched = tool.ec2.instances_by_id(&decoy_ids).await.unwrap();
    assert_eq!(untouched.len(), 3);
    assert!(untouched.iter().all(|i| i.state == InstanceState::Running), "{untouched:?}");
    aws.ec2.terminate(&decoy_ids).await.unwrap();
}

#[tokio::test]
async fn verification_finds_leftovers_and_reclaim_removes_only_the_clusters() {
    let aws = common::localstack(REGION).await;
    let cloud = common::cloud(REGION).await;
    let cluster = common::unique_cluster("verify");
    let other = common::unique_cluster("other");
    let lt_tags = |c: &str| {
        BTreeMap::from([
            (karpenter::TAG_EKS_CLUSTER.to_string(), c.to_string()),
            (karpenter::TAG_NODECLASS.to_string(), "default".to_string()),
        ])
    };
    let legacy_tags = BTreeMap::from([(karpenter::TAG_LEGACY_CLUSTER.to_string(), cluster.clone())]);
    cloud
        .create_launch_template(&format!("karpenter.k8s.aws/{cluster}-a"), "ami-12c6146b", &lt_tags(&cluster))
        .await
        .unwrap();
    cloud
        .create_launch_template(&format!("karpenter.k8s.aws/{cluster}-legacy"), "ami-12c6146b", &legacy_tags)
        .await
        .unwrap();
    let other_lt = cloud
        .create_launch_template(&format!("karpenter.k8s.aws/{other}-a"), "ami-12c6146b", &lt_tags(&other))
        .await
        .unwrap();
    // a template of the cluster that Karpenter did not make (no prefix) is not ours
    cloud.create_launch_template(&format!("eks-mng-{cluster}"), "ami-12c6146b", &lt_tags(&cluster)).await.unwrap();
    let uid = "4f1c3a2e-0000-4000-8000-000000000001";
    let path = format!("{}{uid}/", karpenter::instance_profile_path_prefix(REGION, &cluster));
    let ptags = |c: &str, region: &str| karpenter::instance_profile_tags(c, region, "default");
    cloud.create_instance_profile(&format!("{cluster}_1234"), &path, &ptags(&cluster, REGION)).await.unwrap();
    cloud.create_instance_profile(&format!("{cluster}_98765"), "/", &ptags(&cluster, REGION)).await.unwrap();
    cloud.create_instance_profile(&format!("{other}_3131"), "/", &ptags(&other, REGION)).await.unwrap();
    let untouchable = user_profiles_that_look_like_karpenters(&cloud, &cluster).await;
    let inst =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&cluster, "spot")).await.unwrap();

    let tool = common::localstack_as_aws(REGION).await;
    let none = BTreeSet::new();
    let left = verify::collect(&tool, &cluster, &none).await.unwrap();
    assert!(!left.is_clean());
    assert_eq!(left.instances.len(), 1);
    assert_eq!(left.launch_templates.len(), 2, "{:?}", left.launch_templates);
    let mut profiles: Vec<&str> = left.instance_profiles.iter().map(|p| p.name.as_str()).collect();
    profiles.sort();
    assert_eq!(profiles, [format!("{cluster}_1234"), format!("{cluster}_98765")], "only profiles on evidence");

    let failures = verify::reclaim(&tool, &left).await.unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    let after = verify::verify(&tool, &cluster, &none, std::time::Duration::from_millis(100), None).await.unwrap();
    assert!(after.is_clean(), "{after:?}");
    for name in &untouchable {
        assert!(
            profile_exists(&cloud, name).await,
            "{name} is not this cluster's Karpenter's and must survive --reclaim"
        );
    }

    // the other cluster's template and profile are still there
    assert_eq!(aws.ec2.launch_templates(&other).await.unwrap().len(), 1);
    assert_eq!(aws.iam.cluster_instance_profiles(REGION, &other).await.unwrap().len(), 1);
    assert!(inst[0].is_live());
    aws.ec2.delete_launch_template(&other_lt).await.unwrap();
}

#[tokio::test]
async fn lookups_of_more_than_200_instances_respect_ec2s_filter_limit() {
    // EC2 refuses more than 200 values in one filter (FilterLimitExceeded); the proxy in front of
    // LocalStack refuses it too. A cluster of 450 Karpenter nodes must still be looked up.
    let aws = common::localstack(REGION).await;
    let cloud = common::cloud(REGION).await;
    let tool = common::localstack_as_aws(REGION).await;
    let cluster = common::unique_cluster("many");
    let real =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 2, &karpenter_tags(&cluster, "general")).await.unwrap();
    let mut ids: Vec<String> = (0..448).map(|i| format!("i-0{i:016x}")).collect();
    ids.extend(real.iter().map(|i| i.id.clone()));
    let found = tool.ec2.instances_by_id(&ids).await.expect("450 ids are looked up in calls EC2 accepts");
    let mut found: Vec<String> = found.into_iter().map(|i| i.id).collect();
    found.sort();
    let mut expected: Vec<String> = real.iter().map(|i| i.id.clone()).collect();
    expected.sort();
    assert_eq!(found, expected);
    // the wait for terminations adds a state filter, whose values count against the same 200
    let live = tool.ec2.live_instances_by_id(&ids).await.expect("with the state filter too");
    let mut live: Vec<String> = live.into_iter().map(|i| i.id).collect();
    live.sort();
    assert_eq!(live, expected);
    aws.ec2.terminate(&expected).await.unwrap();
}

#[tokio::test]
async fn verify_command_reports_a_leftover_with_exit_4_and_reclaims_it_with_exit_0() {
    let aws = common::localstack(REGION).await;
    let cloud = common::cloud(REGION).await;
    let cluster = common::unique_cluster("verifycli");
    let other = common::unique_cluster("keep");
    let leaked =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&cluster, "general")).await.unwrap();
    let decoy =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&other, "general")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("report.json");
    let verify = |extra: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
        c.args(["verify", "--cluster", &cluster, "--region", REGION, "--report"]).arg(&report_path).args(extra);
        c.envs(common::localstack_env()).env("AWS_ACCESS_KEY_ID", common::judged_key(&cluster, REGION));
        c.output().unwrap()
    };
    let out = verify(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["version"], 1);
    assert_eq!(report["outcome"], "leftovers");
    assert_eq!(report["leftovers"]["instances"][0]["id"], leaked[0].id.as_str());
    assert!(String::from_utf8_lossy(&out.stdout).contains(&leaked[0].id));

    // --reclaim without --yes: the same consent model as run; it lists and changes nothing
    let out = verify(&["--reclaim"]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["outcome"], "leftovers");
    assert!(report["would_reclaim"][0].as_str().unwrap().contains(&leaked[0].id), "{report}");
    assert_eq!(report["reclaimed"].as_array().map(Vec::len), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("would reclaim with --yes"));
    let state = aws.ec2.instances_by_id(&[leaked[0].id.clone()]).await.unwrap();
    assert_eq!(state[0].state, InstanceState::Running, "--reclaim without --yes terminated an instance");

    let out = verify(&["--reclaim", "--yes"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["outcome"], "clean");
    let state = aws.ec2.instances_by_id(&[leaked[0].id.clone(), decoy[0].id.clone()]).await.unwrap();
    let by_id = |id: &str| state.iter().find(|i| i.id == id).unwrap().state;
    assert_eq!(by_id(&leaked[0].id), InstanceState::Terminated);
    assert_eq!(by_id(&decoy[0].id), InstanceState::Running, "another cluster's instance survives --reclaim");
    aws.ec2.terminate(&[decoy[0].id.clone()]).await.unwrap();
}

/// Instance profiles that share a prefix, a path or some tags with the cluster's Karpenter's but
/// are not: a user's `<c>_bastion`, the profiles of a cluster named `<c>_eu` (EKS names allow
/// `_`), a cluster of the same name in another region (IAM is global), a `<c>_<digits>` profile
/// the user made without Karpenter's tags, one at the 1.7+ path of `<c>_eu`.
async fn user_profiles_that_look_like_karpenters(cloud: &sandbox_sim::cloud::Cloud, cluster: &str) -> Vec<String> {
    let tags = karpenter::instance_profile_tags;
    let eu = format!("{cluster}_eu");
    let bastion_tags = BTreeMap::from([(karpenter::cluster_tag_key(cluster), "owned".to_string())]);
    let cases = [
        (format!("{cluster}_bastion"), "/".to_string(), bastion_tags),
        (format!("{eu}_4242"), "/".to_string(), tags(&eu, REGION, "default")),
        (format!("{cluster}_5151"), "/".to_string(), tags(cluster, "eu-west-1", "default")),
        (format!("{cluster}_6161"), "/".to_string(), BTreeMap::new()),
        (
            format!("{eu}_7171"),
            format!("{}u/", karpenter::instance_profile_path_prefix(REGION, &eu)),
            tags(&eu, REGION, "d"),
        ),
    ];
    let mut names = Vec::new();
    for (name, path, tags) in cases {
        cloud.create_instance_profile(&name, &path, &tags).await.unwrap();
        names.push(name);
    }
    names
}

async fn profile_exists(cloud: &sandbox_sim::cloud::Cloud, name: &str) -> bool {
    match cloud.iam_sdk().get_instance_profile().instance_profile_name(name).send().await {
        Ok(_) => true,
        Err(e) if e.as_service_error().is_some_and(|e| e.is_no_such_entity_exception()) => false,
        Err(e) => panic!("GetInstanceProfile {name}: {e:?}"),
    }
}

#[tokio::test]
async fn verify_reclaim_never_deletes_profiles_that_only_share_the_clusters_name_prefix() {
    let cloud = common::cloud(REGION).await;
    let cluster = common::unique_cluster("iamsafe");
    let untouchable = user_profiles_that_look_like_karpenters(&cloud, &cluster).await;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["verify", "--cluster", &cluster, "--region", REGION, "--reclaim", "--yes"])
        .envs(common::localstack_env())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "nothing of the cluster's Karpenter exists: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in &untouchable {
        assert!(profile_exists(&cloud, name).await, "{name} was deleted by verify --reclaim");
        cloud.iam_sdk().delete_instance_profile().instance_profile_name(name).send().await.unwrap();
    }
}

/// Creates a detached network interface with `description` and `tags` in a fresh subnet.
async fn detached_interface(cloud: &sandbox_sim::cloud::Cloud, description: &str, tags: &[(String, String)]) -> String {
    use aws_sdk_ec2::types::{ResourceType, Tag, TagSpecification};
    let ec2 = cloud.ec2_sdk();
    let vpc = ec2.create_vpc().cidr_block("10.42.0.0/16").send().await.unwrap();
    let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).unwrap().to_string();
    let subnet = ec2.create_subnet().vpc_id(&vpc_id).cidr_block("10.42.1.0/24").send().await.unwrap();
    let subnet_id = subnet.subnet().and_then(|s| s.subnet_id()).unwrap().to_string();
    let spec = TagSpecification::builder()
        .resource_type(ResourceType::NetworkInterface)
        .set_tags(Some(tags.iter().map(|(k, v)| Tag::builder().key(k).value(v).build()).collect()))
        .build();
    let ni = ec2
        .create_network_interface()
        .subnet_id(subnet_id)
        .description(description)
        .tag_specifications(spec)
        .send()
        .await
        .unwrap();
    ni.network_interface().and_then(|n| n.network_interface_id()).unwrap().to_string()
}

#[tokio::test]
async fn detached_vpc_cni_interfaces_of_the_cluster_are_leftovers_and_reclaimed() {
    let aws = common::localstack(REGION).await;
    let cloud = common::cloud(REGION).await;
    let cluster = common::unique_cluster("eni");
    // held to deploy/iam-policy.json: a reclaim the policy does not allow fails here as on AWS
    let tool = common::localstack_as_aws_with_key(REGION, &common::judged_key(&cluster, REGION)).await;
    let other = common::unique_cluster("eni-other");
    let old = "2026-01-01T00:00:00Z";
    let fresh = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let node = "i-0123456789abcdef0";
    let cni_description = format!("{}{node}", karpenter::VPC_CNI_DESCRIPTION_PREFIX);
    let cni = |c: &str, created: &str| {
        vec![
            (karpenter::TAG_VPC_CNI_CLUSTER.to_string(), c.to_string()),
            (karpenter::TAG_VPC_CNI_NODE.to_string(), node.to_string()),
            (karpenter::TAG_ENI_OWNER.to_string(), "amazon-vpc-cni".to_string()),
            (karpenter::TAG_VPC_CNI_CREATED_AT.to_string(), created.to_string()),
        ]
    };
    // a branch interface the VPC resource controller (Security Groups for Pods) has just created
    // and not yet associated with its trunk: tagged for the cluster, detached, and not ours
    let branch_tags = vec![
        (karpenter::cluster_tag_key(&cluster), "owned".to_string()),
        (karpenter::TAG_ENI_OWNER.to_string(), karpenter::ENI_OWNER_RESOURCE_CONTROLLER.to_string()),
        ("vpcresources.k8s.aws/trunk-eni-id".to_string(), "eni-0123456789abcdef0".to_string()),
        ("vpcresources.k8s.aws/vlan-id".to_string(), "1".to_string()),
        (karpenter::TAG_VPC_CNI_NODE.to_string(), node.to_string()),
    ];
    let leaked = detached_interface(&cloud, &cni_description, &cni(&cluster, old)).await;
    let others = detached_interface(&cloud, &cni_description, &cni(&other, old)).await;
    let young = detached_interface(&cloud, &cni_description, &cni(&cluster, &fresh)).await;
    let branch = detached_interface(&cloud, "aws-k8s-branch-eni", &branch_tags).await;

    let left = verify::collect(&tool, &cluster, &BTreeSet::new()).await.unwrap();
    let ids: Vec<&str> = left.network_interfaces.iter().map(|n| n.id.as_str()).collect();
    assert_eq!(ids, [leaked.as_str()], "only the cluster's settled CNI interface is a leftover");
    assert!(left.network_interfaces[0].reason.as_deref().is_some_and(|r| r.contains("VPC CNI")), "{left:?}");
    let mut alone: Vec<&str> = left.network_interfaces_left.iter().map(|n| n.id.as_str()).collect();
    alone.sort();
    let mut expected_alone = vec![young.as_str(), branch.as_str()];
    expected_alone.sort();
    assert_eq!(alone, expected_alone, "the young CNI interface and the branch interface are reported, left alone");
    let branch_reason = left.network_interfaces_left.iter().find(|n| n.id == branch).and_then(|n| n.reason.clone());
    assert!(branch_reason.is_some_and(|r| r.contains("VPC resource controller")));
    assert!(!left.is_clean());

    let failures = verify::reclaim(&tool, &left).await.unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    let exists = |id: String| {
        let ec2 = cloud.ec2_sdk().clone();
        async move {
            match ec2.describe_network_interfaces().network_interface_ids(&id).send().await {
                Ok(o) => !o.network_interfaces().is_empty(),
                Err(_) => false,
            }
        }
    };
    assert!(!exists(leaked.clone()).await, "the leaked interface was deleted");
    assert!(exists(others.clone()).await, "another cluster's interface survives");
    assert!(exists(young.clone()).await, "an interface inside the CNI's cool-down survives");
    assert!(exists(branch.clone()).await, "the resource controller's branch interface survives --reclaim");
    let after = verify::collect(&tool, &cluster, &BTreeSet::new()).await.unwrap();
    assert!(after.is_clean(), "what is left alone does not count against a clean result: {after:?}");
    for id in [others, young, branch] {
        aws.ec2.delete_network_interface(&id).await.unwrap();
    }
}

// multi-threaded: the proxy serves the spawned tool from this test's runtime while it waits
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reclaim_ends_clean_when_its_instances_stay_shutting_down_for_a_minute() {
    // EC2 keeps an instance shutting-down for a while after TerminateInstances, and a read right
    // after the call may still say running; the proxy models both, a minute of it at a tenth of
    // EC2's time. A reclaim must wait for what it terminated before it checks again.
    let aws = common::localstack(REGION).await;
    let cloud = common::cloud(REGION).await;
    let cluster = common::unique_cluster("slowterm");
    let leaked =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 2, &karpenter_tags(&cluster, "general")).await.unwrap();
    let proxy =
        sandbox_sim::ec2proxy::Ec2Proxy::start(common::LOCALSTACK, sandbox_sim::ec2proxy::ProxyFaults::default())
            .await
            .unwrap();
    let timing = sandbox_sim::ec2time::Ec2Timing {
        shutting_down: std::time::Duration::from_secs(6),
        stale_reads: std::time::Duration::from_secs(1),
    };
    proxy.control().set_timing(timing);
    let key = common::fresh_key();
    proxy.control().attach_policy(&key, common::principal(common::shipped_policy(&cluster, REGION)));
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("report.json");
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["verify", "--cluster", &cluster, "--region", REGION, "--reclaim", "--yes", "--report"])
        .arg(&report_path)
        .envs(common::localstack_env())
        .env("AWS_ENDPOINT_URL", proxy.url())
        .env("AWS_ACCESS_KEY_ID", &key)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}\n{report:#}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(report["outcome"], "clean", "{report:#}");
    assert!(started.elapsed() >= timing.shutting_down, "the reclaim waited out the shutting-down instances");
    assert!(proxy.control().unauthorized().is_empty(), "{:?}", proxy.control().unauthorized());
    let ids: Vec<String> = leaked.iter().map(|i| i.id.clone()).collect();
    let after = aws.ec2.instances_by_id(&ids).await.unwrap();
    assert!(after.iter().all(|i| i.state == InstanceState::Terminated), "{after:?}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_ec2_proxy_shows_terminations_as_ec2_would_and_filters_on_that_state() {
    let cloud = common::cloud(REGION).await;
    let cluster = common::unique_cluster("ec2clock");
    let ours =
        cloud.launch_tagged("ami-12c6146b", "m5.large", None, 1, &karpenter_tags(&cluster, "general")).await.unwrap();
    let proxy =
        sandbox_sim::ec2proxy::Ec2Proxy::start(common::LOCALSTACK, sandbox_sim::ec2proxy::ProxyFaults::default())
            .await
            .unwrap();
    // windows of seconds, not fractions: the reads land in them on a loaded 2-core machine too
    proxy.control().set_timing(sandbox_sim::ec2time::Ec2Timing {
        shutting_down: std::time::Duration::from_secs(10),
        stale_reads: std::time::Duration::from_secs(3),
    });
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(REGION))
        .endpoint_url(proxy.url())
        .credentials_provider(aws_credential_types::Credentials::new("test", "test", None, None, "tests"))
        .load()
        .await;
    let tool = karpenter_teardown::aws::AwsClients::from_config(&config).await.unwrap();
    let id = ours[0].id.clone();
    tool.ec2.terminate(std::slice::from_ref(&id)).await.unwrap();
    let state = |tool: &karpenter_teardown::aws::AwsClients| {
        let (tool, id) = (tool.clone(), id.clone());
        async move { tool.ec2.instances_by_id(&[id]).await.unwrap().first().map(|i| i.state) }
    };
    // what a wait for the termination reads: LocalStack already says terminated throughout
    let live_by_id = |tool: &karpenter_teardown::aws::AwsClients| {
        let (tool, id) = (tool.clone(), id.clone());
        async move { tool.ec2.live_instances_by_id(&[id]).await.unwrap().first().map(|i| i.state) }
    };
    assert_eq!(state(&tool).await, Some(InstanceState::Running), "a read right after the call is stale");
    assert_eq!(live_by_id(&tool).await, Some(InstanceState::Running), "a wait does not end on a stale read");
    let live = tool.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap();
    assert_eq!(live.len(), 1, "the live-state filter still finds it");
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    assert_eq!(state(&tool).await, Some(InstanceState::ShuttingDown));
    assert_eq!(live_by_id(&tool).await, Some(InstanceState::ShuttingDown), "nor while it shuts down");
    assert_eq!(tool.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap().len(), 1);
    tokio::time::sleep(std::time::Duration::from_millis(7000)).await;
    assert_eq!(state(&tool).await, Some(InstanceState::Terminated));
    assert_eq!(live_by_id(&tool).await, None, "terminated: left out of the answer, so the wait ends");
    assert!(tool.ec2.cluster_instances(&cluster, InstanceScope::KarpenterLive).await.unwrap().is_empty());
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminations_asked_for_at_once_are_paced_to_ec2s_instance_bucket_and_never_refused() {
    // EC2 lets 1,000 instances go at once and 20 a second after that, and refuses as a whole a
    // call for more than its bucket holds. 1,100 terminations asked for at once: the batcher
    // sends what the bucket holds, so EC2 refuses none, where batches of 500 met refusals and
    // the SDK's backoff. The proxy is this test's own, so its bucket is full at the start.
    let cloud = common::cloud(REGION).await;
    let proxy = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults::default()).await.unwrap();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(REGION))
        .endpoint_url(proxy.url())
        .credentials_provider(aws_credential_types::Credentials::new("test", "test", None, None, "tests"))
        // the tool's own retry settings (aws::AwsClients::connect)
        .retry_config(aws_config::retry::RetryConfig::standard().with_max_attempts(8))
        .load()
        .await;
    let tool = karpenter_teardown::aws::AwsClients::from_config(&config).await.unwrap();
    let cluster = common::unique_cluster("paced");
    let ours = cloud
        .launch_tagged("ami-12c6146b", "m5.large", None, 1100, &karpenter_tags(&cluster, "general"))
        .await
        .unwrap();
    assert_eq!(ours.len(), 1100);

    let (batcher, work) = Ec2Batcher::start(tool.ec2.clone(), cluster.clone());
    let worker = tokio::spawn(work);
    let asks = ours.iter().map(|i| {
        let (batcher, id) = (batcher.clone(), i.id.clone());
        async move {
            let accepted = batcher.terminate(&id, None).await.map_err(|e| format!("{id}: {e}"))?;
            assert_eq!(accepted, karpenter_teardown::engine::batcher::Sent::Accepted, "no guard: nothing withdraws it");
            let sent = std::time::Instant::now();
            batcher.wait_terminated(&id).await.map_err(|e| format!("{id}: {e}"))?;
            Ok::<_, String>((sent, std::time::Instant::now()))
        }
    });
    let (mut times, mut failed) = (Vec::new(), Vec::new());
    for r in futures::future::join_all(asks).await {
        match r {
            Ok(t) => times.push(t),
            Err(e) => failed.push(e),
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
    // the machines terminated first are confirmed while the last ones still wait their turn
    // for the bucket (5 s for the last 100), not all at the end
    let first_confirmed = times.iter().map(|(_, confirmed)| *confirmed).min().unwrap();
    let last_sent = times.iter().map(|(sent, _)| *sent).max().unwrap();
    assert!(first_confirmed < last_sent, "no termination was confirmed before the last one was sent");

    let counts = proxy.counts();
    assert_eq!(counts.over_budget, 0, "EC2 refused terminations the bucket could not hold: {counts:?}");
    let calls = proxy.actions().get("TerminateInstances").copied().unwrap_or(0);
    // two full calls of 500, then the other 100 at the refill's pace
    assert!(calls >= 3, "{calls} TerminateInstances calls for 1,100 instances");
    let ids: Vec<String> = ours.iter().map(|i| i.id.clone()).collect();
    let after = tool.ec2.instances_by_id(&ids).await.unwrap();
    assert_eq!(after.len(), 1100);
    assert!(
        after.iter().all(|i| matches!(i.state, InstanceState::ShuttingDown | InstanceState::Terminated)),
        "{after:?}"
    );
    worker.abort();
    proxy.shutdown().await;
}
