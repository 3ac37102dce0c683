//! RBAC for the identity of the sandbox's kubeconfig: the rules of ClusterRoles (the project's
//! `deploy/rbac.yaml` in the tests) decide every request that carries the kubeconfig's token, with
//! kube-apiserver's RBAC semantics and its 403 wording; requests without it (the test harness, the
//! simulated controllers) are cluster-admin. Also `SelfSubjectAccessReview`, answered from the
//! same rules, so a client can ask before it acts.

use serde_json::{Value, json};

use super::status::ApiError;

/// The bearer token of the kubeconfig [`super::ApiServer::write_kubeconfig`] writes.
pub const KUBECONFIG_TOKEN: &str = "sandbox";
/// The user name of that token in 403 messages and reviews.
pub const KUBECONFIG_USER: &str = "karpenter-teardown";

/// One policy rule of a ClusterRole.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Rule {
    api_groups: Vec<String>,
    resources: Vec<String>,
    resource_names: Vec<String>,
    verbs: Vec<String>,
    non_resource_urls: Vec<String>,
}

/// What one request asks to do, in RBAC's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`.
    pub verb: String,
    /// API group (`""` for core).
    pub group: String,
    /// Resource (`pods`).
    pub resource: String,
    /// Subresource (`eviction`, `scale`, `status`), or empty.
    pub subresource: String,
    /// Object name, or empty.
    pub name: String,
    /// Namespace, or empty for cluster scope / all namespaces.
    pub namespace: String,
}

/// The rules of one or more ClusterRoles.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rbac {
    rules: Vec<Rule>,
}

/// A ClusterRole document that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the RBAC rules: {0}; pass ClusterRole YAML such as deploy/rbac.yaml")]
pub struct RbacError(String);

impl Rbac {
    /// The rules of every ClusterRole in a YAML stream (other kinds are skipped).
    pub fn from_yaml(text: &str) -> Result<Rbac, RbacError> {
        let mut rules = Vec::new();
        let docs: Vec<Value> = serde_saphyr::from_multiple(text).map_err(|e| RbacError(e.to_string()))?;
        for v in docs {
            if v["kind"] != "ClusterRole" {
                continue;
            }
            for r in v["rules"].as_array().into_iter().flatten() {
                let list = |k: &str| -> Vec<String> {
                    r[k].as_array().into_iter().flatten().filter_map(|x| x.as_str().map(str::to_string)).collect()
                };
                rules.push(Rule {
                    api_groups: list("apiGroups"),
                    resources: list("resources"),
                    resource_names: list("resourceNames"),
                    verbs: list("verbs"),
                    non_resource_urls: list("nonResourceURLs"),
                });
            }
        }
        if rules.is_empty() {
            return Err(RbacError("no ClusterRole rules found".into()));
        }
        Ok(Rbac { rules })
    }

    /// Whether the rules allow a resource request (kube-apiserver's `RuleAllows`: verb, group,
    /// `resource/subresource` or `*`, and the name when the rule lists names; a rule with names
    /// never allows `list`, `watch`, `create` or `deletecollection` of unnamed objects).
    pub fn allows(&self, a: &Attributes) -> bool {
        let combined =
            if a.subresource.is_empty() { a.resource.clone() } else { format!("{}/{}", a.resource, a.subresource) };
        self.rules.iter().any(|r| {
            let has = |list: &[String], v: &str| list.iter().any(|x| x == "*" || x == v);
            has(&r.verbs, &a.verb)
                && has(&r.api_groups, &a.group)
                && (r.resources.iter().any(|x| x == "*" || *x == combined)
                    || (a.subresource.is_empty() && r.resources.iter().any(|x| *x == format!("{}/*", a.resource)))
                    || (!a.subresource.is_empty() && r.resources.iter().any(|x| *x == format!("*/{}", a.subresource))))
                && (r.resource_names.is_empty() || (!a.name.is_empty() && r.resource_names.contains(&a.name)))
        })
    }

    /// Whether the rules allow a non-resource request (`GET /version`).
    pub fn allows_path(&self, verb: &str, path: &str) -> bool {
        self.rules.iter().any(|r| {
            r.verbs.iter().any(|v| v == "*" || v == verb)
                && r.non_resource_urls.iter().any(|u| {
                    u == "*" || u == path || u.strip_suffix('*').is_some_and(|prefix| path.starts_with(prefix))
                })
        })
    }
}

/// kube-apiserver's 403 for a denied request, worded as its RBAC authorizer words it.
pub fn forbidden(a: &Attributes) -> ApiError {
    let what = if a.subresource.is_empty() { a.resource.clone() } else { format!("{}/{}", a.resource, a.subresource) };
    let scope = if a.namespace.is_empty() {
        "at the cluster scope".to_string()
    } else {
        format!("in the namespace \"{}\"", a.namespace)
    };
    let why = format!(
        "User \"{KUBECONFIG_USER}\" cannot {} resource \"{what}\" in API group \"{}\" {scope}",
        a.verb, a.group
    );
    ApiError::forbidden(&a.group, &what, &a.name, &why)
}

