//! A simulated Karpenter controller (design §3, §6): provisions NodeClaims for pending pods within
//! NodePool limits, runs Karpenter's termination for deleted NodeClaims and Nodes (taint, evict
//! through PDBs, terminate, then drop finalizers conflict-safely), finalizes EC2NodeClasses
//! (launch templates and instance profiles), and garbage-collects orphan instances.
//!
//! Like the real controller it acts only while its Deployment has a ready replica: scale it to
//! zero or delete it and every finalizer stays put, exactly the situation the teardown tool exists
//! for. It sees the cluster through reflectors (watches), not polling; a periodic resync only
//! paces retries (a 429 from a PDB, an instance still shutting down) and garbage collection.
//!
//! The client given to [`SimController::start`] should have kube's default retry off
//! (`Config::default_retry = false`, as the sandbox server's `kube_config()` does): otherwise a PDB
//! 429 stalls the whole controller inside the client instead of being retried on the next pass.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};

use crate::podcache::{PodCache, PodPhase, PodRecord, WirePod};
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::naming::{self, KARPENTER_NAME, KARPENTER_NAMESPACE};
use super::objects::{self, PoolRef};
use super::ops::{self, EvictOutcome, FinalizerOutcome};
use super::world::{NodeLaunch, ensure_class_resources, launch_karpenter_node};
use super::{KarpenterVersion, SimError};
use crate::cloud::{Cloud, SimInstance};
use crate::karpenter::{self, ProviderId};

/// How the simulated controller runs.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// The cluster it manages (its CLUSTER_NAME).
    pub cluster: String,
    /// Region (instance-profile paths, node labels).
    pub region: String,
    /// Zones it launches into, round-robin.
    pub zones: Vec<String>,
    /// The Karpenter release it imitates.
    pub version: KarpenterVersion,
    /// Multiplies every interval below; 1.0 is real time, tests use 0.05 or less.
    pub time_scale: f64,
    /// Workload pods a launched node has room for (allocatable pods is one more, for the
    /// DaemonSet pod).
    pub pods_per_node: u32,
    /// How long a pod must stay unscheduled before it counts as needing capacity (scaled).
    pub pending_grace: Duration,
    /// Period of the orphan-instance garbage collection (scaled).
    pub gc_interval: Duration,
    /// Period of the resync that paces retries (scaled).
    pub resync: Duration,
    /// Bound on concurrent terminations and launches per pass.
    pub concurrency: usize,
    /// Namespace of the controller's Deployment.
    pub namespace: String,
    /// Name of the controller's Deployment.
    pub deployment: String,
}

impl SimSettings {
    /// Settings for `cluster` in `region` with the defaults (real time).
    pub fn new(cluster: &str, region: &str) -> SimSettings {
        SimSettings {
            cluster: cluster.to_string(),
            region: region.to_string(),
            zones: ["a", "b", "c"].iter().map(|z| format!("{region}{z}")).collect(),
            version: KarpenterVersion::default(),
            time_scale: 1.0,
            pods_per_node: 4,
            pending_grace: Duration::from_secs(1),
            gc_interval: Duration::from_secs(5),
            resync: Duration::from_secs(1),
            concurrency: 16,
            namespace: KARPENTER_NAMESPACE.to_string(),
            deployment: KARPENTER_NAME.to_string(),
        }
    }

    fn scaled(&self, d: Duration) -> Duration {
        let s = if self.time_scale.is_finite() && self.time_scale > 0.0 { self.time_scale } else { 1.0 };
        d.mul_f64(s).max(Duration::from_millis(5))
    }
}

/// Counters of what the controller did, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct SimStats {
    nodeclaims_launched: AtomicU64,
    instances_terminated: AtomicU64,
    pods_evicted: AtomicU64,
    evictions_blocked: AtomicU64,
    finalizers_removed: AtomicU64,
    orphans_terminated: AtomicU64,
    nodeclaims_collected: AtomicU64,
    launch_templates_deleted: AtomicU64,
    instance_profiles_deleted: AtomicU64,
    disrupted_taints_removed: AtomicU64,
    passes: AtomicU64,
    gc_rounds: AtomicU64,
    errors: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStatsSnapshot {
    /// NodeClaims created for pending pods.
    pub nodeclaims_launched: u64,
    /// Instances the termination flow or garbage collection terminated.
    pub instances_terminated: u64,
    /// Evictions accepted (201).
    pub pods_evicted: u64,
    /// Evictions refused by a PDB (429).
    pub evictions_blocked: u64,
    /// `karpenter.sh/termination` and `karpenter.k8s.aws/termination` finalizers removed.
    pub finalizers_removed: u64,
    /// Orphan instances (no NodeClaim) terminated by garbage collection.
    pub orphans_terminated: u64,
    /// NodeClaims deleted because their instance was gone.
    pub nodeclaims_collected: u64,
    /// Launch templates deleted while finalizing EC2NodeClasses.
    pub launch_templates_deleted: u64,
    /// Instance profiles deleted while finalizing EC2NodeClasses.
    pub instance_profiles_deleted: u64,
    /// Disrupted taints removed from live Karpenter nodes (the disruption controller's cleanup).
    pub disrupted_taints_removed: u64,
    /// Reconcile passes made while active.
    pub passes: u64,
    /// Garbage-collection rounds completed while active.
    pub gc_rounds: u64,
    /// API or AWS errors met (each retried on a later pass).
    pub errors: u64,
}

impl SimStats {
    fn snapshot(&self) -> SimStatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SimStatsSnapshot {
            nodeclaims_launched: g(&self.nodeclaims_launched),
            instances_terminated: g(&self.instances_terminated),
            pods_evicted: g(&self.pods_evicted),
            evictions_blocked: g(&self.evictions_blocked),
            finalizers_removed: g(&self.finalizers_removed),
            orphans_terminated: g(&self.orphans_terminated),
            nodeclaims_collected: g(&self.nodeclaims_collected),
            launch_templates_deleted: g(&self.launch_templates_deleted),
            instance_profiles_deleted: g(&self.instance_profiles_deleted),
            disrupted_taints_removed: g(&self.disrupted_taints_removed),
            passes: g(&self.passes),
            gc_rounds: g(&self.gc_rounds),
            errors: g(&self.errors),
        }
    }
}

fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// The running controller. Dropping it aborts its tasks; [`SimController::shutdown`] also waits
/// for them to end.
#[derive(Debug)]
pub struct SimController {
    tasks: JoinSet<()>,
    cancel: CancellationToken,
    stats: Arc<SimStats>,
    active: watch::Receiver<bool>,
}

