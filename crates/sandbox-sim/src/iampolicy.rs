//! An IAM policy evaluator for the EC2 proxy: it judges each request a caller makes against the
//! identity policy attached to it (the project's `deploy/iam-policy.json`, with its placeholders
//! bound), the way AWS's policy evaluation does for the part of the policy language that policy
//! uses, so that a policy too narrow for what the tool does fails a test with the
//! `UnauthorizedOperation` AWS would answer.
//!
//! What it evaluates (IAM User Guide, "Policy evaluation logic" and "IAM JSON policy elements"):
//! - `Statement` (one or a list), `Effect` `Allow`/`Deny`, `Action` and `Resource` (a string or
//!   a list, `*` and `?` wildcards; actions case-insensitive, resources case-sensitive, a `*` in
//!   a resource matching across `/` and `:`), `Sid` (ignored), `Version`;
//! - `Condition` with `StringEquals`, `StringNotEquals`, `StringLike`, `StringNotLike` and `Null`,
//!   on the keys `aws:ResourceTag/<key>` (from the resource's tags as they are at the request;
//!   the tag key matched case-insensitively, as IAM does) and `aws:RequestedRegion`. Operators
//!   of one statement, and keys of one operator, must all match; the values of one key are
//!   alternatives. A missing key fails `StringEquals`/`StringLike` and satisfies
//!   `StringNotEquals`/`StringNotLike`;
//! - an explicit `Deny` wins over any `Allow`; nothing allowed is an implicit deny.
//!
//! Its limits: one identity-based policy per caller, no resource policies, permission
//! boundaries, session policies or SCPs; no `NotAction`, `NotResource`, `Principal`, `IfExists`,
//! `ForAnyValue`/`ForAllValues`, numeric, date, boolean, ARN or IP operators, and no policy
//! variables (`${aws:username}`): a policy using any of them is refused when parsed, so it is
//! never misjudged. Which resource ARN each API action is authorized on is the proxy's
//! ([`super::ec2proxy`]), for the actions the tool calls.

use std::collections::BTreeMap;

use serde_json::Value;

/// A policy the evaluator cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("IAM policy: {0}; the test bed's evaluator reads only the elements listed in sandbox_sim::iampolicy")]
pub struct PolicyError(String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Effect {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    StringEquals,
    StringNotEquals,
    StringLike,
    StringNotLike,
    Null,
}

#[derive(Debug, Clone)]
struct Condition {
    op: Op,
    key: String,
    values: Vec<String>,
}

#[derive(Debug, Clone)]
struct Statement {
    effect: Effect,
    actions: Vec<String>,
    resources: Vec<String>,
    conditions: Vec<Condition>,
}

/// One request as IAM sees it.
#[derive(Debug, Clone, Copy)]
pub struct Authorization<'a> {
    /// `service:Action`, e.g. `ec2:TerminateInstances`.
    pub action: &'a str,
    /// The resource's ARN, or `*` for actions without resource-level permissions.
    pub resource: &'a str,
    /// The region the request went to.
    pub region: &'a str,
    /// The resource's tags now.
    pub tags: &'a BTreeMap<String, String>,
}

/// What the policy says about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A statement allows it and none denies it.
    Allow,
    /// No statement allows it.
    ImplicitDeny,
    /// A `Deny` statement matches it.
    ExplicitDeny,
}

/// An identity-based policy.
#[derive(Debug, Clone)]
pub struct Policy {
    statements: Vec<Statement>,
}

fn strings(v: &Value, what: &str) -> Result<Vec<String>, PolicyError> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| PolicyError(format!("{what} holds a non-string"))))
            .collect(),
        Value::Bool(b) => Ok(vec![b.to_string()]),
        _ => Err(PolicyError(format!("{what} is neither a string nor a list of strings"))),
    }
}

