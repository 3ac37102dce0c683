//! The live inventory: what of Karpenter the cluster and EC2 hold right now. Every action is a
//! function of this state, which is what makes a re-run after a crash finish the job.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::core::DynamicObject;
use serde_json::Value;

use crate::k8s::{self, KubeError};
use crate::karpenter::{self, Foreign, ProviderId};
use crate::plan::ObjectSets;
use crate::{evidence, gitops, verify};

/// A Karpenter machine: a NodeClaim and the Node it registered, either of which may be gone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Machine {
    /// The machine's name: the NodeClaim's, or `node/<name>` for a Node whose NodeClaim is gone.
    pub name: String,
    /// The NodeClaim, if it still exists.
    pub nodeclaim: Option<String>,
    /// The Node, if it still exists.
    pub node: Option<String>,
    /// The instance behind it, from `status.providerID` or the Node's `spec.providerID`.
    pub provider_id: Option<ProviderId>,
    /// The NodePool it belongs to.
    pub nodepool: Option<String>,
    /// The EC2NodeClass it was launched from.
    pub nodeclass: Option<String>,
}

/// The Karpenter controller Deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Controller {
    /// Namespace (usually kube-system).
    pub namespace: String,
    /// Deployment name (usually karpenter).
    pub name: String,
    /// Desired replicas.
    pub replicas: i32,
    /// The cluster name it is configured for (env CLUSTER_NAME), identity evidence.
    pub cluster_name: Option<String>,
    /// What its metadata says about who applies it (a GitOps owner scales it back up).
    pub tracked: gitops::Tracked,
}

/// Everything of Karpenter in the cluster.
#[derive(Debug, Clone, Default)]
pub struct Inventory {
    /// Machines by name.
    pub machines: BTreeMap<String, Machine>,
    /// NodePool names.
    pub nodepools: Vec<String>,
    /// EC2NodeClass names.
    pub nodeclasses: Vec<String>,
    /// The controller, when found (`kube-system/karpenter` first).
    pub controller: Option<Controller>,
    /// Any other Deployment that runs Karpenter's controller: stopped too, never left running
    /// beside the teardown.
    pub other_controllers: Vec<Controller>,
    /// Instance profiles named by an EC2NodeClass's `spec.instanceProfile`: the user's, which
    /// Karpenter never deletes and the tool never reports or deletes.
    pub user_instance_profiles: BTreeSet<String>,
    /// The NodePools and EC2NodeClasses with the metadata that names their GitOps owners.
    pub tracked: Vec<gitops::Tracked>,
    /// Karpenter-kind objects that are not this controller's, left alone.
    pub not_ours: Vec<Foreign>,
}

impl Inventory {
    /// The NodePools set aside as another controller's, and whose.
    pub(crate) fn foreign_pools(&self) -> BTreeMap<String, karpenter::NotOurs> {
        self.not_ours.iter().filter(|f| f.kind == "NodePool").map(|f| (f.name.clone(), f.why.clone())).collect()
    }

    /// The nodes of this controller's machines: what the drain empties.
    pub(crate) fn karpenter_nodes(&self) -> BTreeSet<String> {
        self.machines.values().filter_map(|m| m.node.clone()).collect()
    }

    /// Reads the inventory through the API (three Karpenter lists, one node list by label, one
    /// deployment list by label). A Karpenter CRD that is not installed reads as empty.
    pub async fn read(client: &kube::Client) -> Result<Inventory, KubeError> {
        let mut inv = Self::read_objects(client).await?;
        inv.set_controllers(find_controllers(client).await?);
        Ok(inv)
    }

    /// [`Inventory::read`] without the controller: the Karpenter objects and nodes, for a check
    /// that does not look at the controller (what verification reports as left).
    pub(crate) async fn read_objects(client: &kube::Client) -> Result<Inventory, KubeError> {
        let (claims, pools) = read_claims_and_pools(client).await?;
        let classes = list_dynamic(client, &k8s::nodeclass_resource()).await?;
        let nodes = list_karpenter_nodes(client).await?;
        let named = read_named_nodes(client, &claims, &nodes).await?;
        Ok(Self::assemble(claims, pools, classes, nodes, named))
    }

