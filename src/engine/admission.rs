//! Admission before the first write (design §2.1). RBAC saying yes is not the API server saying
//! yes: webhooks and admission policies refuse writes RBAC allows, and a refusal half-way leaves
//! NodePools fenced and nodes cordoned with the run stopped. Before the first write the tool
//! sends one server-side dry run (`dryRun=All`: the whole admission chain, nothing stored) of
//! each kind of write the plan makes, on a representative object, and reads every webhook
//! configuration for those whose only backends the drain itself will take away.
//!
//! What a refusal means and what to do about it is decided here, purely ([`blocked_by`],
//! [`stranded`]); [`check`] is the thin loop that asks the server. The tool never edits or
//! deletes a webhook configuration or a policy: it names them and the fix.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use kube::Resource;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};

use super::inventory::Inventory;
use super::permissions::KubePermission;
use crate::k8s::admission::{Admitter, Webhook};
use crate::k8s::objects::patch_params;
use crate::k8s::{self, KubeError, status_code};
use crate::karpenter;

/// How often the cordon's dry run is asked again of a node written in between (see there).
const CORDON_DRY_RUN_TRIES: u32 = 5;

/// The admission operation of a verb.
fn operation(verb: &str) -> Option<&'static str> {
    match verb {
        "create" => Some("CREATE"),
        "patch" | "update" => Some("UPDATE"),
        "delete" => Some("DELETE"),
        _ => None,
    }
}

/// The writes among what a plan needs. The CRD patch is left out: it is the named repair of a
/// 1.0.x conversion webhook, made only when that webhook is configured.
pub(crate) fn writes(need: &BTreeSet<KubePermission>) -> Vec<&KubePermission> {
    need.iter()
        .filter(|p| operation(p.verb).is_some() && p.resource != "customresourcedefinitions")
        // one per kind, verb and subresource: rules by resource name are asked by RBAC
        .fold(Vec::<&KubePermission>::new(), |mut out, p| {
            if !out
                .iter()
                .any(|q| (q.verb, q.group, q.resource, q.subresource) == (p.verb, p.group, p.resource, p.subresource))
            {
                out.push(p);
            }
            out
        })
}

/// A write the admission chain would refuse, with who refuses it and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blocked {
    /// The write, as `patch nodes` with the object tried.
    pub(crate) write: String,
    /// The webhook or policy (for the report's blocker name).
    pub(crate) who: String,
    /// What the server said, with the configuration found.
    pub(crate) cause: String,
    /// What to do.
    pub(crate) fix: String,
    /// The webhook, when the server could not call it.
    pub(crate) unreachable: Option<String>,
}

impl std::fmt::Display for Blocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is refused: {}; {}", self.write, self.cause, self.fix)
    }
}

/// What the admission check found.
#[derive(Debug, Clone, Default)]
pub(crate) struct Findings {
    /// Dry runs sent.
    pub(crate) dry_runs: usize,
    /// Writes that would be refused.
    pub(crate) blocked: Vec<Blocked>,
    /// Writes that could not be tried (a webhook with side effects refuses dry runs).
    pub(crate) unchecked: Vec<String>,
}

/// A webhook Karpenter's own releases before v1 installed (`validation.webhook.karpenter.sh`,
/// `defaulting.webhook.karpenter.k8s.aws`, ...): v1 serves none of them, and its upgrade guide
/// says to delete them.
pub(crate) fn is_karpenter_webhook(name: &str) -> bool {
    name.ends_with(".karpenter.sh") || name.ends_with(".karpenter.k8s.aws")
}

fn kubectl_kind(kind: &str) -> String {
    kind.to_ascii_lowercase()
}

/// Who refused `write`, with the configuration of the webhook it names (when found), and the fix.
pub(crate) fn blocked_by(write: String, admitter: &Admitter, webhooks: &[Webhook]) -> Blocked {
    let config = admitter.webhook().and_then(|name| webhooks.iter().find(|w| w.name == name));
    let seen = config.map(|w| format!(" [{}]", w.describe())).unwrap_or_default();
    let cause = format!("{admitter}{seen}");
    let fix = match (admitter, config) {
        (Admitter::Unreachable { webhook, .. }, Some(w)) if is_karpenter_webhook(webhook) => format!(
            "it is a webhook of a Karpenter release before v1, which Karpenter v1 no longer serves: delete it as Karpenter's v1 upgrade guide says (kubectl delete {} {}), then run again",
            kubectl_kind(w.config_kind),
            w.config
        ),
        (Admitter::Unreachable { webhook, .. }, None) if is_karpenter_webhook(webhook) => format!(
            "it is a webhook of a Karpenter release before v1, which Karpenter v1 no longer serves: delete the webhook configuration that holds {webhook} as Karpenter's v1 upgrade guide says, then run again"
        ),
        (Admitter::Unreachable { .. }, Some(w)) => format!(
            "bring its backend back, or, if its controller is gone for good, have its owner remove {} {}; then run again",
            w.config_kind, w.config
        ),
        (Admitter::Unreachable { .. }, None) => {
            "bring the webhook's backend back, or have its owner remove its configuration; then run again".into()
        }
        (Admitter::DeniedByWebhook { webhook, .. }, _) => format!(
            "exempt this identity or these objects from webhook {webhook} for the teardown (its objectSelector or its controller's own policy), then run again"
        ),
        (Admitter::DeniedByPolicy { policy, .. }, _) => format!(
            "exempt this identity or these objects from ValidatingAdmissionPolicy {policy} for the teardown (its binding's matchResources or the policy's matchConditions), then run again"
        ),
        (Admitter::NoDryRun { .. }, _) => "nothing is known of it before the real write".into(),
    };
    let who = match admitter {
        Admitter::DeniedByPolicy { policy, .. } => format!("ValidatingAdmissionPolicy/{policy}"),
        other => match config {
            Some(w) => format!("{}/{}", w.config_kind, w.config),
            None => format!("webhook/{}", other.webhook().unwrap_or_default()),
        },
    };
    let unreachable = match admitter {
        Admitter::Unreachable { webhook, .. } => Some(webhook.clone()),
        _ => None,
    };
    Blocked { write, who, cause, fix, unreachable }
}