/// Answers a `SelfSubjectAccessReview` (authorization.k8s.io/v1) for a requester with `rbac`
/// (`None`: cluster-admin).
pub fn review(rbac: Option<&Rbac>, body: &Value) -> Result<Value, ApiError> {
    let spec = &body["spec"];
    let allowed = if let Some(ra) = spec["resourceAttributes"].as_object() {
        let s = |k: &str| ra.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        let a = Attributes {
            verb: s("verb"),
            group: s("group"),
            resource: s("resource"),
            subresource: s("subresource"),
            name: s("name"),
            namespace: s("namespace"),
        };
        if a.verb.is_empty() || a.resource.is_empty() {
            return Err(ApiError::unprocessable("spec.resourceAttributes needs verb and resource"));
        }
        rbac.is_none_or(|r| r.allows(&a))
    } else if let Some(nra) = spec["nonResourceAttributes"].as_object() {
        let s = |k: &str| nra.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        rbac.is_none_or(|r| r.allows_path(&s("verb"), &s("path")))
    } else {
        return Err(ApiError::unprocessable(
            "exactly one of spec.resourceAttributes or spec.nonResourceAttributes must be set",
        ));
    };
    let reason = match (rbac, allowed) {
        (None, _) => "cluster-admin",
        (Some(_), true) => "RBAC: allowed by ClusterRoleBinding \"karpenter-teardown\"",
        (Some(_), false) => "",
    };
    let mut out = body.clone();
    out["apiVersion"] = json!("authorization.k8s.io/v1");
    out["kind"] = json!("SelfSubjectAccessReview");
    out["status"] = json!({"allowed": allowed, "reason": reason});
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROLE: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: t}
rules:
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["get", "patch"]
  - apiGroups: [""]
    resources: ["pods/eviction"]
    verbs: ["create"]
  - apiGroups: ["apiextensions.k8s.io"]
    resources: ["customresourcedefinitions"]
    resourceNames: ["nodepools.karpenter.sh"]
    verbs: ["get", "patch"]
  - nonResourceURLs: ["/version", "/apis/*"]
    verbs: ["get"]
---
kind: ClusterRoleBinding
"#;

    fn attrs(verb: &str, group: &str, resource: &str, sub: &str, name: &str) -> Attributes {
        Attributes {
            verb: verb.into(),
            group: group.into(),
            resource: resource.into(),
            subresource: sub.into(),
            name: name.into(),
            namespace: String::new(),
        }
    }

    #[test]
    fn rules_allow_what_they_name_and_nothing_else() {
        let r = Rbac::from_yaml(ROLE).unwrap();
        assert!(r.allows(&attrs("patch", "", "nodes", "", "n1")));
        assert!(!r.allows(&attrs("delete", "", "nodes", "", "n1")));
        assert!(r.allows(&attrs("create", "", "pods", "eviction", "p")));
        assert!(!r.allows(&attrs("create", "", "pods", "", "p")), "the subresource does not grant the resource");
        assert!(!r.allows(&attrs("delete", "", "pods", "", "p")));
        assert!(r.allows(&attrs(
            "patch",
            "apiextensions.k8s.io",
            "customresourcedefinitions",
            "",
            "nodepools.karpenter.sh"
        )));
        assert!(!r.allows(&attrs("patch", "apiextensions.k8s.io", "customresourcedefinitions", "", "other")));
        assert!(!r.allows(&attrs("patch", "apiextensions.k8s.io", "customresourcedefinitions", "", "")));
        assert!(r.allows_path("get", "/version") && r.allows_path("get", "/apis/karpenter.sh"));
        assert!(!r.allows_path("get", "/metrics"));
    }

    #[test]
    fn reviews_answer_from_the_same_rules_and_403s_read_like_kube_apiserver() {
        let r = Rbac::from_yaml(ROLE).unwrap();
        let ask = |verb: &str, res: &str| json!({"spec": {"resourceAttributes": {"verb": verb, "group": "", "resource": res}}});
        assert_eq!(review(Some(&r), &ask("patch", "nodes")).unwrap()["status"]["allowed"], true);
        assert_eq!(review(Some(&r), &ask("delete", "nodes")).unwrap()["status"]["allowed"], false);
        assert_eq!(review(None, &ask("delete", "nodes")).unwrap()["status"]["allowed"], true);
        assert!(review(Some(&r), &json!({"spec": {}})).is_err());
        let e = forbidden(&attrs("delete", "", "nodes", "", "n1"));
        assert_eq!(e.code, 403);
        assert!(e.to_status()["message"].as_str().unwrap().contains("cannot delete resource \"nodes\""));
        assert!(Rbac::from_yaml("kind: ClusterRoleBinding").is_err());
    }
}
