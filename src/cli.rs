//! The command line, as clap parses it. Nothing here runs: [`crate::config`] turns these raw
//! arguments into a validated configuration first.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::exit::EXIT_CODES_HELP;

const ABOUT: &str = "Tears down the compute of a Karpenter-managed EKS cluster safely and in order, \
and proves through the EC2 API that nothing it was responsible for is left running.";

const EXAMPLES: &str = "\
Examples:
  # Show what a teardown would do (changes nothing):
  karpenter-teardown run --cluster prod-eu --region eu-west-1
  # Do it, with a JSON report for CI:
  karpenter-teardown run --cluster prod-eu --region eu-west-1 --yes --report teardown.json
  # Only prove through EC2 that nothing is left:
  karpenter-teardown verify --cluster prod-eu --region eu-west-1
  # The plan as a graph:
  karpenter-teardown plan --format mermaid

Every flag can also be set through the environment variable shown next to it
(KARPENTER_TEARDOWN_*), which is how a Terraform destroy-time provisioner passes them.
AWS endpoints and credentials come from the SDK's standard environment (AWS_PROFILE,
AWS_ENDPOINT_URL, ...); the Kubernetes API from the standard kubeconfig rules (KUBECONFIG).";

/// The whole command line.
#[derive(Debug, Parser)]
#[command(name = "karpenter-teardown", version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("KARPENTER_TEARDOWN_COMMIT"), ")"), about = ABOUT, after_long_help = format!("{EXAMPLES}\n\n{EXIT_CODES_HELP}"), after_help = EXIT_CODES_HELP)]
pub struct Cli {
    /// Log line format when stderr is not a terminal (text or json).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "KARPENTER_TEARDOWN_LOG_FORMAT")]
    pub log_format: LogFormat,

