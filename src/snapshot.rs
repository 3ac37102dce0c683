//! A read-only snapshot of a live cluster's Karpenter compute: the Kubernetes objects a teardown
//! reads or waits on, and the EC2 instances, launch templates and instance profiles behind them.
//! `rehearse` loads it into the sandbox; `--snapshot-out` writes it as versioned JSON (README,
//! "Rehearse").
//!
//! Taking one only lists and describes: no write reaches the cluster or AWS. What could hold a
//! secret is never kept: Secrets and ConfigMaps are not read at all; containers keep their name,
//! image, ports and resources (no environment, command, arguments, probes or hooks); volumes keep
//! their name and kind only (a claim keeps its claim name); Helm values, Argo CD parameters and
//! Flux substitutions are dropped; the `last-applied-configuration` annotation is dropped. The one
//! environment value kept is `CLUSTER_NAME`, the cluster's name, which the teardown's identity
//! check reads from the Karpenter controller.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;

use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::aws::ec2::InstanceScope;
use crate::aws::{AwsClients, AwsError};
use crate::gitops::OwnerKind;
use crate::k8s::{self, Kube, KubeError};
use crate::karpenter::{self, ProviderId};

/// The `format` field of every snapshot.
pub(crate) const SNAPSHOT_FORMAT: &str = "karpenter-teardown/snapshot";
/// The schema version this build writes and reads.
pub(crate) const SNAPSHOT_VERSION: u32 = 1;
/// The only environment variables a snapshot keeps: the controller's cluster name and its own
/// Service's name, which with its image say that a container is Karpenter's controller.
const KEPT_ENV: [&str; 2] = [karpenter::ENV_CLUSTER_NAME, karpenter::ENV_SERVICE];
/// Karpenter's CRDs, the only ones a snapshot copies.
pub(crate) use karpenter::CRDS as KARPENTER_CRDS;

/// Why a snapshot could not be taken, read or written.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The Kubernetes side failed.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// The AWS side failed.
    #[error(transparent)]
    Aws(#[from] AwsError),
    /// The identity may not read what a snapshot needs.
    #[error(
        "the kubeconfig's identity may not {what} ({detail}); a rehearsal reads with deploy/rbac-rehearse.yaml: apply it and bind it to the identity (README, Rehearse)"
    )]
    Forbidden {
        /// The read that was refused.
        what: String,
        /// The server's message.
        detail: String,
    },
    /// A snapshot file could not be read.
    #[error("cannot read the snapshot {path}: {detail}; pass a file written by `rehearse --snapshot-out`")]
    Read {
        /// The file.
        path: String,
        /// What went wrong.
        detail: String,
    },
    /// A snapshot file is of another format or version.
    #[error(
        "{path} is not a snapshot this build reads ({detail}); take a new one with `karpenter-teardown rehearse --snapshot-out FILE`"
    )]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// The snapshot could not be written.
    #[error("cannot write the snapshot to {path}: {detail}; check that the directory exists and is writable")]
    Write {
        /// The file.
        path: String,
        /// What went wrong.
        detail: String,
    },
}

impl SnapshotError {
    /// True for errors of configuration or input (exit 2).
    #[cfg_attr(
        not(feature = "sandbox"),
        allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
    )]
    pub(crate) fn is_configuration(&self) -> bool {
        match self {
            SnapshotError::Kube(e) => e.is_configuration(),
            SnapshotError::Aws(e) => e.is_configuration(),
            SnapshotError::Read { .. } | SnapshotError::Format { .. } | SnapshotError::Forbidden { .. } => true,
            SnapshotError::Write { .. } => false,
        }
    }
}

/// A snapshot (versioned JSON; README, "Rehearse").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// Always [`SNAPSHOT_FORMAT`].
    pub format: String,
    /// [`SNAPSHOT_VERSION`] when written by this build.
    pub version: u32,
    /// The tool version that took it.
    pub tool_version: String,
    /// RFC 3339 time it was taken.
    pub taken_at: String,
    /// The cluster name it was taken for.
    pub cluster: String,
    /// The region.
    pub region: String,
    /// The AWS account the credentials belonged to.
    pub account: String,
    /// The API server it was read from, and the kubeconfig context.
    pub source: Source,
    /// What the snapshot tells of Karpenter itself.
    pub karpenter: KarpenterFacts,
    /// The Kubernetes objects (reduced as the module documentation says).
    pub kubernetes: KubeObjects,
    /// The EC2 and IAM objects.
    pub aws: AwsObjects,
    /// What taking it cost.
    pub reads: ReadStats,
}

