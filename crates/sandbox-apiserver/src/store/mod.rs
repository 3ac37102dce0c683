//! The object store: JSON objects keyed by (group, resource, namespace, name), one global
//! resourceVersion, finalizers, graceful deletion, garbage collection and a change stream.
//! The HTTP layer and the simulated controllers both act through [`Store`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::kinds::{Registry, ResourceInfo};
use super::packed::{Json, Packer};
use super::patch::{self, PatchType, WriteRecord};
use super::schema;
use super::select::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::stored::{Ids, Interner, Stored};

/// A version-independent resource: `("", "pods")`, `("karpenter.sh", "nodeclaims")`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupResource {
    /// API group (`""` for core).
    pub group: String,
    /// Plural resource name.
    pub resource: String,
}

impl GroupResource {
    /// Builds a group-resource.
    pub fn new(group: &str, resource: &str) -> Self {
        GroupResource { group: group.into(), resource: resource.into() }
    }
}

/// The full address of one object; `namespace` is empty for cluster-scoped objects.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// Its resource.
    pub gr: GroupResource,
    /// Namespace, `""` for cluster-scoped.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

/// Kind of a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Removed.
    Deleted,
}

impl EventType {
    /// The watch event type string.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change of the store, in resourceVersion order, its objects as JSON.
///
/// The change stream holds its last changes for receivers that fall behind, and most of the
/// versions it holds are no longer current; as values they were most of a rehearsal's memory (a
/// pod's small maps are B-tree nodes, several times its JSON). As JSON they are the bytes the
/// watch history keeps anyway, shared (compressed: [`Json`]), and a watch writes them as they
/// are; a receiver that reads fields parses what it reads ([`StoreEvent::object`],
/// [`StoreEvent::old`]).
#[derive(Debug, Clone)]
pub struct StoreEvent {
    /// The resourceVersion this change produced.
    pub rv: u64,
    /// Added, modified, deleted.
    pub event_type: EventType,
    /// Which object.
    pub key: ObjectKey,
    /// The object after the change (for deletions: its last state with the deletion's rv), as
    /// JSON.
    pub object_json: Json,
    /// The object before the change, if any, as JSON.
    pub old_json: Option<Json>,
}

impl StoreEvent {
    /// The object after the change.
    pub fn object(&self) -> Value {
        self.object_json.value()
    }

    /// The object before the change, if any.
    pub fn old(&self) -> Option<Value> {
        self.old_json.as_ref().map(Json::value)
    }
}

/// One change as the watch history keeps it: the objects serialized. A pod with its
/// managedFields takes several times more memory as a `serde_json::Value` (every small map is a
/// B-tree node) than as JSON; the history holds up to [`crate::ServerOptions::watch_history`]
/// changes, most of them versions no longer current, so it keeps bytes and rebuilds values only
/// for a watch that resumes from an older resourceVersion.
#[derive(Debug)]
struct HistoryEntry {
    rv: u64,
    /// When it was recorded: a change older than the freshness window leaves the history.
    at: std::time::Instant,
    event_type: EventType,
    key: ObjectKey,
    object: Json,
    old: OldVersion,
}

/// The version before a change, as the history keeps it.
#[derive(Debug)]
enum OldVersion {
    /// A creation: there was none.
    None,
    /// The object of the previous entry of the same key, which is still in the history: not
    /// kept twice.
    Previous,
    /// The previous entry has left the history (or there never was one): kept here.
    Bytes(Json),
}

/// A key's entries in the history: how many, the object of its newest entry that has left the
/// history (the old version of its oldest remaining entry), and the object of its newest entry
/// (the old version of its next change, shared rather than serialized again).
#[derive(Debug, Default)]
struct KeyHistory {
    entries: usize,
    base: Option<Json>,
    latest: Option<Json>,
}

/// A value from JSON the store wrote (anything else reads as `null`).
pub(crate) fn json_value(b: &[u8]) -> Value {
    // The bytes are what `json_bytes` wrote.
    serde_json::from_slice(b).unwrap_or(Value::Null)
}

/// A change a watch sends before its live ones: a current object (initial events), serialized
/// only when it is sent, one at a time, so that a watch of every pod never holds them all as
/// JSON at once; or a change from the history.
#[derive(Debug, Clone)]
pub struct Backlogged(Backlog);

#[derive(Debug, Clone)]
enum Backlog {
    Current { rv: u64, key: ObjectKey, object: Stored },
    Past(Arc<StoreEvent>),
}

impl Backlogged {
    /// The change as an event.
    pub fn event(&self) -> Arc<StoreEvent> {
        match &self.0 {
            Backlog::Current { rv, key, object } => Arc::new(StoreEvent {
                rv: *rv,
                event_type: EventType::Added,
                key: key.clone(),
                object_json: object.json().clone(),
                old_json: None,
            }),
            Backlog::Past(ev) => ev.clone(),
        }
    }
}

/// Options of a write.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Field manager recorded in managedFields (required for apply).
    pub field_manager: String,
    /// Server-side apply `force`.
    pub force: bool,
    /// The apiVersion the client used (recorded in managedFields); storage version if empty.
    pub api_version: String,
}

impl WriteOptions {
    /// Options with a field manager.
    pub fn manager(m: &str) -> Self {
        WriteOptions { field_manager: m.into(), ..Default::default() }
    }
}

/// Propagation policy of a delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// Dependents are deleted by the garbage collector after the owner is gone.
    #[default]
    Background,
    /// The owner stays (finalizer `foregroundDeletion`) until blocking dependents are gone.
    Foreground,
    /// Dependents lose their owner references.
    Orphan,
}

/// Options of a delete (`DeleteOptions`).
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    /// `gracePeriodSeconds`; `None` uses the object's default.
    pub grace_period_seconds: Option<i64>,
    /// `propagationPolicy`.
    pub propagation: Propagation,
    /// `preconditions.uid`.
    pub precondition_uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub precondition_rv: Option<String>,
}

impl DeleteOptions {
    /// Parses a `DeleteOptions` body (or query-derived JSON).
    pub fn from_json(v: &Value) -> Result<Self, ApiError> {
        let propagation = match v["propagationPolicy"].as_str() {
            None => {
                if v["orphanDependents"] == true {
                    Propagation::Orphan
                } else {
                    Propagation::Background
                }
            }
            Some("Background") => Propagation::Background,
            Some("Foreground") => Propagation::Foreground,
            Some("Orphan") => Propagation::Orphan,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "DeleteOptions.meta.k8s.io \"\" is invalid: propagationPolicy: Unsupported value: \"{other}\": supported values: \"Foreground\", \"Background\", \"Orphan\""
                )));
            }
        };
        Ok(DeleteOptions {
            grace_period_seconds: v["gracePeriodSeconds"].as_i64(),
            propagation,
            precondition_uid: v["preconditions"]["uid"].as_str().map(str::to_string),
            precondition_rv: v["preconditions"]["resourceVersion"].as_str().map(str::to_string),
        })
    }
}

/// Options of a list.
#[derive(Debug, Clone, Default)]
pub struct ListOptions {
    /// Label selector.
    pub labels: Option<LabelSelector>,
    /// Field selector.
    pub fields: Option<FieldSelector>,
    /// Page size.
    pub limit: Option<usize>,
    /// Continue token of the previous page.
    pub continue_token: Option<String>,
}

/// A page of a list.
#[derive(Debug, Clone)]
pub struct ObjectList {
    /// The objects, in key order.
    pub items: Vec<Stored>,
    /// The list's resourceVersion.
    pub resource_version: u64,
    /// Token for the next page.
    pub continue_token: Option<String>,
    /// Objects after this page (when paging).
    pub remaining: Option<usize>,
}

type Bucket = BTreeMap<(Arc<str>, Arc<str>), Stored>;

/// Work the garbage collector and the finalizer logic still have to do.
enum Work {
    /// An object was removed: its dependents and its deleting owners need a look.
    Removed { uid: String, owners: Vec<String>, key: ObjectKey },
    /// An object is being deleted and carries a finalizer the server itself processes.
    Deleting(ObjectKey),
}

pub(crate) struct Inner {
    pub(crate) rv: u64,
    pub(crate) registry: Registry,
    objects: HashMap<GroupResource, Bucket>,
    uids: HashMap<Arc<str>, ObjectKey>,
    dependents: HashMap<String, BTreeSet<ObjectKey>>,
    history: VecDeque<HistoryEntry>,
    /// Per key with entries in the history: how many, and its base.
    history_keys: HashMap<ObjectKey, KeyHistory>,
    history_cap: usize,
    /// How long a change stays in the history once it is no longer among the newest
    /// [`HISTORY_LOWER_BOUND`]; `None`: until the cap pushes it out.
    history_fresh: Option<Duration>,
    /// The newest resourceVersion the cap pushed out: a list continuation from before it is too
    /// old (etcd compacted it).
    history_floor: u64,
    /// The newest resourceVersion that left the history for any reason: a watch from before it
    /// gets 410.
    watch_floor: u64,
    tx: broadcast::Sender<Arc<StoreEvent>>,
    rng: u64,
    work: VecDeque<Work>,
    packer: Packer,
    interner: Interner,
}

