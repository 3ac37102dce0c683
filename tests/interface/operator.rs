//! Operator experience: output without a terminal (no escape codes, JSON log lines), the report
//! against its shipped schema, the shipped RBAC and IAM policies against the calls a real
//! sandbox teardown makes, `plan --format dot` through Graphviz, and shell completions.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::Client;
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::{KarpenterVersion, WorldSpec, generate};
use serde_json::{Value, json};

const REGION: &str = "us-west-2";
const BIN: &str = env!("CARGO_BIN_EXE_karpenter-teardown");

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

use crate::common::schema::schema_errors;

/// A survey with an owner of each kind (one paused by the run, one unpausable), an object managed
/// from elsewhere and a label set aside: every shape the report's `gitops` section takes.
fn gitops_survey() -> karpenter_teardown::gitops::Survey {
    use karpenter_teardown::gitops::{OwnerKind, OwnerObject, Tracked, survey};
    let pool = |name: &str, meta: Value| {
        let mut m = json!({"name": name});
        m.as_object_mut().unwrap().extend(meta.as_object().unwrap().clone());
        Tracked::from_json("karpenter.sh", "NodePool", &json!({"metadata": m}))
    };
    let objects = [
        pool("a", json!({"annotations": {"argocd.argoproj.io/tracking-id": "apps:karpenter.sh/NodePool:/a"}})),
        pool(
            "b",
            json!({"labels": {"kustomize.toolkit.fluxcd.io/name": "k", "kustomize.toolkit.fluxcd.io/namespace": "flux-system"}}),
        ),
        pool(
            "c",
            json!({"labels": {"helm.toolkit.fluxcd.io/name": "h", "helm.toolkit.fluxcd.io/namespace": "flux-system"}}),
        ),
        pool("d", json!({"managedFields": [{"manager": "argocd-controller"}]})),
        pool("e", json!({"labels": {"app.kubernetes.io/instance": "karpenter"}})),
    ];
    let listed = [
        OwnerObject::from_json(
            OwnerKind::Application,
            &json!({"metadata": {"name": "apps", "namespace": "argocd", "ownerReferences": [{"kind": "ApplicationSet", "name": "set"}]},
                    "spec": {"syncPolicy": {"automated": {"selfHeal": true}}}}),
        ),
        OwnerObject::from_json(
            OwnerKind::Kustomization,
            &json!({"metadata": {"name": "k", "namespace": "flux-system"}, "spec": {"interval": "10m"}}),
        ),
        OwnerObject::from_json(
            OwnerKind::HelmRelease,
            &json!({"metadata": {"name": "h", "namespace": "flux-system"}, "spec": {"suspend": true}}),
        ),
        OwnerObject::from_json(
            OwnerKind::Application,
            &json!({"metadata": {"name": "prod", "namespace": "argocd"}, "spec": {"destination": {"server": "https://prod.example"}},
                    "status": {"resources": [{"group": "karpenter.sh", "kind": "NodePool", "name": "e"}]}}),
        ),
    ];
    let mut s = survey(&objects, &listed, "https://kubernetes.example");
    s.owners[1].paused_by_run = true;
    assert_eq!((s.owners.len(), s.unreachable.len(), s.set_aside.len()), (3, 1, 1), "{s:#?}");
    assert_eq!(s.other_clusters.len(), 1, "{s:#?}");
    s
}