/// Where a snapshot was read from.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Source {
    /// API server URL.
    pub server: String,
    /// Kubeconfig context.
    pub context: Option<String>,
}

/// Karpenter's release and liveness.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KarpenterFacts {
    /// The controller's release, from its image tag (`1.0.14`), when it has one.
    pub version: Option<String>,
    /// The controller Deployment as `namespace/name`, when there is one.
    pub controller: Option<String>,
    /// Ready replicas of the controller.
    pub ready_replicas: i64,
    /// Whether any Karpenter CRD routes conversion through the controller's webhook (1.0.x).
    pub conversion_webhook: bool,
}

/// One Kubernetes object as a snapshot keeps it: its JSON text, written to and read from the
/// snapshot file as it is. A 20,000-pod snapshot is 54 MB of JSON and was 611 MB as
/// `serde_json::Value`s (every small map a B-tree node); a reader parses the object it looks at,
/// one at a time.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RawObject(Box<RawValue>);

impl RawObject {
    /// The object's JSON text.
    pub(crate) fn new(v: &Value) -> RawObject {
        // Serializing a Value cannot fail: its map keys are strings.
        RawObject(serde_json::value::to_raw_value(v).unwrap_or_default())
    }

    /// The object, parsed.
    pub(crate) fn value(&self) -> Value {
        // The text is JSON: it was written by `new` or read as JSON.
        serde_json::from_str(self.0.get()).unwrap_or(Value::Null)
    }
}

impl From<Value> for RawObject {
    fn from(v: Value) -> RawObject {
        RawObject::new(&v)
    }
}

/// The Kubernetes objects of a snapshot, as JSON objects.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KubeObjects {
    /// Karpenter's CRDs.
    pub crds: Vec<RawObject>,
    /// Namespaces.
    pub namespaces: Vec<RawObject>,
    /// The Services Karpenter's conversion webhook points at.
    pub services: Vec<RawObject>,
    /// EC2NodeClasses.
    pub ec2nodeclasses: Vec<RawObject>,
    /// NodePools.
    pub nodepools: Vec<RawObject>,
    /// NodeClaims.
    pub nodeclaims: Vec<RawObject>,
    /// Nodes.
    pub nodes: Vec<RawObject>,
    /// Deployments.
    pub deployments: Vec<RawObject>,
    /// ReplicaSets.
    pub replicasets: Vec<RawObject>,
    /// StatefulSets.
    pub statefulsets: Vec<RawObject>,
    /// DaemonSets.
    pub daemonsets: Vec<RawObject>,
    /// Pods.
    pub pods: Vec<RawObject>,
    /// PodDisruptionBudgets.
    pub pdbs: Vec<RawObject>,
    /// Argo CD Applications, Flux Kustomizations and HelmReleases.
    pub gitops: Vec<RawObject>,
}

impl KubeObjects {
    /// Takes every list out (leaving them empty), with its name, in the order a loader needs them
    /// (definitions and namespaces first): a loader consumes the objects instead of holding them
    /// twice.
    #[cfg_attr(
        not(feature = "sandbox"),
        allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
    )]
    pub(crate) fn take_kinds(&mut self) -> Vec<(&'static str, Vec<RawObject>)> {
        vec![
            ("customresourcedefinitions", std::mem::take(&mut self.crds)),
            ("namespaces", std::mem::take(&mut self.namespaces)),
            ("services", std::mem::take(&mut self.services)),
            ("ec2nodeclasses", std::mem::take(&mut self.ec2nodeclasses)),
            ("nodepools", std::mem::take(&mut self.nodepools)),
            ("nodeclaims", std::mem::take(&mut self.nodeclaims)),
            ("nodes", std::mem::take(&mut self.nodes)),
            ("deployments", std::mem::take(&mut self.deployments)),
            ("replicasets", std::mem::take(&mut self.replicasets)),
            ("statefulsets", std::mem::take(&mut self.statefulsets)),
            ("daemonsets", std::mem::take(&mut self.daemonsets)),
            ("pods", std::mem::take(&mut self.pods)),
            ("poddisruptionbudgets", std::mem::take(&mut self.pdbs)),
            ("gitops", std::mem::take(&mut self.gitops)),
        ]
    }
}

/// An instance as the snapshot keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapInstance {
    /// `i-...`
    pub id: String,
    /// EC2's state name (`running`, ...).
    pub state: String,
    /// Availability zone.
    pub zone: String,
    /// All tags.
    pub tags: BTreeMap<String, String>,
}