    /// Log filter (tracing env-filter syntax, e.g. `info` or `karpenter_teardown=debug`).
    #[arg(long, global = true, default_value = "info", env = "KARPENTER_TEARDOWN_LOG")]
    pub log_level: String,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The structured-log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event, no colours when not on a terminal.
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tear down the cluster's Karpenter compute (without --yes: show what would be done).
    #[command(after_long_help = format!("{EXAMPLES}\n\n{EXIT_CODES_HELP}"))]
    Run(RunArgs),
    /// Show a teardown plan: its steps and their order, as text, Graphviz DOT or Mermaid.
    Plan(PlanArgs),
    /// Prove through EC2 (and IAM) that nothing of the cluster's Karpenter is left.
    #[command(after_long_help = EXIT_CODES_HELP)]
    Verify(VerifyArgs),
    /// Find what Karpenter left behind in whole regions, cluster by cluster, and (with --yes)
    /// reclaim what belongs to clusters EKS no longer has.
    #[command(after_long_help = SWEEP_HELP)]
    Sweep(SweepArgs),
    /// Predict a teardown: read the live cluster (read-only), play the plan on a copy of it in
    /// the sandbox with the clock accelerated, and report the predicted outcome, exit code,
    /// blockers and wall time. Changes nothing anywhere; exits with the predicted exit code.
    #[cfg(feature = "sandbox")]
    #[command(after_long_help = REHEARSE_HELP)]
    Rehearse(RehearseArgs),
    /// A simulated Karpenter cluster on this machine, for trying the tool and for tests.
    #[cfg(feature = "sandbox")]
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Find Terraform state entries that point at cluster objects now gone (node taints, labels,
    /// Karpenter manifests) and print the `terraform state rm` commands and `removed` blocks
    /// that make Terraform forget them. Changes nothing.
    #[command(name = "tf-prune", after_long_help = TF_PRUNE_HELP)]
    TfPrune(TfPruneArgs),
    /// Draw a run's report (`run --report FILE`): `report timeline FILE` prints a Mermaid Gantt
    /// chart of its steps, the slowest machines and what did not end done.
    #[command(subcommand)]
    Report(ReportCommand),
    /// Print a shell completion script (e.g. `karpenter-teardown completions bash > /etc/bash_completion.d/karpenter-teardown`).
    Completions(CompletionsArgs),
}

const SWEEP_HELP: &str = "\
Each cluster gets one verdict, the first that matches:
  protected   a resource carries the tag karpenter-teardown.io/keep (any value)
  uncertain   its resources' tags disagree on the cluster, an instance is EKS Auto Mode's,
              or EKS could not answer (access denied, throttled, region not enabled)
  active      EKS has the cluster: its own Karpenter, or `run`, owns it
  too-young   something of it is newer than --min-age (or its age is unknown)
  orphaned    EKS answers not found in that region for these credentials, and the user data
              of its instances or launch templates names an EKS endpoint (a self-managed
              cluster cannot be proven gone through EKS: --cluster NAME --not-eks): reclaimable
Only orphans are reclaimed (--yes): instances (their tags untouched) until terminated, then
launch templates, instance profiles (roles removed first), detached network interfaces.

Exit codes: 0 nothing orphaned is left; 4 orphans left (a dry run lists them, or a reclaim
failed); 3 a cluster is uncertain, or --max-instances / --account refused (nothing changed);
2 bad input, or a call the reclaim needs that EC2's dry run refuses (nothing changed); 1 failure.

Example (a nightly CI job):
  karpenter-teardown sweep --region eu-west-1 --region us-east-1 --report sweep.json";

const TF_PRUNE_HELP: &str = "\
Examples:
  terraform show -json > state.json
  karpenter-teardown tf-prune --state state.json --kubeconfig ~/.kube/config
  # after the cluster itself is gone, every entry points at nothing:
  terraform show -json | karpenter-teardown tf-prune --state - --assume-gone

Looked at: kubernetes_node_taint, kubernetes_labels / kubernetes_annotations of kind Node,
kubernetes_manifest / kubectl_manifest of NodePool, NodeClaim, EC2NodeClass. An object counts as
gone only when the API server answers 404; any other error stops the command.";

#[cfg(feature = "sandbox")]
const REHEARSE_HELP: &str = "\
Examples:
  # What would a teardown of prod-eu do, and how long would it take?
  karpenter-teardown rehearse --cluster prod-eu --region eu-west-1 --report rehearsal.json
  # Keep the snapshot, rehearse it again later (no cluster needed) or explore it with kubectl:
  karpenter-teardown rehearse --cluster prod-eu --region eu-west-1 --snapshot-out prod-eu.snapshot.json
  karpenter-teardown rehearse --from-snapshot prod-eu.snapshot.json --on-drain-deadline delete
  karpenter-teardown sandbox up --from-snapshot prod-eu.snapshot.json --kubeconfig-out copy.kubeconfig

Reads only (deploy/rbac-rehearse.yaml, deploy/iam-policy-rehearse.json). Needs a LocalStack on
this machine for the copy's AWS side (--localstack, default http://localhost:4566); the copy's
credentials are fake, so nothing it does can reach AWS. Exit code: the one predicted for the real
run (0 clean, 3 refused, 4 leftovers, 5 blocked, 1 failed); 2 when the rehearsal itself cannot
start (bad flags, unreadable snapshot, no LocalStack, unreachable cluster).";

/// `rehearse`.
#[cfg(feature = "sandbox")]
#[derive(Debug, Args)]
pub struct RehearseArgs {
    /// Cluster name (with --from-snapshot: taken from the snapshot when not given).
    #[arg(long, env = "KARPENTER_TEARDOWN_CLUSTER", required_unless_present = "from_snapshot")]
    pub cluster: Option<String>,

    /// AWS region (falls back to AWS_REGION / AWS_DEFAULT_REGION; with --from-snapshot: the snapshot's).
    #[arg(long, env = "KARPENTER_TEARDOWN_REGION")]
    pub region: Option<String>,

    /// Write the JSON report (`command: "rehearse"`, with the prediction) to this file.
    #[arg(long, env = "KARPENTER_TEARDOWN_REPORT", value_name = "FILE")]
    pub report: Option<PathBuf>,

    /// Write the snapshot of the live cluster (versioned JSON) to this file.
    #[arg(long, value_name = "FILE", conflicts_with = "from_snapshot")]
    pub snapshot_out: Option<PathBuf>,

    /// Rehearse a snapshot written earlier instead of reading the live cluster.
    #[arg(long, value_name = "FILE")]
    pub from_snapshot: Option<PathBuf>,

    /// The teardown to rehearse: the same flags as `run`'s (the drain deadline on the real clock).
    #[command(flatten)]
    pub teardown: TeardownArgs,

    /// As for `run`.
    #[arg(long, env = "KARPENTER_TEARDOWN_RECLAIM")]
    pub reclaim: bool,