/// The webhooks that refuse closed, match a write the plan makes, and whose every ready backend
/// runs on a Karpenter node: a dry run passes now, but once the drain has taken those nodes'
/// pods away every write they match fails. `backends` holds the nodes of each service's ready
/// endpoints (`None`: an endpoint with no node, which no drain removes).
pub(crate) fn stranded(
    webhooks: &[Webhook],
    writes: &[&KubePermission],
    backends: &BTreeMap<(String, String), Vec<Option<String>>>,
    karpenter_nodes: &BTreeSet<String>,
) -> Vec<Blocked> {
    let mut out = Vec::new();
    for w in webhooks.iter().filter(|w| w.fails_closed) {
        let Some((ns, name, _)) = &w.service else { continue };
        let matched = matched_writes(w, writes);
        if matched.is_empty() {
            continue;
        }
        let Some(nodes) = backends.get(&(ns.clone(), name.clone())) else { continue };
        let on_karpenter: Vec<&str> =
            nodes.iter().filter_map(|n| n.as_deref()).filter(|n| karpenter_nodes.contains(*n)).collect();
        if nodes.is_empty() || on_karpenter.len() < nodes.len() {
            continue;
        }
        let mut on: Vec<&str> = on_karpenter.clone();
        on.sort_unstable();
        on.dedup();
        out.push(Blocked {
            write: matched.join(", "),
            who: format!("{}/{}", w.config_kind, w.config),
            cause: format!(
                "webhook {} ({}) is served only from Karpenter nodes ({}): the drain takes its backend away, and every later write it matches would fail",
                w.name,
                w.describe(),
                on.join(", ")
            ),
            fix: format!(
                "run service {ns}/{name}'s pods on capacity this run keeps (a managed node group or Fargate){}, then run again",
                if is_karpenter_webhook(&w.name) {
                    format!(
                        "; or, as a webhook of a Karpenter release before v1, delete it as the v1 upgrade guide says (kubectl delete {} {})",
                        kubectl_kind(w.config_kind),
                        w.config
                    )
                } else {
                    String::new()
                }
            ),
            unreachable: None,
        });
    }
    out
}

/// The other webhooks that call the backend of a webhook found unreachable, refuse closed,
/// and match a write of the plan: the server names only the first webhook a write fails on
/// (mutating before validating), and a run that stopped at each in turn would need one run per
/// stale webhook to name them all.
pub(crate) fn same_backend(
    blocked: &[Blocked],
    unreachable: &[&str],
    webhooks: &[Webhook],
    writes: &[&KubePermission],
) -> Vec<Blocked> {
    let dead: Vec<&Webhook> = webhooks.iter().filter(|w| unreachable.contains(&w.name.as_str())).collect();
    let mut out = Vec::new();
    for w in webhooks.iter().filter(|w| w.fails_closed && !unreachable.contains(&w.name.as_str())) {
        let who = format!("{}/{}", w.config_kind, w.config);
        let Some(first) = dead.iter().find(|d| d.service.is_some() && d.service == w.service) else { continue };
        if blocked.iter().any(|b| b.who == who) {
            continue;
        }
        let matched = matched_writes(w, writes);
        if matched.is_empty() {
            continue;
        }
        let admitter = Admitter::Unreachable {
            webhook: w.name.clone(),
            detail: format!("it calls the same backend as webhook {}, which cannot be called", first.name),
        };
        out.push(blocked_by(matched.join(", "), &admitter, webhooks));
    }
    out
}

/// The plan's writes a webhook's rules match, in words.
fn matched_writes(w: &Webhook, writes: &[&KubePermission]) -> Vec<String> {
    writes
        .iter()
        .filter(|p| {
            let op = operation(p.verb).unwrap_or_default();
            w.rules.iter().any(|r| r.matches(op, p.group, p.resource, p.subresource))
        })
        .map(|p| permission_words(p))
        .collect()
}

