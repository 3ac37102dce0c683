//! Watches: newline-delimited JSON events from a resourceVersion, with bookmarks, timeouts,
//! selectors, 410 for a too old resourceVersion and optional injected disconnects.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use super::http::{Query, Shared, Target, as_version, error_response, list_options};
use super::kinds::ResourceInfo;
use super::packed::Json;
use super::store::{Backlogged, EventType, ListOptions, StoreEvent, json_value};
use super::table;

fn line(ty: &str, object: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": ty, "object": object})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

/// A watch event line around an object's JSON as the store keeps it.
fn raw_line(ty: &str, object: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(object.len() + 32);
    v.extend_from_slice(b"{\"type\":\"");
    v.extend_from_slice(ty.as_bytes());
    v.extend_from_slice(b"\",\"object\":");
    v.extend_from_slice(object);
    v.extend_from_slice(b"}\n");
    Bytes::from(v)
}

/// The one field of an object a watch needs to decide whether it can send the stored JSON as it
/// is; reading it skips the rest without building it.
#[derive(serde::Deserialize)]
struct ApiVersionOnly {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
}

struct Filter {
    namespace: Option<String>,
    opts: ListOptions,
}

impl Filter {
    /// Whether the filter reads the object (a selector) or only its key.
    fn reads_objects(&self) -> bool {
        self.opts.labels.is_some() || self.opts.fields.is_some()
    }

    /// [`Filter::matches`] on an object as the store keeps it, parsed only for a selector.
    fn matches_json(&self, ev_ns: &str, obj: &Json) -> bool {
        if self.reads_objects() {
            self.matches(ev_ns, &obj.value())
        } else {
            self.namespace.as_deref().is_none_or(|n| n == ev_ns)
        }
    }

    fn matches(&self, ev_ns: &str, obj: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|n| n == ev_ns)
            && self.opts.labels.as_ref().is_none_or(|l| l.matches(obj))
            && self.opts.fields.as_ref().is_none_or(|f| f.matches(obj))
    }

    /// The watch event type a client of this filter sees for a store event, if any: objects
    /// entering the selection are ADDED, leaving it DELETED.
    fn translate(&self, ev: &StoreEvent) -> Option<&'static str> {
        let now = self.matches_json(&ev.key.namespace, &ev.object_json);
        let before = ev.old_json.as_ref().is_some_and(|o| self.matches_json(&ev.key.namespace, o));
        match ev.event_type {
            EventType::Added => now.then_some("ADDED"),
            EventType::Deleted => before.then_some("DELETED"),
            EventType::Modified => match (before, now) {
                (true, true) => Some("MODIFIED"),
                (false, true) => Some("ADDED"),
                (true, false) => Some("DELETED"),
                (false, false) => None,
            },
        }
    }
}

/// Serves a watch request.
pub(crate) fn serve(
    shared: Arc<Shared>,
    t: Target,
    info: ResourceInfo,
    q: Query,
    table_out: bool,
    drop_after: Option<Duration>,
) -> Response {
    let opts = match list_options(&info, &q) {
        Ok(o) => o,
        Err(e) => return error_response(&e),
    };
    let filter = Filter { namespace: t.namespace.clone(), opts };
    let rv = q.get("resourceVersion").filter(|r| !r.is_empty() && *r != "0").map(|r| r.parse::<u64>());
    let rv = match rv {
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            return error_response(&super::status::ApiError::bad_request(
                "resourceVersion: Invalid value: must be a number",
            ));
        }
        None => None,
    };
    let send_initial = q.get("sendInitialEvents").is_some_and(|v| v == "true");
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout = q.get("timeoutSeconds").and_then(|s| s.parse::<u64>().ok()).map(Duration::from_secs);
    let gr = t.gr();
    let av = t.api_version();
    let subscribed = shared.store.watch_from(&gr, if send_initial { None } else { rv });
    let bookmark_every = Duration::from_secs_f64((60.0 * shared.time_scale).clamp(0.1, 60.0));
    let cancel = shared.cancel.clone();
    let kind = info.kind.clone();
    // The stored JSON goes out as it is when it is already what the client asked for; a table or
    // another version is built from its value.
    let render = move |ty: &str, json: &Json| -> Bytes {
        let json = json.to_vec();
        let json = json.as_slice();
        if !table_out && serde_json::from_slice::<ApiVersionOnly>(json).is_ok_and(|o| o.api_version == av) {
            return raw_line(ty, json);
        }
        let o = as_version(json_value(json), &av);
        line(ty, &if table_out { table::table(&info, &[o], 0, &Query::new(), true) } else { o })
    };
    let stream = async_stream::stream! {
        let (backlog, mut rx, start_rv) = match subscribed {
            Ok(s) => s,
            Err(e) => {
                // Like the real server: 200, then one ERROR event carrying the 410 Status.
                yield Ok::<Bytes, Infallible>(line("ERROR", &e.to_status()));
                return;
            }
        };
        let mut last_rv = start_rv;
        for ev in backlog.iter().map(Backlogged::event) {
            let ty = if rv.is_none() || send_initial {
                filter.matches_json(&ev.key.namespace, &ev.object_json).then_some("ADDED")
            } else {
                filter.translate(&ev)
            };
            if let Some(ty) = ty {
                yield Ok(render(ty, &ev.object_json));
            }
        }
        if send_initial {
            yield Ok(line("BOOKMARK", &json!({"kind": kind, "apiVersion": t.api_version(),
                "metadata": {"resourceVersion": last_rv.to_string(),
                "annotations": {"k8s.io/initial-events-end": "true"}}})));
        }
        let deadline = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(3600)).min(drop_after.unwrap_or(Duration::MAX)));
        tokio::pin!(deadline);
        // kube-apiserver's watch cache also sends one bookmark 2 s before the watch times out,
        // so that the client resumes from the newest resourceVersion (apiserver's
        // storage/cacher/cache_watcher.go, nextBookmarkTime); none when the timeout is shorter
        let pretimeout = timeout.and_then(|t| t.checked_sub(Duration::from_secs(2))).filter(|_| bookmarks);
        let pretimeout_bookmark = tokio::time::sleep(pretimeout.unwrap_or(Duration::MAX / 4));
        tokio::pin!(pretimeout_bookmark);
        let mut pretimeout_due = pretimeout.is_some();
        let mut tick = tokio::time::interval(bookmark_every);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = &mut deadline => break,
                _ = &mut pretimeout_bookmark, if pretimeout_due => {
                    pretimeout_due = false;
                    yield Ok(line("BOOKMARK", &json!({"kind": kind, "apiVersion": t.api_version(),
                        "metadata": {"resourceVersion": last_rv.to_string()}})));
                }
                _ = tick.tick(), if bookmarks => {
                    yield Ok(line("BOOKMARK", &json!({"kind": kind, "apiVersion": t.api_version(),
                        "metadata": {"resourceVersion": last_rv.to_string()}})));
                }
                r = rx.recv() => match r {
                    Ok(ev) => {
                        last_rv = last_rv.max(ev.rv);
                        if ev.key.gr != gr {
                            continue;
                        }
                        if let Some(ty) = filter.translate(&ev) {
                            yield Ok(render(ty, &ev.object_json));
                        }
                    }
                    // A watcher that fell behind is cut; the client resumes from its last rv.
                    Err(RecvError::Lagged(_)) | Err(RecvError::Closed) => break,
                },
            }
        }
    };
    let mut r = Response::new(Body::from_stream(stream));
    *r.status_mut() = StatusCode::OK;
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    r
}