impl SimController {
    /// Starts the watches and the reconcile loop. Returns at once; the loop waits for the
    /// watches' first lists (and for the Karpenter CRDs to exist) before it acts.
    pub fn start(client: Client, aws: Cloud, settings: SimSettings) -> SimController {
        let mut tasks = JoinSet::new();
        let cancel = CancellationToken::new();
        let notify = Arc::new(Notify::new());
        let stats = Arc::new(SimStats::default());
        let (active_tx, active) = watch::channel(false);
        let max_backoff = settings.scaled(Duration::from_secs(2)).max(Duration::from_millis(50));

        let pools_ar = objects::nodepool_resource();
        let claims_ar = objects::nodeclaim_resource();
        let classes_ar = objects::ec2nodeclass_resource();
        let mut caches = Caches { tasks: &mut tasks, cancel: &cancel, notify: &notify, max_backoff };
        // lists in pages of 50: a page is held parsed while the cache is rebuilt beside the old
        // one, and 500 NodeClaims as values were 11.6 MB of a 1,000-node rehearsal's heap peak
        // (a watch cut during the drain relists)
        let all = || watcher::Config::default().page_size(50);
        let stores = Stores {
            pools: caches.spawn(Api::all_with(client.clone(), &pools_ar), pools_ar, all(), drop_field_managers),
            claims: caches.spawn(Api::all_with(client.clone(), &claims_ar), claims_ar, all(), trim_claim),
            classes: caches.spawn(Api::all_with(client.clone(), &classes_ar), classes_ar, all(), drop_field_managers),
            nodes: caches.spawn(Api::<Node>::all(client.clone()), (), all(), trim_node),
            pods: caches.spawn_pods(Api::<WirePod>::all(client.clone())),
            deployment: caches.spawn(
                Api::<Deployment>::namespaced(client.clone(), &settings.namespace),
                (),
                all().fields(&format!("metadata.name={}", settings.deployment)),
                drop_field_managers,
            ),
        };
        let ctx = Arc::new(Ctx {
            client,
            aws,
            settings,
            stats: stats.clone(),
            stores,
            launched: std::sync::Mutex::new(HashSet::new()),
            active: active_tx,
            retry_eviction_at: std::sync::Mutex::new(HashMap::new()),
        });
        let loop_cancel = cancel.clone();
        let loop_ctx = ctx.clone();
        tasks.spawn(async move { run(loop_ctx, notify, loop_cancel).await });
        let gc_cancel = cancel.clone();
        tasks.spawn(async move { run_gc(ctx, gc_cancel).await });
        SimController { tasks, cancel, stats, active }
    }

    /// The counters so far.
    pub fn stats(&self) -> SimStatsSnapshot {
        self.stats.snapshot()
    }

    /// Whether the controller currently acts (its Deployment has a ready replica).
    pub fn is_active(&self) -> bool {
        *self.active.borrow()
    }

    /// Waits until the controller's activity is `active` (true: it saw its ready Deployment),
    /// or `timeout` passes; returns whether it got there.
    pub async fn wait_active(&mut self, active: bool, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.active.wait_for(|a| *a == active)).await.is_ok_and(|r| r.is_ok())
    }

    /// Stops every task and waits for them to end. A pass in progress may finish its writes
    /// first (for up to ten seconds): aborting a launch between RunInstances and the NodeClaim's
    /// status would leak an instance nobody knows about.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        let tasks = &mut self.tasks;
        let finished =
            tokio::time::timeout(Duration::from_secs(10), async { while tasks.join_next().await.is_some() {} }).await;
        if finished.is_err() {
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
        }
    }
}

/// Exponential backoff for the watches, capped low so a CRD created after the controller started
/// (or a server fault) is picked up within a scaled second or two, not kube's 30 s default.
struct CappedBackoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Iterator for CappedBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        Some(d)
    }
}

impl Backoff for CappedBackoff {
    fn reset(&mut self) {
        self.next = self.min;
    }
}

/// The cache keeps an object as the API served it but for its field managers, which the
/// simulation never reads and which are the larger part of a NodeClaim or a Node (heaptrack put
/// 20 MB of a 1,000-node rehearsal's heap peak on these caches).
fn drop_field_managers<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

/// A Node as the simulation reads it: its metadata, its spec (provider id, taints,
/// unschedulable) and the pods it has room for. Its conditions, addresses, capacity and node
/// info are dropped: nothing here reads them, and taints are written from a fresh read.
fn trim_node(node: &mut Node) {
    drop_field_managers(node);
    if let Some(status) = node.status.as_mut() {
        *status =
            k8s_openapi::api::core::v1::NodeStatus { allocatable: status.allocatable.take(), ..Default::default() };
    }
}

/// A NodeClaim as the simulation reads it: its metadata (finalizers, labels, owners, deletion)
/// and the class, instance and node it names ([`objects::claim_class`],
/// [`objects::claim_provider_id`], [`objects::claim_node_name`]). Its requirements, resources,
/// conditions and capacity are most of it, as values 10 KB a claim, and nothing here reads them;
/// the simulation's writes to claims are patches of their metadata and status, never the cached
/// object written back.
fn trim_claim(claim: &mut DynamicObject) {
    drop_field_managers(claim);
    let mut kept = serde_json::json!({});
    if let Some(class) = claim.data["spec"].get_mut("nodeClassRef") {
        kept["spec"] = serde_json::json!({"nodeClassRef": class.take()});
    }
    for field in ["providerID", "nodeName"] {
        if let Some(v) = claim.data["status"].get_mut(field) {
            kept["status"][field] = v.take();
        }
    }
    claim.data = kept;
}

/// What the simulation's watch caches share: the tasks that feed them, the cancellation, the
/// signal that something changed, and the backoff between retries.
struct Caches<'a> {
    tasks: &'a mut JoinSet<()>,
    cancel: &'a CancellationToken,
    notify: &'a Arc<Notify>,
    max_backoff: Duration,
}

impl Caches<'_> {
    /// A cache of what `api` lists under `config`, each object as `trim` leaves it.
    fn spawn<K>(&mut self, api: Api<K>, dyntype: K::DynamicType, config: watcher::Config, trim: fn(&mut K)) -> Store<K>
    where
        K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
    {
        let writer = reflector::store::Writer::new(dyntype);
        let reader = writer.as_reader();
        let stream = reflector::reflector(writer, watcher(api, config).backoff(self.backoff()).modify(trim));
        self.drive(stream, |_| {});
        reader
    }

    /// The cache of every pod in the cluster, as records ([`PodCache`]).
    fn spawn_pods(&mut self, api: Api<WirePod>) -> PodCache {
        let cache = PodCache::new();
        let stream = watcher(api, watcher::Config::default()).backoff(self.backoff());
        let feed = cache.clone();
        self.drive(stream, move |ev| {
            if let Ok(ev) = ev {
                feed.apply(&ev);
            }
        });
        cache
    }

    fn backoff(&self) -> CappedBackoff {
        let min = Duration::from_millis(10);
        CappedBackoff { next: min, min, max: self.max_backoff }
    }

    /// Runs `stream` in a task of its own until cancelled, handing each item to `consume` and
    /// then waking the reconcile loop (errors too: the backoff retries them, and either way
    /// the loop has news).
    fn drive<S>(&mut self, stream: S, mut consume: impl FnMut(S::Item) + Send + 'static)
    where
        S: futures::Stream + Send + 'static,
    {
        let notify = self.notify.clone();
        let cancel = self.cancel.clone();
        self.tasks.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    ev = stream.next() => match ev {
                        Some(ev) => {
                            consume(ev);
                            notify.notify_one();
                        }
                        None => break,
                    },
                }
            }
        });
    }
}

