//! Simulated Argo CD and Flux: what they write on the objects they apply, and a reconciler that
//! puts back what is removed or changed while they are not paused.
//!
//! The CRDs are ours, with just the fields these controllers use. The "Git repository" is the
//! manifests of the adopted objects as they were when adopted, held in memory. What the
//! reconciler does, per owner kind, follows the real controllers:
//!
//! - Argo CD Application with automated sync and self-heal: a missing object is created again, a
//!   changed field it manages is set back (NodePool limits and disruption, Deployment replicas,
//!   a child Application's sync policy). Automated sync off (`spec.syncPolicy.automated` absent or
//!   `enabled: false`) or `argocd.argoproj.io/skip-reconcile: "true"`: nothing. While it applies,
//!   the Application carries `status.operationState.phase: Running`, as Argo CD's sync does.
//!   Before every write of such a pass it reads its Application again, so a pause is honoured
//!   from the next write on. A sync started on purpose ([`GitopsSim::sync_in_flight`]) runs to
//!   its end whatever the sync policy says, as an Argo CD operation does: `operation` set,
//!   `operationState.phase: Running`, then `Succeeded` and `operation` cleared.
//! - Flux Kustomization: re-applies its inventory every interval unless `spec.suspend: true`.
//! - Flux HelmRelease with `spec.driftDetection.mode: enabled`: corrects drift and re-creates
//!   deleted objects unless suspended.
//! - Flux passes read the object once, at their start: a pass under way when `suspend` is set
//!   finishes its apply (with condition `Reconciling: Progressing` meanwhile), and every pass,
//!   a suspended one too, ends by copying `reconcile.fluxcd.io/requestedAt` to
//!   `status.lastHandledReconcileAt`, as kustomize-controller and helm-controller do.
//!
//! An Application for a cluster-scoped object writes its destination namespace in the tracking
//! id, as Argo CD does (`UnstructuredToAppInstanceValue` in `util/argo/resource_tracking.go`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::naming::{KARPENTER_NAME, KARPENTER_NAMESPACE};
use super::{SimError, World, objects, ops};
use crate::karpenter;

/// Argo CD's annotation tracking (`util/argo/resource_tracking.go`).
pub const ARGO_TRACKING_ANNOTATION: &str = "argocd.argoproj.io/tracking-id";
/// Flux's reconcile request annotation (`fluxcd/pkg` `apis/meta`).
pub const FLUX_RECONCILE_REQUEST: &str = "reconcile.fluxcd.io/requestedAt";
/// An Application Argo CD does not reconcile at all.
const ARGO_SKIP_RECONCILE: &str = "argocd.argoproj.io/skip-reconcile";
/// kustomize-controller's labels on what it applies.
const FLUX_KUSTOMIZATION_LABELS: (&str, &str) =
    ("kustomize.toolkit.fluxcd.io/name", "kustomize.toolkit.fluxcd.io/namespace");
/// helm-controller's labels on what a HelmRelease renders.
const FLUX_HELMRELEASE_LABELS: (&str, &str) = ("helm.toolkit.fluxcd.io/name", "helm.toolkit.fluxcd.io/namespace");

/// The GitOps owner kinds the simulation plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OwnerKind {
    /// Argo CD `applications.argoproj.io`.
    Application,
    /// Flux `kustomizations.kustomize.toolkit.fluxcd.io`.
    Kustomization,
    /// Flux `helmreleases.helm.toolkit.fluxcd.io`.
    HelmRelease,
}

impl OwnerKind {
    /// The API group.
    pub fn group(self) -> &'static str {
        match self {
            OwnerKind::Application => "argoproj.io",
            OwnerKind::Kustomization => "kustomize.toolkit.fluxcd.io",
            OwnerKind::HelmRelease => "helm.toolkit.fluxcd.io",
        }
    }

    /// The resource (plural) name.
    pub fn plural(self) -> &'static str {
        match self {
            OwnerKind::Application => "applications",
            OwnerKind::Kustomization => "kustomizations",
            OwnerKind::HelmRelease => "helmreleases",
        }
    }

    /// The version the sandbox serves it at (the current release of each project).
    pub fn version(self) -> &'static str {
        match self {
            OwnerKind::Application => "v1alpha1",
            OwnerKind::Kustomization => "v1",
            OwnerKind::HelmRelease => "v2",
        }
    }

    /// The kind name.
    pub fn kind(self) -> &'static str {
        match self {
            OwnerKind::Application => "Application",
            OwnerKind::Kustomization => "Kustomization",
            OwnerKind::HelmRelease => "HelmRelease",
        }
    }
}