/// A report the tool itself serialises, with every kind of leftover and `would_reclaim`, is valid
/// against the shipped schema (a field added to a leftover type must be added to the schema too).
#[test]
fn a_report_with_every_kind_of_leftover_matches_the_schema() {
    use karpenter_teardown::aws::InstanceProfileInfo;
    use karpenter_teardown::aws::ec2::{DetachedResource, LaunchTemplateInfo};
    use karpenter_teardown::exit::Exit;
    use karpenter_teardown::karpenter::ProfileEvidence;
    use karpenter_teardown::report::Report;
    let (mut report, started) = Report::start("verify", "c", "us-west-2", "");
    report.leftovers.launch_templates = vec![LaunchTemplateInfo {
        id: "lt-1".into(),
        name: "karpenter.k8s.aws/1".into(),
        nodeclass: Some("default".into()),
        tags: Default::default(),
        created: Some(1_700_000_000),
    }];
    report.leftovers.instance_profiles = vec![InstanceProfileInfo {
        name: "c_123".into(),
        path: "/".into(),
        roles: vec!["KarpenterNodeRole-c".into()],
        evidence: ProfileEvidence::LegacyName,
        nodeclass: "default".into(),
        tags: Default::default(),
        created: Some(1_700_000_000),
    }];
    let eni =
        |id: &str, why: &str| DetachedResource { id: id.into(), status: "available".into(), reason: Some(why.into()) };
    report.leftovers.network_interfaces = vec![eni("eni-1", "the VPC CNI's")];
    report.leftovers.network_interfaces_left = vec![eni("eni-2", "the VPC resource controller's")];
    report.leftovers.objects = vec!["NodeClaim/x".into()];
    report.leftovers.load_balancing = vec![karpenter_teardown::aws::LoadBalancing {
        kind: karpenter_teardown::aws::LbKind::ClassicLoadBalancer,
        id: "a1b2".into(),
        name: "a1b2".into(),
        owner: "the in-tree service controller".into(),
        made_for: "Service default/web".into(),
    }];
    report.would_reclaim = report.leftovers.reclaimable();
    assert!(!report.would_reclaim.iter().any(|l| l.contains("a1b2")), "the tool never deletes a load balancer");
    report.gitops = gitops_survey();
    report.finish(started, Exit::Leftovers, false);
    let v = serde_json::to_value(&report).unwrap();
    assert_eq!(schema_errors(&v), Vec::<String>::new(), "{v:#}");
}

#[test]
fn the_validator_rejects_what_the_schema_forbids() {
    let good = json!({
        "version": 1, "tool_version": "0.1.0", "command": "verify", "cluster": "c", "region": "r",
        "plan": "", "outcome": "clean", "exit_code": 0, "started": "t", "finished": "t",
        "wall_seconds": 0.5, "steps": [], "blockers": [],
        "leftovers": {"instances": [], "launch_templates": [], "instance_profiles": [],
                      "network_interfaces": [], "volumes": [], "load_balancing": [], "objects": []},
        "reclaimed": [], "api_calls": {"ec2:DescribeInstances": 2}
    });
    assert_eq!(schema_errors(&good), Vec::<String>::new());
    let mut bad_outcome = good.clone();
    bad_outcome["outcome"] = json!("fine");
    assert_eq!(schema_errors(&bad_outcome).len(), 1, "{:?}", schema_errors(&bad_outcome));
    let mut missing = good.clone();
    missing.as_object_mut().unwrap().remove("leftovers");
    assert!(schema_errors(&missing)[0].contains("leftovers"));
    let mut extra = good.clone();
    extra["leftovers"]["volumes"] = json!([{"id": "vol-1", "status": "available", "size": 3}]);
    assert!(schema_errors(&extra)[0].contains("size"), "{:?}", schema_errors(&extra));
    let mut wrong_type = good;
    wrong_type["api_calls"]["ec2:TerminateInstances"] = json!("many");
    assert!(!schema_errors(&wrong_type).is_empty());
}

// ---------------------------------------------------------------------------------------------
// The shipped policies.

/// (apiGroup, resource, verb) triples the ClusterRole allows, plus its non-resource URLs.
fn rbac_rules() -> (BTreeSet<(String, String, String)>, Vec<String>) {
    let text = std::fs::read_to_string(repo_file("deploy/rbac.yaml")).unwrap();
    let mut allowed = BTreeSet::new();
    let mut urls = Vec::new();
    for v in serde_saphyr::from_multiple::<Value>(&text).unwrap() {
        if v["kind"] != "ClusterRole" {
            continue;
        }
        for rule in v["rules"].as_array().unwrap() {
            let list = |k: &str| -> Vec<String> {
                rule[k].as_array().into_iter().flatten().filter_map(|x| x.as_str().map(str::to_string)).collect()
            };
            urls.extend(list("nonResourceURLs"));
            for g in list("apiGroups") {
                for r in list("resources") {
                    for verb in list("verbs") {
                        allowed.insert((g.clone(), r.clone(), verb));
                    }
                }
            }
        }
    }
    (allowed, urls)
}

