//! Reading what the cleanup controllers hold and where they run (the judgement is in
//! `crate::cleanup`). Objects are read first; the controllers and the other nodes only when some
//! object is held, so a cluster without them pays six lists.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::Ingress;
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Resource;
use kube::api::{Api, DynamicObject, ListParams};
use kube::core::{ApiResource, GroupVersionKind};

use super::{KubeError, list_pages, status_code};
use crate::cleanup::{ClaimUser, Cleaner, Held, Requests, Running, VolumeFacts, cleaner_of, held_volume, volume_of};

/// What the survey needs, as read.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    pub(crate) held: Vec<Held>,
    pub(crate) running: BTreeMap<Cleaner, Running>,
    /// Every node the run keeps (not a Karpenter node).
    pub(crate) other_nodes: Vec<Node>,
    /// What the pods bound to each of `other_nodes` request: how much room a cleaner's pod
    /// would find there.
    pub(crate) requested: BTreeMap<String, Requests>,
    /// The EBS volumes of the PersistentVolumes the EBS CSI driver deletes (reclaim policy
    /// `Delete`), by volume id, each with its PV's name: verification reads them by id, since the
    /// driver tags a volume with its cluster only when told to.
    pub(crate) volumes: BTreeMap<String, String>,
    /// What `--release volumes` needs of the EBS driver's PVs and attachments.
    pub(crate) facts: VolumeFacts,
}

/// A list of every object of a kind, keeping what `keep` makes of each; a kind the server does
/// not serve is none.
async fn all<K, T>(api: Api<K>, what: &str, keep: impl FnMut(K) -> Option<T>) -> Result<Vec<T>, KubeError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match list_pages(&api, &ListParams::default(), keep).await {
        Ok(v) => Ok(v),
        Err(e) if status_code(&e) == Some(404) => Ok(Vec::new()),
        Err(e) => Err(KubeError::api(format!("list {what}"), e)),
    }
}

fn held_by(kind: &'static str, meta: &kube::api::ObjectMeta) -> Vec<Held> {
    let name = match &meta.namespace {
        Some(ns) => format!("{ns}/{}", meta.name.as_deref().unwrap_or_default()),
        None => meta.name.clone().unwrap_or_default(),
    };
    let protected = meta.annotations.as_ref().is_some_and(crate::cleanup::annotated_protection);
    meta.finalizers
        .iter()
        .flatten()
        .filter_map(|f| {
            cleaner_of(kind, f).map(|cleaner| Held {
                kind,
                name: name.clone(),
                finalizer: Some(f.clone()),
                cleaner,
                protected,
                uid: meta.uid.clone(),
            })
        })
        .collect()
}

