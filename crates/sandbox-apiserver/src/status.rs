//! API errors rendered as `meta/v1 Status` objects with the reasons and codes of kube-apiserver.

use serde_json::{Value, json};

/// An API error as kube-apiserver reports it: an HTTP code, a `reason` and a message, plus the
/// `details` the real server attaches (name, group, kind, causes).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code (404, 409, 422, ...).
    pub code: u16,
    /// `Status.reason` (`NotFound`, `Conflict`, `Invalid`, ...).
    pub reason: &'static str,
    /// Human readable message, worded like the real server's.
    pub message: String,
    /// `Status.details`, when the real server sets it.
    pub details: Option<Value>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.reason, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

/// `pods` or `nodepools.karpenter.sh`: the qualified resource the real server names in messages.
pub(crate) fn qualified(group: &str, resource: &str) -> String {
    if group.is_empty() { resource.to_string() } else { format!("{resource}.{group}") }
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError { code, reason, message: message.into(), details: None }
    }

    fn with_details(mut self, name: &str, group: &str, kind: &str) -> Self {
        self.details = Some(json!({"name": name, "group": group, "kind": kind}));
        self
    }

    /// 404 `pods "x" not found`.
    pub fn not_found(group: &str, resource: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{} \"{name}\" not found", qualified(group, resource)))
            .with_details(name, group, resource)
    }

    /// 404 for a path that names no known resource.
    pub fn no_route(path: &str) -> Self {
        Self::new(404, "NotFound", format!("the server could not find the requested resource ({path})"))
    }

    /// 409 `pods "x" already exists`.
    pub fn already_exists(group: &str, resource: &str, name: &str) -> Self {
        Self::new(409, "AlreadyExists", format!("{} \"{name}\" already exists", qualified(group, resource)))
            .with_details(name, group, resource)
    }

    /// 409 optimistic-concurrency conflict.
    pub fn conflict(group: &str, resource: &str, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {} \"{name}\": {why}", qualified(group, resource)),
        )
        .with_details(name, group, resource)
    }

    /// 409 for a stale `metadata.resourceVersion`.
    pub fn stale(group: &str, resource: &str, name: &str) -> Self {
        Self::conflict(
            group,
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 `Kind.group "name" is invalid: field: Type: detail` (the kind qualified by its group,
    /// as kube-apiserver's `NewInvalid` names a `GroupKind`).
    pub fn invalid(group: &str, kind: &str, name: &str, field: &str, cause: &str, detail: &str) -> Self {
        Self::invalid_causes(group, kind, name, &[(field.to_string(), cause, detail.to_string())])
    }

    /// 422 for several causes `(field, reason, message)`: one is written `field: message`,
    /// more are listed in brackets, as kube-apiserver's `NewInvalid` writes an error list.
    pub fn invalid_causes(group: &str, kind: &str, name: &str, causes: &[(String, &str, String)]) -> Self {
        let listed: Vec<String> = causes.iter().map(|(field, _, detail)| format!("{field}: {detail}")).collect();
        let listed = match listed.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let qualified_kind = if group.is_empty() { kind.to_string() } else { format!("{kind}.{group}") };
        let mut e = Self::new(422, "Invalid", format!("{qualified_kind} \"{name}\" is invalid: {listed}"));
        let causes: Vec<Value> = causes
            .iter()
            .map(|(field, reason, detail)| json!({"reason": reason, "message": detail, "field": field}))
            .collect();
        e.details = Some(json!({"name": name, "group": group, "kind": kind, "causes": causes}));
        e
    }

    /// 422 without a field (e.g. a failed JSON patch `test`).
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 403 Forbidden.
    /// (`pods is forbidden` when the request names no object, as kube-apiserver's
    /// `NewForbidden` writes it.)
    pub fn forbidden(group: &str, resource: &str, name: &str, why: &str) -> Self {
        let what = if name.is_empty() {
            qualified(group, resource)
        } else {
            format!("{} \"{name}\"", qualified(group, resource))
        };
        Self::new(403, "Forbidden", format!("{what} is forbidden: {why}")).with_details(name, group, resource)
    }

    /// 405 MethodNotAllowed.
    pub fn method_not_allowed(what: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({what})"),
        )
    }

    /// 415 UnsupportedMediaType.
    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {content_type})"
            ),
        )
    }

    /// 429 TooManyRequests.
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        Self::new(429, "TooManyRequests", message)
    }

    /// 410 with reason `Expired`, as the real server answers a too old resourceVersion or
    /// continue token.
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 500 InternalError.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// 503 ServiceUnavailable.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, "ServiceUnavailable", message)
    }

    /// The `Status` object of this error.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kube-apiserver's wording, as the differential suite saw it: a request that names no object
    /// is forbidden without an empty quoted name, and an invalid custom resource names its kind
    /// with its group and lists several causes in brackets.
    #[test]
    fn messages_are_worded_as_kube_apiservers() {
        let why = "User \"u\" cannot list resource \"secrets\"";
        assert_eq!(ApiError::forbidden("", "secrets", "", why).message, format!("secrets is forbidden: {why}"));
        assert_eq!(ApiError::forbidden("", "nodes", "n1", why).message, format!("nodes \"n1\" is forbidden: {why}"));

        let one = ApiError::invalid("karpenter.sh", "NodePool", "p", "spec", "FieldValueInvalid", "bad");
        assert_eq!(one.message, "NodePool.karpenter.sh \"p\" is invalid: spec: bad");
        assert_eq!(one.details.as_ref().unwrap()["kind"], "NodePool");
        let two = ApiError::invalid_causes(
            "",
            "Node",
            "n",
            &[
                ("a".into(), "FieldValueRequired", "Required value".into()),
                ("b".into(), "FieldValueInvalid", "x".into()),
            ],
        );
        assert_eq!(two.message, "Node \"n\" is invalid: [a: Required value, b: x]");
        assert_eq!(
            two.details.unwrap()["causes"][1],
            json!({"reason": "FieldValueInvalid", "message": "x", "field": "b"})
        );
    }
}
