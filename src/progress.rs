//! The live progress view on a terminal: stages with their task counts, one line per running
//! task (a node draining with its pods left and what it waits on, an instance terminating) and
//! what blocks. It is fed the engine's typed events ([`crate::engine::events`]); it reads no log
//! text. Log lines (warnings and errors while the view is up) are printed above it.
//!
//! Without a terminal the view is not created at all: the logs are the only output there.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::engine::events::{EngineEvent, TaskRef, Waiting};
use crate::plan::Action;
use crate::report::{BlockerKind, TaskResult};

/// How many running tasks get a line of their own; the rest are counted in the header.
const MAX_TASK_LINES: usize = 12;
/// How many recent blockers are shown.
const MAX_BLOCKER_LINES: usize = 4;

/// State of one task as the view knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TaskState {
    /// Running since the instant.
    Running(Instant),
    /// Over, with how it ended.
    Ended(TaskResult),
}

/// A task of the plan, by step and object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct TaskKey {
    /// Step id.
    pub step: String,
    /// Object of a per-object task, empty for a whole-step task.
    pub object: String,
}

impl TaskKey {
    fn of(t: &TaskRef) -> TaskKey {
        TaskKey { step: t.step.clone(), object: t.object.clone().unwrap_or_default() }
    }

    fn label(&self) -> String {
        if self.object.is_empty() { self.step.clone() } else { format!("{} {}", self.step, self.object) }
    }
}

/// One task's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskLine {
    /// Running or over.
    pub state: TaskState,
    /// The action the task runs.
    pub action: Action,
    /// A drain's pods left and what it waits on.
    pub drain: Option<(u64, Waiting)>,
}

/// Everything the view shows, kept apart from drawing so it can be tested without a terminal.
#[derive(Debug, Default)]
pub(crate) struct Board {
    /// Total tasks of the run, once the engine said.
    pub total: Option<u64>,
    /// Tasks of each step in the graph, in plan order.
    pub steps: Vec<(String, u64)>,
    /// Tasks that started, with their state.
    pub tasks: BTreeMap<TaskKey, TaskLine>,
    /// Recent blockers and failures.
    pub blockers: Vec<String>,
}

impl Board {
    /// Applies one engine event.
    pub(crate) fn on_event(&mut self, ev: &EngineEvent, now: Instant) {
        match ev {
            EngineEvent::RunStarted { tasks, steps } => {
                self.total = Some(*tasks);
                self.steps = steps.clone();
            }
            EngineEvent::MachineFoundLate { machine, why, tasks } => {
                self.total = self.total.map(|t| t + tasks.len() as u64);
                for t in tasks {
                    if let Some((_, n)) = self.steps.iter_mut().find(|(s, _)| *s == t.step) {
                        *n += 1;
                    }
                }
                self.push_blocker(format!("found late: NodeClaim {machine}: {why}"));
            }
            EngineEvent::TaskStarted(t) => {
                self.tasks
                    .insert(TaskKey::of(t), TaskLine { state: TaskState::Running(now), action: t.action, drain: None });
            }
            EngineEvent::DrainProgress { task, pods_left, waiting } => {
                if let Some(line) = self.tasks.get_mut(&TaskKey::of(task)) {
                    line.drain = Some((*pods_left, waiting.clone()));
                }
            }
            EngineEvent::DrainDeadlinePassed { task, pods_left } => {
                self.push_blocker(format!(
                    "{}: drain deadline passed with {pods_left} pod(s) left",
                    TaskKey::of(task).label()
                ));
            }
            EngineEvent::TaskEnded { task, result, detail } => {
                let key = TaskKey::of(task);
                if !result.is_ok() {
                    self.push_blocker(format!("{}: {result}: {detail}", key.label()));
                }
                if let Some(line) = self.tasks.get_mut(&key) {
                    line.state = TaskState::Ended(*result);
                }
            }
            EngineEvent::Blocker(b) => {
                let line = if b.kind == BlockerKind::PodGoesWithNode {
                    format!("goes with its node: pod {}", b.name)
                } else {
                    format!("{} {}: {}", b.kind, b.name, b.reason)
                };
                self.push_blocker(line);
            }
            // the drains' own progress lines show the pods; the report counts them
            EngineEvent::PodsRebound { .. } | EngineEvent::PodsLost { .. } | EngineEvent::Verified { .. } => {}
            EngineEvent::Bypassed(b) => match b.kind {
                // named by its blocker line already
                crate::report::BypassKind::RidesWithNode => {}
                crate::report::BypassKind::Skip => self.push_blocker(format!("left by policy skip: pod {}", b.pod)),
                crate::report::BypassKind::Delete => {
                    self.push_blocker(format!("deleted by policy delete: pod {}", b.pod))
                }
            },
        }
    }

