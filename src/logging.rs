//! Structured logs: human text on a terminal, plain text or JSON lines without one, never
//! colour or cursor codes when stderr is not a terminal (CI logs, Terraform output). On a
//! terminal with text logs, the live progress view ([`crate::progress`]) is drawn below the log
//! lines, which are then warnings and errors only; they are written with the view suspended so
//! the two never mix.

use std::io::{IsTerminal, Write};

use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{EnvFilter, Registry};

use crate::cli::LogFormat;
use crate::progress::Progress;

/// Installs the global subscriber writing to stderr. A bad filter falls back to `info` with a
/// warning instead of failing the run.
pub fn init(format: LogFormat, filter: &str) {
    let tty = std::io::stderr().is_terminal();
    init_with(format, filter, tty && format == LogFormat::Text);
}

/// Libraries' log lines that only say ahead of time what the tool's own error then says with the
/// fix (the credential chain's warning per provider that found nothing, kube's line per failed
/// connection), each quieted unless `--log-level` names the crate.
const SAID_BY_OUR_ERRORS: [(&str, &str); 2] =
    [("aws_config", "aws_config::meta::credentials::chain=error"), ("kube_client", "kube_client::client::builder=off")];

/// [`init`] with the progress view chosen by the caller.
pub(crate) fn init_with(format: LogFormat, filter: &str, progress: bool) {
    let mut directives = filter.to_string();
    for (krate, quiet) in SAID_BY_OUR_ERRORS {
        if !filter.contains(krate) {
            directives.push(',');
            directives.push_str(quiet);
        }
    }
    let (filter, bad) = match EnvFilter::try_new(&directives) {
        Ok(f) => (f, None),
        Err(e) => (EnvFilter::new("info"), Some(format!("ignoring --log-level {filter:?}: {e}"))),
    };
    let tty = std::io::stderr().is_terminal();
    let view = progress.then(Progress::stderr);
    let writer = LogWriter { view: view.clone() };
    // under the live view only warnings and errors are printed (above it): the view shows the rest
    let quiet = view.is_some().then(|| Targets::new().with_default(Level::WARN));
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer).with_target(false);
    let fmt_layer = match format {
        LogFormat::Json => {
            fmt.json().flatten_event(true).with_current_span(true).with_span_list(false).with_filter(filter).boxed()
        }
        LogFormat::Text => fmt.with_ansi(tty).with_filter(filter).with_filter(quiet).boxed(),
    };
    // try_init: a second initialisation (tests calling into the CLI twice) is harmless
    let installed = Registry::default().with(fmt_layer).try_init().is_ok();
    if installed && let Some(v) = &view {
        v.install();
    }
    if let Some(msg) = bad {
        tracing::warn!("{msg}");
    }
}

/// Writes log lines to stderr, with the progress view (if any) suspended meanwhile.
#[derive(Clone)]
struct LogWriter {
    view: Option<Progress>,
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &self.view {
            Some(v) => v.suspend(|| std::io::stderr().write(buf)),
            None => std::io::stderr().write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        // one suspension per line, not per partial write
        match &self.view {
            Some(v) => v.suspend(|| std::io::stderr().write_all(buf)),
            None => std::io::stderr().write_all(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}
