//! Expansion of a plan into a DAG of tasks over the live objects, and the helpers an engine needs
//! to run it: dependencies, dependents, ready sets and a topological order.
//!
//! Shape of the expansion. A step without `for_each` is one task; a step with `for_each` is one
//! task per object of its kind. When step B runs after step A and both expand over the same
//! kind, B[x] waits only for A[x], so a machine that is drained moves on without waiting for the
//! slowest one. Otherwise B waits for all of A; when both sides have several tasks, a barrier node
//! (zero cost, completed as soon as it is ready) sits between them so a 1,000-machine plan has
//! O(n) edges instead of O(n²). A step that expands to no tasks (no objects of its kind) passes
//! its own dependencies on to its dependents, so the order of the other steps is kept.

use std::collections::HashSet;
use std::fmt;
use std::ops::Index;

use petgraph::Direction;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use serde::Serialize;

use super::{Action, ObjectKind, Params, Plan, Step};

/// Identifies a task (or barrier) in a [`TaskGraph`].
pub type TaskId = NodeIndex;

/// The live objects a plan is expanded over, by name. Duplicates are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectSets {
    /// Machines (NodeClaims with their Nodes), by NodeClaim name.
    pub machines: Vec<String>,
    /// NodePool names.
    pub nodepools: Vec<String>,
    /// EC2NodeClass names.
    pub nodeclasses: Vec<String>,
}

impl ObjectSets {
    /// The objects of one kind.
    pub fn of(&self, kind: ObjectKind) -> &[String] {
        match kind {
            ObjectKind::Machine => &self.machines,
            ObjectKind::Nodepool => &self.nodepools,
            ObjectKind::Nodeclass => &self.nodeclasses,
        }
    }
}

/// One node of the task graph: a unit of work, or a barrier.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskNode {
    /// The id of the step the task belongs to.
    pub step: String,
    /// What the task does.
    pub action: Action,
    /// The kind of `object`, when the step expands per object.
    pub for_each: Option<ObjectKind>,
    /// The object this task acts on; `None` for a whole-cluster task and for barriers.
    pub object: Option<String>,
    /// The step's params, defaults resolved.
    pub params: Params,
    /// A barrier does no work: it only joins "all tasks of one step" to "all tasks of the next".
    /// An engine completes it as soon as it is ready ([`ReadyTracker`] does that itself).
    pub barrier: bool,
}

impl TaskNode {
    /// A short name for logs: `drain[ip-10-0-1-5]`, `fence`, `drain[*]` for a barrier.
    pub fn label(&self) -> String {
        match (&self.object, self.barrier) {
            (_, true) => format!("{}[*]", self.step),
            (Some(object), false) => format!("{}[{object}]", self.step),
            (None, false) => self.step.clone(),
        }
    }
}

/// The tasks of a plan over a set of objects, with their dependencies.
///
/// Invariant: the graph has no cycle. As expanded, every edge goes from a lower [`TaskId`] index to
/// a higher one; a machine added later ([`TaskGraph::grow`]) is waited for by tasks made before it.
#[derive(Clone, Debug)]
pub struct TaskGraph {
    plan: String,
    graph: DiGraph<TaskNode, ()>,
    /// Every step of the plan in run order, with its task count, so empty steps still show up.
    steps: Vec<StepSummary>,
}

/// How many tasks one step expanded to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepSummary {
    /// Step id.
    pub step: String,
    /// The step's action.
    pub action: Action,
    /// The kind it expands over, if any.
    pub for_each: Option<ObjectKind>,
    /// Tasks of this step, barriers not counted.
    pub tasks: usize,
}

/// What a dry run shows: tasks per step and the size of the graph.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TaskSummary {
    /// The plan's name.
    pub plan: String,
    /// Per step, in run order.
    pub steps: Vec<StepSummary>,
    /// All tasks, barriers not counted.
    pub tasks: usize,
    /// Barrier nodes.
    pub barriers: usize,
    /// Dependency edges.
    pub edges: usize,
}