/// One GitOps owner object of the simulation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OwnerId {
    /// Its kind.
    pub kind: OwnerKind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl std::fmt::Display for OwnerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tool = match self.kind {
            OwnerKind::Application => "Argo CD",
            OwnerKind::Kustomization | OwnerKind::HelmRelease => "Flux",
        };
        write!(f, "{tool} {} {}/{}", self.kind.kind(), self.namespace, self.name)
    }
}

/// The address of an object an owner applies.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    /// API group (empty for core).
    pub group: String,
    /// Kind.
    pub kind: String,
    /// Namespace, empty for cluster-scoped objects.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.namespace.as_str() {
            "" => write!(f, "{}/{}", self.kind, self.name),
            ns => write!(f, "{}/{}/{}", self.kind, ns, self.name),
        }
    }
}

/// A Flux inventory entry id (`<ns>_<name>_<group>_<kind>`, fluxcd/pkg `ssa/utils`).
fn inventory_id(key: &ObjectKey) -> String {
    format!("{}_{}_{}_{}", key.namespace, key.name, key.group, key.kind)
}

/// Argo CD's tracking id of an object owned by application `app`.
fn tracking_id(app: &str, key: &ObjectKey) -> String {
    format!("{app}:{}/{}:{}/{}", key.group, key.kind, key.namespace, key.name)
}

/// Whether an owner reconciles at all, as the real controllers decide it: Argo CD skips an
/// Application annotated `skip-reconcile: "true"` and syncs on its own only with
/// `spec.syncPolicy.automated` (not `enabled: false`, Argo CD 3.1+); Flux skips a suspended
/// object.
fn reconciles(kind: OwnerKind, obj: &Value) -> bool {
    match kind {
        OwnerKind::Application => {
            let automated = &obj["spec"]["syncPolicy"]["automated"];
            obj["metadata"]["annotations"][ARGO_SKIP_RECONCILE] != "true"
                && automated.is_object()
                && automated["enabled"] != Value::Bool(false)
        }
        OwnerKind::Kustomization | OwnerKind::HelmRelease => obj["spec"]["suspend"] != Value::Bool(true),
    }
}

/// Argo CD's namespace in the sandbox.
pub const ARGOCD_NAMESPACE: &str = "argocd";
/// Flux's namespace in the sandbox.
pub const FLUX_NAMESPACE: &str = "flux-system";

/// The served version of each owner kind in the sandbox (the newest the tool knows).
fn owner_resource(kind: OwnerKind) -> ApiResource {
    let version = kind.version();
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(kind.group(), version, kind.kind()), kind.plural())
}

/// Our CRDs for Application, Kustomization and HelmRelease: the fields the reconcilers and the
/// tool use, everything else preserved as given.
pub fn crds() -> Vec<Value> {
    let open = json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    let application = json!({
        "type": "object",
        "properties": {
            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true, "properties": {
                "project": {"type": "string"},
                "source": open,
                "destination": {"type": "object", "properties": {"server": {"type": "string"}, "name": {"type": "string"},
                                                                  "namespace": {"type": "string"}}},
                "syncPolicy": {"type": "object", "x-kubernetes-preserve-unknown-fields": true, "properties": {
                    "automated": {"type": "object", "properties": {
                        "enabled": {"type": "boolean"}, "prune": {"type": "boolean"},
                        "selfHeal": {"type": "boolean"}, "allowEmpty": {"type": "boolean"}}}}}}},
            "operation": open,
            "status": open,
        },
    });
    let flux_spec = |extra: Value| {
        let mut props = json!({"interval": {"type": "string"}, "suspend": {"type": "boolean"}});
        if let (Some(p), Some(e)) = (props.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true, "properties": props},
            "status": open}})
    };
    let kustomization =
        flux_spec(json!({"path": {"type": "string"}, "prune": {"type": "boolean"}, "sourceRef": open.clone()}));
    let helmrelease = flux_spec(json!({"chart": open.clone(), "releaseName": {"type": "string"},
        "driftDetection": {"type": "object", "properties": {"mode": {"type": "string"}}}}));
    [
        (OwnerKind::Application, application, false),
        (OwnerKind::Kustomization, kustomization, true),
        (OwnerKind::HelmRelease, helmrelease, true),
    ]
    .into_iter()
    .map(|(kind, schema, status)| {
        let mut version = json!({"name": kind.version(), "served": true, "storage": true,
            "schema": {"openAPIV3Schema": schema}});
        // Argo CD's Application CRD has no status subresource; Flux's have one
        if status {
            version["subresources"] = json!({"status": {}});
        }
        json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": format!("{}.{}", kind.plural(), kind.group())},
            "spec": {"group": kind.group(), "scope": "Namespaced",
                "names": {"plural": kind.plural(), "singular": kind.kind().to_lowercase(), "kind": kind.kind(),
                          "listKind": format!("{}List", kind.kind())},
                "versions": [version]},
        })
    })
    .collect()
}

