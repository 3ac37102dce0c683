//! The JSON report (`--report FILE`) and the short human summary printed at the end of a run.
//! The schema is versioned; `deploy/report.schema.json` (JSON Schema 2020-12) describes version 1
//! field by field, and a test validates a real run's report against it.

pub(crate) mod timeline;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use serde::Serialize;

use crate::exit::Exit;
use crate::gitops::Survey;
use crate::verify::Leftovers;

/// Version of the report schema; bumped on any incompatible change.
pub(crate) const REPORT_VERSION: u32 = 1;

/// How a run ended, as the report names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// Nothing left.
    Clean,
    /// Leftovers remain.
    Leftovers,
    /// Something failed.
    Failed,
    /// A guard refused; nothing changed.
    Refused,
    /// Blocked past a deadline under policy `fail`.
    Blocked,
    /// No `--yes`: nothing changed.
    DryRun,
    /// Interrupted.
    Interrupted,
    /// The plan has no `verify` step: nothing proves what is left.
    Unverified,
}

impl Outcome {
    /// The outcome an exit status stands for.
    pub(crate) fn from_exit(exit: Exit) -> Outcome {
        match exit {
            Exit::Clean => Outcome::Clean,
            Exit::Leftovers => Outcome::Leftovers,
            Exit::Refused => Outcome::Refused,
            Exit::Blocked => Outcome::Blocked,
            Exit::Interrupted => Outcome::Interrupted,
            Exit::Unverified => Outcome::Unverified,
            Exit::Failure | Exit::BadInput => Outcome::Failed,
        }
    }
}

/// How a task ended, as the report's `steps[].result` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TaskResult {
    /// It did what it is for (or found it done).
    Done,
    /// Nothing to do, or skipped by policy.
    Skipped,
    /// Blocked past its deadline (pods, PDBs).
    Blocked,
    /// Verification found leftovers.
    Leftovers,
    /// It failed.
    Failed,
    /// Stopped by Ctrl-C / SIGTERM.
    Interrupted,
}

impl TaskResult {
    /// The word, as in the report.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TaskResult::Done => "done",
            TaskResult::Skipped => "skipped",
            TaskResult::Blocked => "blocked",
            TaskResult::Leftovers => "leftovers",
            TaskResult::Failed => "failed",
            TaskResult::Interrupted => "interrupted",
        }
    }

    /// Whether it went as planned (done or skipped).
    pub(crate) fn is_ok(self) -> bool {
        matches!(self, TaskResult::Done | TaskResult::Skipped)
    }
}

impl std::fmt::Display for TaskResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What kind of thing blocked or fought a run, as the report's `blockers[].kind` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlockerKind {
    /// A pod that was still on its node at the deadline.
    Pod,
    /// A PodDisruptionBudget that allowed no disruption.
    Pdb,
    /// A field manager that undid the tool's write (a cordon, the controller's replicas).
    FieldManager,
    /// A leftover `--reclaim` could not remove.
    Reclaim,
    /// A pod that tolerates the fence and went with its node (blocked nothing).
    PodGoesWithNode,
    /// A GitOps owner whose sync or reconcile was still in flight at the deadline.
    GitopsOwner,
    /// A pod a drain must move that was still bound to its node when the node's instance was
    /// terminated: it went down with it.
    PodLost,
    /// A webhook or admission policy that refuses a write the run makes.
    Admission,
    /// An object a cleanup controller holds, which the drain would strand.
    Stranded,
    /// An object `--release` deletes that cannot be released (deletion protection, its
    /// controller not running) or was not gone by the deadline.
    Release,
}

impl BlockerKind {
    /// The word, as in the report.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BlockerKind::Pod => "pod",
            BlockerKind::Pdb => "pdb",
            BlockerKind::FieldManager => "field-manager",
            BlockerKind::Reclaim => "reclaim",
            BlockerKind::PodGoesWithNode => "pod-goes-with-node",
            BlockerKind::GitopsOwner => "gitops-owner",
            BlockerKind::PodLost => "pod-lost",
            BlockerKind::Admission => "admission",
            BlockerKind::Stranded => "stranded",
            BlockerKind::Release => "release",
        }
    }
}

impl std::fmt::Display for BlockerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A pod the run let go without the Eviction API's consent: what a CI step that must not lose
/// pods fails on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Bypass {
    /// How the pod went.
    pub kind: BypassKind,
    /// `namespace/name`.
    pub pod: String,
    /// The node it was on.
    pub node: String,
}