/// What [`TaskGraph::grow`] added for one machine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Growth {
    /// The machine's tasks, in run order.
    pub tasks: Vec<TaskId>,
    /// Tasks made before it that now wait for its tasks.
    pub waiting: Vec<TaskId>,
}

impl fmt::Display for TaskSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan {:?}: {} task{} in {} step{}",
            self.plan,
            self.tasks,
            plural(self.tasks),
            self.steps.len(),
            plural(self.steps.len())
        )?;
        let width = self.steps.iter().map(|s| s.step.len()).max().unwrap_or(0);
        for s in &self.steps {
            let per = match s.for_each {
                Some(kind) => format!(" (one per {kind})"),
                None => String::new(),
            };
            let word = if s.tasks == 1 { "task" } else { "tasks" };
            writeln!(f, "  {:<width$}  {:>6} {word:<5}  {}{per}", s.step, s.tasks, s.action)?;
        }
        Ok(())
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

impl Plan {
    /// Expands the plan over the live objects into a task graph. Linear in the number of objects
    /// (see the module documentation for the shape).
    pub fn expand(&self, objects: &ObjectSets) -> TaskGraph {
        Expander::new(self, objects).run()
    }
}

struct Expander<'p> {
    plan: &'p Plan,
    objects: &'p ObjectSets,
    graph: DiGraph<TaskNode, ()>,
    /// Per step index: its tasks, in the order of its (deduplicated) objects.
    tasks: Vec<Vec<TaskId>>,
    /// Per step index, once known: the nodes whose completion means "all of this step is done".
    exits: Vec<Option<Vec<TaskId>>>,
    /// Per node index: the step index it belongs to.
    owner: Vec<usize>,
    /// `runs_after[s][t]`: step `s` runs after step `t`, directly or through other steps.
    runs_after: Vec<Vec<bool>>,
}

impl<'p> Expander<'p> {
    fn new(plan: &'p Plan, objects: &'p ObjectSets) -> Self {
        let n = plan.steps.len();
        let mut runs_after = vec![vec![false; n]; n];
        for &s in &plan.order {
            for &d in &plan.steps[s].after_idx {
                // `d` comes earlier in `order`, so its row is complete.
                let inherited = runs_after[d].clone();
                let row = &mut runs_after[s];
                row[d] = true;
                for (cell, via) in row.iter_mut().zip(inherited) {
                    *cell |= via;
                }
            }
        }
        Expander {
            plan,
            objects,
            graph: DiGraph::new(),
            tasks: vec![Vec::new(); n],
            exits: vec![None; n],
            owner: Vec::new(),
            runs_after,
        }
    }

    fn run(mut self) -> TaskGraph {
        for &si in &self.plan.order {
            self.expand_step(si);
        }
        let steps = self
            .plan
            .order
            .iter()
            .map(|&si| {
                let step = &self.plan.steps[si];
                StepSummary {
                    step: step.id.clone(),
                    action: step.action,
                    for_each: step.for_each,
                    tasks: self.tasks[si].len(),
                }
            })
            .collect();
        TaskGraph { plan: self.plan.name.clone(), graph: self.graph, steps }
    }