fn permission_words(p: &KubePermission) -> String {
    let group = if p.group.is_empty() { String::new() } else { format!(".{}", p.group) };
    let sub = if p.subresource.is_empty() { String::new() } else { format!("/{}", p.subresource) };
    format!("{} {}{group}{sub}", p.verb, p.resource)
}

/// The GitOps owners a run pauses: one of each kind is tried, with the listing they came from.
pub(crate) struct Pausing<'a> {
    pub(crate) owners: &'a crate::k8s::gitops::Owners,
    pub(crate) active: Vec<crate::gitops::OwnerId>,
}

/// Asks the server, before the first write: the webhook configurations, the nodes their
/// services run on, and one dry run per kind of write on a representative object (and of the
/// pause of each kind of GitOps owner the run pauses).
pub(crate) async fn check(
    client: &kube::Client,
    inv: &Inventory,
    need: &BTreeSet<KubePermission>,
    pausing: Option<Pausing<'_>>,
) -> Result<Findings, KubeError> {
    let writes = writes(need);
    // a plan that writes nothing (a verify-only plan) has nothing for admission to refuse
    if writes.is_empty() && pausing.as_ref().is_none_or(|p| p.active.is_empty()) {
        return Ok(Findings::default());
    }
    let webhooks = k8s::retry_transient(|| k8s::admission::webhooks(client)).await?;
    let karpenter_nodes = inv.karpenter_nodes();
    let mut backends = BTreeMap::new();
    for w in webhooks.iter().filter(|w| w.fails_closed) {
        if let Some((ns, name, _)) = &w.service
            && !backends.contains_key(&(ns.clone(), name.clone()))
        {
            let nodes = k8s::retry_transient(|| k8s::admission::service_nodes(client, ns, name)).await?;
            backends.insert((ns.clone(), name.clone()), nodes);
        }
    }
    let mut findings =
        Findings { blocked: stranded(&webhooks, &writes, &backends, &karpenter_nodes), ..Findings::default() };
    let pod = representative_pod(client, inv).await?;
    'writes: for p in writes.iter().copied() {
        let eviction = p.subresource == "eviction";
        // a dry run that fails transiently (throttled, a server error that is no webhook's) is
        // sent again, a few times: nothing is learnt of admission from it
        let mut tries = 0u32;
        let (target, answer) = loop {
            let Some((target, answer)) = dry_run(client, inv, p, pod.as_ref()).await? else { continue 'writes };
            findings.dry_runs += 1;
            match &answer {
                Err(e) if tries < 4 && k8s::is_transient(e) && !(eviction && held_back(e)) => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(250 << tries)).await;
                }
                _ => break (target, answer),
            }
        };
        if let Err(e) = answer {
            let write = format!("{} ({target})", permission_words(p));
            judge(&mut findings, write, e, &webhooks, eviction)?;
        }
    }
    // Two writes share their kind and verb with one tried above, with bodies of their own: the
    // Node's finalizer removal (a patch, as the cordon is) and the 1.0.x CRD repair
    let releases_nodes = writes.iter().any(|p| (p.group, p.resource, p.verb) == ("", "nodes", "delete"));
    if let Some(name) = inv.machines.values().find_map(|m| m.node.clone()).filter(|_| releases_nodes) {
        let ar = ApiResource::erase::<Node>(&());
        let read = |api: Api<DynamicObject>, name: String| async move {
            k8s::retry_transient(|| async {
                api.get_opt(&name).await.map_err(|e| KubeError::api(format!("read node {name} for a dry run"), e))
            })
            .await
        };
        let (target, answer) =
            release_or_delete(client, &ar, read, "Node", name, karpenter::FINALIZER_TERMINATION, "patch").await?;
        findings.dry_runs += 1;
        if let Err(e) = answer {
            judge(&mut findings, format!("patch nodes ({target})"), e, &webhooks, false)?;
        }
    }
    if need.iter().any(|p| p.resource == "customresourcedefinitions" && p.verb == "patch") {
        for (target, answer) in conversion_dry_runs(client).await? {
            findings.dry_runs += 1;
            if let Err(e) = answer {
                judge(&mut findings, format!("patch customresourcedefinitions ({target})"), e, &webhooks, false)?;
            }
        }
    }
    if let Some(pausing) = &pausing {
        let mut kinds_tried = BTreeSet::new();
        for id in pausing.active.iter().filter(|id| kinds_tried.insert(id.kind)) {
            let Some(answer) = k8s::retry_transient(|| k8s::gitops::pause_dry_run(client, pausing.owners, id)).await?
            else {
                continue;
            };
            findings.dry_runs += 1;
            if let Err(e) = answer {
                judge(&mut findings, format!("pause {id}"), e, &webhooks, false)?;
            }
        }
    }
    let unreachable: Vec<String> = findings.blocked.iter().filter_map(|b| b.unreachable.clone()).collect();
    let names: Vec<&str> = unreachable.iter().map(String::as_str).collect();
    let more = same_backend(&findings.blocked, &names, &webhooks, &writes);
    findings.blocked.extend(more);
    Ok(findings)
}

