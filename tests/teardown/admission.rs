//! A webhook the drain would take away (design §2.1): `failurePolicy: Fail`, matching writes the
//! run makes after the drain, and served only from pods on Karpenter nodes. A dry run passes
//! while its pods run; once the drain has evicted them, every write it matches would fail. The
//! run refuses before its first write, and a webhook with one backend elsewhere does not.
//!
//! The emulator stores webhook configurations and EndpointSlices but calls no webhook: what is
//! tested here is the reading of where a webhook's backends run. The real server's calls of
//! webhooks and policies are in `tests/realstack/admission.rs`.

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use sandbox_sim::generate;
use serde_json::json;

use crate::common::e2e::{
    Consent, assert_no_node_fenced, bed, blockers_of, node_policy_webhook, small_world, teardown,
};

fn endpoint(ip: &str, node: &str) -> serde_json::Value {
    json!({"addresses": [ip], "nodeName": node, "conditions": {"ready": true}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_served_only_from_karpenter_nodes_refuses_the_run_before_the_drain() {
    let s = small_world("e2e-stranded", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let pp = PostParams::default();
    let hook: ValidatingWebhookConfiguration = serde_json::from_value(node_policy_webhook()).unwrap();
    Api::<ValidatingWebhookConfiguration>::all(b.client.clone()).create(&pp, &hook).await.unwrap();
    let karpenter_node = &world.nodes[0].node;
    let slices: Api<EndpointSlice> = Api::namespaced(b.client.clone(), "default");
    let slice = |name: &str, endpoints: Vec<serde_json::Value>| -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "node-policy"}},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"port": 8443, "protocol": "TCP"}],
        }))
        .unwrap()
    };
    slices.create(&pp, &slice("node-policy-a", vec![endpoint("10.0.1.5", karpenter_node)])).await.unwrap();

    // refused, dry and with consent, before anything is written
    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&b, &world.cluster, consent, &[]).await;
        assert_eq!(run.code, 2, "{consent:?}: {}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("nodes.policy.example.com")
                && error.contains(&format!("served only from Karpenter nodes ({karpenter_node})"))
                && error.contains("patch nodes")
                && error.contains("Nothing was changed"),
            "{error}"
        );
        let blockers = blockers_of(&run, "admission");
        assert_eq!(blockers.len(), 1, "{}", run.dump());
        assert_eq!(blockers[0]["name"], "ValidatingWebhookConfiguration/node-policy");
    }
    assert_no_node_fenced(&b.client, &world).await;

    // one backend on a managed node keeps it served through the drain: nothing to refuse
    let managed = &world.managed_nodes[0].node;
    slices.create(&pp, &slice("node-policy-b", vec![endpoint("10.0.2.5", managed)])).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    b.server.shutdown().await;
}
