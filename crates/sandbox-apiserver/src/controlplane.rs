//! A small simulated control plane running inside the sandbox server: scheduler, kubelet
//! (pods start and terminate), ReplicaSet, Deployment, StatefulSet and DaemonSet controllers,
//! the disruption controller (PDB status) and pod GC for deleted nodes.
//!
//! One task reacts to the store's change stream plus timers; it never polls in a loop.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::broadcast::error::TryRecvError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    DeleteOptions, EventType, GroupResource, LabelSelector, ListOptions, PatchType, Store, StoreEvent, Stored,
    WriteOptions, deletion_timeout, now_rfc3339, pdb_gr, pods_gr, refresh_pdb,
};

fn apps(r: &str) -> GroupResource {
    GroupResource::new("apps", r)
}

fn nodes_gr() -> GroupResource {
    GroupResource::new("", "nodes")
}

type NsName = (String, String);

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// The kubelet reports the pod running.
    Start(String, String, String),
    /// Recompute the status of the PDBs in the namespaces that changed.
    PdbRefresh,
    /// Run the scheduling pass that was held back by [`SCHEDULE_EVERY`].
    Schedule,
    /// Recompute a namespace's PDBs when an entry of their `disruptedPods` expires, like the
    /// disruption controller's `enqueuePdbForRecheck`.
    PdbRecheck(String),
}

#[derive(Default)]
struct Dirty {
    schedule: bool,
    all: bool,
    rs: BTreeSet<NsName>,
    deploy: BTreeSet<NsName>,
    sts: BTreeSet<NsName>,
    ds: BTreeSet<NsName>,
    ds_all: bool,
    /// Namespaces whose every PDB needs a refresh (a workload or budget spec changed).
    pdb_ns: BTreeSet<String>,
    /// Label sets of pods that changed, by namespace: only the budgets selecting them need a
    /// refresh.
    pdb_pods: PodLabels,
    gone_nodes: Vec<String>,
}

/// Distinct pod label sets by namespace, keyed by their JSON text, each kept as a minimal object
/// a [`LabelSelector`] can match.
type PodLabels = BTreeMap<String, HashMap<String, Value>>;

/// Pods of one namespace by the uid of their controller, listed once per reconcile pass: each
/// workload controller used to list (and copy) the whole namespace, which at 20,000 pods made a
/// pass over thousands of workloads quadratic.
#[derive(Default)]
struct OwnedPods(HashMap<String, HashMap<Arc<str>, Vec<Stored>>>);

impl OwnedPods {
    /// The pods of `ns` whose controller has `uid`, as stored.
    fn stored(&mut self, store: &Store, ns: &str, uid: &str) -> Vec<Stored> {
        let by_owner = self.0.entry(ns.to_string()).or_insert_with(|| {
            let mut m: HashMap<Arc<str>, Vec<Stored>> = HashMap::new();
            let items = store.list(&pods_gr(), Some(ns), &ListOptions::default()).map(|l| l.items).unwrap_or_default();
            for p in items {
                if let Some(owner) = p.summary().controller_uid.clone() {
                    m.entry(owner).or_default().push(p);
                }
            }
            m
        });
        by_owner.get(uid).cloned().unwrap_or_default()
    }
}

fn note_pod_labels(set: &mut PodLabels, ns: &str, labels: &Value) {
    set.entry(ns.to_string())
        .or_default()
        .entry(labels.to_string())
        .or_insert_with(|| json!({"metadata": {"labels": labels}}));
}

/// Whether a workload event can change a budget's status: the budget reads the workload's
/// existence, spec (replicas) and owner references, never its status (written on every pod start).
fn workload_shape_changed(ev: &StoreEvent, o: &Value, old: Option<&Value>) -> bool {
    ev.event_type != EventType::Modified
        || old.is_none_or(|old| {
            old["spec"] != o["spec"] || old["metadata"]["ownerReferences"] != o["metadata"]["ownerReferences"]
        })
}

/// Whether a workload event is only a status write (ours: these controllers are the only writers
/// of workload status). Reconciling the workload again for it would find nothing to do, and at
/// 10,000 workloads those second passes and their events were what overflowed the change stream.
fn status_write_only(ev: &StoreEvent, o: &Value, old: Option<&Value>) -> bool {
    let Some(old) = old.filter(|_| ev.event_type == EventType::Modified) else { return false };
    let meta = |v: &Value| {
        let mut m = v["metadata"].clone();
        if let Some(m) = m.as_object_mut() {
            m.remove("resourceVersion");
            m.remove("managedFields");
        }
        m
    };
    old["spec"] == o["spec"] && meta(old) == meta(o)
}

/// An object's labels alone, read from its JSON without building the rest.
fn labels_of(json: &[u8]) -> Value {
    #[derive(serde::Deserialize, Default)]
    struct Meta {
        #[serde(default)]
        labels: Value,
    }
    #[derive(serde::Deserialize)]
    struct Labelled {
        #[serde(default)]
        metadata: Meta,
    }
    serde_json::from_slice::<Labelled>(json).map(|l| l.metadata.labels).unwrap_or(Value::Null)
}

struct ControlPlane {
    store: Store,
    scale: f64,
    /// Pods to remove once their grace period is over, handed to [`kubelet`].
    kubelet: tokio::sync::mpsc::UnboundedSender<Removal>,
    timers: BTreeMap<(Instant, u64), Timer>,
    seq: u64,
    terminating: BTreeSet<String>,
    starting: BTreeSet<String>,
    /// Namespaces whose PDB statuses are all due for a refresh.
    pdb_pending: BTreeSet<String>,
    /// Pod label sets whose budgets are due for a refresh.
    pdb_pending_pods: PodLabels,
    /// Whether a [`Timer::PdbRefresh`] is queued.
    pdb_armed: bool,
    /// namespace → when its queued [`Timer::PdbRecheck`] fires.
    pdb_recheck: HashMap<String, Instant>,
    /// When the scheduler last ran, and whether a [`Timer::Schedule`] is queued.
    scheduled_at: Option<Instant>,
    schedule_armed: bool,
    stats: LoopStats,
}

/// How often the scheduler runs at most. A pass lists every pod; during a large drain every
/// eviction, deletion and replacement asks for one, and running them back to back kept a core
/// busy (at 1,000 nodes it was most of the sandbox's time) for passes that bind nothing, since
/// replacement pods have nowhere to go. The first request after a quiet spell runs at once.
const SCHEDULE_EVERY: Duration = Duration::from_millis(100);

/// How often PDB statuses are recomputed at most. Every pod event touches them, and each refresh
/// scans the namespace's pods per budget; coalescing keeps large worlds (thousands of pods and
/// budgets) from spending every pass there. Evictions decide on this stored status, as
/// kube-apiserver does (`eviction.rs`), so the delay stands for the disruption controller's own lag
/// behind pod changes.
const PDB_REFRESH: Duration = Duration::from_millis(500);

/// How often [`LoopStats`] are logged.
const STATS_EVERY: Duration = Duration::from_secs(10);

/// The parts of the controllers' loop whose time [`LoopStats`] keeps apart.
#[derive(Clone, Copy)]
enum Phase {
    /// Reading the change stream.
    Observe,
    /// The kubelet reporting pods started.
    PodStart,
    PdbRefresh,
    /// Listing everything after falling behind the change stream.
    Resync,
    PodGc,
    Deployments,
    ReplicaSets,
    StatefulSets,
    DaemonSets,
    Schedule,
}

impl Phase {
    const ALL: [Phase; 10] = [
        Phase::Observe,
        Phase::PodStart,
        Phase::PdbRefresh,
        Phase::Resync,
        Phase::PodGc,
        Phase::Deployments,
        Phase::ReplicaSets,
        Phase::StatefulSets,
        Phase::DaemonSets,
        Phase::Schedule,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Observe => "observe",
            Phase::PodStart => "pod_start",
            Phase::PdbRefresh => "pdb_refresh",
            Phase::Resync => "resync",
            Phase::PodGc => "pod_gc",
            Phase::Deployments => "deployments",
            Phase::ReplicaSets => "replicasets",
            Phase::StatefulSets => "statefulsets",
            Phase::DaemonSets => "daemonsets",
            Phase::Schedule => "schedule",
        }
    }
}

