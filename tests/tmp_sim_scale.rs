mod common;
use std::time::{Duration, Instant};
use karpenter_teardown::sandbox::sim::{WorldSpec, generate, SimController, SimSettings};
use karpenter_teardown::sandbox::{ApiServer, ServerOptions};
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale() {
    let n: usize = std::env::var("SIM_NODES").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let aws = common::localstack("us-west-2").await;
    let server = ApiServer::start(ServerOptions { time_scale: 0.01, ..ServerOptions::default() }).await.unwrap();
    let client = kube::Client::try_from(server.kube_config()).unwrap();
    let spec = WorldSpec { cluster: common::unique_cluster("scale"), nodes: n, settle_timeout: Duration::from_secs(300), ..WorldSpec::default() };
    let t = Instant::now();
    let world = generate(&spec, &client, &aws).await.unwrap();
    eprintln!("generated {} nodes in {:?}", world.nodes.len(), t.elapsed());
    let mut s = SimSettings::new(&world.cluster, "us-west-2"); s.time_scale = 0.05;
    let mut ctl = SimController::start(client.clone(), aws.clone(), s);
    let t = Instant::now();
    assert!(ctl.wait_active(true, Duration::from_secs(60)).await);
    eprintln!("controller active after {:?}", t.elapsed());
    tokio::time::sleep(Duration::from_secs(3)).await;
    eprintln!("stats idle {:?}", ctl.stats());
    ctl.shutdown().await;
    server.shutdown().await;
}
