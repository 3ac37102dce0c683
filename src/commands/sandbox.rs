//! `sandbox serve|up|demo`: the built-in sandbox (emulated API server, simulated Karpenter,
//! LocalStack) from the command line. Built only with the `sandbox` feature (on by default); a
//! lean build of the tool leaves it, and its HTTP server and CEL dependencies, out.

use std::io::Write;

use tokio_util::sync::CancellationToken;

use super::{fail, watch_signals};
use crate::cli::SandboxCommand;
use crate::exit::Exit;
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::cloud::Cloud;
use sandbox_sim::localstack;

/// Runs a `sandbox` subcommand.
pub(super) async fn sandbox_command(cmd: SandboxCommand) -> Exit {
    match cmd {
        SandboxCommand::Serve(args) => {
            let opts = ServerOptions { port: args.port, ..Default::default() };
            let server = match ApiServer::start(opts).await {
                Ok(s) => s,
                Err(e) => return fail(&e.into()),
            };
            if let Err(e) = server.write_kubeconfig(&args.kubeconfig_out, &args.cluster) {
                server.shutdown().await;
                return fail(&e.into());
            }
            println!("{}", server.url());
            println!("kubeconfig: {} (context {})", args.kubeconfig_out.display(), args.cluster);
            let _ = std::io::stdout().flush();
            let stop = CancellationToken::new();
            let signals = watch_signals(stop.clone());
            stop.cancelled().await;
            signals.abort();
            server.shutdown().await;
            Exit::Clean
        }
        SandboxCommand::Up(args) if args.from_snapshot.is_some() => sandbox_up_from_snapshot(&args).await,
        SandboxCommand::Demo(args) if args.from_snapshot.is_some() => {
            eprintln!(
                "error: sandbox demo generates its own cluster; to play a teardown on a snapshot use `karpenter-teardown rehearse --from-snapshot FILE`, to explore one `sandbox up --from-snapshot FILE`"
            );
            Exit::BadInput
        }
        SandboxCommand::Up(args) => sandbox_up(&args, false).await,
        SandboxCommand::Demo(args) => sandbox_up(&args, true).await,
    }
}

/// Workloads per namespace in a generated cluster.
const WORKLOADS_PER_NAMESPACE: usize = 25;

/// The region the sandbox plays in.
const SANDBOX_REGION: &str = "us-west-2";

