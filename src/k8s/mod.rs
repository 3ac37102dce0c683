//! The Kubernetes side: a client built from the standard kubeconfig rules (with kube's silent
//! retries off, design §5), request accounting, and the conflict-safe writes the teardown makes.

pub(crate) mod admission;
pub(crate) mod apf;
pub(crate) mod calls;
pub(crate) mod cleanup;
pub(crate) mod gitops;
pub mod nodes;
pub mod objects;
pub mod pods;

use kube::api::{Api, DynamicObject, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};

use crate::config::KubeTarget;
use crate::karpenter;
pub(crate) use calls::ApiCalls;

/// Objects per list request, as kubectl asks for them. A cluster of thousands of nodes is read
/// in pages: an unpaged list is one response the API server must build and the tool must hold
/// whole (a real node's status lists its images, tens of kilobytes each), and it risks the API
/// server's 60 s request timeout on a busy control plane.
pub(crate) const LIST_PAGE: u32 = 500;

/// Lists every object `lp` selects, page by page, keeping of each only what `keep` makes of
/// it, so that no more than one page of whole objects is held at a time.
pub async fn list_pages<K, T>(
    api: &kube::Api<K>,
    lp: &ListParams,
    mut keep: impl FnMut(K) -> Option<T>,
) -> Result<Vec<T>, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut out = Vec::new();
    let mut lp = lp.clone().limit(LIST_PAGE);
    loop {
        let page = api.list(&lp).await?;
        let token = page.metadata.continue_.filter(|t| !t.is_empty());
        out.extend(page.items.into_iter().filter_map(&mut keep));
        match token {
            Some(t) => lp = lp.continue_token(&t),
            None => return Ok(out),
        }
    }
}

/// Lists every object of `ar` in pages, keeping what `keep` makes of each; a kind the server
/// does not serve is an empty list.
pub(crate) async fn list_kind<T>(
    client: &kube::Client,
    ar: &ApiResource,
    keep: impl FnMut(DynamicObject) -> Option<T>,
) -> Result<Vec<T>, kube::Error> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    match list_pages(&api, &ListParams::default(), keep).await {
        Err(e) if status_code(&e) == Some(404) => Ok(Vec::new()),
        r => r,
    }
}

/// What a failed list of `ar` means: a 1.0.x conversion webhook with nothing behind it is named
/// with its fix.
pub(crate) fn list_error(ar: &ApiResource, e: kube::Error) -> KubeError {
    match e {
        kube::Error::Api(s) if s.code == 500 && s.message.contains("conversion webhook") => {
            KubeError::ConversionWebhook {
                action: format!("list {}", ar.plural),
                crd: format!("{}.{}", ar.plural, ar.group),
                detail: s.message,
            }
        }
        e => KubeError::api(format!("list {}", ar.plural), e),
    }
}

/// Failures of the Kubernetes side, with what the user can do about them.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig could not be read or has no usable context.
    #[error(
        "cannot use the kubeconfig {path}: {detail}; pass --kubeconfig FILE (and --context NAME) or set KUBECONFIG"
    )]
    Kubeconfig {
        /// Which file (or `KUBECONFIG`/default).
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// The API server could not be reached.
    #[error(
        "cannot reach the Kubernetes API server {server}: {detail}; check the kubeconfig's server address, the network, and that the cluster is up"
    )]
    Unreachable {
        /// The server URL.
        server: String,
        /// The transport error.
        detail: String,
    },
    /// A Karpenter 1.0.x CRD routes conversion through the controller's webhook, and the
    /// controller is gone: objects stored at another version cannot be read or written.
    #[error(
        "Kubernetes {action} failed: the CRD {crd} routes conversion through the Karpenter controller's webhook, which cannot answer ({detail}). Make the objects reachable again by turning the webhook off (Karpenter 1.1 did the same): kubectl patch crd {crd} --type merge -p '{{\"spec\":{{\"conversion\":{{\"strategy\":\"None\"}}}}}}' (or scale the controller back up), then run again"
    )]
    ConversionWebhook {
        /// What the tool was doing.
        action: String,
        /// The CRD's name.
        crd: String,
        /// The server's message.
        detail: String,
    },
    /// A pod holds a Karpenter leader Lease and cannot be traced to the Deployment that runs it:
    /// nothing can stop that controller before its nodes go.
    #[error(
        "cannot tell where Karpenter runs: the leader Lease {lease} is held by pod {pod}, {why}. A live Karpenter \
         beside the teardown races it for the instances and finalizers. Nothing was changed; scale that controller \
         to zero yourself (or delete what runs it), then run again"
    )]
    UntracedController {
        /// `namespace/name` of the Lease.
        lease: String,
        /// `namespace/name` of the pod.
        pod: String,
        /// Why it cannot be traced.
        why: String,
    },
    /// A GitOps owner would not stay paused.
    #[error("{owner} could not be paused: {detail}")]
    NotPaused {
        /// The owner.
        owner: String,
        /// What happened.
        detail: String,
    },
    /// The server refused or failed a request.
    #[error("Kubernetes {action} failed: {}", describe_error(.source))]
    Api {
        /// What the tool was doing.
        action: String,
        /// The client error.
        source: kube::Error,
    },
}