    fn push_blocker(&mut self, line: String) {
        self.blockers.push(line);
        if self.blockers.len() > MAX_BLOCKER_LINES {
            self.blockers.remove(0);
        }
    }

    /// The header: per step `ended/tasks` with what went wrong.
    pub(crate) fn header(&self) -> String {
        let mut parts = Vec::new();
        for (step, all) in &self.steps {
            let (mut ended, mut bad) = (0, BTreeMap::<TaskResult, u32>::new());
            for line in self.tasks.iter().filter(|(k, _)| &k.step == step).map(|(_, l)| l) {
                if let TaskState::Ended(r) = line.state {
                    ended += 1;
                    if !r.is_ok() {
                        *bad.entry(r).or_default() += 1;
                    }
                }
            }
            let mut p = format!("{step} {ended}/{all}");
            for (r, n) in bad {
                let _ = write!(p, " ({n} {r})");
            }
            parts.push(p);
        }
        parts.join(" · ")
    }

    /// The tasks running now, with when each started.
    fn running(&self) -> Vec<(&TaskKey, Instant, &TaskLine)> {
        self.tasks
            .iter()
            .filter_map(|(k, l)| match l.state {
                TaskState::Running(since) => Some((k, since, l)),
                TaskState::Ended(_) => None,
            })
            .collect()
    }

    /// Finished tasks.
    pub(crate) fn finished(&self) -> u64 {
        self.tasks.values().filter(|l| matches!(l.state, TaskState::Ended(_))).count() as u64
    }

    /// One line per running task, longest-running first, at most [`MAX_TASK_LINES`], and how
    /// many more run.
    pub(crate) fn running_lines(&self, now: Instant) -> (Vec<(TaskKey, String)>, usize) {
        let mut running = self.running();
        running.sort_by_key(|(_, since, _)| *since);
        let more = running.len().saturating_sub(MAX_TASK_LINES);
        let lines = running
            .into_iter()
            .take(MAX_TASK_LINES)
            .map(|(k, since, line)| {
                let mut l = format!("{}: {}", k.label(), doing(line.action));
                if let Some((pods, waiting)) = &line.drain {
                    let _ = write!(l, ", {pods} pod(s) left");
                    match waiting {
                        Waiting::Evicting => {}
                        Waiting::GracePeriods => l.push_str(", waiting for their grace periods"),
                        Waiting::Budget(b) => {
                            let _ = write!(l, ", waiting on PodDisruptionBudget {b}");
                        }
                    }
                }
                let _ = write!(l, " ({}s)", now.saturating_duration_since(since).as_secs());
                (k.clone(), l)
            })
            .collect();
        (lines, more)
    }
}

