//! GitOps owners on the real kube-apiserver, with Argo CD's and Flux's own CRDs (Application,
//! Kustomization, HelmRelease v2 at the pinned releases, `sandbox_sim::gitops_crds`): the real
//! server holds every write of the simulated controllers and of the tool to those schemas, and
//! the tool's identity to `deploy/rbac.yaml`. The simulated Argo CD and Flux reconcile against
//! the real server as they do against the sandbox's.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use sandbox_sim::gitops::{self, GitopsSettings, GitopsSim, OwnerId, OwnerKind};
use sandbox_sim::{SimController, SimSettings, generate};
use serde_json::{Value, json};

use crate::common::e2e::{REGION, assert_torn_down_on, gitops_crds, small_world, untouchable_nodes};
use crate::{control_plane, teardown_with};

/// Puts in place (or takes away) a ValidatingAdmissionPolicy that forbids the tool's identity to
/// update Flux Kustomizations, and waits until the server applies it (or no longer does) to a
/// dry-run suspend of one, as the tool.
async fn suspends_forbidden(s: &realstack::RealStack, admin: &Client, owners: &[OwnerId], on: bool) {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(admin.clone());
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(admin.clone());
    if on {
        let policy = json!({
            "metadata": {"name": "no-suspends"},
            "spec": {"failurePolicy": "Fail",
                     "matchConstraints": {"resourceRules": [{"apiGroups": ["kustomize.toolkit.fluxcd.io"], "apiVersions": ["*"],
                         "operations": ["UPDATE"], "resources": ["kustomizations"]}]},
                     "validations": [{"expression": format!("request.userInfo.username != '{}'", realstack::TOOL_USER),
                         "message": "suspending a Kustomization needs a change request"}]},
        });
        policies.create(&PostParams::default(), &serde_json::from_value(policy).unwrap()).await.unwrap();
        let binding = json!({"metadata": {"name": "no-suspends"},
                             "spec": {"policyName": "no-suspends", "validationActions": ["Deny"]}});
        bindings.create(&PostParams::default(), &serde_json::from_value(binding).unwrap()).await.unwrap();
    } else {
        bindings.delete("no-suspends", &Default::default()).await.unwrap();
        policies.delete("no-suspends", &Default::default()).await.unwrap();
    }
    let k = owners.iter().find(|o| o.kind == OwnerKind::Kustomization).expect("a Kustomization owner");
    let tool = owner_api(&s.tool_client().await.unwrap(), k);
    let dry = kube::api::PatchParams { dry_run: true, ..Default::default() };
    let touch = kube::api::Patch::Merge(json!({"metadata": {"annotations": {"admission-test": "dry"}}}));
    let deadline = Instant::now() + Duration::from_secs(30);
    while tool.patch(&k.name, &dry, &touch).await.is_ok() == on {
        assert!(Instant::now() < deadline, "the policy is not {} after 30 s", if on { "applied" } else { "gone" });
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn owner_api(client: &Client, owner: &OwnerId) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(owner.kind.group(), owner.kind.version(), owner.kind.kind()),
        owner.kind.plural(),
    );
    Api::namespaced_with(client.clone(), &owner.namespace, &ar)
}

/// Each owner's resourceVersion.
async fn versions(client: &Client, owners: &[OwnerId]) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for o in owners {
        let obj = owner_api(client, o).get(&o.name).await.unwrap_or_else(|e| panic!("{o}: {e}"));
        out.insert(o.to_string(), json!(obj.metadata.resource_version));
    }
    out
}

/// An Argo CD Application of this cluster that has nothing to do with Karpenter (automated sync,
/// self-heal, its own objects): the run must neither name nor touch it.
async fn unrelated_application(client: &Client) -> OwnerId {
    let id =
        OwnerId { kind: OwnerKind::Application, namespace: gitops::ARGOCD_NAMESPACE.into(), name: "monitoring".into() };
    let app: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Application",
        "metadata": {"name": id.name, "namespace": id.namespace},
        "spec": {"project": "default",
                 "source": {"repoURL": "https://git.example.com/platform.git", "path": "monitoring"},
                 "destination": {"server": "https://kubernetes.default.svc", "namespace": "monitoring"},
                 "syncPolicy": {"automated": {"selfHeal": true, "prune": true}}},
        "status": {"resources": [{"group": "apps", "kind": "Deployment", "namespace": "monitoring", "name": "prometheus",
                                   "status": "Synced"}]},
    }))
    .unwrap();
    owner_api(client, &id).create(&PostParams::default(), &app).await.unwrap_or_else(|e| panic!("{id}: {e}"));
    id
}