/// A launch template as the snapshot keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapLaunchTemplate {
    /// `lt-...`
    pub id: String,
    /// Its name.
    pub name: String,
    /// All tags.
    pub tags: BTreeMap<String, String>,
}

/// An instance profile as the snapshot keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapInstanceProfile {
    /// Its name.
    pub name: String,
    /// Its path.
    pub path: String,
    /// The roles in it.
    pub roles: Vec<String>,
    /// All tags.
    pub tags: BTreeMap<String, String>,
}

/// The AWS objects of a snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AwsObjects {
    /// Instances tagged with the cluster, and every instance a Node or NodeClaim names.
    pub instances: Vec<SnapInstance>,
    /// The cluster's Karpenter launch templates.
    pub launch_templates: Vec<SnapLaunchTemplate>,
    /// The cluster's Karpenter instance profiles.
    pub instance_profiles: Vec<SnapInstanceProfile>,
}

/// What taking the snapshot cost.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ReadStats {
    /// Kubernetes requests, by verb (only `get`/`list` ever).
    pub kubernetes: BTreeMap<String, u64>,
    /// AWS requests, by IAM action (only `Describe*`, `List*`, `Get*`).
    pub aws: BTreeMap<String, u64>,
    /// Wall time of the Kubernetes reads, seconds.
    pub kubernetes_seconds: f64,
    /// Wall time of the AWS reads, seconds.
    pub aws_seconds: f64,
}

/// What a report says of the snapshot a rehearsal played.
#[cfg_attr(
    not(feature = "sandbox"),
    allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
)]
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub(crate) struct SnapshotSummary {
    /// When it was taken.
    pub taken_at: String,
    /// The API server it was read from.
    pub server: String,
    /// The controller's release, as its image tag says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub karpenter_version: Option<String>,
    /// Ready replicas of the controller.
    pub controller_ready_replicas: i64,
    /// Nodes, of them Karpenter's.
    pub nodes: usize,
    /// Karpenter nodes.
    pub karpenter_nodes: usize,
    /// NodeClaims.
    pub nodeclaims: usize,
    /// Pods.
    pub pods: usize,
    /// PodDisruptionBudgets.
    pub pdbs: usize,
    /// Instances read.
    pub instances: usize,
    /// Launch templates read.
    pub launch_templates: usize,
    /// Instance profiles read.
    pub instance_profiles: usize,
    /// The read-only requests taking it made, by `service:verb`.
    pub requests: BTreeMap<String, u64>,
    /// Seconds taking it took (0 when it was read from a file).
    pub seconds: f64,
}

