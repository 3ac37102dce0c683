//! The simulated Karpenter against the sandbox API server (over HTTP) and LocalStack: a generated
//! world looks like §3 says, and the controller launches, terminates and finalizes like the real
//! one — and does nothing once its Deployment is scaled to zero.

use crate::common;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use karpenter_teardown::aws::{AwsClients, InstanceState};
use karpenter_teardown::karpenter;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::naming;
use sandbox_sim::objects;
use sandbox_sim::world::expected_instance_tags;
use sandbox_sim::{KarpenterVersion, SimController, SimSettings, World, WorldSpec, generate};
use serde_json::json;

const REGION: &str = "us-west-2";

struct Bed {
    server: ApiServer,
    client: Client,
    aws: AwsClients,
    cloud: sandbox_sim::cloud::Cloud,
}

async fn bed() -> Bed {
    let aws = common::localstack(REGION).await;
    let server = ApiServer::start(ServerOptions { time_scale: 0.01, ..ServerOptions::default() }).await.unwrap();
    let client = Client::try_from(server.kube_config()).unwrap();
    let cloud = common::cloud(REGION).await;
    Bed { server, client, aws, cloud }
}

/// A few nodes, one pod each, so every drain can proceed (single-replica workloads).
fn small_spec(prefix: &str) -> WorldSpec {
    WorldSpec {
        cluster: common::unique_cluster(prefix),
        nodes: 3,
        node_pools: 2,
        node_classes: 2,
        pods_per_node: 1,
        replicas_per_workload: 1,
        managed_nodes: 1,
        decoys: 1,
        concurrency: 8,
        settle_timeout: Duration::from_secs(20),
        karpenter_crds: Some(common::e2e::real_crds(KarpenterVersion::V1_14)),
        ..WorldSpec::default()
    }
}

fn settings(world: &World) -> SimSettings {
    SimSettings {
        version: world.version,
        time_scale: 0.02,
        pods_per_node: 2,
        // 1 s at this time scale: a LocalStack DescribeInstances with tag filters is slow, and
        // back-to-back garbage collections of parallel tests would starve their other calls.
        gc_interval: Duration::from_secs(50),
        ..SimSettings::new(&world.cluster, REGION)
    }
}

async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn states(aws: &AwsClients, ids: &[String]) -> BTreeMap<String, InstanceState> {
    aws.ec2.instances_by_id(ids).await.unwrap().into_iter().map(|i| (i.id, i.state)).collect()
}

async fn all_running(aws: &AwsClients, ids: &[String]) -> bool {
    let s = states(aws, ids).await;
    ids.iter().all(|id| s.get(id) == Some(&InstanceState::Running))
}

fn claims(c: &Client) -> Api<DynamicObject> {
    Api::all_with(c.clone(), &objects::nodeclaim_resource())
}

fn pools(c: &Client) -> Api<DynamicObject> {
    Api::all_with(c.clone(), &objects::nodepool_resource())
}

fn classes(c: &Client) -> Api<DynamicObject> {
    Api::all_with(c.clone(), &objects::ec2nodeclass_resource())
}

/// Leaves LocalStack as the test found it: LocalStack keeps every instance it ever launched, and
/// its tag filters slow down with each one, so tests terminate what they made.
async fn cleanup(b: Bed, world: &World, extra: &[String]) {
    let mut ids = world.karpenter_instance_ids();
    ids.extend(world.managed_instance_ids());
    ids.extend(world.decoy_instances.iter().cloned());
    ids.extend(extra.iter().cloned());
    // and whatever the simulated controller launched
    for c in claims(&b.client).list(&ListParams::default()).await.unwrap() {
        if let Some(pid) = objects::claim_provider_id(&c).and_then(|p| karpenter::ProviderId::parse(p).ok()) {
            ids.push(pid.instance_id);
        }
    }
    b.aws.ec2.terminate(&ids).await.unwrap();
    for lt in b.aws.ec2.launch_templates(&world.cluster).await.unwrap() {
        b.aws.ec2.delete_launch_template(&lt.id).await.unwrap();
    }
    for p in b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap() {
        b.aws.iam.delete_instance_profile(&p).await.unwrap();
    }
    b.server.shutdown().await;
}

