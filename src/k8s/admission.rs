//! The API server's admission chain as the tool meets it: who refused a write (a webhook the
//! server could not call, a webhook or a `ValidatingAdmissionPolicy` that said no), read from the
//! server's own wording, and the webhook configurations as they stand (design §2.1).
//!
//! The wording is kube-apiserver's: `failed calling webhook "NAME"` (an unreachable webhook with
//! `failurePolicy: Fail`, HTTP 500), `admission webhook "NAME" denied the request`,
//! `ValidatingAdmissionPolicy 'NAME' [with binding 'BINDING'] denied request`, and
//! `admission webhook "NAME" does not support dry run` (a webhook with side effects, HTTP 400).

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use serde_json::Value;

use super::{KubeError, list_pages, status_code};

/// Who in the admission chain refused a request, as the server's message names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admitter {
    /// A webhook the server could not call (no service, no endpoints, a timeout, TLS), with
    /// `failurePolicy: Fail`: every write it matches fails until its backend answers again.
    Unreachable { webhook: String, detail: String },
    /// A webhook that answered no.
    DeniedByWebhook { webhook: String, detail: String },
    /// A `ValidatingAdmissionPolicy` whose rule failed.
    DeniedByPolicy { policy: String, binding: Option<String>, detail: String },
    /// A webhook that declares side effects: the server refuses dry runs it matches, so nothing
    /// is learnt of it before the real write.
    NoDryRun { webhook: String },
}

impl Admitter {
    /// The webhook's name, for the kinds that name one.
    pub(crate) fn webhook(&self) -> Option<&str> {
        match self {
            Admitter::Unreachable { webhook, .. }
            | Admitter::DeniedByWebhook { webhook, .. }
            | Admitter::NoDryRun { webhook } => Some(webhook),
            Admitter::DeniedByPolicy { .. } => None,
        }
    }
}

impl std::fmt::Display for Admitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Admitter::Unreachable { webhook, detail } => {
                write!(f, "admission webhook \"{webhook}\" cannot be called ({detail})")
            }
            Admitter::DeniedByWebhook { webhook, detail } => {
                write!(f, "admission webhook \"{webhook}\" denied it ({detail})")
            }
            Admitter::DeniedByPolicy { policy, binding: Some(b), detail } => {
                write!(f, "ValidatingAdmissionPolicy '{policy}' (binding '{b}') denied it ({detail})")
            }
            Admitter::DeniedByPolicy { policy, binding: None, detail } => {
                write!(f, "ValidatingAdmissionPolicy '{policy}' denied it ({detail})")
            }
            Admitter::NoDryRun { webhook } => {
                write!(f, "admission webhook \"{webhook}\" does not support dry runs (it declares side effects)")
            }
        }
    }
}

/// The admission refusal an API error is, if it is one.
pub(crate) fn admitter(e: &kube::Error) -> Option<Admitter> {
    match e {
        kube::Error::Api(s) => parse(&s.message),
        _ => None,
    }
}

/// Reads kube-apiserver's wording (see the module's documentation).
pub(crate) fn parse(message: &str) -> Option<Admitter> {
    if let Some((webhook, rest)) = quoted_after(message, "failed calling webhook \"", '"') {
        return Some(Admitter::Unreachable { webhook, detail: tail(rest) });
    }
    if let Some((webhook, rest)) = quoted_after(message, "admission webhook \"", '"') {
        if rest.starts_with(" does not support dry run") {
            return Some(Admitter::NoDryRun { webhook });
        }
        if rest.starts_with(" denied the request") {
            return Some(Admitter::DeniedByWebhook { webhook, detail: tail(rest) });
        }
    }
    if let Some((policy, rest)) = quoted_after(message, "ValidatingAdmissionPolicy '", '\'') {
        let (binding, rest) = match quoted_after(rest, " with binding '", '\'') {
            Some((b, r)) if rest.starts_with(" with binding '") => (Some(b), r),
            _ => (None, rest),
        };
        if rest.starts_with(" denied request") {
            return Some(Admitter::DeniedByPolicy { policy, binding, detail: tail(rest) });
        }
    }
    None
}

/// The text between `prefix` and the next `close`, and what follows it.
fn quoted_after<'a>(message: &'a str, prefix: &str, close: char) -> Option<(String, &'a str)> {
    let start = message.find(prefix)? + prefix.len();
    let len = message[start..].find(close)?;
    Some((message[start..start + len].to_string(), &message[start + len + 1..]))
}

/// What the server says after the name: past the first `": "`, trimmed.
fn tail(rest: &str) -> String {
    let detail = rest.split_once(": ").map_or("", |(_, d)| d).trim();
    if detail.is_empty() { "no explanation given".into() } else { detail.to_string() }
}