struct Stores {
    pools: Store<DynamicObject>,
    claims: Store<DynamicObject>,
    classes: Store<DynamicObject>,
    nodes: Store<Node>,
    pods: PodCache,
    deployment: Store<Deployment>,
}

impl Stores {
    /// The NodePools this controller manages: like Karpenter's own watches (filtered by
    /// `IsManaged` in `pkg/utils/nodepool`), only those whose node class reference is the AWS
    /// provider's. EKS Auto Mode's pools in the same cluster are someone else's.
    fn managed_pools(&self) -> Vec<Arc<DynamicObject>> {
        self.pools.state().into_iter().filter(|p| karpenter::manages_pool(p)).collect()
    }

    /// The NodeClaims this controller manages (`IsManaged` in `pkg/utils/nodeclaim`).
    fn managed_claims(&self) -> Vec<Arc<DynamicObject>> {
        self.claims.state().into_iter().filter(|c| karpenter::manages_claim(c)).collect()
    }

    /// The Nodes this controller manages (`IsManaged` in `pkg/utils/node`).
    fn managed_nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.state().into_iter().filter(|n| karpenter::manages_node(n.labels())).collect()
    }
}

struct Ctx {
    client: Client,
    aws: Cloud,
    settings: SimSettings,
    stats: Arc<SimStats>,
    stores: Stores,
    /// Instance ids this controller launched and has not yet seen claimed: garbage collection
    /// (its own task) must never take them for orphans.
    launched: std::sync::Mutex<HashSet<String>>,
    /// Whether the controller acts; garbage collection reads it too.
    active: watch::Sender<bool>,
    /// Pods (by uid) a PDB refused, and when to ask again: like Karpenter's eviction queue, a
    /// refused eviction is retried after a delay, not on every watch event.
    retry_eviction_at: std::sync::Mutex<HashMap<String, Instant>>,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding this lock cannot leave the set inconsistent (single inserts and
    // retains), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the loop remembers between passes.
#[derive(Default)]
struct State {
    /// When each unscheduled pod (by uid) was first seen unscheduled.
    pending_since: HashMap<String, Instant>,
    /// Nodes launched whose Node the reflector has not shown yet, with their free slots.
    inflight: HashMap<String, u32>,
    /// Classes (by uid) whose launch template and profile exist.
    classes_ready: HashSet<String>,
    zone_cursor: usize,
    /// When the disruption loop last cleared stale disrupted taints.
    last_disruption_pass: Option<Instant>,
}

/// What garbage collection remembers between its rounds.
#[derive(Default)]
struct GcState {
    /// Orphan instances seen by the previous round.
    orphan_suspects: HashSet<String>,
    /// NodeClaims whose instance was missing at the previous round.
    claim_suspects: HashSet<String>,
}

/// The shortest time from the start of one reconcile pass to the next (not scaled: it bounds
/// the simulator's CPU, which the time scale does not shrink).
const MIN_PASS_GAP: Duration = Duration::from_millis(100);

async fn run(ctx: Arc<Ctx>, notify: Arc<Notify>, cancel: CancellationToken) {
    let ready = async {
        let s = &ctx.stores;
        let _ = s.deployment.wait_until_ready().await;
        let _ = s.nodes.wait_until_ready().await;
        s.pods.wait_until_ready().await;
        let _ = s.pools.wait_until_ready().await;
        let _ = s.claims.wait_until_ready().await;
        let _ = s.classes.wait_until_ready().await;
    };
    tokio::select! {
        _ = cancel.cancelled() => return,
        _ = ready => {},
    }
    let mut state = State::default();
    let resync = ctx.settings.scaled(ctx.settings.resync);
    loop {
        let pass_started = tokio::time::Instant::now();
        let active = controller_ready(&ctx);
        ctx.active.send_replace(active);
        if active {
            bump(&ctx.stats.passes, 1);
            reconcile(&ctx, &mut state).await;
        } else {
            // A stopped controller forgets its in-memory view like a restarted pod would.
            state = State::default();
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = notify.notified() => {},
            _ = tokio::time::sleep(resync) => {},
        }
        // Like Karpenter's batching window: changes that arrive together make one pass. A pass
        // reads every pod, and during a drain of thousands the store changes continuously.
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep_until(pass_started + MIN_PASS_GAP) => {},
        }
    }
}

/// The real controller only runs while its pods do: a Deployment with replicas and a ready one.
fn controller_ready(ctx: &Ctx) -> bool {
    ctx.stores.deployment.state().iter().any(|d| {
        d.name_any() == ctx.settings.deployment
            && d.meta().deletion_timestamp.is_none()
            && d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) > 0
            && d.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0) > 0
    })
}

async fn reconcile(ctx: &Ctx, state: &mut State) {
    let now = Instant::now();
    // expired entries are meaningless (and pods that vanished would leave them forever)
    lock(&ctx.retry_eviction_at).retain(|_, at| *at > now);
    prepare_classes(ctx, state).await;
    strip_stale_disrupted_taints(ctx, state).await;
    terminate(ctx).await;
    finalize_classes(ctx).await;
    provision(ctx, state).await;
    report_pool_resources(ctx).await;
}

/// Karpenter's disruption controller polls every 10 s.
const DISRUPTION_POLL: Duration = Duration::from_secs(10);

/// What the real disruption controller does at the start of every pass: it removes
/// `karpenter.sh/disrupted:NoSchedule` from every Karpenter node (one with a NodeClaim) that is
/// neither in its own orchestration queue nor marked for deletion (NodeClaim or Node with a
/// deletionTimestamp), because a taint left by a crashed disruption would otherwise fence the
/// node for ever (kubernetes-sigs/karpenter `pkg/controllers/disruption/controller.go`). This
/// simulator never disrupts on its own, so its queue is always empty: a taint that anyone else
/// puts on a live Karpenter node is gone within one pass, as on a real cluster.
async fn strip_stale_disrupted_taints(ctx: &Ctx, state: &mut State) {
    let period = ctx.settings.scaled(DISRUPTION_POLL);
    if state.last_disruption_pass.is_some_and(|at| at.elapsed() < period) {
        return;
    }
    state.last_disruption_pass = Some(Instant::now());
    let claims = ctx.stores.managed_claims();
    let live_claim_of = |node: &Node| {
        let name = node.name_any();
        let pid = node_provider_id(node);
        claims.iter().find(|c| {
            c.data["status"]["nodeName"].as_str() == Some(name.as_str())
                || (pid.is_some() && c.data["status"]["providerID"].as_str() == pid)
        })
    };
    let stale: Vec<String> =
        ctx.stores
            .managed_nodes()
            .iter()
            .filter(|n| !is_deleting(n.as_ref()) && n.labels().contains_key(karpenter::LABEL_NODEPOOL))
            .filter(|n| {
                n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|ts| {
                    ts.iter().any(|t| t.key == karpenter::TAINT_DISRUPTED && t.effect == "NoSchedule")
                })
            })
            .filter(|n| live_claim_of(n).is_some_and(|c| c.metadata.deletion_timestamp.is_none()))
            .map(|n| n.name_any())
            .collect();
    for node in stale {
        match ops::remove_taint(&ctx.client, &node, karpenter::TAINT_DISRUPTED, "NoSchedule").await {
            Ok(true) => bump(&ctx.stats.disrupted_taints_removed, 1),
            Ok(false) => {}
            Err(e) => record_error(ctx, &SimError::kube(format!("removing the disrupted taint of Node {node}"))(e)),
        }
    }
}

