//! The controllers the rest of a destroy depends on, on the real control plane (design §2.1):
//! stand-ins of the AWS Load Balancer Controller and the EBS CSI controller (pods with the
//! charts' `app.kubernetes.io/name` labels, placed by the real scheduler), and objects held by
//! their real finalizers (`service.k8s.aws/resources`, `ingress.k8s.aws/resources` and
//! `gateway.k8s.aws/nlb` of the Load Balancer Controller's `pkg/shared_constants/finalizers.go`,
//! the Gateway under the Gateway API's own CRD; csi-provisioner's
//! `external-provisioner.volume.kubernetes.io/finalizer` on a volume it deletes). In the first
//! test the stand-ins clean up nothing in AWS: what is tested is where they run and what they
//! hold; the release tests run `sandbox_sim::lbc` and `sandbox_sim::ebscsi`.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, Pod, Service};
use k8s_openapi::api::networking::v1::Ingress;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::admission::teardown;
use super::karpenter::{node_of, phase};
use super::resume::provisioned;

fn stand_in(name: &str, chart: &str, placement: Value) -> Deployment {
    let labels = json!({"app.kubernetes.io/name": chart, "app.kubernetes.io/instance": name});
    let mut pod_spec = json!({"containers": [{"name": "controller", "image": "registry.k8s.io/pause:3.10"}]});
    for (k, v) in placement.as_object().unwrap() {
        pod_spec[k] = v.clone();
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "kube-system", "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
    }))
    .unwrap()
}

