//! The watch history: the changes a watch resumes from, kept as JSON for a window as
//! kube-apiserver's watch cache keeps them, the resourceVersion below which a watch gets 410,
//! and the replay of a resumed watch.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use super::{EventType, GroupResource, Inner, ObjectKey, Store, StoreEvent};
use crate::packed::Json;
use crate::status::ApiError;
use crate::stored::Stored;

/// One change as the watch history keeps it: the objects serialized. A pod with its
/// managedFields takes several times more memory as a `serde_json::Value` (every small map is a
/// B-tree node) than as JSON; the history holds up to [`crate::ServerOptions::watch_history`]
/// changes, most of them versions no longer current, so it keeps bytes and rebuilds values only
/// for a watch that resumes from an older resourceVersion.
#[derive(Debug)]
pub(super) struct HistoryEntry {
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
pub(super) struct KeyHistory {
    entries: usize,
    base: Option<Json>,
    latest: Option<Json>,
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

/// Changes the history keeps whatever their age: kube-apiserver's watch cache never shrinks
/// below 100 events (`defaultLowerBoundCapacity`).
pub(super) const HISTORY_LOWER_BOUND: usize = 100;

impl Store {
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
}

impl Inner {
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

    pub(super) fn emit(&mut self, event_type: EventType, key: ObjectKey, object_json: Json, old: Option<Json>) {
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
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::store::tests::cm;
    use crate::store::{DeleteOptions, ListOptions, WriteOptions};

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
}