    fn expand_step(&mut self, si: usize) {
        let step = &self.plan.steps[si];
        let objects: Vec<Option<&str>> = match step.for_each {
            None => vec![None],
            Some(kind) => unique(self.objects.of(kind)).into_iter().map(Some).collect(),
        };

        // Dependencies over the same kind are object-wise; all others are on the whole step.
        let mut whole: Vec<TaskId> = Vec::new();
        let mut pairwise: Vec<usize> = Vec::new();
        for &d in &step.after_idx {
            let dep = &self.plan.steps[d];
            if step.for_each.is_some() && dep.for_each == step.for_each && !self.tasks[d].is_empty() {
                pairwise.push(d);
            } else {
                whole.extend(self.exit(d));
            }
        }
        whole.sort_unstable();
        whole.dedup();
        // Waiting for all of a later step already means waiting for all of an earlier one: drop
        // the earlier one. This keeps the edges of steps without objects (which pass on several
        // dependencies) to the ones that matter.
        let owners: Vec<usize> = whole.iter().map(|n| self.owner[n.index()]).collect();
        whole.retain(|n| {
            let mine = self.owner[n.index()];
            !owners.iter().any(|&other| other != mine && self.runs_after[other][mine])
        });

        if objects.is_empty() {
            // Nothing to do for this step: whoever waits for it waits for what it waited for.
            self.exits[si] = Some(whole);
            return;
        }

        let entry = if whole.len() > 1 && objects.len() > 1 {
            let barrier = self.add(si, None, true);
            for &w in &whole {
                self.edge(w, barrier);
            }
            vec![barrier]
        } else {
            whole
        };
        for (i, object) in objects.into_iter().enumerate() {
            let task = self.add(si, object, false);
            for &e in &entry {
                self.edge(e, task);
            }
            for &d in &pairwise {
                // Same kind and same object list, so position i is the same object.
                let upstream = self.tasks[d][i];
                self.edge(upstream, task);
            }
            self.tasks[si].push(task);
        }
    }

    /// The nodes whose completion means all of step `d` is done, creating its exit barrier the
    /// first time a dependent needs one.
    fn exit(&mut self, d: usize) -> Vec<TaskId> {
        if let Some(exit) = &self.exits[d] {
            return exit.clone();
        }
        let exit = match self.tasks[d].as_slice() {
            [] => Vec::new(),
            [only] => vec![*only],
            many => {
                let many = many.to_vec();
                let barrier = self.add(d, None, true);
                for t in many {
                    self.edge(t, barrier);
                }
                vec![barrier]
            }
        };
        self.exits[d] = Some(exit.clone());
        exit
    }

    fn add(&mut self, si: usize, object: Option<&str>, barrier: bool) -> TaskId {
        let step: &Step = &self.plan.steps[si];
        self.owner.push(si);
        self.graph.add_node(TaskNode {
            step: step.id.clone(),
            action: step.action,
            for_each: step.for_each,
            object: object.map(str::to_owned),
            params: step.params,
            barrier,
        })
    }

    fn edge(&mut self, from: TaskId, to: TaskId) {
        // Nodes are created in step run order, dependencies first: see the TaskGraph invariant.
        debug_assert!(from.index() < to.index(), "edge against creation order");
        self.graph.add_edge(from, to, ());
    }
}

/// The names in order of first appearance, without duplicates.
fn unique(names: &[String]) -> Vec<&str> {
    let mut seen = HashSet::with_capacity(names.len());
    names.iter().map(String::as_str).filter(|n| seen.insert(*n)).collect()
}

impl TaskGraph {
    /// The underlying petgraph graph: an edge `a -> b` means `b` waits for `a`.
    pub fn graph(&self) -> &DiGraph<TaskNode, ()> {
        &self.graph
    }

    /// The name of the plan this graph came from.
    pub fn plan_name(&self) -> &str {
        &self.plan
    }

    /// Number of nodes, barriers included.
    pub fn node_count(&self) -> usize {
        self.graph.node_count()
    }

    /// Number of tasks that do work (barriers not counted).
    pub fn task_count(&self) -> usize {
        self.graph.node_weights().filter(|n| !n.barrier).count()
    }

    /// Number of dependency edges.
    pub fn edge_count(&self) -> usize {
        self.graph.edge_count()
    }

    /// Whether the graph has no nodes at all.
    pub fn is_empty(&self) -> bool {
        self.graph.node_count() == 0
    }

    /// The node with this id, if it exists.
    pub fn get(&self, id: TaskId) -> Option<&TaskNode> {
        self.graph.node_weight(id)
    }

