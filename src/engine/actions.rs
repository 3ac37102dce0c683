//! The actions: small, idempotent functions of the live state (observe, act, wait for the
//! condition). Each treats "already gone" as "done", so a re-run finishes what a killed run began.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, Patch};
use kube::core::DynamicObject;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::batcher::Sent;
use super::context::Ctx;
use super::drain::Release;
use super::events::EngineEvent;
use super::inventory::{Inventory, Machine, claim_owner, find_controllers, list_dynamic, pool_owner};
use super::machine_node::{claim_node, karpenter_nodes_to_fence, node_of_claim, node_read_of};
use super::task::{LateMachine, Outcome, TaskError, TaskOutcome};
use crate::k8s::nodes::cordon_read_node;
use crate::k8s::objects::{
    FinalizerRemoval, delete_and_remove_finalizer, delete_if_present, last_manager_in, patch_params, remove_finalizer,
};
use crate::k8s::{self, KubeError, status_code};
use crate::karpenter::{self, ProviderId};
use crate::plan::{OnDeadline, Params};
use crate::report::BlockerKind;
use crate::verify;

/// A batched EC2 call's failure: throttling that outlasted the SDK's retries runs the task again.
fn batch_failure(detail: String, e: &super::batcher::BatchError) -> TaskOutcome {
    if e.unanswered {
        TaskOutcome::Blocked(detail)
    } else if e.transient {
        TaskOutcome::Transient(detail)
    } else {
        TaskOutcome::Failed(detail)
    }
}

/// Annotation on a fenced NodePool holding its original limits and budgets.
pub const FENCE_ANNOTATION: &str = "karpenter-teardown.io/original-limits-and-budgets";

/// Sleeps, returning false if the run was cancelled meanwhile.
async fn pause(ctx: &Ctx, d: Duration) -> bool {
    tokio::select! {
        _ = ctx.cancel.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

// ---------------------------------------------------------------- fence

/// The fence of one NodePool as a merge patch: limits and disruption budgets to zero, the
/// originals in an annotation, conditioned on the resourceVersion read (the admission dry run
/// sends the same body).
pub(crate) fn fence_patch(current: &DynamicObject) -> Value {
    let limits = current.data.pointer("/spec/limits").cloned().unwrap_or(Value::Null);
    let budgets = current.data.pointer("/spec/disruption/budgets").cloned().unwrap_or(Value::Null);
    let zero = karpenter::fence_limits(&current.data["spec"]);
    // a pool fenced before and opened since keeps the originals its first fence saved
    let saved = current.metadata.annotations.as_ref().and_then(|a| a.get(FENCE_ANNOTATION)).cloned();
    let original = saved.unwrap_or_else(|| json!({"limits": limits, "budgets": budgets}).to_string());
    json!({
        "metadata": {
            "resourceVersion": current.metadata.resource_version,
            "annotations": {FENCE_ANNOTATION: original},
        },
        "spec": {"limits": zero, "disruption": {"budgets": [{"nodes": "0"}]}},
    })
}

/// How often the fence reads and patches a NodePool that another writer keeps changing.
const FENCE_ATTEMPTS: usize = 8;

/// NodePool limits to zero and disruption budgets to zero nodes, originals kept in an
/// annotation; a NodePool whose spec still holds the fence is left alone, one that carries the
/// annotation with its limits put back is fenced again. Static NodePools are fenced on
/// `limits.nodes` only (see [`karpenter::fence_limits`]); their `replicas` stay as they are.
/// A pool another writer changes under every attempt is an error, not a pool left unfenced.
pub async fn fence(ctx: &Ctx) -> Outcome {
    let ar = k8s::nodepool_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    let pools = list_dynamic(&ctx.kube.client, &ar).await?;
    let mut fenced = 0;
    // EKS Auto Mode's pools (its built-in ones may not be modified at all) and other
    // providers' are not this controller's: their capacity is not the tool's to stop
    for pool in pools.into_iter().filter(|p| pool_owner(p).is_ok()) {
        let name = pool.metadata.name.clone().unwrap_or_default();
        for attempt in 0..FENCE_ATTEMPTS {
            let current = match if attempt == 0 { Ok(Some(pool.clone())) } else { api.get_opt(&name).await } {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(e) => return Err(KubeError::api(format!("read NodePool {name}"), e).into()),
            };
            // the annotation says a fence was put on; the spec says whether it still holds
            let annotated = current.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(FENCE_ANNOTATION));
            if annotated && karpenter::holds_fence(&current.data["spec"]) {
                break;
            }
            if annotated {
                tracing::warn!(nodepool = %name, "the NodePool carries the fence's annotation but its limits or budgets were put back: fencing it again");
            }
            let patch = fence_patch(&current);
            match api.patch(&name, &patch_params(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    fenced += 1;
                    break;
                }
                Err(e) if status_code(&e) == Some(404) => break,
                // another writer changed it since the read: read again, up to the last attempt
                Err(e) if status_code(&e) == Some(409) && attempt + 1 < FENCE_ATTEMPTS => continue,
                Err(e) if status_code(&e) == Some(409) => {
                    return Err(KubeError::api(
                        format!(
                            "fence NodePool {name} (another writer changed it under each of {FENCE_ATTEMPTS} attempts)"
                        ),
                        e,
                    )
                    .into());
                }
                Err(e) => return Err(KubeError::api(format!("fence NodePool {name}"), e).into()),
            }
        }
    }
    Ok(TaskOutcome::Done(format!("{fenced} NodePool(s) fenced")))
}

// ---------------------------------------------------------------- cordon

/// Cordons the nodes of every inventoried machine (or of one machine) before any is
/// drained. Drains run in parallel but not all at once: a pod evicted from one node would
/// otherwise be scheduled onto a node that is drained later and be evicted again, once per
/// node it lands on, which multiplies evictions and the makespan on a large cluster.
pub async fn cordon(ctx: &Ctx, machine: Option<&str>, params: &Params) -> Outcome {
    let nodes = match machine {
        Some(m) => match node_read_of(ctx, m).await? {
            Some(n) => vec![n],
            None => return Ok(TaskOutcome::Skipped("no node".into())),
        },
        None => inventoried_nodes(ctx).await?,
    };
    let api: Api<Node> = Api::all(ctx.kube.client.clone());
    let total = nodes.len();
    let mut results = stream::iter(nodes)
        .map(|(node, read)| {
            let api = &api;
            async move {
                let out = cordon_read_node(api, &node, false, read).await;
                (node, out)
            }
        })
        .buffer_unordered(params.concurrency.get());
    let (mut wrote, mut gone) = (0, 0);
    loop {
        let next = tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
            next = results.next() => next,
        };
        let Some((node, out)) = next else { break };
        // the engine runs the task again on a transient error; nodes done so far are no-ops
        let o = out?;
        if o.gone {
            gone += 1;
        } else if o.wrote {
            wrote += 1;
            tracing::debug!(node = %node, "cordoned");
        }
    }
    Ok(TaskOutcome::Done(format!(
        "{} node(s) cordoned ({wrote} written now){}",
        total - gone,
        if gone > 0 { format!(", {gone} already gone") } else { String::new() }
    )))
}

