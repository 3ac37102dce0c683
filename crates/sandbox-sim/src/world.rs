//! The world generator: builds a Karpenter-managed cluster in the sandbox API server and in
//! LocalStack, as the real Karpenter, EKS and workloads would have left it, and records what it
//! made so tests can assert the end state of a teardown.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::naming::{self, IMAGE_ID, INSTANCE_TYPE, KARPENTER_NAME, KARPENTER_NAMESPACE, LABEL_NODEGROUP};
use super::objects::{self, ClaimRef, PoolRef};
use super::ops;
use super::{KarpenterVersion, SimError};
use crate::cloud::{Cloud, CloudError, SimInstance};
use crate::karpenter;
use crate::karpenter_crds::{karpenter_crds, karpenter_crds_from};

/// What to build. `Default` gives the design's reference cluster: 20 Karpenter nodes over 3
/// NodePools and 2 EC2NodeClasses, 4 pods per node, a managed node group of 2, a control-plane
/// node and 2 decoy instances of another cluster.
#[derive(Debug, Clone)]
pub struct WorldSpec {
    /// The EKS cluster name (tags, the controller's CLUSTER_NAME, profile paths).
    pub cluster: String,
    /// AWS region.
    pub region: String,
    /// Zones the nodes are spread over.
    pub zones: Vec<String>,
    /// Karpenter nodes (each with its NodeClaim and instance).
    pub nodes: usize,
    /// NodePools; nodes are dealt round-robin over them.
    pub node_pools: usize,
    /// EC2NodeClasses; pool `i` uses class `i % node_classes`. Class 0 uses `spec.role`.
    pub node_classes: usize,
    /// Workload pods per Karpenter node (from Deployments and StatefulSets), besides the
    /// DaemonSet pod every node runs.
    pub pods_per_node: usize,
    /// Replicas per workload; the last one takes the remainder.
    pub replicas_per_workload: usize,
    /// Make the first workload's PDB strict (`minAvailable == replicas`): it blocks every eviction.
    pub strict_pdb: bool,
    /// Give every other workload's PDB `maxUnavailable: n` (a PDB-heavy cluster) instead of a
    /// budget that never refuses. Once the pools are fenced such a budget only allows the next
    /// eviction when a replacement is ready somewhere else.
    pub pdb_max_unavailable: Option<u32>,
    /// Make the last NodePool static (Karpenter ≥ 1.8): `spec.replicas` set to the nodes dealt to
    /// it, no weight, limits only on `nodes` (the CRD's CEL rules refuse anything else).
    pub static_pool: bool,
    /// Managed node group nodes (not Karpenter's), hosting the controller and CoreDNS.
    pub managed_nodes: usize,
    /// Nodes outside Karpenter that the workloads may use (labelled
    /// `karpenter.sh/capacity-type: on-demand`, as a self-managed group can be, with no NodePool),
    /// with room for `spare_pods` pods each: once the pools are fenced, evicted pods become ready
    /// there, so PodDisruptionBudgets that count ready pods let the drain go on. Added after the
    /// workloads are running, so nothing starts on them.
    pub spare_nodes: usize,
    /// Pods each spare node has room for.
    pub spare_pods: u32,
    /// Give the first managed node the taint `dedicated=system:NoSchedule`.
    pub taint_managed_node: bool,
    /// Add a node tainted `node-role.kubernetes.io/control-plane:NoSchedule`, with no instance.
    pub control_plane_node: bool,
    /// Instances of ANOTHER cluster carrying the same Karpenter tags; they must survive.
    pub decoys: usize,
    /// The other cluster's name; `None` → `<cluster>-decoy`.
    pub decoy_cluster: Option<String>,
    /// The Karpenter release to imitate.
    pub version: KarpenterVersion,
    /// `spec.limits.cpu` of every NodePool; `None` → unlimited.
    pub pool_cpu_limit: Option<u64>,
    /// Namespace of the workloads, or the prefix of their namespaces when there are several.
    pub workload_namespace: String,
    /// How many namespaces the workloads are dealt over (round-robin): `workload_namespace`
    /// itself when 1, else `<workload_namespace>-0`, `-1`, …. Large clusters spread their
    /// workloads like real ones, which keeps PodDisruptionBudget arithmetic per namespace.
    pub workload_namespaces: usize,
    /// The `pods` allocatable of every Karpenter node; `None` → exactly its pods (the DaemonSet
    /// pod plus `pods_per_node`), so evicted pods find no room on other Karpenter nodes. Room
    /// to spare lets them land on nodes that are not cordoned yet, as on a real cluster.
    pub max_pods_per_node: Option<usize>,
    /// Bound on concurrent API/EC2 calls while generating.
    pub concurrency: usize,
    /// How long to wait for the workloads' pods to run once created (control-plane placement).
    pub settle_timeout: Duration,
    /// Termination grace periods of the workloads as (seconds, weight) pairs: each workload draws
    /// one, seeded by `grace_seed`, so a benchmark sees the spread real clusters have (most 30 s,
    /// some minutes). Empty gives every pod 1 s, which keeps tests fast. The server's time scale
    /// applies to them like to every grace period.
    pub grace_periods: Vec<(i64, u32)>,
    /// Seed of the grace period draw: the same seed gives the same periods to the same workloads.
    pub grace_seed: u64,
    /// EKS Auto Mode beside the self-managed Karpenter, as AWS's migration guide runs them: this
    /// many Auto Mode nodes of its built-in `general-purpose` pool (the built-in `system` pool is
    /// created too), each with its NodeClaim and an instance tagged as EKS tags its own, and a
    /// Deployment `auto-mode/auto-app` with a pod on each. 0: none.
    pub auto_mode_nodes: usize,
    /// Give every workload container what a real one carries besides its image and resources: an
    /// environment, a command and a readiness probe. A snapshot drops them, so, as with every
    /// Deployment copied from a real cluster, a copied template no longer hashes to the name of
    /// the ReplicaSet that runs it.
    pub full_containers: bool,
    /// A directory of Karpenter's own CRD files for the release (`karpenter.sh_nodepools.yaml`,
    /// ...); `None` installs the sandbox's permissive CRDs. With the real files the API server
    /// applies their schema defaults and CEL rules, as a real cluster does.
    pub karpenter_crds: Option<std::path::PathBuf>,
}

impl Default for WorldSpec {
    fn default() -> Self {
        WorldSpec {
            cluster: "sandbox".into(),
            region: "us-west-2".into(),
            zones: vec!["us-west-2a".into(), "us-west-2b".into(), "us-west-2c".into()],
            nodes: 20,
            node_pools: 3,
            node_classes: 2,
            pods_per_node: 4,
            replicas_per_workload: 4,
            strict_pdb: false,
            pdb_max_unavailable: None,
            spare_nodes: 0,
            spare_pods: 110,
            managed_nodes: 2,
            taint_managed_node: true,
            control_plane_node: true,
            decoys: 2,
            decoy_cluster: None,
            version: KarpenterVersion::default(),
            pool_cpu_limit: None,
            workload_namespace: "apps".into(),
            workload_namespaces: 1,
            max_pods_per_node: None,
            concurrency: 32,
            settle_timeout: Duration::from_secs(60),
            grace_periods: Vec::new(),
            grace_seed: 0,
            full_containers: false,
            karpenter_crds: None,
            static_pool: false,
            auto_mode_nodes: 0,
        }
    }
}

