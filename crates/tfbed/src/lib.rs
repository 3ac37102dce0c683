//! The test bed of the Terraform and CI recipes: OpenTofu, the hashicorp/kubernetes provider and
//! actionlint built from source (`go/`, by the `build-tools` script), the recipes taken from the
//! README as a user copies them, and OpenTofu run on them with providers from a filesystem mirror
//! only (no registry is ever asked).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Why a tool could not be built or run, or a recipe not found; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum TfbedError {
    /// `build-tools` could not run Go.
    #[error(
        "Go is not installed (or not on PATH): the recipe tests build OpenTofu, the kubernetes provider and actionlint from source with Go 1.26.6 or later; install Go (https://go.dev/doc/install) and run the tests again"
    )]
    GoMissing,
    /// `build-tools` ran and failed.
    #[error(
        "building OpenTofu, the kubernetes provider or actionlint failed ({status}): run `crates/tfbed/build-tools` to see the Go error (it needs the Go module proxy, or GOMODCACHE holding the modules of crates/tfbed/go/*/go.sum)"
    )]
    Build {
        /// The script's exit status, or why it did not run.
        status: String,
    },
    /// A tool could not be started.
    #[error("cannot run {what}: {source}")]
    Io {
        /// What was being run.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The Markdown section the recipe lives in is not there.
    #[error(
        "no line `{heading}` in the Markdown: the recipe tests read the recipe from that section; if it was renamed, rename it in the test too"
    )]
    NoSection {
        /// The heading line looked for.
        heading: String,
    },
    /// The section holds no fenced block of the language, or more than one.
    #[error(
        "the section `{heading}` holds {found} ```{lang} blocks, the recipe tests need exactly one (the recipe a user copies)"
    )]
    Blocks {
        /// The section's heading line.
        heading: String,
        /// The fence's language.
        lang: String,
        /// How many there are.
        found: usize,
    },
    /// A reference the test replaces is not in the recipe.
    #[error(
        "the recipe no longer refers to `{reference}`: the test stands in for it with a resource it can run; update the test's list of stand-ins"
    )]
    NoReference {
        /// The reference looked for.
        reference: String,
    },
}

/// The built tools and the provider installation OpenTofu is given.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The `tofu` binary.
    pub tofu: PathBuf,
    /// The `actionlint` binary.
    pub actionlint: PathBuf,
    /// The OpenTofu CLI configuration (`TF_CLI_CONFIG_FILE`): providers from the mirror only.
    pub cli_config: PathBuf,
}

/// The `build-tools` script.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("build-tools")
}

/// The tools, built by `build-tools` the first time a process asks (the script is a no-op when
/// they are current, so a test binary pays only one check).
pub fn tools() -> Result<Tools, TfbedError> {
    static BUILT: OnceLock<Result<Tools, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| build().map_err(|e| e.to_string()));
    built.clone().map_err(|e| match e {
        // kept as text (TfbedError holds io::Errors, which are not Clone): the first caller saw
        // the typed error, later callers get the same message back
        msg if msg.starts_with("Go is not installed") => TfbedError::GoMissing,
        msg => TfbedError::Build { status: msg },
    })
}

fn build() -> Result<Tools, TfbedError> {
    let script = build_script();
    let status = Command::new("bash")
        .arg(&script)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .map_err(|source| TfbedError::Io { what: script.display().to_string(), source })?;
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("go/bin");
    match status.code() {
        Some(0) => {
            Ok(Tools { tofu: bin.join("tofu"), actionlint: bin.join("actionlint"), cli_config: bin.join("tofurc") })
        }
        // the script's own exit code when `go` is not on PATH
        Some(127) => Err(TfbedError::GoMissing),
        _ => Err(TfbedError::Build { status: status.to_string() }),
    }
}

