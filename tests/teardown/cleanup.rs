//! The controllers the rest of a destroy depends on (design §2.1): a Load Balancer Controller
//! whose only pod runs on a Karpenter node, with a Service still held by its finalizer, would be
//! left nowhere to run by the drain, and the Service's load balancer could then never be deleted.
//! The run refuses before its first write (exit 3), dry or not; a replica on a managed node lifts
//! the refusal, and the plan says who holds what.

use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{Api, Patch, PatchParams, PostParams};
use sandbox_sim::generate;
use serde_json::json;

use crate::common::e2e::{
    Consent, assert_no_node_fenced, assert_torn_down, bed, bed_with, blockers_of, controller_pod, lbc_deployment,
    running_lbc, scale_controller, shop_services, small_world, teardown, untouchable_nodes,
};

/// Service `shop/front` of type LoadBalancer, held by the Load Balancer Controller's finalizer.
async fn held_service(client: &kube::Client) {
    let pp = PostParams::default();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
    Api::<Namespace>::all(client.clone()).create(&pp, &ns).await.unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "front", "namespace": "shop", "finalizers": ["service.k8s.aws/resources"]},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), "shop").create(&pp, &svc).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_controller_only_on_karpenter_nodes_refuses_the_run_before_the_drain() {
    let s = small_world("e2e-strand-lbc", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let pp = PostParams::default();
    lbc_deployment(&b.client).await;
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), "kube-system");
    let karpenter_node = &world.nodes[0].node;
    pods.create(&pp, &controller_pod("lbc-0", karpenter_node, true)).await.unwrap();
    held_service(&b.client).await;

    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&b, &world.cluster, consent, &[]).await;
        assert_eq!(run.code, 3, "{consent:?}: {}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("the AWS Load Balancer Controller (kube-system/lbc-0 on ")
                && error.contains("Service shop/front (finalizer service.k8s.aws/resources)")
                && error.contains("Nothing was changed"),
            "{error}"
        );
        let stranded = blockers_of(&run, "stranded");
        assert_eq!(stranded.len(), 1, "{}", run.dump());
        assert_eq!(stranded[0]["name"], "Service/shop/front");
    }
    assert_no_node_fenced(&b.client, &world).await;
    // --release without deploy/rbac-release.yaml: refused before any write, naming what is missing
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--release", "load-balancers"]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    let error = run.report["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("delete services (core)") && error.contains("delete ingresses (networking.k8s.io)"),
        "{error}"
    );
    assert_no_node_fenced(&b.client, &world).await;
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--release", "volumes"]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    let error = run.report["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("delete persistentvolumeclaims (core)")
            && error.contains("patch statefulsets/scale (apps)")
            && !error.contains("delete services"),
        "{error}"
    );
    assert_no_node_fenced(&b.client, &world).await;

    // a second replica on the managed node group keeps it running through the drain
    pods.create(&pp, &controller_pod("lbc-1", &world.managed_nodes[0].node, false)).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert!(
        run.stdout.contains("holds 1 object(s) for their load balancers, target groups and security groups; it keeps running through the drain"),
        "{}",
        run.dump()
    );
    b.server.shutdown().await;
}