async fn scale_controller(c: &Client, replicas: i32) {
    let api: Api<Deployment> = Api::namespaced(c.clone(), naming::KARPENTER_NAMESPACE);
    api.patch(naming::KARPENTER_NAME, &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": replicas}})))
        .await
        .unwrap();
}

#[tokio::test]
async fn generated_world_carries_exactly_the_karpenter_tags() {
    let b = bed().await;
    let spec = small_spec("sim-tags");
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    assert_eq!(world.nodes.len(), 3);

    // every Karpenter instance: exactly the §3 tags, nothing more, nothing less
    let infos = b.aws.ec2.instances_by_id(&world.karpenter_instance_ids()).await.unwrap();
    assert_eq!(infos.len(), 3);
    for n in &world.nodes {
        let info = infos.iter().find(|i| i.id == n.instance_id).unwrap();
        assert_eq!(info.tags, expected_instance_tags(&world, n), "tags of {}", n.instance_id);
        assert_eq!(info.tags.len(), 6);
        assert_eq!(info.zone, n.zone);
    }
    // the managed node group: the cluster's tags, no Karpenter tag
    for i in b.aws.ec2.instances_by_id(&world.managed_instance_ids()).await.unwrap() {
        assert_eq!(i.tag(karpenter::TAG_EKS_CLUSTER), Some(world.cluster.as_str()));
        assert!(i.tag(karpenter::TAG_NODEPOOL).is_none() && i.tag(karpenter::TAG_NODECLASS).is_none());
    }
    // decoys: Karpenter's tags, another cluster
    for i in b.aws.ec2.instances_by_id(&world.decoy_instances).await.unwrap() {
        assert_eq!(i.tag(karpenter::TAG_EKS_CLUSTER), Some(world.decoy_cluster.as_str()));
        assert!(i.tag(karpenter::TAG_NODEPOOL).is_some());
    }

    // Kubernetes side: NodeClaim → NodePool and Node → NodeClaim ownership, finalizers, ids
    let nodes: Api<Node> = Api::all(b.client.clone());
    for n in &world.nodes {
        let claim = claims(&b.client).get(&n.nodeclaim).await.unwrap();
        assert_eq!(claim.finalizers(), &[karpenter::FINALIZER_TERMINATION.to_string()]);
        let owner = &claim.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.block_owner_deletion),
            ("NodePool", n.pool.as_str(), Some(true))
        );
        assert_eq!(objects::claim_provider_id(&claim), Some(n.provider_id.as_str()));
        assert_eq!(objects::claim_node_name(&claim), Some(n.node.as_str()));
        let node = nodes.get(&n.node).await.unwrap();
        assert_eq!(node.spec.as_ref().unwrap().provider_id.as_deref(), Some(n.provider_id.as_str()));
        assert_eq!(node.labels().get(karpenter::LABEL_NODEPOOL), Some(&n.pool));
        assert_eq!(node.labels().get(karpenter::LABEL_NODECLASS), Some(&n.class));
        assert_eq!(node.finalizers(), &[karpenter::FINALIZER_TERMINATION.to_string()]);
        let owner = &node.owner_references()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("NodeClaim", claim.uid().unwrap().as_str()));
    }
    // managed and control-plane nodes are not Karpenter's
    for m in &world.managed_nodes {
        let node = nodes.get(&m.node).await.unwrap();
        assert!(!node.labels().contains_key(karpenter::LABEL_NODEPOOL));
        assert!(node.labels().contains_key(naming::LABEL_NODEGROUP));
    }
    let cp = nodes.get(world.control_plane_node.as_ref().unwrap()).await.unwrap();
    assert_eq!(cp.spec.unwrap().taints.unwrap()[0].key, naming::CONTROL_PLANE_KEY);

    // launch templates per class, tagged the 1.14 way; an instance profile only for the role class
    let lts = b.aws.ec2.launch_templates(&world.cluster).await.unwrap();
    for c in &world.node_classes {
        let lt = lts.iter().find(|l| l.name == c.launch_template).unwrap();
        assert_eq!(lt.nodeclass.as_deref(), Some(c.name.as_str()));
    }
    let profiles = b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap();
    assert_eq!(profiles.len(), 1);
    let role_class = world.node_classes.iter().find(|c| c.role.is_some()).unwrap();
    assert_eq!(profiles[0].name, role_class.instance_profile);
    assert_eq!(profiles[0].path, format!("/karpenter/{REGION}/{}/{}/", world.cluster, role_class.uid));

    // the workloads run on Karpenter nodes, one pod per node, and the controller is ready
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), &spec.workload_namespace);
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for p in pods.list(&ListParams::default()).await.unwrap() {
        *per_node.entry(p.spec.unwrap().node_name.unwrap()).or_default() += 1;
    }
    let karpenter_nodes: Vec<&String> = world.nodes.iter().map(|n| &n.node).collect();
    assert!(per_node.keys().all(|n| karpenter_nodes.contains(&n)), "{per_node:?}");
    assert_eq!(per_node.values().sum::<usize>(), 3);

    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn karpenter_1_0_worlds_use_the_old_tags_paths_and_crds() {
    let b = bed().await;
    let spec = WorldSpec {
        version: KarpenterVersion::V1_0,
        karpenter_crds: Some(common::e2e::real_crds(KarpenterVersion::V1_0)),
        nodes: 1,
        node_pools: 1,
        node_classes: 1,
        ..small_spec("sim-v10")
    };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(b.client.clone());
    let crd = crds.get("nodeclaims.karpenter.sh").await.unwrap();
    let conversion = crd.spec.conversion.unwrap();
    assert_eq!(conversion.strategy, "Webhook");
    let svc = conversion.webhook.unwrap().client_config.unwrap().service.unwrap();
    assert_eq!((svc.name.as_str(), svc.namespace.as_str(), svc.port), ("karpenter", "kube-system", Some(8443)));

    let lts = b.aws.ec2.launch_templates(&world.cluster).await.unwrap();
    assert_eq!(lts.len(), 1, "found through the legacy karpenter.k8s.aws/cluster tag");
    let profiles = b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap();
    assert_eq!(profiles.len(), 1);
    assert_eq!(profiles[0].path, "/");
    assert!(profiles[0].name.starts_with(&format!("{}_", world.cluster)));
    let node = Api::<Node>::all(b.client.clone()).get(&world.nodes[0].node).await.unwrap();
    assert!(!node.labels().contains_key(karpenter::LABEL_NODECLASS), "1.0 nodes lack the class label");
    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn deleted_nodepools_cascade_and_deleted_classes_release_their_aws_resources() {
    let b = bed().await;
    let spec = small_spec("sim-cascade");
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let mut ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await, "controller never saw its ready Deployment");

    for p in &world.node_pools {
        pools(&b.client).delete(p, &DeleteParams::default()).await.unwrap();
    }
    let ids = world.karpenter_instance_ids();
    eventually("NodeClaims and Karpenter nodes gone, instances terminated", Duration::from_secs(90), || async {
        let c = claims(&b.client).list(&ListParams::default()).await.unwrap().items.len();
        let n = Api::<Node>::all(b.client.clone())
            .list(&ListParams::default().labels(karpenter::LABEL_NODEPOOL))
            .await
            .unwrap()
            .items
            .len();
        if c != 0 || n != 0 {
            return false;
        }
        let s = states(&b.aws, &ids).await;
        ids.iter().all(|id| s.get(id).is_none_or(|st| !st.is_live()))
    })
    .await;
    let stats = ctl.stats();
    assert_eq!(stats.instances_terminated, 3, "{stats:?}");
    assert!(stats.pods_evicted >= 3, "{stats:?}");
    assert_eq!(stats.nodeclaims_launched, 0, "no pool left to launch from: {stats:?}");

    for c in &world.node_classes {
        classes(&b.client).delete(&c.name, &DeleteParams::default()).await.unwrap();
    }
    eventually("EC2NodeClasses finalized", Duration::from_secs(90), || async {
        classes(&b.client).list(&ListParams::default()).await.unwrap().items.is_empty()
    })
    .await;
    assert!(b.aws.ec2.launch_templates(&world.cluster).await.unwrap().is_empty());
    assert!(b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap().is_empty());

    // what is not Karpenter's survives
    assert!(all_running(&b.aws, &world.decoy_instances).await, "decoys must survive");
    assert!(all_running(&b.aws, &world.managed_instance_ids()).await, "managed node group must survive");
    let nodes: Api<Node> = Api::all(b.client.clone());
    for m in &world.managed_nodes {
        assert!(nodes.get_opt(&m.node).await.unwrap().is_some());
    }
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn a_controller_scaled_to_zero_leaves_finalizers_and_instances_until_it_returns() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 2, node_pools: 1, node_classes: 1, ..small_spec("sim-stuck") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let mut ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await);

    scale_controller(&b.client, 0).await;
    assert!(ctl.wait_active(false, Duration::from_secs(60)).await, "controller kept acting at zero replicas");
    let victim = &world.nodes[0];
    claims(&b.client).delete(&victim.nodeclaim, &DeleteParams::default()).await.unwrap();
    // many passes' worth of time at this time scale
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stuck = claims(&b.client).get(&victim.nodeclaim).await.unwrap();
    assert!(stuck.metadata.deletion_timestamp.is_some());
    assert_eq!(stuck.finalizers(), &[karpenter::FINALIZER_TERMINATION.to_string()]);
    assert!(all_running(&b.aws, std::slice::from_ref(&victim.instance_id)).await, "instance must keep running");
    assert_eq!(ctl.stats().instances_terminated, 0);

    scale_controller(&b.client, 1).await;
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await, "controller did not come back");
    eventually("the stuck NodeClaim processed once the controller is back", Duration::from_secs(90), || async {
        claims(&b.client).get_opt(&victim.nodeclaim).await.unwrap().is_none()
            && !all_running(&b.aws, std::slice::from_ref(&victim.instance_id)).await
    })
    .await;
    assert!(Api::<Node>::all(b.client.clone()).get_opt(&victim.node).await.unwrap().is_none());
    assert!(
        all_running(&b.aws, std::slice::from_ref(&world.nodes[1].instance_id)).await,
        "the other node is untouched"
    );
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn pending_pods_get_capacity_up_to_the_nodepool_limit_and_no_further() {
    let b = bed().await;
    // no Karpenter nodes yet; one pool limited to 8 cpu = 2 nodes of 4
    let spec = WorldSpec {
        nodes: 0,
        pods_per_node: 0,
        node_pools: 1,
        node_classes: 1,
        pool_cpu_limit: Some(8),
        ..small_spec("sim-limit")
    };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let mut ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await);

    let labels = json!({"app": "inflate"});
    let deploy: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "inflate", "namespace": "default"},
        "spec": {"replicas": 6, "selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
            "spec": {"nodeSelector": {naming::LABEL_CAPACITY_TYPE: "on-demand"},
                "containers": [{"name": "pause", "image": "pause:3.2"}]}}}}))
    .unwrap();
    Api::<Deployment>::namespaced(b.client.clone(), "default").create(&PostParams::default(), &deploy).await.unwrap();

    let pods: Api<Pod> = Api::namespaced(b.client.clone(), "default");
    eventually("4 inflate pods running on 2 launched nodes", Duration::from_secs(90), || async {
        let list = pods.list(&ListParams::default().labels("app=inflate")).await.unwrap();
        list.items.iter().filter(|p| p.spec.as_ref().unwrap().node_name.is_some()).count() == 4
    })
    .await;
    // give it many more passes: the limit must hold
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all = claims(&b.client).list(&ListParams::default()).await.unwrap().items;
    assert_eq!(all.len(), 2, "the 8-cpu limit allows exactly 2 nodes");
    assert_eq!(ctl.stats().nodeclaims_launched, 2);
    let unbound = pods
        .list(&ListParams::default().labels("app=inflate"))
        .await
        .unwrap()
        .items
        .iter()
        .filter(|p| p.spec.as_ref().unwrap().node_name.is_none())
        .count();
    assert_eq!(unbound, 2, "the rest stays pending");

    // what it launched looks like what the generator makes
    for claim in &all {
        assert_eq!(claim.finalizers(), &[karpenter::FINALIZER_TERMINATION.to_string()]);
        let pid = karpenter::ProviderId::parse(objects::claim_provider_id(claim).unwrap()).unwrap();
        let info = b.aws.ec2.instances_by_id(std::slice::from_ref(&pid.instance_id)).await.unwrap().remove(0);
        let node = objects::claim_node_name(claim).unwrap();
        let pool = &world.node_pools[0];
        let expected =
            naming::instance_tags(&world.cluster, pool, &world.node_classes[0].name, &claim.name_any(), node);
        assert_eq!(info.tags, expected);
        assert_eq!(info.state, InstanceState::Running);
    }

    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn garbage_collection_terminates_orphans_of_this_cluster_only() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 1, node_pools: 1, node_classes: 1, ..small_spec("sim-gc") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    // an instance with this cluster's Karpenter tags and no NodeClaim: a leaked launch
    let tags =
        naming::instance_tags(&world.cluster, &world.node_pools[0], &world.node_classes[0].name, "gone-x", "ip-x");
    let orphan =
        b.cloud.launch_tagged(naming::IMAGE_ID, naming::INSTANCE_TYPE, Some("us-west-2a"), 1, &tags).await.unwrap();
    let orphan = vec![orphan[0].id.clone()];

    let gc = SimSettings { gc_interval: Duration::from_secs(5), ..settings(&world) };
    let mut ctl = SimController::start(b.client.clone(), b.cloud.clone(), gc);
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await);
    eventually("the orphan terminated", Duration::from_secs(90), || async { ctl.stats().orphans_terminated >= 1 })
        .await;
    assert_eq!(ctl.stats().orphans_terminated, 1);
    assert!(!all_running(&b.aws, &orphan).await);
    assert!(all_running(&b.aws, &world.decoy_instances).await, "decoys of another cluster are never collected");
    assert!(all_running(&b.aws, &world.karpenter_instance_ids()).await, "claimed instances are never collected");
    assert!(all_running(&b.aws, &world.managed_instance_ids()).await);
    ctl.shutdown().await;
    cleanup(b, &world, &orphan).await;
}