    /// The copy's clock: grace periods, Karpenter's delays and the drain deadline are
    /// multiplied by it (0.2: five times as fast). Between 0.001 and 1. A faster clock
    /// compresses the API server's reaction to the evictions into the time they are still being
    /// sent, which slows the rehearsal's own requests: the prediction then runs long.
    #[arg(long, default_value_t = 0.2, value_name = "FACTOR")]
    pub time_scale: f64,

    /// The LocalStack that holds the copy's AWS side (a private account of its own).
    #[arg(long, env = "KARPENTER_TEARDOWN_LOCALSTACK", default_value = "http://localhost:4566", value_name = "URL")]
    pub localstack: String,

    /// The kubeconfig and AWS credentials given are the ones the real run will use: a
    /// permission of the plan they lack (asked as the run's preflight asks, read-only) is
    /// predicted as the run's refusal (exit 2). Without it the rehearsal, usually run with the
    /// read-only identity of deploy/rbac-rehearse.yaml, only reports what that identity lacks.
    #[arg(long, env = "KARPENTER_TEARDOWN_PREDICT_PERMISSIONS", conflicts_with = "from_snapshot")]
    pub predict_permissions: bool,
}

/// `report ...`.
#[derive(Debug, Subcommand)]
pub enum ReportCommand {
    /// Print the report as a Mermaid Gantt chart (paste it into a Markdown file, a pull request
    /// or a CI job summary, which render Mermaid).
    Timeline(ReportTimelineArgs),
}

/// `report timeline`.
#[derive(Debug, Args)]
pub struct ReportTimelineArgs {
    /// The report file `run --report` wrote.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
}

/// `tf-prune`.
#[derive(Debug, Args)]
pub struct TfPruneArgs {
    /// `terraform show -json` output: a file, or `-` for stdin.
    #[arg(long, value_name = "FILE|-")]
    pub state: String,

    /// Take every referenced object as gone, without asking a cluster (the cluster is deleted).
    /// The kubeconfig flags are then ignored.
    #[arg(long)]
    pub assume_gone: bool,

    /// Kubeconfig file (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "KARPENTER_TEARDOWN_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubeconfig context (default: the current context).
    #[arg(long, env = "KARPENTER_TEARDOWN_CONTEXT")]
    pub context: Option<String>,
}

/// `completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: CompletionShell,
}

/// Shells `completions` writes for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompletionShell {
    /// bash
    Bash,
    /// zsh
    Zsh,
    /// fish
    Fish,
}

/// Which cluster, in which region.
#[derive(Debug, Args, Clone)]
pub struct TargetArgs {
    /// Name of the EKS cluster to tear down. Required: the tool refuses when the kubeconfig
    /// reaches another cluster.
    #[arg(long, env = "KARPENTER_TEARDOWN_CLUSTER")]
    pub cluster: String,

    /// AWS region of the cluster (falls back to AWS_REGION / AWS_DEFAULT_REGION).
    #[arg(long, env = "KARPENTER_TEARDOWN_REGION")]
    pub region: Option<String>,

    /// AWS account id the credentials must belong to (checked through STS before any change).
    #[arg(long, env = "KARPENTER_TEARDOWN_ACCOUNT")]
    pub account: Option<String>,

    /// Write a JSON report of the run to this file.
    #[arg(long, env = "KARPENTER_TEARDOWN_REPORT", value_name = "FILE")]
    pub report: Option<PathBuf>,

    /// Also remove leftovers verification finds (instances without NodeClaim, launch templates,
    /// instance profiles, detached network interfaces). Volumes are never deleted. `verify`
    /// terminates instances only once EKS says the cluster is gone or its API shows no node on
    /// them; otherwise it refuses (exit 3): use `run`, which drains first.
    #[arg(long, env = "KARPENTER_TEARDOWN_RECLAIM")]
    pub reclaim: bool,
}

/// `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Cluster, region, report.
    #[command(flatten)]
    pub target: TargetArgs,

    /// Plan, kubeconfig, drain, blast radius and GitOps.
    #[command(flatten)]
    pub teardown: TeardownArgs,

    /// Actually do it. Without --yes the tool shows the concrete plan and changes nothing.
    #[arg(long, short = 'y', env = "KARPENTER_TEARDOWN_YES")]
    pub yes: bool,

    /// Without a terminal (a CI log), how often to log what the run is waiting for: tasks
    /// running, pods left on how many nodes, the budgets holding them, time to the deadline.
    #[arg(long, env = "KARPENTER_TEARDOWN_PROGRESS_EVERY", value_name = "DURATION", default_value = "30s")]
    pub progress_every: String,
}

