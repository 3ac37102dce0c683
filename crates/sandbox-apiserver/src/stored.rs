//! An object as the store holds it: its JSON, plus the few fields that passes over many objects
//! read (labels, owner, node, phase, deletion), so that such a pass parses only what it acts on.
//!
//! A pod of 1.7 KB of JSON is 15 KB as a `serde_json::Value` (each of its ~19 small maps is a
//! B-tree leaf of 11 slots), and a rehearsal of a 1,000-node cluster holds up to 40,000 pods at
//! once: as values they were two thirds of its memory. The JSON is also the bytes the watch
//! history keeps and a watch or list writes, shared rather than serialized again, and kept
//! compressed ([`Json`]).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde_json::Value;

use super::packed::Json;
use super::select::{FieldSelector, LabelSelector};

/// The fields of an object read by passes over many objects, taken when it is stored. What pods
/// of one workload repeat (namespace, node, phase, owner, the label set) is shared between them
/// through the store's [`Interner`].
#[derive(Debug, Default)]
pub struct Summary {
    /// `apiVersion`: a watch or list at that version writes the JSON as it is.
    pub api_version: Arc<str>,
    /// `metadata.namespace`; empty for cluster-scoped objects.
    pub namespace: Arc<str>,
    /// `metadata.name`.
    pub name: Arc<str>,
    /// `metadata.uid`.
    pub uid: Arc<str>,
    /// `metadata.labels`, in key order.
    pub labels: Labels,
    /// The uid of the owner reference marked `controller: true`.
    pub controller_uid: Option<Arc<str>>,
    /// Whether `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `spec.nodeName` (pods); empty when unset.
    pub node_name: Arc<str>,
    /// `status.phase`; empty when unset.
    pub phase: Arc<str>,
    /// `spec.schedulerName`, when set.
    pub scheduler_name: Option<Arc<str>>,
    /// Whether `status.conditions` holds `Ready` with status `True`.
    pub ready: bool,
    /// A pod's `[spec.nodeSelector, spec.tolerations]` as JSON text, one copy for all the pods
    /// that have the same: what decides the nodes a pod may go to, so the scheduler groups
    /// pending pods by it without parsing each. `None` for other kinds.
    pub placement: Option<Arc<str>>,
}

/// An object's labels, in key order; shared by the objects that carry the same set.
pub type Labels = Arc<[(Arc<str>, Arc<str>)]>;

/// An object's name and uid as the store's keys already hold them, for its summary to share.
#[derive(Debug, Default)]
pub(crate) struct Ids {
    /// `metadata.name`, as the object's key holds it.
    pub name: Option<Arc<str>>,
    /// `metadata.uid`, as the store's index of uids holds it.
    pub uid: Option<Arc<str>>,
}

/// `held` if it is the text of `v`, else a copy of its own.
fn shared_or_own(held: Option<Arc<str>>, v: &Value) -> Arc<str> {
    let text = v.as_str().unwrap_or_default();
    held.filter(|h| **h == *text).unwrap_or_else(|| text.into())
}

/// The strings and label sets summaries share: one copy of each, however many objects carry it.
/// At 40,000 pods, a summary's own copies of its namespace, node, phase, owner and labels were
/// about 300 bytes of each. Entries no summary holds any more are dropped whenever the interner
/// has doubled since the last sweep, so it stays the size of what is stored.
#[derive(Debug, Default)]
pub(crate) struct Interner {
    strs: HashSet<Arc<str>>,
    /// By the hash of their pairs.
    label_sets: HashMap<u64, Vec<Labels>>,
    label_count: usize,
    swept_at: usize,
}

impl Interner {
    fn str(&mut self, v: &Value) -> Arc<str> {
        self.text(v.as_str().unwrap_or_default())
    }

    /// The shared copy of `s`.
    pub(crate) fn text(&mut self, s: &str) -> Arc<str> {
        if let Some(shared) = self.strs.get(s) {
            return shared.clone();
        }
        let shared: Arc<str> = s.into();
        self.strs.insert(shared.clone());
        shared
    }