#[tokio::test]
async fn a_strict_pdb_blocks_the_drain_until_it_is_relaxed() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 2, node_pools: 1, node_classes: 1, strict_pdb: true, ..small_spec("sim-pdb") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let strict = world.workloads.iter().find(|w| w.strict_pdb).unwrap();
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), &strict.namespace);
    let pod = pods.list(&ListParams::default().labels(&format!("app={}", strict.name))).await.unwrap().items.remove(0);
    let node_name = pod.spec.unwrap().node_name.unwrap();
    let victim = world.nodes.iter().find(|n| n.node == node_name).unwrap();

    let ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    claims(&b.client).delete(&victim.nodeclaim, &DeleteParams::default()).await.unwrap();
    eventually("evictions refused by the strict PDB", Duration::from_secs(90), || async {
        ctl.stats().evictions_blocked >= 2
    })
    .await;
    let node = Api::<Node>::all(b.client.clone()).get(&victim.node).await.unwrap();
    assert!(node.metadata.deletion_timestamp.is_some(), "the claim's deletion deletes its node");
    let taints = node.spec.unwrap().taints.unwrap();
    assert!(taints.iter().any(|t| t.key == karpenter::TAINT_DISRUPTED && t.effect == "NoSchedule"));
    assert!(claims(&b.client).get_opt(&victim.nodeclaim).await.unwrap().is_some(), "blocked: the claim stays");
    assert!(all_running(&b.aws, std::slice::from_ref(&victim.instance_id)).await, "blocked: the instance runs");
    assert_eq!(ctl.stats().instances_terminated, 0);

    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(b.client.clone(), &strict.namespace);
    pdbs.patch(&strict.name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"minAvailable": 0}})))
        .await
        .unwrap();
    eventually("the drain finishes once the PDB allows it", Duration::from_secs(90), || async {
        claims(&b.client).get_opt(&victim.nodeclaim).await.unwrap().is_none()
            && !all_running(&b.aws, std::slice::from_ref(&victim.instance_id)).await
    })
    .await;
    assert!(ctl.stats().pods_evicted >= 1);
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

