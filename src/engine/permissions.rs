//! Permissions before changes: on a real cluster a missing RBAC verb or IAM action shows up as a
//! 403 in the middle of a run, with the cluster half torn down. Before the first write the tool
//! asks the API server (`SelfSubjectAccessReview`) about every verb and resource the chosen plan
//! uses, and EC2 (`DryRun`) about its mutating calls; a gap refuses the run with exit 2, naming
//! each missing permission and the shipped file that grants it.
//!
//! What the plan needs is decided here, from the plan alone ([`kubernetes_needs`],
//! [`ec2_needs`]); the asking is a thin loop around it.

use std::collections::BTreeSet;

use futures::{StreamExt, stream};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use kube::api::{Api, PostParams};

use crate::aws::AwsClients;
use crate::aws::ec2::DryRun;
use crate::k8s::{KubeError, status_code};
use crate::karpenter;
use crate::plan::{Action, OnDeadline, Plan};

/// One Kubernetes permission, in RBAC's terms.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct KubePermission {
    /// `get`, `list`, `watch`, `create`, `patch`, `delete`.
    pub verb: &'static str,
    /// API group (`""` for core).
    pub group: &'static str,
    /// Resource.
    pub resource: &'static str,
    /// Subresource (`eviction`, `scale`), or empty.
    pub subresource: &'static str,
    /// The object name, for rules limited by `resourceNames`.
    pub name: &'static str,
}

impl std::fmt::Display for KubePermission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() { "core" } else { self.group };
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.subresource.is_empty() {
            write!(f, "/{}", self.subresource)?;
        }
        if !self.name.is_empty() {
            write!(f, " {}", self.name)?;
        }
        write!(f, " ({group})")
    }
}

const fn p(verb: &'static str, group: &'static str, resource: &'static str) -> KubePermission {
    KubePermission { verb, group, resource, subresource: "", name: "" }
}

/// What the 1.0.x CRD repair needs: reading and patching Karpenter's three CRDs, by name.
pub(crate) fn conversion_repair_needs() -> BTreeSet<KubePermission> {
    karpenter::CRDS
        .into_iter()
        .flat_map(|name| {
            [
                KubePermission { name, ..p("get", "apiextensions.k8s.io", "customresourcedefinitions") },
                KubePermission { name, ..p("patch", "apiextensions.k8s.io", "customresourcedefinitions") },
            ]
        })
        .collect()
}

/// Listing the GitOps owners (Argo CD Applications, Flux Kustomizations and HelmReleases), for
/// the survey of who applies the Karpenter objects.
pub(crate) fn gitops_survey_needs() -> BTreeSet<KubePermission> {
    [
        p("list", "argoproj.io", "applications"),
        p("list", "kustomize.toolkit.fluxcd.io", "kustomizations"),
        p("list", "helm.toolkit.fluxcd.io", "helmreleases"),
    ]
    .into()
}

/// What `--release` adds (`deploy/rbac-release.yaml`): deleting the objects the Load Balancer
/// Controller holds; for volumes, scaling StatefulSets to zero and deleting their claims.
/// Waiting until they are gone lists them, as the survey does. Not sent through the admission check's
/// dry runs: a delete is refused by no webhook the controllers install.
pub fn cleanup_release_needs(release: &BTreeSet<crate::cleanup::Release>) -> BTreeSet<KubePermission> {
    let mut need = BTreeSet::new();
    for r in release {
        match r.what {
            crate::cleanup::Releasable::LoadBalancers => need.extend([
                p("delete", "", "services"),
                p("delete", "networking.k8s.io", "ingresses"),
                p("delete", "elbv2.k8s.aws", "targetgroupbindings"),
                p("delete", "gateway.networking.k8s.io", "gateways"),
            ]),
            // the claims' pods are found by the pod list the drain has anyway
            crate::cleanup::Releasable::Volumes => need.extend([
                KubePermission { subresource: "scale", ..p("get", "apps", "statefulsets") },
                KubePermission { subresource: "scale", ..p("patch", "apps", "statefulsets") },
                p("delete", "", "persistentvolumeclaims"),
            ]),
        }
    }
    need
}

