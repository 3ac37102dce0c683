//! Teardown benchmark: for each cluster size, the same generated world is torn down by
//! the default plan, the delegate plan and the baseline users write today (`kubectl drain` node by
//! node, then `kubectl delete nodepools --all` and a poll until the NodeClaims are gone), each on a
//! fresh sandbox API server so every run starts from the same state.
//!
//! ```text
//! cargo build --release --bin karpenter-teardown
//! cargo bench --bench teardown -- --sizes 10,100 --pods-per-node 20 --time-scale 0.05 --out results.md
//! ```
//!
//! Needs LocalStack (`localstack/up`; at `AWS_ENDPOINT_URL` when set, else 127.0.0.1:4566) and
//! `kubectl` for the baseline.
//!
//! `--bed real` runs the same contenders on a real control plane instead (`realstack`: etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler and kwok, fresh for each run), with the
//! world generated there and the simulated Karpenter against the real kube-apiserver. kwok ends a
//! deleted pod when its grace period is over, in real seconds: use `--time-scale 1.0` there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::flowcontrol::v1::FlowSchema;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use karpenter_teardown::k8s::{self, Kube};
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use realstack::{PodExit, RealStack};
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::cloud::Cloud;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
use sandbox_sim::localstack;
use sandbox_sim::{KarpenterVersion, SimController, SimSettings, World, WorldSpec, generate};
use serde_json::Value;

/// The tool's allocator for the bed too (see the dependency's comment in `Cargo.toml`). This
/// process holds the sandbox API server, its control plane and the simulated Karpenter, and with
/// glibc's malloc half of its CPU at 5,000 nodes went to malloc and free of parsed JSON.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const REGION: &str = "us-west-2";

/// Realistic termination grace periods as (seconds, weight): most workloads keep Kubernetes'
/// 30 s default, some ask for one or two minutes (databases, queue consumers), a few for less.
const GRACE_PERIODS: &[(i64, u32)] = &[(10, 10), (30, 70), (60, 12), (120, 8)];

