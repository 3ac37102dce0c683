//! The controllers the rest of a destroy depends on (design §2.1): a Load Balancer Controller
//! whose only pod runs on a Karpenter node, with a Service still held by its finalizer, would be
//! left nowhere to run by the drain, and the Service's load balancer could then never be deleted.
//! The run refuses before its first write (exit 3), dry or not; a replica on a managed node lifts
//! the refusal, and the plan says who holds what.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{Api, PostParams};
use sandbox_sim::generate;
use serde_json::json;

use crate::common::e2e::{Consent, assert_no_node_fenced, bed, blockers_of, small_world, teardown};

const LBC: &str = "aws-load-balancer-controller";

fn controller_pod(name: &str, node: &str, karpenter_only: bool) -> Pod {
    let mut spec = json!({"nodeName": node, "containers": [{"name": "controller", "image": "public.ecr.aws/eks/aws-load-balancer-controller:v2.13.0"}]});
    if karpenter_only {
        spec["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}}});
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "kube-system", "labels": {"app.kubernetes.io/name": LBC, "app.kubernetes.io/instance": LBC}},
        "spec": spec,
    }))
    .unwrap()
}

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
    // the chart's Deployment (its pods made by hand, placed where the test wants them)
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": LBC, "namespace": "kube-system", "labels": {"app.kubernetes.io/name": LBC}},
        "spec": {"replicas": 0,
                 "selector": {"matchLabels": {"app.kubernetes.io/name": LBC, "app.kubernetes.io/instance": LBC}},
                 "template": {"metadata": {"labels": {"app.kubernetes.io/name": LBC, "app.kubernetes.io/instance": LBC}},
                              "spec": {"containers": [{"name": "controller", "image": "x"}]}}},
    }))
    .unwrap();
    Api::<Deployment>::namespaced(b.client.clone(), "kube-system").create(&pp, &deployment).await.unwrap();
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
