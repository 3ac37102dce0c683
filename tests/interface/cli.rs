//! The command-line contract: help text, environment variables, exit codes for bad input.

use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    // a clean environment, so a developer's KARPENTER_TEARDOWN_* or AWS_* cannot leak in
    c.env_clear().env("PATH", std::env::var("PATH").unwrap_or_default()).env("HOME", "/nonexistent");
    c
}

fn run(c: &mut Command) -> (i32, String, String) {
    let Output { status, stdout, stderr } = c.output().expect("the binary runs");
    (status.code().unwrap_or(-1), String::from_utf8_lossy(&stdout).into(), String::from_utf8_lossy(&stderr).into())
}

#[test]
fn help_lists_every_run_flag_with_its_environment_variable() {
    let (code, out, _) = run(bin().args(["run", "--help"]));
    assert_eq!(code, 0);
    for (flag, env) in [
        ("--cluster", "KARPENTER_TEARDOWN_CLUSTER"),
        ("--region", "KARPENTER_TEARDOWN_REGION"),
        ("--plan", "KARPENTER_TEARDOWN_PLAN"),
        ("--kubeconfig", "KARPENTER_TEARDOWN_KUBECONFIG"),
        ("--context", "KARPENTER_TEARDOWN_CONTEXT"),
        ("--yes", "KARPENTER_TEARDOWN_YES"),
        ("--report", "KARPENTER_TEARDOWN_REPORT"),
        ("--drain-deadline", "KARPENTER_TEARDOWN_DRAIN_DEADLINE"),
        ("--on-drain-deadline", "KARPENTER_TEARDOWN_ON_DRAIN_DEADLINE"),
        ("--reclaim", "KARPENTER_TEARDOWN_RECLAIM"),
        ("--max-nodes", "KARPENTER_TEARDOWN_MAX_NODES"),
    ] {
        assert!(out.contains(flag), "run --help lacks {flag}:\n{out}");
        assert!(out.contains(env), "run --help lacks {env}:\n{out}");
    }
    for code in ["0 ", "1 ", "2 ", "3 ", "4 ", "5 ", "130"] {
        assert!(out.contains(&format!("  {code}")), "exit code {code} not documented in run --help");
    }
}

#[test]
fn top_level_help_names_the_commands_and_exit_codes() {
    let (code, out, _) = run(bin().arg("--help"));
    assert_eq!(code, 0);
    for cmd in ["run", "plan", "verify", "sandbox"] {
        assert!(out.contains(cmd), "--help lacks {cmd}");
    }
    assert!(out.contains("Exit codes"), "{out}");
}

#[test]
fn unknown_flag_exits_2_naming_it() {
    let (code, _, err) = run(bin().args(["run", "--cluster", "c", "--region", "eu-west-1", "--frobnicate"]));
    assert_eq!(code, 2);
    assert!(err.contains("--frobnicate"), "{err}");
}

#[test]
fn missing_cluster_exits_2_naming_it() {
    let (code, _, err) = run(bin().args(["run", "--region", "eu-west-1"]));
    assert_eq!(code, 2);
    assert!(err.contains("--cluster"), "{err}");
}

#[test]
fn flags_come_from_the_environment() {
    // the cluster comes from the environment; the bad region proves the value was read and
    // validated before anything was contacted
    let (code, _, err) = run(bin()
        .args(["verify"])
        .env("KARPENTER_TEARDOWN_CLUSTER", "from-env")
        .env("KARPENTER_TEARDOWN_REGION", "nowhere"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--region \"nowhere\""), "{err}");
}

#[test]
fn missing_region_exits_2_with_the_fix() {
    let (code, _, err) = run(bin().args(["verify", "--cluster", "c"]));
    assert_eq!(code, 2);
    assert!(err.contains("--region") && err.contains("AWS_REGION"), "{err}");
}

#[test]
fn bad_drain_deadline_exits_2() {
    let (code, _, err) =
        run(bin().args(["run", "--cluster", "c", "--region", "eu-west-1", "--drain-deadline", "soon"]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--drain-deadline"), "{err}");
}

#[test]
fn unreachable_aws_endpoint_exits_2_naming_it() {
    // nothing listens on port 9 of loopback
    let (code, _, err) = run(bin()
        .args(["verify", "--cluster", "c", "--region", "eu-west-1"])
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_MAX_ATTEMPTS", "1"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("http://127.0.0.1:9") && err.contains("localstack/up"), "{err}");
}

#[test]
fn missing_aws_credentials_exit_2_with_the_fix() {
    let (code, _, err) = run(bin()
        .args(["verify", "--cluster", "c", "--region", "eu-west-1"])
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", "/nonexistent/config")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no AWS credentials") && err.contains("AWS_ACCESS_KEY_ID"), "{err}");
}
