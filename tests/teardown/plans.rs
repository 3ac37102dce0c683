//! End to end, beyond the default plan: the delegate plan with a healthy and with a broken
//! controller, why the fence step exists, and Karpenter 1.0.x (the CRD conversion webhook).
//! The real binary runs through a kubeconfig against the sandbox API server and LocalStack.

use std::path::PathBuf;
use std::time::Duration;

use crate::common::e2e::{
    Bed, Consent, REGION, Run, assert_torn_down, bed, bed_with, controller_through_the_drain, count,
    default_without_fence, legacy_v1beta1_pool, real_crds, scale_controller, small_world, states, teardown,
    untouchable_nodes,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::aws::ec2::InstanceScope;
use karpenter_teardown::k8s;
use kube::api::{Api, DynamicObject, ListParams};
use kube::core::{ApiResource, GroupVersionKind};
use sandbox_apiserver::ServerOptions;
use sandbox_sim::{KarpenterVersion, SimController, SimSettings, generate, naming};
use serde_json::Value;

const MANIFEST: &str = env!("CARGO_MANIFEST_DIR");

/// Writes a plan file into the bed's temp dir.
fn plan_file(b: &Bed, name: &str, text: &str) -> PathBuf {
    let p = b.dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The shipped delegate plan with a shorter wait for Karpenter (15m is too long for a test).
fn delegate_waiting(deadline: &str) -> String {
    let text = std::fs::read_to_string(format!("{MANIFEST}/plans/delegate.toml")).unwrap();
    let wait = "deadline = \"15m\"\non_deadline = \"continue\"";
    assert!(text.contains(wait), "plans/delegate.toml changed: update this test");
    text.replacen(wait, &format!("deadline = \"{deadline}\"\non_deadline = \"continue\""), 1)
}

/// The report record of a step that is not expanded per object.
fn step<'a>(run: &'a Run, id: &str) -> &'a Value {
    run.report["steps"]
        .as_array()
        .and_then(|s| s.iter().find(|r| r["step"] == id && r.get("object").is_none()))
        .unwrap_or_else(|| panic!("no record of step {id} in the report: {}", run.report))
}

/// The results of a per-object step's tasks.
fn task_results(run: &Run, id: &str) -> Vec<String> {
    run.report["steps"]
        .as_array()
        .map(|s| s.iter().filter(|r| r["step"] == id).map(|r| r["result"].as_str().unwrap_or("").to_string()).collect())
        .unwrap_or_default()
}

fn explain(run: &Run) -> String {
    format!("exit {}\nstdout:\n{}\nstderr:\n{}\nreport:\n{:#}", run.code, run.stdout, run.stderr, run.report)
}

