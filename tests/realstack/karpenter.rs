//! The real Karpenter (karpenter-provider-aws, built from source by
//! `crates/realstack/build-karpenter`) as the live controller on the real control plane, with
//! LocalStack as EC2 and IAM: it provisions for pending pods with its own CreateFleet, launch
//! templates and instance profile, and the tool tears that down while it runs. Each test runs for
//! the newest release line (1.14) and the oldest still in the field (1.0), whose CRDs name a
//! conversion webhook, whose launch templates carry `karpenter.k8s.aws/cluster` and whose instance
//! profiles sit at path `/` named `<cluster>_<hash>`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aws_sdk_ec2::types::{Filter, ResourceType, Tag, TagSpecification};
use k8s_openapi::api::core::v1::{Node, Pod};
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::k8s;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use realstack::karpenter::{KarpenterSettings, RealKarpenter};
use sandbox_sim::KarpenterVersion;
use serde_json::{Value, json};

use super::common;
use super::common::e2e::{REGION, count, states};

const PODS: usize = 2;

fn tags(pairs: &[(&str, &str)]) -> Vec<Tag> {
    pairs.iter().map(|(k, v)| Tag::builder().key(*k).value(*v).build()).collect()
}

pub(crate) fn spec(kind: ResourceType, pairs: &[(&str, &str)]) -> TagSpecification {
    TagSpecification::builder().resource_type(kind).set_tags(Some(tags(pairs))).build()
}