    /// Every node, barriers included, in topological order.
    pub fn nodes(&self) -> impl Iterator<Item = (TaskId, &TaskNode)> + '_ {
        self.graph.node_indices().map(|i| (i, &self.graph[i]))
    }

    /// The tasks that do work, in topological order.
    pub fn tasks(&self) -> impl Iterator<Item = (TaskId, &TaskNode)> + '_ {
        self.nodes().filter(|(_, n)| !n.barrier)
    }

    /// A topological order of every node: dependencies come before their dependents.
    pub fn topological_order(&self) -> Vec<TaskId> {
        // the graph has no cycle (see the invariant on TaskGraph): the fallback is never taken
        petgraph::algo::toposort(&self.graph, None).unwrap_or_else(|_| self.graph.node_indices().collect())
    }

    /// Adds the tasks of a machine found after the expansion (a NodeClaim launched during the
    /// run): one per `for_each = "machine"` step of `plan` (the plan this graph was expanded
    /// from), with the plan's params and edges. Each waits for the same machine's task of an
    /// earlier machine step and for every task of the other steps it runs after; every task
    /// of a step that runs after a machine step, and for which `open` holds (it has not started),
    /// waits for it in turn. Returns the new tasks, in run order, and the open tasks that now wait
    /// for them. A plan without machine steps adds nothing.
    pub fn grow(&mut self, plan: &Plan, machine: &str, open: impl Fn(TaskId) -> bool) -> Growth {
        let n = plan.steps.len();
        let is_machine = |si: usize| plan.steps[si].for_each == Some(ObjectKind::Machine);
        let mut mine: Vec<Option<TaskId>> = vec![None; n];
        let mut growth = Growth::default();
        for &si in &plan.order {
            if !is_machine(si) {
                continue;
            }
            let step = &plan.steps[si];
            let task = self.graph.add_node(TaskNode {
                step: step.id.clone(),
                action: step.action,
                for_each: step.for_each,
                object: Some(machine.to_string()),
                params: step.params,
                barrier: false,
            });
            for dep in self.upstream(plan, si, &mine) {
                self.graph.add_edge(dep, task, ());
            }
            if let Some(summary) = self.steps.iter_mut().find(|s| s.step == step.id) {
                summary.tasks += 1;
            }
            mine[si] = Some(task);
            growth.tasks.push(task);
        }
        // the steps that run after a machine step, through any chain of `after`
        let mut after_machines = vec![false; n];
        for &si in &plan.order {
            after_machines[si] = plan.steps[si].after_idx.iter().any(|&d| is_machine(d) || after_machines[d]);
        }
        let waiting: Vec<TaskId> = self
            .tasks()
            .filter(|(id, node)| {
                !growth.tasks.contains(id)
                    && node.for_each != Some(ObjectKind::Machine)
                    && plan.steps.iter().position(|st| st.id == node.step).is_some_and(|si| after_machines[si])
                    && open(*id)
            })
            .map(|(id, _)| id)
            .collect();
        for &w in &waiting {
            for &t in &growth.tasks {
                self.graph.add_edge(t, w, ());
            }
        }
        growth.waiting = waiting;
        growth
    }

    /// What a new machine task of step `si` waits for: its own task of each earlier machine step
    /// it runs after, and every task of each other step it runs after (through that step's own
    /// dependencies when it has no tasks).
    fn upstream(&self, plan: &Plan, si: usize, mine: &[Option<TaskId>]) -> Vec<TaskId> {
        let mut out = Vec::new();
        let mut todo: Vec<usize> = plan.steps[si].after_idx.clone();
        let mut seen = vec![false; plan.steps.len()];
        while let Some(d) = todo.pop() {
            if std::mem::replace(&mut seen[d], true) {
                continue;
            }
            if plan.steps[d].for_each == Some(ObjectKind::Machine) {
                out.extend(mine[d]);
                continue;
            }
            let tasks = self.step_tasks(&plan.steps[d].id);
            if tasks.is_empty() {
                todo.extend(plan.steps[d].after_idx.iter().copied());
            }
            out.extend(tasks);
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Makes `task` wait for `deps` too (a step that found a machine late waits for its tasks).
    pub fn wait_for(&mut self, task: TaskId, deps: &[TaskId]) {
        for &d in deps {
            if d != task && self.graph.find_edge(d, task).is_none() {
                self.graph.add_edge(d, task, ());
            }
        }
    }

    /// The nodes `id` waits for directly.
    pub fn dependencies(&self, id: TaskId) -> impl Iterator<Item = TaskId> + '_ {
        self.graph.edges_directed(id, Direction::Incoming).map(|e| e.source())
    }

    /// The nodes that wait for `id` directly.
    pub fn dependents(&self, id: TaskId) -> impl Iterator<Item = TaskId> + '_ {
        self.graph.edges_directed(id, Direction::Outgoing).map(|e| e.target())
    }

    /// How many nodes `id` waits for directly.
    pub fn in_degree(&self, id: TaskId) -> usize {
        self.graph.edges_directed(id, Direction::Incoming).count()
    }

    /// The nodes that wait for nothing.
    pub fn roots(&self) -> Vec<TaskId> {
        self.graph.node_indices().filter(|&i| self.in_degree(i) == 0).collect()
    }

    /// The task of `step` for `object` (`None` for a step without `for_each`). Barriers are never
    /// returned.
    pub fn find(&self, step: &str, object: Option<&str>) -> Option<TaskId> {
        self.tasks().find(|(_, n)| n.step == step && n.object.as_deref() == object).map(|(i, _)| i)
    }

    /// The tasks of one step, barriers not included.
    pub fn step_tasks(&self, step: &str) -> Vec<TaskId> {
        self.tasks().filter(|(_, n)| n.step == step).map(|(i, _)| i).collect()
    }

    /// Every task that waits for `id`, directly or through others: what cannot run if `id`
    /// fails. Barriers are passed through, not returned.
    pub fn descendants(&self, id: TaskId) -> Vec<TaskId> {
        let mut seen = vec![false; self.graph.node_count()];
        let mut stack: Vec<TaskId> = self.dependents(id).collect();
        let mut out = Vec::new();
        while let Some(n) = stack.pop() {
            if std::mem::replace(&mut seen[n.index()], true) {
                continue;
            }
            if !self.graph[n].barrier {
                out.push(n);
            }
            stack.extend(self.dependents(n));
        }
        out.sort_unstable();
        out
    }

    /// Tasks per step, for dry runs.
    pub fn summary(&self) -> TaskSummary {
        TaskSummary {
            plan: self.plan.clone(),
            steps: self.steps.clone(),
            tasks: self.task_count(),
            barriers: self.graph.node_count() - self.task_count(),
            edges: self.graph.edge_count(),
        }
    }
}

