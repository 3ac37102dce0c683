//! `--release load-balancers` at scale: a generated cluster whose Load Balancer Controller (the
//! test bed's stand-in, `sandbox_sim::lbc`, on a managed node) holds N Services of type
//! LoadBalancer, each with a network load balancer, a target group and a security group in
//! LocalStack; one `run --yes --release load-balancers` of the release build. Prints the run's
//! time, how long the release itself took, and the tool's requests.
//!
//! ```text
//! localstack/up
//! cargo build --release --bin karpenter-teardown
//! cargo bench --bench release -- --load-balancers 50
//! ```
//!
//! LocalStack deletes a load balancer at once, where ELBv2 takes seconds to minutes: the figure
//! is the tool's own cost (its requests, its polling), not AWS's deletion latency.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use sandbox_apiserver::{ApiServer, ServerOptions};
use sandbox_sim::cloud::{Cloud, EksSpec};
use sandbox_sim::{WorldSpec, generate, localstack, naming};
use serde_json::{Value, json};

const REGION: &str = "us-west-2";
const LBC: &str = "aws-load-balancer-controller";

#[derive(Parser, Debug)]
#[command(about = "Benchmarks karpenter-teardown's release of the Load Balancer Controller's Services")]
struct Args {
    /// Services of type LoadBalancer, each with its load balancer, target group and security group.
    #[arg(long, default_value_t = 50)]
    load_balancers: usize,
    /// Karpenter nodes of the generated cluster.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// The binary to run.
    #[arg(long, default_value = "target/release/karpenter-teardown")]
    bin: PathBuf,
    /// Cargo passes --bench to a harness-less bench.
    #[arg(long, hide = true)]
    bench: bool,
}

fn object<T: serde::de::DeserializeOwned>(v: Value) -> anyhow::Result<T> {
    Ok(serde_json::from_value(v)?)
}

/// The stand-in's count of what it made in AWS for the cluster (load balancers, target groups
/// and security groups).
async fn made(aws: &karpenter_teardown::aws::AwsClients, cluster: &str) -> anyhow::Result<usize> {
    Ok(karpenter_teardown::verify::load_balancing(aws, cluster).await?.len())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !args.bin.exists() {
        bail!("{} is missing: cargo build --release --bin karpenter-teardown", args.bin.display());
    }
    let account = localstack::fresh_account();
    let config = localstack::config_as(REGION, &account).await;
    let cloud = Cloud::from_config(&config);
    cloud.ping().await.context("LocalStack does not answer: localstack/up")?;
    let server = ApiServer::start(ServerOptions { time_scale: 0.05, ..ServerOptions::default() }).await?;
    let client = Client::try_from(server.kube_config())?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    let cluster = format!("bench-release-{account}");
    server.write_kubeconfig(&kubeconfig, &cluster)?;
    let spec = WorldSpec {
        cluster: cluster.clone(),
        nodes: args.nodes,
        pods_per_node: 2,
        managed_nodes: 2,
        concurrency: 16,
        ..WorldSpec::default()
    };
    let world = generate(&spec, &client, &cloud).await?;
    cloud.register_eks_cluster(&cluster, &EksSpec { endpoint: server.url(), ca_pem: None, auto_mode: false }).await?;
    let karpenter: Api<Deployment> = Api::namespaced(client.clone(), naming::KARPENTER_NAMESPACE);
    karpenter
        .patch(naming::KARPENTER_NAME, &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 0}})))
        .await?;

    // the controller's Deployment and its pod on a managed node: it runs through the drain
    let pp = PostParams::default();
    let labels = json!({"app.kubernetes.io/name": LBC, "app.kubernetes.io/instance": LBC});
    let deployment: Deployment = object(json!({
        "metadata": {"name": LBC, "namespace": "kube-system", "labels": {"app.kubernetes.io/name": LBC}},
        "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "controller", "image": "x"}]}}},
    }))?;
    Api::<Deployment>::namespaced(client.clone(), "kube-system").create(&pp, &deployment).await?;
    let node = &world.managed_nodes.first().context("the world has no managed node")?.node;
    let pod: Pod = object(json!({
        "metadata": {"name": "lbc-0", "namespace": "kube-system", "labels": labels},
        "spec": {"nodeName": node, "tolerations": [{"operator": "Exists"}], "containers": [{"name": "controller", "image": "x"}]},
    }))?;
    Api::<Pod>::namespaced(client.clone(), "kube-system").create(&pp, &pod).await?;
    let lbc = sandbox_sim::lbc::start(client.clone(), &config, &cluster, Duration::from_millis(100));

    let ns: Namespace = object(json!({"metadata": {"name": "shop"}}))?;
    Api::<Namespace>::all(client.clone()).create(&pp, &ns).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    for i in 0..args.load_balancers {
        let svc: Service = object(json!({"metadata": {"name": format!("svc-{i}")},
                                         "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}}))?;
        services.create(&pp, &svc).await?;
    }
    let aws = karpenter_teardown::aws::AwsClients::from_config(&config).await?;
    let t = Instant::now();
    while made(&aws, &cluster).await? < 3 * args.load_balancers {
        if t.elapsed() > Duration::from_secs(600) {
            bail!(
                "the stand-in made {} of {} objects in 10 minutes",
                made(&aws, &cluster).await?,
                3 * args.load_balancers
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "bench: {} load balancers with their target groups and security groups made in {:.1?}",
        args.load_balancers,
        t.elapsed()
    );

    let report = dir.path().join("report.json");
    let t = Instant::now();
    let out = tokio::process::Command::new(&args.bin)
        .args([
            "run",
            "--yes",
            "--release",
            "load-balancers",
            "--cluster",
            &cluster,
            "--region",
            REGION,
            "--kubeconfig",
        ])
        .arg(&kubeconfig)
        .arg("--report")
        .arg(&report)
        .env("AWS_ENDPOINT_URL", localstack::endpoint())
        .env("AWS_ACCESS_KEY_ID", &account)
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .await?;
    let wall = t.elapsed().as_secs_f64();
    lbc.shutdown().await;
    server.shutdown().await;
    let report: Value = serde_json::from_slice(&std::fs::read(&report)?)?;
    if out.status.code() != Some(0) {
        bail!("the run ended with {:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr));
    }
    let steps = report["steps"].as_array().context("no steps in the report")?;
    let release = steps.iter().find(|s| s["step"] == "release").context("no release step")?;
    let at = |field: &str| humantime::parse_rfc3339_weak(release[field].as_str().unwrap_or_default());
    let release_s = at("finished")?.duration_since(at("started")?)?.as_secs_f64();
    let calls = report["api_calls"].as_object().context("no api_calls")?;
    let sum = |prefix: &str| -> u64 {
        calls.iter().filter(|(k, _)| k.starts_with(prefix)).filter_map(|(_, v)| v.as_u64()).sum()
    };
    let kubernetes = sum("kubernetes:") - calls.get("kubernetes:throttled").and_then(Value::as_u64).unwrap_or(0);
    println!(
        "| load balancers | run (s) | release (s) | Kubernetes requests | ELB requests | EC2 requests | left in AWS |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {wall:.1} | {release_s:.1} | {kubernetes} | {} | {} | {} |",
        args.load_balancers,
        sum("elasticloadbalancing:"),
        sum("ec2:"),
        report["leftovers"]["load_balancing"].as_array().map(Vec::len).unwrap_or(0)
    );
    Ok(())
}