/// The dry runs of the 1.0.x CRD repair alone, for the run that must make it before the
/// Karpenter objects can be read (`phases::unstrand`).
pub(crate) async fn check_conversion_repair(client: &kube::Client) -> Result<Findings, KubeError> {
    let mut findings = Findings::default();
    let tries = conversion_dry_runs(client).await?;
    if tries.iter().all(|(_, a)| a.is_ok()) {
        findings.dry_runs = tries.len();
        return Ok(findings);
    }
    let webhooks = k8s::retry_transient(|| k8s::admission::webhooks(client)).await?;
    for (write, answer) in tries {
        findings.dry_runs += 1;
        if let Err(e) = answer {
            judge(&mut findings, write, e, &webhooks, false)?;
        }
    }
    Ok(findings)
}

/// One server-side dry run of each kind of write `--release` makes, on an object it will make
/// it to (the first surveyed object of each kind the Load Balancer Controller holds, the first
/// StatefulSet whose scale goes to zero, the first claim deleted): a policy that refuses one of
/// them would otherwise stop the run half-way, its load balancers gone and its StatefulSets at
/// zero.
pub(crate) async fn check_release(
    client: &kube::Client,
    release: &[crate::cleanup::Held],
    volumes: &crate::cleanup::VolumeRelease,
) -> Result<Findings, KubeError> {
    let lbc = |h: &&crate::cleanup::Held| h.cleaner == crate::cleanup::Cleaner::LoadBalancerController;
    if !release.iter().any(|h| lbc(&h)) && volumes.statefulsets.is_empty() && volumes.claim_uids.is_empty() {
        return Ok(Findings::default());
    }
    let webhooks = k8s::retry_transient(|| k8s::admission::webhooks(client)).await?;
    let mut findings = Findings::default();
    let mut kinds = BTreeSet::new();
    let mut tries: Vec<(String, Answer)> = Vec::new();
    for h in release.iter().filter(lbc).filter(|h| kinds.insert(h.kind)) {
        let (collection, name) = k8s::cleanup::collection_of(h);
        tries.push((format!("delete {} {} (release)", h.kind, h.name), dry_delete(client, collection, &name).await));
    }
    if let Some(sts) = volumes.statefulsets.iter().next() {
        let (ns, name) = sts.split_once('/').unwrap_or(("", sts));
        let api: Api<k8s_openapi::api::apps::v1::StatefulSet> = Api::namespaced(client.clone(), ns);
        let body = json!({"spec": {"replicas": 0}});
        let answer = api.patch_scale(name, &dry_patch(), &Patch::Merge(&body)).await.map(drop);
        tries.push((format!("scale StatefulSet {sts} to 0 (release)"), answer));
    }
    if let Some(claim) = volumes.claim_uids.keys().next() {
        let (ns, name) = claim.split_once('/').unwrap_or(("", claim));
        let collection = k8s_openapi::api::core::v1::PersistentVolumeClaim::url_path(&(), Some(ns));
        tries.push((
            format!("delete PersistentVolumeClaim {claim} (release)"),
            dry_delete(client, collection, name).await,
        ));
    }
    for (write, answer) in tries {
        findings.dry_runs += 1;
        if let Err(e) = answer {
            judge(&mut findings, write, e, &webhooks, false)?;
        }
    }
    Ok(findings)
}

/// What a refused dry run of `write` means: a refusal by the admission chain (blocked, or
/// unchecked for a webhook that takes no dry runs), nothing (the object changed under it; an
/// eviction its budget holds back, which is the drain's business), a failure to retry, or a
/// refusal by the server itself.
fn judge(
    findings: &mut Findings,
    write: String,
    e: kube::Error,
    webhooks: &[Webhook],
    eviction: bool,
) -> Result<(), KubeError> {
    match k8s::admission::admitter(&e) {
        Some(Admitter::NoDryRun { webhook }) => {
            tracing::warn!(write = %write, webhook = %webhook, "a webhook with side effects refuses dry runs: this write is not checked before the run");
            findings.unchecked.push(format!("{write}: webhook {webhook} does not support dry runs"));
        }
        Some(a) => findings.blocked.push(blocked_by(write, &a, webhooks)),
        None => match status_code(&e) {
            Some(404 | 409) => tracing::debug!(write = %write, "the object tried changed under the dry run"),
            _ if eviction && held_back(&e) => {}
            _ if k8s::is_transient(&e) => return Err(KubeError::api(format!("dry run of {write}"), e)),
            _ => findings.blocked.push(refused_as_invalid(write, &e)),
        },
    }
    Ok(())
}

/// An eviction its budget holds back (429 with a budget's cause, or 500 for a pod two budgets
/// select): admitted by the admission chain, and the drain's business.
fn held_back(e: &kube::Error) -> bool {
    k8s::apf::is_disruption_budget_refusal(e) || k8s::pods::is_multiple_budgets(e)
}