/// EKS Auto Mode's nodes carry `karpenter.sh/nodepool` too, but the run keeps them: a controller
/// that needs `karpenter.sh/nodepool` capacity can move there, so it is not stranded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_that_fits_eks_auto_modes_nodes_is_not_stranded() {
    let mut s = small_world("e2e-strand-auto", 3);
    s.auto_mode_nodes = 2;
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let pp = PostParams::default();
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), "kube-system");
    pods.create(&pp, &controller_pod("lbc-0", &world.nodes[0].node, true)).await.unwrap();
    held_service(&b.client).await;
    // found through its leader Lease alone (no Deployment carries the chart's label here)
    let lease: k8s_openapi::api::coordination::v1::Lease = serde_json::from_value(json!({
        "metadata": {"name": "aws-load-balancer-controller-leader", "namespace": "kube-system"},
        "spec": {"holderIdentity": "lbc-0_6f1c1a2e-1b7e-4c55-9c39-3c1f0a7e2d11", "leaseDurationSeconds": 15},
    }))
    .unwrap();
    Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(b.client.clone(), "kube-system")
        .create(&pp, &lease)
        .await
        .unwrap();
    // EKS says Auto Mode is on for this cluster (otherwise its compute here contradicts it)
    let eks = sandbox_sim::cloud::EksSpec { endpoint: b.server.url(), auto_mode: true, ..Default::default() };
    crate::common::register_eks_as(&world.cluster, crate::common::e2e::REGION, &eks).await;
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert!(
        run.stdout.contains("cleanup: the AWS Load Balancer Controller (kube-system/lbc-0 on ")
            && run.stdout.contains("it keeps running through the drain"),
        "{}",
        run.dump()
    );
    b.server.shutdown().await;
}

