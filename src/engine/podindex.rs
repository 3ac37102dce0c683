//! One watch over all pods, indexed by node, that every drain task waits on: draining a node
//! costs its evictions and no polling (design §2.3).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;

use crate::k8s::pods::{PodRef, drainable};

#[derive(Default)]
struct Index {
    /// node → uid → pod
    by_node: HashMap<String, BTreeMap<String, PodRef>>,
    /// uid → node, to find a deleted pod's node
    node_of: HashMap<String, String>,
    /// during a (re)list: the uids seen so far
    relisting: Option<HashMap<String, (String, Option<PodRef>)>>,
}

/// A live view of the drainable pods per node.
#[derive(Clone)]
pub struct PodIndex {
    inner: Arc<Mutex<Index>>,
    /// Bumped on every change; `synced` is true once the first list is complete.
    changes: watch::Sender<(u64, bool)>,
}

impl PodIndex {
    /// Starts the watch; the returned future runs it until dropped (the engine owns it).
    pub fn start(client: kube::Client) -> (PodIndex, impl Future<Output = ()> + Send + 'static) {
        let (tx, _) = watch::channel((0, false));
        let index = PodIndex { inner: Arc::new(Mutex::new(Index::default())), changes: tx };
        let me = index.clone();
        let fut = async move {
            let api: Api<Pod> = Api::all(client);
            let mut stream = watcher(api, watcher::Config::default().page_size(500)).default_backoff().boxed();
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(ev) => me.apply(ev),
                    Err(e) => tracing::warn!(error = %e, "pod watch interrupted; resuming"),
                }
            }
        };
        (index, fut)
    }

    fn apply(&self, ev: watcher::Event<Pod>) {
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut synced = self.changes.borrow().1;
        match ev {
            watcher::Event::Init => idx.relisting = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => {
                if let Some((uid, node, r)) = entry(&pod)
                    && let Some(seen) = idx.relisting.as_mut()
                {
                    seen.insert(uid, (node, r));
                }
            }
            watcher::Event::InitDone => {
                let seen = idx.relisting.take().unwrap_or_default();
                idx.by_node.clear();
                idx.node_of.clear();
                for (uid, (node, r)) in seen {
                    insert(&mut idx, uid, node, r);
                }
                synced = true;
            }
            watcher::Event::Apply(pod) => {
                if let Some((uid, node, r)) = entry(&pod) {
                    remove(&mut idx, &uid);
                    insert(&mut idx, uid, node, r);
                }
            }
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    remove(&mut idx, uid);
                }
            }
        }
        drop(idx);
        self.changes.send_modify(|(n, s)| {
            *n += 1;
            *s = synced;
        });
    }

    /// The drainable pods on `node` now.
    pub fn pods_on(&self, node: &str) -> Vec<PodRef> {
        let idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        idx.by_node.get(node).map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    /// A receiver that changes whenever the index does.
    pub fn subscribe(&self) -> watch::Receiver<(u64, bool)> {
        self.changes.subscribe()
    }

    /// Waits until the first full list has been read.
    pub async fn synced(&self) {
        let mut rx = self.subscribe();
        let _ = rx.wait_for(|(_, s)| *s).await;
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
    if let Some(r) = r {
        idx.by_node.entry(node.clone()).or_default().insert(uid.clone(), r);
        idx.node_of.insert(uid, node);
    }
}

fn remove(idx: &mut Index, uid: &str) {
    if let Some(node) = idx.node_of.remove(uid)
        && let Some(m) = idx.by_node.get_mut(&node)
    {
        m.remove(uid);
        if m.is_empty() {
            idx.by_node.remove(&node);
        }
    }
}
