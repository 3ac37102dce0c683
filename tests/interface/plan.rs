//! The plan module from the outside: the shipped plans, every validation error with its message
//! and line, the expansion into a task graph, and rendering.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use karpenter_teardown::plan::{
    Action, ObjectKind, ObjectSets, OnDeadline, Plan, PlanError, ReadyTracker, RenderFormat, TaskGraph, TaskId,
};

fn crate_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn fixture(name: &str) -> PathBuf {
    crate_path("tests/fixtures/plans").join(name)
}

fn load(path: &Path) -> Plan {
    match Plan::load(path) {
        Ok(plan) => plan,
        Err(e) => panic!("{} should load: {e}", path.display()),
    }
}

/// The message of the error `text` must produce, with the source named `t.toml`.
fn error_of(text: &str) -> String {
    match Plan::from_str(text, "t.toml") {
        Ok(plan) => panic!("accepted an invalid plan:\n{text}\n{plan:?}"),
        Err(e) => e.to_string(),
    }
}

/// The message for a fixture loaded from disk, with the path in front replaced by its file name,
/// after checking the path is there.
fn fixture_error(name: &str) -> String {
    let path = fixture(name);
    let message = match Plan::load(&path) {
        Ok(_) => panic!("{name} should be rejected"),
        Err(e) => e.to_string(),
    };
    let prefix = path.display().to_string();
    match message.strip_prefix(&prefix) {
        Some(rest) => format!("{name}{rest}"),
        None => panic!("message does not start with the path {prefix}: {message}"),
    }
}

/// A plan header (two lines) in front of `steps`, so the first step line is line 3.
fn with_header(steps: &str) -> String {
    format!("version = 1\nname = \"t\"\n{steps}")
}

fn machines(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("m{i}")).collect()
}

fn labels(graph: &TaskGraph, ids: impl IntoIterator<Item = TaskId>) -> BTreeSet<String> {
    ids.into_iter().map(|i| graph[i].label()).collect()
}

fn deps(graph: &TaskGraph, id: TaskId) -> BTreeSet<String> {
    labels(graph, graph.dependencies(id))
}

fn task(graph: &TaskGraph, step: &str, object: Option<&str>) -> TaskId {
    match graph.find(step, object) {
        Some(id) => id,
        None => panic!("no task {step}[{object:?}]"),
    }
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Edges only go forward in index order, and petgraph agrees that the graph is acyclic.
fn assert_topological(graph: &TaskGraph) {
    for edge in graph.graph().raw_edges() {
        assert!(edge.source().index() < edge.target().index(), "edge against index order");
    }
    assert!(petgraph::algo::toposort(graph.graph(), None).is_ok());
    assert_eq!(graph.topological_order().len(), graph.node_count());
}

// ---- The shipped plans ----

#[test]
fn the_default_plan_loads_and_has_the_documented_order() {
    let plan = load(&crate_path("plans/default.toml"));
    assert_eq!(plan.name(), "default");
    let ids: Vec<&str> = plan.ordered_steps().map(|s| s.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "preflight",
            "fence",
            "remove-controller",
            "cordon",
            "drain",
            "discharge-finalizers",
            "delete-nodepools",
            "delete-nodeclasses",
            "verify"
        ]
    );
    // the controller goes beside the drain, not after it, so that terminations run under it
    assert_eq!(plan.step("remove-controller").unwrap().after, ["fence"]);
    let drain = plan.step("drain").unwrap();
    assert_eq!(drain.for_each, Some(ObjectKind::Machine));
    assert_eq!(drain.params.deadline, Some(Duration::from_secs(600)));
    assert_eq!(drain.params.on_deadline, OnDeadline::Fail);
    assert_eq!(drain.params.concurrency.get(), 5000);
    let discharge = plan.step("discharge-finalizers").unwrap();
    assert_eq!(discharge.after, ["drain", "remove-controller"]);
    assert_eq!(discharge.params.concurrency.get(), 5000);
    assert_eq!(plan.step("verify").unwrap().params.settle, Duration::from_secs(5));

    // The compiled-in copy is the same plan.
    let builtin = Plan::builtin_default();
    assert_eq!(builtin.steps(), plan.steps());
    assert_eq!(builtin.source(), "builtin:default");
}

