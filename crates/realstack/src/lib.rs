//! The test bed on a real control plane: kube-apiserver and etcd built from source (`go/`, by the
//! `build-real` script) and run on loopback, with generated certificates, a static token file,
//! `--authorization-mode=Node,RBAC`, and the tool's identity bound to exactly `deploy/rbac.yaml`.
//! [`RealStack::start_full`] adds kube-controller-manager, kube-scheduler (same release) and kwok,
//! which makes every Node Ready and runs the pods bound to it, so workloads schedule and run.
//!
//! [`RealStack`] owns the processes it starts: they run in a process group of their own, and the
//! whole group is killed when it is dropped, a failing test's unwinding included.

pub mod karpenter;
pub mod metrics;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{Value, json};

/// The Kubernetes release `go/go.mod` pins, as `/version` reports it.
pub const KUBERNETES_VERSION: &str = "v1.34.4";

/// The groups of the tool's identity: `deploy/rbac.yaml` binds its ClusterRole to this group, as
/// an EKS access entry maps a CI role to one.
pub const TOOL_GROUP: &str = "karpenter-teardown";

/// The tool's user name on the real server.
pub const TOOL_USER: &str = "karpenter-teardown-ci";

/// Why the real control plane could not be built or started; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum RealStackError {
    /// `build-real` could not run Go.
    #[error(
        "Go is not installed (or not on PATH): the test bed builds kube-apiserver, etcd and cloud-provider-aws from source with Go 1.26 or later; install Go (https://go.dev/doc/install) and run the tests again"
    )]
    GoMissing,
    /// `build-real` ran and failed.
    #[error(
        "building the real control plane failed ({status}): run `crates/realstack/build-real` to see the Go error (it needs the Go module proxy, or GOMODCACHE holding the modules of crates/realstack/go/go.sum)"
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
    /// `openssl` failed while making the certificates.
    #[error(
        "openssl {what} failed: {stderr} (the test bed makes its certificates with the openssl CLI: install openssl)"
    )]
    Openssl {
        /// Which certificate or key.
        what: &'static str,
        /// What openssl printed.
        stderr: String,
    },
    /// kwok's pod stages could not be read from Go's module cache.
    #[error(
        "cannot read kwok's pod stages from Go's module cache: {reason}; the test bed needs Go and its module proxy (or GOMODCACHE holding sigs.k8s.io/kwok v0.7.0, which crates/realstack/build-real downloads)"
    )]
    KwokStages {
        /// What went wrong.
        reason: String,
    },
    /// A component exited while the stack was starting.
    #[error("{component} exited while starting ({status}); the end of its log:\n{log}")]
    Exited {
        /// The component.
        component: &'static str,
        /// How it ended.
        status: String,
        /// The last lines of its log.
        log: String,
    },
    /// kube-apiserver did not become ready in time.
    #[error(
        "kube-apiserver was not ready after {waited:?} (last answer of /readyz: {last}); the end of its log:\n{log}"
    )]
    NotReady {
        /// How long it was waited for.
        waited: Duration,
        /// The last answer or error of `/readyz`.
        last: String,
        /// The last lines of its log.
        log: String,
    },
    /// kube-controller-manager, kube-scheduler or kwok did not answer `/healthz` in time.
    #[error(
        "{component} was not healthy after {waited:?} (last answer of /healthz: {last}); the end of its log:\n{log}"
    )]
    NotHealthy {
        /// The component.
        component: &'static str,
        /// How long it was waited for.
        waited: Duration,
        /// The last answer or error of `/healthz`.
        last: String,
        /// The last lines of its log.
        log: String,
    },
    /// A kubeconfig the stack wrote could not be loaded.
    #[error("loading the kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// The kubeconfig.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The RBAC file to bind the tool's identity to is not what it must be.
    #[error("the RBAC file: {0} (it must hold ClusterRoles and ClusterRoleBindings only)")]
    Rbac(String),
    /// A call to the real server failed.
    #[error("{what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The cause.
        source: kube::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RealStackError {
    let what = what.into();
    move |source| RealStackError::Io { what, source }
}

/// The path of the `build-real` script.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("build-real")
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("go/bin")
}

/// kwok's binary, which `build-real` builds beside [`binary`]'s (from a module of its own).
fn kwok_binary() -> Result<PathBuf, RealStackError> {
    binary()?;
    Ok(bin_dir().join("kwok"))
}

/// cloud-provider-aws's cloud controller manager, which `build-real` builds beside [`binary`]'s
/// (from a module of its own, `ccm/`).
fn ccm_binary() -> Result<PathBuf, RealStackError> {
    binary()?;
    Ok(bin_dir().join("ccm"))
}

/// The real control plane's binary, built by `build-real` the first time a process asks.
pub fn binary() -> Result<PathBuf, RealStackError> {
    static BUILT: OnceLock<Result<(), BuildFailure>> = OnceLock::new();
    match build_once(&BUILT, &build_script()) {
        Ok(()) => Ok(bin_dir().join("realstack")),
        Err(BuildFailure::GoMissing) => Err(RealStackError::GoMissing),
        Err(BuildFailure::Failed(status)) => Err(RealStackError::Build { status }),
    }
}

/// Why a build script produced no binaries. Clone, unlike the typed errors (they hold
/// `io::Error`s), so one process-wide answer serves every caller.
#[derive(Debug, Clone)]
pub(crate) enum BuildFailure {
    /// The script's own exit code 127: `go` is not on PATH.
    GoMissing,
    /// Anything else, as the status or the error running it.
    Failed(String),
}

