//! The real Karpenter (`github.com/aws/karpenter-provider-aws`, `./cmd/controller`, built from
//! source by `build-karpenter` at the version `karpenter/go.mod` pins, or for the 1.0 line
//! `karpenter-1.0/go.mod`) as the live controller of a [`RealStack`], with EC2, IAM and STS served
//! by LocalStack.
//!
//! What 1.0 needs that 1.14 does not, each closed as narrowly as it goes:
//! - its CRDs route conversion to a webhook Service `kube-system/karpenter` that does not exist
//!   here. kube-apiserver calls a conversion webhook only for objects whose apiVersion differs
//!   from the one asked for (k8s.io/apiextensions-apiserver v0.34
//!   pkg/apiserver/conversion/webhook_converter.go, `getObjectsToConvert`; with none it answers
//!   without a call); every object here, the tool's and Karpenter's, is written and read as `v1`,
//!   the storage version, so the missing Service is never dialled. The
//!   controller's own webhook server (and the migration controllers that go with it) is switched
//!   off with `DISABLE_WEBHOOK=true`, which its `pkg/operator/options` provides for that;
//! - it calls AWS through aws-sdk-go v1, which ignores `AWS_ENDPOINT_URL`: see [`sdk_v1_relay`];
//! - it has no `EKS_CONTROL_PLANE` option (it always reads the Kubernetes version from the API
//!   server) and logs, without stopping, that it was not made for the stack's Kubernetes (1.0.14
//!   supports 1.25 to 1.31; `pkg/providers/version`).
//!
//! Karpenter runs as a process on this machine, not as a pod, so the test bed plays the parts of
//! the cluster around it that are not there. On a stack of etcd and kube-apiserver only:
//! - the `karpenter` Deployment in `kube-system` (or the name [`KarpenterSettings::name`] gives it,
//!   as the chart's `nameOverride` does) and its one Pod stand for the process: while the
//!   Deployment asks for a replica the process runs and the Deployment reports it ready; once it is
//!   scaled to zero (or deleted) the process is killed and the Pod removed, as the Deployment
//!   controller and the kubelet would;
//! - pending pods are marked `PodScheduled=False, reason Unschedulable`, which kube-scheduler
//!   writes and which is the only sign Karpenter provisions for;
//! - each launched NodeClaim gets its Node, registered as the kubelet on that instance would, and
//!   marked Ready.
//!
//! On the full stack ([`ControlPlane::Full`]) the real components do their own parts: the
//! Deployment and ReplicaSet controllers make and remove the controller's pod (which the real
//! scheduler places as Karpenter's Helm chart shapes it: never on a Karpenter node), kube-scheduler
//! marks pending pods unschedulable, and kwok makes each registered Node Ready and runs the pods
//! bound to it. Only the process follows the Deployment, and the registrar still creates each
//! Node (kwok manages Nodes, it does not create them).
//!
//! [`RealKarpenter`] owns the process: it runs in a process group of its own with a watchdog that
//! ends it once the test process is gone, and the group is killed when it is dropped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

pub use sandbox_sim::KarpenterVersion;

use crate::{BuildFailure, ControlPlane, RealStack, build_once_with};

mod sdk_v1_relay;

/// The namespace and name of the controller's Deployment, where Karpenter's Helm chart puts it.
pub const NAMESPACE: &str = "kube-system";
/// See [`NAMESPACE`]. The name [`KarpenterSettings::name`] has unless a test says otherwise.
pub const NAME: &str = "karpenter";

/// The field manager of everything the test bed writes on Karpenter's behalf.
const MANAGER: &str = "realstack-karpenter";

