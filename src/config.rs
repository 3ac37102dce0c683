//! The validated configuration: every flag checked and typed before anything runs, so bad input
//! is reported (exit 2) without a single call to Kubernetes or AWS.

use std::path::PathBuf;
use std::time::Duration;

use crate::cli::{DrainPolicyArg, RunArgs, TargetArgs, TeardownArgs};

/// A flag or environment value that cannot be used, with the fix.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    /// The cluster name is not a valid EKS cluster name.
    #[error(
        "--cluster {0:?} is not a valid EKS cluster name (1-100 characters: letters, digits, '-' and '_', starting with a letter or digit)"
    )]
    BadCluster(String),
    /// No region given and none in the environment.
    #[error("no AWS region: pass --region (or set KARPENTER_TEARDOWN_REGION, AWS_REGION or AWS_DEFAULT_REGION)")]
    NoRegion,
    /// The region does not look like an AWS region.
    #[error("--region {0:?} is not an AWS region name (like eu-west-1 or us-gov-west-1)")]
    BadRegion(String),
    /// The account id is not 12 digits.
    #[error("--account {0:?} is not an AWS account id (12 digits)")]
    BadAccount(String),
    /// The duration does not parse.
    #[error("--{flag} {value:?} is not a duration ({detail}); write it like 90s, 10m or 1h30m")]
    BadDuration {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
        /// The parser's complaint.
        detail: String,
    },
    /// A zero limit would refuse every run.
    #[error("--max-nodes 0 would refuse every run; give a positive number or leave it out")]
    ZeroMaxNodes,
    /// A zero limit would refuse every sweep that found an orphan.
    #[error("--max-instances 0 would refuse every sweep with an orphan; give a positive number or leave it out")]
    ZeroMaxInstances,
}

/// `sweep`, validated.
#[derive(Debug, Clone)]
pub(crate) struct SweepConfig {
    pub(crate) regions: Vec<String>,
    /// Only these clusters (empty: all).
    pub(crate) clusters: std::collections::BTreeSet<String>,
    pub(crate) exclude: std::collections::BTreeSet<String>,
    pub(crate) min_age: Duration,
    pub(crate) max_instances: Option<u32>,
    /// `--not-eks`: the named clusters need no evidence that they ran on EKS.
    pub(crate) not_eks: bool,
    pub(crate) account: Option<String>,
    pub(crate) consent: Consent,
    pub(crate) report: Option<PathBuf>,
}

impl SweepConfig {
    pub(crate) fn from_args(a: &crate::cli::SweepArgs) -> Result<SweepConfig, ConfigError> {
        let mut regions: Vec<String> = Vec::new();
        for r in &a.regions {
            validate_region(r)?;
            if !regions.contains(r) {
                regions.push(r.clone());
            }
        }
        for c in a.clusters.iter().chain(&a.exclude_clusters) {
            validate_cluster(c)?;
        }
        if let Some(acct) = &a.account {
            validate_account(acct)?;
        }
        if a.max_instances == Some(0) {
            return Err(ConfigError::ZeroMaxInstances);
        }
        Ok(SweepConfig {
            regions,
            clusters: a.clusters.iter().cloned().collect(),
            exclude: a.exclude_clusters.iter().cloned().collect(),
            min_age: parse_duration("min-age", &a.min_age)?,
            max_instances: a.max_instances,
            not_eks: a.not_eks,
            account: a.account.clone(),
            consent: if a.yes { Consent::Yes } else { Consent::DryRun },
            report: a.report.clone(),
        })
    }
}

/// What to do with pods still on a node when its drain deadline passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrainPolicy {
    /// Stop, exit 5, name the blockers.
    Fail,
    /// Delete the remaining pods with their grace period.
    Delete,
    /// Go on without draining them.
    Skip,
}

