//! The test bed's Kubernetes: an in-memory API server over HTTP/1.1 on loopback, generic over
//! kinds, with the semantics karpenter-teardown depends on (design §4) and what kubectl needs
//! (design §5), and a simulated control plane ([`controlplane`]: scheduler, kubelet, workload and
//! disruption controllers).
//!
//! It knows nothing of Karpenter or AWS: those are `sandbox-sim`'s, which talks to this server
//! only over HTTP, like a real controller talks to EKS.
#![forbid(unsafe_code)]

pub mod authz;
pub mod controlplane;
mod conversion;
mod discovery;
mod eviction;
mod faults;
mod http;
mod kinds;
mod openapi;
mod packed;
mod patch;
mod scale;
pub mod schema;
mod select;
mod status;
mod store;
mod stored;
mod table;
mod watch;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use discovery::GIT_VERSION;
pub use eviction::pod_healthy;
pub use faults::{ErrorRule, FaultConfig, RequestStats};
pub use kinds::{PrinterColumn, Registry, ResourceInfo, ScalePaths};
pub use packed::Json;
pub use patch::PatchType;
pub use select::{FieldSelector, LabelSelector};
pub use status::ApiError;
pub use store::{
    Backlogged, DeleteOptions, EventType, GroupResource, ListOptions, ObjectKey, ObjectList, Propagation, Store,
    StoreEvent, WriteOptions, now_rfc3339,
};
pub use stored::{Stored, Summary};

pub(crate) use eviction::{deletion_timeout, pdb_gr, pods_gr, refresh_pdb};

/// Errors of starting the server.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The listening socket could not be opened.
    #[error("cannot listen on 127.0.0.1:{port}: {source}; pick another port or use 0 for any")]
    Bind {
        /// Requested port.
        port: u16,
        /// Cause.
        source: std::io::Error,
    },
    /// The kubeconfig could not be written.
    #[error("cannot write kubeconfig {path}: {reason}; check that the directory exists and is writable")]
    Kubeconfig {
        /// Target path.
        path: std::path::PathBuf,
        /// Cause.
        reason: String,
    },
}

/// The shortest real time an event stays for watch resumption: a client's retry delays run on
/// the real clock, not the sandbox's, and at a time scale of 0.01 the watch cache's 75 s would be
/// shorter than the first of them.
pub const MIN_HISTORY_WINDOW: Duration = Duration::from_secs(5);

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// TCP port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// Multiplies grace periods and controller delays; 1.0 is real time, 0.01 for tests.
    pub time_scale: f64,
    /// Faults to inject from the start.
    pub faults: FaultConfig,
    /// Events kept for watch resumption at most; a watch from an older resourceVersion gets 410.
    pub watch_history: usize,
    /// How long, on the sandbox clock, an event stays for watch resumption (kube-apiserver's
    /// watch cache: 75 s, `eventFreshDuration`); `None`: until `watch_history` pushes it out.
    /// Never less than [`MIN_HISTORY_WINDOW`] of real time.
    pub watch_history_fresh: Option<Duration>,
    /// Run the simulated control plane (scheduler, kubelet, workload controllers).
    pub control_plane: bool,
    /// Most non-watch requests served at once (API Priority and Fairness seats); a request
    /// beyond them gets APF's 429 with `Retry-After`. EKS sizes its priority levels with the
    /// control plane; 100 seats is the order of the `workload-low` level a tool's identity lands
    /// in on a small control plane.
    pub max_in_flight: usize,
    /// RBAC rules (ClusterRoles, e.g. the project's `deploy/rbac.yaml`) enforced on requests
    /// carrying the token of the kubeconfig the server writes: the tool runs with exactly the
    /// permissions the README tells users to grant. `None`: that identity is cluster-admin too.
    pub rbac: Option<authz::Rbac>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            port: 0,
            time_scale: 1.0,
            faults: FaultConfig::default(),
            watch_history: 100_000,
            watch_history_fresh: Some(Duration::from_secs(75)),
            control_plane: true,
            max_in_flight: 100,
            rbac: None,
        }
    }
}

/// A running sandbox API server. Dropping it without [`ApiServer::shutdown`] aborts its tasks.
pub struct ApiServer {
    shared: Arc<http::Shared>,
    tasks: JoinSet<()>,
    port: u16,
    control_plane: bool,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer").field("port", &self.port).finish()
    }
}

