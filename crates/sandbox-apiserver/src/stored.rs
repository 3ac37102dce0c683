//! An object as the store holds it: its JSON, plus the few fields that passes over many objects
//! read (labels, owner, node, phase, deletion), so that such a pass parses only what it acts on.
//!
//! A pod of 1.7 KB of JSON is 15 KB as a `serde_json::Value` (each of its ~19 small maps is a
//! B-tree leaf of 11 slots), and a rehearsal of a 1,000-node cluster holds up to 40,000 pods at
//! once: as values they were two thirds of its memory. The JSON is also the bytes the watch
//! history keeps and a watch or list writes, shared rather than serialized again, and kept
//! compressed ([`Json`]).

use std::sync::Arc;

use serde_json::Value;

use super::packed::Json;
use super::select::{FieldSelector, LabelSelector};

/// The fields of an object read by passes over many objects, taken when it is stored.
#[derive(Debug, Default)]
pub struct Summary {
    /// `apiVersion`: a watch or list at that version writes the JSON as it is.
    pub api_version: Box<str>,
    /// `metadata.namespace`; empty for cluster-scoped objects.
    pub namespace: Box<str>,
    /// `metadata.name`.
    pub name: Box<str>,
    /// `metadata.uid`.
    pub uid: Box<str>,
    /// `metadata.labels`, in key order.
    pub labels: Box<[(Box<str>, Box<str>)]>,
    /// The uid of the owner reference marked `controller: true`.
    pub controller_uid: Option<Box<str>>,
    /// Whether `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `spec.nodeName` (pods); empty when unset.
    pub node_name: Box<str>,
    /// `status.phase`; empty when unset.
    pub phase: Box<str>,
    /// `spec.schedulerName`, when set.
    pub scheduler_name: Option<Box<str>>,
}

fn boxed(v: &Value) -> Box<str> {
    v.as_str().unwrap_or_default().into()
}

impl Summary {
    fn of(obj: &Value) -> Summary {
        let meta = &obj["metadata"];
        Summary {
            api_version: boxed(&obj["apiVersion"]),
            namespace: boxed(&meta["namespace"]),
            name: boxed(&meta["name"]),
            uid: boxed(&meta["uid"]),
            labels: meta["labels"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.as_str().into(), boxed(v)))
                .collect(),
            controller_uid: meta["ownerReferences"]
                .as_array()
                .and_then(|a| a.iter().find(|r| r["controller"] == true))
                .map(|r| boxed(&r["uid"])),
            deleting: !meta["deletionTimestamp"].is_null(),
            node_name: boxed(&obj["spec"]["nodeName"]),
            phase: boxed(&obj["status"]["phase"]),
            scheduler_name: obj["spec"]["schedulerName"].as_str().map(Into::into),
        }
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
    pub(crate) fn new(obj: &Value, json: Json, keep_parsed: bool) -> Stored {
        Stored(Arc::new(Entry { summary: Summary::of(obj), parsed: keep_parsed.then(|| Arc::new(obj.clone())), json }))
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
        Stored::new(v, Json::plain(serde_json::to_vec(v).unwrap()), false)
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
}