    /// The machines of this controller's NodeClaims, decided as [`Inventory::read`] decides them,
    /// from two lists (NodeClaims and NodePools, whose owners decide the claims'): enough to know
    /// which claims still use a class, without listing every node again.
    pub(crate) async fn read_claimed_machines(client: &kube::Client) -> Result<Vec<Machine>, KubeError> {
        let (claims, pools) = read_claims_and_pools(client).await?;
        let inv = Self::assemble(claims, pools, Vec::new(), Vec::new(), Vec::new());
        Ok(inv.machines.into_values().filter(|m| m.nodeclaim.is_some()).collect())
    }

    /// The inventory without the Karpenter kinds: machines from the Karpenter-labelled nodes and
    /// the controller. Enough to prove identity when the Karpenter kinds cannot be read (a 1.0.x
    /// conversion webhook with no controller behind it).
    pub async fn read_core(client: &kube::Client) -> Result<Inventory, KubeError> {
        let nodes = list_karpenter_nodes(client).await?;
        let mut inv = Self::assemble(Vec::new(), Vec::new(), Vec::new(), nodes, Vec::new());
        inv.set_controllers(find_controllers(client).await?);
        Ok(inv)
    }

    fn assemble(
        claims: Vec<DynamicObject>,
        pools: Vec<DynamicObject>,
        classes: Vec<DynamicObject>,
        nodes: Vec<NodeFacts>,
        named: Vec<NodeFacts>,
    ) -> Inventory {
        // Whose each object is, decided as Karpenter decides what it manages: pools and claims by
        // their node class reference, nodes by their claim (or, without one, their labels and
        // pool). What is not ours is set aside here, so no step ever sees it. `named` are the
        // Nodes without a NodePool label that a claim names: never a machine, only reported.
        let mut not_ours = Vec::new();
        let mut foreign_pools: BTreeMap<String, karpenter::NotOurs> = BTreeMap::new();
        let pools: Vec<DynamicObject> = pools
            .into_iter()
            .filter(|p| match pool_owner(p) {
                Ok(()) => true,
                Err(why) => {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    foreign_pools.insert(name.clone(), why.clone());
                    not_ours.push(Foreign { kind: "NodePool", name, why });
                    false
                }
            })
            .collect();
        let mut foreign_nodes: BTreeMap<String, karpenter::NotOurs> = BTreeMap::new();
        let mut foreign_instances: HashMap<ProviderId, karpenter::NotOurs> = HashMap::new();
        let mut machines = BTreeMap::new();
        let mut by_node: BTreeMap<String, String> = BTreeMap::new();
        for c in &claims {
            let name = c.metadata.name.clone().unwrap_or_default();
            let status = c.data.get("status");
            let node = status.and_then(|s| s.get("nodeName")).and_then(|v| v.as_str()).map(str::to_string);
            let provider_id = claim_provider_id(c);
            let labels = c.metadata.labels.clone().unwrap_or_default();
            if let Err(why) = claim_owner(c, &labels, &foreign_pools) {
                foreign_nodes.extend(node.clone().map(|n| (n, why.clone())));
                foreign_instances.extend(provider_id.clone().map(|p| (p, why.clone())));
                not_ours.push(Foreign { kind: "NodeClaim", name, why });
                continue;
            }
            let nodeclass = c
                .data
                .pointer("/spec/nodeClassRef/name")
                .and_then(|v| v.as_str())
                .map(str::to_string)
                .or_else(|| labels.get(karpenter::LABEL_NODECLASS).cloned());
            if let Some(n) = &node {
                by_node.insert(n.clone(), name.clone());
            }
            machines.insert(
                name.clone(),
                Machine {
                    name: name.clone(),
                    nodeclaim: Some(name),
                    node: None,
                    provider_id,
                    nodepool: labels.get(karpenter::LABEL_NODEPOOL).cloned(),
                    nodeclass,
                },
            );
        }
        let by_instance: HashMap<ProviderId, String> =
            machines.values().filter_map(|m| Some((m.provider_id.clone()?, m.name.clone()))).collect();
        for (node_name, pid, nodepool, nodeclass, owner) in nodes {
            let foreign = owner
                .err()
                .or_else(|| foreign_nodes.get(&node_name).cloned())
                .or_else(|| pid.as_ref().and_then(|p| foreign_instances.get(p)).cloned())
                .or_else(|| {
                    nodepool.as_ref().and_then(|p| foreign_pools.get(p)).map(|_| pool_not_ours(nodepool.as_deref()))
                });
            if let Some(why) = foreign {
                not_ours.push(Foreign { kind: "Node", name: node_name, why });
                continue;
            }
            // A Node belongs to the NodeClaim on whose instance it runs, with that claim's pool
            // (`crate::evidence`): the claim that names it is only the first one asked.
            let node_facts = evidence::Facts { instance: pid.as_ref(), nodepool: nodepool.as_deref() };
            let is_claims = |c: &String| {
                machines.get(c).is_some_and(|m: &Machine| {
                    let claim = evidence::Facts { instance: m.provider_id.as_ref(), nodepool: m.nodepool.as_deref() };
                    evidence::node_is_claims(claim, node_facts).is_ok()
                })
            };
            let named_by = by_node.get(&node_name).cloned();
            let claim = named_by
                .clone()
                .filter(|c| is_claims(c))
                .or_else(|| pid.as_ref().and_then(|p| by_instance.get(p)).cloned().filter(|c| is_claims(c)));
            if let Some(c) = named_by.filter(|c| claim.as_ref() != Some(c)) {
                tracing::warn!(nodeclaim = %c, node = %node_name, "the NodeClaim names a Node that is not its machine: handled as a claim without a node");
            }
            match claim.and_then(|c| machines.get_mut(&c)) {
                Some(m) => m.node = Some(node_name),
                None => {
                    let name = format!("node/{node_name}");
                    machines.insert(
                        name.clone(),
                        Machine { name, nodeclaim: None, node: Some(node_name), provider_id: pid, nodepool, nodeclass },
                    );
                }
            }
        }
        // The Nodes a claim names that are no Karpenter node at all (the reused name of a managed
        // node group's node): named in the report, never acted on.
        for (node_name, pid, nodepool, _, _) in named {
            let Some(c) = by_node.get(&node_name).and_then(|c| machines.get(c)) else { continue };
            let claim = evidence::Facts { instance: c.provider_id.as_ref(), nodepool: c.nodepool.as_deref() };
            let node = evidence::Facts { instance: pid.as_ref(), nodepool: nodepool.as_deref() };
            if let Err(mismatch) = evidence::node_is_claims(claim, node) {
                tracing::warn!(nodeclaim = %c.name, node = %node_name, %mismatch, "the NodeClaim names a Node that is not its machine: left alone");
                let why = karpenter::NotOurs::ClaimMismatch(format!("NodeClaim {} names it, but {mismatch}", c.name));
                not_ours.push(Foreign { kind: "Node", name: node_name, why });
            }
        }
        let tracked = pools
            .iter()
            .map(|p| tracked(karpenter::KARPENTER_GROUP, "NodePool", p))
            .chain(classes.iter().map(|c| tracked(karpenter::AWS_GROUP, "EC2NodeClass", c)))
            .collect();
        not_ours.sort();
        Inventory {
            not_ours,
            tracked,
            machines,
            nodepools: names(&pools),
            nodeclasses: names(&classes),
            user_instance_profiles: user_instance_profiles(&classes),
            controller: None,
            other_controllers: Vec::new(),
        }
    }