/// Every Kubernetes permission a run of `plan` uses. `delete_pods` says whether pods may be
/// deleted at the drain deadline (`--on-drain-deadline delete` or a plan's `on_deadline`);
/// `pause_gitops` whether GitOps owners may be paused (`--pause-gitops`).
pub fn kubernetes_needs(plan: &Plan, delete_pods: bool, pause_gitops: bool) -> BTreeSet<KubePermission> {
    // the inventory, the pod index and the node watch, whatever the plan
    let mut need: BTreeSet<KubePermission> = [
        p("list", "", "nodes"),
        p("watch", "", "nodes"),
        p("list", "", "pods"),
        p("watch", "", "pods"),
        p("list", "policy", "poddisruptionbudgets"),
        p("watch", "policy", "poddisruptionbudgets"),
        p("list", "apps", "deployments"),
        // the Karpenter controller found by its leader Lease and the pod that holds it
        p("list", "coordination.k8s.io", "leases"),
        p("get", "", "pods"),
        p("list", karpenter::KARPENTER_GROUP, "nodeclaims"),
        p("list", karpenter::KARPENTER_GROUP, "nodepools"),
        p("list", karpenter::AWS_GROUP, "ec2nodeclasses"),
        // the admission check: the webhooks that may refuse a write, and where their services run
        p("list", "admissionregistration.k8s.io", "validatingwebhookconfigurations"),
        p("list", "admissionregistration.k8s.io", "mutatingwebhookconfigurations"),
        p("list", "discovery.k8s.io", "endpointslices"),
    ]
    .into();
    // the GitOps owners of the Karpenter objects, whatever the plan: without them a run cannot
    // tell whether Argo CD or Flux will put back what it removes
    need.extend(gitops_survey_needs());
    // what the cleanup controllers (load balancers, volumes) still hold, and where they run,
    // for a plan whose nodes go away
    if plan.steps().iter().any(|s| drains(s.action)) {
        need.extend([
            p("list", "", "services"),
            p("list", "networking.k8s.io", "ingresses"),
            p("list", "elbv2.k8s.aws", "targetgroupbindings"),
            p("list", "gateway.networking.k8s.io", "gateways"),
            p("list", "", "persistentvolumes"),
            p("list", "storage.k8s.io", "volumeattachments"),
            p("list", "coordination.k8s.io", "leases"),
            p("get", "", "pods"),
        ]);
    }
    if pause_gitops {
        for (group, resource) in [
            ("argoproj.io", "applications"),
            ("kustomize.toolkit.fluxcd.io", "kustomizations"),
            ("helm.toolkit.fluxcd.io", "helmreleases"),
        ] {
            need.extend([p("get", group, resource), p("patch", group, resource)]);
        }
    }
    for step in plan.steps() {
        match step.action {
            Action::Preflight | Action::Verify | Action::WaitNodeclaimsGone => {}
            Action::Fence => need.extend([
                p("get", karpenter::KARPENTER_GROUP, "nodepools"),
                p("patch", karpenter::KARPENTER_GROUP, "nodepools"),
            ]),
            Action::Cordon => need.extend([p("get", "", "nodes"), p("patch", "", "nodes")]),
            Action::Drain => {
                need.extend(drain_needs());
                if delete_pods || step.params.on_deadline == OnDeadline::Delete {
                    need.insert(p("delete", "", "pods"));
                }
            }
            Action::RemoveController => {
                need.extend([
                    p("get", "apps", "deployments"),
                    KubePermission { subresource: "scale", ..p("patch", "apps", "deployments") },
                ]);
                need.extend(conversion_repair_needs());
            }
            // the release check drains what was bound since the drain (`release-check`)
            // and a note on a class of a claim released with no instance found
            Action::DischargeFinalizers => {
                need.extend(release_needs().into_iter().chain(drain_needs()));
                need.insert(p("patch", karpenter::AWS_GROUP, "ec2nodeclasses"));
            }
            Action::DeleteNodepools => need.extend([p("delete", karpenter::KARPENTER_GROUP, "nodepools")]),
            // a NodeClaim launched during the run is drained and released by the plan's own
            // machine steps, whose needs are their own
            Action::DeleteNodeclasses => need.extend([
                p("get", karpenter::AWS_GROUP, "ec2nodeclasses"),
                p("patch", karpenter::AWS_GROUP, "ec2nodeclasses"),
                p("delete", karpenter::AWS_GROUP, "ec2nodeclasses"),
            ]),
        }
    }
    need
}

/// Whether a step takes Karpenter's nodes away (its own drain, or Karpenter's once the pools go).
pub(crate) fn drains(action: Action) -> bool {
    matches!(action, Action::Drain | Action::DischargeFinalizers | Action::DeleteNodepools | Action::DeleteNodeclasses)
}

/// What a drain does: read and fence the node, read its pods and budgets, evict.
fn drain_needs() -> [KubePermission; 6] {
    [
        p("get", "", "nodes"),
        p("patch", "", "nodes"),
        p("get", karpenter::KARPENTER_GROUP, "nodeclaims"),
        p("get", "", "pods"),
        p("list", "policy", "poddisruptionbudgets"),
        KubePermission { subresource: "eviction", ..p("create", "", "pods") },
    ]
}

