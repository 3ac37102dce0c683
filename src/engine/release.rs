//! `--release`: before the drain, while the cleanup controllers still run, delete the objects
//! they hold and wait until each is gone (its controller removes its finalizer once it has
//! deleted what it made in AWS) and AWS shows nothing left for its stack. For volumes, the
//! StatefulSets that mount the claims are scaled to zero and the claims deleted; the PV
//! controller then releases each PV, and the EBS CSI controller deletes its volume and the PV.
//! The tool never removes a finalizer, and never deletes a PV or a volume itself: that would
//! leak the AWS objects behind them, or delete a volume still attached.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::phases::Stop;
use crate::aws::AwsClients;
use crate::cleanup::{Cleaner, Held, VolumeRelease, stack_of};
use crate::exit::Exit;
use crate::k8s::Kube;
use crate::report::{Blocker, BlockerKind, StepRecord};

/// How often the wait reads the objects and AWS again.
const POLL: Duration = Duration::from_secs(2);

/// What is still there of one released object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    /// `Kind/namespace/name`.
    pub(crate) object: String,
    /// Whether the object itself is still in the API.
    pub(crate) in_cluster: bool,
    /// The names of its load balancers, target groups and security groups still in AWS.
    pub(crate) in_aws: Vec<String>,
}

/// What of `release` is still there, from which objects are gone, what AWS shows for the
/// cluster (`found`: [`crate::verify::load_balancing`]) and which of the PVs' volumes (`volumes`,
/// PV to volume id) are still in EC2 (`in_ec2`), pure.
pub(crate) fn pending(
    release: &[Held],
    gone: &BTreeSet<String>,
    found: &[crate::aws::LoadBalancing],
    volumes: &BTreeMap<String, String>,
    in_ec2: &BTreeSet<String>,
) -> Vec<Pending> {
    release
        .iter()
        .filter_map(|h| {
            let object = h.object();
            let in_aws: Vec<String> = if h.kind == "PersistentVolume" {
                volumes.get(&h.name).filter(|id| in_ec2.contains(*id)).cloned().into_iter().collect()
            } else {
                let stack = stack_of(h);
                found.iter().filter(|l| Some(&l.made_for) == stack.as_ref()).map(|l| l.name.clone()).collect()
            };
            let in_cluster = !gone.contains(&object);
            (in_cluster || !in_aws.is_empty()).then_some(Pending { object, in_cluster, in_aws })
        })
        .collect()
}

/// Deletes each Load Balancer Controller object of `release`, scales the StatefulSets of
/// `volumes` to zero and deletes their claims, then waits until [`pending`] is empty, for at
/// most `deadline`: past it, the run ends blocked (exit 5) before the drain, naming what is left.
pub(crate) async fn release(
    kube: &Kube,
    aws: &AwsClients,
    cluster: &str,
    release: &[Held],
    volumes: &VolumeRelease,
    deadline: Duration,
    cancel: &CancellationToken,
) -> (StepRecord, Option<Stop>) {
    let started = SystemTime::now();
    let (detail, stop) = match run(kube, aws, cluster, release, volumes, deadline, cancel).await {
        Ok(scaled) => {
            let mut detail = format!(
                "released {} object(s) while their controllers ran; they and what they stood for in AWS (load balancers, target groups, security groups, EBS volumes) are gone",
                release.len()
            );
            for (sts, from) in scaled {
                detail.push_str(&format!("; StatefulSet {sts} scaled from {from} to 0"));
            }
            (detail, None)
        }
        Err(stop) => (stop.error.clone(), Some(stop)),
    };
    (super::phase_record("release", started, stop.as_ref(), detail), stop)
}