fn sim_settings(cluster: &str, version: KarpenterVersion) -> SimSettings {
    SimSettings { version, time_scale: 0.02, ..SimSettings::new(cluster, REGION) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegate_plan_lets_a_healthy_karpenter_do_the_work() {
    let s = small_world("plans-delegate", 5);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = SimController::start(b.client.clone(), b.cloud.clone(), sim_settings(&world.cluster, world.version));
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", "delegate"]).await;
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(run.report["outcome"], "clean");
    assert_eq!(run.report["plan"], "delegate");
    let wait = step(&run, "wait-nodeclaims-gone");
    assert_eq!(wait["result"], "done");
    assert!(
        wait["detail"].as_str().unwrap_or_default().starts_with("Karpenter removed every NodeClaim"),
        "Karpenter did not finish before the deadline: {wait}"
    );
    // the fallback found nothing to do: every machine was already gone
    assert!(task_results(&run, "discharge-finalizers").iter().all(|r| r == "skipped"), "{}", explain(&run));
    assert!(task_results(&run, "drain").iter().all(|r| r == "skipped"), "{}", explain(&run));
    let stats = sim.stats();
    sim.shutdown().await;
    assert!(stats.instances_terminated >= world.nodes.len() as u64, "Karpenter terminated the instances: {stats:?}");
    assert!(stats.finalizers_removed >= 2 * world.nodes.len() as u64, "Karpenter released its finalizers: {stats:?}");
    assert_eq!(stats.nodeclaims_launched, 0, "the fence kept Karpenter from launching replacements");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegate_plan_falls_back_when_karpenter_is_broken() {
    let s = small_world("plans-fallback", 5);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    // a controller that exists but does nothing: the NodeClaims never go by themselves
    let sim = SimController::start(b.client.clone(), b.cloud.clone(), sim_settings(&world.cluster, world.version));
    scale_controller(&b.client, 0).await;
    let before = untouchable_nodes(&b.client, &world).await;
    let plan = plan_file(&b, "delegate-3s.toml", &delegate_waiting("3s"));

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan.to_str().unwrap()]).await;
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(run.report["outcome"], "clean");
    let wait = step(&run, "wait-nodeclaims-gone");
    assert_eq!(wait["result"], "done", "on_deadline = continue lets the fallback run: {wait}");
    let detail = wait["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("NodeClaim(s) left after 3s") && detail.contains("take over"), "{wait}");
    let discharged = task_results(&run, "discharge-finalizers");
    assert_eq!(discharged.len(), world.nodes.len());
    assert!(discharged.iter().all(|r| r == "done"), "the fallback terminated every machine: {}", explain(&run));
    let stats = sim.stats();
    sim.shutdown().await;
    assert_eq!(stats.instances_terminated, 0, "the broken controller did nothing: {stats:?}");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// Per machine found late, the steps of its tasks (sorted), each marked with why it was late.
fn late_tasks(run: &Run) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut late: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for t in run.report["steps"].as_array().into_iter().flatten() {
        if let Some(why) = t["found_late"].as_str() {
            assert!(why.contains("launched during the run") && why.contains("found by"), "{t}");
            late.entry(t["object"].as_str().unwrap_or_default().to_string())
                .or_default()
                .push(t["step"].as_str().unwrap_or_default().to_string());
        }
    }
    late.values_mut().for_each(|v| v.sort());
    late
}

/// A world whose NodePools may grow, a live controller, and pods that take a moment to terminate
/// (server time scale 0.3: a 1 s grace period is 0.3 s) so that evicted pods' replacements are
/// Pending long enough for the controller (pending grace 20 ms) to react.
async fn growing_world(prefix: &str) -> (Bed, sandbox_sim::World, SimController) {
    grown(small_world(prefix, 4)).await
}

/// [`growing_world`] of the spec `s`.
async fn grown(s: sandbox_sim::WorldSpec) -> (Bed, sandbox_sim::World, SimController) {
    assert_eq!(s.pool_cpu_limit, None, "the pools must allow growth");
    let b = bed_with(&s.cluster, ServerOptions { time_scale: 0.3, ..ServerOptions::default() }).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = SimController::start(b.client.clone(), b.cloud.clone(), sim_settings(&world.cluster, world.version));
    (b, world, sim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_fence_karpenter_chases_the_drain() {
    let (b, world, sim) = growing_world("plans-nofence").await;
    let before = untouchable_nodes(&b.client, &world).await;
    let plan = plan_file(&b, "no-fence.toml", &default_without_fence());

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan.to_str().unwrap()]).await;
    let stats = sim.stats();
    sim.shutdown().await;
    assert!(stats.nodeclaims_launched > 0, "evicted pods made Karpenter launch replacements: {stats:?}");
    // The replacements are not in the run's inventory. The step that finds them (the classes'
    // deletion, or verification) hands them to the executor: each gets the plan's own machine
    // steps as tasks, marked as found late, before the class goes; the run ends clean.
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(run.report["outcome"], "clean");
    let late = late_tasks(&run);
    assert!(!late.is_empty(), "the report lists the machines launched during the run: {}", explain(&run));
    assert!(late.len() as u64 <= stats.nodeclaims_launched);
    for (machine, steps) in &late {
        assert_eq!(steps, &["discharge-finalizers", "drain"], "{machine}: the plan's machine steps: {}", explain(&run));
    }
    assert!(
        !run.report["steps"].as_array().into_iter().flatten().any(|t| t["step"] == "sweep"),
        "no task outside the plan's steps: {}",
        explain(&run)
    );
    assert!(
        !run.report["blockers"].as_array().into_iter().flatten().any(|b| b["kind"] == "nodeclaim"),
        "a machine found late is a task, not a blocker"
    );
    let live = b.aws.ec2.cluster_instances(&world.cluster, InstanceScope::KarpenterLive).await.unwrap();
    assert!(live.is_empty(), "replacement instances left running: {live:?}");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// A machine found late runs the plan's own drain, held by the plan's own deadline and
/// escalation. Every workload's budget lets one pod go at a time: the unfenced controller moves
/// each evicted pod to a machine it launches during the drain, so the inventoried drains finish;
/// once the controller is gone, a late machine's drain evicts one pod of a workload, whose
/// replacement can run nowhere, and the budget holds the next at the plan's deadline (`fail`:
/// blocked). The blocked machine is not released, its instance runs, and its class stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_holding_a_machine_found_late_blocks_its_drain_with_the_plans_escalation() {
    let spec = sandbox_sim::WorldSpec { pdb_max_unavailable: Some(1), ..small_world("plans-late-pdb", 4) };
    let (b, world, sim) = grown(spec).await;
    let text = default_without_fence();
    assert!(text.contains("deadline = \"10m\""), "the drain's deadline in plans/default.toml changed");
    let plan = plan_file(&b, "no-fence-20s.toml", &text.replace("deadline = \"10m\"", "deadline = \"20s\""));

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan.to_str().unwrap()]).await;
    let stats = sim.stats();
    sim.shutdown().await;
    assert!(stats.nodeclaims_launched > 0, "evicted pods made the controller launch: {stats:?}");
    assert_eq!(run.code, 5, "blocked: {}", explain(&run));
    let tasks: Vec<&Value> = run.report["steps"].as_array().into_iter().flatten().collect();
    let inventoried: std::collections::BTreeSet<&str> = world.nodes.iter().map(|n| n.nodeclaim.as_str()).collect();
    // every inventoried machine's drain finished: the budget let each pod go once its
    // replacement ran on a machine the controller launched
    let drained: Vec<&&Value> = tasks
        .iter()
        .filter(|t| t["step"] == "drain" && inventoried.contains(t["object"].as_str().unwrap_or_default()))
        .collect();
    assert_eq!(drained.len(), world.nodes.len(), "{}", explain(&run));
    assert!(drained.iter().all(|t| t["result"] == "done"), "{}", explain(&run));
    // the late machines' drains are the plan's drain step's tasks; at least one is held
    let late = late_tasks(&run);
    assert!(!late.is_empty(), "{}", explain(&run));
    let blocked: Vec<&&Value> = tasks.iter().filter(|t| t["step"] == "drain" && t["result"] == "blocked").collect();
    assert!(!blocked.is_empty(), "{}", explain(&run));
    for t in &blocked {
        let machine = t["object"].as_str().unwrap_or_default();
        assert!(t["found_late"].is_string(), "only a late machine's drain is held: {t}");
        let detail = t["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("after 20s") && detail.contains("(PDB "),
            "held by a budget at the plan's deadline: {t}"
        );
        assert!(
            !tasks.iter().any(|r| r["step"] == "discharge-finalizers" && r["object"] == machine),
            "the blocked machine is not released: {}",
            explain(&run)
        );
        let claim =
            Api::<DynamicObject>::all_with(b.client.clone(), &k8s::nodeclaim_resource()).get(machine).await.unwrap();
        let provider = claim.data.pointer("/status/providerID").and_then(Value::as_str).unwrap_or_default();
        let id = provider.rsplit('/').next().unwrap_or_default().to_string();
        let state = states(&b.aws, std::slice::from_ref(&id)).await;
        assert_eq!(state.get(&id), Some(&InstanceState::Running), "{machine}: {state:?}");
    }
    assert!(count(&b.client, &k8s::nodeclass_resource()).await > 0, "a class in use was deleted");
    b.server.shutdown().await;
}

/// Machines launched once the run has taken its inventory (here by the test, as an unfenced
/// controller or a launch in flight would) are drained together, as the inventory's are: their
/// drains are tasks of the plan's drain step, run at its concurrency, each held by its own budget
/// until the plan's deadline and then blocked by its escalation. Run one after the other, three
/// drains of 15 s would take 45 s and never overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drains_of_machines_found_late_run_together_under_the_plans_deadline() {
    // evicted pods take 8 s to stop: the inventory's drains last long enough for the machines
    // below to be launched after the inventory, before the classes' deletion looks for users
    let spec = sandbox_sim::WorldSpec { grace_periods: vec![(8, 1)], ..small_world("plans-late-together", 2) };
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let text = std::fs::read_to_string(format!("{MANIFEST}/plans/default.toml")).unwrap();
    assert!(text.contains("deadline = \"10m\""), "the drain's deadline in plans/default.toml changed");
    let plan = plan_file(&b, "drain-15s.toml", &text.replace("deadline = \"10m\"", "deadline = \"15s\""));
    const LATE: usize = 3;

    let launch_late = async {
        // the cordon step follows the inventory: once a node of the world is cordoned, a machine
        // launched now is one the run has not seen
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(b.client.clone());
        let cordoned = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let any = nodes.list(&ListParams::default()).await.unwrap().items.iter().any(|n| {
                    world.nodes.iter().any(|w| Some(&w.node) == n.metadata.name.as_ref())
                        && n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
                });
                if any {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(cordoned.is_ok(), "the run never cordoned a node");
        // each machine's pod and its budget first: the pod runs as soon as its node does, so
        // no drain can find the node empty
        let names: Vec<String> = (0..LATE).map(|_| sandbox_sim::world::fresh_node_name(&world.region)).collect();
        for (i, node) in names.iter().enumerate() {
            pinned_behind_a_closed_budget(&b.client, &format!("pinned-{i}"), node).await;
        }
        let pool = &world.nodes[0].pool;
        let launched = futures::future::join_all(
            names.iter().map(|n| sandbox_sim::world::launch_machine(&world, &b.client, &b.cloud, pool, n, 20)),
        )
        .await;
        let machines: Vec<sandbox_sim::world::GeneratedNode> = launched.into_iter().map(Result::unwrap).collect();
        for (i, m) in machines.iter().enumerate() {
            running_on(&b.client, &format!("pinned-{i}"), &m.node).await;
        }
        machines
    };
    let args = ["--plan", plan.to_str().unwrap()];
    let (run, machines) = tokio::join!(teardown(&b, &world.cluster, Consent::Yes, &args), launch_late);
    assert_eq!(machines.len(), LATE);
    assert_eq!(run.code, 5, "blocked: {}", explain(&run));
    let late = late_tasks(&run);
    let drains: Vec<&Value> = machines
        .iter()
        .map(|m| {
            assert!(late.contains_key(&m.nodeclaim), "{} is not listed as found late: {}", m.nodeclaim, explain(&run));
            let mut of_machine = run.report["steps"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["step"] == "drain" && t["object"] == m.nodeclaim.as_str());
            let drain = of_machine.next().unwrap_or_else(|| panic!("no drain of {}: {}", m.nodeclaim, explain(&run)));
            assert!(of_machine.next().is_none(), "one drain task per machine: {}", explain(&run));
            drain
        })
        .collect();
    assert_eq!(drains.len(), LATE);
    for t in &drains {
        assert_eq!(t["result"], "blocked", "{t}");
        assert!(t["found_late"].is_string(), "{t}");
        let detail = t["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("after 15s") && detail.contains("(PDB "),
            "held by its budget at the plan's deadline: {t}"
        );
    }
    let at = |t: &Value, field: &str| humantime::parse_rfc3339_weak(t[field].as_str().unwrap()).unwrap();
    let last_start = drains.iter().map(|t| at(t, "started")).max().unwrap();
    let first_end = drains.iter().map(|t| at(t, "finished")).min().unwrap();
    assert!(last_start < first_end, "the late machines' drains ran one after another: {drains:#?}");
    // blocked, so not released: each late machine's claim and running instance stay
    let ids: Vec<String> = machines.iter().map(|m| m.instance_id.clone()).collect();
    let state = states(&b.aws, &ids).await;
    assert_eq!(state.len(), LATE);
    assert!(state.values().all(|s| *s == InstanceState::Running), "{state:?}");
    let claims = Api::<DynamicObject>::all_with(b.client.clone(), &k8s::nodeclaim_resource());
    for m in &machines {
        assert!(claims.get_opt(&m.nodeclaim).await.unwrap().is_some(), "{} was released", m.nodeclaim);
    }
    b.server.shutdown().await;
}

/// A one-replica Deployment `name` in `default`, pinned to `node`, whose PodDisruptionBudget
/// allows no eviction.
async fn pinned_behind_a_closed_budget(client: &kube::Client, name: &str, node: &str) {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let pp = kube::api::PostParams::default();
    let deployment: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.9"}]
                }
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), "default").create(&pp, &deployment).await.unwrap();
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": name}}}
    }))
    .unwrap();
    Api::<PodDisruptionBudget>::namespaced(client.clone(), "default").create(&pp, &pdb).await.unwrap();
}

