//! The admission chain on the real server (design §2.1): the webhooks and admission policies a
//! real cluster carries are asked, through server-side dry runs, before the tool's first write.
//! A refusal is named with its fix and exit 2, and nothing is written; the webhooks the server
//! does not apply to this run's writes refuse nothing.

use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Node;
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::engine::actions::FENCE_ANNOTATION;
use karpenter_teardown::k8s;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::common::e2e::{Run, run_of, states};
use super::resume::{Provisioned, provisioned};

/// The webhook configurations Karpenter's 0.3x charts installed and v1 stopped serving, as
/// the upgrade left them: service `karpenter` on port 8443 (here in `kube-system`, where no such
/// service exists), `failurePolicy: Fail`, rules for the v1beta1 kinds. `api_versions` are the
/// versions their rules name.
fn stale_karpenter_webhooks(api_versions: &[&str]) -> (Vec<Value>, Vec<Value>) {
    let hook = |name: &str, path: &str, group: &str, resources: &[&str]| {
        json!({
            "name": name,
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"service": {"name": "karpenter", "namespace": "kube-system", "port": 8443, "path": path}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "rules": [{"apiGroups": [group], "apiVersions": api_versions, "operations": ["CREATE", "UPDATE"],
                       "resources": resources, "scope": "*"}],
        })
    };
    let config = |name: &str, hook: Value| json!({"metadata": {"name": name}, "webhooks": [hook]});
    let claims_and_pools = ["nodeclaims", "nodeclaims/status", "nodepools", "nodepools/status"];
    let classes = ["ec2nodeclasses", "ec2nodeclasses/status"];
    let validating = vec![
        config(
            "validation.webhook.karpenter.sh",
            hook("validation.webhook.karpenter.sh", "/validate/karpenter.sh", "karpenter.sh", &claims_and_pools),
        ),
        config(
            "validation.webhook.karpenter.k8s.aws",
            hook("validation.webhook.karpenter.k8s.aws", "/validate/karpenter.k8s.aws", "karpenter.k8s.aws", &classes),
        ),
    ];
    let mutating = vec![config(
        "defaulting.webhook.karpenter.k8s.aws",
        hook("defaulting.webhook.karpenter.k8s.aws", "/default/karpenter.k8s.aws", "karpenter.k8s.aws", &classes),
    )];
    (validating, mutating)
}

async fn install_stale(admin: &kube::Client, api_versions: &[&str]) {
    let (validating, mutating) = stale_karpenter_webhooks(api_versions);
    let pp = PostParams::default();
    let v: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    let m: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
    for c in validating {
        v.create(&pp, &serde_json::from_value(c).unwrap()).await.unwrap();
    }
    for c in mutating {
        m.create(&pp, &serde_json::from_value(c).unwrap()).await.unwrap();
    }
}

async fn remove_stale(admin: &kube::Client) {
    let v: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    let m: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
    let dp = DeleteParams::default();
    for name in ["validation.webhook.karpenter.sh", "validation.webhook.karpenter.k8s.aws"] {
        v.delete(name, &dp).await.unwrap();
    }
    m.delete("defaulting.webhook.karpenter.k8s.aws", &dp).await.unwrap();
}