/// The nodes of the inventoried machines that still exist as NodeClaims (or bare nodes), read
/// with two lists instead of one read per machine, each with what its cordon starts from.
async fn inventoried_nodes(ctx: &Ctx) -> Result<Vec<(String, Option<Node>)>, KubeError> {
    let claims = list_dynamic(&ctx.kube.client, &k8s::nodeclaim_resource()).await?;
    let listed = karpenter_nodes_to_fence(&ctx.kube.client).await?;
    let seen: Vec<_> = listed.iter().map(|(s, _)| s.clone()).collect();
    let mut reads: HashMap<String, Node> =
        listed.into_iter().map(|(_, n)| (n.metadata.name.clone().unwrap_or_default(), n)).collect();
    let by_claim: HashMap<String, String> =
        claims.iter().filter_map(|c| Some((c.metadata.name.clone()?, claim_node(c, &seen)?))).collect();
    Ok(ctx
        .inventoried
        .iter()
        .filter_map(|m| match m.strip_prefix("node/") {
            Some(n) => Some(n.to_string()),
            None => by_claim.get(m).cloned(),
        })
        .map(|n| {
            let read = reads.remove(&n);
            (n, read)
        })
        .collect())
}

// ---------------------------------------------------------------- remove controller

/// Makes Karpenter 1.0.x CRDs independent of the conversion webhook (served by the controller
/// about to go away), scales the controller to zero, waits for its pods to go, and scales it
/// down again (naming who) if something scaled it back meanwhile.
pub async fn remove_controller(ctx: &Ctx, params: &Params) -> Outcome {
    let mut detail = Vec::new();
    match drop_conversion_webhooks(&ctx.kube.client).await?.len() {
        0 => {}
        n => detail.push(format!("conversion webhook removed from {n} Karpenter CRD(s)")),
    }
    // every Deployment that runs Karpenter's controller, whatever its chart called it
    let controllers = find_controllers(&ctx.kube.client).await?;
    if controllers.is_empty() {
        detail.push("no Karpenter controller Deployment found (already removed)".into());
        return Ok(TaskOutcome::Done(detail.join("; ")));
    }
    let deadline = Instant::now() + params.deadline.unwrap_or(Duration::from_secs(300));
    for controller in &controllers {
        match stop_controller(ctx, params, controller, deadline, &mut detail).await? {
            TaskOutcome::Done(_) => {}
            other => return Ok(other),
        }
    }
    ctx.controller_seen_gone();
    Ok(TaskOutcome::Done(detail.join("; ")))
}

/// Scales one controller Deployment to zero and waits for its pods to go, scaling it down again
/// (naming who) if something scaled it back meanwhile.
async fn stop_controller(
    ctx: &Ctx,
    params: &Params,
    controller: &super::inventory::Controller,
    deadline: Instant,
    detail: &mut Vec<String>,
) -> Outcome {
    let deployments: Api<Deployment> = Api::namespaced(ctx.kube.client.clone(), &controller.namespace);
    let pods: Api<Pod> = Api::namespaced(ctx.kube.client.clone(), &controller.namespace);
    let mut scaled_once = false;
    loop {
        let dep = match deployments.get_opt(&controller.name).await {
            Ok(Some(d)) => d,
            Ok(None) => {
                detail.push(format!("Deployment {}/{} is gone", controller.namespace, controller.name));
                return Ok(TaskOutcome::Done(String::new()));
            }
            Err(e) => return Err(KubeError::api("read the Karpenter Deployment", e).into()),
        };
        let replicas = dep.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        if replicas > 0 {
            if scaled_once {
                let managed = serde_json::to_value(&dep.metadata.managed_fields).unwrap_or(Value::Null);
                let who = last_manager_in(&managed, &["spec", "replicas"]).unwrap_or_else(|| "unknown".into());
                tracing::warn!(field_manager = %who, replicas, "the Karpenter controller was scaled back up; scaling it down again");
                ctx.note(
                    BlockerKind::FieldManager,
                    &who,
                    format!("scaled {}/{} back to {replicas}", controller.namespace, controller.name),
                );
            }
            let patch = json!({"spec": {"replicas": 0}});
            if let Err(e) = deployments.patch_scale(&controller.name, &patch_params(), &Patch::Merge(&patch)).await
                && status_code(&e) != Some(404)
            {
                return Err(KubeError::api("scale the Karpenter controller to zero", e).into());
            }
            scaled_once = true;
            detail.push(format!("scaled {}/{} from {replicas} to 0", controller.namespace, controller.name));
        }
        let selector = dep
            .spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.as_ref())
            .map(|m| m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","))
            .unwrap_or_else(crate::karpenter::controller_selector);
        let running = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| KubeError::api("list the Karpenter controller's pods", e))?
            .items
            .len();
        if running == 0 && replicas == 0 {
            return Ok(TaskOutcome::Done(String::new()));
        }
        if Instant::now() >= deadline {
            return Ok(TaskOutcome::Failed(format!(
                "the Karpenter controller still has {running} pod(s) after {}",
                humantime::format_duration(params.deadline.unwrap_or_default())
            )));
        }
        if !pause(ctx, Duration::from_millis(500)).await {
            return Ok(TaskOutcome::Interrupted);
        }
    }
}

