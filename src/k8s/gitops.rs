//! Reading GitOps owners (Argo CD Applications, Flux Kustomizations and HelmReleases) and
//! pausing them. What counts as an owner, and whether a run may start, is decided in
//! [`crate::gitops`].

use std::collections::BTreeMap;
use std::time::Duration;

use kube::api::{Api, ListParams, Patch};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{Value, json};

use super::objects::patch_params;
use super::{KubeError, status_code};
use crate::gitops::{
    FLUX_RECONCILE_REQUEST, Finding, OwnerId, OwnerKind, OwnerObject, OwnerState, PAUSED_AUTOMATED_ANNOTATION,
    in_flight,
};

/// The owner objects in the cluster, and the version each kind is served at.
#[derive(Debug, Clone, Default)]
pub(crate) struct Owners {
    /// Every Application, Kustomization and HelmRelease, judged.
    pub objects: Vec<OwnerObject>,
    /// The served version of each installed kind; a kind that is not installed is absent.
    pub versions: BTreeMap<OwnerKind, &'static str>,
}

fn resource(kind: OwnerKind, version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(kind.group(), version, kind.kind()), kind.plural())
}

/// Lists every owner object in every namespace. A kind whose CRD is not installed (404 at
/// every version the tool knows) is simply absent.
pub(crate) async fn list_owners(client: &kube::Client) -> Result<Owners, KubeError> {
    let mut out = Owners::default();
    for kind in OwnerKind::ALL {
        for version in kind.versions() {
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource(kind, version));
            match api.list(&ListParams::default()).await {
                Ok(list) => {
                    for o in &list.items {
                        let value = serde_json::to_value(o).map_err(|e| {
                            KubeError::api(format!("read {}", kind.plural()), kube::Error::SerdeError(e))
                        })?;
                        out.objects.push(OwnerObject::from_json(kind, &value));
                    }
                    out.versions.insert(kind, version);
                    break;
                }
                Err(e) if status_code(&e) == Some(404) => continue,
                Err(e) => {
                    return Err(KubeError::api(
                        format!(
                            "list {}.{} (looking for GitOps owners of the Karpenter objects)",
                            kind.plural(),
                            kind.group()
                        ),
                        e,
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// What pausing one owner did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PauseOutcome {
    /// It reconciled and now does not. `request` is the Flux reconcile request written with the
    /// suspend, whose handling says the controller has seen it (see [`crate::gitops::in_flight`]).
    Paused {
        /// The `reconcile.fluxcd.io/requestedAt` value written (Flux only).
        request: Option<String>,
    },
    /// It was already paused (a re-run, or someone else).
    AlreadyPaused,
    /// It is gone.
    Gone,
}

/// Pauses one owner: Flux `spec.suspend: true` (what `flux suspend` writes) with a reconcile
/// request (what `flux reconcile` writes) whose handling acknowledges the suspend; Argo CD
/// automated sync off, the original `spec.syncPolicy.automated` kept in an annotation.
/// Conflict-safe (the write carries the resourceVersion it was decided on) and idempotent; read
/// back after.
pub(crate) async fn pause(client: &kube::Client, owners: &Owners, id: &OwnerId) -> Result<PauseOutcome, KubeError> {
    let Some(version) = owners.versions.get(&id.kind) else { return Ok(PauseOutcome::Gone) };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &id.namespace, &resource(id.kind, version));
    for _ in 0..8 {
        let Some(obj) = api.get_opt(&id.name).await.map_err(|e| KubeError::api(format!("read {id}"), e))? else {
            return Ok(PauseOutcome::Gone);
        };
        let value =
            serde_json::to_value(&obj).map_err(|e| KubeError::api(format!("read {id}"), kube::Error::SerdeError(e)))?;
        if !OwnerObject::from_json(id.kind, &value).state.is_active() {
            return Ok(PauseOutcome::AlreadyPaused);
        }
        let (patch, request) = pause_patch(id.kind, &value, obj.metadata.resource_version.as_deref());
        // the patch answers with the object as written: judged again, it says whether the pause held
        let written = match api.patch(&id.name, &patch_params(), &Patch::Merge(patch)).await {
            Ok(o) => o,
            Err(e) if status_code(&e) == Some(404) => return Ok(PauseOutcome::Gone),
            // changed since it was read: decide again on the new version
            Err(e) if status_code(&e) == Some(409) => continue,
            Err(e) => return Err(KubeError::api(format!("pause {id}"), e)),
        };
        let value = serde_json::to_value(&written)
            .map_err(|e| KubeError::api(format!("read {id}"), kube::Error::SerdeError(e)))?;
        return match OwnerObject::from_json(id.kind, &value).state {
            OwnerState::Paused(_) => Ok(PauseOutcome::Paused { request }),
            OwnerState::Active(d) => Err(KubeError::NotPaused {
                owner: id.to_string(),
                detail: format!(
                    "the write was accepted but the object still reconciles ({d}); something keeps it on (an \
                     admission webhook, a parent Application or Kustomization, an ApplicationSet): pause that owner \
                     and run again"
                ),
            }),
        };
    }
    Err(KubeError::NotPaused {
        owner: id.to_string(),
        detail: "it kept changing under the tool (8 conflicts in a row); run again".into(),
    })
}

/// The pause of one owner as a merge patch, conditioned on `rv`, and the Flux reconcile
/// request it writes (the admission check's dry run sends the same body).
fn pause_patch(kind: OwnerKind, value: &Value, rv: Option<&str>) -> (Value, Option<String>) {
    match kind {
        OwnerKind::Application => {
            let original = value["spec"]["syncPolicy"]["automated"].to_string();
            let patch = json!({
                "metadata": {"resourceVersion": rv, "annotations": {PAUSED_AUTOMATED_ANNOTATION: original}},
                "spec": {"syncPolicy": {"automated": null}},
            });
            (patch, None)
        }
        OwnerKind::Kustomization | OwnerKind::HelmRelease => {
            // any value other than the last handled one is a new request; the time makes it so
            let token = crate::report::rfc3339(std::time::SystemTime::now());
            let patch = json!({"metadata": {"resourceVersion": rv, "annotations": {FLUX_RECONCILE_REQUEST: token}},
                               "spec": {"suspend": true}});
            (patch, Some(token))
        }
    }
}

/// The pause of `id` as a server-side dry run, through the admission chain: the server's answer,
/// or `None` when the owner is gone or already paused (then the run writes nothing to it).
pub(crate) async fn pause_dry_run(
    client: &kube::Client,
    owners: &Owners,
    id: &OwnerId,
) -> Result<Option<Result<(), kube::Error>>, KubeError> {
    let Some(version) = owners.versions.get(&id.kind) else { return Ok(None) };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &id.namespace, &resource(id.kind, version));
    let Some(obj) = api.get_opt(&id.name).await.map_err(|e| KubeError::api(format!("read {id}"), e))? else {
        return Ok(None);
    };
    let value =
        serde_json::to_value(&obj).map_err(|e| KubeError::api(format!("read {id}"), kube::Error::SerdeError(e)))?;
    if !OwnerObject::from_json(id.kind, &value).state.is_active() {
        return Ok(None);
    }
    let (patch, _) = pause_patch(id.kind, &value, obj.metadata.resource_version.as_deref());
    let params = kube::api::PatchParams { dry_run: true, ..patch_params() };
    Ok(Some(api.patch(&id.name, &params, &Patch::Merge(patch)).await.map(drop)))
}

/// Waits until `id` has nothing in flight (see [`crate::gitops::in_flight`]) or `deadline`
/// passes; `request` is the Flux reconcile request the run wrote with its suspend, if it did.
/// `Ok(None)` when it settled (or is gone), `Ok(Some(what))` with what was still in flight at the
/// deadline.
pub(crate) async fn wait_settled(
    client: &kube::Client,
    owners: &Owners,
    id: &OwnerId,
    request: Option<&str>,
    deadline: tokio::time::Instant,
) -> Result<Option<String>, KubeError> {
    let Some(version) = owners.versions.get(&id.kind) else { return Ok(None) };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &id.namespace, &resource(id.kind, version));
    loop {
        let Some(obj) = api.get_opt(&id.name).await.map_err(|e| KubeError::api(format!("read {id}"), e))? else {
            return Ok(None);
        };
        let value =
            serde_json::to_value(&obj).map_err(|e| KubeError::api(format!("read {id}"), kube::Error::SerdeError(e)))?;
        let Some(busy) = in_flight(id.kind, &value, request) else { return Ok(None) };
        if tokio::time::Instant::now() >= deadline {
            return Ok(Some(busy));
        }
        tracing::debug!(owner = %id, what = %busy, "waiting for GitOps work in flight");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Marks the findings this run paused.
pub(crate) fn mark_paused(findings: &mut [Finding], id: &OwnerId) {
    for f in findings.iter_mut().filter(|f| f.owner == *id) {
        f.paused_by_run = true;
    }
}
