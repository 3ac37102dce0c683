//! The registry of served kinds: the built-in ones and those registered by CustomResourceDefinitions.

use serde_json::Value;

use super::status::ApiError;

/// A printer column (`additionalPrinterColumns` of a CRD or a built-in table column).
#[derive(Debug, Clone, PartialEq)]
pub struct PrinterColumn {
    /// Column header.
    pub name: String,
    /// OpenAPI type (`string`, `integer`, `date`, ...).
    pub type_: String,
    /// JSONPath into the object, e.g. `.spec.template.spec.nodeClassRef.name`.
    pub json_path: String,
    /// 0 = always shown, >0 only with `-o wide`.
    pub priority: i64,
}

/// Where the replica counts of a scale subresource live.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalePaths {
    /// e.g. `.spec.replicas`.
    pub spec_replicas: String,
    /// e.g. `.status.replicas`.
    pub status_replicas: String,
    /// e.g. `.status.selector` (CRDs) - built-ins derive it from `.spec.selector`.
    pub label_selector: Option<String>,
}

/// One served resource: its names, scope, versions and subresources.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceInfo {
    /// API group, `""` for the core group.
    pub group: String,
    /// Served versions.
    pub versions: Vec<String>,
    /// The version objects are stored in.
    pub storage_version: String,
    /// Plural resource name (`pods`).
    pub resource: String,
    /// Singular name (`pod`).
    pub singular: String,
    /// Kind (`Pod`).
    pub kind: String,
    /// Kind of the list (`PodList`).
    pub list_kind: String,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// Short names for kubectl (`po`).
    pub short_names: Vec<String>,
    /// Categories (`all`).
    pub categories: Vec<String>,
    /// Has a `/status` subresource.
    pub status: bool,
    /// Has a `/scale` subresource.
    pub scale: Option<ScalePaths>,
    /// Built into the server (strategic merge patch allowed) rather than a custom resource.
    pub builtin: bool,
    /// Table columns after NAME (CRDs: additionalPrinterColumns).
    pub printer_columns: Vec<PrinterColumn>,
}

impl ResourceInfo {
    /// `group/version` or `version` for the core group.
    pub fn api_version(&self, version: &str) -> String {
        if self.group.is_empty() { version.to_string() } else { format!("{}/{version}", self.group) }
    }

    /// Field selectors the real server accepts for this resource.
    pub fn field_supported(&self, field: &str) -> bool {
        if field == "metadata.name" || (field == "metadata.namespace" && self.namespaced) {
            return true;
        }
        match (self.group.as_str(), self.resource.as_str()) {
            ("", "pods") => matches!(
                field,
                "spec.nodeName"
                    | "status.phase"
                    | "spec.restartPolicy"
                    | "spec.schedulerName"
                    | "spec.serviceAccountName"
                    | "status.podIP"
                    | "status.nominatedNodeName"
                    | "spec.hostNetwork"
            ),
            ("", "nodes") => field == "spec.unschedulable",
            ("", "namespaces") => field == "status.phase",
            ("apps", "replicasets") => field == "status.replicas",
            _ => false,
        }
    }
}

#[expect(
    clippy::too_many_arguments,
    reason = "a table of built-in kinds, one row per call: positional arguments keep each row on one line"
)]
fn builtin(
    group: &str,
    version: &str,
    resource: &str,
    kind: &str,
    namespaced: bool,
    short: &[&str],
    status: bool,
    scale: bool,
) -> ResourceInfo {
    ResourceInfo {
        group: group.into(),
        versions: vec![version.into()],
        storage_version: version.into(),
        resource: resource.into(),
        singular: kind.to_lowercase(),
        kind: kind.into(),
        list_kind: format!("{kind}List"),
        namespaced,
        short_names: short.iter().map(|s| s.to_string()).collect(),
        categories: Vec::new(),
        status,
        scale: scale.then(|| ScalePaths {
            spec_replicas: ".spec.replicas".into(),
            status_replicas: ".status.replicas".into(),
            label_selector: None,
        }),
        builtin: true,
        printer_columns: Vec::new(),
    }
}

/// All served resources.
#[derive(Debug, Clone)]
pub struct Registry {
    resources: Vec<ResourceInfo>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    /// The built-in kinds of the sandbox.
    pub fn new() -> Self {
        let all = |mut r: ResourceInfo| {
            r.categories = vec!["all".into()];
            r
        };
        let mut crd = builtin(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            false,
            &["crd", "crds"],
            true,
            false,
        );
        crd.categories = vec!["api-extensions".into()];
        Registry {
            resources: vec![
                builtin("", "v1", "namespaces", "Namespace", false, &["ns"], true, false),
                builtin("", "v1", "nodes", "Node", false, &["no"], true, false),
                all(builtin("", "v1", "pods", "Pod", true, &["po"], true, false)),
                all(builtin("", "v1", "services", "Service", true, &["svc"], true, false)),
                builtin("", "v1", "serviceaccounts", "ServiceAccount", true, &["sa"], false, false),
                builtin("", "v1", "configmaps", "ConfigMap", true, &["cm"], false, false),
                all(builtin("apps", "v1", "deployments", "Deployment", true, &["deploy"], true, true)),
                all(builtin("apps", "v1", "replicasets", "ReplicaSet", true, &["rs"], true, true)),
                all(builtin("apps", "v1", "daemonsets", "DaemonSet", true, &["ds"], true, false)),
                all(builtin("apps", "v1", "statefulsets", "StatefulSet", true, &["sts"], true, true)),
                builtin("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", true, &["pdb"], true, false),
                // stored and listed, never called: the sandbox runs no admission webhooks
                builtin(
                    "admissionregistration.k8s.io",
                    "v1",
                    "validatingwebhookconfigurations",
                    "ValidatingWebhookConfiguration",
                    false,
                    &[],
                    false,
                    false,
                ),
                builtin(
                    "admissionregistration.k8s.io",
                    "v1",
                    "mutatingwebhookconfigurations",
                    "MutatingWebhookConfiguration",
                    false,
                    &[],
                    false,
                    false,
                ),
                builtin("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", true, &[], false, false),
                builtin("coordination.k8s.io", "v1", "leases", "Lease", true, &[], false, false),
                crd,
            ],
        }
    }

