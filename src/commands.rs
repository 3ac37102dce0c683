//! The subcommands, run from a validated configuration. Each returns the [`Exit`] status; errors
//! are printed here with what to do about them.

use std::collections::BTreeSet;
use std::time::Duration;

use std::io::{BufRead, IsTerminal, Write};

use tokio_util::sync::CancellationToken;

use crate::aws::{AwsClients, AwsError};
use crate::cli::{
    Cli, Command, CompletionShell, CompletionsArgs, PlanArgs, PlanFormat, RunArgs, TfPruneArgs, VerifyArgs,
};
use crate::config::{ConfigError, Consent, KubeTarget, PlanSource, RunConfig, Target};
use crate::engine::context::DrainOverrides;
use crate::engine::events::{EngineEvent, Events};
use crate::engine::{self, RunSettings};
use crate::exit::Exit;
use crate::k8s::{Kube, KubeError};
use crate::plan::{Plan, PlanError, RenderFormat};
use crate::report::Report;
use crate::verify;

/// Any error a command can end with, mapped to its exit code by [`CommandError::exit`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum CommandError {
    /// A flag or environment value is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The AWS side failed.
    #[error(transparent)]
    Aws(#[from] AwsError),
    /// The plan is not valid.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The kubeconfig or the API server is not usable.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// The sandbox could not start.
    #[cfg(feature = "sandbox")]
    #[error(transparent)]
    Sandbox(#[from] sandbox_apiserver::SandboxError),
    /// `tf-prune` could not read the state or ask the cluster.
    #[error(transparent)]
    TfPrune(#[from] crate::tfprune::TfPruneError),
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
    pub(crate) fn exit(&self) -> Exit {
        match self {
            CommandError::Config(_) | CommandError::Plan(_) => Exit::BadInput,
            CommandError::TfPrune(crate::tfprune::TfPruneError::Kube(e)) if e.is_configuration() => Exit::BadInput,
            CommandError::TfPrune(crate::tfprune::TfPruneError::Kube(_)) => Exit::Failure,
            CommandError::TfPrune(_) => Exit::BadInput,
            CommandError::Kube(e) if e.is_configuration() => Exit::BadInput,
            CommandError::Kube(_) => Exit::Failure,
            // a permission the identity lacks is the caller's setup, as in the run's preflight
            CommandError::Aws(e) if e.is_configuration() || e.is_access_denied() => Exit::BadInput,
            CommandError::Aws(AwsError::WrongAccount { .. }) => Exit::Refused,
            CommandError::Aws(_) | CommandError::Report { .. } => Exit::Failure,
            #[cfg(feature = "sandbox")]
            CommandError::Sandbox(_) => Exit::Failure,
        }
    }
}

#[cfg(feature = "sandbox")]
mod rehearse;
#[cfg(feature = "sandbox")]
mod sandbox;
mod sweep;

/// Runs the parsed command line and returns the exit status.
pub async fn execute(cli: Cli) -> Exit {
    match cli.command {
        Command::TfPrune(args) => tf_prune_command(&args).await,
        Command::Completions(args) => completions_command(&args),
        Command::Report(crate::cli::ReportCommand::Timeline(args)) => report_timeline_command(&args),
        Command::Verify(args) => verify_command(&args).await,
        Command::Sweep(args) => sweep::sweep_command(&args).await,
        Command::Run(args) => run_command(&args).await,
        Command::Plan(args) => plan_command(&args),
        #[cfg(feature = "sandbox")]
        Command::Rehearse(args) => rehearse::rehearse_command(&args).await,
        #[cfg(feature = "sandbox")]
        Command::Sandbox(cmd) => sandbox::sandbox_command(cmd).await,
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
    if args.max_nodes == Some(0) {
        return fail(&ConfigError::ZeroMaxNodes.into());
    }
    let min_age = match crate::config::parse_duration("min-age", &args.min_age) {
        Ok(d) => d,
        Err(e) => return fail(&e.into()),
    };
    let (mut report, started) = Report::start("verify", &target.cluster, &target.region, "");
    let consent = if args.yes { Consent::Yes } else { Consent::DryRun };
    let kube = KubeTarget { kubeconfig: args.kubeconfig.clone(), context: args.context.clone() };
    let result = verify_target(&target, consent, &kube, (args.max_nodes, min_age), &mut report).await;
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

/// `limits`: `--max-nodes` and `--min-age`.
async fn verify_target(
    target: &Target,
    consent: Consent,
    kube: &KubeTarget,
    limits: (Option<u32>, Duration),
    report: &mut Report,
) -> Result<Exit, CommandError> {
    let aws = AwsClients::connect(&target.region).await?;
    let result = verify_with(target, consent, kube, limits, report, &aws).await;
    report.api_calls.extend(aws.calls.snapshot());
    result
}

async fn verify_with(
    target: &Target,
    consent: Consent,
    kube: &KubeTarget,
    (max_nodes, min_age): (Option<u32>, Duration),
    report: &mut Report,
    aws: &AwsClients,
) -> Result<Exit, CommandError> {
    if let Some(account) = &target.account {
        aws.check_account(account).await?;
    }
    let mut left = verify::verify(aws, &target.cluster, &BTreeSet::new(), VERIFY_SETTLE, None).await?;
    let mut user_profiles = BTreeSet::new();
    let mut live_classes = BTreeSet::new();
    if target.reclaim && !left.reclaimable().is_empty() {
        // Positive evidence before a removal from AWS alone: the cluster is gone, or its own API
        // shows that nothing runs on what is about to go.
        let seen = cluster_seen(target, kube, aws).await?;
        tracing::info!(cluster = ?seen, "what the cluster says before a reclaim");
        if let Some(refusal) = verify::reclaim_refusal(&left, &seen, &target.cluster, max_nodes) {
            crate::progress::finish();
            eprintln!("error: {refusal}");
            report.error = Some(refusal.to_string());
            report.leftovers = left;
            return Ok(Exit::Refused);
        }
        // EKS no longer has it: `sweep`'s verdict decides, so the two paths cannot drift apart
        if let verify::ClusterSeen::Gone(gone) = &seen {
            let found = sweep::found_in(&left, &target.region);
            let verdict =
                crate::sweep::verdict_of_named(&target.cluster, &target.region, found, sweep::rules_now(min_age));
            if !matches!(verdict, crate::sweep::Verdict::Orphaned(_)) {
                let error = format!(
                    "refusing to reclaim: {gone}, but what is left of it is {} ({}). Nothing was changed",
                    verdict.name(),
                    verdict.why()
                );
                crate::progress::finish();
                eprintln!("error: {error}");
                report.error = Some(error);
                report.leftovers = left;
                return Ok(Exit::Refused);
            }
        }
        if let verify::ClusterSeen::Live(holders) = seen {
            user_profiles = holders.user_profiles;
            live_classes = holders.nodeclasses;
            left = left.without_profiles(&user_profiles);
        }
    }
    // a live cluster's classes still launch with their templates and profiles: reported, kept
    let to_reclaim = left.clone().without_live_classes(&live_classes);
    if !left.is_clean() && target.reclaim && consent == Consent::DryRun {
        tracing::warn!("--reclaim without --yes: listing what would be reclaimed, changing nothing");
        report.would_reclaim = to_reclaim.reclaimable();
    } else if !left.is_clean() && target.reclaim {
        report.reclaimed = to_reclaim.describe();
        let failures = verify::reclaim(aws, &to_reclaim).await?;
        for f in failures {
            tracing::warn!(failure = %f, "could not reclaim");
        }
        left = verify::verify(aws, &target.cluster, &user_profiles, VERIFY_SETTLE, None).await?;
    }
    let clean = left.is_clean();
    report.leftovers = left;
    Ok(if clean { Exit::Clean } else { Exit::Leftovers })
}

/// What EKS and, while the cluster exists, its own API say of it: which instances its Nodes
/// and NodeClaims stand for, and which instance profiles its EC2NodeClasses name. The API is
/// read only once EKS's endpoint or certificate authority proves the kubeconfig reaches it.
async fn cluster_seen(
    target: &Target,
    kube: &KubeTarget,
    aws: &AwsClients,
) -> Result<verify::ClusterSeen, CommandError> {
    use crate::aws::EksLookup;
    use crate::engine::preflight::{Observations, Reached, Target as IdentityTarget, verdict};
    use verify::ClusterSeen;
    let eks = aws.eks.describe_cluster(&target.cluster).await?;
    match &eks {
        EksLookup::NotFound => {
            return Ok(ClusterSeen::Gone(format!("EKS has no cluster {} in {}", target.cluster, target.region)));
        }
        EksLookup::Found(c) if c.is_deleting() => {
            return Ok(ClusterSeen::Gone(format!("EKS is deleting cluster {}", target.cluster)));
        }
        EksLookup::Found(_) => {}
    }
    let kube = match Kube::connect(kube).await {
        Ok(k) => k,
        Err(e) => return Ok(ClusterSeen::Unproven(e.to_string())),
    };
    // only EKS's word counts here: what the cluster says of itself is read after it is proven
    let obs = Observations { context: None, reached: Reached::of(&kube), eks: Some(eks), ..Observations::default() };
    let identity = IdentityTarget { cluster: &target.cluster, region: &target.region, account: None };
    let ev = verdict(&obs, &identity);
    if !ev.contradictions.is_empty() {
        return Ok(ClusterSeen::Unproven(ev.contradictions.join("; ")));
    }
    match crate::engine::inventory::cluster_holders(&kube.client).await {
        Ok(holders) => Ok(ClusterSeen::Live(holders)),
        Err(e) => Ok(ClusterSeen::Unproven(e.to_string())),
    }
}

/// Writes the report file (if asked) and prints the summary; a report that cannot be written
/// turns a clean run into a failure, since CI would otherwise read nothing.
fn finish_report(target: &Target, report: &Report, exit: Exit) -> Exit {
    crate::progress::finish();
    println!("{}", report.summary());
    if let Some(path) = &target.report
        && let Err(source) = report.write(path)
    {
        return exit.worst(fail(&CommandError::Report { path: path.display().to_string(), source }));
    }
    exit
}

fn load_plan(source: &PlanSource) -> Result<Plan, PlanError> {
    match source {
        PlanSource::Builtin(name) => Plan::builtin(name),
        PlanSource::File(path) => Plan::load(path),
    }
}

/// `completions`: the script for the shell on stdout.
fn completions_command(args: &CompletionsArgs) -> Exit {
    use clap::CommandFactory;
    let shell = match args.shell {
        CompletionShell::Bash => clap_complete::Shell::Bash,
        CompletionShell::Zsh => clap_complete::Shell::Zsh,
        CompletionShell::Fish => clap_complete::Shell::Fish,
    };
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "karpenter-teardown", &mut std::io::stdout());
    Exit::Clean
}

/// `report timeline`: the chart on stdout; a file that cannot be read or is not a report is
/// bad input.
fn report_timeline_command(args: &crate::cli::ReportTimelineArgs) -> Exit {
    let path = args.file.display();
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read the report {path}: {e}");
            return Exit::BadInput;
        }
    };
    let chart = serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| {
            format!("{path} is not JSON ({e}): is this a report written by `karpenter-teardown run --report`?")
        })
        .and_then(|v| crate::report::timeline::timeline(&v).map_err(|e| format!("{path}: {e}")));
    match chart {
        Ok(c) => {
            print!("{c}");
            Exit::Clean
        }
        Err(e) => {
            eprintln!("error: {e}");
            Exit::BadInput
        }
    }
}

