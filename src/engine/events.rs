//! What the engine tells the rest of the program while it runs, as typed values on one channel:
//! the live view, the interrupt handler (what is in flight) and anything else read these, never
//! the log text.

use tokio::sync::mpsc;

use crate::report::{Blocker, Bypass, TaskResult};
use crate::verify::Leftovers;

/// One task of the plan, as the events name it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskRef {
    /// The step id from the plan.
    pub step: String,
    /// The step's action (`drain`, `discharge-finalizers`, ...): what the task does, whatever the
    /// user named the step.
    pub action: crate::plan::Action,
    /// The object of a per-object task.
    pub object: Option<String>,
}

impl TaskRef {
    /// `step` or `step object`.
    pub fn label(&self) -> String {
        match &self.object {
            Some(o) => format!("{} {o}", self.step),
            None => self.step.clone(),
        }
    }
}

/// What a drain is waiting on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waiting {
    /// Evictions are being asked for.
    Evicting,
    /// Every pod left was evicted: their grace periods are running.
    GracePeriods,
    /// A PodDisruptionBudget allows no disruption now (`namespace/name`).
    Budget(String),
}

/// An event of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// The graph is expanded and the first tasks start.
    RunStarted {
        /// Tasks in the graph.
        tasks: u64,
        /// Tasks per step, in plan order.
        steps: Vec<(String, u64)>,
    },
    /// A task got its permit and runs.
    TaskStarted(TaskRef),
    /// A drain's pods left on its node, and what it waits on.
    DrainProgress {
        /// The drain task.
        task: TaskRef,
        /// Drainable pods still on the node.
        pods_left: u64,
        /// What it waits on.
        waiting: Waiting,
    },
    /// A drain's deadline passed with pods still on its node; its policy (fail, delete, skip)
    /// applies now.
    DrainDeadlinePassed {
        /// The drain task.
        task: TaskRef,
        /// Drainable pods still on the node.
        pods_left: u64,
    },
    /// Something blocked or fought the run.
    Blocker(Blocker),
    /// A pod let go without an eviction.
    Bypassed(Bypass),
    /// Pods found bound to a node after its drain began (the scheduler placed them while
    /// something had lifted the node's fence); each is drained too.
    PodsRebound {
        /// The node.
        node: String,
        /// The pods' UIDs.
        uids: Vec<String>,
    },
    /// Pods a drain must move found on a node whose instance was terminated: they went down with
    /// it (bound after the node was checked empty, while something lifted its fence).
    PodsLost {
        /// The node.
        node: String,
        /// The pods' UIDs.
        uids: Vec<String>,
    },
    /// Verification's answer: what is left, and what `--reclaim` removed before it looked again.
    Verified {
        /// What AWS and the cluster still hold.
        leftovers: Leftovers,
        /// What `--reclaim` removed.
        reclaimed: Vec<String>,
    },
    /// A machine the plan was not expanded over (a NodeClaim launched during the run) was found:
    /// it gets the plan's machine steps as tasks of their own.
    MachineFoundLate {
        /// The NodeClaim.
        machine: String,
        /// Why it is late, and which task found it.
        why: String,
        /// Its tasks, in run order.
        tasks: Vec<TaskRef>,
    },
    /// A task is over.
    TaskEnded {
        /// The task.
        task: TaskRef,
        /// How it ended.
        result: TaskResult,
        /// What happened.
        detail: String,
    },
}

/// Where the engine sends its events; a sink with no receiver drops them.
#[derive(Debug, Clone, Default)]
pub struct Events {
    tx: Option<mpsc::UnboundedSender<EngineEvent>>,
}

impl Events {
    /// A sink and the receiver that reads it.
    pub fn channel() -> (Events, mpsc::UnboundedReceiver<EngineEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Events { tx: Some(tx) }, rx)
    }

    /// A sink nobody reads.
    pub fn none() -> Events {
        Events::default()
    }

    /// Sends an event (dropped when nobody reads).
    pub fn send(&self, ev: EngineEvent) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ev);
        }
    }
}