/// Like the static provisioning controller (Karpenter ≥ 1.8), the simulator keeps a static
/// NodePool at `spec.replicas`: a NodeClaim deleted under it is replaced, unless `limits.nodes`
/// forbids it.
#[tokio::test]
async fn a_static_pool_is_kept_at_its_replicas_within_limits_nodes() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 2, node_pools: 1, node_classes: 1, static_pool: true, ..small_spec("sim-static") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    claims(&b.client).delete(&world.nodes[0].nodeclaim, &DeleteParams::default()).await.unwrap();
    eventually("a replacement NodeClaim", Duration::from_secs(60), || async { ctl.stats().nodeclaims_launched >= 1 })
        .await;
    let pools = Api::<DynamicObject>::all_with(b.client.clone(), &objects::nodepool_resource());
    let pool = &world.node_pools[0];
    pools
        .patch(pool, &PatchParams::default(), &Patch::Merge(json!({"spec": {"limits": {"nodes": "0"}}})))
        .await
        .unwrap();
    let launched = ctl.stats().nodeclaims_launched;
    claims(&b.client).delete(&world.nodes[1].nodeclaim, &DeleteParams::default()).await.unwrap();
    eventually("the deleted claim is gone", Duration::from_secs(60), || async {
        claims(&b.client).get_opt(&world.nodes[1].nodeclaim).await.unwrap().is_none()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ctl.stats().nodeclaims_launched, launched, "limits.nodes 0 stops the static provisioner");
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

/// Like Karpenter's disruption controller, the live simulator removes `karpenter.sh/disrupted`
/// from a node it is not disrupting itself, and leaves a cordon alone.
#[tokio::test]
async fn a_live_controller_strips_a_disrupted_taint_it_did_not_put_there_and_keeps_cordons() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 2, node_pools: 1, node_classes: 1, ..small_spec("sim-untaint") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let nodes: Api<Node> = Api::all(b.client.clone());
    let target = &world.nodes[0].node;
    let patch = json!({"spec": {"unschedulable": true, "taints": [{"key": karpenter::TAINT_DISRUPTED, "effect": "NoSchedule"}]}});
    nodes.patch(target, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    eventually("the disrupted taint is removed", Duration::from_secs(30), || async {
        let n = nodes.get(target).await.unwrap();
        !n.spec.and_then(|s| s.taints).unwrap_or_default().iter().any(|t| t.key == karpenter::TAINT_DISRUPTED)
    })
    .await;
    assert!(ctl.stats().disrupted_taints_removed >= 1);
    let n = nodes.get(target).await.unwrap();
    assert_eq!(n.spec.and_then(|s| s.unschedulable), Some(true), "Karpenter never undoes a cordon");
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn deleting_a_node_takes_its_nodeclaim_and_instance_with_it() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 2, node_pools: 1, node_classes: 1, ..small_spec("sim-node") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    let victim = &world.nodes[1];
    Api::<Node>::all(b.client.clone()).delete(&victim.node, &DeleteParams::default()).await.unwrap();
    eventually("node, claim and instance gone", Duration::from_secs(90), || async {
        Api::<Node>::all(b.client.clone()).get_opt(&victim.node).await.unwrap().is_none()
            && claims(&b.client).get_opt(&victim.nodeclaim).await.unwrap().is_none()
            && !all_running(&b.aws, std::slice::from_ref(&victim.instance_id)).await
    })
    .await;
    assert!(all_running(&b.aws, std::slice::from_ref(&world.nodes[0].instance_id)).await);
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

#[tokio::test]
async fn an_applied_nodeclass_gets_its_finalizer_launch_template_and_instance_profile() {
    let b = bed().await;
    let spec = WorldSpec { nodes: 0, pods_per_node: 0, node_pools: 1, node_classes: 1, ..small_spec("sim-apply") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let mut ctl = SimController::start(b.client.clone(), b.cloud.clone(), settings(&world));
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await);
    // as `kubectl apply` would create it: no finalizer, no status
    let class: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": "applied"},
        "spec": {"role": "KarpenterNodeRole-applied", "amiSelectorTerms": [{"alias": "al2023@latest"}],
                 "subnetSelectorTerms": [{"tags": {"karpenter.sh/discovery": world.cluster}}],
                 "securityGroupSelectorTerms": [{"tags": {"karpenter.sh/discovery": world.cluster}}]}}))
    .unwrap();
    let created = classes(&b.client).create(&PostParams::default(), &class).await.unwrap();
    let uid = created.uid().unwrap();
    eventually("the class reconciled", Duration::from_secs(90), || async {
        let c = classes(&b.client).get("applied").await.unwrap();
        c.finalizers().iter().any(|f| f == karpenter::FINALIZER_NODECLASS)
            && c.data["status"]["instanceProfile"].as_str().is_some_and(|p| !p.is_empty())
    })
    .await;
    let c = classes(&b.client).get("applied").await.unwrap();
    let profile = c.data["status"]["instanceProfile"].as_str().unwrap().to_string();
    let profiles = b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap();
    let p = profiles.iter().find(|p| p.name == profile).unwrap();
    assert_eq!(p.path, format!("/karpenter/{REGION}/{}/{uid}/", world.cluster));
    let lts = b.aws.ec2.launch_templates(&world.cluster).await.unwrap();
    assert!(lts.iter().any(|l| l.nodeclass.as_deref() == Some("applied")));
    ctl.shutdown().await;
    cleanup(b, &world, &[]).await;
}