/// One rule of a webhook, as it matches requests.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Rule {
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT` or `*`.
    pub(crate) operations: Vec<String>,
    pub(crate) groups: Vec<String>,
    /// `nodes`, `pods/eviction`, `*`, `*/*`, `nodes/*`.
    pub(crate) resources: Vec<String>,
}

impl Rule {
    /// Whether a request of `operation` on `group`'s `resource` (and `subresource`) matches,
    /// as kube-apiserver's rule matcher decides (selectors aside).
    pub(crate) fn matches(&self, operation: &str, group: &str, resource: &str, subresource: &str) -> bool {
        let any = |list: &[String], v: &str| list.iter().any(|x| x == "*" || x == v);
        let resource_ok = self.resources.iter().any(|r| {
            if subresource.is_empty() {
                r == "*" || r == resource
            } else {
                r == "*/*"
                    || *r == format!("{resource}/{subresource}")
                    || *r == format!("*/{subresource}")
                    || *r == format!("{resource}/*")
            }
        });
        any(&self.operations, operation) && any(&self.groups, group) && resource_ok
    }
}

/// One webhook of a Validating or MutatingWebhookConfiguration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Webhook {
    /// `ValidatingWebhookConfiguration` or `MutatingWebhookConfiguration`.
    pub(crate) config_kind: &'static str,
    /// The configuration's name (what `kubectl delete` takes).
    pub(crate) config: String,
    /// The webhook's own name (what the server's errors name).
    pub(crate) name: String,
    /// `failurePolicy: Fail` (the default): a webhook that cannot be called refuses.
    pub(crate) fails_closed: bool,
    /// `namespace/name:port` of its service, when it is called through one.
    pub(crate) service: Option<(String, String, i32)>,
    /// Its URL, when it is called by one.
    pub(crate) url: Option<String>,
    pub(crate) rules: Vec<Rule>,
    /// Whether an object or namespace selector narrows what it matches.
    pub(crate) selective: bool,
}

impl Webhook {
    /// How it is configured, in a few words.
    pub(crate) fn describe(&self) -> String {
        let target = match (&self.service, &self.url) {
            (Some((ns, name, port)), _) => format!("service {ns}/{name} port {port}"),
            (None, Some(u)) => format!("URL {u}"),
            (None, None) => "no backend".into(),
        };
        let policy = if self.fails_closed { "Fail" } else { "Ignore" };
        let narrowed = if self.selective { ", narrowed by a selector" } else { "" };
        format!("{} {} calls {target}, failurePolicy {policy}{narrowed}", self.config_kind, self.config)
    }
}

/// Every webhook of both configuration kinds. A server that serves neither (none does not)
/// answers with an empty list.
pub(crate) async fn webhooks(client: &kube::Client) -> Result<Vec<Webhook>, KubeError> {
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let lp = ListParams::default();
    let mut out = Vec::new();
    for c in list_pages(&validating, &lp, as_json::<ValidatingWebhookConfiguration>)
        .await
        .or_else(not_served)
        .map_err(|e| KubeError::api("list validatingwebhookconfigurations", e))?
    {
        out.extend(from_config("ValidatingWebhookConfiguration", &c));
    }
    for c in list_pages(&mutating, &lp, as_json::<MutatingWebhookConfiguration>)
        .await
        .or_else(not_served)
        .map_err(|e| KubeError::api("list mutatingwebhookconfigurations", e))?
    {
        out.extend(from_config("MutatingWebhookConfiguration", &c));
    }
    Ok(out)
}

fn as_json<T: serde::Serialize>(c: T) -> Option<Value> {
    serde_json::to_value(c).ok()
}

/// The webhooks of one configuration (both kinds spell these fields alike).
fn from_config(config_kind: &'static str, config: &Value) -> Vec<Webhook> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_string).collect()
    };
    let narrowing = |v: &Value| v.as_object().is_some_and(|o| !o.is_empty());
    let name = config["metadata"]["name"].as_str().unwrap_or_default();
    let hooks = config["webhooks"].as_array().into_iter().flatten();
    hooks
        .map(|w| {
            let svc = &w["clientConfig"]["service"];
            Webhook {
                config_kind,
                config: name.to_string(),
                name: w["name"].as_str().unwrap_or_default().to_string(),
                fails_closed: w["failurePolicy"].as_str() != Some("Ignore"),
                service: svc.is_object().then(|| {
                    (
                        svc["namespace"].as_str().unwrap_or_default().to_string(),
                        svc["name"].as_str().unwrap_or_default().to_string(),
                        svc["port"].as_i64().and_then(|p| i32::try_from(p).ok()).unwrap_or(443),
                    )
                }),
                url: w["clientConfig"]["url"].as_str().map(str::to_string),
                rules: w["rules"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| Rule {
                        operations: strings(&r["operations"]),
                        groups: strings(&r["apiGroups"]),
                        resources: strings(&r["resources"]),
                    })
                    .collect(),
                selective: narrowing(&w["objectSelector"]) || narrowing(&w["namespaceSelector"]),
            }
        })
        .collect()
}