    fn set_controllers(&mut self, found: Vec<Controller>) {
        let mut found = found.into_iter();
        self.controller = found.next();
        self.other_controllers = found.collect();
    }

    /// Every object whose GitOps owners matter: the pools, the classes and the controllers.
    pub fn gitops_subjects(&self) -> Vec<gitops::Tracked> {
        let mut out = self.tracked.clone();
        out.extend(self.controller.iter().chain(&self.other_controllers).map(|c| c.tracked.clone()));
        out
    }

    /// The object sets a plan expands over.
    pub fn object_sets(&self) -> ObjectSets {
        ObjectSets {
            machines: self.machines.keys().cloned().collect(),
            nodepools: self.nodepools.clone(),
            nodeclasses: self.nodeclasses.clone(),
        }
    }

    /// True when nothing of Karpenter is left in the cluster.
    pub fn is_empty(&self) -> bool {
        self.machines.is_empty() && self.nodepools.is_empty() && self.nodeclasses.is_empty()
    }

    /// The cluster objects still present, as `Kind/name`, for the report.
    pub fn object_names(&self) -> Vec<String> {
        let mut out = Vec::new();
        for m in self.machines.values() {
            if let Some(c) = &m.nodeclaim {
                out.push(format!("NodeClaim/{c}"));
            }
            if let Some(n) = &m.node {
                out.push(format!("Node/{n}"));
            }
        }
        out.extend(self.nodepools.iter().map(|p| format!("NodePool/{p}")));
        out.extend(self.nodeclasses.iter().map(|c| format!("EC2NodeClass/{c}")));
        out
    }
}

