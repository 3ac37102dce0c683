//! Test-bed helpers shared by the integration tests: LocalStack clients and unique names.
#![allow(dead_code, reason = "each test binary uses its own subset of these helpers")]

pub mod e2e;
pub mod safety;
pub mod schema;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use aws_config::{BehaviorVersion, Region};
use aws_credential_types::Credentials;
use karpenter_teardown::aws::AwsClients;
use sandbox_sim::ec2auth::Principal;
use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyControl, ProxyFaults};
use sandbox_sim::iampolicy::Policy;

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
    let config = sandbox_sim::localstack::config_as(region, "test").await;
    AwsClients::from_config(&config).await.expect("LocalStack clients")
}

/// The test bed's own EC2/IAM calls (playing Karpenter: launching instances, creating templates
/// and profiles) against LocalStack directly.
pub async fn cloud(region: &str) -> sandbox_sim::cloud::Cloud {
    require_localstack();
    sandbox_sim::cloud::Cloud::from_config(&sandbox_sim::localstack::config_as(region, "test").await)
}

/// Makes LocalStack's EKS know `cluster` in `region` with the endpoint (and, for a TLS server,
/// the certificate authority) of the API server a test started, as the cluster's creator would
/// have: the positive evidence the tool proves a kubeconfig with before any write.
pub async fn register_eks(cluster: &str, region: &str, endpoint: &str, ca_pem: Option<String>) {
    let spec = sandbox_sim::cloud::EksSpec { endpoint: endpoint.to_string(), ca_pem, auto_mode: false };
    register_eks_as(cluster, region, &spec).await;
}

/// [`register_eks`] with every field of EKS's answer given (Auto Mode's flag among them).
pub async fn register_eks_as(cluster: &str, region: &str, spec: &sandbox_sim::cloud::EksSpec) {
    cloud(region)
        .await
        .register_eks_cluster(cluster, spec)
        .await
        .unwrap_or_else(|e| panic!("registering EKS cluster {cluster}: {e}"));
}

/// SDK clients for the code under test: through the enforcing EC2 proxy ([`ec2_proxy`]), so
/// every EC2 call is held to AWS's request limits and throttling budget.
pub async fn localstack_as_aws(region: &str) -> AwsClients {
    require_localstack();
    let config = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .endpoint_url(ec2_proxy())
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .load()
        .await;
    AwsClients::from_config(&config).await.expect("LocalStack clients through the EC2 proxy")
}

/// The URL of this test binary's EC2 proxy in front of LocalStack: it refuses what real EC2
/// refuses (more than 200 filter values, `MaxResults` out of range or with ids, ...) and
/// throttles with EC2's token buckets; IAM and STS pass through. One per test binary, on a thread
/// of its own so that it outlives each test's runtime; the tests of a binary share its budget,
/// like the tools of one account share EC2's.
///
/// Everything the tool does goes through it ([`localstack_env`], [`localstack_as_aws`]); the
/// test bed's own setup (playing Karpenter: launching instances, creating templates) talks to
/// LocalStack directly ([`localstack`]). A tool run with a [`judged_key`] is also held to
/// `deploy/iam-policy.json`.
pub fn ec2_proxy() -> &'static str {
    &shared_proxy().0
}

/// The settings of this test binary's EC2 proxy (what it hides, what it saw).
pub fn ec2_proxy_control() -> &'static ProxyControl {
    &shared_proxy().1
}

fn shared_proxy() -> &'static (String, ProxyControl) {
    static PROXY: OnceLock<(String, ProxyControl)> = OnceLock::new();
    PROXY.get_or_init(|| {
        require_localstack();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("ec2-proxy".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("proxy runtime");
                rt.block_on(async {
                    let proxy = Ec2Proxy::start(LOCALSTACK, ProxyFaults::default()).await.expect("EC2 proxy");
                    tx.send((proxy.url(), proxy.control())).expect("test thread waits for the proxy URL");
                    std::future::pending::<()>().await;
                });
            })
            .expect("EC2 proxy thread");
        rx.recv().expect("EC2 proxy URL")
    })
}

/// LocalStack's account: every access key that is not 12 digits (or one of its encoded forms)
/// is its default account.
pub const LOCALSTACK_ACCOUNT: &str = "000000000000";

/// The shipped `deploy/iam-policy.json` with its placeholders bound, as a user attaches it.
pub fn shipped_policy(cluster: &str, region: &str) -> Policy {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/iam-policy.json"))
        .expect("deploy/iam-policy.json");
    policy_from(&text, cluster, region)
}

/// A policy document in the shipped one's form (placeholders `CLUSTER_NAME`, `REGION`,
/// `ACCOUNT_ID`, `PARTITION`), bound for `cluster` in `region` of LocalStack's account.
pub fn policy_from(text: &str, cluster: &str, region: &str) -> Policy {
    // ACCOUNT_ID before the others: none of the values contains a placeholder
    let bindings = [
        ("CLUSTER_NAME", cluster),
        ("ACCOUNT_ID", LOCALSTACK_ACCOUNT),
        ("PARTITION", karpenter_teardown::partition::partition_of_region(region)),
        ("REGION", region),
    ];
    Policy::parse(text, &bindings).expect("the policy parses")
}

/// A caller of LocalStack's account held to `policy`.
pub fn principal(policy: Policy) -> Principal {
    Principal { policy, account: LOCALSTACK_ACCOUNT.into(), partition: "aws".into() }
}

/// A fresh access key of LocalStack's default account (like `test`), for a caller a proxy holds
/// to a policy.
pub fn fresh_key() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("KTDTEST{}X{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A fresh access key that the shared EC2 proxy holds to `policy`.
pub fn key_with_policy(policy: Policy) -> String {
    let key = fresh_key();
    shared_proxy().1.attach_policy(&key, principal(policy));
    key
}

/// An access key that the shared EC2 proxy holds to `deploy/iam-policy.json` bound for
/// `cluster`: every EC2, IAM and STS call made with it is authorized as AWS would authorize it,
/// and refused with `UnauthorizedOperation`/`AccessDenied` otherwise.
pub fn judged_key(cluster: &str, region: &str) -> String {
    key_with_policy(shipped_policy(cluster, region))
}

/// [`localstack_as_aws`] signing with `access_key` (a [`judged_key`]).
pub async fn localstack_as_aws_with_key(region: &str, access_key: &str) -> AwsClients {
    require_localstack();
    let config = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .endpoint_url(ec2_proxy())
        .credentials_provider(Credentials::new(access_key, "test", None, None, "tests"))
        .load()
        .await;
    AwsClients::from_config(&config).await.expect("LocalStack clients through the EC2 proxy")
}

/// The environment a spawned `karpenter-teardown` needs to reach LocalStack (through the
/// enforcing EC2 proxy, see [`ec2_proxy`]).
pub fn localstack_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("AWS_ENDPOINT_URL", ec2_proxy()),
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

/// Two subnets of LocalStack's default VPC in the config's region, and the VPC: where the test
/// bed makes load balancers and security groups.
pub async fn default_subnets(config: &aws_config::SdkConfig) -> (Vec<String>, String) {
    let ec2 = aws_sdk_ec2::Client::new(config);
    let subnets: Vec<String> = ec2
        .describe_subnets()
        .send()
        .await
        .unwrap()
        .subnets()
        .iter()
        .filter_map(|s| s.subnet_id().map(str::to_string))
        .take(2)
        .collect();
    let vpc = ec2.describe_vpcs().send().await.unwrap().vpcs()[0].vpc_id().unwrap().to_string();
    (subnets, vpc)
}
