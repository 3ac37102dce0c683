//! The sandbox's EC2 proxy: a small HTTP/1.1 reverse proxy on loopback that forwards AWS requests
//! to an upstream endpoint (LocalStack), refuses what real EC2 refuses and LocalStack does not
//! (request limits and the throttling budget, [`super::ec2limits`]), and answers a configurable
//! share of EC2 requests with EC2's throttling error (`RequestLimitExceeded`, HTTP 503) or an
//! internal error (HTTP 500), so the tool is tested against the real SDK as AWS would treat it.
//!
//! Only EC2 requests (query protocol, `Version=2016-11-15`) are faulted; IAM, STS and EKS requests
//! sharing the endpoint are forwarded untouched, so a test isolates EC2 throttling.
//!
//! Two more things real AWS does that LocalStack does not:
//! - a caller whose access key has a policy attached ([`ProxyControl::attach_policy`]) is held to
//!   it, on EC2, IAM and STS alike ([`super::ec2auth`], [`super::iampolicy`]): a request the
//!   policy does not allow is answered `UnauthorizedOperation` (EC2) or `AccessDenied` (IAM), a
//!   `DryRun` included. Callers with no policy attached are not judged;
//! - EC2's time ([`ProxyControl::set_timing`], [`super::ec2time`]): terminated instances stay
//!   `shutting-down` for a while, and reads right after a termination still show them running.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::ec2auth::{Caller, Principal};
use super::ec2limits::Ec2Limits;
use super::ec2time::{Ec2Timing, Terminations};
use crate::cloud::Cloud;

/// The API version every EC2 query-protocol request carries.
const EC2_API_VERSION: &str = "Version=2016-11-15";

/// Largest request body the proxy buffers (EC2 query requests are a few KiB).
const MAX_BODY: usize = 16 * 1024 * 1024;

/// Errors of the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The listening socket could not be opened.
    #[error("cannot listen on 127.0.0.1 for the EC2 fault proxy: {0}; check that loopback is available")]
    Bind(std::io::Error),
    /// The upstream endpoint is not a `http://host:port` address.
    #[error(
        "the EC2 proxy's upstream {0:?} is not http://host:port; pass LocalStack's address (http://127.0.0.1:4566)"
    )]
    Upstream(String),
}

/// What share of EC2 requests to fail, and how.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ProxyFaults {
    /// Fraction (0.0 to 1.0) answered with `RequestLimitExceeded` (HTTP 503).
    pub throttle_rate: f64,
    /// Fraction (0.0 to 1.0) answered with `InternalError` (HTTP 500).
    pub error_rate: f64,
    /// Seed of the random generator, so runs are reproducible.
    pub seed: u64,
}

/// Counts of what the proxy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyCounts {
    /// Requests forwarded upstream.
    pub forwarded: u64,
    /// Requests answered with `RequestLimitExceeded`.
    pub throttled: u64,
    /// Requests answered with HTTP 500.
    pub failed: u64,
    /// Requests whose upstream could not be reached (answered 502).
    pub upstream_errors: u64,
    /// Requests EC2 would refuse as malformed (`FilterLimitExceeded`, bad `MaxResults`, ...).
    pub refused: u64,
    /// Requests over EC2's throttling budget (answered `RequestLimitExceeded`).
    pub over_budget: u64,
}

#[derive(Debug, Default)]
struct Counters {
    forwarded: AtomicU64,
    throttled: AtomicU64,
    failed: AtomicU64,
    upstream_errors: AtomicU64,
    refused: AtomicU64,
    over_budget: AtomicU64,
}