/// Why the real Karpenter could not be built, started or served; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum KarpenterError {
    /// `build-karpenter` could not run Go.
    #[error(
        "Go is not installed (or not on PATH): the test bed builds Karpenter from source with Go 1.26 or later; install Go (https://go.dev/doc/install) and run the tests again"
    )]
    GoMissing,
    /// `build-karpenter` ran and failed.
    #[error(
        "building Karpenter failed ({status}): run `crates/realstack/build-karpenter` to see the Go error (it needs the Go module proxy, or GOMODCACHE holding the modules of crates/realstack/karpenter/go.sum)"
    )]
    Build {
        /// How the script ended.
        status: String,
    },
    /// A file or a process could not be made.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A call to the real server failed.
    #[error("{what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The cause.
        source: kube::Error,
    },
    /// The stack's own client or kubeconfig could not be had.
    #[error("{0}")]
    Stack(#[from] crate::RealStackError),
    /// The kubeconfig the stack wrote for the tool is not what it writes.
    #[error("the tool's kubeconfig {0} has no cluster entry to reuse for Karpenter")]
    Kubeconfig(PathBuf),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> KarpenterError {
    let what = what.into();
    move |source| KarpenterError::Io { what, source }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> KarpenterError {
    let what = what.into();
    move |source| KarpenterError::Kube { what, source }
}

/// The path of the `build-karpenter` script.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("build-karpenter")
}

/// The Karpenter 1.14 binary, built by `build-karpenter` the first time a process asks.
pub fn binary() -> Result<PathBuf, KarpenterError> {
    binary_for(KarpenterVersion::V1_14)
}

/// The release line `build-karpenter` is asked for, and the Go module directory it builds in.
pub(crate) fn release_line(version: KarpenterVersion) -> (&'static str, &'static str) {
    match version {
        KarpenterVersion::V1_0 => ("1.0", "karpenter-1.0"),
        KarpenterVersion::V1_14 => ("1.14", "karpenter"),
    }
}

/// The Karpenter binary of a release line, built by `build-karpenter` the first time a process
/// asks for that line.
pub fn binary_for(version: KarpenterVersion) -> Result<PathBuf, KarpenterError> {
    static BUILT_1_0: OnceLock<Result<(), BuildFailure>> = OnceLock::new();
    static BUILT_1_14: OnceLock<Result<(), BuildFailure>> = OnceLock::new();
    let cell = match version {
        KarpenterVersion::V1_0 => &BUILT_1_0,
        KarpenterVersion::V1_14 => &BUILT_1_14,
    };
    let (line, dir) = release_line(version);
    match build_once_with(cell, &build_script(), &[line]) {
        Ok(()) => Ok(Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join("bin/karpenter")),
        Err(BuildFailure::GoMissing) => Err(KarpenterError::GoMissing),
        Err(BuildFailure::Failed(status)) => Err(KarpenterError::Build { status }),
    }
}

/// What the real Karpenter is started with.
#[derive(Debug, Clone)]
pub struct KarpenterSettings {
    /// The cluster's name (`CLUSTER_NAME`): Karpenter tags what it creates with it.
    pub cluster_name: String,
    /// The AWS region.
    pub region: String,
    /// Where the AWS SDK sends every call (`AWS_ENDPOINT_URL`): LocalStack, or a proxy before it.
    pub aws_endpoint: String,
    /// The name Karpenter's Helm chart gives the controller: its Deployment's and ServiceAccount's
    /// name and its pods' `app.kubernetes.io/name`, [`NAME`] by default, or what the chart's
    /// `nameOverride` and `fullnameOverride` set (charts/karpenter/templates/_helpers.tpl,
    /// `karpenter.name` and `karpenter.fullname`). The supervisor, the stand-in pod and the
    /// scheduler's stand-in all follow it.
    pub name: String,
}

impl Default for KarpenterSettings {
    /// No cluster, region or endpoint (each test gives its own), and the chart's default name.
    fn default() -> Self {
        KarpenterSettings {
            cluster_name: String::new(),
            region: String::new(),
            aws_endpoint: String::new(),
            name: NAME.to_string(),
        }
    }
}

/// How Karpenter 1.0's AWS calls reach the endpoint (see [`sdk_v1_relay`]).
#[derive(Debug, Clone)]
pub(crate) struct AwsRelay {
    /// `HTTPS_PROXY`.
    pub(crate) proxy_url: String,
    /// `AWS_CA_BUNDLE`: the relay's certificate.
    pub(crate) ca_file: PathBuf,
}

/// The environment of the Karpenter process. The names are those of
/// `pkg/operator/options/options.go` in karpenter-provider-aws and in sigs.k8s.io/karpenter, at
/// the version of each release line.
pub(crate) fn environment(
    version: KarpenterVersion,
    settings: &KarpenterSettings,
    kubeconfig: &Path,
    cluster_endpoint: &str,
    metrics_port: u16,
    health_port: u16,
    relay: Option<&AwsRelay>,
) -> Vec<(String, String)> {
    let mut pairs: Vec<(&str, String)> = vec![
        ("KUBECONFIG", kubeconfig.display().to_string()),
        ("CLUSTER_NAME", settings.cluster_name.clone()),
        // set, so Karpenter does not ask EKS's DescribeCluster for it (operator.ResolveClusterEndpoint)
        ("CLUSTER_ENDPOINT", cluster_endpoint.to_string()),
        // no Pricing API here: with an isolated VPC Karpenter keeps its built-in price list
        // (pricing.NewDefaultProvider)
        ("ISOLATED_VPC", "true".into()),
        // the Kubernetes version comes from the API server's /version, not EKS's DescribeCluster
        // (version.DefaultProvider.UpdateVersion)
        ("EKS_CONTROL_PLANE", "false".into()),
        ("DISABLE_LEADER_ELECTION", "true".into()),
        // many tests may run side by side: no fixed ports
        ("METRICS_PORT", metrics_port.to_string()),
        ("HEALTH_PROBE_PORT", health_port.to_string()),
        ("LOG_LEVEL", "debug".into()),
        // a test's pods come all at once: a short batching window
        ("BATCH_IDLE_DURATION", "1s".into()),
        ("BATCH_MAX_DURATION", "3s".into()),
        ("AWS_REGION", settings.region.clone()),
        ("AWS_ENDPOINT_URL", settings.aws_endpoint.clone()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_EC2_METADATA_DISABLED", "true".into()),
        // the SDK's shared config must not be this machine's
        ("AWS_CONFIG_FILE", "/dev/null".into()),
    ];
    if version == KarpenterVersion::V1_0 {
        // 1.0 has neither option: it reads the Kubernetes version from the API server, and its
        // SDK (aws-sdk-go v1) ignores AWS_ENDPOINT_URL; leaving them out keeps its environment
        // what it reads
        pairs.retain(|(k, _)| !matches!(*k, "EKS_CONTROL_PLANE" | "AWS_ENDPOINT_URL"));
        // no conversion webhook server (there is no Service to reach it, and no object here is
        // converted) and none of the v1beta1 migration controllers that only run beside it
        // (sigs.k8s.io/karpenter v1.0 pkg/controllers/controllers.go, pkg/operator/operator.go)
        pairs.push(("DISABLE_WEBHOOK", "true".into()));
        // 1.0's operator asks knative for its namespace at start (knative.dev/pkg system.Namespace,
        // sigs.k8s.io/karpenter v1.0 pkg/operator/operator.go) and panics without it; its Helm
        // chart sets it from the pod's namespace through the downward API
        pairs.push(("SYSTEM_NAMESPACE", NAMESPACE.into()));
        if let Some(relay) = relay {
            pairs.push(("HTTPS_PROXY", relay.proxy_url.clone()));
            // the API server is on loopback, which Go never proxies; said anyway for readers
            pairs.push(("NO_PROXY", "127.0.0.1,localhost".into()));
            // the SDK's own CA setting (aws-sdk-go v1 aws/session reads AWS_CA_BUNDLE and then
            // trusts only that bundle): set here, it also replaces one this machine exports
            pairs.push(("AWS_CA_BUNDLE", relay.ca_file.display().to_string()));
        }
    }
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Whether the Deployment asks for the controller to run: it exists and wants a replica.
pub(crate) fn wants_to_run(deployment: Option<&Deployment>) -> bool {
    deployment.is_some_and(|d| {
        d.metadata.deletion_timestamp.is_none() && d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) > 0
    })
}

/// The instance id and zone of an AWS provider id, `aws:///<zone>/<instance-id>`
/// (karpenter-provider-aws `pkg/utils.ParseInstanceID` reads the same form).
pub(crate) fn parse_provider_id(provider_id: &str) -> Option<(&str, &str)> {
    let rest = provider_id.strip_prefix("aws:///")?;
    let (zone, id) = rest.split_once('/')?;
    (!zone.is_empty() && id.starts_with("i-")).then_some((zone, id))
}

/// The Node the kubelet on a NodeClaim's instance registers: named as the instance's private DNS
/// name (the kubelet's hostname on EC2), with the provider id, the NodeClaim's labels and taints,
/// and Karpenter's `karpenter.sh/unregistered:NoExecute` taint, which the kubelet is started with
/// (karpenter's `pkg/apis/v1` UnregisteredNoExecuteTaint) and Karpenter removes on registration.
/// Capacity and allocatable are the NodeClaim's. With `ready` the node reports Ready itself;
/// without, it has no conditions, which is what kwok's `node-initialize` stage selects (Ready not
/// True; sigs.k8s.io/kwok kustomize/stage/node/fast/node-initialize.yaml) to make it Ready while
/// keeping the capacity and allocatable it finds.
pub(crate) fn node_for(claim: &Value, node_name: &str, ready: bool) -> Option<Value> {
    let status = &claim["status"];
    let provider_id = status["providerID"].as_str()?;
    let (zone, _) = parse_provider_id(provider_id)?;
    let mut labels: BTreeMap<String, Value> = claim["metadata"]["labels"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    labels.insert("kubernetes.io/hostname".into(), json!(node_name));
    labels.insert("topology.kubernetes.io/zone".into(), json!(zone));
    let mut taints: Vec<Value> = Vec::new();
    for t in [&claim["spec"]["taints"], &claim["spec"]["startupTaints"]] {
        taints.extend(t.as_array().cloned().unwrap_or_default());
    }
    taints.push(json!({"key": "karpenter.sh/unregistered", "effect": "NoExecute"}));
    let now = "1970-01-01T00:00:00Z";
    let mut node_status = json!({"capacity": status["capacity"], "allocatable": status["allocatable"]});
    if ready {
        node_status["conditions"] = json!([{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "kubelet is posting ready status", "lastHeartbeatTime": now, "lastTransitionTime": now,
        }]);
    }
    Some(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name, "labels": labels},
        "spec": {"providerID": provider_id, "taints": taints},
        "status": node_status,
    }))
}