impl Index<TaskId> for TaskGraph {
    type Output = TaskNode;

    /// Panics when `id` is not of this graph, like any out-of-range index.
    fn index(&self, id: TaskId) -> &TaskNode {
        &self.graph[id]
    }
}

/// Tracks which tasks are ready to run as others complete. Barriers are completed on the spot, so
/// callers only ever see tasks that do work.
///
/// A task whose dependency failed is never made ready: leave the failed task uncompleted and use
/// [`TaskGraph::descendants`] to report what it held up.
#[derive(Clone, Debug)]
pub struct ReadyTracker {
    /// Per node: dependencies not yet completed.
    waiting: Vec<usize>,
    done: Vec<bool>,
    /// Per node: handed out as ready (it runs, or ran) and not reopened since.
    released: Vec<bool>,
    /// Work tasks not yet completed.
    remaining: usize,
}

impl ReadyTracker {
    /// A tracker for `graph` with nothing completed yet.
    pub fn new(graph: &TaskGraph) -> Self {
        ReadyTracker {
            waiting: graph.graph.node_indices().map(|i| graph.in_degree(i)).collect(),
            done: vec![false; graph.node_count()],
            released: vec![false; graph.node_count()],
            remaining: graph.task_count(),
        }
    }

    /// The tasks that can start right away.
    pub fn start(&mut self, graph: &TaskGraph) -> Vec<TaskId> {
        let mut ready = Vec::new();
        for id in graph.roots() {
            self.became_ready(graph, id, &mut ready);
        }
        ready
    }