/// The JSON patch that turns a CRD's conversion to `None`, conditioned on the version read (the
/// admission check's dry run sends the same).
pub(crate) fn conversion_patch(crd: &CustomResourceDefinition) -> Vec<Value> {
    vec![
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": crd.metadata.resource_version}),
        json!({"op": "replace", "path": "/spec/conversion", "value": {"strategy": "None"}}),
    ]
}

/// Karpenter 1.0.x CRDs route conversion through the controller's webhook; with the controller
/// gone any request needing conversion fails and the objects become unreachable. Only v1 is
/// stored and used from here on, so conversion `None` is safe (Karpenter 1.1 does the same).
pub(crate) async fn drop_conversion_webhooks(client: &kube::Client) -> Result<Vec<DroppedConversion>, KubeError> {
    let mut changed = Vec::new();
    drop_conversion_webhooks_into(client, &mut changed).await?;
    Ok(changed)
}

/// [`drop_conversion_webhooks`], adding each CRD to `changed` as it is changed: a failure on a
/// later CRD leaves the earlier ones there, to be put back.
pub(crate) async fn drop_conversion_webhooks_into(
    client: &kube::Client,
    changed: &mut Vec<DroppedConversion>,
) -> Result<(), KubeError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in crate::karpenter::CRDS {
        let crd = match crds.get_opt(name).await {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => return Err(KubeError::api(format!("read CRD {name}"), e)),
        };
        let webhook = crd.spec.conversion.as_ref().is_some_and(|c| c.strategy == "Webhook");
        if !webhook {
            continue;
        }
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(conversion_patch(&crd)))
            .map_err(|e| KubeError::api("build the CRD patch", kube::Error::SerdeError(e)))?;
        match crds.patch(name, &patch_params(), &Patch::<()>::Json(patch)).await {
            Ok(patched) => changed.push(DroppedConversion {
                crd: name.to_string(),
                conversion: crd.spec.conversion.clone(),
                resource_version: patched.metadata.resource_version,
            }),
            // changed meanwhile: the next run (or the verify step) sees the new state
            Err(e) if matches!(status_code(&e), Some(404 | 409 | 422)) => {}
            Err(e) => return Err(KubeError::api(format!("remove the conversion webhook of CRD {name}"), e)),
        }
    }
    Ok(())
}

/// A CRD whose conversion webhook [`drop_conversion_webhooks`] turned off: what it was, and the
/// version the change made.
#[derive(Debug, Clone)]
pub(crate) struct DroppedConversion {
    pub(crate) crd: String,
    pub(crate) conversion:
        Option<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceConversion>,
    pub(crate) resource_version: Option<String>,
}

/// Puts back the conversion [`drop_conversion_webhooks`] turned off, on the CRDs no one changed
/// since: a run that repaired a 1.0.x CRD to read its objects and was then stopped by a later
/// check leaves the cluster as it found it. Returns the CRDs it could not put back, with why.
pub(crate) async fn restore_conversion_webhooks(client: &kube::Client, dropped: &[DroppedConversion]) -> Vec<String> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut failed = Vec::new();
    for d in dropped {
        let ops = json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": d.resource_version},
            {"op": "replace", "path": "/spec/conversion", "value": d.conversion},
        ]);
        let patch = match serde_json::from_value::<json_patch::Patch>(ops) {
            Ok(p) => p,
            Err(e) => {
                failed.push(format!("{} ({e})", d.crd));
                continue;
            }
        };
        let put = || async {
            crds.patch(&d.crd, &patch_params(), &Patch::<()>::Json(patch.clone()))
                .await
                .map(|_| ())
                .map_err(|e| KubeError::api(format!("put back the conversion of CRD {}", d.crd), e))
        };
        if let Err(e) = crate::k8s::retry_transient(put).await {
            let why = match &e {
                KubeError::Api { source, .. } if matches!(status_code(source), Some(409 | 422)) => {
                    "changed since the run changed it".to_string()
                }
                other => other.to_string(),
            };
            failed.push(format!("{} ({why})", d.crd));
        }
    }
    failed
}

// ---------------------------------------------------------------- finalizers

