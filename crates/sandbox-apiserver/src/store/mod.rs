//! The object store: JSON objects keyed by (group, resource, namespace, name), one global
//! resourceVersion, finalizers, graceful deletion, garbage collection and a change stream.
//! The HTTP layer and the simulated controllers both act through [`Store`].
//!
//! Each concern has a file: [`history`] keeps the watch history (what a resumed watch replays,
//! and the 410 floor), [`writes`] creates, restores, updates and patches (with the admission
//! and validation an object gets before it is stored), and [`deletion`] deletes (grace periods,
//! finalizers, garbage collection). This file holds the public types, the state of [`Inner`]
//! and the core every change goes through: lookup, `commit`, `remove`, `put`, and lists with
//! their continuation tokens.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::kinds::{Registry, ResourceInfo};
use super::packed::{Json, Packer};
use super::patch::{self, PatchType, WriteRecord};
use super::select::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::stored::{Ids, Interner, Stored};

mod deletion;
mod history;
mod writes;

use deletion::Work;
pub use history::Backlogged;
use history::{HistoryEntry, KeyHistory};

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

/// A value from JSON the store wrote (anything else reads as `null`).
pub(crate) fn json_value(b: &[u8]) -> Value {
    // The bytes are what `json_bytes` wrote.
    serde_json::from_slice(b).unwrap_or(Value::Null)
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
    /// `dryRun=All`: admitted and answered as if written, nothing stored.
    pub dry_run: bool,
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
    /// `dryRun: ["All"]`: checked and answered as if deleted, nothing changed.
    pub dry_run: bool,
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
            dry_run: dry_run_value(&v["dryRun"], "DeleteOptions")?,
        })
    }
}

