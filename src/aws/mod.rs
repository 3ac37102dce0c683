//! The AWS side: EC2 (instances, launch templates, network interfaces, volumes, security
//! groups), IAM (instance profiles), STS (account identity), EKS (which API server the named
//! cluster is) and Elastic Load Balancing (what the cleanup controllers left), through the real
//! SDK.
//!
//! Endpoints come from the SDK's standard environment (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_EC2`,
//! ...), credentials from its default chain; LocalStack needs no special flags.

pub(crate) mod calls;
pub mod ec2;
pub mod eks;
pub mod elb;
pub(crate) mod iam;
pub(crate) mod pacing;
pub(crate) mod pricing;

use aws_config::{BehaviorVersion, Region, retry::RetryConfig};
use aws_credential_types::provider::ProvideCredentials;

pub use crate::cleanup::LbKind;
pub(crate) use calls::AwsCalls;
pub use ec2::{Ec2, InstanceInfo, InstanceState};
pub use eks::{Eks, EksCluster, EksLookup};
pub use elb::{Elb, LoadBalancing};
pub use iam::{Iam, InstanceProfileInfo};

/// Failures of the AWS side, with what the user can do about them.
#[derive(Debug, thiserror::Error)]
pub enum AwsError {
    /// No credentials could be resolved from the default chain.
    #[error(
        "no AWS credentials found ({0}); set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, \
         or run where an instance or pod role is available (for LocalStack any non-empty pair works, e.g. test/test)"
    )]
    NoCredentials(String),
    /// The endpoint could not be reached at all.
    #[error(
        "cannot reach the AWS {service} endpoint {endpoint} during {operation}: {detail}; check the network, \
         AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_{service_upper} and, for the sandbox, that LocalStack runs (localstack/up)"
    )]
    Unreachable {
        /// `ec2`, `iam` or `sts`.
        service: &'static str,
        /// Upper-case service name for the endpoint variable.
        service_upper: &'static str,
        /// The endpoint the SDK used (or `the default endpoint`).
        endpoint: String,
        /// The API operation that failed.
        operation: &'static str,
        /// The transport error.
        detail: String,
    },
    /// The call reached AWS and was refused or failed.
    #[error("AWS {operation} failed: {code}: {message}{}", aws_hint(code))]
    Api {
        /// The service (`ec2`, `iam`, `sts`, `eks`).
        service: &'static str,
        /// The API operation that failed.
        operation: &'static str,
        /// The AWS error code (e.g. `UnauthorizedOperation`).
        code: String,
        /// The AWS error message.
        message: String,
    },
    /// The account reached is not the one the user named with `--account`.
    #[error(
        "the AWS credentials belong to account {actual}, not {expected}; use credentials for account {expected} or fix --account"
    )]
    WrongAccount {
        /// The account the user asked for.
        expected: String,
        /// The account STS reports.
        actual: String,
    },
}

impl AwsError {
    /// True when the failure is in the configuration (credentials, endpoint), not the operation.
    pub(crate) fn is_configuration(&self) -> bool {
        matches!(self, AwsError::NoCredentials(_) | AwsError::Unreachable { .. })
    }