/// A cheap, cloneable handle on the object store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store")
    }
}

/// RFC 3339 time, second precision, as Kubernetes renders `metav1.Time`.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// RFC 3339 time `secs` seconds from now.
pub fn rfc3339_in(secs: i64) -> String {
    let t = if secs >= 0 {
        SystemTime::now() + Duration::from_secs(secs.unsigned_abs())
    } else {
        SystemTime::now() - Duration::from_secs(secs.unsigned_abs())
    };
    humantime::format_rfc3339_seconds(t).to_string()
}

pub(crate) fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

pub(crate) fn str_list(v: &Value) -> Vec<String> {
    v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_string)).collect()
}

fn finalizers(obj: &Value) -> Vec<String> {
    str_list(&obj["metadata"]["finalizers"])
}

fn set_finalizers(obj: &mut Value, f: &[String]) {
    if f.is_empty() {
        if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("finalizers");
        }
    } else {
        obj["metadata"]["finalizers"] = json!(f);
    }
}

fn owner_uids(obj: &Value) -> Vec<String> {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["uid"].as_str().map(str::to_string))
        .collect()
}

/// The object without metadata and status: a change here bumps `generation`.
fn spec_part(v: &Value) -> Value {
    let mut c = v.clone();
    if let Some(m) = c.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
        m.remove("apiVersion");
        m.remove("kind");
    }
    c
}

/// Changes the history keeps whatever their age: kube-apiserver's watch cache never shrinks
/// below 100 events (`defaultLowerBoundCapacity`).
const HISTORY_LOWER_BOUND: usize = 100;

const FOREGROUND: &str = "foregroundDeletion";
const ORPHAN: &str = "orphan";
const CRD_CLEANUP: &str = "customresourcecleanup.apiextensions.k8s.io";

fn crd_gr() -> GroupResource {
    GroupResource::new("apiextensions.k8s.io", "customresourcedefinitions")
}

fn ns_gr() -> GroupResource {
    GroupResource::new("", "namespaces")
}

impl Store {
    /// An empty store with the default namespaces; `watch_history` events are kept for watch
    /// resumption (older resourceVersions answer 410).
    pub fn new(watch_history: usize, seed: u64) -> Store {
        // Live watchers and the control plane read changes from this ring; one that falls more than
        // its capacity behind is cut and resumes from the history (a watch) or resynchronises (the
        // control plane), as kube-apiserver closes a watcher that does not keep up. 4,096 cut the
        // tool's pod watch 17 times in a 1,000-node teardown and cost it 6 s; 16,384 cut it none,
        // and the process's peak memory was the same (3.0 GiB) either way.
        let (tx, _) = broadcast::channel(16_384);
        let inner = Inner {
            rv: 1,
            registry: Registry::new(),
            objects: HashMap::new(),
            uids: HashMap::new(),
            dependents: HashMap::new(),
            history: VecDeque::new(),
            history_keys: HashMap::new(),
            history_cap: watch_history.max(1),
            history_fresh: None,
            history_floor: 0,
            watch_floor: 0,
            tx,
            rng: seed | 1,
            work: VecDeque::new(),
            packer: Packer::default(),
            interner: Interner::default(),
        };
        let store = Store { inner: Arc::new(Mutex::new(inner)) };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            // Cannot fail: the store is empty and the namespace objects are valid.
            let _ = store.create(
                &ns_gr(),
                "",
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
                &WriteOptions::manager("kube-apiserver"),
            );
        }
        store
    }

    /// Keeps changes in the history for `window` (beyond the newest
    /// [`HISTORY_LOWER_BOUND`]), as kube-apiserver's watch cache keeps 75 s of them
    /// (`eventFreshDuration`): a watch resuming from further back gets 410 and lists again, as it
    /// would there, instead of being replayed what a real server has long dropped. The cap given
    /// to [`Store::new`] still applies.
    pub fn keep_history_for(&self, window: Duration) {
        self.lock().history_fresh = Some(window);
    }

    /// Drops the history of every change so far, as if the objects now stored had long existed:
    /// kube-apiserver's watch cache holds the last 75 s of changes, not how a cluster came to
    /// be. A loader calls this once a copy is loaded (at 20,000 pods that history was 13 MB
    /// nobody would read); a watch from a resourceVersion before it gets 410 and lists again.
    pub fn forget_history(&self) {
        let mut inner = self.lock();
        inner.history = VecDeque::new();
        inner.history_keys = HashMap::new();
        inner.watch_floor = inner.rv;
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A snapshot of the served resources.
    pub fn registry(&self) -> Registry {
        self.lock().registry.clone()
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// A receiver of every change from now on. A receiver that falls behind by more than the
    /// channel's capacity gets `Lagged` and must re-list.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<StoreEvent>> {
        self.lock().tx.subscribe()
    }

    /// Reads one object.
    pub fn get(&self, gr: &GroupResource, ns: &str, name: &str) -> Result<Value, ApiError> {
        let inner = self.lock();
        inner.info(gr)?;
        inner
            .find(gr, ns, name)
            .map(Arc::unwrap_or_clone)
            .ok_or_else(|| ApiError::not_found(&gr.group, &gr.resource, name))
    }

    /// Lists objects of a resource; `ns = None` lists across namespaces.
    pub fn list(&self, gr: &GroupResource, ns: Option<&str>, opts: &ListOptions) -> Result<ObjectList, ApiError> {
        self.lock().list(gr, ns, opts)
    }

    /// Creates an object (generateName, uid, creationTimestamp, generation are set here).
    pub fn create(&self, gr: &GroupResource, ns: &str, obj: Value, opts: &WriteOptions) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let out = inner.create(gr, ns, obj, opts)?;
        inner.run_work();
        Ok(out)
    }

    /// Creates an object copied from another cluster, as that cluster holds it: a new uid and
    /// resourceVersion like any create, but its `status`, `managedFields`, `deletionTimestamp` and
    /// `deletionGracePeriodSeconds` are kept instead of being reset, so that what reads them
    /// (field managers, an object stuck terminating on a finalizer, a drain waiting for a pod that
    /// is already going, a budget that no longer counts it) sees what the other cluster showed;
    /// and the apiVersion it was given, as the version it is stored at. A CRD's status is the
    /// server's own. Only a loader uses this; no request can.
    ///
    /// The control plane's kubelet removes a terminating pod once its `deletionGracePeriodSeconds`
    /// have passed from the moment it sees the pod, so a loader gives the pod what was left of its
    /// grace period; with 0 (or none) the pod stays terminating until its node is gone, as one
    /// stuck past its deletion time does.
    ///
    /// An object given without `managedFields` (a snapshot drops a pod's and a node's: nothing
    /// that reads the copy needs them) is stored without them, as given, rather than with a
    /// made-up manager owning every field: at 20,000 pods that entry was half of each pod's
    /// memory in the store, and again in every change the watch ring holds.
    pub fn restore(&self, gr: &GroupResource, ns: &str, obj: Value) -> Result<Value, ApiError> {
        let managed = obj["metadata"]["managedFields"].clone();
        let deleting = obj["metadata"]["deletionTimestamp"].clone();
        let grace = obj["metadata"]["deletionGracePeriodSeconds"].clone();
        let api_version = obj["apiVersion"].clone();
        let status = obj["status"].clone();
        let mut inner = self.lock();
        // one write, as the object appears once: watchers see it ADDED as the other cluster
        // holds it, not created and then changed
        let (key, mut restored) = inner.new_object(gr, ns, obj, &WriteOptions::manager("restore"), false)?;
        if managed.is_array() {
            restored["metadata"]["managedFields"] = managed;
        } else if let Some(meta) = restored["metadata"].as_object_mut() {
            meta.remove("managedFields");
        }
        if deleting.is_string() {
            restored["metadata"]["deletionTimestamp"] = deleting;
            if grace.is_i64() {
                restored["metadata"]["deletionGracePeriodSeconds"] = grace;
            }
        }
        if !status.is_null() && *gr != crd_gr() {
            restored["status"] = status;
        }
        // the version it is stored at: a Karpenter 1.0.x object written at v1beta1 stays so, and
        // reading it needs the conversion webhook
        if let Some(v) = api_version.as_str().filter(|v| !v.is_empty()) {
            restored["apiVersion"] = json!(v);
        }
        let out = inner.commit(key, restored, None);
        inner.run_work();
        Ok(out)
    }

    /// Replaces an object (`subresource` `""` or `"status"`).
    pub fn update(
        &self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
        obj: Value,
        subresource: &str,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let out = inner.update(gr, ns, name, obj, subresource, opts, "Update")?;
        inner.run_work();
        Ok(out)
    }

    /// Patches an object (`subresource` `""` or `"status"`). Apply patches create the object if
    /// it does not exist.
    #[expect(
        clippy::too_many_arguments,
        reason = "a write's key, body, preconditions and options, as the HTTP layer passes them"
    )]
    pub fn patch(
        &self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
        ty: PatchType,
        patch_body: &Value,
        subresource: &str,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let out = inner.patch(gr, ns, name, ty, patch_body, subresource, opts)?;
        inner.run_work();
        Ok(out)
    }

    /// Deletes an object. Returns the object (still present when finalizers or a grace period
    /// keep it) and whether it is gone.
    pub fn delete(
        &self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Value, bool), ApiError> {
        let mut inner = self.lock();
        let out = inner.delete(gr, ns, name, opts)?;
        inner.run_work();
        Ok(out)
    }

    /// Events after `rv` for a resource (`None`: synthetic ADDED events of the current state),
    /// plus a receiver for what follows and the current resourceVersion, taken atomically.
    /// Err(410) when `rv` is too old.
    #[expect(
        clippy::type_complexity,
        reason = "the replay, the live receiver and the resourceVersion are taken together under one lock; a named type would hide that"
    )]
    pub fn watch_from(
        &self,
        gr: &GroupResource,
        rv: Option<u64>,
    ) -> Result<(Vec<Backlogged>, broadcast::Receiver<Arc<StoreEvent>>, u64), ApiError> {
        let inner = self.lock();
        inner.info(gr)?;
        let rx = inner.tx.subscribe();
        let backlog = match rv {
            None => inner
                .objects
                .get(gr)
                .into_iter()
                .flat_map(|b| b.iter())
                .map(|((ns, name), obj)| {
                    Backlogged(Backlog::Current {
                        rv: inner.rv,
                        key: ObjectKey { gr: gr.clone(), namespace: ns.clone(), name: name.clone() },
                        object: obj.clone(),
                    })
                })
                .collect(),
            Some(rv) => {
                if rv < inner.watch_floor {
                    return Err(ApiError::expired(format!(
                        "too old resource version: {rv} ({})",
                        inner.watch_floor + 1
                    )));
                }
                inner.replay(gr, rv)
            }
        };
        Ok((backlog, rx, inner.rv))
    }

    /// Runs `f` with exclusive access to the store's internals (eviction, binding, scale).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut inner = self.lock();
        let r = f(&mut inner);
        inner.run_work();
        r
    }
}