/// The network, the node role and an AMI Karpenter discovers by the cluster's tag, as the
/// cluster's infrastructure code would have made them; returns the AMI's id.
pub(crate) async fn infrastructure(ec2: &aws_sdk_ec2::Client, iam: &aws_sdk_iam::Client, cluster: &str) -> String {
    let discovery = [("karpenter.sh/discovery", cluster)];
    let vpc = ec2.create_vpc().cidr_block("10.77.0.0/16").send().await.unwrap();
    let vpc = vpc.vpc().unwrap().vpc_id().unwrap().to_string();
    for (i, zone) in ["us-west-2a", "us-west-2b"].iter().enumerate() {
        ec2.create_subnet()
            .vpc_id(&vpc)
            .cidr_block(format!("10.77.{i}.0/24"))
            .availability_zone(*zone)
            .tag_specifications(spec(ResourceType::Subnet, &discovery))
            .send()
            .await
            .unwrap();
    }
    ec2.create_security_group()
        .group_name(format!("{cluster}-nodes"))
        .description("nodes")
        .vpc_id(&vpc)
        .tag_specifications(spec(ResourceType::SecurityGroup, &discovery))
        .send()
        .await
        .unwrap();
    iam.create_role()
        .role_name(format!("{cluster}-node"))
        .assume_role_policy_document(
            json!({"Version": "2012-10-17", "Statement": [{"Effect": "Allow",
                "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]})
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    // LocalStack's built-in images include x86_64 Linux ones; Karpenter takes any image by id
    let images = ec2
        .describe_images()
        .filters(Filter::builder().name("architecture").values("x86_64").build())
        .filters(Filter::builder().name("name").values("ubuntu/images/*").build())
        .send()
        .await
        .unwrap();
    images.images().first().and_then(|i| i.image_id()).expect("an x86_64 Linux image in LocalStack").to_string()
}

pub(crate) fn object(v: Value) -> DynamicObject {
    serde_json::from_value(v).unwrap()
}

/// The EC2NodeClass and the NodePool `default`, as the cluster's Karpenter configuration would
/// have them; returns the classes' API.
pub(crate) async fn class_and_pool(admin: &kube::Client, ami: &str, cluster: &str) -> Api<DynamicObject> {
    let pp = PostParams::default();
    let classes: Api<DynamicObject> = Api::all_with(admin.clone(), &k8s::nodeclass_resource());
    // AL2, not AL2023: for AL2023 Karpenter validates the class by reading the service CIDR from
    // EKS's DescribeCluster (pkg/controllers/nodeclass/validation.go), which LocalStack does not serve
    classes
        .create(
            &pp,
            &object(json!({
                "apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass",
                "metadata": {"name": "default"},
                "spec": {
                    "amiFamily": "AL2",
                    "amiSelectorTerms": [{"id": ami}],
                    "role": format!("{cluster}-node"),
                    "subnetSelectorTerms": [{"tags": {"karpenter.sh/discovery": cluster}}],
                    "securityGroupSelectorTerms": [{"tags": {"karpenter.sh/discovery": cluster}}],
                },
            })),
        )
        .await
        .unwrap();
    let pools: Api<DynamicObject> = Api::all_with(admin.clone(), &k8s::nodepool_resource());
    pools
        .create(
            &pp,
            &object(json!({
                "apiVersion": "karpenter.sh/v1", "kind": "NodePool",
                "metadata": {"name": "default"},
                "spec": {
                    "template": {"spec": {
                        "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                        "requirements": [
                            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["m5.large"]},
                            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                        ],
                    }},
                    // LocalStack's CreateFleet does not put the launch template's security groups
                    // on the instance, so Karpenter sees its nodes as drifted and would replace
                    // them over and over; no voluntary disruption keeps the cluster still
                    "disruption": {"consolidateAfter": "Never", "budgets": [{"nodes": "0"}]},
                },
            })),
        )
        .await
        .unwrap();
    classes
}

/// The tag a release line marks its launch templates with, read by the test from EC2 itself:
/// `karpenter.k8s.aws/cluster` in 1.0 (karpenter-provider-aws v1.0.14
/// pkg/providers/launchtemplate/launchtemplate.go, `v1.TagManagedLaunchTemplate`),
/// `eks:eks-cluster-name` since.
fn launch_template_tag(version: KarpenterVersion) -> &'static str {
    match version {
        KarpenterVersion::V1_0 => "karpenter.k8s.aws/cluster",
        KarpenterVersion::V1_14 => "eks:eks-cluster-name",
    }
}

/// The names of the launch templates tagged as `cluster`'s by `version`.
async fn tagged_launch_templates(ec2: &aws_sdk_ec2::Client, version: KarpenterVersion, cluster: &str) -> Vec<String> {
    let key = launch_template_tag(version);
    let out = ec2
        .describe_launch_templates()
        .filters(Filter::builder().name(format!("tag:{key}")).values(cluster).build())
        .send()
        .await
        .unwrap();
    out.launch_templates().iter().filter_map(|t| t.launch_template_name()).map(str::to_string).collect()
}

/// Where a release line puts the instance profile it makes for a class: at `/`, named
/// `<cluster>_<hash>` in 1.0 (v1.0.14 pkg/apis/v1/ec2nodeclass.go `InstanceProfileName`), under
/// `/karpenter/<region>/<cluster>/<class uid>/` since.
fn assert_profile_shape(version: KarpenterVersion, cluster: &str, name: &str, path: &str) {
    match version {
        KarpenterVersion::V1_0 => {
            assert_eq!(path, "/", "{name}");
            let hash = name.strip_prefix(&format!("{cluster}_")).unwrap_or_default();
            assert!(!hash.is_empty() && hash.bytes().all(|b| b.is_ascii_digit()), "{name}");
        }
        KarpenterVersion::V1_14 => {
            assert!(path.starts_with(&format!("/karpenter/{REGION}/{cluster}/")), "{name} at {path}");
        }
    }
}

/// The instance ids of the NodeClaims that have one; `None` (after a short pause) while the
/// server still answers 429 for a CRD just installed, whose cache is starting, until `deadline`.
pub(crate) async fn claimed_instances(claims: &Api<DynamicObject>, deadline: Instant) -> Option<Vec<String>> {
    let list = match claims.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(kube::Error::Api(e)) if e.code == 429 && Instant::now() < deadline => {
            tokio::time::sleep(Duration::from_millis(500)).await;
            return None;
        }
        Err(e) => panic!("listing NodeClaims: {e}"),
    };
    Some(
        list.items
            .iter()
            .filter_map(|c| c.data["status"]["providerID"].as_str())
            .filter_map(|p| p.rsplit('/').next())
            .map(str::to_string)
            .collect(),
    )
}

/// A number made from `name` (FNV-1a): the same name gives the same number.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// What another cluster's Karpenter 1.0 left in the same account: a launch template with
/// Karpenter's name and the other cluster's tag, and a `/`-path instance profile named for the
/// other cluster. The teardown must leave both. Returns the template's id and the profile's name.
async fn other_clusters_leftovers(
    ec2: &aws_sdk_ec2::Client,
    iam: &aws_sdk_iam::Client,
    cluster: &str,
) -> (String, String) {
    let other = format!("{cluster}-other");
    let lt = ec2
        .create_launch_template()
        // Karpenter 1.0 names its templates `karpenter.k8s.aws/<hash>`; the hash of this test's own
        // cluster name, so that tests running side by side in one account name theirs apart
        .launch_template_name(format!("karpenter.k8s.aws/{}", name_hash(cluster)))
        .launch_template_data(
            aws_sdk_ec2::types::RequestLaunchTemplateData::builder()
                .instance_type(aws_sdk_ec2::types::InstanceType::M5Large)
                .build(),
        )
        .tag_specifications(spec(ResourceType::LaunchTemplate, &[("karpenter.k8s.aws/cluster", &other)]))
        .send()
        .await
        .unwrap();
    let lt = lt.launch_template().and_then(|t| t.launch_template_id()).unwrap().to_string();
    let profile = format!("{other}_1234567890");
    iam.create_instance_profile().instance_profile_name(&profile).path("/").send().await.unwrap();
    (lt, profile)
}

/// The workload: namespace `web` with a Deployment of `pods` pods, each asking for a whole
/// m5.large, and the pods themselves (nothing creates pods from the Deployment on a stack without
/// kube-controller-manager, so they are made as its ReplicaSet would make them).
pub(super) async fn web_workload(admin: &kube::Client, pods: usize) {
    let pp = PostParams::default();
    let ns: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
    ns.create(&pp, &serde_json::from_value(json!({"metadata": {"name": "web"}})).unwrap()).await.unwrap();
    let labels = json!({"app": "web"});
    let container =
        json!({"name": "web", "image": "registry.k8s.io/pause:3.10", "resources": {"requests": {"cpu": "1"}}});
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(admin.clone(), "web");
    deployments
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"replicas": pods,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}))
            .unwrap(),
        )
        .await
        .unwrap();
    let api: Api<Pod> = Api::namespaced(admin.clone(), "web");
    for i in 0..pods {
        let pod =
            json!({"metadata": {"name": format!("web-{i}"), "labels": labels}, "spec": {"containers": [container]}});
        api.create(&pp, &serde_json::from_value(pod).unwrap()).await.unwrap();
    }
}