/// What is wrong with a kubeconfig, once: kube's own message for a file it cannot read quotes
/// the path it was given (`'"/path"'`), which the error already names.
fn kubeconfig_detail(e: &kube::config::KubeconfigError) -> String {
    match e {
        kube::config::KubeconfigError::ReadConfig(io, _) => io.to_string(),
        other => other.to_string(),
    }
}

impl KubeError {
    /// True for failures of configuration or reachability (exit 2), not of an operation.
    pub(crate) fn is_configuration(&self) -> bool {
        matches!(self, KubeError::Kubeconfig { .. } | KubeError::Unreachable { .. })
    }

    /// True for failures worth trying again (429, 5xx, a lost connection mid-request).
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, KubeError::Api { source, .. } if is_transient(source))
    }

    /// Wraps a client error from `action`.
    pub(crate) fn api(action: impl Into<String>, source: kube::Error) -> KubeError {
        KubeError::Api { action: action.into(), source }
    }
}

/// A client error for people: the server's own message, its HTTP status, and what to do, instead
/// of kube's Debug dump of the whole `Status`.
pub(crate) fn describe_error(e: &kube::Error) -> String {
    let kube::Error::Api(s) = e else {
        return match e {
            kube::Error::HyperError(_) | kube::Error::Service(_) => format!(
                "the connection to the API server failed ({e}); check the network and run again (the tool resumes where it stopped)"
            ),
            other => other.to_string(),
        };
    };
    let message = if s.message.trim().is_empty() { "no message" } else { s.message.trim() };
    let causes: Vec<String> = s
        .details
        .iter()
        .flat_map(|d| &d.causes)
        .filter(|c| !c.message.is_empty() && !message.contains(c.message.as_str()))
        .map(|c| if c.field.is_empty() { c.message.clone() } else { format!("{}: {}", c.field, c.message) })
        .collect();
    let causes = if causes.is_empty() { String::new() } else { format!(" [{}]", causes.join("; ")) };
    let status = if s.reason.is_empty() { format!("HTTP {}", s.code) } else { format!("HTTP {} {}", s.code, s.reason) };
    // a write refused by the admission chain is no server failure and no missing permission:
    // running again changes nothing until the webhook or policy does
    if let Some(who) = admission::parse(message) {
        return format!(
            "{message} ({status}){causes}; refused by the admission chain: {who}. Running again will not help until that changes; the tool never edits webhook configurations or admission policies (`karpenter-teardown run` without --yes names the fix)"
        );
    }
    let todo = match s.code {
        401 => {
            "the kubeconfig's credentials were refused: refresh them (aws eks update-kubeconfig, aws sso login) and run again"
        }
        403 => {
            "the identity lacks this permission: apply deploy/rbac.yaml and bind it to the identity the kubeconfig uses (README, Real use against EKS)"
        }
        404 => "it does not exist (any more), or its kind is not served: check that the Karpenter CRDs are installed",
        409 => "another writer changed it meanwhile: run again",
        422 => "the server refused the change as invalid: the message names the rule",
        429 => "the API server is throttling: run again later (the tool resumes where it stopped)",
        500..=599 => "the API server failed: run again (the tool resumes where it stopped)",
        _ => "see the server's message",
    };
    format!("{message} ({status}){causes}; {todo}")
}

