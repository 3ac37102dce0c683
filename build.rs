//! Build script: the commit `--version` prints, as `KARPENTER_TEARDOWN_COMMIT`.
//!
//! In order: the environment variable `KARPENTER_TEARDOWN_COMMIT` (for a packager building from a
//! source tarball), then `git rev-parse` when this package is the top of a git work tree, else
//! `unknown`. Never fails: a tarball without `.git`, a missing `git` or a repository git refuses to
//! read all give `unknown`.

use std::path::{Path, PathBuf};
use std::process::Command;

const VAR: &str = "KARPENTER_TEARDOWN_COMMIT";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed={VAR}");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = match std::env::var(VAR) {
        Ok(given) if !given.trim().is_empty() => given.trim().to_string(),
        _ => from_git(&dir).unwrap_or_else(|| "unknown".to_string()),
    };
    println!("cargo:rustc-env={VAR}={commit}");
}

/// The short commit of HEAD, when `dir` is the top of a git work tree (not a tarball unpacked
/// inside some other repository); also asks Cargo to run this again when HEAD moves.
fn from_git(dir: &Path) -> Option<String> {
    let top = git(dir, &["rev-parse", "--show-toplevel"])?;
    let same = |a: &Path, b: &Path| a.canonicalize().ok().zip(b.canonicalize().ok()).is_some_and(|(a, b)| a == b);
    if !same(Path::new(&top), dir) {
        return None;
    }
    let commit = git(dir, &["rev-parse", "--short=12", "HEAD"])?;
    // HEAD, the branch it names (a commit moves it) and packed-refs (where `git gc` moves it)
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    watched.extend(git(dir, &["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        if let Some(path) = git(dir, &["rev-parse", "--git-path", &name]) {
            let path = dir.join(path);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    Some(commit)
}

/// `git ARGS` in `dir`: its trimmed output, or nothing when git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(dir).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}