/// Waits until the server applies (or stops applying) what was just configured: a dry-run
/// fence of a NodePool and a dry-run cordon of a Karpenter node, as the tool, are refused (or
/// admitted) as `refused` says. The server's admission configuration follows its own watches.
async fn settled(p: &Provisioned, refused: (bool, bool)) {
    let tool = p.s.tool_client().await.unwrap();
    let pools: Api<DynamicObject> = Api::all_with(tool.clone(), &k8s::nodepool_resource());
    let nodes: Api<Node> = Api::all(tool);
    let node = karpenter_nodes(&p.admin).await.into_iter().next().expect("a Karpenter node");
    let dry = PatchParams { dry_run: true, field_manager: Some("admission-test".into()), ..PatchParams::default() };
    let touch = json!({"metadata": {"annotations": {"admission-test": "dry"}}});
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pool = pools.patch("default", &dry, &Patch::Merge(&touch)).await.is_err();
        let cordon = nodes.patch(&node, &dry, &Patch::Merge(&json!({"spec": {"unschedulable": true}}))).await.is_err();
        if (pool, cordon) == refused {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server's admission is not {refused:?} after 30 s: {:?}",
            (pool, cordon)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A fail-closed webhook on node updates and deletes, called through service `default/node-policy`,
/// whose one ready endpoint (an EndpointSlice of the service, as the EndpointSlice controller
/// writes them) runs on `node`; or, with `on` false, none of it.
async fn served_from(admin: &kube::Client, node: &str, on: bool) {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    let services: Api<Service> = Api::namespaced(admin.clone(), "default");
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), "default");
    if !on {
        let dp = DeleteParams::default();
        hooks.delete("node-policy", &dp).await.unwrap();
        slices.delete("node-policy-1", &dp).await.unwrap();
        services.delete("node-policy", &dp).await.unwrap();
        return;
    }
    let pp = PostParams::default();
    let svc = json!({"metadata": {"name": "node-policy"}, "spec": {"ports": [{"port": 443, "targetPort": 8443}]}});
    services.create(&pp, &serde_json::from_value(svc).unwrap()).await.unwrap();
    let slice = json!({
        "metadata": {"name": "node-policy-1", "labels": {"kubernetes.io/service-name": "node-policy"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.77.0.50"], "nodeName": node, "conditions": {"ready": true}}],
        "ports": [{"port": 8443, "protocol": "TCP"}],
    });
    slices.create(&pp, &serde_json::from_value(slice).unwrap()).await.unwrap();
    let hook = super::common::e2e::node_policy_webhook();
    hooks.create(&pp, &serde_json::from_value(hook).unwrap()).await.unwrap();
}

async fn karpenter_nodes(admin: &kube::Client) -> Vec<String> {
    let nodes: Api<Node> = Api::all(admin.clone());
    let list = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    list.items.into_iter().filter_map(|n| n.metadata.name).collect()
}

/// Nothing of the teardown was written: no NodePool fenced, no Karpenter node cordoned or
/// tainted, the controller running, every instance running.
async fn untouched(p: &Provisioned, run: &Run) {
    let pools: Api<DynamicObject> = Api::all_with(p.admin.clone(), &k8s::nodepool_resource());
    let list = pools.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1, "the test's one NodePool");
    for pool in &list.items {
        let fenced = pool.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(FENCE_ANNOTATION));
        assert!(!fenced, "NodePool {:?} was fenced:\n{}", pool.metadata.name, run.dump());
    }
    let names = karpenter_nodes(&p.admin).await;
    assert_eq!(names.len(), p.instances.len(), "{names:?}");
    let nodes: Api<Node> = Api::all(p.admin.clone());
    for name in &names {
        let node = nodes.get(name).await.unwrap();
        let spec = node.spec.unwrap_or_default();
        assert_ne!(spec.unschedulable, Some(true), "node {name} was cordoned:\n{}", run.dump());
        assert!(
            !spec.taints.unwrap_or_default().iter().any(|t| t.key == k8s::nodes::TAINT_DRAINING),
            "node {name} was tainted"
        );
    }
    assert!(p.karpenter.running(), "the controller was removed:\n{}", run.dump());
    let live = states(&p.aws, &p.instances).await;
    assert_eq!(live.len(), p.instances.len());
    assert!(live.values().all(|s| *s == InstanceState::Running), "{live:?}");
}

/// `run` against the stack as the tool's identity, with `--yes` or without.
pub(super) async fn teardown(p: &Provisioned, yes: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = p.tool("run", p.s.tool_kubeconfig(), &report);
    if yes {
        cmd.arg("--yes");
    }
    run_of(cmd, &report).await
}