impl Board {
    /// One line for a log without a terminal, saying what the run is waiting for now: how many
    /// tasks run, the drains' pods and nodes, the budgets they wait on, and how long until the
    /// longest-running drain's deadline. `None` when nothing runs.
    pub(crate) fn waiting_summary(&self, now: Instant, drain_deadline: Duration) -> Option<String> {
        let running = self.running();
        if running.is_empty() {
            return None;
        }
        let mut by_step: BTreeMap<&str, usize> = BTreeMap::new();
        for (k, _, _) in &running {
            *by_step.entry(k.step.as_str()).or_default() += 1;
        }
        let steps: Vec<String> = by_step.iter().map(|(s, n)| format!("{s} {n}")).collect();
        let mut out = format!("{} task(s) running ({})", running.len(), steps.join(", "));
        let drains: Vec<&(&TaskKey, Instant, &TaskLine)> =
            running.iter().filter(|(_, _, l)| l.action == Action::Drain).collect();
        if !drains.is_empty() {
            let pods: u64 = drains.iter().filter_map(|(_, _, l)| l.drain.as_ref().map(|d| d.0)).sum();
            let nodes = drains.iter().filter(|(_, _, l)| l.drain.as_ref().is_some_and(|d| d.0 > 0)).count();
            let _ = write!(out, "; {pods} pod(s) to move on {nodes} node(s)");
            let budgets: std::collections::BTreeSet<&str> = drains
                .iter()
                .filter_map(|(_, _, l)| match l.drain.as_ref().map(|d| &d.1) {
                    Some(Waiting::Budget(b)) => Some(b.as_str()),
                    _ => None,
                })
                .collect();
            if !budgets.is_empty() {
                let shown: Vec<&str> = budgets.iter().take(5).copied().collect();
                let more = if budgets.len() > shown.len() { ", ..." } else { "" };
                let _ = write!(out, ", held by PodDisruptionBudget(s) {}{more}", shown.join(", "));
            }
            if let Some(oldest) = drains.iter().map(|(_, since, _)| *since).min() {
                let left = drain_deadline.saturating_sub(now.saturating_duration_since(oldest));
                let _ = write!(out, "; the first drain's deadline in {}s", left.as_secs());
            }
        }
        Some(out)
    }
}

/// What a task of an action is doing while it runs, in words.
fn doing(action: Action) -> &'static str {
    match action {
        Action::Drain => "draining",
        Action::DischargeFinalizers => "terminating the instance, then releasing the finalizer",
        Action::RemoveController => "scaling the controller to zero",
        Action::Fence => "fencing NodePools",
        Action::Cordon => "cordoning the Karpenter nodes",
        Action::WaitNodeclaimsGone => "waiting for NodeClaims to go",
        Action::DeleteNodeclasses => "deleting launch templates, instance profiles, then the EC2NodeClass",
        Action::DeleteNodepools => "deleting NodePools",
        Action::Verify => "verifying through EC2",
        Action::Preflight => "proving identity and taking inventory",
    }
}

/// The drawing side: indicatif bars fed from the board.
struct View {
    multi: MultiProgress,
    header: Option<ProgressBar>,
    lines: BTreeMap<TaskKey, ProgressBar>,
    more: Option<ProgressBar>,
    blockers: Option<ProgressBar>,
    board: Board,
}

impl View {
    fn redraw(&mut self) {
        if self.board.tasks.is_empty() {
            return;
        }
        let now = Instant::now();
        let header = self.header.get_or_insert_with(|| {
            let bar = self.multi.add(ProgressBar::new(0));
            // the template is a constant; a bad one would show the default style instead
            if let Ok(style) =
                ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:24} {pos}/{len} tasks  {wide_msg}")
            {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(250));
            bar
        });
        header.set_length(self.board.total.unwrap_or(self.board.tasks.len() as u64));
        header.set_position(self.board.finished());
        header.set_message(self.board.header());