impl From<DrainPolicyArg> for DrainPolicy {
    fn from(a: DrainPolicyArg) -> Self {
        match a {
            DrainPolicyArg::Fail => DrainPolicy::Fail,
            DrainPolicyArg::Delete => DrainPolicy::Delete,
            DrainPolicyArg::Skip => DrainPolicy::Skip,
        }
    }
}

/// Which cluster, proven later against the evidence (design §7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// EKS cluster name.
    pub cluster: String,
    /// AWS region.
    pub region: String,
    /// AWS account the credentials must belong to.
    pub account: Option<String>,
    /// Report file.
    pub report: Option<PathBuf>,
    /// Remove leftovers found by verification.
    pub reclaim: bool,
}

/// Where the Kubernetes API is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct KubeTarget {
    /// Explicit kubeconfig file.
    pub kubeconfig: Option<PathBuf>,
    /// Explicit context.
    pub context: Option<String>,
}

/// Whether writes are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Consent {
    /// No `--yes`: show the plan, change nothing.
    DryRun,
    /// `--yes`: act.
    Yes,
}

/// Which plan to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PlanSource {
    /// A plan compiled into the binary (`default`, `delegate`).
    Builtin(String),
    /// A plan file.
    File(PathBuf),
}

impl PlanSource {
    /// `None` → the default plan; a built-in name → that plan; anything else → a file.
    pub(crate) fn from_arg(arg: Option<&str>) -> PlanSource {
        match arg {
            None => PlanSource::Builtin("default".into()),
            Some(name @ ("default" | "delegate")) => PlanSource::Builtin(name.into()),
            Some(path) => PlanSource::File(PathBuf::from(path)),
        }
    }
}

/// The validated `run` configuration.
#[derive(Debug, Clone)]
pub(crate) struct RunConfig {
    /// Cluster and region.
    pub target: Target,
    /// Kubernetes access.
    pub kube: KubeTarget,
    /// Plan.
    pub plan: PlanSource,
    /// Dry run or act.
    pub consent: Consent,
    /// Per-node drain deadline (overrides the plan's).
    pub drain_deadline: Option<Duration>,
    /// Policy at the drain deadline (overrides the plan's).
    pub on_drain_deadline: Option<DrainPolicy>,
    /// Blast-radius limit.
    pub max_nodes: Option<u32>,
    /// What may be done about GitOps owners of the Karpenter objects.
    pub gitops: crate::gitops::GitopsConsent,
    /// Without a terminal, how often the run logs what it waits for.
    pub progress_every: Duration,
    /// What the cleanup controllers hold that the run may release before the drain.
    pub release: std::collections::BTreeSet<crate::cleanup::Release>,
    /// The cleanup controllers taken as not running when no pod of theirs is found.
    pub assume_stopped: std::collections::BTreeSet<crate::cleanup::Cleaner>,
}

impl Target {
    /// Validates cluster, region and account.
    pub(crate) fn from_args(a: &TargetArgs) -> Result<Target, ConfigError> {
        let region = match &a.region {
            Some(r) => r.clone(),
            None => std::env::var("AWS_REGION")
                .or_else(|_| std::env::var("AWS_DEFAULT_REGION"))
                .map_err(|_| ConfigError::NoRegion)?,
        };
        validate_cluster(&a.cluster)?;
        validate_region(&region)?;
        if let Some(acct) = &a.account {
            validate_account(acct)?;
        }
        Ok(Target {
            cluster: a.cluster.clone(),
            region,
            account: a.account.clone(),
            report: a.report.clone(),
            reclaim: a.reclaim,
        })
    }
}

impl RunConfig {
    /// Validates every `run` flag.
    pub(crate) fn from_args(a: &RunArgs) -> Result<RunConfig, ConfigError> {
        let target = Target::from_args(&a.target)?;
        let t = TeardownConfig::from_args(&a.teardown)?;
        Ok(RunConfig {
            target,
            kube: t.kube,
            plan: t.plan,
            consent: if a.yes { Consent::Yes } else { Consent::DryRun },
            drain_deadline: t.drain_deadline,
            on_drain_deadline: t.on_drain_deadline,
            max_nodes: t.max_nodes,
            gitops: t.gitops,
            release: t.release,
            assume_stopped: t.assume_stopped,
            progress_every: match parse_duration("progress-every", &a.progress_every)? {
                d if d.is_zero() => {
                    return Err(ConfigError::BadDuration {
                        flag: "progress-every",
                        value: a.progress_every.clone(),
                        detail: "it must be longer than zero".into(),
                    });
                }
                d => d,
            },
        })
    }
}

