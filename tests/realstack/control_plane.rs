//! The rest of the real control plane: kube-controller-manager and kube-scheduler of the same
//! release, and kwok standing in for the kubelets. Workloads get pods, the scheduler binds them,
//! kwok runs them, and the disruption controller computes the budgets evictions are held to.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Client;
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams, PostParams};
use realstack::{PodExit, RealStack};
use serde_json::json;

pub(crate) async fn full_stack(context: &str) -> RealStack {
    RealStack::start_full(context, &super::shipped_rbac_yaml()).await.unwrap_or_else(|e| panic!("{e}"))
}

/// Node objects labelled `group=<group>`, with room for `pods` pods each; kwok makes them Ready.
async fn create_nodes(client: &Client, group: &str, count: usize, pods: u32) -> Vec<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut names = Vec::new();
    for i in 0..count {
        let name = format!("{group}-{i}");
        let resources = json!({"cpu": "4", "memory": "8Gi", "pods": pods.to_string()});
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"group": group, "kubernetes.io/hostname": name}},
            "status": {"allocatable": resources, "capacity": resources},
        }))
        .unwrap();
        nodes.create(&PostParams::default(), &node).await.unwrap();
        names.push(name);
    }
    names
}

async fn create_namespace(client: &Client, name: &str) {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns =
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})).unwrap();
    api.create(&PostParams::default(), &ns).await.unwrap();
}

/// A Deployment of `replicas` pods of app `name`, held to the nodes of `group`.
async fn create_deployment(client: &Client, ns: &str, name: &str, group: &str, replicas: i32) {
    create_deployment_with_grace(client, ns, name, group, replicas, 1).await
}

/// [`create_deployment`] with pods of `grace` seconds' termination grace period.
async fn create_deployment_with_grace(client: &Client, ns: &str, name: &str, group: &str, replicas: i32, grace: i64) {
    let api: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), ns);
    let labels = json!({"app": name});
    let d = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "nodeSelector": {"group": group},
                "terminationGracePeriodSeconds": grace,
                "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]}}},
    }))
    .unwrap();
    api.create(&PostParams::default(), &d).await.unwrap();
}

fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