/// Waits until the Deployment's one pod runs, and returns its node.
async fn running_on(admin: &kube::Client, chart: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "kube-system");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = pods.list(&ListParams::default().labels(&format!("app.kubernetes.io/name={chart}"))).await.unwrap();
        if let [p] = list.items.as_slice()
            && phase(p) == "Running"
            && let Some(n) = node_of(p)
        {
            return n.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "{chart}'s pod is not running: {:?}",
            list.items.iter().map(phase).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_controller_the_drain_would_strand_refuses_the_run_on_the_real_server() {
    let t = Instant::now();
    let p = provisioned("rcln", &super::shipped_rbac_yaml(), 2).await;
    let pp = PostParams::default();
    let deployments: Api<Deployment> = Api::namespaced(p.admin.clone(), "kube-system");
    let on_karpenter = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}}}});
    deployments
        .create(&pp, &stand_in("aws-load-balancer-controller", "aws-load-balancer-controller", on_karpenter))
        .await
        .unwrap();
    let on_system =
        json!({"nodeSelector": {"kubernetes.io/hostname": "system-0"}, "tolerations": [{"operator": "Exists"}]});
    deployments.create(&pp, &stand_in("ebs-csi-controller", "aws-ebs-csi-driver", on_system)).await.unwrap();
    let lbc_node = running_on(&p.admin, "aws-load-balancer-controller").await;
    assert_ne!(lbc_node, "system-0");
    assert_eq!(running_on(&p.admin, "aws-ebs-csi-driver").await, "system-0");

    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
    Api::<Namespace>::all(p.admin.clone()).create(&pp, &ns).await.unwrap();
    let services: Api<Service> = Api::namespaced(p.admin.clone(), "shop");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "front", "finalizers": ["service.k8s.aws/resources"]},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
    }))
    .unwrap();
    services.create(&pp, &svc).await.unwrap();
    let ingresses: Api<Ingress> = Api::namespaced(p.admin.clone(), "shop");
    let ing: Ingress = serde_json::from_value(json!({
        "metadata": {"name": "front", "finalizers": ["ingress.k8s.aws/resources"]},
        "spec": {"defaultBackend": {"service": {"name": "front", "port": {"number": 80}}}},
    }))
    .unwrap();
    ingresses.create(&pp, &ing).await.unwrap();
    // a Gateway of its network load balancer class, under the Gateway API's own CRD
    let crds = sandbox_sim::lbc::gateway_crds().unwrap_or_else(|e| panic!("{e}"));
    sandbox_sim::world::create_crds(&p.admin, crds).await.unwrap();
    let gateway = kube::core::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "Gateway"),
        "gateways",
    );
    let gateways: Api<kube::api::DynamicObject> = Api::namespaced_with(p.admin.clone(), "shop", &gateway);
    let gw: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "front", "finalizers": ["gateway.k8s.aws/nlb"]},
        "spec": {"gatewayClassName": "aws-nlb", "listeners": [{"name": "web", "port": 80, "protocol": "HTTP"}]},
    }))
    .unwrap();
    gateways.create(&pp, &gw).await.unwrap();
    // the PV's volume in EC2, tagged as the EBS CSI driver tags it by default, and another one
    // so tagged
    let ours = ebs_volume(&p.ec2, "data-0").await;
    let theirs = ebs_volume(&p.ec2, "data-0").await;
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": "data-0", "finalizers": ["external-provisioner.volume.kubernetes.io/finalizer"]},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "persistentVolumeReclaimPolicy": "Delete",
                 "csi": {"driver": "ebs.csi.aws.com", "volumeHandle": ours}},
    }))
    .unwrap();
    Api::<PersistentVolume>::all(p.admin.clone()).create(&pp, &pv).await.unwrap();
    // the same driver's volumes with no finalizer to say so: one from a csi-provisioner before
    // v5, and one made through the in-tree name (EKS's default gp2 StorageClass) that CSI
    // migration hands to the driver, its id in the in-tree form
    let bare = ebs_volume(&p.ec2, "data-1").await;
    let in_tree = ebs_volume(&p.ec2, "data-2").await;
    for (name, source) in [
        ("data-1", json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": bare}})),
        ("data-2", json!({"awsElasticBlockStore": {"volumeID": format!("aws://us-west-2a/{in_tree}")}})),
    ] {
        let mut spec = json!({"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                              "persistentVolumeReclaimPolicy": "Delete"});
        spec.as_object_mut().unwrap().extend(source.as_object().unwrap().clone());
        let pv: PersistentVolume = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
        Api::<PersistentVolume>::all(p.admin.clone()).create(&pp, &pv).await.unwrap();
    }

    // refused before any write, dry or not, one blocker per object the stranded controller holds
    for yes in [false, true] {
        let r = teardown(&p, yes).await;
        assert_eq!(r.code, 3, "--yes {yes}: {}", r.dump());
        let error = r.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("the AWS Load Balancer Controller (kube-system/aws-load-balancer-controller-")
                && error.contains(&format!(" on {lbc_node})"))
                && error.contains("Service shop/front (finalizer service.k8s.aws/resources)")
                && error.contains("Ingress shop/front (finalizer ingress.k8s.aws/resources)")
                && error.contains("Gateway shop/front (finalizer gateway.k8s.aws/nlb)")
                && !error.contains("EBS"),
            "{error}"
        );
        let mut names: Vec<String> = r.report["blockers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["kind"] == "stranded")
            .map(|b| b["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        assert_eq!(names, ["Gateway/shop/front", "Ingress/shop/front", "Service/shop/front"], "{}", r.dump());
        assert!(p.karpenter.running(), "the controller was removed");
        let ours = super::common::e2e::states(&p.aws, &p.instances).await;
        assert!(ours.values().all(|s| *s == karpenter_teardown::aws::InstanceState::Running), "{ours:?}");
    }

    // the user deletes what the controller holds while it still runs (its cleanup done, here by
    // hand): the run goes ahead, the volume's controller named as staying
    let unhold = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    services.delete("front", &DeleteParams::default()).await.unwrap();
    services.patch("front", &PatchParams::default(), &unhold).await.unwrap();
    ingresses.delete("front", &DeleteParams::default()).await.unwrap();
    ingresses.patch("front", &PatchParams::default(), &unhold).await.unwrap();
    gateways.delete("front", &DeleteParams::default()).await.unwrap();
    gateways.patch("front", &PatchParams::default(), &unhold).await.unwrap();
    let dry = teardown(&p, false).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    assert!(
        dry.stdout.contains("cleanup: the EBS CSI controller (kube-system/ebs-csi-controller-")
            && dry
                .stdout
                .contains("on system-0) holds 3 object(s) for their EBS volumes; it keeps running through the drain"),
        "{}",
        dry.dump()
    );
    let clean = teardown(&p, true).await;
    assert_eq!(clean.code, 0, "{}", clean.dump());
    p.assert_torn_down(&p.instances).await;
    // the PVs' volumes, still in EC2, are reported by the ids the run read on the PVs (not
    // counted: the tool never deletes a volume); the other, tagged the same, is not this cluster's
    let mut volumes: Vec<(String, String, String)> = clean.report["leftovers"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["id"].as_str().unwrap().into(), v["status"].as_str().unwrap().into(), v["reason"].to_string()))
        .collect();
    assert_eq!(volumes.len(), 3, "{}", clean.dump());
    volumes.sort_by_key(|v| v.2.clone());
    for ((id, status, reason), (want, pv)) in
        volumes.iter().zip([(&ours, "data-0"), (&bare, "data-1"), (&in_tree, "data-2")])
    {
        assert_eq!((id, status.as_str()), (want, "available"), "{}", clean.dump());
        assert!(reason.contains(&format!("PersistentVolume {pv}")), "{}", clean.dump());
    }
    assert!(!clean.stdout.contains(&theirs), "{}", clean.dump());
    for id in [&ours, &bare, &in_tree, &theirs] {
        p.ec2.delete_volume().volume_id(id).send().await.unwrap();
    }
    eprintln!("cleanup cases took {:?}", t.elapsed());
    p.end().await;
}

/// A provisioned cluster whose tool identity holds `deploy/rbac.yaml` and
/// `deploy/rbac-release.yaml`, with a stand-in controller's Deployment (`name`, its chart's
/// `chart` label) that only Karpenter capacity can run, so the drain would strand it; and the
/// configuration of LocalStack for the stand-in's own AWS calls.
async fn release_bed(cluster: &str, name: &str, chart: &str) -> (super::resume::Provisioned, aws_config::SdkConfig) {
    let rbac = format!(
        "{}---\n{}",
        super::shipped_rbac_yaml(),
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac-release.yaml")).unwrap()
    );
    let p = provisioned(cluster, &rbac, 2).await;
    let on_karpenter = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}}}});
    Api::<Deployment>::namespaced(p.admin.clone(), "kube-system")
        .create(&PostParams::default(), &stand_in(name, chart, on_karpenter))
        .await
        .unwrap();
    assert_ne!(running_on(&p.admin, chart).await, "system-0");
    let config = sandbox_sim::localstack::config_as(super::common::e2e::REGION, "test").await;
    (p, config)
}