#[test]
fn the_delegate_plan_waits_then_falls_back() {
    let plan = load(&crate_path("plans/delegate.toml"));
    let ids: Vec<&str> = plan.ordered_steps().map(|s| s.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "preflight",
            "fence",
            "delete-nodepools",
            "wait-nodeclaims-gone",
            "cordon",
            "drain",
            "remove-controller",
            "discharge-finalizers",
            "delete-nodeclasses",
            "verify"
        ]
    );
    let wait = plan.step("wait-nodeclaims-gone").unwrap();
    assert_eq!(wait.action, Action::WaitNodeclaimsGone);
    assert_eq!(wait.params.deadline, Some(Duration::from_secs(15 * 60)));
    assert_eq!(wait.params.on_deadline, OnDeadline::Continue);
    assert_eq!(Plan::builtin("delegate").unwrap().steps(), plan.steps());
}

#[test]
fn a_custom_plan_runs_in_dependency_order_with_defaults_filled_in() {
    let plan = load(&fixture("custom.toml"));
    let ids: Vec<&str> = plan.ordered_steps().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["fence", "drain", "verify"]);
    let drain = plan.step("drain").unwrap();
    assert_eq!(drain.after, ["fence"], "a repeated `after` entry counts once");
    assert_eq!(drain.params.deadline, Some(Duration::from_secs(90)));
    assert_eq!(drain.params.on_deadline, OnDeadline::Skip);
    assert_eq!(drain.params.concurrency, karpenter_teardown::plan::DEFAULT_CONCURRENCY);
    assert_eq!(plan.step("verify").unwrap().params.settle, Duration::from_millis(250));
}

// ---- Every validation error: the message and the line ----

#[test]
fn syntax_errors_name_the_line_and_column() {
    let message = fixture_error("syntax-error.toml");
    assert!(
        message.starts_with("syntax-error.toml:8:8: invalid plan: unclosed array table, expected `]`"),
        "{message}"
    );
}

#[test]
fn unknown_keys_are_rejected_with_the_valid_keys() {
    assert_eq!(
        fixture_error("unknown-key.toml"),
        "unknown-key.toml:7:1: unknown key \"depends_on\" in [[step]]; expected one of `id`, `action`, `after`, \
         `for_each`, `description`, `params`; remove or rename it"
    );
    assert_eq!(
        error_of(&with_header("[[step]]\nid = \"x\"\naction = \"fence\"\nfor-each = \"machine\"\n")),
        "t.toml:6:1: unknown key \"for-each\" in [[step]]; did you mean \"for_each\"?; expected one of `id`, `action`, \
         `after`, `for_each`, `description`, `params`; remove or rename it"
    );
    let top = error_of(&with_header("[[steps]]\nid = \"x\"\n"));
    assert!(top.starts_with("t.toml:3:3: unknown key \"steps\" at the top level; did you mean \"step\"?"), "{top}");
    // `[step]` instead of `[[step]]` gets a hint.
    let single = error_of(&with_header("[step]\nid = \"x\"\naction = \"fence\"\n"));
    assert!(single.starts_with("t.toml:3:1: invalid plan: invalid type: map, expected a sequence"), "{single}");
    assert!(single.contains("write each step as [[step]]"), "{single}");
}

#[test]
fn missing_required_keys_are_named() {
    assert_eq!(
        error_of(&with_header("[[step]]\nid = \"x\"\n")),
        "t.toml:3:1: missing required key \"action\" in [[step]]; add it (see plans/default.toml)"
    );
    assert_eq!(
        error_of("name = \"t\"\n[[step]]\nid = \"x\"\naction = \"fence\"\n"),
        "t.toml:1:1: missing required key \"version\" at the top level; add it (see plans/default.toml)"
    );
}

#[test]
fn unknown_actions_list_the_known_ones() {
    assert_eq!(
        fixture_error("unknown-action.toml"),
        "unknown-action.toml:12:10: unknown action \"drian\"; did you mean \"drain\"?; known actions: preflight, \
         fence, cordon, drain, remove-controller, discharge-finalizers, delete-nodepools, wait-nodeclaims-gone, \
         delete-nodeclasses, verify"
    );
}