/// Waits until `want` pods of app `app` are Running, and returns them.
async fn running_pods(client: &Client, ns: &str, app: &str, want: usize, s: &RealStack) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let list = pods.list(&ListParams::default().labels(&format!("app={app}"))).await.unwrap();
        let running: Vec<Pod> = list.items.iter().filter(|p| phase(p) == "Running").cloned().collect();
        if running.len() >= want {
            return running;
        }
        if Instant::now() > deadline {
            let states: Vec<(Option<String>, String, Option<String>)> = list
                .items
                .iter()
                .map(|p| {
                    (p.metadata.name.clone(), phase(p).to_string(), p.spec.as_ref().and_then(|s| s.node_name.clone()))
                })
                .collect();
            panic!(
                "{want} pods of {app} not Running after 90s: {states:?}\nkube-scheduler:\n{}\nkube-controller-manager:\n{}\nkwok:\n{}",
                s.log_tail("kube-scheduler"),
                s.log_tail("kube-controller-manager"),
                s.log_tail("kwok")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_is_scheduled_onto_kwok_nodes_and_its_pods_run() {
    let t = Instant::now();
    let s = full_stack("realstack-schedule").await;
    eprintln!("full control plane ready in {:?}", t.elapsed());
    let admin = s.admin_client().await.unwrap();
    // two pods fit on a node, so three replicas need both nodes
    let names = create_nodes(&admin, "sched", 2, 2).await;
    create_namespace(&admin, "sched").await;
    create_deployment(&admin, "sched", "web", "sched", 3).await;
    let running = running_pods(&admin, "sched", "web", 3, &s).await;
    eprintln!("3 pods Running {:?} after the start", t.elapsed());

    let mut bound: Vec<String> =
        running.iter().map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default()).collect();
    bound.sort();
    bound.dedup();
    assert_eq!(bound, names, "the scheduler spread the pods over both nodes, as their room forces");
    for p in &running {
        let status = p.status.as_ref().unwrap();
        assert!(status.pod_ip.is_some(), "kwok gives a running pod an IP: {status:?}");
        let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
        assert!(ready, "kwok reports the pod Ready: {status:?}");
        // the ReplicaSet controller made the pod, and the garbage collector's owner is set
        let owner = p.metadata.owner_references.as_ref().and_then(|o| o.first()).map(|o| o.kind.clone());
        assert_eq!(owner.as_deref(), Some("ReplicaSet"));
    }
    // the ReplicaSet controller acted as its own ServiceAccount (--use-service-account-credentials),
    // which kube-controller-manager made for it in kube-system
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(admin.clone(), "kube-system");
    assert!(accounts.get_opt("replicaset-controller").await.unwrap().is_some(), "no per-controller identity");
    // kwok keeps the nodes Ready
    let nodes: Api<Node> = Api::all(admin);
    for n in &names {
        let node = nodes.get(n).await.unwrap();
        let ready = node.status.and_then(|s| s.conditions).unwrap_or_default();
        assert!(ready.iter().any(|c| c.type_ == "Ready" && c.status == "True"), "{n}: {ready:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_graceful_pod_exit_an_evicted_pod_goes_when_its_grace_period_is_over_and_not_before() {
    let s = RealStack::start_full_with("realstack-grace", &super::shipped_rbac_yaml(), PodExit::AfterGracePeriod)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = s.admin_client().await.unwrap();
    create_nodes(&admin, "grace", 1, 4).await;
    create_namespace(&admin, "grace").await;
    create_deployment_with_grace(&admin, "grace", "slow", "grace", 1, 8).await;
    let running = running_pods(&admin, "grace", "slow", 1, &s).await;
    let name = running[0].metadata.name.clone().unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "grace");
    pods.evict(&name, &EvictParams::default()).await.unwrap();
    let asked = Instant::now();
    while pods.get_opt(&name).await.unwrap().is_some() {
        assert!(asked.elapsed() < Duration::from_secs(60), "kwok never deleted {name}:\n{}", s.log_tail("kwok"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // the deletionTimestamp is kept to the second, so the pod may go up to a second early
    let took = asked.elapsed();
    assert!(took >= Duration::from_secs(7), "{name} deleted {took:?} after its eviction, inside its 8 s grace period");
    // kwok still runs pods: the ReplicaSet's replacement
    running_pods(&admin, "grace", "slow", 1, &s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disruption_controller_computes_a_budget_and_the_server_refuses_an_eviction_beyond_it() {
    let s = full_stack("realstack-pdb").await;
    let admin = s.admin_client().await.unwrap();
    let names = create_nodes(&admin, "pdb", 2, 4).await;
    create_namespace(&admin, "pdb").await;
    create_deployment(&admin, "pdb", "web", "pdb", 3).await;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(admin.clone(), "pdb");
    let pdb = serde_json::from_value(json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "web", "namespace": "pdb"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}},
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    let running = running_pods(&admin, "pdb", "web", 3, &s).await;

    // the real disruption controller's arithmetic: 3 healthy, 2 desired, 1 disruption allowed
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        let got = pdbs.get("web").await.unwrap();
        let generation = got.metadata.generation;
        let status = got.status.unwrap_or_default();
        if status.observed_generation == generation && status.current_healthy == 3 {
            break status;
        }
        assert!(Instant::now() < deadline, "the PDB's status was not computed: {status:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!((status.desired_healthy, status.expected_pods, status.disruptions_allowed), (2, 3, 1), "{status:?}");

    // cordoned nodes keep the evicted pod's replacement Pending, so the budget stays spent
    let nodes: Api<Node> = Api::all(admin.clone());
    for n in &names {
        nodes.patch(n, &PatchParams::default(), &Patch::Merge(json!({"spec": {"unschedulable": true}}))).await.unwrap();
    }
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "pdb");
    let first = running[0].metadata.name.clone().unwrap();
    pods.evict(&first, &EvictParams::default()).await.unwrap_or_else(|e| panic!("the allowed eviction: {e}"));
    let second = running[1].metadata.name.clone().unwrap();
    let asked = Instant::now();
    let err = pods.evict(&second, &EvictParams::default()).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 429), "an eviction beyond the budget: {err}");
    // the refusal reaches the caller as it happens, as it reaches the tool (no client retries)
    assert!(asked.elapsed() < Duration::from_secs(5), "the 429 came after {:?}", asked.elapsed());
    // and the budget the controller recomputes once the evicted pod is gone stays at 0
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = pdbs.get("web").await.unwrap().status.unwrap_or_default();
        let pending = pods
            .list(&ListParams::default().labels("app=web"))
            .await
            .unwrap()
            .items
            .iter()
            .filter(|p| phase(p) == "Pending")
            .count();
        if status.current_healthy == 2 && pending == 1 {
            assert_eq!(status.disruptions_allowed, 0, "{status:?}");
            break;
        }
        assert!(Instant::now() < deadline, "no replacement Pending with 2 healthy: {status:?}, {pending} pending");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let err = pods.evict(&second, &EvictParams::default()).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 429), "still beyond the budget: {err}");
}

/// After a teardown: the real ReplicaSet controller has recreated every evicted pod of the world's
/// Deployments, and with no Karpenter node left (and the managed nodes not theirs) each stays
/// Pending, bound to no node.
pub(crate) async fn assert_evicted_deployments_wait_pending(client: &Client, world: &sandbox_sim::World) {
    let deployments: Vec<_> = world.workloads.iter().filter(|w| w.kind == "Deployment").collect();
    assert!(!deployments.is_empty(), "the world has Deployments");
    let deadline = Instant::now() + Duration::from_secs(60);
    for w in deployments {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &w.namespace);
        loop {
            let list = pods.list(&ListParams::default().labels(&format!("app={}", w.name))).await.unwrap();
            let waiting = list
                .items
                .iter()
                .filter(|p| {
                    phase(p) == "Pending"
                        && p.metadata.deletion_timestamp.is_none()
                        && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none()
                })
                .count();
            if waiting == w.replicas && list.items.len() == w.replicas {
                break;
            }
            let states: Vec<(Option<String>, String, Option<String>)> = list
                .items
                .iter()
                .map(|p| {
                    (p.metadata.name.clone(), phase(p).to_string(), p.spec.as_ref().and_then(|s| s.node_name.clone()))
                })
                .collect();
            assert!(
                Instant::now() < deadline,
                "{}/{}: want {} recreated pods Pending on no node, got {states:?}",
                w.namespace,
                w.name,
                w.replicas
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