impl Snapshot {
    /// The summary a report carries.
    #[cfg_attr(
        not(feature = "sandbox"),
        allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
    )]
    pub(crate) fn summary(&self) -> SnapshotSummary {
        let mut requests = self.reads.kubernetes.clone();
        requests.extend(self.reads.aws.clone());
        SnapshotSummary {
            taken_at: self.taken_at.clone(),
            server: self.source.server.clone(),
            karpenter_version: self.karpenter.version.clone(),
            controller_ready_replicas: self.karpenter.ready_replicas,
            nodes: self.kubernetes.nodes.len(),
            karpenter_nodes: self.karpenter_nodes().count(),
            nodeclaims: self.kubernetes.nodeclaims.len(),
            pods: self.kubernetes.pods.len(),
            pdbs: self.kubernetes.pdbs.len(),
            instances: self.aws.instances.len(),
            launch_templates: self.aws.launch_templates.len(),
            instance_profiles: self.aws.instance_profiles.len(),
            requests,
            seconds: self.reads.kubernetes_seconds + self.reads.aws_seconds,
        }
    }

    /// Reads the live cluster through `kube` and `aws`, listing and describing only.
    pub async fn take(kube: &Kube, aws: &AwsClients, cluster: &str, region: &str) -> Result<Snapshot, SnapshotError> {
        kube.check_reachable().await?;
        let started = Instant::now();
        let kubernetes = read_kubernetes(&kube.client).await?;
        let kubernetes_seconds = started.elapsed().as_secs_f64();
        let karpenter = karpenter_facts(&kubernetes);
        let started = Instant::now();
        let account = aws.account().await?;
        let aws_objects = read_aws(aws, cluster, region, &kubernetes).await?;
        let aws_seconds = started.elapsed().as_secs_f64();
        Ok(Snapshot {
            format: SNAPSHOT_FORMAT.into(),
            version: SNAPSHOT_VERSION,
            tool_version: env!("CARGO_PKG_VERSION").into(),
            taken_at: crate::report::rfc3339(std::time::SystemTime::now()),
            cluster: cluster.into(),
            region: region.into(),
            account,
            source: Source { server: kube.server.clone(), context: kube.context.clone() },
            karpenter,
            kubernetes,
            aws: aws_objects,
            reads: ReadStats {
                kubernetes: kube.calls.snapshot(),
                aws: aws.calls.snapshot(),
                kubernetes_seconds,
                aws_seconds,
            },
        })
    }

    /// Reads a snapshot file, refusing another format or a newer version.
    #[cfg_attr(
        not(feature = "sandbox"),
        allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
    )]
    pub(crate) fn load(path: &Path) -> Result<Snapshot, SnapshotError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| SnapshotError::Read { path: shown.clone(), detail: e.to_string() })?;
        // The format and version are read first, skipping the objects, so that another format or
        // version is named as such rather than as a missing field.
        #[derive(Deserialize)]
        struct Head {
            #[serde(default)]
            format: Value,
            #[serde(default)]
            version: Value,
        }
        let head: Head = serde_json::from_str(&text)
            .map_err(|e| SnapshotError::Format { path: shown.clone(), detail: format!("not JSON: {e}") })?;
        if head.format != SNAPSHOT_FORMAT {
            return Err(SnapshotError::Format {
                path: shown,
                detail: format!("its format is {}, not {SNAPSHOT_FORMAT:?}", head.format),
            });
        }
        if head.version.as_u64() != Some(u64::from(SNAPSHOT_VERSION)) {
            return Err(SnapshotError::Format {
                path: shown,
                detail: format!("it is version {}, this build reads version {SNAPSHOT_VERSION}", head.version),
            });
        }
        serde_json::from_str(&text).map_err(|e| SnapshotError::Format { path: shown, detail: e.to_string() })
    }

    /// Writes the snapshot as JSON (one line per top-level field would not help: it is data).
    pub fn write(&self, path: &Path) -> Result<(), SnapshotError> {
        let bad = |detail: String| SnapshotError::Write { path: path.display().to_string(), detail };
        let file = std::fs::File::create(path).map_err(|e| bad(e.to_string()))?;
        let mut w = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut w, self).map_err(|e| bad(e.to_string()))?;
        std::io::Write::flush(&mut w).map_err(|e| bad(e.to_string()))
    }

    /// Karpenter nodes: Nodes labelled with a NodePool.
    #[cfg_attr(
        not(feature = "sandbox"),
        allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
    )]
    pub(crate) fn karpenter_nodes(&self) -> impl Iterator<Item = Value> {
        self.kubernetes
            .nodes
            .iter()
            .map(RawObject::value)
            .filter(|n| !n["metadata"]["labels"][karpenter::LABEL_NODEPOOL].is_null())
    }
}

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// Lists every object of a kind, page by page ([`k8s::list_pages`]), reducing each object before
/// the next page is asked for: a 20,000-pod cluster is never one response. A kind the server
/// does not serve is an empty list.
async fn list_all(
    client: &kube::Client,
    ar: &ApiResource,
    reduce: fn(&mut Value),
) -> Result<Vec<RawObject>, SnapshotError> {
    let keep = |item: DynamicObject| {
        let mut v = serde_json::to_value(&item).unwrap_or_default();
        if v["apiVersion"].is_null() {
            v["apiVersion"] = Value::String(ar.api_version.clone());
            v["kind"] = Value::String(ar.kind.clone());
        }
        reduce(&mut v);
        Some(RawObject::new(&v))
    };
    match k8s::list_kind(client, ar, keep).await {
        Ok(out) => Ok(out),
        Err(kube::Error::Api(s)) if s.code == 403 => {
            let group = if ar.group.is_empty() { String::new() } else { format!(".{}", ar.group) };
            Err(SnapshotError::Forbidden { what: format!("list {}{group}", ar.plural), detail: s.message })
        }
        Err(e) => Err(k8s::list_error(ar, e).into()),
    }
}