impl Inner {
    pub(crate) fn info(&self, gr: &GroupResource) -> Result<&ResourceInfo, ApiError> {
        self.registry
            .get(&gr.group, &gr.resource)
            .ok_or_else(|| ApiError::no_route(&format!("{}/{}", gr.group, gr.resource)))
    }

    /// `key` with the namespace and name the store already holds for it (or, for a new object,
    /// its namespace shared with the other objects there): every copy of a key (the object's
    /// entry, its uid, its owners' dependents, the watch history, the change stream) then
    /// shares two strings instead of holding its own.
    fn shared_key(&mut self, key: ObjectKey) -> ObjectKey {
        let held = self
            .objects
            .get(&key.gr)
            .and_then(|b| b.get_key_value(&(key.namespace.clone(), key.name.clone())))
            .map(|((ns, name), _)| (ns.clone(), name.clone()));
        match held {
            Some((namespace, name)) => ObjectKey { gr: key.gr, namespace, name },
            None => ObjectKey { namespace: self.interner.text(&key.namespace), ..key },
        }
    }

    /// An object as stored.
    pub(crate) fn stored(&self, gr: &GroupResource, ns: &str, name: &str) -> Option<&Stored> {
        self.objects.get(gr).and_then(|b| b.get(&(Arc::from(ns), Arc::from(name))))
    }

    /// An object, parsed.
    pub(crate) fn find(&self, gr: &GroupResource, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.stored(gr, ns, name).map(Stored::value)
    }

