//! Loading a [`Snapshot`] into the sandbox: an API server holding the same objects (Karpenter's
//! own CRDs included), the simulated Karpenter at the same release and liveness, and a private
//! LocalStack account seeded with the same instances, launch templates and instance profiles.
//!
//! The objects go straight into the server's store before its control plane starts
//! ([`sandbox_apiserver::Store::restore`]): they keep their status and field managers, the
//! controllers then find every workload with its pods already placed, and nothing is
//! rescheduled. Uids change (the owner references are rewritten to the new ones), and so do
//! instance ids (LocalStack picks them; Nodes and NodeClaims are rewritten to the new ids, and
//! [`Copy::live_id`] maps back for the report).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use sandbox_apiserver::{ApiServer, GroupResource, ServerOptions, Store};
use sandbox_sim::cloud::Cloud;
use sandbox_sim::naming::{IMAGE_ID, INSTANCE_TYPE};
use sandbox_sim::{KarpenterVersion, SimController, SimSettings};
use serde_json::{Value, json};

use super::RehearseError;
use crate::karpenter::ProviderId;
use crate::snapshot::{RawObject, Snapshot};

/// Concurrent LocalStack calls while seeding.
const SEED_CONCURRENCY: usize = 16;

/// How to build the copy.
#[derive(Debug, Clone)]
pub(crate) struct LoadOptions {
    /// The sandbox clock: grace periods and Karpenter's delays are multiplied by it.
    pub time_scale: f64,
    /// The LocalStack to seed (never the AWS the snapshot came from).
    pub localstack: String,
    /// Port of the API server (0: any free one).
    pub port: u16,
}

/// A running copy of the snapshot's cluster.
pub(crate) struct Copy {
    /// The API server.
    pub server: ApiServer,
    /// The simulated Karpenter (active only while its Deployment has a ready replica, as the
    /// real one is only there when it runs).
    pub sim: SimController,
    /// The private LocalStack account, through the simulation's own calls.
    pub cloud: Cloud,
    /// Its SDK configuration, for the teardown's own clients.
    pub sdk: aws_config::SdkConfig,
    /// The account id LocalStack files everything under.
    pub account: String,
    /// The account the snapshot was read from.
    pub live_account: String,
    /// The release the simulation imitates.
    pub version: KarpenterVersion,
    /// live instance id → the copy's.
    pub instances: BTreeMap<String, String>,
    /// Objects loaded.
    pub objects: usize,
}

impl Copy {
    /// Replaces the copy's instance ids and account in `text` with the live ones.
    pub(crate) fn to_live_ids(&self, text: &str) -> String {
        let mut out = text.replace(self.account.as_str(), &self.live_account);
        for (live, copy) in &self.instances {
            if out.contains(copy.as_str()) {
                out = out.replace(copy.as_str(), live);
            }
        }
        out
    }

    /// Stops the simulation and the server, and terminates what was seeded in LocalStack.
    pub(crate) async fn shutdown(self) {
        self.sim.shutdown().await;
        self.server.shutdown().await;
        let ids: Vec<String> = self.instances.values().cloned().collect();
        if let Err(e) = self.cloud.terminate(&ids).await {
            tracing::warn!(error = %e, "could not terminate the rehearsal's instances in LocalStack");
        }
    }
}

/// The release the simulation imitates for a snapshot: 1.0.x when the controller says so or the
/// CRDs still route conversion through its webhook; the current behaviour otherwise.
pub(crate) fn simulated_version(snap: &Snapshot) -> KarpenterVersion {
    let says_1_0 = snap.karpenter.version.as_deref().is_some_and(|v| v == "1.0" || v.starts_with("1.0."));
    if says_1_0 || snap.karpenter.conversion_webhook { KarpenterVersion::V1_0 } else { KarpenterVersion::V1_14 }
}

/// A LocalStack account of its own for this rehearsal: twelve digits, which LocalStack takes as
/// the account id, so nothing seeded here meets anything else in the same LocalStack.
fn private_account() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let n = (nanos ^ (u128::from(std::process::id()) << 20)) % 100_000_000_000;
    format!("7{n:011}")
}