/// Where the controllers' loop spent its time, logged at debug level every [`STATS_EVERY`]. Every
/// reaction of the sandbox (a Deployment scaled to zero losing its pod, a replacement created)
/// waits for its turn in this one loop, so under a large drain its passes are the bed's latency,
/// and a benchmark needs to see which part of them bounds its figures.
struct LoopStats {
    since: Instant,
    passes: u64,
    events: u64,
    resyncs: u64,
    longest_pass: Duration,
    pending: usize,
    spent: [Duration; Phase::ALL.len()],
}

impl LoopStats {
    fn new() -> Self {
        LoopStats {
            since: Instant::now(),
            passes: 0,
            events: 0,
            resyncs: 0,
            longest_pass: Duration::ZERO,
            pending: 0,
            spent: [Duration::ZERO; Phase::ALL.len()],
        }
    }

    fn add(&mut self, phase: Phase, started: Instant) {
        self.spent[phase as usize] += started.elapsed();
    }

    fn pass_done(&mut self, started: Instant) {
        self.passes += 1;
        self.longest_pass = self.longest_pass.max(started.elapsed());
        if self.since.elapsed() < STATS_EVERY || !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let ms = |d: Duration| d.as_millis() as u64;
        let spent: Vec<String> = Phase::ALL
            .iter()
            .filter(|p| !self.spent[**p as usize].is_zero())
            .map(|p| format!("{}={}", p.name(), ms(self.spent[*p as usize])))
            .collect();
        tracing::debug!(
            window_ms = ms(self.since.elapsed()),
            passes = self.passes,
            events = self.events,
            resyncs = self.resyncs,
            longest_pass_ms = ms(self.longest_pass),
            unscheduled = self.pending,
            spent_ms = %spent.join(" "),
            "sandbox controllers' loop"
        );
        *self = LoopStats { pending: self.pending, ..LoopStats::new() };
    }
}