    fn labels(&mut self, labels: &Value) -> Labels {
        let Some(map) = labels.as_object().filter(|m| !m.is_empty()) else { return Labels::default() };
        let mut pairs: Vec<(&str, &str)> =
            map.iter().map(|(k, v)| (k.as_str(), v.as_str().unwrap_or_default())).collect();
        // serde_json's maps are in key order already (no `preserve_order`); sorting keeps
        // `Summary::label`'s binary search right should that change
        pairs.sort_unstable();
        let hash = {
            let mut h = std::hash::DefaultHasher::new();
            pairs.hash(&mut h);
            h.finish()
        };
        let same = |set: &&Labels| {
            set.len() == pairs.len() && set.iter().zip(&pairs).all(|((k, v), (pk, pv))| **k == **pk && **v == **pv)
        };
        if let Some(shared) = self.label_sets.get(&hash).and_then(|sets| sets.iter().find(same)) {
            return shared.clone();
        }
        let set: Labels = pairs.iter().map(|(k, v)| (self.text(k), self.text(v))).collect();
        self.label_sets.entry(hash).or_default().push(set.clone());
        self.label_count += 1;
        set
    }

    fn sweep(&mut self) {
        let size = self.strs.len() + self.label_count;
        if size < 1024 || size < 2 * self.swept_at {
            return;
        }
        self.label_sets.retain(|_, sets| {
            sets.retain(|set| Arc::strong_count(set) > 1);
            !sets.is_empty()
        });
        self.label_count = self.label_sets.values().map(Vec::len).sum();
        self.strs.retain(|s| Arc::strong_count(s) > 1);
        self.swept_at = self.strs.len() + self.label_count;
    }
}

impl Summary {
    fn of(obj: &Value, interner: &mut Interner, ids: Ids) -> Summary {
        interner.sweep();
        let meta = &obj["metadata"];
        Summary {
            api_version: interner.str(&obj["apiVersion"]),
            namespace: interner.str(&meta["namespace"]),
            name: shared_or_own(ids.name, &meta["name"]),
            uid: shared_or_own(ids.uid, &meta["uid"]),
            labels: interner.labels(&meta["labels"]),
            controller_uid: meta["ownerReferences"]
                .as_array()
                .and_then(|a| a.iter().find(|r| r["controller"] == true))
                .map(|r| interner.str(&r["uid"])),
            deleting: !meta["deletionTimestamp"].is_null(),
            node_name: interner.str(&obj["spec"]["nodeName"]),
            phase: interner.str(&obj["status"]["phase"]),
            scheduler_name: obj["spec"]["schedulerName"]
                .is_string()
                .then(|| interner.str(&obj["spec"]["schedulerName"])),
            ready: obj["status"]["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True")),
            placement: (obj["kind"] == "Pod").then(|| {
                let spec = &obj["spec"];
                interner.text(&serde_json::json!([spec["nodeSelector"], spec["tolerations"]]).to_string())
            }),
        }
    }

    /// Whether a pod counts as healthy for its controller and its budgets: running, ready and
    /// not being deleted (the summary's reading of `pod_healthy`).
    pub fn pod_healthy(&self) -> bool {
        !self.deleting && &*self.phase == "Running" && self.ready
    }

    /// A label's value.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.binary_search_by(|(k, _)| (**k).cmp(key)).ok().map(|i| &*self.labels[i].1)
    }

    /// Whether a pod is in a terminal phase.
    pub fn terminal(&self) -> bool {
        matches!(&*self.phase, "Succeeded" | "Failed")
    }
}

#[derive(Debug)]
struct Entry {
    json: Json,
    summary: Summary,
    /// Kept parsed as well: a CRD is read (its schema) on every write of its kind, and a
    /// Karpenter CRD is over 100 KB of JSON.
    parsed: Option<Arc<Value>>,
}

/// One stored object: its JSON and its [`Summary`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Stored(Arc<Entry>);

