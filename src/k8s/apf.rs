//! API Priority and Fairness: an EKS API server under load answers 429 with `Retry-After` and a
//! plain-text body ("Too many requests, please try again later."), not a `Status` object, while a
//! PodDisruptionBudget refusal is a 429 `Status` whose causes name `DisruptionBudget`. kube parses
//! the plain-text answer into a `Status` without the header, so the delay the server asked for is
//! lost; this layer turns such an answer into the `Status` kube-apiserver would have written
//! (reason `TooManyRequests`, `details.retryAfterSeconds` from the header) before kube sees it,
//! and counts it as `kubernetes:throttled` in the report.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use kube::client::DynBody;

use super::calls::ApiCalls;

/// The longest delay honoured (APF's own `maxRetryAfter` is 32 s).
const MAX_RETRY_AFTER: u32 = 32;

/// A tower layer that rewrites APF's plain-text 429 into a `Status` carrying its `Retry-After`.
pub(crate) fn layer(
    calls: ApiCalls,
) -> tower::util::MapResponseLayer<impl Fn(Response<Box<DynBody>>) -> Response<Box<DynBody>> + Clone> {
    tower::util::MapResponseLayer::new(move |res: Response<Box<DynBody>>| normalise(&calls, res))
}

fn normalise(calls: &ApiCalls, res: Response<Box<DynBody>>) -> Response<Box<DynBody>> {
    if res.status() != StatusCode::TOO_MANY_REQUESTS {
        return res;
    }
    let json =
        res.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| ct.contains("json"));
    if json {
        return res; // a Status of the server's own (a PDB refusal): left as it is
    }
    calls.record("throttled");
    let retry_after = retry_after_header(res.headers()).unwrap_or(1);
    let status = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 429,
        "reason": "TooManyRequests",
        "message": "the API server is throttling requests (API Priority and Fairness: too many requests, please try again later)",
        "details": {"retryAfterSeconds": retry_after},
    });
    let (mut parts, _) = res.into_parts();
    parts.headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = Full::new(Bytes::from(status.to_string())).map_err(|never| -> tower::BoxError { match never {} });
    Response::from_parts(parts, Box::new(body) as Box<DynBody>)
}

/// `Retry-After` in seconds (the form kube-apiserver writes), capped at APF's maximum.
fn retry_after_header(headers: &http::HeaderMap) -> Option<u32> {
    let secs: u32 = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(secs.clamp(1, MAX_RETRY_AFTER))
}

/// The delay a throttled request asks for: `details.retryAfterSeconds` of a 429.
pub(crate) fn retry_after(e: &kube::Error) -> Option<Duration> {
    match e {
        kube::Error::Api(s) if s.code == 429 => {
            let secs = s.details.as_ref().map(|d| d.retry_after_seconds).filter(|s| *s > 0)?;
            Some(Duration::from_secs(u64::from(secs)))
        }
        _ => None,
    }
}

/// Whether a 429 is a PodDisruptionBudget's refusal (its causes name `DisruptionBudget`), as
/// opposed to the API server throttling.
pub(crate) fn is_disruption_budget_refusal(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 429
        && s.details.as_ref().is_some_and(|d| d.causes.iter().any(|c| c.reason == "DisruptionBudget")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16, content_type: &str, retry_after: Option<&str>, body: &str) -> Response<Box<DynBody>> {
        let mut b = Response::builder().status(status).header(header::CONTENT_TYPE, content_type);
        if let Some(r) = retry_after {
            b = b.header(header::RETRY_AFTER, r);
        }
        let body = Full::new(Bytes::from(body.to_string())).map_err(|never| -> tower::BoxError { match never {} });
        b.body(Box::new(body) as Box<DynBody>).unwrap()
    }

    async fn text(res: Response<Box<DynBody>>) -> serde_json::Value {
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null)
    }

    #[tokio::test]
    async fn an_apf_rejection_becomes_a_status_with_its_delay_and_is_counted() {
        let calls = ApiCalls::default();
        let res = normalise(
            &calls,
            response(429, "text/plain; charset=utf-8", Some("7"), "Too many requests, please try again later.\n"),
        );
        let v = text(res).await;
        assert_eq!(v["reason"], "TooManyRequests");
        assert_eq!(v["details"]["retryAfterSeconds"], 7);
        assert_eq!(calls.snapshot().get("kubernetes:throttled"), Some(&1));
        let capped = text(normalise(&calls, response(429, "text/plain", Some("600"), ""))).await;
        assert_eq!(capped["details"]["retryAfterSeconds"], MAX_RETRY_AFTER);
    }

    #[tokio::test]
    async fn a_pdb_refusal_and_other_answers_pass_untouched() {
        let calls = ApiCalls::default();
        let pdb = r#"{"kind":"Status","code":429,"reason":"TooManyRequests","details":{"causes":[{"reason":"DisruptionBudget"}]}}"#;
        let v = text(normalise(&calls, response(429, "application/json", None, pdb))).await;
        assert_eq!(v["details"]["causes"][0]["reason"], "DisruptionBudget");
        let ok = text(normalise(&calls, response(200, "text/plain", None, "x"))).await;
        assert_eq!(ok, serde_json::Value::Null);
        assert!(calls.snapshot().is_empty());
    }
}