impl WorldSpec {
    /// A spec for `cluster` with the defaults.
    pub fn named(cluster: &str) -> WorldSpec {
        WorldSpec { cluster: cluster.to_string(), ..WorldSpec::default() }
    }

    /// The namespaces the workloads live in.
    pub fn namespaces(&self) -> Vec<String> {
        if self.workload_namespaces <= 1 {
            return vec![self.workload_namespace.clone()];
        }
        (0..self.workload_namespaces).map(|i| format!("{}-{i}", self.workload_namespace)).collect()
    }

    fn decoy_name(&self) -> String {
        self.decoy_cluster.clone().unwrap_or_else(|| format!("{}-decoy", self.cluster))
    }

    fn validate(&self) -> Result<(), SimError> {
        if self.cluster.is_empty() || self.region.is_empty() || self.zones.is_empty() {
            return Err(SimError::BadSpec("cluster, region and at least one zone are required".into()));
        }
        if self.nodes > 0 && (self.node_pools == 0 || self.node_classes == 0) {
            return Err(SimError::BadSpec("Karpenter nodes need at least one NodePool and one EC2NodeClass".into()));
        }
        if self.pods_per_node > 0 && self.replicas_per_workload == 0 {
            return Err(SimError::BadSpec("replicas_per_workload must be at least 1".into()));
        }
        if self.nodes > 0 && self.managed_nodes == 0 {
            return Err(SimError::BadSpec(
                "the controller needs a managed node group: managed_nodes must be ≥ 1".into(),
            ));
        }
        Ok(())
    }

    /// The termination grace period of workload `w`: a weighted draw from `grace_periods`,
    /// deterministic in (`grace_seed`, `w`).
    fn grace_of(&self, w: usize) -> i64 {
        let total: u64 = self.grace_periods.iter().map(|(_, weight)| u64::from(*weight)).sum();
        if total == 0 {
            return 1;
        }
        let mut pick = naming::stable_hash(&[&self.grace_seed.to_string(), &w.to_string()]) % total;
        for (secs, weight) in &self.grace_periods {
            if pick < u64::from(*weight) {
                return *secs;
            }
            pick -= u64::from(*weight);
        }
        // unreachable: `pick < total`, the sum of the weights walked above
        1
    }

    fn pool_name(&self, i: usize) -> String {
        format!("pool-{i}")
    }

    fn class_name(&self, i: usize) -> String {
        format!("class-{i}")
    }
}

/// An EC2NodeClass the generator made, with its AWS resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedClass {
    /// Class name.
    pub name: String,
    /// Class uid.
    pub uid: String,
    /// `spec.role`, when the class has one (then Karpenter owns `instance_profile`).
    pub role: Option<String>,
    /// The instance profile (`status.instanceProfile`).
    pub instance_profile: String,
    /// The instance profile's IAM path, when Karpenter made it.
    pub instance_profile_path: Option<String>,
    /// Launch template name (`karpenter.k8s.aws/<hash>`).
    pub launch_template: String,
    /// Launch template id.
    pub launch_template_id: String,
}

/// A Karpenter node the generator made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedNode {
    /// Node name.
    pub node: String,
    /// NodeClaim name.
    pub nodeclaim: String,
    /// NodePool name.
    pub pool: String,
    /// EC2NodeClass name.
    pub class: String,
    /// Zone.
    pub zone: String,
    /// EC2 instance id.
    pub instance_id: String,
    /// `aws:///<zone>/<id>`.
    pub provider_id: String,
}

/// A node outside Karpenter (managed node group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagedNode {
    /// Node name.
    pub node: String,
    /// EC2 instance id.
    pub instance_id: String,
    /// Zone.
    pub zone: String,
}

/// A workload the generator made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// `Deployment` or `StatefulSet`.
    pub kind: &'static str,
    /// Namespace.
    pub namespace: String,
    /// Name (also its `app` label and its PDB's name).
    pub name: String,
    /// Replicas.
    pub replicas: usize,
    /// True when its PDB allows no disruption at all.
    pub strict_pdb: bool,
    /// `terminationGracePeriodSeconds` of its pods.
    pub grace_seconds: i64,
}

/// Everything the generator made, so tests can assert what must be gone and what must survive.
#[derive(Debug, Clone)]
pub struct World {
    /// Cluster name.
    pub cluster: String,
    /// Region.
    pub region: String,
    /// Imitated release.
    pub version: KarpenterVersion,
    /// NodePool names.
    pub node_pools: Vec<String>,
    /// EC2NodeClasses with their launch templates and instance profiles.
    pub node_classes: Vec<GeneratedClass>,
    /// Karpenter nodes.
    pub nodes: Vec<GeneratedNode>,
    /// Managed node group nodes (must survive a teardown).
    pub managed_nodes: Vec<ManagedNode>,
    /// The control-plane-like node, if any (must survive).
    pub control_plane_node: Option<String>,
    /// The other cluster's name.
    pub decoy_cluster: String,
    /// Decoy instance ids (must survive).
    pub decoy_instances: Vec<String>,
    /// Workloads (Deployments and StatefulSets) with their PDBs.
    pub workloads: Vec<Workload>,
    /// The DaemonSet (namespace, name).
    pub daemonset: (String, String),
    /// EKS Auto Mode's nodes (must survive, with their NodeClaims, pods and instances).
    pub auto_mode_nodes: Vec<GeneratedNode>,
}

impl World {
    /// Instance ids of the Karpenter nodes.
    pub fn karpenter_instance_ids(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.instance_id.clone()).collect()
    }

    /// Instance ids of the managed node group.
    pub fn managed_instance_ids(&self) -> Vec<String> {
        self.managed_nodes.iter().map(|n| n.instance_id.clone()).collect()
    }

    /// The Karpenter nodes of one pool.
    pub fn nodes_of_pool<'a>(&'a self, pool: &'a str) -> impl Iterator<Item = &'a GeneratedNode> + 'a {
        self.nodes.iter().filter(move |n| n.pool == pool)
    }

    /// The generated node of a NodeClaim.
    pub fn by_nodeclaim(&self, nodeclaim: &str) -> Option<&GeneratedNode> {
        self.nodes.iter().find(|n| n.nodeclaim == nodeclaim)
    }
}

fn typed<T: DeserializeOwned>(what: &str, v: Value) -> Result<T, SimError> {
    // Our own JSON literals always match the k8s-openapi types; a failure here is a bug in them.
    serde_json::from_value(v)
        .map_err(|e| SimError::BadSpec(format!("generated {what} does not match its Kubernetes type: {e}")))
}