/// What a teardown does and against which cluster: shared by `run` and `rehearse` (which plays
/// exactly the run these flags describe).
#[derive(Debug, Args)]
pub struct TeardownArgs {
    /// Plan file (default: the built-in default plan; `delegate` names the built-in delegate plan).
    #[arg(long, env = "KARPENTER_TEARDOWN_PLAN", value_name = "FILE")]
    pub plan: Option<String>,

    /// Kubeconfig file (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "KARPENTER_TEARDOWN_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubeconfig context (default: the current context).
    #[arg(long, env = "KARPENTER_TEARDOWN_CONTEXT")]
    pub context: Option<String>,

    /// How long one node may take to drain before --on-drain-deadline applies (e.g. 10m, 90s).
    /// Overrides the plan's drain deadline (10m in the built-in plans).
    #[arg(long, env = "KARPENTER_TEARDOWN_DRAIN_DEADLINE", value_name = "DURATION")]
    pub drain_deadline: Option<String>,

    /// What to do with pods still there at the drain deadline: fail (exit 5 naming the blockers),
    /// delete (delete them with their grace period, bypassing PodDisruptionBudgets), skip (go on:
    /// the node's instance is terminated under the pods left, bypassing their PodDisruptionBudgets).
    /// Overrides the plan's policy (fail in the built-in plans).
    #[arg(long, env = "KARPENTER_TEARDOWN_ON_DRAIN_DEADLINE", value_enum)]
    pub on_drain_deadline: Option<DrainPolicyArg>,

    /// Refuse (exit 3) when the run would act on more Karpenter nodes than this.
    #[arg(long, env = "KARPENTER_TEARDOWN_MAX_NODES", value_name = "N")]
    pub max_nodes: Option<u32>,

    /// Suspend the Argo CD Applications and Flux Kustomizations/HelmReleases that apply the
    /// NodePools, EC2NodeClasses or the Karpenter controller (and their parents) before the
    /// fence; they are never resumed. Without it, a run that finds an active owner refuses (exit 3).
    #[arg(long, env = "KARPENTER_TEARDOWN_PAUSE_GITOPS")]
    pub pause_gitops: bool,

    /// The GitOps owners outside this cluster (an Argo CD in a management cluster, a field
    /// manager no owner here accounts for) are paused: go on. Without it such objects refuse the run.
    #[arg(long, env = "KARPENTER_TEARDOWN_GITOPS_PAUSED_ELSEWHERE")]
    pub gitops_paused_elsewhere: bool,

    /// Before the drain, while the controllers that clean up in AWS still run, delete what they
    /// hold and wait until it and its AWS objects are gone: `load-balancers` (the Services,
    /// Ingresses, Gateways and TargetGroupBindings the AWS Load Balancer Controller holds, and so
    /// their load balancers, target groups and security groups); `volumes` (the StatefulSets mounting
    /// the claims of the EBS CSI controller's Delete-policy PVs are scaled to zero and the claims
    /// deleted, and so the PVs and their EBS volumes). Only what the drain would strand (its
    /// controller runs only where the drain takes it); `load-balancers=all`, `volumes=all` also
    /// where the controller keeps running. Refused (exit 3) for a load balancer with deletion
    /// protection, and for a claim mounted by a pod no StatefulSet owns. Finalizers are never
    /// removed; the data on the volumes is gone.
    #[arg(long, env = "KARPENTER_TEARDOWN_RELEASE", value_enum, value_delimiter = ',', value_name = "WHAT")]
    pub release: Vec<ReleaseArg>,

    /// A controller that cleans up in AWS and holds objects, but of which no pod is found (by its
    /// chart's label, its leader Lease, its webhooks or its image), is taken as not running: go
    /// on. Without it such a run refuses (exit 3): where the controller runs cannot be told, so
    /// neither can whether the drain strands it.
    #[arg(
        long,
        env = "KARPENTER_TEARDOWN_ASSUME_STOPPED",
        value_enum,
        value_delimiter = ',',
        value_name = "CONTROLLER"
    )]
    pub assume_stopped: Vec<CleanerArg>,
}