fn s(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn ns_name(o: &Value) -> NsName {
    (s(&o["metadata"]["namespace"]), s(&o["metadata"]["name"]))
}

fn stored_ns_name(o: &Stored) -> NsName {
    (o.summary().namespace.to_string(), o.summary().name.to_string())
}

fn controller_of(o: &Value) -> Option<(String, String)> {
    o["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|r| r["controller"] == true)
        .map(|r| (s(&r["kind"]), s(&r["name"])))
}

fn deleting(o: &Value) -> bool {
    !o["metadata"]["deletionTimestamp"].is_null()
}

fn node_ready(n: &Value) -> bool {
    n["status"]["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

fn tolerates(tolerations: &[Value], taint: &Value) -> bool {
    tolerations.iter().any(|t| {
        let key_ok = t["key"].is_null() && t["operator"] == "Exists" || t["key"] == taint["key"];
        let effect_ok = t["effect"].is_null() || t["effect"] == "" || t["effect"] == taint["effect"];
        let value_ok = t["operator"] == "Exists"
            || t["value"].as_str().unwrap_or_default() == taint["value"].as_str().unwrap_or_default();
        key_ok && effect_ok && value_ok
    })
}

/// Whether a pod spec may run on a node: nodeSelector, NoSchedule/NoExecute taints, and the
/// cordon. Like kube-scheduler's NodeUnschedulable plugin, a cordoned node takes a pod that
/// tolerates `node.kubernetes.io/unschedulable:NoSchedule` (a DaemonSet's pods, or anything with
/// `tolerations: [{operator: Exists}]`), and no other.
fn fits(spec: &Value, node: &Value) -> bool {
    let tolerations = spec["tolerations"].as_array().cloned().unwrap_or_default();
    if node["spec"]["unschedulable"] == true
        && !tolerates(&tolerations, &json!({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}))
    {
        return false;
    }
    let taints_ok = node["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|t| !(t["effect"] == "NoSchedule" || t["effect"] == "NoExecute") || tolerates(&tolerations, t));
    let labels = &node["metadata"]["labels"];
    let selector_ok = spec["nodeSelector"].as_object().is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    taints_ok && selector_ok
}

/// Whether a DaemonSet's pod already on a node keeps running there: like `NodeShouldRunDaemonPod`'s
/// `shouldContinueRunning` (kubernetes `pkg/controller/daemon/daemon_controller.go`), a taint stops
/// it only with effect NoExecute; a NoSchedule taint or a cordon keeps new pods off and leaves it.
fn keeps_running(spec: &Value, node: &Value) -> bool {
    let tolerations = spec["tolerations"].as_array().cloned().unwrap_or_default();
    let taints_ok = node["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|t| t["effect"] != "NoExecute" || tolerates(&tolerations, t));
    let labels = &node["metadata"]["labels"];
    let selector_ok = spec["nodeSelector"].as_object().is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    taints_ok && selector_ok
}

fn capacity(node: &Value) -> usize {
    let v = &node["status"]["allocatable"]["pods"];
    v.as_u64().map(|n| n as usize).or_else(|| v.as_str().and_then(|s| s.parse().ok())).unwrap_or(110)
}

fn short_hash(v: &Value) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.to_string().hash(&mut h);
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut x = h.finish();
    (0..10)
        .map(|_| {
            let c = ALPHABET[(x % ALPHABET.len() as u64) as usize] as char;
            x /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

fn owner_ref(kind: &str, o: &Value) -> Value {
    json!({"apiVersion": "apps/v1", "kind": kind, "name": o["metadata"]["name"], "uid": o["metadata"]["uid"],
        "controller": true, "blockOwnerDeletion": true})
}

const DS_TOLERATIONS: [(&str, &str); 6] = [
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
];

/// Runs the control plane until `cancel` fires.
pub async fn run(store: Store, time_scale: f64, cancel: CancellationToken) {
    let (removals, removals_rx) = tokio::sync::mpsc::unbounded_channel();
    // A task of its own, so that it runs while the controllers' loop is busy. It ends with that
    // loop (its sender dropped) or on `cancel`, and the set aborts it should this future be
    // dropped first.
    let mut kubelet_task = tokio::task::JoinSet::new();
    kubelet_task.spawn(tracing::Instrument::instrument(
        kubelet(store.clone(), removals_rx, cancel.clone()),
        tracing::debug_span!("sandbox kubelet"),
    ));
    controllers(store, time_scale, removals, cancel).await;
    let _ = kubelet_task.join_next().await;
}

/// A pod whose grace period ends at `due`.
struct Removal {
    due: Instant,
    ns: String,
    name: String,
    uid: String,
}

/// Removes terminating pods when their grace period is over. A loop of its own, like a kubelet
/// beside the controllers: the controllers' loop can be busy for seconds with a scheduling pass
/// over thousands of pending replacements, and pods whose time came meanwhile were removed late,
/// together, after it.
async fn kubelet(store: Store, mut removals: tokio::sync::mpsc::UnboundedReceiver<Removal>, cancel: CancellationToken) {
    let mut due: BTreeMap<(Instant, u64), Removal> = BTreeMap::new();
    let mut seq = 0u64;
    loop {
        let next = due.keys().next().map(|(t, _)| *t);
        let sleep = tokio::time::sleep_until(next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600)));
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = removals.recv() => match r {
                Some(r) => {
                    seq += 1;
                    due.insert((r.due, seq), r);
                }
                // the controllers' loop ended
                None => return,
            },
            _ = sleep, if next.is_some() => {
                let now = Instant::now();
                let keys: Vec<(Instant, u64)> = due.range(..=(now, u64::MAX)).map(|(k, _)| *k).collect();
                for k in keys {
                    let Some(r) = due.remove(&k) else { continue };
                    let still =
                        store.get(&pods_gr(), &r.ns, &r.name).is_ok_and(|p| p["metadata"]["uid"] == r.uid.as_str());
                    if still {
                        let opts = DeleteOptions { grace_period_seconds: Some(0), ..Default::default() };
                        // Already gone or changed underneath: nothing left to terminate.
                        let _ = store.delete(&pods_gr(), &r.ns, &r.name, &opts);
                    }
                }
            }
        }
    }
}

async fn controllers(
    store: Store,
    time_scale: f64,
    kubelet: tokio::sync::mpsc::UnboundedSender<Removal>,
    cancel: CancellationToken,
) {
    let mut cp = ControlPlane {
        store: store.clone(),
        scale: time_scale,
        kubelet,
        timers: BTreeMap::new(),
        seq: 0,
        terminating: BTreeSet::new(),
        starting: BTreeSet::new(),
        pdb_pending: BTreeSet::new(),
        pdb_pending_pods: BTreeMap::new(),
        pdb_armed: false,
        pdb_recheck: HashMap::new(),
        scheduled_at: None,
        schedule_armed: false,
        stats: LoopStats::new(),
    };
    let mut rx = store.subscribe();
    let mut dirty = Dirty { all: true, schedule: true, ds_all: true, ..Default::default() };
    loop {
        let pass = Instant::now();
        off_the_workers(|| cp.reconcile(&mut dirty));
        cp.stats.pass_done(pass);
        let next = cp.timers.keys().next().map(|(t, _)| *t);
        let sleep = tokio::time::sleep_until(next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600)));
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = sleep, if next.is_some() => off_the_workers(|| cp.fire_timers(&mut dirty)),
            r = rx.recv() => off_the_workers(|| {
                let started = Instant::now();
                match r {
                    Ok(ev) => cp.observe(&ev, &mut dirty),
                    Err(_) => {
                        // Fell behind the change stream: resynchronise everything.
                        rx = store.subscribe();
                        cp.stats.resyncs += 1;
                        dirty.all = true;
                    }
                }
                // Batch whatever else is already queued before reconciling.
                for _ in 0..10_000 {
                    match rx.try_recv() {
                        Ok(ev) => cp.observe(&ev, &mut dirty),
                        Err(TryRecvError::Empty) => break,
                        Err(_) => {
                            rx = store.subscribe();
                            cp.stats.resyncs += 1;
                            dirty.all = true;
                            break;
                        }
                    }
                }
                cp.stats.add(Phase::Observe, started);
            }),
        }
        // Under load the change stream is never empty, so nothing above waits: give the API
        // server's tasks this loop woke their turn before the next pass.
        tokio::task::yield_now().await;
    }
}

/// Runs one synchronous pass of the controllers. At a thousand nodes a pass takes seconds, and a
/// task that computes that long without returning to the runtime starves every task queued on
/// its worker thread: the other worker steals only once its own queue is empty, which under load
/// it never is, so requests and watch streams of the API server waited up to 28 s for one busy
/// pass after another. On a multi-threaded runtime the worker's queue goes to another thread for
/// the pass (`block_in_place`); a single-threaded runtime has no other thread to give it to.
fn off_the_workers<T>(pass: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi { tokio::task::block_in_place(pass) } else { pass() }
}

impl ControlPlane {
    fn after(&mut self, secs: f64, t: Timer) {
        let d = Duration::from_secs_f64((secs * self.scale).max(0.0));
        self.seq += 1;
        self.timers.insert((Instant::now() + d, self.seq), t);
    }

    fn remove_after(&self, d: Duration, ns: String, name: String, uid: String) {
        // the receiver lives as long as this loop (see `run`)
        let _ = self.kubelet.send(Removal { due: Instant::now() + d, ns, name, uid });
    }

    fn observe(&mut self, ev: &StoreEvent, d: &mut Dirty) {
        self.stats.events += 1;
        // Changes arrive as JSON; an object is parsed only by the arms that read it.
        let object = std::cell::LazyCell::new(|| ev.object());
        let (ns, name) = (ev.key.namespace.to_string(), ev.key.name.to_string());
        match (ev.key.gr.group.as_str(), ev.key.gr.resource.as_str()) {
            ("", "pods") => {
                let o = &*object;
                self.observe_pod(ev, o, d);
                note_pod_labels(&mut d.pdb_pods, &ns, &o["metadata"]["labels"]);
                if let Some(old_labels) = ev.old_json.as_ref().map(|j| labels_of(&j.to_vec()))
                    && old_labels != o["metadata"]["labels"]
                {
                    note_pod_labels(&mut d.pdb_pods, &ns, &old_labels);
                }
                if let Some((kind, owner)) = controller_of(o) {
                    match kind.as_str() {
                        "ReplicaSet" => d.rs.insert((ns, owner)),
                        "StatefulSet" => d.sts.insert((ns, owner)),
                        "DaemonSet" => d.ds.insert((ns, owner)),
                        _ => false,
                    };
                }
            }
            ("", "nodes") => {
                let o = &*object;
                d.schedule = true;
                d.ds_all = true;
                if ev.event_type == EventType::Deleted {
                    d.gone_nodes.push(name);
                } else if node_ready(o) && ev.old().is_some_and(|old| !node_ready(&old)) {
                    d.all = true;
                }
            }
            ("apps", "replicasets") => {
                let (o, old) = (&*object, ev.old());
                if !status_write_only(ev, o, old.as_ref()) {
                    d.rs.insert((ns.clone(), name));
                }
                // the Deployment's status adds up its ReplicaSets' statuses
                if let Some((kind, owner)) = controller_of(o)
                    && kind == "Deployment"
                {
                    d.deploy.insert((ns.clone(), owner));
                }
                if workload_shape_changed(ev, o, old.as_ref()) {
                    d.pdb_ns.insert(ns);
                }
            }
            ("apps", "deployments") => {
                let (o, old) = (&*object, ev.old());
                if !status_write_only(ev, o, old.as_ref()) {
                    d.deploy.insert((ns.clone(), name));
                }
                if workload_shape_changed(ev, o, old.as_ref()) {
                    d.pdb_ns.insert(ns);
                }
            }
            ("apps", "statefulsets") => {
                let (o, old) = (&*object, ev.old());
                if !status_write_only(ev, o, old.as_ref()) {
                    d.sts.insert((ns.clone(), name));
                }
                if workload_shape_changed(ev, o, old.as_ref()) {
                    d.pdb_ns.insert(ns);
                }
            }
            ("apps", "daemonsets") if !status_write_only(ev, &object, ev.old().as_ref()) => {
                d.ds.insert((ns, name));
            }
            ("policy", "poddisruptionbudgets") if ev.event_type != EventType::Deleted => {
                // Only spec changes need a recompute; our own status writes do not.
                let spec_changed = ev.old().is_none_or(|old| old["spec"] != object["spec"]);
                if spec_changed {
                    d.pdb_ns.insert(ns);
                }
            }
            _ => {}
        }
    }

    fn observe_pod(&mut self, ev: &StoreEvent, o: &Value, d: &mut Dirty) {
        let uid = s(&o["metadata"]["uid"]);
        let (ns, name) = ns_name(o);
        if ev.event_type == EventType::Deleted {
            self.terminating.remove(&uid);
            self.starting.remove(&uid);
            d.schedule = true;
            return;
        }
        if deleting(o) {
            if self.terminating.insert(uid.clone()) {
                let grace = o["metadata"]["deletionGracePeriodSeconds"].as_i64().unwrap_or(0);
                if grace > 0 {
                    // a backlog of changes can bring the deletion late
                    let left = removal_left(o, self.scale, std::time::SystemTime::now());
                    self.remove_after(left, ns, name, uid);
                }
            }
            return;
        }
        let node = s(&o["spec"]["nodeName"]);
        if node.is_empty() {
            d.schedule = true;
        } else if o["status"]["phase"] == "Pending" && self.starting.insert(uid.clone()) {
            self.after(0.5, Timer::Start(ns, name, uid));
        }
    }

    fn fire_timers(&mut self, d: &mut Dirty) {
        let now = Instant::now();
        let due: Vec<(Instant, u64)> = self.timers.range(..=(now, u64::MAX)).map(|(k, _)| *k).collect();
        for k in due {
            let Some(t) = self.timers.remove(&k) else { continue };
            match t {
                Timer::Start(ns, name, uid) => {
                    let started = Instant::now();
                    self.starting.remove(&uid);
                    self.start_pod(&ns, &name, &uid, d);
                    self.stats.add(Phase::PodStart, started);
                }
                Timer::PdbRefresh => self.refresh_pdbs(),
                Timer::PdbRecheck(ns) => {
                    self.pdb_recheck.remove(&ns);
                    self.pdb_pending.insert(ns);
                    self.refresh_pdbs();
                }
                Timer::Schedule => {
                    self.schedule_armed = false;
                    d.schedule = true;
                }
            }
        }
    }

    fn start_pod(&mut self, ns: &str, name: &str, uid: &str, d: &mut Dirty) {
        let Ok(p) = self.store.get(&pods_gr(), ns, name) else { return };
        if p["metadata"]["uid"] != uid || deleting(&p) || p["status"]["phase"] != "Pending" {
            return;
        }
        let node_name = s(&p["spec"]["nodeName"]);
        let Ok(node) = self.store.get(&nodes_gr(), "", &node_name) else { return };
        if !node_ready(&node) {
            // Retried when the node turns Ready (the node event marks everything dirty).
            return;
        }
        let now = now_rfc3339();
        let host_ip = node["status"]["addresses"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["type"] == "InternalIP"))
            .map(|x| s(&x["address"]))
            .unwrap_or_else(|| "10.0.0.1".into());
        let octet = |i: u64| (crate::controlplane::hash_str(uid) >> i) % 250 + 2;
        let pod_ip = format!("10.{}.{}.{}", octet(0) % 200, octet(8), octet(16));
        let containers: Vec<Value> = p["spec"]["containers"].as_array().into_iter().flatten().map(|c| json!({
            "name": c["name"], "image": c["image"], "ready": true, "started": true, "restartCount": 0,
            "state": {"running": {"startedAt": now}}, "imageID": "", "containerID": format!("containerd://{uid}"),
        })).collect();
        let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
        let status = json!({"status": {
            "phase": "Running", "hostIP": host_ip, "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "startTime": now,
            "qosClass": p["status"]["qosClass"].as_str().unwrap_or("BestEffort"),
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"), cond("ContainersReady"), cond("PodScheduled")],
            "containerStatuses": containers,
        }});
        let _ = self.store.patch(
            &pods_gr(),
            ns,
            name,
            PatchType::Merge,
            &status,
            "status",
            &WriteOptions::manager("kubelet"),
        );
        note_pod_labels(&mut d.pdb_pods, ns, &p["metadata"]["labels"]);
    }

    fn reconcile(&mut self, d: &mut Dirty) {
        let started = Instant::now();
        if d.all {
            d.all = false;
            d.schedule = true;
            d.ds_all = true;
            let lo = ListOptions::default();
            for (gr, set) in [
                ("replicasets", &mut d.rs),
                ("deployments", &mut d.deploy),
                ("statefulsets", &mut d.sts),
                ("daemonsets", &mut d.ds),
            ] {
                if let Ok(l) = self.store.list(&apps(gr), None, &lo) {
                    set.extend(l.items.iter().map(stored_ns_name));
                }
            }
            if let Ok(l) = self.store.list(&pods_gr(), None, &lo) {
                // the listed objects are the store's own, shared: a copy of every pod was the
                // largest allocation of a 20,000-pod rehearsal
                for p in &l.items {
                    let sum = p.summary();
                    d.pdb_ns.insert(sum.namespace.to_string());
                    let uid = sum.uid.to_string();
                    let (ns, name) = stored_ns_name(p);
                    if sum.deleting {
                        if self.terminating.insert(uid.clone()) {
                            let pod = p.value();
                            let grace = pod["metadata"]["deletionGracePeriodSeconds"].as_i64().unwrap_or(0);
                            if grace > 0 {
                                let left = removal_left(&pod, self.scale, std::time::SystemTime::now());
                                self.remove_after(left, ns, name, uid);
                            }
                        }
                    } else if !sum.node_name.is_empty() && &*sum.phase == "Pending" && self.starting.insert(uid.clone())
                    {
                        self.after(0.0, Timer::Start(ns, name, uid));
                    }
                }
            }
            self.stats.add(Phase::Resync, started);
        }
        let started = Instant::now();
        let gone = std::mem::take(&mut d.gone_nodes);
        if !gone.is_empty() {
            self.pod_gc(&gone.into_iter().collect());
            self.stats.add(Phase::PodGc, started);
        }
        let started = Instant::now();
        for k in std::mem::take(&mut d.deploy) {
            self.deployment(&k);
        }
        self.stats.add(Phase::Deployments, started);
        // Each controller below writes only the pods it owns, so one listing per namespace
        // serves the whole pass; what changes meanwhile arrives as events for the next pass.
        let mut owned = OwnedPods::default();
        let started = Instant::now();
        for k in std::mem::take(&mut d.rs) {
            self.replicaset(&k, &mut owned);
        }
        self.stats.add(Phase::ReplicaSets, started);
        let started = Instant::now();
        for k in std::mem::take(&mut d.sts) {
            self.statefulset(&k, &mut owned);
        }
        self.stats.add(Phase::StatefulSets, started);
        let started = Instant::now();
        if std::mem::take(&mut d.ds_all)
            && let Ok(l) = self.store.list(&apps("daemonsets"), None, &ListOptions::default())
        {
            d.ds.extend(l.items.iter().map(stored_ns_name));
        }
        for k in std::mem::take(&mut d.ds) {
            self.daemonset(&k, &mut owned);
        }
        self.stats.add(Phase::DaemonSets, started);
        if std::mem::take(&mut d.schedule) && !self.schedule_armed {
            match self.scheduled_at.map(|t| t + SCHEDULE_EVERY).filter(|next| *next > Instant::now()) {
                Some(next) => {
                    self.schedule_armed = true;
                    self.seq += 1;
                    self.timers.insert((next, self.seq), Timer::Schedule);
                }
                None => {
                    let started = Instant::now();
                    self.scheduled_at = Some(started);
                    self.stats.pending = self.schedule();
                    self.stats.add(Phase::Schedule, started);
                }
            }
        }
        self.pdb_pending.extend(std::mem::take(&mut d.pdb_ns));
        for (ns, sets) in std::mem::take(&mut d.pdb_pods) {
            self.pdb_pending_pods.entry(ns).or_default().extend(sets);
        }
        if (!self.pdb_pending.is_empty() || !self.pdb_pending_pods.is_empty()) && !self.pdb_armed {
            self.pdb_armed = true;
            self.seq += 1;
            self.timers.insert((Instant::now() + PDB_REFRESH, self.seq), Timer::PdbRefresh);
        }
    }

    /// The nodes not being deleted that `keep` accepts, each reduced to what placing a pod reads
    /// (name, labels, taints, the cordon, allocatable pods). They are parsed one at a time: a
    /// pass that held 1,000 whole nodes parsed held 12 MB, at the moment of a rehearsal's peak.
    fn placement_nodes(&self, keep: impl Fn(&Value) -> bool) -> Vec<Value> {
        let items = self.store.list(&nodes_gr(), None, &ListOptions::default()).map(|l| l.items).unwrap_or_default();
        items
            .iter()
            .filter(|n| !n.summary().deleting)
            .filter_map(|n| {
                let v = n.value();
                keep(&v).then(|| {
                    json!({
                        "metadata": {"name": v["metadata"]["name"], "labels": v["metadata"]["labels"]},
                        "spec": {"taints": v["spec"]["taints"], "unschedulable": v["spec"]["unschedulable"]},
                        "status": {"allocatable": {"pods": v["status"]["allocatable"]["pods"]}},
                    })
                })
            })
            .collect()
    }

    /// The objects of a resource, parsed: for the kinds a pass reads whole (budgets).
    fn values(&self, gr: &GroupResource, ns: Option<&str>) -> Vec<Arc<Value>> {
        self.store
            .list(gr, ns, &ListOptions::default())
            .map(|l| l.items.iter().map(Stored::value).collect())
            .unwrap_or_default()
    }

    fn refresh_pdbs(&mut self) {
        let started = Instant::now();
        self.refresh_pdbs_now();
        self.stats.add(Phase::PdbRefresh, started);
    }

    fn refresh_pdbs_now(&mut self) {
        self.pdb_armed = false;
        let whole = std::mem::take(&mut self.pdb_pending);
        let mut by_pods = std::mem::take(&mut self.pdb_pending_pods);
        let namespaces: BTreeSet<String> = whole.iter().cloned().chain(by_pods.keys().cloned()).collect();
        for ns in namespaces {
            let pdbs = self.values(&pdb_gr(), Some(&ns));
            let names: Vec<String> = if whole.contains(&ns) {
                pdbs.iter().map(|p| s(&p["metadata"]["name"])).collect()
            } else {
                let changed = by_pods.remove(&ns).unwrap_or_default();
                budgets_selecting(&pdbs, changed.values())
            };
            // Each refresh scans the namespace's pods, so only the budgets whose pods changed
            // are recomputed; the status they get is the same as from a full refresh.
            let timeout = deletion_timeout(self.scale);
            for n in names {
                // a pod evicted and re-created under the same name (a StatefulSet's) counts as
                // disrupted until its entry expires; the real controller re-queues the budget for
                // that moment, or its status would stay at zero allowed until something else changes
                let Some(after) = self.store.with(|inner| refresh_pdb(inner, &ns, &n, timeout)) else { continue };
                let at = Instant::now() + after;
                if self.pdb_recheck.get(&ns).is_none_or(|queued| at < *queued) {
                    self.pdb_recheck.insert(ns.clone(), at);
                    self.seq += 1;
                    self.timers.insert((at, self.seq), Timer::PdbRecheck(ns.clone()));
                }
            }
        }
    }

    /// Deletes the pods bound to nodes that are gone, like the pod garbage collector. One listing
    /// for all of them: a teardown deletes nodes by the thousand, and a listing per node made
    /// that quadratic.
    fn pod_gc(&self, gone: &BTreeSet<String>) {
        let pods = self.store.list(&pods_gr(), None, &ListOptions::default()).map(|l| l.items).unwrap_or_default();
        let opts = DeleteOptions { grace_period_seconds: Some(0), ..Default::default() };
        for p in pods.iter().filter(|p| gone.contains(&*p.summary().node_name)) {
            let (ns, name) = stored_ns_name(p);
            let _ = self.store.delete(&pods_gr(), &ns, &name, &opts);
        }
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "a pod's template, name, owner, labels, node and tolerations are each what a controller decides"
    )]
    fn create_pod(
        &self,
        ns: &str,
        template: &Value,
        name: Option<String>,
        generate: &str,
        owner: Value,
        extra_labels: &[(&str, String)],
        node: Option<&str>,
        tolerations: &[Value],
    ) {
        let mut meta = template["metadata"].clone();
        if !meta.is_object() {
            meta = json!({});
        }
        for (k, v) in extra_labels {
            meta["labels"][*k] = json!(v);
        }
        match name {
            Some(n) => meta["name"] = json!(n),
            None => meta["generateName"] = json!(generate),
        }
        meta["namespace"] = json!(ns);
        meta["ownerReferences"] = json!([owner]);
        let mut spec = template["spec"].clone();
        if let Some(n) = node {
            spec["nodeName"] = json!(n);
        }
        if !tolerations.is_empty() {
            let mut t = spec["tolerations"].as_array().cloned().unwrap_or_default();
            t.extend(tolerations.iter().cloned());
            spec["tolerations"] = json!(t);
        }
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec});
        if let Err(e) = self.store.create(&pods_gr(), ns, pod, &WriteOptions::manager("kube-controller-manager")) {
            tracing::debug!(error = %e, "control plane could not create a pod");
        }
    }

    fn delete_stored_pod(&self, p: &Stored) {
        let (ns, name) = stored_ns_name(p);
        let _ = self.store.delete(&pods_gr(), &ns, &name, &DeleteOptions::default());
    }

    fn write_status(&self, gr: &GroupResource, obj: &Value, status: Value) {
        let mut merged = obj["status"].clone();
        if !merged.is_object() {
            merged = json!({});
        }
        let mut changed = false;
        for (k, v) in status.as_object().into_iter().flatten() {
            if merged[k] != *v {
                merged[k] = v.clone();
                changed = true;
            }
        }
        if changed {
            let (ns, name) = ns_name(obj);
            let _ = self.store.patch(
                gr,
                &ns,
                &name,
                PatchType::Merge,
                &json!({"status": status}),
                "status",
                &WriteOptions::manager("kube-controller-manager"),
            );
        }
    }

    fn replicaset(&self, (ns, name): &NsName, owned: &mut OwnedPods) {
        let Ok(rs) = self.store.get(&apps("replicasets"), ns, name) else { return };
        if deleting(&rs) {
            return;
        }
        let uid = s(&rs["metadata"]["uid"]);
        let want = rs["spec"]["replicas"].as_i64().unwrap_or(1).max(0) as usize;
        // Read from the summaries: a resync reconciles every ReplicaSet, and parsing each one's
        // pods made that pass a minute long at 100,000 pods, while the change stream overflowed.
        let mut active: Vec<Stored> =
            owned.stored(&self.store, ns, &uid).into_iter().filter(|p| !p.summary().deleting).collect();
        if active.len() < want {
            for _ in active.len()..want {
                self.create_pod(
                    ns,
                    &rs["spec"]["template"],
                    None,
                    &format!("{name}-"),
                    owner_ref("ReplicaSet", &rs),
                    &[],
                    None,
                    &[],
                );
            }
        } else if active.len() > want {
            // Unscheduled, then not ready, then newest go first.
            active.sort_by_cached_key(|p| {
                let sum = p.summary();
                let created = s(&p.value()["metadata"]["creationTimestamp"]);
                (!sum.node_name.is_empty(), sum.pod_healthy(), std::cmp::Reverse(created))
            });
            for p in active.drain(..active.len() - want).collect::<Vec<_>>() {
                self.delete_stored_pod(&p);
            }
        }
        let ready = active.iter().filter(|p| p.summary().pod_healthy()).count();
        self.write_status(
            &apps("replicasets"),
            &rs,
            json!({
                "replicas": active.len().min(want.max(active.len())), "fullyLabeledReplicas": active.len(),
                "readyReplicas": ready, "availableReplicas": ready, "observedGeneration": rs["metadata"]["generation"],
            }),
        );
    }

    fn deployment(&self, (ns, name): &NsName) {
        let Ok(dep) = self.store.get(&apps("deployments"), ns, name) else { return };
        if deleting(&dep) {
            return;
        }
        let uid = s(&dep["metadata"]["uid"]);
        let replicas = dep["spec"]["replicas"].as_i64().unwrap_or(1);
        let all_rs: Vec<Value> = self
            .store
            .list(&apps("replicasets"), Some(ns), &ListOptions::default())
            .map(|l| {
                l.items
                    .iter()
                    .filter(|r| r.summary().controller_uid.as_deref() == Some(uid.as_str()))
                    .map(|r| Arc::unwrap_or_clone(r.value()))
                    .collect()
            })
            .unwrap_or_default();
        let wm = WriteOptions::manager("kube-controller-manager");
        let current = current_replicaset(&dep, &all_rs);
        match current {
            None => {
                let hash = short_hash(&dep["spec"]["template"]);
                let rs_name = format!("{name}-{hash}");
                let mut template = dep["spec"]["template"].clone();
                template["metadata"]["labels"][POD_TEMPLATE_HASH] = json!(hash);
                let mut selector = dep["spec"]["selector"].clone();
                selector["matchLabels"][POD_TEMPLATE_HASH] = json!(hash);
                let mut labels = dep["spec"]["template"]["metadata"]["labels"].clone();
                labels[POD_TEMPLATE_HASH] = json!(hash);
                let rs = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "metadata": {"name": rs_name, "namespace": ns, "labels": labels, "ownerReferences": [owner_ref("Deployment", &dep)]},
                    "spec": {"replicas": replicas, "selector": selector, "template": template}});
                let _ = self.store.create(&apps("replicasets"), ns, rs, &wm);
            }
            Some(rs) if rs["spec"]["replicas"].as_i64() != Some(replicas) => {
                let _ = self.store.patch(
                    &apps("replicasets"),
                    ns,
                    &s(&rs["metadata"]["name"]),
                    PatchType::Merge,
                    &json!({"spec": {"replicas": replicas}}),
                    "",
                    &wm,
                );
            }
            Some(_) => {}
        }
        let current_uid = current.map(|r| r["metadata"]["uid"].clone());
        let is_current = |r: &Value| current_uid.as_ref() == Some(&r["metadata"]["uid"]);
        // Old ReplicaSets (an earlier template) scale to zero: a Recreate-style rollout.
        for old in all_rs.iter().filter(|r| !is_current(r) && r["spec"]["replicas"] != 0) {
            let _ = self.store.patch(
                &apps("replicasets"),
                ns,
                &s(&old["metadata"]["name"]),
                PatchType::Merge,
                &json!({"spec": {"replicas": 0}}),
                "",
                &wm,
            );
        }
        let sum = |k: &str| all_rs.iter().map(|r| r["status"][k].as_i64().unwrap_or(0)).sum::<i64>();
        let updated = current.map(|r| r["status"]["replicas"].as_i64().unwrap_or(0)).unwrap_or(0);
        let available = sum("availableReplicas");
        let avail_cond = if available >= replicas { "True" } else { "False" };
        let prev =
            dep["status"]["conditions"].as_array().and_then(|c| c.iter().find(|c| c["type"] == "Available").cloned());
        let conds = if prev.as_ref().is_some_and(|c| c["status"] == avail_cond) {
            dep["status"]["conditions"].clone()
        } else {
            let now = now_rfc3339();
            json!([{"type": "Available", "status": avail_cond, "reason": if avail_cond == "True" { "MinimumReplicasAvailable" } else { "MinimumReplicasUnavailable" },
                "message": "", "lastUpdateTime": now, "lastTransitionTime": now}])
        };
        self.write_status(
            &apps("deployments"),
            &dep,
            json!({
                "replicas": sum("replicas"), "updatedReplicas": updated, "readyReplicas": sum("readyReplicas"),
                "availableReplicas": available, "unavailableReplicas": (replicas - available).max(0),
                "observedGeneration": dep["metadata"]["generation"], "conditions": conds,
            }),
        );
    }

    fn statefulset(&self, (ns, name): &NsName, owned: &mut OwnedPods) {
        let Ok(sts) = self.store.get(&apps("statefulsets"), ns, name) else { return };
        if deleting(&sts) {
            return;
        }
        let uid = s(&sts["metadata"]["uid"]);
        let want = sts["spec"]["replicas"].as_i64().unwrap_or(1).max(0) as usize;
        // from the summaries, like the ReplicaSet's
        let pods: Vec<Stored> = owned.stored(&self.store, ns, &uid);
        let names: HashSet<&str> = pods.iter().map(|p| &*p.summary().name).collect();
        for i in 0..want {
            let pn = format!("{name}-{i}");
            if !names.contains(pn.as_str()) {
                self.create_pod(
                    ns,
                    &sts["spec"]["template"],
                    Some(pn.clone()),
                    "",
                    owner_ref("StatefulSet", &sts),
                    &[
                        ("statefulset.kubernetes.io/pod-name", pn.clone()),
                        ("apps.kubernetes.io/pod-index", i.to_string()),
                    ],
                    None,
                    &[],
                );
            }
        }
        for p in &pods {
            let ord = p.summary().name.rsplit('-').next().and_then(|o| o.parse::<usize>().ok());
            if ord.is_none_or(|o| o >= want) && !p.summary().deleting {
                self.delete_stored_pod(p);
            }
        }
        let live = pods.iter().filter(|p| !p.summary().deleting).count();
        let ready = pods.iter().filter(|p| p.summary().pod_healthy()).count();
        self.write_status(
            &apps("statefulsets"),
            &sts,
            json!({
                "replicas": live, "readyReplicas": ready, "availableReplicas": ready,
                "currentReplicas": live, "updatedReplicas": live, "observedGeneration": sts["metadata"]["generation"],
            }),
        );
    }

    fn daemonset(&self, (ns, name): &NsName, owned: &mut OwnedPods) {
        let Ok(ds) = self.store.get(&apps("daemonsets"), ns, name) else { return };
        if deleting(&ds) {
            return;
        }
        let uid = s(&ds["metadata"]["uid"]);
        let tolerations: Vec<Value> =
            DS_TOLERATIONS.iter().map(|(k, e)| json!({"key": k, "operator": "Exists", "effect": e})).collect();
        let mut spec = ds["spec"]["template"]["spec"].clone();
        let mut t = spec["tolerations"].as_array().cloned().unwrap_or_default();
        t.extend(tolerations.iter().cloned());
        spec["tolerations"] = json!(t);
        let nodes = self.placement_nodes(|_| true);
        let eligible: BTreeSet<String> =
            nodes.iter().filter(|n| fits(&spec, n)).map(|n| s(&n["metadata"]["name"])).collect();
        let keep: BTreeSet<String> =
            nodes.iter().filter(|n| keeps_running(&spec, n)).map(|n| s(&n["metadata"]["name"])).collect();
        // a DaemonSet has a pod on every node: read from the summaries, parsed one at a time
        let pods: Vec<Stored> =
            owned.stored(&self.store, ns, &uid).into_iter().filter(|p| !p.summary().deleting).collect();
        let mut covered = BTreeSet::new();
        for p in &pods {
            let node = &*p.summary().node_name;
            if keep.contains(node) && covered.insert(node.to_string()) {
                continue;
            }
            self.delete_stored_pod(p);
        }
        for n in eligible.difference(&covered) {
            self.create_pod(
                ns,
                &ds["spec"]["template"],
                None,
                &format!("{name}-"),
                owner_ref("DaemonSet", &ds),
                &[],
                Some(n),
                &tolerations,
            );
        }
        let ready =
            pods.iter().filter(|p| eligible.contains(&*p.summary().node_name) && p.summary().pod_healthy()).count();
        self.write_status(
            &apps("daemonsets"),
            &ds,
            json!({
                "desiredNumberScheduled": eligible.len(), "currentNumberScheduled": covered.len(), "numberReady": ready,
                "numberAvailable": ready, "updatedNumberScheduled": covered.len(), "numberMisscheduled": 0,
                "observedGeneration": ds["metadata"]["generation"],
            }),
        );
    }

    /// Binds what it can of the unscheduled pods; returns how many were unscheduled.
    fn schedule(&self) -> usize {
        let all = self.store.list(&pods_gr(), None, &ListOptions::default()).map(|l| l.items).unwrap_or_default();
        let mut load: HashMap<String, usize> = HashMap::new();
        let mut pending = Vec::new();
        for p in &all {
            let sum = p.summary();
            if !sum.node_name.is_empty() {
                if !sum.terminal() {
                    *load.entry(sum.node_name.to_string()).or_default() += 1;
                }
            } else if !sum.deleting && !sum.terminal() {
                let sched = sum.scheduler_name.as_deref().unwrap_or("default-scheduler");
                if sched == "default-scheduler" {
                    pending.push(p);
                }
            }
        }
        let unscheduled = pending.len();
        if pending.is_empty() {
            return 0;
        }
        let usable = self.placement_nodes(node_ready);
        // Pods of one workload share nodeSelector and tolerations (their summary's `placement`):
        // work out their eligible nodes once per placement, and keep them ordered by load, so a
        // pass costs O(placements × nodes + pods × log nodes) instead of O(pods × nodes) (20,000
        // pods on 1,000 nodes would otherwise never settle). A pod is parsed only to be bound or
        // to stand for its placement: at 5,000 nodes tens of thousands of replacements wait here
        // with nowhere to go, and parsing each on every pass took most of the pass.
        let caps: HashMap<String, usize> = usable.iter().map(|n| (s(&n["metadata"]["name"]), capacity(n))).collect();
        let mut by_placement: HashMap<Arc<str>, BTreeSet<(usize, String)>> = HashMap::new();
        for stored in pending {
            let placement = stored.summary().placement.clone().unwrap_or_default();
            // Least loaded fitting node first, like a spreading scheduler.
            let chosen = by_placement
                .entry(placement)
                .or_insert_with(|| {
                    let p = stored.value();
                    usable
                        .iter()
                        .filter(|n| fits(&p["spec"], n))
                        .map(|n| {
                            let name = s(&n["metadata"]["name"]);
                            (load.get(&name).copied().unwrap_or(0), name)
                        })
                        .filter(|(l, name)| *l < caps.get(name).copied().unwrap_or(0))
                        .collect()
                })
                .first()
                .cloned();
            let Some((node_load, node_name)) = chosen else { continue };
            let p = stored.value();
            let (ns, name) = ns_name(&p);
            let wm = WriteOptions::manager("default-scheduler");
            let bound = self.store.patch(&pods_gr(), &ns, &name, PatchType::Merge,
                &json!({"metadata": {"resourceVersion": p["metadata"]["resourceVersion"]}, "spec": {"nodeName": node_name}}), "", &wm);
            if bound.is_err() {
                continue;
            }
            *load.entry(node_name.clone()).or_default() += 1;
            let cond = json!({"status": {"conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}]}});
            let _ = self.store.patch(&pods_gr(), &ns, &name, PatchType::Strategic, &cond, "status", &wm);
            // every signature that can use this node must see its new load
            let new_load = node_load + 1;
            let cap = caps.get(&node_name).copied().unwrap_or(0);
            for set in by_placement.values_mut() {
                if set.remove(&(node_load, node_name.clone())) && new_load < cap {
                    set.insert((new_load, node_name.clone()));
                }
            }
        }
        unscheduled
    }
}

/// The label the Deployment controller adds to its ReplicaSets' pod templates and selectors.
const POD_TEMPLATE_HASH: &str = "pod-template-hash";

/// The ReplicaSet among `owned` (those the Deployment controls) that runs the Deployment's current
/// pod template: the oldest whose template is the Deployment's once the `pod-template-hash` label
/// is set aside, as kube-controller-manager finds it (`FindNewReplicaSet` and `EqualIgnoreHash` in
/// kubernetes/kubernetes pkg/controller/deployment/util/deployment_util.go). Never by its name:
/// a ReplicaSet copied from a real cluster is named after that cluster's hash of the template
/// (and of the template before a snapshot dropped fields from it), and taking it for an old one
/// rolled every copied Deployment out, its running pods deleted and replaced.
fn current_replicaset<'a>(dep: &Value, owned: &'a [Value]) -> Option<&'a Value> {
    let template = &dep["spec"]["template"];
    owned
        .iter()
        .filter(|rs| same_template_ignoring_hash(&rs["spec"]["template"], template))
        .min_by_key(|rs| (s(&rs["metadata"]["creationTimestamp"]), s(&rs["metadata"]["name"])))
}