/// What a machine's release does once its instance is gone: delete the Node and NodeClaim and
/// remove their finalizer.
fn release_needs() -> [KubePermission; 6] {
    [
        p("get", karpenter::KARPENTER_GROUP, "nodeclaims"),
        p("patch", karpenter::KARPENTER_GROUP, "nodeclaims"),
        p("delete", karpenter::KARPENTER_GROUP, "nodeclaims"),
        p("get", "", "nodes"),
        p("patch", "", "nodes"),
        p("delete", "", "nodes"),
    ]
}

/// A mutating EC2 call a run of the plan makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ec2Need {
    /// `ec2:TerminateInstances` (discharge-finalizers, `--reclaim`).
    TerminateInstances,
    /// `ec2:DeleteLaunchTemplate` (delete-nodeclasses, `--reclaim`).
    DeleteLaunchTemplate,
    /// `ec2:DeleteNetworkInterface` (`--reclaim`: detached interfaces of the cluster's nodes).
    DeleteNetworkInterface,
}

/// The mutating EC2 calls a run of `plan` makes. (IAM's calls have no `DryRun`; they are covered
/// by the same shipped policy and named in the README.)
pub fn ec2_needs(plan: &Plan, reclaim: bool) -> BTreeSet<Ec2Need> {
    let mut need = BTreeSet::new();
    for step in plan.steps() {
        match step.action {
            Action::DischargeFinalizers => {
                need.insert(Ec2Need::TerminateInstances);
            }
            Action::DeleteNodeclasses => {
                need.insert(Ec2Need::DeleteLaunchTemplate);
            }
            Action::Verify if reclaim => {
                need.extend([
                    Ec2Need::TerminateInstances,
                    Ec2Need::DeleteLaunchTemplate,
                    Ec2Need::DeleteNetworkInterface,
                ]);
            }
            _ => {}
        }
    }
    need
}