/// Reads the objects the cleaners hold, then, if any, where the cleaners run and the nodes the
/// run keeps. `karpenter_nodes` are the nodes the run drains.
pub(crate) async fn read(client: &kube::Client, karpenter_nodes: &BTreeSet<String>) -> Result<Seen, KubeError> {
    let mut held = Vec::new();
    let services = all(Api::<Service>::all(client.clone()), "services", |s| Some(held_by("Service", &s.metadata)));
    let ingresses = all(Api::<Ingress>::all(client.clone()), "ingresses", |i| Some(held_by("Ingress", &i.metadata)));
    let tgb = resource_of("TargetGroupBinding");
    let bindings = all(Api::<DynamicObject>::all_with(client.clone(), &tgb), "targetgroupbindings", |b| {
        Some(held_by("TargetGroupBinding", &b.metadata))
    });
    let gateways = all(Api::<DynamicObject>::all_with(client.clone(), &resource_of("Gateway")), "gateways", |g| {
        Some(held_by("Gateway", &g.metadata))
    });
    let volumes = all(Api::<PersistentVolume>::all(client.clone()), "persistentvolumes", |pv| {
        let spec = pv.spec.as_ref();
        let volume = spec.and_then(volume_of);
        let driver = volume.as_ref().map(|(d, _)| d.as_str());
        let reclaim = spec.and_then(|s| s.persistent_volume_reclaim_policy.as_deref());
        let name = pv.metadata.name.clone().unwrap_or_default();
        let held = held_volume(&name, pv.metadata.finalizers.as_deref().unwrap_or_default(), driver, reclaim);
        let claim_ref = spec.and_then(|s| s.claim_ref.as_ref());
        let claim = claim_ref.map(|r| {
            format!("{}/{}", r.namespace.as_deref().unwrap_or_default(), r.name.as_deref().unwrap_or_default())
        });
        let claim_uid = claim_ref.and_then(|r| r.uid.clone());
        // the volumes the EBS driver deletes: exactly the PVs held for it
        let ebs = held
            .first()
            .filter(|h| h.cleaner == Cleaner::EbsCsi)
            .and(volume)
            .map(|(_, id)| (name, id, claim, claim_uid));
        Some((held, ebs))
    });
    let attachments = all(Api::<VolumeAttachment>::all(client.clone()), "volumeattachments", |va| {
        let held = held_by("VolumeAttachment", &va.metadata);
        let pv = (!held.is_empty())
            .then(|| Some((va.metadata.name.clone()?, va.spec.source.persistent_volume_name.clone()?)))
            .flatten();
        Some((held, pv))
    });
    let (s, i, b, g, v, a) = futures::try_join!(services, ingresses, bindings, gateways, volumes, attachments)?;
    let mut ebs_volumes = BTreeMap::new();
    let mut facts = VolumeFacts::default();
    for (h, ebs) in v {
        held.extend(h);
        if let Some((pv, id, claim, claim_uid)) = ebs {
            ebs_volumes.insert(id.clone(), pv.clone());
            facts.volume_ids.insert(pv.clone(), id);
            if let Some(uid) = claim_uid {
                facts.claim_uids.insert(pv.clone(), uid);
            }
            facts.claims.insert(pv, claim);
        }
    }
    for (h, pv) in a {
        held.extend(h);
        facts.attached.extend(pv);
    }
    for found in [s, i, b, g] {
        held.extend(found.into_iter().flatten());
    }
    if held.is_empty() {
        return Ok(Seen { volumes: ebs_volumes, facts, ..Seen::default() });
    }
    let mut running = BTreeMap::new();
    let wanted: BTreeSet<Cleaner> = held.iter().map(|h| h.cleaner).collect();
    for cleaner in wanted {
        running.insert(cleaner, Running { pods: pods_of(client, cleaner).await? });
    }
    // the nodes the run keeps: those without Karpenter's label, and EKS Auto Mode's, which
    // carry it but are not this controller's (two lists, so thousands of Karpenter nodes are
    // not read again)
    let nodes: Api<Node> = Api::all(client.clone());
    let mut other_nodes = Vec::new();
    for selector in [
        format!("!{}", crate::karpenter::LABEL_NODEPOOL),
        format!("{},{}=auto", crate::karpenter::LABEL_NODEPOOL, crate::karpenter::LABEL_COMPUTE_TYPE),
    ] {
        let kept = list_pages(&nodes, &ListParams::default().labels(&selector), |n: Node| {
            (!karpenter_nodes.contains(n.metadata.name.as_deref().unwrap_or_default())).then_some(n)
        })
        .await
        .map_err(|e| KubeError::api("list the nodes the run keeps", e))?;
        other_nodes.extend(kept);
    }
    let mut requested = BTreeMap::new();
    let pods: Api<Pod> = Api::all(client.clone());
    for n in &other_nodes {
        let name = n.metadata.name.clone().unwrap_or_default();
        let lp = ListParams::default().fields(&format!("spec.nodeName={name}"));
        let on_node = list_pages(&pods, &lp, |p: Pod| {
            let ended = matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
            (!ended).then(|| Requests::of_pod(&p))
        })
        .await
        .map_err(|e| KubeError::api(format!("list the pods on node {name}"), e))?;
        requested.insert(name, on_node.into_iter().fold(Requests::default(), Requests::plus));
    }
    Ok(Seen { held, running, other_nodes, requested, volumes: ebs_volumes, facts })
}