/// One object in the simulated Git repository.
#[derive(Debug, Clone)]
pub struct Desired {
    /// The owner that applies it.
    pub owner: OwnerId,
    /// Where it goes.
    pub key: ObjectKey,
    /// How to reach its kind.
    pub resource: ApiResource,
    /// The manifest as Git has it.
    pub manifest: Value,
}

/// The GitOps side of a world: its owners, parents first, and what each applies.
#[derive(Debug, Clone, Default)]
pub struct GitopsWorld {
    /// Every owner object created.
    pub owners: Vec<OwnerId>,
    /// The repository.
    pub repo: Vec<Desired>,
}

fn pools_app() -> OwnerId {
    OwnerId { kind: OwnerKind::Application, namespace: ARGOCD_NAMESPACE.into(), name: "karpenter-nodepools".into() }
}
fn root_app() -> OwnerId {
    OwnerId { kind: OwnerKind::Application, namespace: ARGOCD_NAMESPACE.into(), name: "platform".into() }
}
fn classes_ks() -> OwnerId {
    OwnerId { kind: OwnerKind::Kustomization, namespace: FLUX_NAMESPACE.into(), name: "karpenter-nodeclasses".into() }
}
fn infra_ks() -> OwnerId {
    OwnerId { kind: OwnerKind::Kustomization, namespace: FLUX_NAMESPACE.into(), name: "infrastructure".into() }
}
fn controller_hr() -> OwnerId {
    OwnerId { kind: OwnerKind::HelmRelease, namespace: FLUX_NAMESPACE.into(), name: "karpenter".into() }
}

/// The destination namespace of the sandbox's Applications: Argo CD writes it in the tracking id
/// of the cluster-scoped objects they apply.
fn destination_namespace(app: &OwnerId) -> &'static str {
    if *app == pools_app() { KARPENTER_NAMESPACE } else { ARGOCD_NAMESPACE }
}

fn key_of(group: &str, kind: &str, namespace: &str, name: &str) -> ObjectKey {
    ObjectKey { group: group.into(), kind: kind.into(), namespace: namespace.into(), name: name.into() }
}

fn key_of_owner(id: &OwnerId) -> ObjectKey {
    key_of(id.kind.group(), id.kind.kind(), &id.namespace, &id.name)
}

/// What a GitOps controller writes on an object it applies, and the field manager it writes as.
fn marks(owner: &OwnerId, key: &ObjectKey) -> (Value, &'static str) {
    match owner.kind {
        // annotation tracking (Argo CD 3.x default); the Application lives in Argo CD's namespace,
        // so the tracking id carries its bare name, and a cluster-scoped object's empty
        // namespace is filled with the Application's destination namespace
        OwnerKind::Application => {
            let mut claimed = key.clone();
            if claimed.namespace.is_empty() {
                claimed.namespace = destination_namespace(owner).to_string();
            }
            (
                json!({"metadata": {"annotations": {ARGO_TRACKING_ANNOTATION: tracking_id(&owner.name, &claimed)}}}),
                "argocd-controller",
            )
        }
        OwnerKind::Kustomization => (
            json!({"metadata": {"labels": {FLUX_KUSTOMIZATION_LABELS.0: owner.name, FLUX_KUSTOMIZATION_LABELS.1: owner.namespace}}}),
            "kustomize-controller",
        ),
        OwnerKind::HelmRelease => (
            json!({"metadata": {"labels": {FLUX_HELMRELEASE_LABELS.0: owner.name, FLUX_HELMRELEASE_LABELS.1: owner.namespace}}}),
            "helm-controller",
        ),
    }
}

fn dynamic_api(client: &Client, resource: &ApiResource, namespace: &str) -> Api<DynamicObject> {
    if namespace.is_empty() {
        Api::all_with(client.clone(), resource)
    } else {
        Api::namespaced_with(client.clone(), namespace, resource)
    }
}

/// The manifest Git would hold for a live object: what a user writes, none of what the server adds.
fn manifest_of(obj: &DynamicObject, resource: &ApiResource) -> Value {
    let mut metadata = json!({"name": obj.name_any()});
    if let Some(ns) = &obj.metadata.namespace {
        metadata["namespace"] = json!(ns);
    }
    if let Some(l) = &obj.metadata.labels {
        metadata["labels"] = json!(l);
    }
    if let Some(a) = &obj.metadata.annotations {
        metadata["annotations"] = json!(a);
    }
    json!({"apiVersion": resource.api_version, "kind": resource.kind, "metadata": metadata,
           "spec": obj.data.get("spec").cloned().unwrap_or(Value::Null)})
}

