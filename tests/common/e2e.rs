//! End-to-end helpers shared by the teardown tests: a test bed (sandbox API server, LocalStack
//! clients, a kubeconfig), a world spec, a run of the real binary, and the end-state checks every
//! successful teardown must pass.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use karpenter_teardown::aws::{AwsClients, InstanceState};
use karpenter_teardown::k8s;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use sandbox_apiserver::authz::Rbac;
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::{KarpenterVersion, World, WorldSpec, naming};
use serde_json::{Value, json};

/// The region of every end-to-end world.
pub const REGION: &str = "us-west-2";

/// The store's resourceVersion once the control plane has stopped writing: the same for a
/// second and a half in a row. Its status writes (a PodDisruptionBudget's is made up to 500 ms
/// after the last pod event) trail a generated world's last pod, by more on a loaded machine; a
/// version taken before them would count them as the tool's writes.
pub async fn settled_resource_version(server: &ApiServer) -> u64 {
    let quiet = Duration::from_millis(1500);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut rv = server.store().resource_version();
    let mut since = std::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = server.store().resource_version();
        if now != rv {
            (rv, since) = (now, std::time::Instant::now());
        } else if since.elapsed() >= quiet {
            return rv;
        }
        assert!(std::time::Instant::now() < deadline, "the control plane kept writing for 30 s (at version {rv})");
    }
}

/// The sandbox API server, clients of it and of LocalStack, and a kubeconfig in a temp dir.
pub struct Bed {
    pub server: ApiServer,
    pub client: Client,
    pub aws: AwsClients,
    /// The test bed's own EC2/IAM calls (the simulated Karpenter's).
    pub cloud: sandbox_sim::cloud::Cloud,
    pub dir: tempfile::TempDir,
    pub kubeconfig: PathBuf,
}

/// A test bed with the sandbox API server at the tests' usual speed.
pub async fn bed(cluster: &str) -> Bed {
    bed_with(cluster, ServerOptions { time_scale: 0.01, ..ServerOptions::default() }).await
}

/// The project's `deploy/rbac.yaml`, as the sandbox enforces it.
pub fn shipped_rbac() -> Rbac {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml");
    Rbac::from_yaml(&std::fs::read_to_string(path).expect("deploy/rbac.yaml")).expect("deploy/rbac.yaml parses")
}

/// A test bed with the given server options, and a kubeconfig whose context is `cluster`. The
/// kubeconfig's identity (the tool's) holds exactly the permissions of `deploy/rbac.yaml`, unless
/// `opts` names other rules: every run is held to what the README tells users to grant.
pub async fn bed_with(cluster: &str, mut opts: ServerOptions) -> Bed {
    opts.rbac = opts.rbac.or_else(|| Some(shipped_rbac()));
    let aws = super::localstack(REGION).await;
    let cloud = super::cloud(REGION).await;
    let server = ApiServer::start(opts).await.unwrap();
    let client = Client::try_from(server.kube_config()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, cluster).unwrap();
    super::register_eks(cluster, REGION, &server.url(), None).await;
    Bed { server, client, aws, cloud, dir, kubeconfig }
}

/// Karpenter's own files of a release (CRDs, examples), from Go's module cache at the pinned
/// version (another project's files: read from there, never copied in). Asked once per release
/// and test binary.
pub fn release(version: KarpenterVersion) -> sandbox_sim::karpenter_crds::ReleaseFiles {
    static FILES: std::sync::Mutex<Vec<(KarpenterVersion, sandbox_sim::karpenter_crds::ReleaseFiles)>> =
        std::sync::Mutex::new(Vec::new());
    let mut files = FILES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, f)) = files.iter().find(|(v, _)| *v == version) {
        return f.clone();
    }
    let f = sandbox_sim::karpenter_crds::release_files(version).unwrap_or_else(|e| panic!("{e}"));
    files.push((version, f.clone()));
    f
}

/// Karpenter's own CRD files of a release.
pub fn real_crds(version: KarpenterVersion) -> PathBuf {
    release(version).crds()
}

/// Argo CD's Application and Flux's Kustomization and HelmRelease CRDs of the pinned releases,
/// from Go's module cache (`sandbox_sim::gitops_crds`). Read once per test binary.
pub fn gitops_crds() -> Vec<Value> {
    static CRDS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    CRDS.get_or_init(|| sandbox_sim::gitops_crds::release_crds().unwrap_or_else(|e| panic!("{e}"))).clone()
}