/// Whether a NodePool is this controller's: its template's node class reference decides.
pub(crate) fn pool_owner(pool: &DynamicObject) -> Result<(), karpenter::NotOurs> {
    karpenter::nodeclass_ref_owner(pool.data.pointer("/spec/template/spec/nodeClassRef").unwrap_or(&Value::Null))
}

/// Whether a NodeClaim is this controller's: its labels, its node class reference, and its
/// NodePool (a claim of a pool that is not ours is not ours, whatever else it says).
pub(crate) fn claim_owner(
    claim: &DynamicObject,
    labels: &BTreeMap<String, String>,
    foreign_pools: &BTreeMap<String, karpenter::NotOurs>,
) -> Result<(), karpenter::NotOurs> {
    karpenter::labels_owner(labels)?;
    karpenter::nodeclass_ref_owner(claim.data.pointer("/spec/nodeClassRef").unwrap_or(&Value::Null))?;
    match labels.get(karpenter::LABEL_NODEPOOL) {
        Some(p) if foreign_pools.contains_key(p) => Err(pool_not_ours(Some(p))),
        _ => Ok(()),
    }
}

fn pool_not_ours(pool: Option<&str>) -> karpenter::NotOurs {
    karpenter::NotOurs::PoolNotOurs(pool.unwrap_or_default().to_string())
}

fn tracked(group: &str, kind: &str, obj: &DynamicObject) -> gitops::Tracked {
    // serialising an object just read cannot fail; Null would only lose the owner evidence
    gitops::Tracked::from_json(group, kind, &serde_json::to_value(obj).unwrap_or_default())
}

fn names(objs: &[DynamicObject]) -> Vec<String> {
    objs.iter().filter_map(|o| o.metadata.name.clone()).collect()
}

/// Of each Karpenter-labelled node what the inventory needs: its name, instance, pool, class and
/// whether its labels make it another controller's.
type NodeFacts = (String, Option<ProviderId>, Option<String>, Option<String>, Result<(), karpenter::NotOurs>);

async fn read_claims_and_pools(client: &kube::Client) -> Result<(Vec<DynamicObject>, Vec<DynamicObject>), KubeError> {
    let t = Instant::now();
    let claims = list_dynamic(client, &k8s::nodeclaim_resource()).await?;
    tracing::debug!(seconds = t.elapsed().as_secs_f64(), objects = claims.len(), "NodeClaims listed");
    let pools = list_dynamic(client, &k8s::nodepool_resource()).await?;
    Ok((claims, pools))
}

/// The Nodes that claims name and the Karpenter-labelled list did not hold: each read on its own
/// (there are none in a cluster whose claims all name their own nodes), so that a claim naming
/// another machine's Node is reported, and one naming a Node that is gone is not.
async fn read_named_nodes(
    client: &kube::Client,
    claims: &[DynamicObject],
    listed: &[NodeFacts],
) -> Result<Vec<NodeFacts>, KubeError> {
    let listed: BTreeSet<&str> = listed.iter().map(|n| n.0.as_str()).collect();
    let wanted: BTreeSet<String> = claims
        .iter()
        .filter_map(|c| c.data.pointer("/status/nodeName").and_then(Value::as_str))
        .filter(|n| !listed.contains(n))
        .map(str::to_string)
        .collect();
    let api: Api<Node> = Api::all(client.clone());
    let mut out = Vec::new();
    for name in wanted {
        match api.get_opt(&name).await {
            Ok(Some(n)) => out.push(node_facts(n)),
            Ok(None) => {}
            Err(e) => return Err(KubeError::api(format!("read Node {name}"), e)),
        }
    }
    Ok(out)
}