/// `tf-prune`: prints the advice on stdout; exit 0 whether or not there is something to prune.
async fn tf_prune_command(args: &TfPruneArgs) -> Exit {
    match tf_prune(args).await {
        Ok(text) => {
            print!("{text}");
            Exit::Clean
        }
        Err(e) => fail(&e),
    }
}

async fn tf_prune(args: &TfPruneArgs) -> Result<String, CommandError> {
    use crate::tfprune::{self, TfPruneError};
    let (source_name, text) = if args.state == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .map_err(|e| TfPruneError::Read { source_name: "stdin".into(), detail: e.to_string() })?;
        ("stdin".to_string(), text)
    } else {
        let text = std::fs::read_to_string(&args.state)
            .map_err(|e| TfPruneError::Read { source_name: args.state.clone(), detail: e.to_string() })?;
        (args.state.clone(), text)
    };
    let refs = tfprune::find_refs(&text, &source_name)?;
    if args.assume_gone {
        return Ok(tfprune::render(&refs, &refs, "assumed gone: --assume-gone, no cluster asked"));
    }
    if refs.is_empty() {
        return Ok(tfprune::render(&[], &refs, "no cluster asked"));
    }
    let kube = Kube::connect(&crate::config::KubeTarget {
        kubeconfig: args.kubeconfig.clone(),
        context: args.context.clone(),
    })
    .await?;
    kube.check_reachable().await?;
    let exists = tfprune::exists_in_cluster(&kube.client, &refs).await?;
    let gone: Vec<_> = refs.iter().filter(|r| exists.get(&(r.kind, r.name.clone())) == Some(&false)).cloned().collect();
    let against =
        format!("checked against context {} at {}", kube.context.as_deref().unwrap_or("(current)"), kube.server);
    Ok(tfprune::render(&gone, &refs, &against))
}