async fn run(
    kube: &Kube,
    aws: &AwsClients,
    cluster: &str,
    release: &[Held],
    volumes: &VolumeRelease,
    deadline: Duration,
    cancel: &CancellationToken,
) -> Result<Vec<(String, i32)>, Stop> {
    let clock = Instant::now();
    for h in release.iter().filter(|h| h.cleaner == Cleaner::LoadBalancerController) {
        let span = tracing::info_span!("task", step = "release", object = %h.object());
        crate::k8s::retry_transient(|| crate::k8s::cleanup::delete(&kube.client, h))
            .instrument(span)
            .await
            .map_err(Stop::failed)?;
        tracing::warn!(object = %h.object(), "deleted; its controller deletes what it made in AWS, then its finalizer");
    }
    // the StatefulSets first: one still wanting its pod makes the pod's claim again
    let mut scaled = Vec::new();
    for sts in &volumes.statefulsets {
        let span = tracing::info_span!("task", step = "release", object = %format!("StatefulSet/{sts}"));
        let from = crate::k8s::retry_transient(|| crate::k8s::cleanup::scale_to_zero(&kube.client, sts))
            .instrument(span)
            .await
            .map_err(Stop::failed)?;
        tracing::warn!(statefulset = %sts, from, "scaled to zero: its claims are released next");
        scaled.push((sts.clone(), from));
    }
    // every claim the plan deletes with the uid its PV's claimRef gives (a PV without one is
    // refused by the plan)
    for (claim, uid) in &volumes.claim_uids {
        let span = tracing::info_span!("task", step = "release", object = %format!("PersistentVolumeClaim/{claim}"));
        crate::k8s::retry_transient(|| crate::k8s::cleanup::delete_claim(&kube.client, claim, uid))
            .instrument(span)
            .await
            .map_err(Stop::failed)?;
        tracing::warn!(claim = %claim, "deleted; the EBS CSI controller deletes its volume, then its PV");
    }
    let balancers = release.iter().any(|h| h.cleaner == Cleaner::LoadBalancerController);
    // verification's reading of the volumes, keyed by id
    let by_id: BTreeMap<String, String> = volumes.volumes.iter().map(|(pv, id)| (id.clone(), pv.clone())).collect();
    loop {
        let there = crate::k8s::retry_transient(|| crate::k8s::cleanup::still_there(&kube.client, release))
            .await
            .map_err(Stop::failed)?;
        let gone: BTreeSet<String> = release.iter().map(|h| h.object()).filter(|o| !there.contains(o)).collect();
        let found = if balancers {
            crate::verify::load_balancing(aws, cluster).await.map_err(|e| Stop::of(&e, e.is_configuration()))?
        } else {
            Vec::new()
        };
        let in_ec2: BTreeSet<String> = if by_id.is_empty() {
            BTreeSet::new()
        } else {
            let left =
                aws.ec2.volumes_of_volume_claims(&by_id).await.map_err(|e| Stop::of(&e, e.is_configuration()))?;
            left.into_iter().map(|v| v.id).collect()
        };
        let left = pending(release, &gone, &found, &volumes.volumes, &in_ec2);
        if left.is_empty() {
            return scaled_back(kube, scaled).await;
        }
        if clock.elapsed() >= deadline {
            return Err(blocked(&left, deadline));
        }
        tokio::select! {
            _ = cancel.cancelled() => {
                return Err(Stop { exit: Exit::Interrupted, error: "interrupted while releasing".into(), blockers: Vec::new() });
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// After the wait: a StatefulSet scaled up again by someone else (an autoscaler, a GitOps
/// controller) makes its claims and volumes again, which the drain would then strand.
async fn scaled_back(kube: &Kube, scaled: Vec<(String, i32)>) -> Result<Vec<(String, i32)>, Stop> {
    let mut up = Vec::new();
    for (sts, _) in &scaled {
        let now = crate::k8s::retry_transient(|| crate::k8s::cleanup::replicas(&kube.client, sts))
            .await
            .map_err(Stop::failed)?;
        if now > 0 {
            up.push(Blocker {
                kind: BlockerKind::Release,
                name: format!("StatefulSet/{sts}"),
                reason: format!("scaled up again to {now} after the release scaled it to zero: it makes its claims and volumes again"),
            });
        }
    }
    if up.is_empty() {
        return Ok(scaled);
    }
    Err(Stop {
        exit: Exit::Blocked,
        error: format!(
            "{}. The drain has not begun and no node was touched; stop what scales it (a HorizontalPodAutoscaler, a GitOps controller: see --pause-gitops), then run again",
            up.iter().map(|b| format!("{} was {}", b.name, b.reason)).collect::<Vec<_>>().join("; ")
        ),
        blockers: up,
    })
}

fn blocked(left: &[Pending], deadline: Duration) -> Stop {
    let blockers: Vec<Blocker> = left
        .iter()
        .map(|p| {
            let mut why = Vec::new();
            if p.in_cluster {
                why.push("still in the cluster, held by its finalizer".to_string());
            }
            if !p.in_aws.is_empty() {
                why.push(format!("still in AWS: {}", p.in_aws.join(", ")));
            }
            Blocker { kind: BlockerKind::Release, name: p.object.clone(), reason: why.join("; ") }
        })
        .collect();
    Stop {
        exit: Exit::Blocked,
        error: format!(
            "the release did not finish within {}: {}. The drain has not begun and no node was touched; see the controller's log for why it does not finish, then run again",
            humantime::format_duration(deadline),
            blockers.iter().map(|b| format!("{} ({})", b.name, b.reason)).collect::<Vec<_>>().join("; ")
        ),
        blockers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aws::{LbKind, LoadBalancing};
    use crate::cleanup::Cleaner;

    fn held(kind: &'static str, name: &str, finalizer: &str) -> Held {
        Held {
            kind,
            name: name.into(),
            finalizer: Some(finalizer.into()),
            cleaner: Cleaner::LoadBalancerController,
            protected: false,
            uid: None,
        }
    }

    fn lb(name: &str, made_for: &str) -> LoadBalancing {
        LoadBalancing {
            kind: LbKind::LoadBalancer,
            id: name.into(),
            name: name.into(),
            owner: "the AWS Load Balancer Controller".into(),
            made_for: made_for.into(),
        }
    }

    #[test]
    fn an_object_is_released_once_it_and_its_stack_in_aws_are_gone() {
        let release = [
            held("Service", "shop/front", "service.k8s.aws/resources"),
            held("Ingress", "shop/web", "ingress.k8s.aws/resources"),
        ];
        let aws = [lb("k8s-shop-front", "service.k8s.aws/stack shop/front"), lb("other", "service.k8s.aws/stack x/y")];
        let none = BTreeSet::new();
        let nv = BTreeMap::new();
        let left = pending(&release, &none, &aws, &nv, &none);
        assert_eq!(left.len(), 2);
        assert_eq!(left[0].in_aws, vec!["k8s-shop-front".to_string()]);
        assert!(left[1].in_aws.is_empty() && left[1].in_cluster);
        // the Service gone from the cluster, its load balancer not yet: still pending
        let gone: BTreeSet<String> = ["Service/shop/front".to_string(), "Ingress/shop/web".to_string()].into();
        let left = pending(&release, &gone, &aws, &nv, &none);
        assert_eq!(left.len(), 1);
        assert_eq!(
            left[0],
            Pending { object: "Service/shop/front".into(), in_cluster: false, in_aws: vec!["k8s-shop-front".into()] }
        );
        // another stack's load balancer keeps nothing pending
        assert_eq!(pending(&release, &gone, &aws[1..], &nv, &none), Vec::new());
        let stop = blocked(&pending(&release, &none, &aws, &nv, &none), Duration::from_secs(60));
        assert_eq!(stop.exit, Exit::Blocked);
        assert_eq!(stop.blockers.len(), 2);
        assert!(
            stop.error.contains("within 1m") && stop.error.contains("still in AWS: k8s-shop-front"),
            "{}",
            stop.error
        );
    }

    #[test]
    fn a_volume_is_released_once_its_pv_and_its_ebs_volume_are_gone() {
        let pv = Held {
            kind: "PersistentVolume",
            name: "pv-db-0".into(),
            finalizer: Some(crate::cleanup::FINALIZER_PROVISIONER.into()),
            cleaner: Cleaner::EbsCsi,
            protected: false,
            uid: None,
        };
        let release = [pv];
        let volumes: BTreeMap<String, String> = [("pv-db-0".to_string(), "vol-0".to_string())].into();
        let in_ec2: BTreeSet<String> = ["vol-0".to_string()].into();
        let none = BTreeSet::new();
        let left = pending(&release, &none, &[], &volumes, &in_ec2);
        assert_eq!(
            left,
            vec![Pending { object: "PersistentVolume/pv-db-0".into(), in_cluster: true, in_aws: vec!["vol-0".into()] }]
        );
        // the PV gone (the controller deletes it after the volume), the volume still listed
        // (EC2's eventual consistency): still pending
        let gone: BTreeSet<String> = ["PersistentVolume/pv-db-0".to_string()].into();
        assert_eq!(pending(&release, &gone, &[], &volumes, &in_ec2).len(), 1);
        assert!(pending(&release, &gone, &[], &volumes, &none).is_empty());
        // a load balancer of any stack never keeps a PV pending
        assert!(pending(&release, &gone, &[lb("k8s-x", "service.k8s.aws/stack a/b")], &volumes, &none).is_empty());
    }
}