/// A write the server itself refuses (not a webhook or policy): as the run would make it, it
/// would fail the same way.
fn refused_as_invalid(write: String, e: &kube::Error) -> Blocked {
    Blocked {
        write,
        who: "kube-apiserver".into(),
        cause: k8s::describe_error(e),
        fix: "the server refuses this write as the run would make it".into(),
        unreachable: None,
    }
}

/// A pod a drain would evict, from the first Karpenter nodes that hold one.
async fn representative_pod(client: &kube::Client, inv: &Inventory) -> Result<Option<Pod>, KubeError> {
    let api: Api<Pod> = Api::all(client.clone());
    // a few nodes at most: the check costs the same on ten nodes as on ten thousand
    for node in inv.machines.values().filter_map(|m| m.node.as_deref()).take(3) {
        let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
        let pods = k8s::retry_transient(|| async {
            api.list(&lp).await.map_err(|e| KubeError::api(format!("list the pods of node {node}"), e))
        })
        .await?;
        if let Some(p) = pods
            .items
            .into_iter()
            .find(|p| k8s::pods::drainable(p).is_some_and(|r| !r.terminating && r.rides_with_node.is_none()))
        {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

fn dry_patch() -> PatchParams {
    PatchParams { dry_run: true, ..patch_params() }
}

/// A delete of `name` in the collection at `collection` (a URL path), as a dry run. kube sends a
/// delete's `dryRun` in its body only; here the query carries it too (the server reads both), so
/// whoever counts requests by their URL (the tool's own accounting, an audit log's reader)
/// counts a dry run, not a delete.
async fn dry_delete(client: &kube::Client, collection: String, name: &str) -> Answer {
    let body = serde_json::to_vec(&json!({"kind": "DeleteOptions", "apiVersion": "v1", "dryRun": ["All"]}))
        .map_err(kube::Error::SerdeError)?;
    let req = http::Request::delete(format!("{collection}/{name}?dryRun=All"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(body)
        .map_err(kube::Error::HttpError)?;
    client.request_text(req).await.map(drop)
}

type Answer = Result<(), kube::Error>;

/// One dry run of `p`'s kind of write on a representative object: the object tried and the
/// server's answer, or `None` when the cluster holds no object of that kind to try it on (then
/// the run has nothing of that kind to write either).
async fn dry_run(
    client: &kube::Client,
    inv: &Inventory,
    p: &KubePermission,
    pod: Option<&Pod>,
) -> Result<Option<(String, Answer)>, KubeError> {
    let first_node = inv.machines.values().find_map(|m| m.node.clone());
    let first_claim = inv.machines.values().find_map(|m| m.nodeclaim.clone());
    let dynamic = |ar: &ApiResource| Api::<DynamicObject>::all_with(client.clone(), ar);
    let read = |api: Api<DynamicObject>, name: String| async move {
        k8s::retry_transient(|| async {
            api.get_opt(&name).await.map_err(|e| KubeError::api(format!("read {name} for a dry run"), e))
        })
        .await
    };
    let answer: (String, Answer) = match (p.group, p.resource, p.subresource, p.verb) {
        ("karpenter.sh", "nodepools", "", "patch") => {
            let Some(name) = inv.nodepools.first() else { return Ok(None) };
            let api = dynamic(&k8s::nodepool_resource());
            let Some(pool) = read(api.clone(), name.clone()).await? else { return Ok(None) };
            let body = super::actions::fence_patch(&pool);
            (format!("fence NodePool {name}"), api.patch(name, &dry_patch(), &Patch::Merge(&body)).await.map(drop))
        }
        ("", "nodes", "", "patch") => {
            let Some(name) = first_node else { return Ok(None) };
            let api: Api<Node> = Api::all(client.clone());
            let read_node = || async {
                k8s::retry_transient(|| async {
                    api.get_opt(&name).await.map_err(|e| KubeError::api(format!("read node {name} for a dry run"), e))
                })
                .await
            };
            let Some(mut node) = read_node().await? else { return Ok(None) };
            // The patch tests the resourceVersion it was computed from, as the cordon does: a
            // node written in between (its kubelet, the node lifecycle controller) fails the test
            // with 422, which is not the admission chain's answer. Such a failure is told apart
            // by the node's version having moved on, and asked again of the new version.
            let mut tries = 0;
            loop {
                let rv = node.metadata.resource_version.clone().unwrap_or_default();
                let mut ops = vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv})];
                ops.extend(k8s::nodes::fence_ops(&node));
                let patch = json_patch(ops)?;
                let answer = api.patch(&name, &dry_patch(), &Patch::<()>::Json(patch)).await.map(drop);
                tries += 1;
                if tries < CORDON_DRY_RUN_TRIES
                    && let Err(e) = &answer
                    && matches!(status_code(e), Some(409 | 422))
                {
                    let Some(now) = read_node().await? else { return Ok(None) };
                    if now.metadata.resource_version.as_deref() != Some(rv.as_str()) {
                        node = now;
                        continue;
                    }
                }
                break (format!("cordon node {name}"), answer);
            }
        }
        ("", "nodes", "", "delete") => {
            let Some(name) = first_node else { return Ok(None) };
            (format!("delete node {name}"), dry_delete(client, Node::url_path(&(), None), &name).await)
        }
        ("karpenter.sh", "nodeclaims", "", verb) => {
            let Some(name) = first_claim else { return Ok(None) };
            let ar = k8s::nodeclaim_resource();
            release_or_delete(client, &ar, read, "NodeClaim", name, karpenter::FINALIZER_TERMINATION, verb).await?
        }
        ("karpenter.k8s.aws", "ec2nodeclasses", "", verb) => {
            let Some(name) = inv.nodeclasses.first().cloned() else { return Ok(None) };
            let ar = k8s::nodeclass_resource();
            release_or_delete(client, &ar, read, "EC2NodeClass", name, karpenter::FINALIZER_NODECLASS, verb).await?
        }
        ("karpenter.sh", "nodepools", "", "delete") => {
            let Some(name) = inv.nodepools.first() else { return Ok(None) };
            let collection = DynamicObject::url_path(&k8s::nodepool_resource(), None);
            (format!("delete NodePool {name}"), dry_delete(client, collection, name).await)
        }
        ("", "pods", "eviction", "create") => {
            let Some(pod) = pod else { return Ok(None) };
            let (ns, name) = pod_names(pod);
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let eviction = Eviction {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                },
                delete_options: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::DeleteOptions {
                    dry_run: Some(vec!["All".into()]),
                    preconditions: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions {
                        uid: pod.metadata.uid.clone(),
                        resource_version: None,
                    }),
                    ..Default::default()
                }),
            };
            let pp = PostParams { dry_run: true, ..PostParams::default() };
            (
                format!("evict pod {ns}/{name}"),
                api.create_subresource::<Eviction, Value>("eviction", &name, &pp, &eviction).await.map(drop),
            )
        }
        ("", "pods", "", "delete") => {
            let Some(pod) = pod else { return Ok(None) };
            let (ns, name) = pod_names(pod);
            (format!("delete pod {ns}/{name}"), dry_delete(client, Pod::url_path(&(), Some(&ns)), &name).await)
        }
        ("apps", "deployments", "scale", "patch") => {
            let Some(c) = &inv.controller else { return Ok(None) };
            let api: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), &c.namespace);
            let body = json!({"spec": {"replicas": 0}});
            (
                format!("scale deployment {}/{} to 0", c.namespace, c.name),
                api.patch_scale(&c.name, &dry_patch(), &Patch::Merge(&body)).await.map(drop),
            )
        }
        // the GitOps owners' pauses are tried on the owners themselves (`Pausing`)
        _ => return Ok(None),
    };
    Ok(Some(answer))
}

