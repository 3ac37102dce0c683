//! Karpenter's CustomResourceDefinitions: written by us with the parts the sandbox and kubectl
//! use (names, scope, the status subresource and printer columns, permissive schemas), or read
//! from Karpenter's own CRD files, whose schemas (defaults and CEL rules) the sandbox API server
//! then applies to every write. The tests use the real files (`../shared/karpenter/crds-v*`);
//! they are another project's files and are never copied into this repository.

use serde_json::{Value, json};

fn col(name: &str, ty: &str, path: &str, priority: i64) -> Value {
    json!({"name": name, "type": ty, "jsonPath": path, "priority": priority})
}

fn crd(
    group: &str,
    kind: &str,
    plural: &str,
    singular: &str,
    short: &[&str],
    columns: Vec<Value>,
    conversion_webhook: bool,
) -> Value {
    let mut c = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {
            "group": group,
            "names": {
                "kind": kind, "listKind": format!("{kind}List"), "plural": plural,
                "singular": singular, "shortNames": short, "categories": ["karpenter"],
            },
            "scope": "Cluster",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    },
                }},
            }],
        },
    });
    if conversion_webhook {
        // Karpenter 1.0.x: every request needing conversion goes to this webhook (design §3).
        c["spec"]["conversion"] = json!({
            "strategy": "Webhook",
            "webhook": {
                "conversionReviewVersions": ["v1beta1", "v1"],
                "clientConfig": {"service": {"name": "karpenter", "namespace": "kube-system", "port": 8443}},
            },
        });
    }
    c
}

/// The NodePool, NodeClaim (karpenter.sh/v1) and EC2NodeClass (karpenter.k8s.aws/v1) CRDs.
/// `conversion_webhook` adds the 1.0.x conversion stanza.
pub fn karpenter_crds(conversion_webhook: bool) -> Vec<Value> {
    let ready = |p| col("Ready", "string", ".status.conditions[?(@.type==\"Ready\")].status", p);
    vec![
        crd(
            "karpenter.sh",
            "NodePool",
            "nodepools",
            "nodepool",
            &[],
            vec![
                col("NodeClass", "string", ".spec.template.spec.nodeClassRef.name", 0),
                col("Nodes", "string", ".status.resources.nodes", 0),
                ready(0),
                col("Age", "date", ".metadata.creationTimestamp", 0),
                col("Weight", "integer", ".spec.weight", 1),
                col("CPU", "string", ".status.resources.cpu", 1),
                col("Memory", "string", ".status.resources.memory", 1),
            ],
            conversion_webhook,
        ),
        crd(
            "karpenter.sh",
            "NodeClaim",
            "nodeclaims",
            "nodeclaim",
            &[],
            vec![
                col("Type", "string", ".metadata.labels.node\\.kubernetes\\.io/instance-type", 0),
                col("Capacity", "string", ".metadata.labels.karpenter\\.sh/capacity-type", 0),
                col("Zone", "string", ".metadata.labels.topology\\.kubernetes\\.io/zone", 0),
                col("Node", "string", ".status.nodeName", 0),
                ready(0),
                col("Age", "date", ".metadata.creationTimestamp", 0),
                col("ID", "string", ".status.providerID", 1),
                col("NodePool", "string", ".metadata.labels.karpenter\\.sh/nodepool", 1),
                col("NodeClass", "string", ".spec.nodeClassRef.name", 1),
            ],
            conversion_webhook,
        ),
        crd(
            "karpenter.k8s.aws",
            "EC2NodeClass",
            "ec2nodeclasses",
            "ec2nodeclass",
            &["ec2nc", "ec2ncs"],
            vec![
                ready(0),
                col("Age", "date", ".metadata.creationTimestamp", 0),
                col("Role", "string", ".spec.role", 1),
            ],
            conversion_webhook,
        ),
    ]
}

/// A directory of Karpenter's CRD files that could not be used.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot use Karpenter's CRDs from {dir}: {reason}; point at a directory holding karpenter.sh_nodepools.yaml, karpenter.sh_nodeclaims.yaml and karpenter.k8s.aws_ec2nodeclasses.yaml"
)]
pub struct CrdFilesError {
    /// The directory.
    pub dir: String,
    /// What is wrong.
    pub reason: String,
}

/// Karpenter's own NodePool, NodeClaim and EC2NodeClass CRDs, read from the release's files in
/// `dir` (as `kubectl apply -f` would send them).
pub fn karpenter_crds_from(dir: &std::path::Path) -> Result<Vec<Value>, CrdFilesError> {
    let bad = |reason: String| CrdFilesError { dir: dir.display().to_string(), reason };
    ["karpenter.sh_nodepools.yaml", "karpenter.sh_nodeclaims.yaml", "karpenter.k8s.aws_ec2nodeclasses.yaml"]
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(dir.join(f)).map_err(|e| bad(format!("{f}: {e}")))?;
            let crd: Value = serde_saphyr::from_str(&text).map_err(|e| bad(format!("{f}: {e}")))?;
            if crd["kind"] != "CustomResourceDefinition" {
                return Err(bad(format!("{f} is not a CustomResourceDefinition")));
            }
            Ok(crd)
        })
        .collect()
}
