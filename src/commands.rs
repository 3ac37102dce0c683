//! The subcommands, run from a validated configuration. Each returns the [`Exit`] status; errors
//! are printed here with what to do about them.

use std::time::Duration;

use crate::aws::{AwsClients, AwsError};
use crate::cli::{Cli, Command, VerifyArgs};
use crate::config::{ConfigError, RunConfig, Target};
use crate::exit::Exit;
use crate::report::Report;
use crate::verify;

/// Any error a command can end with, mapped to its exit code by [`CommandError::exit`].
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// A flag or environment value is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The AWS side failed.
    #[error(transparent)]
    Aws(#[from] AwsError),
    /// The report could not be written.
    #[error("cannot write the report to {path}: {source}; check that the directory exists and is writable")]
    Report {
        /// The report path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl CommandError {
    /// The exit code this error stands for.
    pub fn exit(&self) -> Exit {
        match self {
            CommandError::Config(_) => Exit::BadInput,
            CommandError::Aws(e) if e.is_configuration() => Exit::BadInput,
            CommandError::Aws(AwsError::WrongAccount { .. }) => Exit::Refused,
            CommandError::Aws(_) | CommandError::Report { .. } => Exit::Failure,
        }
    }
}

/// Runs the parsed command line and returns the exit status.
pub async fn execute(cli: Cli) -> Exit {
    match cli.command {
        Command::Verify(args) => verify_command(&args).await,
        Command::Run(args) => match RunConfig::from_args(&args) {
            Ok(_) => {
                eprintln!("error: the teardown engine is not in this build yet; only `verify` works");
                Exit::Failure
            }
            Err(e) => fail(&e.into()),
        },
        Command::Plan(_) | Command::Sandbox(_) => {
            eprintln!("error: this command is not in this build yet");
            Exit::Failure
        }
    }
}

fn fail(e: &CommandError) -> Exit {
    eprintln!("error: {e}");
    e.exit()
}

/// How long verification waits between its two reads.
const VERIFY_SETTLE: Duration = Duration::from_secs(5);

async fn verify_command(args: &VerifyArgs) -> Exit {
    let target = match Target::from_args(&args.target) {
        Ok(t) => t,
        Err(e) => return fail(&e.into()),
    };
    let (mut report, started) = Report::start("verify", &target.cluster, &target.region, "");
    let result = verify_target(&target, &mut report).await;
    let exit = match &result {
        Ok(exit) => *exit,
        Err(e) => {
            report.error = Some(e.to_string());
            fail(e)
        }
    };
    report.finish(started, exit, false);
    finish_report(&target, &report, exit)
}

async fn verify_target(target: &Target, report: &mut Report) -> Result<Exit, CommandError> {
    let aws = AwsClients::connect(&target.region).await?;
    if let Some(account) = &target.account {
        aws.check_account(account).await?;
    }
    let mut left = verify::verify(&aws, &target.cluster, VERIFY_SETTLE).await?;
    if !left.is_clean() && target.reclaim {
        report.reclaimed = left.describe();
        let failures = verify::reclaim(&aws, &left).await?;
        for f in failures {
            tracing::warn!(failure = %f, "could not reclaim");
        }
        left = verify::verify(&aws, &target.cluster, VERIFY_SETTLE).await?;
    }
    let clean = left.is_clean();
    report.leftovers = left;
    Ok(if clean { Exit::Clean } else { Exit::Leftovers })
}

/// Writes the report file (if asked) and prints the summary; a report that cannot be written
/// turns a clean run into a failure, since CI would otherwise read nothing.
fn finish_report(target: &Target, report: &Report, exit: Exit) -> Exit {
    println!("{}", report.summary());
    if let Some(path) = &target.report
        && let Err(source) = report.write(path)
    {
        return exit.worst(fail(&CommandError::Report { path: path.display().to_string(), source }));
    }
    exit
}
