//! `rehearse`: snapshot the live cluster (read-only), play the plan on a copy of it, report the
//! prediction. Built only with the `sandbox` feature, whose API server and simulated Karpenter
//! hold the copy.

use std::fmt::Write as _;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{fail, load_plan, watch_signals};
use crate::aws::AwsClients;
use crate::cli::RehearseArgs;
use crate::cli::TargetArgs;
use crate::config::{KubeTarget, Target, TeardownConfig};
use crate::engine::context::DrainOverrides;
use crate::exit::Exit;
use crate::k8s::Kube;
use crate::rehearse::{PermissionsSeen, Prediction, Rehearsal, RehearsalSettings, RehearseError};
use crate::report::Report;
use crate::snapshot::{Snapshot, SnapshotError};

/// Runs `rehearse`.
pub(super) async fn rehearse_command(args: &RehearseArgs) -> Exit {
    let (teardown, target, localstack) = match validate(args) {
        Ok(v) => v,
        Err(msg) => {
            eprintln!("error: {msg}");
            return Exit::BadInput;
        }
    };
    let plan = match load_plan(&teardown.plan).and_then(|p| {
        if args.reclaim {
            p.check_reclaim()?;
        }
        Ok(p)
    }) {
        Ok(p) => p,
        Err(e) => return fail(&e.into()),
    };
    let (snap, live) = match snapshot(args, target.as_ref(), &teardown.kube).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return if e.is_configuration() { Exit::BadInput } else { Exit::Failure };
        }
    };
    let (mut report, started) = Report::start("rehearse", &snap.cluster, &snap.region, plan.name());
    if let Some(path) = &args.snapshot_out {
        if let Err(e) = snap.write(path) {
            eprintln!("error: {e}");
            return Exit::Failure;
        }
        println!("rehearse: snapshot written to {}", path.display());
    }
    let summary = snap.summary();
    println!(
        "rehearse: snapshot of {} ({}): {} nodes ({} Karpenter's), {} pods, {} PDBs, {} instances; Karpenter {} with {} ready controller replica(s); read in {:.1}s",
        snap.cluster,
        snap.region,
        summary.nodes,
        summary.karpenter_nodes,
        summary.pods,
        summary.pdbs,
        summary.instances,
        summary.karpenter_version.as_deref().unwrap_or("(version unknown)"),
        summary.controller_ready_replicas,
        summary.seconds
    );
    println!("rehearse: playing plan {} on a copy, clock {}x faster...", plan.name(), (1.0 / args.time_scale).round());
    let settings = RehearsalSettings {
        plan,
        drain: DrainOverrides {
            deadline: teardown.drain_deadline,
            policy: teardown.on_drain_deadline,
            deadline_from_dispatch: true,
        },
        max_nodes: teardown.max_nodes,
        reclaim: args.reclaim,
        gitops: teardown.gitops,
        release: teardown.release.clone(),
        assume_stopped: teardown.assume_stopped.clone(),
        time_scale: args.time_scale,
        localstack,
    };
    let cancel = CancellationToken::new();
    let signals = watch_signals(cancel.clone());
    // the copy runs as its administrator: with the run's own identity, what it may do is asked
    // of the live cluster and EC2 as the real run's preflight asks (access reviews and EC2 dry
    // runs, which a read-only rehearsal identity is not meant to send), before the copy is played
    let instances: Vec<String> = snap.aws.instances.iter().map(|i| i.id.clone()).collect();
    let permissions = match live.as_ref().filter(|_| args.predict_permissions) {
        Some((kube, aws)) => match live_permissions(kube, aws, &settings, &snap.cluster, &instances).await {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: {e}");
                return Exit::Failure;
            }
        },
        None => None,
    };
    // and what the live cleanup controllers (reads, always) and admission chain (dry runs, with
    // the run's own identity) would refuse: nothing is stored
    let refused = match live.as_ref() {
        Some((kube, _)) => match live_refusal(kube, &settings, args.predict_permissions).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}");
                return Exit::Failure;
            }
        },
        None => (None, String::new()),
    };
    let played = crate::rehearse::rehearse(snap, &settings, cancel.clone()).await.map(|p| {
        let p = match permissions {
            Some(seen) => p.with_permissions(seen),
            None => p,
        };
        p.with_live_refusal(refused.0, &refused.1)
    });
    signals.abort();
    let exit = match played {
        Ok(prediction) => {
            println!("{}", render(&prediction));
            let exit = if cancel.is_cancelled() { Exit::Interrupted } else { prediction.exit() };
            report.rehearsal = section(Rehearsal { snapshot: summary, prediction: Some(prediction) });
            exit
        }
        Err(e) => {
            report.error = Some(e.to_string());
            report.rehearsal = section(Rehearsal { snapshot: summary, prediction: None });
            eprintln!("error: {e}");
            match e {
                RehearseError::LocalStack { .. } => Exit::BadInput,
                _ => Exit::Failure,
            }
        }
    };
    report.finish(started, exit, false);
    let target = Target {
        cluster: report.cluster.clone(),
        region: report.region.clone(),
        account: None,
        report: args.report.clone(),
        reclaim: args.reclaim,
    };
    super::finish_report(&target, &report, exit)
}