/// The one fenced block of language `lang` in the section of `markdown` that starts at the line
/// `heading` (e.g. `### Terraform`) and ends at the next heading of the same or a higher level.
/// Lines inside fences never count as headings (a `#` comment in a shell block is not one).
pub fn fenced_block(markdown: &str, heading: &str, lang: &str) -> Result<String, TfbedError> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = markdown.lines().skip_while(|l| l.trim_end() != heading);
    if lines.next().is_none() {
        return Err(TfbedError::NoSection { heading: heading.into() });
    }
    let mut blocks = Vec::new();
    let mut open: Option<(String, Vec<&str>)> = None;
    for line in lines {
        match open.as_mut() {
            Some((info, body)) => {
                if line.trim_start().starts_with("```") && line.trim() == "```" {
                    if info == lang {
                        blocks.push(body.join("\n") + "\n");
                    }
                    open = None;
                } else {
                    body.push(line);
                }
            }
            None => {
                if let Some(info) = line.trim_start().strip_prefix("```") {
                    let info = info.split_whitespace().next().unwrap_or("").to_string();
                    open = Some((info, Vec::new()));
                    continue;
                }
                let hashes = line.chars().take_while(|c| *c == '#').count();
                if hashes > 0 && hashes <= level && line[hashes..].starts_with(' ') {
                    break;
                }
            }
        }
    }
    match blocks.len() {
        1 => Ok(blocks.remove(0)),
        found => Err(TfbedError::Blocks { heading: heading.into(), lang: lang.into(), found }),
    }
}