#[derive(Parser, Debug)]
#[command(about = "Benchmarks karpenter-teardown's plans against a kubectl drain baseline")]
struct Args {
    /// Karpenter node counts to benchmark, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10,100")]
    sizes: Vec<usize>,
    /// Workload pods per Karpenter node.
    #[arg(long, default_value_t = 20)]
    pods_per_node: usize,
    /// Replicas per workload (Deployment or StatefulSet), each with its own PDB.
    #[arg(long, default_value_t = 10)]
    replicas: usize,
    /// Scales grace periods and controller delays of the sandbox (1.0 is real time).
    #[arg(long, default_value_t = 0.05)]
    time_scale: f64,
    /// Which contenders to run, comma-separated: default, delegate, kubectl.
    #[arg(long, value_delimiter = ',', default_value = "default,delegate,kubectl")]
    plans: Vec<Contender>,
    /// Skip the kubectl baseline above this many nodes (it drains one node at a time).
    #[arg(long, default_value_t = 100)]
    baseline_max_nodes: usize,
    /// Seconds between the baseline's `kubectl get nodeclaims` polls.
    #[arg(long, default_value_t = 1.0)]
    poll: f64,
    /// Seed of the grace-period draw.
    #[arg(long, default_value_t = 8)]
    seed: u64,
    /// The karpenter-teardown binary; default: target/release, else target/debug.
    #[arg(long)]
    bin: Option<PathBuf>,
    /// kubectl for the baseline.
    #[arg(long, default_value = "kubectl")]
    kubectl: PathBuf,
    /// Write the Markdown results here too.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep each run's report and log under this directory (`<nodes>-<contender>.{json,log}`).
    #[arg(long)]
    keep: Option<PathBuf>,
    /// Give up on one run after this many seconds (the run is then reported as timed out).
    #[arg(long, default_value_t = 1800)]
    run_timeout: u64,
    /// A PDB-heavy cluster: every workload's budget is `maxUnavailable: N` (default: budgets that
    /// never refuse). Use with --spare-nodes, or every budget blocks once the pools are fenced.
    #[arg(long)]
    pdb_max_unavailable: Option<u32>,
    /// Watch events the sandbox API server keeps for resuming watches (default: the server's).
    #[arg(long)]
    watch_history: Option<usize>,
    /// Nodes outside Karpenter the workloads may use, 110 pods each: where evicted pods become
    /// ready again, so budgets that count ready pods let the drain go on.
    #[arg(long, default_value_t = 0)]
    spare_nodes: usize,
    /// The clock of `rehearse`'s copy (its --time-scale).
    #[arg(long, default_value_t = 0.2)]
    rehearse_time_scale: f64,
    /// Where the contenders run: the sandbox API server with its emulated control plane, or a
    /// real one (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok).
    #[arg(long, value_enum, default_value_t = Bed::Sandbox)]
    bed: Bed,
    /// Seconds the world generator waits for every pod to run (default: 60 + nodes / 2 on the
    /// sandbox, 120 + nodes on the real bed, whose scheduler binds one pod at a time).
    #[arg(long)]
    settle_timeout: Option<u64>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Bed {
    Sandbox,
    Real,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Contender {
    Default,
    Delegate,
    Kubectl,
    /// `karpenter-teardown rehearse` of the world (read-only: the world is left as it was).
    Rehearse,
}

impl Contender {
    fn label(self) -> &'static str {
        match self {
            Contender::Default => "default plan",
            Contender::Delegate => "delegate plan",
            Contender::Kubectl => "kubectl drain baseline",
            Contender::Rehearse => "rehearse (snapshot + copy + prediction)",
        }
    }
}

/// One measured teardown.
#[derive(Debug, Default)]
struct Measured {
    size: usize,
    contender: &'static str,
    outcome: String,
    generate_s: f64,
    makespan_s: f64,
    critical_s: f64,
    pods: usize,
    /// Requests of the contender (the server's counts minus the simulated controller's), by verb.
    k8s: BTreeMap<String, u64>,
    /// Requests of the simulated Karpenter controller during the run.
    sim_k8s: u64,
    ec2_tool: Option<u64>,
    /// The tool's EC2 requests the enforcing proxy answered `RequestLimitExceeded` (EC2's token
    /// buckets) or refused as malformed.
    ec2_throttled: Option<(u64, u64)>,
    ec2_sim: u64,
    /// Peak memory and CPU time of the contender's processes.
    usage: Usage,
    /// Where it ran.
    bed: Option<Bed>,
    /// On the real bed: the contender's requests as kube-apiserver counted them (by API Priority
    /// and Fairness, under a FlowSchema of the tool's identity); `k8s` then holds the tool's own
    /// count by verb, from its report.
    k8s_server: Option<u64>,
    /// CPU seconds of each process of the bed while the world was generated and during the run.
    bed_cpu: Vec<(String, f64, f64)>,
}

impl Measured {
    fn k8s_total(&self) -> u64 {
        self.k8s_server.unwrap_or_else(|| self.k8s.values().sum())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // `BENCH_LOG=sandbox_apiserver=debug` prints the bed's own timings (the sandbox's controllers'
    // loop among them) on stderr, to tell what in the bed bounds a figure.
    if let Ok(filter) = std::env::var("BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .init();
    }
    let bin = match &args.bin {
        Some(b) => b.clone(),
        None => locate_binary()?,
    };
    require_localstack()?;
    eprintln!("bench: tool binary {}", bin.display());
    let mut rows = Vec::new();
    for &size in &args.sizes {
        for &c in &args.plans {
            if c == Contender::Kubectl && size > args.baseline_max_nodes {
                eprintln!("bench: skipping the kubectl baseline at {size} nodes (--baseline-max-nodes)");
                continue;
            }
            eprintln!("bench: {size} nodes, {}", c.label());
            let m = run_one(&args, &bin, size, c).await?;
            eprintln!(
                "bench: {size} nodes, {}: {} in {:.1}s (critical path {:.1}s, generated in {:.1}s); this process \
                 (sandbox, simulated Karpenter) now {} MiB resident, {} MiB at its peak",
                c.label(),
                m.outcome,
                m.makespan_s,
                m.critical_s,
                m.generate_s,
                own_memory_kib("VmRSS") / 1024,
                own_memory_kib("VmHWM") / 1024,
            );
            rows.push(m);
        }
    }
    let table = render(&args, &bin, &rows);
    println!("{table}");
    if let Some(out) = &args.out {
        std::fs::write(out, &table).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The tool built by `cargo build --release`, else the debug build: benches get no
/// `CARGO_BIN_EXE_*`.
fn locate_binary() -> anyhow::Result<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    for profile in ["release", "debug"] {
        let p = target.join(profile).join("karpenter-teardown");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("no karpenter-teardown binary under {}: run `cargo build --release` or pass --bin", target.display())
}

/// The LocalStack every run talks to: `AWS_ENDPOINT_URL` when set, else `localstack/up`'s.
fn require_localstack() -> anyhow::Result<()> {
    let endpoint = localstack::endpoint();
    let host = endpoint.trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/');
    let addr = std::net::ToSocketAddrs::to_socket_addrs(host)
        .ok()
        .and_then(|mut a| a.next())
        .with_context(|| format!("LocalStack address {endpoint}"))?;
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map(|_| ()).with_context(|| {
        format!("LocalStack is not running at {endpoint}: start it with `localstack/up` (or set AWS_ENDPOINT_URL)")
    })
}

/// Workloads per namespace: large clusters spread their workloads over many namespaces.
const WORKLOADS_PER_NAMESPACE: usize = 25;

fn spec(args: &Args, size: usize) -> WorldSpec {
    let workloads = (size * args.pods_per_node).div_ceil(args.replicas.max(1));
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    WorldSpec {
        // unique per run: instances of earlier runs stay in LocalStack
        cluster: format!("bench-{size}-{:x}", nanos & 0xffff_ffff),
        region: REGION.into(),
        nodes: size,
        node_pools: 3,
        node_classes: 2,
        pods_per_node: args.pods_per_node,
        replicas_per_workload: args.replicas,
        workload_namespaces: workloads.div_ceil(WORKLOADS_PER_NAMESPACE).max(1),
        managed_nodes: 2,
        decoys: 2,
        concurrency: 32,
        settle_timeout: Duration::from_secs(args.settle_timeout.unwrap_or(match args.bed {
            Bed::Sandbox => 60 + size as u64 / 2,
            Bed::Real => 120 + size as u64,
        })),
        grace_periods: GRACE_PERIODS.to_vec(),
        grace_seed: args.seed,
        pdb_max_unavailable: args.pdb_max_unavailable,
        spare_nodes: args.spare_nodes,
        ..WorldSpec::default()
    }
}

/// The server a run happens on.
enum Server {
    Sandbox(ApiServer),
    Real(RealStack),
}

/// The FlowSchema that counts the tool's identity's requests on the real bed.
const COUNTING_FLOW_SCHEMA: &str = "karpenter-teardown-bench";

/// The processes of the real bed, in `RealStack::pids`' order.
const REAL_COMPONENTS: [&str; 5] = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"];

/// A bed for one run: the server, a client with every right for the benchmark's own setup and
/// checks, the config of the simulated Karpenter's client, and the kubeconfig of the contenders.
async fn start_bed(
    args: &Args,
    s: &WorldSpec,
    contender: Contender,
    dir: &Path,
) -> anyhow::Result<(Server, Client, kube::Config, PathBuf)> {
    let kubeconfig = dir.join("kubeconfig");
    match args.bed {
        Bed::Sandbox => {
            let mut opts = ServerOptions { time_scale: args.time_scale, ..ServerOptions::default() };
            if let Some(n) = args.watch_history {
                opts.watch_history = n;
            }
            let server = ApiServer::start(opts).await?;
            let client = Client::try_from(server.kube_config())?;
            server.write_kubeconfig(&kubeconfig, &s.cluster)?;
            let sim = server.kube_config();
            Ok((Server::Sandbox(server), client, sim, kubeconfig))
        }
        Bed::Real => {
            let rbac = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml"))
                .context("reading deploy/rbac.yaml")?;
            // kwok ends a deleted pod when its grace period is over, as a kubelet ends a container
            // that ignores SIGTERM, so the real bed has the sandbox's critical path
            let stack = RealStack::start_full_with(&s.cluster, &rbac, PodExit::AfterGracePeriod).await?;
            let admin = stack.admin_client().await?;
            let schema = realstack::metrics::counting_flow_schema(COUNTING_FLOW_SCHEMA, realstack::TOOL_GROUP)?;
            Api::<FlowSchema>::all(admin.clone()).create(&PostParams::default(), &schema).await?;
            if contender == Contender::Kubectl {
                grant_kubectl_drain(&admin).await?;
            }
            // the simulated Karpenter acts as the admin (system:masters), whose requests APF
            // counts under its `exempt` FlowSchema, apart from the tool's identity
            let kc = Kubeconfig::read_from(stack.admin_kubeconfig())?;
            let sim = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
            std::fs::copy(stack.tool_kubeconfig(), &kubeconfig).context("copying the tool's kubeconfig")?;
            Ok((Server::Real(stack), admin, sim, kubeconfig))
        }
    }
}

/// `kubectl drain --ignore-daemonsets` reads each DaemonSet pod's owner before it skips the pod
/// (k8s.io/kubectl pkg/drain/filters.go, `daemonSetFilter`), which `deploy/rbac.yaml` does not
/// grant: the baseline's identity gets that read on top, and nothing else.
async fn grant_kubectl_drain(admin: &Client) -> anyhow::Result<()> {
    let name = "kubectl-drain-baseline";
    let role: ClusterRole = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
        "rules": [{"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get"]}],
    }))?;
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": realstack::TOOL_GROUP}],
    }))?;
    Api::<ClusterRole>::all(admin.clone()).create(&PostParams::default(), &role).await?;
    Api::<ClusterRoleBinding>::all(admin.clone()).create(&PostParams::default(), &binding).await?;
    Ok(())
}