/// A small world: 3 pools, 2 classes, 2 pods per node, managed nodes, a control-plane node, decoys,
/// on Karpenter's real CRDs (their defaults and CEL rules hold, as on a real cluster).
pub fn small_world(prefix: &str, nodes: usize) -> WorldSpec {
    WorldSpec {
        karpenter_crds: Some(real_crds(KarpenterVersion::default())),
        cluster: super::unique_cluster(prefix),
        nodes,
        node_pools: 3,
        node_classes: 2,
        pods_per_node: 2,
        managed_nodes: 2,
        taint_managed_node: true,
        control_plane_node: true,
        decoys: 2,
        concurrency: 16,
        settle_timeout: Duration::from_secs(30),
        ..WorldSpec::default()
    }
}

/// What a run of the binary produced.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub report: Value,
}

impl Run {
    /// Everything a user sees, for assertion messages.
    pub fn dump(&self) -> String {
        format!("exit {}\nstdout:\n{}\nstderr:\n{}\nreport:\n{:#}", self.code, self.stdout, self.stderr, self.report)
    }
}

/// Whether a run may change anything: every call of [`teardown`] says so, so no test is a dry
/// run (or a real one) by accident of which helper is in scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consent {
    /// No `--yes`: the run reads, plans and changes nothing.
    DryRun,
    /// `--yes`: the run tears down.
    Yes,
}

/// Runs `karpenter-teardown run` against the bed with `consent` and `extra` arguments; reads
/// its JSON report.
pub async fn teardown(b: &Bed, cluster: &str, consent: Consent, extra: &[&str]) -> Run {
    let report = b.dir.path().join("report.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    // KT_TEST_LOGS=1 shows the tool's logs live (with --nocapture) when a test needs debugging
    if std::env::var_os("KT_TEST_LOGS").is_some() {
        cmd.stderr(std::process::Stdio::inherit());
    }
    cmd.args(["run", "--cluster", cluster, "--region", REGION, "--kubeconfig"])
        .arg(&b.kubeconfig)
        .arg("--report")
        .arg(&report)
        .args((consent == Consent::Yes).then_some("--yes"))
        .args(extra)
        .envs(super::localstack_env())
        // held to deploy/iam-policy.json by the EC2 proxy, as AWS holds the user's identity
        .env("AWS_ACCESS_KEY_ID", super::judged_key(cluster, REGION))
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

/// Runs a prepared command of the binary to its end and reads the report it wrote at `report`.
pub async fn run_of(mut cmd: tokio::process::Command, report: &std::path::Path) -> Run {
    let out = cmd.kill_on_drop(true).output().await.unwrap();
    let report = std::fs::read(report).ok().and_then(|r| serde_json::from_slice(&r).ok()).unwrap_or(Value::Null);
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        report,
    }
}

/// EC2 states of instances by id.
pub async fn states(aws: &AwsClients, ids: &[String]) -> BTreeMap<String, InstanceState> {
    aws.ec2.instances_by_id(ids).await.unwrap().into_iter().map(|i| (i.id, i.state)).collect()
}

/// How many objects of a kind the cluster holds (0 when the kind is not served).
pub async fn count(client: &Client, ar: &kube::core::ApiResource) -> usize {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    api.list(&ListParams::default()).await.map(|l| l.items.len()).unwrap_or(0)
}

/// Labels, taints and schedulability of the nodes the tool must never touch.
/// A ValidatingWebhookConfiguration `node-policy`: one fail-closed webhook on node updates and
/// deletes, called through service `default/node-policy`, giving up after a second.
pub fn node_policy_webhook() -> Value {
    json!({
        "metadata": {"name": "node-policy"},
        "webhooks": [{
            "name": "nodes.policy.example.com",
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"service": {"namespace": "default", "name": "node-policy", "port": 443}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "timeoutSeconds": 1,
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE", "DELETE"], "resources": ["nodes"]}],
        }],
    })
}

/// The blockers of `kind` in a run's report.
pub fn blockers_of<'a>(run: &'a Run, kind: &str) -> Vec<&'a Value> {
    run.report["blockers"].as_array().into_iter().flatten().filter(|b| b["kind"] == kind).collect()
}

/// A run refused before its first write left every Karpenter node of the world there and
/// uncordoned.
pub async fn assert_no_node_fenced(client: &Client, world: &World) {
    let nodes: Api<Node> = Api::all(client.clone());
    let karpenter = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    assert_eq!(karpenter.items.len(), world.nodes.len());
    assert!(
        karpenter.items.iter().all(|n| n.spec.as_ref().and_then(|s| s.unschedulable) != Some(true)),
        "a node was cordoned"
    );
}

