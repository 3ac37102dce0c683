//! What EC2 refuses that LocalStack lets through: the request limits and the throttling budget of
//! the real API, applied by the sandbox's EC2 proxy to every request so that a test or a
//! benchmark passes only if AWS would let it happen.
//!
//! Sources (checked by hand, see the README's "Real use against EKS"):
//! - filter values: at most 200 in one call, else `FilterLimitExceeded` ("The maximum number of
//!   filter values specified on a single call is 200");
//! - `MaxResults` ranges (DescribeInstances and DescribeNetworkInterfaces 5–1000, DescribeVolumes
//!   5–500, DescribeLaunchTemplates 1–200, DescribeTags 5–1000), else `InvalidParameterValue`;
//!   `MaxResults` together with explicit ids (instances, network interfaces, volumes) is
//!   `InvalidParameterCombination`; TerminateInstances takes at most 1,000 ids;
//! - throttling ("Request throttling for the Amazon EC2 API"): a token bucket per API action,
//!   100 tokens refilled at 20/s for Describe calls, 50 at 10/s for a Describe call with neither a
//!   filter nor pagination, 50 at 5/s for mutating calls by default, TerminateInstances 100 at 5/s
//!   plus a resource bucket of 1,000 instances refilled at 20/s, CreateTags 100 at 10/s,
//!   DeleteNetworkInterface 100 at 5/s; an empty bucket answers HTTP 503 `RequestLimitExceeded`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// A refusal as EC2 words it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status (400 for a malformed request, 503 for throttling).
    pub status: u16,
    /// EC2 error code.
    pub code: &'static str,
    /// EC2's message.
    pub message: String,
}

/// The request limits of EC2's query API.
pub const FILTER_VALUES_MAX: usize = 200;
/// Ids TerminateInstances accepts in one call.
pub const TERMINATE_IDS_MAX: usize = 1000;

/// A token bucket: `capacity` tokens, refilled at `refill` per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketShape {
    /// Tokens when full.
    pub capacity: f64,
    /// Tokens added per second.
    pub refill: f64,
}