        let (running, more) = self.board.running_lines(now);
        let keep: Vec<&TaskKey> = running.iter().map(|(k, _)| k).collect();
        self.lines.retain(|k, bar| {
            let stays = keep.contains(&k);
            if !stays {
                bar.finish_and_clear();
                self.multi.remove(bar);
            }
            stays
        });
        for (k, line) in running {
            let bar = self.lines.entry(k).or_insert_with(|| {
                let bar = self.multi.add(ProgressBar::new_spinner());
                if let Ok(style) = ProgressStyle::with_template("  {spinner} {wide_msg}") {
                    bar.set_style(style);
                }
                bar
            });
            bar.set_message(line);
            bar.tick();
        }
        set_line(&self.multi, &mut self.more, (more > 0).then(|| format!("  … and {more} more running")));
        let blockers = (!self.board.blockers.is_empty())
            .then(|| format!("  blocking / warnings:\n    {}", self.board.blockers.join("\n    ")));
        set_line(&self.multi, &mut self.blockers, blockers);
    }

    fn clear(&mut self) {
        for bar in self.lines.values() {
            bar.finish_and_clear();
        }
        self.lines.clear();
        for bar in [self.header.take(), self.more.take(), self.blockers.take()].into_iter().flatten() {
            bar.finish_and_clear();
        }
        let _ = self.multi.clear();
    }
}

/// Shows `text` on a line of its own (kept at the bottom), or removes the line.
fn set_line(multi: &MultiProgress, slot: &mut Option<ProgressBar>, text: Option<String>) {
    match (text, slot.as_ref()) {
        (Some(t), Some(bar)) => bar.set_message(t),
        (Some(t), None) => {
            let bar = multi.add(ProgressBar::new_spinner());
            if let Ok(style) = ProgressStyle::with_template("{msg}") {
                bar.set_style(style);
            }
            bar.set_message(t);
            *slot = Some(bar);
        }
        (None, Some(bar)) => {
            bar.finish_and_clear();
            multi.remove(bar);
            *slot = None;
        }
        (None, None) => {}
    }
}

/// The live view; clones share it.
#[derive(Clone)]
pub(crate) struct Progress {
    view: Arc<Mutex<View>>,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress")
    }
}

/// The view of this process, once logging installed it; [`finish`] clears it.
static ACTIVE: OnceLock<Progress> = OnceLock::new();

impl Progress {
    /// A view drawing on stderr.
    pub(crate) fn stderr() -> Progress {
        Progress::with_target(ProgressDrawTarget::stderr())
    }

    /// A view drawing to `target` (hidden in tests).
    pub(crate) fn with_target(target: ProgressDrawTarget) -> Progress {
        Progress {
            view: Arc::new(Mutex::new(View {
                multi: MultiProgress::with_draw_target(target),
                header: None,
                lines: BTreeMap::new(),
                more: None,
                blockers: None,
                board: Board::default(),
            })),
        }
    }

    /// Makes this the process's view, so [`finish`] can clear it before the summary.
    pub(crate) fn install(&self) {
        let _ = ACTIVE.set(self.clone());
    }

    fn with<R>(&self, f: impl FnOnce(&mut View) -> R) -> R {
        // a panic while drawing poisons the lock; the board itself stays usable
        let mut v = self.view.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut v)
    }

    /// Runs `f` (writing a log line) with the bars out of the way, so lines and bars never mix.
    pub(crate) fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        let multi = self.with(|v| v.multi.clone());
        multi.suspend(f)
    }

    /// A copy of what the board shows: the header, the running lines and the blockers.
    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> (String, Vec<String>, Vec<String>) {
        self.with(|v| {
            let (lines, _) = v.board.running_lines(Instant::now());
            (v.board.header(), lines.into_iter().map(|(_, l)| l).collect(), v.board.blockers.clone())
        })
    }

    /// Removes the bars (before the summary is printed).
    pub(crate) fn clear(&self) {
        self.with(View::clear);
    }

    /// Shows one engine event.
    pub(crate) fn on_engine_event(&self, ev: &EngineEvent) {
        self.with(|v| {
            v.board.on_event(ev, Instant::now());
            v.redraw();
        });
    }
}