    /// Marks `id` done and returns the tasks that became ready because of it. Completing a task
    /// twice is a no-op. `graph` must be the graph the tracker was made for.
    pub fn complete(&mut self, graph: &TaskGraph, id: TaskId) -> Vec<TaskId> {
        let mut ready = Vec::new();
        self.finish(graph, id, &mut ready);
        ready
    }

    /// Whether `id` is still to be handed out: not done, not running, waiting for dependencies.
    pub fn is_open(&self, id: TaskId) -> bool {
        let i = id.index();
        !self.done.get(i).copied().unwrap_or(false) && !self.released.get(i).copied().unwrap_or(false)
    }

    /// Takes a task that ran back among those to hand out (it found work it must wait for).
    pub fn reopen(&mut self, id: TaskId) {
        if let Some(r) = self.released.get_mut(id.index()) {
            *r = false;
        }
    }

    /// Catches up with a graph that grew ([`TaskGraph::grow`], [`TaskGraph::wait_for`]): new
    /// nodes are tracked, and `touched` (new or given new dependencies) wait for what of theirs
    /// is not done. Returns those of them that can start right away.
    pub fn resync(&mut self, graph: &TaskGraph, touched: &[TaskId]) -> Vec<TaskId> {
        for i in self.done.len()..graph.node_count() {
            self.done.push(false);
            self.released.push(false);
            self.waiting.push(0);
            if !graph.graph[TaskId::new(i)].barrier {
                self.remaining += 1;
            }
        }
        let mut ready = Vec::new();
        for &id in touched {
            if !self.is_open(id) {
                continue;
            }
            let waiting = graph.dependencies(id).filter(|d| !self.is_done(*d)).count();
            self.waiting[id.index()] = waiting;
            if waiting == 0 {
                self.became_ready(graph, id, &mut ready);
            }
        }
        ready.sort_unstable();
        ready
    }

    /// Whether `id` has been completed.
    pub fn is_done(&self, id: TaskId) -> bool {
        self.done.get(id.index()).copied().unwrap_or(false)
    }

    /// Work tasks not yet completed.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// Whether every work task has been completed.
    pub fn all_done(&self) -> bool {
        self.remaining == 0
    }

    fn became_ready(&mut self, graph: &TaskGraph, id: TaskId, ready: &mut Vec<TaskId>) {
        if graph.graph[id].barrier {
            self.finish(graph, id, ready);
        } else {
            self.released[id.index()] = true;
            ready.push(id);
        }
    }