/// The requests counted for the contenders so far: the sandbox's by verb, or the real server's
/// under the tool's FlowSchema (one total).
async fn server_requests(server: &Server, admin: &Client) -> anyhow::Result<BTreeMap<(String, String), u64>> {
    match server {
        Server::Sandbox(s) => Ok(s.requests().snapshot()),
        Server::Real(_) => {
            let req = http::Request::get("/metrics").body(Vec::new())?;
            let text = admin.request_text(req).await.context("reading kube-apiserver's /metrics")?;
            let n = realstack::metrics::dispatched_under(&text, COUNTING_FLOW_SCHEMA);
            Ok(BTreeMap::from([(("all".to_string(), String::new()), n)]))
        }
    }
}

/// CPU ticks of the bed's processes (and of this process, which holds the simulated Karpenter and,
/// on the sandbox, the API server), by name.
fn bed_ticks(server: &Server) -> Vec<(String, u64)> {
    let mut out = vec![("benchmark process".to_string(), cpu_ticks(std::process::id()))];
    if let Server::Real(stack) = server {
        for (name, pid) in REAL_COMPONENTS.iter().zip(stack.pids()) {
            out.push((name.to_string(), cpu_ticks(pid)));
        }
    }
    out
}

async fn run_one(args: &Args, bin: &Path, size: usize, contender: Contender) -> anyhow::Result<Measured> {
    let dir = tempfile::tempdir()?;
    let account = localstack::fresh_account();
    let mut s = spec(args, size);
    if args.bed == Bed::Real {
        // the real server holds Karpenter's own CRDs to their schemas and CEL rules
        let files = sandbox_sim::karpenter_crds::release_files(KarpenterVersion::default())?;
        s.karpenter_crds = Some(files.crds());
    }
    let (server, client, sim_config, kubeconfig) = start_bed(args, &s, contender, dir.path()).await?;
    let ticks0 = bed_ticks(&server);
    let t = Instant::now();
    let world = match generate(&s, &client, &Cloud::from_config(&localstack::config_as(REGION, &account).await)).await {
        Ok(w) => w,
        Err(e) => {
            if let Server::Real(stack) = &server {
                for c in ["kube-scheduler", "kwok", "kube-controller-manager"] {
                    eprintln!("bench: end of {c}'s log:\n{}", stack.log_tail(c));
                }
            }
            return Err(e.into());
        }
    };
    let generate_s = t.elapsed().as_secs_f64();
    // EKS knows the cluster as the bed's API server, as the tool's identity proof asks of it
    let eks = match &server {
        Server::Sandbox(api) => sandbox_sim::cloud::EksSpec { endpoint: api.url(), ca_pem: None, auto_mode: false },
        Server::Real(stack) => {
            sandbox_sim::cloud::EksSpec { endpoint: stack.server(), ca_pem: Some(stack.ca_pem()?), auto_mode: false }
        }
    };
    Cloud::from_config(&localstack::config_as(REGION, &account).await)
        .register_eks_cluster(&world.cluster, &eks)
        .await?;
    // kube-apiserver does not scale time: on the real bed a grace period is its seconds
    let grace_scale = if args.bed == Bed::Real { 1.0 } else { args.time_scale };
    let (critical_s, pods) = critical_path(&client, &world, grace_scale).await?;

    // The simulated Karpenter gets its own clients so its requests can be told apart.
    let sim_kube = Kube::from_config(sim_config, None)?;
    let sim_aws = Cloud::from_config(&localstack::config_as(REGION, &account).await);
    let sim = SimController::start(
        sim_kube.client.clone(),
        sim_aws.clone(),
        SimSettings {
            version: world.version,
            time_scale: args.time_scale,
            pods_per_node: u32::try_from(args.pods_per_node).unwrap_or(u32::MAX),
            ..SimSettings::new(&world.cluster, REGION)
        },
    );
    let before = server_requests(&server, &client).await?;
    let sim_before = sim_kube.calls.snapshot();
    let sim_ec2_before = sim_aws.ec2_requests();
    let ticks1 = bed_ticks(&server);

    let t = Instant::now();
    let limit = Duration::from_secs(args.run_timeout);
    let (outcome, ec2_tool, ec2_throttled, usage, tool_k8s) = match contender {
        Contender::Default | Contender::Delegate => {
            let plan = if contender == Contender::Default { "default" } else { "delegate" };
            let r = run_tool(bin, &world.cluster, &account, &kubeconfig, dir.path(), plan, limit).await?;
            (r.0, Some(r.1), Some(r.3), r.2, r.4)
        }
        Contender::Kubectl => {
            let r = run_kubectl(args, &world, &kubeconfig, dir.path(), limit).await?;
            (r.0, None, None, r.1, BTreeMap::new())
        }
        Contender::Rehearse => {
            let r = run_rehearse(args, bin, &world.cluster, &account, &kubeconfig, dir.path(), limit).await?;
            (r.0, None, None, r.1, BTreeMap::new())
        }
    };
    let makespan_s = t.elapsed().as_secs_f64();
    let ticks2 = bed_ticks(&server);
    if let Some(keep) = &args.keep {
        keep_artifacts(dir.path(), keep, size, contender)?;
    }

    let after = server_requests(&server, &client).await?;
    let sim_after = sim_kube.calls.snapshot();
    let ec2_sim = sim_aws.ec2_requests().saturating_sub(sim_ec2_before);
    sim.shutdown().await;
    let left = leftovers(&client).await;
    let outcome = match (outcome.as_str(), left) {
        // a rehearsal must leave the world as it found it
        (o, n) if contender == Contender::Rehearse => {
            let whole = world.nodes.len() * 2;
            if n == whole { o.to_string() } else { format!("{o}, but {n} of {whole} Karpenter objects left") }
        }
        (o, 0) => o.to_string(),
        (o, n) => format!("{o}, {n} left"),
    };
    match server {
        Server::Sandbox(server) => server.shutdown().await,
        // dropping the stack kills its processes
        Server::Real(stack) => drop(stack),
    }

    let mut k8s: BTreeMap<String, u64> = BTreeMap::new();
    for (key @ (verb, _), n) in &after {
        *k8s.entry(verb.clone()).or_default() += n.saturating_sub(before.get(key).copied().unwrap_or(0));
    }
    // The client's accounting names discovery and /version `other`; the server counts them as `get`.
    let mut sim_k8s = 0;
    for (key, n) in &sim_after {
        let delta = n.saturating_sub(sim_before.get(key).copied().unwrap_or(0));
        sim_k8s += delta;
        if args.bed == Bed::Real {
            // counted apart by the server already (the admin's `exempt` FlowSchema)
            continue;
        }
        let verb = key.trim_start_matches("kubernetes:");
        let verb = if verb == "other" { "get" } else { verb };
        let e = k8s.entry(verb.to_string()).or_default();
        *e = e.saturating_sub(delta);
    }
    k8s.retain(|_, n| *n > 0);
    let (k8s, k8s_server) = match args.bed {
        Bed::Sandbox => (k8s, None),
        Bed::Real => (tool_k8s, Some(k8s.values().sum())),
    };
    let secs = |t: u64| t as f64 / 100.0;
    let bed_cpu = ticks0
        .iter()
        .zip(&ticks1)
        .zip(&ticks2)
        .map(|(((name, t0), (_, t1)), (_, t2))| {
            (name.clone(), secs(t1.saturating_sub(*t0)), secs(t2.saturating_sub(*t1)))
        })
        .collect();
    Ok(Measured {
        size,
        contender: contender.label(),
        outcome,
        generate_s,
        makespan_s,
        critical_s,
        pods,
        k8s,
        sim_k8s,
        ec2_tool,
        ec2_throttled,
        ec2_sim,
        usage,
        bed: Some(args.bed),
        k8s_server,
        bed_cpu,
    })
}

