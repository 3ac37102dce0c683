//! `rehearse`: it writes nothing to the live cluster or AWS, with exactly the
//! read-only role it ships; and on sandbox clusters of several kinds it predicts the real run's
//! outcome, exit code and named blockers exactly and its wall time within 20%.
//!
//! The "live" cluster of these tests is a sandbox on the real clock (time scale 1.0) with short
//! grace periods, so a real teardown takes seconds; the rehearsal plays its copy faster.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::common;
use crate::common::e2e::{Bed, REGION, Run, bed_with, real_crds, run_of, scale_controller, small_world};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use sandbox_apiserver::ServerOptions;
use sandbox_apiserver::authz::Rbac;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
use sandbox_sim::{KarpenterVersion, SimController, SimSettings, World, WorldSpec, generate, naming};
use serde_json::{Value, json};

/// The rehearsal's clock in these tests: four times as fast as the "live" one.
const REHEARSAL_SCALE: &str = "0.25";

const REHEARSE_RBAC: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac-rehearse.yaml"));
const RUN_RBAC: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml"));
const RELEASE_RBAC: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac-release.yaml"));

/// Only the rehearsal's read-only role.
fn rehearse_rbac() -> Rbac {
    Rbac::from_yaml(REHEARSE_RBAC).expect("deploy/rbac-rehearse.yaml parses")
}

/// An identity bound to both shipped roles: it rehearses, then tears down.
fn both_roles() -> Rbac {
    Rbac::from_yaml(&format!("{RUN_RBAC}\n---\n{REHEARSE_RBAC}")).expect("the shipped roles parse")
}

/// A small world on the real clock: every workload pod has a 3 s grace period.
fn live_spec(prefix: &str, nodes: usize) -> WorldSpec {
    WorldSpec { grace_periods: vec![(3, 1)], ..small_world(prefix, nodes) }
}

/// The live cluster's API server, with its AWS side in a LocalStack account of its own: the real
/// run's EC2 calls then see what the rehearsal's copy sees (LocalStack answers slower the more
/// instances an account holds, and the other tests leave theirs in the default one).
async fn live_bed(cluster: &str, rbac: Rbac) -> Bed {
    let mut b =
        bed_with(cluster, ServerOptions { time_scale: 1.0, rbac: Some(rbac), ..ServerOptions::default() }).await;
    let account = account_of(cluster);
    let config = sandbox_sim::localstack::config_at(common::LOCALSTACK, REGION, &account).await;
    b.cloud = sandbox_sim::cloud::Cloud::from_config(&config);
    b.aws = karpenter_teardown::aws::AwsClients::from_config(&config).await.unwrap();
    // EKS of that account knows the cluster
    let eks = sandbox_sim::cloud::EksSpec { endpoint: b.server.url(), ..Default::default() };
    b.cloud.register_eks_cluster(cluster, &eks).await.unwrap();
    b
}

/// A 12-digit LocalStack account for a cluster (its access key), stable for the test.
fn account_of(cluster: &str) -> String {
    let h = cluster.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    format!("6{:011}", h % 100_000_000_000)
}