    /// All objects of a resource in a namespace (or everywhere with `None`).
    pub(crate) fn iter_ns<'a>(
        &'a self,
        gr: &GroupResource,
        ns: Option<&'a str>,
    ) -> impl Iterator<Item = &'a Stored> + 'a {
        let bucket = self.objects.get(gr);
        let start: Arc<str> = ns.unwrap_or_default().into();
        bucket
            .into_iter()
            .flat_map(move |b| b.range((start.clone(), Arc::from(""))..))
            .take_while(move |((n, _), _)| ns.is_none_or(|ns| **n == *ns))
            .map(|(_, v)| v)
    }

    fn random_suffix(&mut self, n: usize) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        (0..n)
            .map(|_| {
                let i = (xorshift(&mut self.rng) % ALPHABET.len() as u64) as usize;
                ALPHABET[i] as char
            })
            .collect()
    }

    fn new_uid(&mut self) -> String {
        let a = xorshift(&mut self.rng);
        let b = xorshift(&mut self.rng);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            b >> 52,
            b & 0xffff_ffff_ffff
        )
    }

    /// The history's changes of `gr` after `rv`, as events. Walks the whole history of `gr`
    /// from its start, because an entry's old version may be the object of an earlier entry.
    fn replay(&self, gr: &GroupResource, rv: u64) -> Vec<Backlogged> {
        let mut latest: HashMap<&ObjectKey, &Json> = HashMap::new();
        let mut out = Vec::new();
        for e in self.history.iter().filter(|e| e.key.gr == *gr) {
            if e.rv > rv {
                let old = match &e.old {
                    OldVersion::None => None,
                    OldVersion::Previous => latest
                        .get(&e.key)
                        .copied()
                        .or_else(|| self.history_keys.get(&e.key).and_then(|k| k.base.as_ref()))
                        .cloned(),
                    OldVersion::Bytes(b) => Some(b.clone()),
                };
                out.push(Backlogged(Backlog::Past(Arc::new(StoreEvent {
                    rv: e.rv,
                    event_type: e.event_type,
                    key: e.key.clone(),
                    object_json: e.object.clone(),
                    old_json: old,
                }))));
            }
            latest.insert(&e.key, &e.object);
        }
        out
    }

    fn emit(&mut self, event_type: EventType, key: ObjectKey, object_json: Json, old: Option<Json>) {
        let keyed = self.history_keys.entry(key.clone()).or_default();
        // The stored object a change replaces is the object of that key's previous change, or,
        // once that has left the history, the base kept for the key: kept once, not per entry.
        let (old_json, old_entry) = match old {
            None => (None, OldVersion::None),
            Some(_) if keyed.entries > 0 => (keyed.latest.clone(), OldVersion::Previous),
            Some(b) => (Some(b.clone()), OldVersion::Bytes(b)),
        };
        keyed.entries += 1;
        keyed.latest = Some(object_json.clone());
        let now = std::time::Instant::now();
        self.history.push_back(HistoryEntry {
            rv: self.rv,
            at: now,
            event_type,
            key: key.clone(),
            object: object_json.clone(),
            old: old_entry,
        });
        loop {
            let over_cap = self.history.len() > self.history_cap;
            let stale = self.history.len() > HISTORY_LOWER_BOUND
                && self.history_fresh.zip(self.history.front()).is_some_and(|(f, e)| now.duration_since(e.at) > f);
            if !over_cap && !stale {
                break;
            }
            let Some(e) = self.history.pop_front() else { break };
            if over_cap {
                self.history_floor = e.rv;
            }
            self.watch_floor = e.rv;
            if let Some(keyed) = self.history_keys.get_mut(&e.key) {
                keyed.entries = keyed.entries.saturating_sub(1);
                if keyed.entries == 0 {
                    self.history_keys.remove(&e.key);
                } else {
                    keyed.base = Some(e.object);
                }
            }
        }
        let ev = Arc::new(StoreEvent { rv: self.rv, event_type, key, object_json, old_json });
        // No receiver is fine: nobody watches.
        let _ = self.tx.send(ev);
    }

    /// Stores `obj` under a new resourceVersion and emits the event.
    fn commit(&mut self, key: ObjectKey, mut obj: Value, old: Option<Arc<Value>>) -> Value {
        let key = self.shared_key(key);
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        if let Some(o) = &old {
            for uid in owner_uids(o) {
                if let Some(set) = self.dependents.get_mut(&uid) {
                    set.remove(&key);
                }
            }
        }
        for uid in owner_uids(&obj) {
            self.dependents.entry(uid).or_default().insert(key.clone());
        }
        let uid: Option<Arc<str>> = obj["metadata"]["uid"].as_str().map(|u| {
            let shared = self.uids.get_key_value(u).map(|(held, _)| held.clone()).unwrap_or_else(|| u.into());
            self.uids.insert(shared.clone(), key.clone());
            shared
        });
        let ty = if old.is_some() { EventType::Modified } else { EventType::Added };
        let old_json = old.and(self.stored(&key.gr, &key.namespace, &key.name)).map(|s| s.json().clone());
        let json = self.packer.pack(&key.gr, &obj);
        let ids = Ids { name: Some(key.name.clone()), uid };
        let stored = Stored::new(&obj, json.clone(), key.gr == crd_gr(), &mut self.interner, ids);
        self.emit(ty, key.clone(), json, old_json);
        self.objects.entry(key.gr).or_default().insert((key.namespace, key.name), stored);
        obj
    }

    /// Removes an object for good.
    fn remove(&mut self, key: &ObjectKey) -> Option<Value> {
        let old = self.objects.get_mut(&key.gr)?.remove(&(key.namespace.clone(), key.name.clone()))?;
        self.rv += 1;
        let mut last = Arc::unwrap_or_clone(old.value());
        last["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let uid = last["metadata"]["uid"].as_str().unwrap_or_default().to_string();
        self.uids.remove(uid.as_str());
        let owners = owner_uids(&last);
        for o in &owners {
            if let Some(set) = self.dependents.get_mut(o) {
                set.remove(key);
                if set.is_empty() {
                    self.dependents.remove(o);
                }
            }
        }
        let last_json = self.packer.pack(&key.gr, &last);
        self.emit(EventType::Deleted, key.clone(), last_json, Some(old.json().clone()));
        self.work.push_back(Work::Removed { uid, owners, key: key.clone() });
        if key.gr == crd_gr() {
            let group = last["spec"]["group"].as_str().unwrap_or_default().to_string();
            let plural = last["spec"]["names"]["plural"].as_str().unwrap_or_default().to_string();
            self.registry.unregister(&group, &plural);
            self.objects.remove(&GroupResource::new(&group, &plural));
        }
        Some(last)
    }

    pub(crate) fn list(
        &self,
        gr: &GroupResource,
        ns: Option<&str>,
        opts: &ListOptions,
    ) -> Result<ObjectList, ApiError> {
        self.info(gr)?;
        let mut list_rv = self.rv;
        let mut start: Bound<(Arc<str>, Arc<str>)> = Bound::Included((ns.unwrap_or_default().into(), "".into()));
        if let Some(tok) = &opts.continue_token {
            let (rv, kns, kname) = decode_continue(tok)?;
            if rv < self.history_floor {
                return Err(ApiError::expired(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
                ));
            }
            list_rv = rv;
            start = Bound::Excluded((kns.into(), kname.into()));
        }
        let mut items = Vec::new();
        let mut next = None;
        let mut remaining = 0usize;
        let mut last: Option<(&str, &str)> = None;
        if let Some(bucket) = self.objects.get(gr) {
            for ((kns, kname), obj) in bucket.range((start, Bound::Unbounded)) {
                if ns.is_some_and(|n| n != &**kns) {
                    break;
                }
                if !opts.labels.as_ref().is_none_or(|l| obj.selected_by(l))
                    || !opts.fields.as_ref().is_none_or(|f| obj.selected_by_fields(f, kns, kname))
                {
                    continue;
                }
                if opts.limit.is_some_and(|l| l > 0 && items.len() >= l) {
                    if next.is_none() {
                        let (last_ns, last_name) = last.unwrap_or((kns, kname));
                        next = Some(encode_continue(list_rv, last_ns, last_name));
                    }
                    remaining += 1;
                    continue;
                }
                last = Some((kns, kname));
                items.push(obj.clone());
            }
        }
        Ok(ObjectList {
            items,
            resource_version: list_rv,
            remaining: next.as_ref().map(|_| remaining),
            continue_token: next,
        })
    }

    pub(crate) fn create(
        &mut self,
        gr: &GroupResource,
        ns: &str,
        obj: Value,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let (key, obj) = self.new_object(gr, ns, obj, opts, true)?;
        Ok(self.commit(key, obj, None))
    }

    /// A create's object, checked and filled in, not yet stored; its managedFields recorded for
    /// `opts`'s manager when `record` (a restore brings its own).
    fn new_object(
        &mut self,
        gr: &GroupResource,
        ns: &str,
        mut obj: Value,
        opts: &WriteOptions,
        record: bool,
    ) -> Result<(ObjectKey, Value), ApiError> {
        let info = self.info(gr)?.clone();
        if !obj.is_object() {
            return Err(ApiError::bad_request("the request body must be a JSON object"));
        }
        check_kind(&info, &obj)?;
        let ns = if info.namespaced { ns } else { "" };
        if info.namespaced {
            if ns.is_empty() {
                return Err(ApiError::bad_request("the namespace of the object is required"));
            }
            check_body_namespace(&obj, ns)?;
            match self.find(&ns_gr(), "", ns) {
                None => return Err(ApiError::not_found("", "namespaces", ns)),
                Some(n) if !n["metadata"]["deletionTimestamp"].is_null() => {
                    return Err(ApiError::forbidden(
                        &gr.group,
                        &gr.resource,
                        obj["metadata"]["name"].as_str().unwrap_or_default(),
                        &format!("unable to create new content in namespace {ns} because it is being terminated"),
                    ));
                }
                Some(_) => {}
            }
        }
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        let mut name = obj["metadata"]["name"].as_str().unwrap_or_default().to_string();
        if name.is_empty() {
            let prefix = obj["metadata"]["generateName"].as_str().unwrap_or_default().to_string();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    &info.group,
                    &info.kind,
                    "",
                    "metadata.name",
                    "FieldValueRequired",
                    "Required value: name or generateName is required",
                ));
            }
            name = format!("{prefix}{}", self.random_suffix(5));
        }
        validate_name(&info, &name)?;
        if self.stored(gr, ns, &name).is_some() {
            return Err(ApiError::already_exists(&gr.group, &gr.resource, &name));
        }
        let version = if opts.api_version.is_empty() {
            info.api_version(&info.storage_version)
        } else {
            opts.api_version.clone()
        };
        obj["apiVersion"] = json!(version);
        obj["kind"] = json!(info.kind);
        let meta = &mut obj["metadata"];
        meta["name"] = json!(name);
        if info.namespaced {
            meta["namespace"] = json!(ns);
        } else if let Some(m) = meta.as_object_mut() {
            m.remove("namespace");
        }
        let uid = self.new_uid();
        let meta = &mut obj["metadata"];
        meta["uid"] = json!(uid);
        meta["creationTimestamp"] = json!(now_rfc3339());
        meta["generation"] = json!(1);
        if let Some(m) = meta.as_object_mut() {
            for k in ["deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "resourceVersion", "selfLink"]
            {
                m.remove(k);
            }
        }
        prepare_create(&info, &mut obj);
        self.admit_custom(&info, &name, &mut obj, None)?;
        if *gr == crd_gr() {
            let registered = self.registry.register_crd(&obj)?;
            let mut f = finalizers(&obj);
            if !f.iter().any(|x| x == CRD_CLEANUP) {
                f.push(CRD_CLEANUP.into());
            }
            set_finalizers(&mut obj, &f);
            obj["status"] = crd_status(&obj, &registered);
        }
        if record {
            let now = now_rfc3339();
            patch::record_managed_fields(
                None,
                &mut obj,
                &WriteRecord {
                    manager: &opts.field_manager,
                    operation: "Update",
                    subresource: "",
                    api_version: &version,
                    time: &now,
                    applied: None,
                },
            );
        }
        Ok((ObjectKey { gr: gr.clone(), namespace: ns.into(), name: name.into() }, obj))
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "a write's key, body, preconditions and options, as the HTTP layer passes them"
    )]
    pub(crate) fn update(
        &mut self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
        mut obj: Value,
        subresource: &str,
        opts: &WriteOptions,
        operation: &str,
    ) -> Result<Value, ApiError> {
        let info = self.info(gr)?.clone();
        let ns = if info.namespaced { ns } else { "" };
        if !obj.is_object() {
            return Err(ApiError::bad_request("the request body must be a JSON object"));
        }
        check_kind(&info, &obj)?;
        let body_name = obj["metadata"]["name"].as_str().unwrap_or_default();
        if !body_name.is_empty() && body_name != name {
            return Err(ApiError::bad_request("the name of the object does not match the name on the URL"));
        }
        if info.namespaced {
            check_body_namespace(&obj, ns)?;
        }
        let old = self.find(gr, ns, name).ok_or_else(|| ApiError::not_found(&gr.group, &gr.resource, name))?;
        if let Some(rv) = obj["metadata"]["resourceVersion"].as_str()
            && !rv.is_empty()
            && old["metadata"]["resourceVersion"].as_str() != Some(rv)
        {
            return Err(ApiError::stale(&gr.group, &gr.resource, name));
        }
        // Server-owned metadata always comes from the stored object.
        for k in
            ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation", "selfLink"]
        {
            match old["metadata"].get(k) {
                Some(v) => obj["metadata"][k] = v.clone(),
                None => {
                    if let Some(m) = obj["metadata"].as_object_mut() {
                        m.remove(k);
                    }
                }
            }
        }
        if !old["metadata"]["managedFields"].is_null() {
            obj["metadata"]["managedFields"] = old["metadata"]["managedFields"].clone();
        } else if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("managedFields");
        }
        obj["metadata"]["name"] = json!(name);
        if info.namespaced {
            obj["metadata"]["namespace"] = json!(ns);
        }
        obj["apiVersion"] =
            if opts.api_version.is_empty() { old["apiVersion"].clone() } else { json!(opts.api_version) };
        obj["kind"] = json!(info.kind);
        match subresource {
            "status" => {
                if !info.status {
                    return Err(ApiError::no_route(&format!("{}/status", gr.resource)));
                }
                let status = obj.get("status").cloned();
                obj = (*old).clone();
                obj["metadata"]["managedFields"] = old["metadata"]["managedFields"].clone();
                match status {
                    Some(s) => obj["status"] = s,
                    None => {
                        if let Some(m) = obj.as_object_mut() {
                            m.remove("status");
                        }
                    }
                }
            }
            "" => {
                if info.status {
                    match old.get("status") {
                        Some(s) => obj["status"] = s.clone(),
                        None => {
                            if let Some(m) = obj.as_object_mut() {
                                m.remove("status");
                            }
                        }
                    }
                }
                if spec_part(&obj) != spec_part(&old) {
                    let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                    obj["metadata"]["generation"] = json!(g + 1);
                }
            }
            other => return Err(ApiError::no_route(&format!("{}/{other}", gr.resource))),
        }
        // Finalizers cannot be added once deletion started.
        if !old["metadata"]["deletionTimestamp"].is_null() {
            let before = finalizers(&old);
            let added: Vec<String> = finalizers(&obj).into_iter().filter(|f| !before.contains(f)).collect();
            if !added.is_empty() {
                return Err(ApiError::invalid(
                    &info.group,
                    &info.kind,
                    name,
                    "metadata.finalizers",
                    "FieldValueForbidden",
                    &format!(
                        "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{{{}}}",
                        added.iter().map(|f| format!("\"{f}\"")).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        self.admit_custom(&info, name, &mut obj, Some(&old))?;
        if *gr == crd_gr() {
            let registered = self.registry.register_crd(&obj)?;
            let mut st = crd_status(&obj, &registered);
            if let Some(c) = old["status"]["storedVersions"].as_array() {
                st["storedVersions"] = json!(c);
            }
            obj["status"] = st;
        }
        if obj == *old {
            // A no-op write does not bump the resourceVersion, like the real server.
            return Ok(obj);
        }
        let now = now_rfc3339();
        let api_version = obj["apiVersion"].as_str().unwrap_or_default().to_string();
        patch::record_managed_fields(
            Some(&old),
            &mut obj,
            &WriteRecord {
                manager: &opts.field_manager,
                operation,
                subresource,
                api_version: &api_version,
                time: &now,
                applied: None,
            },
        );
        if obj == *old {
            return Ok(obj);
        }
        let key = ObjectKey { gr: gr.clone(), namespace: ns.into(), name: name.into() };
        let deleting = !obj["metadata"]["deletionTimestamp"].is_null();
        let out = self.commit(key.clone(), obj, Some(old));
        if deleting {
            return Ok(self.after_deleting_write(&key).unwrap_or(out));
        }
        Ok(out)
    }

    /// A custom resource's write, as the real server admits it: its CRD's schema defaults, then
    /// its CEL rules (transition rules against `old`); a failed rule is a 422 naming the field
    /// and the rule's message.
    fn admit_custom(
        &self,
        info: &ResourceInfo,
        name: &str,
        obj: &mut Value,
        old: Option<&Value>,
    ) -> Result<(), ApiError> {
        if info.builtin {
            return Ok(());
        }
        let Some(crd) = self.find(&crd_gr(), "", &format!("{}.{}", info.resource, info.group)) else {
            return Ok(());
        };
        let version = obj["apiVersion"].as_str().and_then(|v| v.rsplit('/').next()).unwrap_or_default().to_string();
        let Some(schema) = schema::schema_of(&crd, &version) else {
            return Ok(());
        };
        schema::apply_defaults(schema, obj);
        let violations = schema::validate(schema, obj, old);
        let Some(first) = violations.first() else {
            return Ok(());
        };
        // kube-apiserver's wording: `<field>: Invalid value: "object": <message>` per rule
        let detail = violations.iter().enumerate().map(|(i, v)| {
            let field = if i == 0 { String::new() } else { format!("{}: ", v.field) };
            format!("{field}Invalid value: \"object\": {}", v.message)
        });
        Err(ApiError::invalid(
            &info.group,
            &info.kind,
            name,
            &first.field,
            "FieldValueInvalid",
            &detail.collect::<Vec<_>>().join(", "),
        ))
    }

    /// After a write to an object under deletion: remove it when no finalizer and no grace
    /// period is left, or queue server-side finalizer work.
    fn after_deleting_write(&mut self, key: &ObjectKey) -> Option<Value> {
        let obj = self.find(&key.gr, &key.namespace, &key.name)?.clone();
        let fins = finalizers(&obj);
        let grace = obj["metadata"]["deletionGracePeriodSeconds"].as_i64().unwrap_or(0);
        if fins.is_empty() && grace == 0 {
            return self.remove(key);
        }
        if fins.iter().any(|f| f == FOREGROUND || f == ORPHAN || f == CRD_CLEANUP) || (key.gr == ns_gr()) {
            self.work.push_back(Work::Deleting(key.clone()));
        }
        None
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "a write's key, body, preconditions and options, as the HTTP layer passes them"
    )]
    pub(crate) fn patch(
        &mut self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
        ty: PatchType,
        body: &Value,
        subresource: &str,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let info = self.info(gr)?.clone();
        let ns = if info.namespaced { ns } else { "" };
        if ty == PatchType::Strategic && !info.builtin {
            return Err(ApiError::unsupported_media_type("application/strategic-merge-patch+json"));
        }
        let current = self.find(gr, ns, name);
        if ty == PatchType::Apply {
            if opts.field_manager.is_empty() {
                return Err(ApiError::invalid(
                    "meta.k8s.io",
                    "PatchOptions",
                    "",
                    "fieldManager",
                    "FieldValueRequired",
                    "Required value: is required for apply patch",
                ));
            }
            let Some(live) = current else {
                if !subresource.is_empty() {
                    return Err(ApiError::not_found(&gr.group, &gr.resource, name));
                }
                let mut obj = body.clone();
                obj["metadata"]["name"] = json!(name);
                let mut created = self.create(gr, ns, obj, opts)?;
                // Re-record as an Apply so the manager owns what it applied.
                let key = ObjectKey { gr: gr.clone(), namespace: ns.into(), name: name.into() };
                let mut paths = Vec::new();
                patch::leaves(body, &mut Vec::new(), &mut paths);
                if let Some(m) = created["metadata"].as_object_mut() {
                    m.remove("managedFields");
                }
                let now = now_rfc3339();
                let api_version = created["apiVersion"].as_str().unwrap_or_default().to_string();
                patch::record_managed_fields(
                    None,
                    &mut created,
                    &WriteRecord {
                        manager: &opts.field_manager,
                        operation: "Apply",
                        subresource: "",
                        api_version: &api_version,
                        time: &now,
                        applied: Some(paths),
                    },
                );
                if let Some(slot) =
                    self.objects.get_mut(gr).and_then(|b| b.get_mut(&(key.namespace.clone(), key.name.clone())))
                {
                    *slot = Stored::new(
                        &created,
                        self.packer.pack(gr, &created),
                        *gr == crd_gr(),
                        &mut self.interner,
                        Ids::default(),
                    );
                }
                return Ok(created);
            };
            check_kind(&info, body)?;
            let (merged, applied) = patch::apply_merge(&live, body, &opts.field_manager);
            if !opts.force {
                let mut conflicts = Vec::new();
                for p in &applied {
                    let mut a = &live as &Value;
                    let mut b = body;
                    for seg in p {
                        a = &a[seg.as_str()];
                        b = &b[seg.as_str()];
                    }
                    if a != b && !a.is_null() {
                        for o in patch::owners_of(&live, p, &opts.field_manager) {
                            conflicts.push(format!("conflict with \"{o}\": .{}", p.join(".")));
                        }
                    }
                }
                if !conflicts.is_empty() {
                    let mut e = ApiError::conflict(&gr.group, &gr.resource, name, "");
                    e.message = format!(
                        "Apply failed with {} conflict{}: {}",
                        conflicts.len(),
                        if conflicts.len() == 1 { "" } else { "s" },
                        conflicts.join(", ")
                    );
                    return Err(e);
                }
            }
            let mut merged = merged;
            if let Some(m) = merged["metadata"].as_object_mut() {
                m.remove("resourceVersion");
            }
            if let Some(rv) = body["metadata"]["resourceVersion"].as_str() {
                merged["metadata"]["resourceVersion"] = json!(rv);
            }
            let out = self.update(gr, ns, name, merged, subresource, opts, "Apply")?;
            // Apply replaces the manager's field set with what it applied.
            let key = ObjectKey { gr: gr.clone(), namespace: ns.into(), name: name.into() };
            if let Some(slot) =
                self.objects.get_mut(gr).and_then(|b| b.get_mut(&(key.namespace.clone(), key.name.clone())))
            {
                let mut fixed = Arc::unwrap_or_clone(slot.value());
                let now = now_rfc3339();
                let api_version = fixed["apiVersion"].as_str().unwrap_or_default().to_string();
                patch::record_managed_fields(
                    Some(&out),
                    &mut fixed,
                    &WriteRecord {
                        manager: &opts.field_manager,
                        operation: "Apply",
                        subresource,
                        api_version: &api_version,
                        time: &now,
                        applied: Some(applied),
                    },
                );
                *slot = Stored::new(
                    &fixed,
                    self.packer.pack(gr, &fixed),
                    *gr == crd_gr(),
                    &mut self.interner,
                    Ids::default(),
                );
                return Ok(fixed);
            }
            return Ok(out);
        }
        let current = current.ok_or_else(|| ApiError::not_found(&gr.group, &gr.resource, name))?;
        let mut patched = patch::apply_patch(ty, &current, body)?;
        if ty != PatchType::Json
            && body["metadata"]["resourceVersion"].is_null()
            && let Some(m) = patched["metadata"].as_object_mut()
        {
            // Without an rv in the patch there is no precondition.
            m.remove("resourceVersion");
        }
        if ty == PatchType::Json
            && patched["metadata"]["resourceVersion"] == current["metadata"]["resourceVersion"]
            && let Some(m) = patched["metadata"].as_object_mut()
        {
            m.remove("resourceVersion");
        }
        self.update(gr, ns, name, patched, subresource, opts, "Update")
    }

    pub(crate) fn delete(
        &mut self,
        gr: &GroupResource,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Value, bool), ApiError> {
        let info = self.info(gr)?.clone();
        let ns = if info.namespaced { ns } else { "" };
        let obj = self.find(gr, ns, name).ok_or_else(|| ApiError::not_found(&gr.group, &gr.resource, name))?;
        if let Some(uid) = &opts.precondition_uid
            && obj["metadata"]["uid"].as_str() != Some(uid.as_str())
        {
            return Err(ApiError::conflict(
                &gr.group,
                &gr.resource,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    obj["metadata"]["uid"].as_str().unwrap_or_default()
                ),
            ));
        }
        if let Some(rv) = &opts.precondition_rv
            && obj["metadata"]["resourceVersion"].as_str() != Some(rv.as_str())
        {
            return Err(ApiError::conflict(
                &gr.group,
                &gr.resource,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    obj["metadata"]["resourceVersion"].as_str().unwrap_or_default()
                ),
            ));
        }
        let key = ObjectKey { gr: gr.clone(), namespace: ns.into(), name: name.into() };
        let is_pod = gr.group.is_empty() && gr.resource == "pods";
        let mut grace = 0i64;
        if is_pod {
            grace = opts
                .grace_period_seconds
                .unwrap_or_else(|| obj["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap_or(30));
            let phase = obj["status"]["phase"].as_str().unwrap_or_default();
            if obj["spec"]["nodeName"].as_str().unwrap_or_default().is_empty()
                || phase == "Succeeded"
                || phase == "Failed"
            {
                grace = 0;
            }
            grace = grace.max(0);
        }
        let mut fins = finalizers(&obj);
        let deleting = !obj["metadata"]["deletionTimestamp"].is_null();
        let policy_fin = match opts.propagation {
            Propagation::Foreground => Some(FOREGROUND),
            Propagation::Orphan => Some(ORPHAN),
            Propagation::Background => None,
        };
        if let Some(f) = policy_fin
            && !fins.iter().any(|x| x == f)
            && (!fins.is_empty()
                || grace > 0
                || self.dependents.contains_key(obj["metadata"]["uid"].as_str().unwrap_or_default())
                || f == FOREGROUND)
        {
            fins.push(f.to_string());
        }
        if *gr == ns_gr() && !deleting {
            let mut o = (*obj).clone();
            o["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            o["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            o["status"]["phase"] = json!("Terminating");
            let out = self.commit(key.clone(), o, Some(obj));
            self.work.push_back(Work::Deleting(key));
            return Ok((out, false));
        }
        if deleting {
            let mut o = (*obj).clone();
            let cur_grace = obj["metadata"]["deletionGracePeriodSeconds"].as_i64().unwrap_or(0);
            let mut changed = false;
            if is_pod && grace < cur_grace {
                o["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
                o["metadata"]["deletionTimestamp"] = json!(rfc3339_in(grace));
                changed = true;
            }
            if fins != finalizers(&obj) {
                set_finalizers(&mut o, &fins);
                changed = true;
            }
            if !changed {
                return Ok(((*obj).clone(), false));
            }
            self.commit(key.clone(), o.clone(), Some(obj));
            return Ok(match self.after_deleting_write(&key) {
                Some(gone) => (gone, true),
                None => (self.find(gr, ns, name).map(Arc::unwrap_or_clone).unwrap_or(o), false),
            });
        }
        if fins.is_empty() && grace == 0 {
            let gone = self.remove(&key).unwrap_or_else(|| (*obj).clone());
            return Ok((gone, true));
        }
        let mut o = (*obj).clone();
        o["metadata"]["deletionTimestamp"] = json!(rfc3339_in(grace));
        o["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        set_finalizers(&mut o, &fins);
        if spec_part(&o) == spec_part(&obj) {
            let g = o["metadata"]["generation"].as_i64().unwrap_or(1);
            o["metadata"]["generation"] = json!(g + 1);
        }
        let out = self.commit(key.clone(), o, Some(obj));
        if fins.iter().any(|f| f == FOREGROUND || f == ORPHAN || f == CRD_CLEANUP) {
            self.work.push_back(Work::Deleting(key));
        }
        Ok((out, false))
    }

    /// Drops one finalizer the server processes itself.
    fn drop_finalizer(&mut self, key: &ObjectKey, fin: &str) {
        let Some(obj) = self.find(&key.gr, &key.namespace, &key.name) else {
            return;
        };
        let mut f = finalizers(&obj);
        f.retain(|x| x != fin);
        let mut o = (*obj).clone();
        set_finalizers(&mut o, &f);
        self.commit(key.clone(), o, Some(obj));
        self.after_deleting_write(key);
    }

    /// Background deletion of a dependent or a namespace's content.
    fn delete_quietly(&mut self, key: &ObjectKey, propagation: Propagation) {
        let already = self.stored(&key.gr, &key.namespace, &key.name).is_none_or(|o| o.summary().deleting);
        if already {
            return;
        }
        let opts = DeleteOptions { propagation, ..Default::default() };
        // The object exists (checked above); a failure would only be a vanished object.
        let _ = self.delete(&key.gr, &key.namespace, &key.name, &opts);
    }

    /// Processes garbage collection and server-side finalizers until nothing is left to do.
    pub(crate) fn run_work(&mut self) {
        let mut guard = 0usize;
        while let Some(w) = self.work.pop_front() {
            guard += 1;
            if guard > 1_000_000 {
                self.work.clear();
                break;
            }
            match w {
                Work::Removed { uid, owners, key } => {
                    // Dependents whose owners are all gone are deleted; others lose the ref.
                    let deps: Vec<ObjectKey> =
                        self.dependents.get(&uid).map(|s| s.iter().cloned().collect()).unwrap_or_default();
                    for d in deps {
                        let Some(dep) = self.find(&d.gr, &d.namespace, &d.name) else {
                            continue;
                        };
                        let alive = owner_uids(&dep).iter().any(|u| self.uids.contains_key(u.as_str()));
                        if alive {
                            let mut o = (*dep).clone();
                            if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
                                refs.retain(|r| r["uid"].as_str() != Some(uid.as_str()));
                            }
                            self.commit(d, o, Some(dep));
                        } else {
                            self.delete_quietly(&d, Propagation::Background);
                        }
                    }
                    self.dependents.remove(&uid);
                    for o in owners {
                        if let Some(ok) = self.uids.get(o.as_str()).cloned() {
                            self.work.push_back(Work::Deleting(ok));
                        }
                    }
                    // Content of a terminating namespace, custom resources of a deleting CRD.
                    if !key.namespace.is_empty() {
                        let nk = ObjectKey { gr: ns_gr(), namespace: "".into(), name: key.namespace.clone() };
                        if self
                            .find(&nk.gr, "", &nk.name)
                            .is_some_and(|n| !n["metadata"]["deletionTimestamp"].is_null())
                        {
                            self.work.push_back(Work::Deleting(nk));
                        }
                    }
                    if !key.gr.group.is_empty()
                        && self.registry.get(&key.gr.group, &key.gr.resource).is_some_and(|r| !r.builtin)
                    {
                        let ck = ObjectKey {
                            gr: crd_gr(),
                            namespace: "".into(),
                            name: format!("{}.{}", key.gr.resource, key.gr.group).into(),
                        };
                        if self
                            .find(&ck.gr, "", &ck.name)
                            .is_some_and(|c| !c["metadata"]["deletionTimestamp"].is_null())
                        {
                            self.work.push_back(Work::Deleting(ck));
                        }
                    }
                }
                Work::Deleting(key) => self.process_deleting(&key),
            }
        }
    }

    fn process_deleting(&mut self, key: &ObjectKey) {
        let Some(obj) = self.find(&key.gr, &key.namespace, &key.name) else {
            return;
        };
        if obj["metadata"]["deletionTimestamp"].is_null() {
            return;
        }
        let fins = finalizers(&obj);
        let uid = obj["metadata"]["uid"].as_str().unwrap_or_default().to_string();
        if key.gr == ns_gr() {
            let mut left = 0usize;
            let namespaced: Vec<GroupResource> = self
                .registry
                .all()
                .iter()
                .filter(|r| r.namespaced)
                .map(|r| GroupResource::new(&r.group, &r.resource))
                .collect();
            for gr in namespaced {
                let names: Vec<String> =
                    self.iter_ns(&gr, Some(&key.name)).map(|o| o.summary().name.to_string()).collect();
                left += names.len();
                for n in names {
                    let k = ObjectKey { gr: gr.clone(), namespace: key.name.clone(), name: n.into() };
                    self.delete_quietly(&k, Propagation::Background);
                }
            }
            if left == 0 && fins.is_empty() {
                self.remove(key);
            }
            return;
        }
        if fins.iter().any(|f| f == ORPHAN) {
            let deps: Vec<ObjectKey> =
                self.dependents.get(&uid).map(|s| s.iter().cloned().collect()).unwrap_or_default();
            for d in deps {
                if let Some(dep) = self.find(&d.gr, &d.namespace, &d.name) {
                    let mut o = (*dep).clone();
                    if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
                        refs.retain(|r| r["uid"].as_str() != Some(uid.as_str()));
                        if refs.is_empty()
                            && let Some(m) = o["metadata"].as_object_mut()
                        {
                            m.remove("ownerReferences");
                        }
                    }
                    self.commit(d, o, Some(dep));
                }
            }
            self.dependents.remove(&uid);
            self.drop_finalizer(key, ORPHAN);
            return;
        }
        if fins.iter().any(|f| f == FOREGROUND) {
            let deps: Vec<ObjectKey> =
                self.dependents.get(&uid).map(|s| s.iter().cloned().collect()).unwrap_or_default();
            let mut blocking = 0;
            for d in deps {
                let Some(dep) = self.find(&d.gr, &d.namespace, &d.name) else {
                    continue;
                };
                let blocks = dep["metadata"]["ownerReferences"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|r| r["uid"].as_str() == Some(uid.as_str()) && r["blockOwnerDeletion"] == true);
                self.delete_quietly(&d, Propagation::Foreground);
                if blocks && self.stored(&d.gr, &d.namespace, &d.name).is_some() {
                    blocking += 1;
                }
            }
            if blocking == 0 {
                self.drop_finalizer(key, FOREGROUND);
            }
            return;
        }
        if key.gr == crd_gr() && fins.iter().any(|f| f == CRD_CLEANUP) {
            let group = obj["spec"]["group"].as_str().unwrap_or_default().to_string();
            let plural = obj["spec"]["names"]["plural"].as_str().unwrap_or_default().to_string();
            let gr = GroupResource::new(&group, &plural);
            let keys: Vec<ObjectKey> = self
                .iter_ns(&gr, None)
                .map(|o| ObjectKey {
                    gr: gr.clone(),
                    namespace: o.summary().namespace.clone(),
                    name: o.summary().name.as_ref().into(),
                })
                .collect();
            for k in &keys {
                self.delete_quietly(k, Propagation::Background);
            }
            if self.iter_ns(&gr, None).next().is_none() {
                self.drop_finalizer(key, CRD_CLEANUP);
            }
        }
    }

    /// Direct write of a new state without the HTTP semantics (used by eviction, binding and
    /// scale, which have checked what they need).
    pub(crate) fn put(&mut self, key: &ObjectKey, mut obj: Value, manager: &str, subresource: &str) -> Value {
        let old = self.find(&key.gr, &key.namespace, &key.name);
        let now = now_rfc3339();
        let api_version = obj["apiVersion"].as_str().unwrap_or_default().to_string();
        patch::record_managed_fields(
            old.as_deref(),
            &mut obj,
            &WriteRecord {
                manager,
                operation: "Update",
                subresource,
                api_version: &api_version,
                time: &now,
                applied: None,
            },
        );
        self.commit(key.clone(), obj, old)
    }
}

fn check_kind(info: &ResourceInfo, obj: &Value) -> Result<(), ApiError> {
    if let Some(k) = obj["kind"].as_str()
        && !k.is_empty()
        && k != info.kind
    {
        return Err(ApiError::bad_request(format!(
            "the kind in the body ({k}) does not match the kind of the resource ({})",
            info.kind
        )));
    }
    Ok(())
}

fn check_body_namespace(obj: &Value, ns: &str) -> Result<(), ApiError> {
    if let Some(n) = obj["metadata"]["namespace"].as_str()
        && !n.is_empty()
        && n != ns
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    Ok(())
}

fn validate_name(info: &ResourceInfo, name: &str) -> Result<(), ApiError> {
    let ok = name.len() <= 253
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            &info.group,
            &info.kind,
            name,
            "metadata.name",
            "FieldValueInvalid",
            &format!(
                "Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
            ),
        ))
    }
}

