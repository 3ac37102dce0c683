//! `sweep` at scale: `--clusters` destroyed EKS clusters of `--instances-per-cluster` Karpenter
//! instances each, every one with a launch template and an instance profile as Karpenter leaves
//! them, in one region of a fresh LocalStack account, reached through the sandbox's EC2 proxy (the
//! request limits and throttling buckets of real EC2, `TerminateInstances`' resource bucket of
//! 1,000 instances refilled at 20 a second among them, and instances that stay `shutting-down` for
//! `--shutting-down` seconds). Three runs of the release build: the dry run, `sweep --yes`, and a
//! last sweep that must find nothing. Prints each run's time, exit code and requests by action,
//! and how many requests EC2 would have throttled.
//!
//! ```text
//! localstack/up
//! cargo build --release --bin karpenter-teardown
//! cargo bench --bench sweep -- --clusters 50 --instances-per-cluster 100
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine as _;
use clap::Parser;
use sandbox_sim::cloud::Cloud;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
use sandbox_sim::ec2time::Ec2Timing;
use sandbox_sim::{localstack, naming};

#[derive(Parser, Debug)]
#[command(about = "Benchmarks karpenter-teardown sweep over many destroyed clusters' leftovers")]
struct Args {
    /// Destroyed clusters whose leftovers are swept.
    #[arg(long, default_value_t = 50)]
    clusters: usize,
    /// Running Karpenter instances each destroyed cluster left.
    #[arg(long, default_value_t = 100)]
    instances_per_cluster: usize,
    /// How long a terminated instance stays `shutting-down` (real EC2: tens of seconds to minutes).
    #[arg(long, default_value_t = 30)]
    shutting_down: u64,
    /// The region swept (a fresh LocalStack account is used, so nothing else is there).
    #[arg(long, default_value = "eu-west-3")]
    region: String,
    /// The binary to run.
    #[arg(long, default_value = "target/release/karpenter-teardown")]
    bin: PathBuf,
    /// Cargo passes --bench to a harness-less bench.
    #[arg(long, hide = true)]
    bench: bool,
}

/// What a destroyed cluster left: `instances` running instances launched by Karpenter's default
/// pool, its launch template and its instance profile, all with the user data and tags Karpenter
/// gives them.
async fn leave_behind(
    ec2: &aws_sdk_ec2::Client,
    cloud: &Cloud,
    region: &str,
    cluster: &str,
    instances: usize,
) -> anyhow::Result<()> {
    use aws_sdk_ec2::types::{InstanceType, RequestLaunchTemplateData, ResourceType};
    let user_data = base64::engine::general_purpose::STANDARD.encode(format!(
        "apiVersion: node.eks.aws/v1alpha1\nkind: NodeConfig\nspec:\n  cluster:\n    name: {cluster}\n    \
         apiServerEndpoint: https://0123456789ABCDEF.gr7.{region}.eks.amazonaws.com\n"
    ));
    let tags = naming::launch_tags(cluster, "default", "default");
    let mut left = instances;
    while left > 0 {
        // RunInstances launches at most 100 in LocalStack's default quota per call here
        let n = left.min(100) as i32;
        ec2.run_instances()
            .image_id(naming::IMAGE_ID)
            .instance_type(InstanceType::M5Large)
            .min_count(n)
            .max_count(n)
            .user_data(&user_data)
            .tag_specifications(sandbox_sim::cloud::tag_spec(ResourceType::Instance, &tags))
            .send()
            .await
            .with_context(|| format!("launching {cluster}'s instances"))?;
        left -= n as usize;
    }
    let mut lt_tags = tags.clone();
    lt_tags.remove(karpenter_teardown::karpenter::TAG_NODEPOOL);
    ec2.create_launch_template()
        .launch_template_name(format!("karpenter.k8s.aws/{cluster}"))
        .launch_template_data(
            RequestLaunchTemplateData::builder().image_id(naming::IMAGE_ID).user_data(&user_data).build(),
        )
        .tag_specifications(sandbox_sim::cloud::tag_spec(ResourceType::LaunchTemplate, &lt_tags))
        .send()
        .await
        .with_context(|| format!("creating {cluster}'s launch template"))?;
    let profile_tags = sandbox_sim::karpenter::instance_profile_tags(cluster, region, "default");
    cloud
        .create_instance_profile(
            &format!("{cluster}_1234567"),
            &format!("/karpenter/{region}/{cluster}/uid-1/"),
            &profile_tags,
        )
        .await
        .with_context(|| format!("creating {cluster}'s instance profile"))?;
    Ok(())
}