impl ApiServer {
    /// Binds 127.0.0.1:`port` and starts serving, plus the control plane when enabled.
    pub async fn start(opts: ServerOptions) -> Result<ApiServer, SandboxError> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", opts.port))
            .await
            .map_err(|source| SandboxError::Bind { port: opts.port, source })?;
        let port = listener.local_addr().map_err(|source| SandboxError::Bind { port: opts.port, source })?.port();
        let url = format!("http://127.0.0.1:{port}");
        let seed = opts.faults.seed;
        let store = Store::new(opts.watch_history, seed ^ 0x5eed);
        if let Some(fresh) = opts.watch_history_fresh {
            let scaled = Duration::try_from_secs_f64(fresh.as_secs_f64() * opts.time_scale).unwrap_or(fresh);
            store.keep_history_for(scaled.max(MIN_HISTORY_WINDOW));
        }
        let shared = Arc::new(http::Shared {
            store,
            stats: RequestStats::default(),
            faults: Mutex::new(faults::Faults::new(opts.faults.clone())),
            cancel: CancellationToken::new(),
            time_scale: opts.time_scale,
            url,
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            max_in_flight: opts.max_in_flight.max(1),
            rbac: opts.rbac.clone(),
        });
        let router = axum::Router::new().fallback(http::handle).with_state(shared.clone());
        let mut tasks = JoinSet::new();
        let cancel = shared.cancel.clone();
        tasks.spawn(async move {
            let served =
                axum::serve(listener, router).with_graceful_shutdown(async move { cancel.cancelled().await }).await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "sandbox API server stopped");
            }
        });
        let mut server = ApiServer { shared, tasks, port, control_plane: false };
        if opts.control_plane {
            server.start_control_plane();
        }
        Ok(server)
    }

    /// Starts the simulated control plane of a server started without it
    /// (`ServerOptions::control_plane: false`): a loader fills the store first, and the
    /// controllers then find every workload with its pods already there. Does nothing when the
    /// control plane already runs.
    pub fn start_control_plane(&mut self) {
        if self.control_plane {
            return;
        }
        self.control_plane = true;
        let store = self.shared.store.clone();
        let cancel = self.shared.cancel.clone();
        let scale = self.shared.time_scale;
        self.tasks.spawn(async move {
            controlplane::run(store, scale, cancel).await;
        });
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        self.shared.url.clone()
    }

    /// Writes a kubeconfig whose cluster, user and current context are named `cluster_name`.
    pub fn write_kubeconfig(&self, path: &Path, cluster_name: &str) -> Result<(), SandboxError> {
        let doc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster_name, "cluster": {"server": self.url()}}],
            "users": [{"name": cluster_name, "user": {"token": authz::KUBECONFIG_TOKEN}}],
            "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": cluster_name, "namespace": "default"}}],
            "current-context": cluster_name,
            "preferences": {},
        });
        let text = serde_saphyr::to_string(&doc)
            .map_err(|e| SandboxError::Kubeconfig { path: path.to_path_buf(), reason: e.to_string() })?;
        std::fs::write(path, text)
            .map_err(|e| SandboxError::Kubeconfig { path: path.to_path_buf(), reason: e.to_string() })
    }

    /// A kube client configuration for this server, with kube's built-in retries off (design
    /// §5: they hide 429s from PodDisruptionBudgets).
    pub fn kube_config(&self) -> kube::Config {
        // The URL is built from 127.0.0.1 and a port, so it always parses.
        let uri: ::http::Uri = self.url().parse().unwrap_or_default();
        let mut cfg = kube::Config::new(uri);
        cfg.default_retry = false;
        cfg.connect_timeout = Some(Duration::from_secs(5));
        cfg.read_timeout = Some(Duration::from_secs(300));
        cfg
    }

    /// Direct access to the object store.
    pub fn store(&self) -> Store {
        self.shared.store.clone()
    }

    /// Request counts by (verb, resource). Subresource writes count as `pods/status`,
    /// `deployments/scale`; evictions as (`evict`, `pods`).
    pub fn requests(&self) -> RequestStats {
        self.shared.stats.clone()
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, f: FaultConfig) {
        let mut cur = self.shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        *cur = faults::Faults::new(f);
    }

    /// Stops serving (open watches end), stops the control plane, waits briefly and aborts
    /// whatever is left.
    pub async fn shutdown(mut self) {
        self.shared.cancel.cancel();
        let drained =
            tokio::time::timeout(Duration::from_secs(2), async { while self.tasks.join_next().await.is_some() {} })
                .await;
        if drained.is_err() {
            self.tasks.shutdown().await;
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
        self.tasks.abort_all();
    }
}
