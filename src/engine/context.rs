//! What every task can reach: the clients, the shared pod index and EC2 batcher, the run's
//! settings and a sink for what it observed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
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
    /// The order of every drain's evictions: earliest deadline first, cluster-wide (see the gate).
    pub(crate) evictions: super::gate::PriorityGate,
    /// CLI overrides for drain steps.
    pub drain: DrainOverrides,
    /// `--reclaim`.
    pub reclaim: bool,
    /// The machines of the inventory the plan was expanded over. A NodeClaim not among them
    /// (nor in `late`) was launched during the run (by a controller that was not fenced): the
    /// step that finds it hands it to the executor (`TaskOutcome::FoundLate`).
    pub inventoried: BTreeSet<String>,
    /// The machines found late that the executor has given tasks of the plan's machine steps.
    pub(crate) late: Mutex<BTreeSet<String>>,
    /// The NodePools the inventory found another controller's, and whose: their NodeClaims are
    /// not this run's to wait for or act on, whatever their own labels say.
    pub(crate) foreign_pools: BTreeMap<String, crate::karpenter::NotOurs>,
    /// Instance profiles the inventory's EC2NodeClasses name in `spec.instanceProfile`: the
    /// user's, never reported or deleted.
    pub user_instance_profiles: BTreeSet<String>,
    /// The EBS volumes of the cluster's PersistentVolumes as the run found them (volume id, PV
    /// name): verification reports those still in EC2.
    pub volumes: std::collections::BTreeMap<String, String>,
    /// Set on Ctrl-C / SIGTERM: stop starting work, finish or abandon in-flight work safely.
    pub cancel: CancellationToken,
    /// Where the run's typed events go (the live view, the interrupt handler).
    pub events: super::events::Events,
    /// When this run saw the Karpenter controller's pods gone (scaled to zero, or its Deployment
    /// deleted): nothing of Karpenter's can start a launch after it, so verification's settle
    /// counts from here.
    pub controller_gone_at: OnceLock<std::time::Instant>,
    /// UIDs of the pods a drain left on their node by policy (`skip` at the deadline): the
    /// user's consent to let them go with the node, which the check before a node's release
    /// honours.
    pub abandoned: Mutex<HashSet<String>>,
    /// When each drain's deadline clock started (`step/node`), kept across the attempts of its
    /// task: a drain restarted after a transient error keeps its first deadline.
    pub(crate) drain_clocks: Mutex<HashMap<String, tokio::time::Instant>>,
}

impl Ctx {
    /// Whether the graph has tasks for this machine: inventoried, or found late and added.
    pub(crate) fn knows(&self, machine: &str) -> bool {
        self.inventoried.contains(machine) || self.late.lock().unwrap_or_else(|p| p.into_inner()).contains(machine)
    }

    /// Records that the executor gave a machine found late its tasks.
    pub(crate) fn know_late(&self, machine: &str) {
        self.late.lock().unwrap_or_else(|p| p.into_inner()).insert(machine.to_string());
    }

    /// Records that the Karpenter controller's pods are gone (the first time counts).
    pub fn controller_seen_gone(&self) {
        let _ = self.controller_gone_at.set(std::time::Instant::now());
    }

    /// Reports pods found bound to `node` after its drain began (the run's record counts each
    /// pod once, however often it is reported).
    pub(crate) fn note_rebound<'a>(&self, node: &str, uids: impl IntoIterator<Item = &'a str>) {
        let uids: Vec<String> = uids.into_iter().map(str::to_string).collect();
        if uids.is_empty() {
            return;
        }
        tracing::warn!(node = %node, pods = uids.len(), "pods were bound to the node after its drain began; draining them too");
        self.events.send(super::events::EngineEvent::PodsRebound { node: node.to_string(), uids });
    }

    /// When the drain `key` (`step/node`) started its deadline's clock in an earlier attempt.
    pub(crate) fn drain_clock(&self, key: &str) -> Option<tokio::time::Instant> {
        self.drain_clocks.lock().unwrap_or_else(|p| p.into_inner()).get(key).copied()
    }

    /// Keeps the first start of the drain `key`'s deadline clock.
    pub(crate) fn keep_drain_clock(&self, key: &str, since: tokio::time::Instant) {
        self.drain_clocks.lock().unwrap_or_else(|p| p.into_inner()).entry(key.to_string()).or_insert(since);
    }

    /// Reports pods that went down with their node: each is named, and the run is not clean.
    pub(crate) fn note_lost(&self, node: &str, pods: &[crate::k8s::pods::PodRef]) {
        if pods.is_empty() {
            return;
        }
        tracing::error!(node = %node, pods = pods.len(), "pods went down with their node: bound to it after it was checked empty");
        for p in pods {
            self.note(
                BlockerKind::PodLost,
                &format!("{}/{}", p.namespace, p.name),
                format!(
                    "went down with node {node}: bound to it after it was checked empty, while something had lifted its fence"
                ),
            );
        }
        let uids = pods.iter().map(|p| p.uid.clone()).collect();
        self.events.send(super::events::EngineEvent::PodsLost { node: node.to_string(), uids });
    }

    /// Records a pod let go without an eviction.
    pub(crate) fn note_bypass(&self, kind: crate::report::BypassKind, pod: &str, node: &str) {
        let b = crate::report::Bypass { kind, pod: pod.into(), node: node.into() };
        self.events.send(super::events::EngineEvent::Bypassed(b));
    }

    /// Reports a blocker or an actor that fought the run (the run's record keeps each once).
    pub fn note(&self, kind: BlockerKind, name: &str, reason: impl Into<String>) {
        let b = Blocker { kind, name: name.into(), reason: reason.into() };
        self.events.send(super::events::EngineEvent::Blocker(b));
    }
}

/// A shared context.
pub type SharedCtx = Arc<Ctx>;