impl Policy {
    /// Parses a policy document after replacing each `(placeholder, value)` in its text (the
    /// shipped policy's `CLUSTER_NAME`, `REGION`, `ACCOUNT_ID`, `PARTITION`).
    pub fn parse(text: &str, bindings: &[(&str, &str)]) -> Result<Policy, PolicyError> {
        let mut text = text.to_string();
        for (placeholder, value) in bindings {
            text = text.replace(placeholder, value);
        }
        let doc: Value = serde_json::from_str(&text).map_err(|e| PolicyError(format!("not JSON: {e}")))?;
        let list = match &doc["Statement"] {
            Value::Array(a) => a.clone(),
            s @ Value::Object(_) => vec![s.clone()],
            _ => return Err(PolicyError("no Statement".into())),
        };
        let mut statements = Vec::new();
        for st in &list {
            let obj = st.as_object().ok_or_else(|| PolicyError("a statement is not an object".into()))?;
            for key in obj.keys() {
                if !matches!(key.as_str(), "Sid" | "Effect" | "Action" | "Resource" | "Condition") {
                    return Err(PolicyError(format!("unsupported statement element {key}")));
                }
            }
            let effect = match obj.get("Effect").and_then(Value::as_str) {
                Some("Allow") => Effect::Allow,
                Some("Deny") => Effect::Deny,
                other => return Err(PolicyError(format!("Effect {other:?}"))),
            };
            let actions = strings(obj.get("Action").unwrap_or(&Value::Null), "Action")?;
            let resources = strings(obj.get("Resource").unwrap_or(&Value::Null), "Resource")?;
            let mut conditions = Vec::new();
            if let Some(c) = obj.get("Condition") {
                let ops = c.as_object().ok_or_else(|| PolicyError("Condition is not an object".into()))?;
                for (op_name, keys) in ops {
                    let op = match op_name.as_str() {
                        "StringEquals" => Op::StringEquals,
                        "StringNotEquals" => Op::StringNotEquals,
                        "StringLike" => Op::StringLike,
                        "StringNotLike" => Op::StringNotLike,
                        "Null" => Op::Null,
                        other => return Err(PolicyError(format!("unsupported condition operator {other}"))),
                    };
                    let keys = keys.as_object().ok_or_else(|| PolicyError(format!("{op_name} is not an object")))?;
                    for (key, values) in keys {
                        let lower = key.to_ascii_lowercase();
                        if !(lower.starts_with("aws:resourcetag/") || lower == "aws:requestedregion") {
                            return Err(PolicyError(format!("unsupported condition key {key}")));
                        }
                        if key.contains("${") {
                            return Err(PolicyError(format!("policy variables are not supported: {key}")));
                        }
                        conditions.push(Condition { op, key: key.clone(), values: strings(values, key)? });
                    }
                }
            }
            statements.push(Statement { effect, actions, resources, conditions });
        }
        Ok(Policy { statements })
    }

    /// Evaluates one request.
    pub fn decide(&self, req: &Authorization<'_>) -> Decision {
        let mut allowed = false;
        for st in &self.statements {
            let applies = st.actions.iter().any(|a| glob(&a.to_ascii_lowercase(), &req.action.to_ascii_lowercase()))
                && st.resources.iter().any(|r| glob(r, req.resource))
                && st.conditions.iter().all(|c| c.holds(req));
            match (applies, st.effect) {
                (true, Effect::Deny) => return Decision::ExplicitDeny,
                (true, Effect::Allow) => allowed = true,
                (false, _) => {}
            }
        }
        if allowed { Decision::Allow } else { Decision::ImplicitDeny }
    }
}

impl Condition {
    fn holds(&self, req: &Authorization<'_>) -> bool {
        let lower = self.key.to_ascii_lowercase();
        let actual: Option<&str> = match lower.strip_prefix("aws:resourcetag/") {
            Some(tag) => req.tags.iter().find(|(k, _)| k.to_ascii_lowercase() == tag).map(|(_, v)| v.as_str()),
            None => Some(req.region),
        };
        match (self.op, actual) {
            (Op::Null, a) => self.values.iter().any(|v| (v == "true") == a.is_none()),
            (Op::StringEquals | Op::StringLike, None) => false,
            (Op::StringNotEquals | Op::StringNotLike, None) => true,
            (Op::StringEquals, Some(a)) => self.values.iter().any(|v| v == a),
            (Op::StringNotEquals, Some(a)) => !self.values.iter().any(|v| v == a),
            (Op::StringLike, Some(a)) => self.values.iter().any(|v| glob(v, a)),
            (Op::StringNotLike, Some(a)) => !self.values.iter().any(|v| glob(v, a)),
        }
    }
}