#[test]
fn unknown_dependencies_are_rejected() {
    let text = with_header(
        "[[step]]\nid = \"preflight\"\naction = \"preflight\"\n\
         [[step]]\nid = \"fence\"\naction = \"fence\"\nafter = [\"prefligt\"]\n",
    );
    assert_eq!(
        error_of(&text),
        "t.toml:9:10: step \"fence\" runs after \"prefligt\", but there is no step with that id; did you mean \
         \"preflight\"?; known steps: preflight, fence"
    );
}

#[test]
fn duplicate_ids_name_both_lines() {
    let text = with_header("[[step]]\nid = \"x\"\naction = \"fence\"\n[[step]]\nid = \"x\"\naction = \"verify\"\n");
    assert_eq!(error_of(&text), "t.toml:7:6: duplicate step id \"x\", first used on line 4; give each step its own id");
}

#[test]
fn invalid_ids_are_rejected() {
    let text = with_header("[[step]]\nid = \"Drain_1\"\naction = \"fence\"\n");
    assert_eq!(
        error_of(&text),
        "t.toml:4:6: invalid step id \"Drain_1\"; use only lowercase letters, digits and dashes, e.g. \"drain-nodes\""
    );
}

#[test]
fn cycles_are_named_in_run_order() {
    assert_eq!(
        fixture_error("cycle.toml"),
        "cycle.toml:11:23: steps wait on each other in a cycle: a -> b -> c -> a (each runs after the one before \
         it); remove one of these `after` entries"
    );
    let text = with_header("[[step]]\nid = \"x\"\naction = \"fence\"\nafter = [\"x\"]\n");
    let message = error_of(&text);
    assert!(message.starts_with("t.toml:6:10: steps wait on each other in a cycle: x -> x "), "{message}");
}

#[test]
fn bad_durations_are_rejected_with_an_example() {
    let drain = |params: &str| {
        with_header(&format!(
            "[[step]]\nid = \"drain\"\naction = \"drain\"\nfor_each = \"machine\"\n[step.params]\n{params}\n"
        ))
    };
    let message = error_of(&drain("deadline = \"10 parsecs\""));
    assert!(
        message.starts_with("t.toml:8:12: param \"deadline\": invalid duration \"10 parsecs\" (unknown time unit"),
        "{message}"
    );
    assert!(message.ends_with("; write it like \"90s\", \"10m\" or \"1h 30m\""), "{message}");
    assert_eq!(
        error_of(&drain("deadline = \"0s\"")),
        "t.toml:8:12: param \"deadline\": invalid duration \"0s\" (a deadline of zero would expire before the step \
         starts); write it like \"90s\", \"10m\" or \"1h 30m\""
    );
    assert_eq!(
        error_of(&drain("deadline = 600")),
        "t.toml:8:12: param \"deadline\" must be a duration string, e.g. \"10m\", not integer 600"
    );
}

#[test]
fn for_each_must_fit_the_action() {
    let step = |action: &str, for_each: Option<&str>| {
        let for_each = for_each.map(|k| format!("for_each = \"{k}\"\n")).unwrap_or_default();
        error_of(&with_header(&format!("[[step]]\nid = \"s\"\naction = \"{action}\"\n{for_each}")))
    };
    assert_eq!(
        step("fence", Some("machine")),
        "t.toml:6:12: step \"s\": action \"fence\" acts on the cluster as a whole and cannot run per object; remove \
         for_each = \"machine\""
    );
    assert_eq!(
        step("drain", None),
        "t.toml:5:10: step \"s\": action \"drain\" runs once per object; add for_each = \"machine\""
    );
    assert_eq!(
        step("discharge-finalizers", Some("nodepool")),
        "t.toml:6:12: step \"s\": action \"discharge-finalizers\" runs once per machine, not per nodepool; write \
         for_each = \"machine\""
    );
    assert_eq!(
        step("delete-nodepools", Some("nodeclass")),
        "t.toml:6:12: step \"s\": action \"delete-nodepools\" can run once per nodepool, not per nodeclass; write \
         for_each = \"nodepool\" or remove for_each"
    );
    assert_eq!(
        step("drain", Some("node")),
        "t.toml:6:12: unknown for_each \"node\"; use one of machine, nodepool, nodeclass"
    );
}