fn node_facts(n: Node) -> NodeFacts {
    let pid = n.spec.and_then(|s| s.provider_id).and_then(|p| ProviderId::parse(&p).ok());
    let mut labels = n.metadata.labels.unwrap_or_default();
    let owner = karpenter::labels_owner(&labels);
    (
        n.metadata.name.unwrap_or_default(),
        pid,
        labels.remove(karpenter::LABEL_NODEPOOL),
        labels.remove(karpenter::LABEL_NODECLASS),
        owner,
    )
}

async fn list_karpenter_nodes(client: &kube::Client) -> Result<Vec<NodeFacts>, KubeError> {
    let t = Instant::now();
    let nodes: Api<Node> = Api::all(client.clone());
    // of each node only what the inventory needs, so a list of thousands is never held whole
    let nodes = k8s::list_pages(&nodes, &ListParams::default().labels(karpenter::LABEL_NODEPOOL), |n: Node| {
        Some(node_facts(n))
    })
    .await
    .map_err(|e| KubeError::api("list Karpenter nodes", e))?;
    tracing::debug!(seconds = t.elapsed().as_secs_f64(), nodes = nodes.len(), "Karpenter nodes listed");
    Ok(nodes)
}

/// What of a live cluster stands for which instance, for `verify --reclaim`: every Node's and
/// NodeClaim's instance id (all Nodes, not only Karpenter's: a node that lost its labels still
/// runs pods), the names of the NodeClaims (an instance not yet named by its claim carries the
/// claim's name as a tag), the instance profiles the EC2NodeClasses name, and the classes.
pub(crate) async fn cluster_holders(client: &kube::Client) -> Result<verify::ClusterHolders, KubeError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node_ids = k8s::list_pages(&nodes, &ListParams::default(), |n: Node| {
        let pid = n.spec.and_then(|s| s.provider_id).and_then(|p| ProviderId::parse(&p).ok())?;
        Some((pid.instance_id, format!("Node {}", n.metadata.name.unwrap_or_default())))
    })
    .await
    .map_err(|e| KubeError::api("list nodes", e))?;
    let claims = list_dynamic(client, &k8s::nodeclaim_resource()).await?;
    let classes = list_dynamic(client, &k8s::nodeclass_resource()).await?;
    let mut holders = verify::ClusterHolders::default();
    for c in &claims {
        let name = c.metadata.name.clone().unwrap_or_default();
        if let Some(pid) = claim_provider_id(c) {
            holders.instances.insert(pid.instance_id, format!("NodeClaim {name}"));
        }
        holders.claims.insert(name);
    }
    // a Node names its instance more plainly than its claim does
    holders.instances.extend(node_ids);
    holders.user_profiles = user_instance_profiles(&classes);
    holders.nodeclasses = names(&classes).into_iter().collect();
    Ok(holders)
}

/// The instance a NodeClaim names (`status.providerID`), once it names one.
fn claim_provider_id(claim: &DynamicObject) -> Option<ProviderId> {
    claim.data.pointer("/status/providerID").and_then(Value::as_str).and_then(|p| ProviderId::parse(p).ok())
}

/// The instance profiles EC2NodeClasses name in `spec.instanceProfile`: the user's.
fn user_instance_profiles(classes: &[DynamicObject]) -> BTreeSet<String> {
    classes
        .iter()
        .filter_map(|c| c.data.pointer("/spec/instanceProfile").and_then(Value::as_str))
        .map(str::to_string)
        .collect()
}

/// Lists a Karpenter kind; a kind the server does not know (CRD not installed, or already
/// removed) is an empty list, not an error.
pub async fn list_dynamic(
    client: &kube::Client,
    ar: &kube::core::ApiResource,
) -> Result<Vec<DynamicObject>, KubeError> {
    k8s::list_kind(client, ar, Some).await.map_err(|e| k8s::list_error(ar, e))
}

/// Finds the Karpenter controller: the first of [`find_controllers`], preferring
/// `kube-system/karpenter`.
pub async fn find_controller(client: &kube::Client) -> Result<Option<Controller>, KubeError> {
    Ok(find_controllers(client).await?.into_iter().next())
}