/// Whether kube-scheduler would have marked this pod unschedulable by now: not bound, not yet
/// marked, not deleted, and not the controller's own pod (`app.kubernetes.io/name` = `name`; it
/// would run on a node of another node group in a real cluster).
pub(crate) fn needs_unschedulable_mark(pod: &Pod, name: &str) -> bool {
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
    let marked = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "PodScheduled"));
    let controller =
        pod.metadata.labels.as_ref().and_then(|l| l.get("app.kubernetes.io/name")).map(String::as_str) == Some(name);
    !bound && !marked && !controller && pod.metadata.deletion_timestamp.is_none()
}

fn nodeclaims() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("karpenter.sh", "v1", "NodeClaim"), "nodeclaims")
}

fn free_port() -> Result<u16, KarpenterError> {
    crate::free_port().map_err(io("finding a free port"))
}

/// The process and what the supervisor needs to restart it.
struct Process {
    bin: PathBuf,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl Process {
    fn start(&mut self) -> Result<(), KarpenterError> {
        use std::os::unix::process::CommandExt;
        if self.child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(io(format!("opening {}", self.log.display())))?;
        let log2 = log.try_clone().map_err(io(format!("opening {}", self.log.display())))?;
        // A watchdog shell runs Karpenter and ends it once the test process is no longer its
        // parent: a test binary killed outright runs no drop, and Karpenter has no such check of
        // its own. Both are in a new process group, which drop kills.
        let script = r#"
"$0" & k=$!
while kill -0 "$k" 2>/dev/null; do
    if [ "$(cut -d' ' -f4 /proc/$$/stat)" != "$REALSTACK_PARENT_PID" ]; then kill -KILL "$k"; exit 1; fi
    sleep 1
done
wait "$k""#;
        let child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .arg(&self.bin)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("REALSTACK_PARENT_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .spawn()
            .map_err(io(format!("starting Karpenter ({})", self.bin.display())))?;
        self.child = Some(child);
        self.starts += 1;
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGKILL to the group (`kill -- -PGID`): the workspace forbids `unsafe`, which
            // calling kill(2) directly would need
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.child = None;
                false
            }
            None => false,
        }
    }
}