struct Shared {
    upstream: String,
    limits: Ec2Limits,
    /// EC2 actions the caller's (emulated) IAM policy does not allow.
    denied: Mutex<std::collections::BTreeSet<String>>,
    faults: Mutex<(ProxyFaults, u64)>,
    counters: Counters,
    /// Every request that reached the proxy, by its `Action` (EC2, IAM and STS alike): what a
    /// write audit reads.
    actions: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Callers held to a policy, by access key.
    principals: Mutex<std::collections::HashMap<String, Principal>>,
    /// LocalStack clients for reading resources' tags, by region and access key.
    clouds: Mutex<std::collections::HashMap<(String, String), Cloud>>,
    timing: Mutex<Ec2Timing>,
    terminations: Mutex<Terminations>,
    /// `service:Action on resource` of each request a caller's policy refused.
    unauthorized: Mutex<Vec<String>>,
    /// Instances `DescribeInstances` does not show yet, until when: EC2's describe lags behind
    /// a fresh launch ([`ProxyControl::hide_instances`]).
    hidden: Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// Instances a `TerminateInstances` named while `DescribeInstances` did not show them.
    terminated_unseen: Mutex<Vec<String>>,
    /// How long requests of an action wait before they are answered ([`ProxyControl::delay_action`]).
    delays: Mutex<std::collections::HashMap<String, std::time::Duration>>,
    /// Requests held until released, by (access key, action) ([`ProxyControl::hold`]): the gate
    /// (false while held) and how many requests wait at it.
    holds: Mutex<std::collections::HashMap<(String, String), Gate>>,
    /// What the Price List API answers (LocalStack has none): `None` passes its requests on.
    prices: Mutex<Option<super::pricelist::PriceList>>,
}

/// Where held requests wait ([`ProxyControl::hold`]). Only the map holds the sender: a request
/// waits on a receiver, so a gate dropped or replaced lets its requests go.
struct Gate {
    open: tokio::sync::watch::Sender<bool>,
    waiting: Arc<AtomicU64>,
}

impl Shared {
    /// The instances hidden from `DescribeInstances` at `now`.
    fn hidden_now(&self, now: std::time::Instant) -> std::collections::BTreeSet<String> {
        lock(&self.hidden).iter().filter(|(_, until)| now < **until).map(|(id, _)| id.clone()).collect()
    }
}

/// A handle on a running proxy's settings that other threads and tasks can hold.
#[derive(Clone)]
pub struct ProxyControl {
    shared: Arc<Shared>,
}

impl ProxyControl {
    /// Holds the caller with this access key id to `principal`'s policy from now on.
    pub fn attach_policy(&self, access_key: &str, principal: Principal) {
        lock(&self.shared.principals).insert(access_key.to_string(), principal);
    }

    /// Models EC2's timing of terminations from now on.
    pub fn set_timing(&self, timing: Ec2Timing) {
        *lock(&self.shared.timing) = timing;
    }

    /// Requests refused because the caller's policy did not allow them, so far.
    pub fn unauthorized(&self) -> Vec<String> {
        lock(&self.shared.unauthorized).clone()
    }

    /// Leaves these instances out of every `DescribeInstances` answer for `how_long` from now,
    /// as EC2's eventually consistent describe does for some seconds after a launch.
    pub fn hide_instances(&self, ids: &[String], how_long: std::time::Duration) {
        let until = std::time::Instant::now() + how_long;
        lock(&self.shared.hidden).extend(ids.iter().map(|id| (id.clone(), until)));
    }

    /// Holds every request of `action` (`DescribeInstances`, ...) for `how_long` before it is
    /// answered, from now on (zero: no longer): a slow or far EC2, or a caller's turn at EC2's
    /// pace, stretched so that a test can act in between.
    pub fn delay_action(&self, action: &str, how_long: std::time::Duration) {
        lock(&self.shared.delays).insert(action.to_string(), how_long);
    }

    /// Answers the Price List API's `GetProducts` from `list` from now on, as AWS's own endpoint
    /// would (LocalStack does not emulate it: without a list, `None`, its requests go on to
    /// LocalStack, which refuses them).
    pub fn serve_prices(&self, list: Option<super::pricelist::PriceList>) {
        *lock(&self.shared.prices) = list;
    }

    /// Holds every request of `action` signed with `access_key` until [`ProxyControl::release`]:
    /// one caller stopped at one call (a process to be killed there), while other callers of the
    /// same proxy go on.
    pub fn hold(&self, access_key: &str, action: &str) {
        let gate = Gate { open: tokio::sync::watch::Sender::new(false), waiting: Arc::default() };
        lock(&self.shared.holds).insert((access_key.to_string(), action.to_string()), gate);
    }

    /// How many requests [`ProxyControl::hold`] holds now for this caller and action.
    pub fn held(&self, access_key: &str, action: &str) -> u64 {
        lock(&self.shared.holds)
            .get(&(access_key.to_string(), action.to_string()))
            .map_or(0, |g| g.waiting.load(Ordering::SeqCst))
    }