/// Returns once the pod of Deployment `name` in `default` runs on `node`.
async fn running_on(client: &kube::Client, name: &str, node: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let lp = ListParams::default().labels(&format!("app={name}"));
    let running = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let items = pods.list(&lp).await.unwrap().items;
            if items.iter().any(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(running.is_ok(), "the pod of {name} never ran on {node}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_fence_karpenter_launches_nothing_under_the_same_pressure() {
    let (b, world, sim) = growing_world("plans-fence").await;
    let before = untouchable_nodes(&b.client, &world).await;
    let text = std::fs::read_to_string(format!("{MANIFEST}/plans/default.toml")).unwrap();
    let plan = plan_file(&b, "fenced.toml", &controller_through_the_drain(&text));

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan.to_str().unwrap()]).await;
    let stats = sim.stats();
    sim.shutdown().await;
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(stats.nodeclaims_launched, 0, "the fence kept Karpenter from launching: {stats:?}");
    assert!(
        !run.report["blockers"].as_array().into_iter().flatten().any(|x| x["kind"] == "nodeclaim"),
        "{}",
        explain(&run)
    );
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// The shipped default plan with one drain at a time (nodes wait their turn, as with a
/// concurrency below the node count on a large cluster).
fn default_sequential() -> String {
    let text = std::fs::read_to_string(format!("{MANIFEST}/plans/default.toml")).unwrap();
    let drain = "after = [\"cordon\"]\ndescription = \"Cordon each Karpenter node and evict its pods, respecting \
                 PodDisruptionBudgets.\"\n[step.params]\ndeadline = \"10m\"\non_deadline = \"fail\"\nconcurrency = 5000";
    assert!(text.contains(drain), "plans/default.toml changed: update this test");
    text.replacen(drain, &drain.replace("concurrency = 5000", "concurrency = 1"), 1)
        .replace("name = \"default\"", "name = \"sequential\"")
}

/// Nodes with room to spare (real nodes rarely run full), drained one at a time. Returns the
/// bed, the world and the number of workload pods on Karpenter nodes at the start.
async fn roomy_world(prefix: &str) -> (Bed, sandbox_sim::World, u64) {
    let mut s = small_world(prefix, 5);
    s.max_pods_per_node = Some(s.pods_per_node * 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    (b, world, (s.nodes * s.pods_per_node) as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_cordon_step_every_pod_is_evicted_exactly_once() {
    let (b, world, pods) = roomy_world("plans-cordon").await;
    let before = untouchable_nodes(&b.client, &world).await;
    let plan = plan_file(&b, "cordon.toml", &default_sequential());
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan.to_str().unwrap()]).await;
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(b.server.requests().count("evict", "pods"), pods, "{}", explain(&run));
    assert_eq!(step(&run, "cordon")["result"], "done", "{}", explain(&run));
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// Installs Karpenter 1.0.14's own CRDs (served v1 and v1beta1, conversion through the
/// controller's webhook) before the generator, which keeps CRDs that exist.
fn karpenter_resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// Every Karpenter kind at both served versions.
fn all_versions() -> Vec<ApiResource> {
    let mut out = Vec::new();
    for v in ["v1", "v1beta1"] {
        out.push(karpenter_resource("karpenter.sh", v, "NodePool", "nodepools"));
        out.push(karpenter_resource("karpenter.sh", v, "NodeClaim", "nodeclaims"));
        out.push(karpenter_resource("karpenter.k8s.aws", v, "EC2NodeClass", "ec2nodeclasses"));
    }
    out
}

async fn conversion_strategies(client: &kube::Client) -> Vec<String> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut out = Vec::new();
    for name in ["nodepools.karpenter.sh", "nodeclaims.karpenter.sh", "ec2nodeclasses.karpenter.k8s.aws"] {
        let crd = api.get(name).await.unwrap();
        out.push(crd.spec.conversion.map(|c| c.strategy).unwrap_or_default());
    }
    out
}

async fn wait_controller_pods_gone(client: &kube::Client) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), naming::KARPENTER_NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/name=karpenter");
    for _ in 0..200 {
        if pods.list(&lp).await.unwrap().items.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the karpenter controller's pods did not go");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn karpenter_1_0_default_plan_leaves_nothing_unreachable() {
    let s = sandbox_sim::WorldSpec {
        version: KarpenterVersion::V1_0,
        karpenter_crds: Some(real_crds(KarpenterVersion::V1_0)),
        ..small_world("plans-v10", 5)
    };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    assert_eq!(conversion_strategies(&b.client).await, ["Webhook"; 3]);
    let sim = SimController::start(b.client.clone(), b.cloud.clone(), sim_settings(&world.cluster, world.version));
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    sim.shutdown().await;
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(run.report["outcome"], "clean");
    let removed = step(&run, "remove-controller");
    assert!(
        removed["detail"].as_str().unwrap_or_default().contains("conversion webhook removed from 3 Karpenter CRD(s)"),
        "{removed}"
    );
    assert_torn_down(&b, &world, &before).await;
    assert_eq!(conversion_strategies(&b.client).await, ["None"; 3]);
    // with the controller gone, every kind answers at every served version
    for ar in all_versions() {
        let api: Api<DynamicObject> = Api::all_with(b.client.clone(), &ar);
        let list = api.list(&ListParams::default()).await;
        assert!(list.is_ok_and(|l| l.items.is_empty()), "{} at {}", ar.plural, ar.api_version);
    }
    b.server.shutdown().await;
}

/// A Karpenter 1.0.x world of one machine, one pool and one class.
fn one_machine_1_0(prefix: &str) -> sandbox_sim::WorldSpec {
    sandbox_sim::WorldSpec {
        version: KarpenterVersion::V1_0,
        karpenter_crds: Some(real_crds(KarpenterVersion::V1_0)),
        node_pools: 1,
        node_classes: 1,
        decoys: 0,
        ..small_world(prefix, 1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversion_needs_the_webhook_until_the_crds_stop_using_it() {
    let s = one_machine_1_0("plans-conv");
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let v1 = Api::<DynamicObject>::all_with(b.client.clone(), &k8s::nodepool_resource());

    // the controller is up: conversion works, and an object written at v1beta1 stays stored so
    let at_v1beta1 = karpenter_resource("karpenter.sh", "v1beta1", "NodePool", "nodepools");
    assert_eq!(
        Api::<DynamicObject>::all_with(b.client.clone(), &at_v1beta1)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    let v1beta1 = legacy_v1beta1_pool(&b.client, &world.node_classes[0].name).await;
    assert_eq!(v1.list(&ListParams::default()).await.unwrap().items.len(), 2);

    scale_controller(&b.client, 0).await;
    wait_controller_pods_gone(&b.client).await;
    let status = |r: Result<_, kube::Error>| match r {
        Err(kube::Error::Api(s)) => (s.code, s.message),
        Ok(_) => (200, String::new()),
        Err(e) => panic!("{e}"),
    };
    let no_endpoints = "no endpoints available for service \"karpenter\"";
    let (code, msg) = status(v1beta1.list(&ListParams::default()).await.map(|_| ()));
    assert_eq!(code, 500, "{msg}");
    assert!(
        msg.contains("conversion webhook for karpenter.sh/v1beta1, Kind=NodePool failed") && msg.contains(no_endpoints),
        "{msg}"
    );
    // at the storage version only the object stored at v1beta1 needs the webhook
    let (code, msg) = status(v1.list(&ListParams::default()).await.map(|_| ()));
    assert_eq!(code, 500, "{msg}");
    assert!(msg.contains(no_endpoints), "{msg}");
    assert_eq!(status(v1.get("legacy").await.map(|_| ())).0, 500);
    assert_eq!(status(v1.get(&world.node_pools[0]).await.map(|_| ())).0, 200);
    assert_eq!(count(&b.client, &k8s::nodeclaim_resource()).await, 1, "NodeClaims are all stored at v1");

    // without consent the tool cannot take inventory: it changes nothing and says how to get out
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 1, "{}", explain(&run));
    assert!(run.stderr.contains("strategy") && run.stderr.contains("nodepools.karpenter.sh"), "{}", explain(&run));
    assert_eq!(status(v1beta1.list(&ListParams::default()).await.map(|_| ())).0, 500, "a dry run changed the CRDs");

    // with --yes it proves identity from the nodes, turns the dead webhook off and finishes
    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", explain(&run));
    let crds: Api<CustomResourceDefinition> = Api::all(b.client.clone());
    for name in ["nodepools.karpenter.sh", "nodeclaims.karpenter.sh", "ec2nodeclasses.karpenter.k8s.aws"] {
        let crd = crds.get(name).await.unwrap();
        assert_eq!(crd.spec.conversion.map(|c| c.strategy).as_deref(), Some("None"), "{name}");
    }
    assert_eq!(count(&b.client, &k8s::nodepool_resource()).await, 0, "NodePools left (the v1beta1 one included)");
    assert_eq!(count(&b.client, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
    let left = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(left.values().all(|s| *s == InstanceState::Terminated), "{left:?}");
    b.server.shutdown().await;
}

/// Karpenter 1.0.x after `helm uninstall`, its objects under Argo CD and Flux: the objects cannot
/// be read until the CRDs' dead conversion webhook is turned off, but the owners' own records
/// list them, so the GitOps check refuses the run (no `--pause-gitops`) before that first write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_1_0_crd_repair_waits_for_the_gitops_check_on_what_the_owners_list() {
    let s = one_machine_1_0("plans-conv-gitops");
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    sandbox_sim::gitops::adopt(&b.client, &world, &crate::common::e2e::gitops_crds()).await.unwrap();
    // an object stored at v1beta1: unreadable once the controller is gone
    let v1beta1 = legacy_v1beta1_pool(&b.client, &world.node_classes[0].name).await;
    scale_controller(&b.client, 0).await;
    wait_controller_pods_gone(&b.client).await;
    assert!(v1beta1.list(&ListParams::default()).await.is_err(), "the webhook is not dead yet");

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 3, "{}", explain(&run));
    for owner in ["argocd/karpenter-nodepools", "flux-system/karpenter-nodeclasses"] {
        assert!(run.stderr.contains(owner), "{owner} is named: {}", explain(&run));
    }
    assert_eq!(conversion_strategies(&b.client).await, ["Webhook"; 3], "the CRDs were changed before the check");
    b.server.shutdown().await;
}

/// Karpenter 1.0.x after `helm uninstall`: the run turns the CRDs' dead conversion webhook off to
/// read the objects, and a check after that (here the blast radius: two machines, `--max-nodes
/// 1`) refuses the run: the webhook is put back exactly as it was, and the cluster is as the run
/// found it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_after_the_1_0_crd_repair_that_refuses_the_run_puts_the_webhook_back() {
    let s = sandbox_sim::WorldSpec { nodes: 2, ..one_machine_1_0("plans-conv-undo") };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let v1beta1 = legacy_v1beta1_pool(&b.client, &world.node_classes[0].name).await;
    scale_controller(&b.client, 0).await;
    wait_controller_pods_gone(&b.client).await;
    assert!(v1beta1.list(&ListParams::default()).await.is_err(), "the webhook is not dead yet");
    let crds: Api<CustomResourceDefinition> = Api::all(b.client.clone());
    let names = ["nodepools.karpenter.sh", "nodeclaims.karpenter.sh", "ec2nodeclasses.karpenter.k8s.aws"];
    let mut before = Vec::new();
    for name in names {
        before.push(serde_json::to_value(crds.get(name).await.unwrap().spec.conversion).unwrap());
    }
    assert!(before.iter().all(|c| c["strategy"] == "Webhook"), "{before:?}");

    let run = teardown(&b, &world.cluster, Consent::Yes, &["--max-nodes", "1"]).await;
    assert_eq!(run.code, 3, "refused by the blast radius: {}", explain(&run));
    assert!(run.stderr.contains("put back as it was"), "{}", explain(&run));
    let mut after = Vec::new();
    for name in names {
        after.push(serde_json::to_value(crds.get(name).await.unwrap().spec.conversion).unwrap());
    }
    assert_eq!(after, before, "the CRDs' conversion was not put back");
    assert!(v1beta1.list(&ListParams::default()).await.is_err(), "the objects are readable as they were not");
    assert_eq!(count(&b.client, &k8s::nodeclaim_resource()).await, 2, "nothing was torn down");
    let state = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(state.values().all(|s| *s == InstanceState::Running), "{state:?}");
    b.server.shutdown().await;
}

/// A plan of one's own without `verify` tears down what it says and ends `unverified` (exit 6):
/// nothing proved what is left, so it is never `clean`. Its dry run says what `skip` bypasses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_without_verify_ends_unverified_and_a_skip_policy_says_what_it_bypasses() {
    let s = small_world("e2e-unverified", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let text = std::fs::read_to_string(format!("{MANIFEST}/plans/default.toml")).unwrap();
    let start = text.find("[[step]]\nid = \"verify\"").expect("default.toml has a verify step");
    let without = text[..start].replace("name = \"default\"", "name = \"no-verify\"");
    let plan = plan_file(&b, "no-verify.toml", &without);
    let plan = plan.to_str().unwrap();

    let dry = teardown(&b, &world.cluster, Consent::DryRun, &["--plan", plan, "--on-drain-deadline", "skip"]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    assert!(
        dry.stdout.contains("Consent: at the drain deadline the drain stops and the node's instance is terminated under the pods left, their PodDisruptionBudgets bypassed"),
        "{}",
        dry.stdout
    );
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--plan", plan]).await;
    assert_eq!(run.code, 6, "{}", run.dump());
    assert_eq!(run.report["outcome"], "unverified", "{}", run.dump());
    let left = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert_eq!(left.len(), 2);
    assert!(left.values().all(|st| *st == InstanceState::Terminated), "the plan did its work: {left:?}");
    b.server.shutdown().await;
}

/// The drain of a node whose claim changed: a Node the inventory found with no NodeClaim (a
/// controller stopped between registering it and naming it on its claim) is named by a NodeClaim
/// made while it drains (the registration finished). The drain hands that claim to the executor,
/// which runs the plan's machine steps for it, marked as found late by the drain, and waits for
/// them; the run ends clean with the claim released and its instance terminated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_names_a_node_during_its_drain_joins_the_plan() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use kube::api::{Patch, PatchParams, PostParams};
    let spec = small_world("plans-late-claim", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let n = &world.nodes[0];
    let claims: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodeclaim_resource());
    let old = claims.get(&n.nodeclaim).await.unwrap();
    let finalizers = serde_json::json!({"metadata": {"finalizers": null}});
    claims.patch(&n.nodeclaim, &PatchParams::default(), &Patch::Merge(&finalizers)).await.unwrap();
    claims.delete(&n.nodeclaim, &Default::default()).await.unwrap();
    // one pod of the node is held by a budget until the claim is made
    let pods: Api<Pod> = Api::all(b.client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={}", n.node));
    let held = pods
        .list(&on_node)
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|p| p.metadata.owner_references.iter().flatten().all(|o| o.kind != "DaemonSet"));
    let held = held.expect("a workload pod on the node");
    let ns = held.metadata.namespace.clone().unwrap();
    let held_name = held.metadata.name.clone().unwrap();
    let ns_pods: Api<Pod> = Api::namespaced(b.client.clone(), &ns);
    let label = serde_json::json!({"metadata": {"labels": {"held": "until-claimed"}}});
    ns_pods.patch(&held_name, &PatchParams::default(), &Patch::Merge(&label)).await.unwrap();
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(b.client.clone(), &ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "held-until-claimed"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"held": "until-claimed"}}},
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();

    let late_claim = format!("{}-registered", n.nodeclaim);
    let register = async {
        // the drain has moved everything but the held pod
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let left = pods.list(&on_node).await.unwrap().items;
            let others = left.iter().filter(|p| p.metadata.name.as_deref() != Some(held_name.as_str())).count();
            let movable = left
                .iter()
                .filter(|p| p.metadata.owner_references.iter().flatten().all(|o| o.kind != "DaemonSet"))
                .count();
            if movable == 1 && others + 1 == left.len() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the drain never reached the held pod: {left:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let claim = serde_json::json!({
            "apiVersion": "karpenter.sh/v1",
            "kind": "NodeClaim",
            "metadata": {
                "name": late_claim,
                "labels": old.metadata.labels,
                "finalizers": ["karpenter.sh/termination"],
            },
            "spec": old.data["spec"],
        });
        let claim: DynamicObject = serde_json::from_value(claim).unwrap();
        claims.create(&PostParams::default(), &claim).await.unwrap();
        let status = serde_json::json!({"status": {"providerID": n.provider_id, "nodeName": n.node}});
        claims.patch_status(&late_claim, &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
        pdbs.delete("held-until-claimed", &Default::default()).await.unwrap();
    };
    let (run, ()) = tokio::join!(teardown(&b, &world.cluster, Consent::Yes, &[]), register);
    assert_eq!(run.code, 0, "{}", explain(&run));
    assert_eq!(run.report["outcome"], "clean");
    let late: Vec<&Value> =
        run.report["steps"].as_array().into_iter().flatten().filter(|t| t["object"] == late_claim.as_str()).collect();
    let mut steps: Vec<&str> = late.iter().filter_map(|t| t["step"].as_str()).collect();
    steps.sort();
    assert_eq!(steps, ["discharge-finalizers", "drain"], "{}", explain(&run));
    for t in &late {
        let why = t["found_late"].as_str().unwrap_or_default();
        assert!(
            why.contains("its registration finished during the run")
                && why.contains(&format!("drain[node/{}]", n.node)),
            "{t}"
        );
    }
    assert!(claims.get_opt(&late_claim).await.unwrap().is_none(), "the claim found late was released");
    let ended = states(&b.aws, std::slice::from_ref(&n.instance_id)).await;
    assert_eq!(ended.get(&n.instance_id), Some(&InstanceState::Terminated));
    b.server.shutdown().await;
}
