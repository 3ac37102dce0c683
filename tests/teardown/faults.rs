//! Faults: the sandbox API server answers a share of requests with 429/500/503, adds latency and
//! cuts watches; an EC2 proxy in front of LocalStack throttles (`RequestLimitExceeded`) and fails
//! a share of EC2 calls. The teardown must ride them out: exit 0 and the same end state.

use crate::common;

use std::time::Duration;

use crate::common::safety::*;
use sandbox_apiserver::ErrorRule;
use sandbox_apiserver::FaultConfig;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
use sandbox_sim::generate;
use serde_json::Value;

/// 10% of every verb's requests fail, spread over 429, 500 and 503; 30 ms on each request;
/// watches cut every 3 s.
fn kubernetes_faults(seed: u64) -> FaultConfig {
    let rule = |code| ErrorRule { verb: None, resource: None, code, rate: 0.034 };
    FaultConfig {
        latency: Duration::from_millis(30),
        errors: vec![rule(429), rule(500), rule(503)],
        drop_watches_every: Some(Duration::from_secs(3)),
        seed,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_errors_latency_and_watch_drops() {
    let s = two_pool_world("faults-k8s", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let served_before = b.server.requests().total();
    b.server.set_faults(kubernetes_faults(42));

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    // the checks below read through the same server: no faults for them
    b.server.set_faults(FaultConfig::default());
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean");
    assert_torn_down(&b, &world, &before).await;
    assert!(b.server.requests().total() > served_before, "the run made no requests");
    let calls = run.report["api_calls"].as_object().expect("api_calls in the report");
    assert!(calls.keys().any(|k| k.starts_with("kubernetes:")), "{calls:?}");
    // The injected 429s are API Priority and Fairness's (plain text, Retry-After):
    // counted as throttling, and never reported as a PodDisruptionBudget blocking anything
    assert!(calls.get("kubernetes:throttled").and_then(Value::as_u64).unwrap_or(0) > 0, "{calls:?}");
    let blockers = run.report["blockers"].as_array().expect("blockers in the report");
    assert!(
        !blockers.iter().any(|b| b["kind"] == "pdb" || b["kind"] == "pod"),
        "throttling taken for a PDB: {blockers:?}"
    );
    // a tenth of the requests failed: some tasks needed more than one attempt, and the report says so
    let steps = run.report["steps"].as_array().expect("steps in the report");
    let retries: u64 = steps.iter().map(|st| st["attempts"].as_u64().unwrap_or(1).saturating_sub(1)).sum();
    assert!(retries > 0, "no retries counted under 10% API errors: {}", run.dump());
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ec2_throttling_and_errors() {
    let s = two_pool_world("faults-ec2", 4);
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let proxy = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults { throttle_rate: 0.1, error_rate: 0.05, seed: 7 })
        .await
        .unwrap();

    let inv = Invocation { args: vec!["--yes"], env: vec![("AWS_ENDPOINT_URL", proxy.url())], ..Invocation::default() };
    let run = tool(&b, "run", &world.cluster, &inv).await;
    let counts = proxy.counts();
    assert_eq!(run.code, 0, "{}\nproxy: {counts:?}", run.dump());
    assert_eq!(run.report["outcome"], "clean");
    assert!(counts.throttled + counts.failed > 0, "the proxy injected nothing: {counts:?}");
    assert_eq!(counts.upstream_errors, 0, "{counts:?}");
    // what the report says about it: calls by operation, retries not told apart (see the notes)
    let ec2_calls: u64 = run.report["api_calls"]
        .as_object()
        .map(|m| m.iter().filter(|(k, _)| k.starts_with("ec2:")).filter_map(|(_, v)| v.as_u64()).sum())
        .unwrap_or(0);
    eprintln!("proxy {counts:?}; report ec2 calls {ec2_calls}");
    assert_torn_down(&b, &world, &before).await;
    proxy.shutdown().await;
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ec2_proxy_forwards_and_throttles_through_the_sdk() {
    // every EC2 call throttled, with the SDK's retries off: the error reaches the caller as
    // EC2's own throttling code; with no faults the same call goes through to LocalStack
    let proxy = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults { throttle_rate: 1.0, ..ProxyFaults::default() })
        .await
        .unwrap();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(REGION))
        .endpoint_url(proxy.url())
        .credentials_provider(aws_credential_types::Credentials::new("test", "test", None, None, "tests"))
        .retry_config(aws_config::retry::RetryConfig::disabled())
        .load()
        .await;
    let aws = karpenter_teardown::aws::AwsClients::from_config(&config).await.unwrap();
    let err = aws.ec2.launch_templates("nobody").await.unwrap_err();
    assert_eq!(err.code(), Some("RequestLimitExceeded"), "{err}");
    proxy.set_faults(ProxyFaults::default());
    assert!(aws.ec2.launch_templates("nobody").await.unwrap().is_empty());
    let c = proxy.counts();
    // one throttled answer; the clean listing may take more than one call (two tag filters)
    assert_eq!(c.throttled, 1, "{c:?}");
    assert!(c.forwarded >= 1, "{c:?}");
    proxy.shutdown().await;
}
