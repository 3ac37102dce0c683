//! The emulator's own patches (`localstack/launch.py`): faster, and the same answers.

use std::path::PathBuf;
use std::process::Command;

/// `localstack/up` keeps its state, the virtualenv included, where `LOCALSTACK_STATE_DIR` says.
fn localstack_state() -> PathBuf {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    match std::env::var_os("LOCALSTACK_STATE_DIR") {
        Some(dir) => repo.join(dir),
        None => repo.join("localstack/.state"),
    }
}

/// Runs one of `localstack/`'s checks in LocalStack's virtualenv, in-process and without a
/// server (nothing of the running LocalStack is touched); its standard output, once it passed.
fn run_check(state: &std::path::Path, script: &str, env: &[(&str, &str)]) -> String {
    let python = state.join("venv/bin/python");
    assert!(python.exists(), "no LocalStack virtualenv at {}: run localstack/up first", python.display());
    let out = Command::new(&python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("localstack").join(script))
        .envs(env.iter().copied())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LOCALSTACK_TELEMETRY", "0")
        .output()
        .expect("run LocalStack's python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

#[test]
fn launch_py_speeds_up_describe_instances_without_changing_its_answers() {
    let state = localstack_state();
    let mode = std::fs::read_to_string(state.join("mode")).unwrap_or_default();
    if mode.trim() == "docker" {
        // the image runs LocalStack as released: launch.py and its patches are not in it
        eprintln!("LocalStack runs from its Docker image here; launch.py's patches are not in use");
        return;
    }
    let stdout = run_check(&state, "check_launch.py", &[("SERVICES", "ec2,iam,sts")]);
    // every comparison ran: six queries of seven checks, one asking for JSON of four, two more
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 6 * 7 + 4 + 2, "{stdout}");
}

#[test]
fn launch_py_serves_eks_elb_and_elbv2_through_moto_and_eks_with_the_test_beds_endpoint_and_authority() {
    // the script reads SERVICES from localstack/up itself; every check ran: the scripts, three
    // services without and with launch.py, 21 of EKS, 14 of ELBv2 and ELB, 3 after
    let stdout = run_check(&localstack_state(), "check_eks.py", &[]);
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 1 + 6 + 21 + 14 + 3, "{stdout}");
}