/// Asks the API server about each permission (a handful at a time). A permission the server
/// denies is returned; `Ok(None)` when the server cannot answer reviews at all (then the run
/// goes on, as it would have without the check).
pub async fn missing_kubernetes(
    client: &kube::Client,
    need: &BTreeSet<KubePermission>,
) -> Result<Option<Vec<KubePermission>>, KubeError> {
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let answers: Vec<(KubePermission, Result<bool, KubeError>)> = stream::iter(need.iter().cloned())
        .map(|perm| {
            let api = api.clone();
            async move {
                let review = SelfSubjectAccessReview {
                    spec: SelfSubjectAccessReviewSpec {
                        resource_attributes: Some(ResourceAttributes {
                            verb: Some(perm.verb.into()),
                            group: Some(perm.group.into()),
                            resource: Some(perm.resource.into()),
                            subresource: (!perm.subresource.is_empty()).then(|| perm.subresource.into()),
                            name: (!perm.name.is_empty()).then(|| perm.name.into()),
                            ..ResourceAttributes::default()
                        }),
                        ..SelfSubjectAccessReviewSpec::default()
                    },
                    ..SelfSubjectAccessReview::default()
                };
                // throttling and server errors are retried (honouring Retry-After), like every
                // read before the first write
                let allowed = crate::k8s::retry_transient(|| async {
                    api.create(&PostParams::default(), &review).await.map_err(|e| {
                        KubeError::api("ask the API server about permissions (SelfSubjectAccessReview)", e)
                    })
                })
                .await
                .map(|r| r.status.is_some_and(|s| s.allowed));
                (perm, allowed)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut missing = Vec::new();
    for (perm, answer) in answers {
        match answer {
            Ok(true) => {}
            Ok(false) => missing.push(perm),
            // no SelfSubjectAccessReview on this server (or not for us): nothing to learn here
            Err(KubeError::Api { source, .. }) if matches!(status_code(&source), Some(403..=405)) => {
                tracing::warn!(error = %crate::k8s::describe_error(&source), "the API server answers no access reviews: permissions are not checked before the run");
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    }
    missing.sort();
    Ok(Some(missing))
}

/// Asks EC2 (`DryRun`) about each mutating call, on resources of this cluster (`instances`: the
/// inventory's instance ids, since the shipped policy allows termination by tag; a launch
/// template and a reclaimable network interface of the cluster, found as verification finds
/// them): the IAM actions the credentials lack. EC2 evaluates a dry run's authorization as it
/// would the call's, resource tags included, so a policy whose conditions miss these resources
/// is caught here. A call that cannot be tried on a real resource (no instance, launch template
/// or reclaimable interface left) is not asked about.
pub async fn missing_ec2(
    aws: &AwsClients,
    cluster: &str,
    need: &BTreeSet<Ec2Need>,
    instances: &[String],
) -> Result<Vec<&'static str>, crate::aws::AwsError> {
    let mut missing = Vec::new();
    for n in need {
        let (action, answer) = match n {
            Ec2Need::TerminateInstances if !instances.is_empty() => {
                let ids = &instances[..instances.len().min(crate::aws::ec2::FILTER_VALUES_MAX)];
                ("ec2:TerminateInstances", aws.ec2.terminate_dry_run(ids).await?)
            }
            Ec2Need::DeleteLaunchTemplate => match aws.ec2.launch_templates(cluster).await?.first() {
                Some(lt) => ("ec2:DeleteLaunchTemplate", aws.ec2.delete_launch_template_dry_run(&lt.id).await?),
                None => continue,
            },
            Ec2Need::DeleteNetworkInterface => match aws.ec2.detached_network_interfaces(cluster).await?.0.first() {
                Some(ni) => ("ec2:DeleteNetworkInterface", aws.ec2.delete_network_interface_dry_run(&ni.id).await?),
                None => continue,
            },
            Ec2Need::TerminateInstances => continue,
        };
        match answer {
            DryRun::Allowed => {}
            DryRun::Denied(why) => {
                tracing::warn!(action, why = %why, "EC2 refuses a dry run");
                missing.push(action);
            }
            DryRun::Inconclusive(code) => {
                tracing::info!(action, code = %code, "EC2's dry run answered neither yes nor no; not counted as missing");
            }
        }
    }
    Ok(missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has(set: &BTreeSet<KubePermission>, verb: &str, resource: &str, sub: &str) -> bool {
        set.iter().any(|p| p.verb == verb && p.resource == resource && p.subresource == sub)
    }

    #[test]
    fn the_default_plan_needs_evictions_cordons_and_finalizer_writes_but_not_pod_deletes() {
        let need = kubernetes_needs(&Plan::builtin_default(), false, false);
        assert!(has(&need, "create", "pods", "eviction"));
        assert!(has(&need, "patch", "nodes", ""));
        assert!(has(&need, "patch", "deployments", "scale"));
        assert!(has(&need, "delete", "nodeclaims", ""));
        assert!(!has(&need, "delete", "pods", ""), "pods are deleted only with --on-drain-deadline delete");
        assert!(has(&kubernetes_needs(&Plan::builtin_default(), true, false), "delete", "pods", ""));
        let crd = need.iter().find(|p| p.resource == "customresourcedefinitions" && p.verb == "patch").unwrap();
        assert!(karpenter::CRDS.contains(&crd.name), "CRD writes are asked by name: {crd}");
    }

    #[test]
    fn ec2_calls_follow_the_plan_and_reclaim() {
        let plan = Plan::builtin_default();
        assert_eq!(ec2_needs(&plan, false), [Ec2Need::TerminateInstances, Ec2Need::DeleteLaunchTemplate].into());
        let text = "version = 1\nname = \"p\"\n[[step]]\nid = \"preflight\"\naction = \"preflight\"\n[[step]]\nid = \"verify\"\naction = \"verify\"\nafter = [\"preflight\"]\n";
        let verify_only = Plan::from_str(text, "test").unwrap();
        assert!(ec2_needs(&verify_only, false).is_empty());
        assert_eq!(
            ec2_needs(&verify_only, true),
            [Ec2Need::TerminateInstances, Ec2Need::DeleteLaunchTemplate, Ec2Need::DeleteNetworkInterface,].into(),
            "--reclaim may delete detached interfaces: their permission is asked too"
        );
    }

    /// A plan of `preflight` and one step after it.
    fn plan_with(id: &str, action: &str, for_each: Option<&str>) -> Plan {
        let each = for_each.map(|k| format!("for_each = \"{k}\"\n")).unwrap_or_default();
        let text = format!(
            "version = 1\nname = \"p\"\n[[step]]\nid = \"preflight\"\naction = \"preflight\"\n[[step]]\nid = \"{id}\"\naction = \"{action}\"\n{each}after = [\"preflight\"]\n"
        );
        Plan::from_str(&text, "test").unwrap()
    }

    #[test]
    fn the_work_a_step_does_beyond_its_graph_is_asked_for_too() {
        // delete-nodeclasses hands a machine launched during the run to the plan's machine steps:
        // it drains and terminates nothing itself
        let classes = plan_with("classes", "delete-nodeclasses", None);
        let need = kubernetes_needs(&classes, false, false);
        assert!(!has(&need, "create", "pods", "eviction") && !has(&need, "delete", "nodes", ""), "{need:?}");
        assert!(has(&need, "delete", "ec2nodeclasses", ""), "{need:?}");
        assert!(!ec2_needs(&classes, false).contains(&Ec2Need::TerminateInstances));
        // discharge-finalizers drains what was bound to a node since its drain (`release-check`)
        let release = plan_with("release", "discharge-finalizers", Some("machine"));
        assert!(has(&kubernetes_needs(&release, false, false), "create", "pods", "eviction"));
    }
}