impl BucketShape {
    const fn new(capacity: f64, refill: f64) -> BucketShape {
        BucketShape { capacity, refill }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    shape: BucketShape,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn take(&mut self, n: f64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.shape.refill).min(self.shape.capacity);
        self.at = now;
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

/// EC2's throttling budget and request limits for one account and region.
#[derive(Debug, Default)]
pub struct Ec2Limits {
    buckets: Mutex<HashMap<String, Bucket>>,
}

/// The parameters of one query-protocol request.
#[derive(Debug, Default)]
struct Params {
    action: String,
    max_results: Option<String>,
    has_next_token: bool,
    /// values per `Filter.N`
    filters: HashMap<String, usize>,
    /// `InstanceId.N`, `NetworkInterfaceId.N`, `VolumeId.N`, `LaunchTemplateId.N`
    ids: usize,
}

impl Params {
    fn parse(body: &str) -> Params {
        let mut p = Params::default();
        for (k, v) in form_urlencoded::parse(body.as_bytes()) {
            match k.as_ref() {
                "Action" => p.action = v.into_owned(),
                "MaxResults" => p.max_results = Some(v.into_owned()),
                "NextToken" => p.has_next_token = true,
                key => {
                    if let Some(rest) = key.strip_prefix("Filter.")
                        && let Some((n, field)) = rest.split_once('.')
                        && field.starts_with("Value.")
                    {
                        *p.filters.entry(n.to_string()).or_default() += 1;
                    } else if ["InstanceId.", "NetworkInterfaceId.", "VolumeId.", "LaunchTemplateId."]
                        .iter()
                        .any(|prefix| key.starts_with(prefix))
                    {
                        p.ids += 1;
                    }
                }
            }
        }
        p
    }
}

/// The `Action` of a query-protocol request body.
pub fn action_of(body: &str) -> Option<String> {
    form_urlencoded::parse(body.as_bytes()).find(|(k, _)| k == "Action").map(|(_, v)| v.into_owned())
}

fn refuse(status: u16, code: &'static str, message: impl Into<String>) -> Option<Refusal> {
    Some(Refusal { status, code, message: message.into() })
}

impl Ec2Limits {
    /// Judges one EC2 request body (`Action=...&...`) at `now`: `None` when EC2 would serve it.
    /// A request that is malformed for EC2 is refused before it costs a token, like EC2's own
    /// validation.
    pub fn check(&self, body: &str, now: Instant) -> Option<Refusal> {
        let p = Params::parse(body);
        if let Some(r) = Self::validate(&p) {
            return Some(r);
        }
        let (key, shape, resources) = Self::bucket_of(&p);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let mut take = |key: String, shape: BucketShape, n: f64| {
            buckets.entry(key).or_insert(Bucket { shape, tokens: shape.capacity, at: now }).take(n, now)
        };
        let request_ok = take(key, shape, 1.0);
        let resources_ok = match resources {
            Some((key, shape, n)) if request_ok => take(key, shape, n),
            _ => true,
        };
        if request_ok && resources_ok { None } else { refuse(503, "RequestLimitExceeded", "Request limit exceeded.") }
    }

    fn validate(p: &Params) -> Option<Refusal> {
        let total_values: usize = p.filters.values().sum();
        if total_values > FILTER_VALUES_MAX {
            return refuse(
                400,
                "FilterLimitExceeded",
                format!("The maximum number of filter values specified on a single call is {FILTER_VALUES_MAX}"),
            );
        }
        let range = match p.action.as_str() {
            "DescribeInstances" | "DescribeNetworkInterfaces" | "DescribeTags" => Some((5, 1000)),
            "DescribeVolumes" => Some((5, 500)),
            "DescribeLaunchTemplates" => Some((1, 200)),
            _ => None,
        };
        if let (Some((lo, hi)), Some(raw)) = (range, &p.max_results) {
            match raw.parse::<i64>() {
                Ok(n) if n < lo => {
                    return refuse(
                        400,
                        "InvalidParameterValue",
                        format!(
                            "Value ( {n} ) for parameter MaxResults is invalid. Expecting a value greater than or equal to {lo}."
                        ),
                    );
                }
                // DescribeVolumes documents that a larger value returns at most 500 items; the
                // others refuse it
                Ok(n) if n > hi && p.action != "DescribeVolumes" => {
                    return refuse(
                        400,
                        "InvalidParameterValue",
                        format!(
                            "Value ( {n} ) for parameter MaxResults is invalid. Expecting a value less than or equal to {hi}."
                        ),
                    );
                }
                Ok(_) => {}
                Err(_) => {
                    return refuse(400, "InvalidParameterValue", format!("Invalid value '{raw}' for MaxResults"));
                }
            }
            let ids_exclusive =
                matches!(p.action.as_str(), "DescribeInstances" | "DescribeNetworkInterfaces" | "DescribeVolumes");
            if ids_exclusive && p.ids > 0 {
                let set = match p.action.as_str() {
                    "DescribeInstances" => "instancesSet",
                    "DescribeNetworkInterfaces" => "NetworkInterfaceIds",
                    _ => "VolumeIds",
                };
                return refuse(
                    400,
                    "InvalidParameterCombination",
                    format!("The parameter {set} cannot be used with the parameter maxResults"),
                );
            }
        }
        if p.action == "TerminateInstances" && p.ids > TERMINATE_IDS_MAX {
            return refuse(
                400,
                "InvalidParameterValue",
                format!("The maximum number of instance IDs in one TerminateInstances call is {TERMINATE_IDS_MAX}"),
            );
        }
        None
    }

    /// The request bucket of the action (each API action has its own) and, for actions with a
    /// resource bucket, that bucket with the number of resources the request touches.
    fn bucket_of(p: &Params) -> (String, BucketShape, Option<(String, BucketShape, f64)>) {
        const DESCRIBE: BucketShape = BucketShape::new(100.0, 20.0);
        const UNFILTERED_DESCRIBE: BucketShape = BucketShape::new(50.0, 10.0);
        const MUTATING: BucketShape = BucketShape::new(50.0, 5.0);
        let a = p.action.as_str();
        let unfiltered_kind = matches!(
            a,
            "DescribeInstances"
                | "DescribeInstanceStatus"
                | "DescribeNetworkInterfaces"
                | "DescribeSecurityGroups"
                | "DescribeSnapshots"
                | "DescribeSpotInstanceRequests"
                | "DescribeVolumes"
        );
        let non_mutating = ["Describe", "List", "Search", "Get"].iter().any(|v| a.starts_with(v));
        let paged_or_filtered = !p.filters.is_empty() || p.max_results.is_some() || p.has_next_token || p.ids > 0;
        let shape = match a {
            _ if unfiltered_kind && !paged_or_filtered => UNFILTERED_DESCRIBE,
            _ if non_mutating => DESCRIBE,
            "TerminateInstances" | "DeleteNetworkInterface" | "DeleteVolume" => BucketShape::new(100.0, 5.0),
            "CreateTags" | "DeleteTags" => BucketShape::new(100.0, 10.0),
            "RunInstances" => BucketShape::new(5.0, 2.0),
            _ => MUTATING,
        };
        let key = if shape == UNFILTERED_DESCRIBE { format!("{a}/unfiltered") } else { a.to_string() };
        let resources = match a {
            "TerminateInstances" => Some(("TerminateInstances/instances".into(), BucketShape::new(1000.0, 20.0))),
            "RunInstances" => Some(("RunInstances/instances".into(), BucketShape::new(1000.0, 2.0))),
            _ => None,
        }
        .map(|(k, s)| (k, s, p.ids.max(1) as f64));
        (key, shape, resources)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn filter_body(action: &str, values: usize, max_results: Option<u32>) -> String {
        let mut b = format!("Action={action}&Version=2016-11-15&Filter.1.Name=instance-id");
        for i in 1..=values {
            b.push_str(&format!("&Filter.1.Value.{i}=i-{i:017}"));
        }
        if let Some(m) = max_results {
            b.push_str(&format!("&MaxResults={m}"));
        }
        b
    }

    #[test]
    fn more_than_200_filter_values_are_refused_like_ec2() {
        let l = Ec2Limits::default();
        let now = Instant::now();
        assert_eq!(l.check(&filter_body("DescribeInstances", 200, Some(1000)), now), None);
        let r = l.check(&filter_body("DescribeInstances", 201, Some(1000)), now).unwrap();
        assert_eq!((r.status, r.code), (400, "FilterLimitExceeded"));
    }

    #[test]
    fn max_results_ranges_and_exclusivity_with_ids() {
        let l = Ec2Limits::default();
        let now = Instant::now();
        let r = l.check(&filter_body("DescribeInstances", 1, Some(4)), now).unwrap();
        assert_eq!(r.code, "InvalidParameterValue");
        assert_eq!(l.check("Action=DescribeLaunchTemplates&MaxResults=1", now), None);
        let r = l.check("Action=DescribeInstances&InstanceId.1=i-1&MaxResults=5", now).unwrap();
        assert_eq!(r.code, "InvalidParameterCombination");
        assert_eq!(l.check("Action=DescribeInstances&InstanceId.1=i-1", now), None);
        let ids: String = (0..=TERMINATE_IDS_MAX).map(|i| format!("&InstanceId.{}=i-{i}", i + 1)).collect();
        let r = l.check(&format!("Action=TerminateInstances{ids}"), now).unwrap();
        assert_eq!(r.code, "InvalidParameterValue");
    }

    #[test]
    fn describe_calls_spend_a_bucket_of_100_refilled_at_20_per_second() {
        let l = Ec2Limits::default();
        let t0 = Instant::now();
        let body = filter_body("DescribeInstances", 1, Some(1000));
        for i in 0..100 {
            assert_eq!(l.check(&body, t0), None, "request {i} fits the bucket");
        }
        let r = l.check(&body, t0).unwrap();
        assert_eq!((r.status, r.code), (503, "RequestLimitExceeded"));
        // each action has its own bucket
        assert_eq!(
            l.check("Action=DescribeLaunchTemplates&MaxResults=200&Filter.1.Name=a&Filter.1.Value.1=b", t0),
            None
        );
        // a second refills 20 tokens
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..20 {
            assert_eq!(l.check(&body, t1), None);
        }
        assert!(l.check(&body, t1).is_some());
    }

    #[test]
    fn unfiltered_unpaginated_describes_use_the_smaller_bucket() {
        let l = Ec2Limits::default();
        let t0 = Instant::now();
        for _ in 0..50 {
            assert_eq!(l.check("Action=DescribeInstances", t0), None);
        }
        assert!(l.check("Action=DescribeInstances", t0).is_some());
        assert_eq!(
            l.check(&filter_body("DescribeInstances", 1, None), t0),
            None,
            "a filtered call is in the big bucket"
        );
    }

    #[test]
    fn terminations_spend_a_resource_bucket_of_1000_instances() {
        let l = Ec2Limits::default();
        let t0 = Instant::now();
        let batch = |from: usize| -> String {
            let ids: String = (0..500).map(|i| format!("&InstanceId.{}=i-{}", i + 1, from + i)).collect();
            format!("Action=TerminateInstances{ids}")
        };
        assert_eq!(l.check(&batch(0), t0), None);
        assert_eq!(l.check(&batch(500), t0), None);
        let r = l.check(&batch(1000), t0).unwrap();
        assert_eq!(r.code, "RequestLimitExceeded", "1,500 instances at once exceed the 1,000-instance bucket");
        // 25 s refill 500 instances
        assert_eq!(l.check(&batch(1000), t0 + Duration::from_secs(25)), None);
    }
}
