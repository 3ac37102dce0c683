//! The Node a machine runs as, by the evidence rule (`crate::evidence`): read for the cordon,
//! the drain and the release alike, so none of them trusts a name the others would not.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use kube::core::DynamicObject;
use serde_json::Value;

use super::context::Ctx;
use super::task::LateMachine;
use crate::k8s::{self, KubeError};
use crate::karpenter::{self, ProviderId};

/// The node of a machine (its NodeClaim's node, see [`claim_node`], or `node/<name>`), with the
/// Node as it was read to prove it the claim's when it was read alone (the cordon starts from
/// that read instead of reading the Node again); `None` when the NodeClaim is gone or has no
/// node.
pub(crate) async fn node_read_of(ctx: &Ctx, machine: &str) -> Result<Option<(String, Option<Node>)>, KubeError> {
    if let Some(n) = machine.strip_prefix("node/") {
        return Ok(Some((n.to_string(), None)));
    }
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &k8s::nodeclaim_resource());
    match api.get_opt(machine).await {
        Ok(Some(c)) => node_of_claim(&ctx.kube.client, &c).await,
        Ok(None) => Ok(None),
        Err(e) => Err(KubeError::api(format!("read NodeClaim {machine}"), e)),
    }
}

/// The Node of a NodeClaim ([`claim_node`]): the one its `status.nodeName` names, read alone,
/// when that one passes the evidence rule (returned with the Node as read, so the caller need
/// not read it again); otherwise the Karpenter-labelled Nodes are listed and the one on the
/// claim's instance taken, if any.
pub(crate) async fn node_of_claim(
    client: &kube::Client,
    claim: &DynamicObject,
) -> Result<Option<(String, Option<Node>)>, KubeError> {
    if claim.data.pointer("/status/providerID").and_then(Value::as_str).is_none() {
        return Ok(None);
    }
    if let Some(n) = claim.data.pointer("/status/nodeName").and_then(Value::as_str) {
        let api: Api<Node> = Api::all(client.clone());
        if let Some(node) = api.get_opt(n).await.map_err(|e| KubeError::api(format!("read Node {n}"), e))?
            && let Some(found) = claim_node(claim, &[NodeSeen::of(node.clone())])
        {
            return Ok(Some((found, Some(node))));
        }
    }
    let nodes = karpenter_nodes(client).await?;
    Ok(claim_node(claim, &nodes).map(|n| (n, None)))
}

/// The NodeClaims the run has no tasks for that `node`'s machine now runs as: a Node the
/// inventory found with no NodeClaim (`node/<name>`: a controller stopped between registering it
/// and naming it on its claim) that a NodeClaim names by the evidence rule since (the controller
/// finished the registration during the run). The drain that finds one hands it to the executor.
pub(crate) async fn claims_found_for_node(ctx: &Ctx, node: &str) -> Result<Vec<LateMachine>, KubeError> {
    let api: Api<Node> = Api::all(ctx.kube.client.clone());
    let Some(read) = api.get_opt(node).await.map_err(|e| KubeError::api(format!("read Node {node}"), e))? else {
        return Ok(Vec::new());
    };
    let seen = [NodeSeen::of(read)];
    let ar = k8s::nodeclaim_resource();
    let claims = k8s::list_kind(&ctx.kube.client, &ar, Some).await.map_err(|e| k8s::list_error(&ar, e))?;
    Ok(claims
        .iter()
        .filter(|c| claim_node(c, &seen).is_some_and(|n| n == node))
        .filter_map(|c| c.metadata.name.clone())
        .filter(|name| !ctx.knows(name))
        .map(|name| LateMachine {
            why: format!(
                "NodeClaim {name} names node {node}, which had no NodeClaim when the run took its inventory: its \
                 registration finished during the run (a controller that was not fenced)"
            ),
            name,
        })
        .collect())
}

/// Of a Node what the evidence rule reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeSeen {
    name: String,
    instance: Option<ProviderId>,
    nodepool: Option<String>,
}

impl NodeSeen {
    fn of(n: Node) -> NodeSeen {
        NodeSeen {
            instance: n.spec.and_then(|s| s.provider_id).and_then(|p| ProviderId::parse(&p).ok()),
            nodepool: n.metadata.labels.and_then(|mut l| l.remove(karpenter::LABEL_NODEPOOL)),
            name: n.metadata.name.unwrap_or_default(),
        }
    }
}

/// The Nodes labelled with a NodePool, each as the evidence rule reads it and as a cordon
/// starts from it: its name, resourceVersion and fence (`spec.unschedulable`, `spec.taints`),
/// nothing else. A cordon from this read writes only if the Node is unchanged since (its patch
/// tests the resourceVersion); at thousands of nodes the rest of each Node would be most of
/// the run's memory.
pub(crate) async fn karpenter_nodes_to_fence(client: &kube::Client) -> Result<Vec<(NodeSeen, Node)>, KubeError> {
    let api: Api<Node> = Api::all(client.clone());
    let trim = |n: Node| {
        let fence = Node {
            metadata: kube::api::ObjectMeta {
                name: n.metadata.name.clone(),
                resource_version: n.metadata.resource_version.clone(),
                ..Default::default()
            },
            spec: n.spec.as_ref().map(|s| k8s_openapi::api::core::v1::NodeSpec {
                unschedulable: s.unschedulable,
                taints: s.taints.clone(),
                ..Default::default()
            }),
            status: None,
        };
        Some((NodeSeen::of(n), fence))
    };
    k8s::list_pages(&api, &ListParams::default().labels(karpenter::LABEL_NODEPOOL), trim)
        .await
        .map_err(|e| KubeError::api("list Karpenter nodes", e))
}