/// The validated flags: the teardown to play, the live cluster to read (none with
/// --from-snapshot), and the LocalStack for the copy.
fn validate(args: &RehearseArgs) -> Result<(TeardownConfig, Option<Target>, String), String> {
    if !(0.001..=1.0).contains(&args.time_scale) {
        return Err(format!(
            "--time-scale {} is out of range: give a factor between 0.001 and 1 (0.2 is five times as fast)",
            args.time_scale
        ));
    }
    let url = args.localstack.trim_end_matches('/').to_string();
    let host = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .map(|h| h.split(['/', ':']).next().unwrap_or(""));
    match host {
        None | Some("") => {
            return Err(format!(
                "--localstack {url:?} is not an http(s) URL: pass LocalStack's endpoint, e.g. http://localhost:4566"
            ));
        }
        // the copy's AWS side must never be AWS itself (its credentials are fake too, so AWS would
        // refuse every call, but a clear refusal here is better)
        Some(h) if h.ends_with("amazonaws.com") || h.ends_with("amazonaws.com.cn") => {
            return Err(format!(
                "--localstack {url} is an AWS endpoint: the rehearsal's copy lives in a LocalStack, never in AWS"
            ));
        }
        Some(_) => {}
    }
    let teardown = TeardownConfig::from_args(&args.teardown).map_err(|e| e.to_string())?;
    let target = match (&args.from_snapshot, &args.cluster) {
        (Some(_), _) => None,
        (None, cluster) => Some(
            Target::from_args(&TargetArgs {
                cluster: cluster.clone().unwrap_or_default(),
                region: args.region.clone(),
                account: None,
                report: None,
                reclaim: false,
            })
            .map_err(|e| e.to_string())?,
        ),
    };
    Ok((teardown, target, url))
}

/// What of the plan's permissions the live identity lacks: the real run's preflight questions
/// (SelfSubjectAccessReviews, EC2 dry runs), asked of the live cluster and EC2. Read-only.
async fn live_permissions(
    kube: &Kube,
    aws: &AwsClients,
    settings: &RehearsalSettings,
    cluster: &str,
    instances: &[String],
) -> Result<PermissionsSeen, String> {
    use crate::engine::permissions;
    let delete_pods = settings.drain.policy == Some(crate::config::DrainPolicy::Delete);
    let mut k8s_need = permissions::kubernetes_needs(&settings.plan, delete_pods, settings.gitops.pause);
    if !settings.release.is_empty() {
        k8s_need.extend(permissions::cleanup_release_needs(&settings.release));
    }
    let k8s = permissions::missing_kubernetes(&kube.client, &k8s_need).await.map_err(|e| e.to_string())?;
    let ec2_need = permissions::ec2_needs(&settings.plan, settings.reclaim);
    let ec2 = permissions::missing_ec2(aws, cluster, &ec2_need, instances).await.map_err(|e| e.to_string())?;
    Ok(PermissionsSeen {
        kubernetes_checked: k8s.is_some(),
        missing_kubernetes: k8s.unwrap_or_default().iter().map(ToString::to_string).collect(),
        missing_ec2: ec2.iter().map(ToString::to_string).collect(),
    })
}

/// What the real run's checks before its first write would refuse on the live cluster: with
/// `admission` (the run's own identity), one server-side dry run per kind of write through its
/// admission chain; always, the cleanup controllers the drain would strand (reads, which the
/// rehearsal's role grants), with the plan's lines for them and for what `--release` would
/// release. Nothing is stored.
async fn live_refusal(
    kube: &Kube,
    settings: &RehearsalSettings,
    admission: bool,
) -> Result<(Option<crate::engine::Refused>, String), String> {
    use crate::engine::inventory::Inventory;
    use crate::engine::{admission_verdict, cleanup_verdict};
    let inv = crate::k8s::retry_transient(|| Inventory::read(&kube.client)).await.map_err(|e| e.to_string())?;
    let mut text = String::new();
    if admission {
        let delete_pods = settings.drain.policy == Some(crate::config::DrainPolicy::Delete);
        let need = crate::engine::permissions::kubernetes_needs(&settings.plan, delete_pods, settings.gitops.pause);
        let refused = admission_verdict(&kube.client, &need, &inv, None, &mut text).await.map_err(|e| e.to_string())?;
        if refused.is_some() {
            return Ok((refused, text));
        }
    }
    let verdict =
        cleanup_verdict(&kube.client, &settings.plan, &inv, &settings.release, &settings.assume_stopped, &mut text)
            .await
            .map_err(|e| e.to_string())?;
    Ok((verdict.refused, text))
}