/// The simulated Argo CD and Flux put back what is deleted or changed while they are
/// not paused (a NodePool, an EC2NodeClass, the controller's replicas, a child Application's
/// automated sync), and nothing once paused: the refusal and `--pause-gitops` are tested
/// against reconcilers with teeth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_argo_cd_and_flux_put_back_what_is_removed_until_paused() {
    use sandbox_sim::gitops::{self, GitopsSettings, GitopsSim};
    let b = bed().await;
    // Git holds the pools' cpu limit: that is the field a fence changes and self-heal sets back
    let spec = WorldSpec { pool_cpu_limit: Some(1000), ..small_spec("sim-gitops") };
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let g = gitops::adopt(&b.client, &world, &crate::common::e2e::gitops_crds()).await.unwrap();
    let sim = GitopsSim::start(b.client.clone(), &g, GitopsSettings::default());
    let pool = world.node_pools[0].clone();
    let class = world.node_classes[0].name.clone();

    // Argo CD (self-heal) re-creates a deleted NodePool with its tracking id, and sets a fenced
    // limit back
    pools(&b.client).delete(&pool, &DeleteParams::default()).await.unwrap();
    eventually("the NodePool re-created", Duration::from_secs(10), || async {
        pools(&b.client)
            .get_opt(&pool)
            .await
            .unwrap()
            .is_some_and(|p| p.annotations().get(sandbox_sim::gitops::ARGO_TRACKING_ANNOTATION).is_some())
    })
    .await;
    pools(&b.client)
        .patch(&pool, &PatchParams::default(), &Patch::Merge(json!({"spec": {"limits": {"cpu": "0"}}})))
        .await
        .unwrap();
    eventually("the NodePool's limits set back", Duration::from_secs(10), || async {
        pools(&b.client).get(&pool).await.unwrap().data["spec"]["limits"]["cpu"] != "0"
    })
    .await;
    // Flux re-creates a deleted EC2NodeClass; the HelmRelease scales the controller back up
    classes(&b.client).delete(&class, &DeleteParams::default()).await.unwrap();
    // no simulated Karpenter runs here to discharge the class's termination finalizer
    let no_finalizers = json!({"metadata": {"finalizers": null}});
    classes(&b.client).patch(&class, &PatchParams::default(), &Patch::Merge(no_finalizers)).await.unwrap();
    scale_controller(&b.client, 0).await;
    let deployments: Api<Deployment> = Api::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE);
    eventually("the class re-created and the controller scaled back up", Duration::from_secs(10), || async {
        let class_back =
            classes(&b.client).get_opt(&class).await.unwrap().is_some_and(|c| c.metadata.deletion_timestamp.is_none());
        let replicas = deployments.get(naming::KARPENTER_NAME).await.unwrap().spec.unwrap().replicas;
        class_back && replicas == Some(1)
    })
    .await;
    assert!(sim.stats().recreated >= 2 && sim.stats().reverted >= 2, "{:?}", sim.stats());

    // the app-of-apps parent turns a child's automated sync back on
    let apps_ar = kube::core::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("argoproj.io", "v1alpha1", "Application"),
        "applications",
    );
    let apps: Api<DynamicObject> = Api::namespaced_with(b.client.clone(), gitops::ARGOCD_NAMESPACE, &apps_ar);
    let off = json!({"spec": {"syncPolicy": {"automated": null}}});
    apps.patch("karpenter-nodepools", &PatchParams::default(), &Patch::Merge(off.clone())).await.unwrap();
    eventually("the parent turned the child's automated sync back on", Duration::from_secs(10), || async {
        apps.get("karpenter-nodepools").await.unwrap().data["spec"]["syncPolicy"]["automated"].is_object()
    })
    .await;

    // paused (parent first), a deleted NodePool stays deleted
    apps.patch("platform", &PatchParams::default(), &Patch::Merge(off.clone())).await.unwrap();
    apps.patch("karpenter-nodepools", &PatchParams::default(), &Patch::Merge(off)).await.unwrap();
    let before = sim.stats();
    pools(&b.client).delete(&pool, &DeleteParams::default()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(pools(&b.client).get_opt(&pool).await.unwrap().is_none(), "a paused Application re-created the pool");
    assert_eq!(sim.stats(), before);
    sim.shutdown().await;
    cleanup(b, &world, &[]).await;
}