/// How a pod went without an eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BypassKind {
    /// The drain's deadline passed under policy `skip`: the pod went with its node, its
    /// PodDisruptionBudget bypassed.
    Skip,
    /// The drain's deadline passed under policy `delete`: the pod was deleted, its budget bypassed.
    Delete,
    /// The pod tolerates the fence (`karpenter.sh/disrupted`, or every taint): it is not evicted
    /// and goes with its node, as Karpenter lets it.
    RidesWithNode,
}

/// One step or per-object task of the plan, as it ran.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepRecord {
    /// Step id from the plan.
    pub step: String,
    /// Action of the step.
    pub action: String,
    /// The object a per-object task acted on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    /// RFC 3339 start time.
    pub started: String,
    /// RFC 3339 end time.
    pub finished: String,
    /// How many attempts it took (1 when nothing was retried).
    pub attempts: u32,
    /// How it ended.
    pub result: TaskResult,
    /// What happened, in a sentence.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// For a task of a machine found after the plan was expanded (a NodeClaim launched during
    /// the run): why it was late, and which task found it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub found_late: Option<String>,
}

/// Something that kept the run from going on.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Blocker {
    /// What kind of thing it is.
    pub kind: BlockerKind,
    /// `namespace/name` or name.
    pub name: String,
    /// Why it blocks.
    pub reason: String,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Schema version ([`REPORT_VERSION`]).
    pub version: u32,
    /// The tool's version.
    pub tool_version: String,
    /// The command that produced it (`run`, `verify`).
    pub command: String,
    /// Cluster name.
    pub cluster: String,
    /// Region.
    pub region: String,
    /// Plan name (empty for `verify`).
    pub plan: String,
    /// How it ended.
    pub outcome: Outcome,
    /// The process exit code.
    pub exit_code: u8,
    /// RFC 3339 start.
    pub started: String,
    /// RFC 3339 end.
    pub finished: String,
    /// Wall time in seconds.
    pub wall_seconds: f64,
    /// Steps and tasks.
    pub steps: Vec<StepRecord>,
    /// What blocked.
    pub blockers: Vec<Blocker>,
    /// What was left at the end (ids).
    pub leftovers: Leftovers,
    /// What was reclaimed (`--reclaim`), as ids and names.
    pub reclaimed: Vec<String>,
    /// What `--reclaim` would have removed had `--yes` been given (same form as `reclaimed`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub would_reclaim: Vec<String>,
    /// `run`: pods found bound to a node after its drain began (placed while something had
    /// lifted the node's fence), each drained too before its node was released.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pods_rebound: Option<u64>,
    /// `run`: every pod the run let go without an eviction (policy `skip` or `delete` at a
    /// drain's deadline, pods that tolerate the fence and go with their node), each once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bypasses: Option<Vec<Bypass>>,
    /// `run`: pods a drain must move that were still bound to their node when its instance was
    /// terminated (bound after the node was checked empty): they went down with it, and the run
    /// is not clean.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pods_lost: Option<u64>,
    /// API calls made, by `service:verb` (e.g. `kubernetes:patch`, `ec2:TerminateInstances`); AWS
    /// keys are the IAM actions the calls need.
    pub api_calls: BTreeMap<String, u64>,
    /// The GitOps owners (Argo CD, Flux) of the Karpenter objects and what the run did with them.
    #[serde(skip_serializing_if = "Survey::is_empty")]
    pub gitops: Survey,
    /// NodePools, NodeClaims and Nodes of Karpenter's kinds that are not this cluster's
    /// self-managed Karpenter's (EKS Auto Mode's, another provider's): left alone, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_ours: Vec<crate::karpenter::Foreign>,
    /// The error, when the outcome is `failed` or `refused`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `rehearse`: the snapshot it played and what it predicts for the real run, as `rehearse`
    /// writes it (the report knows the run's vocabulary, not the rehearsal's; the schema
    /// describes both).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rehearsal: Option<serde_json::Value>,
}

impl Report {
    /// A report for a run that starts now.
    pub fn start(command: &str, cluster: &str, region: &str, plan: &str) -> (Report, SystemTime) {
        let now = SystemTime::now();
        let stamp = rfc3339(now);
        (
            Report {
                version: REPORT_VERSION,
                tool_version: env!("CARGO_PKG_VERSION").to_string(),
                command: command.to_string(),
                cluster: cluster.to_string(),
                region: region.to_string(),
                plan: plan.to_string(),
                outcome: Outcome::Failed,
                exit_code: Exit::Failure.code(),
                started: stamp.clone(),
                finished: stamp,
                wall_seconds: 0.0,
                steps: Vec::new(),
                blockers: Vec::new(),
                leftovers: Leftovers::default(),
                reclaimed: Vec::new(),
                would_reclaim: Vec::new(),
                pods_rebound: None,
                bypasses: None,
                pods_lost: None,
                api_calls: BTreeMap::new(),
                gitops: Survey::default(),
                not_ours: Vec::new(),
                error: None,
                rehearsal: None,
            },
            now,
        )
    }