/// Runs a build script the first time a process asks and remembers the answer in `cell`; the
/// scripts are no-ops when their binaries are current, so a test binary pays only one check.
pub(crate) fn build_once(cell: &'static OnceLock<Result<(), BuildFailure>>, script: &Path) -> Result<(), BuildFailure> {
    build_once_with(cell, script, &[])
}

/// [`build_once`] with arguments for the script.
pub(crate) fn build_once_with(
    cell: &'static OnceLock<Result<(), BuildFailure>>,
    script: &Path,
    args: &[&str],
) -> Result<(), BuildFailure> {
    cell.get_or_init(|| {
        let status = Command::new("bash")
            .arg(script)
            .args(args)
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .status()
            .map_err(|e| BuildFailure::Failed(format!("running {}: {e}", script.display())))?;
        match status.code() {
            Some(0) => Ok(()),
            Some(127) => Err(BuildFailure::GoMissing),
            _ => Err(BuildFailure::Failed(status.to_string())),
        }
    })
    .clone()
}

/// Ports and files of one stack, from which the command lines are made.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    dir: PathBuf,
    etcd_client_port: u16,
    etcd_peer_port: u16,
    apiserver_port: u16,
    controller_manager_port: u16,
    scheduler_port: u16,
    kwok_port: u16,
}

/// The controllers kube-controller-manager runs (`--controllers`): what the test bed's workloads
/// and a teardown meet on a real cluster, and no more (each controller costs CPU on a small
/// machine). Names from kubernetes' cmd/kube-controller-manager/names/controller_names.go.
pub(crate) const CONTROLLERS: &[&str] = &[
    // Deployments → ReplicaSets → pods, and the evicted pods they recreate
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    // the aws-node DaemonSet's pod on every node
    "daemonset-controller",
    // PodDisruptionBudget status (disruptionsAllowed), which the eviction subresource reads
    "disruption-controller",
    // ownerReferences: a deleted Deployment's ReplicaSets and pods, a deleted NodeClaim's dependents
    "garbage-collector-controller",
    // a deleted namespace's content
    "namespace-controller",
    // each namespace's `default` ServiceAccount, without which the ServiceAccount admission
    // plugin refuses the namespace's pods
    "serviceaccount-controller",
    // the `kube-root-ca.crt` ConfigMap the ServiceAccount admission plugin's projected volume names
    "root-ca-certificate-publisher-controller",
    // the not-ready/unreachable taints of nodes whose heartbeats (kwok's leases) stop
    "node-lifecycle-controller",
    // evicts pods from nodes tainted NoExecute
    "taint-eviction-controller",
    // deletes the pods bound to a Node object that is gone
    "pod-garbage-collector-controller",
    // claims and volumes: binds a claim to its volume, releases the volume of a deleted claim
    // (leaving a CSI volume to its external deleter), and keeps a claim while a pod mounts it
    // and a volume while it is bound (`--release volumes`)
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
];

/// The identities of the control plane's own components, as kubernetes' bootstrap RBAC policy
/// names them (plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go binds the ClusterRoles
/// `system:kube-controller-manager` and `system:kube-scheduler` (+ `system:volume-scheduler`) to
/// these users; namespace_policy.go gives both the `extension-apiserver-authentication-reader`
/// Role in kube-system for delegated authentication).
pub(crate) const CONTROLLER_MANAGER_USER: &str = "system:kube-controller-manager";
pub(crate) const SCHEDULER_USER: &str = "system:kube-scheduler";

impl Layout {
    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn server(&self) -> String {
        format!("https://127.0.0.1:{}", self.apiserver_port)
    }

    pub(crate) fn etcd_args(&self) -> Vec<String> {
        vec![
            "etcd".into(),
            "--data-dir".into(),
            self.file("etcd").display().to_string(),
            "--listen-client-url".into(),
            format!("http://127.0.0.1:{}", self.etcd_client_port),
            "--listen-peer-url".into(),
            format!("http://127.0.0.1:{}", self.etcd_peer_port),
        ]
    }