#[test]
fn params_must_be_accepted_by_the_action() {
    let step = |action: &str, params: &str| {
        error_of(&with_header(&format!(
            "[[step]]\nid = \"s\"\naction = \"{action}\"\nfor_each = \"machine\"\n[step.params]\n{params}\n"
        )))
    };
    assert_eq!(
        error_of(&with_header("[[step]]\nid = \"s\"\naction = \"fence\"\n[step.params]\ndeadline = \"1m\"\n")),
        "t.toml:7:1: action \"fence\" does not accept param \"deadline\"; it takes no params; remove [step.params]"
    );
    assert_eq!(
        step("drain", "deadline = \"1m\"\ndeadlin = \"2m\""),
        "t.toml:9:1: action \"drain\" does not accept param \"deadlin\"; did you mean \"deadline\"?; it accepts: \
         deadline, on_deadline, concurrency"
    );
    assert_eq!(
        step("discharge-finalizers", "on_deadline = \"delete\""),
        "t.toml:8:1: action \"discharge-finalizers\" does not accept param \"on_deadline\"; it accepts: deadline, \
         concurrency"
    );
    assert_eq!(
        step("drain", "on_deadline = \"continue\""),
        "t.toml:8:15: action \"drain\" cannot do on_deadline = \"continue\"; choose one of fail, delete, skip"
    );
    let wait =
        with_header("[[step]]\nid = \"w\"\naction = \"wait-nodeclaims-gone\"\n[step.params]\non_deadline = \"skip\"\n");
    assert_eq!(
        error_of(&wait),
        "t.toml:7:15: action \"wait-nodeclaims-gone\" cannot do on_deadline = \"skip\"; choose one of fail, continue"
    );
}

#[test]
fn concurrency_must_be_a_positive_integer() {
    let drain = |value: &str| {
        error_of(&with_header(&format!(
            "[[step]]\nid = \"s\"\naction = \"drain\"\nfor_each = \"machine\"\n[step.params]\nconcurrency = {value}\n"
        )))
    };
    assert_eq!(
        drain("0"),
        "t.toml:8:15: concurrency must be a positive integer, not 0; 0 tasks at once would never run anything, use \
         1 to run one at a time"
    );
    assert!(drain("-3").starts_with("t.toml:8:15: concurrency must be a positive integer, not -3;"));
    assert_eq!(
        drain("\"64\""),
        "t.toml:8:15: param \"concurrency\" must be a positive integer, e.g. 64, not string \"64\""
    );
}

#[test]
fn only_version_1_is_read() {
    assert_eq!(
        error_of("version = 2\nname = \"t\"\n[[step]]\nid = \"x\"\naction = \"fence\"\n"),
        "t.toml:1:11: unsupported plan version 2; this program reads version = 1"
    );
}

#[test]
fn empty_plans_and_names_are_rejected() {
    assert_eq!(error_of(&with_header("")), "t.toml: the plan has no steps; add at least one [[step]] table");
    assert_eq!(error_of(&with_header("step = []\n")), "t.toml: the plan has no steps; add at least one [[step]] table");
    assert_eq!(
        error_of("version = 1\nname = \" \"\n[[step]]\nid = \"x\"\naction = \"fence\"\n"),
        "t.toml:2:8: the plan name is empty; give the plan a name, e.g. name = \"default\""
    );
}

#[test]
fn errors_carry_their_location_and_missing_files_are_reported() {
    let err = Plan::from_str(&with_header("[[step]]\nid = \"x\"\naction = \"explode\"\n"), "t.toml").unwrap_err();
    let at = err.location().unwrap();
    assert_eq!((at.source.as_str(), at.line, at.column), ("t.toml", 5, 10));

    let missing = fixture("does-not-exist.toml");
    let err = Plan::load(&missing).unwrap_err();
    assert!(matches!(err, PlanError::Read { .. }), "{err:?}");
    assert!(err.to_string().starts_with(&format!("{}: cannot read the plan file:", missing.display())), "{err}");
    assert!(err.location().is_none());
    assert!(matches!(Plan::builtin("fast"), Err(PlanError::UnknownBuiltin { .. })));
}

