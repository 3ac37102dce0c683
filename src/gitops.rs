//! GitOps owners of the Karpenter objects (Argo CD and Flux), and the judgement over them.
//!
//! A GitOps controller with automated sync puts back what the teardown removes: Argo CD's
//! self-heal re-creates a deleted NodePool and reverts the fence, Flux re-applies its
//! Kustomization's inventory on every interval and a HelmRelease scales the controller back up.
//! The run then chases its own tail or ends with leftovers. So before any write the tool finds
//! who applies the NodePools, EC2NodeClasses and the controller Deployment, from what those
//! controllers themselves write on the objects:
//!
//! - Argo CD: the `argocd.argoproj.io/tracking-id` annotation `<app>:<group>/<kind>:<ns>/<name>`
//!   (annotation tracking, the default since Argo CD 3.0; `<app>` is `<namespace>_<name>` for an
//!   Application outside Argo CD's own namespace), or the `app.kubernetes.io/instance` label
//!   (label tracking, the 2.x default; Helm charts set that label too, so it only counts when the
//!   Application it names lists the object in `status.resources`);
//! - Flux: `kustomize.toolkit.fluxcd.io/{name,namespace}` and `helm.toolkit.fluxcd.io/{name,namespace}`
//!   labels, and a Kustomization's `status.inventory`;
//! - `managedFields`: an object last written by `argocd-controller`, `kustomize-controller` or
//!   `helm-controller` that no owner in this cluster accounts for is managed from elsewhere.
//!
//! Owners of owners count too (an app-of-apps parent with self-heal would turn a child's
//! automated sync back on; a Kustomization that applies a HelmRelease may reset `suspend`), so
//! they are found the same way, and paused first.
//!
//! Everything here is a pure function of objects already read; `crate::k8s::gitops` does the
//! reading and the pausing.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::Serialize;
use serde_json::Value;

/// Argo CD's annotation tracking (`<app>:<group>/<kind>:<namespace>/<name>`).
pub(crate) const ARGO_TRACKING_ANNOTATION: &str = "argocd.argoproj.io/tracking-id";
/// Argo CD's label tracking (and the well-known label Helm charts set themselves).
pub(crate) const ARGO_INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
/// An Application Argo CD does not reconcile at all.
pub(crate) const ARGO_SKIP_RECONCILE: &str = "argocd.argoproj.io/skip-reconcile";
/// Flux kustomize-controller's labels on what it applies.
pub(crate) const FLUX_KUSTOMIZATION_LABELS: (&str, &str) =
    ("kustomize.toolkit.fluxcd.io/name", "kustomize.toolkit.fluxcd.io/namespace");
/// Flux helm-controller's labels on what a HelmRelease renders.
pub(crate) const FLUX_HELMRELEASE_LABELS: (&str, &str) =
    ("helm.toolkit.fluxcd.io/name", "helm.toolkit.fluxcd.io/namespace");
/// Argo CD's address for the cluster it runs in (`KubernetesInternalAPIServerAddr`).
pub(crate) const ARGO_IN_CLUSTER_SERVER: &str = "https://kubernetes.default.svc";
/// Argo CD's name for the cluster it runs in (`KubernetesInClusterName`).
pub(crate) const ARGO_IN_CLUSTER_NAME: &str = "in-cluster";
/// Flux's reconcile request (`meta.ReconcileRequestAnnotation`): the controller copies its value
/// to `status.lastHandledReconcileAt` at the end of every pass, a suspended one included.
pub(crate) const FLUX_RECONCILE_REQUEST: &str = "reconcile.fluxcd.io/requestedAt";
/// Where the tool keeps an Application's `spec.syncPolicy.automated` when it turns it off, so a
/// human can see (and restore) what it was.
pub const PAUSED_AUTOMATED_ANNOTATION: &str = "karpenter-teardown.io/paused-automated-sync";
/// Field managers of the GitOps controllers, and the owner kinds that write as them.
const GITOPS_MANAGERS: [(&str, &[OwnerKind]); 4] = [
    ("argocd-controller", &[OwnerKind::Application]),
    ("argocd-application-controller", &[OwnerKind::Application]),
    ("kustomize-controller", &[OwnerKind::Kustomization]),
    ("helm-controller", &[OwnerKind::HelmRelease]),
];

/// The kinds of GitOps owner the tool knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum OwnerKind {
    /// Argo CD `applications.argoproj.io`.
    Application,
    /// Flux `kustomizations.kustomize.toolkit.fluxcd.io`.
    Kustomization,
    /// Flux `helmreleases.helm.toolkit.fluxcd.io`.
    HelmRelease,
}

impl OwnerKind {
    /// Every kind, in the order they are listed.
    pub(crate) const ALL: [OwnerKind; 3] = [OwnerKind::Application, OwnerKind::Kustomization, OwnerKind::HelmRelease];

    /// The API group.
    pub(crate) fn group(self) -> &'static str {
        match self {
            OwnerKind::Application => "argoproj.io",
            OwnerKind::Kustomization => "kustomize.toolkit.fluxcd.io",
            OwnerKind::HelmRelease => "helm.toolkit.fluxcd.io",
        }
    }

    /// The resource (plural) name.
    pub(crate) fn plural(self) -> &'static str {
        match self {
            OwnerKind::Application => "applications",
            OwnerKind::Kustomization => "kustomizations",
            OwnerKind::HelmRelease => "helmreleases",
        }
    }

    /// The versions to read it at, newest first: clusters run Flux releases from before the
    /// v1/v2 APIs, and a version the server does not serve answers 404.
    pub(crate) fn versions(self) -> &'static [&'static str] {
        match self {
            OwnerKind::Application => &["v1alpha1"],
            OwnerKind::Kustomization => &["v1", "v1beta2"],
            OwnerKind::HelmRelease => &["v2", "v2beta2", "v2beta1"],
        }
    }

    /// The kind name.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            OwnerKind::Application => "Application",
            OwnerKind::Kustomization => "Kustomization",
            OwnerKind::HelmRelease => "HelmRelease",
        }
    }

    /// The product, for messages.
    pub(crate) fn tool(self) -> &'static str {
        match self {
            OwnerKind::Application => "Argo CD",
            OwnerKind::Kustomization | OwnerKind::HelmRelease => "Flux",
        }
    }
}

/// One GitOps owner object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct OwnerId {
    /// Its kind.
    pub kind: OwnerKind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}/{}", self.kind.tool(), self.kind.kind(), self.namespace, self.name)
    }
}

/// The address of an object: group, kind, namespace (empty when cluster-scoped), name.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
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

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}/{}", self.kind, self.name)
        } else {
            write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// An object whose owners matter, with the metadata that names them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tracked {
    /// Where it is.
    pub key: ObjectKey,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its annotations.
    pub annotations: BTreeMap<String, String>,
    /// The field managers in its `managedFields`.
    pub managers: BTreeSet<String>,
    /// Its owner references, as (kind, name).
    pub owner_refs: Vec<(String, String)>,
}