/// Keeps NodePool `status.resources` (what `kubectl get nodepools` shows, and what Karpenter
/// counts against `spec.limits`) current; written only when it changed.
async fn report_pool_resources(ctx: &Ctx) {
    let claims = ctx.stores.managed_claims();
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &objects::nodepool_resource());
    for pool in ctx.stores.managed_pools() {
        if is_deleting(pool.as_ref()) {
            continue;
        }
        let name = pool.name_any();
        let n = claims.iter().filter(|c| objects::claim_pool(c) == Some(name.as_str())).count() as u64;
        let want = serde_json::json!({
            "cpu": (n * naming::CPU_PER_NODE).to_string(),
            "memory": format!("{}Gi", n * naming::MEMORY_GIB_PER_NODE),
            "nodes": n.to_string(),
        });
        if pool.data["status"]["resources"] == want {
            continue;
        }
        if let Err(e) = ops::patch_status(&api, &name, serde_json::json!({"resources": want})).await
            && !ops::is_not_found(&e)
        {
            record_error(ctx, &SimError::kube(format!("writing NodePool {name} status"))(e));
        }
    }
}

fn is_deleting<K: Resource>(o: &K) -> bool {
    o.meta().deletion_timestamp.is_some()
}

fn record_error(ctx: &Ctx, e: &SimError) {
    bump(&ctx.stats.errors, 1);
    tracing::debug!(error = %e, "simulated karpenter: will retry on a later pass");
}

// ---------------------------------------------------------------------------------------------
// EC2NodeClasses

/// New classes get their launch template and (for `spec.role`) instance profile, like Karpenter's
/// class reconciler; the generator already did it for the classes it made.
async fn prepare_classes(ctx: &Ctx, state: &mut State) {
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &objects::ec2nodeclass_resource());
    for class in ctx.stores.classes.state() {
        let Some(uid) = class.uid() else { continue };
        if is_deleting(class.as_ref()) {
            continue;
        }
        // Karpenter puts its finalizer on every class it reconciles (kubectl-applied ones too).
        if let Err(e) = ops::add_finalizer(&api, class.as_ref(), karpenter::FINALIZER_NODECLASS).await {
            record_error(ctx, &SimError::kube(format!("adding the finalizer of EC2NodeClass {}", class.name_any()))(e));
        }
        if state.classes_ready.contains(&uid) {
            continue;
        }
        if class.data["status"]["instanceProfile"].as_str().is_some_and(|s| !s.is_empty()) {
            state.classes_ready.insert(uid);
            continue;
        }
        let s = &ctx.settings;
        match ensure_class_resources(s.version, &s.region, &s.cluster, &api, &ctx.aws, &class, &uid).await {
            Ok(_) => {
                state.classes_ready.insert(uid);
            }
            Err(e) => record_error(ctx, &e),
        }
    }
}

/// Deleted classes: wait until no NodeClaim references them, then delete their launch templates
/// and instance profile, then drop `karpenter.k8s.aws/termination`.
async fn finalize_classes(ctx: &Ctx) {
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &objects::ec2nodeclass_resource());
    for class in ctx.stores.classes.state() {
        if !is_deleting(class.as_ref()) || !class.finalizers().iter().any(|f| f == karpenter::FINALIZER_NODECLASS) {
            continue;
        }
        let name = class.name_any();
        let referenced = ctx.stores.managed_claims().iter().any(|c| objects::claim_class(c) == Some(name.as_str()));
        if referenced {
            continue;
        }
        if let Err(e) = finalize_class(ctx, &api, &class, &name).await {
            record_error(ctx, &e);
        }
    }
}