async fn read_kubernetes(client: &kube::Client) -> Result<KubeObjects, SnapshotError> {
    let mut k = KubeObjects {
        crds: list_all(
            client,
            &resource("apiextensions.k8s.io", "v1", "CustomResourceDefinition", "customresourcedefinitions"),
            reduce_meta,
        )
        .await?
        .into_iter()
        .filter(|c| c.value()["metadata"]["name"].as_str().is_some_and(|n| KARPENTER_CRDS.contains(&n)))
        .collect(),
        namespaces: list_all(client, &resource("", "v1", "Namespace", "namespaces"), reduce_meta).await?,
        ec2nodeclasses: list_all(client, &k8s::nodeclass_resource(), reduce_meta).await?,
        nodepools: list_all(client, &k8s::nodepool_resource(), reduce_meta).await?,
        nodeclaims: list_all(client, &k8s::nodeclaim_resource(), reduce_meta).await?,
        nodes: list_all(client, &resource("", "v1", "Node", "nodes"), reduce_node).await?,
        deployments: list_all(client, &resource("apps", "v1", "Deployment", "deployments"), reduce_workload).await?,
        replicasets: list_all(client, &resource("apps", "v1", "ReplicaSet", "replicasets"), reduce_workload).await?,
        statefulsets: list_all(client, &resource("apps", "v1", "StatefulSet", "statefulsets"), reduce_workload).await?,
        daemonsets: list_all(client, &resource("apps", "v1", "DaemonSet", "daemonsets"), reduce_workload).await?,
        pods: list_all(client, &resource("", "v1", "Pod", "pods"), reduce_pod).await?,
        pdbs: list_all(client, &resource("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets"), reduce_meta)
            .await?,
        ..KubeObjects::default()
    };
    for kind in OwnerKind::ALL {
        let Some(version) = kind.versions().first() else { continue };
        let ar = resource(kind.group(), version, kind.kind(), kind.plural());
        k.gitops.extend(list_all(client, &ar, reduce_gitops).await?);
    }
    // the conversion webhook's Services, named by the CRDs (1.0.x): they decide whether
    // conversion works, so the copy must have them, and nothing else of Services is needed
    let wanted: BTreeSet<(String, String)> = k
        .crds
        .iter()
        .map(RawObject::value)
        .filter_map(|c| {
            let svc = &c["spec"]["conversion"]["webhook"]["clientConfig"]["service"];
            Some((svc["namespace"].as_str()?.to_string(), svc["name"].as_str()?.to_string()))
        })
        .collect();
    for (ns, name) in wanted {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &ns, &resource("", "v1", "Service", "services"));
        match api.get_opt(&name).await {
            Ok(Some(s)) => {
                let mut v = serde_json::to_value(&s).unwrap_or_default();
                reduce_meta(&mut v);
                k.services.push(RawObject::new(&v));
            }
            Ok(None) => {}
            Err(kube::Error::Api(s)) if s.code == 403 => {
                return Err(SnapshotError::Forbidden { what: format!("get service {ns}/{name}"), detail: s.message });
            }
            Err(e) => return Err(KubeError::api(format!("get service {ns}/{name}"), e).into()),
        }
    }
    Ok(k)
}

async fn read_aws(aws: &AwsClients, cluster: &str, region: &str, k: &KubeObjects) -> Result<AwsObjects, AwsError> {
    let mut instances: BTreeMap<String, SnapInstance> = BTreeMap::new();
    fn keep(into: &mut BTreeMap<String, SnapInstance>, i: crate::aws::ec2::InstanceInfo) {
        let state = serde_json::to_value(i.state).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        into.insert(i.id.clone(), SnapInstance { id: i.id, state, zone: i.zone, tags: i.tags });
    }
    for i in aws.ec2.cluster_instances(cluster, InstanceScope::ClusterAny).await? {
        keep(&mut instances, i);
    }
    // instances the Nodes and NodeClaims name that carry no cluster tag (self-managed groups):
    // the teardown's identity check asks EC2 about them too
    let named: BTreeSet<String> = k
        .nodes
        .iter()
        .map(|n| n.value()["spec"]["providerID"].take())
        .chain(k.nodeclaims.iter().map(|c| c.value()["status"]["providerID"].take()))
        .filter_map(|p| ProviderId::parse(p.as_str()?).ok())
        .map(|p| p.instance_id)
        .collect();
    let missing: Vec<String> = named.into_iter().filter(|id| !instances.contains_key(id)).collect();
    if !missing.is_empty() {
        for i in aws.ec2.instances_by_id(&missing).await? {
            keep(&mut instances, i);
        }
    }
    let launch_templates = aws
        .ec2
        .launch_templates(cluster)
        .await?
        .into_iter()
        .map(|t| SnapLaunchTemplate { id: t.id, name: t.name, tags: t.tags })
        .collect();
    let instance_profiles = aws
        .iam
        .cluster_instance_profiles(region, cluster)
        .await?
        .into_iter()
        .map(|p| SnapInstanceProfile { name: p.name, path: p.path, roles: p.roles, tags: p.tags })
        .collect();
    Ok(AwsObjects { instances: instances.into_values().collect(), launch_templates, instance_profiles })
}

