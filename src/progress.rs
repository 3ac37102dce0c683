//! The live progress view on a terminal: stages with their task counts, one line per running
//! task (a node draining, an instance terminating) and what blocks. It is a tracing [`Layer`]
//! reading the events the engine already emits inside its `task{step,object}` spans, so the
//! view, the logs and the report read the same event stream and the engine knows nothing of it.
//!
//! Events it understands:
//! - `starting the teardown` with `tasks = N`: the total the header counts toward;
//! - `started` (debug) inside a task span: the task runs;
//! - `task ended` with `result` and `detail` inside a task span: the task is over;
//! - any event inside a task span carrying `pods_left = N`: shown on that task's line;
//! - any warning or error: shown as what blocks or fights the run, with the task it came from.
//!
//! Without a terminal this layer is not installed at all: the logs are the only output there.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// How many running tasks get a line of their own; the rest are counted in the header.
const MAX_TASK_LINES: usize = 12;
/// How many recent blockers are shown.
const MAX_BLOCKER_LINES: usize = 4;

/// State of one task as the view knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskState {
    /// Spawned, waiting for its step's concurrency permit.
    Waiting,
    /// Running since the instant.
    Running(Instant),
    /// Over, with the engine's result word (`done`, `blocked`, ...).
    Ended(String),
}

/// A task of the plan, by step and object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TaskKey {
    /// Step id.
    pub step: String,
    /// Object of a per-object task, empty for a whole-step task.
    pub object: String,
}

impl TaskKey {
    fn label(&self) -> String {
        if self.object.is_empty() { self.step.clone() } else { format!("{} {}", self.step, self.object) }
    }
}

/// Everything the view shows, kept apart from drawing so it can be tested without a terminal.
#[derive(Debug, Default)]
pub struct Board {
    /// Total tasks of the run, once the engine said.
    pub total: Option<u64>,
    /// Tasks in the order they appeared, with their state and last pod count.
    pub tasks: BTreeMap<TaskKey, (TaskState, Option<u64>)>,
    /// Step ids in the order they first appeared.
    pub step_order: Vec<String>,
    /// Recent warnings: what blocks or fights the run.
    pub blockers: Vec<String>,
}

/// What one event means to the board.
#[derive(Debug, Default)]
struct Seen {
    message: String,
    result: Option<String>,
    detail: Option<String>,
    tasks: Option<u64>,
    pods_left: Option<u64>,
    others: Vec<(String, String)>,
}

impl Visit for Seen {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "tasks" => self.tasks = Some(value),
            "pods_left" => self.pods_left = Some(value),
            n => self.others.push((n.to_string(), value.to_string())),
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        match u64::try_from(value) {
            Ok(v) => self.record_u64(field, v),
            Err(_) => self.others.push((field.name().to_string(), value.to_string())),
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            "result" => self.result = Some(value.to_string()),
            "detail" => self.detail = Some(value.to_string()),
            n => self.others.push((n.to_string(), value.to_string())),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        // Display-formatted fields (`%x`) and the message arrive here
        let text = format!("{value:?}");
        match field.name() {
            "message" => self.message = text,
            "result" | "detail" => self.record_str(field, &text),
            "tasks" | "pods_left" => match text.parse::<u64>() {
                Ok(v) => self.record_u64(field, v),
                Err(_) => self.others.push((field.name().to_string(), text)),
            },
            n => self.others.push((n.to_string(), text)),
        }
    }
}

impl Board {
    fn task(&mut self, key: &TaskKey) -> &mut (TaskState, Option<u64>) {
        if !self.step_order.contains(&key.step) {
            self.step_order.push(key.step.clone());
        }
        self.tasks.entry(key.clone()).or_insert((TaskState::Waiting, None))
    }

    /// A task span was created: the engine spawned the task.
    pub fn spawned(&mut self, key: &TaskKey) {
        self.task(key);
    }