async fn finalize_class(
    ctx: &Ctx,
    api: &Api<DynamicObject>,
    class: &DynamicObject,
    name: &str,
) -> Result<(), SimError> {
    let s = &ctx.settings;
    let templates =
        ctx.aws.class_launch_templates(&s.cluster, name).await.map_err(SimError::aws("listing launch templates"))?;
    for lt in &templates {
        ctx.aws
            .delete_launch_template(&lt.id)
            .await
            .map_err(SimError::aws(format!("deleting launch template {}", lt.name)))?;
        bump(&ctx.stats.launch_templates_deleted, 1);
    }
    if class.data["spec"]["role"].is_string()
        && let Some(profile) = class.data["status"]["instanceProfile"].as_str().filter(|p| !p.is_empty())
    {
        // Karpenter deletes the profile it generated by name (instanceprofile.Provider.Delete:
        // roles removed first), without listing.
        let deleted = ctx
            .aws
            .delete_instance_profile(profile)
            .await
            .map_err(SimError::aws(format!("deleting instance profile {profile}")))?;
        if deleted {
            bump(&ctx.stats.instance_profiles_deleted, 1);
        }
    }
    match ops::remove_finalizer(api, name, karpenter::FINALIZER_NODECLASS).await {
        Ok(FinalizerOutcome::Removed) => bump(&ctx.stats.finalizers_removed, 1),
        Ok(_) => {}
        Err(e) => return Err(SimError::kube(format!("removing the finalizer of EC2NodeClass {name}"))(e)),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Termination

fn node_provider_id(node: &Node) -> Option<&str> {
    node.spec.as_ref().and_then(|s| s.provider_id.as_deref()).filter(|p| !p.is_empty())
}

fn has_finalizer<K: Resource>(o: &K, f: &str) -> bool {
    o.meta().finalizers.as_ref().is_some_and(|fs| fs.iter().any(|x| x == f))
}

/// One NodeClaim/Node pair to terminate.
struct Job {
    claim: Option<Arc<DynamicObject>>,
    node: Option<Arc<Node>>,
}

async fn terminate(ctx: &Ctx) {
    let claims = ctx.stores.managed_claims();
    let nodes = ctx.stores.managed_nodes();
    let node_by_name: HashMap<String, Arc<Node>> = nodes.iter().map(|n| (n.name_any(), n.clone())).collect();
    let node_by_pid: HashMap<&str, Arc<Node>> =
        nodes.iter().filter_map(|n| node_provider_id(n).map(|p| (p, n.clone()))).collect();
    let claim_api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &objects::nodeclaim_resource());

    let mut jobs = Vec::new();
    let mut covered: HashSet<String> = HashSet::new();
    for claim in &claims {
        if !is_deleting(claim.as_ref()) || !has_finalizer(claim.as_ref(), karpenter::FINALIZER_TERMINATION) {
            continue;
        }
        let node = objects::claim_node_name(claim)
            .and_then(|n| node_by_name.get(n).cloned())
            .or_else(|| objects::claim_provider_id(claim).and_then(|p| node_by_pid.get(p).cloned()));
        if let Some(n) = &node {
            covered.insert(n.name_any());
        }
        jobs.push(Job { claim: Some(claim.clone()), node });
    }
    for node in &nodes {
        let name = node.name_any();
        if !is_deleting(node.as_ref())
            || !has_finalizer(node.as_ref(), karpenter::FINALIZER_TERMINATION)
            || covered.contains(&name)
        {
            continue;
        }
        // A deleted Node takes its NodeClaim with it (Karpenter v1); the claim's own termination
        // then drains and terminates. A node whose claim is gone is terminated on its own.
        let claim = claims.iter().find(|c| {
            objects::claim_node_name(c) == Some(name.as_str())
                || (node_provider_id(node).is_some() && objects::claim_provider_id(c) == node_provider_id(node))
        });
        match claim {
            Some(c) => {
                if let Err(e) = ops::delete_if_present(&claim_api, &c.name_any()).await {
                    record_error(ctx, &SimError::kube(format!("deleting NodeClaim {}", c.name_any()))(e));
                }
            }
            None => jobs.push(Job { claim: None, node: Some(node.clone()) }),
        }
    }
    stream::iter(jobs)
        .for_each_concurrent(ctx.settings.concurrency.max(1), |job| async move {
            if let Err(e) = terminate_one(ctx, &job).await {
                record_error(ctx, &e);
            }
        })
        .await;
}

/// Pods Karpenter's drain leaves alone: DaemonSet and mirror pods, finished pods, and pods that
/// tolerate the disrupted taint (they would just come back).
fn is_drainable(pod: &PodRecord) -> bool {
    let tolerates = pod.placement.tolerations.iter().any(|t| {
        let key_ok = match t.key.as_deref() {
            None | Some("") => t.exists,
            Some(k) => k == karpenter::TAINT_DISRUPTED,
        };
        key_ok && t.effect.as_deref().is_none_or(|e| e.is_empty() || e == "NoSchedule")
    });
    !(pod.daemonset || pod.mirror || pod.phase.finished() || tolerates)
}

/// Drains the node (non-critical pods first, critical ones after), and returns whether it is
/// empty of drainable pods.
async fn drain(ctx: &Ctx, node: &Node) -> Result<bool, SimError> {
    let name = node.name_any();
    if !ops::ensure_taint(&ctx.client, &name, karpenter::TAINT_DISRUPTED, "NoSchedule")
        .await
        .map_err(SimError::kube(format!("tainting Node {name}")))?
    {
        return Ok(false);
    }
    let pods: Vec<Arc<PodRecord>> = ctx.stores.pods.on_node(&name).into_iter().filter(|p| is_drainable(p)).collect();
    if pods.is_empty() {
        return Ok(true);
    }
    let non_critical: Vec<&Arc<PodRecord>> = pods.iter().filter(|p| !p.critical).collect();
    let wave: Vec<&Arc<PodRecord>> = if non_critical.is_empty() { pods.iter().collect() } else { non_critical };
    let now = Instant::now();
    let retry_after = ctx.settings.scaled(ctx.settings.resync);
    for pod in wave.into_iter().filter(|p| !p.deleting) {
        let uid = pod.uid.to_string();
        if lock(&ctx.retry_eviction_at).get(&uid).is_some_and(|at| *at > now) {
            continue;
        }
        let ns = &pod.namespace;
        let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
        match ops::evict(&api, &pod.name, Some(&pod.uid))
            .await
            .map_err(SimError::kube(format!("evicting pod {ns}/{}", pod.name)))?
        {
            EvictOutcome::Evicted | EvictOutcome::Gone => {
                lock(&ctx.retry_eviction_at).remove(&uid);
                bump(&ctx.stats.pods_evicted, 1);
            }
            EvictOutcome::Blocked(_) => {
                lock(&ctx.retry_eviction_at).insert(uid, now + retry_after);
                bump(&ctx.stats.evictions_blocked, 1);
            }
        }
    }
    Ok(false)
}

/// Terminates the instance behind `provider_id`; true once EC2 reports it terminated or unknown.
async fn terminate_instance(ctx: &Ctx, provider_id: &str) -> Result<bool, SimError> {
    let Some(pid) = ProviderId::parse(provider_id) else {
        // Not an AWS instance: nothing of ours to terminate.
        return Ok(true);
    };
    let ids = vec![pid.instance_id.clone()];
    let live = |infos: &[SimInstance]| infos.iter().any(SimInstance::is_live);
    let found = ctx.aws.instances_by_id(&ids).await.map_err(SimError::aws("describing an instance"))?;
    if !live(&found) {
        return Ok(true);
    }
    let out = ctx.aws.terminate(&ids).await.map_err(SimError::aws(format!("terminating {}", pid.instance_id)))?;
    bump(&ctx.stats.instances_terminated, out.len() as u64);
    let after = ctx.aws.instances_by_id(&ids).await.map_err(SimError::aws("describing an instance"))?;
    Ok(!live(&after))
}

async fn terminate_one(ctx: &Ctx, job: &Job) -> Result<(), SimError> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    if let Some(node) = &job.node {
        let name = node.name_any();
        if !is_deleting(node.as_ref()) {
            ops::delete_if_present(&nodes, &name).await.map_err(SimError::kube(format!("deleting Node {name}")))?;
        }
        if !drain(ctx, node).await? {
            return Ok(());
        }
    }
    let provider_id = job
        .claim
        .as_deref()
        .and_then(objects::claim_provider_id)
        .or_else(|| job.node.as_deref().and_then(node_provider_id))
        .map(str::to_string);
    if let Some(pid) = provider_id
        && !terminate_instance(ctx, &pid).await?
    {
        return Ok(());
    }
    if let Some(node) = &job.node {
        let name = node.name_any();
        match ops::remove_finalizer(&nodes, &name, karpenter::FINALIZER_TERMINATION)
            .await
            .map_err(SimError::kube(format!("removing the finalizer of Node {name}")))?
        {
            FinalizerOutcome::Removed => bump(&ctx.stats.finalizers_removed, 1),
            FinalizerOutcome::Absent => {}
            FinalizerOutcome::Conflict => return Ok(()),
        }
    }
    if let Some(claim) = &job.claim {
        let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &objects::nodeclaim_resource());
        let name = claim.name_any();
        if ops::remove_finalizer(&api, &name, karpenter::FINALIZER_TERMINATION)
            .await
            .map_err(SimError::kube(format!("removing the finalizer of NodeClaim {name}")))?
            == FinalizerOutcome::Removed
        {
            bump(&ctx.stats.finalizers_removed, 1);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Provisioning

/// A NodePool that may launch, with what its nodes look like to a scheduler.
struct Candidate {
    name: String,
    uid: String,
    class: String,
    labels: BTreeMap<String, String>,
    taints: Vec<serde_json::Value>,
    /// Nodes its limits still allow (`None`: unlimited), less what this pass planned.
    room: Option<u64>,
    weight: i64,
    /// A static pool: the NodeClaims it is short of `spec.replicas` (it takes no pending pods).
    static_deficit: Option<u64>,
}

fn pod_fits_labels(pod: &PodRecord, labels: &BTreeMap<String, String>, taints: &[serde_json::Value]) -> bool {
    let placement = &pod.placement;
    let selector_ok = placement
        .node_selector
        .iter()
        .all(|(k, v)| &**k == naming::LABEL_ZONE || labels.get(&**k).map(String::as_str) == Some(&**v));
    let tolerations = &placement.tolerations;
    let taints_ok = taints.iter().all(|t| {
        let key = t["key"].as_str().unwrap_or_default();
        let effect = t["effect"].as_str().unwrap_or_default();
        effect == "PreferNoSchedule"
            || tolerations.iter().any(|tol| {
                let key_ok = match tol.key.as_deref() {
                    None | Some("") => tol.exists,
                    Some(k) => {
                        k == key
                            && (tol.exists
                                || tol.value.as_deref().unwrap_or_default() == t["value"].as_str().unwrap_or_default())
                    }
                };
                key_ok && tol.effect.as_deref().is_none_or(|e| e.is_empty() || e == effect)
            })
    });
    selector_ok && taints_ok
}

fn candidates(ctx: &Ctx) -> Vec<Candidate> {
    let classes = ctx.stores.classes.state();
    let claims = ctx.stores.managed_claims();
    let mut out = Vec::new();
    for pool in ctx.stores.managed_pools() {
        if is_deleting(pool.as_ref()) {
            continue;
        }
        let (Some(uid), Some(class)) = (pool.uid(), objects::pool_class(&pool)) else { continue };
        // A pool whose class is missing or being deleted launches nothing (Karpenter reports
        // the NodePool not ready).
        if !classes.iter().any(|c| c.name_any() == class && !is_deleting(c.as_ref())) {
            continue;
        }
        let name = pool.name_any();
        let existing = claims.iter().filter(|c| objects::claim_pool(c) == Some(name.as_str())).count() as u64;
        // like the static provisioning controller: NodeClaims being deleted do not count as running
        let running =
            claims.iter().filter(|c| objects::claim_pool(c) == Some(name.as_str()) && !is_deleting(c.as_ref())).count()
                as u64;
        let mut labels: BTreeMap<String, String> = pool.data["spec"]["template"]["metadata"]["labels"]
            .as_object()
            .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
            .unwrap_or_default();
        for (k, v) in [
            (karpenter::LABEL_NODEPOOL, name.as_str()),
            (karpenter::LABEL_NODECLASS, class),
            (naming::LABEL_CAPACITY_TYPE, "on-demand"),
            (naming::LABEL_INSTANCE_TYPE, naming::INSTANCE_TYPE),
            (naming::LABEL_REGION, ctx.settings.region.as_str()),
            ("kubernetes.io/arch", "amd64"),
            ("kubernetes.io/os", "linux"),
        ] {
            labels.insert(k.to_string(), v.to_string());
        }
        out.push(Candidate {
            name: name.clone(),
            uid,
            class: class.to_string(),
            labels,
            taints: pool.data["spec"]["template"]["spec"]["taints"].as_array().cloned().unwrap_or_default(),
            room: objects::nodes_allowed_by_limits(&pool, existing),
            weight: pool.data["spec"]["weight"].as_i64().unwrap_or(0),
            static_deficit: objects::static_replicas(&pool).map(|r| r.saturating_sub(running)),
        });
    }
    out.sort_by(|a, b| b.weight.cmp(&a.weight).then_with(|| a.name.cmp(&b.name)));
    out
}

fn node_schedulable(node: &Node) -> bool {
    let spec = node.spec.as_ref();
    !is_deleting(node)
        && !spec.and_then(|s| s.unschedulable).unwrap_or(false)
        && !spec
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == karpenter::TAINT_DISRUPTED))
        && node.labels().contains_key(karpenter::LABEL_NODEPOOL)
}

