//! From a rehearsal on the accelerated copy to a prediction on the real clock.
//!
//! The copy runs every grace period and every Karpenter delay `time_scale` times as fast, and the
//! drain deadline too (its clock starting once the node's evictions are asked for), so each wait
//! ends at the same point of the work as it would for real.
//! The API and EC2 work is not accelerated: it is measured as it is. So a step's real duration is
//! predicted as what the rehearsal measured, plus the part of its waits the acceleration took
//! away: `measured + (1 - time_scale) × waits`, where `waits` is the step's chain of real waits
//! read from the snapshot (the drain: the slowest node's grace periods, wave after wave, or the
//! drain deadline when the rehearsal hit it; removing the controller: its pods' grace period).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use crate::report::{StepRecord, TaskResult};
use crate::snapshot::{RawObject, Snapshot};

/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE: i64 = 30;
/// The priority classes a drain evicts last (Karpenter's and the tool's second wave).
const CRITICAL_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];

/// One step of the plan, as predicted.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct StepPrediction {
    /// Step id.
    pub step: String,
    /// Its action.
    pub action: String,
    /// Tasks it ran in the rehearsal.
    pub tasks: usize,
    /// How the step ended in the rehearsal (its worst task).
    pub result: TaskResult,
    /// Wall time in the rehearsal, seconds.
    pub rehearsal_seconds: f64,
    /// Real waits on the step's critical chain, seconds (see the module documentation).
    pub waits_seconds: f64,
    /// Predicted wall time on the real clock, seconds.
    pub predicted_seconds: f64,
    /// Its share of the predicted total (0–1).
    pub share: f64,
    /// Where its waits come from.
    pub basis: String,
}

/// The per-step predictions and their total.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub(crate) struct Timing {
    /// The steps, in the order they started.
    pub steps: Vec<StepPrediction>,
    /// Predicted wall time of the whole run, seconds.
    pub predicted_seconds: f64,
    /// Wall time of the rehearsal's run, seconds.
    pub rehearsal_seconds: f64,
}

/// What the timing model needs of the run's settings.
#[derive(Debug, Clone)]
pub(crate) struct TimingInputs {
    /// The copy's clock.
    pub time_scale: f64,
    /// The drain deadline on the real clock.
    pub drain_deadline: Duration,
    /// Wall time of the rehearsal's whole run (preflight and inventory included), seconds.
    pub run_seconds: f64,
    /// The machines whose drain ran into its deadline in the rehearsal (whatever its policy did).
    pub deadline_passed: BTreeSet<String>,
}

/// The real waits a snapshot holds, read before its objects move into the copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Waits {
    /// Per machine (a NodeClaim's name, or `node/<name>` for a Karpenter node without one, as the
    /// plan names them): its node's chain of grace periods, seconds.
    pub drain: BTreeMap<String, f64>,
    /// The controller's pods' longest grace period, seconds (0 when it runs no pod).
    pub controller_grace: f64,
}

impl Waits {
    /// Reads them off a snapshot.
    pub(crate) fn of(snap: &Snapshot) -> Waits {
        let claim_of: BTreeMap<String, String> = snap
            .kubernetes
            .nodeclaims
            .iter()
            .map(RawObject::value)
            .filter_map(|c| {
                Some((c["status"]["nodeName"].as_str()?.to_string(), c["metadata"]["name"].as_str()?.to_string()))
            })
            .collect();
        let drain = drain_chains(snap)
            .into_iter()
            .map(|(node, secs)| {
                let machine =
                    claim_of.get(node.as_str()).map(|c| c.to_string()).unwrap_or_else(|| format!("node/{node}"));
                (machine, secs)
            })
            .collect();
        Waits { drain, controller_grace: if snap.karpenter.ready_replicas > 0 { controller_grace(snap) } else { 0.0 } }
    }
}