/// The 1.0.x repair of each Karpenter CRD that routes conversion through the controller's
/// webhook (`super::actions::drop_conversion_webhooks`), as dry runs; none when no CRD does.
async fn conversion_dry_runs(client: &kube::Client) -> Result<Vec<(String, Answer)>, KubeError> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut out = Vec::new();
    for name in karpenter::CRDS {
        let crd = k8s::retry_transient(|| async {
            crds.get_opt(name).await.map_err(|e| KubeError::api(format!("read CRD {name} for a dry run"), e))
        })
        .await?;
        let Some(crd) = crd.filter(|c| c.spec.conversion.as_ref().is_some_and(|c| c.strategy == "Webhook")) else {
            continue;
        };
        let patch = json_patch(super::actions::conversion_patch(&crd))?;
        let answer = crds.patch(name, &dry_patch(), &Patch::<()>::Json(patch)).await.map(drop);
        out.push((format!("remove the conversion webhook of CRD {name}"), answer));
    }
    Ok(out)
}

fn pod_names(pod: &Pod) -> (String, String) {
    (pod.metadata.namespace.clone().unwrap_or_default(), pod.metadata.name.clone().unwrap_or_default())
}

fn json_patch(ops: Vec<Value>) -> Result<json_patch::Patch, KubeError> {
    serde_json::from_value(Value::Array(ops))
        .map_err(|e| KubeError::api("build a dry-run patch", kube::Error::SerdeError(e)))
}

