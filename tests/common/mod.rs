//! Test-bed helpers shared by the integration tests: LocalStack clients and unique names.
#![allow(dead_code)]

pub mod e2e;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use aws_config::{BehaviorVersion, Region};
use aws_credential_types::Credentials;
use karpenter_teardown::aws::AwsClients;

/// Where `localstack/up` serves LocalStack.
pub const LOCALSTACK: &str = "http://127.0.0.1:4566";

/// Fails the test with the fix when LocalStack does not answer (it is part of the README's test
/// command, so a missing LocalStack is a broken test bed, never a reason to skip).
pub fn require_localstack() {
    if std::net::TcpStream::connect_timeout(&"127.0.0.1:4566".parse().unwrap(), std::time::Duration::from_secs(2))
        .is_err()
    {
        panic!(
            "LocalStack is not running on 127.0.0.1:4566: start it with `localstack/up` (the README's test command does)"
        );
    }
}

/// SDK clients pointed at LocalStack with its dummy credentials.
pub async fn localstack(region: &str) -> AwsClients {
    require_localstack();
    let config = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .endpoint_url(LOCALSTACK)
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .load()
        .await;
    AwsClients::from_config(&config).await.expect("LocalStack clients")
}

/// The environment a spawned `karpenter-teardown` needs to reach LocalStack.
pub fn localstack_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("AWS_ENDPOINT_URL", LOCALSTACK),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ]
}

/// A cluster name no other test (or earlier run against the same LocalStack) uses.
pub fn unique_cluster(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{prefix}-{}-{nanos:x}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}