/// Predicts each step's and the run's wall time from the rehearsal's step records.
///
/// A drain task's real end is its end in the rehearsal plus what the acceleration took from its
/// own node's waits; the step ends with its last task. Nodes drain at once, so the queue of
/// evictions overlaps the grace periods in the real run as it does in the rehearsal: adding the
/// slowest node's waits to the whole step would count that queue twice. Every later step starts
/// that much later.
pub(crate) fn timing(waits: &Waits, records: &[StepRecord], inputs: &TimingInputs) -> Timing {
    let scale = inputs.time_scale.clamp(0.0, 1.0);
    let mut by_step: Vec<(String, String, Vec<&StepRecord>)> = Vec::new();
    for r in records {
        match by_step.iter_mut().find(|(s, _, _)| *s == r.step) {
            Some((_, _, v)) => v.push(r),
            None => by_step.push((r.step.clone(), r.action.clone(), vec![r])),
        }
    }
    let mut steps = Vec::new();
    let mut added = 0.0;
    for (step, action, recs) in by_step {
        let span: Vec<(f64, f64, &StepRecord)> = {
            let t0 = recs.iter().filter_map(|r| parse_time(&r.started)).min();
            recs.iter()
                .filter_map(|r| {
                    let since = |t: SystemTime| t.duration_since(t0?).ok().map(|d| d.as_secs_f64());
                    Some((since(parse_time(&r.started)?)?, since(parse_time(&r.finished)?)?, *r))
                })
                .collect()
        };
        let measured = span.iter().map(|(_, e, _)| *e).fold(0.0, f64::max);
        let result = recs.iter().map(|r| r.result).max().unwrap_or(TaskResult::Done);
        let (predicted, wait, basis) = match action.as_str() {
            "drain" => drain_step(waits, &span, inputs, scale),
            "remove-controller" if waits.controller_grace > 0.0 => (
                measured + (1.0 - scale) * waits.controller_grace,
                waits.controller_grace,
                "the controller's pods' grace period".to_string(),
            ),
            _ => (measured, 0.0, "API and EC2 work only, as measured".to_string()),
        };
        added += predicted - measured;
        steps.push(StepPrediction {
            step,
            action,
            tasks: recs.len(),
            result,
            rehearsal_seconds: measured,
            waits_seconds: wait,
            predicted_seconds: predicted,
            share: 0.0,
            basis,
        });
    }
    let predicted_seconds = inputs.run_seconds + added;
    for s in &mut steps {
        s.share = if predicted_seconds > 0.0 { s.predicted_seconds / predicted_seconds } else { 0.0 };
    }
    Timing { steps, predicted_seconds, rehearsal_seconds: inputs.run_seconds }
}

/// The drain step: (predicted seconds, the waits of the task that ends it, why).
fn drain_step(
    waits: &Waits,
    span: &[(f64, f64, &StepRecord)],
    inputs: &TimingInputs,
    scale: f64,
) -> (f64, f64, String) {
    let deadline = inputs.drain_deadline.as_secs_f64();
    let mut last: Option<(f64, f64, String, bool)> = None;
    for (_, end, r) in span {
        let machine = r.object.clone().unwrap_or_default();
        let hit = inputs.deadline_passed.contains(&machine);
        let wait = if hit { deadline } else { waits.drain.get(&machine).copied().unwrap_or(0.0) };
        let predicted_end = end + (1.0 - scale) * wait;
        if last.as_ref().is_none_or(|(e, _, _, _)| predicted_end > *e) {
            last = Some((predicted_end, wait, machine, hit));
        }
    }
    match last {
        None => (0.0, 0.0, "no node to drain".to_string()),
        Some((end, wait, machine, true)) => (
            end,
            wait,
            format!(
                "the drain deadline: {} node(s) ran into it, the last to end {machine}",
                inputs.deadline_passed.len()
            ),
        ),
        Some((end, wait, machine, false)) => (
            end,
            wait,
            format!(
                "ends with {machine}: its evictions, then its pods' grace periods (critical pods after the others)"
            ),
        ),
    }
}

fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

fn grace(pod: &Value) -> i64 {
    pod["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap_or(DEFAULT_GRACE).max(0)
}

fn is_daemon(pod: &Value) -> bool {
    pod["metadata"]["ownerReferences"].as_array().is_some_and(|r| r.iter().any(|o| o["kind"] == "DaemonSet"))
}

fn is_critical(pod: &Value) -> bool {
    pod["spec"]["priorityClassName"].as_str().is_some_and(|c| CRITICAL_CLASSES.contains(&c))
}

/// Each Karpenter node's chain of waits when nothing blocks: its non-critical pods' longest
/// grace period, then its critical pods' (they are evicted once the others are gone).
fn drain_chains(snap: &Snapshot) -> BTreeMap<String, f64> {
    let ours: std::collections::BTreeSet<String> =
        snap.karpenter_nodes().filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string)).collect();
    let mut per_node: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for p in snap.kubernetes.pods.iter().map(RawObject::value) {
        let Some(node) = p["spec"]["nodeName"].as_str().filter(|n| ours.contains(*n)) else { continue };
        if is_daemon(&p) || matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")) {
            continue;
        }
        let e = per_node.entry(node.to_string()).or_default();
        if is_critical(&p) {
            e.1 = e.1.max(grace(&p));
        } else {
            e.0 = e.0.max(grace(&p));
        }
    }
    per_node.into_iter().map(|(n, (normal, critical))| (n, (normal + critical) as f64)).collect()
}