/// Copies a run's report and log out of its temporary directory.
fn keep_artifacts(dir: &Path, keep: &Path, size: usize, contender: Contender) -> anyhow::Result<()> {
    std::fs::create_dir_all(keep).with_context(|| format!("creating {}", keep.display()))?;
    let label = format!("{size}-{contender:?}").to_lowercase();
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ext = match name.rsplit_once('.') {
            Some((_, e @ ("json" | "log"))) => e.to_string(),
            _ => continue,
        };
        let to = keep.join(format!("{label}.{ext}"));
        std::fs::copy(entry.path(), &to).with_context(|| format!("copying {name} to {}", to.display()))?;
    }
    Ok(())
}

/// The longest unavoidable chain of waits: every node can drain in parallel, but none is empty
/// before its slowest pod has had its grace period; instance termination adds nothing because
/// LocalStack terminates at once. Also returns the workload pods that must be evicted.
async fn critical_path(client: &Client, world: &World, time_scale: f64) -> anyhow::Result<(f64, usize)> {
    let ours: std::collections::BTreeSet<&str> = world.nodes.iter().map(|n| n.node.as_str()).collect();
    let pods: Api<Pod> = Api::all(client.clone());
    let mut per_node: BTreeMap<String, i64> = BTreeMap::new();
    let mut count = 0;
    for p in pods.list(&ListParams::default()).await?.items {
        let spec = p.spec.unwrap_or_default();
        let Some(node) = spec.node_name.filter(|n| ours.contains(n.as_str())) else { continue };
        let daemon = p.metadata.owner_references.unwrap_or_default().iter().any(|o| o.kind == "DaemonSet");
        if daemon {
            continue;
        }
        count += 1;
        let grace = spec.termination_grace_period_seconds.unwrap_or(30);
        let e = per_node.entry(node).or_default();
        *e = (*e).max(grace);
    }
    let longest = per_node.values().copied().max().unwrap_or(0);
    Ok((longest as f64 * time_scale, count))
}

