//! Label and field selectors, parsed the way kube-apiserver parses them.

use serde_json::Value;

use super::kinds::ResourceInfo;
use super::status::ApiError;

#[derive(Debug, Clone, PartialEq)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector (`a=b,c!=d,e in (x,y),f notin (z),g,!h`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector(Vec<Req>);

fn split_top(s: &str) -> Vec<String> {
    // Commas inside `in (...)` belong to the set, not to the requirement list.
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c)
            }
            ')' => {
                depth -= 1;
                cur.push(c)
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out.into_iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

fn set_values(rest: &str, whole: &str) -> Result<Vec<String>, ApiError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| ApiError::bad_request(format!("unable to parse requirement: found '{whole}', expected: '('")))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect())
}

impl LabelSelector {
    /// Parses a selector string; an empty string selects everything.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            let words: Vec<&str> = part.split_whitespace().collect();
            if let Some(k) = part.strip_prefix('!') {
                reqs.push(Req::NotExists(k.trim().to_string()));
            } else if words.len() >= 2 && words[1] == "in" {
                let rest = part.split_once(" in ").map(|x| x.1).unwrap_or_default();
                reqs.push(Req::In(words[0].into(), set_values(rest, &part)?));
            } else if words.len() >= 2 && words[1] == "notin" {
                let rest = part.split_once(" notin ").map(|x| x.1).unwrap_or_default();
                reqs.push(Req::NotIn(words[0].into(), set_values(rest, &part)?));
            } else if let Some((k, v)) = part.split_once("!=") {
                reqs.push(Req::Ne(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once("==") {
                reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once('=') {
                reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
            } else if part.contains(['(', ')', ' ', '<', '>']) {
                return Err(ApiError::bad_request(format!(
                    "unable to parse requirement: invalid label selector '{part}'"
                )));
            } else {
                reqs.push(Req::Exists(part));
            }
        }
        Ok(LabelSelector(reqs))
    }

    /// A selector from a `metav1.LabelSelector` object (matchLabels/matchExpressions). `None`
    /// (a missing selector) selects nothing, an empty one everything, as for PDBs.
    pub fn from_object(sel: &Value) -> Option<Self> {
        if sel.is_null() {
            return None;
        }
        let mut reqs = Vec::new();
        if let Some(m) = sel["matchLabels"].as_object() {
            for (k, v) in m {
                reqs.push(Req::Eq(k.clone(), v.as_str().unwrap_or_default().into()));
            }
        }
        for e in sel["matchExpressions"].as_array().into_iter().flatten() {
            let key = e["key"].as_str().unwrap_or_default().to_string();
            let values: Vec<String> =
                e["values"].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_string)).collect();
            reqs.push(match e["operator"].as_str().unwrap_or_default() {
                "In" => Req::In(key, values),
                "NotIn" => Req::NotIn(key, values),
                "Exists" => Req::Exists(key),
                _ => Req::NotExists(key),
            });
        }
        Some(LabelSelector(reqs))
    }

    /// Whether the selector selects everything.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object's labels match.
    pub fn matches_labels(&self, labels: &Value) -> bool {
        self.matches_with(|k| labels.get(k).and_then(Value::as_str))
    }

    /// Whether labels read through `get` match.
    pub fn matches_with<'a>(&self, get: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => get(k) == Some(v.as_str()),
            Req::Ne(k, v) => get(k) != Some(v.as_str()),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        })
    }

    /// Whether an object matches.
    pub fn matches(&self, obj: &Value) -> bool {
        self.matches_labels(&obj["metadata"]["labels"])
    }

    /// Renders the selector as a string (for Scale `status.selector`).
    pub fn render(&self) -> String {
        self.0
            .iter()
            .map(|r| match r {
                Req::Eq(k, v) => format!("{k}={v}"),
                Req::Ne(k, v) => format!("{k}!={v}"),
                Req::In(k, vs) => format!("{k} in ({})", vs.join(",")),
                Req::NotIn(k, vs) => format!("{k} notin ({})", vs.join(",")),
                Req::Exists(k) => k.clone(),
                Req::NotExists(k) => format!("!{k}"),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A parsed field selector (`spec.nodeName=x,status.phase!=Running`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses and checks the fields against what the real server supports for the resource.
    pub fn parse(s: &str, info: &ResourceInfo) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, eq, v) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(ApiError::bad_request(format!("invalid selector: '{s}'; can't understand '{part}'")));
            };
            let k = k.trim();
            if !info.field_supported(k) {
                return Err(ApiError::bad_request(format!("field label not supported: {k}")));
            }
            reqs.push((k.to_string(), eq, v.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    /// Whether an object matches.
    pub fn matches(&self, obj: &Value) -> bool {
        self.matches_with(|k| Self::field_text(obj, k))
    }

    /// The value `field` must equal for an object to match, when the selector requires one.
    pub fn required(&self, field: &str) -> Option<&str> {
        self.0.iter().find(|(k, eq, _)| *eq && k == field).map(|(_, _, v)| v.as_str())
    }

    /// Whether the fields read through `get` (as text, absent as empty) match.
    pub fn matches_with(&self, mut get: impl FnMut(&str) -> String) -> bool {
        self.0.iter().all(|(k, eq, v)| (get(k) == *v) == *eq)
    }

    /// A field's value as a field selector compares it.
    pub fn field_text(obj: &Value, field: &str) -> String {
        let mut cur = obj;
        for seg in field.split('.') {
            cur = &cur[seg];
        }
        match cur {
            Value::String(s) => s.clone(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            // Absent boolean fields select as "false" (spec.unschedulable), strings as "".
            Value::Null if field == "spec.unschedulable" || field == "spec.hostNetwork" => "false".into(),
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selector_forms() {
        let labels = json!({"app": "web", "tier": "front"});
        let ok = |s: &str| LabelSelector::parse(s).unwrap().matches_labels(&labels);
        assert!(ok("app=web"));
        assert!(ok("app==web,tier"));
        assert!(!ok("app!=web"));
        assert!(ok("app in (db, web),!missing"));
        assert!(!ok("app notin (web)"));
        assert!(ok(""));
        assert!(!ok("missing"));
        assert!(LabelSelector::parse("app in web").is_err());
    }
}
