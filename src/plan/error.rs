//! Errors of loading and validating a plan. Every message names the file, the 1-based line and
//! column, the problem and how to fix it, in the `file:line:col: message` shape editors and CI
//! logs turn into links. The CLI maps every [`PlanError`] to exit code 2 (bad input).

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

use super::{Action, ParamKey};

/// Where in a plan file something is: the file's name as the user gave it, 1-based line and column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The file name as given to [`crate::plan::Plan::load`], or the source name given to
    /// [`crate::plan::Plan::from_str`] (`builtin:default` for the compiled-in plans).
    pub source: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, counted in characters, not bytes.
    pub column: usize,
}

impl Location {
    /// The location of byte `offset` of `text`. An offset past the end or inside a multi-byte
    /// character is clamped, so a slightly off span from a parser still gives a usable location.
    pub fn at(source: &str, text: &str, offset: usize) -> Location {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &text[..offset];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Location {
            source: source.to_owned(),
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
        }
    }

    /// The location of the start of `span`.
    pub fn of_span(source: &str, text: &str, span: Range<usize>) -> Location {
        Location::at(source, text, span.start)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.source, self.line, self.column)
    }
}

/// Why a plan could not be loaded. Each variant carries what its message needs; the message says
/// what to change. Lists of valid choices are derived from [`Action::spec`] when displayed, so
/// they cannot drift from what the parser accepts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The plan file could not be read.
    #[error("{}: cannot read the plan file: {source}; check the path given with --plan", path.display())]
    Read {
        /// The path as given.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },

    /// `Plan::builtin` was asked for a plan that is not compiled in.
    #[error("there is no built-in plan named {name:?}; built-in plans: {known}; or give a file path")]
    UnknownBuiltin {
        /// The name asked for.
        name: String,
        /// The built-in plans, comma-separated.
        known: String,
    },

    /// The text is not valid TOML, or a value has the wrong TOML type.
    #[error("{at}: invalid plan: {message}; see plans/default.toml for a valid plan")]
    Syntax {
        /// Where the TOML parser stopped.
        at: Location,
        /// The TOML parser's message.
        message: String,
    },

    /// A key that the plan format does not have (`deny_unknown_fields`).
    #[error(
        "{at}: unknown key {key:?}{within}{}; {expected}; remove or rename it",
        // The parser lists the valid keys in backticks: every odd piece is one.
        did_you_mean(key, expected.split('`').skip(1).step_by(2))
    )]
    UnknownKey {
        /// Where the key is.
        at: Location,
        /// The key as written.
        key: String,
        /// Which table it is in: ` in [[step]]` or ` at the top level`.
        within: &'static str,
        /// What the keys could be, as the parser listed them.
        expected: String,
    },

    /// A required key is missing.
    #[error("{at}: missing required key {key:?}{within}; add it (see plans/default.toml)")]
    MissingKey {
        /// The table that lacks the key.
        at: Location,
        /// The missing key.
        key: String,
        /// Which table it is in: ` in [[step]]` or ` at the top level`.
        within: &'static str,
    },

    /// `version` is not one this program understands.
    #[error("{at}: unsupported plan version {found}; this program reads version = 1")]
    UnsupportedVersion {
        /// Where `version` is.
        at: Location,
        /// The version written.
        found: i64,
    },

    /// `name` is empty.
    #[error("{at}: the plan name is empty; give the plan a name, e.g. name = \"default\"")]
    EmptyName {
        /// Where `name` is.
        at: Location,
    },

    /// With `--reclaim`, a verify step that does not run after a drain.
    #[error(
        "{source_name}: step {step:?} (verify) would reclaim with --reclaim without running after a drain: \
         it would terminate instances under nodes that may still run pods. Add a drain step to its `after` \
         chain (see plans/default.toml), or run without --reclaim"
    )]
    ReclaimBeforeDrain {
        /// Source name.
        source_name: String,
        /// The verify step's id.
        step: String,
    },
    /// The plan has no `[[step]]` at all.
    #[error("{source_name}: the plan has no steps; add at least one [[step]] table")]
    EmptyPlan {
        /// The file.
        source_name: String,
    },

    /// A step id is not made of lowercase letters, digits and dashes.
    #[error("{at}: invalid step id {id:?}; use only lowercase letters, digits and dashes, e.g. \"drain-nodes\"")]
    InvalidId {
        /// Where the id is.
        at: Location,
        /// The id as written.
        id: String,
    },

    /// Two steps have the same id.
    #[error("{at}: duplicate step id {id:?}, first used on line {first_line}; give each step its own id")]
    DuplicateId {
        /// Where the second use is.
        at: Location,
        /// The id.
        id: String,
        /// The line of the first use.
        first_line: usize,
    },

    /// `action` names no known action.
    #[error(
        "{at}: unknown action {action:?}{}; known actions: {}",
        did_you_mean(action, Action::ALL.map(Action::name)),
        Action::known_names()
    )]
    UnknownAction {
        /// Where the action is.
        at: Location,
        /// The action as written.
        action: String,
    },

    /// `for_each` names no known kind of object.
    #[error("{at}: unknown for_each {value:?}; use one of machine, nodepool, nodeclass")]
    UnknownForEach {
        /// Where the value is.
        at: Location,
        /// The value as written.
        value: String,
    },

    /// `for_each` does not fit the action.
    #[error("{at}: step {step:?}: {problem}")]
    WrongForEach {
        /// Where `for_each` is, or the action when `for_each` is missing.
        at: Location,
        /// The step id.
        step: String,
        /// What is wrong and what to write instead.
        problem: String,
    },

    /// A `[step.params]` key the step's action does not take.
    #[error(
        "{at}: action {:?} does not accept param {param:?}{}; {}",
        action.name(),
        did_you_mean(param, action.spec().params.iter().map(|p| p.name())),
        accepted_params(*action)
    )]
    ParamNotAccepted {
        /// Where the key is.
        at: Location,
        /// The step's action.
        action: Action,
        /// The key as written.
        param: String,
    },

    /// A param value of the wrong TOML type.
    #[error("{at}: param {:?} must be {expected}, not {found}", param.name())]
    ParamType {
        /// Where the value is.
        at: Location,
        /// The param.
        param: ParamKey,
        /// What it must be, with an example.
        expected: &'static str,
        /// The TOML type and value found.
        found: String,
    },

    /// A duration that humantime cannot parse, or a deadline of zero.
    #[error(
        "{at}: param {:?}: invalid duration {value:?} ({reason}); write it like \"90s\", \"10m\" or \"1h 30m\"",
        param.name()
    )]
    BadDuration {
        /// Where the value is.
        at: Location,
        /// The param.
        param: ParamKey,
        /// The value as written.
        value: String,
        /// Why it was rejected.
        reason: String,
    },

    /// `on_deadline` names a choice the action does not have.
    #[error(
        "{at}: action {:?} cannot do on_deadline = {value:?}; choose one of {}",
        action.name(),
        action.spec().on_deadline.iter().map(|o| o.name()).collect::<Vec<_>>().join(", ")
    )]
    BadOnDeadline {
        /// Where the value is.
        at: Location,
        /// The step's action.
        action: Action,
        /// The value as written.
        value: String,
    },

    /// `concurrency` is zero or negative.
    #[error(
        "{at}: concurrency must be a positive integer, not {value}; {value} tasks at once would never run anything, use 1 to run one at a time"
    )]
    BadConcurrency {
        /// Where the value is.
        at: Location,
        /// The value written.
        value: i64,
    },

    /// `after` names a step that does not exist.
    #[error(
        "{at}: step {step:?} runs after {missing:?}, but there is no step with that id{}; known steps: {}",
        did_you_mean(missing, known.iter().map(String::as_str)),
        known.join(", ")
    )]
    UnknownDependency {
        /// Where the `after` entry is.
        at: Location,
        /// The step whose `after` it is.
        step: String,
        /// The id that names nothing.
        missing: String,
        /// Every step id, in file order.
        known: Vec<String>,
    },

    /// Steps wait on each other in a circle, so none of them could ever start.
    #[error(
        "{at}: steps wait on each other in a cycle: {} (each runs after the one before it); remove one of these `after` entries",
        cycle.join(" -> ")
    )]
    Cycle {
        /// Where the `after` entry that closes the cycle is.
        at: Location,
        /// The steps in run order, with the first repeated at the end.
        cycle: Vec<String>,
    },
}

