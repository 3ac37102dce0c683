//! Helpers of the safety and reliability tests (field reports, bad input, resume, faults): their
//! world, a runner of the real binary for any subcommand, and what they check in reports; the
//! test bed and end-state checks are `common::e2e`'s.
#![allow(dead_code, reason = "each test binary uses its own subset of these helpers")]

use std::path::PathBuf;

use sandbox_sim::WorldSpec;
use serde_json::Value;

use crate::common;
// each test file uses its own subset of these
#[allow(unused_imports, reason = "each test file uses its own subset of these")]
pub use crate::common::e2e::{
    Bed, Consent, REGION, Run, assert_torn_down, bed, bed_with, count, settled_resource_version, states, teardown,
    untouchable_names, untouchable_nodes,
};

/// A small world: few nodes, one decoy, a managed node group of 2 (one tainted) and a
/// control-plane node.
pub fn two_pool_world(prefix: &str, nodes: usize) -> WorldSpec {
    WorldSpec { node_pools: 2, replicas_per_workload: 2, decoys: 1, ..crate::common::e2e::small_world(prefix, nodes) }
}

/// How to invoke the binary beyond `<subcommand> --cluster --region --kubeconfig --report`.
#[derive(Default)]
pub struct Invocation<'a> {
    pub args: Vec<&'a str>,
    pub env: Vec<(&'a str, String)>,
    pub env_remove: Vec<&'a str>,
}

/// The command, ready to spawn: `run`/`verify` against the bed, with LocalStack's environment.
pub fn command(b: &Bed, sub: &str, cluster: &str, inv: &Invocation<'_>) -> tokio::process::Command {
    let report = b.dir.path().join(format!("report-{sub}.json"));
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args([sub, "--cluster", cluster, "--region", REGION]);
    // a test passing its own --kubeconfig (bad input) replaces the bed's
    if sub == "run" && !inv.args.contains(&"--kubeconfig") {
        cmd.arg("--kubeconfig").arg(&b.kubeconfig);
    }
    cmd.arg("--report").arg(&report).args(&inv.args).envs(common::localstack_env());
    // held to deploy/iam-policy.json by the shared EC2 proxy (a test pointing the tool at a proxy
    // of its own through `inv.env` is not judged there)
    cmd.env("AWS_ACCESS_KEY_ID", common::judged_key(cluster, REGION));
    cmd.env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    for (k, v) in &inv.env {
        cmd.env(k, v);
    }
    for k in &inv.env_remove {
        cmd.env_remove(k);
    }
    cmd.kill_on_drop(true);
    cmd
}

pub fn report_path(b: &Bed, sub: &str) -> PathBuf {
    b.dir.path().join(format!("report-{sub}.json"))
}

pub fn read_report(b: &Bed, sub: &str) -> Value {
    std::fs::read(report_path(b, sub)).ok().and_then(|r| serde_json::from_slice(&r).ok()).unwrap_or(Value::Null)
}

/// Runs the binary to the end.
pub async fn tool(b: &Bed, sub: &str, cluster: &str, inv: &Invocation<'_>) -> Run {
    let mut cmd = command(b, sub, cluster, inv);
    if std::env::var_os("KT_TEST_LOGS").is_some() {
        cmd.stderr(std::process::Stdio::inherit());
    }
    let out = cmd.output().await.unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
        report: read_report(b, sub),
    }
}

/// True when the report's blockers name `name` (as a blocker's name or in its reason).
pub fn blockers_name(report: &Value, name: &str) -> bool {
    report["blockers"].as_array().is_some_and(|bs| {
        bs.iter().any(|b| b["name"] == name || b["reason"].as_str().is_some_and(|r| r.contains(name)))
    })
}