    fn finish(&mut self, graph: &TaskGraph, id: TaskId, ready: &mut Vec<TaskId>) {
        // A worklist rather than recursion: barriers can chain (exit barrier, then entry barrier).
        let mut work = vec![id];
        while let Some(id) = work.pop() {
            let Some(done) = self.done.get_mut(id.index()) else {
                continue;
            };
            if std::mem::replace(done, true) {
                continue;
            }
            if !graph.graph[id].barrier {
                self.remaining -= 1;
            }
            for next in graph.dependents(id) {
                let waiting = &mut self.waiting[next.index()];
                *waiting = waiting.saturating_sub(1);
                if *waiting == 0 && !self.released[next.index()] {
                    if graph.graph[next].barrier {
                        work.push(next);
                    } else {
                        self.released[next.index()] = true;
                        ready.push(next);
                    }
                }
            }
        }
        ready.sort_unstable();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIAMOND: &str = r#"
version = 1
name = "diamond"
[[step]]
id = "a"
action = "preflight"
[[step]]
id = "b"
action = "drain"
for_each = "machine"
after = ["a"]
[[step]]
id = "c"
action = "remove-controller"
after = ["a"]
[[step]]
id = "d"
action = "discharge-finalizers"
for_each = "machine"
after = ["b", "c"]
[[step]]
id = "e"
action = "verify"
after = ["d"]
"#;

    fn machines(n: usize) -> ObjectSets {
        ObjectSets { machines: (0..n).map(|i| format!("m{i}")).collect(), ..ObjectSets::default() }
    }

    fn plan() -> Plan {
        match Plan::from_str(DIAMOND, "diamond.toml") {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn tracker_runs_everything_in_dependency_order_and_hides_barriers() {
        let g = plan().expand(&machines(3));
        let mut tracker = ReadyTracker::new(&g);
        let mut ready = tracker.start(&g);
        let mut ran = Vec::new();
        while let Some(id) = ready.pop() {
            assert!(!g[id].barrier, "a barrier was handed out");
            assert!(g.dependencies(id).all(|d| tracker.is_done(d)), "{} ran early", g[id].label());
            ran.push(g[id].label());
            ready.extend(tracker.complete(&g, id));
        }
        assert!(tracker.all_done());
        assert_eq!(ran.len(), g.task_count());
        assert_eq!(ran.first().map(String::as_str), Some("a"));
        assert_eq!(ran.last().map(String::as_str), Some("e"));
        // Completing twice changes nothing.
        let first = g.find("a", None).unwrap();
        assert!(tracker.complete(&g, first).is_empty());
        assert_eq!(tracker.remaining(), 0);
    }

    #[test]
    fn a_machine_found_late_gets_the_plans_machine_steps_and_what_runs_after_them_waits_for_it() {
        let p = plan();
        let mut g = p.expand(&machines(2));
        let mut tracker = ReadyTracker::new(&g);
        let mut ready = tracker.start(&g);
        // run a, b[m0], b[m1], c, d[m0]: d[m1] and e are still to come
        for label in ["a", "b[m0]", "b[m1]", "c", "d[m0]"] {
            let id = ready.iter().copied().find(|&id| g[id].label() == label).unwrap_or_else(|| panic!("{label}"));
            ready.retain(|&r| r != id);
            ready.extend(tracker.complete(&g, id));
        }
        let d_m1 = g.find("d", Some("m1")).unwrap();
        let e = g.find("e", None).unwrap();
        assert_eq!(ready, [d_m1], "d[m1] runs; e waits");
        let before = g.task_count();
        let growth = g.grow(&p, "late", |id| tracker.is_open(id));
        assert_eq!(growth.tasks.len(), 2, "one task per machine step");
        let labels: Vec<String> = growth.tasks.iter().map(|&t| g[t].label()).collect();
        assert_eq!(labels, ["b[late]", "d[late]"]);
        assert_eq!(g[growth.tasks[0]].params, p.steps[1].params, "the plan's own params");
        assert_eq!(growth.waiting, [e], "the running d[m1] is not made to wait; e is");
        assert_eq!(g.task_count(), before + 2);
        assert_eq!(g.summary().steps.iter().map(|s| s.tasks).collect::<Vec<_>>(), [1, 3, 1, 3, 1]);
        // b[late] waits for a (done), d[late] for b[late] and c (done): b[late] starts at once
        let mut touched = growth.tasks.clone();
        touched.extend(&growth.waiting);
        let now = tracker.resync(&g, &touched);
        assert_eq!(now, [growth.tasks[0]]);
        assert!(g.dependencies(growth.tasks[1]).any(|d| d == growth.tasks[0]));
        assert_eq!(g.topological_order().len(), g.node_count(), "still acyclic");
        // e runs only once both d[m1] and the late machine are through
        assert!(tracker.complete(&g, d_m1).is_empty(), "e waits for the late machine");
        assert_eq!(tracker.complete(&g, growth.tasks[0]), [growth.tasks[1]]);
        assert_eq!(tracker.complete(&g, growth.tasks[1]), [e]);
        assert!(tracker.complete(&g, e).is_empty());
        assert!(tracker.all_done());
    }

    #[test]
    fn a_task_that_found_a_machine_runs_again_after_the_machines_tasks() {
        let p = plan();
        let mut g = p.expand(&machines(1));
        let mut tracker = ReadyTracker::new(&g);
        let mut ready = tracker.start(&g);
        while let Some(id) = ready.pop() {
            if g[id].label() == "e" {
                // e is running and finds a machine: it goes back to wait for the machine's tasks
                let growth = g.grow(&p, "late", |t| tracker.is_open(t));
                assert!(growth.waiting.is_empty(), "nothing open runs after the machine steps");
                g.wait_for(id, &growth.tasks);
                tracker.reopen(id);
                let mut touched = growth.tasks.clone();
                touched.push(id);
                assert_eq!(tracker.resync(&g, &touched), [growth.tasks[0]]);
                let after_b = tracker.complete(&g, growth.tasks[0]);
                assert_eq!(after_b, [growth.tasks[1]]);
                assert_eq!(tracker.complete(&g, growth.tasks[1]), [id], "e runs again");
                assert!(tracker.complete(&g, id).is_empty());
                assert!(tracker.all_done());
                return;
            }
            ready.extend(tracker.complete(&g, id));
        }
        panic!("e never ran");
    }

    #[test]
    fn a_plan_without_machine_steps_adds_nothing_for_a_late_machine() {
        let p = Plan::from_str(
            "version = 1\nname = \"p\"\n[[step]]\nid = \"a\"\naction = \"preflight\"\n[[step]]\nid = \"v\"\naction = \"verify\"\nafter = [\"a\"]\n",
            "p.toml",
        )
        .unwrap();
        let mut g = p.expand(&machines(1));
        let edges = g.edge_count();
        let growth = g.grow(&p, "late", |_| true);
        assert_eq!(growth, Growth::default());
        assert_eq!(g.edge_count(), edges);
    }

    #[test]
    fn one_machine_can_move_on_before_the_others_are_drained() {
        let g = plan().expand(&machines(3));
        let mut tracker = ReadyTracker::new(&g);
        let ready = tracker.start(&g);
        assert_eq!(ready.len(), 1);
        let after_a = tracker.complete(&g, ready[0]);
        // b[m0], b[m1], b[m2] and c.
        assert_eq!(after_a.len(), 4);
        let c = g.find("c", None).unwrap();
        assert!(tracker.complete(&g, c).is_empty());
        let b0 = g.find("b", Some("m0")).unwrap();
        let next = tracker.complete(&g, b0);
        assert_eq!(next, vec![g.find("d", Some("m0")).unwrap()]);
    }

    #[test]
    fn descendants_are_what_a_failure_holds_up() {
        let g = plan().expand(&machines(2));
        let b0 = g.find("b", Some("m0")).unwrap();
        let held: Vec<String> = g.descendants(b0).into_iter().map(|i| g[i].label()).collect();
        assert_eq!(held, vec!["d[m0]", "e"]);
    }

    #[test]
    fn duplicate_objects_are_expanded_once() {
        let objects = ObjectSets { machines: vec!["x".into(), "y".into(), "x".into()], ..ObjectSets::default() };
        let g = plan().expand(&objects);
        assert_eq!(g.step_tasks("b").len(), 2);
    }

    #[test]
    fn summary_lists_every_step_even_empty_ones() {
        let s = plan().expand(&machines(0)).summary();
        assert_eq!(s.steps.len(), 5);
        assert_eq!(s.tasks, 3);
        let text = s.to_string();
        assert!(text.contains("\n  b       0 tasks  drain (one per machine)\n"), "{text}");
        assert!(text.contains("\n  a       1 task   preflight\n"), "{text}");
    }
}