fn plan_command(args: &PlanArgs) -> Exit {
    let plan = match load_plan(&PlanSource::from_arg(args.plan.as_deref())) {
        Ok(p) => p,
        Err(e) => return fail(&e.into()),
    };
    let format = match args.format {
        PlanFormat::Text => RenderFormat::Text,
        PlanFormat::Dot => RenderFormat::Dot,
        PlanFormat::Mermaid => RenderFormat::Mermaid,
    };
    print!("{}", plan.render(format));
    Exit::Clean
}

/// Cancels `token` on Ctrl-C or SIGTERM; the returned task is aborted when the run ends.
#[cfg(feature = "sandbox")]
fn watch_signals(token: CancellationToken) -> tokio::task::JoinHandle<()> {
    watch_run_signals(token, None)
}

/// Waits for one Ctrl-C or SIGTERM.
async fn interrupted() {
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// [`watch_signals`] for a teardown: the first signal stops new work and lets in-flight writes
/// finish; a second one ends the process at once with exit 130, naming the tasks that were in
/// flight (each is idempotent: a re-run picks them up from the cluster and EC2).
fn watch_run_signals(token: CancellationToken, in_flight: Option<InFlight>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        interrupted().await;
        tracing::warn!(
            "interrupted: no new work starts; in-flight writes finish; run again to resume (interrupt again to stop at once)"
        );
        token.cancel();
        let Some(in_flight) = in_flight else { return };
        interrupted().await;
        let tasks: Vec<String> = in_flight.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
        crate::progress::finish();
        let what = if tasks.is_empty() { "nothing".to_string() } else { tasks.join(", ") };
        eprintln!(
            "interrupted twice: stopping at once with {} task(s) in flight: {what}. Nothing is left half-done that a re-run \
             does not finish: run the same command again to resume",
            tasks.len()
        );
        std::process::exit(i32::from(Exit::Interrupted.code()));
    })
}

