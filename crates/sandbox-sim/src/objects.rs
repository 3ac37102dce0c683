//! The Kubernetes objects of the simulation: Karpenter's custom resources as [`DynamicObject`]s
//! (kube's `derive` feature is off, and the CRDs are the server's business), and the JSON shapes
//! Karpenter gives to NodePools, EC2NodeClasses, NodeClaims and Nodes (field names from the real
//! v1 CRDs).

use kube::api::{ApiResource, DynamicObject};
use serde_json::{Value, json};

use super::KarpenterVersion;
use super::naming::{self, CPU_PER_NODE, INSTANCE_TYPE, MEMORY_GIB_PER_NODE};
use crate::karpenter;

/// `karpenter.sh/v1` NodePool.
pub fn nodepool_resource() -> ApiResource {
    resource(karpenter::KARPENTER_GROUP, "NodePool", "nodepools")
}

/// `karpenter.sh/v1` NodeClaim.
pub fn nodeclaim_resource() -> ApiResource {
    resource(karpenter::KARPENTER_GROUP, "NodeClaim", "nodeclaims")
}

/// `karpenter.k8s.aws/v1` EC2NodeClass.
pub fn ec2nodeclass_resource() -> ApiResource {
    resource(karpenter::AWS_GROUP, "EC2NodeClass", "ec2nodeclasses")
}

fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.to_string(),
        version: karpenter::VERSION.to_string(),
        api_version: format!("{group}/{}", karpenter::VERSION),
        kind: kind.to_string(),
        plural: plural.to_string(),
    }
}

/// The current time as Kubernetes writes it (RFC 3339, seconds).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

fn condition(type_: &str, reason: &str) -> Value {
    json!({
        "type": type_,
        "status": "True",
        "reason": reason,
        "message": "",
        "lastTransitionTime": now_rfc3339(),
    })
}

/// An EC2NodeClass, with `spec.role` (Karpenter then manages an instance profile) or a
/// user-managed `spec.instanceProfile`, and the finalizer Karpenter adds to every class.
pub fn ec2nodeclass(name: &str, cluster: &str, role: Option<&str>, instance_profile: Option<&str>) -> Value {
    let mut spec = json!({
        "amiSelectorTerms": [{"alias": "al2023@latest"}],
        "subnetSelectorTerms": [{"tags": {"karpenter.sh/discovery": cluster}}],
        "securityGroupSelectorTerms": [{"tags": {"karpenter.sh/discovery": cluster}}],
        "metadataOptions": {"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 1},
    });
    if let Some(role) = role {
        spec["role"] = json!(role);
    }
    if let Some(profile) = instance_profile {
        spec["instanceProfile"] = json!(profile);
    }
    json!({
        "apiVersion": format!("{}/{}", karpenter::AWS_GROUP, karpenter::VERSION),
        "kind": "EC2NodeClass",
        "metadata": {"name": name, "finalizers": [karpenter::FINALIZER_NODECLASS]},
        "spec": spec,
    })
}

/// The status Karpenter reports on a ready EC2NodeClass.
pub fn ec2nodeclass_status(instance_profile: &str) -> Value {
    json!({
        "instanceProfile": instance_profile,
        "amis": [{"id": naming::IMAGE_ID, "name": "al2023", "requirements": []}],
        "conditions": [condition("Ready", "Ready")],
    })
}

/// A NodePool pointing at `class`, with optional `spec.limits.cpu` and weight, and a disruption
/// budget like the chart's default.
pub fn nodepool(name: &str, class: &str, cpu_limit: Option<u64>, weight: Option<u32>) -> Value {
    let mut spec = json!({
        "template": {
            "metadata": {"labels": {"workload-tier": name}},
            "spec": {
                "nodeClassRef": {"group": karpenter::AWS_GROUP, "kind": "EC2NodeClass", "name": class},
                "requirements": [
                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
                    {"key": naming::LABEL_CAPACITY_TYPE, "operator": "In", "values": ["on-demand"]},
                    {"key": naming::LABEL_INSTANCE_TYPE, "operator": "In", "values": [INSTANCE_TYPE]},
                ],
                "expireAfter": "720h",
            },
        },
        "disruption": {
            "consolidationPolicy": "WhenEmptyOrUnderutilized",
            "consolidateAfter": "1m",
            "budgets": [{"nodes": "10%"}],
        },
    });
    if let Some(cpu) = cpu_limit {
        spec["limits"] = json!({"cpu": cpu.to_string()});
    }
    if let Some(w) = weight {
        spec["weight"] = json!(w);
    }
    json!({
        "apiVersion": format!("{}/{}", karpenter::KARPENTER_GROUP, karpenter::VERSION),
        "kind": "NodePool",
        "metadata": {"name": name},
        "spec": spec,
    })
}

/// Identity of the NodePool a NodeClaim is made for.
#[derive(Debug, Clone)]
pub struct PoolRef<'a> {
    /// NodePool name.
    pub name: &'a str,
    /// NodePool uid (for the ownerReference).
    pub uid: &'a str,
    /// The EC2NodeClass it references.
    pub class: &'a str,
}