/// NodeClaims and Karpenter nodes still present.
async fn leftovers(client: &Client) -> usize {
    let claims: Api<DynamicObject> = Api::all_with(client.clone(), &k8s::nodeclaim_resource());
    let nodes: Api<Node> = Api::all(client.clone());
    let c = claims.list(&ListParams::default()).await.map(|l| l.items.len()).unwrap_or(0);
    let n =
        nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.map(|l| l.items.len()).unwrap_or(0);
    c + n
}

/// A memory figure of this process (`VmRSS`, `VmHWM`) in KiB, 0 when /proc cannot say: the
/// sandbox runs in here, and its growth from run to run is what shows a leak.
fn own_memory_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// What sampling a child process tree found.
#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    /// Exit code; None when killed at the limit.
    code: Option<i32>,
    /// The largest VmHWM of any process in the tree, KiB.
    peak_kib: u64,
    /// CPU time (user + system) of the tree, seconds, as last sampled before each process ended.
    cpu_s: f64,
}

impl Usage {
    /// Adds a later command's usage (the baseline runs many kubectl commands).
    fn add(&mut self, other: Usage) {
        self.peak_kib = self.peak_kib.max(other.peak_kib);
        self.cpu_s += other.cpu_s;
    }
}

/// Runs a child to completion while sampling the peak resident memory (VmHWM) and CPU time of it
/// and its descendants every 10 ms; kills it after `limit`.
async fn run_measured(mut cmd: tokio::process::Command, limit: Duration) -> anyhow::Result<Usage> {
    let mut child = cmd.kill_on_drop(true).spawn().context("spawning")?;
    let pid = child.id().context("child pid")?;
    let deadline = tokio::time::Instant::now() + limit;
    let mut peak = 0;
    // pid → its CPU ticks as last seen: a process's last sample stands once it is gone
    let mut ticks: BTreeMap<u32, u64> = BTreeMap::new();
    let usage = |code, peak, ticks: &BTreeMap<u32, u64>| Usage {
        code,
        peak_kib: peak,
        // USER_HZ, the unit of /proc/<pid>/stat's times, is 100 on Linux
        cpu_s: ticks.values().sum::<u64>() as f64 / 100.0,
    };
    loop {
        peak = peak.max(sample_tree(pid, &mut ticks));
        tokio::select! {
            status = child.wait() => return Ok(usage(status?.code(), peak, &ticks)),
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        if tokio::time::Instant::now() >= deadline {
            child.kill().await?;
            return Ok(usage(None, peak, &ticks));
        }
    }
}

/// The largest VmHWM of `pid` and its descendants (kubectl's dispatcher runs the real client as
/// a child); records each one's CPU ticks (utime + stime, all threads) in `ticks`.
fn sample_tree(pid: u32, ticks: &mut BTreeMap<u32, u64>) -> u64 {
    let mut peak = 0;
    let mut stack = vec![pid];
    while let Some(p) = stack.pop() {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{p}/status")) {
            let hwm = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or(0);
            peak = peak.max(hwm);
        }
        let t = cpu_ticks(p);
        let e = ticks.entry(p).or_default();
        *e = (*e).max(t);
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                if let Ok(children) = std::fs::read_to_string(t.path().join("children")) {
                    stack.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
                }
            }
        }
    }
    peak
}

