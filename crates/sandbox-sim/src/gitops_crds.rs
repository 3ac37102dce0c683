//! Argo CD's and Flux's own CustomResourceDefinitions for the GitOps owners the simulation plays
//! (Application, Kustomization, HelmRelease), read from their projects' releases in Go's module
//! cache at pinned versions and checksums, as [`crate::karpenter_crds::release_files`] does for
//! Karpenter. The tests install these, so the sandbox API server and the real kube-apiserver
//! hold every object the simulators and the tool write to their schemas (required fields, enums,
//! CEL rules). They are another project's files and are never copied into this repository.
//!
//! `sandbox demo` and `rehearse` run where there may be no Go: they install the hand-written
//! [`crate::gitops::crds`], which [`mismatches`] holds to these (names, versions, the status
//! subresource, the type of every field they declare and of every field the tool reads).

use serde_json::Value;

use crate::gitops::OwnerKind;
use crate::karpenter_crds::go_module_dir;

/// Where one owner kind's CRD comes from: a Go module at a pinned version, its `go.sum` hash,
/// and the file's path in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrdSource {
    /// The kind.
    pub kind: OwnerKind,
    /// The module.
    pub module: &'static str,
    /// Its version.
    pub version: &'static str,
    /// Its `go.sum` hash (`h1:`), checked on top of Go's own check against the checksum
    /// database, whatever `GONOSUMDB`/`GOFLAGS` the machine sets.
    pub sum: &'static str,
    /// The CRD file in the module.
    pub path: &'static str,
}

/// The releases the tests use: the newest of each project the Go module proxy serves that the
/// Go toolchain of the test machines (1.26) can download (newer ones ask for Go 1.27).
/// Argo CD's Application CRD is in its main module; Flux's in each controller's module
/// (`config/crd/bases`, what `flux install` applies for that controller).
pub const SOURCES: [CrdSource; 3] = [
    CrdSource {
        kind: OwnerKind::Application,
        module: "github.com/argoproj/argo-cd/v3",
        version: "v3.5.7",
        sum: "h1:Xm1BF+I5OgDKUG3SDK49vn2/Y5AMyaNVko+/JT08gj0=",
        path: "manifests/crds/application-crd.yaml",
    },
    CrdSource {
        kind: OwnerKind::Kustomization,
        module: "github.com/fluxcd/kustomize-controller",
        version: "v1.9.6",
        sum: "h1:XB+G3A0mky0j5uVHZWv4oSlS2RvZBoNIUhstIvY0JKE=",
        path: "config/crd/bases/kustomize.toolkit.fluxcd.io_kustomizations.yaml",
    },
    CrdSource {
        kind: OwnerKind::HelmRelease,
        module: "github.com/fluxcd/helm-controller",
        version: "v1.4.3",
        sum: "h1:449LcGJXLCylvrNCq8ycevwa5mxE1Mn9vxTwlsj/no8=",
        path: "config/crd/bases/helm.toolkit.fluxcd.io_helmreleases.yaml",
    },
];

/// A GitOps CRD that could not be had.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot get the {kind} CRD ({module}@{version}, {path}) from Go's module cache: {reason}; the test bed needs Go (1.21 or later) and its module proxy: install Go, or set GOPROXY/GOMODCACHE to a proxy or a cache that has the module"
)]
pub struct GitopsCrdsError {
    /// The owner kind.
    pub kind: &'static str,
    /// The module.
    pub module: &'static str,
    /// Its version.
    pub version: &'static str,
    /// The file.
    pub path: &'static str,
    /// What went wrong.
    pub reason: String,
}

/// The real Application, Kustomization and HelmRelease CRDs, in that order, as `kubectl apply -f`
/// would send them: `go mod download` fetches each module once (a warm cache answers at once).
pub fn release_crds() -> Result<Vec<Value>, GitopsCrdsError> {
    SOURCES
        .iter()
        .map(|s| {
            let bad = |reason: String| GitopsCrdsError {
                kind: s.kind.kind(),
                module: s.module,
                version: s.version,
                path: s.path,
                reason,
            };
            let dir = go_module_dir(s.module, s.version, s.sum).map_err(bad)?;
            let text = std::fs::read_to_string(dir.join(s.path)).map_err(|e| bad(e.to_string()))?;
            let crd: Value = serde_saphyr::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let name = format!("{}.{}", s.kind.plural(), s.kind.group());
            if crd["kind"] != "CustomResourceDefinition" || crd["metadata"]["name"] != name.as_str() {
                return Err(bad(format!("the file is not the CustomResourceDefinition {name}")));
            }
            Ok(crd)
        })
        .collect()
}