/// IAM actions the policy allows (wildcards such as `ec2:Describe*` kept as patterns).
fn iam_actions() -> Vec<String> {
    let text = std::fs::read_to_string(repo_file("deploy/iam-policy.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for st in v["Statement"].as_array().unwrap() {
        assert_eq!(st["Effect"], "Allow", "the shipped policy only allows");
        match &st["Action"] {
            Value::String(a) => out.push(a.clone()),
            Value::Array(a) => out.extend(a.iter().filter_map(|x| x.as_str().map(str::to_string))),
            other => panic!("unexpected Action {other}"),
        }
    }
    out
}

fn iam_allows(actions: &[String], action: &str) -> bool {
    actions.iter().any(|a| match a.strip_suffix('*') {
        Some(prefix) => action.to_ascii_lowercase().starts_with(&prefix.to_ascii_lowercase()),
        None => a.eq_ignore_ascii_case(action),
    })
}

/// The API group of a resource as the sandbox server names it (`deployments/scale`); a resource
/// missing here fails the test so that a new kind of call is looked at, not waved through.
fn group_of(resource: &str) -> Option<&'static str> {
    let base = resource.split('/').next().unwrap_or(resource);
    Some(match base {
        "nodes" | "pods" | "namespaces" | "services" | "serviceaccounts" | "events" => "",
        "deployments" | "replicasets" | "daemonsets" | "statefulsets" => "apps",
        "poddisruptionbudgets" => "policy",
        "customresourcedefinitions" => "apiextensions.k8s.io",
        "selfsubjectaccessreviews" => "authorization.k8s.io",
        "nodepools" | "nodeclaims" => "karpenter.sh",
        "applications" => "argoproj.io",
        "kustomizations" => "kustomize.toolkit.fluxcd.io",
        "helmreleases" => "helm.toolkit.fluxcd.io",
        "ec2nodeclasses" => "karpenter.k8s.aws",
        "validatingwebhookconfigurations" | "mutatingwebhookconfigurations" => "admissionregistration.k8s.io",
        "endpointslices" => "discovery.k8s.io",
        "persistentvolumes" => "",
        "ingresses" => "networking.k8s.io",
        "targetgroupbindings" => "elbv2.k8s.aws",
        "gateways" => "gateway.networking.k8s.io",
        "persistentvolumeclaims" => "",
        "volumeattachments" => "storage.k8s.io",
        "leases" => "coordination.k8s.io",
        _ => return None,
    })
}

/// Maps one request the sandbox counted to what RBAC must allow; returns why it is not allowed.
fn rbac_denies(
    rules: &BTreeSet<(String, String, String)>,
    urls: &[String],
    verb: &str,
    resource: &str,
) -> Option<String> {
    if resource == "discovery" || resource == "openapi" {
        let want = if resource == "discovery" { "/apis" } else { "/openapi/v3" };
        let ok = urls.iter().any(|u| u == want || u.strip_suffix('*').is_some_and(|p| want.starts_with(p)));
        return (!ok).then(|| format!("GET {want} (non-resource URL)"));
    }
    // a dry run (`dry-run patch`) needs the permission of the write it tries
    let verb = verb.strip_prefix("dry-run ").unwrap_or(verb);
    // the server counts an eviction as verb `evict` on `pods`; RBAC calls it create pods/eviction
    let (verb, resource) = if verb == "evict" { ("create", "pods/eviction") } else { (verb, resource) };
    let Some(group) = group_of(resource) else {
        return Some(format!("{verb} {resource}: unknown resource, add its API group to group_of"));
    };
    let ok = rules.contains(&(group.to_string(), resource.to_string(), verb.to_string()))
        || rules.contains(&(group.to_string(), "*".to_string(), verb.to_string()));
    (!ok).then(|| format!("{verb} {group}/{resource}"))
}

#[test]
fn the_policy_checks_can_fail() {
    let (rules, urls) = rbac_rules();
    assert_eq!(rbac_denies(&rules, &urls, "evict", "pods"), None);
    assert_eq!(rbac_denies(&rules, &urls, "patch", "deployments/scale"), None);
    assert_eq!(rbac_denies(&rules, &urls, "dry-run evict", "pods"), None);
    assert!(rbac_denies(&rules, &urls, "dry-run create", "nodes").is_some(), "a dry run needs the write's permission");
    assert!(rbac_denies(&rules, &urls, "create", "nodes").is_some(), "the tool never creates nodes");
    assert!(rbac_denies(&rules, &urls, "delete", "deployments").is_some());
    assert!(rbac_denies(&rules, &urls, "get", "secrets").is_some());
    let actions = iam_actions();
    assert!(iam_allows(&actions, "ec2:TerminateInstances"));
    assert!(!iam_allows(&actions, "ec2:RunInstances"), "the tool never launches");
    assert!(!iam_allows(&actions, "iam:DeleteRole"));
}

