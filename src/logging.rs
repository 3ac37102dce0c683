//! Structured logs: human text on a terminal, plain text or JSON lines without one, never
//! colour codes when stderr is not a terminal (CI logs, Terraform output).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Installs the global subscriber writing to stderr. A bad filter falls back to `info` with a
/// warning instead of failing the run.
pub fn init(format: LogFormat, filter: &str) {
    let (filter, bad) = match EnvFilter::try_new(filter) {
        Ok(f) => (f, None),
        Err(e) => (EnvFilter::new("info"), Some(format!("ignoring --log-level {filter:?}: {e}"))),
    };
    let tty = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    // try_init: a second initialisation (tests calling into the CLI twice) is harmless.
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).try_init(),
        LogFormat::Text => builder.with_ansi(tty).try_init(),
    };
    if let Some(msg) = bad {
        tracing::warn!("{msg}");
    }
}