async fn provision(ctx: &Ctx, state: &mut State) {
    let grace = ctx.settings.scaled(ctx.settings.pending_grace);
    let now = Instant::now();
    let pods = ctx.stores.pods.state();
    let mut seen = HashSet::new();
    let mut pending: Vec<Arc<PodRecord>> = Vec::new();
    for pod in &pods {
        if pod.node_name.is_some() || pod.phase != PodPhase::Pending || pod.daemonset || pod.deleting {
            continue;
        }
        let uid = pod.uid.to_string();
        seen.insert(uid.clone());
        let since = *state.pending_since.entry(uid).or_insert(now);
        if now.duration_since(since) >= grace {
            pending.push(pod.clone());
        }
    }
    state.pending_since.retain(|uid, _| seen.contains(uid));

    // Free slots on schedulable Karpenter nodes, and on nodes launched but not yet in the store.
    let nodes = ctx.stores.nodes.state();
    let known: HashSet<String> = nodes.iter().map(|n| n.name_any()).collect();
    state.inflight.retain(|n, _| !known.contains(n));
    let mut used: HashMap<String, u32> = HashMap::new();
    for pod in &pods {
        if let Some(n) = pod.node_name.as_deref()
            && !pod.phase.finished()
        {
            *used.entry(n.to_string()).or_default() += 1;
        }
    }
    let mut free: Vec<(BTreeMap<String, String>, Vec<serde_json::Value>, u32)> = Vec::new();
    for node in nodes.iter().filter(|n| node_schedulable(n)) {
        let alloc = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("pods"))
            .and_then(|q| q.0.parse::<u32>().ok())
            .unwrap_or(0);
        let slots = alloc.saturating_sub(used.get(&node.name_any()).copied().unwrap_or(0));
        if slots > 0 {
            let labels = node.labels().clone().into_iter().collect();
            let taints = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .map(|ts| ts.iter().filter_map(|t| serde_json::to_value(t).ok()).collect())
                .unwrap_or_default();
            free.push((labels, taints, slots));
        }
    }
    let mut inflight_slots: u32 = state.inflight.values().sum();

    let mut cands = candidates(ctx);
    // planned[i]: (pool index, free slots left on the planned node)
    let mut planned: Vec<(usize, u32)> = Vec::new();
    for pod in &pending {
        if let Some(slot) = free.iter_mut().find(|(l, t, s)| *s > 0 && pod_fits_labels(pod, l, t)) {
            slot.2 -= 1;
            continue;
        }
        if inflight_slots > 0 {
            inflight_slots -= 1;
            continue;
        }
        if let Some(p) =
            planned.iter_mut().find(|(i, s)| *s > 0 && pod_fits_labels(pod, &cands[*i].labels, &cands[*i].taints))
        {
            p.1 -= 1;
            continue;
        }
        // static pools take no pending pods: Karpenter provisions them to their replicas only
        let Some(i) = cands.iter().position(|c| {
            c.static_deficit.is_none() && c.room != Some(0) && pod_fits_labels(pod, &c.labels, &c.taints)
        }) else {
            continue;
        };
        if let Some(r) = cands[i].room.as_mut() {
            *r -= 1;
        }
        planned.push((i, ctx.settings.pods_per_node.saturating_sub(1)));
    }
    // Static pools (the static provisioning controller): up to `replicas`, within `limits.nodes`.
    for (i, c) in cands.iter_mut().enumerate() {
        let Some(deficit) = c.static_deficit else { continue };
        let n = c.room.map_or(deficit, |r| r.min(deficit));
        if let Some(r) = c.room.as_mut() {
            *r -= n;
        }
        planned.extend((0..n).map(|_| (i, ctx.settings.pods_per_node)));
    }
    if planned.is_empty() {
        return;
    }
    let zones = if ctx.settings.zones.is_empty() {
        vec![format!("{}a", ctx.settings.region)]
    } else {
        ctx.settings.zones.clone()
    };
    let launches: Vec<(usize, String, String)> = planned
        .iter()
        .map(|(i, _)| {
            state.zone_cursor = state.zone_cursor.wrapping_add(1);
            let zone = zones[state.zone_cursor % zones.len()].clone();
            let salt = naming::stable_hash(&[&naming::random_suffix(8)]) & 0x00ff_ffff;
            (*i, zone, super::world::ip_node_name(&ctx.settings.region, salt, 0))
        })
        .collect();
    let pods_alloc = ctx.settings.pods_per_node + 1;
    let cands = &cands;
    let results: Vec<(String, Result<super::world::GeneratedNode, SimError>)> = stream::iter(launches)
        .map(|(i, zone, node_name)| async move {
            let c = &cands[i];
            let launch = NodeLaunch {
                cluster: &ctx.settings.cluster,
                region: &ctx.settings.region,
                version: ctx.settings.version,
                pool: PoolRef { name: &c.name, uid: &c.uid, class: &c.class },
                zone: &zone,
                node_name: &node_name,
                pods: pods_alloc,
            };
            (node_name.clone(), launch_karpenter_node(&ctx.client, &ctx.aws, &launch).await)
        })
        .buffer_unordered(ctx.settings.concurrency.max(1))
        .collect()
        .await;
    for (node_name, r) in results {
        match r {
            Ok(n) => {
                bump(&ctx.stats.nodeclaims_launched, 1);
                lock(&ctx.launched).insert(n.instance_id);
                state.inflight.insert(node_name, ctx.settings.pods_per_node);
            }
            Err(e) => record_error(ctx, &e),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Garbage collection

/// Garbage collection runs in its own task: listing the cluster's instances can take a while
/// (LocalStack filters slowly), and termination work must not wait behind it.
async fn run_gc(ctx: Arc<Ctx>, cancel: CancellationToken) {
    let mut state = GcState::default();
    let interval = ctx.settings.scaled(ctx.settings.gc_interval);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {},
        }
        if *ctx.active.borrow() {
            collect_garbage(&ctx, &mut state).await;
            bump(&ctx.stats.gc_rounds, 1);
        } else {
            state = GcState::default();
        }
    }
}