    pub(crate) fn apiserver_args(&self, control_plane: ControlPlane) -> Vec<String> {
        let f = |name: &str| self.file(name).display().to_string();
        let mut args: Vec<String> = [
            "kube-apiserver".to_string(),
            format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_client_port),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={}", self.apiserver_port),
            format!("--cert-dir={}", f("certs")),
            format!("--tls-cert-file={}", f("apiserver.crt")),
            format!("--tls-private-key-file={}", f("apiserver.key")),
            format!("--client-ca-file={}", f("ca.crt")),
            format!("--token-auth-file={}", f("tokens.csv")),
            "--authorization-mode=Node,RBAC".into(),
            format!("--service-account-key-file={}", f("sa.key")),
            format!("--service-account-signing-key-file={}", f("sa.key")),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            // The `kubernetes` Service's endpoints may not be a loopback address (kubernetes'
            // pkg/apis/core/validation refuses it); there is no Service network here anyway.
            "--endpoint-reconciler-type=none".into(),
            "--profiling=false".into(),
        ]
        .into();
        if control_plane == ControlPlane::ApiServerOnly {
            // Without kube-controller-manager nobody creates a namespace's `default`
            // ServiceAccount, and the ServiceAccount admission plugin refuses every pod of a
            // namespace until it exists (kubernetes' plugin/pkg/admission/serviceaccount).
            args.push("--disable-admission-plugins=ServiceAccount".into());
        }
        args
    }

    /// The flags kube-controller-manager and kube-scheduler share: their own kubeconfig for the
    /// API, delegated authentication and authorization through the same identity (as kubeadm
    /// starts them), loopback serving with the server's certificate (its SAN is 127.0.0.1), and
    /// no leader election: one instance of each, for one test binary.
    fn component_args(&self, kubeconfig: &str, port: u16) -> Vec<String> {
        let f = |name: &str| self.file(name).display().to_string();
        vec![
            format!("--kubeconfig={}", f(kubeconfig)),
            format!("--authentication-kubeconfig={}", f(kubeconfig)),
            format!("--authorization-kubeconfig={}", f(kubeconfig)),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", f("apiserver.crt")),
            format!("--tls-private-key-file={}", f("apiserver.key")),
            "--leader-elect=false".into(),
            "--profiling=false".into(),
        ]
    }

    pub(crate) fn controller_manager_args(&self) -> Vec<String> {
        let mut args = vec!["kube-controller-manager".to_string()];
        args.extend(self.component_args("controller-manager.kubeconfig", self.controller_manager_port));
        args.extend([
            format!("--controllers={}", CONTROLLERS.join(",")),
            // each controller acts as its own ServiceAccount in kube-system, bound to its own
            // `system:controller:*` ClusterRole by the bootstrap policy, as on real clusters
            "--use-service-account-credentials=true".into(),
            format!("--root-ca-file={}", self.file("ca.crt").display()),
        ]);
        args
    }

    pub(crate) fn scheduler_args(&self) -> Vec<String> {
        let mut args = vec!["kube-scheduler".to_string()];
        args.extend(self.component_args("scheduler.kubeconfig", self.scheduler_port));
        args
    }

    /// kwok as kwokctl starts it (sigs.k8s.io/kwok pkg/kwokctl/components/kwok_controller.go):
    /// every node managed, node leases of 40 s (kwok's default), the stages of the stack's own
    /// `kwok.yaml` ([`kwok_config`]; no Stage CRD), and its server on loopback for `/healthz`.
    pub(crate) fn kwok_args(&self) -> Vec<String> {
        vec![
            format!("--kubeconfig={}", self.file("admin.kubeconfig").display()),
            format!("--config={}", self.file("kwok.yaml").display()),
            "--manage-all-nodes=true".into(),
            "--node-lease-duration-seconds=40".into(),
            format!("--server-address=127.0.0.1:{}", self.kwok_port),
            "--node-ip=127.0.0.1".into(),
            // pod IPs: kwok's default /24 runs out at 254 pods
            "--cidr=10.0.0.1/16".into(),
        ]
    }
}

/// What runs besides etcd and kube-apiserver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlPlane {
    /// etcd and kube-apiserver only: objects are stored and validated, nothing acts on them.
    ApiServerOnly,
    /// Also kube-controller-manager, kube-scheduler and kwok: workloads get pods, pods get nodes
    /// and run, PodDisruptionBudgets get a status.
    Full,
}

/// How kwok ends a pod that is being deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PodExit {
    /// At once, whatever its grace period: kwok's default stages (sigs.k8s.io/kwok
    /// `kustomize/stage/pod/fast`, what it loads without a configuration).
    #[default]
    AtOnce,
    /// When its grace period is over, at the `deletionTimestamp` kube-apiserver set to the time of
    /// the delete plus the grace period, as a kubelet ends a container that ignores SIGTERM: the
    /// slowest pod of a node decides when its drain ends, as on a real cluster. kwok's own stages
    /// make pods ready and complete them; the deletion stage is [`GRACEFUL_POD_DELETE`].
    AfterGracePeriod,
}

/// kwok's module, whose pod stages [`PodExit::AfterGracePeriod`] loads from Go's module cache:
/// the version `kwok/go.mod` builds, and its `go.sum` hash.
pub(crate) const KWOK_MODULE: (&str, &str, &str) =
    ("sigs.k8s.io/kwok", "v0.7.0", "h1:+eGsNOIPapjsSzeZlOEcwbpyEVa2Vqlcafa0qIjaKV4=");

/// The deletion stage of [`PodExit::AfterGracePeriod`]: kwok's fast `pod-delete` (finalizers
/// emptied, the pod deleted), delayed until the pod's `deletionTimestamp` (kwok reads an RFC 3339
/// time in `durationFrom` as the time left until it: pkg/utils/lifecycle/value_duration_from.go).
pub const GRACEFUL_POD_DELETE: &str = "apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete-after-grace-period
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  delay:
    durationMilliseconds: 0
    durationFrom:
      expressionFrom: '.metadata.deletionTimestamp'
  next:
    finalizers:
      empty: true
    delete: true
";

/// kwok's configuration for `pod_exit`: empty for its defaults, else its fast `pod-ready` and
/// `pod-complete` stages from Go's module cache and [`GRACEFUL_POD_DELETE`]. kwok uses the pod
/// stages of its configuration instead of all of its defaults, so all three are given; its node
/// stages stay its defaults.
pub(crate) fn kwok_config(pod_exit: PodExit) -> Result<String, RealStackError> {
    match pod_exit {
        PodExit::AtOnce => Ok(String::new()),
        PodExit::AfterGracePeriod => {
            let (module, version, sum) = KWOK_MODULE;
            let dir = sandbox_sim::karpenter_crds::go_module_dir(module, version, sum)
                .map_err(|reason| RealStackError::KwokStages { reason })?;
            let mut docs = Vec::new();
            for stage in ["pod-ready", "pod-complete"] {
                let path = dir.join(format!("kustomize/stage/pod/fast/{stage}.yaml"));
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| RealStackError::KwokStages { reason: format!("{}: {e}", path.display()) })?;
                docs.push(text);
            }
            docs.push(GRACEFUL_POD_DELETE.to_string());
            Ok(docs.join("\n---\n"))
        }
    }
}