/// CPU ticks (utime + stime, all threads, in USER_HZ) of a process, 0 when it is gone.
fn cpu_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    // fields after the parenthesised command name; utime and stime are the 14th and 15th
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    fields.get(11..13).map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum()).unwrap_or(0)
}

fn localstack_env(cmd: &mut tokio::process::Command, account: &str) {
    cmd.env("AWS_ENDPOINT_URL", localstack::endpoint())
        .env("AWS_ACCESS_KEY_ID", account)
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true");
}

/// Runs a plan with its EC2 calls through the enforcing EC2 proxy (AWS's request limits and
/// token buckets, one budget per run like one account); returns the report's outcome, the tool's
/// EC2 calls, its peak memory, and what the proxy throttled and refused.
async fn run_tool(
    bin: &Path,
    cluster: &str,
    account: &str,
    kubeconfig: &Path,
    dir: &Path,
    plan: &str,
    limit: Duration,
) -> anyhow::Result<(String, u64, Usage, (u64, u64), BTreeMap<String, u64>)> {
    let report = dir.join(format!("report-{plan}.json"));
    let proxy = Ec2Proxy::start(&localstack::endpoint(), ProxyFaults::default()).await?;
    let run = ["run", "--yes", "--plan", plan, "--cluster", cluster, "--region", REGION];
    let cmd = tool_command(bin, &run, kubeconfig, &report, &dir.join(format!("{plan}.log")), account, &proxy.url())?;
    let usage = run_measured(cmd, limit).await?;
    let counts = proxy.counts();
    proxy.shutdown().await;
    let code = usage.code;
    let report: Value =
        std::fs::read(&report).ok().and_then(|r| serde_json::from_slice(&r).ok()).unwrap_or(Value::Null);
    let outcome = match code {
        None => "timed out".to_string(),
        Some(c) => {
            let o = report["outcome"].as_str().unwrap_or("no report");
            if c == 0 { o.to_string() } else { format!("{o} (exit {c})") }
        }
    };
    let ec2 = report["api_calls"]
        .as_object()
        .map(|m| m.iter().filter(|(k, _)| k.starts_with("ec2:")).filter_map(|(_, v)| v.as_u64()).sum())
        .unwrap_or(0);
    // the tool's own count of its Kubernetes requests, by verb (`kubernetes:get`); `throttled`
    // counts answers, not requests
    let k8s = report["api_calls"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("kubernetes:")?.to_string(), v.as_u64()?)))
                .filter(|(verb, n)| verb != "throttled" && *n > 0)
                .collect()
        })
        .unwrap_or_default();
    if code != Some(0) {
        let tail = std::fs::read_to_string(dir.join(format!("{plan}.log"))).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(20).collect();
        eprintln!("bench: {plan} plan did not finish cleanly; last log lines:");
        for l in tail.into_iter().rev() {
            eprintln!("  {l}");
        }
    }
    Ok((outcome, ec2, usage, (counts.over_budget, counts.refused), k8s))
}