/// The pods of a cleaner, found by what it is and does rather than by one name: those of the
/// Deployments its chart labels or whose pods run its image, those behind the services of its
/// admission webhooks (the Load Balancer Controller's `*.elbv2.k8s.aws` keep their names
/// whatever the chart is called), and the holder of its leader Lease.
async fn pods_of(client: &kube::Client, cleaner: Cleaner) -> Result<Vec<Pod>, KubeError> {
    let mut pods: BTreeMap<(String, String), Pod> = BTreeMap::new();
    let mut selectors: BTreeSet<(String, String)> = BTreeSet::new();
    let deployments: Api<Deployment> = Api::all(client.clone());
    let all = list_pages(&deployments, &ListParams::default(), Some)
        .await
        .map_err(|e| KubeError::api(format!("list the Deployments to find {cleaner}"), e))?;
    for d in all.iter().filter(|d| crate::cleanup::deployment_is(cleaner, d)) {
        let ns = d.metadata.namespace.clone().unwrap_or_default();
        let Some(selector) = d.spec.as_ref().and_then(|s| s.selector.match_labels.clone()) else { continue };
        let labels: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        selectors.insert((ns, labels.join(",")));
    }
    if let Some(suffix) = cleaner.webhook_suffix() {
        let webhooks = super::admission::webhooks(client).await?;
        let services: BTreeSet<(String, String)> = webhooks
            .iter()
            .filter(|w| w.name.ends_with(suffix))
            .filter_map(|w| w.service.as_ref().map(|(ns, name, _)| (ns.clone(), name.clone())))
            .collect();
        for (ns, name) in services {
            let api: Api<Service> = Api::namespaced(client.clone(), &ns);
            let lp = ListParams::default().fields(&format!("metadata.name={name}"));
            let found = api
                .list(&lp)
                .await
                .map_err(|e| KubeError::api(format!("list the webhook service {ns}/{name} of {cleaner}"), e))?;
            for svc in found.items {
                let Some(selector) = svc.spec.and_then(|s| s.selector).filter(|s| !s.is_empty()) else { continue };
                let labels: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
                selectors.insert((ns.clone(), labels.join(",")));
            }
        }
    }
    for (ns, labels) in selectors {
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let list = api
            .list(&ListParams::default().labels(&labels))
            .await
            .map_err(|e| KubeError::api(format!("list the pods of {cleaner}"), e))?;
        for p in list.items {
            pods.insert((ns.clone(), p.metadata.name.clone().unwrap_or_default()), p);
        }
    }
    let leases: Api<Lease> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("metadata.name={}", cleaner.lease()));
    let found = match leases.list(&lp).await {
        Ok(l) => l.items,
        Err(e) if status_code(&e) == Some(404) => Vec::new(),
        Err(e) => return Err(KubeError::api(format!("list the leader Lease of {cleaner}"), e)),
    };
    for lease in found {
        let ns = lease.metadata.namespace.clone().unwrap_or_default();
        // controller-runtime's identity is `<pod>_<uuid>`, client-go's the pod's host name
        let Some(holder) = lease.spec.and_then(|s| s.holder_identity) else { continue };
        let pod = holder.split('_').next().unwrap_or_default().to_string();
        if pod.is_empty() || pods.contains_key(&(ns.clone(), pod.clone())) {
            continue;
        }
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        match api.get_opt(&pod).await {
            Ok(Some(p)) => {
                pods.insert((ns, pod), p);
            }
            Ok(None) => {}
            Err(e) => return Err(KubeError::api(format!("read the leader pod {ns}/{pod} of {cleaner}"), e)),
        }
    }
    Ok(pods.into_values().filter(|p| p.metadata.deletion_timestamp.is_none()).collect())
}

/// The API resource of a held object's kind.
fn resource_of(kind: &str) -> ApiResource {
    match kind {
        "Service" => ApiResource::erase::<Service>(&()),
        "Ingress" => ApiResource::erase::<Ingress>(&()),
        "PersistentVolume" => ApiResource::erase::<PersistentVolume>(&()),
        "VolumeAttachment" => ApiResource::erase::<VolumeAttachment>(&()),
        // the version the Load Balancer Controller's Gateway support requires (Gateway API v1)
        "Gateway" => ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "Gateway"),
            "gateways",
        ),
        _ => ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("elbv2.k8s.aws", "v1beta1", "TargetGroupBinding"),
            "targetgroupbindings",
        ),
    }
}