/// Finds every Karpenter controller Deployment by what it runs and does, never by its chart's
/// name alone (`nameOverride` and `fullnameOverride` rename the Deployment and its
/// `app.kubernetes.io/name`): a Deployment whose pods run Karpenter's controller
/// ([`karpenter::controller_container`]) or carry its chart's label, and the Deployment behind
/// the pod that holds a Karpenter leader Lease (`<pod>_<uuid>`). A Lease held by a pod that no
/// Deployment can be traced for is an error: nothing could keep that controller stopped. A
/// holder whose pod is gone holds nothing (a controller scaled to zero leaves its Lease).
pub async fn find_controllers(client: &kube::Client) -> Result<Vec<Controller>, KubeError> {
    let api: Api<Deployment> = Api::all(client.clone());
    let all = api
        .list(&ListParams::default())
        .await
        .map_err(|e| KubeError::api("list the Deployments to find the Karpenter controller", e))?
        .items;
    let mut found: Vec<&Deployment> = all.iter().filter(|d| karpenter_deployment(d).is_some()).collect();
    let mut lease_names: BTreeSet<String> = BTreeSet::from([karpenter::LEADER_LEASE.to_string()]);
    lease_names.extend(found.iter().filter_map(|d| env_of(d, karpenter::ENV_LEADER_LEASE)));
    let leases: Api<Lease> = Api::all(client.clone());
    let leases = leases
        .list(&ListParams::default())
        .await
        .map_err(|e| KubeError::api("list the Leases to find the Karpenter controller's leader", e))?
        .items;
    for lease in leases.iter().filter(|l| l.metadata.name.as_ref().is_some_and(|n| lease_names.contains(n))) {
        let Some(pod_name) =
            lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).and_then(karpenter::lease_holder_pod)
        else {
            continue;
        };
        // the holder runs in the Lease's namespace, unless a controller's environment moved its
        // Lease elsewhere (LEADER_ELECTION_NAMESPACE)
        let lease_ns = lease.metadata.namespace.clone().unwrap_or_default();
        let mut namespaces = vec![lease_ns.clone()];
        namespaces.extend(
            found
                .iter()
                .filter(|d| env_of(d, karpenter::ENV_LEADER_NAMESPACE).as_deref() == Some(lease_ns.as_str()))
                .filter_map(|d| d.metadata.namespace.clone()),
        );
        let mut holder = None;
        for ns in namespaces {
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let got =
                pods.get_opt(pod_name).await.map_err(|e| KubeError::api(format!("read pod {ns}/{pod_name}"), e))?;
            if let Some(p) = got {
                holder = Some((ns, p));
                break;
            }
        }
        let Some((ns, pod)) = holder else { continue };
        match owning_deployment(&pod, &all) {
            Ok(d) => {
                if !found.iter().any(|f| std::ptr::eq(*f, d)) {
                    tracing::info!(deployment = %d.metadata.name.as_deref().unwrap_or_default(), "the Karpenter leader runs in a Deployment its labels and image do not name");
                    found.push(d);
                }
            }
            Err(why) => {
                return Err(KubeError::UntracedController {
                    lease: format!("{lease_ns}/{}", lease.metadata.name.as_deref().unwrap_or_default()),
                    pod: format!("{ns}/{pod_name}"),
                    why,
                });
            }
        }
    }
    let mut controllers: Vec<Controller> = found.into_iter().map(controller_of).collect();
    controllers.sort_by(|a, b| {
        (a.namespace != "kube-system", a.name != "karpenter", &a.namespace, &a.name).cmp(&(
            b.namespace != "kube-system",
            b.name != "karpenter",
            &b.namespace,
            &b.name,
        ))
    });
    Ok(controllers)
}

/// Why a Deployment is Karpenter's controller: a container of its pod template runs it, or the
/// template carries the chart's label.
fn karpenter_deployment(d: &Deployment) -> Option<&'static str> {
    let template = d.spec.as_ref().map(|s| &s.template);
    let containers = template.and_then(|t| t.spec.as_ref()).map(|p| p.containers.as_slice()).unwrap_or_default();
    let by_container = containers.iter().find_map(|c| {
        let env: Vec<(&str, Option<&str>)> =
            c.env.iter().flatten().map(|v| (v.name.as_str(), v.value.as_deref())).collect();
        karpenter::controller_container(c.image.as_deref(), &env)
    });
    let (key, value) = karpenter::CONTROLLER_LABEL;
    let labelled =
        [d.metadata.labels.as_ref(), template.and_then(|t| t.metadata.as_ref()).and_then(|m| m.labels.as_ref())]
            .into_iter()
            .flatten()
            .any(|l| l.get(key).is_some_and(|v| v == value));
    by_container.or(labelled.then_some("carries the chart's label"))
}