/// The tasks running now, by label, from the engine's events.
type InFlight = std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>;

/// Reads the engine's events: the live view (on a terminal), or without one a line every
/// `every` (`--progress-every`) saying what the run waits for (a CI log shows a long wait as it
/// happens), and what is in flight.
fn consume_events(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
    in_flight: InFlight,
    drain_deadline: std::time::Duration,
    every: std::time::Duration,
) -> tokio::task::JoinHandle<()> {
    let view = crate::progress::active();
    tokio::spawn(async move {
        let mut board = view.is_none().then(crate::progress::Board::default);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => ev,
                    None => break,
                },
                _ = tick.tick() => {
                    if let Some(line) = board.as_ref().and_then(|b| b.waiting_summary(std::time::Instant::now(), drain_deadline)) {
                        tracing::info!(waiting = %line, "still running");
                    }
                    continue;
                }
            };
            if let Some(b) = board.as_mut() {
                b.on_event(&ev, std::time::Instant::now());
            }
            match &ev {
                EngineEvent::TaskStarted(t) => {
                    in_flight.lock().unwrap_or_else(|p| p.into_inner()).insert(t.label());
                }
                EngineEvent::TaskEnded { task, .. } => {
                    in_flight.lock().unwrap_or_else(|p| p.into_inner()).remove(&task.label());
                }
                _ => {}
            }
            if let Some(v) = &view {
                v.on_engine_event(&ev);
            }
        }
    })
}