/// `--assume-stopped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CleanerArg {
    /// The AWS Load Balancer Controller.
    LoadBalancerController,
    /// The EBS CSI driver's controller.
    EbsCsi,
    /// The EFS CSI driver's controller.
    EfsCsi,
}

/// `--release`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReleaseArg {
    /// The Load Balancer Controller's Services, Ingresses, Gateways and TargetGroupBindings, and
    /// so their load balancers, target groups and security groups.
    LoadBalancers,
    /// The EBS CSI controller's PersistentVolumes (reclaim policy Delete): the StatefulSets
    /// mounting their claims are scaled to zero and the claims deleted, and so their volumes.
    Volumes,
    /// `load-balancers`, also when the Load Balancer Controller keeps running through the drain.
    #[value(name = "load-balancers=all")]
    LoadBalancersAll,
    /// `volumes`, also when the EBS CSI controller keeps running through the drain.
    #[value(name = "volumes=all")]
    VolumesAll,
}

/// `--on-drain-deadline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DrainPolicyArg {
    /// Stop and exit 5, naming the pods and PodDisruptionBudgets that block.
    Fail,
    /// Delete the remaining pods with their grace period (bypasses PodDisruptionBudgets).
    Delete,
    /// Go on with the teardown: the node's instance is terminated under the pods left, bypassing
    /// their PodDisruptionBudgets.
    Skip,
}

/// `plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Plan file (default: the built-in default plan; `delegate` names the built-in delegate plan).
    #[arg(long, env = "KARPENTER_TEARDOWN_PLAN", value_name = "FILE")]
    pub plan: Option<String>,

    /// Output format.
    #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
    pub format: PlanFormat,
}

/// `plan --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanFormat {
    /// Steps in order, with their dependencies and parameters.
    Text,
    /// Graphviz DOT (`| dot -Tsvg > plan.svg`).
    Dot,
    /// Mermaid flowchart (renders on code hosts).
    Mermaid,
}

/// `verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Cluster, region, report.
    #[command(flatten)]
    pub target: TargetArgs,

    /// With --reclaim: actually remove the leftovers. Without --yes, verify lists what it would
    /// reclaim and changes nothing (the same consent model as `run`).
    #[arg(long, short = 'y', env = "KARPENTER_TEARDOWN_YES")]
    pub yes: bool,

    /// With --reclaim, while EKS says the cluster exists: the kubeconfig of that cluster, read to
    /// prove no node still runs on an instance before it is terminated without a drain (default:
    /// KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "KARPENTER_TEARDOWN_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubeconfig context for --reclaim (default: the current context).
    #[arg(long, env = "KARPENTER_TEARDOWN_CONTEXT")]
    pub context: Option<String>,

    /// With --reclaim: refuse (exit 3) when it would terminate more instances than this.
    #[arg(long, env = "KARPENTER_TEARDOWN_MAX_NODES", value_name = "N")]
    pub max_nodes: Option<u32>,

    /// With --reclaim of a cluster EKS no longer has: refuse (exit 3) while anything left of it
    /// is newer than this (`sweep`'s rule; naming the cluster is consent for its young
    /// resources, so the default is none).
    #[arg(long, env = "KARPENTER_TEARDOWN_VERIFY_MIN_AGE", default_value = "0s", value_name = "DURATION")]
    pub min_age: String,
}

/// `sweep`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    /// A region to sweep; repeat for several.
    #[arg(long = "region", env = "KARPENTER_TEARDOWN_SWEEP_REGIONS", value_delimiter = ',', required = true)]
    pub regions: Vec<String>,

    /// Only these clusters (by the name their resources' tags give); repeat for several.
    #[arg(long = "cluster", value_delimiter = ',')]
    pub clusters: Vec<String>,

    /// Leave these clusters out; repeat for several.
    #[arg(long = "exclude-cluster", value_delimiter = ',')]
    pub exclude_clusters: Vec<String>,

    /// A cluster with anything newer than this is too young to sweep (`24h`, `3d`, `90m`).
    #[arg(long, env = "KARPENTER_TEARDOWN_MIN_AGE", default_value = "24h", value_name = "DURATION")]
    pub min_age: String,

    /// Refuse (exit 3, nothing changed) when the orphans hold more instances than this.
    #[arg(long, env = "KARPENTER_TEARDOWN_MAX_INSTANCES", value_name = "N")]
    pub max_instances: Option<u32>,

    /// The clusters named with --cluster were not EKS clusters (a self-managed Karpenter on
    /// EC2): EKS's "not found" is taken as gone without the evidence that they ran on EKS.
    #[arg(long, requires = "clusters")]
    pub not_eks: bool,

    /// AWS account id the credentials must belong to (checked through STS first).
    #[arg(long, env = "KARPENTER_TEARDOWN_ACCOUNT")]
    pub account: Option<String>,

    /// Reclaim the orphans. Without it the sweep lists what it would reclaim and changes nothing.
    #[arg(long, short = 'y', env = "KARPENTER_TEARDOWN_YES")]
    pub yes: bool,

    /// Write a JSON report of the sweep to this file.
    #[arg(long, env = "KARPENTER_TEARDOWN_REPORT", value_name = "FILE")]
    pub report: Option<PathBuf>,
}