// ---- Expansion ----

#[test]
fn machines_move_from_drain_to_their_own_finalizer_step() {
    let plan = Plan::builtin_default();
    let objects =
        ObjectSets { machines: machines(3), nodepools: vec!["p1".into(), "p2".into()], nodeclasses: vec!["c1".into()] };
    let graph = plan.expand(&objects);
    assert_topological(&graph);
    assert_eq!(graph.task_count(), 1 + 1 + 1 + 3 + 1 + 3 + 2 + 1 + 1);

    // Object-wise: discharge-finalizers[m] waits for drain[m] (and the controller), nothing else.
    for m in ["m1", "m2", "m3"] {
        let discharge = task(&graph, "discharge-finalizers", Some(m));
        assert_eq!(deps(&graph, discharge), set(&[&format!("drain[{m}]"), "remove-controller"]));
        let drain = task(&graph, "drain", Some(m));
        // every node is cordoned before the first drain starts
        assert_eq!(deps(&graph, drain), set(&["cordon"]));
        // nothing waits for every drain: a machine moves on without the others
        assert_eq!(labels(&graph, graph.dependents(drain)), set(&[&format!("discharge-finalizers[{m}]")]));
    }

    // Whole-step: remove-controller waits for the fence only, beside the cordon and the drains.
    let controller = task(&graph, "remove-controller", None);
    assert_eq!(deps(&graph, controller), set(&["fence"]));

    // Every nodepool waits for every machine's finalizers; the class waits for both pools.
    for p in ["p1", "p2"] {
        let pool = task(&graph, "delete-nodepools", Some(p));
        let via: Vec<TaskId> = graph.dependencies(pool).collect();
        assert_eq!(via.len(), 1);
        assert_eq!(
            deps(&graph, via[0]),
            set(&["discharge-finalizers[m1]", "discharge-finalizers[m2]", "discharge-finalizers[m3]"])
        );
    }
    let class = task(&graph, "delete-nodeclasses", Some("c1"));
    let via: Vec<TaskId> = graph.dependencies(class).collect();
    assert_eq!(deps(&graph, via[0]), set(&["delete-nodepools[p1]", "delete-nodepools[p2]"]));
    assert_eq!(deps(&graph, task(&graph, "verify", None)), set(&["delete-nodeclasses[c1]"]));

    // Running it: once the controller is gone, each drained machine moves on alone, while the
    // other machines still drain.
    let mut tracker = ReadyTracker::new(&graph);
    let mut ready = tracker.start(&graph);
    assert_eq!(labels(&graph, ready.clone()), set(&["preflight"]));
    ready = tracker.complete(&graph, ready[0]);
    ready = tracker.complete(&graph, ready[0]);
    assert_eq!(labels(&graph, ready.clone()), set(&["remove-controller", "cordon"]));
    let cordon = task(&graph, "cordon", None);
    assert_eq!(labels(&graph, tracker.complete(&graph, cordon)), set(&["drain[m1]", "drain[m2]", "drain[m3]"]));
    assert!(tracker.complete(&graph, task(&graph, "drain", Some("m1"))).is_empty());
    assert_eq!(labels(&graph, tracker.complete(&graph, controller)), set(&["discharge-finalizers[m1]"]));
    assert_eq!(
        labels(&graph, tracker.complete(&graph, task(&graph, "drain", Some("m2")))),
        set(&["discharge-finalizers[m2]"])
    );

    // What a dry run prints.
    let summary = graph.summary();
    assert_eq!(summary.tasks, graph.task_count());
    assert_eq!(summary.barriers, 2);
    assert_eq!(summary.steps.iter().find(|s| s.step == "drain").map(|s| s.tasks), Some(3));
    assert!(summary.to_string().contains("drain (one per machine)"), "{summary}");
}