/// The real Karpenter, running against a [`RealStack`] for as long as its Deployment asks.
/// Dropping it kills the process and stops the test bed's stand-ins.
pub struct RealKarpenter {
    process: Arc<Mutex<Process>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    registered: Arc<Mutex<Vec<String>>>,
    log: PathBuf,
    version: KarpenterVersion,
    _relay: Option<sdk_v1_relay::Relay>,
    _dir: tempfile::TempDir,
}

impl RealKarpenter {
    /// Gives Karpenter an identity on the stack (a ServiceAccount bound to `cluster-admin`, with a
    /// token from the TokenRequest API), creates its Deployment (and, without the full control
    /// plane, its Pod), starts the process, and starts the stand-ins the stack needs (see the
    /// module's documentation). `ec2` is what the node registrar reads instances with.
    pub async fn start(
        stack: &RealStack,
        settings: KarpenterSettings,
        ec2: aws_sdk_ec2::Client,
    ) -> Result<RealKarpenter, KarpenterError> {
        Self::start_version(stack, KarpenterVersion::V1_14, settings, ec2).await
    }

    /// [`RealKarpenter::start`] for a release line of Karpenter.
    pub async fn start_version(
        stack: &RealStack,
        version: KarpenterVersion,
        settings: KarpenterSettings,
        ec2: aws_sdk_ec2::Client,
    ) -> Result<RealKarpenter, KarpenterError> {
        let bin = binary_for(version)?;
        let admin = stack.admin_client().await?;
        let dir = tempfile::Builder::new().prefix("karpenter-").tempdir().map_err(io("making a temp dir"))?;
        let kubeconfig = dir.path().join("kubeconfig");
        let token = identity(&admin, &settings.name).await?;
        std::fs::write(&kubeconfig, kubeconfig_with_token(stack.tool_kubeconfig(), &token)?.to_string())
            .map_err(io(format!("writing {}", kubeconfig.display())))?;
        create_deployment(&admin, &settings).await?;

        let relay = match version {
            KarpenterVersion::V1_0 => {
                Some(sdk_v1_relay::start(dir.path(), &settings.region, &settings.aws_endpoint).await?)
            }
            KarpenterVersion::V1_14 => None,
        };
        let aws_relay = relay.as_ref().map(|r| AwsRelay { proxy_url: r.proxy_url.clone(), ca_file: r.ca_file.clone() });
        let log = dir.path().join("karpenter.log");
        let env = environment(
            version,
            &settings,
            &kubeconfig,
            &stack.server(),
            free_port()?,
            free_port()?,
            aws_relay.as_ref(),
        );
        let process = Arc::new(Mutex::new(Process { bin, env, log: log.clone(), child: None, starts: 0 }));
        let registered = Arc::new(Mutex::new(Vec::new()));
        let full = stack.control_plane() == ControlPlane::Full;
        let mut tasks = vec![
            tokio::spawn(supervise(admin.clone(), process.clone(), !full, settings.name.clone())),
            tokio::spawn(register_nodes(admin.clone(), ec2, registered.clone(), !full)),
        ];
        if !full {
            tasks.push(tokio::spawn(mark_unschedulable(admin, settings.name.clone())));
        }
        Ok(RealKarpenter { process, tasks, registered, log, version, _relay: relay, _dir: dir })
    }

    /// The release line running.
    pub fn version(&self) -> KarpenterVersion {
        self.version
    }

    /// Whether the Karpenter process is running now.
    pub fn running(&self) -> bool {
        self.process.lock().is_ok_and(|mut p| p.running())
    }

    /// How many times the process was started.
    pub fn starts(&self) -> u32 {
        self.process.lock().map(|p| p.starts).unwrap_or(0)
    }

