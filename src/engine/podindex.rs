//! One watch over all pods, indexed by node, and one over all nodes, that every drain task waits
//! on: draining a node costs its evictions and no polling (design §2.3). The node watch tells a
//! drain whether its node is still fenced (cordoned and tainted), so that re-asserting the fence (design
//! §1.6) costs nothing while nobody undoes it; reading each draining node every few seconds cost
//! more requests than the evictions once every node drains at once.
//!
//! Each node has its own change signal: with one signal for the whole index, every pod event woke
//! every drain task (at 1,000 nodes that was tens of thousands of events times hundreds of tasks,
//! all spent re-reading unchanged nodes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;

use crate::k8s::nodes::is_fenced;
use crate::k8s::pods::{Labels, PodRef, drainable};

/// Labels as pods share them.
type SharedLabels = Arc<Labels>;

/// Memory: the index holds every drainable pod of the cluster (100,000 at 5,000
/// nodes), and each drain task takes its node's pods at every wake-up. So a pod is held once,
/// behind an `Arc` that a drain's copy only counts, a node's name once per node, and a label set
/// once for all the pods that carry it (the pods of one ReplicaSet; a StatefulSet's pods each
/// carry their own, which [`Labels`] keeps compact).
#[derive(Default)]
struct Index {
    /// node → its pods, in UID order (a node holds tens of pods: a sorted vector costs a
    /// pointer per pod where a map keyed by UID held a second copy of each UID)
    by_node: HashMap<Arc<str>, Vec<Arc<PodRef>>>,
    /// uid → node, to find a deleted pod's node, and the list that last saw the pod
    node_of: HashMap<String, (Arc<str>, u64)>,
    /// the label sets of the pods in the index, each held once, with how many pods in the index
    /// carry it (drains hold copies of pods that are gone: counting references would keep a
    /// set for as long as any drain looked at one of its pods)
    label_sets: HashMap<SharedLabels, usize>,
    /// which (re)list the pod watch is in or last finished: a relist writes each pod it reads
    /// straight into the index, marked with this number, and at its end removes the pods it did
    /// not read. Holding the list apart until its end, as the index once did, held a second
    /// copy of every pod, labels unshared: the tool's peak at 5,000 nodes.
    list_round: u64,
    /// node → its change signal, for the nodes someone waits on
    signals: HashMap<String, watch::Sender<u64>>,
    /// node → whether the node watch last saw it fenced (cordoned and tainted), and since when
    /// it has been seen so (the release of a machine waits for its fence to hold a while)
    fenced: HashMap<String, FenceSeen>,
    /// during a (re)list of the nodes: what was seen so far
    nodes_relisting: Option<HashMap<String, bool>>,
}

/// What the node watch last showed of one node's fence, and since when it has shown it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FenceSeen {
    fenced: bool,
    since: Instant,
}

impl Index {
    /// Records what the watch shows of `node`'s fence now; true when that changed.
    fn see_fence(&mut self, node: &str, fenced: bool, now: Instant) -> bool {
        match self.fenced.get_mut(node) {
            Some(seen) if seen.fenced == fenced => false,
            Some(seen) => {
                *seen = FenceSeen { fenced, since: now };
                true
            }
            None => {
                self.fenced.insert(node.to_string(), FenceSeen { fenced, since: now });
                true
            }
        }
    }

    fn changed(&self, node: &str) {
        if let Some(tx) = self.signals.get(node) {
            tx.send_modify(|n| *n += 1);
        }
    }
}

/// A live view of the drainable pods per node, and of whether each node is fenced.
#[derive(Clone)]
pub struct PodIndex {
    inner: Arc<Mutex<Index>>,
    /// True once the first list is complete.
    synced: watch::Sender<bool>,
}

impl PodIndex {
    /// Starts the watches; the returned future runs them until dropped (the engine owns it).
    pub fn start(client: kube::Client) -> (PodIndex, impl Future<Output = ()> + Send + 'static) {
        let (tx, _) = watch::channel(false);
        let index = PodIndex { inner: Arc::new(Mutex::new(Index::default())), synced: tx };
        let pods_to = index.clone();
        let nodes_to = index.clone();
        let pods: Api<Pod> = Api::all(client.clone());
        let nodes: Api<Node> = Api::all(client);
        let fut = async move {
            futures::future::join(
                follow(pods, "pod", move |ev| pods_to.apply(ev)),
                follow(nodes, "node", move |ev| nodes_to.apply_node(ev)),
            )
            .await;
        };
        (index, fut)
    }