/// The API of a held object's kind, in its namespace, and its name.
fn api_of(client: &kube::Client, held: &Held) -> (Api<DynamicObject>, String) {
    let resource = resource_of(held.kind);
    match held.name.split_once('/') {
        Some((ns, name)) => (Api::namespaced_with(client.clone(), ns, &resource), name.to_string()),
        None => (Api::all_with(client.clone(), &resource), held.name.clone()),
    }
}

/// Deletes a held object (its finalizer stays: its controller removes it once it has cleaned
/// up in AWS), the one surveyed only: an object made under its name since is refused by the
/// server (409) and left alone. Already gone is done.
pub(crate) async fn delete(client: &kube::Client, held: &Held) -> Result<(), KubeError> {
    let (api, name) = api_of(client, held);
    match api.delete(&name, &surveyed(held.uid.as_deref())).await {
        Ok(_) => Ok(()),
        Err(e) if status_code(&e) == Some(404) => Ok(()),
        Err(e) if status_code(&e) == Some(409) => Err(KubeError::api(
            format!(
                "delete {} {} (another object has taken its name since the survey and is left alone)",
                held.kind, held.name
            ),
            e,
        )),
        Err(e) => Err(KubeError::api(format!("delete {} {}", held.kind, held.name), e)),
    }
}

/// The collection (a URL path) and name of a held object, for a dry run of its delete.
pub(crate) fn collection_of(held: &Held) -> (String, String) {
    let (ns, name) = match held.name.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, held.name.as_str()),
    };
    (DynamicObject::url_path(&resource_of(held.kind), ns), name.to_string())
}

/// Deletion of the object with `uid` only, when the survey read one.
fn surveyed(uid: Option<&str>) -> kube::api::DeleteParams {
    kube::api::DeleteParams {
        preconditions: uid.map(|u| kube::api::Preconditions { uid: Some(u.to_string()), resource_version: None }),
        ..kube::api::DeleteParams::default()
    }
}

/// Which of `held` are still in the API, as `Kind/namespace/name`: one list per kind, however
/// many objects are waited for.
pub(crate) async fn still_there(client: &kube::Client, held: &[Held]) -> Result<BTreeSet<String>, KubeError> {
    let mut there = BTreeSet::new();
    let kinds: BTreeSet<&'static str> = held.iter().map(|h| h.kind).collect();
    for kind in kinds {
        let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource_of(kind));
        let names = list_pages(&all, &ListParams::default(), |o: DynamicObject| {
            let name = o.metadata.name.clone().unwrap_or_default();
            Some(match &o.metadata.namespace {
                Some(ns) => format!("{kind}/{ns}/{name}"),
                None => format!("{kind}/{name}"),
            })
        })
        .await
        .map_err(|e| KubeError::api(format!("list the {kind}s released"), e))?;
        there.extend(names);
    }
    Ok(there)
}