impl Tracked {
    /// Reads the parts of an object (as JSON, any kind) that name its owners.
    pub fn from_json(group: &str, kind: &str, obj: &Value) -> Tracked {
        let meta = &obj["metadata"];
        let strings = |v: &Value| -> BTreeMap<String, String> {
            v.as_object()
                .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
                .unwrap_or_default()
        };
        let list = |v: &Value| v.as_array().cloned().unwrap_or_default();
        Tracked {
            key: ObjectKey {
                group: group.to_string(),
                kind: kind.to_string(),
                namespace: meta["namespace"].as_str().unwrap_or_default().to_string(),
                name: meta["name"].as_str().unwrap_or_default().to_string(),
            },
            labels: strings(&meta["labels"]),
            annotations: strings(&meta["annotations"]),
            managers: list(&meta["managedFields"])
                .iter()
                .filter_map(|m| m["manager"].as_str().map(str::to_string))
                .collect(),
            owner_refs: list(&meta["ownerReferences"])
                .iter()
                .filter_map(|r| Some((r["kind"].as_str()?.to_string(), r["name"].as_str()?.to_string())))
                .collect(),
        }
    }
}

/// A GitOps owner object as read from the cluster, judged.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnerObject {
    /// Which one.
    pub id: OwnerId,
    /// Its own metadata: it may have owners of its own.
    pub meta: Tracked,
    /// Whether it would put back what the teardown removes, and in what words.
    pub state: OwnerState,
    /// What its status says it manages (Argo CD `status.resources`, Flux `status.inventory`).
    pub manages: BTreeSet<ObjectKey>,
    /// The ApplicationSet that generates it (Argo CD), which rewrites its sync policy.
    pub application_set: Option<String>,
    /// The cluster it applies to.
    pub destination: Destination,
}

/// The cluster an owner applies what it manages to, as its spec says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// Argo CD `spec.destination.server`, without the trailing `/` Argo CD trims before it
    /// compares (`util/argo/argo.go`, `GetDestinationServer`).
    Server(String),
    /// Argo CD `spec.destination.name`, which Argo CD resolves through its cluster Secrets.
    Name(String),
    /// Flux `spec.kubeConfig`: the Secret or ConfigMap holding another cluster's kubeconfig.
    KubeConfig(String),
    /// Nothing names another cluster: Flux without `spec.kubeConfig`, or an Application whose
    /// destination Argo CD rejects (none, or both `server` and `name`), which applies nothing
    /// anywhere; counting it as this cluster's errs on the side of refusing.
    Here,
}

impl Destination {
    fn from_json(kind: OwnerKind, obj: &Value) -> Destination {
        let spec = &obj["spec"];
        let text = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
        match kind {
            OwnerKind::Application => {
                let d = &spec["destination"];
                match (text(&d["server"]), text(&d["name"])) {
                    (Some(server), None) => Destination::Server(server.trim_end_matches('/').to_string()),
                    (None, Some(name)) => Destination::Name(name),
                    _ => Destination::Here,
                }
            }
            OwnerKind::Kustomization | OwnerKind::HelmRelease => {
                let k = &spec["kubeConfig"];
                if let Some(secret) = text(&k["secretRef"]["name"]) {
                    Destination::KubeConfig(format!("Secret {secret}"))
                } else if let Some(map) = text(&k["configMapRef"]["name"]) {
                    Destination::KubeConfig(format!("ConfigMap {map}"))
                } else if k.is_object() {
                    Destination::KubeConfig("an unnamed reference".into())
                } else {
                    Destination::Here
                }
            }
        }
    }

    /// Where it applies, when that is not this cluster (`None` when it is). `this_server` is the
    /// API server URL the tool itself talks to: an Application may name this cluster by that
    /// address instead of Argo CD's in-cluster one.
    ///
    /// Argo CD's in-cluster destination is the server `https://kubernetes.default.svc`, or the
    /// name `in-cluster` when no cluster Secret takes that name (`util/db/cluster.go`,
    /// `GetClusterServersByName`). Other names are resolved through cluster Secrets, which the
    /// tool does not read (they hold credentials); such an Application counts as another
    /// cluster's, and the survey treats what it cannot place with care (see [`survey`]).
    pub(crate) fn elsewhere(&self, this_server: &str) -> Option<String> {
        match self {
            Destination::Server(s) if s == ARGO_IN_CLUSTER_SERVER || s == this_server.trim_end_matches('/') => None,
            Destination::Server(s) => Some(format!("deploys to the cluster at {s}")),
            Destination::Name(n) if n == ARGO_IN_CLUSTER_NAME => None,
            Destination::Name(n) => Some(format!("deploys to the Argo CD cluster named {n}")),
            Destination::KubeConfig(r) => Some(format!("applies to the cluster in its spec.kubeConfig ({r})")),
            Destination::Here => None,
        }
    }

    /// True for a destination named by an Argo CD cluster name the tool cannot resolve.
    fn by_name(&self) -> bool {
        matches!(self, Destination::Name(_))
    }
}

/// Whether an owner reconciles.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "detail", rename_all = "kebab-case")]
pub enum OwnerState {
    /// It puts back what is removed (what its settings say).
    Active(String),
    /// It does not (why: suspended, automated sync off, reconcile skipped).
    Paused(String),
}

impl OwnerState {
    /// True when it reconciles.
    pub(crate) fn is_active(&self) -> bool {
        matches!(self, OwnerState::Active(_))
    }
}

impl OwnerObject {
    /// Judges an owner object read at any served version.
    pub fn from_json(kind: OwnerKind, obj: &Value) -> OwnerObject {
        let meta = Tracked::from_json(kind.group(), kind.kind(), obj);
        let id = OwnerId { kind, namespace: meta.key.namespace.clone(), name: meta.key.name.clone() };
        let (state, manages) = match kind {
            OwnerKind::Application => (application_state(obj, &meta), application_resources(obj)),
            OwnerKind::Kustomization => (flux_state(obj), kustomization_inventory(obj)),
            OwnerKind::HelmRelease => (flux_state(obj), BTreeSet::new()),
        };
        let application_set = (kind == OwnerKind::Application)
            .then(|| meta.owner_refs.iter().find(|(k, _)| k == "ApplicationSet").map(|(_, n)| n.clone()))
            .flatten();
        let destination = Destination::from_json(kind, obj);
        OwnerObject { id, meta, state, manages, application_set, destination }
    }
}

fn application_state(obj: &Value, meta: &Tracked) -> OwnerState {
    if meta.annotations.get(ARGO_SKIP_RECONCILE).map(String::as_str) == Some("true") {
        return OwnerState::Paused(format!("{ARGO_SKIP_RECONCILE}=true"));
    }
    let automated = &obj["spec"]["syncPolicy"]["automated"];
    if !automated.is_object() {
        return OwnerState::Paused("automated sync off".into());
    }
    // Argo CD 3.1+: `enabled: false` keeps the settings but turns automated sync off; absent or
    // null means on
    if automated["enabled"] == Value::Bool(false) {
        return OwnerState::Paused("automated sync off (enabled: false)".into());
    }
    let mut how = vec!["automated sync"];
    if automated["selfHeal"] == Value::Bool(true) {
        how.push("self-heal");
    }
    if automated["prune"] == Value::Bool(true) {
        how.push("prune");
    }
    OwnerState::Active(how.join(", "))
}