pub(crate) fn ip_node_name(region: &str, base: u64, i: usize) -> String {
    let n = base + i as u64;
    format!("ip-10-{}-{}-{}.{region}.compute.internal", (n >> 16) & 0xff, (n >> 8) & 0xff, n & 0xff)
}

/// Builds the world `spec` describes, through `client` (the sandbox API server over HTTP) and
/// `aws` (LocalStack). Idempotent for the Kubernetes objects of fixed names (CRDs, pools, classes,
/// system workloads); every run launches new instances.
pub async fn generate(spec: &WorldSpec, client: &Client, aws: &Cloud) -> Result<World, SimError> {
    spec.validate()?;
    let conc = spec.concurrency.max(1);
    install_crds(client, spec.version, spec.karpenter_crds.as_deref()).await?;
    let mut namespaces = vec![KARPENTER_NAMESPACE.to_string(), "default".to_string()];
    namespaces.extend(spec.namespaces());
    for ns in &namespaces {
        let api: Api<Namespace> = Api::all(client.clone());
        let obj = typed("namespace", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))?;
        ops::create_or_get(&api, &obj).await.map_err(SimError::kube(format!("creating namespace {ns}")))?;
    }

    let node_classes = create_classes(spec, client, aws).await?;
    let pools = create_pools(spec, client).await?;
    let (managed_nodes, control_plane_node) = create_system_nodes(spec, client, aws).await?;
    create_controller(spec, client).await?;

    // Karpenter nodes: pool i % P, zone (i / P) % Z, so every pool spans the zones.
    let base = (naming::stable_hash(&[&spec.cluster]) & 0x7f) << 16;
    let plan: Vec<(usize, String, String, String, String)> = (0..spec.nodes)
        .map(|i| {
            let p = i % spec.node_pools;
            let zone = spec.zones[(i / spec.node_pools) % spec.zones.len()].clone();
            let (pool, uid) = pools[p].clone();
            (i, pool, uid, zone, ip_node_name(&spec.region, base, i))
        })
        .collect();
    let nodes: Vec<GeneratedNode> = stream::iter(plan)
        .map(|(i, pool, uid, zone, node)| {
            let class = spec.class_name((i % spec.node_pools) % spec.node_classes);
            async move {
                let launch = NodeLaunch {
                    cluster: &spec.cluster,
                    region: &spec.region,
                    version: spec.version,
                    pool: PoolRef { name: &pool, uid: &uid, class: &class },
                    zone: &zone,
                    node_name: &node,
                    pods: u32::try_from(spec.max_pods_per_node.unwrap_or(spec.pods_per_node + 1)).unwrap_or(u32::MAX),
                };
                launch_karpenter_node(client, aws, &launch).await
            }
        })
        .buffer_unordered(conc)
        .try_collect()
        .await?;

    let decoy_cluster = spec.decoy_name();
    let decoy_instances = launch_decoys(spec, aws, &decoy_cluster).await?;
    let daemonset = create_daemonset(client).await?;
    let workloads = create_workloads(spec, client).await?;
    if spec.pods_per_node > 0 && spec.nodes > 0 {
        wait_for_pods(spec, client).await?;
    }
    create_spare_nodes(spec, client).await?;
    let auto_mode_nodes = create_auto_mode(spec, client, aws).await?;

    let mut nodes = nodes;
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(World {
        cluster: spec.cluster.clone(),
        region: spec.region.clone(),
        version: spec.version,
        node_pools: pools.into_iter().map(|(n, _)| n).collect(),
        node_classes,
        nodes,
        managed_nodes,
        control_plane_node,
        decoy_cluster,
        decoy_instances,
        workloads,
        daemonset,
        auto_mode_nodes,
    })
}

/// Creates (or keeps) the Karpenter CRDs of the release: Karpenter's own files from
/// `real_crds` when given (their defaults and CEL rules then hold for every write), else the
/// sandbox's permissive ones.
pub async fn install_crds(
    client: &Client,
    version: KarpenterVersion,
    real_crds: Option<&std::path::Path>,
) -> Result<(), SimError> {
    let crds = match real_crds {
        Some(dir) => karpenter_crds_from(dir).map_err(|e| SimError::BadSpec(e.to_string()))?,
        None => karpenter_crds(version.has_conversion_webhook()),
    };
    create_crds(client, crds).await
}

/// Creates (or keeps) `crds` and waits until the server serves each.
pub async fn create_crds(client: &Client, crds: Vec<serde_json::Value>) -> Result<(), SimError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut names = Vec::new();
    for crd in crds {
        let name = crd["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let obj: CustomResourceDefinition = typed("CRD", crd)?;
        ops::create_or_get(&api, &obj).await.map_err(SimError::kube(format!("creating CRD {name}")))?;
        names.push(name);
    }
    // kube-apiserver serves a custom resource only once its CRD's names are accepted, which its
    // own controllers record after the create has returned (apiextensions-apiserver's
    // pkg/apiserver/customresource_handler.go; kubernetes/kubernetes#57042): until then a create
    // answers 404. Wait for Established, as installers of CRDs do (the sandbox server
    // establishes a CRD as it creates it, so this returns at once there).
    for name in names {
        let established = kube::runtime::wait::await_condition(
            api.clone(),
            &name,
            kube::runtime::wait::conditions::is_crd_established(),
        );
        match tokio::time::timeout(CRD_ESTABLISH_TIMEOUT, established).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(SimError::NotEstablished { crd: name, reason: e.to_string() }),
            Err(_) => {
                let reason = format!("not Established within {CRD_ESTABLISH_TIMEOUT:?}");
                return Err(SimError::NotEstablished { crd: name, reason });
            }
        }
    }
    Ok(())
}

/// How long [`install_crds`] waits for the server to serve a new CRD: a real kube-apiserver
/// takes well under a second on an idle machine.
const CRD_ESTABLISH_TIMEOUT: Duration = Duration::from_secs(60);

async fn create_classes(spec: &WorldSpec, client: &Client, aws: &Cloud) -> Result<Vec<GeneratedClass>, SimError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &objects::ec2nodeclass_resource());
    let mut out = Vec::new();
    for c in 0..spec.node_classes {
        let name = spec.class_name(c);
        let role = (c == 0).then(|| format!("KarpenterNodeRole-{}", spec.cluster));
        let static_profile = format!("{}-node-profile", spec.cluster);
        let body = objects::ec2nodeclass(
            &name,
            &spec.cluster,
            role.as_deref(),
            role.is_none().then_some(static_profile.as_str()),
        );
        let obj: DynamicObject = typed("EC2NodeClass", body)?;
        let created =
            ops::create_or_get(&api, &obj).await.map_err(SimError::kube(format!("creating EC2NodeClass {name}")))?;
        let uid =
            created.uid().ok_or_else(|| SimError::Malformed { what: format!("EC2NodeClass {name}"), field: "uid" })?;
        let class =
            ensure_class_resources(spec.version, &spec.region, &spec.cluster, &api, aws, &created, &uid).await?;
        out.push(class);
    }
    Ok(out)
}