/// Does what `karpenter.sh/termination` guards for one machine: terminate its instance, confirm
/// `terminated` through EC2, then delete the Node and NodeClaim and remove exactly that
/// finalizer from each. Never strips a finalizer before the instance is gone.
pub async fn discharge_finalizers(ctx: &Ctx, machine: &str, params: &Params) -> Outcome {
    let claims: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &k8s::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(ctx.kube.client.clone());
    let (claim_name, mut node_name) = match machine.strip_prefix("node/") {
        Some(n) => (None, Some(n.to_string())),
        None => (Some(machine.to_string()), None),
    };
    let mut provider: Option<ProviderId> = None;
    let mut claim_exists = false;
    let mut claim_uid: Option<String> = None;
    let mut named_node: Option<Node> = None;
    let mut claim_read: Option<DynamicObject> = None;
    if let Some(c) = &claim_name {
        match claims.get_opt(c).await {
            Ok(Some(obj)) => {
                claim_exists = true;
                claim_uid = obj.metadata.uid.clone();
                provider = obj
                    .data
                    .pointer("/status/providerID")
                    .and_then(Value::as_str)
                    .and_then(|p| ProviderId::parse(p).ok());
                if node_name.is_none()
                    && let Some((n, read)) = node_of_claim(&ctx.kube.client, &obj).await?
                {
                    node_name = Some(n);
                    named_node = read;
                }
                claim_read = Some(obj);
            }
            Ok(None) => {}
            Err(e) => return Err(KubeError::api(format!("read NodeClaim {c}"), e).into()),
        }
    }
    let mut node_read = None;
    if let Some(n) = &node_name {
        // the Node the evidence rule just read is not read again
        let got = match named_node {
            Some(node) => Ok(Some(node)),
            None => nodes.get_opt(n).await,
        };
        match got {
            Ok(Some(node)) => {
                if provider.is_none() {
                    provider = node
                        .spec
                        .as_ref()
                        .and_then(|s| s.provider_id.as_deref())
                        .and_then(|p| ProviderId::parse(p).ok());
                }
                node_read = Some(node);
            }
            Ok(None) => node_name = None,
            Err(e) => return Err(KubeError::api(format!("read Node {n}"), e).into()),
        }
    }
    if provider.is_none() && node_name.is_none() && !claim_exists {
        // Karpenter (or an earlier run) finished this machine: nothing is left to guard
        return Ok(TaskOutcome::Skipped("already gone".into()));
    }
    let node_uid = node_read.as_ref().and_then(|node| node.metadata.uid.clone());
    // A node goes only once its fence has held a while and no pod a drain must move is on it,
    // however often its fence was lifted since its drain.
    let mut ready = match &node_name {
        Some(n) => match Box::pin(super::drain::hold_before_release(ctx, machine, n, node_read)).await? {
            Release::Stop(stop) => return Ok(stop),
            Release::Ready { fenced_since, abandoned } => Some((fenced_since, abandoned)),
            Release::Gone => None,
        },
        None => None,
    };
    // A claim that names no instance may still have one: EC2 decides, not the claim's silence.
    // First an instance Karpenter's tagging controller already tagged with the claim's name;
    // then one of a launch in flight when the controller went, which carries only the launch's
    // tags (`evidence::launch_of_claim` decides which is the claim's).
    let mut what = Vec::new();
    if provider.is_none()
        && let Some(c) = claim_name.as_deref().filter(|_| claim_exists)
    {
        // EC2's describe shows a launch late: a claim younger than EC2's allowance is looked up
        // only once it is old enough for its instance, if any, to show
        let created = claim_read.as_ref().and_then(|o| o.metadata.creation_timestamp.as_ref()).map(|t| t.0.as_second());
        if let Some(wait) = crate::evidence::until_a_launch_shows(created, unix_now()) {
            tracing::info!(
                seconds = wait.as_secs(),
                "the NodeClaim names no instance and is new; giving EC2 its time to show one"
            );
            if !pause(ctx, wait).await {
                return Ok(TaskOutcome::Interrupted);
            }
        }
        let found = ctx
            .aws
            .ec2
            .live_instances_tagged(&ctx.cluster, &[(karpenter::TAG_NODECLAIM, c)])
            .await
            .map_err(TaskError::from)?;
        match found.as_slice() {
            [] => {
                if let Some(obj) = &claim_read {
                    match launch_of_claim(ctx, c, obj).await? {
                        Ok(Some(one)) => {
                            tracing::info!(instance = %one.instance_id, "the NodeClaim names no instance, but EC2 holds one launched for it");
                            what.push(format!("instance {} found by its launch's tags", one.instance_id));
                            provider = Some(one);
                        }
                        Ok(None) => {}
                        Err(several) => return Ok(TaskOutcome::Failed(several)),
                    }
                }
            }
            [one] => {
                tracing::info!(instance = %one.id, "the NodeClaim names no instance, but EC2 holds one tagged for it");
                provider = Some(ProviderId { zone: one.zone.clone(), instance_id: one.id.clone() });
            }
            many => {
                let ids: Vec<&str> = many.iter().map(|i| i.id.as_str()).collect();
                return Ok(TaskOutcome::Failed(format!(
                    "NodeClaim {c} names no instance and EC2 holds {} tagged for it ({}): left for Karpenter or a person to decide",
                    ids.len(),
                    ids.join(", ")
                )));
            }
        }
    }
    if let Some(p) = &provider {
        loop {
            let guard = node_name.as_deref().zip(ready.take()).map(|(n, (held, abandoned))| {
                let (pods, node) = (ctx.pods.clone(), n.to_string());
                Box::new(move || {
                    super::drain::still_clear(&node, pods.fenced_since(&node), held, &pods.pods_on(&node), &abandoned)
                }) as super::batcher::Guard
            });
            tracing::debug!(instance = %p.instance_id, "node checked empty; asking for the termination");
            // the call may wait its turn for EC2's termination bucket (minutes at thousands of
            // machines), so an interrupt must not wait for it
            let sent = tokio::select! {
                _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
                r = ctx.ec2.terminate(&p.instance_id, guard) => match r {
                    Ok(sent) => sent,
                    Err(e) => return Ok(batch_failure(format!("terminate instance {}: {e}", p.instance_id), &e)),
                },
            };
            let Sent::Withdrawn(why) = sent else { break };
            // while it waited its turn, its node was opened again: check it, drain it, again
            let Some(n) = node_name.as_deref() else { break };
            tracing::warn!(node = %n, why = %why, "the termination was withdrawn; checking the node again");
            ready = match Box::pin(super::drain::hold_before_release(ctx, machine, n, None)).await? {
                Release::Stop(stop) => return Ok(stop),
                Release::Ready { fenced_since, abandoned } => Some((fenced_since, abandoned)),
                Release::Gone => None,
            };
        }
        tracing::debug!(instance = %p.instance_id, "termination accepted");
        // EC2 accepted the termination: the instance is shutting down, which nothing undoes. The
        // Node goes now, not once EC2 shows it terminated (a minute or more later), so that
        // nothing can be bound to it meanwhile; the NodeClaim keeps its finalizer, and with it
        // the instance's name for a resumed run, until the instance is confirmed terminated.
        if let Some(n) = &node_name {
            release_node(ctx, &nodes, n, node_uid.as_deref(), true, &mut what).await?;
        }
        let limit = params.deadline.unwrap_or(Duration::from_secs(600));
        tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(TaskOutcome::Interrupted),
            r = tokio::time::timeout(limit, ctx.ec2.wait_terminated(&p.instance_id)) => match r {
                Ok(Ok(())) => {
                    tracing::debug!(instance = %p.instance_id, "termination confirmed");
                    what.insert(0, format!("instance {} terminated", p.instance_id));
                }
                Ok(Err(e)) => return Ok(batch_failure(format!("confirm termination of {}: {e}", p.instance_id), &e)),
                Err(_) => return Ok(TaskOutcome::Failed(format!("instance {} not terminated after {}", p.instance_id, humantime::format_duration(limit)))),
            },
        }
    } else {
        what.push("no instance (never launched)".into());
        // EC2 may show its launch later still: its class, told so before the claim goes (and so
        // across a killed run), takes a second look before it goes
        if let Some(obj) = claim_read.as_ref().filter(|_| claim_exists) {
            remember_unseen_launch(ctx, obj).await?;
        }
        if let Some(n) = &node_name {
            release_node(ctx, &nodes, n, node_uid.as_deref(), false, &mut what).await?;
        }
    }
    // The instance is gone: now, and only now, its NodeClaim may go, and only the one that was
    // read (a NodeClaim of the same name made since is another machine's)
    if let Some(c) = &claim_name {
        let uid = claim_uid.as_deref();
        match delete_and_remove_finalizer(&claims, c, karpenter::FINALIZER_TERMINATION, uid).await? {
            FinalizerRemoval::Replaced => {
                what.push(format!("NodeClaim {c} was replaced by another object: left alone"))
            }
            _ => what.push(format!("NodeClaim {c} released")),
        }
    }
    Ok(TaskOutcome::Done(what.join("; ")))
}