/// The static token file: an admin in `system:masters`, the tool's identity in [`TOOL_GROUP`]
/// only, and each of `components` (token, user) as a user in no group, as the client
/// certificates kubeadm makes for them carry a common name and no organization. Format:
/// `token,user,uid,"group1,group2"` (groups optional), as kube-apiserver's `--token-auth-file`
/// reads it.
pub(crate) fn token_file(admin_token: &str, tool_token: &str, components: &[(&str, &str)]) -> String {
    let mut text = format!(
        "{admin_token},admin,admin-uid,\"system:masters\"\n{tool_token},{TOOL_USER},{TOOL_USER}-uid,\"{TOOL_GROUP}\"\n"
    );
    for (token, user) in components {
        text.push_str(&format!("{token},{user},{user}-uid\n"));
    }
    text
}

/// A kubeconfig (JSON, which every YAML reader reads) with one context named `context`.
pub(crate) fn kubeconfig(context: &str, server: &str, ca: &Path, user: &str, token: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
    })
}

/// The RBAC objects of a multi-document YAML file, each as the typed object to create; anything
/// else in the file is refused, so the tool's identity is bound to exactly what the file says.
pub(crate) fn rbac_objects(yaml: &str) -> Result<(Vec<ClusterRole>, Vec<ClusterRoleBinding>), RealStackError> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml).map_err(|e| RealStackError::Rbac(e.to_string()))?;
    let (mut roles, mut bindings) = (Vec::new(), Vec::new());
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let bad = |e: serde_json::Error| RealStackError::Rbac(format!("{kind}: {e}"));
        match kind.as_str() {
            "ClusterRole" => roles.push(serde_json::from_value(doc).map_err(bad)?),
            "ClusterRoleBinding" => bindings.push(serde_json::from_value(doc).map_err(bad)?),
            other => return Err(RealStackError::Rbac(format!("unexpected kind {other:?}"))),
        }
    }
    if roles.is_empty() || bindings.is_empty() {
        return Err(RealStackError::Rbac("no ClusterRole or no ClusterRoleBinding".into()));
    }
    Ok((roles, bindings))
}

/// A random hex token: loopback only and for one test binary, so std's randomly seeded hasher
/// is random enough.
fn token() -> String {
    use std::hash::{BuildHasher, RandomState};
    let s = RandomState::new();
    format!("{:016x}{:016x}", s.hash_one(1u8), s.hash_one(2u8))
}

/// A port free on every interface, below the kernel's ephemeral range (32768 and up on Linux).
/// A port the kernel hands out for `bind(0)` comes from that range, where every outgoing
/// connection also takes its source port: between this check and the component's own bind, a
/// client connection of another test could take it (Karpenter's metrics server then fails to
/// start, `address already in use`). Below the range only listeners compete.
pub(crate) fn free_port() -> std::io::Result<u16> {
    use std::hash::{BuildHasher, RandomState};
    const LOW: u64 = 20_000;
    const SPAN: u64 = 12_000;
    let seed = RandomState::new();
    for attempt in 0u64..200 {
        let port = (LOW + seed.hash_one(attempt) % SPAN) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free port below the ephemeral range"))
}

fn openssl(dir: &Path, what: &'static str, args: &[&str]) -> Result<(), RealStackError> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| RealStackError::Openssl { what, stderr: e.to_string() })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(RealStackError::Openssl { what, stderr: String::from_utf8_lossy(&out.stderr).into() })
    }
}

/// A CA, the server's certificate for 127.0.0.1 signed by it, and the service-account key
/// (P-256 keys: fast to make, and both Go and rustls take them).
fn make_certs(dir: &Path) -> Result<(), RealStackError> {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let mut ca = vec!["req", "-x509", "-days", "2", "-subj", "/CN=realstack-ca", "-keyout", "ca.key", "-out", "ca.crt"];
    ca.extend(ec);
    openssl(dir, "making the CA", &ca)?;
    let mut csr = vec!["req", "-subj", "/CN=kube-apiserver", "-keyout", "apiserver.key", "-out", "apiserver.csr"];
    csr.extend(ec);
    openssl(dir, "making the server's request", &csr)?;
    std::fs::write(
        dir.join("apiserver.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature\n",
    )
    .map_err(io("writing apiserver.ext"))?;
    openssl(
        dir,
        "signing the server's certificate",
        &[
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "apiserver.ext",
            "-out",
            "apiserver.crt",
        ],
    )?;
    openssl(
        dir,
        "making the service-account key",
        &["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key"],
    )
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// kube's default client retries every 429 (up to 15 times, after the server's `Retry-After`),
/// so an eviction a PodDisruptionBudget refuses would come back minutes later, and the simulated
/// Karpenter on such a client stalls inside it (sandbox-sim's controller.rs). The tool turns it
/// off for its own client (src/k8s), the sandbox server's configs do too: the test bed's clients
/// see a refusal when it happens, as the tool does.
pub(crate) fn without_retry(mut config: kube::Config) -> kube::Config {
    config.default_retry = false;
    config
}

/// How a component's `/healthz` is reached.
enum Health {
    /// Over TLS with the server's CA (kube-controller-manager, kube-scheduler).
    Tls(kube::Client),
    /// Plain HTTP on loopback (kwok's server, started without a certificate).
    Plain(std::net::SocketAddr),
}

impl Health {
    async fn get(&self, path: &str) -> Result<String, String> {
        match self {
            Health::Tls(client) => {
                let req = http::Request::get(path).body(Vec::new()).map_err(|e| e.to_string())?;
                client.request_text(req).await.map_err(|e| e.to_string())
            }
            Health::Plain(addr) => plain_get(*addr, path).await.map_err(|e| e.to_string()),
        }
    }
}

/// The body of `GET path` on `addr` over HTTP/1.0 (the server closes the connection after its
/// answer, so the body is what follows the headers).
async fn plain_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await??;
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(2), conn.read_to_string(&mut text)).await??;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    if head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200") {
        Ok(body.to_string())
    } else {
        Err(std::io::Error::other(format!("answered {}", head.lines().next().unwrap_or_default())))
    }
}