/// The snapshot: from a file, or read from the live cluster (lists and describes only), with the
/// live clients it was read through.
async fn snapshot(
    args: &RehearseArgs,
    target: Option<&Target>,
    kube: &KubeTarget,
) -> Result<(Snapshot, Option<(Kube, AwsClients)>), SnapshotError> {
    if let Some(path) = &args.from_snapshot {
        let snap = Snapshot::load(path)?;
        if let Some(c) = &args.cluster
            && *c != snap.cluster
        {
            return Err(SnapshotError::Format {
                path: path.display().to_string(),
                detail: format!("it is a snapshot of cluster {}, not {c}", snap.cluster),
            });
        }
        return Ok((snap, None));
    }
    let Some(target) = target else {
        return Err(SnapshotError::Read { path: "the command line".into(), detail: "no --cluster to read".into() });
    };
    let kube = Kube::connect(kube).await?;
    let aws = AwsClients::connect(&target.region).await?;
    let snap = Snapshot::take(&kube, &aws, &target.cluster, &target.region).await?;
    Ok((snap, Some((kube, aws))))
}

/// The prediction for a terminal.
fn render(p: &Prediction) -> String {
    let mut s = String::new();
    let outcome = serde_json::to_value(p.outcome).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    let _ = writeln!(
        s,
        "rehearse: predicted outcome {outcome} (exit {}) in about {} on the real clock (the rehearsal took {:.1}s, its copy {:.1}s to build)",
        p.exit_code,
        humantime::format_duration(Duration::from_secs(p.timing.predicted_seconds.round() as u64)),
        p.timing.rehearsal_seconds,
        p.copy.load_seconds
    );
    if let Some(e) = &p.error {
        let _ = writeln!(s, "  error it will end with: {e}");
    }
    match &p.permissions {
        Some(seen) if seen.missing_kubernetes.is_empty() && seen.missing_ec2.is_empty() => {
            let k8s = if seen.kubernetes_checked {
                "the API server"
            } else {
                "EC2 (the API server answers no access reviews)"
            };
            let _ = writeln!(s, "  permissions: the live identity has every one the plan needs, asked of {k8s}");
        }
        Some(_) => {}
        None => {
            let _ = writeln!(
                s,
                "  permissions: not predicted (the copy runs as administrator); rehearse with the run's own identity and \
                 --predict-permissions to predict them"
            );
        }
    }
    for b in &p.blockers {
        let _ = write!(s, "  blocker: {} {}: {}", b.kind, b.name, b.reason);
        if let Some(a) = &b.budget {
            let _ = write!(
                s,
                " [{} pods, {} healthy, {} required healthy, {} disruption(s) allowed]",
                a.expected_pods, a.current_healthy, a.desired_healthy, a.disruptions_allowed
            );
        }
        s.push('\n');
    }
    let _ = writeln!(s, "  time by step (predicted, share, basis):");
    for st in &p.timing.steps {
        let _ = writeln!(
            s,
            "    {:<22} {:>8.1}s {:>5.1}%  {} ({} task(s){}, {})",
            st.step,
            st.predicted_seconds,
            st.share * 100.0,
            st.basis,
            st.tasks,
            if st.found_late > 0 { format!(", {} of machines found late", st.found_late) } else { String::new() },
            st.result
        );
    }
    let total: u64 = p.requests.values().sum();
    let _ = writeln!(
        s,
        "  requests it expects to make: {total} ({})",
        p.requests.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(s, "  verification: {}", if p.clean { "clean" } else { "leftovers" });
    let _ = write!(s, "  the plan, as it would run:\n{}", p.plan.trim_end());
    s
}

/// The report's `rehearsal` section. Serialising plain data cannot fail; were it ever to, the
/// report would lack the section rather than the run fail.
fn section(r: Rehearsal) -> Option<serde_json::Value> {
    serde_json::to_value(r).ok()
}