fn flux_state(obj: &Value) -> OwnerState {
    if obj["spec"]["suspend"] == Value::Bool(true) {
        return OwnerState::Paused("suspended".into());
    }
    match obj["spec"]["interval"].as_str() {
        Some(i) => OwnerState::Active(format!("reconciles every {i}")),
        None => OwnerState::Active("reconciles".into()),
    }
}

fn application_resources(obj: &Value) -> BTreeSet<ObjectKey> {
    obj["status"]["resources"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| ObjectKey {
                    group: r["group"].as_str().unwrap_or_default().to_string(),
                    kind: r["kind"].as_str().unwrap_or_default().to_string(),
                    namespace: r["namespace"].as_str().unwrap_or_default().to_string(),
                    name: r["name"].as_str().unwrap_or_default().to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What an owner is still doing that would apply the Karpenter objects as Git has them, from
/// its object as read now; `None` when nothing is in flight. Pausing stops what an owner would
/// start next, not what it has started: an Argo CD sync runs to its end (and a failed one retries)
/// with automated sync off, and a Flux reconcile that read the object before `suspend` finishes
/// its apply.
///
/// Argo CD (`controller/appcontroller.go`, `processRequestedAppOperation`; phases in
/// `gitops-engine/pkg/sync/common/types.go`): `operation` is set from the request until the
/// operation completes; `status.operationState.phase` is `Running` while it runs and while a
/// failed one waits to retry (`finishedAt` then set), `Terminating` while it is being stopped.
///
/// Flux (`fluxcd/pkg` `apis/meta`): `request` is the `reconcile.fluxcd.io/requestedAt` value
/// the run wrote in the same write as `suspend: true`. The controller reconciles one object one
/// pass at a time and copies that value to `status.lastHandledReconcileAt` at the end of every
/// pass, a suspended one included (kustomize-controller `finalizeStatus`, helm-controller
/// `Reconcile`): once it is there, a pass has seen the suspend and every pass before it is over.
/// Without a request of the run's (an owner already suspended), the `Reconciling` condition says
/// whether a pass is under way; its reason `ProgressingWithRetry` only means a failed pass would
/// be retried, which a suspended object is not.
pub(crate) fn in_flight(kind: OwnerKind, obj: &Value, request: Option<&str>) -> Option<String> {
    match kind {
        OwnerKind::Application => {
            let state = &obj["status"]["operationState"];
            let requested = obj.get("operation").is_some_and(|o| !o.is_null());
            match state["phase"].as_str() {
                Some("Terminating") => Some("a sync is being terminated (operationState.phase Terminating)".into()),
                Some("Running") if !state["finishedAt"].is_null() => Some(format!(
                    "a failed sync waits to retry (attempt {}): {}",
                    state["retryCount"].as_i64().unwrap_or_default() + 1,
                    state["message"].as_str().unwrap_or("no message")
                )),
                Some("Running") => Some(format!(
                    "a sync is running (operationState.phase Running since {})",
                    state["startedAt"].as_str().unwrap_or("an unknown time")
                )),
                _ if requested => Some("a sync is requested (operation set) and has not ended".into()),
                _ => None,
            }
        }
        OwnerKind::Kustomization | OwnerKind::HelmRelease => {
            if let Some(request) = request {
                let handled = obj["status"]["lastHandledReconcileAt"].as_str().unwrap_or_default();
                return (handled != request).then(|| {
                    format!(
                        "Flux has not handled the suspend yet (status.lastHandledReconcileAt is {:?}, the run asked \
                         {request:?}): a reconcile begun before it may still be applying",
                        handled
                    )
                });
            }
            let conditions = obj["status"]["conditions"].as_array().cloned().unwrap_or_default();
            let reconciling = conditions.iter().find(|c| c["type"] == "Reconciling" && c["status"] == "True")?;
            let reason = reconciling["reason"].as_str().unwrap_or_default();
            (reason != "ProgressingWithRetry").then(|| {
                format!(
                    "a reconcile is under way (condition Reconciling: {reason}: {})",
                    reconciling["message"].as_str().unwrap_or_default()
                )
            })
        }
    }
}

/// Flux inventory entries are `<namespace>_<name>_<group>_<kind>`; none of the four can contain
/// `_` (DNS names and kinds), and the namespace and group are empty for cluster-scoped and core.
fn kustomization_inventory(obj: &Value) -> BTreeSet<ObjectKey> {
    obj["status"]["inventory"]["entries"]
        .as_array()
        .map(|es| es.iter().filter_map(|e| parse_inventory_id(e["id"].as_str()?)).collect())
        .unwrap_or_default()
}

/// Parses a Flux inventory id.
pub(crate) fn parse_inventory_id(id: &str) -> Option<ObjectKey> {
    let parts: Vec<&str> = id.split('_').collect();
    let [namespace, name, group, kind] = parts.as_slice() else { return None };
    Some(ObjectKey {
        group: group.to_string(),
        kind: kind.to_string(),
        namespace: namespace.to_string(),
        name: name.to_string(),
    })
}

/// Formats a Flux inventory id.
#[cfg(test)]
pub(crate) fn inventory_id(key: &ObjectKey) -> String {
    format!("{}_{}_{}_{}", key.namespace, key.name, key.group, key.kind)
}

/// A tracking id, parsed: the application (namespace when given, name) and the object it claims.
fn parse_tracking_id(value: &str) -> Option<(Option<String>, String, ObjectKey)> {
    let mut parts = value.splitn(3, ':');
    let app = parts.next()?;
    let (group, kind) = parts.next()?.split_once('/')?;
    let (namespace, name) = parts.next()?.split_once('/')?;
    let (app_ns, app_name) = match app.split_once('_') {
        Some((ns, n)) => (Some(ns.to_string()), n.to_string()),
        None => (None, app.to_string()),
    };
    let key = ObjectKey {
        group: group.to_string(),
        kind: kind.to_string(),
        namespace: namespace.to_string(),
        name: name.to_string(),
    };
    Some((app_ns, app_name, key))
}

/// Whether a tracking id that claims `claimed` is the one of `obj`, as Argo CD decides it
/// (`controller/state.go`, `isSelfReferencedObj`): group, kind and name must match; the namespace
/// too, except for a cluster-scoped object, whose id carries the Application's destination
/// namespace in place of its own empty one (`util/argo/resource_tracking.go`,
/// `UnstructuredToAppInstanceValue`). Any other mismatch is an id copied with a manifest.
fn claims(claimed: &ObjectKey, obj: &ObjectKey) -> bool {
    claimed.group == obj.group
        && claimed.kind == obj.kind
        && claimed.name == obj.name
        && (obj.namespace.is_empty() || claimed.namespace == obj.namespace)
}

/// An owner the survey found, with what it applies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// The owner.
    pub owner: OwnerId,
    /// Whether it reconciles, before the run did anything.
    #[serde(flatten)]
    pub state: OwnerState,
    /// What it applies, as `Kind/name`, `Kind/namespace/name` or another owner.
    pub owns: Vec<String>,
    /// How each was found.
    pub evidence: Vec<String>,
    /// Why the tool cannot pause it, when it cannot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unpausable: Option<String>,
    /// Whether this run paused it.
    pub paused_by_run: bool,
    /// How far it is from the Karpenter objects (1: applies them; 2: applies an owner of them).
    #[serde(skip)]
    pub depth: usize,
}

impl Finding {
    /// One line for the plan, the refusal and the logs.
    pub(crate) fn describe(&self) -> String {
        let state = match &self.state {
            OwnerState::Active(d) => d.clone(),
            OwnerState::Paused(d) => format!("already paused: {d}"),
        };
        format!("{} ({state}) applies {}", self.owner, self.owns.join(", "))
    }
}

/// An object managed by a GitOps controller the tool cannot reach from this cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unreachable {
    /// The object.
    pub object: String,
    /// What says it is managed.
    pub evidence: String,
    /// Why the owner cannot be found or paused from here.
    pub why: String,
}

/// An owner in this cluster that applies to another cluster, set aside: what it lists has the
/// same name as an object here, but lives there. Never paused, never patched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OtherCluster {
    /// The owner.
    pub owner: OwnerId,
    /// Where it applies, and so why it was set aside.
    pub why: String,
    /// The objects here it names, as `Kind/name` or `Kind/namespace/name`.
    pub names: Vec<String>,
}