    /// Lets the held requests of this caller and action go on (to the upstream), and holds no more.
    pub fn release(&self, access_key: &str, action: &str) {
        if let Some(gate) = lock(&self.shared.holds).remove(&(access_key.to_string(), action.to_string())) {
            gate.open.send_replace(true);
        }
    }

    /// The instances a `TerminateInstances` named while they were hidden from `DescribeInstances`
    /// (sent without a look at their tags), so far.
    pub fn terminated_unseen(&self) -> Vec<String> {
        lock(&self.shared.terminated_unseen).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // a poisoned lock only means another request's task panicked; the data is still usable
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running proxy. Dropping it without [`Ec2Proxy::shutdown`] aborts its task.
pub struct Ec2Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl Ec2Proxy {
    /// Starts the proxy on `127.0.0.1:0`, forwarding to `upstream` (`http://host:port`).
    pub async fn start(upstream: &str, faults: ProxyFaults) -> Result<Ec2Proxy, ProxyError> {
        let host = upstream
            .strip_prefix("http://")
            .map(|h| h.trim_end_matches('/'))
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .ok_or_else(|| ProxyError::Upstream(upstream.to_string()))?;
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(ProxyError::Bind)?;
        let addr = listener.local_addr().map_err(ProxyError::Bind)?;
        let shared = Arc::new(Shared {
            upstream: host.to_string(),
            limits: Ec2Limits::default(),
            denied: Mutex::default(),
            faults: Mutex::new((faults, faults.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)),
            counters: Counters::default(),
            actions: Mutex::default(),
            principals: Mutex::default(),
            clouds: Mutex::default(),
            timing: Mutex::default(),
            terminations: Mutex::default(),
            unauthorized: Mutex::default(),
            hidden: Mutex::default(),
            delays: Mutex::default(),
            holds: Mutex::default(),
            prices: Mutex::default(),
            terminated_unseen: Mutex::default(),
        });
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let task = tokio::spawn(async move {
            // serve only returns on a listener error; the test then sees connection failures
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "the EC2 fault proxy stopped");
            }
        });
        Ok(Ec2Proxy { addr, shared, task: Some(task) })
    }

    /// The proxy's URL, for `AWS_ENDPOINT_URL`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Changes the faults from now on.
    pub fn set_faults(&self, faults: ProxyFaults) {
        let mut f = self.shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        f.0 = faults;
    }

    /// Answers these EC2 actions (`TerminateInstances`) the way EC2 answers a caller whose IAM
    /// policy does not allow them: 403 `UnauthorizedOperation`, `DryRun` or not.
    pub fn deny_actions(&self, actions: &[&str]) {
        let mut d = self.shared.denied.lock().unwrap_or_else(|p| p.into_inner());
        d.extend(actions.iter().map(|a| a.to_string()));
    }

    /// A handle on the proxy's settings (policies, timing).
    pub fn control(&self) -> ProxyControl {
        ProxyControl { shared: self.shared.clone() }
    }

    /// What the proxy did so far.
    pub fn counts(&self) -> ProxyCounts {
        let c = &self.shared.counters;
        ProxyCounts {
            forwarded: c.forwarded.load(Ordering::Relaxed),
            throttled: c.throttled.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            upstream_errors: c.upstream_errors.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            over_budget: c.over_budget.load(Ordering::Relaxed),
        }
    }