/// Asserts that the run's first step is the release, done, and that it finished before every
/// drain began; returns it.
fn release_came_first(run: &super::common::e2e::Run) -> &Value {
    let steps = run.report["steps"].as_array().unwrap();
    assert_eq!(
        (steps[0]["step"].as_str(), steps[0]["result"].as_str()),
        (Some("release"), Some("done")),
        "{}",
        run.dump()
    );
    let at = |r: &Value, field: &str| humantime::parse_rfc3339_weak(r[field].as_str().unwrap()).unwrap();
    let drains: Vec<&Value> = steps.iter().filter(|r| r["step"] == "drain").collect();
    assert!(
        !drains.is_empty() && drains.iter().all(|d| at(d, "started") >= at(&steps[0], "finished")),
        "{}",
        run.dump()
    );
    &steps[0]
}

/// `--release load-balancers` on the real control plane: the stand-in Load Balancer Controller
/// (`sandbox_sim::lbc`, its pod placed by the real scheduler on a Karpenter node and run by
/// kwok) holds a Service of type LoadBalancer, an Ingress of its IngressClass and a Gateway of
/// its network load balancer GatewayClass with their real finalizers, and their load balancers,
/// target groups and security groups are in LocalStack. The real kube-apiserver keeps each
/// deleted object until the controller removes its finalizer; the run, held to
/// `deploy/rbac.yaml` and `deploy/rbac-release.yaml`, deletes all three before the drain evicts
/// the controller and waits until they and their AWS objects are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_consent_the_real_server_sees_the_controllers_service_ingress_and_gateway_released_before_the_drain() {
    let (p, config) = release_bed("rrel", "aws-load-balancer-controller", "aws-load-balancer-controller").await;
    let pp = PostParams::default();
    let lbc = sandbox_sim::lbc::start(p.admin.clone(), &config, &p.cluster, Duration::from_millis(200));
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
    Api::<Namespace>::all(p.admin.clone()).create(&pp, &ns).await.unwrap();
    let services: Api<Service> = Api::namespaced(p.admin.clone(), "shop");
    let svc: Service = serde_json::from_value(
        json!({"metadata": {"name": "front"}, "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}}),
    )
    .unwrap();
    services.create(&pp, &svc).await.unwrap();
    // an Ingress of the controller's IngressClass, for which it makes an application load balancer
    let class: k8s_openapi::api::networking::v1::IngressClass =
        serde_json::from_value(json!({"metadata": {"name": "alb"}, "spec": {"controller": "ingress.k8s.aws/alb"}}))
            .unwrap();
    Api::<k8s_openapi::api::networking::v1::IngressClass>::all(p.admin.clone()).create(&pp, &class).await.unwrap();
    let ingresses: Api<Ingress> = Api::namespaced(p.admin.clone(), "shop");
    let ing: Ingress = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"ingressClassName": "alb", "defaultBackend": {"service": {"name": "front", "port": {"number": 80}}}},
    }))
    .unwrap();
    ingresses.create(&pp, &ing).await.unwrap();
    // a Gateway of its network load balancer GatewayClass, under the Gateway API's own CRDs
    let crds = sandbox_sim::lbc::gateway_crds().unwrap_or_else(|e| panic!("{e}"));
    sandbox_sim::world::create_crds(&p.admin, crds).await.unwrap();
    let gateway_api = |kind: &str, plural: &str| {
        kube::core::ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", kind),
            plural,
        )
    };
    let object = |v: Value| serde_json::from_value::<kube::api::DynamicObject>(v).unwrap();
    Api::<kube::api::DynamicObject>::all_with(p.admin.clone(), &gateway_api("GatewayClass", "gatewayclasses"))
        .create(
            &pp,
            &object(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                "metadata": {"name": "aws-nlb"}, "spec": {"controllerName": "gateway.k8s.aws/nlb"}})),
        )
        .await
        .unwrap();
    let gateways: Api<kube::api::DynamicObject> =
        Api::namespaced_with(p.admin.clone(), "shop", &gateway_api("Gateway", "gateways"));
    gateways
        .create(
            &pp,
            &object(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                "metadata": {"name": "edge"},
                "spec": {"gatewayClassName": "aws-nlb", "listeners": [{"name": "tcp", "port": 80, "protocol": "TCP"}]}})),
        )
        .await
        .unwrap();
    let stacks =
        ["service.k8s.aws/stack shop/front", "ingress.k8s.aws/stack shop/web", "gateway.k8s.aws.nlb/stack shop/edge"];
    let (aws, cluster) = (&p.aws, p.cluster.as_str());
    let in_aws = |stack: &'static str| async move {
        karpenter_teardown::verify::load_balancing(aws, cluster)
            .await
            .unwrap()
            .into_iter()
            .filter(|l| l.made_for == stack)
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held = services.get("front").await.unwrap().metadata.finalizers.is_some()
            && ingresses.get("web").await.unwrap().metadata.finalizers.is_some()
            && gateways.get("edge").await.unwrap().metadata.finalizers.is_some();
        if held && in_aws(stacks[0]).await == 3 && in_aws(stacks[1]).await == 3 && in_aws(stacks[2]).await == 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stand-in did not make the Service's, the Ingress's and the Gateway's load balancers"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // without consent the drain would strand the controller: refused
    let refused = teardown(&p, true).await;
    assert_eq!(refused.code, 3, "{}", refused.dump());
    assert!(p.karpenter.running(), "a refused run removed the controller");

    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = p.tool("run", p.s.tool_kubeconfig(), &report);
    cmd.args(["--yes", "--release", "load-balancers"]);
    let run = super::common::e2e::run_of(cmd, &report).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    release_came_first(&run);
    assert!(services.get_opt("front").await.unwrap().is_none(), "the Service outlived its release");
    assert!(ingresses.get_opt("web").await.unwrap().is_none(), "the Ingress outlived its release");
    assert!(gateways.get_opt("edge").await.unwrap().is_none(), "the Gateway outlived its release");
    for stack in stacks {
        assert_eq!(in_aws(stack).await, 0, "a load balancer, target group or security group of {stack} is left");
    }
    p.assert_torn_down(&p.instances).await;
    lbc.shutdown().await;
    p.end().await;
}