/// The fields the tool and the simulators read or write on each kind, with their OpenAPI type:
/// were the real CRD to name one differently or give it another shape, the tool would read
/// nothing there. `[]` steps into an array's items.
pub fn fields_used(kind: OwnerKind) -> &'static [(&'static str, &'static str)] {
    match kind {
        OwnerKind::Application => &[
            ("spec.project", "string"),
            ("spec.destination.server", "string"),
            ("spec.destination.name", "string"),
            ("spec.destination.namespace", "string"),
            ("spec.syncPolicy.automated", "object"),
            ("spec.syncPolicy.automated.enabled", "boolean"),
            ("spec.syncPolicy.automated.selfHeal", "boolean"),
            ("spec.syncPolicy.automated.prune", "boolean"),
            ("operation", "object"),
            ("operation.sync.revision", "string"),
            ("operation.initiatedBy.username", "string"),
            ("status.resources[].group", "string"),
            ("status.resources[].kind", "string"),
            ("status.resources[].namespace", "string"),
            ("status.resources[].name", "string"),
            ("status.operationState.phase", "string"),
            ("status.operationState.startedAt", "string"),
            ("status.operationState.finishedAt", "string"),
            ("status.operationState.retryCount", "integer"),
            ("status.operationState.message", "string"),
        ],
        OwnerKind::Kustomization => &[
            ("spec.interval", "string"),
            ("spec.suspend", "boolean"),
            ("spec.prune", "boolean"),
            ("spec.path", "string"),
            ("spec.sourceRef.kind", "string"),
            ("spec.sourceRef.name", "string"),
            ("spec.kubeConfig.secretRef.name", "string"),
            ("spec.kubeConfig.configMapRef.name", "string"),
            ("status.inventory.entries[].id", "string"),
            ("status.inventory.entries[].v", "string"),
            ("status.lastHandledReconcileAt", "string"),
            ("status.conditions[].type", "string"),
            ("status.conditions[].status", "string"),
            ("status.conditions[].reason", "string"),
            ("status.conditions[].message", "string"),
        ],
        OwnerKind::HelmRelease => &[
            ("spec.interval", "string"),
            ("spec.suspend", "boolean"),
            ("spec.releaseName", "string"),
            ("spec.chart.spec.chart", "string"),
            ("spec.chart.spec.version", "string"),
            ("spec.chart.spec.sourceRef.kind", "string"),
            ("spec.chart.spec.sourceRef.name", "string"),
            ("spec.driftDetection.mode", "string"),
            ("spec.kubeConfig.secretRef.name", "string"),
            ("status.lastHandledReconcileAt", "string"),
            ("status.conditions[].type", "string"),
            ("status.conditions[].status", "string"),
            ("status.conditions[].reason", "string"),
            ("status.conditions[].message", "string"),
        ],
    }
}

/// The schema of version `version` of `crd`.
fn version_schema<'a>(crd: &'a Value, version: &str) -> Option<&'a Value> {
    crd["spec"]["versions"].as_array()?.iter().find(|v| v["name"] == version).map(|v| &v["schema"]["openAPIV3Schema"])
}

/// The schema at a dotted `path` (`[]` after a step goes into the array's items).
fn schema_at<'a>(schema: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(schema, |s, step| {
        let (name, items) = match step.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (step, false),
        };
        let field = s["properties"].get(name)?;
        if items { field.get("items") } else { Some(field) }
    })
}

/// Every field path `schema` declares, with its type (`[]` into array items).
fn declared(schema: &Value, prefix: &str, out: &mut Vec<(String, String)>) {
    let Some(props) = schema["properties"].as_object() else { return };
    for (name, s) in props {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        out.push((path.clone(), s["type"].as_str().unwrap_or_default().to_string()));
        declared(s, &path, out);
        if s["type"] == "array" {
            declared(&s["items"], &format!("{path}[]"), out);
        }
    }
}