async fn sandbox_up(args: &crate::cli::SandboxUpArgs, demo: bool) -> Exit {
    use sandbox_sim::{KarpenterVersion, SimController, SimSettings, WorldSpec, generate};
    let version = match args.karpenter {
        crate::cli::KarpenterVersionArg::V1_14 => KarpenterVersion::V1_14,
        crate::cli::KarpenterVersionArg::V1_0 => KarpenterVersion::V1_0,
    };
    let aws = match localstack::config(SANDBOX_REGION).await {
        Ok(config) => Cloud::from_config(&config),
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::BadInput;
        }
    };
    let opts = ServerOptions { port: args.port, time_scale: args.time_scale, ..Default::default() };
    let server = match ApiServer::start(opts).await {
        Ok(s) => s,
        Err(e) => return fail(&e.into()),
    };
    let tmp = std::env::temp_dir().join(format!("karpenter-teardown-sandbox-{}.kubeconfig", std::process::id()));
    let kubeconfig = args.kubeconfig_out.clone().unwrap_or(tmp);
    if let Err(e) = server.write_kubeconfig(&kubeconfig, &args.cluster) {
        server.shutdown().await;
        return fail(&e.into());
    }
    // EKS (LocalStack's) knows the sandbox's API server as the cluster, as EKS knows a real one
    let eks = sandbox_sim::cloud::EksSpec { endpoint: server.url(), ..Default::default() };
    if let Err(e) = aws.register_eks_cluster(&args.cluster, &eks).await {
        server.shutdown().await;
        eprintln!(
            "error: cannot register the sandbox cluster with LocalStack's EKS: {e}; restart LocalStack with localstack/down and localstack/up"
        );
        return Exit::BadInput;
    }
    let client = match kube::Client::try_from(server.kube_config()) {
        Ok(c) => c,
        Err(e) => {
            server.shutdown().await;
            eprintln!("error: cannot build a client for the sandbox: {e}");
            return Exit::Failure;
        }
    };
    let base = WorldSpec::named(&args.cluster);
    let workloads = (args.nodes * args.pods_per_node).div_ceil(base.replicas_per_workload.max(1));
    let spec = WorldSpec {
        cluster: args.cluster.clone(),
        nodes: args.nodes,
        pods_per_node: args.pods_per_node,
        version,
        // large clusters spread their workloads over namespaces, as real ones do (one namespace
        // of thousands of workloads makes the sandbox's per-namespace passes quadratic)
        workload_namespaces: workloads.div_ceil(WORKLOADS_PER_NAMESPACE).max(1),
        settle_timeout: std::time::Duration::from_secs(60 + args.nodes as u64 / 2),
        ..base
    };
    println!(
        "sandbox: generating cluster {} ({} Karpenter nodes, Karpenter {})...",
        spec.cluster,
        spec.nodes,
        version.as_str()
    );
    let world = match generate(&spec, &client, &aws).await {
        Ok(w) => w,
        Err(e) => {
            server.shutdown().await;
            eprintln!("error: cannot generate the sandbox cluster: {e}");
            return Exit::Failure;
        }
    };
    let reconcilers = if args.gitops {
        match // the hand-written CRDs: the sandbox runs where Go may not be
        sandbox_sim::gitops::adopt(&client, &world, &sandbox_sim::gitops::crds()).await {
            Ok(g) => {
                for o in &g.owners {
                    println!("sandbox: GitOps owner {o} reconciles (simulated)");
                }
                Some(sandbox_sim::gitops::GitopsSim::start(client.clone(), &g, Default::default()))
            }
            Err(e) => {
                server.shutdown().await;
                eprintln!("error: cannot put the sandbox cluster under GitOps: {e}");
                return Exit::Failure;
            }
        }
    } else {
        None
    };
    let sim = SimController::start(
        client.clone(),
        aws.clone(),
        SimSettings { version, time_scale: args.time_scale, ..SimSettings::new(&world.cluster, SANDBOX_REGION) },
    );
    println!("sandbox: API server {} ; kubeconfig {} (context {})", server.url(), kubeconfig.display(), args.cluster);
    let exit =
        if demo { sandbox_demo(&kubeconfig, &world, &aws, args.gitops).await } else { serve_until_interrupted().await };
    sim.shutdown().await;
    if let Some(r) = reconcilers {
        r.shutdown().await;
    }
    server.shutdown().await;
    if args.kubeconfig_out.is_none() {
        let _ = std::fs::remove_file(&kubeconfig);
    }
    exit
}

/// `sandbox up --from-snapshot`: serves a copy of the snapshot's cluster (the one `rehearse`
/// plays on) for kubectl, with the simulated Karpenter at the snapshot's release and liveness and
/// the AWS side in a private LocalStack account.
async fn sandbox_up_from_snapshot(args: &crate::cli::SandboxUpArgs) -> Exit {
    use crate::rehearse::load::{LoadOptions, load};
    let Some(path) = &args.from_snapshot else { return Exit::BadInput };
    let mut snap = match crate::snapshot::Snapshot::load(path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::BadInput;
        }
    };
    let opts = LoadOptions { time_scale: args.time_scale, localstack: localstack::endpoint(), port: args.port };
    let copy = match load(&mut snap, &opts).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return if matches!(e, crate::rehearse::RehearseError::LocalStack { .. }) {
                Exit::BadInput
            } else {
                Exit::Failure
            };
        }
    };
    let tmp = std::env::temp_dir().join(format!("karpenter-teardown-copy-{}.kubeconfig", std::process::id()));
    let kubeconfig = args.kubeconfig_out.clone().unwrap_or(tmp);
    if let Err(e) = copy.server.write_kubeconfig(&kubeconfig, &snap.cluster) {
        copy.shutdown().await;
        return fail(&e.into());
    }
    println!(
        "sandbox: a copy of {} ({} objects, {} instances in LocalStack account {}; Karpenter {} simulated, controller {})",
        snap.cluster,
        copy.objects,
        copy.instances.len(),
        copy.account,
        copy.version.as_str(),
        if copy.sim.is_active() { "live" } else { "not running" }
    );
    println!(
        "sandbox: API server {} ; kubeconfig {} (context {})",
        copy.server.url(),
        kubeconfig.display(),
        snap.cluster
    );
    serve_until_interrupted().await;
    copy.shutdown().await;
    if args.kubeconfig_out.is_none() {
        let _ = std::fs::remove_file(&kubeconfig);
    }
    Exit::Clean
}

