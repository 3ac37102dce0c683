//! `tf-prune`: which Terraform state entries point at cluster objects that are gone (design
//! §1.8). A node removed by an autoscaler or by this tool leaves its `kubernetes_node_taint` in
//! the state: before hashicorp/kubernetes v2.30.0 its refresh failed with `nodes "x" not found`,
//! blocking every later plan; since then (the provider's #2402) the refresh only warns "Node has
//! been deleted" and keeps the entry, and any change to the resource fails at apply with that
//! error (tests/recipes, with v3.2.1). A `kubernetes_manifest` NodePool the teardown deleted is
//! planned for re-creation instead, which would hand Karpenter a NodePool again. The way out is
//! to make Terraform forget those entries, which this module proposes as `terraform state rm`
//! commands and as `removed` blocks (Terraform 1.7+; OpenTofu 1.12.6 applies them as printed).
//! It never edits a state itself.
//!
//! Input is `terraform show -json` output (a state, or a saved plan whose `prior_state` it reads).
//! Resources considered: `kubernetes_node_taint`, `kubernetes_labels` / `kubernetes_annotations`
//! of kind `Node`, and `kubernetes_manifest` / `kubectl_manifest` of the Karpenter kinds
//! `NodePool`, `NodeClaim` and `EC2NodeClass`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kube::Client;
use kube::api::{Api, DynamicObject};
use serde_json::Value;

use crate::k8s::{self, KubeError};
use crate::karpenter;

/// Failures of `tf-prune`, with what to do about them.
#[derive(Debug, thiserror::Error)]
pub enum TfPruneError {
    /// The state could not be read.
    #[error(
        "cannot read the Terraform state from {source_name}: {detail}; pass the output of `terraform show -json` as a file or on stdin (`--state -`)"
    )]
    Read {
        /// File name or `stdin`.
        source_name: String,
        /// The I/O error.
        detail: String,
    },
    /// The state is not `terraform show -json` output.
    #[error(
        "{source_name} is not `terraform show -json` output: {detail}; produce it with `terraform show -json > state.json` (a plain `terraform.tfstate` is not the same format)"
    )]
    Format {
        /// File name or `stdin`.
        source_name: String,
        /// What is wrong.
        detail: String,
    },
    /// Looking an object up in the cluster failed (anything but "not found").
    #[error(transparent)]
    Kube(#[from] KubeError),
}

/// The kind of cluster object a state entry points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    /// A core/v1 Node.
    Node,
    /// karpenter.sh NodePool.
    NodePool,
    /// karpenter.sh NodeClaim.
    NodeClaim,
    /// karpenter.k8s.aws EC2NodeClass.
    Ec2NodeClass,
}

impl ObjectKind {
    /// The Kubernetes kind name.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Node => "Node",
            ObjectKind::NodePool => karpenter::NODEPOOL_KIND,
            ObjectKind::NodeClaim => karpenter::NODECLAIM_KIND,
            ObjectKind::Ec2NodeClass => karpenter::NODECLASS_KIND,
        }
    }

    /// The kind of a Kubernetes object, when it is one this command looks after. Karpenter kinds
    /// count only in their own API groups (a `NodePool` of another project is not ours).
    fn from_kind(api_version: &str, kind: &str) -> Option<ObjectKind> {
        let group = api_version.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
        match (group, kind) {
            ("", "Node") => Some(ObjectKind::Node),
            (karpenter::KARPENTER_GROUP, karpenter::NODEPOOL_KIND) => Some(ObjectKind::NodePool),
            (karpenter::KARPENTER_GROUP, karpenter::NODECLAIM_KIND) => Some(ObjectKind::NodeClaim),
            (karpenter::AWS_GROUP, karpenter::NODECLASS_KIND) => Some(ObjectKind::Ec2NodeClass),
            _ => None,
        }
    }
}

/// One state entry that points at a cluster object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRef {
    /// The full resource instance address (`module.a["x"].kubernetes_node_taint.t[0]`).
    pub address: String,
    /// The resource address without instance keys, as a `removed` block needs it.
    pub resource: String,
    /// Resource type (`kubernetes_node_taint`).
    pub resource_type: String,
    /// Kind of the object.
    pub kind: ObjectKind,
    /// Name of the object (all kinds here are cluster-scoped).
    pub name: String,
}