/// A bed whose tool identity holds `deploy/rbac.yaml` and `deploy/rbac-release.yaml`.
async fn release_bed(cluster: &str) -> crate::common::e2e::Bed {
    let mut rbac = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml")).unwrap();
    rbac.push_str("---\n");
    rbac.push_str(&std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac-release.yaml")).unwrap());
    let opts = sandbox_apiserver::ServerOptions {
        time_scale: 0.01,
        rbac: Some(sandbox_apiserver::authz::Rbac::from_yaml(&rbac).unwrap()),
        ..Default::default()
    };
    bed_with(cluster, opts).await
}

/// What the stand-in Load Balancer Controller made in AWS for `stack` (`<ns>/<name>`) of
/// `cluster`, as verification reads it.
async fn stack_in_aws(aws: &karpenter_teardown::aws::AwsClients, cluster: &str, stack: &str) -> Vec<String> {
    let found = karpenter_teardown::verify::load_balancing(aws, cluster).await.unwrap();
    let made_for = format!("service.k8s.aws/stack {stack}");
    found.into_iter().filter(|l| l.made_for == made_for).map(|l| format!("{:?} {}", l.kind, l.name)).collect()
}

/// Waits until the stand-in has made the Service's load balancer, target group and security group.
async fn made(aws: &karpenter_teardown::aws::AwsClients, cluster: &str, stack: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let found = stack_in_aws(aws, cluster, stack).await;
        if found.len() == 3 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the stand-in made {found:?} for {stack}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// With `--release load-balancers`, what the Load Balancer Controller holds is deleted while it
/// still runs, before the fence and the drain, and the run waits until its load balancer,
/// target group and security group are gone from AWS; deletion protection (by annotation or on
/// the load balancer alone) refuses it, consent or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_consent_load_balancers_are_released_before_the_drain_and_verification_is_clean() {
    let s = small_world("e2e-release-lbc", 3);
    let b = release_bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    scale_controller(&b.client, 0).await;
    let config = sandbox_sim::localstack::config_as(crate::common::e2e::REGION, "test").await;
    let lbc = running_lbc(&b, &config, &world.cluster, &world.nodes[0].node, true).await;
    let services = shop_services(&b.client, &["front"]).await;
    // made protected: the stand-in sets the annotation's attributes on the load balancer it makes
    let locked: Service = serde_json::from_value(json!({
        "metadata": {"name": "locked", "namespace": "shop",
                     "annotations": {(sandbox_sim::lbc::ATTRIBUTES_ANNOTATION): "deletion_protection.enabled=true"}},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}}))
    .unwrap();
    services.create(&PostParams::default(), &locked).await.unwrap();
    made(&b.aws, &world.cluster, "shop/front").await;
    made(&b.aws, &world.cluster, "shop/locked").await;
    // another cluster's load balancer for a Service of the same name
    let other = crate::common::unique_cluster("e2e-release-other");
    let v2 = aws_sdk_elasticloadbalancingv2::Client::new(&config);
    let (subnets, _) = crate::common::default_subnets(&config).await;
    let tag = |k: &str, v: &str| aws_sdk_elasticloadbalancingv2::types::Tag::builder().key(k).value(v).build();
    let decoy = v2
        .create_load_balancer()
        .name(format!("k8s-shop-front-{}", &other[other.len() - 6..]))
        .set_subnets(Some(subnets))
        .tags(tag("elbv2.k8s.aws/cluster", &other))
        .tags(tag("service.k8s.aws/stack", "shop/front"))
        .send()
        .await
        .unwrap()
        .load_balancers()[0]
        .load_balancer_arn()
        .unwrap()
        .to_string();

    // without consent: the stranded controller refuses the run, and the refusal names the flag
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    assert!(run.report["error"].as_str().unwrap_or_default().contains("--release load-balancers"), "{}", run.dump());

    // with consent, a load balancer with deletion protection refuses it, before any write
    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&b, &world.cluster, consent, &["--release", "load-balancers"]).await;
        assert_eq!(run.code, 3, "{consent:?}: {}", run.dump());
        let refused = blockers_of(&run, "release");
        assert_eq!(refused.len(), 1, "{}", run.dump());
        assert_eq!(refused[0]["name"], "Service/shop/locked");
        let reason = refused[0]["reason"].as_str().unwrap();
        assert!(
            reason.contains("its annotation turns deletion protection on") && reason.contains("in AWS"),
            "{reason}"
        );
    }
    assert_eq!(services.list(&Default::default()).await.unwrap().items.len(), 2, "a refused run deleted a Service");
    assert_no_node_fenced(&b.client, &world).await;
    // the annotation gone, the protection set on the load balancer alone still refuses
    let unannotate = Patch::Merge(json!({"metadata": {"annotations": null}}));
    services.patch("locked", &PatchParams::default(), &unannotate).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--release", "load-balancers"]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    let reason = blockers_of(&run, "release")[0]["reason"].as_str().unwrap().to_string();
    assert!(!reason.contains("annotation") && reason.contains("has deletion protection on in AWS"), "{reason}");
    // the user turns it off: a dry run plans the release of both, and changes nothing
    let locked = karpenter_teardown::verify::load_balancing(&b.aws, &world.cluster)
        .await
        .unwrap()
        .into_iter()
        .find(|l| {
            l.made_for == "service.k8s.aws/stack shop/locked" && l.kind == karpenter_teardown::aws::LbKind::LoadBalancer
        })
        .unwrap();
    let off = aws_sdk_elasticloadbalancingv2::types::LoadBalancerAttribute::builder()
        .key("deletion_protection.enabled")
        .value("false")
        .build();
    v2.modify_load_balancer_attributes().load_balancer_arn(&locked.id).attributes(off).send().await.unwrap();
    let dry = teardown(&b, &world.cluster, Consent::DryRun, &["--release", "load-balancers"]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    for name in ["front", "locked"] {
        assert!(
            dry.stdout
                .contains(&format!("release: delete Service shop/{name} while the AWS Load Balancer Controller runs")),
            "{}",
            dry.dump()
        );
    }
    assert_eq!(services.list(&Default::default()).await.unwrap().items.len(), 2, "a dry run deleted a Service");

    let before = untouchable_nodes(&b.client, &world).await;
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--release", "load-balancers"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    // released first, while the controller ran (it is evicted by the drain, and only a running
    // controller deletes in AWS and removes its finalizer)
    let steps = run.report["steps"].as_array().unwrap();
    assert_eq!(steps[0]["step"], "release", "{}", run.dump());
    assert_eq!(steps[0]["result"], "done", "{}", run.dump());
    let at = |r: &serde_json::Value, field: &str| humantime::parse_rfc3339_weak(r[field].as_str().unwrap()).unwrap();
    let drains: Vec<&serde_json::Value> = steps.iter().filter(|r| r["step"] == "drain").collect();
    assert_eq!(drains.len(), world.nodes.len(), "{}", run.dump());
    assert!(drains.iter().all(|d| at(d, "started") >= at(&steps[0], "finished")), "{}", run.dump());
    assert_eq!(services.list(&Default::default()).await.unwrap().items.len(), 0);
    for stack in ["shop/front", "shop/locked"] {
        assert_eq!(stack_in_aws(&b.aws, &world.cluster, stack).await, Vec::<String>::new());
    }
    assert_eq!(run.report["leftovers"]["load_balancing"].as_array().map(Vec::len), Some(0), "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    // another cluster's load balancer of the same stack is untouched
    let still = v2.describe_load_balancers().load_balancer_arns(&decoy).send().await.unwrap();
    assert_eq!(still.load_balancers().len(), 1);
    v2.delete_load_balancer().load_balancer_arn(&decoy).send().await.unwrap();
    lbc.shutdown().await;
    b.server.shutdown().await;
}

/// `--release load-balancers` reaches only what the drain would strand: a Load Balancer
/// Controller that keeps running on the managed node group deletes in AWS by itself whenever its
/// Services go, so the run leaves its Service and load balancer alone and says so; naming
/// `load-balancers=all` is what reaches them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_leaves_what_a_surviving_controller_holds_unless_all_is_named() {
    let s = small_world("e2e-release-kept", 2);
    let b = release_bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    scale_controller(&b.client, 0).await;
    let config = sandbox_sim::localstack::config_as(crate::common::e2e::REGION, "test").await;
    let lbc = running_lbc(&b, &config, &world.cluster, &world.managed_nodes[0].node, false).await;
    let services = shop_services(&b.client, &["front"]).await;
    made(&b.aws, &world.cluster, "shop/front").await;

    // named with =all, a dry run plans its deletion
    let dry = teardown(&b, &world.cluster, Consent::DryRun, &["--release", "load-balancers=all"]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    assert!(
        dry.stdout.contains("release: delete Service shop/front while the AWS Load Balancer Controller runs"),
        "{}",
        dry.dump()
    );
    // the default consent plans nothing for it, and says how to reach it
    let dry = teardown(&b, &world.cluster, Consent::DryRun, &["--release", "load-balancers"]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    assert!(
        dry.stdout.contains("release: nothing of the 1 object(s) the AWS Load Balancer Controller holds")
            && dry.stdout.contains("--release load-balancers=all releases them anyway")
            && !dry.stdout.contains("release: delete Service"),
        "{}",
        dry.dump()
    );
    let before = untouchable_nodes(&b.client, &world).await;
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--release", "load-balancers"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let steps = run.report["steps"].as_array().unwrap();
    assert!(steps.iter().all(|r| r["step"] != "release"), "{}", run.dump());
    let front = services.get("front").await.unwrap();
    assert!(front.metadata.deletion_timestamp.is_none(), "the run deleted a Service its controller outlives");
    assert_eq!(stack_in_aws(&b.aws, &world.cluster, "shop/front").await.len(), 3, "its load balancer was touched");
    assert_torn_down(&b, &world, &before).await;
    lbc.shutdown().await;
    b.server.shutdown().await;
}

/// `--release` deletes objects only while their controller runs to finish them: with no pod of
/// the Load Balancer Controller, a Service it holds could only hang in deletion, so the run is
/// refused before any write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_controller_does_not_run_is_refused() {
    let s = small_world("e2e-release-idle", 2);
    let b = release_bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    lbc_deployment(&b.client).await;
    held_service(&b.client).await;
    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&b, &world.cluster, consent, &["--release", "load-balancers"]).await;
        assert_eq!(run.code, 3, "{consent:?}: {}", run.dump());
        let refused = blockers_of(&run, "release");
        assert_eq!(refused.len(), 1, "{}", run.dump());
        assert_eq!(refused[0]["name"], "Service/shop/front");
        assert!(refused[0]["reason"].as_str().unwrap().contains("no pod of the AWS Load Balancer Controller runs"));
    }
    let services: Api<Service> = Api::namespaced(b.client.clone(), "shop");
    assert!(services.get("front").await.unwrap().metadata.deletion_timestamp.is_none(), "a refused run deleted it");
    assert_no_node_fenced(&b.client, &world).await;
    b.server.shutdown().await;
}