/// Reads a `dryRun` list as kube-apiserver validates it: absent or empty is a real write, `All`
/// is the only other value it accepts (apimachinery's `ValidateDryRun`).
pub fn dry_run_value(v: &Value, options_kind: &str) -> Result<bool, ApiError> {
    let values: Vec<&str> = match v {
        Value::Null => return Ok(false),
        Value::String(s) => vec![s.as_str()],
        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
        _ => vec![""],
    };
    match values.as_slice() {
        [] => Ok(false),
        ["All"] => Ok(true),
        other => Err(ApiError::invalid(
            "meta.k8s.io",
            options_kind,
            "",
            "dryRun",
            "FieldValueNotSupported",
            &format!("Unsupported value: {other:?}: supported values: \"All\""),
        )),
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

/// An object's namespace and name, the order lists return objects in.
type NsName = (Arc<str>, Arc<str>);
type Bucket = BTreeMap<NsName, Stored>;

fn is_pods(gr: &GroupResource) -> bool {
    gr.group.is_empty() && gr.resource == "pods"
}

pub(crate) struct Inner {
    pub(crate) rv: u64,
    pub(crate) registry: Registry,
    objects: HashMap<GroupResource, Bucket>,
    /// The keys of the pods bound to each node, as kube-apiserver's watch cache indexes pods by
    /// `spec.nodeName` (k8s.io/kubernetes pkg/registry/core/pod/storage/storage.go, `Indexers`):
    /// a list of one node's pods reads those, not every pod of the cluster under the store's lock.
    pods_by_node: HashMap<Arc<str>, BTreeSet<NsName>>,
    uids: HashMap<Arc<str>, ObjectKey>,
    dependents: HashMap<String, BTreeSet<ObjectKey>>,
    history: VecDeque<HistoryEntry>,
    /// Per key with entries in the history: how many, and its base.
    history_keys: HashMap<ObjectKey, KeyHistory>,
    history_cap: usize,
    /// How long a change stays in the history once it is no longer among the newest
    /// [`HISTORY_LOWER_BOUND`](history::HISTORY_LOWER_BOUND); `None`: until the cap pushes it out.
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
        // and the process's peak memory was the same (3.0 GiB) either way. A 5,000-node drain
        // writes about 2,000 changes a second, so 16,384 left the control plane 8 s for a pass, and
        // each pass longer than that ended in a resynchronisation that made the next one longer.
        let (tx, _) = broadcast::channel(65_536);
        let inner = Inner {
            rv: 1,
            registry: Registry::new(),
            objects: HashMap::new(),
            pods_by_node: HashMap::new(),
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

    /// The object with this uid, and its resource.
    pub(crate) fn by_uid(&self, uid: &str) -> Option<(&GroupResource, &Stored)> {
        let key = self.uids.get(uid)?;
        let stored = self.objects.get(&key.gr)?.get(&(key.namespace.clone(), key.name.clone()))?;
        // a name the object's successor took since
        (*stored.summary().uid == *uid).then_some((&key.gr, stored))
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
        if is_pods(&key.gr) {
            let before = self.stored(&key.gr, &key.namespace, &key.name).map(|s| s.summary().node_name.clone());
            self.index_pod(&key, before.as_ref(), Some(&stored.summary().node_name));
        }
        self.objects.entry(key.gr).or_default().insert((key.namespace, key.name), stored);
        obj
    }

    /// Moves a pod's key in [`Inner::pods_by_node`] from the node it was bound to (if any) to the
    /// one it is bound to now (if any); unbound pods are not indexed.
    fn index_pod(&mut self, key: &ObjectKey, from: Option<&Arc<str>>, to: Option<&Arc<str>>) {
        if from == to {
            return;
        }
        let entry = (key.namespace.clone(), key.name.clone());
        if let Some(node) = from.filter(|n| !n.is_empty())
            && let Some(set) = self.pods_by_node.get_mut(node)
        {
            set.remove(&entry);
            if set.is_empty() {
                self.pods_by_node.remove(node);
            }
        }
        if let Some(node) = to.filter(|n| !n.is_empty()) {
            self.pods_by_node.entry(node.clone()).or_default().insert(entry);
        }
    }

    /// Removes an object for good.
    fn remove(&mut self, key: &ObjectKey) -> Option<Value> {
        let old = self.objects.get_mut(&key.gr)?.remove(&(key.namespace.clone(), key.name.clone()))?;
        if is_pods(&key.gr) {
            self.index_pod(key, Some(&old.summary().node_name), None);
        }
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
        // one node's pods: only the keys indexed under it (the filters below still decide)
        let node =
            opts.fields.as_ref().and_then(|f| f.required("spec.nodeName")).filter(|n| is_pods(gr) && !n.is_empty());
        if let Some(bucket) = self.objects.get(gr) {
            let candidates: Box<dyn Iterator<Item = (&NsName, &Stored)>> = match node {
                Some(node) => Box::new(
                    self.pods_by_node
                        .get(node)
                        .into_iter()
                        .flat_map(move |keys| keys.range((start.clone(), Bound::Unbounded)))
                        .filter_map(|k| bucket.get_key_value(k)),
                ),
                None => Box::new(bucket.range((start, Bound::Unbounded))),
            };
            for ((kns, kname), obj) in candidates {
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

    /// Direct write of a new state without the HTTP semantics (used by eviction, binding and
    /// scale, which have checked what they need).
    pub(crate) fn put(&mut self, key: &ObjectKey, mut obj: Value, manager: &str, subresource: &str) -> Value {
        writes::go_shape(&key.gr, &mut obj);
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

    pub(super) fn cm(name: &str, data: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"v": data}})
    }

    fn pod(name: &str, node: Option<&str>) -> Value {
        let mut spec = json!({"containers": [{"name": "c", "image": "busybox"}]});
        if let Some(n) = node {
            spec["nodeName"] = json!(n);
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})
    }

    fn names(list: &ObjectList) -> Vec<String> {
        list.items
            .iter()
            .map(|o| {
                format!(
                    "{}/{}",
                    o.value()["metadata"]["namespace"].as_str().unwrap(),
                    o.value()["metadata"]["name"].as_str().unwrap()
                )
            })
            .collect()
    }

    /// A list of one node's pods reads the node index; it must answer exactly what a scan of
    /// every pod answers, page by page, as pods are created, bound, and deleted.
    #[test]
    fn a_list_of_one_nodes_pods_answers_what_a_scan_of_every_pod_does() {
        let store = Store::new(1024, 1);
        let gr = GroupResource::new("", "pods");
        let info = Registry::new().get("", "pods").unwrap().clone();
        let opts = WriteOptions::manager("t");
        for ns in ["a", "b"] {
            let namespace = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            store.create(&GroupResource::new("", "namespaces"), "", namespace, &opts).unwrap();
        }
        for i in 0..30 {
            let node = ["n0", "n1", "n2"].get(i % 4).copied();
            store.create(&gr, ["a", "b"][i % 2], pod(&format!("p{i}"), node), &opts).unwrap();
        }
        store
            .delete(&gr, "a", "p4", &DeleteOptions { grace_period_seconds: Some(0), ..DeleteOptions::default() })
            .unwrap();
        // an unbound pod bound later (as the binding subresource writes it)
        store.with(|inner| {
            let key = ObjectKey { gr: gr.clone(), namespace: "b".into(), name: "p3".into() };
            let mut bound = Arc::unwrap_or_clone(inner.find(&gr, "b", "p3").unwrap());
            bound["spec"]["nodeName"] = json!("n1");
            inner.put(&key, bound, "kube-scheduler", "binding");
        });
        let every = |selector: &str| {
            let fields = FieldSelector::parse(selector, &info).unwrap();
            let all = store.list(&gr, None, &ListOptions::default()).unwrap();
            let mut want: Vec<String> = Vec::new();
            for o in &all.items {
                let v = o.value();
                if fields.matches(&v) {
                    want.push(format!(
                        "{}/{}",
                        v["metadata"]["namespace"].as_str().unwrap(),
                        v["metadata"]["name"].as_str().unwrap()
                    ));
                }
            }
            want
        };
        for node in ["n0", "n1", "n2", "n9"] {
            let selector = format!("spec.nodeName={node}");
            let want = every(&selector);
            let fields = Some(FieldSelector::parse(&selector, &info).unwrap());
            let got = store.list(&gr, None, &ListOptions { fields: fields.clone(), ..ListOptions::default() }).unwrap();
            assert_eq!(names(&got), want, "{node}");
            // page by page, 2 at a time, from continue tokens
            let mut paged = Vec::new();
            let mut token = None;
            loop {
                let page = store
                    .list(
                        &gr,
                        None,
                        &ListOptions {
                            fields: fields.clone(),
                            limit: Some(2),
                            continue_token: token,
                            ..ListOptions::default()
                        },
                    )
                    .unwrap();
                paged.extend(names(&page));
                token = page.continue_token;
                if token.is_none() {
                    break;
                }
            }
            assert_eq!(paged, want, "{node}, paged");
            // within one namespace
            let in_a = store.list(&gr, Some("a"), &ListOptions { fields, ..ListOptions::default() }).unwrap();
            let want_a: Vec<String> = want.iter().filter(|n| n.starts_with("a/")).cloned().collect();
            assert_eq!(names(&in_a), want_a, "{node}, namespace a");
        }
        assert!(every("spec.nodeName=n1").contains(&"b/p3".to_string()), "the bound pod is indexed under its node");
        assert!(!every("spec.nodeName=n0").contains(&"a/p4".to_string()));
    }
}
