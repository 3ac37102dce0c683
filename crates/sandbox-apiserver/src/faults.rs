//! Fault injection (latency, error responses, dropped watches) and request accounting.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::store::xorshift;

/// One error-injection rule: answer `code` to a fraction `rate` of matching requests.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorRule {
    /// Verb to match (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`, `evict`), or `None` for every verb.
    pub verb: Option<String>,
    /// Resource to match (`pods`, `nodeclaims`), or `None` for every resource.
    pub resource: Option<String>,
    /// HTTP code to answer: 429, 500 or 503.
    pub code: u16,
    /// Fraction of matching requests that fail, 0.0 to 1.0.
    pub rate: f64,
}

/// Faults the server injects. The default injects nothing.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultConfig {
    /// Added to every request before it is served.
    pub latency: Duration,
    /// Error responses.
    pub errors: Vec<ErrorRule>,
    /// Watches are cut after this long (the client must resume).
    pub drop_watches_every: Option<Duration>,
    /// Seed of the random generator, so runs are reproducible.
    pub seed: u64,
}

/// The server's fault state: the config plus its random generator.
#[derive(Debug)]
pub(crate) struct Faults {
    config: FaultConfig,
    rng: u64,
}

impl Faults {
    pub(crate) fn new(config: FaultConfig) -> Self {
        let rng = config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        Faults { config, rng }
    }

    pub(crate) fn config(&self) -> &FaultConfig {
        &self.config
    }

    /// The error code to inject for this request, if any.
    pub(crate) fn pick_error(&mut self, verb: &str, resource: &str) -> Option<u16> {
        let rules: Vec<ErrorRule> = self.config.errors.clone();
        for r in rules {
            let verb_ok = r.verb.as_deref().is_none_or(|v| v == verb);
            let res_ok = r.resource.as_deref().is_none_or(|x| x == resource);
            if verb_ok && res_ok {
                let draw = (xorshift(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64;
                if draw < r.rate {
                    return Some(r.code);
                }
            }
        }
        None
    }
}

/// Counts of served requests by (verb, resource); a cheap cloneable handle.
#[derive(Debug, Clone, Default)]
pub struct RequestStats {
    counts: Arc<Mutex<BTreeMap<(String, String), u64>>>,
}

impl RequestStats {
    pub(crate) fn record(&self, verb: &str, resource: &str) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *c.entry((verb.to_string(), resource.to_string())).or_default() += 1;
    }

    /// Requests seen for a verb and resource (`("evict", "pods")`, `("list", "nodes")`).
    pub fn count(&self, verb: &str, resource: &str) -> u64 {
        let c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.get(&(verb.to_string(), resource.to_string())).copied().unwrap_or(0)
    }

    /// Every count, keyed by (verb, resource).
    pub fn snapshot(&self) -> BTreeMap<(String, String), u64> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Total requests counted.
    pub fn total(&self) -> u64 {
        self.snapshot().values().sum()
    }
}