/// Pod `name` of a Load Balancer Controller installed under another chart name (`app: lb`), only
/// on Karpenter's nodes, running `image`.
fn renamed_controller_pod(name: &str, node: &str, image: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "kube-system", "labels": {"app": "lb"}},
        "spec": {"nodeName": node, "containers": [{"name": "controller", "image": image}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}}}},
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_controller_under_another_name_is_found_by_its_image_or_its_webhooks() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use k8s_openapi::api::apps::v1::Deployment;
    let s = small_world("e2e-strand-renamed", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let pp = PostParams::default();
    held_service(&b.client).await;
    let karpenter_node = &world.nodes[0].node;
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), "kube-system");

    // by its image: a Deployment `lb` of the chart installed as `lb`
    let image = "public.ecr.aws/eks/aws-load-balancer-controller:v2.13.0";
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "lb", "namespace": "kube-system", "labels": {"app.kubernetes.io/name": "lb"}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "lb"}},
            "template": {"metadata": {"labels": {"app": "lb"}},
                "spec": {"containers": [{"name": "controller", "image": image}]}}},
    }))
    .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(b.client.clone(), "kube-system");
    deployments.create(&pp, &deployment).await.unwrap();
    pods.create(&pp, &renamed_controller_pod("lb-0", karpenter_node, image)).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    let error = run.report["error"].as_str().unwrap_or_default();
    assert!(error.contains("the AWS Load Balancer Controller (kube-system/lb-0 on "), "{error}");

    // by its webhooks: no Deployment names it, a mirrored image, but its `*.elbv2.k8s.aws`
    // webhooks are served by its pods
    deployments.delete("lb", &Default::default()).await.unwrap();
    pods.delete("lb-0", &Default::default()).await.unwrap();
    pods.create(&pp, &renamed_controller_pod("lb-1", karpenter_node, "registry.internal/lb:2")).await.unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "lb-webhook", "namespace": "kube-system"},
        "spec": {"selector": {"app": "lb"}, "ports": [{"port": 443, "targetPort": 9443}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(b.client.clone(), "kube-system").create(&pp, &svc).await.unwrap();
    let webhooks: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": "lb-webhook"},
        "webhooks": [{"name": "vingress.elbv2.k8s.aws", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Ignore",
            "clientConfig": {"service": {"namespace": "kube-system", "name": "lb-webhook", "path": "/validate"}},
            "rules": [{"apiGroups": ["networking.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["ingresses"]}]}],
    }))
    .unwrap();
    Api::<ValidatingWebhookConfiguration>::all(b.client.clone()).create(&pp, &webhooks).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    let error = run.report["error"].as_str().unwrap_or_default();
    assert!(error.contains("the AWS Load Balancer Controller (kube-system/lb-1 on "), "{error}");
    assert_no_node_fenced(&b.client, &world).await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_that_holds_objects_and_cannot_be_placed_refuses_unless_assumed_stopped() {
    let s = small_world("e2e-strand-unplaced", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    held_service(&b.client).await;
    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&b, &world.cluster, consent, &[]).await;
        assert_eq!(run.code, 3, "{consent:?}: {}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("cannot tell where the AWS Load Balancer Controller runs")
                && error.contains("Service shop/front (finalizer service.k8s.aws/resources)")
                && error.contains("--assume-stopped load-balancer-controller")
                && error.contains("Nothing was changed"),
            "{error}"
        );
        assert_eq!(blockers_of(&run, "stranded").len(), 1, "{}", run.dump());
    }
    assert_no_node_fenced(&b.client, &world).await;
    // the user's word that it is stopped lets the run go on
    let run = teardown(&b, &world.cluster, Consent::DryRun, &["--assume-stopped", "load-balancer-controller"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    b.server.shutdown().await;
}
