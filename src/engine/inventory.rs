//! The live inventory: what of Karpenter the cluster and EC2 hold right now. Every action is a
//! function of this state, which is what makes a re-run after a crash finish the job.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use kube::core::DynamicObject;
use serde_json::Value;

use crate::gitops;
use crate::k8s::{self, KubeError};
use crate::karpenter::{self, ProviderId};
use crate::plan::ObjectSets;

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

/// A Karpenter object in the cluster that is not this cluster's self-managed Karpenter's (EKS
/// Auto Mode's, another provider's): named in the plan and the report, never acted on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Foreign {
    /// `NodePool`, `NodeClaim` or `Node`.
    pub kind: &'static str,
    /// Its name.
    pub name: String,
    /// Whose it is instead.
    #[serde(flatten)]
    pub why: karpenter::NotOurs,
}

impl std::fmt::Display for Foreign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.kind, self.name, self.why)
    }
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
    /// The controller, when found.
    pub controller: Option<Controller>,
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
        inv.controller = find_controller(client).await?;
        Ok(inv)
    }

    /// [`Inventory::read`] without the controller: the Karpenter objects and nodes, for a check
    /// that does not look at the controller (what verification reports as left).
    pub(crate) async fn read_objects(client: &kube::Client) -> Result<Inventory, KubeError> {
        let (claims, pools) = read_claims_and_pools(client).await?;
        let classes = list_dynamic(client, &k8s::nodeclass_resource()).await?;
        let nodes = list_karpenter_nodes(client).await?;
        Ok(Self::assemble(claims, pools, classes, nodes))
    }

    /// The machines of this controller's NodeClaims, decided as [`Inventory::read`] decides them,
    /// from two lists (NodeClaims and NodePools, whose owners decide the claims'): enough to know
    /// which claims still use a class, without listing every node again.
    pub(crate) async fn read_claimed_machines(client: &kube::Client) -> Result<Vec<Machine>, KubeError> {
        let (claims, pools) = read_claims_and_pools(client).await?;
        let inv = Self::assemble(claims, pools, Vec::new(), Vec::new());
        Ok(inv.machines.into_values().filter(|m| m.nodeclaim.is_some()).collect())
    }

    /// The inventory without the Karpenter kinds: machines from the Karpenter-labelled nodes and
    /// the controller. Enough to prove identity when the Karpenter kinds cannot be read (a 1.0.x
    /// conversion webhook with no controller behind it).
    pub async fn read_core(client: &kube::Client) -> Result<Inventory, KubeError> {
        let nodes = list_karpenter_nodes(client).await?;
        let mut inv = Self::assemble(Vec::new(), Vec::new(), Vec::new(), nodes);
        inv.controller = find_controller(client).await?;
        Ok(inv)
    }

    fn assemble(
        claims: Vec<DynamicObject>,
        pools: Vec<DynamicObject>,
        classes: Vec<DynamicObject>,
        nodes: Vec<NodeFacts>,
    ) -> Inventory {
        // Whose each object is, decided as Karpenter decides what it manages: pools and claims by
        // their node class reference, nodes by their claim (or, without one, their labels and
        // pool). What is not ours is set aside here, so no step ever sees it.
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
            // a Node belongs to the NodeClaim that names it, or whose instance it runs on
            let claim =
                by_node.get(&node_name).cloned().or_else(|| pid.as_ref().and_then(|p| by_instance.get(p)).cloned());
            match claim.and_then(|c| machines.get_mut(&c)) {
                Some(m) => {
                    m.node = Some(node_name);
                    if m.provider_id.is_none() {
                        m.provider_id = pid;
                    }
                }
                None => {
                    let name = format!("node/{node_name}");
                    machines.insert(
                        name.clone(),
                        Machine { name, nodeclaim: None, node: Some(node_name), provider_id: pid, nodepool, nodeclass },
                    );
                }
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
        }
    }

    /// Every object whose GitOps owners matter: the pools, the classes and the controller.
    pub fn gitops_subjects(&self) -> Vec<gitops::Tracked> {
        let mut out = self.tracked.clone();
        out.extend(self.controller.as_ref().map(|c| c.tracked.clone()));
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

async fn list_karpenter_nodes(client: &kube::Client) -> Result<Vec<NodeFacts>, KubeError> {
    let t = Instant::now();
    let nodes: Api<Node> = Api::all(client.clone());
    // of each node only what the inventory needs, so a list of thousands is never held whole
    let nodes = k8s::list_pages(&nodes, &ListParams::default().labels(karpenter::LABEL_NODEPOOL), |n: Node| {
        let pid = n.spec.and_then(|s| s.provider_id).and_then(|p| ProviderId::parse(&p).ok());
        let mut labels = n.metadata.labels.unwrap_or_default();
        let owner = karpenter::labels_owner(&labels);
        Some((
            n.metadata.name.unwrap_or_default(),
            pid,
            labels.remove(karpenter::LABEL_NODEPOOL),
            labels.remove(karpenter::LABEL_NODECLASS),
            owner,
        ))
    })
    .await
    .map_err(|e| KubeError::api("list Karpenter nodes", e))?;
    tracing::debug!(seconds = t.elapsed().as_secs_f64(), nodes = nodes.len(), "Karpenter nodes listed");
    Ok(nodes)
}

/// What of a live cluster stands for which instance, for `verify --reclaim`: every Node's and
/// NodeClaim's instance id (all Nodes, not only Karpenter's: a node that lost its labels still
/// runs pods), the names of the NodeClaims (an instance not yet named by its claim carries the
/// claim's name as a tag), and the instance profiles the EC2NodeClasses name.
pub(crate) async fn cluster_holders(client: &kube::Client) -> Result<ClusterHolders, KubeError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node_ids = k8s::list_pages(&nodes, &ListParams::default(), |n: Node| {
        let pid = n.spec.and_then(|s| s.provider_id).and_then(|p| ProviderId::parse(&p).ok())?;
        Some((pid.instance_id, format!("Node {}", n.metadata.name.unwrap_or_default())))
    })
    .await
    .map_err(|e| KubeError::api("list nodes", e))?;
    let claims = list_dynamic(client, &k8s::nodeclaim_resource()).await?;
    let classes = list_dynamic(client, &k8s::nodeclass_resource()).await?;
    let mut holders = ClusterHolders::default();
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

/// See [`cluster_holders`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ClusterHolders {
    /// Instance id → `Node <name>` or `NodeClaim <name>`.
    pub instances: BTreeMap<String, String>,
    /// Every NodeClaim's name.
    pub claims: BTreeSet<String>,
    /// Instance profiles named by an EC2NodeClass's `spec.instanceProfile`.
    pub user_profiles: BTreeSet<String>,
}

