//! The README's CI teardown step, checked by actionlint as the job of a workflow.

use std::path::Path;

const SECTION: &str = "### CI teardown step";

/// actionlint on `workflow`, written where GitHub reads workflows.
fn actionlint(dir: &Path, workflow: &str) -> tfbed::Output {
    let tools = crate::tools();
    let workflows = dir.join(".github/workflows");
    std::fs::create_dir_all(&workflows).unwrap();
    let file = workflows.join("teardown.yml");
    std::fs::write(&file, workflow).unwrap();
    let out = std::process::Command::new(&tools.actionlint)
        .arg("-no-color")
        .arg(&file)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", tools.actionlint.display()));
    tfbed::Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

#[test]
fn the_readme_ci_step_passes_actionlint() {
    let snippet = tfbed::fenced_block(&crate::readme(), SECTION, "yaml").unwrap_or_else(|e| panic!("{e}"));
    let workflow = tfbed::ci_workflow(&snippet);
    let dir = tempfile::tempdir().unwrap();
    let out = actionlint(dir.path(), &workflow);
    assert_eq!(out.code, 0, "actionlint on the README's CI step (as one job):\n{workflow}\n{}", out.all());

    // The same check finds a mistake in that step: an input configure-aws-credentials does not
    // have (actionlint knows the inputs of popular actions)
    let broken = workflow.replace("aws-region:", "aws_region:");
    assert_ne!(broken, workflow, "the step no longer sets aws-region");
    let out = actionlint(dir.path(), &broken);
    assert_eq!(out.code, 1, "{}", out.all());
    assert!(out.stdout.contains("aws_region"), "{}", out.all());
}