/// Names of the nodes the tool must never touch: the managed node group and the control plane.
pub fn untouchable_names(world: &World) -> Vec<String> {
    let mut names: Vec<String> = world.managed_nodes.iter().map(|m| m.node.clone()).collect();
    names.extend(world.control_plane_node.clone());
    names
}

pub async fn untouchable_nodes(client: &Client, world: &World) -> BTreeMap<String, Value> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut out = BTreeMap::new();
    for n in untouchable_names(world) {
        let node = nodes.get(&n).await.unwrap();
        let spec = node.spec.unwrap_or_default();
        out.insert(
            n,
            json!({"labels": node.metadata.labels, "taints": spec.taints, "unschedulable": spec.unschedulable}),
        );
    }
    out
}

/// The end state every successful teardown must reach.
pub async fn assert_torn_down(b: &Bed, world: &World, before: &BTreeMap<String, Value>) {
    assert_torn_down_on(&b.client, &b.aws, world, before).await;
}

/// [`assert_torn_down`] for any API server (`client` may read everything) and LocalStack.
pub async fn assert_torn_down_on(client: &Client, aws: &AwsClients, world: &World, before: &BTreeMap<String, Value>) {
    let ours = states(aws, &world.karpenter_instance_ids()).await;
    assert_eq!(ours.len(), world.nodes.len());
    assert!(ours.values().all(|s| *s == InstanceState::Terminated), "Karpenter instances: {ours:?}");
    let mut keep = world.managed_instance_ids();
    keep.extend(world.decoy_instances.clone());
    let kept = states(aws, &keep).await;
    assert!(kept.values().all(|s| *s == InstanceState::Running), "managed and decoy instances: {kept:?}");
    assert_eq!(count(client, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
    assert_eq!(count(client, &k8s::nodepool_resource()).await, 0, "NodePools left");
    assert_eq!(count(client, &k8s::nodeclass_resource()).await, 0, "EC2NodeClasses left");
    let nodes: Api<Node> = Api::all(client.clone());
    let karpenter_nodes = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
    assert!(karpenter_nodes.items.is_empty(), "Karpenter nodes left");
    assert!(aws.ec2.launch_templates(&world.cluster).await.unwrap().is_empty(), "launch templates left");
    assert!(
        aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap().is_empty(),
        "instance profiles left"
    );
    assert_eq!(&untouchable_nodes(client, world).await, before, "non-Karpenter nodes changed");
}

/// The simulated Karpenter, live on the bed's world at the tests' usual accelerated clock.
pub fn live_karpenter(b: &Bed, world: &World) -> sandbox_sim::SimController {
    sandbox_sim::SimController::start(
        b.client.clone(),
        b.cloud.clone(),
        sandbox_sim::SimSettings {
            version: world.version,
            time_scale: 0.02,
            ..sandbox_sim::SimSettings::new(&world.cluster, REGION)
        },
    )
}

/// Scales the Karpenter Deployment.
pub async fn scale_controller(c: &Client, replicas: i32) {
    let api: Api<Deployment> = Api::namespaced(c.clone(), naming::KARPENTER_NAMESPACE);
    api.patch(naming::KARPENTER_NAME, &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": replicas}})))
        .await
        .unwrap();
}

/// The Load Balancer Controller's chart name (its pods' `app.kubernetes.io/name`).
pub const LBC: &str = "aws-load-balancer-controller";

/// A pod of the Load Balancer Controller (its chart's labels) bound to `node`; `karpenter_only`
/// gives it a required affinity for Karpenter's nodes.
pub fn controller_pod(name: &str, node: &str, karpenter_only: bool) -> Pod {
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

/// The chart's Deployment (its pods made by hand, placed where the test wants them).
pub async fn lbc_deployment(client: &kube::Client) {
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": LBC, "namespace": "kube-system", "labels": {"app.kubernetes.io/name": LBC}},
        "spec": {"replicas": 0,
                 "selector": {"matchLabels": {"app.kubernetes.io/name": LBC, "app.kubernetes.io/instance": LBC}},
                 "template": {"metadata": {"labels": {"app.kubernetes.io/name": LBC, "app.kubernetes.io/instance": LBC}},
                              "spec": {"containers": [{"name": "controller", "image": "x"}]}}},
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), "kube-system")
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
}

/// The Load Balancer Controller as a test needs it running: its chart's Deployment, its pod
/// `lbc-0` on `node` (needing Karpenter's capacity when `karpenter_only`), and the stand-in
/// (`sandbox_sim::lbc`) acting for it against the AWS of `config`.
pub async fn running_lbc(
    b: &Bed,
    config: &aws_config::SdkConfig,
    cluster: &str,
    node: &str,
    karpenter_only: bool,
) -> sandbox_sim::standin::StandIn {
    lbc_deployment(&b.client).await;
    let pods: Api<Pod> = Api::namespaced(b.client.clone(), "kube-system");
    pods.create(&PostParams::default(), &controller_pod("lbc-0", node, karpenter_only)).await.unwrap();
    sandbox_sim::lbc::start(b.client.clone(), config, cluster, Duration::from_millis(100))
}

/// Namespace `shop` and in it a Service `shop/<name>` of type LoadBalancer for each of `names`;
/// returns the namespace's Services.
pub async fn shop_services(client: &Client, names: &[&str]) -> Api<k8s_openapi::api::core::v1::Service> {
    use k8s_openapi::api::core::v1::{Namespace, Service};
    let pp = PostParams::default();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
    Api::<Namespace>::all(client.clone()).create(&pp, &ns).await.unwrap();
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    for name in names {
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name, "namespace": "shop"},
                                                          "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}}))
        .unwrap();
        services.create(&pp, &svc).await.unwrap();
    }
    services
}

/// NodePool `legacy` of class `class`, written at `v1beta1` while Karpenter 1.0.x's conversion
/// webhook answers: it stays stored at `v1beta1`, unreadable once the webhook is gone. Returns
/// the NodePools at `v1beta1`.
pub async fn legacy_v1beta1_pool(client: &Client, class: &str) -> Api<DynamicObject> {
    let v1beta1 = Api::<DynamicObject>::all_with(
        client.clone(),
        &kube::core::ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk("karpenter.sh", "v1beta1", "NodePool"),
            "nodepools",
        ),
    );
    let legacy: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "karpenter.sh/v1beta1", "kind": "NodePool", "metadata": {"name": "legacy"},
        // `requirements` is required by the v1beta1 schema too: the real server refuses the pool without it
        "spec": {"template": {"spec": {"nodeClassRef": {"name": class},
            "requirements": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}}},
    }))
    .unwrap();
    v1beta1.create(&PostParams::default(), &legacy).await.unwrap();
    v1beta1
}

