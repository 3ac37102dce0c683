//! The simulated Karpenter's view of every pod in the cluster: a small record per pod, kept
//! current by a watch.
//!
//! A rehearsal's copy holds up to 40,000 pods at once (its ReplicaSets create a Pending
//! replacement for each evicted pod, as real ones do), in the same process as the copy's API
//! server. kube's reflector keeps each pod as the type it was decoded into, whole `ObjectMeta`
//! included, under a key of four strings: even trimmed to the fields read here that was about
//! 100 MB of a rehearsal's 300 MB heap. A [`PodRecord`] keeps only what scheduling and draining
//! decide on, and pods made from one template share one [`Placement`].

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock};

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::watcher::Event;
use serde::Deserialize;
use tokio::sync::watch;

/// The annotation the kubelet puts on a static pod's mirror.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A pod as the watch decodes it: the fields the record is made from, nothing else. Decoded
/// objects live only until they are turned into a [`PodRecord`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WirePod {
    /// The pod's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What scheduling and draining read of the spec.
    pub spec: Option<WirePodSpec>,
    /// The phase.
    pub status: Option<WirePodStatus>,
}

/// What the simulation reads of a pod's spec.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WirePodSpec {
    /// The node it is bound to.
    pub node_name: Option<String>,
    /// Labels a node must carry.
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints it tolerates.
    pub tolerations: Option<Vec<Toleration>>,
    /// Its resolved priority.
    pub priority: Option<i32>,
    /// Its priority class.
    pub priority_class_name: Option<String>,
}

/// What the simulation reads of a pod's status.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WirePodStatus {
    /// Pending, Running, Succeeded, Failed.
    pub phase: Option<String>,
}

impl Resource for WirePod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn api_version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A pod's `status.phase`; an absent one reads as [`PodPhase::Pending`], as the API defaults it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    /// Not yet running (or no phase reported).
    Pending,
    /// Bound and running.
    Running,
    /// Ended well.
    Succeeded,
    /// Ended badly.
    Failed,
    /// The node stopped reporting.
    Unknown,
}

impl PodPhase {
    fn parse(phase: Option<&str>) -> PodPhase {
        match phase {
            Some("Running") => PodPhase::Running,
            Some("Succeeded") => PodPhase::Succeeded,
            Some("Failed") => PodPhase::Failed,
            Some("Unknown") => PodPhase::Unknown,
            _ => PodPhase::Pending,
        }
    }

    /// Succeeded or Failed: the pod holds no slot and is not drained.
    pub fn finished(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// One toleration, as the scheduling and draining checks compare it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodToleration {
    /// The taint key; `None` (or empty) with `Exists` tolerates every taint.
    pub key: Option<Box<str>>,
    /// `Exists` rather than `Equal`.
    pub exists: bool,
    /// The value compared under `Equal`.
    pub value: Option<Box<str>>,
    /// The effect tolerated; `None` (or empty) tolerates every effect.
    pub effect: Option<Box<str>>,
}

impl From<&Toleration> for PodToleration {
    fn from(t: &Toleration) -> PodToleration {
        PodToleration {
            key: t.key.as_deref().map(Box::from),
            exists: t.operator.as_deref() == Some("Exists"),
            value: t.value.as_deref().map(Box::from),
            effect: t.effect.as_deref().map(Box::from),
        }
    }
}

/// Where a pod may run: its node selector and tolerations. Every pod of a workload has the
/// same, so the cache keeps one of each distinct placement and the records share it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Placement {
    /// Labels a node must carry.
    pub node_selector: Box<[(Box<str>, Box<str>)]>,
    /// Taints it tolerates.
    pub tolerations: Box<[PodToleration]>,
}

/// What the simulated Karpenter knows of a pod.
#[derive(Debug, Clone)]
pub struct PodRecord {
    /// Its namespace.
    pub namespace: Box<str>,
    /// Its name.
    pub name: Box<str>,
    /// Its uid (the precondition of its eviction).
    pub uid: Box<str>,
    /// The node it is bound to.
    pub node_name: Option<Box<str>>,
    /// Its phase.
    pub phase: PodPhase,
    /// `system-cluster-critical` / `system-node-critical`, or a priority of two billion or more:
    /// Karpenter drains these last.
    pub critical: bool,
    /// Owned by a DaemonSet: never drained, never provisioned for.
    pub daemonset: bool,
    /// A static pod's mirror: never drained.
    pub mirror: bool,
    /// Has a deletion timestamp.
    pub deleting: bool,
    /// Its node selector and tolerations (shared with pods of the same template).
    pub placement: Arc<Placement>,
}