/// Marks one object as applied by `owner`, and records its manifest in the repository.
async fn adopt_one(
    client: &Client,
    repo: &mut Vec<Desired>,
    owner: &OwnerId,
    resource: ApiResource,
    key: ObjectKey,
) -> Result<(), SimError> {
    let api = dynamic_api(client, &resource, &key.namespace);
    let (patch, manager) = marks(owner, &key);
    let pp = PatchParams { field_manager: Some(manager.into()), ..PatchParams::default() };
    let live =
        api.patch(&key.name, &pp, &Patch::Merge(patch)).await.map_err(SimError::kube(format!("marking {key}")))?;
    repo.push(Desired { owner: owner.clone(), manifest: manifest_of(&live, &resource), key, resource });
    Ok(())
}

/// Creates an owner object (status included) and returns its manifest for its parent.
async fn create_owner(client: &Client, id: &OwnerId, spec: Value, status: Value) -> Result<(), SimError> {
    let resource = owner_resource(id.kind);
    let api = dynamic_api(client, &resource, &id.namespace);
    let mut body = json!({"apiVersion": resource.api_version, "kind": resource.kind,
        "metadata": {"name": id.name, "namespace": id.namespace}, "spec": spec});
    if id.kind == OwnerKind::Application {
        // no status subresource on Application: the controller writes it with the object
        body["status"] = status.clone();
    }
    let obj: DynamicObject = serde_json::from_value(body)
        .map_err(|e| SimError::BadSpec(format!("generated {} does not parse: {e}", id.kind.kind())))?;
    ops::create_or_get(&api, &obj).await.map_err(SimError::kube(format!("creating {id}")))?;
    if id.kind != OwnerKind::Application {
        ops::patch_status(&api, &id.name, status)
            .await
            .map_err(SimError::kube(format!("writing the status of {id}")))?;
    }
    Ok(())
}

/// Puts the world's Karpenter objects under GitOps, the way a platform team typically has them:
///
/// - Argo CD Application `argocd/karpenter-nodepools` (automated, self-heal, prune) applies every
///   NodePool; it is itself applied by the app-of-apps `argocd/platform` (automated, self-heal);
/// - Flux Kustomization `flux-system/karpenter-nodeclasses` applies every EC2NodeClass;
/// - Flux HelmRelease `flux-system/karpenter` (drift detection on) renders the controller
///   Deployment; it is itself applied by Kustomization `flux-system/infrastructure`.
///
/// `crds` are installed first: Argo CD's and Flux's own (`gitops_crds::release_crds`), or
/// [`crds`] where there is no Go.
pub async fn adopt(client: &Client, world: &World, crds: &[Value]) -> Result<GitopsWorld, SimError> {
    crate::world::create_crds(client, crds.to_vec()).await?;
    let ns_api: Api<Namespace> = Api::all(client.clone());
    for ns in [ARGOCD_NAMESPACE, FLUX_NAMESPACE] {
        let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))
            .map_err(|e| SimError::BadSpec(format!("namespace does not parse: {e}")))?;
        ops::create_or_get(&ns_api, &obj).await.map_err(SimError::kube(format!("creating namespace {ns}")))?;
    }
    let mut repo = Vec::new();
    for pool in &world.node_pools {
        let key = key_of(karpenter::KARPENTER_GROUP, "NodePool", "", pool);
        adopt_one(client, &mut repo, &pools_app(), objects::nodepool_resource(), key).await?;
    }
    for class in &world.node_classes {
        let key = key_of(karpenter::AWS_GROUP, "EC2NodeClass", "", &class.name);
        adopt_one(client, &mut repo, &classes_ks(), objects::ec2nodeclass_resource(), key).await?;
    }
    let deploy = ApiResource::erase::<Deployment>(&());
    let key = key_of("apps", "Deployment", KARPENTER_NAMESPACE, KARPENTER_NAME);
    adopt_one(client, &mut repo, &controller_hr(), deploy, key).await?;

    fn owned(repo: &[Desired], owner: &OwnerId) -> Vec<ObjectKey> {
        repo.iter().filter(|d| d.owner == *owner).map(|d| d.key.clone()).collect()
    }
    let resources = |keys: Vec<ObjectKey>| -> Value {
        keys.iter()
            .map(|k| json!({"group": k.group, "kind": k.kind, "namespace": k.namespace, "name": k.name, "status": "Synced"}))
            .collect()
    };
    let inventory = |keys: Vec<ObjectKey>| -> Value {
        json!({"inventory": {"entries": keys.iter().map(|k| json!({"id": inventory_id(k), "v": "v1"})).collect::<Vec<_>>()}})
    };
    let automated = json!({"automated": {"selfHeal": true, "prune": true}});
    let app_spec = |path: &str, app: &OwnerId| {
        json!({"project": "default", "source": {"repoURL": "https://git.example.com/platform.git", "path": path},
               "destination": {"server": "https://kubernetes.default.svc", "namespace": destination_namespace(app)},
               "syncPolicy": automated})
    };
    let ks_spec = |path: &str| json!({"interval": "1m", "path": path, "prune": true, "sourceRef": {"kind": "GitRepository", "name": "platform"}});

    // leaves first, then their parents: a parent's repository holds its children as created
    create_owner(
        client,
        &pools_app(),
        app_spec("karpenter/nodepools", &pools_app()),
        json!({"resources": resources(owned(&repo, &pools_app()))}),
    )
    .await?;
    create_owner(client, &classes_ks(), ks_spec("./karpenter/nodeclasses"), inventory(owned(&repo, &classes_ks())))
        .await?;
    let hr_spec = json!({"interval": "5m", "releaseName": "karpenter", "driftDetection": {"mode": "enabled"},
        "chart": {"spec": {"chart": "karpenter", "version": world.version.as_str(),
            // required by helm-controller's CRD, as every chart comes from a source
            "sourceRef": {"kind": "HelmRepository", "name": "karpenter"}}}});
    create_owner(client, &controller_hr(), hr_spec, json!({})).await?;

    let app_resource = owner_resource(OwnerKind::Application);
    adopt_one(client, &mut repo, &root_app(), app_resource, key_of_owner(&pools_app())).await?;
    let hr_resource = owner_resource(OwnerKind::HelmRelease);
    adopt_one(client, &mut repo, &infra_ks(), hr_resource, key_of_owner(&controller_hr())).await?;
    create_owner(
        client,
        &root_app(),
        app_spec("apps", &root_app()),
        json!({"resources": resources(owned(&repo, &root_app()))}),
    )
    .await?;
    create_owner(client, &infra_ks(), ks_spec("./infrastructure"), inventory(owned(&repo, &infra_ks()))).await?;

    Ok(GitopsWorld { owners: vec![root_app(), infra_ks(), pools_app(), classes_ks(), controller_hr()], repo })
}

