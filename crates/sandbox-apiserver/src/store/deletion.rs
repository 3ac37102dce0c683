//! Deletion: preconditions, grace periods, the finalizers the server processes itself
//! (`foregroundDeletion`, `orphan`, a CRD's cleanup, a namespace's content) and the garbage
//! collector's queue of work.

use std::sync::Arc;

use serde_json::{Value, json};

use super::{
    CRD_CLEANUP, DeleteOptions, GroupResource, Inner, ObjectKey, Propagation, crd_gr, finalizers, now_rfc3339, ns_gr,
    owner_uids, rfc3339_in, set_finalizers, spec_part,
};
use crate::status::ApiError;

/// Work the garbage collector and the finalizer logic still have to do.
pub(super) enum Work {
    /// An object was removed: its dependents and its deleting owners need a look.
    Removed { uid: String, owners: Vec<String>, key: ObjectKey },
    /// An object is being deleted and carries a finalizer the server itself processes.
    Deleting(ObjectKey),
}

const FOREGROUND: &str = "foregroundDeletion";
const ORPHAN: &str = "orphan";

impl Inner {
    /// After a write to an object under deletion: remove it when no finalizer and no grace
    /// period is left, or queue server-side finalizer work.
    pub(super) fn after_deleting_write(&mut self, key: &ObjectKey) -> Option<Value> {
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
            let found = obj["metadata"]["uid"].as_str().unwrap_or_default();
            // a pod's delete is graceful, and kube-apiserver checks its UID precondition before
            // the storage does, naming the kind (apiserver's registry/rest/delete.go, BeforeDelete)
            return Err(if *gr == GroupResource::new("", "pods") {
                ApiError::conflict(
                    "",
                    "Pod",
                    name,
                    &format!(
                        "the UID in the precondition ({uid}) does not match the UID in record ({found}). The object might have been deleted and then recreated"
                    ),
                )
            } else {
                ApiError::conflict(
                    &gr.group,
                    &gr.resource,
                    name,
                    &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {found}"),
                )
            });
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
        if opts.dry_run {
            // what the delete would answer, nothing changed: gone at once without finalizers
            // or a grace period, else marked for deletion
            if deleting || !fins.is_empty() || grace > 0 {
                let mut o = (*obj).clone();
                if !deleting {
                    o["metadata"]["deletionTimestamp"] = json!(rfc3339_in(grace));
                    o["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
                }
                set_finalizers(&mut o, &fins);
                return Ok((o, false));
            }
            return Ok(((*obj).clone(), true));
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
}