async fn run_command(args: &RunArgs) -> Exit {
    let config = match RunConfig::from_args(args) {
        Ok(c) => c,
        Err(e) => return fail(&e.into()),
    };
    let plan = match load_plan(&config.plan).and_then(|p| {
        if config.target.reclaim {
            p.check_reclaim()?;
        }
        Ok(p)
    }) {
        Ok(p) => p,
        Err(e) => return fail(&e.into()),
    };
    let target = &config.target;
    let (mut report, started) = Report::start("run", &target.cluster, &target.region, plan.name());
    let mut dry_run = config.consent == Consent::DryRun;
    let result = async {
        let kube = Kube::connect(&config.kube).await?;
        let aws = AwsClients::connect(&target.region).await?;
        let settings = RunSettings {
            cluster: target.cluster.clone(),
            region: target.region.clone(),
            account: target.account.clone(),
            plan: plan.clone(),
            dry_run,
            drain: DrainOverrides {
                deadline: config.drain_deadline,
                policy: config.on_drain_deadline,
                deadline_from_dispatch: false,
            },
            max_nodes: config.max_nodes,
            reclaim: target.reclaim,
            gitops: config.gitops,
            release: config.release.clone(),
            assume_stopped: config.assume_stopped.clone(),
        };
        let cancel = CancellationToken::new();
        let in_flight = InFlight::default();
        let signals = watch_run_signals(cancel.clone(), Some(in_flight.clone()));
        let (events, rx) = Events::channel();
        let drain_deadline = config
            .drain_deadline
            .or_else(|| plan.ordered_steps().find(|s| s.action == crate::plan::Action::Drain)?.params.deadline)
            .unwrap_or(std::time::Duration::from_secs(600));
        let consumer = consume_events(rx, in_flight, drain_deadline, config.progress_every);
        // the report counts every call, Kubernetes and AWS, however the run ends
        let calls = (kube.calls.clone(), aws.calls.clone());
        let mut result = engine::run(kube.clone(), aws.clone(), settings.clone(), cancel.clone(), events.clone()).await;
        if dry_run && result.error.is_none() {
            println!("{}", result.plan_text);
            if confirm_on_terminal(&target.cluster) {
                dry_run = false;
                let settings = RunSettings { dry_run: false, ..settings };
                result = engine::run(kube.clone(), aws, settings, cancel, events.clone()).await;
            } else {
                println!("Dry run: nothing was changed. Run again with --yes to do it.");
            }
        }
        // the engine's senders are gone with its runs: the consumer ends once it has read all
        drop(events);
        let _ = consumer.await;
        signals.abort();
        report.api_calls = calls.0.snapshot();
        report.api_calls.extend(calls.1.snapshot());
        Ok::<_, CommandError>(result)
    }
    .await;
    let exit = match result {
        Ok(r) => {
            if let Some(e) = &r.error {
                crate::progress::finish();
                eprintln!("error: {e}");
            }
            report.steps = r.steps;
            report.blockers = r.blockers;
            report.leftovers = r.leftovers;
            report.reclaimed = r.reclaimed;
            report.pods_rebound = Some(r.pods_rebound);
            report.pods_lost = Some(r.pods_lost);
            report.bypasses = Some(r.bypasses);
            report.error = r.error;
            report.gitops = r.gitops;
            report.not_ours = r.not_ours;
            r.exit
        }
        Err(e) => {
            report.error = Some(e.to_string());
            fail(&e)
        }
    };
    report.finish(started, exit, dry_run);
    finish_report(target, &report, exit)
}

/// On a terminal without `--yes`, asks for the cluster name to be typed; never prompts without
/// a terminal (Terraform, CI), where the dry run is the answer.
fn confirm_on_terminal(cluster: &str) -> bool {
    if !std::io::stdin().is_terminal() || !std::io::stdout().is_terminal() {
        return false;
    }
    print!("Type the cluster name ({cluster}) to tear it down, anything else to stop: ");
    let _ = std::io::stdout().flush();
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line).is_err() {
        return false;
    }
    line.trim() == cluster
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: &str) -> CommandError {
        CommandError::Aws(AwsError::Api {
            service: "eks",
            operation: "DescribeCluster",
            code: code.into(),
            message: "no".into(),
        })
    }

    #[test]
    fn a_missing_aws_permission_is_bad_input_and_other_refusals_are_failures() {
        assert_eq!(api("AccessDeniedException").exit(), Exit::BadInput);
        assert_eq!(api("UnauthorizedOperation").exit(), Exit::BadInput);
        assert_eq!(api("InternalFailure").exit(), Exit::Failure);
    }
}
