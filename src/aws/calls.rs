//! AWS call accounting: an SDK interceptor that counts every request the EC2, IAM and STS
//! clients send, by `service:Operation` (`ec2:TerminateInstances`), for the report and for the
//! least-privilege check against `deploy/iam-policy.json`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use aws_sdk_ec2::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_ec2::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_ec2::error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;

/// Counts of AWS requests by `service:Operation`; cheap to clone, all clones share the counts.
#[derive(Clone, Debug, Default)]
pub struct AwsCalls {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl AwsCalls {
    /// Counts one request.
    pub(crate) fn record(&self, service: &str, operation: &str) {
        // A poisoned lock only means another thread panicked mid-increment; counting on is fine.
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(format!("{}:{operation}", iam_prefix(service))).or_default() += 1;
    }

    /// A copy of the counts so far.
    pub(crate) fn snapshot(&self) -> BTreeMap<String, u64> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The IAM action prefix of an SDK service name (`EC2` → `ec2`), so a report key is the IAM
/// action the call needs: ELBv2 and classic ELB share `elasticloadbalancing`.
fn iam_prefix(service: &str) -> String {
    let lower = service.to_ascii_lowercase();
    match lower.as_str() {
        "elastic load balancing v2" | "elastic load balancing" => "elasticloadbalancing".to_string(),
        _ => lower,
    }
}

impl Intercept for AwsCalls {
    fn name(&self) -> &'static str {
        "karpenter-teardown call counter"
    }

    // before transmit: once per attempt, so retried (throttled) requests count as the API
    // calls they are
    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        match cfg.load::<Metadata>() {
            Some(m) => self.record(m.service(), m.name()),
            // every generated operation stores its metadata; should one not, it still counts
            None => self.record("aws", "Unknown"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_iam_actions() {
        let c = AwsCalls::default();
        c.record("EC2", "DescribeInstances");
        c.record("ec2", "DescribeInstances");
        c.record("IAM", "ListInstanceProfiles");
        let s = c.snapshot();
        assert_eq!(s.get("ec2:DescribeInstances"), Some(&2));
        assert_eq!(s.get("iam:ListInstanceProfiles"), Some(&1));
        c.record("Elastic Load Balancing v2", "DescribeTags");
        c.record("Elastic Load Balancing", "DescribeTags");
        assert_eq!(s.len() + 1, c.snapshot().len());
        assert_eq!(c.snapshot().get("elasticloadbalancing:DescribeTags"), Some(&2));
    }
}