/// The HTTP status of an API error response, if the error is one.
pub(crate) fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// True for errors worth retrying: throttling, server errors, lost connections.
pub(crate) fn is_transient(e: &kube::Error) -> bool {
    match e {
        // a webhook that cannot be called answers 500 too, on every try
        kube::Error::Api(s) => matches!(s.code, 429 | 500 | 502 | 503 | 504) && admission::parse(&s.message).is_none(),
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

/// Runs `f` again with exponential backoff (backon) while it fails transiently; for the reads
/// the engine makes before any task runs (tasks themselves are retried whole by the engine).
pub(crate) async fn retry_transient<T, F, Fut>(f: F) -> Result<T, KubeError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, KubeError>>,
{
    use backon::Retryable;
    let backoff = backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_secs(2))
        .with_max_times(8)
        .with_jitter();
    // a throttled request waits as long as the server asked (API Priority and Fairness)
    f.retry(backoff)
        .when(KubeError::is_transient)
        .adjust(|e, planned| match e {
            KubeError::Api { source, .. } => planned.map(|p| apf::retry_after(source).unwrap_or(p)),
            _ => planned,
        })
        .await
}

/// A connected client with what the preflight needs to know of where it points.
#[derive(Clone)]
pub struct Kube {
    /// The client (request accounting included).
    pub client: kube::Client,
    /// The kubeconfig context in use (its name is identity evidence when it is an EKS ARN).
    pub context: Option<String>,
    /// The API server URL.
    pub server: String,
    /// The certificate authority the kubeconfig trusts for that server (DER), empty without one.
    pub ca_certs: Vec<Vec<u8>>,
    /// False when the kubeconfig turns TLS verification off (`insecure-skip-tls-verify`): then
    /// its certificate authority proves nothing of the server reached.
    pub tls_verified: bool,
    /// Requests made, by verb.
    pub calls: ApiCalls,
}

/// The most Kubernetes requests the tool has in flight at once, whatever the steps' concurrency.
/// A drain task spends nearly all its time waiting for grace periods, so every node drains at
/// once; this bound keeps a thousand of them from opening a thousand connections and sending
/// their evictions in one burst (API Priority and Fairness would answer with 429s). A watch holds
/// a slot only until its response starts.
pub(crate) const MAX_REQUESTS_IN_FLIGHT: usize = 64;

impl Kube {
    /// Builds a client from the kubeconfig rules: `--kubeconfig`, else `KUBECONFIG`, else
    /// `~/.kube/config`; `--context`, else the current context.
    pub(crate) async fn connect(target: &KubeTarget) -> Result<Kube, KubeError> {
        let path_label = target
            .kubeconfig
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| std::env::var("KUBECONFIG").unwrap_or_else(|_| "~/.kube/config".into()));
        let bad = |detail: String| KubeError::Kubeconfig { path: path_label.clone(), detail };
        let kubeconfig = match &target.kubeconfig {
            Some(p) => Kubeconfig::read_from(p),
            None => Kubeconfig::read(),
        }
        .map_err(|e| bad(kubeconfig_detail(&e)))?;
        let context = target.context.clone().or_else(|| kubeconfig.current_context.clone());
        if let Some(name) = &context
            && !kubeconfig.contexts.iter().any(|c| &c.name == name)
        {
            let known: Vec<&str> = kubeconfig.contexts.iter().map(|c| c.name.as_str()).collect();
            return Err(bad(format!("no context named {name:?} (it has: {})", known.join(", "))));
        }
        let options = KubeConfigOptions { context: context.clone(), cluster: None, user: None };
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(|e| bad(e.to_string()))?;
        Self::from_config(config, context)
    }

    /// Builds a client from a ready configuration (tests, the sandbox).
    pub fn from_config(mut config: kube::Config, context: Option<String>) -> Result<Kube, KubeError> {
        // kube retries 429/503/504 on its own by default, which turns a PodDisruptionBudget block
        // into a silent multi-minute stall (design §5); the engine retries what it chooses to.
        config.default_retry = false;
        let server = config.cluster_url.to_string();
        let ca_certs = config.root_cert.clone().unwrap_or_default();
        let tls_verified = !config.accept_invalid_certs && server.starts_with("https");
        let calls = ApiCalls::default();
        let client = kube::client::ClientBuilder::try_from(config)
            .map_err(|e| KubeError::Kubeconfig { path: "kubeconfig".into(), detail: e.to_string() })?
            .with_layer(&apf::layer(calls.clone()))
            .with_layer(&calls.layer())
            .with_layer(&tower::limit::ConcurrencyLimitLayer::new(MAX_REQUESTS_IN_FLIGHT))
            .build();
        Ok(Kube { client, context, server, ca_certs, tls_verified, calls })
    }

    /// Proves the server answers (`/version`), so an unreachable endpoint is reported as such.
    pub(crate) async fn check_reachable(&self) -> Result<(), KubeError> {
        self.client.apiserver_version().await.map(|_| ()).map_err(|e| match e {
            kube::Error::Api(_) => KubeError::api("GET /version", e),
            other => KubeError::Unreachable { server: self.server.clone(), detail: crate::exit::causes(&other) },
        })
    }
}