/// Makes the sandbox a hub as well: next to the owners [`adopt`] made, owners that apply the
/// same objects (same names) to other clusters, as a platform team's management cluster has them:
///
/// - Argo CD Application `argocd/prod-karpenter`, generated by ApplicationSet `karpenter` (what
///   its cluster generator makes of a cluster Secret: `spec.destination.server` that cluster's
///   API server), automated with self-heal, listing every NodePool and the controller Deployment;
/// - Argo CD Application `argocd/stage-karpenter`, destination by cluster name `stage`, same list;
/// - Flux Kustomization `flux-system/prod-nodeclasses` with `spec.kubeConfig.secretRef`, listing
///   every EC2NodeClass in its inventory.
///
/// They have no reconciler here: what they apply lives on the other clusters.
pub async fn add_other_clusters(client: &Client, world: &GitopsWorld) -> Result<Vec<OwnerId>, SimError> {
    let keys = |kinds: &[&str]| -> Vec<ObjectKey> {
        world.repo.iter().filter(|d| kinds.contains(&d.key.kind.as_str())).map(|d| d.key.clone()).collect()
    };
    let resources: Vec<Value> = keys(&["NodePool", "Deployment"])
        .iter()
        .map(
            |k| json!({"group": k.group, "kind": k.kind, "namespace": k.namespace, "name": k.name, "status": "Synced"}),
        )
        .collect();
    let entries: Vec<Value> =
        keys(&["EC2NodeClass"]).iter().map(|k| json!({"id": inventory_id(k), "v": "v1"})).collect();
    let app =
        |name: &str| OwnerId { kind: OwnerKind::Application, namespace: ARGOCD_NAMESPACE.into(), name: name.into() };
    let spec = |destination: Value| {
        json!({"project": "default", "source": {"repoURL": "https://git.example.com/platform.git", "path": "karpenter"},
               "destination": destination, "syncPolicy": {"automated": {"selfHeal": true, "prune": true}}})
    };
    let prod = app("prod-karpenter");
    let stage = app("stage-karpenter");
    let flux =
        OwnerId { kind: OwnerKind::Kustomization, namespace: FLUX_NAMESPACE.into(), name: "prod-nodeclasses".into() };
    let status = json!({"resources": resources});
    create_owner(
        client,
        &prod,
        spec(json!({"server": "https://PROD0123456789.gr7.eu-west-1.eks.amazonaws.com", "namespace": KARPENTER_NAMESPACE})),
        status.clone(),
    )
    .await?;
    // what the ApplicationSet controller sets on what it generates
    let api = dynamic_api(client, &owner_resource(OwnerKind::Application), ARGOCD_NAMESPACE);
    let owner_ref = json!({"metadata": {"ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "ApplicationSet",
        "name": "karpenter", "uid": "00000000-0000-0000-0000-000000000001", "controller": true, "blockOwnerDeletion": true}]}});
    api.patch(&prod.name, &PatchParams::default(), &Patch::Merge(owner_ref))
        .await
        .map_err(SimError::kube(format!("marking {prod} as generated")))?;
    create_owner(client, &stage, spec(json!({"name": "stage", "namespace": KARPENTER_NAMESPACE})), status).await?;
    let ks = json!({"interval": "1m", "path": "./karpenter/nodeclasses", "prune": true,
        "sourceRef": {"kind": "GitRepository", "name": "platform"}, "kubeConfig": {"secretRef": {"name": "prod-kubeconfig"}}});
    create_owner(client, &flux, ks, json!({"inventory": {"entries": entries}})).await?;
    Ok(vec![prod, stage, flux])
}