/// Builds the copy. The snapshot's Kubernetes objects are moved into the copy (its lists are
/// left empty), so a large cluster is not held twice.
pub(crate) async fn load(snap: &mut Snapshot, opts: &LoadOptions) -> Result<Copy, RehearseError> {
    let account = private_account();
    let sdk = sandbox_sim::localstack::config_at(&opts.localstack, &snap.region, &account).await;
    let cloud = Cloud::from_config(&sdk);
    cloud
        .ping()
        .await
        .map_err(|e| RehearseError::LocalStack { endpoint: opts.localstack.clone(), detail: e.to_string() })?;
    let instances = seed_aws(snap, &cloud).await?;
    let version = simulated_version(snap);
    let pods_per_node = pods_per_node(snap);
    let mut server = ApiServer::start(ServerOptions {
        port: opts.port,
        time_scale: opts.time_scale,
        control_plane: false,
        ..ServerOptions::default()
    })
    .await?;
    let objects = match restore_objects(snap, &server.store(), &instances) {
        Ok(n) => n,
        Err(e) => {
            server.shutdown().await;
            return Err(e);
        }
    };
    // the copy starts as the live cluster is: its objects long there, no history of their making
    server.store().forget_history();
    server.start_control_plane();
    let client = kube::Client::try_from(server.kube_config())
        .map_err(|e| RehearseError::Load { what: "a client for the copy".into(), detail: e.to_string() })?;
    // EKS of the copy's account knows the copy as the cluster, as EKS knows the live one: the
    // identity the rehearsed run proves is the copy's own, and Auto Mode is on where the copy
    // holds Auto Mode's compute (the live cluster's EKS said so, or the live run is refused)
    let auto_mode = match crate::engine::inventory::Inventory::read_objects(&client).await {
        Ok(inv) => inv.not_ours.iter().any(|f| f.why == crate::karpenter::NotOurs::EksAutoMode),
        Err(e) => {
            server.shutdown().await;
            return Err(RehearseError::Load { what: "the copy's Karpenter objects".into(), detail: e.to_string() });
        }
    };
    let eks = sandbox_sim::cloud::EksSpec { endpoint: server.url(), auto_mode, ..Default::default() };
    if let Err(e) = cloud.register_eks_cluster(&snap.cluster, &eks).await {
        server.shutdown().await;
        return Err(RehearseError::LocalStack { endpoint: opts.localstack.clone(), detail: e.to_string() });
    }
    let (namespace, deployment) = snap
        .karpenter
        .controller
        .as_deref()
        .and_then(|c| c.split_once('/'))
        .map(|(n, d)| (n.to_string(), d.to_string()))
        .unwrap_or_else(|| ("kube-system".into(), "karpenter".into()));
    let mut sim = SimController::start(
        client,
        cloud.clone(),
        SimSettings {
            version,
            time_scale: opts.time_scale,
            pods_per_node,
            namespace,
            deployment,
            ..SimSettings::new(&snap.cluster, &snap.region)
        },
    );
    // the simulation reads its Deployment's readiness once it has synced: wait for that, so the
    // rehearsal starts with Karpenter as live as the snapshot showed it
    let live = snap.karpenter.ready_replicas > 0;
    sim.wait_active(live, Duration::from_secs(10)).await;
    Ok(Copy { server, sim, cloud, sdk, account, live_account: snap.account.clone(), version, instances, objects })
}

/// The workload pods a Karpenter node has room for: the most common `allocatable.pods` of the
/// snapshot's Karpenter nodes, less the DaemonSet pod.
fn pods_per_node(snap: &Snapshot) -> u32 {
    let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
    for n in snap.karpenter_nodes() {
        let pods = n["status"]["allocatable"]["pods"]
            .as_str()
            .and_then(|p| p.parse::<u32>().ok())
            .or_else(|| n["status"]["allocatable"]["pods"].as_u64().and_then(|p| u32::try_from(p).ok()));
        if let Some(p) = pods {
            *counts.entry(p).or_default() += 1;
        }
    }
    counts.into_iter().max_by_key(|(_, n)| *n).map(|(p, _)| p.saturating_sub(1).max(1)).unwrap_or(4)
}