/// The tool with `args`, the bed's kubeconfig, a report, JSON logs into `log`, and AWS at
/// `endpoint` as `account`.
fn tool_command(
    bin: &Path,
    args: &[&str],
    kubeconfig: &Path,
    report: &Path,
    log: &Path,
    account: &str,
    endpoint: &str,
) -> anyhow::Result<tokio::process::Command> {
    let log = std::fs::File::create(log)?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--report")
        .arg(report)
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    localstack_env(&mut cmd, account);
    cmd.env("AWS_ENDPOINT_URL", endpoint);
    Ok(cmd)
}

/// `karpenter-teardown rehearse` of the world, as a user would run it before the teardown: the
/// outcome is the prediction (`predicts clean in 163.2 s`).
async fn run_rehearse(
    args: &Args,
    bin: &Path,
    cluster: &str,
    account: &str,
    kubeconfig: &Path,
    dir: &Path,
    limit: Duration,
) -> anyhow::Result<(String, Usage)> {
    let report = dir.join("report-rehearse.json");
    let proxy = Ec2Proxy::start(&localstack::endpoint(), ProxyFaults::default()).await?;
    let scale = args.rehearse_time_scale.to_string();
    let endpoint = localstack::endpoint();
    let rehearse =
        ["rehearse", "--cluster", cluster, "--region", REGION, "--localstack", &endpoint, "--time-scale", &scale];
    let cmd = tool_command(bin, &rehearse, kubeconfig, &report, &dir.join("rehearse.log"), account, &proxy.url())?;
    let usage = run_measured(cmd, limit).await?;
    proxy.shutdown().await;
    let report: Value =
        std::fs::read(&report).ok().and_then(|r| serde_json::from_slice(&r).ok()).unwrap_or(Value::Null);
    let p = &report["rehearsal"]["prediction"];
    let outcome = match (usage.code, p["outcome"].as_str()) {
        (None, _) => "timed out".to_string(),
        (Some(_), Some(o)) => format!(
            "predicts {o} in {:.1} s (copy built in {:.1} s, played in {:.1} s)",
            p["timing"]["predicted_seconds"].as_f64().unwrap_or_default(),
            p["copy"]["load_seconds"].as_f64().unwrap_or_default(),
            p["timing"]["rehearsal_seconds"].as_f64().unwrap_or_default()
        ),
        (Some(c), None) => format!("no prediction (exit {c}): {}", report["error"].as_str().unwrap_or("no report")),
    };
    Ok((outcome, usage))
}

/// The script users write today: drain the nodes one after another, delete the NodePools, and
/// poll until Karpenter has removed every NodeClaim. Returns the outcome and kubectl's usage
/// (the drain and delete commands; the polls are not sampled).
async fn run_kubectl(
    args: &Args,
    world: &World,
    kubeconfig: &Path,
    dir: &Path,
    limit: Duration,
) -> anyhow::Result<(String, Usage)> {
    let log = std::fs::File::create(dir.join("kubectl.log"))?;
    let deadline = Instant::now() + limit;
    let mut usage = Usage::default();
    let kubectl = |extra: &[&str]| {
        let mut cmd = tokio::process::Command::new(&args.kubectl);
        cmd.arg("--kubeconfig").arg(kubeconfig).args(extra).stdin(Stdio::null());
        // kubectl's own account of the drain goes to the log (it is tens of thousands of lines)
        cmd.stdout(log.try_clone().map(Stdio::from).unwrap_or_else(|_| Stdio::null()));
        cmd.stderr(log.try_clone().map(Stdio::from).unwrap_or_else(|_| Stdio::null()));
        cmd
    };
    let left = |deadline: Instant| deadline.saturating_duration_since(Instant::now());
    for n in &world.nodes {
        let cmd = kubectl(&["drain", &n.node, "--ignore-daemonsets", "--delete-emptydir-data"]);
        let u = run_measured(cmd, left(deadline)).await?;
        usage.add(u);
        match u.code {
            Some(0) => {}
            None => return Ok(("timed out".into(), usage)),
            Some(c) => return Ok((format!("kubectl drain {} failed (exit {c})", n.node), usage)),
        }
    }
    let u = run_measured(kubectl(&["delete", "nodepools", "--all"]), left(deadline)).await?;
    usage.add(u);
    if u.code != Some(0) {
        return Ok(("kubectl delete nodepools failed".into(), usage));
    }
    loop {
        let mut get = kubectl(&["get", "nodeclaims", "-o", "name"]);
        let out = get.stdout(Stdio::piped()).output().await?;
        if out.status.success() && out.stdout.iter().all(u8::is_ascii_whitespace) {
            return Ok(("clean".into(), usage));
        }
        if Instant::now() >= deadline {
            return Ok(("timed out".into(), usage));
        }
        tokio::time::sleep(Duration::from_secs_f64(args.poll)).await;
    }
}