impl PlanError {
    /// Where in the plan the problem is, when it is in the plan text.
    pub fn location(&self) -> Option<&Location> {
        match self {
            PlanError::Read { .. }
            | PlanError::UnknownBuiltin { .. }
            | PlanError::EmptyPlan { .. }
            | PlanError::ReclaimBeforeDrain { .. } => None,
            PlanError::Syntax { at, .. }
            | PlanError::UnknownKey { at, .. }
            | PlanError::MissingKey { at, .. }
            | PlanError::UnsupportedVersion { at, .. }
            | PlanError::EmptyName { at }
            | PlanError::InvalidId { at, .. }
            | PlanError::DuplicateId { at, .. }
            | PlanError::UnknownAction { at, .. }
            | PlanError::UnknownForEach { at, .. }
            | PlanError::WrongForEach { at, .. }
            | PlanError::ParamNotAccepted { at, .. }
            | PlanError::ParamType { at, .. }
            | PlanError::BadDuration { at, .. }
            | PlanError::BadOnDeadline { at, .. }
            | PlanError::BadConcurrency { at, .. }
            | PlanError::UnknownDependency { at, .. }
            | PlanError::Cycle { at, .. } => Some(at),
        }
    }

    /// Turns a TOML deserialisation error into the matching variant, with its location.
    pub(crate) fn from_toml(err: &toml::de::Error, text: &str, source: &str) -> PlanError {
        let span = err.span().unwrap_or(0..0);
        let at = Location::at(source, text, span.start);
        let message = err.message().trim();
        if let Some((key, tail)) = message.strip_prefix("unknown field `").and_then(|r| r.split_once('`')) {
            let expected = tail.trim_start_matches(',').trim();
            return PlanError::UnknownKey {
                // Only two tables are checked by serde (params are checked by hand), and only
                // the step table has an `action` key.
                within: if expected.contains("`action`") { " in [[step]]" } else { " at the top level" },
                expected: if expected.is_empty() { "this table takes no keys".to_owned() } else { expected.to_owned() },
                at,
                key: key.to_owned(),
            };
        }
        if let Some((key, _)) = message.strip_prefix("missing field `").and_then(|r| r.split_once('`')) {
            return PlanError::MissingKey {
                within: if matches!(key, "id" | "action") { " in [[step]]" } else { " at the top level" },
                at,
                key: key.to_owned(),
            };
        }
        let mut message = message.to_owned();
        if text.get(span.start..).is_some_and(|rest| rest.starts_with("[step]")) {
            // `[step]` instead of `[[step]]` is the likeliest way to get a map where steps go.
            message.push_str(" (write each step as [[step]], with double brackets)");
        }
        PlanError::Syntax { at, message }
    }
}