/// NodePools under an Argo CD Application (automated sync, self-heal, annotation tracking, with
/// an app-of-apps parent), EC2NodeClasses under a Flux Kustomization, the controller under a
/// Flux HelmRelease applied by a Kustomization; next to them owners that apply the same names to
/// other clusters, and an Application of this cluster that owns nothing of Karpenter's. As on the
/// sandbox (`tests/teardown` `active_gitops_owners_refuse_...`, `pause_gitops_suspends_...`,
/// `a_hubs_owners_for_other_clusters_...`): without --pause-gitops the run refuses with exit 3,
/// naming each in-cluster owner and none of the others, and writes nothing to any owner; with it,
/// exactly the in-cluster owners are paused (parents first), nothing is put back, the teardown
/// ends clean, and the other owners are not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gitops_owners_with_the_real_crds_refuse_then_pause_on_the_real_server() {
    let spec = sandbox_sim::WorldSpec {
        pool_cpu_limit: Some(1000),
        pods_per_node: 2,
        settle_timeout: Duration::from_secs(120),
        ..small_world("rs-gitops", 4)
    };
    let s = control_plane::full_stack(&spec.cluster).await;
    let admin = s.admin_client().await.unwrap();
    let cloud = crate::common::cloud(REGION).await;
    let aws = crate::common::localstack(REGION).await;
    let world = generate(&spec, &admin, &cloud).await.unwrap_or_else(|e| {
        panic!("{e}\nkube-scheduler:\n{}", s.log_tail("kube-scheduler"));
    });
    let g = gitops::adopt(&admin, &world, &gitops_crds())
        .await
        .unwrap_or_else(|e| panic!("{e}\nkube-apiserver:\n{}", s.log_tail("kube-apiserver")));
    let remote = gitops::add_other_clusters(&admin, &g).await.unwrap();
    let unrelated = unrelated_application(&admin).await;
    let reconcilers = GitopsSim::start(admin.clone(), &g, GitopsSettings::default());
    let foreign: Vec<OwnerId> = remote.iter().cloned().chain([unrelated.clone()]).collect();

    // refused: every in-cluster owner named, the others not, no owner written
    let all: Vec<OwnerId> = g.owners.iter().chain(&foreign).cloned().collect();
    let before_refusal = versions(&admin, &all).await;
    let refused = teardown_with(&s, &world.cluster, &[]).await;
    assert_eq!(refused.code, 3, "{}", refused.dump());
    assert_eq!(refused.report["outcome"], "refused", "{}", refused.dump());
    for owner in &g.owners {
        assert!(refused.stderr.contains(&owner.to_string()), "{owner} is named:\n{}", refused.stderr);
    }
    for owner in &foreign {
        assert!(!refused.stderr.contains(&owner.name), "{owner} does not refuse:\n{}", refused.stderr);
    }
    let pools = refused.report["gitops"]["owners"]
        .as_array()
        .expect("report.gitops.owners")
        .iter()
        .find(|o| o["owner"]["name"] == "karpenter-nodepools")
        .cloned()
        .unwrap_or_default();
    assert!(
        pools["evidence"].to_string().contains(":kube-system/"),
        "the tracking id names its Application: {pools:#}"
    );
    assert_eq!(refused.report["gitops"]["other_clusters"].as_array().map(Vec::len), Some(remote.len()));
    assert_eq!(versions(&admin, &all).await, before_refusal, "a refused run wrote to an owner");

    // rehearse, reading the same cluster as the run's identity, predicts that refusal, naming the
    // same owners, and writes to none
    let tool_group = json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": realstack::TOOL_GROUP});
    crate::resume::bind_rehearse_role(&admin, tool_group, "tool-rehearses").await;
    let reviews: Api<k8s_openapi::api::authorization::v1::SelfSubjectAccessReview> =
        Api::all(s.tool_client().await.unwrap());
    let crd_list: k8s_openapi::api::authorization::v1::SelfSubjectAccessReview = serde_json::from_value(json!({"spec":
        {"resourceAttributes": {"verb": "list", "group": "apiextensions.k8s.io", "resource": "customresourcedefinitions"}}}))
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reviews.create(&PostParams::default(), &crd_list).await.unwrap().status.is_some_and(|s| s.allowed) {
        assert!(Instant::now() < deadline, "the rehearse role is not bound to the tool after 30 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("rehearsal.json");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["rehearse", "--cluster", &world.cluster, "--region", REGION, "--kubeconfig"])
        .arg(s.tool_kubeconfig())
        .arg("--report")
        .arg(&report)
        .args(["--time-scale", "0.25", "--localstack", crate::common::LOCALSTACK])
        .envs(crate::common::localstack_env());
    let rehearsal = crate::common::e2e::run_of(cmd, &report).await;
    let prediction = &rehearsal.report["rehearsal"]["prediction"];
    assert_eq!(rehearsal.code, 3, "rehearse exits with the predicted refusal:\n{}", rehearsal.dump());
    assert_eq!(prediction["exit_code"], refused.report["exit_code"], "{}", rehearsal.dump());
    assert_eq!(prediction["outcome"], refused.report["outcome"], "{}", rehearsal.dump());
    let predicted_error = prediction["error"].as_str().unwrap_or_default();
    for owner in &g.owners {
        assert!(predicted_error.contains(&owner.to_string()), "{owner} is named: {predicted_error}");
    }
    for owner in &foreign {
        assert!(!predicted_error.contains(&owner.name), "{owner} does not refuse: {predicted_error}");
    }
    assert_eq!(versions(&admin, &all).await, before_refusal, "the rehearsal wrote to an owner");

    // an admission policy that forbids this identity to suspend Kustomizations: the pause is
    // tried as a dry run before the first write, and the run refuses (exit 2), naming it
    suspends_forbidden(&s, &admin, &g.owners, true).await;
    let forbidden = teardown_with(&s, &world.cluster, &["--pause-gitops"]).await;
    assert_eq!(forbidden.code, 2, "{}", forbidden.dump());
    let error = forbidden.report["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("pause Flux Kustomization ") && error.contains("ValidatingAdmissionPolicy 'no-suspends'"),
        "{error}"
    );
    assert_eq!(versions(&admin, &all).await, before_refusal, "a run refused by admission wrote to an owner");
    suspends_forbidden(&s, &admin, &g.owners, false).await;

    // paused: exactly this cluster's Karpenter owners, parents first, nothing put back
    let sim = SimController::start(
        admin.clone(),
        cloud.clone(),
        SimSettings { version: world.version, time_scale: 0.02, ..SimSettings::new(&world.cluster, REGION) },
    );
    let untouchable = untouchable_nodes(&admin, &world).await;
    let before_foreign = versions(&admin, &foreign).await;
    let t = Instant::now();
    let run = tokio::time::timeout(Duration::from_secs(240), teardown_with(&s, &world.cluster, &["--pause-gitops"]))
        .await
        .unwrap_or_else(|_| panic!("the teardown did not end within 240s"));
    eprintln!("paused and torn down in {:?}", t.elapsed());
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean", "{}", run.dump());
    assert_torn_down_on(&admin, &aws, &world, &untouchable).await;
    assert_eq!(reconcilers.stats(), Default::default(), "a GitOps owner put something back");
    assert_eq!(sim.stats().nodeclaims_launched, 0, "the fence kept Karpenter from launching replacements");
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
    for owner in &g.owners {
        let o = owner_api(&admin, owner).get(&owner.name).await.unwrap();
        match owner.kind {
            OwnerKind::Application => {
                assert!(o.data["spec"]["syncPolicy"]["automated"].is_null(), "{owner}: {:?}", o.data);
                let kept =
                    &o.metadata.annotations.as_ref().unwrap()[karpenter_teardown::gitops::PAUSED_AUTOMATED_ANNOTATION];
                assert!(kept.contains("selfHeal"), "{owner}: {kept}");
            }
            OwnerKind::Kustomization | OwnerKind::HelmRelease => assert_eq!(o.data["spec"]["suspend"], true, "{owner}"),
        }
    }
    assert_eq!(
        versions(&admin, &foreign).await,
        before_foreign,
        "an owner that is not this cluster's Karpenter's was written"
    );
    let again = teardown_with(&s, &world.cluster, &[]).await;
    assert_eq!(again.code, 0, "paused owners do not refuse a re-run: {}", again.dump());
    reconcilers.shutdown().await;
    sim.shutdown().await;
    control_plane::assert_evicted_deployments_wait_pending(&admin, &world).await;
}