    fn apply_node(&self, ev: watcher::Event<Node>) {
        let fenced = is_fenced;
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match ev {
            watcher::Event::Init => idx.nodes_relisting = Some(HashMap::new()),
            watcher::Event::InitApply(node) => {
                if let Some(name) = node.metadata.name.clone()
                    && let Some(seen) = idx.nodes_relisting.as_mut()
                {
                    seen.insert(name, fenced(&node));
                }
            }
            watcher::Event::InitDone => {
                // A node fenced before and after the watch was down keeps its `since`: a lift
                // and its repair while the watch was down go unseen here, but the release's
                // check on the server (its resourceVersion) does not miss them.
                let now = Instant::now();
                let seen = idx.nodes_relisting.take().unwrap_or_default();
                idx.fenced.retain(|name, _| seen.contains_key(name));
                for (name, fenced) in seen {
                    idx.see_fence(&name, fenced, now);
                }
                for tx in idx.signals.values() {
                    tx.send_modify(|n| *n += 1);
                }
            }
            watcher::Event::Apply(node) => {
                if let Some(name) = node.metadata.name.clone()
                    && idx.see_fence(&name, fenced(&node), Instant::now())
                {
                    idx.changed(&name);
                }
            }
            watcher::Event::Delete(node) => {
                if let Some(name) = node.metadata.name.as_deref()
                    && idx.fenced.remove(name).is_some()
                {
                    idx.changed(name);
                }
            }
        }
    }

    /// Whether the node watch last saw `node` fenced (cordoned and tainted); `None` if it has not seen the
    /// node (not listed yet, or deleted): only a read can tell then.
    pub fn fenced(&self, node: &str) -> Option<bool> {
        let idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        idx.fenced.get(node).map(|f| f.fenced)
    }

    /// Since when the node watch has shown `node` fenced without a break; `None` while it
    /// shows the fence lifted or does not show the node.
    pub(crate) fn fenced_since(&self, node: &str) -> Option<Instant> {
        let idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        idx.fenced.get(node).filter(|f| f.fenced).map(|f| f.since)
    }

    fn apply(&self, ev: watcher::Event<Pod>) {
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match ev {
            watcher::Event::Init => idx.list_round += 1,
            // A drain that reads the index meanwhile sees each pod as the list or the watch
            // before it last showed it: no older than what it saw before the relist began.
            watcher::Event::InitApply(pod) => {
                if let Some((uid, node, r)) = entry(&pod) {
                    remove(&mut idx, &uid);
                    insert(&mut idx, uid, node, r);
                }
            }
            watcher::Event::InitDone => {
                let round = idx.list_round;
                let unseen: Vec<String> =
                    idx.node_of.iter().filter(|(_, (_, seen))| *seen != round).map(|(uid, _)| uid.clone()).collect();
                for uid in unseen {
                    remove(&mut idx, &uid);
                }
                // anything may have changed while the watch was down
                for tx in idx.signals.values() {
                    tx.send_modify(|n| *n += 1);
                }
                drop(idx);
                self.synced.send_replace(true);
            }
            watcher::Event::Apply(pod) => {
                if let Some((uid, node, r)) = entry(&pod) {
                    if let Some(old) = remove(&mut idx, &uid) {
                        idx.changed(&old);
                    }
                    insert(&mut idx, uid, node.clone(), r);
                    idx.changed(&node);
                }
            }
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref()
                    && let Some(old) = remove(&mut idx, uid)
                {
                    idx.changed(&old);
                }
            }
        }
    }

    /// The drainable pods on `node` now.
    pub fn pods_on(&self, node: &str) -> Vec<Arc<PodRef>> {
        let idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        idx.by_node.get(node).cloned().unwrap_or_default()
    }

    /// A receiver that changes whenever the pods on `node` may have (and after every relist).
    pub fn subscribe(&self, node: &str) -> watch::Receiver<u64> {
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        idx.signals.entry(node.to_string()).or_insert_with(|| watch::channel(0).0).subscribe()
    }

    /// Waits until the first full list has been read.
    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }
}

/// Feeds one watch's events to `apply` for as long as it runs, resuming after errors.
pub(super) async fn follow<K>(api: Api<K>, what: &'static str, apply: impl Fn(watcher::Event<K>))
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut stream = watcher(api, watcher::Config::default().page_size(500)).default_backoff().boxed();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(ev) => apply(ev),
            Err(e) => tracing::warn!(error = %e, "{what} watch interrupted; resuming"),
        }
    }
}