#[test]
fn the_delegate_plan_runs_the_fallback_per_machine_after_the_wait() {
    let graph = Plan::builtin("delegate").unwrap().expand(&ObjectSets {
        machines: machines(2),
        nodepools: vec!["p".into()],
        nodeclasses: vec!["c".into()],
    });
    assert_topological(&graph);
    assert_eq!(deps(&graph, task(&graph, "wait-nodeclaims-gone", None)), set(&["delete-nodepools"]));
    assert_eq!(deps(&graph, task(&graph, "cordon", None)), set(&["wait-nodeclaims-gone"]));
    assert_eq!(deps(&graph, task(&graph, "drain", Some("m1"))), set(&["cordon"]));
    assert_eq!(
        deps(&graph, task(&graph, "discharge-finalizers", Some("m2"))),
        set(&["drain[m2]", "remove-controller"])
    );
}

#[test]
fn steps_without_objects_keep_the_order_of_the_rest() {
    let plan = Plan::builtin_default();
    let graph = plan.expand(&ObjectSets { nodeclasses: vec!["c".into()], ..ObjectSets::default() });
    assert_topological(&graph);
    assert_eq!(graph.step_tasks("drain").len(), 0);
    assert_eq!(graph.step_tasks("discharge-finalizers").len(), 0);
    assert_eq!(deps(&graph, task(&graph, "remove-controller", None)), set(&["fence"]));
    // the empty drain and finalizer steps pass on both of theirs: the cordon and the controller
    assert_eq!(deps(&graph, task(&graph, "delete-nodeclasses", Some("c"))), set(&["cordon", "remove-controller"]));
    assert_eq!(deps(&graph, task(&graph, "verify", None)), set(&["delete-nodeclasses[c]"]));

    // Nothing at all: still preflight -> fence -> remove-controller and cordon -> verify.
    let graph = plan.expand(&ObjectSets::default());
    let order: Vec<String> = graph.tasks().filter(|(_, t)| !t.barrier).map(|(_, t)| t.label()).collect();
    assert_eq!(order, ["preflight", "fence", "remove-controller", "cordon", "verify"]);
    assert_eq!(deps(&graph, task(&graph, "verify", None)), set(&["cordon", "remove-controller"]));
    assert_eq!(graph.summary().steps.len(), 9, "empty steps are still listed");
}

#[test]
fn an_empty_step_passes_on_several_dependencies_through_one_barrier() {
    let text = with_header(
        "[[step]]\nid = \"a\"\naction = \"fence\"\n\
         [[step]]\nid = \"b\"\naction = \"remove-controller\"\n\
         [[step]]\nid = \"pools\"\naction = \"delete-nodepools\"\nfor_each = \"nodepool\"\nafter = [\"a\", \"b\"]\n\
         [[step]]\nid = \"d\"\naction = \"drain\"\nfor_each = \"machine\"\nafter = [\"pools\"]\n",
    );
    let plan = Plan::from_str(&text, "t.toml").unwrap();
    let graph = plan.expand(&ObjectSets { machines: machines(3), ..ObjectSets::default() });
    assert_topological(&graph);
    let entry: BTreeSet<TaskId> =
        graph.step_tasks("d").into_iter().flat_map(|t| graph.dependencies(t).collect::<Vec<_>>()).collect();
    assert_eq!(entry.len(), 1, "all drains wait on one barrier");
    let entry = entry.into_iter().next().unwrap();
    assert!(graph[entry].barrier);
    assert_eq!(deps(&graph, entry), set(&["a", "b"]));
    assert_eq!(graph.edge_count(), 2 + 3);
}

#[test]
fn thousands_of_machines_expand_into_a_graph_linear_in_their_number() {
    let plan = Plan::builtin_default();
    for n in [1_000, 10_000] {
        let objects = ObjectSets {
            machines: machines(n),
            nodepools: (0..10).map(|i| format!("p{i}")).collect(),
            nodeclasses: (0..10).map(|i| format!("c{i}")).collect(),
        };
        // how long it takes is a benchmark's to say, not a test's: the size of what it builds is
        // what stays linear
        let graph = plan.expand(&objects);
        assert_eq!(graph.task_count(), 5 + 2 * n + 20);
        // Five edges per machine (cordon->drain, drain->barrier, drain->discharge,
        // controller->discharge, discharge->barrier) plus a constant: O(n), not O(n^2).
        assert!(graph.edge_count() <= 5 * n + 100, "{n} machines gave {} edges", graph.edge_count());
        assert!(graph.node_count() <= graph.task_count() + 8);
        if n == 1_000 {
            assert_topological(&graph);
        }
    }
}