/// Reads `terraform show -json` text and returns the entries that point at cluster objects, in
/// address order.
pub fn find_refs(text: &str, source_name: &str) -> Result<Vec<StateRef>, TfPruneError> {
    let doc: Value = serde_json::from_str(text)
        .map_err(|e| TfPruneError::Format { source_name: source_name.to_string(), detail: e.to_string() })?;
    if !doc.is_object() || doc.get("format_version").is_none() {
        return Err(TfPruneError::Format {
            source_name: source_name.to_string(),
            detail: "no `format_version` at the top level".into(),
        });
    }
    // a state has `values`; a saved plan has the state it was made from under `prior_state`
    let values = doc.get("values").or_else(|| doc.pointer("/prior_state/values"));
    let mut out = Vec::new();
    if let Some(root) = values.and_then(|v| v.get("root_module")) {
        collect(root, &mut out);
    }
    out.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(out)
}

fn collect(module: &Value, out: &mut Vec<StateRef>) {
    for r in module.get("resources").and_then(Value::as_array).into_iter().flatten() {
        if let Some(found) = classify(r) {
            out.push(found);
        }
    }
    for child in module.get("child_modules").and_then(Value::as_array).into_iter().flatten() {
        collect(child, out);
    }
}

/// The first block of a nested block list (`metadata = [{...}]`), or the object itself.
fn block<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v.get(key)? {
        Value::Array(items) => items.first(),
        other => Some(other),
    }
}

fn str_at<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str).filter(|s| !s.is_empty())
}

fn classify(r: &Value) -> Option<StateRef> {
    if r.get("mode").and_then(Value::as_str) != Some("managed") {
        return None;
    }
    let address = str_at(r, "address")?;
    let rtype = str_at(r, "type")?;
    let values = r.get("values")?;
    let (kind, name) = match rtype {
        "kubernetes_node_taint" => (ObjectKind::Node, str_at(block(values, "metadata")?, "name")?),
        "kubernetes_labels" | "kubernetes_annotations" => {
            let kind = ObjectKind::from_kind(str_at(values, "api_version").unwrap_or("v1"), str_at(values, "kind")?)?;
            (kind, str_at(block(values, "metadata")?, "name")?)
        }
        "kubernetes_manifest" => {
            // `object` is what the provider read back; `manifest` what the configuration said
            let m = values.get("object").filter(|o| o.is_object()).or_else(|| values.get("manifest"))?;
            let kind = ObjectKind::from_kind(str_at(m, "apiVersion")?, str_at(m, "kind")?)?;
            (kind, str_at(m.get("metadata")?, "name")?)
        }
        "kubectl_manifest" => {
            let (api_version, kind, name) =
                match (str_at(values, "api_version"), str_at(values, "kind"), str_at(values, "name")) {
                    (Some(a), Some(k), Some(n)) => (a.to_string(), k.to_string(), n.to_string()),
                    _ => {
                        let body: Value = serde_saphyr::from_str(str_at(values, "yaml_body")?).ok()?;
                        (
                            str_at(&body, "apiVersion")?.to_string(),
                            str_at(&body, "kind")?.to_string(),
                            str_at(body.get("metadata")?, "name")?.to_string(),
                        )
                    }
                };
            let kind = ObjectKind::from_kind(&api_version, &kind)?;
            return Some(StateRef {
                address: address.to_string(),
                resource: static_address(address),
                resource_type: rtype.to_string(),
                kind,
                name,
            });
        }
        _ => return None,
    };
    Some(StateRef {
        address: address.to_string(),
        resource: static_address(address),
        resource_type: rtype.to_string(),
        kind,
        name: name.to_string(),
    })
}

