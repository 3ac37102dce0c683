//! The README's Terraform and CI recipes, as a user copies them, run by the real tools: OpenTofu
//! and the hashicorp/kubernetes provider (built from source by `crates/tfbed/build-tools`, the
//! provider installed from a filesystem mirror) against the sandbox API server, the simulated
//! Karpenter and LocalStack, and actionlint on the CI step.

#[path = "../common/mod.rs"]
mod common;

mod ci;
mod field_report;
mod terraform;

use std::path::{Path, PathBuf};

/// The README, read as the user reads it.
fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md")
}

/// The built tools; a failed build fails the test with the way to see Go's error.
fn tools() -> tfbed::Tools {
    tfbed::tools().unwrap_or_else(|e| panic!("{e}"))
}

/// A directory for commands the provisioner finds on PATH: the tool under test as
/// `karpenter-teardown`, as a user installs it. Returns the directory and the PATH to use.
fn bin_dir(dir: &Path) -> (PathBuf, std::ffi::OsString) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_karpenter-teardown"), bin.join("karpenter-teardown")).unwrap();
    let mut paths = vec![bin.clone()];
    paths.extend(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()));
    (bin, std::env::join_paths(paths).unwrap())
}

/// Writes an executable script.
fn write_script(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}