fn admission_blockers(run: &Run) -> Vec<(String, String)> {
    run.report["blockers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["kind"] == "admission")
        .map(|b| {
            (b["name"].as_str().unwrap_or_default().to_string(), b["reason"].as_str().unwrap_or_default().to_string())
        })
        .collect()
}

/// The log line that counts the dry runs: how many the run sent.
fn dry_runs(run: &Run) -> u64 {
    let line = run
        .stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "admission checked before any change")
        .unwrap_or_else(|| panic!("no admission line:\n{}", run.dump()));
    line["dry_runs"].as_u64().unwrap_or_else(|| panic!("{line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admission_chain_is_asked_before_the_first_write_and_names_who_refuses() {
    let t = Instant::now();
    let p = provisioned("radm", &super::shipped_rbac_yaml(), 2).await;

    // 1. The configurations exactly as 0.3x left them: their rules name v1beta1, which these
    //    CRDs no longer serve, so the server applies them to no write of the run and the dry
    //    runs pass. A check that matched webhooks by name would refuse here.
    install_stale(&p.admin, &["v1beta1"]).await;
    settled(&p, (false, false)).await;
    let dry = teardown(&p, false).await;
    assert_eq!(dry.code, 0, "{}", dry.dump());
    assert!(admission_blockers(&dry).is_empty(), "{}", dry.dump());
    remove_stale(&p.admin).await;

    // 2. The same webhooks applying to v1 (as on Karpenter 1.0.x, whose CRDs still serve
    //    v1beta1, where the server converts each v1 write for them): every write of a NodePool,
    //    NodeClaim or EC2NodeClass fails calling them. Refused before any write, dry or not,
    //    each named with the upgrade guide's fix.
    install_stale(&p.admin, &["v1beta1", "v1"]).await;
    settled(&p, (true, false)).await;
    for yes in [false, true] {
        let run = teardown(&p, yes).await;
        assert_eq!(run.code, 2, "{}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default().to_string();
        for fix in [
            "kubectl delete validatingwebhookconfiguration validation.webhook.karpenter.sh",
            "kubectl delete validatingwebhookconfiguration validation.webhook.karpenter.k8s.aws",
            "kubectl delete mutatingwebhookconfiguration defaulting.webhook.karpenter.k8s.aws",
        ] {
            assert!(error.contains(fix), "--yes {yes}: {fix} not in {error}");
        }
        assert!(error.contains("Nothing was changed") && error.contains("service \"karpenter\""), "{error}");
        let blockers = admission_blockers(&run);
        let names: std::collections::BTreeSet<&str> = blockers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "MutatingWebhookConfiguration/defaulting.webhook.karpenter.k8s.aws",
                "ValidatingWebhookConfiguration/validation.webhook.karpenter.k8s.aws",
                "ValidatingWebhookConfiguration/validation.webhook.karpenter.sh",
            ]
            .into(),
            "{}",
            run.dump()
        );
        untouched(&p, &run).await;
        if !yes {
            // a rehearsal with the run's identity predicts the same refusal, naming the same
            // webhooks, from the live cluster's own admission chain (its copy has none)
            let rehearsal = super::resume::rehearse_as_the_run(&p).await;
            let prediction = &rehearsal.report["rehearsal"]["prediction"];
            assert_eq!(rehearsal.code, 2, "{}", rehearsal.dump());
            let predicted: std::collections::BTreeSet<&str> = prediction["blockers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|b| b["kind"] == "admission")
                .filter_map(|b| b["name"].as_str())
                .collect();
            assert_eq!(predicted, names, "{}", rehearsal.dump());
            untouched(&p, &rehearsal).await;
        }
    }
    remove_stale(&p.admin).await;
    settled(&p, (false, false)).await;

    // 2b. A fail-closed webhook on node writes whose service's only endpoint runs on a
    //     Karpenter node: the drain would take its backend away, so it refuses the run before
    //     any write, named as served only from Karpenter nodes. (Nothing answers at that address
    //     here, so the server cannot call it now either, and it is named for that too.)
    let karpenter_node = karpenter_nodes(&p.admin).await.into_iter().next().expect("a Karpenter node");
    served_from(&p.admin, &karpenter_node, true).await;
    settled(&p, (false, true)).await;
    let run = teardown(&p, false).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    let hook: Vec<(String, String)> = admission_blockers(&run)
        .into_iter()
        .filter(|(n, _)| n == "ValidatingWebhookConfiguration/node-policy")
        .collect();
    assert!(
        hook.iter().any(|(_, r)| r.contains(&format!("is served only from Karpenter nodes ({karpenter_node})"))),
        "{}",
        run.dump()
    );
    untouched(&p, &run).await;
    served_from(&p.admin, &karpenter_node, false).await;
    settled(&p, (false, false)).await;

    // 3. A ValidatingAdmissionPolicy that forbids this identity to update nodes ("no one
    //    cordons production"): refused before the first write, the policy named.
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": "no-cordons"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["UPDATE"], "resources": ["nodes"]}]},
            "validations": [{"expression": format!("request.userInfo.username != '{}'", realstack::TOOL_USER),
                "message": "no one cordons production"}],
        },
    }))
    .unwrap();
    let pp = PostParams::default();
    Api::<ValidatingAdmissionPolicy>::all(p.admin.clone()).create(&pp, &policy).await.unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": "no-cordons"},
        "spec": {"policyName": "no-cordons", "validationActions": ["Deny"]},
    }))
    .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(p.admin.clone()).create(&pp, &binding).await.unwrap();
    settled(&p, (false, true)).await;
    let run = teardown(&p, true).await;
    assert_eq!(run.code, 2, "{}", run.dump());
    // both writes of nodes it refuses are named: the cordon and the release's finalizer removal
    let blockers = admission_blockers(&run);
    assert_eq!(blockers.len(), 2, "{}", run.dump());
    assert!(blockers.iter().all(|(n, _)| n == "ValidatingAdmissionPolicy/no-cordons"), "{blockers:?}");
    assert!(blockers.iter().all(|(_, r)| r.contains("no one cordons production")), "{blockers:?}");
    assert!(blockers.iter().any(|(_, r)| r.contains("patch nodes")), "{blockers:?}");
    assert!(
        blockers.iter().any(|(_, r)| r.contains("remove finalizer karpenter.sh/termination from Node")),
        "{blockers:?}"
    );
    untouched(&p, &run).await;
    Api::<ValidatingAdmissionPolicyBinding>::all(p.admin.clone())
        .delete("no-cordons", &DeleteParams::default())
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(p.admin.clone())
        .delete("no-cordons", &DeleteParams::default())
        .await
        .unwrap();
    settled(&p, (false, false)).await;

    // 4. Nothing in the way: the same cluster is torn down, the dry runs one per kind of write
    //    whatever the cluster's size.
    let clean = teardown(&p, true).await;
    assert_eq!(clean.code, 0, "{}", clean.dump());
    assert_eq!(
        dry_runs(&clean),
        11,
        "one dry run per kind of write of the default plan, and the node's finalizer removal:\n{}",
        clean.dump()
    );
    p.assert_torn_down(&p.instances).await;
    eprintln!("admission cases took {:?}", t.elapsed());
    p.end().await;
}