/// Creates a class's launch template and (for `spec.role` classes) its instance profile, and
/// reports them in the class status, as Karpenter does when it first reconciles a class.
pub(crate) async fn ensure_class_resources(
    version: KarpenterVersion,
    region: &str,
    cluster: &str,
    api: &Api<DynamicObject>,
    aws: &Cloud,
    class: &DynamicObject,
    uid: &str,
) -> Result<GeneratedClass, SimError> {
    let name = class.name_any();
    let role = class.data["spec"]["role"].as_str().map(str::to_string);
    let lt_name = naming::launch_template_name(cluster, &name, uid);
    // Create first and look up only when it exists already (a re-run): listing is the slow call
    // on LocalStack.
    let tags = naming::launch_template_tags(version, cluster, &name);
    let lt_id = match aws.create_launch_template(&lt_name, IMAGE_ID, &tags).await {
        Ok(id) => id,
        Err(e) if e.code().is_some_and(|c| c.contains("AlreadyExists")) => aws
            .launch_template_id(&lt_name)
            .await
            .map_err(SimError::aws("looking up a launch template"))?
            .ok_or_else(|| SimError::aws(format!("creating launch template {lt_name}"))(e))?,
        Err(e) => return Err(SimError::aws(format!("creating launch template {lt_name}"))(e)),
    };
    let (profile, profile_path) = match &role {
        Some(_) => {
            let (pname, path) = naming::instance_profile(version, region, cluster, uid);
            // The role itself is not created: the project's IAM layer has no CreateRole and
            // LocalStack refuses AddRoleToInstanceProfile for an unknown role. The role name
            // stays visible in spec.role; the profile is what a teardown must delete.
            let tags = karpenter::instance_profile_tags(cluster, region, &name);
            match aws.create_instance_profile(&pname, &path, &tags).await {
                Ok(()) => {}
                Err(e) if e.code() == Some("EntityAlreadyExists") => {}
                Err(e) => return Err(SimError::aws(format!("creating instance profile {pname}"))(e)),
            }
            (pname, Some(path))
        }
        None => (class.data["spec"]["instanceProfile"].as_str().unwrap_or_default().to_string(), None),
    };
    ops::patch_status(api, &name, objects::ec2nodeclass_status(&profile))
        .await
        .map_err(SimError::kube(format!("writing EC2NodeClass {name} status")))?;
    Ok(GeneratedClass {
        name,
        uid: uid.to_string(),
        role,
        instance_profile: profile,
        instance_profile_path: profile_path,
        launch_template: lt_name,
        launch_template_id: lt_id,
    })
}

async fn create_pools(spec: &WorldSpec, client: &Client) -> Result<Vec<(String, String)>, SimError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &objects::nodepool_resource());
    let mut out = Vec::new();
    for p in 0..spec.node_pools {
        let name = spec.pool_name(p);
        let class = spec.class_name(p % spec.node_classes);
        let is_static = spec.static_pool && p + 1 == spec.node_pools;
        let body = if is_static {
            let replicas = (0..spec.nodes).filter(|i| i % spec.node_pools == p).count();
            objects::static_nodepool(&name, &class, replicas as u64)
        } else {
            objects::nodepool(&name, &class, spec.pool_cpu_limit, (p == 0).then_some(10))
        };
        let obj: DynamicObject = typed("NodePool", body)?;
        let created =
            ops::create_or_get(&api, &obj).await.map_err(SimError::kube(format!("creating NodePool {name}")))?;
        let uid =
            created.uid().ok_or_else(|| SimError::Malformed { what: format!("NodePool {name}"), field: "uid" })?;
        out.push((name, uid));
    }
    Ok(out)
}

/// What one Karpenter node launch needs: where it goes and what it is called.
#[derive(Debug, Clone)]
pub(crate) struct NodeLaunch<'a> {
    pub cluster: &'a str,
    pub region: &'a str,
    pub version: KarpenterVersion,
    pub pool: PoolRef<'a>,
    pub zone: &'a str,
    pub node_name: &'a str,
    /// Allocatable pods of the node.
    pub pods: u32,
}

/// Launches in `zone`. LocalStack knows the zones of the commercial regions only; for a region
/// of another partition (us-gov-west-1, cn-north-1) it refuses the zone, and the instance is
/// launched without one. The NodeClaim and Node still name the spec's zone, as on a real cluster
/// in that region: the tool reads the region from them, never from LocalStack's placement.
async fn launch_in_zone(
    aws: &Cloud,
    instance_type: &str,
    zone: &str,
    count: i32,
    tags: &BTreeMap<String, String>,
) -> Result<Vec<SimInstance>, CloudError> {
    match aws.launch_tagged(IMAGE_ID, instance_type, Some(zone), count, tags).await {
        Err(e) if e.code() == Some("InvalidParameterValue") && e.to_string().contains("Availability Zone") => {
            aws.launch_tagged(IMAGE_ID, instance_type, None, count, tags).await
        }
        other => other,
    }
}

