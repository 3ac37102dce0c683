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

#[test]
fn launch_py_speeds_up_describe_instances_without_changing_its_answers() {
    let state = localstack_state();
    let mode = std::fs::read_to_string(state.join("mode")).unwrap_or_default();
    if mode.trim() == "docker" {
        // the image runs LocalStack as released: launch.py and its patches are not in it
        eprintln!("LocalStack runs from its Docker image here; launch.py's patches are not in use");
        return;
    }
    let python = state.join("venv/bin/python");
    assert!(python.exists(), "no LocalStack virtualenv at {}: run localstack/up first", python.display());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("localstack/check_launch.py");
    let out = Command::new(&python)
        .arg(&script)
        // in-process and without a server: nothing of the running LocalStack is touched
        .env("SERVICES", "ec2,iam,sts")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LOCALSTACK_TELEMETRY", "0")
        .output()
        .expect("run LocalStack's python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // every comparison ran: six queries of seven checks, one asking for JSON of four, two more
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok ")).count(), 6 * 7 + 4 + 2, "{stdout}");
}