/// Seeds the private account: every live instance (with its tags, in its zone), launch template
/// and instance profile. Returns live id → copy id.
async fn seed_aws(snap: &Snapshot, cloud: &Cloud) -> Result<BTreeMap<String, String>, RehearseError> {
    let seed_err = |what: &str, e: sandbox_sim::cloud::CloudError| RehearseError::Load {
        what: format!("LocalStack: {what}"),
        detail: e.to_string(),
    };
    let live: Vec<_> = snap.aws.instances.iter().filter(|i| i.state != "terminated").collect();
    let pairs: Vec<(String, String)> = stream::iter(live)
        .map(|i| async move {
            let zone = Some(i.zone.as_str()).filter(|z| !z.is_empty());
            let launched = cloud.launch_tagged(IMAGE_ID, INSTANCE_TYPE, zone, 1, &i.tags).await?;
            Ok::<_, sandbox_sim::cloud::CloudError>((
                i.id.clone(),
                launched.first().map(|l| l.id.clone()).unwrap_or_default(),
            ))
        })
        .buffer_unordered(SEED_CONCURRENCY)
        .try_collect()
        .await
        .map_err(|e| seed_err("launch the instances", e))?;
    for t in &snap.aws.launch_templates {
        cloud
            .create_launch_template(&t.name, IMAGE_ID, &t.tags)
            .await
            .map_err(|e| seed_err(&format!("launch template {}", t.name), e))?;
    }
    for p in &snap.aws.instance_profiles {
        cloud
            .create_instance_profile(&p.name, &p.path, &p.tags)
            .await
            .map_err(|e| seed_err(&format!("instance profile {}", p.name), e))?;
    }
    seed_profile_roles(&snap.aws.instance_profiles, cloud).await?;
    Ok(pairs.into_iter().filter(|(_, c)| !c.is_empty()).collect())
}

/// The roles the copy's instance profiles must hold, and each (profile, role) to attach: the
/// live profiles' own. A profile Karpenter made holds the node role, and the teardown removes it
/// (`RemoveRoleFromInstanceProfile`) because IAM refuses to delete a profile that still has one
/// (`DeleteConflict`, https://docs.aws.amazon.com/IAM/latest/APIReference/API_DeleteInstanceProfile.html);
/// without it in the copy that call is missing from the prediction.
fn profile_roles(profiles: &[crate::snapshot::SnapInstanceProfile]) -> (BTreeSet<&str>, Vec<(&str, &str)>) {
    let attach: Vec<(&str, &str)> =
        profiles.iter().flat_map(|p| p.roles.iter().map(move |r| (p.name.as_str(), r.as_str()))).collect();
    (attach.iter().map(|(_, r)| *r).collect(), attach)
}