/// The address without instance keys (`module.a["x"].t.n[0]` → `module.a.t.n`): a `removed`
/// block names a resource or module, never one instance. Quoted keys may hold `]`, `.` or `"`.
pub fn static_address(address: &str) -> String {
    let mut out = String::with_capacity(address.len());
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for c in address.chars() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            '"' if depth > 0 => in_string = true,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// Quotes `s` for a POSIX shell: single quotes, with any single quote inside closed, escaped and
/// reopened.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Whether each referenced object still exists in the cluster; "not found" is the only answer
/// taken as gone, every other failure stops the command (guessing would make Terraform forget a
/// live object).
pub async fn exists_in_cluster(
    client: &Client,
    refs: &[StateRef],
) -> Result<BTreeMap<(ObjectKind, String), bool>, TfPruneError> {
    let mut out = BTreeMap::new();
    for r in refs {
        let key = (r.kind, r.name.clone());
        if out.contains_key(&key) {
            continue;
        }
        let ar = match r.kind {
            ObjectKind::Node => kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Node>(&()),
            ObjectKind::NodePool => k8s::nodepool_resource(),
            ObjectKind::NodeClaim => k8s::nodeclaim_resource(),
            ObjectKind::Ec2NodeClass => k8s::nodeclass_resource(),
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
        let found =
            api.get_opt(&r.name).await.map_err(|e| KubeError::api(format!("GET {} {}", r.kind.as_str(), r.name), e))?;
        out.insert(key, found.is_some());
    }
    Ok(out)
}

/// The advice for the entries whose objects are gone: `terraform state rm` commands, and
/// `removed` blocks for the resources all of whose instances are gone. `all` is every entry
/// found, so a resource with some instances still live gets no `removed` block (it would make
/// Terraform forget the live ones too).
pub fn render(gone: &[StateRef], all: &[StateRef], checked_against: &str) -> String {
    let mut out = String::new();
    if gone.is_empty() {
        let _ = writeln!(
            out,
            "# tf-prune: {} state entr{} point at cluster objects; all of them still exist ({checked_against}). Nothing to prune.",
            all.len(),
            if all.len() == 1 { "y" } else { "ies" }
        );
        return out;
    }
    let _ = writeln!(
        out,
        "# tf-prune: {} of {} state entries point at cluster objects that are gone ({checked_against}).",
        gone.len(),
        all.len()
    );
    let _ = writeln!(out, "# Either make Terraform forget them now:");
    for r in gone {
        let _ = writeln!(out, "terraform state rm {}  # {} {}", shell_quote(&r.address), r.kind.as_str(), r.name);
    }
    let mut whole: Vec<&str> = Vec::new();
    let mut partial: Vec<&str> = Vec::new();
    for r in gone {
        let resource = r.resource.as_str();
        if whole.contains(&resource) || partial.contains(&resource) {
            continue;
        }
        let live_sibling = all.iter().any(|a| a.resource == resource && !gone.iter().any(|g| g.address == a.address));
        if live_sibling { partial.push(resource) } else { whole.push(resource) }
    }
    if !whole.is_empty() {
        let _ = writeln!(out, "\n# or (Terraform 1.7+) delete these resource blocks from the configuration and add:");
        for resource in &whole {
            let _ = writeln!(out, "removed {{\n  from = {resource}\n\n  lifecycle {{\n    destroy = false\n  }}\n}}");
        }
    }
    for resource in &partial {
        let _ = writeln!(
            out,
            "\n# {resource}: some of its instances still point at live objects, and a removed block \
             cannot name one instance; use the state rm commands above for the gone ones."
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_addresses_drop_instance_keys_even_with_odd_characters() {
        assert_eq!(static_address("kubernetes_node_taint.t"), "kubernetes_node_taint.t");
        assert_eq!(static_address("kubernetes_node_taint.t[0]"), "kubernetes_node_taint.t");
        assert_eq!(
            static_address(r#"module.a["x.y"].kubernetes_node_taint.t["a]b"]"#),
            "module.a.kubernetes_node_taint.t"
        );
        assert_eq!(static_address(r#"module.a["q\"]"].b.c["d"]"#), "module.a.b.c");
    }

    #[test]
    fn shell_quoting_survives_single_quotes() {
        assert_eq!(shell_quote(r#"a.b["x"]"#), r#"'a.b["x"]'"#);
        assert_eq!(shell_quote(r#"a.b["it's"]"#), r#"'a.b["it'\''s"]'"#);
    }

    #[test]
    fn other_kinds_and_groups_are_not_ours() {
        assert_eq!(ObjectKind::from_kind("v1", "Node"), Some(ObjectKind::Node));
        assert_eq!(ObjectKind::from_kind("karpenter.sh/v1beta1", "NodePool"), Some(ObjectKind::NodePool));
        assert_eq!(ObjectKind::from_kind("example.com/v1", "NodePool"), None);
        assert_eq!(ObjectKind::from_kind("v1", "Pod"), None);
    }
}
