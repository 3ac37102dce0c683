//! The sandbox's AWS: always LocalStack, never a real account. The endpoint is
//! `AWS_ENDPOINT_URL` when set (another LocalStack), else `localstack/up`'s 127.0.0.1:4566, with
//! LocalStack's dummy credentials, so a sandbox command cannot reach real AWS by accident.

use aws_config::{BehaviorVersion, Region};
use aws_credential_types::Credentials;

use crate::cloud::Cloud;

/// Where `localstack/up` serves LocalStack.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:4566";

/// LocalStack is not answering.
#[derive(Debug, thiserror::Error)]
#[error(
    "LocalStack does not answer at {endpoint} ({detail}); start it with `localstack/up` (or point AWS_ENDPOINT_URL at yours)"
)]
pub struct LocalStackDown {
    /// The endpoint tried.
    pub endpoint: String,
    /// What failed.
    pub detail: String,
}

/// The LocalStack endpoint the sandbox uses.
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| DEFAULT_ENDPOINT.to_string())
}

/// The environment a child `karpenter-teardown` needs to reach the same LocalStack.
pub fn child_env(region: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", region.to_string()),
        ("AWS_EC2_METADATA_DISABLED", "true".into()),
    ]
}

/// A LocalStack account of its own for one benchmark run: LocalStack takes a 12-digit access key
/// id as the account, and each account has its own EC2 state. Every run then starts from an empty
/// account instead of paying for the instances of the runs before it (LocalStack's
/// DescribeInstances slows down with every instance it holds, terminated ones included).
pub fn fresh_account() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{:012}", (nanos / 1000) % 1_000_000_000_000)
}

/// The SDK configuration for LocalStack in `region` as the account `access_key` names (LocalStack
/// takes a 12-digit access key as the account id; "test" is its default account).
pub async fn config_as(region: &str, access_key: &str) -> aws_config::SdkConfig {
    config_at(&endpoint(), region, access_key).await
}

/// [`config_as`] for the LocalStack at `endpoint`, whatever `AWS_ENDPOINT_URL` says (a rehearsal
/// keeps its own LocalStack apart from the AWS the user's environment points at).
pub async fn config_at(endpoint: &str, region: &str, access_key: &str) -> aws_config::SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new(access_key, "test", None, None, "sandbox"))
        .load()
        .await
}

/// The SDK configuration for LocalStack's default account in `region`, after proving it answers.
pub async fn config(region: &str) -> Result<aws_config::SdkConfig, LocalStackDown> {
    let config = config_as(region, "test").await;
    Cloud::from_config(&config)
        .ping()
        .await
        .map_err(|e| LocalStackDown { endpoint: endpoint(), detail: e.to_string() })?;
    Ok(config)
}