/// A running etcd and kube-apiserver (and, when started full, the rest of the control plane), and
/// the kubeconfigs to reach them. Dropping it kills them all.
pub struct RealStack {
    layout: Layout,
    /// Children in start order; all in the process group of the first.
    children: Vec<(&'static str, Child)>,
    admin_kubeconfig: PathBuf,
    tool_kubeconfig: PathBuf,
    control_plane: ControlPlane,
    // last: removed after the processes using it are gone
    _dir: tempfile::TempDir,
}

impl RealStack {
    /// Builds the binary if needed, starts etcd and kube-apiserver, waits for `/readyz`, creates
    /// `rbac_yaml`'s objects, and writes the kubeconfigs (context `context`).
    pub async fn start(context: &str, rbac_yaml: &str) -> Result<RealStack, RealStackError> {
        Self::start_with(context, rbac_yaml, ControlPlane::ApiServerOnly).await
    }

    /// [`RealStack::start`], then kube-controller-manager, kube-scheduler and kwok, each waited
    /// for on its `/healthz`.
    pub async fn start_full(context: &str, rbac_yaml: &str) -> Result<RealStack, RealStackError> {
        Self::start_with(context, rbac_yaml, ControlPlane::Full).await
    }

    /// [`RealStack::start_full`] with kwok ending deleted pods as `pod_exit` says.
    pub async fn start_full_with(
        context: &str,
        rbac_yaml: &str,
        pod_exit: PodExit,
    ) -> Result<RealStack, RealStackError> {
        Self::start_as(context, rbac_yaml, ControlPlane::Full, pod_exit).await
    }

    /// Starts the stack `control_plane` names.
    pub async fn start_with(
        context: &str,
        rbac_yaml: &str,
        control_plane: ControlPlane,
    ) -> Result<RealStack, RealStackError> {
        Self::start_as(context, rbac_yaml, control_plane, PodExit::AtOnce).await
    }

    async fn start_as(
        context: &str,
        rbac_yaml: &str,
        control_plane: ControlPlane,
        pod_exit: PodExit,
    ) -> Result<RealStack, RealStackError> {
        // A free port is found by binding port 0 and letting it go, so another stack starting at
        // the same moment (tests run in parallel) can take it before the component binds it: a
        // component that exits with "address already in use" is started again on new ports (the
        // stack that failed is dropped first, which kills what it started).
        let mut attempt = 1;
        loop {
            match Self::start_once(context, rbac_yaml, control_plane, pod_exit).await {
                Err(e) if attempt < 3 && e.to_string().contains("address already in use") => attempt += 1,
                other => return other,
            }
        }
    }

    async fn start_once(
        context: &str,
        rbac_yaml: &str,
        control_plane: ControlPlane,
        pod_exit: PodExit,
    ) -> Result<RealStack, RealStackError> {
        let (roles, bindings) = rbac_objects(rbac_yaml)?;
        let bin = binary()?;
        let dir = tempfile::Builder::new().prefix("realstack-").tempdir().map_err(io("making a temp dir"))?;
        let layout = Layout {
            dir: dir.path().to_path_buf(),
            etcd_client_port: free_port().map_err(io("finding a free port"))?,
            etcd_peer_port: free_port().map_err(io("finding a free port"))?,
            apiserver_port: free_port().map_err(io("finding a free port"))?,
            controller_manager_port: free_port().map_err(io("finding a free port"))?,
            scheduler_port: free_port().map_err(io("finding a free port"))?,
            kwok_port: free_port().map_err(io("finding a free port"))?,
        };
        make_certs(&layout.dir)?;
        let (admin_token, tool_token) = (token(), token());
        let (cm_token, scheduler_token) = (token(), token());
        let components = [(cm_token.as_str(), CONTROLLER_MANAGER_USER), (scheduler_token.as_str(), SCHEDULER_USER)];
        std::fs::write(layout.file("tokens.csv"), token_file(&admin_token, &tool_token, &components))
            .map_err(io("writing tokens.csv"))?;
        let ca = layout.file("ca.crt");
        let admin_kubeconfig = layout.file("admin.kubeconfig");
        let tool_kubeconfig = layout.file("kubeconfig");
        for (path, user, token) in [
            (admin_kubeconfig.clone(), "admin", admin_token.as_str()),
            (tool_kubeconfig.clone(), TOOL_USER, tool_token.as_str()),
            (layout.file("controller-manager.kubeconfig"), CONTROLLER_MANAGER_USER, cm_token.as_str()),
            (layout.file("scheduler.kubeconfig"), SCHEDULER_USER, scheduler_token.as_str()),
        ] {
            let text = kubeconfig(context, &layout.server(), &ca, user, token).to_string();
            std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))?;
        }
        // kwok reads ~/.kwok/kwok.yaml unless told otherwise: a configuration of the stack's own
        // keeps the user's out (empty, it leaves kwok its defaults)
        std::fs::write(layout.file("kwok.yaml"), kwok_config(pod_exit)?).map_err(io("writing kwok.yaml"))?;

        let mut stack =
            RealStack { layout, children: Vec::new(), admin_kubeconfig, tool_kubeconfig, control_plane, _dir: dir };
        stack.spawn(&bin, "etcd", stack.layout.etcd_args())?;
        stack.spawn(&bin, "kube-apiserver", stack.layout.apiserver_args(control_plane))?;
        let admin = stack.admin_client().await?;
        stack.wait_ready(&admin, Duration::from_secs(180)).await?;