struct Measured {
    seconds: f64,
    code: i32,
    requests: BTreeMap<String, u64>,
    over_budget: u64,
}

async fn measure(
    args: &Args,
    proxy: &Ec2Proxy,
    account: &str,
    dir: &std::path::Path,
    extra: &[&str],
) -> anyhow::Result<Measured> {
    let (before, budget_before) = (proxy.actions(), proxy.counts().over_budget);
    let started = Instant::now();
    let out = tokio::process::Command::new(&args.bin)
        .args(["sweep", "--region", &args.region, "--min-age", "0s", "--report"])
        .arg(dir.join("sweep.json"))
        .args(extra)
        .env("AWS_ENDPOINT_URL", proxy.url())
        .env("AWS_ACCESS_KEY_ID", account)
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json")
        .output()
        .await?;
    let seconds = started.elapsed().as_secs_f64();
    let requests = proxy
        .actions()
        .into_iter()
        .map(|(action, n)| (action.clone(), n - before.get(&action).copied().unwrap_or_default()))
        .filter(|(_, n)| *n > 0)
        .collect();
    let code = out.status.code().unwrap_or(-1);
    if ![0, 4].contains(&code) {
        bail!("sweep {extra:?} exited {code}:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(Measured { seconds, code, requests, over_budget: proxy.counts().over_budget - budget_before })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !args.bin.exists() {
        bail!("{} is missing: cargo build --release --bin karpenter-teardown", args.bin.display());
    }
    let account = localstack::fresh_account();
    let config = localstack::config_as(&args.region, &account).await;
    let cloud = Cloud::from_config(&config);
    cloud.ping().await.context("LocalStack does not answer: localstack/up")?;
    let ec2 = aws_sdk_ec2::Client::new(&config);
    let made = Instant::now();
    for c in 0..args.clusters {
        leave_behind(&ec2, &cloud, &args.region, &format!("bench-sweep-{c:03}"), args.instances_per_cluster).await?;
    }
    let total = args.clusters * args.instances_per_cluster;
    println!(
        "{} destroyed clusters, {total} instances, {} launch templates and instance profiles made in {:.0} s",
        args.clusters,
        args.clusters,
        made.elapsed().as_secs_f64()
    );
    let proxy = Ec2Proxy::start(&localstack::endpoint(), ProxyFaults::default()).await?;
    let shutting_down = Duration::from_secs(args.shutting_down);
    proxy.control().set_timing(Ec2Timing { shutting_down, stale_reads: Duration::from_secs(2).min(shutting_down) });
    let dir = tempfile::tempdir()?;
    for (name, extra) in [("dry run", &[][..]), ("--yes", &["--yes"][..]), ("again", &["--yes"][..])] {
        let m = measure(&args, &proxy, &account, dir.path(), extra).await?;
        let sum: u64 = m.requests.values().sum();
        println!(
            "sweep {name}: exit {}, {:.1} s, {sum} requests ({} over EC2's budget): {:?}",
            m.code, m.seconds, m.over_budget, m.requests
        );
        if name == "again" && m.code != 0 {
            bail!("the sweep after --yes still found orphans (exit {})", m.code);
        }
    }
    proxy.shutdown().await;
    Ok(())
}