/// What the survey found.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Survey {
    /// Owners, parents before the owners they apply.
    pub owners: Vec<Finding>,
    /// Objects whose owner is not in this cluster.
    pub unreachable: Vec<Unreachable>,
    /// Evidence looked at and set aside (a Helm chart's instance label, a copied tracking id).
    pub set_aside: Vec<String>,
    /// Owners here that apply to other clusters (a hub's Argo CD, a Flux with `spec.kubeConfig`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub other_clusters: Vec<OtherCluster>,
}

/// What the user consented to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GitopsConsent {
    /// `--pause-gitops`: suspend the owners found before the fence.
    pub pause: bool,
    /// `--gitops-paused-elsewhere`: the owners outside this cluster are paused by the user.
    pub paused_elsewhere: bool,
}

impl Survey {
    /// True when nothing GitOps was found (the report then leaves the section out).
    pub(crate) fn is_empty(&self) -> bool {
        self.owners.is_empty()
            && self.unreachable.is_empty()
            && self.set_aside.is_empty()
            && self.other_clusters.is_empty()
    }

    /// Records that `owner`, which applies to another cluster (`why`), names `object`.
    fn other_cluster(&mut self, owner: &OwnerObject, why: String, object: &ObjectKey) {
        let name = object.to_string();
        match self.other_clusters.iter_mut().find(|o| o.owner == owner.id) {
            Some(o) if o.names.contains(&name) => {}
            Some(o) => o.names.push(name),
            None => self.other_clusters.push(OtherCluster { owner: owner.id.clone(), why, names: vec![name] }),
        }
    }

    /// The owners that reconcile now.
    pub(crate) fn active(&self) -> impl Iterator<Item = &Finding> {
        self.owners.iter().filter(|f| f.state.is_active())
    }

    /// Why a run must not start, given what the user consented to; `None` when it may.
    pub(crate) fn refusal(&self, consent: GitopsConsent) -> Option<String> {
        let mut reasons = Vec::new();
        let stuck: Vec<String> =
            self.active().filter_map(|f| f.unpausable.as_ref().map(|why| format!("{}: {why}", f.owner))).collect();
        if !stuck.is_empty() {
            reasons.push(format!("owners the tool cannot pause reconcile the Karpenter objects: {}", stuck.join("; ")));
        }
        if !self.unreachable.is_empty() && !consent.paused_elsewhere {
            let list: Vec<String> =
                self.unreachable.iter().map(|u| format!("{} ({}: {})", u.object, u.evidence, u.why)).collect();
            reasons.push(format!(
                "objects are managed by GitOps from outside this cluster: {}. Pause their owners there (Argo CD: turn \
                 automated sync off; Flux: flux suspend), then run again with --gitops-paused-elsewhere",
                list.join("; ")
            ));
        }
        let active: Vec<String> = self.active().filter(|f| f.unpausable.is_none()).map(Finding::describe).collect();
        if !active.is_empty() && !consent.pause {
            reasons.push(format!(
                "GitOps owners would put back what the teardown removes: {}. Run again with --pause-gitops to suspend \
                 exactly these owners before the fence (they are not resumed: the cluster is going away)",
                active.join("; ")
            ));
        }
        (!reasons.is_empty()).then(|| format!("refusing: {}. Nothing was changed", reasons.join(". Also, ")))
    }

    /// Lines for the concrete plan.
    pub(crate) fn plan_lines(&self, consent: GitopsConsent) -> Vec<String> {
        let mut out: Vec<String> = self
            .owners
            .iter()
            .map(|f| {
                let then = match (&f.state, consent.pause) {
                    (OwnerState::Paused(_), _) => "left as it is",
                    (OwnerState::Active(_), true) => "paused before the fence, never resumed",
                    (OwnerState::Active(_), false) => "refuses the run without --pause-gitops",
                };
                format!("GitOps: {}: {then}", f.describe())
            })
            .collect();
        out.extend(self.unreachable.iter().map(|u| format!("GitOps: {} managed from elsewhere ({})", u.object, u.why)));
        out.extend(self.set_aside.iter().map(|s| format!("GitOps: set aside: {s}")));
        out.extend(self.other_clusters.iter().map(|o| {
            format!(
                "GitOps: set aside: {} {} (it names {}, but that is another cluster's): never paused",
                o.owner,
                o.why,
                o.names.join(", ")
            )
        }));
        out
    }
}

/// The Karpenter objects the owners' own records list (Argo CD's `status.resources`, Flux's
/// inventory), as subjects without metadata: what a survey can go on when the objects cannot be
/// read themselves (Karpenter 1.0.x's CRDs behind a dead conversion webhook). Each is found only
/// through the owner that lists it.
pub(crate) fn listed_karpenter_objects(listed: &[OwnerObject]) -> Vec<Tracked> {
    let groups = [crate::karpenter::KARPENTER_GROUP, crate::karpenter::AWS_GROUP];
    let keys: BTreeSet<&ObjectKey> =
        listed.iter().flat_map(|o| &o.manages).filter(|k| groups.contains(&k.group.as_str())).collect();
    keys.into_iter().map(|key| Tracked { key: key.clone(), ..Tracked::default() }).collect()
}