/// Runs `karpenter-teardown run` against the bed as the live cluster's account.
async fn real_run(b: &Bed, cluster: &str, extra: &[&str]) -> Run {
    let report = b.dir.path().join("report.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["run", "--cluster", cluster, "--region", REGION, "--kubeconfig"])
        .arg(&b.kubeconfig)
        .arg("--report")
        .arg(&report)
        .args(extra)
        .envs(common::localstack_env())
        .env("AWS_ACCESS_KEY_ID", account_of(cluster))
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

fn live_sim(b: &Bed, world: &World) -> SimController {
    SimController::start(
        b.client.clone(),
        b.cloud.clone(),
        SimSettings { version: world.version, time_scale: 1.0, ..SimSettings::new(&world.cluster, REGION) },
    )
}

/// Runs `karpenter-teardown rehearse` against the bed as a user would, with the live AWS side at
/// `aws_endpoint` and the copy in LocalStack itself.
async fn rehearse(b: &Bed, cluster: &str, aws_endpoint: &str, extra: &[&str]) -> Run {
    let report = b.dir.path().join("rehearsal.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["rehearse", "--cluster", cluster, "--region", REGION, "--time-scale", REHEARSAL_SCALE])
        .args(["--localstack", common::LOCALSTACK, "--kubeconfig"])
        .arg(&b.kubeconfig)
        .arg("--report")
        .arg(&report)
        .arg("--snapshot-out")
        .arg(b.dir.path().join("snapshot.json"))
        .args(extra)
        .envs(common::localstack_env())
        .env("AWS_ENDPOINT_URL", aws_endpoint)
        .env("AWS_ACCESS_KEY_ID", account_of(cluster))
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

fn blocker_names(blockers: &Value) -> BTreeSet<(String, String)> {
    blockers
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| {
            (b["kind"].as_str().unwrap_or_default().to_string(), b["name"].as_str().unwrap_or_default().to_string())
        })
        .collect()
}

/// Rehearses, then runs for real with the same flags, and holds the prediction to the run.
async fn prediction_matches_the_real_run(b: &Bed, cluster: &str, extra: &[&str]) -> (Value, Value) {
    let rehearsal = rehearse(b, cluster, common::ec2_proxy(), extra).await;
    let prediction = rehearsal.report["rehearsal"]["prediction"].clone();
    assert!(prediction.is_object(), "no prediction:\n{}", rehearsal.dump());
    let mut args = vec!["--yes"];
    args.extend_from_slice(extra);
    let real = real_run(b, cluster, &args).await;
    let explain = || format!("rehearsal:\n{}\n\nreal run:\n{}", rehearsal.dump(), real.dump());
    assert_eq!(prediction["outcome"], real.report["outcome"], "{}", explain());
    assert_eq!(prediction["exit_code"], real.report["exit_code"], "{}", explain());
    assert_eq!(rehearsal.code, real.code, "rehearse exits with the predicted code: {}", explain());
    assert_eq!(blocker_names(&prediction["blockers"]), blocker_names(&real.report["blockers"]), "{}", explain());
    let predicted = prediction["timing"]["predicted_seconds"].as_f64().unwrap_or_default();
    let actual = real.report["wall_seconds"].as_f64().unwrap_or_default();
    eprintln!(
        "{cluster}: predicted {} (exit {}) in {predicted:.2}s, {} blocker(s); the real run: {} in {actual:.2}s",
        prediction["outcome"],
        prediction["exit_code"],
        prediction["blockers"].as_array().map_or(0, Vec::len),
        real.report["outcome"]
    );
    // the real run's wall time includes its own start (the process, the first connection); the
    // prediction covers the engine's run, which is nearly all of it. The copy's EC2 is the
    // sandbox's model and the real run's is LocalStack: over a run's terminations, polls and
    // verification their latencies part by up to a second and a half (5.7 s predicted against
    // 7.2 s on a CI machine, the drain's modelled waits right), so a run of a few seconds is held
    // to two seconds, a longer one to 20%
    assert!(
        (predicted - actual).abs() <= (0.2 * actual).max(2.0),
        "predicted {predicted:.2}s, the real run took {actual:.2}s: more than 20% (or 2 s) apart\n{}",
        explain()
    );
    (prediction, real.report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_writes_nothing_with_its_read_only_role() {
    let _serial = crate::SERIAL.lock().await;
    let s = live_spec("reh-audit", 4);
    let b = live_bed(&s.cluster, rehearse_rbac()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let audit = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults::default()).await.unwrap();
    let before = b.server.requests().snapshot();

    let run = rehearse(&b, &world.cluster, &audit.url(), &[]).await;
    assert_eq!(run.code, 0, "a healthy cluster is predicted to tear down clean:\n{}", run.dump());
    assert_eq!(run.report["command"], "rehearse");
    assert_eq!(common::schema::schema_errors(&run.report), Vec::<String>::new(), "{:#}", run.report);
    assert_eq!(run.report["rehearsal"]["prediction"]["outcome"], "clean", "{}", run.dump());

    // Kubernetes: every request the live server saw during the rehearsal (nothing else talks to
    // it: no simulated controller runs in this test) was a read; the tool's identity holds only
    // deploy/rbac-rehearse.yaml, which would refuse anything else
    let after = b.server.requests().snapshot();
    let writes: Vec<_> = after
        .iter()
        .filter(|((verb, resource), n)| {
            !matches!(verb.as_str(), "get" | "list" | "watch")
                && before.get(&(verb.clone(), resource.clone())).copied().unwrap_or(0) < **n
        })
        .collect();
    assert!(writes.is_empty(), "the rehearsal wrote to the live cluster: {writes:?}\n{}", run.dump());
    // AWS: every call through the audit proxy was a read the shipped statement allows
    let policy: Value =
        serde_json::from_str(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/iam-policy-rehearse.json")))
            .unwrap();
    let allowed: BTreeSet<String> = policy["Statement"][0]["Action"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str()?.split_once(':').map(|(_, a)| a.to_string()))
        .collect();
    let actions = audit.actions();
    assert!(actions.contains_key("DescribeInstances"), "the snapshot read EC2 through the proxy: {actions:?}");
    for action in actions.keys() {
        assert!(allowed.contains(action), "{action} is not a read the rehearse policy allows: {actions:?}");
    }
    audit.shutdown().await;

    // the live world is as it was: every instance running, no node cordoned, every pod there
    let ids = world.karpenter_instance_ids();
    let states = common::e2e::states(&b.aws, &ids).await;
    assert!(states.values().all(|s| *s == karpenter_teardown::aws::InstanceState::Running), "{states:?}");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(b.client.clone());
    for n in nodes.list(&ListParams::default()).await.unwrap() {
        assert!(!n.spec.and_then(|s| s.unschedulable).unwrap_or(false), "a live node was cordoned");
    }
    // the snapshot it wrote holds no environment value but the cluster name and the controller's
    // Service's name (with its image, what tells a container is Karpenter's controller)
    let snap = std::fs::read_to_string(b.dir.path().join("snapshot.json")).unwrap();
    let v: Value = serde_json::from_str(&snap).unwrap();
    assert_eq!(v["format"], "karpenter-teardown/snapshot");
    assert_eq!(v["version"], 1);
    assert_eq!(v["kubernetes"]["nodes"].as_array().map(Vec::len), Some(world.nodes.len() + s.managed_nodes + 1));
    for pod in v["kubernetes"]["pods"].as_array().unwrap() {
        for c in pod["spec"]["containers"].as_array().unwrap() {
            for e in c["env"].as_array().into_iter().flatten() {
                assert!(
                    e["name"] == "CLUSTER_NAME" || e["name"] == "KARPENTER_SERVICE",
                    "an environment value was copied: {c}"
                );
            }
        }
    }
    b.server.shutdown().await;
}

/// Eviction requests a run made (`kubernetes:evict` in a run report's `api_calls`, in a
/// prediction's `requests`).
fn evictions(calls: &Value) -> u64 {
    calls["kubernetes:evict"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_a_healthy_teardown() {
    let _serial = crate::SERIAL.lock().await;
    // containers as real ones are: what the snapshot drops of them must not change the copy
    let s = WorldSpec { full_containers: true, ..live_spec("reh-healthy", 6) };
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_sim(&b, &world);
    let (prediction, real) = prediction_matches_the_real_run(&b, &world.cluster, &[]).await;
    assert_eq!(real["outcome"], "clean");
    assert_eq!(prediction["clean"], true);
    // the copy asks for every drainable pod, once, as the real run does: no budget refuses here
    let drainable = (s.nodes * s.pods_per_node) as u64;
    assert_eq!(evictions(&real["api_calls"]), drainable, "{:#}", real["api_calls"]);
    assert_eq!(evictions(&prediction["requests"]), drainable, "{:#}", prediction["requests"]);
    let drain = prediction["timing"]["steps"].as_array().unwrap().iter().find(|s| s["step"] == "drain").cloned();
    assert_eq!(drain.map(|d| d["waits_seconds"].clone()), Some(json!(3.0)), "the drain waits one 3 s grace period");
    // the plan names the objects
    let plan = prediction["plan"].as_str().unwrap_or_default();
    assert!(world.nodes.iter().all(|n| plan.contains(&n.nodeclaim)), "{plan}");
    sim.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_a_teardown_with_the_controller_gone() {
    let _serial = crate::SERIAL.lock().await;
    let s = live_spec("reh-gone", 4);
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    scale_controller(&b.client, 0).await;
    wait_controller_pods_gone(&b).await;
    let (prediction, _) = prediction_matches_the_real_run(&b, &world.cluster, &[]).await;
    assert_eq!(prediction["copy"]["controller_live"], false);
    assert_eq!(prediction["outcome"], "clean");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_a_strict_budget_blocking_the_drain() {
    let _serial = crate::SERIAL.lock().await;
    let s = WorldSpec { strict_pdb: true, ..live_spec("reh-pdb", 4) };
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_sim(&b, &world);
    let (prediction, real) = prediction_matches_the_real_run(&b, &world.cluster, &["--drain-deadline", "8s"]).await;
    assert_eq!(real["outcome"], "blocked");
    assert_eq!(prediction["exit_code"], 5);
    let pdb =
        prediction["blockers"].as_array().unwrap().iter().find(|b| b["kind"] == "pdb").cloned().unwrap_or_default();
    let budget = &pdb["budget"];
    assert!(budget.is_object(), "the budget's arithmetic is reported: {pdb}");
    assert_eq!(budget["disruptions_allowed"], 0, "{pdb}");
    assert_eq!(
        budget["current_healthy"], budget["desired_healthy"],
        "a strict budget: every pod must stay healthy: {pdb}"
    );
    sim.shutdown().await;
    b.server.shutdown().await;
}

/// A `payments` Deployment of two replicas on Karpenter nodes and a budget that wants both
/// (`minAvailable: 2`, so `disruptionsAllowed: 0`); its container carries an environment, a
/// command and a probe, which a snapshot drops. Returns once both pods are Running and Ready on
/// Karpenter nodes and the budget's status says so.
async fn payments(c: &kube::Client) {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Namespace;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let pp = PostParams::default();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "payments"}})).unwrap();
    Api::<Namespace>::all(c.clone()).create(&pp, &ns).await.unwrap();
    let labels = json!({"app": "payments"});
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "payments", "namespace": "payments", "labels": labels},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
            "spec": {"nodeSelector": {naming::LABEL_CAPACITY_TYPE: "on-demand"}, "terminationGracePeriodSeconds": 3,
                "containers": [{"name": "payments", "image": "registry.example/payments:2.4.1",
                    "command": ["/payments", "--listen=:8080"], "env": [{"name": "DB_HOST", "value": "payments-db"}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}},
                    "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}]}}},
    }))
    .unwrap();
    Api::<Deployment>::namespaced(c.clone(), "payments").create(&pp, &deployment).await.unwrap();
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "payments-pdb", "namespace": "payments"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": labels}},
    }))
    .unwrap();
    let pdbs = Api::<PodDisruptionBudget>::namespaced(c.clone(), "payments");
    pdbs.create(&pp, &pdb).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "payments");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.clone());
    for _ in 0..400 {
        let running: Vec<Pod> = pods
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| {
                p.status.as_ref().is_some_and(|s| {
                    s.phase.as_deref() == Some("Running")
                        && s.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True")
                })
            })
            .collect();
        let mut on_karpenter = 0;
        for p in &running {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
            let n = nodes.get(&node).await.unwrap();
            if n.metadata.labels.unwrap_or_default().contains_key("karpenter.sh/nodepool") {
                on_karpenter += 1;
            }
        }
        let blocked = pdbs
            .get("payments-pdb")
            .await
            .unwrap()
            .status
            .is_some_and(|s| s.current_healthy == 2 && s.disruptions_allowed == 0);
        if on_karpenter == 2 && blocked {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the payments pods did not both run on Karpenter nodes under their budget");
}