/// `NodePool` (karpenter.sh/v1, cluster-scoped).
pub fn nodepool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(karpenter::KARPENTER_GROUP, karpenter::VERSION, "NodePool"),
        "nodepools",
    )
}

/// `NodeClaim` (karpenter.sh/v1, cluster-scoped).
pub fn nodeclaim_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(karpenter::KARPENTER_GROUP, karpenter::VERSION, "NodeClaim"),
        "nodeclaims",
    )
}

/// `EC2NodeClass` (karpenter.k8s.aws/v1, cluster-scoped).
pub fn nodeclass_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(karpenter::AWS_GROUP, karpenter::VERSION, "EC2NodeClass"),
        "ec2nodeclasses",
    )
}

#[cfg(test)]
mod tests {
    use kube::core::Status;
    use kube::core::response::{StatusCause, StatusDetails};

    use super::*;

    #[test]
    fn api_errors_read_as_the_servers_message_and_what_to_do_not_a_debug_dump() {
        let status =
            Status::failure("nodes \"n1\" is forbidden: User \"ci\" cannot patch resource \"nodes\"", "Forbidden")
                .with_code(403);
        let e = KubeError::api("cordon node n1", kube::Error::Api(status.boxed()));
        let text = e.to_string();
        assert!(text.starts_with("Kubernetes cordon node n1 failed: nodes \"n1\" is forbidden"), "{text}");
        assert!(text.contains("(HTTP 403 Forbidden)") && text.contains("deploy/rbac.yaml"), "{text}");
        assert!(!text.contains("Status {") && !text.contains("ApiError"), "{text}");
        assert_eq!(text.matches("is forbidden").count(), 1, "the message appears once: {text}");

        let mut invalid = Status::failure("NodePool.karpenter.sh \"p\" is invalid", "Invalid").with_code(422);
        invalid.details = Some(StatusDetails {
            name: String::new(),
            group: String::new(),
            kind: String::new(),
            uid: String::new(),
            causes: vec![StatusCause {
                reason: "FieldValueInvalid".into(),
                message: "only 'limits.nodes' is supported on static NodePools".into(),
                field: "spec".into(),
            }],
            retry_after_seconds: 0,
        });
        let text = KubeError::api("fence NodePool p", kube::Error::Api(invalid.boxed())).to_string();
        assert!(text.contains("spec: only 'limits.nodes' is supported on static NodePools"), "{text}");
    }

    #[test]
    fn a_write_the_admission_chain_refuses_mid_run_is_named_and_never_retried_as_a_server_failure() {
        let webhook = Status::failure(
            "Internal error occurred: failed calling webhook \"validation.webhook.karpenter.sh\": failed to call webhook: Post \"https://karpenter.kube-system.svc:8443/validate/karpenter.sh?timeout=10s\": service \"karpenter\" not found",
            "InternalError",
        )
        .with_code(500);
        let e = KubeError::api("fence NodePool default", kube::Error::Api(webhook.boxed()));
        assert!(!e.is_transient(), "a webhook that cannot be called fails every retry the same way");
        let text = e.to_string();
        assert!(
            text.contains(
                "refused by the admission chain: admission webhook \"validation.webhook.karpenter.sh\" cannot be called"
            ) && !text.contains("the API server failed: run again"),
            "{text}"
        );
        let policy = Status::failure(
            "nodes \"n1\" is forbidden: ValidatingAdmissionPolicy 'no-cordons' with binding 'no-cordons' denied request: no one cordons production",
            "Forbidden",
        )
        .with_code(403);
        let text = KubeError::api("cordon node n1", kube::Error::Api(policy.boxed())).to_string();
        assert!(
            text.contains("ValidatingAdmissionPolicy 'no-cordons'") && !text.contains("deploy/rbac.yaml"),
            "{text}"
        );
        // a plain server failure is still retried
        let etcd = Status::failure("etcdserver: request timed out", "InternalError").with_code(500);
        assert!(KubeError::api("x", kube::Error::Api(etcd.boxed())).is_transient());
    }
}