/// The validated [`TeardownArgs`], shared by `run` and `rehearse`.
#[derive(Debug, Clone)]
pub(crate) struct TeardownConfig {
    /// Kubernetes access.
    pub kube: KubeTarget,
    /// Plan.
    pub plan: PlanSource,
    /// Per-node drain deadline (overrides the plan's).
    pub drain_deadline: Option<Duration>,
    /// Policy at the drain deadline (overrides the plan's).
    pub on_drain_deadline: Option<DrainPolicy>,
    /// Blast-radius limit.
    pub max_nodes: Option<u32>,
    /// What may be done about GitOps owners of the Karpenter objects.
    pub gitops: crate::gitops::GitopsConsent,
    /// What the cleanup controllers hold that the run may release before the drain.
    pub release: std::collections::BTreeSet<crate::cleanup::Release>,
    /// The cleanup controllers taken as not running when no pod of theirs is found.
    pub assume_stopped: std::collections::BTreeSet<crate::cleanup::Cleaner>,
}

impl TeardownConfig {
    /// Validates the flags that describe a teardown.
    pub(crate) fn from_args(a: &TeardownArgs) -> Result<TeardownConfig, ConfigError> {
        let drain_deadline = a.drain_deadline.as_deref().map(|d| parse_duration("drain-deadline", d)).transpose()?;
        if a.max_nodes == Some(0) {
            return Err(ConfigError::ZeroMaxNodes);
        }
        Ok(TeardownConfig {
            kube: KubeTarget { kubeconfig: a.kubeconfig.clone(), context: a.context.clone() },
            plan: PlanSource::from_arg(a.plan.as_deref()),
            drain_deadline,
            on_drain_deadline: a.on_drain_deadline.map(Into::into),
            max_nodes: a.max_nodes,
            gitops: crate::gitops::GitopsConsent { pause: a.pause_gitops, paused_elsewhere: a.gitops_paused_elsewhere },
            release: a
                .release
                .iter()
                .map(|r| {
                    use crate::cleanup::{Releasable, Release};
                    match r {
                        crate::cli::ReleaseArg::LoadBalancers => {
                            Release { what: Releasable::LoadBalancers, all: false }
                        }
                        crate::cli::ReleaseArg::LoadBalancersAll => {
                            Release { what: Releasable::LoadBalancers, all: true }
                        }
                        crate::cli::ReleaseArg::Volumes => Release { what: Releasable::Volumes, all: false },
                        crate::cli::ReleaseArg::VolumesAll => Release { what: Releasable::Volumes, all: true },
                    }
                })
                .collect(),
            assume_stopped: a
                .assume_stopped
                .iter()
                .map(|c| match c {
                    crate::cli::CleanerArg::LoadBalancerController => crate::cleanup::Cleaner::LoadBalancerController,
                    crate::cli::CleanerArg::EbsCsi => crate::cleanup::Cleaner::EbsCsi,
                    crate::cli::CleanerArg::EfsCsi => crate::cleanup::Cleaner::EfsCsi,
                })
                .collect(),
        })
    }
}

/// Parses a humantime duration (`90s`, `10m`, `1h30m`) for `flag`.
pub(crate) fn parse_duration(flag: &'static str, value: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(value.trim()).map_err(|e| ConfigError::BadDuration {
        flag,
        value: value.to_string(),
        detail: e.to_string(),
    })
}

fn validate_cluster(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok { Ok(()) } else { Err(ConfigError::BadCluster(name.to_string())) }
}

