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
    // The report counts every attempt the tool sent (a throttled call and its retry are two
    // calls, as AWS bills and throttles them), and every AWS call of the run goes through the
    // proxy: the report's figure is the proxy's, to the call.
    let aws_calls: u64 = run.report["api_calls"]
        .as_object()
        .expect("api_calls in the report")
        .iter()
        .filter(|(k, _)| !k.starts_with("kubernetes:"))
        .filter_map(|(_, v)| v.as_u64())
        .sum();
    let seen = counts.forwarded + counts.throttled + counts.failed + counts.refused + counts.over_budget;
    assert_eq!(aws_calls, seen, "the report's AWS calls are not the proxy's: {counts:?}\n{}", run.report["api_calls"]);
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

/// A drain that a budget holds until its deadline, under `--on-drain-deadline delete`, whose pod
/// deletes fail (503) for a while: each failure ends the drain's task as transient and the task
/// runs again. The deadline counts from the first attempt, so the restarts add only their
/// backoff; were each attempt to start a deadline of its own, the drain would last a deadline per
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_holds_across_restarts() {
    const DEADLINE: u64 = 6;
    const FAILED_DELETES: u64 = 6;
    let mut s = two_pool_world("faults-deadline", 2);
    s.strict_pdb = true;
    let b = bed(&s.cluster).await;
    let world = generate(&s, &b.client, &b.cloud).await.unwrap();
    let before = untouchable_nodes(&b.client, &world).await;
    let stats = b.server.requests();
    let (evictions_before, deletes_before) = (stats.count("evict", "pods"), stats.count("delete", "pods"));

    let deadline = format!("{DEADLINE}s");
    let args = ["--drain-deadline", deadline.as_str(), "--on-drain-deadline", "delete"];
    // Once the drains evict (the admission dry runs are behind), pod deletes fail until this many
    // have; then the server answers them again.
    let faults = async {
        while stats.count("evict", "pods") == evictions_before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let failing = ErrorRule { verb: Some("delete".into()), resource: Some("pods".into()), code: 503, rate: 1.0 };
        b.server.set_faults(FaultConfig { errors: vec![failing], ..FaultConfig::default() });
        while stats.count("delete", "pods") < deletes_before + FAILED_DELETES {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        b.server.set_faults(FaultConfig::default());
        // the run ends on its own
        std::future::pending::<()>().await
    };
    let run = tokio::select! {
        run = teardown(&b, &world.cluster, Consent::Yes, &args) => run,
        _ = faults => unreachable!("the fault schedule never ends"),
    };
    b.server.set_faults(FaultConfig::default());
    assert_eq!(run.code, 0, "{}", run.dump());
    assert_eq!(run.report["outcome"], "clean");
    assert!(stats.count("delete", "pods") >= deletes_before + FAILED_DELETES, "fewer deletes than failures");

    let steps = run.report["steps"].as_array().expect("steps in the report");
    let drains: Vec<&Value> = steps.iter().filter(|st| st["step"] == "drain").collect();
    assert_eq!(drains.len(), world.nodes.len(), "one drain per node: {}", run.dump());
    let restarted: Vec<&&Value> = drains.iter().filter(|d| d["attempts"].as_u64().unwrap_or(1) > 1).collect();
    assert!(!restarted.is_empty(), "no drain was restarted by the failed deletes: {}", run.dump());
    let restarts: u64 = restarted.iter().map(|d| d["attempts"].as_u64().unwrap_or(1) - 1).sum();
    assert!(restarts >= FAILED_DELETES, "{restarts} restarts for {FAILED_DELETES} failed deletes: {}", run.dump());
    for d in restarted {
        let at = |k: &str| humantime::parse_rfc3339_weak(d[k].as_str().expect("a time")).expect("RFC 3339");
        let took = at("finished").duration_since(at("started")).expect("finished after started");
        // a deadline per attempt would be at least twice the deadline from the second on
        assert!(
            took < Duration::from_secs(2 * DEADLINE),
            "a drain restarted {} times took {took:?} against a deadline of {DEADLINE}s: {d}",
            d["attempts"]
        );
    }
    assert_torn_down(&b, &world, &before).await;
    b.server.shutdown().await;
}