/// The fields an owner sets back when they drift, per kind of object it applies.
fn drift_fields(kind: &str) -> &'static [&'static str] {
    match kind {
        "NodePool" => &["limits", "disruption"],
        "Deployment" => &["replicas"],
        "Application" => &["syncPolicy"],
        "Kustomization" | "HelmRelease" => &["suspend"],
        _ => &[],
    }
}

/// How the reconcilers run.
#[derive(Debug, Clone)]
pub struct GitopsSettings {
    /// Period of a pass (the sandbox's scaled time; Argo CD's self-heal and Flux's interval are
    /// minutes on a real cluster, which would only make the tests slower).
    pub interval: Duration,
    /// How long a Flux pass that applies takes between reading its object and applying (a
    /// source fetch, a kustomize build, a Helm render): a suspend that lands meanwhile does not
    /// stop it.
    pub flux_pass: Duration,
}

impl Default for GitopsSettings {
    fn default() -> Self {
        GitopsSettings { interval: Duration::from_millis(100), flux_pass: Duration::ZERO }
    }
}

/// Counters of what the reconcilers put back.
#[derive(Debug, Default)]
struct Stats {
    recreated: AtomicU64,
    reverted: AtomicU64,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GitopsStats {
    /// Objects created again after they were deleted.
    pub recreated: u64,
    /// Fields set back after they were changed.
    pub reverted: u64,
}

/// What the reconcilers share: the counters, the syncs started on purpose and when each owner
/// last finished applying.
#[derive(Debug, Default)]
struct Shared {
    stats: Stats,
    /// Argo CD syncs in flight, until when.
    syncs: Mutex<HashMap<OwnerId, Instant>>,
    /// When each owner's last pass or sync that applied ended.
    applied: Mutex<HashMap<OwnerId, SystemTime>>,
}

impl Shared {
    fn applied_now(&self, owner: &OwnerId) {
        self.applied.lock().unwrap_or_else(|p| p.into_inner()).insert(owner.clone(), SystemTime::now());
    }
}

/// The running reconcilers.
pub struct GitopsSim {
    tasks: JoinSet<()>,
    cancel: CancellationToken,
    shared: Arc<Shared>,
    client: Client,
}

impl GitopsSim {
    /// Starts one reconciler per owner.
    pub fn start(client: Client, world: &GitopsWorld, settings: GitopsSettings) -> GitopsSim {
        let cancel = CancellationToken::new();
        let shared = Arc::new(Shared::default());
        let mut tasks = JoinSet::new();
        for owner in &world.owners {
            let repo: Vec<Desired> = world.repo.iter().filter(|d| d.owner == *owner).cloned().collect();
            let (client, cancel, shared, owner, settings) =
                (client.clone(), cancel.clone(), shared.clone(), owner.clone(), settings.clone());
            let span = tracing::info_span!("gitops-sim", owner = %owner);
            tasks.spawn(
                async move {
                    loop {
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(settings.interval) => {}
                        }
                        let pass = match owner.kind {
                            OwnerKind::Application => argo_pass(&client, &owner, &repo, &shared).await,
                            OwnerKind::Kustomization | OwnerKind::HelmRelease => {
                                flux_pass(&client, &owner, &repo, &shared, settings.flux_pass).await
                            }
                        };
                        if let Err(e) = pass {
                            tracing::debug!(error = %e, "pass failed; trying again next interval");
                        }
                    }
                }
                .instrument(span),
            );
        }
        GitopsSim { tasks, cancel, shared, client }
    }

    /// What was put back so far.
    pub fn stats(&self) -> GitopsStats {
        GitopsStats {
            recreated: self.shared.stats.recreated.load(Ordering::Relaxed),
            reverted: self.shared.stats.reverted.load(Ordering::Relaxed),
        }
    }