    /// True when trying again later can succeed: throttling (`RequestLimitExceeded` on EC2,
    /// `Throttling` on IAM/STS) and AWS's own server errors. Every other error the service
    /// answered (`FilterLimitExceeded`, `InvalidParameter*`, `UnauthorizedOperation`, ...) is the
    /// request's fault and fails the same way every time, so it is never retried.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            AwsError::Api { code, .. } => {
                self.is_throttling()
                    || matches!(
                        code.as_str(),
                        "InternalError" | "InternalFailure" | "ServiceUnavailable" | "Unavailable" | "ServiceFailure"
                    )
            }
            // a timeout or a dropped connection mid-run (the endpoint answered before)
            AwsError::Unreachable { detail, .. } => detail == "timed out",
            AwsError::NoCredentials(_) | AwsError::WrongAccount { .. } => false,
        }
    }

    /// True when AWS refused the call for its rate (EC2's `RequestLimitExceeded`, IAM's and STS's
    /// `Throttling`).
    pub(crate) fn is_throttling(&self) -> bool {
        self.code().is_some_and(|c| {
            matches!(c, "RequestLimitExceeded" | "Throttling" | "ThrottlingException" | "RequestThrottled")
        })
    }

    /// True when the identity lacks the permission for the call (EC2's `UnauthorizedOperation`,
    /// IAM's, STS's and EKS's `AccessDenied`).
    pub(crate) fn is_access_denied(&self) -> bool {
        self.code().is_some_and(is_access_denied_code)
    }

    /// The IAM action of the call that failed (`eks:DescribeCluster`), when it reached AWS.
    pub(crate) fn action(&self) -> Option<String> {
        match self {
            AwsError::Api { service, operation, .. } => Some(format!("{service}:{operation}")),
            _ => None,
        }
    }

    /// The AWS error code, when the call reached AWS.
    pub fn code(&self) -> Option<&str> {
        match self {
            AwsError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    pub(crate) fn from_sdk<E, R>(
        service: &'static str,
        operation: &'static str,
        endpoint: &str,
        err: aws_sdk_ec2::error::SdkError<E, R>,
    ) -> AwsError
    where
        E: aws_smithy_types::error::metadata::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug,
    {
        use aws_sdk_ec2::error::SdkError;
        match err {
            SdkError::DispatchFailure(d) => AwsError::Unreachable {
                service,
                service_upper: upper(service),
                endpoint: endpoint.to_string(),
                operation,
                detail: format!("{:?}", d.as_connector_error()).chars().take(300).collect(),
            },
            SdkError::TimeoutError(_) => AwsError::Unreachable {
                service,
                service_upper: upper(service),
                endpoint: endpoint.to_string(),
                operation,
                detail: "timed out".into(),
            },
            SdkError::ServiceError(s) => {
                let e = s.err();
                AwsError::Api {
                    service,
                    operation,
                    code: e.code().unwrap_or("Unknown").to_string(),
                    message: e.message().unwrap_or("").to_string(),
                }
            }
            other => AwsError::Api {
                service,
                operation,
                code: "ClientError".into(),
                message: aws_smithy_types::error::display::DisplayErrorContext(&other).to_string(),
            },
        }
    }
}

/// The codes with which AWS says the identity lacks a permission.
fn is_access_denied_code(code: &str) -> bool {
    matches!(code, "UnauthorizedOperation" | "AccessDenied" | "AccessDeniedException" | "UnauthorizedAccess")
}

/// What to do about an AWS error code, as a clause after its message.
fn aws_hint(code: &str) -> &'static str {
    match code {
        c if is_access_denied_code(c) => {
            "; the credentials lack this permission: attach deploy/iam-policy.json (README, Real use against EKS) to the identity and run again"
        }
        "AuthFailure" | "InvalidClientTokenId" | "ExpiredToken" | "ExpiredTokenException" | "SignatureDoesNotMatch" => {
            "; the credentials were refused: refresh them (aws sso login, a new session) and run again"
        }
        "RequestLimitExceeded" | "Throttling" | "ThrottlingException" => {
            "; AWS kept throttling through every retry: run again later (the tool resumes where it stopped)"
        }
        _ => "",
    }
}