/// What the real strategies' PrepareForCreate do to status.
fn prepare_create(info: &ResourceInfo, obj: &mut Value) {
    if !info.status {
        return;
    }
    match (info.group.as_str(), info.resource.as_str()) {
        // kubelets register nodes with their status.
        ("", "nodes") => {}
        ("", "pods") => {
            obj["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
        }
        ("", "namespaces") => {
            obj["status"] = json!({"phase": "Active"});
            if obj["spec"]["finalizers"].is_null() {
                obj["spec"]["finalizers"] = json!(["kubernetes"]);
            }
        }
        _ => {
            if let Some(m) = obj.as_object_mut() {
                m.remove("status");
            }
        }
    }
}

fn crd_status(crd: &Value, info: &ResourceInfo) -> Value {
    let now = now_rfc3339();
    let names = crd["spec"]["names"].clone();
    json!({
        "acceptedNames": names,
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
        "storedVersions": [info.storage_version],
    })
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    hex(&format!("{rv}\u{1}{ns}\u{1}{name}"))
}

fn decode_continue(tok: &str) -> Result<(u64, String, String), ApiError> {
    let bad = || {
        ApiError::bad_request(
            "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)",
        )
    };
    if !tok.len().is_multiple_of(2) || !tok.is_ascii() {
        return Err(bad());
    }
    let bytes: Result<Vec<u8>, _> = (0..tok.len()).step_by(2).map(|i| u8::from_str_radix(&tok[i..i + 2], 16)).collect();
    let s = String::from_utf8(bytes.map_err(|_| bad())?).map_err(|_| bad())?;
    let mut parts = s.splitn(3, '\u{1}');
    let rv = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
    let ns = parts.next().ok_or_else(bad)?.to_string();
    let name = parts.next().ok_or_else(bad)?.to_string();
    Ok((rv, ns, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(name: &str, data: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"v": data}})
    }

    /// Like kube-apiserver's watch cache, the history drops changes older than its window once
    /// it holds more than its lower bound: a watch from before them gets 410. A list continues
    /// from its token all the same (its limit is etcd's compaction, not the watch cache).
    #[test]
    fn the_history_keeps_its_window_and_list_continuations_outlive_it() {
        let store = Store::new(10_000, 1);
        // a window wide enough that 150 writes on a loaded 2-core machine all fall inside it
        store.keep_history_for(Duration::from_millis(500));
        let gr = GroupResource::new("", "configmaps");
        let w = WriteOptions::manager("test");
        let rv_of = |o: Value| o["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap();
        let rvs: Vec<u64> =
            (0..150).map(|i| rv_of(store.create(&gr, "default", cm(&format!("c{i:03}"), "1"), &w).unwrap())).collect();
        let page = store.list(&gr, None, &ListOptions { limit: Some(10), ..Default::default() }).unwrap();
        assert!(store.watch_from(&gr, Some(rvs[0])).is_ok(), "nothing is old yet");
        std::thread::sleep(Duration::from_millis(600));
        store.create(&gr, "default", cm("late", "1"), &w).unwrap();
        let err = store.watch_from(&gr, Some(rvs[0])).unwrap_err();
        assert_eq!(err.to_status()["code"], 410);
        let (recent, _rx, _) = store.watch_from(&gr, Some(rvs[100])).unwrap();
        assert_eq!(recent.len(), 50, "the newest changes stay: 49 creations and the late one");
        let next = ListOptions { limit: Some(10), continue_token: page.continue_token, ..Default::default() };
        let rest = store.list(&gr, None, &next).unwrap();
        assert_eq!(&*rest.items[0].summary().name, "c010");
    }

    /// A loaded copy starts without the history of its loading: a watch from before gets 410, a
    /// watch from now sees the changes that follow, each with the version it replaced.
    #[test]
    fn a_forgotten_history_answers_410_before_and_replays_after() {
        let store = Store::new(10_000, 1);
        let gr = GroupResource::new("", "configmaps");
        let w = WriteOptions::manager("test");
        let rv_of = |o: &Value| o["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap();
        let first = store.create(&gr, "default", cm("a", "1"), &w).unwrap();
        store.create(&gr, "default", cm("b", "1"), &w).unwrap();
        store.forget_history();
        let listed = store.list(&gr, None, &ListOptions::default()).unwrap();
        assert_eq!(listed.items.len(), 2, "the objects stay");
        assert_eq!(store.watch_from(&gr, Some(rv_of(&first))).unwrap_err().to_status()["code"], 410);
        let (backlog, _rx, _) = store.watch_from(&gr, Some(listed.resource_version)).unwrap();
        assert!(backlog.is_empty());
        let mut changed = cm("a", "2");
        changed["metadata"]["resourceVersion"] = first["metadata"]["resourceVersion"].clone();
        store.update(&gr, "default", "a", changed, "", &w).unwrap();
        let (backlog, _rx, _) = store.watch_from(&gr, Some(listed.resource_version)).unwrap();
        assert_eq!(backlog.len(), 1);
        let Backlog::Past(ev) = &backlog[0].0 else { panic!("a change from the history") };
        let old = ev.old_json.as_ref().expect("the replaced version").value();
        assert_eq!(old["data"]["v"], "1");
    }

    /// A live receiver sees each change with the object it made and the version it replaced,
    /// also once the history no longer holds the key's earlier changes.
    #[test]
    fn live_changes_carry_the_version_each_one_replaced() {
        let store = Store::new(2, 1);
        let gr = GroupResource::new("", "configmaps");
        let w = WriteOptions::manager("test");
        let mut rx = store.subscribe();
        store.create(&gr, "default", cm("a", "1"), &w).unwrap();
        for v in ["2", "3", "4"] {
            let mut o = store.get(&gr, "default", "a").unwrap();
            o["data"]["v"] = json!(v);
            store.update(&gr, "default", "a", o, "", &w).unwrap();
        }
        store.delete(&gr, "default", "a", &DeleteOptions::default()).unwrap();
        let mut seen = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            if ev.key.gr != gr {
                continue;
            }
            let v = |o: Value| o["data"]["v"].as_str().unwrap().to_string();
            seen.push((ev.event_type, v(ev.object()), ev.old().map(v)));
        }
        let at = |t, o: &str, p: Option<&str>| (t, o.to_string(), p.map(str::to_string));
        assert_eq!(
            seen,
            [
                at(EventType::Added, "1", None),
                at(EventType::Modified, "2", Some("1")),
                at(EventType::Modified, "3", Some("2")),
                at(EventType::Modified, "4", Some("3")),
                at(EventType::Deleted, "4", Some("4")),
            ]
        );
    }

    /// A resumed watch gets every change after its resourceVersion with the object and the old
    /// version each change replaced, also when the entry holding that old version has already
    /// left the history; a resourceVersion older than the history gets 410.
    #[test]
    fn resumed_watches_replay_each_change_with_the_version_it_replaced() {
        let store = Store::new(4, 1);
        let gr = GroupResource::new("", "configmaps");
        let w = WriteOptions::manager("test");
        let mut rvs = Vec::new();
        for (name, v) in [("a", "1"), ("b", "1")] {
            let out = store.create(&gr, "default", cm(name, v), &w).unwrap();
            rvs.push(out["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap());
        }
        for v in ["2", "3", "4", "5"] {
            let mut o = store.get(&gr, "default", "a").unwrap();
            o["data"]["v"] = json!(v);
            let out = store.update(&gr, "default", "a", o, "", &w).unwrap();
            rvs.push(out["metadata"]["resourceVersion"].as_str().unwrap().parse::<u64>().unwrap());
        }
        // history of 4: a=2 (old a=1, whose entry has left), a=3, a=4, a=5
        let last = *rvs.last().unwrap();
        let (events, _rx, now) = store.watch_from(&gr, Some(last - 4)).unwrap();
        assert_eq!(now, last);
        let events: Vec<Arc<StoreEvent>> = events.iter().map(Backlogged::event).collect();
        let seen: Vec<(String, Option<String>)> = events
            .iter()
            .map(|e| {
                (
                    e.object()["data"]["v"].as_str().unwrap().to_string(),
                    e.old().map(|o| o["data"]["v"].as_str().unwrap().to_string()),
                )
            })
            .collect();
        let expect = |o: &str, p: &str| (o.to_string(), Some(p.to_string()));
        assert_eq!(seen, [expect("2", "1"), expect("3", "2"), expect("4", "3"), expect("5", "4")]);
        assert!(events.iter().all(|e| e.event_type == EventType::Modified && &*e.key.name == "a"));
        let err = store.watch_from(&gr, Some(last - 5)).unwrap_err();
        assert_eq!(err.to_status()["code"], 410);

        // a deleted and re-created object: the creation has no old version
        store.delete(&gr, "default", "b", &DeleteOptions::default()).unwrap();
        store.create(&gr, "default", cm("b", "9"), &w).unwrap();
        let (events, _rx, _) = store.watch_from(&gr, Some(last)).unwrap();
        let events: Vec<Arc<StoreEvent>> = events.iter().map(Backlogged::event).collect();
        let kinds: Vec<(EventType, bool)> = events.iter().map(|e| (e.event_type, e.old_json.is_some())).collect();
        assert_eq!(kinds, [(EventType::Deleted, true), (EventType::Added, false)]);
        assert_eq!(events[0].old().unwrap()["data"]["v"], "1", "the deletion replaced b=1");
    }

    /// A restored object keeps the managedFields it was given, and gets none when it was given
    /// none; a later write records only its own manager's fields.
    #[test]
    fn a_restored_object_keeps_exactly_the_field_managers_it_was_given() {
        let store = Store::new(16, 1);
        let gr = GroupResource::new("", "configmaps");
        let mut given = cm("managed", "1");
        let argo = json!([{"manager": "argocd-controller", "operation": "Apply", "apiVersion": "v1",
            "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:v": {}}}}]);
        given["metadata"]["managedFields"] = argo.clone();
        store.restore(&gr, "default", given).unwrap();
        assert_eq!(store.get(&gr, "default", "managed").unwrap()["metadata"]["managedFields"], argo);

        store.restore(&gr, "default", cm("bare", "1")).unwrap();
        let bare = store.get(&gr, "default", "bare").unwrap();
        assert!(bare["metadata"].get("managedFields").is_none(), "no manager invented: {bare}");

        let mut o = bare;
        o["data"]["v"] = json!("2");
        store.update(&gr, "default", "bare", o, "", &WriteOptions::manager("kubectl")).unwrap();
        let managers: Vec<String> = store.get(&gr, "default", "bare").unwrap()["metadata"]["managedFields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["manager"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(managers, ["kubectl"]);
    }
}
