//! How a task ends: what every action returns and the engine records. Its own module so that
//! the actions and the drain, which both return it, need not import each other.

use crate::k8s::{self, KubeError};
use crate::report::TaskResult;

/// How a task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskOutcome {
    /// Done; what was done.
    Done(String),
    /// Nothing to do, or skipped by policy.
    Skipped(String),
    /// Blocked past its deadline under policy `fail`.
    Blocked(String),
    /// Verification found leftovers.
    Leftovers(String),
    /// Failed.
    Failed(String),
    /// Failed on something that may pass (429, 5xx, a lost connection): the engine runs the
    /// task again (actions are idempotent functions of the live state) with backoff.
    Transient(String),
    /// Stopped by Ctrl-C / SIGTERM.
    Interrupted,
    /// Found machines the graph does not know (NodeClaims launched during the run) that its
    /// work must wait for: the executor adds their tasks from the plan's own machine steps and
    /// runs this task again after them.
    FoundLate(Vec<LateMachine>),
}

/// A machine (a NodeClaim) found after the plan was expanded, and why it is late.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LateMachine {
    /// The NodeClaim's name.
    pub name: String,
    /// Why it is late, and who found it.
    pub why: String,
}

impl TaskOutcome {
    /// The report's `result`.
    pub fn result(&self) -> TaskResult {
        match self {
            TaskOutcome::Done(_) => TaskResult::Done,
            TaskOutcome::Skipped(_) => TaskResult::Skipped,
            TaskOutcome::Blocked(_) => TaskResult::Blocked,
            TaskOutcome::Leftovers(_) => TaskResult::Leftovers,
            TaskOutcome::Failed(_) | TaskOutcome::Transient(_) => TaskResult::Failed,
            TaskOutcome::Interrupted => TaskResult::Interrupted,
            // never the end of a task: it runs again once the machines' tasks have
            TaskOutcome::FoundLate(_) => TaskResult::Done,
        }
    }

    /// The detail sentence.
    pub fn detail(&self) -> &str {
        match self {
            TaskOutcome::Done(d)
            | TaskOutcome::Skipped(d)
            | TaskOutcome::Blocked(d)
            | TaskOutcome::Leftovers(d)
            | TaskOutcome::Failed(d)
            | TaskOutcome::Transient(d) => d,
            TaskOutcome::Interrupted => "interrupted",
            TaskOutcome::FoundLate(_) => "found machines launched during the run",
        }
    }

    /// Whether dependents may run after this.
    pub fn lets_dependents_run(&self) -> bool {
        matches!(self, TaskOutcome::Done(_) | TaskOutcome::Skipped(_) | TaskOutcome::Leftovers(_))
    }
}

impl From<KubeError> for TaskOutcome {
    fn from(e: KubeError) -> Self {
        match &e {
            KubeError::Api { source, .. } if k8s::is_transient(source) => TaskOutcome::Transient(e.to_string()),
            _ => TaskOutcome::Failed(e.to_string()),
        }
    }
}

impl From<crate::aws::AwsError> for TaskOutcome {
    fn from(e: crate::aws::AwsError) -> Self {
        if e.is_transient() { TaskOutcome::Transient(e.to_string()) } else { TaskOutcome::Failed(e.to_string()) }
    }
}

/// Why a task could not do its work. The engine turns it into a `failed` task, or runs the task
/// again when it is transient (actions are idempotent functions of the live state).
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A Kubernetes call failed.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// An EC2 or IAM call failed.
    #[error(transparent)]
    Aws(#[from] crate::aws::AwsError),
}

impl From<TaskError> for TaskOutcome {
    fn from(e: TaskError) -> Self {
        match e {
            TaskError::Kube(e) => e.into(),
            TaskError::Aws(e) => e.into(),
        }
    }
}

/// What an action returns: how it ended, or the error that stopped it, so that a failed call
/// propagates with `?` and the engine alone decides between `failed` and another attempt.
pub type Outcome = Result<TaskOutcome, TaskError>;