    /// Starts an Argo CD sync of `app` that runs for `length` whatever its sync policy (a sync a
    /// human started, or one automated sync started before it was turned off): `operation` set
    /// and `status.operationState.phase: Running` now; until it ends, every pass applies what Git
    /// has; then `Succeeded`, `operation` cleared.
    pub async fn sync_in_flight(&self, app: &OwnerId, length: Duration) -> Result<(), SimError> {
        let api = dynamic_api(&self.client, &owner_resource(OwnerKind::Application), &app.namespace);
        let operation = json!({"sync": {"revision": "HEAD"}, "initiatedBy": {"username": "admin"}});
        let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let patch = json!({"operation": operation,
            "status": {"operationState": {"operation": operation, "phase": "Running", "startedAt": started, "finishedAt": null,
                                     "message": "syncing"}}});
        let pp = PatchParams { field_manager: Some("argocd-server".into()), ..PatchParams::default() };
        api.patch(&app.name, &pp, &Patch::Merge(patch))
            .await
            .map_err(SimError::kube(format!("starting a sync of {app}")))?;
        self.shared.syncs.lock().unwrap_or_else(|p| p.into_inner()).insert(app.clone(), Instant::now() + length);
        Ok(())
    }

    /// When `owner` last finished applying: a Flux pass that was not suspended when it began, or
    /// a sync started with [`GitopsSim::sync_in_flight`] (its passes and its end).
    pub fn last_applied(&self, owner: &OwnerId) -> Option<SystemTime> {
        self.shared.applied.lock().unwrap_or_else(|p| p.into_inner()).get(owner).copied()
    }