    /// The Nodes the registrar created, in order.
    pub fn registered_nodes(&self) -> Vec<String> {
        self.registered.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The last `lines` lines of Karpenter's log, for assertion messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Karpenter's whole log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RealKarpenter {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        // a poisoned lock still holds the child: kill it all the same
        let mut p = self.process.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        p.stop();
    }
}

/// A ServiceAccount `kube-system/<name>` (`karpenter` by default) bound to `cluster-admin`, and a
/// token for it. The TokenRequest API is served by kube-apiserver itself (signed with its
/// service-account key), so it needs no kube-controller-manager.
async fn identity(admin: &kube::Client, name: &str) -> Result<String, KarpenterError> {
    let pp = PostParams { field_manager: Some(MANAGER.into()), ..PostParams::default() };
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NAMESPACE);
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name, "namespace": NAMESPACE}}))
        .map_err(|e| KarpenterError::Io { what: "the ServiceAccount".into(), source: e.into() })?;
    sas.create(&pp, &sa).await.map_err(kube_err("creating the karpenter ServiceAccount"))?;
    // Karpenter's Helm chart grants narrower ClusterRoles; the tests here are about the tool, and
    // the controller's own permissions are not what they check
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "realstack-karpenter"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
    }))
    .map_err(|e| KarpenterError::Io { what: "the ClusterRoleBinding".into(), source: e.into() })?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&pp, &crb)
        .await
        .map_err(kube_err("binding the karpenter ServiceAccount"))?;
    let req: TokenRequest = serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 86400}}))
        .map_err(|e| KarpenterError::Io { what: "the TokenRequest".into(), source: e.into() })?;
    let got = sas.create_token_request(name, &pp, &req).await.map_err(kube_err("requesting a token for Karpenter"))?;
    got.status.map(|s| s.token).ok_or_else(|| KarpenterError::Io {
        what: "the TokenRequest".into(),
        source: std::io::Error::other("no token in the answer"),
    })
}

/// The tool's kubeconfig (the stack's server and CA) with Karpenter's token instead of the
/// tool's.
pub(crate) fn kubeconfig_with_token(tool_kubeconfig: &Path, token: &str) -> Result<Value, KarpenterError> {
    let text =
        std::fs::read_to_string(tool_kubeconfig).map_err(io(format!("reading {}", tool_kubeconfig.display())))?;
    let mut cfg: Value =
        serde_json::from_str(&text).map_err(|_| KarpenterError::Kubeconfig(tool_kubeconfig.to_path_buf()))?;
    let user = cfg["users"].get_mut(0).ok_or_else(|| KarpenterError::Kubeconfig(tool_kubeconfig.to_path_buf()))?;
    *user = json!({"name": "karpenter", "user": {"token": token}});
    let ctx = cfg["contexts"].get_mut(0).ok_or_else(|| KarpenterError::Kubeconfig(tool_kubeconfig.to_path_buf()))?;
    ctx["context"]["user"] = json!("karpenter");
    Ok(cfg)
}

/// Where Karpenter's Helm chart lets the controller run (charts/karpenter/values.yaml in
/// karpenter-provider-aws v1.14.1): never on a node of a NodePool, so it does not run on the
/// capacity it manages, and on nodes kept for critical add-ons.
fn placement() -> Value {
    json!({
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "DoesNotExist"}]}]}}},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
    })
}

fn pod_spec(name: &str) -> Value {
    let mut spec = placement();
    spec["serviceAccountName"] = json!(name);
    spec["containers"] = json!([{"name": "controller", "image": "public.ecr.aws/karpenter/controller"}]);
    spec
}

/// The labels the chart gives the controller's Deployment and pods, for a chart name `name`.
fn labels(name: &str) -> Value {
    json!({"app.kubernetes.io/name": name, "app.kubernetes.io/instance": name})
}

fn deployment(settings: &KarpenterSettings) -> Value {
    let name = settings.name.as_str();
    let mut spec = pod_spec(name);
    spec["containers"][0]["env"] = json!([{"name": "CLUSTER_NAME", "value": settings.cluster_name}]);
    let labels = labels(name);
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": spec,
            },
        },
    })
}

async fn create_deployment(admin: &kube::Client, settings: &KarpenterSettings) -> Result<(), KarpenterError> {
    let pp = PostParams { field_manager: Some(MANAGER.into()), ..PostParams::default() };
    let d: Deployment = serde_json::from_value(deployment(settings))
        .map_err(|e| KarpenterError::Io { what: "the Deployment".into(), source: e.into() })?;
    Api::<Deployment>::namespaced(admin.clone(), NAMESPACE)
        .create(&pp, &d)
        .await
        .map_err(kube_err("creating the karpenter Deployment"))?;
    Ok(())
}

/// The stand-in of the controller's one pod, `<name>-0`.
fn controller_pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("{name}-0"), "namespace": NAMESPACE, "labels": labels(name)},
        "spec": pod_spec(name),
    })
}