    /// Every served resource.
    pub fn all(&self) -> &[ResourceInfo] {
        &self.resources
    }

    /// The resource `group`/`resource`, whatever the version.
    pub fn get(&self, group: &str, resource: &str) -> Option<&ResourceInfo> {
        self.resources.iter().find(|r| r.group == group && r.resource == resource)
    }

    /// The resource served at `group/version` under `resource`.
    pub fn served(&self, group: &str, version: &str, resource: &str) -> Option<&ResourceInfo> {
        self.get(group, resource).filter(|r| r.versions.iter().any(|v| v == version))
    }

    /// The resource of a kind in a group.
    pub fn by_kind(&self, group: &str, kind: &str) -> Option<&ResourceInfo> {
        self.resources.iter().find(|r| r.group == group && r.kind == kind)
    }

    /// Served group/versions, core group first, in registration order.
    pub fn group_versions(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for r in &self.resources {
            for v in &r.versions {
                let gv = (r.group.clone(), v.clone());
                if !out.contains(&gv) {
                    out.push(gv);
                }
            }
        }
        out
    }

    /// Registers (or re-registers) the kind a CustomResourceDefinition describes.
    pub fn register_crd(&mut self, crd: &Value) -> Result<ResourceInfo, ApiError> {
        let info = crd_info(crd)?;
        self.resources.retain(|r| !(r.group == info.group && r.resource == info.resource));
        self.resources.push(info.clone());
        Ok(info)
    }

    /// Removes a custom resource.
    pub fn unregister(&mut self, group: &str, resource: &str) {
        self.resources.retain(|r| r.builtin || !(r.group == group && r.resource == resource));
    }
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()).unwrap_or_default()
}

/// Validates a CRD the way the real server does for the fields we rely on, and derives its
/// resource description.
pub fn crd_info(crd: &Value) -> Result<ResourceInfo, ApiError> {
    let name = crd["metadata"]["name"].as_str().unwrap_or_default();
    let spec = &crd["spec"];
    let group = spec["group"].as_str().unwrap_or_default().to_string();
    let names = &spec["names"];
    let plural = names["plural"].as_str().unwrap_or_default().to_string();
    let kind = names["kind"].as_str().unwrap_or_default().to_string();
    let invalid = |field: &str, msg: &str| {
        ApiError::invalid("apiextensions.k8s.io", "CustomResourceDefinition", name, field, "FieldValueInvalid", msg)
    };
    if group.is_empty() || plural.is_empty() || kind.is_empty() {
        return Err(invalid("spec", "Required value: group, names.plural and names.kind are required"));
    }
    if name != format!("{plural}.{group}") {
        return Err(invalid(
            "metadata.name",
            &format!("Invalid value: \"{name}\": must be spec.names.plural+\".\"+spec.group"),
        ));
    }
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    let served: Vec<&Value> = versions.iter().filter(|v| v["served"] == true).collect();
    let storage: Vec<&Value> = versions.iter().filter(|v| v["storage"] == true).collect();
    if storage.len() != 1 {
        return Err(invalid("spec.versions", "Invalid value: must have exactly one version marked as storage version"));
    }
    let storage_version = storage[0]["name"].as_str().unwrap_or_default().to_string();
    // The subresources and columns of the storage version stand for every version: the
    // Karpenter CRDs have a single version, and keeping one set keeps lookups simple.
    let chosen = served.first().copied().unwrap_or(storage[0]);
    let sub = &chosen["subresources"];
    let scale = sub.get("scale").map(|s| ScalePaths {
        spec_replicas: s["specReplicasPath"].as_str().unwrap_or(".spec.replicas").into(),
        status_replicas: s["statusReplicasPath"].as_str().unwrap_or(".status.replicas").into(),
        label_selector: s["labelSelectorPath"].as_str().map(str::to_string),
    });
    let printer_columns = chosen["additionalPrinterColumns"]
        .as_array()
        .map(|cols| {
            cols.iter()
                .map(|c| PrinterColumn {
                    name: c["name"].as_str().unwrap_or_default().into(),
                    type_: c["type"].as_str().unwrap_or("string").into(),
                    json_path: c["jsonPath"].as_str().unwrap_or_default().into(),
                    priority: c["priority"].as_i64().unwrap_or(0),
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(ResourceInfo {
        group,
        versions: served.iter().filter_map(|v| v["name"].as_str().map(str::to_string)).collect(),
        storage_version,
        resource: plural,
        singular: names["singular"].as_str().map(str::to_string).unwrap_or_else(|| kind.to_lowercase()),
        list_kind: names["listKind"].as_str().map(str::to_string).unwrap_or_else(|| format!("{kind}List")),
        kind,
        namespaced: spec["scope"] == "Namespaced",
        short_names: strs(&names["shortNames"]),
        categories: strs(&names["categories"]),
        status: sub.get("status").is_some(),
        scale,
        builtin: false,
        printer_columns,
    })
}