/// The process's view, when logging installed one (stderr is a terminal, text logs).
pub(crate) fn active() -> Option<Progress> {
    ACTIVE.get().cloned()
}

/// Clears the process's live view, if there is one, so the summary prints on a clean screen.
pub(crate) fn finish() {
    if let Some(p) = ACTIVE.get() {
        p.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Blocker;

    fn task(step: &str, action: Action, object: Option<&str>) -> TaskRef {
        TaskRef { step: step.into(), action, object: object.map(str::to_string) }
    }

    #[test]
    fn the_board_follows_the_engine_events() {
        let progress = Progress::with_target(ProgressDrawTarget::hidden());
        let (a, b, c) = (
            task("drain", Action::Drain, Some("node-a")),
            task("drain", Action::Drain, Some("node-b")),
            task("halt", Action::Fence, None),
        );
        for ev in [
            EngineEvent::RunStarted { tasks: 3, steps: vec![("halt".into(), 1), ("drain".into(), 2)] },
            EngineEvent::TaskStarted(c.clone()),
            EngineEvent::TaskEnded { task: c, result: TaskResult::Done, detail: "fenced".into() },
            EngineEvent::TaskStarted(a.clone()),
            EngineEvent::DrainProgress { task: a.clone(), pods_left: 4, waiting: Waiting::Budget("ns/web".into()) },
            EngineEvent::TaskStarted(b.clone()),
            EngineEvent::TaskEnded {
                task: b,
                result: TaskResult::Blocked,
                detail: "pod a/p blocked by PDB a/pdb".into(),
            },
        ] {
            progress.on_engine_event(&ev);
        }
        let (header, running, blockers) = progress.snapshot();
        assert_eq!(header, "halt 1/1 · drain 1/2 (1 blocked)");
        assert_eq!(running.len(), 1, "{running:?}");
        // the step is named `halt` by the plan; what it does comes from its action
        assert!(
            running[0].starts_with("drain node-a: draining, 4 pod(s) left, waiting on PodDisruptionBudget ns/web"),
            "{running:?}"
        );
        assert_eq!(blockers, vec!["drain node-b: blocked: pod a/p blocked by PDB a/pdb".to_string()]);
        progress.clear();
    }

    #[test]
    fn without_a_terminal_a_line_says_what_the_run_waits_for() {
        let mut board = Board::default();
        let t0 = Instant::now();
        assert_eq!(board.waiting_summary(t0, Duration::from_secs(600)), None, "nothing runs yet");
        let (a, b, r) = (
            task("drain", Action::Drain, Some("node-a")),
            task("drain", Action::Drain, Some("node-b")),
            task("remove-controller", Action::RemoveController, None),
        );
        for ev in [
            EngineEvent::TaskStarted(a.clone()),
            EngineEvent::TaskStarted(b.clone()),
            EngineEvent::TaskStarted(r),
            EngineEvent::DrainProgress { task: a, pods_left: 3, waiting: Waiting::Budget("web/api".into()) },
            EngineEvent::DrainProgress { task: b, pods_left: 2, waiting: Waiting::GracePeriods },
        ] {
            board.on_event(&ev, t0);
        }
        let line = board.waiting_summary(t0 + Duration::from_secs(90), Duration::from_secs(600)).unwrap();
        assert_eq!(
            line,
            "3 task(s) running (drain 2, remove-controller 1); 5 pod(s) to move on 2 node(s), held by \
             PodDisruptionBudget(s) web/api; the first drain's deadline in 510s"
        );
    }

    #[test]
    fn only_the_latest_blockers_are_kept() {
        let mut b = Board::default();
        for i in 0..10 {
            let blocker = Blocker { kind: BlockerKind::Pod, name: format!("p{i}"), reason: "r".into() };
            b.on_event(&EngineEvent::Blocker(blocker), Instant::now());
        }
        assert_eq!(b.blockers, vec!["pod p6: r", "pod p7: r", "pod p8: r", "pod p9: r"]);
    }
}