impl PodRecord {
    /// The record of `pod`, with its placement taken from (or added to) `placements`.
    fn from_wire(pod: &WirePod, placements: &mut HashSet<Arc<Placement>>) -> PodRecord {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        let placement = Placement {
            node_selector: spec
                .and_then(|s| s.node_selector.as_ref())
                .map(|sel| sel.iter().map(|(k, v)| (Box::from(k.as_str()), Box::from(v.as_str()))).collect())
                .unwrap_or_default(),
            tolerations: spec
                .and_then(|s| s.tolerations.as_ref())
                .map(|ts| ts.iter().map(PodToleration::from).collect())
                .unwrap_or_default(),
        };
        let placement = match placements.get(&placement) {
            Some(shared) => shared.clone(),
            None => {
                let shared = Arc::new(placement);
                placements.insert(shared.clone());
                shared
            }
        };
        PodRecord {
            namespace: meta.namespace.as_deref().unwrap_or_default().into(),
            name: meta.name.as_deref().unwrap_or_default().into(),
            uid: meta.uid.as_deref().unwrap_or_default().into(),
            node_name: spec.and_then(|s| s.node_name.as_deref()).map(Box::from),
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            critical: matches!(
                spec.and_then(|s| s.priority_class_name.as_deref()),
                Some("system-cluster-critical" | "system-node-critical")
            ) || spec.and_then(|s| s.priority).is_some_and(|p| p >= 2_000_000_000),
            daemonset: meta.owner_references.iter().flatten().any(|o| o.kind == "DaemonSet"),
            mirror: meta.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)),
            deleting: meta.deletion_timestamp.is_some(),
            placement,
        }
    }

    /// The record of a pod given as JSON (tests of the decisions made on records).
    #[cfg(test)]
    pub(crate) fn from_json(pod: serde_json::Value) -> PodRecord {
        let wire: WirePod = serde_json::from_value(pod).unwrap();
        PodRecord::from_wire(&wire, &mut HashSet::new())
    }
}

/// The records, keyed by uid, and the placements they share.
#[derive(Debug, Default)]
struct Records {
    pods: HashMap<Box<str>, Arc<PodRecord>>,
    /// Pods listed since the watch (re)started, which replace `pods` once the list is complete.
    relisting: Option<HashMap<Box<str>, Arc<PodRecord>>>,
    placements: HashSet<Arc<Placement>>,
    /// How many placements there were after the last sweep of unused ones.
    placements_swept_at: usize,
}

impl Records {
    /// The record of `pod` and its key; `None` for a pod without a uid, which an API server
    /// never serves.
    fn record(&mut self, pod: &WirePod) -> Option<(Box<str>, Arc<PodRecord>)> {
        pod.metadata.uid.as_ref()?;
        let record = PodRecord::from_wire(pod, &mut self.placements);
        Some((record.uid.clone(), Arc::new(record)))
    }

    /// Drops placements no record uses any more, once their number has doubled since the last
    /// sweep: a cluster whose workloads change keeps few of them, and sweeping on every event
    /// would cost a pass over them each time.
    fn sweep_placements(&mut self) {
        if self.placements.len() >= 2 * self.placements_swept_at.max(16) {
            self.placements.retain(|p| Arc::strong_count(p) > 1);
            self.placements_swept_at = self.placements.len();
        }
    }
}

/// Every pod in the cluster as a [`PodRecord`]: cheap to clone, read by the reconcile loop,
/// written by [`PodCache::apply`] from a pod watch.
#[derive(Debug, Clone)]
pub struct PodCache {
    records: Arc<RwLock<Records>>,
    ready: Arc<watch::Sender<bool>>,
}

impl Default for PodCache {
    fn default() -> PodCache {
        PodCache { records: Arc::default(), ready: Arc::new(watch::Sender::new(false)) }
    }
}

impl PodCache {
    /// An empty cache, not ready until a watch's first list has been applied.
    pub fn new() -> PodCache {
        PodCache::default()
    }