/// The value of `name` in the environment of the Deployment's Karpenter container (or its first).
fn env_of(d: &Deployment, name: &str) -> Option<String> {
    let containers = d.spec.as_ref().and_then(|s| s.template.spec.as_ref()).map(|p| p.containers.as_slice())?;
    let karpenters = containers.iter().find(|c| {
        let env: Vec<(&str, Option<&str>)> =
            c.env.iter().flatten().map(|v| (v.name.as_str(), v.value.as_deref())).collect();
        karpenter::controller_container(c.image.as_deref(), &env).is_some()
    });
    karpenters.or(containers.first())?.env.iter().flatten().find(|v| v.name == name).and_then(|v| v.value.clone())
}

/// The Deployment that runs `pod`: its controlling ReplicaSet is named `<deployment>-<its
/// pod-template-hash>`, and the Deployment's selector matches the pod's labels. Both must agree;
/// `Err` says what did not.
pub(crate) fn owning_deployment<'a>(pod: &Pod, all: &'a [Deployment]) -> Result<&'a Deployment, String> {
    let owner = pod.metadata.owner_references.iter().flatten().find(|o| o.controller == Some(true));
    let Some(rs) = owner.filter(|o| o.kind == "ReplicaSet") else {
        return Err(match owner {
            Some(o) => format!("which {} {} runs, not a Deployment", o.kind, o.name),
            None => "which nothing owns".into(),
        });
    };
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let hash = labels.get("pod-template-hash");
    let deployment = hash.and_then(|h| rs.name.strip_suffix(h.as_str())).and_then(|n| n.strip_suffix('-'));
    let selects = |d: &Deployment| {
        d.spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.as_ref())
            .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels.get(k) == Some(v)))
    };
    all.iter()
        .find(|d| {
            d.metadata.namespace.as_deref() == Some(ns)
                && deployment.is_some_and(|n| d.metadata.name.as_deref() == Some(n))
                && selects(d)
        })
        .ok_or_else(|| {
            format!("whose ReplicaSet {} no Deployment in namespace {ns} with a matching selector owns", rs.name)
        })
}