/// Whether two pod templates are equal but for their `pod-template-hash` label. Compared in place,
/// field by field, without copying either: a pass runs this for every ReplicaSet of every
/// Deployment it reconciles.
fn same_template_ignoring_hash(a: &Value, b: &Value) -> bool {
    type Map = serde_json::Map<String, Value>;
    let empty = Map::new();
    let (ma, mb) = (a["metadata"].as_object().unwrap_or(&empty), b["metadata"].as_object().unwrap_or(&empty));
    let (la, lb) = (
        ma.get("labels").and_then(Value::as_object).unwrap_or(&empty),
        mb.get("labels").and_then(Value::as_object).unwrap_or(&empty),
    );
    // every entry of `x` but the `skip` key is in `y` with the same value
    let within = |x: &Map, y: &Map, skip: &str| x.iter().filter(|(k, _)| *k != skip).all(|(k, v)| y.get(k) == Some(v));
    a["spec"] == b["spec"]
        && within(ma, mb, "labels")
        && within(mb, ma, "labels")
        && within(la, lb, POD_TEMPLATE_HASH)
        && within(lb, la, POD_TEMPLATE_HASH)
}

/// Names of the budgets among `pdbs` whose selector matches any of the `changed` label sets. Budgets
/// are indexed by one of their `matchLabels` pairs (every pair must match), so a pass costs the
/// changed label sets times their labels, not budgets × pods.
fn budgets_selecting<'a>(pdbs: &[Arc<Value>], changed: impl Iterator<Item = &'a Value>) -> Vec<String> {
    let mut by_pair: HashMap<(String, String), Vec<(String, LabelSelector)>> = HashMap::new();
    let mut unindexed: Vec<(String, LabelSelector)> = Vec::new();
    for p in pdbs {
        // A budget without a selector selects no pods: no pod change can alter its status.
        let Some(sel) = LabelSelector::from_object(&p["spec"]["selector"]) else { continue };
        let name = s(&p["metadata"]["name"]);
        let pair = p["spec"]["selector"]["matchLabels"]
            .as_object()
            .and_then(|m| m.iter().find_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string()))));
        match pair {
            Some(pair) => by_pair.entry(pair).or_default().push((name, sel)),
            None => unindexed.push((name, sel)),
        }
    }
    let mut hit = BTreeSet::new();
    for pod in changed {
        for (name, sel) in &unindexed {
            if sel.matches(pod) {
                hit.insert(name.clone());
            }
        }
        for (k, v) in pod["metadata"]["labels"].as_object().into_iter().flatten() {
            let Some(v) = v.as_str() else { continue };
            for (name, sel) in by_pair.get(&(k.clone(), v.to_string())).into_iter().flatten() {
                if sel.matches(pod) {
                    hit.insert(name.clone());
                }
            }
        }
    }
    hit.into_iter().collect()
}