fn entry(pod: &Pod) -> Option<(String, String, Option<PodRef>)> {
    let uid = pod.metadata.uid.clone()?;
    let node = pod.spec.as_ref()?.node_name.clone()?;
    // terminal pods hold nothing on the node; like kubectl drain, they do not block it
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let r = if matches!(phase, Some("Succeeded" | "Failed")) { None } else { drainable(pod) };
    Some((uid, node, r))
}

fn insert(idx: &mut Index, uid: String, node: String, r: Option<PodRef>) {
    let Some(mut r) = r else { return };
    if let Some((shared, _)) = idx.label_sets.get_key_value(&r.labels) {
        r.labels = shared.clone();
    }
    *idx.label_sets.entry(r.labels.clone()).or_default() += 1;
    let node: Arc<str> = match idx.by_node.get_key_value(node.as_str()) {
        Some((shared, _)) => shared.clone(),
        None => node.into(),
    };
    let pods = idx.by_node.entry(node.clone()).or_default();
    let replaced = match pods.binary_search_by(|p| p.uid.as_str().cmp(&uid)) {
        Ok(i) => Some(std::mem::replace(&mut pods[i], Arc::new(r))),
        Err(i) => {
            pods.insert(i, Arc::new(r));
            None
        }
    };
    // callers remove a pod before they insert it again; should one not, its old labels still go
    if let Some(old) = replaced {
        forget_labels(idx, &old.labels);
    }
    let round = idx.list_round;
    idx.node_of.insert(uid, (node, round));
}

/// Removes a pod; returns the node it was on.
fn remove(idx: &mut Index, uid: &str) -> Option<Arc<str>> {
    let (node, _) = idx.node_of.remove(uid)?;
    let mut gone = None;
    if let Some(m) = idx.by_node.get_mut(&node) {
        gone = m.binary_search_by(|p| p.uid.as_str().cmp(uid)).ok().map(|i| m.remove(i));
        if m.is_empty() {
            idx.by_node.remove(&node);
        }
    }
    if let Some(gone) = gone {
        forget_labels(idx, &gone.labels);
    }
    Some(node)
}