/// An EBS volume in LocalStack tagged as the EBS CSI driver tags it without
/// `--k8s-tag-cluster-id` (its chart's default): nothing on it names the cluster.
async fn ebs_volume(ec2: &aws_sdk_ec2::Client, pv: &str) -> String {
    use aws_sdk_ec2::types::{ResourceType, Tag, TagSpecification};
    let tags = TagSpecification::builder()
        .resource_type(ResourceType::Volume)
        .tags(Tag::builder().key("ebs.csi.aws.com/cluster").value("true").build())
        .tags(Tag::builder().key("CSIVolumeName").value(pv).build())
        .build();
    let made = ec2.create_volume().availability_zone("us-west-2a").size(1).tag_specifications(tags).send();
    made.await.unwrap().volume_id().unwrap().to_string()
}

/// In namespace `shop`, `sets` StatefulSets `db`, `db1`, ... of `replicas` pods each, every pod
/// mounting the claim its `data` template makes, bound by the real PV controller to a PV as
/// csi-provisioner makes it (reclaim policy `Delete`, its finalizer and annotation) on a volume
/// in LocalStack. Returns once every claim is bound and every pod runs: the volume ids, in the
/// order of the StatefulSets and their pods.
async fn statefulsets_on_volumes(p: &super::resume::Provisioned, sets: usize, replicas: usize) -> Vec<String> {
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    use k8s_openapi::api::storage::v1::StorageClass;
    let pp = PostParams::default();
    let sc: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "ebs"}, "provisioner": "ebs.csi.aws.com", "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }))
    .unwrap();
    Api::<StorageClass>::all(p.admin.clone()).create(&pp, &sc).await.unwrap();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
    Api::<Namespace>::all(p.admin.clone()).create(&pp, &ns).await.unwrap();
    let pvs: Api<PersistentVolume> = Api::all(p.admin.clone());
    let statefulsets: Api<StatefulSet> = Api::namespaced(p.admin.clone(), "shop");
    let mut ids = Vec::new();
    for set in 0..sets {
        let name = if set == 0 { "db".to_string() } else { format!("db{set}") };
        for r in 0..replicas {
            let (claim, pv) = (format!("data-{name}-{r}"), format!("pvc-data-{name}-{r}"));
            let id = ebs_volume(&p.ec2, &pv).await;
            let pv: PersistentVolume = serde_json::from_value(json!({
                "metadata": {"name": pv,
                             "annotations": {"pv.kubernetes.io/provisioned-by": "ebs.csi.aws.com"},
                             "finalizers": ["external-provisioner.volume.kubernetes.io/finalizer"]},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "persistentVolumeReclaimPolicy": "Delete",
                         "storageClassName": "ebs", "claimRef": {"namespace": "shop", "name": claim},
                         "csi": {"driver": "ebs.csi.aws.com", "volumeHandle": id}},
            }))
            .unwrap();
            pvs.create(&pp, &pv).await.unwrap();
            ids.push(id);
        }
        let labels = json!({"app": name});
        let sts: StatefulSet = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "db",
                         "image": "registry.k8s.io/pause:3.10", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}},
                     "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {"storageClassName": "ebs",
                         "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}]},
        }))
        .unwrap();
        statefulsets.create(&pp, &sts).await.unwrap();
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(p.admin.clone(), "shop");
    let pods: Api<Pod> = Api::namespaced(p.admin.clone(), "shop");
    let want = sets * replicas;
    let deadline = Instant::now() + Duration::from_secs(90 + 3 * want as u64);
    loop {
        let all = ListParams::default();
        let claims = claims.list(&all).await.unwrap().items;
        let bound =
            claims.iter().filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")).count();
        let running = pods.list(&all).await.unwrap().items.iter().filter(|p| phase(p) == "Running").count();
        if bound == want && running == want {
            return ids;
        }
        assert!(
            Instant::now() < deadline,
            "of {want} StatefulSet pods, {running} run and {bound} of their claims are bound"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `--release volumes` on the real control plane: a StatefulSet's pod, placed by the real
/// scheduler, mounts a claim bound by the real PV controller to a PV of the EBS CSI driver
/// (reclaim policy `Delete`, csi-provisioner's finalizer and annotation) whose volume is in
/// LocalStack. The stand-in EBS CSI controller (`sandbox_sim::ebscsi`) runs on a Karpenter
/// node, so the drain would strand it. With consent the run scales the StatefulSet to zero and
/// deletes the claim; the real PV-protection, PVC-protection and PV controllers release the PV
/// once the pod is gone, and the stand-in deletes the volume and then the PV, before any drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_consent_the_real_server_sees_a_statefulsets_volume_released_before_the_drain() {
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    let (p, config) = release_bed("rvol", "ebs-csi-controller", "aws-ebs-csi-driver").await;
    let pp = PostParams::default();
    let csi = sandbox_sim::ebscsi::start(p.admin.clone(), &config, Duration::from_millis(200));

    // the volume as the driver makes it, its PV as csi-provisioner makes it, pre-bound to the
    // claim the StatefulSet's template makes for its pod db-0; and another volume tagged the same
    let ours = statefulsets_on_volumes(&p, 1, 1).await.remove(0);
    let theirs = ebs_volume(&p.ec2, "pvc-data-db-0").await;
    let pvs: Api<PersistentVolume> = Api::all(p.admin.clone());
    let statefulsets: Api<StatefulSet> = Api::namespaced(p.admin.clone(), "shop");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(p.admin.clone(), "shop");
    let pods: Api<Pod> = Api::namespaced(p.admin.clone(), "shop");

    // without consent the drain would strand the controller: refused, nothing changed
    let refused = teardown(&p, true).await;
    assert_eq!(refused.code, 3, "{}", refused.dump());
    assert!(
        refused.report["error"].as_str().unwrap_or_default().contains("PersistentVolume pvc-data-db-0"),
        "{}",
        refused.dump()
    );
    assert!(p.karpenter.running(), "a refused run removed the controller");
    assert_eq!(statefulsets.get("db").await.unwrap().spec.unwrap().replicas, Some(1));

    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let release = || {
        let mut cmd = p.tool("run", p.s.tool_kubeconfig(), &report);
        cmd.args(["--yes", "--release", "volumes"]);
        super::common::e2e::run_of(cmd, &report)
    };
    // a dry run plans the release, one line per StatefulSet and per claim, and changes nothing
    let mut cmd = p.tool("run", p.s.tool_kubeconfig(), &report);
    cmd.args(["--release", "volumes"]);
    let dry = super::common::e2e::run_of(cmd, &report).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    let planned: Vec<&str> = dry.stdout.lines().filter(|l| l.contains("release: ")).collect();
    assert_eq!(planned.len(), 2, "{}", dry.dump());
    assert!(planned[0].contains("scale StatefulSet shop/db to zero"), "{planned:?}");
    assert!(
        planned[1].contains("delete PersistentVolumeClaim shop/data-db-0")
            && planned[1].contains(&format!("PersistentVolume pvc-data-db-0 and EBS volume {ours} are gone")),
        "{planned:?}"
    );
    assert_eq!(statefulsets.get("db").await.unwrap().spec.unwrap().replicas, Some(1));
    // a pod no StatefulSet owns mounts the claim too: scaling the StatefulSet would not free
    // it, so the release is refused, nothing changed
    let backup: Pod = serde_json::from_value(json!({
        "metadata": {"name": "backup", "namespace": "shop"},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
                 "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data-db-0"}}]},
    }))
    .unwrap();
    pods.create(&pp, &backup).await.unwrap();
    let run = release().await;
    assert_eq!(run.code, 3, "{}", run.dump());
    let error = run.report["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(
            "PersistentVolume/pvc-data-db-0: its claim shop/data-db-0 is mounted by pod shop/backup (no owner)"
        ),
        "{}",
        run.dump()
    );
    assert_eq!(statefulsets.get("db").await.unwrap().spec.unwrap().replicas, Some(1));
    assert!(claims.get_opt("data-db-0").await.unwrap().is_some());
    pods.delete("backup", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while pods.get_opt("backup").await.unwrap().is_some() {
        assert!(Instant::now() < deadline, "the backup pod did not go");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let run = release().await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let release = release_came_first(&run);
    assert!(
        release["detail"].as_str().unwrap_or_default().contains("StatefulSet shop/db scaled from 1 to 0"),
        "{}",
        run.dump()
    );
    assert_eq!(statefulsets.get("db").await.unwrap().spec.unwrap().replicas, Some(0));
    assert!(claims.get_opt("data-db-0").await.unwrap().is_none(), "the claim outlived its release");
    assert!(pvs.get_opt("pvc-data-db-0").await.unwrap().is_none(), "the PV outlived its release");
    let left = |id: &str| {
        p.ec2
            .describe_volumes()
            .filters(aws_sdk_ec2::types::Filter::builder().name("volume-id").values(id).build())
            .send()
    };
    assert_eq!(left(&ours).await.unwrap().volumes().len(), 0, "the PV's EBS volume is left");
    assert_eq!(left(&theirs).await.unwrap().volumes().len(), 1, "a volume not of this cluster was touched");
    assert!(run.report["leftovers"]["volumes"].as_array().unwrap().is_empty(), "{}", run.dump());
    p.assert_torn_down(&p.instances).await;
    p.ec2.delete_volume().volume_id(&theirs).send().await.unwrap();
    csi.shutdown().await;
    p.end().await;
}

/// The benchmark of `--release volumes` (docs/benchmarks.md, "Releasing 100 volumes"), on the
/// real control plane as the test above: `KT_BENCH_VOLUMES` claims (default 100) of
/// StatefulSets of 10 pods each, the pods on Karpenter's nodes, released by one
/// `run --yes --release volumes` of `KT_BENCH_BIN` (default the release build). Prints the
/// run's time, the release step's, and the tool's requests.
// Ignored, not dead: a benchmark needs the release build, which CI does not make, and its
// figures go to docs/benchmarks.md; it asserts the release succeeded before it reports them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: cargo build --release --bin karpenter-teardown && cargo test --test realstack -- --ignored --nocapture release_of_many_volumes"]
async fn release_of_many_volumes() {
    let volumes: usize = std::env::var("KT_BENCH_VOLUMES").map_or(100, |v| v.parse().unwrap());
    let bin = std::path::PathBuf::from(
        std::env::var("KT_BENCH_BIN")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/karpenter-teardown").into()),
    );
    assert!(bin.exists(), "no {}: build it first (cargo build --release --bin karpenter-teardown)", bin.display());
    let (p, config) = release_bed("bvol", "ebs-csi-controller", "aws-ebs-csi-driver").await;
    let csi = sandbox_sim::ebscsi::start(p.admin.clone(), &config, Duration::from_millis(200));
    let t = Instant::now();
    let ids = statefulsets_on_volumes(&p, volumes.div_ceil(10), 10.min(volumes)).await;
    eprintln!("bench: {} claims bound and their pods running in {:.1?}", ids.len(), t.elapsed());

    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = p.tool_of(&bin, "run", p.s.tool_kubeconfig(), &report);
    cmd.args(["--yes", "--release", "volumes"]);
    let t = Instant::now();
    let run = super::common::e2e::run_of(cmd, &report).await;
    let took = t.elapsed();
    assert_eq!(run.code, 0, "{}", run.dump());
    let release = release_came_first(&run);
    let at = |field: &str| humantime::parse_rfc3339_weak(release[field].as_str().unwrap()).unwrap();
    let step = at("finished").duration_since(at("started")).unwrap();
    let filter = aws_sdk_ec2::types::Filter::builder().name("volume-id").set_values(Some(ids.clone())).build();
    let left = p.ec2.describe_volumes().filters(filter).send().await.unwrap().volumes().len();
    let calls = run.report["api_calls"].as_object().unwrap();
    let sum = |prefix: &str| -> u64 {
        calls.iter().filter(|(k, _)| k.starts_with(prefix)).filter_map(|(_, n)| n.as_u64()).sum()
    };
    println!("| volumes | run (s) | release step (s) | Kubernetes requests | EC2 requests | left in AWS |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {} | {:.1} | {:.1} | {} | {} | {} |",
        ids.len(),
        took.as_secs_f64(),
        step.as_secs_f64(),
        sum("kubernetes:"),
        sum("ec2:"),
        left
    );
    println!("api_calls: {}", run.report["api_calls"]);
    csi.shutdown().await;
    p.end().await;
}