/// How `ours` (a hand-written CRD) differs from `real` where it matters: its name, group, kind,
/// plural and scope; the version it serves must be served by the real CRD and be its storage
/// version; the status subresource present in both or neither; every field it declares, and
/// every field of [`fields_used`], of the same type in the real schema. Empty when they agree.
pub fn mismatches(kind: OwnerKind, ours: &Value, real: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for pointer in ["/metadata/name", "/spec/group", "/spec/scope", "/spec/names/kind", "/spec/names/plural"] {
        if ours.pointer(pointer) != real.pointer(pointer) {
            out.push(format!("{pointer}: ours {:?}, real {:?}", ours.pointer(pointer), real.pointer(pointer)));
        }
    }
    let Some(version) = ours["spec"]["versions"][0]["name"].as_str() else {
        out.push("ours names no version".into());
        return out;
    };
    let real_versions = real["spec"]["versions"].as_array().cloned().unwrap_or_default();
    let Some(real_version) = real_versions.iter().find(|v| v["name"] == version) else {
        out.push(format!("the real CRD has no version {version}"));
        return out;
    };
    if real_version["served"] != true || real_version["storage"] != true {
        out.push(format!("the real CRD's {version} is not its served storage version"));
    }
    let ours_status = ours["spec"]["versions"][0]["subresources"].get("status").is_some();
    let real_status = real_version["subresources"].get("status").is_some();
    if ours_status != real_status {
        out.push(format!("status subresource: ours {ours_status}, real {real_status}"));
    }
    let (Some(ours_schema), Some(real_schema)) = (version_schema(ours, version), version_schema(real, version)) else {
        out.push(format!("no schema at {version}"));
        return out;
    };
    let mut fields = Vec::new();
    declared(ours_schema, "", &mut fields);
    fields.extend(fields_used(kind).iter().map(|(p, t)| (p.to_string(), t.to_string())));
    for (path, ty) in fields {
        match schema_at(real_schema, &path) {
            None => out.push(format!("{path}: not in the real schema")),
            // `metadata` has no type in some real schemas; an untyped field of ours says nothing
            Some(r) if !ty.is_empty() && !r["type"].is_null() && r["type"] != ty.as_str() => {
                out.push(format!("{path}: ours {ty}, real {}", r["type"]));
            }
            Some(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn real_like() -> Value {
        json!({"metadata": {"name": "kustomizations.kustomize.toolkit.fluxcd.io"},
            "spec": {"group": "kustomize.toolkit.fluxcd.io", "scope": "Namespaced",
                "names": {"kind": "Kustomization", "plural": "kustomizations"},
                "versions": [{"name": "v1", "served": true, "storage": true, "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "spec": {"type": "object", "properties": {"suspend": {"type": "boolean"},
                            "interval": {"type": "string"}}},
                        "status": {"type": "object", "properties": {"inventory": {"type": "object", "properties": {
                            "entries": {"type": "array", "items": {"type": "object", "properties": {
                                "id": {"type": "string"}}}}}}}}}}}}]}})
    }

    #[test]
    fn a_field_of_another_type_another_storage_version_or_a_missing_subresource_is_named() {
        let real = real_like();
        let mut ours = real.clone();
        ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["suspend"] =
            json!({"type": "string"});
        ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["madeUp"] =
            json!({"type": "string"});
        ours["spec"]["versions"][0].as_object_mut().unwrap().remove("subresources");
        let found = mismatches(OwnerKind::Kustomization, &ours, &real);
        assert!(found.iter().any(|m| m.starts_with("spec.suspend: ours string")), "{found:?}");
        assert!(found.iter().any(|m| m == "spec.madeUp: not in the real schema"), "{found:?}");
        assert!(found.iter().any(|m| m.starts_with("status subresource")), "{found:?}");
        // a field the tool reads that the real schema lacks
        assert!(found.iter().any(|m| m == "spec.kubeConfig.secretRef.name: not in the real schema"), "{found:?}");

        let mut old = real.clone();
        old["spec"]["versions"][0]["storage"] = json!(false);
        assert!(mismatches(OwnerKind::Kustomization, &real, &old).iter().any(|m| m.contains("storage")));
        assert_eq!(
            schema_at(&real["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "status.inventory.entries[].id")
                .map(|s| s["type"].clone()),
            Some(json!("string"))
        );
    }

    /// The hand-written CRDs `sandbox demo` and `rehearse` install agree with the releases'.
    #[test]
    fn the_hand_written_gitops_crds_agree_with_argo_cd_and_flux_releases() {
        let real = release_crds().unwrap_or_else(|e| panic!("{e}"));
        let ours = crate::gitops::crds();
        for (s, (ours, real)) in SOURCES.iter().zip(ours.iter().zip(&real)) {
            let found = mismatches(s.kind, ours, real);
            assert!(found.is_empty(), "{} ({}@{}): {found:#?}", s.kind.kind(), s.module, s.version);
        }
    }
}