/// Launches one Karpenter node in Karpenter's order: the NodeClaim with its finalizer first (an
/// instance never exists unguarded), then the instance with its launch tags, then the Node
/// (owned by the NodeClaim, with the termination finalizer), then the statuses, and last the
/// tags naming the node and the claim, as Karpenter's tagging controller adds them.
pub(crate) async fn launch_karpenter_node(
    client: &Client,
    aws: &Cloud,
    l: &NodeLaunch<'_>,
) -> Result<GeneratedNode, SimError> {
    let claims: Api<DynamicObject> = Api::all_with(client.clone(), &objects::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(client.clone());
    let pool = l.pool.name;
    let claim_name = format!("{pool}-{}", naming::random_suffix(5));
    let claim: DynamicObject =
        typed("NodeClaim", objects::nodeclaim(&claim_name, &l.pool, l.zone, l.region, l.version))?;
    let claim = ops::create_or_get(&claims, &claim)
        .await
        .map_err(SimError::kube(format!("creating NodeClaim {claim_name}")))?;
    let claim_uid =
        claim.uid().ok_or_else(|| SimError::Malformed { what: format!("NodeClaim {claim_name}"), field: "uid" })?;
    // the launch's tags name neither the NodeClaim nor the node: the tagging controller adds
    // those once the claim names its node, below
    let tags = naming::launch_tags(l.cluster, pool, l.pool.class);
    let launched = launch_in_zone(aws, INSTANCE_TYPE, l.zone, 1, &tags)
        .await
        .map_err(SimError::aws(format!("launching the instance of NodeClaim {claim_name}")))?;
    let instance = launched.into_iter().next().ok_or_else(|| SimError::ShortLaunch {
        what: format!("NodeClaim {claim_name}"),
        wanted: 1,
        got: 0,
    })?;
    let provider_id = naming::provider_id(l.zone, &instance.id);
    ops::patch_status(&claims, &claim_name, objects::nodeclaim_status(&provider_id, None, l.pods))
        .await
        .map_err(SimError::kube(format!("writing NodeClaim {claim_name} status")))?;
    let claim_ref = ClaimRef { name: &claim_name, uid: &claim_uid };
    let node: Node = typed(
        "Node",
        objects::karpenter_node(l.node_name, &claim_ref, &l.pool, l.zone, l.region, &provider_id, l.version),
    )?;
    ops::create_or_get(&nodes, &node).await.map_err(SimError::kube(format!("creating Node {}", l.node_name)))?;
    ops::patch_status(&nodes, l.node_name, objects::node_status(l.pods, &objects::internal_ip(l.node_name)))
        .await
        .map_err(SimError::kube(format!("writing Node {} status", l.node_name)))?;
    ops::patch_status(&claims, &claim_name, objects::nodeclaim_status(&provider_id, Some(l.node_name), l.pods))
        .await
        .map_err(SimError::kube(format!("writing NodeClaim {claim_name} status")))?;
    aws.tag_instance(&instance.id, &naming::registration_tags(&claim_name, l.node_name))
        .await
        .map_err(SimError::aws(format!("tagging the instance of NodeClaim {claim_name}")))?;
    Ok(GeneratedNode {
        node: l.node_name.to_string(),
        nodeclaim: claim_name,
        pool: pool.to_string(),
        class: l.pool.class.to_string(),
        zone: l.zone.to_string(),
        instance_id: instance.id,
        provider_id,
    })
}

/// A name for a node no world has yet, as EKS names nodes (after a private IP).
pub fn fresh_node_name(region: &str) -> String {
    let salt = naming::stable_hash(&[&naming::random_suffix(8)]) & 0x00ff_ffff;
    ip_node_name(region, salt, 0)
}

/// Launches one more node of `pool` in a generated world, as its controller would: what a run
/// already under way did not inventory (a controller that was not fenced, a launch in flight).
/// Its Node, `node_name`, has room for `pods` pods besides the DaemonSet's.
pub async fn launch_machine(
    world: &World,
    client: &Client,
    aws: &Cloud,
    pool: &str,
    node_name: &str,
    pods: u32,
) -> Result<GeneratedNode, SimError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &objects::nodepool_resource());
    let obj = api.get(pool).await.map_err(SimError::kube(format!("reading NodePool {pool}")))?;
    let uid = obj.uid().ok_or_else(|| SimError::Malformed { what: format!("NodePool {pool}"), field: "uid" })?;
    let class = obj
        .data
        .pointer("/spec/template/spec/nodeClassRef/name")
        .and_then(Value::as_str)
        .ok_or_else(|| SimError::Malformed {
            what: format!("NodePool {pool}"),
            field: "spec.template.spec.nodeClassRef.name",
        })?
        .to_string();
    let zone = world.nodes.first().map_or_else(|| format!("{}a", world.region), |n| n.zone.clone());
    let launch = NodeLaunch {
        cluster: &world.cluster,
        region: &world.region,
        version: world.version,
        pool: PoolRef { name: pool, uid: &uid, class: &class },
        zone: &zone,
        node_name,
        pods: pods + 1,
    };
    launch_karpenter_node(client, aws, &launch).await
}

async fn create_spare_nodes(spec: &WorldSpec, client: &Client) -> Result<(), SimError> {
    let api: Api<Node> = Api::all(client.clone());
    for i in 0..spec.spare_nodes {
        let name = format!("spare-{i}.{}.compute.internal", spec.region);
        let zone = &spec.zones[i % spec.zones.len()];
        let labels = json!({
            naming::LABEL_CAPACITY_TYPE: "on-demand",
            naming::LABEL_ZONE: zone,
            naming::LABEL_REGION: spec.region,
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
        });
        let node: Node = typed("Node", objects::plain_node(&name, labels, Vec::new(), None))?;
        ops::create_or_get(&api, &node).await.map_err(SimError::kube(format!("creating Node {name}")))?;
        ops::patch_status(&api, &name, objects::node_status(spec.spare_pods, &objects::internal_ip(&name)))
            .await
            .map_err(SimError::kube(format!("reporting Node {name} ready")))?;
    }
    Ok(())
}

/// The namespace and name of the Deployment that runs on EKS Auto Mode's nodes.
pub const AUTO_MODE_APP: (&str, &str) = ("auto-mode", "auto-app");
/// Auto Mode's built-in NodePools (which nobody may modify) and their NodeClass.
const AUTO_MODE_POOLS: [&str; 2] = ["general-purpose", "system"];
const AUTO_MODE_CLASS: &str = "default";