/// Instances with this cluster's Karpenter tags but no NodeClaim are terminated, and NodeClaims
/// whose instance is gone are deleted — each only when seen twice in a row, so a launch or a
/// registration in flight is never mistaken for an orphan.
async fn collect_garbage(ctx: &Ctx, state: &mut GcState) {
    let live = match ctx.aws.karpenter_instances(&ctx.settings.cluster).await {
        Ok(l) => l,
        Err(e) => return record_error(ctx, &SimError::aws("listing the cluster's instances")(e)),
    };
    // Only this provider's claims, as `ListManaged` gives them to Karpenter's collector: EKS
    // Auto Mode's instances are not among this controller's, so its claims would all look
    // orphaned. (Karpenter also spares a claim whose Node is still Ready; the sandbox has no
    // node lifecycle controller to mark a dead instance's Node NotReady, so that check is not
    // modelled.)
    let claims = ctx.stores.managed_claims();
    let claimed: HashSet<String> = claims
        .iter()
        .filter_map(|c| objects::claim_provider_id(c))
        .filter_map(|p| ProviderId::parse(p).map(|p| p.instance_id))
        .collect();
    let live_ids: HashSet<String> = live.iter().map(|i| i.id.clone()).collect();
    let launched = lock(&ctx.launched).clone();
    let orphans: HashSet<String> =
        live_ids.iter().filter(|id| !claimed.contains(*id) && !launched.contains(*id)).cloned().collect();
    let confirmed: Vec<String> = orphans.intersection(&state.orphan_suspects).cloned().collect();
    state.orphan_suspects = orphans;
    if !confirmed.is_empty() {
        match ctx.aws.terminate(&confirmed).await {
            Ok(out) => {
                bump(&ctx.stats.instances_terminated, out.len() as u64);
                bump(&ctx.stats.orphans_terminated, out.len() as u64);
            }
            Err(e) => record_error(ctx, &SimError::aws("terminating orphan instances")(e)),
        }
    }
    lock(&ctx.launched).retain(|id| live_ids.contains(id) && !claimed.contains(id));

    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &objects::nodeclaim_resource());
    let mut missing = HashSet::new();
    for claim in claims.iter().filter(|c| !is_deleting(c.as_ref())) {
        let Some(pid) = objects::claim_provider_id(claim).and_then(ProviderId::parse) else { continue };
        if !live_ids.contains(&pid.instance_id) {
            missing.insert(claim.name_any());
        }
    }
    for name in missing.intersection(&state.claim_suspects) {
        match ops::delete_if_present(&api, name).await {
            Ok(()) => bump(&ctx.stats.nodeclaims_collected, 1),
            Err(e) => record_error(ctx, &SimError::kube(format!("deleting NodeClaim {name}"))(e)),
        }
    }
    state.claim_suspects = missing;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> PodRecord {
        PodRecord::from_json(v)
    }

    /// The cache's trimmed NodeClaim answers every question the simulation asks of a claim as
    /// the whole one does.
    #[test]
    fn a_trimmed_claim_reads_as_the_whole_one() {
        let whole: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
            "metadata": {"name": "default-x7k2p", "uid": "c1", "resourceVersion": "42",
                "labels": {"karpenter.sh/nodepool": "default", "node.kubernetes.io/instance-type": "m5.large"},
                "finalizers": ["karpenter.sh/termination"], "deletionTimestamp": "2026-11-25T07:00:00Z",
                "ownerReferences": [{"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "name": "default", "uid": "p1"}],
                "managedFields": [{"manager": "karpenter"}]},
            "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                "requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}],
                "resources": {"requests": {"cpu": "250m"}}},
            "status": {"providerID": "aws:///us-west-2a/i-0abc", "nodeName": "ip-10-0-0-1", "imageID": "ami-1",
                "capacity": {"cpu": "2"}, "conditions": [{"type": "Ready", "status": "True"}]}}))
        .unwrap();
        let mut trimmed = whole.clone();
        trim_claim(&mut trimmed);
        assert_eq!(objects::claim_class(&trimmed), objects::claim_class(&whole));
        assert_eq!(objects::claim_provider_id(&trimmed), Some("aws:///us-west-2a/i-0abc"));
        assert_eq!(objects::claim_node_name(&trimmed), Some("ip-10-0-0-1"));
        assert_eq!(objects::claim_pool(&trimmed), Some("default"));
        assert!(is_deleting(&trimmed) && has_finalizer(&trimmed, karpenter::FINALIZER_TERMINATION));
        assert_eq!((trimmed.resource_version(), trimmed.uid()), (whole.resource_version(), whole.uid()));
        assert!(trimmed.metadata.managed_fields.is_none() && trimmed.data["status"]["conditions"].is_null());
        let mut fresh = whole.clone();
        fresh.data = json!({"spec": {"nodeClassRef": {"name": "default"}}});
        trim_claim(&mut fresh);
        assert_eq!(
            (objects::claim_provider_id(&fresh), objects::claim_node_name(&fresh)),
            (None, None),
            "not launched yet"
        );
    }

    /// The cache's trimmed Node answers what the simulation asks of a node as the whole one
    /// does: schedulable or not, its instance, its room for pods.
    #[test]
    fn a_trimmed_node_reads_as_the_whole_one() {
        let whole: Node = serde_json::from_value(json!({
            "metadata": {"name": "ip-10-0-0-1", "labels": {"karpenter.sh/nodepool": "default"},
                "finalizers": ["karpenter.sh/termination"], "managedFields": [{"manager": "kubelet"}]},
            "spec": {"providerID": "aws:///us-west-2a/i-0abc",
                "taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"pods": "29", "cpu": "1930m"}, "capacity": {"pods": "29"},
                "conditions": [{"type": "Ready", "status": "True"}], "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                "nodeInfo": {"kubeletVersion": "v1.34.0", "architecture": "amd64", "bootID": "", "containerRuntimeVersion": "",
                    "kernelVersion": "", "kubeProxyVersion": "", "machineID": "", "operatingSystem": "linux", "osImage": "",
                    "systemUUID": ""}}}))
        .unwrap();
        let mut trimmed = whole.clone();
        trim_node(&mut trimmed);
        assert_eq!(node_schedulable(&trimmed), node_schedulable(&whole));
        assert_eq!(node_provider_id(&trimmed), Some("aws:///us-west-2a/i-0abc"));
        let pods = |n: &Node| n.status.as_ref()?.allocatable.as_ref()?.get("pods").map(|q| q.0.clone());
        assert_eq!(pods(&trimmed).as_deref(), Some("29"));
        assert!(has_finalizer(&trimmed, karpenter::FINALIZER_TERMINATION) && trimmed.metadata.managed_fields.is_none());
        assert!(trimmed.status.as_ref().is_some_and(|s| s.conditions.is_none() && s.node_info.is_none()));
        let mut open = whole.clone();
        open.spec.as_mut().unwrap().taints = None;
        trim_node(&mut open);
        assert!(node_schedulable(&open), "untainted, in a pool: schedulable");
    }

    #[test]
    fn drain_leaves_daemonset_mirror_finished_and_tolerating_pods() {
        let plain = pod(json!({"metadata": {"name": "a"}, "spec": {"containers": []}}));
        assert!(is_drainable(&plain));
        let ds = pod(json!({"metadata": {"name": "b", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "x", "uid": "u"}]}, "spec": {"containers": []}}));
        assert!(!is_drainable(&ds));
        let mirror = pod(json!({"metadata": {"name": "c", "annotations": {"kubernetes.io/config.mirror": "x"}},
            "spec": {"containers": []}}));
        assert!(!is_drainable(&mirror));
        let done =
            pod(json!({"metadata": {"name": "d"}, "spec": {"containers": []}, "status": {"phase": "Succeeded"}}));
        assert!(!is_drainable(&done));
        let tol = pod(json!({"metadata": {"name": "e"}, "spec": {"containers": [],
            "tolerations": [{"operator": "Exists"}]}}));
        assert!(!is_drainable(&tol));
    }

    #[test]
    fn critical_pods_are_recognised() {
        let c = pod(
            json!({"metadata": {"name": "a"}, "spec": {"containers": [], "priorityClassName": "system-cluster-critical"}}),
        );
        assert!(c.critical);
        let n = pod(json!({"metadata": {"name": "b"}, "spec": {"containers": []}}));
        assert!(!n.critical);
    }

    #[test]
    fn pods_fit_pools_by_selector_and_taints() {
        let labels = BTreeMap::from([(naming::LABEL_CAPACITY_TYPE.to_string(), "on-demand".to_string())]);
        let p = pod(json!({"metadata": {"name": "a"}, "spec": {"containers": [],
            "nodeSelector": {naming::LABEL_CAPACITY_TYPE: "on-demand"}}}));
        assert!(pod_fits_labels(&p, &labels, &[]));
        let ng = pod(json!({"metadata": {"name": "b"}, "spec": {"containers": [],
            "nodeSelector": {naming::LABEL_NODEGROUP: "x"}}}));
        assert!(!pod_fits_labels(&ng, &labels, &[]));
        let taint = json!({"key": "gpu", "value": "true", "effect": "NoSchedule"});
        assert!(!pod_fits_labels(&p, &labels, std::slice::from_ref(&taint)));
        let tol = pod(json!({"metadata": {"name": "c"}, "spec": {"containers": [],
            "tolerations": [{"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]}}));
        assert!(pod_fits_labels(&tol, &labels, &[taint]));
    }

    #[test]
    fn settings_scale_intervals() {
        let mut s = SimSettings::new("c", "us-west-2");
        s.time_scale = 0.01;
        assert_eq!(s.scaled(Duration::from_secs(1)), Duration::from_millis(10));
        assert_eq!(s.zones[0], "us-west-2a");
    }
}