/// A stable hash of a string (pod IPs derived from uids).
pub(crate) fn hash_str(v: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// How long until the kubelet removes a pod being deleted: what is left of its grace period
/// counted from its deletion, not from when the controllers' loop learns of it. The loop learns
/// late when it falls behind the change stream (thousands of evictions at once) and resyncs, and a
/// grace period counted afresh there kept pods up to a whole grace period past their time, where a
/// kubelet ends them on time.
/// `deletionTimestamp` is the deletion's time plus the grace period in real seconds, truncated to
/// the second: a deletion that may be less than a second old is taken as seen when it happened
/// (the whole grace period, exactly, which an accelerated clock needs), an older one as made at
/// the latest moment it can have been, so the pod is never removed earlier than by a kubelet.
fn removal_left(pod: &Value, scale: f64, now: std::time::SystemTime) -> Duration {
    let grace = pod["metadata"]["deletionGracePeriodSeconds"].as_i64().unwrap_or(0).max(0) as f64;
    let full = Duration::from_secs_f64((grace * scale).max(0.0));
    let Some(stamp) = pod["metadata"]["deletionTimestamp"].as_str().and_then(|t| humantime::parse_rfc3339_weak(t).ok())
    else {
        return full;
    };
    let earliest = stamp - Duration::from_secs_f64(grace);
    if now.duration_since(earliest).unwrap_or(Duration::ZERO) <= Duration::from_secs(1) {
        return full;
    }
    let due = earliest + Duration::from_secs(1) + full;
    due.duration_since(now).unwrap_or(Duration::ZERO).min(full)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_found_late_is_removed_when_its_grace_period_from_its_deletion_ends() {
        use std::time::{SystemTime, UNIX_EPOCH};
        let deleted = UNIX_EPOCH + Duration::from_secs(1_800_000_000) + Duration::from_millis(300);
        let pod = |grace: i64| {
            let stamp = humantime::format_rfc3339_seconds(deleted + Duration::from_secs(grace as u64)).to_string();
            json!({"metadata": {"deletionGracePeriodSeconds": grace, "deletionTimestamp": stamp}})
        };
        let at = |secs: f64| deleted + Duration::from_secs_f64(secs);
        // seen at once: the whole grace period, also on an accelerated clock
        assert_eq!(removal_left(&pod(120), 1.0, at(0.0)), Duration::from_secs(120));
        assert_eq!(removal_left(&pod(30), 0.05, at(0.2)), Duration::from_secs_f64(1.5));
        // seen 40 s late: what is left of it, and never less than the kubelet would give
        let late = removal_left(&pod(120), 1.0, at(40.0));
        assert!(late >= Duration::from_secs(80) && late <= Duration::from_secs(81), "{late:?}");
        assert_eq!(removal_left(&pod(30), 1.0, at(45.0)), Duration::ZERO, "overdue: at once");
        // on an accelerated clock the grace period is scaled, the timestamp is not
        let scaled = removal_left(&pod(120), 0.1, at(4.0));
        assert!(scaled >= Duration::from_secs(8) && scaled <= Duration::from_secs(9), "{scaled:?}");
        let unstamped = json!({"metadata": {"deletionGracePeriodSeconds": 30}});
        assert_eq!(removal_left(&unstamped, 1.0, SystemTime::now()), Duration::from_secs(30));
    }

    fn pdb(name: &str, selector: Value) -> Arc<Value> {
        Arc::new(json!({"metadata": {"name": name, "namespace": "apps"}, "spec": {"selector": selector}}))
    }

    fn labels(l: Value) -> Value {
        json!({"metadata": {"labels": l}})
    }

    fn template(labels: Value, image: &str) -> Value {
        json!({"metadata": {"labels": labels}, "spec": {"containers": [{"name": "app", "image": image}]}})
    }

    fn replicaset(name: &str, created: &str, template: Value) -> Value {
        json!({"metadata": {"name": name, "uid": format!("uid-{name}"), "creationTimestamp": created},
            "spec": {"replicas": 2, "template": template}})
    }

    #[test]
    fn a_deployments_current_replicaset_is_found_by_its_template_not_its_name() {
        let dep = json!({"metadata": {"name": "payments"}, "spec": {"template": template(json!({"app": "payments"}), "pay:2")}});
        // named by another cluster's hash, as every ReplicaSet of a copied cluster is
        let copied = replicaset(
            "payments-7d4b9c8f6",
            "2026-01-02T00:00:00Z",
            template(json!({"app": "payments", "pod-template-hash": "7d4b9c8f6"}), "pay:2"),
        );
        let earlier = replicaset(
            &format!("payments-{}", short_hash(&dep["spec"]["template"])),
            "2026-01-01T00:00:00Z",
            template(json!({"app": "payments", "pod-template-hash": "5f6d7c8b9"}), "pay:1"),
        );
        let owned = [earlier.clone(), copied.clone()];
        assert_eq!(current_replicaset(&dep, &owned), Some(&copied));
        assert_eq!(current_replicaset(&dep, &owned[..1]), None, "an earlier template is an old ReplicaSet");
    }

    #[test]
    fn of_two_replicasets_with_the_current_template_the_oldest_is_current() {
        let dep = json!({"spec": {"template": template(json!({"app": "web"}), "web:1")}});
        let newer = replicaset(
            "web-b",
            "2026-01-02T00:00:00Z",
            template(json!({"app": "web", "pod-template-hash": "b"}), "web:1"),
        );
        let older = replicaset(
            "web-c",
            "2026-01-01T00:00:00Z",
            template(json!({"app": "web", "pod-template-hash": "c"}), "web:1"),
        );
        assert_eq!(current_replicaset(&dep, &[newer, older.clone()]), Some(&older));
    }

    #[test]
    fn templates_differ_in_any_label_but_the_hash_and_in_any_other_field() {
        let t = template(json!({"app": "web", "tier": "front"}), "web:1");
        let with_hash = template(json!({"app": "web", "tier": "front", "pod-template-hash": "x"}), "web:1");
        assert!(same_template_ignoring_hash(&t, &with_hash));
        assert!(same_template_ignoring_hash(&with_hash, &t));
        assert!(!same_template_ignoring_hash(&t, &template(json!({"app": "web", "pod-template-hash": "x"}), "web:1")));
        assert!(!same_template_ignoring_hash(&t, &template(json!({"app": "web", "tier": "back"}), "web:1")));
        assert!(!same_template_ignoring_hash(&t, &template(json!({"app": "web", "tier": "front"}), "web:2")));
        let mut annotated = t.clone();
        annotated["metadata"]["annotations"] = json!({"kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z"});
        assert!(!same_template_ignoring_hash(&t, &annotated), "a restart is a new template");
        assert!(!same_template_ignoring_hash(&annotated, &t));
    }

    #[test]
    fn a_workloads_own_status_write_does_not_reconcile_it_again_but_any_other_change_does() {
        let store = Store::new(1024, 1);
        let mut changes = store.subscribe();
        let rs = apps("replicasets");
        let wm = WriteOptions::manager("test");
        let obj = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "web", "namespace": "a"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}});
        let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}});
        store.create(&GroupResource::new("", "namespaces"), "", ns, &wm).unwrap();
        store.create(&rs, "a", obj, &wm).unwrap();
        let mut next = |patch: Value, sub: &str| {
            store.patch(&rs, "a", "web", PatchType::Merge, &patch, sub, &wm).unwrap();
            // the creation's event first, then one per patch
            loop {
                let ev = changes.try_recv().unwrap();
                if ev.event_type == EventType::Modified {
                    let o = ev.object();
                    return status_write_only(&ev, &o, ev.old().as_ref());
                }
            }
        };
        assert!(next(json!({"status": {"replicas": 2, "readyReplicas": 1}}), "status"));
        assert!(!next(json!({"spec": {"replicas": 3}}), ""), "a scale is reconciled");
        assert!(!next(json!({"metadata": {"labels": {"x": "y"}}}), ""), "a label change is reconciled");
        assert!(!next(json!({"metadata": {"finalizers": ["example.com/hold"]}}), ""));
        assert!(next(json!({"status": {"readyReplicas": 2}}), "status"));
    }

    #[test]
    fn only_the_budgets_selecting_a_changed_pod_are_refreshed() {
        let pdbs = vec![
            pdb("web", json!({"matchLabels": {"app": "web"}})),
            pdb("web-canary", json!({"matchLabels": {"app": "web", "track": "canary"}})),
            pdb("db", json!({"matchLabels": {"app": "db"}})),
            pdb("tier", json!({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["front"]}]})),
            pdb("everything", json!({})),
            pdb("nothing", Value::Null),
        ];
        let changed = [labels(json!({"app": "web", "tier": "front"}))];
        assert_eq!(budgets_selecting(&pdbs, changed.iter()), vec!["everything", "tier", "web"]);
        let changed = [labels(json!({"app": "web", "track": "canary"})), labels(json!({"app": "db"}))];
        assert_eq!(budgets_selecting(&pdbs, changed.iter()), vec!["db", "everything", "web", "web-canary"]);
        let changed = [labels(Value::Null)];
        assert_eq!(budgets_selecting(&pdbs, changed.iter()), vec!["everything"]);
    }
}