/// Creates the live profiles' roles in the copy's account (trusting EC2, as a node role does)
/// and puts each in its profiles.
async fn seed_profile_roles(
    profiles: &[crate::snapshot::SnapInstanceProfile],
    cloud: &Cloud,
) -> Result<(), RehearseError> {
    let err = |what: String, e: String| RehearseError::Load { what: format!("LocalStack: {what}"), detail: e };
    let (roles, attach) = profile_roles(profiles);
    let iam = cloud.iam_sdk();
    let trust = json!({"Version": "2012-10-17", "Statement": [{"Effect": "Allow",
        "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]})
    .to_string();
    for role in roles {
        match iam.create_role().role_name(role).assume_role_policy_document(&trust).send().await {
            Ok(_) => {}
            // the account is the copy's own: a role already there is an earlier copy's of it
            Err(e) if e.as_service_error().is_some_and(|s| s.is_entity_already_exists_exception()) => {}
            Err(e) => return Err(err(format!("role {role}"), aws_sdk_iam::error::DisplayErrorContext(e).to_string())),
        }
    }
    for (profile, role) in attach {
        iam.add_role_to_instance_profile().instance_profile_name(profile).role_name(role).send().await.map_err(
            |e| err(format!("role {role} in {profile}"), aws_sdk_iam::error::DisplayErrorContext(e).to_string()),
        )?;
    }
    Ok(())
}

fn gr_of(obj: &Value, plural: &str) -> GroupResource {
    let api_version = obj["apiVersion"].as_str().unwrap_or("v1");
    let group = api_version.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
    GroupResource::new(group, plural)
}

/// Restores every object, owners first, and returns how many.
fn restore_objects(
    snap: &mut Snapshot,
    store: &Store,
    instances: &BTreeMap<String, String>,
) -> Result<usize, RehearseError> {
    let mut uids: BTreeMap<String, String> = BTreeMap::new();
    let mut count = 0;
    // Karpenter 1.0.x: the storage version of each object is invisible through the API; when a
    // CRD says objects may still be stored at another version, assume they are (the worse case:
    // reading them needs the webhook)
    let stored_old: BTreeMap<String, String> = snap
        .kubernetes
        .crds
        .iter()
        .map(RawObject::value)
        .filter(|c| c["spec"]["conversion"]["strategy"] == "Webhook")
        .filter_map(|c| {
            let group = c["spec"]["group"].as_str()?;
            let storage = c["spec"]["versions"].as_array()?.iter().find(|v| v["storage"] == true)?["name"].as_str()?;
            let old =
                c["status"]["storedVersions"].as_array()?.iter().filter_map(Value::as_str).find(|v| *v != storage)?;
            Some((c["spec"]["names"]["plural"].as_str()?.to_string(), format!("{group}/{old}")))
        })
        .collect();
    let taken_at = snap.taken_at.clone();
    let gitops_crds = sandbox_sim::gitops::crds();
    for (plural, list) in snap.kubernetes.take_kinds() {
        if plural == "gitops" && !list.is_empty() {
            for crd in &gitops_crds {
                restore(
                    store,
                    &GroupResource::new("apiextensions.k8s.io", "customresourcedefinitions"),
                    crd.clone(),
                    &mut uids,
                )?;
            }
        }
        // each object is parsed only as it goes into the store, and its text dropped then
        for raw in list {
            let mut obj = raw.value();
            drop(raw);
            rewrite_owners(&mut obj, &uids);
            rewrite_provider_id(&mut obj, instances);
            if plural == "pods" {
                grace_left_at(&mut obj, &taken_at);
            }
            let resource = if plural == "gitops" { gitops_plural(&obj) } else { plural.to_string() };
            if let Some(v) = stored_old.get(&resource) {
                obj["apiVersion"] = json!(v);
            }
            let gr = if plural == "customresourcedefinitions" {
                GroupResource::new("apiextensions.k8s.io", plural)
            } else {
                gr_of(&obj, &resource)
            };
            restore(store, &gr, obj, &mut uids)?;
            count += 1;
        }
    }
    Ok(count)
}

fn gitops_plural(obj: &Value) -> String {
    let kind = obj["kind"].as_str().unwrap_or_default();
    crate::gitops::OwnerKind::ALL
        .iter()
        .find(|k| k.kind() == kind)
        .map(|k| k.plural().to_string())
        .unwrap_or_else(|| format!("{}s", kind.to_lowercase()))
}

fn restore(
    store: &Store,
    gr: &GroupResource,
    obj: Value,
    uids: &mut BTreeMap<String, String>,
) -> Result<(), RehearseError> {
    let old_uid = obj["metadata"]["uid"].as_str().map(str::to_string);
    let ns = obj["metadata"]["namespace"].as_str().unwrap_or_default().to_string();
    let name = obj["metadata"]["name"].as_str().unwrap_or_default().to_string();
    match store.restore(gr, &ns, obj) {
        Ok(created) => {
            if let (Some(old), Some(new)) = (old_uid, created["metadata"]["uid"].as_str()) {
                uids.insert(old, new.to_string());
            }
            Ok(())
        }
        // the server makes its own default namespaces
        Err(e) if e.code == 409 && gr.resource == "namespaces" => Ok(()),
        Err(e) => Err(RehearseError::Load {
            what: format!("{} {}", gr.resource, if ns.is_empty() { name } else { format!("{ns}/{name}") }),
            detail: e.message.clone(),
        }),
    }
}

/// Points owner references at the copy's uids; a reference to an owner the snapshot does not
/// hold (a Job, a kind it does not copy) is dropped, since the copy's garbage collector would
/// otherwise take the object for an orphan.
fn rewrite_owners(obj: &mut Value, uids: &BTreeMap<String, String>) {
    let Some(refs) = obj["metadata"]["ownerReferences"].as_array_mut() else { return };
    refs.retain_mut(|r| match r["uid"].as_str().and_then(|u| uids.get(u)) {
        Some(new) => {
            r["uid"] = json!(new);
            true
        }
        None => false,
    });
}

/// Gives a pod that was terminating when the snapshot was taken what was left of its grace
/// period then, as its `deletionGracePeriodSeconds`: the copy's kubelet counts that down from the
/// moment the copy starts, as the real one was counting down to the pod's `deletionTimestamp`
/// (the moment of the delete plus its grace period: `BeforeDelete` in kubernetes/kubernetes
/// staging/src/k8s.io/apiserver/pkg/registry/rest/delete.go). A pod already past that moment is
/// stuck (its node's kubelet is gone, or a finalizer holds it) and gets 0: the copy keeps it
/// terminating until its node goes. Without this the copy took such a pod for a live one: the
/// drain asked to evict it and its budget counted it healthy, where the real run waits for it.
fn grace_left_at(pod: &mut Value, taken_at: &str) {
    let Some(deletion) = pod["metadata"]["deletionTimestamp"].as_str() else { return };
    let (Ok(deletion), Ok(taken)) = (humantime::parse_rfc3339_weak(deletion), humantime::parse_rfc3339_weak(taken_at))
    else {
        // a time that does not parse leaves the grace period the live server showed
        return;
    };
    let left = match deletion.duration_since(taken) {
        // whole seconds, rounded up: a pod going within the second is still there at the snapshot
        Ok(d) => d.as_secs() + u64::from(d.subsec_nanos() > 0),
        Err(_) => 0,
    };
    pod["metadata"]["deletionGracePeriodSeconds"] = json!(left);
}

/// Points a Node's or NodeClaim's provider id at the copy's instance.
fn rewrite_provider_id(obj: &mut Value, instances: &BTreeMap<String, String>) {
    let field = match obj["kind"].as_str() {
        Some("Node") => &mut obj["spec"]["providerID"],
        Some("NodeClaim") => &mut obj["status"]["providerID"],
        _ => return,
    };
    let Some(pid) = field.as_str().and_then(|p| ProviderId::parse(p).ok()) else { return };
    if let Some(copy) = instances.get(&pid.instance_id) {
        *field = json!(format!("aws:///{}/{copy}", pid.zone));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_references_follow_the_new_uids_and_unknown_owners_are_dropped() {
        let uids = BTreeMap::from([("old-rs".to_string(), "new-rs".to_string())]);
        let mut pod = json!({"metadata": {"ownerReferences": [
            {"kind": "ReplicaSet", "name": "web-1", "uid": "old-rs", "controller": true},
            {"kind": "Job", "name": "j", "uid": "not-copied"}]}});
        rewrite_owners(&mut pod, &uids);
        assert_eq!(
            pod["metadata"]["ownerReferences"],
            json!([{"kind": "ReplicaSet", "name": "web-1", "uid": "new-rs", "controller": true}])
        );
    }

    #[test]
    fn a_terminating_pod_keeps_what_was_left_of_its_grace_period_and_a_stuck_one_none() {
        let taken_at = "2026-11-25T15:00:00.250Z";
        let mut going =
            json!({"metadata": {"deletionTimestamp": "2026-11-25T15:00:20Z", "deletionGracePeriodSeconds": 30}});
        grace_left_at(&mut going, taken_at);
        assert_eq!(going["metadata"]["deletionGracePeriodSeconds"], 20, "19.75 s left, rounded up");
        let mut stuck =
            json!({"metadata": {"deletionTimestamp": "2026-11-25T14:50:00Z", "deletionGracePeriodSeconds": 30}});
        grace_left_at(&mut stuck, taken_at);
        assert_eq!(stuck["metadata"]["deletionGracePeriodSeconds"], 0, "past its deletion time: stuck");
        let mut running = json!({"metadata": {"name": "web-1"}});
        grace_left_at(&mut running, taken_at);
        assert_eq!(running, json!({"metadata": {"name": "web-1"}}), "a pod not terminating is left as it is");
    }

    #[test]
    fn the_copys_profiles_hold_the_live_profiles_roles_each_role_made_once() {
        let profile = |name: &str, roles: &[&str]| crate::snapshot::SnapInstanceProfile {
            name: name.into(),
            path: "/".into(),
            roles: roles.iter().map(|r| r.to_string()).collect(),
            tags: BTreeMap::new(),
        };
        let profiles = [profile("a", &["node"]), profile("b", &["node"]), profile("c", &[])];
        let (roles, attach) = profile_roles(&profiles);
        assert_eq!(roles, BTreeSet::from(["node"]));
        assert_eq!(attach, [("a", "node"), ("b", "node")]);
    }

    #[test]
    fn provider_ids_point_at_the_copys_instances() {
        let ids = BTreeMap::from([("i-live".to_string(), "i-copy".to_string())]);
        let mut node = json!({"kind": "Node", "spec": {"providerID": "aws:///us-west-2a/i-live"}});
        rewrite_provider_id(&mut node, &ids);
        assert_eq!(node["spec"]["providerID"], "aws:///us-west-2a/i-copy");
        let mut claim = json!({"kind": "NodeClaim", "status": {"providerID": "aws:///us-west-2b/i-other"}});
        rewrite_provider_id(&mut claim, &ids);
        assert_eq!(
            claim["status"]["providerID"], "aws:///us-west-2b/i-other",
            "an id the copy has no instance for stays"
        );
    }
}