/// Keeps the process in step with what the Deployment `name` asks and, with `stand_in_pod` (no
/// kube-controller-manager and no kwok on the stack), the Pod and the Deployment's status too, as
/// the Deployment controller and the kubelet would.
async fn supervise(admin: kube::Client, process: Arc<Mutex<Process>>, stand_in_pod: bool, name: String) {
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(admin, NAMESPACE);
    let pp = PostParams { field_manager: Some(MANAGER.into()), ..PostParams::default() };
    let status_pp = PatchParams::apply(MANAGER).force();
    loop {
        if let Ok(d) = deployments.get_opt(&name).await {
            let run = wants_to_run(d.as_ref());
            let running = {
                let Ok(mut p) = process.lock() else { return };
                if run {
                    if let Err(e) = p.start() {
                        tracing::error!(error = %e, "starting Karpenter");
                    }
                } else {
                    p.stop();
                }
                p.running()
            };
            if !stand_in_pod {
                // the real controllers own the Pod and the status
            } else if run {
                if let Ok(pod) = serde_json::from_value::<Pod>(controller_pod(&name)) {
                    let _ = pods.create(&pp, &pod).await;
                }
            } else {
                let _ = pods.delete(&format!("{name}-0"), &DeleteParams::default()).await;
            }
            if stand_in_pod && d.is_some() {
                let ready = i32::from(run && running);
                let status = json!({"apiVersion": "apps/v1", "kind": "Deployment",
                    "status": {"replicas": ready, "readyReplicas": ready, "availableReplicas": ready}});
                let _ = deployments.patch_status(&name, &status_pp, &Patch::Apply(&status)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// kube-scheduler's part: every pending pod is marked unschedulable (there is no node it could be
/// bound to that Karpenter did not make, and those have no kubelet to run it).
async fn mark_unschedulable(admin: kube::Client, name: String) {
    let pods: Api<Pod> = Api::all(admin.clone());
    loop {
        if let Ok(list) = pods.list(&ListParams::default().fields("spec.nodeName=")).await {
            for pod in list.items.iter().filter(|p| needs_unschedulable_mark(p, &name)) {
                let (Some(ns), Some(name)) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref()) else {
                    continue;
                };
                let now = "2026-01-01T00:00:00Z";
                let patch = json!({"status": {"conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/0 nodes are available", "lastTransitionTime": now,
                }]}});
                let api: Api<Pod> = Api::namespaced(admin.clone(), ns);
                let _ = api.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The kubelet's part: a Node for each NodeClaim that has an instance and no Node yet, reporting
/// Ready itself when `ready` (no kwok to do it).
async fn register_nodes(
    admin: kube::Client,
    ec2: aws_sdk_ec2::Client,
    registered: Arc<Mutex<Vec<String>>>,
    ready: bool,
) {
    let claims: Api<DynamicObject> = Api::all_with(admin.clone(), &nodeclaims());
    let nodes: Api<Node> = Api::all(admin);
    let pp = PostParams { field_manager: Some(MANAGER.into()), ..PostParams::default() };
    let mut done: BTreeMap<String, String> = BTreeMap::new();
    loop {
        if let Ok(list) = claims.list(&ListParams::default()).await {
            for claim in list.items {
                let Ok(claim) = serde_json::to_value(&claim) else { continue };
                let Some(provider_id) = claim["status"]["providerID"].as_str() else { continue };
                if done.contains_key(provider_id) || claim["metadata"]["deletionTimestamp"].is_string() {
                    continue;
                }
                let Some((_, instance)) = parse_provider_id(provider_id) else { continue };
                let Some(name) = private_dns_name(&ec2, instance).await else { continue };
                let Some(node) = node_for(&claim, &name, ready) else { continue };
                let Ok(node) = serde_json::from_value::<Node>(node) else { continue };
                let created = match nodes.create(&pp, &node).await {
                    Ok(_) => true,
                    Err(kube::Error::Api(s)) if s.code == 409 => true,
                    Err(e) => {
                        tracing::warn!(error = %e, node = %name, "registering a node");
                        false
                    }
                };
                // status is a subresource: the Ready condition and the resources go in apart
                if created {
                    let status = json!({"status": node.status});
                    if nodes.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status)).await.is_ok() {
                        done.insert(provider_id.to_string(), name.clone());
                        if let Ok(mut r) = registered.lock() {
                            r.push(name);
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The hostname the kubelet on an EC2 instance registers with.
async fn private_dns_name(ec2: &aws_sdk_ec2::Client, instance: &str) -> Option<String> {
    let out = ec2.describe_instances().instance_ids(instance).send().await.ok()?;
    let inst = out.reservations().first()?.instances().first()?;
    inst.private_dns_name().filter(|n| !n.is_empty()).map(str::to_string)
}

impl RealKarpenter {
    /// Restarts the process with `name=value` in its environment (replacing any value it had),
    /// for settings only a process start reads, such as `FEATURE_GATES`; counts as a start.
    pub fn restart_with_env(&self, name: &str, value: &str) -> Result<(), KarpenterError> {
        let mut p = self.process.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        p.stop();
        p.env.retain(|(k, _)| k != name);
        p.env.push((name.to_string(), value.to_string()));
        p.start()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_id_gives_its_zone_and_instance() {
        assert_eq!(
            parse_provider_id("aws:///us-west-2a/i-0123456789abcdef0"),
            Some(("us-west-2a", "i-0123456789abcdef0"))
        );
        assert_eq!(parse_provider_id("aws:///us-west-2a/"), None);
        assert_eq!(parse_provider_id("kwok://node-1"), None);
        assert_eq!(parse_provider_id("aws:////i-1"), None);
    }

    #[test]
    fn the_node_carries_the_claims_identity_and_the_unregistered_taint() {
        let claim = json!({
            "metadata": {"name": "default-abcde", "labels": {"karpenter.sh/nodepool": "default", "node.kubernetes.io/instance-type": "m5.large"}},
            "spec": {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}],
                     "startupTaints": [{"key": "startup", "effect": "NoSchedule"}]},
            "status": {"providerID": "aws:///us-west-2b/i-0abc", "capacity": {"cpu": "2"}, "allocatable": {"cpu": "1930m"}},
        });
        let node = node_for(&claim, "ip-10-0-1-5.us-west-2.compute.internal", true).unwrap();
        assert_eq!(node["metadata"]["name"], "ip-10-0-1-5.us-west-2.compute.internal");
        assert_eq!(node["spec"]["providerID"], "aws:///us-west-2b/i-0abc");
        let labels = &node["metadata"]["labels"];
        assert_eq!(labels["karpenter.sh/nodepool"], "default");
        assert_eq!(labels["topology.kubernetes.io/zone"], "us-west-2b");
        assert_eq!(labels["kubernetes.io/hostname"], "ip-10-0-1-5.us-west-2.compute.internal");
        let keys: Vec<&str> =
            node["spec"]["taints"].as_array().unwrap().iter().map(|t| t["key"].as_str().unwrap()).collect();
        assert_eq!(keys, ["dedicated", "startup", "karpenter.sh/unregistered"]);
        assert_eq!(node["status"]["allocatable"]["cpu"], "1930m");
        assert_eq!(node["status"]["conditions"][0]["type"], "Ready");
        assert_eq!(node["status"]["conditions"][0]["status"], "True");
        // the same Node passes the typed model the registrar sends
        serde_json::from_value::<Node>(node).unwrap();
    }

    #[test]
    fn a_claim_without_an_instance_has_no_node() {
        assert!(node_for(&json!({"metadata": {"name": "x"}, "status": {}}), "n", true).is_none());
    }

    #[test]
    fn a_node_left_to_kwok_has_no_conditions_and_keeps_the_claims_resources() {
        let claim = json!({
            "metadata": {"name": "default-abcde", "labels": {"karpenter.sh/nodepool": "default"}},
            "status": {"providerID": "aws:///us-west-2a/i-0abc", "capacity": {"cpu": "2"}, "allocatable": {"cpu": "1930m"}},
        });
        let node = node_for(&claim, "ip-10-0-1-5.us-west-2.compute.internal", false).unwrap();
        assert!(node["status"].get("conditions").is_none(), "{node}");
        assert_eq!(node["status"]["allocatable"]["cpu"], "1930m");
        assert_eq!(node["status"]["capacity"]["cpu"], "2");
        serde_json::from_value::<Node>(node).unwrap();
    }

    #[test]
    fn the_controller_keeps_off_karpenter_nodes_and_tolerates_critical_add_on_nodes() {
        let s = KarpenterSettings {
            cluster_name: "c1".into(),
            region: "r".into(),
            aws_endpoint: "e".into(),
            ..KarpenterSettings::default()
        };
        let d: Deployment = serde_json::from_value(deployment(&s)).unwrap();
        let p: Pod = serde_json::from_value(controller_pod(NAME)).unwrap();
        for spec in [d.spec.unwrap().template.spec.unwrap(), p.spec.unwrap()] {
            let terms = spec
                .affinity
                .and_then(|a| a.node_affinity)
                .and_then(|n| n.required_during_scheduling_ignored_during_execution)
                .map(|r| r.node_selector_terms)
                .unwrap_or_default();
            let exprs: Vec<(String, String)> = terms
                .iter()
                .flat_map(|t| t.match_expressions.iter().flatten())
                .map(|e| (e.key.clone(), e.operator.clone()))
                .collect();
            assert_eq!(exprs, [("karpenter.sh/nodepool".to_string(), "DoesNotExist".to_string())]);
            let tolerated: Vec<Option<String>> =
                spec.tolerations.unwrap_or_default().into_iter().map(|t| t.key).collect();
            assert_eq!(tolerated, [Some("CriticalAddonsOnly".to_string())]);
            assert_eq!(spec.service_account_name.as_deref(), Some(NAME));
        }
    }

    #[test]
    fn the_controller_runs_only_while_its_deployment_wants_a_replica() {
        let d = |replicas: Option<i32>| -> Deployment {
            serde_json::from_value(json!({"metadata": {"name": NAME}, "spec": {
                "replicas": replicas, "selector": {}, "template": {}}}))
            .unwrap()
        };
        assert!(wants_to_run(Some(&d(Some(1)))));
        assert!(wants_to_run(Some(&d(None))), "replicas defaults to 1");
        assert!(!wants_to_run(Some(&d(Some(0)))));
        assert!(!wants_to_run(None));
        let mut deleting = d(Some(1));
        deleting.metadata.deletion_timestamp = Some(serde_json::from_value(json!("2026-01-01T00:00:00Z")).unwrap());
        assert!(!wants_to_run(Some(&deleting)));
    }

    #[test]
    fn only_unbound_unmarked_workload_pods_are_marked_unschedulable() {
        let pod = |v: Value| -> Pod { serde_json::from_value(v).unwrap() };
        assert!(needs_unschedulable_mark(&pod(json!({"metadata": {"name": "w"}, "spec": {"containers": []}})), NAME));
        assert!(!needs_unschedulable_mark(
            &pod(json!({"metadata": {"name": "w"}, "spec": {"containers": [], "nodeName": "n"}})),
            NAME
        ));
        assert!(!needs_unschedulable_mark(
            &pod(json!({"metadata": {"name": "w"}, "spec": {"containers": []},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}})),
            NAME
        ));
        assert!(!needs_unschedulable_mark(&pod(controller_pod(NAME)), NAME));
        // under another chart name, that name's pod is the controller's, and a pod of the default
        // name is a workload's like any other
        let renamed = "karpenter-controller";
        assert!(!needs_unschedulable_mark(&pod(controller_pod(renamed)), renamed));
        assert!(needs_unschedulable_mark(&pod(controller_pod(NAME)), renamed));
    }

    #[test]
    fn under_the_charts_name_override_everything_the_controller_is_known_by_follows_the_name() {
        let name = "karpenter-controller";
        let s = KarpenterSettings { cluster_name: "c1".into(), name: name.into(), ..KarpenterSettings::default() };
        let d: Deployment = serde_json::from_value(deployment(&s)).unwrap();
        assert_eq!(d.metadata.name.as_deref(), Some(name));
        assert_eq!(d.metadata.namespace.as_deref(), Some(NAMESPACE));
        let want: BTreeMap<String, String> = [
            ("app.kubernetes.io/name".to_string(), name.to_string()),
            ("app.kubernetes.io/instance".to_string(), name.to_string()),
        ]
        .into();
        assert_eq!(d.metadata.labels.as_ref(), Some(&want));
        let spec = d.spec.unwrap();
        assert_eq!(spec.selector.match_labels.as_ref(), Some(&want));
        assert_eq!(spec.template.metadata.and_then(|m| m.labels).as_ref(), Some(&want));
        let pod_spec = spec.template.spec.unwrap();
        assert_eq!(pod_spec.service_account_name.as_deref(), Some(name));
        // what the tool knows it by whatever its name: the controller's image
        assert_eq!(pod_spec.containers[0].image.as_deref(), Some("public.ecr.aws/karpenter/controller"));
        let p: Pod = serde_json::from_value(controller_pod(name)).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("karpenter-controller-0"));
        assert_eq!(p.metadata.labels.as_ref(), Some(&want));
        assert_eq!(KarpenterSettings::default().name, NAME);
    }

    #[test]
    fn karpenter_is_pointed_at_the_stack_and_localstack_without_eks_or_pricing() {
        let s = KarpenterSettings {
            cluster_name: "c1".into(),
            region: "us-west-2".into(),
            aws_endpoint: "http://127.0.0.1:4566".into(),
            ..KarpenterSettings::default()
        };
        let env: BTreeMap<String, String> =
            environment(KarpenterVersion::V1_14, &s, Path::new("/k"), "https://127.0.0.1:6443", 1, 2, None)
                .into_iter()
                .collect();
        assert_eq!(env["CLUSTER_NAME"], "c1");
        assert_eq!(env["CLUSTER_ENDPOINT"], "https://127.0.0.1:6443");
        assert_eq!(env["ISOLATED_VPC"], "true");
        assert_eq!(env["EKS_CONTROL_PLANE"], "false");
        assert_eq!(env["AWS_ENDPOINT_URL"], "http://127.0.0.1:4566");
        assert_eq!(env["KUBECONFIG"], "/k");
        assert_eq!((env["METRICS_PORT"].as_str(), env["HEALTH_PROBE_PORT"].as_str()), ("1", "2"));
        assert!(!env.contains_key("HTTPS_PROXY") && !env.contains_key("DISABLE_WEBHOOK"), "{env:?}");
    }

    #[test]
    fn karpenter_1_0_runs_without_its_webhook_and_reaches_aws_through_the_relay() {
        let s = KarpenterSettings {
            cluster_name: "c1".into(),
            region: "us-west-2".into(),
            aws_endpoint: "http://127.0.0.1:4566".into(),
            ..KarpenterSettings::default()
        };
        let relay = AwsRelay { proxy_url: "http://127.0.0.1:9".into(), ca_file: PathBuf::from("/d/relay.crt") };
        let env: BTreeMap<String, String> =
            environment(KarpenterVersion::V1_0, &s, Path::new("/k"), "https://127.0.0.1:6443", 1, 2, Some(&relay))
                .into_iter()
                .collect();
        assert_eq!(env["DISABLE_WEBHOOK"], "true");
        assert_eq!(env["SYSTEM_NAMESPACE"], NAMESPACE);
        assert_eq!(env["HTTPS_PROXY"], "http://127.0.0.1:9");
        assert_eq!(env["AWS_CA_BUNDLE"], "/d/relay.crt");
        assert_eq!(env["CLUSTER_ENDPOINT"], "https://127.0.0.1:6443");
        assert_eq!(env["ISOLATED_VPC"], "true");
        assert!(!env.contains_key("EKS_CONTROL_PLANE") && !env.contains_key("AWS_ENDPOINT_URL"), "{env:?}");
    }

    #[test]
    fn the_karpenter_kubeconfig_keeps_the_server_and_ca_and_swaps_the_user() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kc");
        let kc = crate::kubeconfig("ctx", "https://127.0.0.1:1", Path::new("/ca.crt"), "tool", "tool-token");
        std::fs::write(&path, kc.to_string()).unwrap();
        let got = kubeconfig_with_token(&path, "karp-token").unwrap();
        assert_eq!(got["clusters"][0]["cluster"]["server"], "https://127.0.0.1:1");
        assert_eq!(got["users"][0]["user"]["token"], "karp-token");
        assert_eq!(got["contexts"][0]["context"]["user"], "karpenter");
        assert!(!got.to_string().contains("tool-token"));
    }
}