/// Finds the owners of `objects` (and their owners) among `listed`. `this_server` is the API
/// server URL the tool talks to (see [`Destination::elsewhere`]). Only owners that apply to this
/// cluster count: one that applies elsewhere and merely lists an object of the same name is set
/// aside; one that the object's own metadata names (a tracking id, Flux's labels) while it
/// applies elsewhere cannot be placed, so the object counts as managed from outside.
pub fn survey(objects: &[Tracked], listed: &[OwnerObject], this_server: &str) -> Survey {
    let mut found: BTreeMap<OwnerId, Finding> = BTreeMap::new();
    let mut out = Survey::default();
    let mut queue: VecDeque<(Tracked, usize)> = objects.iter().cloned().map(|o| (o, 1)).collect();
    let mut seen: BTreeSet<ObjectKey> = BTreeSet::new();
    while let Some((obj, depth)) = queue.pop_front() {
        if !seen.insert(obj.key.clone()) {
            continue;
        }
        for (owner, evidence) in owners_of(&obj, listed, this_server, &mut out) {
            let f = found.entry(owner.id.clone()).or_insert_with(|| Finding {
                owner: owner.id.clone(),
                state: owner.state.clone(),
                owns: Vec::new(),
                evidence: Vec::new(),
                unpausable: owner.application_set.as_ref().map(|s| {
                    format!(
                        "generated by ApplicationSet {s}, which puts its template's sync policy back; turn automated \
                         sync off in the ApplicationSet's template, then run again"
                    )
                }),
                paused_by_run: false,
                depth,
            });
            f.depth = f.depth.max(depth);
            f.owns.push(obj.key.to_string());
            f.evidence.push(format!("{}: {evidence}", obj.key));
            queue.push_back((owner.meta.clone(), depth + 1));
        }
    }
    let mut owners: Vec<Finding> = found.into_values().collect();
    // parents first: pausing a child while its parent still syncs could be undone
    owners.sort_by(|a, b| b.depth.cmp(&a.depth).then_with(|| a.owner.cmp(&b.owner)));
    out.owners = owners;
    out
}