/// The cluster a user met: `rehearse` predicted `clean` and named no blocker, because its copy
/// rolled every Deployment out (the ReplicaSets' names did not match its own hash of the copied
/// templates) and deleted the pods the budget protects; the real run was blocked by the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_the_block_of_a_budget_that_wants_every_replica_of_a_deployment() {
    let _serial = crate::SERIAL.lock().await;
    // room on the Karpenter nodes for the two payments pods
    let s = WorldSpec { full_containers: true, max_pods_per_node: Some(4), ..live_spec("reh-payments", 4) };
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    payments(&b.client).await;
    let sim = live_sim(&b, &world);
    let (prediction, real) = prediction_matches_the_real_run(&b, &world.cluster, &["--drain-deadline", "8s"]).await;
    assert_eq!(real["outcome"], "blocked");
    assert_eq!(prediction["outcome"], "blocked");
    assert_eq!(prediction["exit_code"], 5);
    let pdb = prediction["blockers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["kind"] == "pdb" && b["name"] == "payments/payments-pdb")
        .cloned()
        .unwrap_or_else(|| panic!("payments-pdb is named: {:#}", prediction["blockers"]));
    assert_eq!(
        pdb["budget"],
        json!({"expected_pods": 2, "current_healthy": 2, "desired_healthy": 2, "disruptions_allowed": 0}),
        "{pdb}"
    );
    // the copy asked for every other drainable pod (how often it asks the server again about the
    // blocked ones follows the clock, and the copy's is faster)
    let others = (s.nodes * s.pods_per_node) as u64;
    assert!(evictions(&prediction["requests"]) >= others, "{:#}", prediction["requests"]);
    assert!(evictions(&real["api_calls"]) >= others, "{:#}", real["api_calls"]);
    sim.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_karpenter_1_0_with_objects_stored_at_v1beta1() {
    let _serial = crate::SERIAL.lock().await;
    let s = WorldSpec {
        version: KarpenterVersion::V1_0,
        karpenter_crds: Some(real_crds(KarpenterVersion::V1_0)),
        ..live_spec("reh-v10", 4)
    };
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_sim(&b, &world);
    // an object written at v1beta1 while the webhook answers stays stored at v1beta1
    common::e2e::legacy_v1beta1_pool(&b.client, &world.node_classes[0].name).await;
    let (prediction, _) = prediction_matches_the_real_run(&b, &world.cluster, &[]).await;
    assert_eq!(prediction["copy"]["karpenter"], "1.0.14");
    assert_eq!(prediction["outcome"], "clean", "the tool turns the stranded webhook off itself");
    sim.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_the_refusal_of_active_gitops_owners() {
    let _serial = crate::SERIAL.lock().await;
    let s = WorldSpec { pool_cpu_limit: Some(1000), ..live_spec("reh-gitops", 3) };
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let g = sandbox_sim::gitops::adopt(&b.client, &world, &crate::common::e2e::gitops_crds()).await.unwrap();
    let (prediction, real) = prediction_matches_the_real_run(&b, &world.cluster, &[]).await;
    assert_eq!(real["outcome"], "refused");
    let error = prediction["error"].as_str().unwrap_or_default();
    for owner in &g.owners {
        assert!(error.contains(&owner.to_string()), "the prediction names {owner}: {error}");
    }
    b.server.shutdown().await;
}

/// With --pause-gitops, the run suspends the Flux owners and waits until Flux has handled the
/// suspend; the copy has no Flux of its own, so a stand-in acknowledges it there: the prediction
/// matches the real run (the live bed's Flux is the simulated one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_a_run_that_pauses_flux_owners() {
    let _serial = crate::SERIAL.lock().await;
    let s = WorldSpec { pool_cpu_limit: Some(1000), ..live_spec("reh-gitops-pause", 3) };
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let g = sandbox_sim::gitops::adopt(&b.client, &world, &crate::common::e2e::gitops_crds()).await.unwrap();
    let flux = sandbox_sim::gitops::GitopsSim::start(b.client.clone(), &g, Default::default());
    let (prediction, real) = prediction_matches_the_real_run(&b, &world.cluster, &["--pause-gitops"]).await;
    assert_eq!(real["outcome"], "clean", "{real:#}");
    assert_eq!(prediction["outcome"], "clean", "{prediction:#}");
    flux.shutdown().await;
    b.server.shutdown().await;
}

/// A Load Balancer Controller (the stand-in, `sandbox_sim::lbc`) whose one pod only Karpenter's
/// nodes can run holds a Service: the rehearsal asks the live cluster's cleanup controllers with
/// the run's `--release`, so it predicts the refusal of a run without it and the clean run with
/// `--release load-balancers`, as the real runs end. The copy holds no Service and plays no
/// release, so for the second only the outcome, the exit code and the blockers are held to the
/// real run, not its time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearse_predicts_the_runs_with_and_without_the_release_of_a_stranded_controllers_service() {
    let _serial = crate::SERIAL.lock().await;
    let s = live_spec("reh-release", 3);
    let rbac = Rbac::from_yaml(&format!("{RUN_RBAC}\n---\n{REHEARSE_RBAC}\n---\n{RELEASE_RBAC}")).unwrap();
    let b = live_bed(&s.cluster, rbac).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_sim(&b, &world);
    let config = sandbox_sim::localstack::config_at(common::LOCALSTACK, REGION, &account_of(&world.cluster)).await;
    let lbc = common::e2e::running_lbc(&b, &config, &world.cluster, &world.nodes[0].node, true).await;
    let services = common::e2e::shop_services(&b.client, &["front"]).await;
    let stack = "service.k8s.aws/stack shop/front";
    let in_aws = || async {
        let found = karpenter_teardown::verify::load_balancing(&b.aws, &world.cluster).await.unwrap();
        found.iter().filter(|l| l.made_for == stack).count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while services.get("front").await.unwrap().metadata.finalizers.is_none() || in_aws().await != 3 {
        assert!(std::time::Instant::now() < deadline, "the stand-in did not make the Service's load balancer");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // without consent: the drain would strand the controller, both refuse naming the Service
    let (prediction, real) = prediction_matches_the_real_run(&b, &world.cluster, &[]).await;
    assert_eq!(real["exit_code"], 3, "{real:#}");
    let held = ("stranded".to_string(), "Service/shop/front".to_string());
    assert!(blocker_names(&prediction["blockers"]).contains(&held), "{prediction:#}");
    // refused before its first write, the run makes only the reads before it: the prediction
    // counts the copy's reads up to that point, not the copy's whole run
    let requests = |v: &Value| -> BTreeMap<String, u64> { serde_json::from_value(v.clone()).unwrap_or_default() };
    let (predicted, made) = (requests(&prediction["requests"]), requests(&real["api_calls"]));
    eprintln!("refused run: predicted requests {predicted:?}, made {made:?}");
    assert!(!made.is_empty() && !predicted.is_empty(), "{prediction:#}\n{real:#}");
    // Kubernetes writes have verbs of their own (EC2's permission checks are dry runs counted
    // under the action's name, so only the Kubernetes side tells a write by its key)
    let writes = |r: &BTreeMap<String, u64>| -> Vec<String> {
        let write = ["kubernetes:evict", "kubernetes:patch", "kubernetes:update", "kubernetes:delete"];
        r.keys().filter(|k| write.contains(&k.as_str())).cloned().collect()
    };
    assert_eq!(writes(&made), Vec::<String>::new(), "the refused run wrote: {made:?}");
    assert_eq!(writes(&predicted), Vec::<String>::new(), "a refused run predicted to write: {predicted:?}");
    let total = |r: &BTreeMap<String, u64>| r.values().sum::<u64>() as f64;
    assert!(
        (total(&predicted) - total(&made)).abs() <= 0.2 * total(&made),
        "predicted {} requests, the refused run made {}: {predicted:?}\n{made:?}",
        total(&predicted),
        total(&made)
    );

    // with it: the rehearsal plans the release and predicts the clean run
    let release = ["--release", "load-balancers"];
    let rehearsal = rehearse(&b, &world.cluster, common::ec2_proxy(), &release).await;
    let prediction = rehearsal.report["rehearsal"]["prediction"].clone();
    let plan = prediction["plan"].as_str().unwrap_or_default();
    assert!(
        plan.contains("release: delete Service shop/front while the AWS Load Balancer Controller runs"),
        "{}",
        rehearsal.dump()
    );
    let real = real_run(&b, &world.cluster, &["--yes", "--release", "load-balancers"]).await;
    let explain = || format!("rehearsal:\n{}\n\nreal run:\n{}", rehearsal.dump(), real.dump());
    assert_eq!(real.code, 0, "{}", explain());
    assert_eq!(rehearsal.code, real.code, "{}", explain());
    assert_eq!(prediction["outcome"], real.report["outcome"], "{}", explain());
    assert_eq!(prediction["exit_code"], real.report["exit_code"], "{}", explain());
    assert_eq!(blocker_names(&prediction["blockers"]), blocker_names(&real.report["blockers"]), "{}", explain());
    assert!(services.get_opt("front").await.unwrap().is_none(), "the Service outlived its release");
    assert_eq!(in_aws().await, 0, "the Service's load balancer, target group or security group is left");
    lbc.shutdown().await;
    sim.shutdown().await;
    b.server.shutdown().await;
}

async fn wait_controller_pods_gone(b: &Bed) {
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), naming::KARPENTER_NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/name=karpenter");
    for _ in 0..400 {
        if pods.list(&lp).await.unwrap().items.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the controller's pods did not go");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_up_serves_a_snapshot_to_kubectl() {
    let _serial = crate::SERIAL.lock().await;
    use karpenter_teardown::snapshot::Snapshot;
    use tokio::io::AsyncBufReadExt;
    let s = live_spec("reh-serve", 3);
    let b = live_bed(&s.cluster, both_roles()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let kube = karpenter_teardown::k8s::Kube::from_config(b.server.kube_config(), None).unwrap();
    let snap = Snapshot::take(&kube, &b.aws, &world.cluster, REGION).await.unwrap();
    let path = b.dir.path().join("snap.json");
    snap.write(&path).unwrap();
    let kubeconfig = b.dir.path().join("copy.kubeconfig");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["sandbox", "up", "--from-snapshot"])
        .arg(&path)
        .arg("--kubeconfig-out")
        .arg(&kubeconfig)
        .envs(common::localstack_env())
        .env("AWS_ENDPOINT_URL", common::LOCALSTACK)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await {
        let serving = line.contains("serving until interrupted");
        seen.push(line);
        if serving {
            break;
        }
    }
    assert!(seen.iter().any(|l| l.contains("serving until interrupted")), "the copy never came up: {seen:?}");
    let kubectl = |args: &[&str]| {
        let out =
            std::process::Command::new("kubectl").arg("--kubeconfig").arg(&kubeconfig).args(args).output().unwrap();
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    assert_eq!(kubectl(&["get", "nodes", "-o", "name"]), snap.kubernetes.nodes.len());
    assert_eq!(kubectl(&["get", "nodeclaims", "-o", "name"]), world.nodes.len());
    assert_eq!(kubectl(&["get", "pods", "-A", "-o", "name"]), snap.kubernetes.pods.len());
    child.kill().await.unwrap();
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_without_the_rehearse_role_is_told_which_file_grants_it() {
    let _serial = crate::SERIAL.lock().await;
    let s = live_spec("reh-forbidden", 2);
    let b = live_bed(&s.cluster, Rbac::from_yaml(RUN_RBAC).unwrap()).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let run = rehearse(&b, &world.cluster, common::ec2_proxy(), &[]).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    assert!(run.stderr.contains("deploy/rbac-rehearse.yaml"), "the file that grants it is named:\n{}", run.stderr);
    b.server.shutdown().await;
}