        let pp = PostParams { field_manager: Some("realstack".into()), ..PostParams::default() };
        let role_api: Api<ClusterRole> = Api::all(admin.clone());
        for r in &roles {
            role_api.create(&pp, r).await.map_err(|source| RealStackError::Kube {
                what: format!("creating ClusterRole {:?}", r.metadata.name),
                source,
            })?;
        }
        let binding_api: Api<ClusterRoleBinding> = Api::all(admin);
        for b in &bindings {
            binding_api.create(&pp, b).await.map_err(|source| RealStackError::Kube {
                what: format!("creating ClusterRoleBinding {:?}", b.metadata.name),
                source,
            })?;
        }
        if control_plane == ControlPlane::Full {
            stack.spawn(&bin, "kube-controller-manager", stack.layout.controller_manager_args())?;
            stack.spawn(&bin, "kube-scheduler", stack.layout.scheduler_args())?;
            stack.spawn(&kwok_binary()?, "kwok", stack.layout.kwok_args())?;
            let (cm, sched) = (stack.layout.controller_manager_port, stack.layout.scheduler_port);
            for (component, port) in [("kube-controller-manager", cm), ("kube-scheduler", sched)] {
                let path = stack.layout.file(&format!("{component}-health.kubeconfig"));
                let url = format!("https://127.0.0.1:{port}");
                let text = kubeconfig(context, &url, &ca, "admin", &admin_token).to_string();
                std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))?;
                let client = Self::client_of(&path).await?;
                stack.wait_healthy(component, &Health::Tls(client), Duration::from_secs(120)).await?;
            }
            let kwok = Health::Plain(std::net::SocketAddr::from(([127, 0, 0, 1], stack.layout.kwok_port)));
            stack.wait_healthy("kwok", &kwok, Duration::from_secs(120)).await?;
        }
        Ok(stack)
    }

    /// Starts cloud-provider-aws's service controller (the in-tree one EKS runs in its control
    /// plane) with `cloud_config` (its `--cloud-config`, gcfg) and `env` (its AWS credentials
    /// and region), as the admin identity, and waits for its `/healthz`. It stops with the stack.
    pub async fn start_cloud_controller(
        &mut self,
        cloud_config: &str,
        env: &[(String, String)],
    ) -> Result<(), RealStackError> {
        const COMPONENT: &str = "cloud-controller-manager";
        let config = self.layout.file("cloud.conf");
        std::fs::write(&config, cloud_config).map_err(io("writing cloud.conf"))?;
        let port = free_port().map_err(io("finding a free port"))?;
        let mut args = self.layout.component_args("admin.kubeconfig", port);
        args.extend([
            "--cloud-provider=aws".to_string(),
            format!("--cloud-config={}", config.display()),
            "--controllers=service".into(),
            "--use-service-account-credentials=false".into(),
            "--configure-cloud-routes=false".into(),
            // a node of kwok changes nothing in EC2: a short resync only speeds up the test
            "--node-sync-period=10s".into(),
        ]);
        self.spawn_with(&ccm_binary()?, COMPONENT, args, env)?;
        // the admin kubeconfig (JSON, [`kubeconfig`]) pointed at the controller's own port
        let path = self.layout.file("cloud-controller-manager-health.kubeconfig");
        let bad = |reason: String| RealStackError::Kubeconfig { path: self.admin_kubeconfig.clone(), reason };
        let text = std::fs::read_to_string(&self.admin_kubeconfig).map_err(|e| bad(e.to_string()))?;
        let mut kc: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        kc["clusters"][0]["cluster"]["server"] = json!(format!("https://127.0.0.1:{port}"));
        std::fs::write(&path, kc.to_string()).map_err(io(format!("writing {}", path.display())))?;
        let client = Self::client_of(&path).await?;
        self.wait_healthy(COMPONENT, &Health::Tls(client), Duration::from_secs(120)).await
    }

    fn spawn(&mut self, bin: &Path, component: &'static str, args: Vec<String>) -> Result<(), RealStackError> {
        self.spawn_with(bin, component, args, &[])
    }

    fn spawn_with(
        &mut self,
        bin: &Path,
        component: &'static str,
        args: Vec<String>,
        env: &[(String, String)],
    ) -> Result<(), RealStackError> {
        use std::os::unix::process::CommandExt;
        let log_path = self.layout.file(&format!("{component}.log"));
        let log = std::fs::File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
        let log2 = log.try_clone().map_err(io(format!("opening {}", log_path.display())))?;
        // the first child leads a new process group, the others join it: one kill reaches all
        let group = self.children.first().map_or(0, |(_, c)| c.id());
        let group = i32::try_from(group).map_err(|_| RealStackError::Io {
            what: format!("starting {component}"),
            source: std::io::Error::other("process id out of range"),
        })?;
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            // each component exits by itself once this process is gone (go/main.go)
            .env("REALSTACK_PARENT_PID", std::process::id().to_string())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(log)
            .stderr(log2)
            .process_group(group)
            .spawn()
            .map_err(io(format!("starting {component} ({})", bin.display())))?;
        self.children.push((component, child));
        Ok(())
    }

    async fn wait_ready(&mut self, admin: &kube::Client, timeout: Duration) -> Result<(), RealStackError> {
        let start = Instant::now();
        loop {
            self.check_alive()?;
            let req = http::Request::get("/readyz").body(Vec::new()).map_err(|e| RealStackError::Io {
                what: "building the /readyz request".into(),
                source: std::io::Error::other(e),
            })?;
            let last = match admin.request_text(req).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => body,
                Err(e) => e.to_string(),
            };
            if start.elapsed() > timeout {
                return Err(RealStackError::NotReady {
                    waited: start.elapsed(),
                    last,
                    log: log_tail(&self.layout.file("kube-apiserver.log")),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until `component` answers `ok` on `/healthz`, failing early when any child exits.
    async fn wait_healthy(
        &mut self,
        component: &'static str,
        health: &Health,
        timeout: Duration,
    ) -> Result<(), RealStackError> {
        let start = Instant::now();
        loop {
            self.check_alive()?;
            let last = match health.get("/healthz").await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => body,
                Err(e) => e,
            };
            if start.elapsed() > timeout {
                return Err(RealStackError::NotHealthy {
                    component,
                    waited: start.elapsed(),
                    last,
                    log: log_tail(&self.layout.file(&format!("{component}.log"))),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn check_alive(&mut self) -> Result<(), RealStackError> {
        for (component, child) in &mut self.children {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(RealStackError::Exited {
                    component,
                    status: status.to_string(),
                    log: log_tail(&self.layout.file(&format!("{component}.log"))),
                });
            }
        }
        Ok(())
    }

    async fn client_of(path: &Path) -> Result<kube::Client, RealStackError> {
        let bad = |reason: String| RealStackError::Kubeconfig { path: path.to_path_buf(), reason };
        let kc = Kubeconfig::read_from(path).map_err(|e| bad(e.to_string()))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| bad(e.to_string()))?;
        kube::Client::try_from(without_retry(config)).map_err(|e| bad(e.to_string()))
    }

    /// A client with every permission (`system:masters`), for the test bed's own setup.
    pub async fn admin_client(&self) -> Result<kube::Client, RealStackError> {
        Self::client_of(&self.admin_kubeconfig).await
    }

    /// A client as the tool's identity (only what `deploy/rbac.yaml` grants).
    pub async fn tool_client(&self) -> Result<kube::Client, RealStackError> {
        Self::client_of(&self.tool_kubeconfig).await
    }

    /// The kubeconfig of the tool's identity.
    pub fn tool_kubeconfig(&self) -> &Path {
        &self.tool_kubeconfig
    }

    /// The kubeconfig of the admin identity (for tools a test drives with full rights).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// What was started besides etcd and kube-apiserver.
    pub fn control_plane(&self) -> ControlPlane {
        self.control_plane
    }

    /// The server's URL.
    pub fn server(&self) -> String {
        self.layout.server()
    }

    /// The PEM of the certificate authority the kubeconfigs trust for the server (what EKS gives
    /// as a cluster's `certificateAuthority`).
    pub fn ca_pem(&self) -> Result<String, RealStackError> {
        let path = self.layout.file("ca.crt");
        std::fs::read_to_string(&path).map_err(io(format!("reading {}", path.display())))
    }

    /// The process ids of the components, in start order (etcd, kube-apiserver, then
    /// kube-controller-manager, kube-scheduler and kwok when started full).
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|(_, c)| c.id()).collect()
    }

    /// The log of a component (`etcd`, `kube-apiserver`, `kube-controller-manager`,
    /// `kube-scheduler`, `kwok`), for assertion messages.
    pub fn log_tail(&self, component: &str) -> String {
        log_tail(&self.layout.file(&format!("{component}.log")))
    }
}

impl Drop for RealStack {
    fn drop(&mut self) {
        if let Some((_, leader)) = self.children.first() {
            // SIGKILL to the whole group (`kill -- -PGID`): the workspace forbids `unsafe`, which
            // calling kill(2) directly would need
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", leader.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        for (_, child) in &mut self.children {
            // in case the group kill could not run; then reap, so no zombie outlives the test
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_constant_is_the_one_go_mod_pins() {
        let go_mod = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/go/go.mod")).unwrap();
        let pinned = go_mod.lines().find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes ")).unwrap();
        assert_eq!(pinned.trim(), KUBERNETES_VERSION);
    }

    #[test]
    fn kwoks_stages_come_from_the_module_kwok_is_built_from() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/kwok");
        let go_mod = std::fs::read_to_string(format!("{dir}/go.mod")).unwrap();
        let (module, version, sum) = KWOK_MODULE;
        assert!(go_mod.lines().any(|l| l.trim() == format!("{module} {version}")), "{go_mod}");
        let go_sum = std::fs::read_to_string(format!("{dir}/go.sum")).unwrap();
        assert!(go_sum.lines().any(|l| l == format!("{module} {version} {sum}")));
    }

    #[test]
    fn a_graceful_pod_is_deleted_at_its_deletion_timestamp_and_no_sooner() {
        assert_eq!(kwok_config(PodExit::AtOnce).unwrap(), "", "kwok's defaults");
        let stage: serde_json::Value = serde_saphyr::from_str(GRACEFUL_POD_DELETE).unwrap();
        let spec = &stage["spec"];
        assert_eq!(spec["resourceRef"]["kind"], "Pod");
        assert_eq!(spec["delay"]["durationFrom"]["expressionFrom"], ".metadata.deletionTimestamp");
        assert_eq!(spec["next"]["delete"], true);
        let keys: Vec<&str> =
            spec["selector"]["matchExpressions"].as_array().unwrap().iter().filter_map(|e| e["key"].as_str()).collect();
        assert_eq!(keys, [".metadata.deletionTimestamp"]);
    }

    #[test]
    fn the_build_script_names_the_fix_when_go_is_missing() {
        // a PATH with only what the script needs before it looks for Go
        let bin = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/usr/bin/dirname", bin.path().join("dirname")).unwrap();
        // the child's PATH is also where std looks `bash` up: name it by this process's PATH
        let bash = std::env::split_paths(&std::env::var_os("PATH").unwrap())
            .map(|d| d.join("bash"))
            .find(|p| p.exists())
            .unwrap();
        let out = Command::new(bash).arg(build_script()).env("PATH", bin.path()).output().unwrap();
        assert_eq!(out.status.code(), Some(127), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("Go is not installed") && stderr.contains("go.dev/doc/install"), "{stderr}");
    }

    #[test]
    fn the_token_file_puts_the_tool_in_its_group_only() {
        let text = token_file("a".repeat(8).as_str(), "t0k", &[]);
        let tool = text.lines().find(|l| l.starts_with("t0k,")).unwrap();
        assert_eq!(tool, format!("t0k,{TOOL_USER},{TOOL_USER}-uid,\"{TOOL_GROUP}\""));
        assert!(!tool.contains("system:masters"));
        assert!(text.lines().any(|l| l.starts_with("aaaaaaaa,admin,") && l.ends_with("\"system:masters\"")));
    }

    #[test]
    fn the_components_are_the_users_the_bootstrap_policy_binds_and_in_no_group() {
        let text = token_file("a", "t", &[("c", CONTROLLER_MANAGER_USER), ("s", SCHEDULER_USER)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[2], "c,system:kube-controller-manager,system:kube-controller-manager-uid");
        assert_eq!(lines[3], "s,system:kube-scheduler,system:kube-scheduler-uid");
    }

    fn layout() -> Layout {
        Layout {
            dir: PathBuf::from("/d"),
            etcd_client_port: 1,
            etcd_peer_port: 2,
            apiserver_port: 3,
            controller_manager_port: 4,
            scheduler_port: 5,
            kwok_port: 6,
        }
    }

    #[test]
    fn the_service_account_admission_plugin_runs_only_with_the_controllers_that_feed_it() {
        let disabled = |args: Vec<String>| args.iter().any(|a| a == "--disable-admission-plugins=ServiceAccount");
        assert!(disabled(layout().apiserver_args(ControlPlane::ApiServerOnly)));
        assert!(!disabled(layout().apiserver_args(ControlPlane::Full)));
        assert!(CONTROLLERS.contains(&"serviceaccount-controller"));
    }

    #[test]
    fn the_controller_manager_runs_the_controllers_a_teardown_meets_as_itself_and_alone() {
        let args = layout().controller_manager_args();
        assert_eq!(args[0], "kube-controller-manager");
        let controllers = args.iter().find_map(|a| a.strip_prefix("--controllers=")).unwrap();
        for want in ["disruption-controller", "replicaset-controller", "garbage-collector-controller"] {
            assert!(controllers.split(',').any(|c| c == want), "{want} missing from {controllers}");
        }
        for want in [
            "--kubeconfig=/d/controller-manager.kubeconfig",
            "--authentication-kubeconfig=/d/controller-manager.kubeconfig",
            "--secure-port=4",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--use-service-account-credentials=true",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        let scheduler = layout().scheduler_args();
        assert_eq!(scheduler[0], "kube-scheduler");
        for want in ["--kubeconfig=/d/scheduler.kubeconfig", "--secure-port=5", "--leader-elect=false"] {
            assert!(scheduler.iter().any(|a| a == want), "{want} missing from {scheduler:?}");
        }
    }

    #[test]
    fn kwok_manages_every_node_and_serves_health_on_loopback() {
        let args = layout().kwok_args();
        for want in ["--manage-all-nodes=true", "--server-address=127.0.0.1:6", "--config=/d/kwok.yaml"] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
    }

    #[test]
    fn the_kubeconfig_reads_as_kube_reads_it() {
        let v = kubeconfig("ctx", "https://127.0.0.1:1234", Path::new("/tmp/ca.crt"), "u", "tok");
        let kc: Kubeconfig = serde_json::from_value(v).unwrap();
        assert_eq!(kc.current_context.as_deref(), Some("ctx"));
        let cluster = kc.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:1234"));
        assert_eq!(cluster.certificate_authority.as_deref(), Some("/tmp/ca.crt"));
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert!(user.token.is_some());
        assert_eq!(kc.contexts[0].context.as_ref().unwrap().user.as_deref(), Some("u"));
    }

    #[test]
    fn the_shipped_rbac_binds_the_tool_group() {
        let yaml = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/rbac.yaml")).unwrap();
        let (roles, bindings) = rbac_objects(&yaml).unwrap();
        assert_eq!(roles.len(), 1);
        let subjects = bindings[0].subjects.clone().unwrap_or_default();
        assert!(subjects.iter().any(|s| s.kind == "Group" && s.name == TOOL_GROUP), "{subjects:?}");
        assert_eq!(bindings[0].role_ref.name, roles[0].metadata.name.clone().unwrap());
    }

    #[test]
    fn the_clients_leave_a_refused_eviction_to_the_caller() {
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        assert!(config.default_retry, "kube's default, which the test bed must turn off");
        assert!(!without_retry(config).default_retry);
    }

    #[test]
    fn rbac_files_with_other_kinds_are_refused() {
        let yaml = "kind: ClusterRole\napiVersion: rbac.authorization.k8s.io/v1\nmetadata: {name: r}\n---\nkind: Secret\napiVersion: v1\nmetadata: {name: s}\n";
        assert!(matches!(rbac_objects(yaml), Err(RealStackError::Rbac(m)) if m.contains("Secret")));
    }

    #[test]
    fn the_apiserver_authorizes_with_node_and_rbac_and_reads_the_token_file() {
        let l = layout();
        let args = l.apiserver_args(ControlPlane::Full);
        assert_eq!(args[0], "kube-apiserver");
        for want in [
            "--authorization-mode=Node,RBAC",
            "--token-auth-file=/d/tokens.csv",
            "--etcd-servers=http://127.0.0.1:1",
            "--secure-port=3",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        assert_eq!(l.etcd_args()[0], "etcd");
    }
}