/// The owners one object names, each with the evidence; what cannot be resolved goes to
/// `out.unreachable` or `out.set_aside`, owners that apply to other clusters to
/// `out.other_clusters`.
fn owners_of<'a>(
    obj: &Tracked,
    listed: &'a [OwnerObject],
    this_server: &str,
    out: &mut Survey,
) -> Vec<(&'a OwnerObject, String)> {
    let mut owners: Vec<(&OwnerObject, String)> = Vec::new();
    let lists_it = |o: &OwnerObject| o.manages.contains(&obj.key);
    let elsewhere = |o: &OwnerObject| o.destination.elsewhere(this_server);

    if let Some(value) = obj.annotations.get(ARGO_TRACKING_ANNOTATION) {
        match parse_tracking_id(value) {
            // Argo CD ignores a tracking id that names another object (one copied with the
            // manifest): so does the tool
            Some((_, _, claimed)) if !claims(&claimed, &obj.key) => out.set_aside.push(format!(
                "{}: {ARGO_TRACKING_ANNOTATION} names {claimed}, another object (copied; Argo CD ignores it too)",
                obj.key
            )),
            Some((app_ns, app, _)) => {
                let named: Vec<&OwnerObject> = listed
                    .iter()
                    .filter(|o| o.id.kind == OwnerKind::Application && o.id.name == app)
                    .filter(|o| app_ns.as_ref().is_none_or(|ns| *ns == o.id.namespace))
                    .collect();
                let candidates: Vec<&OwnerObject> = named.iter().copied().filter(|o| elsewhere(o).is_none()).collect();
                let listing: Vec<&OwnerObject> = candidates.iter().copied().filter(|o| lists_it(o)).collect();
                let evidence = format!("{ARGO_TRACKING_ANNOTATION}={value}");
                match (candidates.len(), listing.len()) {
                    (0, _) if named.is_empty() => out.unreachable.push(Unreachable {
                        object: obj.key.to_string(),
                        evidence,
                        why: format!("no Application {app} in this cluster: an Argo CD elsewhere manages it"),
                    }),
                    // only Argo CD writes this id, on what it applies: an Application of that
                    // name here that applies elsewhere did not write it, unless its destination
                    // is another address or name of this cluster; the tool cannot tell which
                    (0, _) => out.unreachable.push(Unreachable {
                        object: obj.key.to_string(),
                        evidence,
                        why: format!(
                            "the Application{} named {app} here {}, not to this cluster: either an Argo CD elsewhere \
                             manages it, or that destination is this cluster under another address or name",
                            if named.len() > 1 { "s" } else { "" },
                            named.iter().filter_map(|o| elsewhere(o)).collect::<Vec<_>>().join(", ")
                        ),
                    }),
                    (1, _) => owners.push((candidates[0], evidence)),
                    (_, 1) => owners.push((listing[0], evidence)),
                    _ => out.unreachable.push(Unreachable {
                        object: obj.key.to_string(),
                        evidence,
                        why: format!(
                            "several Applications are named {app} ({}) and the tracking id does not say which",
                            candidates.iter().map(|o| o.id.namespace.as_str()).collect::<Vec<_>>().join(", ")
                        ),
                    }),
                }
            }
            None => out.set_aside.push(format!("{}: {ARGO_TRACKING_ANNOTATION}={value} is not a tracking id", obj.key)),
        }
    } else if let Some(app) = obj.labels.get(ARGO_INSTANCE_LABEL) {
        let apps: Vec<&OwnerObject> =
            listed.iter().filter(|o| o.id.kind == OwnerKind::Application && o.id.name == *app && lists_it(o)).collect();
        if apps.is_empty() {
            out.set_aside.push(format!(
                "{}: label {ARGO_INSTANCE_LABEL}={app} (no Application {app} lists it; Helm charts set this label too)",
                obj.key
            ));
        }
        for o in apps {
            let evidence = format!("label {ARGO_INSTANCE_LABEL}={app}");
            match elsewhere(o) {
                None => owners.push((o, evidence)),
                // a cluster name could be this cluster's under a cluster Secret the tool does
                // not read: the label (weak as it is) then cannot be dismissed
                Some(why) if o.destination.by_name() => out.unreachable.push(Unreachable {
                    object: obj.key.to_string(),
                    evidence,
                    why: format!(
                        "{} {why}, a name Argo CD resolves through its cluster Secrets: the tool cannot tell whether \
                         it is this cluster",
                        o.id
                    ),
                }),
                // the label is the Helm chart's own, or that Argo CD's on the other cluster's copy
                Some(why) => out.other_cluster(o, why, &obj.key),
            }
        }
    }

    for (kind, (name_label, ns_label)) in
        [(OwnerKind::Kustomization, FLUX_KUSTOMIZATION_LABELS), (OwnerKind::HelmRelease, FLUX_HELMRELEASE_LABELS)]
    {
        let (Some(name), Some(ns)) = (obj.labels.get(name_label), obj.labels.get(ns_label)) else { continue };
        let evidence = format!("labels {name_label}={name}, {ns_label}={ns}");
        match listed.iter().find(|o| o.id.kind == kind && o.id.name == *name && o.id.namespace == *ns) {
            Some(o) => match elsewhere(o) {
                None => owners.push((o, evidence)),
                // Flux writes these labels on what it applies; an owner here that applies
                // elsewhere wrote them only if its kubeconfig is this cluster's
                Some(why) => out.unreachable.push(Unreachable {
                    object: obj.key.to_string(),
                    evidence,
                    why: format!(
                        "{} {why}, not to this cluster: either a Flux elsewhere manages it, or that kubeconfig is this \
                         cluster's",
                        o.id
                    ),
                }),
            },
            None => out.unreachable.push(Unreachable {
                object: obj.key.to_string(),
                evidence,
                why: format!("no {} {ns}/{name} in this cluster", kind.kind()),
            }),
        }
    }

    for o in listed.iter().filter(|o| lists_it(o)) {
        if owners.iter().any(|(known, _)| known.id == o.id) {
            continue;
        }
        match elsewhere(o) {
            None => owners.push((o, format!("listed in the status of {}", o.id))),
            // its status lists the object of that name on the cluster it applies to
            Some(why) => out.other_cluster(o, why, &obj.key),
        }
    }

    for m in &obj.managers {
        let Some((_, kinds)) = GITOPS_MANAGERS.iter().find(|(name, _)| name == m) else { continue };
        let accounted = owners.iter().any(|(o, _)| kinds.contains(&o.id.kind))
            || out.unreachable.iter().any(|u| u.object == obj.key.to_string());
        if !accounted {
            out.unreachable.push(Unreachable {
                object: obj.key.to_string(),
                evidence: format!("managedFields: field manager {m}"),
                why: format!("no {} in this cluster accounts for it", kinds[0].kind()),
            });
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The API server the tests' tool talks to.
    const HERE: &str = "https://ABCD.gr7.eu-west-1.eks.amazonaws.com";

    fn pool(name: &str, labels: Value, annotations: Value, managers: &[&str]) -> Tracked {
        let managed: Vec<Value> = managers.iter().map(|m| json!({"manager": m})).collect();
        Tracked::from_json(
            "karpenter.sh",
            "NodePool",
            &json!({"metadata": {"name": name, "labels": labels, "annotations": annotations, "managedFields": managed}}),
        )
    }

    fn app(ns: &str, name: &str, automated: Value, resources: Value, extra_meta: Value) -> OwnerObject {
        let mut meta = json!({"name": name, "namespace": ns});
        if let (Some(m), Some(e)) = (meta.as_object_mut(), extra_meta.as_object()) {
            m.extend(e.clone());
        }
        OwnerObject::from_json(
            OwnerKind::Application,
            &json!({"metadata": meta, "spec": {"syncPolicy": {"automated": automated}}, "status": {"resources": resources}}),
        )
    }

    fn kustomization(ns: &str, name: &str, suspend: bool, inventory: &[&str]) -> OwnerObject {
        let entries: Vec<Value> = inventory.iter().map(|i| json!({"id": i, "v": "v1"})).collect();
        OwnerObject::from_json(
            OwnerKind::Kustomization,
            &json!({"metadata": {"name": name, "namespace": ns}, "spec": {"suspend": suspend, "interval": "10m"},
                    "status": {"inventory": {"entries": entries}}}),
        )
    }

    fn pool_resource(name: &str) -> Value {
        json!([{"group": "karpenter.sh", "kind": "NodePool", "name": name}])
    }

    #[test]
    fn an_annotation_tracked_pool_names_its_application_and_refuses_without_consent() {
        let objs = [pool(
            "default",
            json!({}),
            json!({ARGO_TRACKING_ANNOTATION: "karpenter:karpenter.sh/NodePool:/default"}),
            &["argocd-controller"],
        )];
        let listed = [app("argocd", "karpenter", json!({"selfHeal": true}), json!([]), json!({}))];
        let s = survey(&objs, &listed, HERE);
        assert_eq!(s.owners.len(), 1, "{s:?}");
        assert!(s.unreachable.is_empty(), "the field manager is accounted for: {s:?}");
        assert_eq!(s.owners[0].state, OwnerState::Active("automated sync, self-heal".into()));
        let refusal = s.refusal(GitopsConsent::default()).expect("refused");
        assert!(
            refusal.contains("Argo CD Application argocd/karpenter") && refusal.contains("--pause-gitops"),
            "{refusal}"
        );
        assert!(refusal.contains("NodePool/default"), "{refusal}");
        assert_eq!(s.refusal(GitopsConsent { pause: true, paused_elsewhere: false }), None);
    }

    #[test]
    fn an_application_outside_argo_cds_namespace_is_matched_by_its_prefixed_name() {
        let objs =
            [pool("a", json!({}), json!({ARGO_TRACKING_ANNOTATION: "team-a_pools:karpenter.sh/NodePool:/a"}), &[])];
        let listed = [
            app("argocd", "pools", json!({}), json!([]), json!({})),
            app("team-a", "pools", json!({}), json!([]), json!({})),
        ];
        let s = survey(&objs, &listed, HERE);
        assert_eq!(s.owners.len(), 1);
        assert_eq!(s.owners[0].owner.namespace, "team-a");
    }

    #[test]
    fn the_helm_charts_instance_label_alone_is_not_argo_cd() {
        // the Karpenter chart sets app.kubernetes.io/instance=karpenter on its Deployment
        let deploy = Tracked::from_json(
            "apps",
            "Deployment",
            &json!({"metadata": {"name": "karpenter", "namespace": "kube-system", "labels": {ARGO_INSTANCE_LABEL: "karpenter"}}}),
        );
        let s = survey(std::slice::from_ref(&deploy), &[], HERE);
        assert!(s.owners.is_empty() && s.unreachable.is_empty(), "{s:?}");
        assert_eq!(s.set_aside.len(), 1);
        assert_eq!(s.refusal(GitopsConsent::default()), None);
        // ... but label tracking by an Application that lists the object is
        let listed = [app(
            "argocd",
            "karpenter",
            json!({}),
            json!([{"group": "apps", "kind": "Deployment", "namespace": "kube-system", "name": "karpenter"}]),
            json!({}),
        )];
        let s = survey(&[deploy], &listed, HERE);
        assert_eq!(s.owners.len(), 1, "{s:?}");
    }

    #[test]
    fn a_copied_tracking_id_naming_another_object_is_set_aside() {
        let objs = [pool("b", json!({}), json!({ARGO_TRACKING_ANNOTATION: "karpenter:karpenter.sh/NodePool:/a"}), &[])];
        let listed = [app("argocd", "karpenter", json!({}), json!([]), json!({}))];
        let s = survey(&objs, &listed, HERE);
        assert!(s.owners.is_empty(), "{s:?}");
        assert_eq!(s.set_aside.len(), 1);
    }

    #[test]
    fn an_owner_outside_the_cluster_refuses_until_the_user_says_it_is_paused_there() {
        let objs = [
            pool("a", json!({}), json!({ARGO_TRACKING_ANNOTATION: "fleet-pools:karpenter.sh/NodePool:/a"}), &[]),
            pool("b", json!({}), json!({}), &["kustomize-controller"]),
        ];
        let s = survey(&objs, &[], HERE);
        assert_eq!(s.unreachable.len(), 2, "{s:?}");
        let refusal = s.refusal(GitopsConsent { pause: true, paused_elsewhere: false }).expect("refused");
        assert!(refusal.contains("--gitops-paused-elsewhere") && refusal.contains("NodePool/b"), "{refusal}");
        assert_eq!(s.refusal(GitopsConsent { pause: false, paused_elsewhere: true }), None);
    }

    #[test]
    fn flux_labels_and_inventory_find_kustomizations_and_suspended_ones_are_left_alone() {
        let flux_labels = json!({"kustomize.toolkit.fluxcd.io/name": "pools", "kustomize.toolkit.fluxcd.io/namespace": "flux-system"});
        let objs = [pool("a", flux_labels, json!({}), &["kustomize-controller"]), pool("b", json!({}), json!({}), &[])];
        let listed = [
            kustomization("flux-system", "pools", false, &["_a_karpenter.sh_NodePool"]),
            kustomization("flux-system", "old", true, &["_b_karpenter.sh_NodePool"]),
        ];
        let s = survey(&objs, &listed, HERE);
        assert_eq!(s.owners.len(), 2, "{s:?}");
        let active: Vec<String> = s.active().map(|f| f.owner.name.clone()).collect();
        assert_eq!(active, ["pools"]);
        assert_eq!(
            s.owners.iter().find(|f| f.owner.name == "pools").unwrap().owns,
            ["NodePool/a"],
            "one entry per object"
        );
        assert!(s.refusal(GitopsConsent::default()).is_some());
        assert_eq!(s.refusal(GitopsConsent { pause: true, paused_elsewhere: false }), None);
    }

    #[test]
    fn parents_of_owners_are_found_and_ordered_first() {
        let objs = [pool("a", json!({}), json!({ARGO_TRACKING_ANNOTATION: "pools:karpenter.sh/NodePool:/a"}), &[])];
        let child = app(
            "argocd",
            "pools",
            json!({"selfHeal": true}),
            pool_resource("a"),
            json!({"annotations": {ARGO_TRACKING_ANNOTATION: "root:argoproj.io/Application:argocd/pools"}}),
        );
        let root = app("argocd", "root", json!({"selfHeal": true}), json!([]), json!({}));
        let s = survey(&objs, &[child, root], HERE);
        let order: Vec<&str> = s.owners.iter().map(|f| f.owner.name.as_str()).collect();
        assert_eq!(order, ["root", "pools"]);
        assert_eq!(s.owners[0].owns, ["Application/argocd/pools"]);
    }

    #[test]
    fn an_applicationset_child_cannot_be_paused_and_refuses_even_with_consent() {
        let objs = [pool("a", json!({}), json!({ARGO_TRACKING_ANNOTATION: "pools:karpenter.sh/NodePool:/a"}), &[])];
        let child = app(
            "argocd",
            "pools",
            json!({}),
            json!([]),
            json!({"ownerReferences": [{"kind": "ApplicationSet", "name": "clusters", "apiVersion": "argoproj.io/v1alpha1", "uid": "u"}]}),
        );
        let s = survey(&objs, &[child], HERE);
        let refusal = s.refusal(GitopsConsent { pause: true, paused_elsewhere: true }).expect("refused");
        assert!(refusal.contains("ApplicationSet clusters"), "{refusal}");
    }

    #[test]
    fn argo_cd_settings_that_turn_automated_sync_off_count_as_paused() {
        let off = |automated: Value, annotations: Value| {
            app("argocd", "a", automated, json!([]), json!({"annotations": annotations})).state.is_active()
        };
        assert!(off(json!({}), json!({})));
        assert!(!off(json!({"enabled": false, "selfHeal": true}), json!({})));
        assert!(!off(Value::Null, json!({})));
        assert!(!off(json!({"selfHeal": true}), json!({ARGO_SKIP_RECONCILE: "true"})));
    }

    /// An Application applying to `destination`, listing `resources`, generated by an
    /// ApplicationSet when `set` is given.
    fn app_to(name: &str, destination: Value, resources: Value, set: Option<&str>) -> OwnerObject {
        let refs: Vec<Value> = set.iter().map(|s| json!({"kind": "ApplicationSet", "name": s})).collect();
        OwnerObject::from_json(
            OwnerKind::Application,
            &json!({"metadata": {"name": name, "namespace": "argocd", "ownerReferences": refs},
                    "spec": {"destination": destination, "syncPolicy": {"automated": {"selfHeal": true}}},
                    "status": {"resources": resources}}),
        )
    }

    fn karpenter_resources() -> Value {
        json!([{"group": "karpenter.sh", "kind": "NodePool", "name": "default"},
               {"group": "apps", "kind": "Deployment", "namespace": "kube-system", "name": "karpenter"}])
    }

    #[test]
    fn a_hubs_owners_for_other_clusters_are_set_aside_and_this_clusters_still_count() {
        let objs = [
            pool(
                "default",
                json!({}),
                json!({ARGO_TRACKING_ANNOTATION: "karpenter:karpenter.sh/NodePool:/default"}),
                &["argocd-controller"],
            ),
            // the Karpenter chart's own instance label on the hub's controller
            Tracked::from_json(
                "apps",
                "Deployment",
                &json!({"metadata": {"name": "karpenter", "namespace": "kube-system",
                                     "labels": {ARGO_INSTANCE_LABEL: "karpenter"}}}),
            ),
        ];
        let listed = [
            app_to(
                "karpenter",
                json!({"server": "https://kubernetes.default.svc", "namespace": "kube-system"}),
                pool_resource("default"),
                None,
            ),
            // what an ApplicationSet's cluster generator makes of the cluster Secrets
            app_to(
                "prod-karpenter",
                json!({"server": "https://PROD.gr7.eu-west-1.eks.amazonaws.com/"}),
                karpenter_resources(),
                Some("karpenter"),
            ),
            app_to("stage-karpenter", json!({"name": "stage"}), karpenter_resources(), Some("karpenter")),
            OwnerObject::from_json(
                OwnerKind::Kustomization,
                &json!({"metadata": {"name": "prod-pools", "namespace": "flux-system"},
                        "spec": {"interval": "5m", "kubeConfig": {"secretRef": {"name": "prod-kubeconfig"}}},
                        "status": {"inventory": {"entries": [{"id": "_default_karpenter.sh_NodePool", "v": "v1"}]}}}),
            ),
        ];
        let s = survey(&objs, &listed, HERE);
        let owners: Vec<&str> = s.owners.iter().map(|f| f.owner.name.as_str()).collect();
        assert_eq!(owners, ["karpenter"], "{s:#?}");
        assert!(s.unreachable.is_empty(), "{s:#?}");
        let aside: Vec<(&str, &str)> =
            s.other_clusters.iter().map(|o| (o.owner.name.as_str(), o.why.as_str())).collect();
        assert_eq!(
            aside,
            [
                ("prod-karpenter", "deploys to the cluster at https://PROD.gr7.eu-west-1.eks.amazonaws.com"),
                ("stage-karpenter", "deploys to the Argo CD cluster named stage"),
                ("prod-pools", "applies to the cluster in its spec.kubeConfig (Secret prod-kubeconfig)"),
            ]
        );
        assert_eq!(s.other_clusters[0].names, ["NodePool/default", "Deployment/kube-system/karpenter"]);
        // the ApplicationSet's children would refuse even with consent, were they counted
        assert_eq!(s.refusal(GitopsConsent { pause: true, paused_elsewhere: false }), None);
        let refusal = s.refusal(GitopsConsent::default()).expect("the in-cluster owner still refuses");
        assert!(refusal.contains("argocd/karpenter ") && !refusal.contains("prod"), "{refusal}");
        assert!(
            s.plan_lines(GitopsConsent::default())
                .iter()
                .any(|l| l.contains("prod-pools") && l.contains("never paused"))
        );

        // this cluster, however an Application names it
        let objs = [pool("default", json!({}), json!({}), &[])];
        for destination in [
            json!({"server": format!("{HERE}/")}),
            json!({"server": "https://kubernetes.default.svc/"}),
            json!({"name": "in-cluster"}),
            json!({}),
        ] {
            let listed = [app_to("pools", destination.clone(), pool_resource("default"), None)];
            let s = survey(&objs, &listed, HERE);
            assert_eq!(s.owners.len(), 1, "{destination}: {s:#?}");
            assert!(s.other_clusters.is_empty(), "{destination}: {s:#?}");
        }
    }

    #[test]
    fn metadata_naming_an_owner_that_applies_elsewhere_cannot_be_placed_and_refuses() {
        let flux = json!({"kustomize.toolkit.fluxcd.io/name": "pools", "kustomize.toolkit.fluxcd.io/namespace": "flux-system"});
        let objs = [
            pool("a", json!({}), json!({ARGO_TRACKING_ANNOTATION: "pools:karpenter.sh/NodePool:/a"}), &[]),
            pool("b", flux, json!({}), &[]),
            pool("c", json!({ARGO_INSTANCE_LABEL: "named"}), json!({}), &[]),
        ];
        let listed = [
            app_to("pools", json!({"server": "https://10.0.0.1"}), json!([]), None),
            app_to("named", json!({"name": "hub"}), pool_resource("c"), None),
            OwnerObject::from_json(
                OwnerKind::Kustomization,
                &json!({"metadata": {"name": "pools", "namespace": "flux-system"},
                        "spec": {"kubeConfig": {"configMapRef": {"name": "remote"}}}}),
            ),
        ];
        let s = survey(&objs, &listed, HERE);
        assert!(s.owners.is_empty(), "nothing applying elsewhere is ever paused: {s:#?}");
        let objects: Vec<&str> = s.unreachable.iter().map(|u| u.object.as_str()).collect();
        assert_eq!(objects, ["NodePool/a", "NodePool/b", "NodePool/c"], "{s:#?}");
        let refusal = s.refusal(GitopsConsent { pause: true, paused_elsewhere: false }).expect("refused");
        assert!(refusal.contains("https://10.0.0.1") && refusal.contains("--gitops-paused-elsewhere"), "{refusal}");
        assert_eq!(s.refusal(GitopsConsent { pause: false, paused_elsewhere: true }), None);
    }

    #[test]
    fn a_cluster_scoped_objects_tracking_id_may_carry_the_destination_namespace() {
        // what Argo CD writes for a NodePool of an Application with destination namespace karpenter
        let objs = [pool(
            "default",
            json!({}),
            json!({ARGO_TRACKING_ANNOTATION: "pools:karpenter.sh/NodePool:karpenter/default"}),
            &["argocd-controller"],
        )];
        let listed =
            [app_to("pools", json!({"server": ARGO_IN_CLUSTER_SERVER, "namespace": "karpenter"}), json!([]), None)];
        let s = survey(&objs, &listed, HERE);
        assert_eq!(s.owners.len(), 1, "{s:#?}");
        assert!(s.set_aside.is_empty() && s.unreachable.is_empty(), "{s:#?}");
        assert!(s.refusal(GitopsConsent::default()).is_some());
        // a namespaced object's id must still name its own namespace
        let deploy = Tracked::from_json(
            "apps",
            "Deployment",
            &json!({"metadata": {"name": "karpenter", "namespace": "kube-system",
                    "annotations": {ARGO_TRACKING_ANNOTATION: "pools:apps/Deployment:karpenter/karpenter"}}}),
        );
        let s = survey(&[deploy], &listed, HERE);
        assert!(s.owners.is_empty() && s.set_aside.len() == 1, "{s:#?}");
    }

    #[test]
    fn an_argo_cd_operation_is_in_flight_while_requested_running_retrying_or_terminating() {
        let app = |operation: Value, state: Value| json!({"operation": operation, "status": {"operationState": state}});
        let busy = |v: Value| in_flight(OwnerKind::Application, &v, None);
        assert_eq!(busy(app(Value::Null, json!({"phase": "Succeeded"}))), None);
        assert_eq!(busy(app(Value::Null, json!({"phase": "Failed", "finishedAt": "t"}))), None, "failed for good");
        assert_eq!(busy(json!({"status": {}})), None);
        assert!(busy(app(json!({"sync": {}}), Value::Null)).unwrap().contains("requested"));
        assert!(
            busy(app(json!({"sync": {}}), json!({"phase": "Running", "startedAt": "t0"}))).unwrap().contains("running")
        );
        let retry = busy(app(
            json!({"sync": {}, "retry": {"limit": 5}}),
            json!({"phase": "Running", "finishedAt": "t1", "retryCount": 2, "message": "one or more objects failed to apply"}),
        ))
        .unwrap();
        assert!(retry.contains("retry (attempt 3)") && retry.contains("failed to apply"), "{retry}");
        assert!(busy(app(json!({"sync": {}}), json!({"phase": "Terminating"}))).unwrap().contains("terminated"));
    }

    #[test]
    fn a_flux_reconcile_is_over_once_the_runs_request_is_handled_or_none_progresses() {
        let obj = |handled: &str, reason: &str| {
            json!({"status": {"lastHandledReconcileAt": handled,
                              "conditions": [{"type": "Reconciling", "status": "True", "reason": reason, "message": "m"}]}})
        };
        for kind in [OwnerKind::Kustomization, OwnerKind::HelmRelease] {
            // the run's request: only its acknowledgement counts, whatever the conditions say
            assert!(in_flight(kind, &obj("older", "ProgressingWithRetry"), Some("now")).unwrap().contains("\"now\""));
            assert_eq!(in_flight(kind, &obj("now", "Progressing"), Some("now")), None);
            assert!(in_flight(kind, &json!({}), Some("now")).is_some());
            // already suspended: the Reconciling condition
            assert!(in_flight(kind, &obj("x", "Progressing"), None).unwrap().contains("under way"));
            assert_eq!(in_flight(kind, &obj("x", "ProgressingWithRetry"), None), None);
            assert_eq!(
                in_flight(kind, &json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}), None),
                None
            );
        }
    }

    #[test]
    fn inventory_ids_round_trip_for_cluster_scoped_and_core_objects() {
        let key = ObjectKey {
            group: "apps".into(),
            kind: "Deployment".into(),
            namespace: "kube-system".into(),
            name: "karpenter".into(),
        };
        assert_eq!(parse_inventory_id(&inventory_id(&key)), Some(key));
        let pool = ObjectKey {
            group: "karpenter.sh".into(),
            kind: "NodePool".into(),
            namespace: String::new(),
            name: "a".into(),
        };
        assert_eq!(inventory_id(&pool), "_a_karpenter.sh_NodePool");
        assert_eq!(parse_inventory_id("bad"), None);
    }
}