/// What a step's `[step.params]` may hold, as advice for a rejected key.
fn accepted_params(action: Action) -> String {
    let params = action.spec().params;
    if params.is_empty() {
        return "it takes no params; remove [step.params]".to_owned();
    }
    let names: Vec<&str> = params.iter().map(|p| p.name()).collect();
    format!("it accepts: {}", names.join(", "))
}

/// `; did you mean "x"?` when one of `candidates` is within two edits of `word`, else empty.
pub(crate) fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| format!("; did you mean {c:?}?"))
        .unwrap_or_default()
}

/// Levenshtein distance, counting a swap of two neighbours as one edit (so "drian" is one edit
/// from "drain", the typo people actually make).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_counts_lines_and_characters() {
        let text = "a = 1\nbé = \"x\"\n";
        let at = Location::at("f.toml", text, text.find('"').unwrap_or(0));
        assert_eq!((at.line, at.column), (2, 6));
        assert_eq!(Location::at("f.toml", text, 0).to_string(), "f.toml:1:1");
        // Past the end and inside a multi-byte character are clamped, not a panic.
        assert_eq!(Location::at("f.toml", text, 999).line, 3);
        assert_eq!(Location::at("f.toml", text, 8).column, 2);
    }

    #[test]
    fn suggestions_catch_swaps_and_small_typos_only() {
        assert_eq!(did_you_mean("drian", ["fence", "drain"]), "; did you mean \"drain\"?");
        assert_eq!(did_you_mean("deadlin", ["deadline", "settle"]), "; did you mean \"deadline\"?");
        assert_eq!(did_you_mean("explode", ["fence", "drain"]), "");
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
