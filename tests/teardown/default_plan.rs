//! End to end: the `karpenter-teardown` binary, through a kubeconfig like any user, against the
//! sandbox API server with a generated Karpenter world and LocalStack.

use crate::common;

use crate::common::e2e::{
    Bed, Consent, REGION, assert_torn_down, bed, live_karpenter, scale_controller, settled_resource_version,
    small_world, states, teardown, untouchable_nodes,
};
use karpenter_teardown::aws::InstanceState;
use sandbox_sim::{SimController, World, WorldSpec, generate};

/// Generates `s`, starts the simulated controller on it, and tears it down with `--yes`: the run
/// must end clean with every end-state check passed and no capacity launched meanwhile.
async fn torn_down_with_a_live_controller(s: &WorldSpec) -> (Bed, World, SimController) {
    let b = bed(&s.cluster).await;
    let world = generate(s, &b.client, &b.cloud).await.unwrap();
    let sim = live_karpenter(&b, &world);
    let before = untouchable_nodes(&b.client, &world).await;
    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert_eq!(run.report["outcome"], "clean");
    assert_torn_down(&b, &world, &before).await;
    assert_eq!(sim.stats().nodeclaims_launched, 0, "the fence kept Karpenter from launching replacements");
    (b, world, sim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_plan_tears_down_a_generated_cluster_with_a_live_controller() {
    let (b, world, sim) = torn_down_with_a_live_controller(&small_world("e2e-default", 20)).await;
    // A live Karpenter removes karpenter.sh/disrupted from nodes it is not disrupting
    // itself; a tool that writes that taint fights it on every node
    assert_eq!(sim.stats().disrupted_taints_removed, 0, "the tool wrote a taint the live controller owns");

    // a second run finds nothing to do and exits 0
    let again = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    sim.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_plan_finishes_with_the_controller_gone_first() {
    let s = small_world("e2e-nocontroller", 8);
    let b = bed(&s.cluster).await;
    let t = std::time::Instant::now();
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    eprintln!("generated in {:?}", t.elapsed());
    scale_controller(&b.client, 0).await;
    let before = untouchable_nodes(&b.client, &world).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

/// Each machine is terminated as soon as its own node is drained and the controller is gone, not
/// after the slowest drain: with one workload's budget blocking every eviction from its nodes, the
/// other machines' instances are terminated and their finalizers released while those drains
/// still wait, and the blocked machines' instances still run when the run stops at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_machine_is_terminated_while_a_blocked_drain_still_waits() {
    let s = WorldSpec { strict_pdb: true, replicas_per_workload: 2, ..small_world("e2e-pipelined", 5) };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let sim = live_karpenter(&b, &world);
    // a release waits FENCE_SETTLE (5 s) and EC2's answers before it ends: the deadline leaves
    // that room on a loaded machine, since what is proved is the order, not the speed
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--drain-deadline", "20s"]).await;
    assert_eq!(run.code, 5, "{}", run.dump());
    let steps = run.report["steps"].as_array().unwrap();
    let at = |r: &serde_json::Value, field: &str| humantime::parse_rfc3339_weak(r[field].as_str().unwrap()).unwrap();
    let of = |step: &'static str| steps.iter().filter(move |r| r["step"] == step);
    let blocked: Vec<&serde_json::Value> = of("drain").filter(|r| r["result"] == "blocked").collect();
    let first_blocked_end = blocked.iter().map(|r| at(r, "finished")).min().expect("a drain was blocked");
    let states = states(&b.aws, &world.karpenter_instance_ids()).await;
    let mut released = 0;
    for n in &world.nodes {
        if blocked.iter().any(|r| r["object"] == n.nodeclaim.as_str()) {
            assert_eq!(states[&n.instance_id], InstanceState::Running, "{}: its drain was blocked", n.nodeclaim);
            continue;
        }
        let discharged = of("discharge-finalizers")
            .find(|r| r["object"] == n.nodeclaim.as_str())
            .unwrap_or_else(|| panic!("{} was drained but not released:\n{}", n.nodeclaim, run.dump()));
        assert_eq!(discharged["result"], "done", "{}", run.dump());
        assert!(
            at(discharged, "finished") < first_blocked_end,
            "{} was released only after the blocked drains ended:\n{}",
            n.nodeclaim,
            run.dump()
        );
        assert_eq!(states[&n.instance_id], InstanceState::Terminated, "{}", n.nodeclaim);
        released += 1;
    }
    assert!(released > 0, "every machine was blocked: the world does not test anything\n{}", run.dump());
    assert_eq!(sim.stats().nodeclaims_launched, 0, "the fence kept Karpenter from launching replacements");
    sim.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_yes_nothing_changes_and_the_plan_is_shown() {
    let s = small_world("e2e-dry", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let rv = settled_resource_version(&b.server).await;
    let ids = world.karpenter_instance_ids();
    let run = teardown(&b, &world.cluster, Consent::DryRun, &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.report["outcome"], "dry-run");
    assert!(run.stdout.contains("Dry run: nothing was changed"), "{}", run.stdout);
    assert!(run.stdout.contains(&world.nodes[0].nodeclaim), "the plan names the objects:\n{}", run.stdout);
    assert_eq!(b.server.store().resource_version(), rv, "a dry run wrote to the cluster");
    let after = states(&b.aws, &ids).await;
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cluster_name_is_refused_with_the_evidence_and_nothing_changes() {
    let s = small_world("e2e-wrong", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let rv = settled_resource_version(&b.server).await;
    let run = teardown(&b, "some-other-cluster", Consent::Yes, &[]).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains(&world.cluster), "the evidence names the real cluster: {}", run.stderr);
    assert_eq!(run.report["outcome"], "refused");
    assert_eq!(b.server.store().resource_version(), rv, "a refused run wrote to the cluster");
    let after = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(after.values().all(|s| *s == InstanceState::Running));
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_nodes_refuses_a_larger_blast_radius() {
    let s = small_world("e2e-max", 3);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--max-nodes", "2"]).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("--max-nodes 2"), "{}", run.stderr);
    b.server.shutdown().await;
}

/// A GovCloud cluster (four-part region, `aws-us-gov` partition, the kube context
/// named by its EKS ARN as `aws eks update-kubeconfig` names it) is torn down like any other.
/// On the old zone-to-region rule every such cluster was refused (exit 3, region `us-gov-`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_govcloud_cluster_is_torn_down_from_its_arn_context() {
    const GOV: &str = "us-gov-west-1";
    let s = WorldSpec {
        region: GOV.into(),
        zones: vec![format!("{GOV}a"), format!("{GOV}b")],
        decoys: 0,
        ..small_world("e2e-gov", 3)
    };
    let b = bed(&s.cluster).await;
    let aws = common::localstack(GOV).await;
    let world = generate(&s, &b.client, &common::cloud(GOV).await).await.unwrap();
    let arn = format!("arn:aws-us-gov:eks:{GOV}:000000000000:cluster/{}", world.cluster);
    let kubeconfig = b.dir.path().join("gov-kubeconfig");
    b.server.write_kubeconfig(&kubeconfig, &arn).unwrap();
    // EKS of the GovCloud region knows the cluster, as it would on AWS
    common::register_eks(&world.cluster, GOV, &b.server.url(), None).await;
    let report = b.dir.path().join("gov-report.json");

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["run", "--yes", "--cluster", &world.cluster, "--region", GOV, "--kubeconfig"])
        .arg(&kubeconfig)
        .arg("--report")
        .arg(&report)
        .envs(common::localstack_env())
        .output()
        .await
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}\n{report:#}");
    assert_eq!(report["outcome"], "clean");
    let left = states(&aws, &world.karpenter_instance_ids()).await;
    assert!(left.values().all(|st| *st == InstanceState::Terminated), "{left:?}");
    assert!(aws.iam.cluster_instance_profiles(GOV, &world.cluster).await.unwrap().is_empty());
    b.server.shutdown().await;
}

/// A static NodePool (Karpenter ≥ 1.8, `spec.replicas`) under the real CRD's CEL
/// rules, with a live controller that keeps static pools at their replicas. The fence writes
/// `limits.nodes` (the only limit a static pool may have; the old `limits.cpu` fence got 422 and
/// failed the run), so the controller launches no replacement while the tool takes the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_nodepool_is_fenced_on_nodes_and_torn_down_with_a_live_controller() {
    let (b, _, sim) =
        torn_down_with_a_live_controller(&WorldSpec { static_pool: true, ..small_world("e2e-static", 6) }).await;
    sim.shutdown().await;
    b.server.shutdown().await;
}

/// NodePools under Argo CD (self-heal, with an app-of-apps parent), EC2NodeClasses
/// under a Flux Kustomization and the controller under a Flux HelmRelease (itself applied by a
/// Kustomization), with the simulated reconcilers running. Without --pause-gitops, a run (and a
/// dry run) refuses with exit 3 naming every owner and the flag, and changes nothing; the dry
/// run with the flag lists the owners it would pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_gitops_owners_refuse_the_run_naming_each_and_change_nothing() {
    use sandbox_sim::gitops::{self, GitopsSettings, GitopsSim};
    let s = WorldSpec { pool_cpu_limit: Some(1000), ..small_world("e2e-gitops-refuse", 4) };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let g = gitops::adopt(&b.client, &world, &crate::common::e2e::gitops_crds()).await.unwrap();
    let sim = GitopsSim::start(b.client.clone(), &g, GitopsSettings::default());
    let rv = settled_resource_version(&b.server).await;

    for consent in [Consent::Yes, Consent::DryRun] {
        let run = teardown(&b, &world.cluster, consent, &[]).await;
        if std::env::var_os("KT_SHOW").is_some() {
            eprintln!("{}", run.dump());
        }
        assert_eq!(run.code, 3, "{consent:?}: {}", run.dump());
        assert_eq!(run.report["outcome"], "refused");
        for owner in &g.owners {
            assert!(run.stderr.contains(&owner.to_string()), "{owner} is named:\n{}", run.stderr);
        }
        assert!(run.stderr.contains("--pause-gitops"), "the flag is named:\n{}", run.stderr);
        assert!(run.stderr.contains(&format!("NodePool/{}", world.node_pools[0])), "{}", run.stderr);
        let owners = run.report["gitops"]["owners"].as_array().expect("report.gitops.owners");
        assert_eq!(owners.len(), g.owners.len(), "{:#}", run.report["gitops"]);
        assert!(owners.iter().all(|o| o["state"] == "active" && o["paused_by_run"] == false));
    }
    let dry = teardown(&b, &world.cluster, Consent::DryRun, &["--pause-gitops"]).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    for owner in &g.owners {
        assert!(
            dry.stdout.contains(&format!("GitOps: {owner}")) && dry.stdout.contains("paused before the fence"),
            "the dry run lists {owner}:\n{}",
            dry.stdout
        );
    }
    assert_eq!(b.server.store().resource_version(), rv, "a refused or dry run wrote to the cluster");
    assert_eq!(sim.stats(), Default::default(), "nothing was removed, so nothing was put back");
    let after = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");
    sim.shutdown().await;
    b.server.shutdown().await;
}

/// The same world with a live Karpenter and the reconcilers running; with
/// --pause-gitops the owners are suspended (parents first) before the fence and the teardown ends
/// clean with nothing put back. They stay paused; a second run has nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_gitops_suspends_exactly_the_owners_and_the_teardown_ends_clean() {
    use sandbox_sim::gitops::{self, GitopsSettings, GitopsSim};
    let s = WorldSpec { pool_cpu_limit: Some(1000), ..small_world("e2e-gitops-pause", 6) };
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let g = gitops::adopt(&b.client, &world, &crate::common::e2e::gitops_crds()).await.unwrap();
    let reconcilers = GitopsSim::start(b.client.clone(), &g, GitopsSettings::default());
    let sim = live_karpenter(&b, &world);
    let before = untouchable_nodes(&b.client, &world).await;
    let run = teardown(&b, &world.cluster, Consent::Yes, &["--pause-gitops"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_torn_down(&b, &world, &before).await;
    assert_eq!(reconcilers.stats(), Default::default(), "a GitOps owner put something back");
    assert_eq!(sim.stats().nodeclaims_launched, 0);
    let first = &run.report["steps"][0];
    assert_eq!((first["step"].as_str(), first["result"].as_str()), (Some("pause-gitops"), Some("done")), "{first:#}");
    let paused: Vec<&str> = run.report["gitops"]["owners"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["paused_by_run"] == true)
        .map(|o| o["owner"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        paused,
        ["platform", "infrastructure", "karpenter-nodepools", "karpenter-nodeclasses", "karpenter"],
        "parents first"
    );

    // what is on the owners now: Flux suspended, Argo CD automated sync off with the original kept
    for owner in &g.owners {
        let ar = kube::core::ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk(owner.kind.group(), owner.kind.version(), owner.kind.kind()),
            owner.kind.plural(),
        );
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::namespaced_with(b.client.clone(), &owner.namespace, &ar);
        let o = api.get(&owner.name).await.unwrap();
        match owner.kind {
            sandbox_sim::gitops::OwnerKind::Application => {
                assert!(o.data["spec"]["syncPolicy"]["automated"].is_null(), "{owner}: {:?}", o.data);
                let kept =
                    &o.metadata.annotations.as_ref().unwrap()[karpenter_teardown::gitops::PAUSED_AUTOMATED_ANNOTATION];
                assert!(kept.contains("selfHeal"), "{owner}: {kept}");
            }
            _ => assert_eq!(o.data["spec"]["suspend"], true, "{owner}"),
        }
    }
    let again = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(again.code, 0, "paused owners do not refuse a re-run: {}", again.dump());
    reconcilers.shutdown().await;
    sim.shutdown().await;
    b.server.shutdown().await;
}

/// The engine speaks in typed events on one channel: the run's size, every task's
/// start and end, and each drain's pods left (what the live view shows as "N pod(s) left"),
/// counting down from the node's drainable pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_reports_typed_events_with_the_pods_each_drain_has_left() {
    use karpenter_teardown::engine::events::{EngineEvent, Events};
    use karpenter_teardown::engine::{self, RunSettings};
    let s = small_world("e2e-events", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let kube = karpenter_teardown::k8s::Kube::from_config(b.server.kube_config(), None).unwrap();
    let settings = RunSettings {
        cluster: world.cluster.clone(),
        region: REGION.into(),
        account: None,
        plan: karpenter_teardown::plan::Plan::builtin_default(),
        dry_run: false,
        drain: Default::default(),
        max_nodes: None,
        reclaim: false,
        gitops: Default::default(),
        release: Default::default(),
        assume_stopped: Default::default(),
    };
    let (events, mut rx) = Events::channel();
    let aws = common::localstack_as_aws(REGION).await;
    let result = engine::run(kube, aws, settings, tokio_util::sync::CancellationToken::new(), events).await;
    assert_eq!(result.exit, karpenter_teardown::exit::Exit::Clean, "{:?}", result.error);
    let mut seen = Vec::new();
    while let Some(ev) = rx.recv().await {
        seen.push(ev);
    }
    let Some(EngineEvent::RunStarted { tasks, .. }) = seen.first() else { panic!("{seen:?}") };
    let started = seen.iter().filter(|e| matches!(e, EngineEvent::TaskStarted(_))).count();
    let ended = seen.iter().filter(|e| matches!(e, EngineEvent::TaskEnded { .. })).count();
    assert_eq!((started as u64, ended as u64), (*tasks, *tasks), "every task starts and ends once");
    for n in &world.nodes {
        let left: Vec<u64> = seen
            .iter()
            .filter_map(|e| match e {
                EngineEvent::DrainProgress { task, pods_left, .. } if task.object.as_deref() == Some(&n.nodeclaim) => {
                    Some(*pods_left)
                }
                _ => None,
            })
            .collect();
        assert_eq!(left.first(), Some(&(s.pods_per_node as u64)), "drain of {}: {left:?}", n.nodeclaim);
        assert!(left.windows(2).all(|w| w[1] <= w[0]), "pods left only go down: {left:?}");
    }
    b.server.shutdown().await;
}