// ---- Rendering ----

#[test]
fn text_lists_steps_in_order_with_their_params() {
    let text = load(&fixture("custom.toml")).render(RenderFormat::Text);
    assert!(text.starts_with("plan \"custom\" ("), "{text}");
    let fence = text.find("\n1. fence\n");
    let drain = text.find("\n2. drain\n");
    let verify = text.find("\n3. verify\n");
    assert!(fence < drain && drain < verify && fence.is_some(), "{text}");
    assert!(text.contains("     for each:  machine\n"), "{text}");
    assert!(text.contains("     after:     fence\n"), "{text}");
    assert!(
        text.contains("     params:    deadline = 1m 30s, on_deadline = skip, concurrency = 64 (default)\n"),
        "{text}"
    );
    let default = Plan::builtin_default().render(RenderFormat::Text);
    assert!(default.contains("\n9. verify\n"), "{default}");
    assert!(default.contains("Prove the cluster's identity and take inventory."), "{default}");
}

/// What must hold of any DOT output, checked without Graphviz.
fn assert_dot_structure(plan: &Plan, dot: &str) {
    assert!(dot.starts_with(&format!("digraph \"{}\" {{\n", plan.name())), "{dot}");
    assert!(dot.ends_with("}\n"), "{dot}");
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());
    for line in dot.lines() {
        let quotes = line.matches('"').count() - line.matches("\\\"").count();
        assert_eq!(quotes % 2, 0, "unbalanced quotes: {line}");
    }
    for step in plan.steps() {
        assert!(dot.contains(&format!("\n  \"{}\" [label=\"{}\\naction: {}", step.id, step.id, step.action)), "{dot}");
        for dep in &step.after {
            assert!(dot.contains(&format!("\n  \"{dep}\" -> \"{}\";\n", step.id)), "{dot}");
        }
    }
    let edges: usize = plan.steps().iter().map(|s| s.after.len()).sum();
    assert_eq!(dot.matches(" -> ").count(), edges);
}

#[test]
fn dot_output_is_a_valid_digraph_of_the_steps() {
    let plans = [Plan::builtin_default(), Plan::builtin("delegate").unwrap(), load(&fixture("custom.toml"))];
    for plan in &plans {
        assert_dot_structure(plan, &plan.render(RenderFormat::Dot));
    }

    // rendered as `| dot -Tsvg` would: parsed and laid out by a DOT renderer, one box a step
    for plan in &plans {
        let dot = plan.render(RenderFormat::Dot);
        let mut parser = layout::gv::DotParser::new(&dot);
        let graph =
            parser.process().unwrap_or_else(|e| panic!("{} is no DOT a renderer reads: {e}\n{dot}", plan.name()));
        let mut builder = layout::gv::GraphBuilder::new();
        builder.visit_graph(&graph);
        let mut visual = builder.get();
        assert_eq!(visual.num_nodes(), plan.steps().len(), "{dot}");
        let mut svg = layout::backends::svg::SVGWriter::new();
        visual.do_it(false, false, false, &mut svg);
        let svg = svg.finalize();
        assert!(svg.contains("<svg"), "{svg}");
        for step in plan.steps() {
            assert!(svg.contains(&step.id), "step {} is not drawn: {svg}", step.id);
        }
    }
}

#[test]
fn mermaid_output_is_a_flowchart_of_the_steps() {
    let plan = Plan::builtin_default();
    let mermaid = plan.render(RenderFormat::Mermaid);
    assert!(mermaid.starts_with("flowchart TD\n"), "{mermaid}");
    assert!(mermaid.contains("    s1[\"preflight<br/>action: preflight\"]\n"), "{mermaid}");
    assert!(mermaid.contains("    s2 --> s3\n"), "{mermaid}");
    let edges: usize = plan.steps().iter().map(|s| s.after.len()).sum();
    assert_eq!(mermaid.matches(" --> ").count(), edges);
    assert_eq!(mermaid.lines().filter(|l| l.trim_start().starts_with('s') && l.ends_with("\"]")).count(), 9);
}