/// The longest grace period of the controller's pods.
fn controller_grace(snap: &Snapshot) -> f64 {
    let Some((ns, _)) = snap.karpenter.controller.as_deref().and_then(|c| c.split_once('/')) else { return 0.0 };
    snap.kubernetes
        .pods
        .iter()
        .map(RawObject::value)
        .filter(|p| {
            p["metadata"]["namespace"] == ns && p["metadata"]["labels"]["app.kubernetes.io/name"] == "karpenter"
        })
        .map(|p| grace(&p))
        .max()
        .unwrap_or(0) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::KubeObjects;
    use serde_json::json;

    fn snap(pods: Vec<Value>) -> Snapshot {
        let node = |n: &str| json!({"metadata": {"name": n, "labels": {"karpenter.sh/nodepool": "default"}}});
        let mut s: Snapshot = serde_json::from_value(json!({
            "format": "karpenter-teardown/snapshot", "version": 1, "tool_version": "t", "taken_at": "t",
            "cluster": "c", "region": "us-west-2", "account": "1", "source": {}, "karpenter": {},
            "kubernetes": {}, "aws": {}, "reads": {}}))
        .unwrap();
        s.kubernetes = KubeObjects {
            nodes: vec![node("a").into(), node("b").into()],
            pods: pods.into_iter().map(RawObject::from).collect(),
            ..KubeObjects::default()
        };
        s
    }

    fn pod(node: &str, grace: i64, critical: bool) -> Value {
        let class = if critical { "system-cluster-critical" } else { "" };
        json!({"metadata": {"name": format!("p{grace}")}, "spec": {"nodeName": node, "terminationGracePeriodSeconds": grace,
            "priorityClassName": class}, "status": {"phase": "Running"}})
    }

    fn record(step: &str, object: Option<&str>, from: f64, to: f64, result: TaskResult) -> StepRecord {
        let t = |s: f64| crate::report::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs_f64(1_700_000_000.0 + s));
        StepRecord {
            step: step.into(),
            action: step.into(),
            object: object.map(str::to_string),
            started: t(from),
            finished: t(to),
            attempts: 1,
            result,
            detail: String::new(),
        }
    }

    fn inputs(run_seconds: f64, deadline_passed: &[&str]) -> TimingInputs {
        TimingInputs {
            time_scale: 0.05,
            drain_deadline: Duration::from_secs(600),
            run_seconds,
            deadline_passed: deadline_passed.iter().map(|m| m.to_string()).collect(),
        }
    }

    #[test]
    fn each_node_waits_its_own_grace_periods_and_critical_pods_wait_for_the_others() {
        let s = snap(vec![pod("a", 30, false), pod("a", 10, true), pod("b", 35, false), pod("elsewhere", 600, false)]);
        let w = Waits::of(&s);
        // no NodeClaim names the nodes: the plan calls their machines node/<name>
        assert_eq!(w.drain, BTreeMap::from([("node/a".to_string(), 40.0), ("node/b".to_string(), 35.0)]));
    }

    #[test]
    fn a_step_gets_back_the_waits_the_acceleration_took_away() {
        let s = snap(vec![pod("a", 60, false)]);
        let records = [
            record("fence", None, 0.0, 1.0, TaskResult::Done),
            record("drain", Some("node/a"), 1.0, 5.0, TaskResult::Done),
        ];
        let t = timing(&Waits::of(&s), &records, &inputs(6.0, &[]));
        assert_eq!(t.steps[0].predicted_seconds, 1.0);
        // 4 s measured (3 s of them the scaled 60 s grace period) + 0.95 × 60 s
        assert!((t.steps[1].predicted_seconds - 61.0).abs() < 1e-9, "{:?}", t.steps[1]);
        assert!((t.predicted_seconds - 63.0).abs() < 1e-9);
        assert!((t.steps.iter().map(|s| s.share).sum::<f64>() - 62.0 / 63.0).abs() < 1e-9);
    }

    #[test]
    fn the_queue_of_evictions_is_not_counted_twice() {
        // node a's evictions are asked at once and wait 60 s; node b's wait in the queue for 30 s
        // and then 10 s: for real b ends at 40 s, long before a at 60 s
        let s = snap(vec![pod("a", 60, false), pod("b", 10, false)]);
        let records = [
            record("drain", Some("node/a"), 0.0, 3.0, TaskResult::Done),
            record("drain", Some("node/b"), 0.0, 30.5, TaskResult::Done),
        ];
        let t = timing(&Waits::of(&s), &records, &inputs(31.0, &[]));
        assert!((t.steps[0].predicted_seconds - 60.0).abs() < 1e-9, "{:?}", t.steps[0]);
        assert!(t.steps[0].basis.contains("node/a"), "{}", t.steps[0].basis);
        assert!((t.predicted_seconds - (31.0 + 60.0 - 30.5)).abs() < 1e-9);
    }

    #[test]
    fn a_drain_that_hit_its_deadline_is_predicted_to_wait_the_whole_real_deadline() {
        let s = snap(vec![pod("a", 5, false)]);
        let records = [record("drain", Some("node/a"), 0.0, 31.0, TaskResult::Blocked)];
        let t = timing(&Waits::of(&s), &records, &inputs(32.0, &["node/a"]));
        assert!((t.steps[0].predicted_seconds - (31.0 + 0.95 * 600.0)).abs() < 1e-9);
        assert!(t.steps[0].basis.contains("deadline"));
    }
}
