//! `--release`: before the drain, while the cleanup controllers still run, delete the objects
//! they hold and wait until each is gone (its controller removes its finalizer once it has
//! deleted what it made in AWS) and AWS shows nothing left for its stack. The tool never removes
//! a finalizer itself: that would leak the AWS objects behind it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::phases::Stop;
use crate::aws::AwsClients;
use crate::cleanup::{Held, stack_of};
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

/// What of `release` is still there, from which objects are gone and what AWS shows for the
/// cluster (`found`: [`crate::verify::load_balancing`]), pure.
pub(crate) fn pending(release: &[Held], gone: &BTreeSet<String>, found: &[crate::aws::LoadBalancing]) -> Vec<Pending> {
    release
        .iter()
        .filter_map(|h| {
            let object = h.object();
            let stack = stack_of(h);
            let in_aws: Vec<String> =
                found.iter().filter(|l| Some(&l.made_for) == stack.as_ref()).map(|l| l.name.clone()).collect();
            let in_cluster = !gone.contains(&object);
            (in_cluster || !in_aws.is_empty()).then_some(Pending { object, in_cluster, in_aws })
        })
        .collect()
}

/// Deletes each object of `release`, then waits until [`pending`] is empty, for at most
/// `deadline`: past it, the run ends blocked (exit 5) before the drain, naming what is left.
pub(crate) async fn release(
    kube: &Kube,
    aws: &AwsClients,
    cluster: &str,
    release: &[Held],
    deadline: Duration,
    cancel: &CancellationToken,
) -> (StepRecord, Option<Stop>) {
    let started = SystemTime::now();
    let (detail, stop) = match run(kube, aws, cluster, release, deadline, cancel).await {
        Ok(()) => (
            format!(
                "released {} object(s) while their controllers ran; they and their load balancers, target groups and security groups are gone",
                release.len()
            ),
            None,
        ),
        Err(stop) => (stop.error.clone(), Some(stop)),
    };
    (super::phase_record("release", started, stop.as_ref(), detail), stop)
}

async fn run(
    kube: &Kube,
    aws: &AwsClients,
    cluster: &str,
    release: &[Held],
    deadline: Duration,
    cancel: &CancellationToken,
) -> Result<(), Stop> {
    let clock = Instant::now();
    for h in release {
        let span = tracing::info_span!("task", step = "release", object = %h.object());
        crate::k8s::retry_transient(|| crate::k8s::cleanup::delete(&kube.client, h))
            .instrument(span)
            .await
            .map_err(Stop::failed)?;
        tracing::warn!(object = %h.object(), "deleted; its controller deletes what it made in AWS, then its finalizer");
    }
    loop {
        let there = crate::k8s::retry_transient(|| crate::k8s::cleanup::still_there(&kube.client, release))
            .await
            .map_err(Stop::failed)?;
        let gone: BTreeSet<String> = release.iter().map(|h| h.object()).filter(|o| !there.contains(o)).collect();
        let found =
            crate::verify::load_balancing(aws, cluster).await.map_err(|e| Stop::of(&e, e.is_configuration()))?;
        let left = pending(release, &gone, &found);
        if left.is_empty() {
            return Ok(());
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
            finalizer: finalizer.into(),
            cleaner: Cleaner::LoadBalancerController,
            protected: false,
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
        let left = pending(&release, &none, &aws);
        assert_eq!(left.len(), 2);
        assert_eq!(left[0].in_aws, vec!["k8s-shop-front".to_string()]);
        assert!(left[1].in_aws.is_empty() && left[1].in_cluster);
        // the Service gone from the cluster, its load balancer not yet: still pending
        let gone: BTreeSet<String> = ["Service/shop/front".to_string(), "Ingress/shop/web".to_string()].into();
        let left = pending(&release, &gone, &aws);
        assert_eq!(left.len(), 1);
        assert_eq!(
            left[0],
            Pending { object: "Service/shop/front".into(), in_cluster: false, in_aws: vec!["k8s-shop-front".into()] }
        );
        // another stack's load balancer keeps nothing pending
        assert_eq!(pending(&release, &gone, &aws[1..]), Vec::new());
        let stop = blocked(&pending(&release, &none, &aws), Duration::from_secs(60));
        assert_eq!(stop.exit, Exit::Blocked);
        assert_eq!(stop.blockers.len(), 2);
        assert!(
            stop.error.contains("within 1m") && stop.error.contains("still in AWS: k8s-shop-front"),
            "{}",
            stop.error
        );
    }
}