fn karpenter_facts(k: &KubeObjects) -> KarpenterFacts {
    let controllers: Vec<Value> = k.deployments.iter().map(RawObject::value).filter(is_karpenter_controller).collect();
    // the same preference as the teardown's own inventory: kube-system, then the name karpenter
    let controller = controllers
        .iter()
        .min_by_key(|d| (d["metadata"]["namespace"] != "kube-system", d["metadata"]["name"] != "karpenter"));
    let version = controller.and_then(|d| {
        d["spec"]["template"]["spec"]["containers"].as_array()?.iter().find_map(|c| {
            let image = c["image"].as_str()?;
            // `registry:5000/karpenter/controller@sha256:…` has no tag: the part after the last
            // colon is then a path, not a release
            let tag = image.split('@').next()?.rsplit_once(':')?.1;
            let tag = tag.trim_start_matches('v');
            if tag.contains('/') {
                return None;
            }
            tag.chars().next().filter(char::is_ascii_digit).map(|_| tag.to_string())
        })
    });
    KarpenterFacts {
        version,
        controller: controller.map(|d| {
            format!(
                "{}/{}",
                d["metadata"]["namespace"].as_str().unwrap_or_default(),
                d["metadata"]["name"].as_str().unwrap_or_default()
            )
        }),
        ready_replicas: controller.and_then(|d| d["status"]["readyReplicas"].as_i64()).unwrap_or(0),
        conversion_webhook: k.crds.iter().any(|c| c.value()["spec"]["conversion"]["strategy"] == "Webhook"),
    }
}

/// Drops what the copy has no use for and what may hold a secret from any object's metadata.
fn reduce_meta(v: &mut Value) {
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("resourceVersion");
        m.remove("selfLink");
    }
    if let Some(a) = v["metadata"]["annotations"].as_object_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

fn reduce_node(v: &mut Value) {
    reduce_meta(v);
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("managedFields");
    }
    if let Some(st) = v["status"].as_object_mut() {
        st.retain(|k, _| matches!(k.as_str(), "conditions" | "allocatable" | "capacity" | "addresses" | "nodeInfo"));
        if let Some(conds) = st.get_mut("conditions").and_then(Value::as_array_mut) {
            conds.retain(|c| c["type"] == "Ready");
        }
    }
}

fn reduce_workload(v: &mut Value) {
    reduce_meta(v);
    reduce_pod_spec(&mut v["spec"]["template"]["spec"]);
}

fn reduce_pod(v: &mut Value) {
    reduce_meta(v);
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("managedFields");
    }
    reduce_pod_spec(&mut v["spec"]);
    if let Some(st) = v["status"].as_object_mut() {
        st.retain(|k, _| matches!(k.as_str(), "phase" | "conditions" | "startTime" | "qosClass"));
    }
}

/// Keeps of a pod spec what eviction, scheduling and termination depend on.
fn reduce_pod_spec(spec: &mut Value) {
    let Some(s) = spec.as_object_mut() else { return };
    s.remove("imagePullSecrets");
    for key in ["containers", "initContainers", "ephemeralContainers"] {
        if let Some(cs) = s.get_mut(key).and_then(Value::as_array_mut) {
            for c in cs.iter_mut() {
                reduce_container(c);
            }
        }
    }
    if let Some(vols) = s.get_mut("volumes").and_then(Value::as_array_mut) {
        for vol in vols.iter_mut() {
            *vol = reduce_volume(vol);
        }
    }
}

fn reduce_container(c: &mut Value) {
    let Some(m) = c.as_object_mut() else { return };
    let kept: Vec<Value> = m
        .get("env")
        .and_then(Value::as_array)
        .map(|env| {
            env.iter()
                .filter(|e| e["name"].as_str().is_some_and(|n| KEPT_ENV.contains(&n)) && e["value"].is_string())
                .map(|e| serde_json::json!({"name": e["name"], "value": e["value"]}))
                .collect()
        })
        .unwrap_or_default();
    m.retain(|k, _| matches!(k.as_str(), "name" | "image" | "ports" | "resources" | "restartPolicy"));
    if !kept.is_empty() {
        m.insert("env".into(), Value::Array(kept));
    }
}