/// Seconds since the epoch, as the API server's timestamps count them.
fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The instance of a launch in flight for claim `name` (`obj`), which names none: EC2's live
/// instances launched for its pool and class, less those a Node or another NodeClaim names, as
/// `evidence::launch_of_claim` rules. `Err` names the instances when several fit.
async fn launch_of_claim(
    ctx: &Ctx,
    name: &str,
    obj: &DynamicObject,
) -> Result<Result<Option<ProviderId>, String>, TaskError> {
    let pool = obj.metadata.labels.as_ref().and_then(|l| l.get(karpenter::LABEL_NODEPOOL)).map(String::as_str);
    let class = obj.data.pointer("/spec/nodeClassRef/name").and_then(Value::as_str);
    let launch = crate::evidence::Launch {
        claim: name,
        nodepool: pool,
        nodeclass: class,
        created: obj.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second()),
    };
    let (Some(pool), Some(class)) = (pool, class) else { return Ok(Ok(None)) };
    let launch_tags = [(karpenter::TAG_NODEPOOL, pool), (karpenter::TAG_NODECLASS, class)];
    let live = ctx.aws.ec2.live_instances_tagged(&ctx.cluster, &launch_tags).await.map_err(TaskError::from)?;
    if live.is_empty() {
        return Ok(Ok(None));
    }
    // every instance a Node or a NodeClaim names is theirs, whatever its tags say
    let holders = super::inventory::cluster_holders(&ctx.kube.client).await?;
    let named: std::collections::BTreeSet<&str> = holders.instances.keys().map(String::as_str).collect();
    let launched: Vec<crate::evidence::Launched<'_>> = live.iter().map(launched_of).collect();
    Ok(match crate::evidence::launch_of_claim(launch, &launched, &named) {
        crate::evidence::LaunchMatch::One(id) => {
            let zone = live.iter().find(|i| i.id == id).map(|i| i.zone.clone()).unwrap_or_default();
            Ok(Some(ProviderId { zone, instance_id: id }))
        }
        crate::evidence::LaunchMatch::Nothing => Ok(None),
        crate::evidence::LaunchMatch::Several(ids) => Err(format!(
            "NodeClaim {name} names no instance and EC2 holds {} launched for its NodePool and EC2NodeClass since it was made ({}), none named by a Node or claim: which is its cannot be told; left for verification (--reclaim) or a person",
            ids.len(),
            ids.join(", ")
        )),
    })
}