/// `sandbox ...`.
#[cfg(feature = "sandbox")]
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Serve an empty sandbox Kubernetes API server until interrupted.
    Serve(SandboxServeArgs),
    /// Serve a generated Karpenter cluster (with a simulated controller and instances in
    /// LocalStack) until interrupted.
    Up(SandboxUpArgs),
    /// Generate a cluster, tear it down with the default plan through the kubeconfig like any
    /// user, print the report and what is left in LocalStack; exits with the teardown's code.
    Demo(SandboxUpArgs),
}

/// `sandbox up` / `sandbox demo`.
#[cfg(feature = "sandbox")]
#[derive(Debug, Args)]
pub struct SandboxUpArgs {
    /// Cluster name (instance tags, kubeconfig context).
    #[arg(long, default_value = "sandbox", env = "KARPENTER_TEARDOWN_SANDBOX_CLUSTER")]
    pub cluster: String,
    /// Karpenter nodes to generate.
    #[arg(long, default_value_t = 20)]
    pub nodes: usize,
    /// Workload pods per node (plus one DaemonSet pod each).
    #[arg(long, default_value_t = 4)]
    pub pods_per_node: usize,
    /// Karpenter release to imitate.
    #[arg(long, value_enum, default_value_t = KarpenterVersionArg::V1_14)]
    pub karpenter: KarpenterVersionArg,
    /// Port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0, env = "KARPENTER_TEARDOWN_SANDBOX_PORT")]
    pub port: u16,
    /// Where to write the kubeconfig (demo: a temporary file when not given).
    #[arg(long, value_name = "FILE", env = "KARPENTER_TEARDOWN_SANDBOX_KUBECONFIG")]
    pub kubeconfig_out: Option<PathBuf>,
    /// Multiplies pod grace periods and controller delays (1.0 = real time).
    #[arg(long, default_value_t = 0.05)]
    pub time_scale: f64,
    /// Put the NodePools under a simulated Argo CD Application (self-heal, with an app-of-apps
    /// parent), the EC2NodeClasses under a Flux Kustomization and the controller under a Flux
    /// HelmRelease, with their reconcilers running (`demo` then runs with --pause-gitops).
    #[arg(long)]
    pub gitops: bool,
    /// Serve a copy of the cluster a snapshot holds (`rehearse --snapshot-out`) instead of a
    /// generated one; --nodes, --pods-per-node, --karpenter and --gitops are then ignored.
    #[arg(long, value_name = "FILE")]
    pub from_snapshot: Option<PathBuf>,
}

/// `--karpenter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KarpenterVersionArg {
    /// Karpenter 1.14 (anything since 1.7).
    #[value(name = "1.14")]
    V1_14,
    /// Karpenter 1.0.x (conversion webhook, older tags and instance-profile names).
    #[value(name = "1.0")]
    V1_0,
}

/// `sandbox serve`.
#[cfg(feature = "sandbox")]
#[derive(Debug, Args)]
pub struct SandboxServeArgs {
    /// Port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0, env = "KARPENTER_TEARDOWN_SANDBOX_PORT")]
    pub port: u16,

    /// Where to write a kubeconfig that points at the server.
    #[arg(long, value_name = "FILE", env = "KARPENTER_TEARDOWN_SANDBOX_KUBECONFIG")]
    pub kubeconfig_out: PathBuf,

    /// Name of the cluster (and kubeconfig context).
    #[arg(long, default_value = "sandbox", env = "KARPENTER_TEARDOWN_SANDBOX_CLUSTER")]
    pub cluster: String,
}