/// A plan of preflight and verify, "just check": with `--reclaim` it is refused when loaded.
pub const VERIFY_ONLY: &str = r#"
version = 1
name = "verify-only"
[[step]]
id = "preflight"
action = "preflight"
[[step]]
id = "check"
action = "verify"
after = ["preflight"]
"#;

/// Drains, then verifies: the nodes are still there (nothing released them) when verify runs, so
/// a reclaim there would terminate instances under them.
pub const DRAIN_THEN_VERIFY: &str = r#"
version = 1
name = "drain-then-verify"
[[step]]
id = "preflight"
action = "preflight"
[[step]]
id = "fence"
action = "fence"
after = ["preflight"]
[[step]]
id = "cordon"
action = "cordon"
after = ["fence"]
[[step]]
id = "drain"
action = "drain"
for_each = "machine"
after = ["cordon"]
[step.params]
deadline = "2m"
[[step]]
id = "verify"
action = "verify"
after = ["drain"]
"#;

/// A copy of the shipped default plan with the controller removed only after every drain: a live
/// controller sees the whole drain (as when something scales it back up, or in the delegate plan's
/// fallback), and no machine is released before every drain is over. The default plan removes it
/// beside the drain, which would hide what the fence is for.
pub fn controller_through_the_drain(text: &str) -> String {
    let early = "id = \"remove-controller\"\naction = \"remove-controller\"\nafter = [\"fence\"]";
    assert!(text.contains(early), "plans/default.toml changed: update this test");
    text.replacen(early, &early.replace("[\"fence\"]", "[\"drain\"]"), 1)
        .replace("name = \"default\"", "name = \"controller-through-the-drain\"")
}

/// The shipped default plan without its fence step, the controller live through the drain: the
/// drain follows the preflight directly, and a controller that sees pods evicted launches for them.
pub fn default_without_fence() -> String {
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/plans/default.toml")).unwrap();
    let text = controller_through_the_drain(&shipped);
    let start = text.find("[[step]]\nid = \"fence\"").expect("default.toml has a fence step");
    let end = start + text[start..].find("\n[[step]]").expect("a step follows the fence") + 1;
    let mut out = format!("{}{}", &text[..start], &text[end..]);
    assert!(out.contains("after = [\"fence\"]"));
    out = out
        .replace("after = [\"fence\"]", "after = [\"preflight\"]")
        .replace("name = \"controller-through-the-drain\"", "name = \"no-fence\"");
    out
}