/// EKS Auto Mode's compute: its built-in NodePools (`karpenter.sh/v1`, but referencing
/// `eks.amazonaws.com` NodeClass `default`), nodes of `general-purpose` launched as EKS launches
/// them, and a Deployment pinned to them. EKS's own controller is not simulated: nothing here
/// ever changes unless someone else acts on it, which is what the tests check.
async fn create_auto_mode(spec: &WorldSpec, client: &Client, aws: &Cloud) -> Result<Vec<GeneratedNode>, SimError> {
    if spec.auto_mode_nodes == 0 {
        return Ok(Vec::new());
    }
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &objects::nodepool_resource());
    let mut pool_uid = String::new();
    for name in AUTO_MODE_POOLS {
        let mut body = objects::nodepool(name, AUTO_MODE_CLASS, None, None);
        body["spec"]["template"]["spec"]["nodeClassRef"] = auto_mode_class_ref();
        let obj: DynamicObject = typed("NodePool", body)?;
        let created =
            ops::create_or_get(&api, &obj).await.map_err(SimError::kube(format!("creating NodePool {name}")))?;
        if name == AUTO_MODE_POOLS[0] {
            pool_uid =
                created.uid().ok_or_else(|| SimError::Malformed { what: format!("NodePool {name}"), field: "uid" })?;
        }
    }
    let mut nodes = Vec::new();
    for i in 0..spec.auto_mode_nodes {
        let zone = &spec.zones[i % spec.zones.len()];
        let pool = PoolRef { name: AUTO_MODE_POOLS[0], uid: &pool_uid, class: AUTO_MODE_CLASS };
        nodes.push(launch_auto_mode_node(spec, client, aws, &pool, zone).await?);
    }
    let (ns, app) = AUTO_MODE_APP;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let obj = typed("namespace", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))?;
    ops::create_or_get(&namespaces, &obj).await.map_err(SimError::kube(format!("creating namespace {ns}")))?;
    let labels = json!({"app": app});
    let mut pod_spec = workload_pod_spec(app, 1, spec.full_containers);
    pod_spec["nodeSelector"] = json!({karpenter::LABEL_COMPUTE_TYPE: "auto"});
    let deployment: Deployment = typed(
        "Deployment",
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": app, "namespace": ns, "labels": labels},
            "spec": {"replicas": nodes.len(), "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}),
    )?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    ops::create_or_get(&deployments, &deployment)
        .await
        .map_err(SimError::kube(format!("creating Deployment {app}")))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deadline = tokio::time::Instant::now() + spec.settle_timeout;
    loop {
        let list = pods.list(&ListParams::default()).await.map_err(SimError::kube("listing Auto Mode pods"))?;
        let running =
            list.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")).count();
        if running >= nodes.len() {
            return Ok(nodes);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(SimError::NotSettled { expected: nodes.len(), running, controller_ready: true });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn auto_mode_class_ref() -> Value {
    json!({"group": karpenter::AUTO_MODE_GROUP, "kind": "NodeClass", "name": AUTO_MODE_CLASS})
}

/// Labels Auto Mode's NodeClaims and Nodes carry where self-managed Karpenter's carry
/// `karpenter.k8s.aws/ec2nodeclass`.
fn make_auto_mode(obj: &mut Value) {
    if let Some(labels) = obj["metadata"]["labels"].as_object_mut() {
        labels.remove(karpenter::LABEL_NODECLASS);
        labels.insert(karpenter::LABEL_COMPUTE_TYPE.into(), json!("auto"));
        labels.insert(karpenter::LABEL_AUTO_NODECLASS.into(), json!(AUTO_MODE_CLASS));
    }
}

/// One Auto Mode node: the NodeClaim (EKS's Karpenter guards it with the same finalizer), an
/// instance tagged as EKS's compute policy requires (and, to leave the tool no easy way out,
/// with the `karpenter.sh/nodepool` and `kubernetes.io/cluster/<c>` tags too), and a Node named
/// after its instance, as Auto Mode names them.
async fn launch_auto_mode_node(
    spec: &WorldSpec,
    client: &Client,
    aws: &Cloud,
    pool: &PoolRef<'_>,
    zone: &str,
) -> Result<GeneratedNode, SimError> {
    let claims: Api<DynamicObject> = Api::all_with(client.clone(), &objects::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(client.clone());
    let claim_name = format!("{}-{}", pool.name, naming::random_suffix(5));
    let mut claim = objects::nodeclaim(&claim_name, pool, zone, &spec.region, spec.version);
    claim["spec"]["nodeClassRef"] = auto_mode_class_ref();
    make_auto_mode(&mut claim);
    let claim: DynamicObject = typed("NodeClaim", claim)?;
    let claim = ops::create_or_get(&claims, &claim)
        .await
        .map_err(SimError::kube(format!("creating NodeClaim {claim_name}")))?;
    let claim_uid =
        claim.uid().ok_or_else(|| SimError::Malformed { what: format!("NodeClaim {claim_name}"), field: "uid" })?;
    let tags = BTreeMap::from([
        (karpenter::TAG_EKS_CLUSTER.to_string(), spec.cluster.clone()),
        (karpenter::TAG_AUTO_NODEPOOL.to_string(), pool.name.to_string()),
        (karpenter::TAG_AUTO_NODECLASS.to_string(), AUTO_MODE_CLASS.to_string()),
        (karpenter::TAG_NODEPOOL.to_string(), pool.name.to_string()),
        (karpenter::cluster_tag_key(&spec.cluster), "owned".to_string()),
    ]);
    let instance = launch_in_zone(aws, INSTANCE_TYPE, zone, 1, &tags)
        .await
        .map_err(SimError::aws(format!("launching the instance of NodeClaim {claim_name}")))?
        .into_iter()
        .next()
        .ok_or_else(|| SimError::ShortLaunch { what: format!("NodeClaim {claim_name}"), wanted: 1, got: 0 })?;
    let provider_id = naming::provider_id(zone, &instance.id);
    let node_name = instance.id.clone();
    let claim_ref = ClaimRef { name: &claim_name, uid: &claim_uid };
    let mut node =
        objects::karpenter_node(&node_name, &claim_ref, pool, zone, &spec.region, &provider_id, spec.version);
    make_auto_mode(&mut node);
    let node: Node = typed("Node", node)?;
    ops::create_or_get(&nodes, &node).await.map_err(SimError::kube(format!("creating Node {node_name}")))?;
    ops::patch_status(&nodes, &node_name, objects::node_status(spec.spare_pods, &objects::internal_ip(&node_name)))
        .await
        .map_err(SimError::kube(format!("writing Node {node_name} status")))?;
    ops::patch_status(&claims, &claim_name, objects::nodeclaim_status(&provider_id, Some(&node_name), spec.spare_pods))
        .await
        .map_err(SimError::kube(format!("writing NodeClaim {claim_name} status")))?;
    Ok(GeneratedNode {
        node: node_name,
        nodeclaim: claim_name,
        pool: pool.name.to_string(),
        class: AUTO_MODE_CLASS.to_string(),
        zone: zone.to_string(),
        instance_id: instance.id,
        provider_id,
    })
}

async fn create_system_nodes(
    spec: &WorldSpec,
    client: &Client,
    aws: &Cloud,
) -> Result<(Vec<ManagedNode>, Option<String>), SimError> {
    let api: Api<Node> = Api::all(client.clone());
    let nodegroup = format!("{}-system", spec.cluster);
    let mut by_zone: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..spec.managed_nodes {
        *by_zone.entry(spec.zones[i % spec.zones.len()].clone()).or_default() += 1;
    }
    let mut instances = Vec::new();
    for (zone, count) in by_zone {
        // One RunInstances per zone: managed node group instances share all their tags.
        let tags = naming::nodegroup_instance_tags(&spec.cluster, &nodegroup);
        let wanted = i32::try_from(count).unwrap_or(i32::MAX);
        let got = launch_in_zone(aws, "m5.large", &zone, wanted, &tags)
            .await
            .map_err(SimError::aws("launching the managed node group"))?;
        if got.len() != count {
            return Err(SimError::ShortLaunch { what: "the managed node group".into(), wanted: count, got: got.len() });
        }
        instances.extend(got.into_iter().map(|i| (zone.clone(), i.id)));
    }
    let mut managed = Vec::new();
    for (i, (zone, id)) in instances.into_iter().enumerate() {
        let name = naming::node_name(&id, &spec.region);
        let labels = json!({
            LABEL_NODEGROUP: nodegroup,
            "eks.amazonaws.com/capacityType": "ON_DEMAND",
            naming::LABEL_INSTANCE_TYPE: "m5.large",
            naming::LABEL_ZONE: zone,
            naming::LABEL_REGION: spec.region,
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        });
        let taints = if spec.taint_managed_node && i == 0 {
            vec![json!({"key": "dedicated", "value": "system", "effect": "NoSchedule"})]
        } else {
            Vec::new()
        };
        let node: Node =
            typed("Node", objects::plain_node(&name, labels, taints, Some(&naming::provider_id(&zone, &id))))?;
        ops::create_or_get(&api, &node).await.map_err(SimError::kube(format!("creating Node {name}")))?;
        ops::patch_status(&api, &name, objects::node_status(30, &objects::internal_ip(&name)))
            .await
            .map_err(SimError::kube(format!("writing Node {name} status")))?;
        managed.push(ManagedNode { node: name, instance_id: id, zone });
    }
    let control_plane = if spec.control_plane_node {
        let name = format!("{}-control-plane", spec.cluster);
        let labels =
            json!({naming::CONTROL_PLANE_KEY: "", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux"});
        let taints = vec![json!({"key": naming::CONTROL_PLANE_KEY, "effect": "NoSchedule"})];
        let node: Node = typed("Node", objects::plain_node(&name, labels, taints, None))?;
        ops::create_or_get(&api, &node).await.map_err(SimError::kube(format!("creating Node {name}")))?;
        ops::patch_status(&api, &name, objects::node_status(10, &objects::internal_ip(&name)))
            .await
            .map_err(SimError::kube(format!("writing Node {name} status")))?;
        Some(name)
    } else {
        None
    };
    Ok((managed, control_plane))
}

/// Tolerations that let system pods run on the managed node group, including its tainted node.
fn system_tolerations() -> Value {
    json!([
        {"key": "CriticalAddonsOnly", "operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"},
    ])
}

fn system_pod_spec(container: &str, image: &str, env: Value, nodegroup: &str) -> Value {
    json!({
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": {LABEL_NODEGROUP: nodegroup},
        "tolerations": system_tolerations(),
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": container, "image": image, "env": env,
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}],
    })
}

async fn create_controller(spec: &WorldSpec, client: &Client) -> Result<(), SimError> {
    let ns = KARPENTER_NAMESPACE;
    let nodegroup = format!("{}-system", spec.cluster);
    let app = json!({naming::KARPENTER_APP_LABEL: KARPENTER_NAME, "app.kubernetes.io/instance": KARPENTER_NAME});
    let sa: ServiceAccount = typed(
        "ServiceAccount",
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": KARPENTER_NAME, "namespace": ns,
            "labels": app, "annotations": {"eks.amazonaws.com/role-arn":
                format!("arn:aws:iam::000000000000:role/KarpenterController-{}", spec.cluster)}}}),
    )?;
    ops::create_or_get(&Api::<ServiceAccount>::namespaced(client.clone(), ns), &sa)
        .await
        .map_err(SimError::kube("creating the karpenter ServiceAccount"))?;
    let svc: Service = typed(
        "Service",
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": KARPENTER_NAME, "namespace": ns, "labels": app},
            "spec": {"selector": app, "ports": [
                {"name": "http-metrics", "port": 8080, "targetPort": 8080, "protocol": "TCP"},
                {"name": "webhook-metrics", "port": 8443, "targetPort": 8443, "protocol": "TCP"}]}}),
    )?;
    ops::create_or_get(&Api::<Service>::namespaced(client.clone(), ns), &svc)
        .await
        .map_err(SimError::kube("creating the karpenter Service"))?;
    let env = json!([
        {"name": "CLUSTER_NAME", "value": spec.cluster},
        {"name": "AWS_REGION", "value": spec.region},
        {"name": "KARPENTER_VERSION", "value": spec.version.as_str()},
    ]);
    let image = format!("public.ecr.aws/karpenter/controller:{}", spec.version.as_str());
    let mut pod_spec = system_pod_spec("controller", &image, env, &nodegroup);
    pod_spec["serviceAccountName"] = json!(KARPENTER_NAME);
    let deploy: Deployment = typed(
        "Deployment",
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": KARPENTER_NAME, "namespace": ns, "labels": app},
            "spec": {"replicas": 1, "selector": {"matchLabels": app},
                "template": {"metadata": {"labels": app}, "spec": pod_spec}}}),
    )?;
    let deployments = Api::<Deployment>::namespaced(client.clone(), ns);
    ops::create_or_get(&deployments, &deploy).await.map_err(SimError::kube("creating the karpenter Deployment"))?;

    let dns = json!({"k8s-app": "kube-dns"});
    let dns_spec = system_pod_spec("coredns", "coredns/coredns:1.11.3", json!([]), &nodegroup);
    let coredns: Deployment = typed(
        "Deployment",
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "coredns", "namespace": ns, "labels": dns},
            "spec": {"replicas": 2, "selector": {"matchLabels": dns},
                "template": {"metadata": {"labels": dns}, "spec": dns_spec}}}),
    )?;
    ops::create_or_get(&deployments, &coredns).await.map_err(SimError::kube("creating the coredns Deployment"))?;
    Ok(())
}