/// Says so, and waits for Ctrl-C or SIGTERM.
async fn serve_until_interrupted() -> Exit {
    println!("sandbox: serving until interrupted (Ctrl-C)");
    let _ = std::io::stdout().flush();
    let stop = CancellationToken::new();
    let signals = watch_signals(stop.clone());
    stop.cancelled().await;
    signals.abort();
    Exit::Clean
}

/// Runs this very binary against the sandbox, as a user would, and shows what is left.
async fn sandbox_demo(kubeconfig: &std::path::Path, world: &sandbox_sim::World, aws: &Cloud, gitops: bool) -> Exit {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this program's own path to run the teardown: {e}");
            return Exit::Failure;
        }
    };
    let report = kubeconfig.with_extension("report.json");
    let extra: &[&str] = if gitops { &["--pause-gitops"] } else { &[] };
    println!(
        "sandbox: $ karpenter-teardown run --cluster {} --region {SANDBOX_REGION} --kubeconfig {} --yes --report {}{}",
        world.cluster,
        kubeconfig.display(),
        report.display(),
        extra.iter().map(|a| format!(" {a}")).collect::<String>()
    );
    let _ = std::io::stdout().flush();
    let status = tokio::process::Command::new(exe)
        .args(["run", "--cluster", &world.cluster, "--region", SANDBOX_REGION, "--yes", "--kubeconfig"])
        .envs(localstack::child_env(SANDBOX_REGION))
        .arg(kubeconfig)
        .arg("--report")
        .arg(&report)
        .args(extra)
        .kill_on_drop(true)
        .status()
        .await;
    let code = match status {
        Ok(s) => s.code().unwrap_or(1),
        Err(e) => {
            eprintln!("error: cannot run the teardown: {e}");
            return Exit::Failure;
        }
    };
    // the run printed its summary above; the report itself is hundreds of lines of JSON, read
    // from its file (or drawn as a timeline) rather than poured onto the terminal
    if report.exists() {
        println!(
            "sandbox: the report is {}; as a timeline: karpenter-teardown report timeline {}",
            report.display(),
            report.display()
        );
    }
    let mut ids = world.karpenter_instance_ids();
    let managed = world.managed_instance_ids();
    ids.extend(managed.iter().cloned());
    ids.extend(world.decoy_instances.iter().cloned());
    match aws.instances_by_id(&ids).await {
        Ok(found) => {
            println!("sandbox: instances in LocalStack after the teardown:");
            for i in found {
                let role = if managed.contains(&i.id) {
                    "managed node group (must survive)"
                } else if world.decoy_instances.contains(&i.id) {
                    "other cluster's decoy (must survive)"
                } else {
                    "Karpenter (must be terminated)"
                };
                println!("  {:<22} {:<14} {role}", i.id, i.state);
            }
        }
        Err(e) => eprintln!("warning: cannot list the instances: {e}"),
    }
    Exit::from_code(u8::try_from(code).unwrap_or(1))
}