/// Whether a Deployment or pod (as JSON) is Karpenter's controller, by what the inventory goes
/// by: a container that runs its image or has its chart's environment
/// (`karpenter::controller_container`), or its chart's label.
pub(crate) fn is_karpenter_controller(object: &Value) -> bool {
    let labelled = object["metadata"]["labels"][karpenter::CONTROLLER_LABEL.0] == karpenter::CONTROLLER_LABEL.1;
    let spec = match object["kind"].as_str() {
        Some("Pod") => &object["spec"],
        _ if object["spec"]["template"].is_object() => &object["spec"]["template"]["spec"],
        _ => &object["spec"],
    };
    let runs = spec["containers"].as_array().into_iter().flatten().any(|c| {
        let env: Vec<(&str, Option<&str>)> = c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| Some((e["name"].as_str()?, e["value"].as_str())))
            .collect();
        karpenter::controller_container(c["image"].as_str(), &env).is_some()
    });
    labelled || runs
}

/// A volume as `{name, <kind>: {}}`; a claim keeps its claim name, an emptyDir its medium.
fn reduce_volume(vol: &Value) -> Value {
    let mut out = serde_json::Map::new();
    let Some(m) = vol.as_object() else { return Value::Object(out) };
    for (k, v) in m {
        match k.as_str() {
            "name" => {
                out.insert(k.clone(), v.clone());
            }
            "persistentVolumeClaim" => {
                out.insert(k.clone(), serde_json::json!({"claimName": v["claimName"]}));
            }
            "emptyDir" => {
                let mut e = serde_json::Map::new();
                if let Some(medium) = v.get("medium") {
                    e.insert("medium".into(), medium.clone());
                }
                out.insert(k.clone(), Value::Object(e));
            }
            _ => {
                out.insert(k.clone(), Value::Object(serde_json::Map::new()));
            }
        }
    }
    Value::Object(out)
}

