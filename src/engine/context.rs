//! What every task can reach: the clients, the shared pod index and EC2 batcher, the run's
//! settings and a sink for what it observed.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::batcher::Ec2Batcher;
use super::podindex::PodIndex;
use crate::aws::AwsClients;
use crate::config::DrainPolicy;
use crate::k8s::Kube;
use crate::report::{Blocker, BlockerKind};

/// Overrides of the plan's drain params from the command line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainOverrides {
    /// `--drain-deadline`.
    pub deadline: Option<Duration>,
    /// `--on-drain-deadline`.
    pub policy: Option<DrainPolicy>,
    /// A rehearsal's drain: the deadline's clock starts once the node's first eviction wave has
    /// been asked for (or held by its budgets), not when the drain starts. The rehearsal runs the
    /// deadline and the grace periods on an accelerated clock but the requests at their own
    /// speed, so on a large cluster the queue of evictions alone would use up an accelerated
    /// deadline that the real run, ten minutes long, is nowhere near.
    pub deadline_from_dispatch: bool,
}

/// Shared state of one run.
pub struct Ctx {
    /// Kubernetes.
    pub kube: Kube,
    /// AWS.
    pub aws: AwsClients,
    /// Cluster name.
    pub cluster: String,
    /// Region.
    pub region: String,
    /// Pods by node, from one watch.
    pub pods: PodIndex,
    /// PodDisruptionBudgets and what they allow now, from one watch.
    pub budgets: super::budgets::Budgets,
    /// Batched EC2 terminations and state polls.
    pub ec2: Ec2Batcher,
    /// CLI overrides for drain steps.
    pub drain: DrainOverrides,
    /// `--reclaim`.
    pub reclaim: bool,
    /// The machines of the inventory the plan was expanded over. A NodeClaim not among them was
    /// launched during the run (by a controller that was not fenced); no task of the graph
    /// handles it, so the step that would otherwise wait for it forever sweeps it up.
    pub inventoried: BTreeSet<String>,
    /// Instance profiles the inventory's EC2NodeClasses name in `spec.instanceProfile`: the
    /// user's, never reported or deleted.
    pub user_instance_profiles: BTreeSet<String>,
    /// Set on Ctrl-C / SIGTERM: stop starting work, finish or abandon in-flight work safely.
    pub cancel: CancellationToken,
    /// Where the run's typed events go (the live view, the interrupt handler).
    pub events: super::events::Events,
    /// Things that blocked or fought the run, for the report.
    pub notes: Mutex<Vec<Blocker>>,
    /// The leftovers verification found, for the report.
    pub leftovers: Mutex<Option<crate::verify::Leftovers>>,
    /// What `--reclaim` removed.
    pub reclaimed: Mutex<Vec<String>>,
    /// When this run saw the Karpenter controller's pods gone (scaled to zero, or its Deployment
    /// deleted): nothing of Karpenter's can start a launch after it, so verification's settle
    /// counts from here.
    pub controller_gone_at: Mutex<Option<std::time::Instant>>,
    /// UIDs of the pods found bound to a node after its drain began (the scheduler placed them
    /// while something had lifted the node's fence): each is drained too, and counted once.
    pub rebound: Mutex<HashSet<String>>,
    /// UIDs of the pods a drain left on their node by policy (`skip` at the deadline): the
    /// user's consent to let them go with the node, which the check before a node's release
    /// honours.
    pub abandoned: Mutex<HashSet<String>>,
}

impl Ctx {
    /// Records that the Karpenter controller's pods are gone (the first time counts).
    pub fn controller_seen_gone(&self) {
        self.controller_gone_at.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(std::time::Instant::now);
    }

    /// Records pods found bound to `node` after its drain began; returns how many were new.
    pub(crate) fn note_rebound<'a>(&self, node: &str, uids: impl IntoIterator<Item = &'a str>) -> usize {
        let mut rebound = self.rebound.lock().unwrap_or_else(|p| p.into_inner());
        let new = uids.into_iter().filter(|u| rebound.insert((*u).to_string())).count();
        drop(rebound);
        if new > 0 {
            tracing::warn!(node = %node, pods = new, "pods were bound to the node after its drain began; draining them too");
        }
        new
    }

    /// Records a blocker or an actor that fought the run.
    pub fn note(&self, kind: BlockerKind, name: &str, reason: impl Into<String>) {
        let b = Blocker { kind, name: name.into(), reason: reason.into() };
        let mut notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
        if !notes.contains(&b) {
            notes.push(b.clone());
            drop(notes);
            self.events.send(super::events::EngineEvent::Blocker(b));
        }
    }
}

/// A shared context.
pub type SharedCtx = Arc<Ctx>;