fn capacity(pods: u32) -> Value {
    json!({
        "cpu": CPU_PER_NODE.to_string(),
        "memory": format!("{MEMORY_GIB_PER_NODE}Gi"),
        "pods": pods.to_string(),
        "ephemeral-storage": "20Gi",
    })
}

/// The labels Karpenter puts on a NodeClaim and its Node.
fn karpenter_labels(version: KarpenterVersion, pool: &PoolRef<'_>, zone: &str, region: &str) -> Value {
    let mut labels = json!({
        karpenter::LABEL_NODEPOOL: pool.name,
        naming::LABEL_INSTANCE_TYPE: INSTANCE_TYPE,
        naming::LABEL_ZONE: zone,
        naming::LABEL_REGION: region,
        naming::LABEL_CAPACITY_TYPE: "on-demand",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "workload-tier": pool.name,
    });
    if version.labels_nodeclass() {
        labels[karpenter::LABEL_NODECLASS] = json!(pool.class);
    }
    labels
}

/// A NodeClaim as Karpenter creates it before launching: finalizer first (so the instance can
/// never exist without a finalizer guarding it), owned by its NodePool.
pub fn nodeclaim(name: &str, pool: &PoolRef<'_>, zone: &str, region: &str, version: KarpenterVersion) -> Value {
    let mut labels = karpenter_labels(version, pool, zone, region);
    // NodeClaims carry the class label in every release; only nodes lacked it before 1.1.
    labels[karpenter::LABEL_NODECLASS] = json!(pool.class);
    json!({
        "apiVersion": format!("{}/{}", karpenter::KARPENTER_GROUP, karpenter::VERSION),
        "kind": "NodeClaim",
        "metadata": {
            "name": name,
            "labels": labels,
            "finalizers": [karpenter::FINALIZER_TERMINATION],
            "ownerReferences": [{
                "apiVersion": format!("{}/{}", karpenter::KARPENTER_GROUP, karpenter::VERSION),
                "kind": "NodePool",
                "name": pool.name,
                "uid": pool.uid,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "nodeClassRef": {"group": karpenter::AWS_GROUP, "kind": "EC2NodeClass", "name": pool.class},
            "requirements": [
                {"key": karpenter::LABEL_NODEPOOL, "operator": "In", "values": [pool.name]},
                {"key": naming::LABEL_INSTANCE_TYPE, "operator": "In", "values": [INSTANCE_TYPE]},
                {"key": naming::LABEL_ZONE, "operator": "In", "values": [zone]},
            ],
            "resources": {"requests": {"pods": "1"}},
            "expireAfter": "720h",
        },
    })
}

/// NodeClaim status after launch (`node_name` None) or after registration.
pub fn nodeclaim_status(provider_id: &str, node_name: Option<&str>, pods: u32) -> Value {
    let mut conditions = vec![condition("Launched", "Launched")];
    let mut status = json!({
        "providerID": provider_id,
        "imageID": naming::IMAGE_ID,
        "capacity": capacity(pods),
        "allocatable": capacity(pods),
    });
    if let Some(node) = node_name {
        status["nodeName"] = json!(node);
        conditions.extend([
            condition("Registered", "Registered"),
            condition("Initialized", "Initialized"),
            condition("Ready", "Ready"),
        ]);
    }
    status["conditions"] = Value::Array(conditions);
    status
}

/// Identity of the NodeClaim a Node belongs to.
#[derive(Debug, Clone)]
pub struct ClaimRef<'a> {
    /// NodeClaim name.
    pub name: &'a str,
    /// NodeClaim uid (for the ownerReference).
    pub uid: &'a str,
}

/// A registered Karpenter Node: labels, the termination finalizer, an ownerReference to its
/// NodeClaim with `blockOwnerDeletion`, and its provider id.
pub fn karpenter_node(
    name: &str,
    claim: &ClaimRef<'_>,
    pool: &PoolRef<'_>,
    zone: &str,
    region: &str,
    provider_id: &str,
    version: KarpenterVersion,
) -> Value {
    let mut labels = karpenter_labels(version, pool, zone, region);
    labels["kubernetes.io/hostname"] = json!(name);
    labels[naming::LABEL_REGISTERED] = json!("true");
    labels[naming::LABEL_INITIALIZED] = json!("true");
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "finalizers": [karpenter::FINALIZER_TERMINATION],
            "ownerReferences": [{
                "apiVersion": format!("{}/{}", karpenter::KARPENTER_GROUP, karpenter::VERSION),
                "kind": "NodeClaim",
                "name": claim.name,
                "uid": claim.uid,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": {"providerID": provider_id},
    })
}

/// A node that is not Karpenter's (managed node group or control plane).
pub fn plain_node(name: &str, labels: Value, taints: Vec<Value>, provider_id: Option<&str>) -> Value {
    let mut spec = json!({});
    if !taints.is_empty() {
        spec["taints"] = Value::Array(taints);
    }
    if let Some(p) = provider_id {
        spec["providerID"] = json!(p);
    }
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": spec})
}

/// A Ready node's status with room for `pods` pods.
pub fn node_status(pods: u32, internal_ip: &str) -> Value {
    json!({
        "capacity": capacity(pods),
        "allocatable": capacity(pods),
        "conditions": [{
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": now_rfc3339(),
            "lastTransitionTime": now_rfc3339(),
        }],
        "addresses": [{"type": "InternalIP", "address": internal_ip}],
        "nodeInfo": {
            "kubeletVersion": "v1.34.1-eks-1a2b3c4",
            "containerRuntimeVersion": "containerd://1.7.27",
            "osImage": "Amazon Linux 2023",
            "kernelVersion": "6.1.0",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "machineID": "", "systemUUID": "", "bootID": "", "kubeProxyVersion": "",
        },
    })
}

/// A made-up private address for a node, stable per name.
pub fn internal_ip(name: &str) -> String {
    let h = naming::stable_hash(&[name]);
    format!("10.{}.{}.{}", (h >> 16) & 0xff, (h >> 8) & 0xff, (h & 0xfe) + 1)
}

/// `spec.nodeClassRef.name` of a NodeClaim.
pub fn claim_class(claim: &DynamicObject) -> Option<&str> {
    claim.data["spec"]["nodeClassRef"]["name"].as_str()
}

/// `spec.template.spec.nodeClassRef.name` of a NodePool.
pub fn pool_class(pool: &DynamicObject) -> Option<&str> {
    pool.data["spec"]["template"]["spec"]["nodeClassRef"]["name"].as_str()
}

/// `status.providerID` of a NodeClaim.
pub fn claim_provider_id(claim: &DynamicObject) -> Option<&str> {
    claim.data["status"]["providerID"].as_str().filter(|s| !s.is_empty())
}

/// `status.nodeName` of a NodeClaim.
pub fn claim_node_name(claim: &DynamicObject) -> Option<&str> {
    claim.data["status"]["nodeName"].as_str().filter(|s| !s.is_empty())
}

/// The NodePool a NodeClaim belongs to (label, falling back to the ownerReference).
pub fn claim_pool(claim: &DynamicObject) -> Option<&str> {
    claim.metadata.labels.as_ref().and_then(|l| l.get(karpenter::LABEL_NODEPOOL)).map(String::as_str).or_else(|| {
        claim.metadata.owner_references.as_ref()?.iter().find(|o| o.kind == "NodePool").map(|o| o.name.as_str())
    })
}

/// Parses a Kubernetes quantity (`"100"`, `100`, `"1500m"`, `"64Gi"`) into base units.
pub fn parse_quantity(v: &Value) -> Option<f64> {
    if let Some(n) = v.as_f64() {
        return Some(n);
    }
    let s = v.as_str()?.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let n: f64 = num.parse().ok()?;
    let mult = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(n * mult)
}

/// A static NodePool (Karpenter ≥ 1.8): Karpenter keeps `replicas` NodeClaims of it, whatever
/// the pods need; no weight and no limits but `nodes` (the CRD's CEL rules).
pub fn static_nodepool(name: &str, class: &str, replicas: u64) -> Value {
    let mut pool = nodepool(name, class, None, None);
    pool["spec"]["replicas"] = json!(replicas);
    pool
}

/// `spec.replicas` of a static NodePool; `None` for a dynamic one.
pub fn static_replicas(pool: &DynamicObject) -> Option<u64> {
    pool.data["spec"]["replicas"].as_u64()
}

/// How many more nodes of the sandbox's one instance type a NodePool's `spec.limits` allow, given
/// the NodeClaims it already has. `None` means unlimited.
pub fn nodes_allowed_by_limits(pool: &DynamicObject, existing: u64) -> Option<u64> {
    let limits = pool.data["spec"]["limits"].as_object()?;
    let mut allowed: Option<u64> = None;
    let mut tighten = |max_nodes: u64| {
        let left = max_nodes.saturating_sub(existing);
        allowed = Some(allowed.map_or(left, |a| a.min(left)));
    };
    for (key, value) in limits {
        // An unparsable limit is treated as zero: launching past a limit we cannot read would be
        // the worse mistake for a teardown test bed.
        let q = parse_quantity(value).unwrap_or(0.0).max(0.0);
        let per_node = match key.as_str() {
            "cpu" => CPU_PER_NODE as f64,
            "memory" => (MEMORY_GIB_PER_NODE * 1024 * 1024 * 1024) as f64,
            "nodes" => 1.0,
            _ => continue,
        };
        // floor with a small epsilon so "8" cpu allows exactly 2 nodes of 4
        tighten((q / per_node + 1e-9).floor() as u64);
    }
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_with(limits: Value) -> DynamicObject {
        let mut p: DynamicObject = serde_json::from_value(nodepool("p", "c", None, None)).unwrap();
        p.data["spec"]["limits"] = limits;
        p
    }

    #[test]
    fn quantities_parse() {
        assert_eq!(parse_quantity(&json!("100")), Some(100.0));
        assert_eq!(parse_quantity(&json!(8)), Some(8.0));
        assert_eq!(parse_quantity(&json!("1500m")), Some(1.5));
        assert_eq!(parse_quantity(&json!("2Gi")), Some(2.0 * 1024.0 * 1024.0 * 1024.0));
        assert_eq!(parse_quantity(&json!("x")), None);
    }

    #[test]
    fn limits_count_whole_nodes() {
        assert_eq!(nodes_allowed_by_limits(&pool_with(json!({"cpu": "8"})), 0), Some(2));
        assert_eq!(nodes_allowed_by_limits(&pool_with(json!({"cpu": "8"})), 1), Some(1));
        assert_eq!(nodes_allowed_by_limits(&pool_with(json!({"cpu": "8"})), 3), Some(0));
        assert_eq!(nodes_allowed_by_limits(&pool_with(json!({"cpu": "0"})), 0), Some(0));
        assert_eq!(nodes_allowed_by_limits(&pool_with(json!({"cpu": "100", "memory": "32Gi"})), 0), Some(2));
        assert_eq!(nodes_allowed_by_limits(&pool_with(json!({"nodes": "3"})), 1), Some(2));
        let unlimited: DynamicObject = serde_json::from_value(nodepool("p", "c", None, None)).unwrap();
        assert_eq!(nodes_allowed_by_limits(&unlimited, 50), None);
    }

    #[test]
    fn nodeclaims_carry_finalizer_owner_and_labels() {
        let pool = PoolRef { name: "general", uid: "u1", class: "default" };
        let c = nodeclaim("general-abcde", &pool, "us-west-2a", "us-west-2", KarpenterVersion::V1_0);
        assert_eq!(c["metadata"]["finalizers"][0], karpenter::FINALIZER_TERMINATION);
        assert_eq!(c["metadata"]["ownerReferences"][0]["uid"], "u1");
        assert_eq!(c["metadata"]["ownerReferences"][0]["blockOwnerDeletion"], true);
        assert_eq!(c["metadata"]["labels"][karpenter::LABEL_NODECLASS], "default");
        let claim = ClaimRef { name: "general-abcde", uid: "u2" };
        let old = karpenter_node(
            "n",
            &claim,
            &pool,
            "us-west-2a",
            "us-west-2",
            "aws:///us-west-2a/i-1",
            KarpenterVersion::V1_0,
        );
        assert!(old["metadata"]["labels"].get(karpenter::LABEL_NODECLASS).is_none());
        let new = karpenter_node(
            "n",
            &claim,
            &pool,
            "us-west-2a",
            "us-west-2",
            "aws:///us-west-2a/i-1",
            KarpenterVersion::V1_14,
        );
        assert_eq!(new["metadata"]["labels"][karpenter::LABEL_NODECLASS], "default");
        assert_eq!(new["metadata"]["ownerReferences"][0]["kind"], "NodeClaim");
    }
}