/// The Nodes labelled with a NodePool (those the inventory takes as Karpenter's).
pub(crate) async fn karpenter_nodes(client: &kube::Client) -> Result<Vec<NodeSeen>, KubeError> {
    let api: Api<Node> = Api::all(client.clone());
    k8s::list_pages(&api, &ListParams::default().labels(karpenter::LABEL_NODEPOOL), |n: Node| Some(NodeSeen::of(n)))
        .await
        .map_err(|e| KubeError::api("list Karpenter nodes", e))
}

/// The Node a NodeClaim's machine runs as: of `nodes`, the one that passes the evidence rule
/// (`crate::evidence`: on the claim's instance, with the claim's NodePool label), the one its
/// `status.nodeName` names first. A name alone proves nothing (EKS names nodes after their
/// reused private IPs). The claim may name none: at registration Karpenter patches the Node
/// first, lifting its `karpenter.sh/unregistered` taint so pods are scheduled there, and writes
/// `status.nodeName` after (sigs.k8s.io/karpenter pkg/controllers/nodeclaim/lifecycle/
/// registration.go): a controller that stops in between, or is gone when the kubelet registers,
/// leaves a Node, pods and all, that its NodeClaim does not name, which must still be fenced and
/// drained before its instance goes.
pub(crate) fn claim_node(claim: &DynamicObject, nodes: &[NodeSeen]) -> Option<String> {
    let instance = ProviderId::parse(claim.data.pointer("/status/providerID")?.as_str()?).ok()?;
    let pool = claim.metadata.labels.as_ref().and_then(|l| l.get(karpenter::LABEL_NODEPOOL));
    let facts = crate::evidence::Facts { instance: Some(&instance), nodepool: pool.map(String::as_str) };
    let named = claim.data.pointer("/status/nodeName").and_then(Value::as_str);
    let passes = |n: &&NodeSeen| {
        let node = crate::evidence::Facts { instance: n.instance.as_ref(), nodepool: n.nodepool.as_deref() };
        crate::evidence::node_is_claims(facts, node).is_ok()
    };
    let mut ours = nodes.iter().filter(passes);
    match named {
        Some(name) => nodes.iter().filter(passes).find(|n| n.name == name).or_else(|| ours.next()),
        None => ours.next(),
    }
    .map(|n| n.name.clone())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn claim(status: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
            "metadata": {"name": "c", "labels": {karpenter::LABEL_NODEPOOL: "web"}},
            "status": status,
        }))
        .unwrap()
    }

    fn seen(name: &str, instance: Option<&str>, pool: Option<&str>) -> NodeSeen {
        NodeSeen {
            name: name.into(),
            instance: instance.and_then(|p| ProviderId::parse(p).ok()),
            nodepool: pool.map(str::to_string),
        }
    }

    #[test]
    fn a_claim_that_does_not_name_its_node_has_the_node_on_its_instance() {
        let nodes = [
            seen("other", Some("aws:///us-west-2a/i-0aaa"), Some("web")),
            seen("ip-10-0-0-4", Some("aws:///us-west-2b/i-0bbb"), Some("web")),
        ];
        // registered by Karpenter, which then stopped before writing status.nodeName
        let unnamed = claim(json!({"providerID": "aws:///us-west-2b/i-0bbb"}));
        assert_eq!(claim_node(&unnamed, &nodes), Some("ip-10-0-0-4".to_string()));
        // no instance yet, or no Node on it: nothing to fence or drain
        assert_eq!(claim_node(&claim(json!({})), &nodes), None);
        let elsewhere = claim(json!({"providerID": "aws:///us-west-2c/i-0ccc"}));
        assert_eq!(claim_node(&elsewhere, &nodes), None);
        assert_eq!(claim_node(&elsewhere, &[seen("no-id", None, Some("web"))]), None);
    }

    #[test]
    fn a_node_name_a_claim_gives_is_taken_only_when_the_node_is_on_its_instance_and_pool() {
        let on_instance = seen("named", Some("aws:///us-west-2b/i-0bbb"), Some("web"));
        let named = claim(json!({"providerID": "aws:///us-west-2b/i-0bbb", "nodeName": "named"}));
        assert_eq!(claim_node(&named, std::slice::from_ref(&on_instance)), Some("named".to_string()));
        // the reused name: a managed node group's node, another instance, no NodePool label
        let reused = seen("named", Some("aws:///us-west-2b/i-0fff"), None);
        assert_eq!(claim_node(&named, &[reused]), None);
        // the right instance but not a Karpenter node of the claim's pool
        assert_eq!(claim_node(&named, &[seen("named", Some("aws:///us-west-2b/i-0bbb"), None)]), None);
        assert_eq!(claim_node(&named, &[seen("named", Some("aws:///us-west-2b/i-0bbb"), Some("batch"))]), None);
        // a stale name, and the claim's own node registered under another
        let own = seen("ip-10-0-0-7", Some("aws:///us-west-2b/i-0bbb"), Some("web"));
        let stale = seen("named", Some("aws:///us-west-2b/i-0fff"), Some("web"));
        assert_eq!(claim_node(&named, &[stale, own]), Some("ip-10-0-0-7".to_string()));
    }
}