/// The pods that mount each of `claims` (`namespace/name`), with their controlling owners: one
/// list of pods per namespace the claims are in.
pub(crate) async fn claim_users(
    client: &kube::Client,
    claims: &BTreeSet<String>,
) -> Result<BTreeMap<String, Vec<ClaimUser>>, KubeError> {
    let namespaces: BTreeSet<&str> = claims.iter().filter_map(|c| c.split_once('/').map(|(ns, _)| ns)).collect();
    let mut out: BTreeMap<String, Vec<ClaimUser>> = BTreeMap::new();
    for ns in namespaces {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let pods = list_pages(&api, &ListParams::default(), Some)
            .await
            .map_err(|e| KubeError::api(format!("list the pods of namespace {ns}"), e))?;
        for p in pods {
            // only apps/v1's StatefulSet is the one the release scales: another API's kind of the
            // same name (OpenKruise's, say) is named with its group, and refused as any owner is
            let owner = p.metadata.owner_references.iter().flatten().find(|o| o.controller == Some(true)).map(|o| {
                if o.kind == "StatefulSet" && o.api_version != "apps/v1" {
                    format!("{} ({})/{}", o.kind, o.api_version, o.name)
                } else {
                    format!("{}/{}", o.kind, o.name)
                }
            });
            let pod_name = p.metadata.name.as_deref().unwrap_or_default();
            let pod = format!("{ns}/{pod_name}");
            let mounted = p.spec.iter().flat_map(|s| s.volumes.iter().flatten());
            // a generic ephemeral volume's claim is named `<pod>-<volume>` (Kubernetes'
            // ephemeral volume controller) and is the pod's as much as a mounted claim is
            for claim in mounted.filter_map(|v| match (&v.persistent_volume_claim, &v.ephemeral) {
                (Some(c), _) => Some(format!("{ns}/{}", c.claim_name)),
                (None, Some(_)) => Some(format!("{ns}/{pod_name}-{}", v.name)),
                _ => None,
            }) {
                if claims.contains(&claim) {
                    out.entry(claim).or_default().push(ClaimUser { pod: pod.clone(), owner: owner.clone() });
                }
            }
        }
    }
    Ok(out)
}

fn split(name: &str) -> (&str, &str) {
    name.split_once('/').unwrap_or(("", name))
}

/// Scales a StatefulSet (`namespace/name`) to zero through its scale subresource, returning the
/// replicas it had; already gone is zero.
pub(crate) async fn scale_to_zero(client: &kube::Client, statefulset: &str) -> Result<i32, KubeError> {
    let (ns, name) = split(statefulset);
    let api: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
    let before = match api.get_scale(name).await {
        Ok(s) => s.spec.and_then(|s| s.replicas).unwrap_or(0),
        Err(e) if status_code(&e) == Some(404) => return Ok(0),
        Err(e) => return Err(KubeError::api(format!("read the scale of StatefulSet {statefulset}"), e)),
    };
    let zero = kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": 0}}));
    match api.patch_scale(name, &kube::api::PatchParams::default(), &zero).await {
        Ok(_) => Ok(before),
        Err(e) if status_code(&e) == Some(404) => Ok(0),
        Err(e) => Err(KubeError::api(format!("scale StatefulSet {statefulset} to zero"), e)),
    }
}

/// The replicas a StatefulSet (`namespace/name`) asks for now (gone is zero): something that
/// scales it up again (an autoscaler, a GitOps controller) makes its claims again.
pub(crate) async fn replicas(client: &kube::Client, statefulset: &str) -> Result<i32, KubeError> {
    let (ns, name) = split(statefulset);
    let api: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
    match api.get_scale(name).await {
        Ok(s) => Ok(s.spec.and_then(|s| s.replicas).unwrap_or(0)),
        Err(e) if status_code(&e) == Some(404) => Ok(0),
        Err(e) => Err(KubeError::api(format!("read the scale of StatefulSet {statefulset}"), e)),
    }
}

/// Deletes a claim (`namespace/name`), the one with `uid` (its PV's `claimRef`) only: a claim
/// made under that name since is not the PV's and is left alone (409). Already gone is done.
/// Its pods' protection (`kubernetes.io/pvc-protection`) keeps it until they are gone.
pub(crate) async fn delete_claim(client: &kube::Client, claim: &str, uid: &str) -> Result<(), KubeError> {
    let (ns, name) = split(claim);
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    match api.delete(name, &surveyed(Some(uid))).await {
        Ok(_) => Ok(()),
        Err(e) if status_code(&e) == Some(404) => Ok(()),
        Err(e) if status_code(&e) == Some(409) => Err(KubeError::api(
            format!(
                "delete PersistentVolumeClaim {claim} (it is no longer the claim its PV is bound to, and is left alone)"
            ),
            e,
        )),
        Err(e) => Err(KubeError::api(format!("delete PersistentVolumeClaim {claim}"), e)),
    }
}