// ---------------------------------------------------------------------------------------------
// Sandbox runs of the real binary.

struct Bed {
    server: ApiServer,
    client: Client,
    cloud: sandbox_sim::cloud::Cloud,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

async fn bed(cluster: &str) -> Bed {
    let server = ApiServer::start(ServerOptions { time_scale: 0.01, ..ServerOptions::default() }).await.unwrap();
    let client = Client::try_from(server.kube_config()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, cluster).unwrap();
    common::register_eks(cluster, REGION, &server.url(), None).await;
    let cloud = common::cloud(REGION).await;
    Bed { server, client, cloud, dir, kubeconfig }
}

fn spec(prefix: &str, nodes: usize, version: KarpenterVersion) -> WorldSpec {
    WorldSpec {
        cluster: common::unique_cluster(prefix),
        nodes,
        node_pools: 2,
        node_classes: 2,
        pods_per_node: 2,
        managed_nodes: 1,
        decoys: 0,
        version,
        karpenter_crds: Some(common::e2e::real_crds(version)),
        concurrency: 8,
        settle_timeout: Duration::from_secs(30),
        ..WorldSpec::default()
    }
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn binary(args: &[&str], env: &[(&str, &str)]) -> Out {
    let out = tokio::process::Command::new(BIN)
        .args(args)
        .envs(common::localstack_env())
        .envs(env.iter().copied())
        // no terminal: stdin, stdout and stderr are pipes
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

/// Escape codes and other control characters; newlines and tabs are fine.
fn control_chars(s: &str) -> Vec<(usize, char)> {
    s.char_indices().filter(|(_, c)| c.is_control() && *c != '\n' && *c != '\t').collect()
}

fn assert_plain(what: &str, s: &str) {
    let bad = control_chars(s);
    assert!(bad.is_empty(), "{what} has control characters at {:?}:\n{s}", &bad[..bad.len().min(5)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teardown_without_a_terminal_logs_json_reports_by_schema_and_stays_within_the_shipped_policies() {
    // Karpenter 1.0 so that the conversion-webhook path (CRD patches) is among the calls; no
    // simulated controller, so every request the server sees during the run is the tool's
    let s = spec("op-policy", 3, KarpenterVersion::V1_0);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = b.server.requests().snapshot();
    let report_path = b.dir.path().join("report.json");
    let kubeconfig = b.kubeconfig.display().to_string();
    let report_arg = report_path.display().to_string();
    let out = binary(
        &[
            "--log-format",
            "json",
            "run",
            "--cluster",
            &world.cluster,
            "--region",
            REGION,
            "--kubeconfig",
            &kubeconfig,
            "--yes",
            "--report",
            &report_arg,
        ],
        &[],
    )
    .await;
    let after = b.server.requests().snapshot();
    assert_eq!(out.code, 0, "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);

    // no terminal: plain text only, and every log line is a JSON object
    assert_plain("stdout", &out.stdout);
    assert_plain("stderr", &out.stderr);
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert!(lines.len() > 5, "the run logs its tasks:\n{}", out.stderr);
    for line in &lines {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v.is_object() && v.get("level").is_some(), "{line}");
    }
    assert!(out.stdout.contains("outcome") || out.stdout.contains("clean"), "the summary: {}", out.stdout);

    // the report, against the shipped schema
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(schema_errors(&report), Vec::<String>::new(), "{report:#}");
    assert_eq!(report["outcome"], "clean");
    assert!(report["steps"].as_array().unwrap().iter().any(|s| s["action"] == "drain"));
    let calls = report["api_calls"].as_object().unwrap();
    assert!(calls.keys().any(|k| k.starts_with("kubernetes:")), "{calls:?}");
    assert!(
        calls.get("ec2:TerminateInstances").is_some_and(|n| n.as_u64() > Some(0)),
        "AWS calls are counted: {calls:?}"
    );

    // Kubernetes: every request the run made is allowed by deploy/rbac.yaml
    let (rules, urls) = rbac_rules();
    let mut denied = Vec::new();
    let mut made = Vec::new();
    for ((verb, resource), n) in &after {
        if before.get(&(verb.clone(), resource.clone())) == Some(n) {
            continue;
        }
        made.push(format!("{verb} {resource}"));
        if let Some(why) = rbac_denies(&rules, &urls, verb, resource) {
            denied.push(why);
        }
    }
    eprintln!("Kubernetes calls of the run: {made:?}");
    assert!(made.iter().any(|m| m == "evict pods"), "the run evicted through the Eviction API: {made:?}");
    assert!(denied.is_empty(), "deploy/rbac.yaml does not allow: {denied:?}");

    // AWS: every operation the run made is allowed by deploy/iam-policy.json
    let actions = iam_actions();
    let aws_calls: Vec<&String> = calls.keys().filter(|k| !k.starts_with("kubernetes:")).collect();
    eprintln!("AWS calls of the run: {aws_calls:?}");
    let denied: Vec<&&String> = aws_calls.iter().filter(|a| !iam_allows(&actions, a)).collect();
    assert!(denied.is_empty(), "deploy/iam-policy.json does not allow: {denied:?}");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_without_a_terminal_have_no_control_characters() {
    let s = spec("op-text", 2, KarpenterVersion::V1_14);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let kubeconfig = b.kubeconfig.display().to_string();
    let report_path = b.dir.path().join("dry.json");
    let report_arg = report_path.display().to_string();
    // a dry run logs identity evidence and prints the plan; FORCE_COLOR and a colour-happy TERM
    // must not bring escape codes into a pipe
    let args =
        ["run", "--cluster", &world.cluster, "--region", REGION, "--kubeconfig", &kubeconfig, "--report", &report_arg];
    let out = binary(&args, &[("TERM", "xterm-256color"), ("CLICOLOR_FORCE", "0")]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("Dry run"), "{}", out.stdout);
    assert!(!out.stderr.is_empty(), "the run logs in text");
    assert_plain("stdout", &out.stdout);
    assert_plain("stderr", &out.stderr);
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["outcome"], "dry-run");
    assert_eq!(schema_errors(&report), Vec::<String>::new(), "{report:#}");

    // errors are plain too, and a refused run's report follows the schema
    let out = binary(
        &[
            "run",
            "--cluster",
            "not-this-one",
            "--region",
            REGION,
            "--kubeconfig",
            &kubeconfig,
            "--yes",
            "--report",
            &report_arg,
        ],
        &[],
    )
    .await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert_plain("stderr", &out.stderr);
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["outcome"], "refused");
    assert_eq!(schema_errors(&report), Vec::<String>::new(), "{report:#}");
    b.server.shutdown().await;
}

/// The DOT the binary prints is plain text a renderer can take as it is (the render itself is
/// checked in `plan::dot_output_is_a_valid_digraph_of_the_steps`).
#[tokio::test]
async fn plan_dot_on_stdout_is_plain_text() {
    for plan in ["default", "delegate"] {
        let out = binary(&["plan", "--plan", plan, "--format", "dot"], &[]).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_plain("dot", &out.stdout);
        assert!(out.stdout.trim_start().starts_with("digraph"), "{}", out.stdout);
        assert!(out.stdout.contains("\"drain\""), "{}", out.stdout);
    }
}

#[tokio::test]
async fn completions_are_scripts_for_each_shell() {
    let mut seen = BTreeMap::new();
    for shell in ["bash", "zsh", "fish"] {
        let out = binary(&["completions", shell], &[]).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert!(out.stdout.contains("tf-prune") && out.stdout.contains("drain-deadline"), "{shell}:\n{}", out.stdout);
        seen.insert(shell, out.stdout);
    }
    // bash must at least parse it
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("completion.bash");
    std::fs::write(&file, &seen["bash"]).unwrap();
    let check = std::process::Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let bad = binary(&["completions", "powershell-9"], &[]).await;
    assert_eq!(bad.code, 2, "an unknown shell is bad input");
}