    /// Applies one event of a watch on pods. Like kube's reflector, a restarted watch's list is
    /// collected aside and replaces the records at once when it is complete, so readers never
    /// see a half-listed cluster.
    pub fn apply(&self, event: &Event<WirePod>) {
        let mut records = self.records.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            Event::Init => records.relisting = Some(HashMap::new()),
            Event::InitApply(pod) => {
                if let Some((uid, record)) = records.record(pod) {
                    records.relisting.get_or_insert_default().insert(uid, record);
                }
            }
            Event::InitDone => {
                let listed = records.relisting.take().unwrap_or_default();
                records.pods = listed;
                records.sweep_placements();
                self.ready.send_replace(true);
            }
            Event::Apply(pod) => {
                if let Some((uid, record)) = records.record(pod) {
                    records.pods.insert(uid, record);
                    records.sweep_placements();
                }
            }
            Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    records.pods.remove(uid);
                }
            }
        }
    }

    /// Every pod now known.
    pub fn state(&self) -> Vec<Arc<PodRecord>> {
        self.records.read().unwrap_or_else(PoisonError::into_inner).pods.values().cloned().collect()
    }

    /// The pods bound to `node`.
    pub fn on_node(&self, node: &str) -> Vec<Arc<PodRecord>> {
        let records = self.records.read().unwrap_or_else(PoisonError::into_inner);
        records.pods.values().filter(|p| p.node_name.as_deref() == Some(node)).cloned().collect()
    }

    /// Waits until the first complete list has been applied.
    pub async fn wait_until_ready(&self) {
        let mut ready = self.ready.subscribe();
        // Err: every sender is gone, so the cache will never fill; the caller's cancellation
        // decides what happens next.
        let _ = ready.wait_for(|r| *r).await;
    }

    /// How many distinct placements the cache holds.
    #[cfg(test)]
    fn placements(&self) -> usize {
        self.records.read().unwrap_or_else(PoisonError::into_inner).placements.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn wire(name: &str, uid: &str, extra: serde_json::Value) -> WirePod {
        let mut v = json!({"metadata": {"name": name, "namespace": "ns", "uid": uid}, "spec": {"containers": []}});
        if let (Some(spec), Some(more)) = (v["spec"].as_object_mut(), extra.as_object()) {
            spec.extend(more.clone());
        }
        serde_json::from_value(v).unwrap()
    }

    fn names(cache: &PodCache) -> Vec<String> {
        let mut n: Vec<String> = cache.state().iter().map(|p| p.name.to_string()).collect();
        n.sort();
        n
    }

    #[tokio::test]
    async fn a_relist_replaces_the_records_only_when_complete() {
        let cache = PodCache::new();
        cache.apply(&Event::Init);
        cache.apply(&Event::InitApply(wire("a", "1", json!({}))));
        assert!(cache.state().is_empty(), "a half-listed cluster is not shown");
        assert!(!*cache.ready.borrow());
        cache.apply(&Event::InitDone);
        cache.wait_until_ready().await;
        assert_eq!(names(&cache), ["a"]);

        cache.apply(&Event::Apply(wire("b", "2", json!({"nodeName": "n1"}))));
        assert_eq!(names(&cache), ["a", "b"]);
        assert_eq!(cache.on_node("n1").len(), 1);
        cache.apply(&Event::Delete(wire("a", "1", json!({}))));
        assert_eq!(names(&cache), ["b"]);

        // the watch restarts and lists again: a pod deleted meanwhile disappears at InitDone
        cache.apply(&Event::Init);
        cache.apply(&Event::InitApply(wire("c", "3", json!({}))));
        assert_eq!(names(&cache), ["b"]);
        cache.apply(&Event::InitDone);
        assert_eq!(names(&cache), ["c"]);
    }

    #[test]
    fn a_replacement_of_the_same_name_is_another_record() {
        let cache = PodCache::new();
        cache.apply(&Event::Apply(wire("a", "1", json!({}))));
        cache.apply(&Event::Apply(wire("a", "2", json!({}))));
        cache.apply(&Event::Delete(wire("a", "1", json!({}))));
        let left = cache.state();
        assert_eq!(left.len(), 1);
        assert_eq!(&*left[0].uid, "2");
    }

    #[test]
    fn pods_of_one_template_share_their_placement() {
        let cache = PodCache::new();
        let placed = json!({"nodeSelector": {"zone": "a"}, "tolerations": [{"key": "k", "operator": "Exists"}]});
        for i in 0..100 {
            cache.apply(&Event::Apply(wire(&format!("p{i}"), &i.to_string(), placed.clone())));
        }
        cache.apply(&Event::Apply(wire("other", "x", json!({"nodeSelector": {"zone": "b"}}))));
        assert_eq!(cache.placements(), 2);
        let state = cache.state();
        let shared = state.iter().filter(|p| p.placement.node_selector[0].1.as_ref() == "a").collect::<Vec<_>>();
        assert_eq!(shared.len(), 100);
        assert!(shared.iter().all(|p| Arc::ptr_eq(&p.placement, &shared[0].placement)));
        assert!(shared[0].placement.tolerations[0].exists);
    }

    #[test]
    fn records_carry_what_draining_and_scheduling_decide_on() {
        let ds = PodRecord::from_json(json!({"metadata": {"name": "d", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "x", "uid": "u"}]},
            "spec": {"containers": [], "priority": 2_000_001_000}, "status": {"phase": "Running"}}));
        assert!(ds.daemonset && ds.critical && !ds.mirror && !ds.deleting);
        assert_eq!(ds.phase, PodPhase::Running);
        let gone = PodRecord::from_json(json!({"metadata": {"name": "g", "deletionTimestamp": "2026-01-01T00:00:00Z",
            "annotations": {MIRROR_ANNOTATION: "x"}}, "spec": {"containers": []}, "status": {"phase": "Failed"}}));
        assert!(gone.deleting && gone.mirror && gone.phase.finished() && !gone.critical);
        let unset = PodRecord::from_json(json!({"metadata": {"name": "u"}}));
        assert_eq!(unset.phase, PodPhase::Pending);
    }
}