/// Drops the index's copy of a label set once no pod in the index carries it.
fn forget_labels(idx: &mut Index, labels: &SharedLabels) {
    if let Some(pods) = idx.label_sets.get_mut(labels) {
        *pods -= 1;
        if *pods == 0 {
            idx.label_sets.remove(labels);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str, node: &str, app: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some("shop".into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                labels: Some([("app".to_string(), app.to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec { node_name: Some(node.into()), ..PodSpec::default() }),
            ..Pod::default()
        }
    }

    fn index() -> PodIndex {
        PodIndex { inner: Arc::new(Mutex::new(Index::default())), synced: watch::channel(false).0 }
    }

    /// A whole (re)list of `pods` (name, node, app).
    fn list(idx: &PodIndex, pods: &[(&str, &str, &str)]) {
        idx.apply(watcher::Event::Init);
        for (name, node, app) in pods {
            idx.apply(watcher::Event::InitApply(pod(name, node, app)));
        }
        idx.apply(watcher::Event::InitDone);
    }

    #[test]
    fn pods_with_the_same_labels_share_one_copy_until_the_last_is_gone() {
        let idx = index();
        list(&idx, &[("web-1", "n1", "web"), ("web-2", "n2", "web"), ("db-0", "n1", "db")]);
        let (n1, n2) = (idx.pods_on("n1"), idx.pods_on("n2"));
        let web1 = n1.iter().find(|p| p.name == "web-1").expect("web-1 on n1");
        let db = n1.iter().find(|p| p.name == "db-0").expect("db-0 on n1");
        assert!(Arc::ptr_eq(&web1.labels, &n2[0].labels), "one label set for both web pods");
        assert!(!Arc::ptr_eq(&web1.labels, &db.labels));
        assert_eq!(idx.inner.lock().unwrap().label_sets.len(), 2);

        // a pod moved by a later event (a new node) is found on its new node only
        idx.apply(watcher::Event::Apply(pod("web-2", "n3", "web")));
        assert!(idx.pods_on("n2").is_empty());
        assert_eq!(idx.pods_on("n3")[0].name, "web-2");

        idx.apply(watcher::Event::Delete(pod("web-1", "n1", "web")));
        assert_eq!(idx.inner.lock().unwrap().label_sets.len(), 2, "web-2 still carries the web labels");
        // a drain still holds copies of both web pods: the set goes all the same
        idx.apply(watcher::Event::Delete(pod("web-2", "n3", "web")));
        let inner = idx.inner.lock().unwrap();
        assert_eq!(inner.label_sets.len(), 1, "only db's labels are left");
        assert_eq!(inner.by_node.keys().map(|k| &**k).collect::<Vec<_>>(), ["n1"]);
        assert_eq!(inner.node_of.len(), 1);
    }

    #[test]
    fn a_relist_drops_the_pods_it_did_not_read_and_wakes_every_drain() {
        let idx = index();
        list(&idx, &[("web-1", "n1", "web"), ("web-2", "n1", "web"), ("db-0", "n2", "db")]);
        let mut n1 = idx.subscribe("n1");
        n1.mark_unchanged();

        // the watch was down: web-1 went away, db-0 moved to n1, cache-0 came
        idx.apply(watcher::Event::Init);
        for (name, node, app) in [("web-2", "n1", "web"), ("db-0", "n1", "db"), ("cache-0", "n3", "cache")] {
            idx.apply(watcher::Event::InitApply(pod(name, node, app)));
        }
        assert!(!n1.has_changed().unwrap(), "no drain is woken before the list is whole");
        idx.apply(watcher::Event::InitDone);
        assert!(n1.has_changed().unwrap());

        let mut on_n1: Vec<String> = idx.pods_on("n1").iter().map(|p| p.name.clone()).collect();
        on_n1.sort();
        assert_eq!(on_n1, ["db-0", "web-2"]);
        assert!(idx.pods_on("n2").is_empty());
        assert_eq!(idx.pods_on("n3")[0].name, "cache-0");
        let inner = idx.inner.lock().unwrap();
        assert_eq!(inner.node_of.len(), 3);
        let counts: std::collections::BTreeMap<String, usize> =
            inner.label_sets.iter().map(|(l, n)| (l.get("app").unwrap_or_default().to_string(), *n)).collect();
        assert_eq!(counts, [("cache".to_string(), 1), ("db".to_string(), 1), ("web".to_string(), 1)].into());
    }
    fn node(name: &str, fenced: bool) -> Node {
        let mut n: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": {}})).unwrap();
        if fenced {
            let spec = n.spec.get_or_insert_default();
            spec.unschedulable = Some(true);
            spec.taints = Some(vec![k8s_openapi::api::core::v1::Taint {
                key: crate::k8s::nodes::TAINT_DRAINING.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]);
        }
        n
    }

    #[test]
    fn a_fence_holds_since_the_watch_last_saw_it_put_back_and_a_relist_keeps_an_unbroken_one() {
        let idx = index();
        idx.apply_node(watcher::Event::Init);
        idx.apply_node(watcher::Event::InitApply(node("a", true)));
        idx.apply_node(watcher::Event::InitApply(node("b", false)));
        idx.apply_node(watcher::Event::InitDone);
        let a_since = idx.fenced_since("a").expect("a is fenced");
        assert_eq!(idx.fenced_since("b"), None, "b is not fenced");
        assert_eq!(idx.fenced_since("c"), None, "c was never seen");
        // another write to a fenced node (a label, a status) does not restart its hold
        idx.apply_node(watcher::Event::Apply(node("a", true)));
        assert_eq!(idx.fenced_since("a"), Some(a_since));
        // a lift ends the hold; the fence put back starts a new one
        idx.apply_node(watcher::Event::Apply(node("a", false)));
        assert_eq!(idx.fenced_since("a"), None);
        assert_eq!(idx.fenced("a"), Some(false));
        std::thread::sleep(std::time::Duration::from_millis(2));
        idx.apply_node(watcher::Event::Apply(node("a", true)));
        let again = idx.fenced_since("a").expect("fenced again");
        assert!(again > a_since, "the hold starts again when the fence is put back");
        // a relist that shows the node fenced still keeps the hold; a node it no longer shows goes
        idx.apply_node(watcher::Event::Init);
        idx.apply_node(watcher::Event::InitApply(node("a", true)));
        idx.apply_node(watcher::Event::InitDone);
        assert_eq!(idx.fenced_since("a"), Some(again));
        assert_eq!(idx.fenced("b"), None, "b was not in the relist");
    }
}