impl Stored {
    /// Stores `obj`, already serialized as `json`; `keep_parsed` also keeps the value.
    pub(crate) fn new(obj: &Value, json: Json, keep_parsed: bool, interner: &mut Interner, ids: Ids) -> Stored {
        Stored(Arc::new(Entry {
            summary: Summary::of(obj, interner, ids),
            parsed: keep_parsed.then(|| Arc::new(obj.clone())),
            json,
        }))
    }

    /// The object as JSON.
    pub fn json(&self) -> &Json {
        &self.0.json
    }

    /// The fields passes over many objects read.
    pub fn summary(&self) -> &Summary {
        &self.0.summary
    }

    /// The object, parsed.
    pub fn value(&self) -> Arc<Value> {
        match &self.0.parsed {
            Some(v) => v.clone(),
            None => Arc::new(self.0.json.value()),
        }
    }

    /// Whether a label selector selects the object.
    pub fn selected_by(&self, sel: &LabelSelector) -> bool {
        sel.matches_with(|k| self.summary().label(k))
    }

    /// Whether a field selector selects the object at `namespace`/`name`; parses the object only
    /// for a field the summary does not hold.
    pub fn selected_by_fields(&self, sel: &FieldSelector, namespace: &str, name: &str) -> bool {
        let s = self.summary();
        let mut parsed: Option<Arc<Value>> = None;
        sel.matches_with(|field| {
            let hot = match field {
                "metadata.name" => Some(name),
                "metadata.namespace" => Some(namespace),
                "spec.nodeName" => Some(&*s.node_name),
                "status.phase" => Some(&*s.phase),
                "spec.schedulerName" => Some(s.scheduler_name.as_deref().unwrap_or_default()),
                _ => None,
            };
            match hot {
                Some(v) => v.to_string(),
                None => FieldSelector::field_text(parsed.get_or_insert_with(|| self.value()), field),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::kinds::Registry;

    fn stored(v: &Value) -> Stored {
        Stored::new(v, Json::plain(serde_json::to_vec(v).unwrap()), false, &mut Interner::default(), Ids::default())
    }

    /// The summary answers selectors exactly as the whole object does, for the fields it holds
    /// and (by parsing) for those it does not: a list or a watch must select the same pods either
    /// way.
    #[test]
    fn selectors_on_the_summary_answer_as_on_the_object() {
        let registry = Registry::new();
        let pods = registry.get("", "pods").unwrap();
        let running = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "apps", "uid": "u1", "labels": {"app": "web", "tier": "front"},
                "ownerReferences": [{"kind": "ReplicaSet", "name": "web", "uid": "rs1", "controller": true}]},
            "spec": {"nodeName": "ip-10-0-0-1", "restartPolicy": "Always", "containers": []},
            "status": {"phase": "Running", "podIP": "10.0.0.9"}});
        let pending = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "db-0", "namespace": "data", "uid": "u2", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"schedulerName": "custom"}, "status": {"phase": "Pending"}});
        let fields = [
            "spec.nodeName=ip-10-0-0-1",
            "spec.nodeName=",
            "spec.nodeName!=ip-10-0-0-1,status.phase=Running",
            "status.phase=Pending",
            "spec.schedulerName=custom",
            "spec.schedulerName=",
            "metadata.name=web-1,metadata.namespace=apps",
            "metadata.namespace!=apps",
            "spec.restartPolicy=Always",
            "status.podIP=10.0.0.9",
            "spec.hostNetwork=false",
        ];
        let labels = ["app=web", "app!=web", "tier in (front,back)", "!tier", "app", ""];
        for obj in [&running, &pending] {
            let s = stored(obj);
            let (ns, name) =
                (obj["metadata"]["namespace"].as_str().unwrap(), obj["metadata"]["name"].as_str().unwrap());
            for f in fields {
                let sel = FieldSelector::parse(f, pods).unwrap();
                assert_eq!(s.selected_by_fields(&sel, ns, name), sel.matches(obj), "{f} on {name}");
            }
            for l in labels {
                let sel = LabelSelector::parse(l).unwrap();
                assert_eq!(s.selected_by(&sel), sel.matches(obj), "{l} on {name}");
            }
        }
        let sum = stored(&running);
        assert_eq!(sum.summary().controller_uid.as_deref(), Some("rs1"));
        assert!(!sum.summary().deleting && stored(&pending).summary().deleting);
        assert_eq!(*sum.value(), running, "the stored JSON parses back to the object");
    }

    /// The controllers count ready pods and the scheduler groups pending ones from the summary
    /// alone: it must say what `pod_healthy` and the pod's own spec say.
    #[test]
    fn a_pods_health_and_placement_on_the_summary_answer_as_on_the_object() {
        let mut interner = Interner::default();
        let pod = |name: &str, phase: &str, ready: &str, deleting: bool, spec: Value| {
            let mut p = json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "apps", "uid": name},
                "spec": spec,
                "status": {"phase": phase, "conditions": [
                    {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready}]}});
            if deleting {
                p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            p
        };
        let web = json!({"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"}, "containers": []});
        let tolerant = json!({"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"},
            "tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}], "containers": []});
        let pods = [
            pod("a", "Running", "True", false, web.clone()),
            pod("b", "Running", "False", false, web.clone()),
            pod("c", "Running", "True", true, web.clone()),
            pod("d", "Pending", "True", false, web.clone()),
            pod("e", "Pending", "False", false, tolerant.clone()),
            pod("f", "Pending", "False", false, json!({"containers": []})),
        ];
        let stored: Vec<Stored> = pods
            .iter()
            .map(|p| Stored::new(p, Json::plain(serde_json::to_vec(p).unwrap()), false, &mut interner, Ids::default()))
            .collect();
        for (p, s) in pods.iter().zip(&stored) {
            assert_eq!(s.summary().pod_healthy(), crate::pod_healthy(p), "{}", p["metadata"]["name"]);
        }
        let placement = |i: usize| stored[i].summary().placement.clone().unwrap();
        assert!(Arc::ptr_eq(&placement(0), &placement(3)), "one copy for pods placed alike");
        assert_ne!(placement(0), placement(4), "tolerations are part of it");
        assert_ne!(placement(0), placement(5), "the node selector is part of it");
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        let node =
            Stored::new(&node, Json::plain(serde_json::to_vec(&node).unwrap()), false, &mut interner, Ids::default());
        assert!(node.summary().ready && node.summary().placement.is_none());
    }

    /// Pods of one template share their label set and repeated strings, read back as their own;
    /// what no stored object holds any more leaves the interner.
    #[test]
    fn summaries_share_what_pods_of_one_template_repeat() {
        let mut interner = Interner::default();
        let pod = |i: usize, app: &str| {
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("{app}-{i}"), "namespace": "apps", "uid": format!("u{i}"),
                    "labels": {"app": app, "pod-template-hash": "5d4f8b"},
                    "ownerReferences": [{"kind": "ReplicaSet", "name": app, "uid": format!("rs-{app}"), "controller": true}]},
                "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
        };
        let stored = |v: &Value, interner: &mut Interner| {
            Stored::new(v, Json::plain(serde_json::to_vec(v).unwrap()), false, interner, Ids::default())
        };
        let a = stored(&pod(1, "web"), &mut interner);
        let b = stored(&pod(2, "web"), &mut interner);
        let c = stored(&pod(3, "db"), &mut interner);
        let (sa, sb, sc) = (a.summary(), b.summary(), c.summary());
        assert!(Arc::ptr_eq(&sa.labels, &sb.labels) && !Arc::ptr_eq(&sa.labels, &sc.labels));
        assert!(Arc::ptr_eq(&sa.namespace, &sc.namespace) && Arc::ptr_eq(&sa.node_name, &sb.node_name));
        assert_eq!((sa.label("app"), sc.label("app"), sa.label("none")), (Some("web"), Some("db"), None));
        assert_eq!((&*sb.name, sb.controller_uid.as_deref(), &*sb.phase), ("web-2", Some("rs-web"), "Running"));
        drop((a, b, c));
        for i in 0..3000 {
            let _ = stored(&pod(i, &format!("app-{i}")), &mut interner);
        }
        assert!(interner.strs.len() + interner.label_count < 3000, "dropped objects' strings are swept");
    }
}