async fn create_daemonset(client: &Client) -> Result<(String, String), SimError> {
    let ns = KARPENTER_NAMESPACE;
    let name = "aws-node";
    let labels = json!({"k8s-app": name});
    let ds: DaemonSet = typed(
        "DaemonSet",
        json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
                "priorityClassName": "system-node-critical",
                // like the VPC CNI: runs on every node whatever its taints
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "aws-node", "image": "amazon-k8s-cni:v1.19.0"}]}}}}),
    )?;
    ops::create_or_get(&Api::<DaemonSet>::namespaced(client.clone(), ns), &ds)
        .await
        .map_err(SimError::kube("creating the aws-node DaemonSet"))?;
    Ok((ns.to_string(), name.to_string()))
}

/// Workload pods ask for Karpenter capacity through the capacity-type label, so they never land
/// on the managed node group and their pending replicas are Karpenter's to provision for.
fn workload_pod_spec(app: &str, grace_seconds: i64, full: bool) -> Value {
    let mut spec = json!({
        "nodeSelector": {naming::LABEL_CAPACITY_TYPE: "on-demand"},
        "terminationGracePeriodSeconds": grace_seconds,
        "containers": [{"name": app, "image": "public.ecr.aws/eks-distro/kubernetes/pause:3.2",
            "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}],
    });
    if full {
        let c = &mut spec["containers"][0];
        c["env"] = json!([{"name": "APP_NAME", "value": app}, {"name": "LOG_LEVEL", "value": "info"}]);
        c["command"] = json!(["/pause"]);
        c["readinessProbe"] = json!({"tcpSocket": {"port": 8080}, "periodSeconds": 10});
    }
    spec
}

async fn create_workloads(spec: &WorldSpec, client: &Client) -> Result<Vec<Workload>, SimError> {
    let namespaces = spec.namespaces();
    let total = spec.nodes * spec.pods_per_node;
    let mut plan = Vec::new();
    let mut left = total;
    let mut w = 0;
    while left > 0 {
        let replicas = left.min(spec.replicas_per_workload);
        left -= replicas;
        let kind = if w % 3 == 2 { "StatefulSet" } else { "Deployment" };
        let name = format!("{}-{w}", if kind == "StatefulSet" { "db" } else { "web" });
        plan.push(Workload {
            kind,
            namespace: namespaces[w % namespaces.len()].clone(),
            name,
            replicas,
            strict_pdb: spec.strict_pdb && w == 0,
            grace_seconds: spec.grace_of(w),
        });
        w += 1;
    }
    stream::iter(plan.iter())
        .map(|w| {
            let deployments = Api::<Deployment>::namespaced(client.clone(), &w.namespace);
            let statefulsets = Api::<StatefulSet>::namespaced(client.clone(), &w.namespace);
            let pdbs = Api::<PodDisruptionBudget>::namespaced(client.clone(), &w.namespace);
            async move {
                let labels = json!({"app": w.name});
                let mut spec_json = json!({"replicas": w.replicas, "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels}, "spec": workload_pod_spec(&w.name, w.grace_seconds, spec.full_containers)}});
                let body = json!({"apiVersion": "apps/v1", "kind": w.kind,
                    "metadata": {"name": w.name, "namespace": w.namespace, "labels": labels}});
                if w.kind == "StatefulSet" {
                    spec_json["serviceName"] = json!(w.name);
                    let mut body = body;
                    body["spec"] = spec_json;
                    let sts: StatefulSet = typed("StatefulSet", body)?;
                    ops::create_or_get(&statefulsets, &sts)
                        .await
                        .map_err(SimError::kube(format!("creating StatefulSet {}", w.name)))?;
                } else {
                    let mut body = body;
                    body["spec"] = spec_json;
                    let d: Deployment = typed("Deployment", body)?;
                    ops::create_or_get(&deployments, &d)
                        .await
                        .map_err(SimError::kube(format!("creating Deployment {}", w.name)))?;
                }
                // Permissive budgets are ones a teardown can satisfy. Once the NodePools are fenced
                // no capacity is left, evicted pods stay Pending and count as unhealthy, so a
                // one-at-a-time budget (`maxUnavailable: 1`) blocks after its first eviction,
                // exactly like the strict one: that is field report 4, covered by `strict_pdb`.
                let budget = if w.strict_pdb {
                    json!({"minAvailable": w.replicas})
                } else if let Some(n) = spec.pdb_max_unavailable {
                    json!({"maxUnavailable": n})
                } else if w.kind == "StatefulSet" {
                    json!({"minAvailable": 0})
                } else {
                    json!({"maxUnavailable": "100%"})
                };
                let mut pdb_spec = budget;
                pdb_spec["selector"] = json!({"matchLabels": labels});
                let pdb: PodDisruptionBudget = typed(
                    "PodDisruptionBudget",
                    json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                        "metadata": {"name": w.name, "namespace": w.namespace}, "spec": pdb_spec}),
                )?;
                ops::create_or_get(&pdbs, &pdb).await.map_err(SimError::kube(format!("creating PDB {}", w.name)))?;
                Ok::<(), SimError>(())
            }
        })
        .buffer_unordered(spec.concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    Ok(plan)
}

/// Waits until the server's control plane has scheduled and started every workload pod and the
/// controller's Deployment is ready, so a test starts from a settled cluster.
async fn wait_for_pods(spec: &WorldSpec, client: &Client) -> Result<(), SimError> {
    let namespaces = spec.namespaces();
    let pods: Api<Pod> = Api::all(client.clone());
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), KARPENTER_NAMESPACE);
    let expected = spec.nodes * spec.pods_per_node;
    let deadline = tokio::time::Instant::now() + spec.settle_timeout;
    let mut delay = Duration::from_millis(20);
    loop {
        let list = pods.list(&ListParams::default()).await.map_err(SimError::kube("listing workload pods"))?;
        let running = list
            .items
            .iter()
            .filter(|p| {
                p.metadata.namespace.as_ref().is_some_and(|ns| namespaces.contains(ns))
                    && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .count();
        let ready = deployments
            .get_opt(KARPENTER_NAME)
            .await
            .map_err(SimError::kube("reading the karpenter Deployment"))?
            .and_then(|d| d.status.and_then(|s| s.ready_replicas))
            .unwrap_or(0);
        if running >= expected && ready > 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(SimError::NotSettled { expected, running, controller_ready: ready > 0 });
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(250));
    }
}

async fn launch_decoys(spec: &WorldSpec, aws: &Cloud, decoy: &str) -> Result<Vec<String>, SimError> {
    let mut out = Vec::new();
    for i in 0..spec.decoys {
        let pool = spec.pool_name(0);
        let claim = format!("{pool}-{}", naming::random_suffix(5));
        let zone = &spec.zones[i % spec.zones.len()];
        let node = ip_node_name(&spec.region, 0x7f_0000, i);
        let tags = naming::instance_tags(decoy, &pool, &spec.class_name(0), &claim, &node);
        let got = launch_in_zone(aws, INSTANCE_TYPE, zone, 1, &tags)
            .await
            .map_err(SimError::aws("launching decoy instances"))?;
        out.extend(got.into_iter().map(|i| i.id));
    }
    Ok(out)
}

/// Karpenter tags the first node's instance carries, for tests asserting §3.
pub fn expected_instance_tags(world: &World, node: &GeneratedNode) -> BTreeMap<String, String> {
    naming::instance_tags(&world.cluster, &node.pool, &node.class, &node.nodeclaim, &node.node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_validated() {
        assert!(WorldSpec::default().validate().is_ok());
        assert!(WorldSpec { zones: vec![], ..WorldSpec::default() }.validate().is_err());
        assert!(WorldSpec { node_pools: 0, ..WorldSpec::default() }.validate().is_err());
        assert!(WorldSpec { managed_nodes: 0, ..WorldSpec::default() }.validate().is_err());
        assert!(WorldSpec { nodes: 0, node_pools: 0, managed_nodes: 0, ..WorldSpec::default() }.validate().is_ok());
    }

    #[test]
    fn grace_periods_are_drawn_by_weight_and_seed() {
        assert_eq!(WorldSpec::default().grace_of(7), 1, "no distribution keeps the fast default");
        let spec =
            WorldSpec { grace_periods: vec![(30, 8), (60, 1), (120, 1)], grace_seed: 42, ..WorldSpec::default() };
        let draws: Vec<i64> = (0..1000).map(|w| spec.grace_of(w)).collect();
        let again: Vec<i64> = (0..1000).map(|w| spec.grace_of(w)).collect();
        assert_eq!(draws, again, "the same seed gives the same draw");
        let thirty = draws.iter().filter(|g| **g == 30).count();
        assert!((700..=900).contains(&thirty), "30 s has weight 8 of 10: {thirty} of 1000");
        assert!(draws.contains(&60) && draws.contains(&120));
        let other = WorldSpec { grace_seed: 43, ..spec.clone() };
        assert_ne!(draws, (0..1000).map(|w| other.grace_of(w)).collect::<Vec<_>>(), "the seed changes the draw");
    }

    #[test]
    fn node_names_are_distinct_within_a_world() {
        let names: std::collections::BTreeSet<String> =
            (0..1000).map(|i| ip_node_name("us-west-2", 0x10000, i)).collect();
        assert_eq!(names.len(), 1000);
    }
}