    /// Every request seen so far, by its query-protocol `Action` (`DescribeInstances`,
    /// `ListInstanceProfiles`, `GetCallerIdentity`, ...), whether or not it was forwarded; a
    /// request without one counts as `(none)`.
    pub fn actions(&self) -> std::collections::BTreeMap<String, u64> {
        self.shared.actions.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stops the proxy.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Ec2Proxy {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

enum Fault {
    Throttle,
    Internal,
}

impl Shared {
    fn pick(&self) -> Option<Fault> {
        let mut guard = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        let (faults, rng) = &mut *guard;
        // xorshift64: reproducible from the seed, good enough to spread faults
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let draw = (*rng >> 11) as f64 / (1u64 << 53) as f64;
        if draw < faults.throttle_rate {
            Some(Fault::Throttle)
        } else if draw < faults.throttle_rate + faults.error_rate {
            Some(Fault::Internal)
        } else {
            None
        }
    }
}

fn ec2_error(status: StatusCode, code: &str, message: &str) -> Response {
    let id = crate::naming::random_suffix(12);
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>{id}</RequestID></Response>"
    );
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", HeaderValue::from_static("text/xml;charset=UTF-8"));
    r
}

/// The error answer of a JSON-protocol service (the Price List API).
fn json_error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({"__type": code, "Message": message}).to_string();
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", HeaderValue::from_static("application/x-amz-json-1.1"));
    r
}

/// IAM's error answer (query protocol).
fn iam_error(status: StatusCode, code: &str, message: &str) -> Response {
    let id = crate::naming::random_suffix(12);
    let body = format!(
        "<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error><RequestId>{id}</RequestId></ErrorResponse>"
    );
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", HeaderValue::from_static("text/xml"));
    r
}

impl Shared {
    /// LocalStack clients of the caller's region and account, for reading resources' tags.
    async fn cloud(&self, caller: &Caller) -> Cloud {
        let key = (caller.region.clone(), caller.key.clone());
        if let Some(c) = lock(&self.clouds).get(&key) {
            return c.clone();
        }
        let endpoint = format!("http://{}", self.upstream);
        let cloud = Cloud::from_config(&crate::localstack::config_at(&endpoint, &caller.region, &caller.key).await);
        lock(&self.clouds).insert(key, cloud.clone());
        cloud
    }

