//! Karpenter's CustomResourceDefinitions: written by us with the parts the sandbox and kubectl
//! use (names, scope, the status subresource and printer columns, permissive schemas), or read
//! from Karpenter's own CRD files, whose schemas (defaults and CEL rules) the sandbox API server
//! then applies to every write. The tests use the real files of each release the simulation
//! imitates: [`release_files`] has Go download the AWS provider's module at a pinned version and
//! checksum into Go's module cache, and the files are read from there. They are another
//! project's files and are never copied into this repository.

use std::path::PathBuf;
use std::process::Command;

use crate::KarpenterVersion;
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

/// The Go module that carries Karpenter's AWS provider: its `pkg/apis/crds` holds the NodePool,
/// NodeClaim and EC2NodeClass CRDs as the release installs them (the core's CRDs with the
/// provider's own validation patched in), and `examples/v1` the documented NodePools.
const PROVIDER_MODULE: &str = "github.com/aws/karpenter-provider-aws";

/// The files of one Karpenter release, in Go's module cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseFiles {
    /// The module's directory.
    pub root: PathBuf,
}

impl ReleaseFiles {
    /// The CRD files (`karpenter.sh_nodepools.yaml`, ...), as [`karpenter_crds_from`] reads them.
    pub fn crds(&self) -> PathBuf {
        self.root.join("pkg/apis/crds")
    }

    /// The release's example manifests (`general-purpose.yaml`, `spot.yaml`, ...).
    pub fn examples(&self) -> PathBuf {
        self.root.join("examples/v1")
    }
}

/// A release's files that could not be had.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot get Karpenter {version}'s files ({PROVIDER_MODULE}@v{version}) from Go's module cache: {reason}; the test bed needs Go (1.21 or later) and its module proxy: install Go, or set GOPROXY/GOMODCACHE to a proxy or a cache that has the module"
)]
pub struct ReleaseFilesError {
    /// The release.
    pub version: &'static str,
    /// What went wrong.
    pub reason: String,
}

impl KarpenterVersion {
    /// The `go.sum` hash (`h1:`) of the provider's module at this release. Go checks it against
    /// the checksum database on download; checking it here as well pins the exact files the
    /// tests were written against, whatever `GONOSUMDB`/`GOFLAGS` the machine sets.
    fn provider_module_sum(self) -> &'static str {
        match self {
            KarpenterVersion::V1_0 => "h1:gB7i285h6eh4X/MI+SIGO0pOyk+QVDgC5skI6rd2vvE=",
            KarpenterVersion::V1_14 => "h1:WGtIQTQcxpElYMdWfWuPwaF2+9muR+hYhPZsTtoY8Gs=",
        }
    }
}

/// The files of `version`'s release: `go mod download` fetches the provider's module (once; a
/// warm cache answers at once) and names its directory. Go locks its cache, so concurrent tests
/// may ask together.
pub fn release_files(version: KarpenterVersion) -> Result<ReleaseFiles, ReleaseFilesError> {
    let v = version.as_str();
    let root = go_module_dir(PROVIDER_MODULE, &format!("v{v}"), version.provider_module_sum())
        .map_err(|reason| ReleaseFilesError { version: v, reason })?;
    Ok(ReleaseFiles { root })
}

/// The directory of `module@version` in Go's module cache, downloaded first if need be, once its
/// `go.sum` hash is `sum`: the message of what went wrong otherwise.
pub fn go_module_dir(module: &str, version: &str, sum: &str) -> Result<PathBuf, String> {
    let out = Command::new(std::env::var_os("GO").unwrap_or_else(|| "go".into()))
        .args(["mod", "download", "-json", &format!("{module}@{version}")])
        // outside any module, so no go.mod of the caller's decides what is downloaded, and with
        // no GOFLAGS of the machine's (a `-mod=vendor` would refuse the download)
        .current_dir(std::env::temp_dir())
        .env("GOFLAGS", "")
        .env("GO111MODULE", "on")
        .output()
        .map_err(|e| format!("cannot run go: {e}"))?;
    // `go mod download -json` prints a JSON object with `Error` set on failure, and exits 1
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!("go printed no module description ({e}): {}", String::from_utf8_lossy(&out.stderr).trim())
    })?;
    if let Some(e) = info["Error"].as_str() {
        return Err(e.to_string());
    }
    if !out.status.success() {
        return Err(format!("go exited with {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    let got = info["Sum"].as_str().unwrap_or_default();
    if got != sum {
        return Err(format!("the module's checksum is {got}, not the pinned {sum}"));
    }
    info["Dir"].as_str().map(PathBuf::from).ok_or_else(|| "go named no directory".into())
}