/// A kind the server does not serve reads as none.
fn not_served<T>(e: kube::Error) -> Result<Vec<T>, kube::Error> {
    if status_code(&e) == Some(404) { Ok(Vec::new()) } else { Err(e) }
}

/// The nodes the ready endpoints of a service run on (from its EndpointSlices); an endpoint
/// without a node name is counted as `None`, which no drain takes away.
pub(crate) async fn service_nodes(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<Option<String>>, KubeError> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), namespace);
    let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={name}"));
    let slices = match list_pages(&api, &lp, Some).await {
        Ok(s) => s,
        Err(e) if status_code(&e) == Some(404) => Vec::new(),
        Err(e) => return Err(KubeError::api(format!("list the endpoints of service {namespace}/{name}"), e)),
    };
    Ok(slices
        .into_iter()
        .flat_map(|s| s.endpoints)
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .map(|e| e.node_name)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_wording_names_who_refused() {
        let unreachable = "Internal error occurred: failed calling webhook \"validation.webhook.karpenter.sh\": failed to call webhook: Post \"https://karpenter.karpenter.svc:8443/?timeout=10s\": service \"karpenter\" not found";
        assert_eq!(
            parse(unreachable),
            Some(Admitter::Unreachable {
                webhook: "validation.webhook.karpenter.sh".into(),
                detail: "failed to call webhook: Post \"https://karpenter.karpenter.svc:8443/?timeout=10s\": service \"karpenter\" not found".into(),
            })
        );
        let denied = "admission webhook \"deny.example.com\" denied the request: no cordons in production";
        assert_eq!(
            parse(denied),
            Some(Admitter::DeniedByWebhook {
                webhook: "deny.example.com".into(),
                detail: "no cordons in production".into()
            })
        );
        let policy = "nodes \"n1\" is forbidden: ValidatingAdmissionPolicy 'no-node-patches' with binding 'no-node-patches' denied request: nodes are not patched here";
        assert_eq!(
            parse(policy),
            Some(Admitter::DeniedByPolicy {
                policy: "no-node-patches".into(),
                binding: Some("no-node-patches".into()),
                detail: "nodes are not patched here".into(),
            })
        );
        let unbound = "ValidatingAdmissionPolicy 'p' denied request: x";
        assert!(matches!(parse(unbound), Some(Admitter::DeniedByPolicy { binding: None, .. })));
        let no_dry = "admission webhook \"sidecar.example.com\" does not support dry run";
        assert_eq!(parse(no_dry), Some(Admitter::NoDryRun { webhook: "sidecar.example.com".into() }));
        assert_eq!(parse("etcdserver: request timed out"), None);
        assert_eq!(parse("conversion webhook for karpenter.sh/v1beta1 failed"), None);
    }

    fn rule(ops: &[&str], groups: &[&str], resources: &[&str]) -> Rule {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        Rule { operations: v(ops), groups: v(groups), resources: v(resources) }
    }

    #[test]
    fn rules_match_as_the_server_matches_them() {
        let karpenter = rule(&["CREATE", "UPDATE"], &["karpenter.sh"], &["nodepools", "nodeclaims"]);
        assert!(karpenter.matches("UPDATE", "karpenter.sh", "nodepools", ""));
        assert!(!karpenter.matches("DELETE", "karpenter.sh", "nodepools", ""));
        assert!(!karpenter.matches("UPDATE", "", "nodes", ""));
        assert!(!karpenter.matches("UPDATE", "karpenter.sh", "nodepools", "status"), "a subresource is named apart");
        let everything = rule(&["*"], &["*"], &["*"]);
        assert!(everything.matches("DELETE", "", "nodes", "") && !everything.matches("CREATE", "", "pods", "eviction"));
        assert!(rule(&["*"], &["*"], &["*/*"]).matches("CREATE", "", "pods", "eviction"));
        assert!(rule(&["CREATE"], &[""], &["pods/eviction"]).matches("CREATE", "", "pods", "eviction"));
        assert!(rule(&["CREATE"], &[""], &["pods/*"]).matches("CREATE", "", "pods", "eviction"));
    }
}