    /// The answer AWS would give a caller whose policy does not allow the request, if so.
    async fn authorize(&self, headers: &HeaderMap, action: &str, params: &[(String, String)]) -> Option<Response> {
        let caller = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(Caller::of)?;
        let principal = lock(&self.principals).get(&caller.key).cloned()?;
        let cloud = self.cloud(&caller).await;
        let denial = match super::ec2auth::judge(&cloud, &principal, &caller, action, params).await {
            Ok(None) => return None,
            Ok(Some(d)) => d,
            Err(e) => {
                self.counters.upstream_errors.fetch_add(1, Ordering::Relaxed);
                return Some(plain(
                    StatusCode::BAD_GATEWAY,
                    format!("the EC2 proxy cannot read the resource's tags: {e}"),
                ));
            }
        };
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        let message = format!(
            "You are not authorized to perform: {} on resource: {} because no identity-based policy allows the {} action",
            denial.action, denial.resource, denial.action
        );
        lock(&self.unauthorized).push(format!("{} on {}", denial.action, denial.resource));
        Some(match caller.service.as_str() {
            "ec2" => ec2_error(StatusCode::FORBIDDEN, "UnauthorizedOperation", &message),
            "pricing" => json_error(StatusCode::BAD_REQUEST, "AccessDeniedException", &message),
            _ => iam_error(StatusCode::FORBIDDEN, "AccessDenied", &message),
        })
    }
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return plain(StatusCode::BAD_REQUEST, format!("cannot read the request body: {e}")),
    };
    let text = String::from_utf8_lossy(&body).into_owned();
    let query = parts.uri.query().unwrap_or_default();
    // EKS speaks REST-JSON: its operation is the method and path, not an `Action` parameter
    let eks = super::ec2auth::eks_operation(&parts.method, parts.uri.path());
    // the JSON protocol (the Price List API) names its operation in a header
    let target = parts
        .headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .and_then(|t| t.rsplit_once('.'))
        .map(|(_, op)| op.to_string());
    let action = target
        .clone()
        .or_else(|| super::ec2limits::action_of(&text))
        .or_else(|| super::ec2limits::action_of(query))
        .or_else(|| eks.as_ref().map(|(op, _)| op.to_string()))
        .unwrap_or_else(|| "(none)".to_string());
    *lock(&shared.actions).entry(action.clone()).or_default() += 1;
    let mut params: Vec<(String, String)> = Vec::new();
    if eks.is_none() && target.is_none() {
        params.extend(
            form_urlencoded::parse(text.as_bytes())
                .chain(form_urlencoded::parse(query.as_bytes()))
                .map(|(k, v)| (k.into_owned(), v.into_owned())),
        );
    }
    if let Some((_, name)) = &eks {
        params.push(("name".into(), name.clone()));
    }
    let is_ec2 = text.contains(EC2_API_VERSION) || query.contains(EC2_API_VERSION);
    if is_ec2 && lock(&shared.denied).contains(&action) {
        shared.counters.refused.fetch_add(1, Ordering::Relaxed);
        return ec2_error(
            StatusCode::FORBIDDEN,
            "UnauthorizedOperation",
            "You are not authorized to perform this operation.",
        );
    }
    if let Some(refusal) = shared.authorize(&parts.headers, &action, &params).await {
        return refusal;
    }
    let delay = lock(&shared.delays).get(&action).copied().unwrap_or_default();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let key = parts.headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(Caller::of).map(|c| c.key);
    let gate = key
        .and_then(|k| lock(&shared.holds).get(&(k, action.clone())).map(|g| (g.open.subscribe(), g.waiting.clone())));
    if let Some((mut open, waiting)) = gate {
        waiting.fetch_add(1, Ordering::SeqCst);
        // released, or the gate dropped (replaced, or the proxy going away): the request goes on
        let _ = open.wait_for(|o| *o).await;
        waiting.fetch_sub(1, Ordering::SeqCst);
    }
    if target.as_deref() == Some("GetProducts") {
        let list = lock(&shared.prices).clone();
        if let Some(list) = list {
            return match list.answer(&text) {
                Ok(answer) => {
                    let mut r = Response::new(Body::from(answer.to_string()));
                    r.headers_mut().insert("content-type", HeaderValue::from_static("application/x-amz-json-1.1"));
                    r
                }
                Err((code, message)) => json_error(StatusCode::BAD_REQUEST, code, &message),
            };
        }
    }
    if is_ec2 {
        if let Some(r) = shared.limits.check(&text, std::time::Instant::now()) {
            let counter = if r.status == 503 { &shared.counters.over_budget } else { &shared.counters.refused };
            counter.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(code = r.code, message = %r.message, "EC2 proxy: refused as EC2 would");
            let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
            return ec2_error(status, r.code, &r.message);
        }
        match shared.pick() {
            Some(Fault::Throttle) => {
                shared.counters.throttled.fetch_add(1, Ordering::Relaxed);
                return ec2_error(StatusCode::SERVICE_UNAVAILABLE, "RequestLimitExceeded", "Request limit exceeded.");
            }
            Some(Fault::Internal) => {
                shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                return ec2_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "An internal error has occurred.",
                );
            }
            None => {}
        }
    }
    // EC2's time: instances whose termination is under way are shown as EC2 would show them, and
    // a state filter is applied to that state, so it is taken off the request LocalStack sees
    let timing = *lock(&shared.timing);
    let modeled = (is_ec2 && action == "DescribeInstances")
        .then(|| lock(&shared.terminations).in_flight(&timing, std::time::Instant::now()))
        .filter(|m| !m.is_empty());
    let (upstream_body, wanted) = match &modeled {
        Some(_) => {
            let (b, w) = super::ec2time::split_state_filter(&text);
            (Bytes::from(b), w)
        }
        None => (body.clone(), None),
    };
    let answer = match forward(&shared.upstream, &parts.method, &parts.uri, &parts.headers, &upstream_body).await {
        Ok(r) => {
            shared.counters.forwarded.fetch_add(1, Ordering::Relaxed);
            r
        }
        Err(e) => {
            shared.counters.upstream_errors.fetch_add(1, Ordering::Relaxed);
            return plain(StatusCode::BAD_GATEWAY, format!("the EC2 proxy cannot reach {}: {e}", shared.upstream));
        }
    };
    let dry_run = params.iter().any(|(k, v)| k == "DryRun" && v.eq_ignore_ascii_case("true"));
    let now = std::time::Instant::now();
    let hidden = if is_ec2 { shared.hidden_now(now) } else { Default::default() };
    if is_ec2 && action == "TerminateInstances" && !dry_run {
        let named = params.iter().filter(|(k, _)| k.starts_with("InstanceId.")).map(|(_, v)| v);
        lock(&shared.terminated_unseen).extend(named.filter(|id| hidden.contains(*id)).cloned());
    }
    if is_ec2 && action == "TerminateInstances" && !dry_run && answer.status().is_success() {
        let ids = params.iter().filter(|(k, _)| k.starts_with("InstanceId.")).map(|(_, v)| v.clone());
        lock(&shared.terminations).record(ids, now);
    }
    let answer = if is_ec2 && action == "DescribeInstances" && !hidden.is_empty() && answer.status().is_success() {
        let (head, body) = answer.into_parts();
        match axum::body::to_bytes(body, MAX_BODY).await {
            Ok(b) => {
                let xml = super::ec2time::drop_instances(&String::from_utf8_lossy(&b), &hidden);
                Response::from_parts(head, Body::from(xml))
            }
            Err(e) => {
                return plain(StatusCode::BAD_GATEWAY, format!("the EC2 proxy cannot read LocalStack's answer: {e}"));
            }
        }
    } else {
        answer
    };
    match modeled {
        Some(m) if answer.status().is_success() => {
            let (head, body) = answer.into_parts();
            match axum::body::to_bytes(body, MAX_BODY).await {
                Ok(b) => {
                    let xml = super::ec2time::rewrite_instances(&String::from_utf8_lossy(&b), &m, wanted.as_ref());
                    Response::from_parts(head, Body::from(xml))
                }
                Err(e) => plain(StatusCode::BAD_GATEWAY, format!("the EC2 proxy cannot read LocalStack's answer: {e}")),
            }
        }
        _ => answer,
    }
}

