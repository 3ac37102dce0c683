//! Resume after a kill: the default plan is SIGKILLed at five points, found by reading the tool's
//! JSON log lines as they arrive; a fresh run must then exit 0 and reach the same end state as an
//! uninterrupted one. And SIGTERM mid-drain exits 130.

use std::process::Stdio;
use std::time::Duration;

use crate::common::safety::*;
use sandbox_sim::generate;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

/// Our crate's `started` events are debug; everything else stays at info.
const LOG_LEVEL: &str = "info,karpenter_teardown=debug";

#[derive(Debug, Clone, Copy)]
enum KillPoint {
    MidDrain,
    AfterControllerScaleDown,
    MidFinalizerDischarge,
    BetweenPoolsAndClasses,
    MidVerify,
    /// Any drain task has started (for SIGTERM: the drain is in progress).
    DrainStarted,
}

/// Watches the log lines for one kill point.
struct Detector {
    point: KillPoint,
    pools: usize,
    pools_ended: usize,
}

impl Detector {
    fn hit(&mut self, line: &Value) -> bool {
        let step = line["span"]["step"].as_str().unwrap_or("");
        let msg = line["message"].as_str().unwrap_or("");
        match self.point {
            // one machine's drain ended: the others are still draining, or about to move on
            KillPoint::MidDrain => step == "drain" && msg == "task ended",
            KillPoint::AfterControllerScaleDown => step == "remove-controller" && msg == "task ended",
            KillPoint::MidFinalizerDischarge => step == "discharge-finalizers" && msg == "task ended",
            KillPoint::BetweenPoolsAndClasses => {
                if step == "delete-nodepools" && msg == "task ended" {
                    self.pools_ended += 1;
                }
                self.pools_ended == self.pools
            }
            KillPoint::MidVerify => step == "verify" && msg == "started",
            KillPoint::DrainStarted => step == "drain" && msg == "started",
        }
    }
}

/// Starts `run --yes` and kills it with `signal` once the detector fires; returns the exit code
/// (`None` when killed by a signal) and the log lines read.
async fn run_until(
    b: &Bed,
    cluster: &str,
    mut det: Detector,
    signals: &[(&str, Duration)],
) -> (Option<i32>, Vec<String>) {
    // Verification's settle counts from the controller's end, which the releases' own settle
    // (their fences held for a while) has mostly used up by the time it starts: a longer one
    // keeps the verify task in flight long enough to be interrupted in the middle.
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("slow-verify.toml");
    let default = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/plans/default.toml")).unwrap();
    assert_eq!(default.matches("settle = \"5s\"").count(), 1, "the default plan's verify settle moved");
    std::fs::write(&plan, default.replace("settle = \"5s\"", "settle = \"20s\"")).unwrap();
    let plan = plan.to_string_lossy().into_owned();
    let mut args = vec!["--yes", "--log-level", LOG_LEVEL];
    if matches!(det.point, KillPoint::MidVerify) {
        args.extend(["--plan", plan.as_str()]);
    }
    let inv = Invocation { args, ..Invocation::default() };
    let mut cmd = command(b, "run", cluster, &inv);
    cmd.stderr(Stdio::piped()).stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut fired = false;
    while let Some(line) = lines.next_line().await.unwrap() {
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        seen.push(line);
        if det.hit(&v) {
            fired = true;
            break;
        }
    }
    assert!(fired, "the run ended before {:?}:\n{}", det.point, seen.join("\n"));
    let pid = child.id().unwrap().to_string();
    for (signal, delay) in signals {
        tokio::time::sleep(*delay).await;
        let killed = std::process::Command::new("kill").args([*signal, pid.as_str()]).status().unwrap();
        assert!(killed.success(), "kill {signal} {pid} failed");
    }
    // keep reading so the tool never blocks on a full pipe while it shuts down
    let drain = tokio::spawn(async move {
        let mut rest = Vec::new();
        while let Ok(Some(l)) = lines.next_line().await {
            rest.push(l);
        }
        rest
    });
    let status = child.wait().await.unwrap();
    seen.extend(drain.await.unwrap());
    (status.code(), seen)
}

async fn kill_and_resume(point: KillPoint) {
    let s = two_pool_world(&format!("resume-{point:?}").to_lowercase(), 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let det = Detector { point, pools: world.node_pools.len(), pools_ended: 0 };
    let delay = if matches!(point, KillPoint::MidVerify) { Duration::from_secs(1) } else { Duration::ZERO };
    let (code, lines) = run_until(&b, &world.cluster, det, &[("-KILL", delay)]).await;
    assert_eq!(code, None, "{point:?}: the run was not killed by the signal:\n{}", lines.join("\n"));

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{point:?}: the fresh run failed:\n{}", run.dump());
    assert_eq!(run.report["outcome"], "clean", "{point:?}");
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_run_finishes_what_a_sigkilled_run_began() {
    // concurrently, on this task (the world generator's future is not `Send` for every
    // lifetime, so it cannot be spawned): one small world per kill point
    futures::future::join_all(
        [
            KillPoint::MidDrain,
            KillPoint::AfterControllerScaleDown,
            KillPoint::MidFinalizerDischarge,
            KillPoint::BetweenPoolsAndClasses,
            KillPoint::MidVerify,
        ]
        .map(kill_and_resume),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_drain_exits_130() {
    let mut s = two_pool_world("resume-sigterm", 2);
    // a strict PDB keeps the drain going (default deadline 10 minutes)
    s.strict_pdb = true;
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let det = Detector { point: KillPoint::DrainStarted, pools: 0, pools_ended: 0 };
    // a second later the drain is evicting, and the strict PDB's pods keep it from ending
    let (code, lines) = run_until(&b, &world.cluster, det, &[("-TERM", Duration::from_secs(1))]).await;
    assert_eq!(code, Some(130), "{}", lines.join("\n"));
    let report = read_report(&b, "run");
    assert_eq!(report["outcome"], "interrupted", "{report:#}");
    b.server.shutdown().await;
}

/// A second interrupt ends the run at once (exit 130), naming what was in flight. The
/// first one, during verification's settle, would let the verify task finish its two reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_interrupt_stops_at_once_naming_the_tasks_in_flight() {
    let s = two_pool_world("resume-twice", 2);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let det = Detector { point: KillPoint::MidVerify, pools: world.node_pools.len(), pools_ended: 0 };
    let signals = [("-TERM", Duration::ZERO), ("-TERM", Duration::from_millis(300))];
    let (code, lines) = run_until(&b, &world.cluster, det, &signals).await;
    assert_eq!(code, Some(130), "{}", lines.join("\n"));
    let said = lines.iter().find(|l| l.contains("interrupted twice")).unwrap_or_else(|| panic!("{}", lines.join("\n")));
    assert!(said.contains("1 task(s) in flight: verify"), "{said}");
    // the run is resumable: a re-run verifies and ends clean
    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    b.server.shutdown().await;
}