/// GitOps objects keep what decides whether they would put objects back (sync policy, suspend,
/// inventory, status), not the values they render with.
fn reduce_gitops(v: &mut Value) {
    reduce_meta(v);
    let spec = &mut v["spec"];
    if let Some(s) = spec.as_object_mut() {
        s.remove("values");
        s.remove("valuesFrom");
        if let Some(pb) = s.get_mut("postBuild").and_then(Value::as_object_mut) {
            pb.remove("substitute");
            pb.remove("substituteFrom");
        }
    }
    let mut sources: Vec<&mut Value> = Vec::new();
    if let Some(s) = spec.as_object_mut() {
        for (k, val) in s.iter_mut() {
            match k.as_str() {
                "source" => sources.push(val),
                "sources" => {
                    if let Some(a) = val.as_array_mut() {
                        sources.extend(a.iter_mut());
                    }
                }
                _ => {}
            }
        }
    }
    for src in sources {
        if let Some(h) = src.get_mut("helm").and_then(Value::as_object_mut) {
            for k in ["values", "valuesObject", "parameters", "fileParameters"] {
                h.remove(k);
            }
        }
        if let Some(p) = src.get_mut("plugin").and_then(Value::as_object_mut) {
            p.remove("env");
            p.remove("parameters");
        }
        if let Some(k) = src.get_mut("kustomize").and_then(Value::as_object_mut) {
            k.remove("patches");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pod_keeps_what_a_drain_depends_on_and_nothing_that_may_be_secret() {
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "apps", "resourceVersion": "9", "managedFields": [{"manager": "x"}],
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"secret\":1}", "keep": "me"},
                "ownerReferences": [{"kind": "ReplicaSet", "name": "web-abc", "uid": "u1", "controller": true}]},
            "spec": {
                "nodeName": "n1", "terminationGracePeriodSeconds": 45, "priorityClassName": "high",
                "tolerations": [{"key": "k", "operator": "Exists"}], "nodeSelector": {"a": "b"},
                "affinity": {"nodeAffinity": {}}, "imagePullSecrets": [{"name": "regcred"}],
                "containers": [{"name": "app", "image": "nginx:1", "env": [{"name": "PASSWORD", "value": "hunter2"},
                    {"name": "CLUSTER_NAME", "value": "prod"}], "envFrom": [{"secretRef": {"name": "s"}}],
                    "command": ["sh", "-c", "echo $TOKEN"], "args": ["--token=s3cr3t"], "resources": {"requests": {"cpu": "1"}},
                    "livenessProbe": {"exec": {"command": ["x"]}}, "lifecycle": {"preStop": {"exec": {"command": ["y"]}}}}],
                "volumes": [{"name": "creds", "secret": {"secretName": "db-password"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "data-web-1"}},
                    {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                    {"name": "cfg", "configMap": {"name": "settings"}}]
            },
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "app"}]}
        });
        reduce_pod(&mut pod);
        let text = pod.to_string();
        for secret in [
            "hunter2",
            "PASSWORD",
            "regcred",
            "db-password",
            "settings",
            "TOKEN",
            "s3cr3t",
            "secretRef",
            "\"secret\":1",
            "preStop",
            "podIP",
        ] {
            assert!(!text.contains(secret), "{secret} must not be kept: {text}");
        }
        assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 45);
        assert_eq!(pod["spec"]["priorityClassName"], "high");
        assert_eq!(pod["spec"]["tolerations"][0]["key"], "k");
        assert_eq!(pod["spec"]["nodeSelector"]["a"], "b");
        assert_eq!(pod["spec"]["containers"][0]["env"], json!([{"name": "CLUSTER_NAME", "value": "prod"}]));
        assert_eq!(pod["spec"]["containers"][0]["resources"]["requests"]["cpu"], "1");
        assert_eq!(pod["spec"]["volumes"][0], json!({"name": "creds", "secret": {}}));
        assert_eq!(pod["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"], "data-web-1");
        assert_eq!(pod["spec"]["volumes"][2], json!({"name": "tmp", "emptyDir": {"medium": "Memory"}}));
        assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "u1");
        assert_eq!(pod["metadata"]["annotations"]["keep"], "me");
        assert!(pod["metadata"]["managedFields"].is_null());
        assert_eq!(pod["status"]["conditions"][0]["type"], "Ready");
    }

    #[test]
    fn gitops_objects_lose_their_values_and_keep_their_sync_policy() {
        let mut hr = json!({"metadata": {"name": "karpenter"}, "spec": {"suspend": false, "values": {"token": "abc"},
            "valuesFrom": [{"kind": "Secret", "name": "vals"}]}});
        reduce_gitops(&mut hr);
        assert_eq!(hr["spec"], json!({"suspend": false}));
        let mut app = json!({"metadata": {"name": "pools"}, "spec": {"syncPolicy": {"automated": {"selfHeal": true}},
            "source": {"repoURL": "r", "helm": {"values": "password: x", "parameters": [{"name": "p", "value": "v"}]}}}});
        reduce_gitops(&mut app);
        assert_eq!(app["spec"]["syncPolicy"]["automated"]["selfHeal"], true);
        assert_eq!(app["spec"]["source"], json!({"repoURL": "r", "helm": {}}));
    }

    #[test]
    fn the_controller_release_comes_from_its_image_tag() {
        let k = KubeObjects {
            deployments: vec![RawObject::new(&json!({"metadata": {"name": "karpenter", "namespace": "kube-system",
                "labels": {"app.kubernetes.io/name": "karpenter"}},
                "spec": {"template": {"spec": {"containers": [{"name": "controller",
                    "image": "public.ecr.aws/karpenter/controller:1.0.14@sha256:abc"}]}}},
                "status": {"readyReplicas": 2}}))],
            ..KubeObjects::default()
        };
        let f = karpenter_facts(&k);
        assert_eq!(f.version.as_deref(), Some("1.0.14"));
        let mut mirrored = k.clone();
        let mut d = mirrored.deployments[0].value();
        d["spec"]["template"]["spec"]["containers"][0]["image"] =
            json!("registry.internal:5000/mirror/karpenter/controller@sha256:abc");
        mirrored.deployments[0] = RawObject::new(&d);
        assert_eq!(karpenter_facts(&mirrored).version, None, "a mirror's port is not a release");
        assert_eq!(f.controller.as_deref(), Some("kube-system/karpenter"));
        assert_eq!(f.ready_replicas, 2);
        assert!(!f.conversion_webhook);
    }

    #[test]
    fn a_snapshot_of_another_format_or_version_is_refused_naming_the_fix() {
        let dir = std::env::temp_dir().join(format!("snap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("s.json");
        std::fs::write(&p, r#"{"format": "karpenter-teardown/snapshot", "version": 99}"#).unwrap();
        let e = Snapshot::load(&p).unwrap_err();
        assert!(e.to_string().contains("version 99") && e.to_string().contains("--snapshot-out"), "{e}");
        assert!(e.is_configuration());
        std::fs::write(&p, r#"{"apiVersion": "v1"}"#).unwrap();
        assert!(Snapshot::load(&p).unwrap_err().to_string().contains("its format is null"));
    }
}