fn plain(status: StatusCode, msg: String) -> Response {
    let mut r = Response::new(Body::from(msg));
    *r.status_mut() = status;
    r
}

/// Sends the request upstream on a fresh connection (`Connection: close`, so the response ends
/// at EOF) and turns the raw answer back into a response.
async fn forward(
    upstream: &str,
    method: &axum::http::Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> std::io::Result<Response> {
    let mut conn = TcpStream::connect(upstream).await?;
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {upstream}\r\n");
    for (name, value) in headers {
        let n = name.as_str();
        if matches!(n, "host" | "connection" | "content-length" | "transfer-encoding" | "keep-alive") {
            continue;
        }
        head.push_str(n);
        head.push_str(": ");
        head.push_str(&String::from_utf8_lossy(value.as_bytes()));
        head.push_str("\r\n");
    }
    head.push_str(&format!("content-length: {}\r\nconnection: close\r\n\r\n", body.len()));
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body).await?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await?;
    parse_response(&raw)
}

fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

fn parse_response(raw: &[u8]) -> std::io::Result<Response> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| bad("headers are not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("empty response"))?;
    let code: u16 =
        status_line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| bad("bad status line"))?;
    let mut builder = Response::builder().status(code);
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let name = name.trim().to_ascii_lowercase();
        let value = value.trim();
        if name == "transfer-encoding" {
            chunked = value.eq_ignore_ascii_case("chunked");
            continue;
        }
        if matches!(name.as_str(), "connection" | "content-length" | "keep-alive") {
            continue;
        }
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            builder = builder.header(n, v);
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked { dechunk(rest)? } else { rest.to_vec() };
    builder.body(Body::from(body)).map_err(|e| bad(&e.to_string()))
}

fn dechunk(mut rest: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| bad("truncated chunk size"))?;
        let size_text = std::str::from_utf8(&rest[..nl]).map_err(|_| bad("bad chunk size"))?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| bad("bad chunk size"))?;
        rest = &rest[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size {
            return Err(bad("truncated chunk"));
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_parsed_with_and_without_chunking() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\ncontent-type: text/xml\r\ncontent-length: 3\r\n\r\nabc").unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-type"], "text/xml");
        assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(), b"abcde");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    #[test]
    fn fault_rates_are_honoured() {
        let shared = Shared {
            upstream: String::new(),
            limits: Ec2Limits::default(),
            denied: Mutex::default(),
            faults: Mutex::new((ProxyFaults { throttle_rate: 0.2, error_rate: 0.1, seed: 7 }, 7 | 1)),
            counters: Counters::default(),
            actions: Mutex::default(),
            principals: Mutex::default(),
            clouds: Mutex::default(),
            timing: Mutex::default(),
            terminations: Mutex::default(),
            unauthorized: Mutex::default(),
            hidden: Mutex::default(),
            delays: Mutex::default(),
            holds: Mutex::default(),
            terminated_unseen: Mutex::default(),
            prices: Mutex::default(),
        };
        let (mut t, mut i) = (0, 0);
        for _ in 0..10_000 {
            match shared.pick() {
                Some(Fault::Throttle) => t += 1,
                Some(Fault::Internal) => i += 1,
                None => {}
            }
        }
        assert!((1_700..2_300).contains(&t), "throttled {t}");
        assert!((700..1_300).contains(&i), "internal {i}");
    }
}
