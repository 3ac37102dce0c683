//! Compute of Karpenter's kinds that is not this cluster's self-managed Karpenter's: EKS Auto
//! Mode beside it, as AWS's migration guide runs both in one cluster. Its NodePools are
//! `karpenter.sh/v1` NodePools too and its NodeClaims and Nodes carry `karpenter.sh/nodepool`,
//! but they reference EKS's `NodeClass`, and their instances are EKS's. The tool leaves every
//! piece of it as it was, and says so in the plan and the report.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::k8s;
use kube::api::{Api, DynamicObject, ListParams};
use sandbox_sim::world::AUTO_MODE_APP;
use sandbox_sim::{World, generate};
use serde_json::{Value, json};

use crate::common;
use crate::common::e2e::{Bed, Consent, REGION, bed, live_karpenter, small_world, states, teardown};

/// Everything of Auto Mode's that a teardown could touch, as it is now.
async fn auto_mode_state(b: &Bed, world: &World) -> Value {
    let pools: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodepool_resource());
    let claims: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(b.client.clone());
    let mut out = serde_json::Map::new();
    for pool in ["general-purpose", "system"] {
        let p = pools.get(pool).await.unwrap();
        out.insert(
            format!("NodePool/{pool}"),
            json!({"spec": p.data["spec"], "annotations": p.metadata.annotations, "deleting": p.metadata.deletion_timestamp.is_some()}),
        );
    }
    for n in &world.auto_mode_nodes {
        let c = claims.get(&n.nodeclaim).await.unwrap();
        out.insert(
            format!("NodeClaim/{}", n.nodeclaim),
            json!({"finalizers": c.metadata.finalizers, "deleting": c.metadata.deletion_timestamp.is_some()}),
        );
        let node = nodes.get(&n.node).await.unwrap();
        let spec = node.spec.unwrap_or_default();
        out.insert(
            format!("Node/{}", n.node),
            json!({"unschedulable": spec.unschedulable, "taints": spec.taints, "labels": node.metadata.labels,
                "deleting": node.metadata.deletion_timestamp.is_some()}),
        );
    }
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), AUTO_MODE_APP.0);
    let mut uids: Vec<String> =
        pods.list(&ListParams::default()).await.unwrap().items.into_iter().filter_map(|p| p.metadata.uid).collect();
    uids.sort();
    out.insert("pods".into(), json!(uids));
    Value::Object(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eks_auto_mode_compute_is_left_alone_while_karpenters_is_torn_down() {
    let mut s = small_world("e2e-automode", 6);
    s.auto_mode_nodes = 2;
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    assert_eq!(world.auto_mode_nodes.len(), 2);
    let sim = live_karpenter(&b, &world);
    // Karpenter's garbage collector must have looked at Auto Mode's claims (whose instances are
    // not this controller's) a few times over before anything is compared: a collector that
    // took them for its own would delete them within two rounds.
    let rounds = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while sim.stats().gc_rounds < 4 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(rounds.is_ok(), "the simulated Karpenter ran no garbage collection: {:?}", sim.stats());
    let before = auto_mode_state(&b, &world).await;
    for n in &world.auto_mode_nodes {
        assert_eq!(before[format!("NodeClaim/{}", n.nodeclaim)]["deleting"], false, "{before:#}");
    }
    assert_eq!(before["pods"].as_array().map(Vec::len), Some(2), "{before:#}");
    let auto_instances: Vec<String> = world.auto_mode_nodes.iter().map(|n| n.instance_id.clone()).collect();

    // Auto Mode's compute where EKS says Auto Mode is off: not the cluster EKS describes
    let refused = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(refused.code, 3, "{}", refused.dump());
    assert!(
        refused.stderr.contains("object(s) of EKS Auto Mode") && refused.stderr.contains("has Auto Mode off"),
        "{}",
        refused.dump()
    );
    assert_eq!(auto_mode_state(&b, &world).await, before, "a refused run changed Auto Mode's compute");
    let eks = sandbox_sim::cloud::EksSpec { endpoint: b.server.url(), auto_mode: true, ..Default::default() };
    common::register_eks_as(&world.cluster, REGION, &eks).await;

    let dry = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    assert!(dry.stdout.contains("EKS Auto Mode is enabled on"), "the plan says what EKS said:\n{}", dry.stdout);
    assert!(
        dry.stdout.contains("Left alone (not this cluster's self-managed Karpenter's)")
            && dry.stdout.contains("NodePool/general-purpose (EKS Auto Mode's)"),
        "the plan names what it leaves alone:\n{}",
        dry.stdout
    );

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean");

    // this controller's compute is gone
    let ours = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(ours.values().all(|s| *s == InstanceState::Terminated), "{ours:?}");
    let pools: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodepool_resource());
    let left: Vec<String> =
        pools.list(&ListParams::default()).await.unwrap().items.into_iter().filter_map(|p| p.metadata.name).collect();
    assert_eq!(left, ["general-purpose", "system"], "only Auto Mode's built-in pools stay");

    // Auto Mode's is as it was: pools unfenced, claims and nodes neither deleted nor cordoned,
    // its pods never evicted, its instances running
    assert_eq!(auto_mode_state(&b, &world).await, before);
    let auto = states(&b.aws, &auto_instances).await;
    assert!(auto.values().all(|s| *s == InstanceState::Running), "Auto Mode's instances: {auto:?}");

    // the report names each piece it left alone, and whose it is
    let not_ours: BTreeMap<String, String> = run.report["not_ours"]
        .as_array()
        .unwrap_or_else(|| panic!("no not_ours in the report:\n{}", run.dump()))
        .iter()
        .map(|f| (format!("{}/{}", f["kind"].as_str().unwrap(), f["name"].as_str().unwrap()), f["owner"].to_string()))
        .collect();
    assert_eq!(not_ours.get("NodePool/general-purpose").map(String::as_str), Some("\"eks-auto-mode\""));
    assert_eq!(not_ours.get("NodePool/system").map(String::as_str), Some("\"eks-auto-mode\""));
    for n in &world.auto_mode_nodes {
        assert!(not_ours.contains_key(&format!("NodeClaim/{}", n.nodeclaim)), "{not_ours:?}");
        assert!(not_ours.contains_key(&format!("Node/{}", n.node)), "{not_ours:?}");
    }
    sim.shutdown().await;
    b.server.shutdown().await;
}