/// A complete workflow around a CI step snippet whose keys are a job's (`permissions`, `steps`),
/// as a user pastes it under a job of their own: one `workflow_dispatch` job on `ubuntu-latest`.
pub fn ci_workflow(job_snippet: &str) -> String {
    let mut out =
        String::from("name: teardown\non: workflow_dispatch\njobs:\n  teardown:\n    runs-on: ubuntu-latest\n");
    for line in job_snippet.lines() {
        if !line.trim().is_empty() {
            out.push_str("    ");
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// `hcl` with every reference `from` replaced by `to`, for each pair: a reference is `from` not
/// preceded or followed by a character that would make it part of a longer name. Each `from` must
/// occur, so a recipe that drops or renames one fails the test instead of going untested.
pub fn replace_references(hcl: &str, replacements: &[(&str, &str)]) -> Result<String, TfbedError> {
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
    let mut text = hcl.to_string();
    for (from, to) in replacements {
        let mut out = String::with_capacity(text.len());
        let mut rest = text.as_str();
        let mut found = false;
        while let Some(at) = rest.find(from) {
            let before = rest[..at].chars().next_back().or_else(|| out.chars().next_back());
            let after = rest[at + from.len()..].chars().next();
            out.push_str(&rest[..at]);
            if before.is_some_and(name_char) || after.is_some_and(name_char) {
                out.push_str(from);
            } else {
                out.push_str(to);
                found = true;
            }
            rest = &rest[at + from.len()..];
        }
        out.push_str(rest);
        if !found {
            return Err(TfbedError::NoReference { reference: (*from).into() });
        }
        text = out;
    }
    Ok(text)
}

/// What one command printed and how it ended.
#[derive(Debug, Clone)]
pub struct Output {
    /// The exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Output {
    /// Both streams, for assertion messages and searching what a user sees.
    pub fn all(&self) -> String {
        format!("exit {}\nstdout:\n{}\nstderr:\n{}", self.code, self.stdout, self.stderr)
    }
}

/// OpenTofu in one configuration directory, with providers from the mirror only.
#[derive(Debug, Clone)]
pub struct Tofu {
    bin: PathBuf,
    dir: PathBuf,
    env: Vec<(OsString, OsString)>,
}

impl Tofu {
    /// `tofu` working in `dir`, configured by `tools`' CLI configuration.
    pub fn new(tools: &Tools, dir: &Path) -> Tofu {
        let env = vec![
            ("TF_CLI_CONFIG_FILE".into(), tools.cli_config.clone().into_os_string()),
            // no prompts, and output worded for automation
            ("TF_INPUT".into(), "0".into()),
            ("TF_IN_AUTOMATION".into(), "1".into()),
            // no upgrade check against the network
            ("CHECKPOINT_DISABLE".into(), "1".into()),
        ];
        Tofu { bin: tools.tofu.clone(), dir: dir.to_path_buf(), env }
    }

    /// Adds an environment variable for every later command (the destroy-time provisioner
    /// inherits OpenTofu's environment).
    pub fn env(&mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> &mut Tofu {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The configuration directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `tofu ARGS -no-color` to its end. `KUBECONFIG` and the `TF_*` variables of the test's
    /// own environment are not passed on: the configuration says what it uses.
    pub async fn run(&self, args: &[&str]) -> Result<Output, TfbedError> {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.current_dir(&self.dir).args(args).arg("-no-color");
        for (k, _) in std::env::vars_os() {
            let name = k.to_string_lossy();
            if name == "KUBECONFIG" || name.starts_with("TF_") || name.starts_with("KARPENTER_TEARDOWN_") {
                cmd.env_remove(&k);
            }
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let out = cmd
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|source| TfbedError::Io { what: format!("{} {}", self.bin.display(), args.join(" ")), source })?;
        Ok(Output {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into(),
            stderr: String::from_utf8_lossy(&out.stderr).into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "# Title\n\n## Use\n\n### Terraform\n\nText.\n\n```hcl\nresource \"a\" \"b\" {\n  # a comment\n}\n```\n\n```sh\n# not a heading\ntofu destroy\n```\n\n#### A subsection\n\n```yaml\nx: 1\n```\n\n### CI\n\n```yaml\nsteps: []\n```\n";

    #[test]
    fn the_block_of_the_section_is_found_and_later_sections_are_not_searched() {
        assert_eq!(fenced_block(DOC, "### Terraform", "hcl").unwrap(), "resource \"a\" \"b\" {\n  # a comment\n}\n");
        // the subsection belongs to the section; the next `###` ends it
        assert_eq!(fenced_block(DOC, "### Terraform", "yaml").unwrap(), "x: 1\n");
        assert_eq!(fenced_block(DOC, "### CI", "yaml").unwrap(), "steps: []\n");
    }

    #[test]
    fn a_missing_section_or_block_and_two_blocks_are_errors() {
        assert!(matches!(fenced_block(DOC, "### Helm", "hcl"), Err(TfbedError::NoSection { .. })));
        assert!(matches!(fenced_block(DOC, "### CI", "hcl"), Err(TfbedError::Blocks { found: 0, .. })));
        let two = format!("{DOC}\n```yaml\ny: 2\n```\n");
        assert!(matches!(fenced_block(&two, "### CI", "yaml"), Err(TfbedError::Blocks { found: 2, .. })));
    }

    #[test]
    fn a_hash_line_inside_a_fence_does_not_end_the_section() {
        let doc = "### Terraform\n\n```sh\n## not a heading\n```\n\n```hcl\nx = 1\n```\n";
        assert_eq!(fenced_block(doc, "### Terraform", "hcl").unwrap(), "x = 1\n");
    }

    #[test]
    fn the_ci_snippet_becomes_the_keys_of_one_job() {
        let wf = ci_workflow("permissions:\n  contents: read\n\nsteps:\n  - run: true\n");
        assert_eq!(
            wf,
            "name: teardown\non: workflow_dispatch\njobs:\n  teardown:\n    runs-on: ubuntu-latest\n    permissions:\n      contents: read\n\n    steps:\n      - run: true\n"
        );
    }

    #[test]
    fn only_whole_references_are_replaced() {
        let hcl =
            "depends_on = [\n  module.eks,\n  module.eks_addons,\n  x.module.eks,\n  helm_release.karpenter,\n]\n";
        let out = replace_references(
            hcl,
            &[("module.eks", "module.stand_in"), ("helm_release.karpenter", "terraform_data.h")],
        )
        .unwrap();
        assert_eq!(
            out,
            "depends_on = [\n  module.stand_in,\n  module.eks_addons,\n  x.module.eks,\n  terraform_data.h,\n]\n"
        );
    }

    #[test]
    fn a_reference_the_recipe_lost_is_an_error() {
        let err = replace_references("depends_on = [module.eks_addons]", &[("module.eks", "x")]).unwrap_err();
        assert!(matches!(err, TfbedError::NoReference { .. }), "{err}");
    }
}