fn controller_of(d: &Deployment) -> Controller {
    Controller {
        namespace: d.metadata.namespace.clone().unwrap_or_default(),
        name: d.metadata.name.clone().unwrap_or_default(),
        replicas: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
        cluster_name: env_of(d, karpenter::ENV_CLUSTER_NAME),
        // serialising an object just read cannot fail; Null would only lose the owner evidence
        tracked: gitops::Tracked::from_json("apps", "Deployment", &serde_json::to_value(d).unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> DynamicObject {
        serde_json::from_value(value).expect("a DynamicObject")
    }

    fn claim(name: &str, pool: &str, class_ref: Value, node: Option<&str>) -> DynamicObject {
        object(json!({
            "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
            "metadata": {"name": name, "labels": {karpenter::LABEL_NODEPOOL: pool}},
            "spec": {"nodeClassRef": class_ref},
            "status": {"nodeName": node, "providerID": node.map(|n| format!("aws:///us-west-2a/i-{n}"))},
        }))
    }

    fn pool(name: &str, class_ref: Value) -> DynamicObject {
        object(json!({
            "apiVersion": "karpenter.sh/v1", "kind": "NodePool",
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"nodeClassRef": class_ref}}},
        }))
    }

    fn ours(class: &str) -> Value {
        json!({"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": class})
    }

    fn auto_mode() -> Value {
        json!({"group": "eks.amazonaws.com", "kind": "NodeClass", "name": "default"})
    }

    fn node(name: &str, pool: &str, class: &str) -> NodeFacts {
        let pid = ProviderId::parse(&format!("aws:///us-west-2a/i-{name}")).ok();
        (name.to_string(), pid, Some(pool.to_string()), Some(class.to_string()), Ok(()))
    }

    #[test]
    fn a_claim_naming_another_machines_node_is_a_machine_without_a_node_and_the_node_is_left_alone() {
        // Karpenter was uninstalled and left this claim; its instance is long gone, and a managed
        // node group's newer instance registered under the same name (the same private IP)
        let stale = claim("stale", "general", ours("default"), Some("ip-10-0-0-9"));
        let managed: NodeFacts =
            ("ip-10-0-0-9".into(), ProviderId::parse("aws:///us-west-2a/i-managed").ok(), None, None, Ok(()));
        let pools = vec![pool("general", ours("default"))];
        let inv = Inventory::assemble(vec![stale], pools, Vec::new(), Vec::new(), vec![managed]);
        assert_eq!(inv.machines.len(), 1);
        let m = &inv.machines["stale"];
        assert_eq!(m.node, None, "the reused name is not the claim's node");
        assert_eq!(m.provider_id.as_ref().map(|p| p.instance_id.as_str()), Some("i-ip-10-0-0-9"));
        assert!(inv.karpenter_nodes().is_empty());
        assert_eq!(inv.not_ours.len(), 1, "{:?}", inv.not_ours);
        let f = &inv.not_ours[0];
        assert_eq!((f.kind, f.name.as_str()), ("Node", "ip-10-0-0-9"));
        let karpenter::NotOurs::ClaimMismatch(why) = &f.why else { panic!("{f:?}") };
        assert!(why.contains("NodeClaim stale") && why.contains("i-managed"), "{why}");
    }

    #[test]
    fn a_karpenter_node_belongs_to_the_claim_on_its_instance_not_to_the_claim_naming_it() {
        // claim a names node 0b (a stale name); claim b runs on 0b's instance and names nothing
        let mut a = claim("a", "general", ours("default"), Some("0a"));
        a.data["status"]["nodeName"] = json!("0b");
        let mut b = claim("b", "general", ours("default"), Some("0b"));
        b.data["status"]["nodeName"] = Value::Null;
        // and claim c's node is labelled with another pool than c's
        let c = claim("c", "general", ours("default"), Some("0c"));
        let pools = vec![pool("general", ours("default")), pool("batch", ours("default"))];
        let nodes = vec![node("0b", "general", "default"), node("0c", "batch", "default")];
        let inv = Inventory::assemble(vec![a, b, c], pools, Vec::new(), nodes, Vec::new());
        assert_eq!(inv.machines.len(), 4, "{:?}", inv.machines.keys().collect::<Vec<_>>());
        assert_eq!(inv.machines["a"].node, None);
        assert_eq!(inv.machines["b"].node.as_deref(), Some("0b"));
        assert_eq!(inv.machines["c"].node, None, "a node of another pool is not the claim's");
        // the node of another pool stands as a machine of its own, on its own labels
        assert_eq!(inv.machines["node/0c"].node.as_deref(), Some("0c"));
    }

    #[test]
    fn the_claims_alone_decide_which_machines_use_a_class_as_the_whole_inventory_does() {
        let claims = vec![
            claim("general-a", "general", ours("default"), Some("0a")),
            claim("general-b", "general", ours("gpu"), None),
            claim("auto-c", "system", auto_mode(), Some("0c")),
            // ours by its reference, but of a pool that is not: not ours
            claim("foreign-d", "foreign", ours("default"), None),
        ];
        let pools = vec![pool("general", ours("default")), pool("foreign", auto_mode())];
        let nodes =
            vec![node("0a", "general", "default"), node("0c", "system", "default"), node("0e", "general", "default")];
        let uses = |machines: Vec<&Machine>| -> Vec<(String, Option<String>)> {
            machines.into_iter().map(|m| (m.name.clone(), m.nodeclass.clone())).collect()
        };

        let whole = Inventory::assemble(claims.clone(), pools.clone(), Vec::new(), nodes, Vec::new());
        let claims_alone = Inventory::assemble(claims, pools, Vec::new(), Vec::new(), Vec::new());

        let expected = vec![
            ("general-a".to_string(), Some("default".to_string())),
            ("general-b".to_string(), Some("gpu".to_string())),
        ];
        assert_eq!(uses(whole.machines.values().filter(|m| m.nodeclaim.is_some()).collect()), expected);
        assert_eq!(uses(claims_alone.machines.values().filter(|m| m.nodeclaim.is_some()).collect()), expected);
        // the node without a claim is a machine of the whole inventory, and references no class
        // through a claim, so it never counts as a user
        assert!(whole.machines.contains_key("node/0e"));
        assert!(whole.machines["node/0e"].nodeclaim.is_none());
    }
}