/// Deletes a machine's Node (the one that was read: a Node of the same name made since is another
/// machine's) once its instance is shutting down, and, when it had an instance (`had_instance`),
/// names any pod that went down with it: bound since the node was checked empty, it is counted
/// and the run is not clean.
async fn release_node(
    ctx: &Ctx,
    nodes: &Api<Node>,
    n: &str,
    uid: Option<&str>,
    had_instance: bool,
    what: &mut Vec<String>,
) -> Result<(), TaskError> {
    match delete_and_remove_finalizer(nodes, n, karpenter::FINALIZER_TERMINATION, uid).await? {
        FinalizerRemoval::Replaced => {
            what.push(format!("Node {n} was replaced by another object: left alone"));
            return Ok(());
        }
        _ => what.push(format!("Node {n} released")),
    }
    if !had_instance {
        return Ok(());
    }
    let pods: Api<Pod> = Api::all(ctx.kube.client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={n}"));
    let on_node = pods.list(&lp).await.map_err(|e| KubeError::api(format!("list the pods on node {n}"), e))?;
    let lost = {
        let abandoned = ctx.abandoned.lock().unwrap_or_else(|p| p.into_inner());
        super::drain::must_leave_before_release(&on_node.items, &abandoned)
    };
    if !lost.is_empty() {
        what.push(format!("{} pod(s) went down with node {n}", lost.len()));
    }
    ctx.note_lost(n, &lost);
    Ok(())
}

// ---------------------------------------------------------------- pools, classes, waits

/// Deletes one NodePool, or all of them.
pub async fn delete_nodepools(ctx: &Ctx, object: Option<&str>) -> Outcome {
    let ar = k8s::nodepool_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    let names = match object {
        Some(o) => vec![o.to_string()],
        None => list_dynamic(&ctx.kube.client, &ar)
            .await?
            .into_iter()
            .filter(|p| pool_owner(p).is_ok())
            .filter_map(|o| o.metadata.name)
            .collect(),
    };
    let mut deleted = 0;
    for n in &names {
        if delete_if_present(&api, n).await? {
            deleted += 1;
        }
    }
    Ok(TaskOutcome::Done(format!("{deleted} NodePool(s) deleted")))
}

/// Waits until no NodeClaim is left (Karpenter doing the work), up to the deadline; then
/// either fails or lets the later steps do what is left.
pub async fn wait_nodeclaims_gone(ctx: &Ctx, params: &Params) -> Outcome {
    let limit = params.deadline.unwrap_or(Duration::from_secs(900));
    let start = Instant::now();
    loop {
        let left = match list_dynamic(&ctx.kube.client, &k8s::nodeclaim_resource()).await {
            // only this controller's claims: EKS Auto Mode's stay as long as the cluster does
            Ok(l) => l
                .iter()
                .filter(|c| {
                    let labels = c.metadata.labels.clone().unwrap_or_default();
                    claim_owner(c, &labels, &ctx.foreign_pools).is_ok()
                })
                .count(),
            // a passing error must not restart the wait (and its deadline): look again shortly
            Err(KubeError::Api { source, .. }) if k8s::is_transient(&source) => {
                if !pause(ctx, Duration::from_millis(500)).await {
                    return Ok(TaskOutcome::Interrupted);
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if left == 0 {
            return Ok(TaskOutcome::Done(format!(
                "Karpenter removed every NodeClaim in {:.1}s",
                start.elapsed().as_secs_f64()
            )));
        }
        if start.elapsed() >= limit {
            let msg = format!("{left} NodeClaim(s) left after {}", humantime::format_duration(limit));
            return Ok(match params.on_deadline {
                OnDeadline::Fail => TaskOutcome::Blocked(msg),
                _ => TaskOutcome::Done(format!("{msg}; the next steps take over")),
            });
        }
        if !pause(ctx, Duration::from_secs(1)).await {
            return Ok(TaskOutcome::Interrupted);
        }
    }
}

/// Deletes one EC2NodeClass (or all): waits until no NodeClaim references it, deletes its
/// launch templates and instance profiles, then removes `karpenter.k8s.aws/termination`.
pub async fn delete_nodeclasses(ctx: &Ctx, object: Option<&str>, params: &Params) -> Outcome {
    let ar = k8s::nodeclass_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    let classes = list_dynamic(&ctx.kube.client, &ar)
        .await?
        .into_iter()
        .filter(|c| object.is_none_or(|o| c.metadata.name.as_deref() == Some(o)))
        .collect::<Vec<_>>();
    let limit = params.deadline.unwrap_or(Duration::from_secs(300));
    let mut done = Vec::new();
    for class in classes {
        let name = class.metadata.name.clone().unwrap_or_default();
        let start = Instant::now();
        loop {
            // the claims alone say which machines still use the class (a Node without a claim
            // references none), so the nodes and the controller are not read again
            let claimed = Inventory::read_claimed_machines(&ctx.kube.client).await?;
            let users: Vec<&Machine> = claimed.iter().filter(|m| m.nodeclass.as_deref() == Some(&name)).collect();
            if users.is_empty() {
                break;
            }
            // a machine launched during the run: its drain and release are the plan's own steps' tasks
            let late = found_late(ctx, &users, &format!("it uses EC2NodeClass {name}"));
            if !late.is_empty() {
                return Ok(TaskOutcome::FoundLate(late));
            }
            let users = users.len();
            if start.elapsed() >= limit {
                return Ok(TaskOutcome::Failed(format!("EC2NodeClass {name} is still used by {users} NodeClaim(s)")));
            }
            if !pause(ctx, Duration::from_secs(1)).await {
                return Ok(TaskOutcome::Interrupted);
            }
        }
        if let Some(stop) = unseen_launch_shown(ctx, &name).await? {
            return Ok(stop);
        }
        delete_if_present(&api, &name).await?;
        let uid = class.metadata.uid.clone().unwrap_or_default();
        // A class with spec.instanceProfile runs on a profile the user manages: status names it
        // too, and Karpenter never deletes it, so neither does the tool.
        let user_managed = class.data.pointer("/spec/instanceProfile").and_then(Value::as_str).is_some();
        let status_profile = class.data.pointer("/status/instanceProfile").and_then(Value::as_str).map(str::to_string);
        let lts = ctx.aws.ec2.launch_templates(&ctx.cluster).await?;
        let mut removed = 0;
        for lt in lts.iter().filter(|l| l.nodeclass.as_deref() == Some(&name)) {
            ctx.aws.ec2.delete_launch_template(&lt.id).await?;
            removed += 1;
        }
        let profiles = ctx.aws.iam.cluster_instance_profiles(&ctx.region, &ctx.cluster).await?;
        let of_this_class = |p: &&crate::aws::InstanceProfileInfo| {
            !user_managed
                && !ctx.user_instance_profiles.contains(&p.name)
                && (p.nodeclass == name
                    || (!uid.is_empty() && p.path.contains(&uid))
                    || status_profile.as_deref() == Some(&p.name))
        };
        for p in profiles.iter().filter(of_this_class) {
            ctx.aws.iam.delete_instance_profile(p).await?;
            removed += 1;
        }
        remove_finalizer(&api, &name, karpenter::FINALIZER_NODECLASS).await?;
        done.push(format!("{name} ({removed} launch template(s)/instance profile(s))"));
    }
    Ok(TaskOutcome::Done(format!("EC2NodeClass(es) deleted: {}", done.join(", "))))
}

/// Tells the claim's EC2NodeClass that the claim `obj` is released with no instance found
/// ([`crate::evidence::UnseenLaunch`], an annotation: the class's deletion takes a second look
/// for its launch, also in a run resumed after this one was killed). A class that is gone needs
/// no telling; a claim that names none is every class's (its schema requires one, so a missing
/// one is a claim the tool cannot place).
async fn remember_unseen_launch(ctx: &Ctx, obj: &DynamicObject) -> Result<(), TaskError> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let record = crate::evidence::UnseenLaunch {
        claim: name.clone(),
        nodepool: obj.metadata.labels.as_ref().and_then(|l| l.get(karpenter::LABEL_NODEPOOL)).cloned(),
        created: obj.metadata.creation_timestamp.as_ref().map_or(0, |t| t.0.as_second()),
    };
    let ar = k8s::nodeclass_resource();
    let classes = match obj.data.pointer("/spec/nodeClassRef/name").and_then(Value::as_str) {
        Some(c) => vec![c.to_string()],
        None => list_dynamic(&ctx.kube.client, &ar).await?.into_iter().filter_map(|c| c.metadata.name).collect(),
    };
    let value = serde_json::to_string(&record)
        .map_err(|e| KubeError::api("write the unseen launch", kube::Error::SerdeError(e)))?;
    let patch = json!({"metadata": {"annotations": {crate::evidence::unseen_launch_key(&name): value}}});
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &ar);
    for class in classes {
        match api.patch(&class, &patch_params(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            Err(e) if status_code(&e) == Some(404) => {}
            Err(e) => {
                return Err(KubeError::api(
                    format!("note on EC2NodeClass {class} that NodeClaim {name} had no instance"),
                    e,
                )
                .into());
            }
        }
    }
    Ok(())
}

/// When a NodeClaim of `class` was released with no instance found (its annotations say so),
/// the class goes only once EC2 has had a second allowance to show that launch: an instance
/// that may be it (`evidence::launches_shown`) keeps the class, its launch templates and its
/// instance profile (blocked, naming it), so that verification and `verify --reclaim` still have
/// the evidence they need. `None`: the class may go.
async fn unseen_launch_shown(ctx: &Ctx, class: &str) -> Result<Option<TaskOutcome>, TaskError> {
    let api: Api<DynamicObject> = Api::all_with(ctx.kube.client.clone(), &k8s::nodeclass_resource());
    let Some(read) = api.get_opt(class).await.map_err(|e| KubeError::api(format!("read EC2NodeClass {class}"), e))?
    else {
        return Ok(None);
    };
    let launches = crate::evidence::unseen_launches(read.metadata.annotations.iter().flatten());
    if launches.is_empty() {
        return Ok(None);
    }
    if let Some(wait) = crate::evidence::until_the_class_may_go(&launches, unix_now()) {
        tracing::info!(
            seconds = wait.as_secs(),
            "a NodeClaim of the class was released with no instance found; giving EC2 its time to show one"
        );
        if !pause(ctx, wait).await {
            return Ok(Some(TaskOutcome::Interrupted));
        }
    }
    let live = ctx
        .aws
        .ec2
        .live_instances_tagged(&ctx.cluster, &[(karpenter::TAG_NODECLASS, class)])
        .await
        .map_err(TaskError::from)?;
    if live.is_empty() {
        return Ok(None);
    }
    let holders = super::inventory::cluster_holders(&ctx.kube.client).await?;
    let named: BTreeSet<&str> = holders.instances.keys().map(String::as_str).collect();
    let launched: Vec<crate::evidence::Launched<'_>> = live.iter().map(launched_of).collect();
    let shown = crate::evidence::launches_shown(&launches, class, &launched, &named);
    if shown.is_empty() {
        return Ok(None);
    }
    let pairs: Vec<String> = shown.iter().map(|(i, c)| format!("{i} (NodeClaim {c}'s?)")).collect();
    Ok(Some(TaskOutcome::Blocked(format!(
        "EC2NodeClass {class} kept, with its launch templates and instance profile: EC2 now shows {} instance(s) \
         that may be the launch of a NodeClaim released with no instance found, and no Node or NodeClaim names: {}. \
         `verify --reclaim` terminates them (the class's launch templates are its evidence); then run again",
        pairs.len(),
        pairs.join(", ")
    ))))
}

/// What `evidence` weighs of one live instance.
fn launched_of(i: &crate::aws::InstanceInfo) -> crate::evidence::Launched<'_> {
    crate::evidence::Launched {
        id: &i.id,
        nodepool: i.tag(karpenter::TAG_NODEPOOL),
        nodeclass: i.tag(karpenter::TAG_NODECLASS),
        nodeclaim: i.tag(karpenter::TAG_NODECLAIM),
        launched: i.launched,
    }
}

/// The NodeClaims of `claimed` the graph has no tasks for: launched during the run, by a
/// controller that was not fenced or a launch in flight when the controller went. The step that
/// finds one hands it to the executor, which runs the plan's machine steps for it.
fn found_late(ctx: &Ctx, claimed: &[&Machine], found: &str) -> Vec<LateMachine> {
    claimed
        .iter()
        .filter(|m| !ctx.knows(&m.name))
        .map(|m| LateMachine {
            name: m.name.clone(),
            why: format!(
                "NodeClaim {} is not in the run's inventory: launched during the run (a controller that was not \
                 fenced, or a launch in flight when it went); {found}",
                m.name
            ),
        })
        .collect()
}

// ---------------------------------------------------------------- verify

/// Proves through EC2 (two reads, the second `settle` after the controller was seen gone or after
/// the first) and the API that nothing is left; reclaims the AWS leftovers when asked and
/// verifies again.
pub async fn verify_step(ctx: &Ctx, params: &Params) -> Outcome {
    let claimed = Inventory::read_claimed_machines(&ctx.kube.client).await?;
    let late = found_late(ctx, &claimed.iter().collect::<Vec<_>>(), "it was still there when verification began");
    if !late.is_empty() {
        return Ok(TaskOutcome::FoundLate(late));
    }
    let quiet_since = ctx.controller_gone_at.get().copied();
    let mut left =
        verify::verify(&ctx.aws, &ctx.cluster, &ctx.user_instance_profiles, params.settle, quiet_since).await?;
    let mut reclaimed = Vec::new();
    let mut refused = None;
    let mut classes = BTreeSet::new();
    if !left.is_clean() && ctx.reclaim {
        // The same rule as `verify --reclaim`, whatever the plan: an instance a Node or NodeClaim
        // of this cluster still stands for needs a drain, not a termination from AWS alone; and
        // an EC2NodeClass that is still there still launches with its templates and profiles.
        let holders = super::inventory::cluster_holders(&ctx.kube.client).await?;
        classes = holders.nodeclasses.clone();
        let seen = verify::ClusterSeen::Live(holders);
        refused = verify::reclaim_refusal(&left, &seen, &ctx.cluster, None);
    }
    if let Some(refusal) = &refused {
        tracing::error!(%refusal, "nothing reclaimed");
        ctx.note(BlockerKind::Reclaim, "reclaim", refusal.to_string());
    } else if !left.is_clean() && ctx.reclaim {
        let to_reclaim = left.clone().without_live_classes(&classes);
        reclaimed = to_reclaim.describe();
        for f in verify::reclaim(&ctx.aws, &to_reclaim).await? {
            ctx.note(BlockerKind::Reclaim, &f, "could not be reclaimed");
        }
        // what was just terminated must have had its time to show, whatever the controller did
        left = verify::verify(&ctx.aws, &ctx.cluster, &ctx.user_instance_profiles, params.settle, None).await?;
    }
    left.add_volumes(ctx.aws.ec2.volumes_of_volume_claims(&ctx.volumes).await?);
    left.objects = Inventory::read_objects(&ctx.kube.client).await?.object_names();
    let clean = left.is_clean();
    let lines = left.describe();
    ctx.events.send(EngineEvent::Verified { leftovers: left, reclaimed });
    Ok(match refused {
        Some(refusal) => TaskOutcome::Blocked(refusal.to_string()),
        None if clean => TaskOutcome::Done("nothing left".into()),
        None => TaskOutcome::Leftovers(lines.join("; ")),
    })
}

#[cfg(test)]
mod future_sizes {
    use super::*;
    use crate::engine::drain::drain;
    use crate::engine::events::TaskRef;
    use crate::plan::TaskNode;

    /// The size of the future `f` returns for arguments `A`, without calling it.
    fn size<A, F: Future>(_: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every machine's drain is in flight at once, each in a task that holds its future from
    /// the moment it is spawned: at 5,000 machines a task of 7 KB (its state sized for the
    /// largest action and the largest request) cost 35 MB of the tool's peak.
    #[test]
    fn a_drain_task_stays_small_while_it_waits() {
        // the lifetimes do not change a future's size; 'static names them without values
        let task =
            size::<(&'static Ctx, &'static TaskNode), _>(|(ctx, node)| crate::engine::run_with_retries(ctx, node));
        let drain = size::<(&'static Ctx, &'static str, &'static Params, &'static TaskRef), _>(
            |(ctx, machine, params, task)| drain(ctx, machine, params, task),
        );
        assert!(task <= 1024, "a task's future is {task} bytes: box the action it awaits");
        assert!(drain <= 2048, "a drain's future is {drain} bytes: box the request it awaits");
    }
}