/// The release's finalizer patch (`patch`) or the delete (`delete`) of `name`, as a dry run.
async fn release_or_delete<R, F>(
    client: &kube::Client,
    ar: &ApiResource,
    read: R,
    kind: &str,
    name: String,
    finalizer: &str,
    verb: &str,
) -> Result<(String, Answer), KubeError>
where
    R: FnOnce(Api<DynamicObject>, String) -> F,
    F: std::future::Future<Output = Result<Option<DynamicObject>, KubeError>>,
{
    if verb == "delete" {
        let collection = DynamicObject::url_path(ar, None);
        return Ok((format!("delete {kind} {name}"), dry_delete(client, collection, &name).await));
    }
    let api = Api::<DynamicObject>::all_with(client.clone(), ar);
    let Some(obj) = read(api.clone(), name.clone()).await? else {
        return Ok((format!("release {kind} {name}"), Ok(())));
    };
    let uid = obj.metadata.uid.clone().unwrap_or_default();
    let mut ops = vec![json!({"op": "test", "path": "/metadata/uid", "value": uid})];
    let finalizers = obj.metadata.finalizers.clone().unwrap_or_default();
    if let Some(idx) = finalizers.iter().position(|f| f == finalizer) {
        ops.push(json!({"op": "test", "path": format!("/metadata/finalizers/{idx}"), "value": finalizer}));
        ops.push(json!({"op": "remove", "path": format!("/metadata/finalizers/{idx}")}));
    }
    let patch = json_patch(ops)?;
    Ok((
        format!("remove finalizer {finalizer} from {kind} {name}"),
        api.patch(&name, &dry_patch(), &Patch::<()>::Json(patch)).await.map(drop),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::admission::Rule;
    use crate::plan::Plan;

    fn webhook(name: &str, config: &str, resources: &[&str], group: &str, fails_closed: bool) -> Webhook {
        Webhook {
            config_kind: "ValidatingWebhookConfiguration",
            config: config.into(),
            name: name.into(),
            fails_closed,
            service: Some(("kube-system".into(), "hook".into(), 8443)),
            url: None,
            rules: vec![Rule {
                operations: vec!["*".into()],
                groups: vec![group.into()],
                resources: resources.iter().map(|s| s.to_string()).collect(),
            }],
            selective: false,
        }
    }

    #[test]
    fn one_write_per_kind_verb_and_subresource_of_the_default_plan_and_no_crd_repair() {
        let need = super::super::permissions::kubernetes_needs(&Plan::builtin_default(), false, false);
        let w = writes(&need);
        let words: Vec<String> = w.iter().map(|p| permission_words(p)).collect();
        for expected in [
            "patch nodepools.karpenter.sh",
            "patch nodes",
            "create pods/eviction",
            "patch deployments.apps/scale",
            "patch nodeclaims.karpenter.sh",
            "delete nodeclaims.karpenter.sh",
            "delete nodes",
            "delete nodepools.karpenter.sh",
            "patch ec2nodeclasses.karpenter.k8s.aws",
            "delete ec2nodeclasses.karpenter.k8s.aws",
        ] {
            assert!(words.contains(&expected.to_string()), "{expected} missing from {words:?}");
        }
        assert_eq!(words.len(), 10, "{words:?}");
        assert!(!words.iter().any(|w| w.contains("customresourcedefinitions")));
    }

    #[test]
    fn a_stale_karpenter_webhook_is_named_with_the_upgrade_guides_fix() {
        let hooks = [webhook(
            "validation.webhook.karpenter.sh",
            "validation.webhook.karpenter.sh",
            &["nodepools"],
            "karpenter.sh",
            true,
        )];
        let a = Admitter::Unreachable {
            webhook: "validation.webhook.karpenter.sh".into(),
            detail: "service \"karpenter\" not found".into(),
        };
        let b = blocked_by("patch nodepools.karpenter.sh (fence NodePool default)".into(), &a, &hooks);
        assert_eq!(b.who, "ValidatingWebhookConfiguration/validation.webhook.karpenter.sh");
        let text = b.to_string();
        assert!(
            text.contains("kubectl delete validatingwebhookconfiguration validation.webhook.karpenter.sh")
                && text.contains("service kube-system/hook port 8443, failurePolicy Fail")
                && text.contains("service \"karpenter\" not found"),
            "{text}"
        );
        let other = blocked_by(
            "delete nodes".into(),
            &Admitter::Unreachable { webhook: "x.example.com".into(), detail: "timeout".into() },
            &[],
        );
        assert!(!other.fix.contains("kubectl delete") && other.fix.contains("backend"), "{other}");
        let policy = Admitter::DeniedByPolicy { policy: "no-cordon".into(), binding: None, detail: "no".into() };
        let p = blocked_by("patch nodes (cordon node n1)".into(), &policy, &hooks);
        assert_eq!(p.who, "ValidatingAdmissionPolicy/no-cordon");
        assert!(p.fix.contains("matchResources"), "{p}");
    }

    fn api_error(code: u16, reason: &str, message: &str, cause: Option<&str>) -> kube::Error {
        let mut s = kube::core::Status::failure(message, reason).with_code(code);
        if let Some(c) = cause {
            s.details = Some(kube::core::response::StatusDetails {
                name: String::new(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                causes: vec![kube::core::response::StatusCause {
                    reason: c.into(),
                    message: "m".into(),
                    field: String::new(),
                }],
                retry_after_seconds: 0,
            });
        }
        kube::Error::Api(s.boxed())
    }

    #[test]
    fn a_refused_dry_run_is_judged_by_who_refused_it() {
        let mut f = Findings::default();
        let budget = api_error(
            429,
            "TooManyRequests",
            "Cannot evict pod as it would violate the pod's disruption budget.",
            Some("DisruptionBudget"),
        );
        judge(&mut f, "evict".into(), budget, &[], true).unwrap();
        let two = api_error(
            500,
            "",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            None,
        );
        judge(&mut f, "evict".into(), two, &[], true).unwrap();
        judge(&mut f, "patch".into(), api_error(409, "Conflict", "changed", None), &[], false).unwrap();
        assert!(
            f.blocked.is_empty() && f.unchecked.is_empty(),
            "a budget's answer and a conflict say nothing of admission"
        );
        let hook = api_error(
            500,
            "InternalError",
            "Internal error occurred: failed calling webhook \"x.example.com\": timeout",
            None,
        );
        judge(&mut f, "patch nodes".into(), hook, &[], false).unwrap();
        let side = api_error(400, "BadRequest", "admission webhook \"y.example.com\" does not support dry run", None);
        judge(&mut f, "delete nodes".into(), side, &[], false).unwrap();
        let invalid = api_error(422, "Invalid", "NodePool.karpenter.sh \"p\" is invalid", None);
        judge(&mut f, "patch nodepools".into(), invalid, &[], false).unwrap();
        assert_eq!(
            f.blocked.iter().map(|b| b.who.as_str()).collect::<Vec<_>>(),
            ["webhook/x.example.com", "kube-apiserver"]
        );
        assert_eq!(f.unchecked.len(), 1);
        let etcd = api_error(500, "InternalError", "etcdserver: request timed out", None);
        assert!(judge(&mut f, "patch".into(), etcd, &[], false).is_err(), "a server failure is no verdict");
    }

    #[test]
    fn the_webhooks_sharing_a_dead_backend_are_named_together() {
        let need = super::super::permissions::kubernetes_needs(&Plan::builtin_default(), false, false);
        let w = writes(&need);
        let hooks = [
            webhook(
                "defaulting.webhook.karpenter.k8s.aws",
                "defaulting.webhook.karpenter.k8s.aws",
                &["ec2nodeclasses"],
                "karpenter.k8s.aws",
                true,
            ),
            webhook(
                "validation.webhook.karpenter.k8s.aws",
                "validation.webhook.karpenter.k8s.aws",
                &["ec2nodeclasses"],
                "karpenter.k8s.aws",
                true,
            ),
            webhook("ignored.example.com", "ignored", &["ec2nodeclasses"], "karpenter.k8s.aws", false),
            webhook("unrelated.example.com", "unrelated", &["services"], "", true),
        ];
        let first = blocked_by(
            "patch ec2nodeclasses.karpenter.k8s.aws".into(),
            &Admitter::Unreachable {
                webhook: "defaulting.webhook.karpenter.k8s.aws".into(),
                detail: "no service".into(),
            },
            &hooks,
        );
        let more = same_backend(std::slice::from_ref(&first), &["defaulting.webhook.karpenter.k8s.aws"], &hooks, &w);
        assert_eq!(more.len(), 1, "{more:?}");
        assert_eq!(more[0].who, "ValidatingWebhookConfiguration/validation.webhook.karpenter.k8s.aws");
        assert!(
            more[0].fix.contains("kubectl delete validatingwebhookconfiguration validation.webhook.karpenter.k8s.aws"),
            "{:?}",
            more[0]
        );
    }

    #[test]
    fn a_webhook_served_only_from_karpenter_nodes_is_stranded_by_the_drain() {
        let need = super::super::permissions::kubernetes_needs(&Plan::builtin_default(), false, false);
        let w = writes(&need);
        let nodes: BTreeSet<String> = ["k1".to_string(), "k2".to_string()].into();
        let on = |list: &[Option<&str>]| {
            BTreeMap::from([(
                ("kube-system".to_string(), "hook".to_string()),
                list.iter().map(|n| n.map(str::to_string)).collect(),
            )])
        };
        let hook = webhook("policy.example.com", "policy", &["nodes"], "", true);
        let found = stranded(std::slice::from_ref(&hook), &w, &on(&[Some("k1"), Some("k2")]), &nodes);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].write.contains("patch nodes") && found[0].write.contains("delete nodes"), "{found:?}");
        assert!(found[0].cause.contains("k1, k2"), "{found:?}");
        // one backend elsewhere keeps it served; Ignore never refuses; no match, no matter
        assert!(stranded(std::slice::from_ref(&hook), &w, &on(&[Some("k1"), Some("managed-1")]), &nodes).is_empty());
        assert!(stranded(std::slice::from_ref(&hook), &w, &on(&[Some("k1"), None]), &nodes).is_empty());
        assert!(stranded(&[webhook("p", "p", &["nodes"], "", false)], &w, &on(&[Some("k1")]), &nodes).is_empty());
        assert!(stranded(&[webhook("p", "p", &["services"], "", true)], &w, &on(&[Some("k1")]), &nodes).is_empty());
        // no ready endpoint at all is the dry run's to find (the call fails now)
        assert!(stranded(std::slice::from_ref(&hook), &w, &on(&[]), &nodes).is_empty());
    }
}