    /// Stops the reconcilers.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Reads an owner: `None` when it is gone. Whether it puts things back, and whether it
/// recreates and reverts (Argo CD without self-heal does neither on live changes; a HelmRelease
/// only with drift detection).
async fn acting(client: &Client, owner: &OwnerId) -> Result<Option<(DynamicObject, bool)>, kube::Error> {
    let api = dynamic_api(client, &owner_resource(owner.kind), &owner.namespace);
    let Some(obj) = api.get_opt(&owner.name).await? else { return Ok(None) };
    let value = serde_json::to_value(&obj).map_err(kube::Error::SerdeError)?;
    let heals = match owner.kind {
        OwnerKind::Application => value["spec"]["syncPolicy"]["automated"]["selfHeal"] == Value::Bool(true),
        OwnerKind::Kustomization => true,
        OwnerKind::HelmRelease => value["spec"]["driftDetection"]["mode"] == "enabled",
    };
    Ok(Some((obj, reconciles(owner.kind, &value) && heals)))
}

async fn still_acting(client: &Client, owner: &OwnerId) -> Result<bool, kube::Error> {
    Ok(acting(client, owner).await?.is_some_and(|(_, a)| a))
}

/// Starts (`running`) or ends an automated sync's `status.operationState` (no status
/// subresource on Application). Argo CD's CRD requires `operation`, `phase` and `startedAt` in
/// an `operationState` (`manifests/crds/application-crd.yaml`), so a start writes all three, and
/// clears the `finishedAt` of the one before, which would read as a failed sync waiting to retry.
async fn operation_phase(client: &Client, owner: &OwnerId, running: bool) -> Result<(), kube::Error> {
    if owner.kind != OwnerKind::Application {
        return Ok(());
    }
    let api = dynamic_api(client, &owner_resource(owner.kind), &owner.namespace);
    let pp = PatchParams { field_manager: Some("argocd-application-controller".into()), ..PatchParams::default() };
    let now = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let state = if running {
        json!({"operation": {"sync": {"revision": "HEAD"}, "initiatedBy": {"automated": true}},
               "phase": "Running", "startedAt": now, "finishedAt": null, "message": "self-healing"})
    } else {
        json!({"phase": "Succeeded", "finishedAt": now, "message": "successfully synced"})
    };
    api.patch(&owner.name, &pp, &Patch::Merge(json!({"status": {"operationState": state}}))).await?;
    Ok(())
}

/// One pass of an Application: a sync started on purpose runs (or ends); otherwise, with
/// automated sync and self-heal, what differs from Git is put back, re-reading the Application
/// before each write.
async fn argo_pass(client: &Client, owner: &OwnerId, repo: &[Desired], shared: &Shared) -> Result<(), kube::Error> {
    let sync_until = shared.syncs.lock().unwrap_or_else(|p| p.into_inner()).get(owner).copied();
    if let Some(until) = sync_until {
        if Instant::now() < until {
            apply(client, owner, repo, &shared.stats, false).await?;
            shared.applied_now(owner);
            return Ok(());
        }
        let api = dynamic_api(client, &owner_resource(owner.kind), &owner.namespace);
        let pp = PatchParams { field_manager: Some("argocd-application-controller".into()), ..PatchParams::default() };
        let finished = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        let patch = json!({"operation": null,
            "status": {"operationState": {"phase": "Succeeded", "finishedAt": finished, "message": "successfully synced"}}});
        api.patch(&owner.name, &pp, &Patch::Merge(patch)).await?;
        shared.syncs.lock().unwrap_or_else(|p| p.into_inner()).remove(owner);
        shared.applied_now(owner);
        return Ok(());
    }
    if !acting(client, owner).await?.is_some_and(|(_, a)| a) {
        return Ok(());
    }
    apply(client, owner, repo, &shared.stats, true).await
}

/// One pass of a Flux object: the object is read once; unless suspended, it is marked
/// `Reconciling`, the pass takes `length`, and what differs from Git is put back; every pass ends
/// by recording the reconcile request it read as handled.
async fn flux_pass(
    client: &Client,
    owner: &OwnerId,
    repo: &[Desired],
    shared: &Shared,
    length: Duration,
) -> Result<(), kube::Error> {
    let Some((obj, acts)) = acting(client, owner).await? else { return Ok(()) };
    let request = obj.annotations().get(FLUX_RECONCILE_REQUEST).cloned();
    let api = dynamic_api(client, &owner_resource(owner.kind), &owner.namespace);
    // a pass of no length writes no condition: the sandbox's store then changes only when
    // something is put back, which the tests that check nothing was written rely on
    let slow = !length.is_zero();
    let result = if acts {
        if slow {
            // Flux's CRDs require every field of a metav1.Condition, lastTransitionTime included
            let since = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
            let reconciling = json!([{"type": "Reconciling", "status": "True", "reason": "Progressing",
                "message": "reconciliation in progress", "lastTransitionTime": since}]);
            ops::patch_status(&api, &owner.name, json!({"conditions": reconciling})).await?;
            tokio::time::sleep(length).await;
        }
        let applied = apply(client, owner, repo, &shared.stats, false).await;
        shared.applied_now(owner);
        if slow {
            ops::patch_status(&api, &owner.name, json!({"conditions": []})).await?;
        }
        applied
    } else {
        Ok(())
    };
    let handled = obj.data["status"]["lastHandledReconcileAt"].as_str();
    if let Some(request) = request.filter(|r| handled != Some(r.as_str())) {
        ops::patch_status(&api, &owner.name, json!({"lastHandledReconcileAt": request})).await?;
    }
    result
}

/// Puts back what differs from Git. An `automated` pass (Argo CD self-heal) reads the owner again
/// before each write and stops once it no longer acts, and shows as an operation of its own
/// while it writes; a sync already under way or a Flux pass does neither.
async fn apply(
    client: &Client,
    owner: &OwnerId,
    repo: &[Desired],
    stats: &Stats,
    automated: bool,
) -> Result<(), kube::Error> {
    let mut syncing = false;
    let mut result = Ok(());
    for d in repo {
        let api = dynamic_api(client, &d.resource, &d.key.namespace);
        let live = api.get_opt(&d.key.name).await?;
        let change = match &live {
            None => Some(None),
            // Argo CD and Flux wait for a deletion to finish before they apply again
            Some(l) if l.metadata.deletion_timestamp.is_some() => None,
            Some(l) => {
                let spec = l.data.get("spec").cloned().unwrap_or(Value::Null);
                let mut patch = serde_json::Map::new();
                for f in drift_fields(&d.key.kind) {
                    let want = &d.manifest["spec"][*f];
                    if !want.is_null() && spec.get(*f) != Some(want) {
                        patch.insert((*f).to_string(), want.clone());
                    }
                }
                (!patch.is_empty()).then_some(Some(json!({"spec": patch})))
            }
        };
        let Some(change) = change else { continue };
        if automated && !still_acting(client, owner).await? {
            break;
        }
        if automated && !syncing {
            operation_phase(client, owner, true).await?;
            syncing = true;
        }
        let (_, manager) = marks(owner, &d.key);
        let pp = PatchParams { field_manager: Some(manager.into()), ..PatchParams::default() };
        let written = match change {
            None => {
                let obj: DynamicObject = serde_json::from_value(d.manifest.clone()).map_err(kube::Error::SerdeError)?;
                let pp = PostParams { field_manager: Some(manager.into()), ..PostParams::default() };
                api.create(&pp, &obj).await.map(|_| &stats.recreated)
            }
            Some(patch) => api.patch(&d.key.name, &pp, &Patch::Merge(patch)).await.map(|_| &stats.reverted),
        };
        match written {
            Ok(counter) => {
                counter.fetch_add(1, Ordering::Relaxed);
                tracing::info!(object = %d.key, "put back what Git has");
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if syncing {
        operation_phase(client, owner, false).await?;
    }
    result
}