    fn apply(&mut self, level: Level, task: Option<&TaskKey>, seen: &Seen, now: Instant) {
        if let Some(t) = seen.tasks
            && seen.message == "starting the teardown"
        {
            self.total = Some(t);
        }
        if let Some(key) = task {
            let entry = self.task(key);
            if seen.message == "started" {
                entry.0 = TaskState::Running(now);
            }
            if let Some(p) = seen.pods_left {
                entry.1 = Some(p);
            }
            if seen.message == "task ended"
                && let Some(r) = &seen.result
            {
                entry.0 = TaskState::Ended(r.clone());
            }
        }
        if level <= Level::WARN {
            let mut line = String::new();
            if let Some(k) = task {
                let _ = write!(line, "{}: ", k.label());
            }
            line.push_str(&seen.message);
            if let Some(d) = seen.detail.as_deref().filter(|d| !d.is_empty()) {
                let _ = write!(line, ": {d}");
            }
            for (k, v) in &seen.others {
                let _ = write!(line, " {k}={v}");
            }
            self.blockers.push(line);
            if self.blockers.len() > MAX_BLOCKER_LINES {
                self.blockers.remove(0);
            }
        }
    }

    /// The header: tasks finished out of the total, and per step `done/seen` with what is off.
    pub fn header(&self) -> String {
        let mut parts = Vec::new();
        for step in &self.step_order {
            let (mut ended, mut all, mut bad) = (0, 0, BTreeMap::<&str, u32>::new());
            for (k, (s, _)) in self.tasks.iter().filter(|(k, _)| &k.step == step) {
                all += 1;
                if let TaskState::Ended(r) = s {
                    ended += 1;
                    if r != "done" && r != "skipped" {
                        *bad.entry(r.as_str()).or_default() += 1;
                    }
                }
                let _ = k;
            }
            let mut p = format!("{step} {ended}/{all}");
            for (r, n) in bad {
                let _ = write!(p, " ({n} {r})");
            }
            parts.push(p);
        }
        parts.join(" · ")
    }

    /// Finished tasks.
    pub fn finished(&self) -> u64 {
        self.tasks.values().filter(|(s, _)| matches!(s, TaskState::Ended(_))).count() as u64
    }

    /// One line per running task, longest-running first, at most [`MAX_TASK_LINES`], and how
    /// many more run.
    pub fn running_lines(&self, now: Instant) -> (Vec<(TaskKey, String)>, usize) {
        let mut running: Vec<(&TaskKey, Instant, Option<u64>)> = self
            .tasks
            .iter()
            .filter_map(|(k, (s, p))| match s {
                TaskState::Running(since) => Some((k, *since, *p)),
                _ => None,
            })
            .collect();
        running.sort_by_key(|(_, since, _)| *since);
        let more = running.len().saturating_sub(MAX_TASK_LINES);
        let lines = running
            .into_iter()
            .take(MAX_TASK_LINES)
            .map(|(k, since, pods)| {
                let mut l = format!("{}: {}", k.label(), doing(&k.step));
                if let Some(p) = pods {
                    let _ = write!(l, ", {p} pod(s) left");
                }
                let _ = write!(l, " ({}s)", now.saturating_duration_since(since).as_secs());
                (k.clone(), l)
            })
            .collect();
        (lines, more)
    }
}