fn upper(service: &'static str) -> &'static str {
    match service {
        "ec2" => "EC2",
        "iam" => "IAM",
        "sts" => "STS",
        "eks" => "EKS",
        "elasticloadbalancing" => "ELASTIC_LOAD_BALANCING_V2",
        "pricing" => "PRICING",
        _ => "<SERVICE>",
    }
}

/// The SDK clients of one region, sharing one configuration.
#[derive(Clone, Debug)]
pub struct AwsClients {
    /// EC2 in the cluster's region.
    pub ec2: Ec2,
    /// IAM (global).
    pub iam: Iam,
    /// EKS in the cluster's region.
    pub eks: Eks,
    /// ELBv2 and classic ELB in the cluster's region.
    pub elb: Elb,
    /// The Price List API, for the region's instances (its own endpoint region).
    pub pricing: pricing::Pricing,
    /// Every request the clients sent, by `service:Operation`.
    pub calls: AwsCalls,
    sts: aws_sdk_sts::Client,
    sts_endpoint: String,
    region: String,
}

impl AwsClients {
    /// Loads the SDK configuration for `region` from the standard environment and proves that
    /// credentials resolve, so a missing credential is reported before anything runs.
    pub(crate) async fn connect(region: &str) -> Result<AwsClients, AwsError> {
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).region(Region::new(region.to_string()));
        // EC2 throttles bulk teardown (RequestLimitExceeded); the SDK's standard mode retries that
        // with backoff, and more attempts than its default 3 ride out a busy account. An explicit
        // AWS_MAX_ATTEMPTS / AWS_RETRY_MODE from the user wins.
        if std::env::var_os("AWS_MAX_ATTEMPTS").is_none() && std::env::var_os("AWS_RETRY_MODE").is_none() {
            loader = loader.retry_config(RetryConfig::standard().with_max_attempts(8));
        }
        AwsClients::from_config(&loader.load().await).await
    }

    /// Builds the clients from a loaded SDK configuration (tests point one at LocalStack) and
    /// proves that its credentials resolve.
    pub async fn from_config(config: &aws_config::SdkConfig) -> Result<AwsClients, AwsError> {
        let region = config.region().map(|r| r.to_string()).unwrap_or_default();
        let provider = config
            .credentials_provider()
            .ok_or_else(|| AwsError::NoCredentials("no credentials provider configured".into()))?;
        provider.provide_credentials().await.map_err(|e| AwsError::NoCredentials(crate::exit::causes(&e)))?;
        let endpoint = |svc: &str| {
            std::env::var(format!("AWS_ENDPOINT_URL_{}", svc.to_uppercase()))
                .ok()
                .or_else(|| config.endpoint_url().map(str::to_string))
                .unwrap_or_else(|| format!("the default {svc} endpoint of {region}"))
        };
        // one counter shared by the clients, so the report names every AWS call the run
        // made and the least-privilege test can compare them with deploy/iam-policy.json
        let calls = AwsCalls::default();
        let ec2 = aws_sdk_ec2::config::Builder::from(config).interceptor(calls.clone()).build();
        let iam = aws_sdk_iam::config::Builder::from(config).interceptor(calls.clone()).build();
        let sts = aws_sdk_sts::config::Builder::from(config).interceptor(calls.clone()).build();
        let eks = aws_sdk_eks::config::Builder::from(config).interceptor(calls.clone()).build();
        let elbv2 = aws_sdk_elasticloadbalancingv2::config::Builder::from(config).interceptor(calls.clone()).build();
        let elb = aws_sdk_elasticloadbalancing::config::Builder::from(config).interceptor(calls.clone()).build();
        // the Price List is served from a few regions only, whatever the instances' region
        let pricing = pricing::price_list_region(&region).map(|at| {
            // informative only: a slow or silent endpoint must not hold a sweep up, so each
            // attempt is bounded, and the attempts are the SDK's default (a user's
            // AWS_MAX_ATTEMPTS still wins), not the eight a teardown's calls get
            let timeouts = aws_config::timeout::TimeoutConfig::builder()
                .connect_timeout(std::time::Duration::from_secs(3))
                .operation_attempt_timeout(std::time::Duration::from_secs(10))
                .operation_timeout(std::time::Duration::from_secs(30))
                .build();
            let mut conf =
                aws_sdk_pricing::config::Builder::from(config).region(Region::new(at)).timeout_config(timeouts);
            if std::env::var_os("AWS_MAX_ATTEMPTS").is_none() && std::env::var_os("AWS_RETRY_MODE").is_none() {
                conf = conf.retry_config(RetryConfig::standard());
            }
            let conf = conf.interceptor(calls.clone()).build();
            aws_sdk_pricing::Client::from_conf(conf)
        });
        Ok(AwsClients {
            ec2: Ec2::new(aws_sdk_ec2::Client::from_conf(ec2), endpoint("ec2")),
            iam: Iam::new(aws_sdk_iam::Client::from_conf(iam), endpoint("iam")),
            eks: Eks::new(aws_sdk_eks::Client::from_conf(eks), endpoint("eks")),
            elb: Elb::new(
                aws_sdk_elasticloadbalancingv2::Client::from_conf(elbv2),
                aws_sdk_elasticloadbalancing::Client::from_conf(elb),
                endpoint("elastic_load_balancing_v2"),
            ),
            pricing: pricing::Pricing::new(pricing, endpoint("pricing")),
            sts: aws_sdk_sts::Client::from_conf(sts),
            sts_endpoint: endpoint("sts"),
            calls,
            region,
        })
    }

    /// The region the clients talk to.
    pub(crate) fn region(&self) -> &str {
        &self.region
    }

    /// The account the credentials belong to (STS GetCallerIdentity).
    pub(crate) async fn account(&self) -> Result<String, AwsError> {
        let out = self
            .sts
            .get_caller_identity()
            .send()
            .await
            .map_err(|e| AwsError::from_sdk("sts", "GetCallerIdentity", &self.sts_endpoint, e))?;
        Ok(out.account().unwrap_or_default().to_string())
    }

    /// Refuses when the credentials belong to another account than `expected`.
    pub(crate) async fn check_account(&self, expected: &str) -> Result<(), AwsError> {
        let actual = self.account().await?;
        if actual != expected {
            return Err(AwsError::WrongAccount { expected: expected.to_string(), actual });
        }
        Ok(())
    }
}
