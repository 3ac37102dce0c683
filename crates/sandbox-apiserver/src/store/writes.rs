//! Create, restore, update and patch: the checks and defaults an object gets before it is
//! committed (kind, name, namespace, a CRD's schema defaults and CEL rules, the strategies'
//! status on create, server-owned metadata, managedFields).

use std::sync::Arc;

use serde_json::{Value, json};

use super::{
    CRD_CLEANUP, GroupResource, Inner, ObjectKey, Store, WriteOptions, crd_gr, finalizers, now_rfc3339, ns_gr,
    set_finalizers, spec_part, xorshift,
};
use crate::kinds::ResourceInfo;
use crate::patch::{self, PatchType, WriteRecord};
use crate::schema;
use crate::status::ApiError;
use crate::stored::{Ids, Stored};

impl Store {
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
}

impl Inner {
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

    pub(crate) fn create(
        &mut self,
        gr: &GroupResource,
        ns: &str,
        obj: Value,
        opts: &WriteOptions,
    ) -> Result<Value, ApiError> {
        let (key, obj) = self.new_object(gr, ns, obj, opts, true)?;
        if opts.dry_run {
            return Ok(obj);
        }
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
        go_shape(gr, &mut obj);
        // a restore loads what another server already stores, which no server validates again
        // on reading it (an object stored before its CRD's schema changed stays readable)
        let admission = if record { Admission::Validate } else { Admission::DefaultOnly };
        self.admit_custom(&info, &name, &mut obj, None, admission)?;
        // a dry run leaves the served kinds as they are, so a CRD's write is admitted only
        if *gr == crd_gr() && !opts.dry_run {
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
        go_shape(gr, &mut obj);
        self.admit_custom(&info, name, &mut obj, Some(&old), Admission::Validate)?;
        if *gr == crd_gr() {
            let registered = self.registry.register_crd(&obj)?;
            let mut st = crd_status(&obj, &registered);
            if let Some(c) = old["status"]["storedVersions"].as_array() {
                st["storedVersions"] = json!(c);
            }
            // the same names keep the conditions as they were: a write that changes nothing
            // else stays a no-op, with no new resourceVersion, as on the real server
            obj["status"] = if old["status"]["acceptedNames"] == st["acceptedNames"]
                && old["status"]["storedVersions"] == st["storedVersions"]
            {
                old["status"].clone()
            } else {
                st
            };
        }
        // A no-op write does not bump the resourceVersion, like the real server; a patch that
        // named no resourceVersion is compared as if it had named the stored one.
        obj["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if obj == *old {
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
        if obj == *old || opts.dry_run {
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
        admission: Admission,
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
        schema::prune(schema, obj);
        schema::apply_defaults(schema, obj);
        if admission == Admission::DefaultOnly {
            return Ok(());
        }
        let mut openapi = schema::check_openapi(schema, obj);
        // validation ratcheting (CRDValidationRatcheting, on by default since 1.30): an update is
        // not refused for a value it leaves as it was, so an object stored before its schema
        // changed can still be written
        if let Some(old) = old {
            openapi.retain(|e| {
                let at = schema::field_pointer(&e.field);
                // a required field missing from an object the old one did not have is refused (a
                // new Flux condition without its lastTransitionTime), though the field was absent
                // before as well; in an object that was there, it ratchets as the field does
                // (kube-openapi ratchets the object holding `required` only while it is unchanged:
                // the emulator is kinder there, for objects stored at an older schema)
                if e.reason == "FieldValueRequired"
                    && old.pointer(at.rsplit_once('/').map(|(parent, _)| parent).unwrap_or_default()).is_none()
                {
                    return true;
                }
                old.pointer(&at) != obj.pointer(&at)
            });
        }
        // kube-apiserver (apiextensions-apiserver `pkg/registry/customresource/strategy.go`):
        // a schema with no CEL rule has no CEL validator, and nothing is said of rules; with
        // rules, an OpenAPI error of a blocking kind (`hasBlockingErr`: unsupported, required,
        // too long, too many, wrong type) stops them with a cause of its own, and any other
        // (a pattern) lets them run, their causes after the OpenAPI ones
        const BLOCKING: [&str; 2] = ["FieldValueNotSupported", "FieldValueRequired"];
        let blocking = openapi.iter().any(|e| BLOCKING.contains(&e.reason));
        let mut causes: Vec<(String, &str, String)> =
            openapi.into_iter().map(|e| (e.field, e.reason, e.message)).collect();
        if schema::has_rules(schema) {
            if blocking {
                causes.push((
                    "<nil>".into(),
                    "FieldValueInvalid",
                    "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation".into(),
                ));
            } else {
                // kube-apiserver's wording: `<field>: Invalid value: "<type>": <message>` per rule
                causes.extend(schema::validate(schema, obj, old).into_iter().map(|v| {
                    (v.field, "FieldValueInvalid", format!("Invalid value: \"{}\": {}", v.value_type, v.message))
                }));
            }
        }
        if causes.is_empty() {
            return Ok(());
        }
        Err(ApiError::invalid_causes(&info.group, &info.kind, name, &causes))
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
                if opts.dry_run {
                    return Ok(created);
                }
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
                let live_version = live["apiVersion"].as_str().unwrap_or_default().to_string();
                for p in &applied {
                    let mut a = &live as &Value;
                    let mut b = body;
                    for seg in p {
                        a = &a[seg.as_str()];
                        b = &b[seg.as_str()];
                    }
                    if a != b && !a.is_null() {
                        for o in patch::owners_of(&live, p, &opts.field_manager) {
                            conflicts.push((
                                format!("conflict with \"{o}\" using {live_version}"),
                                format!(".{}", p.join(".")),
                            ));
                        }
                    }
                }
                if !conflicts.is_empty() {
                    // structured-merge-diff's wording, one cause per field
                    // (apimachinery's managedfields internal/conflict.go)
                    let mut e = ApiError::conflict(&gr.group, &gr.resource, name, "");
                    e.message = format!(
                        "Apply failed with {} conflict{}: {}",
                        conflicts.len(),
                        if conflicts.len() == 1 { "" } else { "s" },
                        conflicts.iter().map(|(who, field)| format!("{who}: {field}")).collect::<Vec<_>>().join(", ")
                    );
                    let causes: Vec<Value> = conflicts
                        .iter()
                        .map(|(who, field)| json!({"reason": "FieldManagerConflict", "message": who, "field": field}))
                        .collect();
                    if let Some(d) = e.details.as_mut() {
                        d["causes"] = json!(causes);
                    }
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
            if opts.dry_run {
                return Ok(out);
            }
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
/// Whether a custom resource's write is validated, or only pruned and defaulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    /// A write through the API: pruned, defaulted, validated.
    Validate,
    /// A restore of what another server stores: pruned and defaulted, as read from storage.
    DefaultOnly,
}

/// An object as kube-apiserver stores it, where that differs from what was sent: the Go types'
/// `omitempty` fields drop a zero value (a node's `spec.unschedulable: false` is no field at all,
/// so no manager owns it and `managedFields` cannot name who uncordoned), a struct field is
/// always there (a node's `spec`, which a JSON patch `add /spec/unschedulable` needs), and a
/// CRD's `spec.conversion` is defaulted to `None` (apiextensions' `SetDefaults_CustomResourceDefinitionSpec`).
pub(crate) fn go_shape(gr: &GroupResource, obj: &mut Value) {
    if let Some(meta) = obj["metadata"].as_object_mut() {
        for key in ["labels", "annotations", "finalizers"] {
            let empty = match meta.get(key) {
                Some(Value::Object(m)) => m.is_empty(),
                Some(Value::Array(a)) => a.is_empty(),
                Some(Value::Null) => true,
                _ => false,
            };
            if empty {
                meta.remove(key);
            }
        }
    }
    match (gr.group.as_str(), gr.resource.as_str()) {
        ("", "nodes") => {
            if !obj["spec"].is_object() {
                obj["spec"] = json!({});
            }
            if obj["spec"]["unschedulable"] == false
                && let Some(spec) = obj["spec"].as_object_mut()
            {
                spec.remove("unschedulable");
            }
        }
        ("apiextensions.k8s.io", "customresourcedefinitions") if obj["spec"]["conversion"].is_null() => {
            obj["spec"]["conversion"] = json!({"strategy": "None"});
        }
        _ => {}
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::cm;

    fn widget_crd() -> Value {
        json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {"group": "example.com", "scope": "Cluster",
                "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
                "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                    "type": "object", "properties": {"spec": {"type": "object", "required": ["size"], "properties": {
                        "size": {"type": "string", "pattern": "^[0-9]+$"},
                        "mode": {"type": "string", "enum": ["a", "b"]}}}}}}}]}})
    }

    /// The tool turns a CRD's conversion webhook off with a JSON patch that `test`s the
    /// resourceVersion; on the real server a CRD has `spec.conversion` (defaulted), and a patch
    /// that changes nothing keeps the resourceVersion, so the same patch applies again.
    #[test]
    fn a_crd_has_its_conversion_defaulted_and_a_no_op_patch_keeps_its_resource_version() {
        let store = Store::new(16, 1);
        let gr = crd_gr();
        let created = store.create(&gr, "", widget_crd(), &WriteOptions::manager("installer")).unwrap();
        assert_eq!(created["spec"]["conversion"], json!({"strategy": "None"}));
        let rv = created["metadata"]["resourceVersion"].clone();
        let patch = json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "replace", "path": "/spec/conversion", "value": {"strategy": "None"}},
        ]);
        let opts = WriteOptions::manager("karpenter-teardown");
        let once = store.patch(&gr, "", "widgets.example.com", PatchType::Json, &patch, "", &opts).unwrap();
        assert_eq!(once["metadata"]["resourceVersion"], rv, "{once:#}\n{created:#}");
        store.patch(&gr, "", "widgets.example.com", PatchType::Json, &patch, "", &opts).unwrap();
    }

    /// A custom resource is pruned, defaulted and held to its schema's `required`, `pattern` and
    /// `enum`, with kube-apiserver's causes and its note that CEL rules were not evaluated.
    #[test]
    fn a_custom_resource_is_pruned_and_held_to_its_openapi_schema() {
        let store = Store::new(16, 1);
        store.create(&crd_gr(), "", with_rule(widget_crd()), &WriteOptions::manager("installer")).unwrap();
        let gr = GroupResource::new("example.com", "widgets");
        let widget = |spec: Value| json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": spec});
        let opts = WriteOptions::manager("t");
        let e = store.create(&gr, "", widget(json!({"mode": "c", "size": "x"})), &opts).unwrap_err();
        assert_eq!(e.code, 422);
        assert_eq!(
            e.message,
            "Widget.example.com \"w\" is invalid: [spec.mode: Unsupported value: \"c\": supported values: \"a\", \"b\", spec.size: Invalid value: \"x\": spec.size in body should match '^[0-9]+$', <nil>: Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation]"
        );
        let e = store.create(&gr, "", widget(json!({})), &opts).unwrap_err();
        let causes = &e.details.unwrap()["causes"];
        assert_eq!(
            causes[0],
            json!({"reason": "FieldValueRequired", "message": "Required value", "field": "spec.size"})
        );
        let made = store.create(&gr, "", widget(json!({"size": "3", "madeUp": true})), &opts).unwrap();
        assert_eq!(made["spec"], json!({"size": "3"}), "unknown fields are pruned");
    }

    fn with_rule(mut crd: Value) -> Value {
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"] =
            json!([{"rule": "self.size != '0'", "message": "size must not be 0"}]);
        crd
    }

    /// As kube-apiserver's CEL gate (`hasBlockingErr`): a schema without rules says nothing of
    /// them; with rules, a pattern error alone lets them run and both are named, a required
    /// field missing stops them with the note.
    #[test]
    fn rules_are_skipped_with_a_note_only_when_there_are_rules_and_a_blocking_error() {
        let gr = GroupResource::new("example.com", "widgets");
        let widget = |name: &str, spec: Value| json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec});
        let opts = WriteOptions::manager("t");
        let causes = |store: &Store, name: &str, spec: Value| -> Vec<String> {
            let e = store.create(&gr, "", widget(name, spec), &opts).unwrap_err();
            e.details.unwrap()["causes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["field"].as_str().unwrap().to_string())
                .collect()
        };
        let plain = Store::new(16, 1);
        plain.create(&crd_gr(), "", widget_crd(), &WriteOptions::manager("installer")).unwrap();
        assert_eq!(causes(&plain, "a", json!({"size": "x", "mode": "c"})), ["spec.mode", "spec.size"]);
        assert_eq!(causes(&plain, "b", json!({})), ["spec.size"]);

        let ruled = Store::new(16, 1);
        ruled.create(&crd_gr(), "", with_rule(widget_crd()), &WriteOptions::manager("installer")).unwrap();
        assert_eq!(causes(&ruled, "c", json!({})), ["spec.size", "<nil>"]);
        assert_eq!(causes(&ruled, "d", json!({"size": "0"})), ["spec"]);
        // a pattern error does not block the rules: both are named (the rule passes on "x")
        assert_eq!(causes(&ruled, "e", json!({"size": "x"})), ["spec.size"]);
    }

    /// A status write that adds an object without a field its schema requires is refused, though
    /// the field was absent before as well: what ratchets is the object that should hold it.
    #[test]
    fn a_new_object_missing_a_required_field_is_refused_on_a_status_write() {
        let store = Store::new(16, 1);
        let mut crd = widget_crd();
        crd["spec"]["versions"][0]["subresources"] = json!({"status": {}});
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"] = json!({"type": "object",
            "properties": {"conditions": {"type": "array", "items": {"type": "object", "required": ["type", "lastTransitionTime"],
                "properties": {"type": {"type": "string"}, "lastTransitionTime": {"type": "string"}}}}}});
        store.create(&crd_gr(), "", crd, &WriteOptions::manager("installer")).unwrap();
        let gr = GroupResource::new("example.com", "widgets");
        let opts = WriteOptions::manager("t");
        let w =
            json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": "1"}});
        store.create(&gr, "", w, &opts).unwrap();
        let bad = json!({"status": {"conditions": [{"type": "Ready"}]}});
        let e = store.patch(&gr, "", "w", PatchType::Merge, &bad, "status", &opts).unwrap_err();
        assert_eq!(e.code, 422);
        assert_eq!(e.details.unwrap()["causes"][0]["field"], "status.conditions[0].lastTransitionTime");
        let good = json!({"status": {"conditions": [{"type": "Ready", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
        store.patch(&gr, "", "w", PatchType::Merge, &good, "status", &opts).unwrap();
    }

    /// What another server stores is restored as it is (pruned and defaulted, as read from
    /// storage, not validated), and a later write is refused only for what it changes.
    #[test]
    fn a_restored_object_is_not_validated_and_writes_ratchet_on_what_they_leave() {
        let store = Store::new(16, 1);
        store.create(&crd_gr(), "", widget_crd(), &WriteOptions::manager("installer")).unwrap();
        let gr = GroupResource::new("example.com", "widgets");
        let legacy = json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "old"},
            "spec": {"mode": "legacy"}});
        store.restore(&gr, "", legacy).unwrap();
        let opts = WriteOptions::manager("t");
        let label = json!({"metadata": {"labels": {"a": "b"}}});
        store.patch(&gr, "", "old", PatchType::Merge, &label, "", &opts).unwrap();
        let bad = json!({"spec": {"size": "x"}});
        let e = store.patch(&gr, "", "old", PatchType::Merge, &bad, "", &opts).unwrap_err();
        assert_eq!(e.details.unwrap()["causes"][0]["field"], "spec.size", "only the changed field is refused");
        assert_eq!(schema::field_pointer("spec.budgets[0].nodes"), "/spec/budgets/0/nodes");
    }

    /// Go's `omitempty`: a node's `unschedulable: false` is no field, so whoever owned it owns
    /// nothing after an uncordon, and an emptied annotation map is gone.
    #[test]
    fn an_uncordon_leaves_no_owner_of_unschedulable_and_empty_maps_are_dropped() {
        let store = Store::new(16, 1);
        let gr = GroupResource::new("", "nodes");
        let bare = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}});
        let created = store.create(&gr, "", bare, &WriteOptions::manager("kubelet")).unwrap();
        assert_eq!(created["spec"], json!({}), "a node always has a spec");
        let cordon = json!([{"op": "add", "path": "/spec/unschedulable", "value": true}]);
        store.patch(&gr, "", "n", PatchType::Json, &cordon, "", &WriteOptions::manager("tool")).unwrap();
        let uncordon = json!({"spec": {"unschedulable": false}, "metadata": {"annotations": {"a": null}}});
        let out =
            store.patch(&gr, "", "n", PatchType::Merge, &uncordon, "", &WriteOptions::manager("reverter")).unwrap();
        assert!(out["spec"].get("unschedulable").is_none(), "{out:#}");
        assert!(out["metadata"].get("annotations").is_none(), "{out:#}");
        let managers: Vec<&str> = out["metadata"]["managedFields"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["manager"].as_str())
            .collect();
        assert!(!managers.contains(&"tool") && !managers.contains(&"reverter"), "{managers:?}");
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