/// What a task of a step is doing while it runs, in words.
fn doing(step: &str) -> &'static str {
    match step {
        s if s.contains("drain") => "draining",
        s if s.contains("finalizer") => "terminating the instance, then releasing the finalizer",
        s if s.contains("controller") => "scaling the controller to zero",
        s if s.contains("fence") => "fencing NodePools",
        s if s.contains("wait") => "waiting for NodeClaims to go",
        s if s.contains("nodeclass") => "deleting EC2NodeClasses",
        s if s.contains("nodepool") => "deleting NodePools",
        s if s.contains("verify") => "verifying through EC2",
        _ => "running",
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
pub struct Progress {
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
    pub fn stderr() -> Progress {
        Progress::with_target(ProgressDrawTarget::stderr())
    }

    /// A view drawing to `target` (hidden in tests).
    pub fn with_target(target: ProgressDrawTarget) -> Progress {
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
    pub fn install(&self) {
        let _ = ACTIVE.set(self.clone());
    }

    fn with<R>(&self, f: impl FnOnce(&mut View) -> R) -> R {
        // a panic while drawing poisons the lock; the board itself stays usable
        let mut v = self.view.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut v)
    }

    /// Runs `f` (writing a log line) with the bars out of the way, so lines and bars never mix.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        let multi = self.with(|v| v.multi.clone());
        multi.suspend(f)
    }

    /// A copy of what the board shows: the header, the running lines and the blockers.
    pub fn snapshot(&self) -> (String, Vec<String>, Vec<String>) {
        self.with(|v| {
            let (lines, _) = v.board.running_lines(Instant::now());
            (v.board.header(), lines.into_iter().map(|(_, l)| l).collect(), v.board.blockers.clone())
        })
    }

    /// Removes the bars (before the summary is printed).
    pub fn clear(&self) {
        self.with(View::clear);
    }
}

/// Clears the process's live view, if there is one, so the summary prints on a clean screen.
pub fn finish() {
    if let Some(p) = ACTIVE.get() {
        p.clear();
    }
}

/// Fields of a `task` span, kept in the span's extensions.
struct TaskSpan(TaskKey);

#[derive(Default)]
struct SpanFields {
    step: String,
    object: String,
}

impl Visit for SpanFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "step" => self.step = value.to_string(),
            "object" => self.object = value.to_string(),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

impl<S> Layer<S> for Progress
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "task" {
            return;
        }
        let mut f = SpanFields::default();
        attrs.record(&mut f);
        let key = TaskKey { step: f.step, object: f.object };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(TaskSpan(key.clone()));
        }
        self.with(|v| {
            v.board.spawned(&key);
            v.redraw();
        });
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let task = ctx.event_scope(event).and_then(|scope| {
            scope.into_iter().find_map(|span| span.extensions().get::<TaskSpan>().map(|t| t.0.clone()))
        });
        let mut seen = Seen::default();
        event.record(&mut seen);
        let level = *event.metadata().level();
        self.with(|v| {
            v.board.apply(level, task.as_ref(), &seen, Instant::now());
            v.redraw();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn the_board_follows_the_engine_events() {
        let progress = Progress::with_target(ProgressDrawTarget::hidden());
        let subscriber = tracing_subscriber::registry().with(progress.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(tasks = 3u64, machines = 2, "starting the teardown");
            let a = tracing::info_span!("task", step = "drain", object = "node-a");
            let b = tracing::info_span!("task", step = "drain", object = "node-b");
            let c = tracing::info_span!("task", step = "fence", object = "");
            c.in_scope(|| {
                tracing::debug!("started");
                tracing::info!(result = "done", detail = "fenced", "task ended");
            });
            a.in_scope(|| {
                tracing::debug!("started");
                tracing::info!(pods_left = 4u64, "evicting");
            });
            b.in_scope(|| {
                tracing::debug!("started");
                tracing::warn!(result = "blocked", detail = "pod a/p blocked by PDB a/pdb", "task ended");
            });
        });
        let (header, running, blockers) = progress.snapshot();
        assert_eq!(header, "drain 1/2 (1 blocked) · fence 1/1");
        assert_eq!(running.len(), 1, "{running:?}");
        assert!(running[0].starts_with("drain node-a: draining, 4 pod(s) left"), "{running:?}");
        assert_eq!(blockers, vec!["drain node-b: task ended: pod a/p blocked by PDB a/pdb".to_string()]);
        progress.clear();
    }

    #[test]
    fn only_the_latest_blockers_are_kept() {
        let mut b = Board::default();
        for i in 0..10 {
            let seen = Seen { message: format!("w{i}"), ..Seen::default() };
            b.apply(Level::WARN, None, &seen, Instant::now());
        }
        assert_eq!(b.blockers, vec!["w6", "w7", "w8", "w9"]);
    }
}