fn render(args: &Args, bin: &Path, rows: &[Measured]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "Teardown benchmark: {} workload pods per node, {} replicas per workload, time scale {}, grace periods \
         {} (seconds:weight, seed {}), tool `{}`.\n\n",
        args.pods_per_node,
        args.replicas,
        args.time_scale,
        GRACE_PERIODS.iter().map(|(s, w)| format!("{s}:{w}")).collect::<Vec<_>>().join(" "),
        args.seed,
        bin.display(),
    ));
    if let Some(n) = args.pdb_max_unavailable {
        out.push_str(&format!(
            "PDB-heavy: every workload's budget is `maxUnavailable: {n}`; {} spare node(s) outside Karpenter take the \
             evicted pods.\n\n",
            args.spare_nodes
        ));
    }
    out.push_str(
        "| bed | nodes | pods | contender | outcome | makespan (s) | critical path (s) | ratio | k8s requests | \
         requests/pod | requests by verb | EC2 calls (tool) | sim Karpenter k8s / EC2 | peak RSS (MiB) | CPU (s) | world generated in (s) |\n",
    );
    out.push_str("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n");
    for m in rows {
        let mut verbs = m.k8s.iter().map(|(v, n)| format!("{v} {n}")).collect::<Vec<_>>().join(", ");
        if m.k8s_server.is_some() && !verbs.is_empty() {
            verbs = format!("(the tool's own count) {verbs}");
        }
        let per_pod =
            if m.pods == 0 { "-".to_string() } else { format!("{:.2}", m.k8s_total() as f64 / m.pods as f64) };
        let ratio = if m.critical_s > 0.0 { format!("{:.2}", m.makespan_s / m.critical_s) } else { "-".into() };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} / {} | {:.1} | {:.1} | {:.0} |\n",
            match m.bed {
                Some(Bed::Real) => "real",
                _ => "sandbox",
            },
            m.size,
            m.pods,
            m.contender,
            m.outcome,
            m.makespan_s,
            m.critical_s,
            ratio,
            m.k8s_total(),
            per_pod,
            verbs,
            match (m.ec2_tool, m.ec2_throttled) {
                (Some(n), Some((0, 0))) => n.to_string(),
                (Some(n), Some((throttled, refused))) => format!("{n} ({throttled} throttled, {refused} refused)"),
                (Some(n), None) => n.to_string(),
                (None, _) => "-".into(),
            },
            m.sim_k8s,
            m.ec2_sim,
            m.usage.peak_kib as f64 / 1024.0,
            m.usage.cpu_s,
            m.generate_s,
        ));
    }
    out.push_str(
        "\nCritical path: per Karpenter node, the largest termination grace period of its workload pods × the \
         time scale; the longest of these, since nodes drain in parallel. Instance termination adds nothing: \
         LocalStack terminates at once. k8s requests are the sandbox server's counts during the run minus the \
         simulated Karpenter controller's own requests (counted by its client); requests/pod divides them by \
         the workload pods on Karpenter nodes at the start. Peak RSS is VmHWM of the tool process (for the \
         baseline: the largest of any kubectl process); CPU is the tool's user + system time (for the baseline: \
         the sum over its drain and delete commands, polls not included). The sandbox API server, the simulated \
         Karpenter and LocalStack run on the same machine and are not included.\n",
    );
    if rows.iter().any(|m| m.bed == Some(Bed::Real)) {
        out.push_str(
            "\nOn the real bed (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, fresh for each \
             run): k8s requests are kube-apiserver's own count of the tool's identity's requests \
             (`apiserver_flowcontrol_dispatched_requests_total` under a FlowSchema that matches that identity's \
             group only, read from /metrics before and after the run; the simulated Karpenter acts as an admin, \
             counted apart under `exempt`); requests by verb are the tool's own count from its report. kwok \
             deletes a pod at its deletionTimestamp, when its grace period is over, and grace periods are \
             real seconds whatever the time scale, so the critical path is the longest of them unscaled.\n",
        );
    }
    out.push_str("\nCPU seconds of the bed's processes, while the world was generated / during the run:\n\n");
    out.push_str("| bed | nodes | contender | process | generation (s) | run (s) |\n|---|---:|---|---|---:|---:|\n");
    for m in rows {
        let bed = if m.bed == Some(Bed::Real) { "real" } else { "sandbox" };
        for (name, generate, run) in &m.bed_cpu {
            out.push_str(&format!("| {bed} | {} | {} | {name} | {generate:.1} | {run:.1} |\n", m.size, m.contender));
        }
    }
    out
}