    /// Closes the report with the run's exit status (a dry run keeps `dry-run`).
    pub fn finish(&mut self, started: SystemTime, exit: Exit, dry_run: bool) {
        let now = SystemTime::now();
        self.finished = rfc3339(now);
        self.wall_seconds = now.duration_since(started).map(|d| d.as_secs_f64()).unwrap_or_default();
        self.exit_code = exit.code();
        self.outcome = if dry_run && matches!(exit, Exit::Clean | Exit::Leftovers | Exit::Unverified) {
            Outcome::DryRun
        } else {
            Outcome::from_exit(exit)
        };
    }

    /// Writes the report as pretty JSON.
    pub(crate) fn write(&self, path: &Path) -> std::io::Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, json + "\n")
    }

    /// The short human summary for the end of every run: the outcome line and what the report
    /// holds, never the error (the command has said it on stderr).
    pub(crate) fn summary(&self) -> String {
        let mut s = format!(
            "{}{} on cluster {} ({}): {} in {:.1}s, exit {}",
            self.command,
            if self.plan.is_empty() { String::new() } else { format!(" [plan {}]", self.plan) },
            self.cluster,
            self.region,
            serde_json::to_value(self.outcome).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
            self.wall_seconds,
            self.exit_code
        );
        if !self.steps.is_empty() {
            let mut results: BTreeMap<TaskResult, usize> = BTreeMap::new();
            for st in &self.steps {
                *results.entry(st.result).or_default() += 1;
            }
            let parts: Vec<String> = results.iter().map(|(r, n)| format!("{n} {r}")).collect();
            s.push_str(&format!("\n  tasks: {}", parts.join(", ")));
            let retried: u32 = self.steps.iter().map(|st| st.attempts.saturating_sub(1)).sum();
            if retried > 0 {
                s.push_str(&format!("\n  retries: {retried} (transient API errors; see steps[].attempts)"));
            }
        }
        if !self.api_calls.is_empty() {
            let mut by_service: BTreeMap<&str, u64> = BTreeMap::new();
            for (k, n) in &self.api_calls {
                *by_service.entry(k.split(':').next().unwrap_or(k)).or_default() += n;
            }
            let parts: Vec<String> = by_service.iter().map(|(svc, n)| format!("{svc} {n}")).collect();
            s.push_str(&format!("\n  api calls: {}", parts.join(", ")));
        }
        for st in self.steps.iter().filter(|st| matches!(st.result, TaskResult::Blocked | TaskResult::Failed)) {
            let what = st.object.as_ref().map(|o| format!("{}[{o}]", st.step)).unwrap_or_else(|| st.step.clone());
            // the run's error, said once on stderr, is not said again here
            if self.error.as_deref() == Some(&format!("{what}: {}", st.detail)) {
                continue;
            }
            s.push_str(&format!("\n  {} {what}: {}", st.result, st.detail));
        }
        let mut late: BTreeMap<&str, &str> = BTreeMap::new();
        for st in &self.steps {
            if let (Some(machine), Some(why)) = (&st.object, &st.found_late) {
                late.entry(machine.as_str()).or_insert(why.as_str());
            }
        }
        for (machine, why) in late {
            s.push_str(&format!("\n  found late: {machine}: {why}"));
        }
        for b in &self.blockers {
            if b.kind == BlockerKind::PodGoesWithNode {
                // it blocked nothing: it tolerates the fence and went with its node
                s.push_str(&format!("\n  went with its node: pod {}: {}", b.name, b.reason));
            } else {
                s.push_str(&format!("\n  blocked by {} {}: {}", b.kind, b.name, b.reason));
            }
        }
        for f in &self.gitops.owners {
            let done = if f.paused_by_run {
                "paused (not resumed)"
            } else if f.state.is_active() {
                "active"
            } else {
                "left paused"
            };
            s.push_str(&format!("\n  gitops: {}: {done}", f.owner));
        }
        for line in self.leftovers.describe() {
            s.push_str(&format!("\n  left: {line}"));
        }
        for r in &self.reclaimed {
            s.push_str(&format!("\n  reclaimed: {r}"));
        }
        for r in &self.would_reclaim {
            s.push_str(&format!("\n  would reclaim with --yes: {r}"));
        }
        // the error is printed once, as the command's `error:` line on stderr, and kept in the
        // report's `error`: the summary does not repeat it
        s
    }
}

/// RFC 3339 UTC with milliseconds.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