/// Whether `text` matches `pattern`, where `*` is any run of characters and `?` one character.
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = r#"{"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["ec2:Describe*"], "Resource": "*"},
        {"Effect": "Allow", "Action": "ec2:TerminateInstances",
         "Resource": "arn:PARTITION:ec2:REGION:ACCOUNT_ID:instance/*",
         "Condition": {"StringEquals": {"aws:ResourceTag/eks:eks-cluster-name": "CLUSTER_NAME"},
                       "Null": {"aws:ResourceTag/karpenter.sh/nodepool": "false"}}},
        {"Effect": "Allow", "Action": "iam:DeleteInstanceProfile", "Resource": "*",
         "Condition": {"StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
        {"Effect": "Deny", "Action": "ec2:TerminateInstances", "Resource": "*",
         "Condition": {"StringEquals": {"aws:ResourceTag/keep": "yes"}}}
    ]}"#;

    fn bound() -> Policy {
        Policy::parse(
            POLICY,
            &[("CLUSTER_NAME", "prod"), ("REGION", "us-west-2"), ("ACCOUNT_ID", "000000000000"), ("PARTITION", "aws")],
        )
        .unwrap()
    }

    fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn decide(action: &str, resource: &str, t: &[(&str, &str)]) -> Decision {
        bound().decide(&Authorization { action, resource, region: "us-west-2", tags: &tags(t) })
    }

    const INSTANCE: &str = "arn:aws:ec2:us-west-2:000000000000:instance/i-1";

    #[test]
    fn actions_match_case_insensitively_with_wildcards() {
        assert_eq!(decide("ec2:DescribeInstances", "*", &[]), Decision::Allow);
        assert_eq!(decide("EC2:describeVolumes", "*", &[]), Decision::Allow);
        assert_eq!(decide("ec2:DeleteVolume", "*", &[]), Decision::ImplicitDeny);
    }

    #[test]
    fn resource_tags_and_arns_decide_a_termination() {
        let ours = [("eks:eks-cluster-name", "prod"), ("karpenter.sh/nodepool", "default")];
        assert_eq!(decide("ec2:TerminateInstances", INSTANCE, &ours), Decision::Allow);
        assert_eq!(
            decide(
                "ec2:TerminateInstances",
                INSTANCE,
                &[("EKS:EKS-Cluster-Name", "prod"), ("karpenter.sh/nodepool", "x")]
            ),
            Decision::Allow,
            "tag keys match case-insensitively"
        );
        assert_eq!(decide("ec2:TerminateInstances", INSTANCE, &ours[..1]), Decision::ImplicitDeny, "Null: false");
        let staging = [("eks:eks-cluster-name", "staging"), ("karpenter.sh/nodepool", "default")];
        assert_eq!(decide("ec2:TerminateInstances", INSTANCE, &staging), Decision::ImplicitDeny);
        let other_region = "arn:aws:ec2:eu-west-1:000000000000:instance/i-1";
        assert_eq!(decide("ec2:TerminateInstances", other_region, &ours), Decision::ImplicitDeny);
        let kept = [ours[0], ours[1], ("keep", "yes")];
        assert_eq!(decide("ec2:TerminateInstances", INSTANCE, &kept), Decision::ExplicitDeny, "Deny wins");
    }

    #[test]
    fn string_like_needs_the_key_and_negations_hold_without_it() {
        assert_eq!(
            decide("iam:DeleteInstanceProfile", "x", &[("karpenter.k8s.aws/ec2nodeclass", "a")]),
            Decision::Allow
        );
        assert_eq!(decide("iam:DeleteInstanceProfile", "x", &[]), Decision::ImplicitDeny);
        let p = Policy::parse(
            r#"{"Statement": {"Effect": "Allow", "Action": "ec2:*", "Resource": "*",
               "Condition": {"StringNotEquals": {"aws:ResourceTag/owner": "them"}}}}"#,
            &[],
        )
        .unwrap();
        let ask = |t: &[(&str, &str)]| {
            p.decide(&Authorization { action: "ec2:DeleteTags", resource: "*", region: "r", tags: &tags(t) })
        };
        assert_eq!(ask(&[]), Decision::Allow);
        assert_eq!(ask(&[("owner", "us")]), Decision::Allow);
        assert_eq!(ask(&[("owner", "them")]), Decision::ImplicitDeny);
    }

    #[test]
    fn what_the_evaluator_cannot_judge_is_refused() {
        for doc in [
            r#"{"Statement": [{"Effect": "Allow", "NotAction": "ec2:*", "Resource": "*"}]}"#,
            r#"{"Statement": [{"Effect": "Allow", "Action": "ec2:*", "Resource": "*", "Condition": {"StringEqualsIfExists": {"aws:ResourceTag/a": "b"}}}]}"#,
            r#"{"Statement": [{"Effect": "Allow", "Action": "ec2:*", "Resource": "*", "Condition": {"StringEquals": {"ec2:InstanceType": "m5.large"}}}]}"#,
            r#"{"Statement": [{"Effect": "Maybe", "Action": "ec2:*", "Resource": "*"}]}"#,
        ] {
            assert!(Policy::parse(doc, &[]).is_err(), "{doc}");
        }
    }

    #[test]
    fn globs() {
        assert!(glob("arn:aws:iam::1:instance-profile/*", "arn:aws:iam::1:instance-profile/karpenter/us/p_1"));
        assert!(glob("a?c", "abc"));
        assert!(!glob("a?c", "ac"));
        assert!(glob("*", ""));
        assert!(!glob("ab", "abc"));
        assert!(glob("*b*", "abc"));
    }
}