/// Lists a Karpenter kind; a kind the server does not know (CRD not installed, or already
/// removed) is an empty list, not an error.
pub async fn list_dynamic(
    client: &kube::Client,
    ar: &kube::core::ApiResource,
) -> Result<Vec<DynamicObject>, KubeError> {
    k8s::list_kind(client, ar, Some).await.map_err(|e| k8s::list_error(ar, e))
}

/// Finds the Karpenter controller: Deployments labelled `app.kubernetes.io/name=karpenter`,
/// preferring `kube-system`.
pub async fn find_controller(client: &kube::Client) -> Result<Option<Controller>, KubeError> {
    let api: Api<Deployment> = Api::all(client.clone());
    let list = api
        .list(&ListParams::default().labels(&karpenter::controller_selector()))
        .await
        .map_err(|e| KubeError::api("list the Karpenter controller Deployment", e))?;
    let mut found: Vec<Controller> = list
        .items
        .iter()
        .map(|d| {
            let env = d
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|p| p.containers.first())
                .and_then(|c| c.env.as_ref());
            let cluster_name =
                env.and_then(|e| e.iter().find(|v| v.name == "CLUSTER_NAME")).and_then(|v| v.value.clone());
            Controller {
                namespace: d.metadata.namespace.clone().unwrap_or_default(),
                name: d.metadata.name.clone().unwrap_or_default(),
                replicas: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
                cluster_name,
                tracked: gitops::Tracked::from_json("apps", "Deployment", &serde_json::to_value(d).unwrap_or_default()),
            }
        })
        .collect();
    found.sort_by_key(|c| (c.namespace != "kube-system", c.name != "karpenter"));
    Ok(found.into_iter().next())
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

        let whole = Inventory::assemble(claims.clone(), pools.clone(), Vec::new(), nodes);
        let claims_alone = Inventory::assemble(claims, pools, Vec::new(), Vec::new());

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