fn validate_account(account: &str) -> Result<(), ConfigError> {
    let ok = account.len() == 12 && account.bytes().all(|b| b.is_ascii_digit());
    if ok { Ok(()) } else { Err(ConfigError::BadAccount(account.to_string())) }
}

fn validate_region(region: &str) -> Result<(), ConfigError> {
    // partition-prefixed names like us-gov-west-1 and cn-north-1 have 3 or 4 parts; the last is a number
    let parts: Vec<&str> = region.split('-').collect();
    let ok = (3..=4).contains(&parts.len())
        && parts[..parts.len() - 1].iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase()))
        && parts[parts.len() - 1].parse::<u8>().is_ok();
    if ok { Ok(()) } else { Err(ConfigError::BadRegion(region.to_string())) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(cluster: &str, region: &str) -> TargetArgs {
        TargetArgs { cluster: cluster.into(), region: Some(region.into()), account: None, report: None, reclaim: false }
    }

    #[test]
    fn clusters_and_regions_are_checked() {
        assert!(Target::from_args(&target("prod-eu_1", "eu-west-1")).is_ok());
        assert!(Target::from_args(&target("prod", "us-gov-west-1")).is_ok());
        assert!(matches!(Target::from_args(&target("-bad", "eu-west-1")), Err(ConfigError::BadCluster(_))));
        assert!(matches!(Target::from_args(&target("a b", "eu-west-1")), Err(ConfigError::BadCluster(_))));
        assert!(matches!(Target::from_args(&target("ok", "europe")), Err(ConfigError::BadRegion(_))));
        assert!(matches!(Target::from_args(&target("ok", "EU-west-1")), Err(ConfigError::BadRegion(_))));
    }

    #[test]
    fn durations_name_the_flag_and_the_fix() {
        assert_eq!(parse_duration("drain-deadline", "1h30m").unwrap(), Duration::from_secs(5400));
        let e = parse_duration("drain-deadline", "ten minutes").unwrap_err().to_string();
        assert!(e.contains("--drain-deadline") && e.contains("10m"), "{e}");
    }

    #[test]
    fn run_and_rehearse_take_the_same_release_consent() {
        use clap::Parser;
        let teardown = |argv: &[&str]| match crate::cli::Cli::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Run(a) => TeardownConfig::from_args(&a.teardown).unwrap(),
            crate::cli::Command::Rehearse(a) => TeardownConfig::from_args(&a.teardown).unwrap(),
            other => panic!("{other:?}"),
        };
        use crate::cleanup::{Releasable, Release};
        let stranded = |what| Release { what, all: false };
        let both = [stranded(Releasable::LoadBalancers), stranded(Releasable::Volumes)].into();
        let run = ["kt", "run", "--cluster", "c", "--region", "eu-west-1", "--release", "load-balancers,volumes"];
        assert_eq!(teardown(&run).release, both);
        let rehearse = ["kt", "rehearse", "--cluster", "c", "--region", "eu-west-1", "--release", "volumes"];
        assert_eq!(teardown(&rehearse).release, [stranded(Releasable::Volumes)].into());
        let all = ["kt", "run", "--cluster", "c", "--region", "eu-west-1", "--release", "load-balancers=all,volumes"];
        let wide = Release { what: Releasable::LoadBalancers, all: true };
        assert_eq!(teardown(&all).release, [wide, stranded(Releasable::Volumes)].into());
        assert!(crate::cli::Cli::try_parse_from(["kt", "run", "--cluster", "c", "--release", "disks"]).is_err());
    }

    #[test]
    fn plan_names_pick_builtins_or_files() {
        assert_eq!(PlanSource::from_arg(None), PlanSource::Builtin("default".into()));
        assert_eq!(PlanSource::from_arg(Some("delegate")), PlanSource::Builtin("delegate".into()));
        assert_eq!(PlanSource::from_arg(Some("plans/x.toml")), PlanSource::File("plans/x.toml".into()));
    }
}