async fn the_tool_tears_down_what_the_real_karpenter_launched_while_it_runs(version: KarpenterVersion) {
    let cluster = common::unique_cluster("rk");
    let s = super::stack(&cluster).await;
    let admin = s.admin_client().await.unwrap();
    let config = sandbox_sim::localstack::config_as(REGION, "test").await;
    let (ec2, iam) = (aws_sdk_ec2::Client::new(&config), aws_sdk_iam::Client::new(&config));
    let aws = common::localstack(REGION).await;

    let crds = common::e2e::real_crds(version);
    sandbox_sim::world::install_crds(&admin, version, Some(&crds)).await.unwrap();
    let ami = infrastructure(&ec2, &iam, &cluster).await;
    // Something of the cluster's that is not Karpenter's: an instance of a managed node group.
    let decoy = ec2
        .run_instances()
        .image_id(&ami)
        .instance_type(aws_sdk_ec2::types::InstanceType::M5Large)
        .min_count(1)
        .max_count(1)
        .tag_specifications(spec(
            ResourceType::Instance,
            &[(&format!("kubernetes.io/cluster/{cluster}"), "owned"), ("eks:nodegroup-name", "system")],
        ))
        .send()
        .await
        .unwrap();
    let decoy = decoy.instances()[0].instance_id().unwrap().to_string();

    let classes = class_and_pool(&admin, &ami, &cluster).await;

    web_workload(&admin, PODS).await;

    let t = Instant::now();
    let karpenter = RealKarpenter::start_version(
        &s,
        version,
        KarpenterSettings {
            cluster_name: cluster.clone(),
            region: REGION.into(),
            aws_endpoint: sandbox_sim::localstack::endpoint(),
            ..KarpenterSettings::default()
        },
        ec2.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Karpenter launches a node per pod, and each registers
    let claims: Api<DynamicObject> = Api::all_with(admin.clone(), &k8s::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(admin.clone());
    let deadline = Instant::now() + Duration::from_secs(240);
    let instances: Vec<String> = loop {
        // a resource whose CRD was just installed answers 429 "storage is (re)initializing" until
        // its watch cache is filled, and the test bed's clients do not retry 429s by themselves
        let (list, registered) = match (
            claims.list(&ListParams::default()).await,
            nodes.list(&ListParams::default().labels("karpenter.sh/registered=true")).await,
        ) {
            (Ok(l), Ok(r)) => (l, r),
            (Err(kube::Error::Api(e)), _) | (_, Err(kube::Error::Api(e))) if e.code == 429 => {
                assert!(Instant::now() < deadline, "still refused at the deadline: {e:?}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            (Err(e), _) | (_, Err(e)) => panic!("listing NodeClaims and Nodes: {e}"),
        };
        let ids: Vec<String> = list
            .items
            .iter()
            .filter_map(|c| c.data["status"]["providerID"].as_str())
            .filter_map(|p| p.rsplit('/').next())
            .map(str::to_string)
            .collect();
        if ids.len() >= PODS && registered.items.len() >= PODS {
            break ids;
        }
        assert!(
            Instant::now() < deadline,
            "Karpenter did not launch and register {PODS} nodes ({} claims with instances, {} registered); its log:\n{}",
            ids.len(),
            registered.items.len(),
            karpenter.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("real Karpenter launched and registered {} nodes in {:?}", instances.len(), t.elapsed());
    assert!(karpenter.running());
    let log = karpenter.log();
    assert!(log.contains("launched nodeclaim"), "{}", karpenter.log_tail(40));

    // what the real controller made, with its own tags
    let running = states(&aws, &instances).await;
    assert!(running.values().all(|s| *s == InstanceState::Running), "{running:?}");
    let described = ec2.describe_instances().set_instance_ids(Some(instances.clone())).send().await.unwrap();
    for i in described.reservations().iter().flat_map(|r| r.instances()) {
        let t: BTreeMap<&str, &str> = i.tags().iter().filter_map(|t| Some((t.key()?, t.value()?))).collect();
        assert_eq!(t.get("eks:eks-cluster-name"), Some(&cluster.as_str()), "{t:?}");
        assert_eq!(t.get("karpenter.sh/nodepool"), Some(&"default"), "{t:?}");
        assert_eq!(t.get(format!("kubernetes.io/cluster/{cluster}").as_str()), Some(&"owned"), "{t:?}");
    }
    let class = classes.get("default").await.unwrap();
    let profile = class.data["status"]["instanceProfile"].as_str().expect("the class's instance profile").to_string();
    let profiles = aws.iam.cluster_instance_profiles(REGION, &cluster).await.unwrap();
    assert!(profiles.iter().any(|p| p.name == profile), "{profile} not found as Karpenter's: {profiles:?}");
    let got = iam.get_instance_profile().instance_profile_name(&profile).send().await.unwrap();
    assert_profile_shape(version, &cluster, &profile, got.instance_profile().map(|p| p.path()).unwrap_or_default());
    assert!(log.contains("created launch template"), "{}", karpenter.log_tail(40));
    let (other_lt, other_profile) = other_clusters_leftovers(&ec2, &iam, &cluster).await;
    // Karpenter deletes a launch template itself a minute after its last use (its cache's
    // eviction, pkg/providers/launchtemplate): how many are left to the tool depends on timing
    let templates = aws.ec2.launch_templates(&cluster).await.unwrap().len();
    eprintln!("before the teardown: {templates} launch template(s), instance profile {profile}");
    assert_eq!(tagged_launch_templates(&ec2, version, &cluster).await.len(), templates, "tagged as {version:?} tags");

    // the teardown, with the real Karpenter alive
    let run = super::teardown(&s, &cluster).await;
    assert_eq!(run.code, 0, "{}\nKarpenter:\n{}", run.dump(), karpenter.log_tail(40));
    assert_eq!(run.report["outcome"], "clean", "{}", run.dump());

    // the tool scaled the Deployment to zero: the process is gone, and it was never restarted
    assert!(!karpenter.running(), "Karpenter still runs after the teardown");
    assert_eq!(karpenter.starts(), 1);
    let ours = states(&aws, &instances).await;
    assert!(ours.values().all(|s| *s == InstanceState::Terminated), "Karpenter's instances: {ours:?}");
    assert_eq!(states(&aws, std::slice::from_ref(&decoy)).await[&decoy], InstanceState::Running, "the decoy");
    assert!(aws.ec2.launch_templates(&cluster).await.unwrap().is_empty(), "launch templates left");
    assert!(aws.iam.cluster_instance_profiles(REGION, &cluster).await.unwrap().is_empty(), "instance profiles left");
    assert!(tagged_launch_templates(&ec2, version, &cluster).await.is_empty(), "{version:?} launch templates left");
    assert!(iam.get_instance_profile().instance_profile_name(&profile).send().await.is_err(), "{profile} left");
    // the node role is the cluster's, not Karpenter's, and the other cluster's are the other's
    iam.get_role().role_name(format!("{cluster}-node")).send().await.unwrap();
    ec2.describe_launch_templates().launch_template_ids(&other_lt).send().await.unwrap();
    iam.get_instance_profile().instance_profile_name(&other_profile).send().await.unwrap();
    assert_eq!(count(&admin, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
    assert_eq!(count(&admin, &k8s::nodepool_resource()).await, 0, "NodePools left");
    assert_eq!(count(&admin, &k8s::nodeclass_resource()).await, 0, "EC2NodeClasses left");
    let left = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    assert!(left.items.is_empty(), "Karpenter nodes left");
    // the workload is the user's: still there, still pending
    let web: Api<Pod> = Api::namespaced(admin.clone(), "web");
    assert_eq!(web.list(&ListParams::default()).await.unwrap().items.len(), PODS);

    ec2.terminate_instances().instance_ids(&decoy).send().await.unwrap();
    ec2.delete_launch_template().launch_template_id(&other_lt).send().await.unwrap();
    iam.delete_instance_profile().instance_profile_name(&other_profile).send().await.unwrap();
    drop(karpenter);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_tears_down_what_the_real_karpenter_1_14_launched_while_it_runs() {
    the_tool_tears_down_what_the_real_karpenter_launched_while_it_runs(KarpenterVersion::V1_14).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_tears_down_what_the_real_karpenter_1_0_launched_while_it_runs() {
    the_tool_tears_down_what_the_real_karpenter_launched_while_it_runs(KarpenterVersion::V1_0).await;
}

pub(crate) fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

pub(crate) fn node_of(p: &Pod) -> Option<&str> {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// On the full control plane: the real scheduler marks the workload unschedulable and later binds
/// it to the nodes Karpenter launched, kwok makes those nodes Ready and runs the pods, and the
/// ReplicaSet and disruption controllers act; the teardown then evicts running pods with Karpenter
/// alive. `unfenced`: the plan has no fence and removes the controller only after the drain, and
/// the budget lets one pod go at a time, so the drain goes on only once the real Karpenter has
/// launched a machine for the first evicted pod's replacement and it runs there: a machine the run
/// finds late, which it must drain and release as the plan's own tasks.
async fn the_tool_drains_running_pods_off_the_real_karpenters_nodes_on_the_full_control_plane(
    version: KarpenterVersion,
    unfenced: bool,
) {
    let cluster = common::unique_cluster(if unfenced { "rku" } else { "rkf" });
    let s = super::control_plane::full_stack(&cluster).await;
    let admin = s.admin_client().await.unwrap();
    let config = sandbox_sim::localstack::config_as(REGION, "test").await;
    let (ec2, iam) = (aws_sdk_ec2::Client::new(&config), aws_sdk_iam::Client::new(&config));
    let aws = common::localstack(REGION).await;

    let crds = common::e2e::real_crds(version);
    sandbox_sim::world::install_crds(&admin, version, Some(&crds)).await.unwrap();
    let ami = infrastructure(&ec2, &iam, &cluster).await;
    let pp = PostParams::default();
    // A managed node group's node, kept for critical add-ons as EKS's guidance for Karpenter's
    // own pods has it: the controller's pod runs here, the workload cannot
    let decoy = ec2
        .run_instances()
        .image_id(&ami)
        .instance_type(aws_sdk_ec2::types::InstanceType::M5Large)
        .min_count(1)
        .max_count(1)
        .tag_specifications(spec(
            ResourceType::Instance,
            &[(&format!("kubernetes.io/cluster/{cluster}"), "owned"), ("eks:nodegroup-name", "system")],
        ))
        .send()
        .await
        .unwrap();
    let decoy = decoy.instances()[0].instance_id().unwrap().to_string();
    let nodes: Api<Node> = Api::all(admin.clone());
    let resources = json!({"cpu": "2", "memory": "8Gi", "pods": "29"});
    let system: Node = serde_json::from_value(json!({
        "metadata": {"name": "system-0", "labels": {"eks.amazonaws.com/nodegroup": "system",
            "kubernetes.io/hostname": "system-0", "topology.kubernetes.io/zone": "us-west-2a"}},
        "spec": {"providerID": format!("aws:///us-west-2a/{decoy}"),
            "taints": [{"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}]},
        "status": {"allocatable": resources, "capacity": resources},
    }))
    .unwrap();
    nodes.create(&pp, &system).await.unwrap();
    let classes = class_and_pool(&admin, &ami, &cluster).await;

    // The workload: the ReplicaSet controller makes its pods, its budget lets both go
    let ns: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
    ns.create(&pp, &serde_json::from_value(json!({"metadata": {"name": "web"}})).unwrap()).await.unwrap();
    let labels = json!({"app": "web"});
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(admin.clone(), "web");
    deployments
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"replicas": PODS,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": {"terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "web", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"requests": {"cpu": "1"}}}]}}}}))
            .unwrap(),
        )
        .await
        .unwrap();
    // Every node of the cluster that could take the workload is Karpenter's, so an evicted pod's
    // replacement stays Pending and never becomes healthy again: a budget that holds back any of
    // the pods would hold the teardown forever. This one lets all of them go, counted by the
    // disruption controller and enforced by the Eviction API.
    let pdbs: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> = Api::namespaced(admin.clone(), "web");
    let allowed = if unfenced { 1 } else { PODS };
    pdbs.create(
        &pp,
        &serde_json::from_value(json!({"metadata": {"name": "web"},
            "spec": {"maxUnavailable": allowed, "selector": {"matchLabels": labels}}}))
        .unwrap(),
    )
    .await
    .unwrap();

    let t = Instant::now();
    let karpenter = RealKarpenter::start_version(
        &s,
        version,
        KarpenterSettings {
            cluster_name: cluster.clone(),
            region: REGION.into(),
            aws_endpoint: sandbox_sim::localstack::endpoint(),
            ..KarpenterSettings::default()
        },
        ec2.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Karpenter launches for what the scheduler could not place, the nodes register, kwok makes
    // them Ready, the scheduler binds the pods there and kwok runs them
    let claims: Api<DynamicObject> = Api::all_with(admin.clone(), &k8s::nodeclaim_resource());
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "web");
    let deadline = Instant::now() + Duration::from_secs(240);
    let (instances, before) = loop {
        let Some(ids) = claimed_instances(&claims, deadline).await else {
            continue;
        };
        let karpenters: Vec<String> = nodes
            .list(&ListParams::default().labels("karpenter.sh/nodepool"))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect();
        let running: Vec<Pod> = pods
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| phase(p) == "Running" && node_of(p).is_some_and(|n| karpenters.iter().any(|k| k == n)))
            .collect();
        if ids.len() >= PODS && running.len() == PODS {
            break (ids, running);
        }
        assert!(
            Instant::now() < deadline,
            "{} claims with instances, {} pods running on {karpenters:?}; Karpenter's log:\n{}\nkube-scheduler:\n{}\nkwok:\n{}",
            ids.len(),
            running.len(),
            karpenter.log_tail(40),
            s.log_tail("kube-scheduler"),
            s.log_tail("kwok")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("the workload runs on {} nodes of the real Karpenter after {:?}", instances.len(), t.elapsed());
    assert!(karpenter.running());
    // Karpenter provisioned for pods the scheduler marked: no stand-in wrote that condition
    assert!(karpenter.log().contains("found provisionable pod(s)"), "{}", karpenter.log_tail(40));
    for n in karpenter.registered_nodes() {
        let node = nodes.get(&n).await.unwrap();
        let conditions = node.status.and_then(|s| s.conditions).unwrap_or_default();
        assert!(conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"), "{n}: {conditions:?}");
    }
    // the controller's own pod, made by the ReplicaSet controller, runs on the system node
    let system_pods: Api<Pod> = Api::namespaced(admin.clone(), realstack::karpenter::NAMESPACE);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = system_pods.list(&ListParams::default().labels("app.kubernetes.io/name=karpenter")).await.unwrap();
        let placed: Vec<(&str, Option<&str>)> = list.items.iter().map(|p| (phase(p), node_of(p))).collect();
        if placed == [("Running", Some("system-0"))] {
            break;
        }
        assert!(Instant::now() < deadline, "the controller's pod: {placed:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // the disruption controller's count, which the teardown's evictions are held to
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = pdbs.get("web").await.unwrap().status.unwrap_or_default();
        if status.current_healthy == PODS as i32 && status.disruptions_allowed == allowed as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "the budget was not computed: {status:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // the instance profile Karpenter made, where its release line puts it
    let class = classes.get("default").await.unwrap();
    let profile = class.data["status"]["instanceProfile"].as_str().expect("the class's instance profile").to_string();
    let got = iam.get_instance_profile().instance_profile_name(&profile).send().await.unwrap();
    assert_profile_shape(version, &cluster, &profile, got.instance_profile().map(|p| p.path()).unwrap_or_default());
    let (other_lt, other_profile) = other_clusters_leftovers(&ec2, &iam, &cluster).await;

    // the teardown, with the real Karpenter alive
    let run = if unfenced {
        let dir = tempfile::tempdir().unwrap();
        let plan = dir.path().join("no-fence.toml");
        std::fs::write(&plan, common::e2e::default_without_fence()).unwrap();
        let plan = plan.display().to_string();
        let inventoried: Vec<String> = before.iter().filter_map(|p| node_of(p).map(str::to_string)).collect();
        // once a replacement runs on a machine launched during the run, the budget lets every pod
        // go: the late machine's drain is then held by nothing but the plan
        let relax = async {
            let deadline = Instant::now() + Duration::from_secs(240);
            loop {
                let list = pods.list(&ListParams::default()).await.unwrap();
                let late = list.items.iter().find(|p| {
                    phase(p) == "Running"
                        && node_of(p).is_some_and(|n| n != "system-0" && !inventoried.iter().any(|i| i == n))
                });
                if let Some(p) = late {
                    let relaxed = json!({"spec": {"maxUnavailable": PODS}});
                    pdbs.patch("web", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&relaxed))
                        .await
                        .unwrap();
                    return node_of(p).map(str::to_string);
                }
                assert!(
                    Instant::now() < deadline,
                    "no replacement ran on a new machine; Karpenter:\n{}",
                    karpenter.log_tail(40)
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        let args = ["--plan", plan.as_str()];
        let (run, late_node) = tokio::join!(super::teardown_with(&s, &cluster, &args), relax);
        eprintln!("a replacement ran on {late_node:?}, a machine launched during the run");
        run
    } else {
        super::teardown(&s, &cluster).await
    };
    assert_eq!(run.code, 0, "{}\nKarpenter:\n{}", run.dump(), karpenter.log_tail(40));
    assert_eq!(run.report["outcome"], "clean", "{}", run.dump());
    // a machine found late runs the plan's machine steps, as tasks of its own
    let mut late: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for t in run.report["steps"].as_array().into_iter().flatten().filter(|t| t["found_late"].is_string()) {
        late.entry(t["object"].as_str().unwrap_or_default().into())
            .or_default()
            .push(t["step"].as_str().unwrap_or_default().into());
    }
    if unfenced {
        assert!(
            !late.is_empty(),
            "the machine Karpenter launched during the drain is not in the report: {}",
            run.dump()
        );
        for (machine, steps) in &mut late {
            steps.sort();
            assert_eq!(steps, &["discharge-finalizers", "drain"], "{machine}: {}", run.dump());
        }
    } else {
        assert!(late.is_empty(), "the fence let Karpenter launch: {late:?}");
    }

    assert!(!karpenter.running(), "Karpenter still runs after the teardown");
    assert_eq!(karpenter.starts(), 1);
    let ours = states(&aws, &instances).await;
    assert!(ours.values().all(|s| *s == InstanceState::Terminated), "Karpenter's instances: {ours:?}");
    assert_eq!(states(&aws, std::slice::from_ref(&decoy)).await[&decoy], InstanceState::Running, "the decoy");
    assert!(aws.ec2.launch_templates(&cluster).await.unwrap().is_empty(), "launch templates left");
    assert!(aws.iam.cluster_instance_profiles(REGION, &cluster).await.unwrap().is_empty(), "instance profiles left");
    assert!(tagged_launch_templates(&ec2, version, &cluster).await.is_empty(), "{version:?} launch templates left");
    assert!(iam.get_instance_profile().instance_profile_name(&profile).send().await.is_err(), "{profile} left");
    ec2.describe_launch_templates().launch_template_ids(&other_lt).send().await.unwrap();
    iam.get_instance_profile().instance_profile_name(&other_profile).send().await.unwrap();
    assert_eq!(count(&admin, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
    assert_eq!(count(&admin, &k8s::nodepool_resource()).await, 0, "NodePools left");
    assert_eq!(count(&admin, &k8s::nodeclass_resource()).await, 0, "EC2NodeClasses left");
    drop(classes);
    let left = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    assert!(left.items.is_empty(), "Karpenter nodes left");
    // the system node is not Karpenter's: neither cordoned nor removed
    let system = nodes.get("system-0").await.unwrap();
    assert_ne!(system.spec.and_then(|s| s.unschedulable), Some(true), "the system node was cordoned");

    // the running pods are gone, and the ReplicaSet's replacements wait Pending on no node
    let evicted: Vec<String> = before.iter().filter_map(|p| p.metadata.name.clone()).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = pods.list(&ListParams::default()).await.unwrap();
        let states: Vec<(String, String, Option<String>)> = list
            .items
            .iter()
            .map(|p| {
                (p.metadata.name.clone().unwrap_or_default(), phase(p).to_string(), node_of(p).map(str::to_string))
            })
            .collect();
        let waiting = list
            .items
            .iter()
            .filter(|p| {
                phase(p) == "Pending"
                    && node_of(p).is_none()
                    && p.metadata.deletion_timestamp.is_none()
                    && p.metadata.name.as_ref().is_some_and(|n| !evicted.contains(n))
            })
            .count();
        if waiting == PODS && list.items.len() == PODS {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "want {PODS} new pods Pending on no node, evicted {evicted:?}, got {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // the controller's pod went with its Deployment's scale to zero
    let list = system_pods.list(&ListParams::default().labels("app.kubernetes.io/name=karpenter")).await.unwrap();
    assert!(list.items.is_empty(), "the controller's pod is still there");

    ec2.terminate_instances().instance_ids(&decoy).send().await.unwrap();
    ec2.delete_launch_template().launch_template_id(&other_lt).send().await.unwrap();
    iam.delete_instance_profile().instance_profile_name(&other_profile).send().await.unwrap();
    drop(karpenter);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_drains_running_pods_off_the_real_karpenter_1_14s_nodes_on_the_full_control_plane() {
    the_tool_drains_running_pods_off_the_real_karpenters_nodes_on_the_full_control_plane(
        KarpenterVersion::V1_14,
        false,
    )
    .await;
}

/// Without the fence, the real Karpenter 1.14 launches for the pods the drain evicts: the machine
/// it launched is found late, drained and released by the plan's own steps, and the run ends clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_the_real_karpenter_launches_during_the_drain_is_torn_down_by_the_plans_own_steps() {
    the_tool_drains_running_pods_off_the_real_karpenters_nodes_on_the_full_control_plane(KarpenterVersion::V1_14, true)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_drains_running_pods_off_the_real_karpenter_1_0s_nodes_on_the_full_control_plane() {
    the_tool_drains_running_pods_off_the_real_karpenters_nodes_on_the_full_control_plane(KarpenterVersion::V1_0, false)
        .await;
}
