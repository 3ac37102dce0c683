//! Custom resources as kube-apiserver treats them: the CRD's structural schema supplies
//! `default`s (a NodePool applied without `disruption` comes back with the defaulted budgets and
//! `expireAfter`), and its CEL rules (`x-kubernetes-validations`) refuse a write with 422, so the
//! real Karpenter CRDs' rules hold in the sandbox ("only 'limits.nodes' is supported on static
//! NodePools"). Rules are evaluated with a maintained CEL crate (`cel`); a rule it cannot
//! evaluate is logged with its text and counted, never silently taken as passed or failed.
//!
//! Transition rules (those that read `oldSelf`) are evaluated on updates where the old value
//! exists, as the real server does; inside lists they are not (the real server correlates only
//! map-type lists, which these CRDs do not use for transition rules).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cel::extractors::This;
use cel::{Context, Program, Value as Cel};
use serde_json::Value;

/// Rules the evaluator could not evaluate since the process started (each is also logged).
static UNEVALUATED: AtomicU64 = AtomicU64::new(0);

/// How many rules could not be evaluated so far (a test asserts the real CRDs need none).
pub fn unevaluated_rules() -> u64 {
    UNEVALUATED.load(Ordering::Relaxed)
}

/// One rule that refused the write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Where, as a field path (`spec`, `spec.template.spec.requirements`).
    pub field: String,
    /// The rule's message.
    pub message: String,
    /// The schema type of the value the rule is on (`object`, `string`), which kube-apiserver
    /// names in its message (`Invalid value: "string": ...`).
    pub value_type: String,
}

/// One error of the OpenAPI part of a schema, as kube-apiserver reports it: the field, the
/// cause's reason and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Where (`spec.template.spec.nodeClassRef`).
    pub field: String,
    /// `FieldValueRequired`, `FieldValueInvalid`, `FieldValueNotSupported`.
    pub reason: &'static str,
    /// `Required value`, `Invalid value: "many": ... should match '...'`.
    pub message: String,
}

/// Removes the fields the schema does not declare, as kube-apiserver's pruning does before it
/// defaults and validates: an object schema with `properties` keeps only those, unless it says
/// `x-kubernetes-preserve-unknown-fields` or has `additionalProperties`. At the root, `apiVersion`,
/// `kind` and `metadata` are the server's own and are kept.
/// (apiextensions-apiserver, pkg/apiserver/schema/pruning/algorithm.go)
pub fn prune(schema: &Value, obj: &mut Value) {
    prune_at(schema, obj, true);
}

fn prune_at(schema: &Value, obj: &mut Value, root: bool) {
    let preserve = schema["x-kubernetes-preserve-unknown-fields"] == true;
    match obj {
        Value::Object(map) => {
            let props = schema["properties"].as_object();
            let extra = schema.get("additionalProperties").filter(|a| a.is_object());
            if let Some(props) = props {
                if !preserve && extra.is_none() {
                    map.retain(|k, _| {
                        props.contains_key(k) || (root && ["apiVersion", "kind", "metadata"].contains(&k.as_str()))
                    });
                }
                for (key, child) in map.iter_mut() {
                    if let Some(prop) = props.get(key).filter(|_| !(root && key == "metadata")) {
                        prune_at(prop, child, false);
                    }
                }
            } else if let Some(extra) = extra {
                for child in map.values_mut() {
                    prune_at(extra, child, false);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    prune_at(item_schema, item, false);
                }
            }
        }
        _ => {}
    }
}

/// Checks the OpenAPI constraints the Karpenter CRDs rely on: `required`, `pattern` and `enum`
/// (kube-openapi's validator, as apiextensions-apiserver runs it after defaulting). A property's
/// own errors come before those of the object holding it, as the real server lists them.
pub fn check_openapi(schema: &Value, obj: &Value) -> Vec<FieldError> {
    let mut out = Vec::new();
    openapi_at(schema, obj, "", &mut out);
    out
}

fn openapi_at(schema: &Value, value: &Value, path: &str, out: &mut Vec<FieldError>) {
    let child_path = |key: &str| if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
    match value {
        Value::Object(map) => {
            if let Some(props) = schema["properties"].as_object() {
                for (key, prop) in props {
                    if let Some(child) = map.get(key).filter(|_| !(path.is_empty() && key == "metadata")) {
                        openapi_at(prop, child, &child_path(key), out);
                    }
                }
            }
            if let Some(extra) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for (key, child) in map {
                    openapi_at(extra, child, &child_path(key), out);
                }
            }
            for key in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                if map.get(key).is_none_or(Value::is_null) {
                    out.push(FieldError {
                        field: child_path(key),
                        reason: "FieldValueRequired",
                        message: "Required value".into(),
                    });
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    openapi_at(item_schema, item, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::String(text) => {
            if let Some(pattern) = schema["pattern"].as_str()
                && pattern_matches(pattern, text) == Some(false)
            {
                out.push(FieldError {
                    field: path.to_string(),
                    reason: "FieldValueInvalid",
                    message: format!("Invalid value: {value}: {path} in body should match '{pattern}'"),
                });
            }
        }
        _ => {}
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !value.is_null()
        && !allowed.contains(value)
    {
        let supported: Vec<String> = allowed.iter().map(Value::to_string).collect();
        out.push(FieldError {
            field: path.to_string(),
            reason: "FieldValueNotSupported",
            message: format!("Unsupported value: {value}: supported values: {}", supported.join(", ")),
        });
    }
}

/// Whether `schema` has a CEL rule anywhere (`x-kubernetes-validations`): without one,
/// kube-apiserver builds no CEL validator for it (`cel.NewValidator` answers nil).
pub fn has_rules(schema: &Value) -> bool {
    match schema {
        Value::Object(map) => {
            map.get("x-kubernetes-validations").is_some_and(|r| r.as_array().is_some_and(|r| !r.is_empty()))
                || map.values().any(has_rules)
        }
        Value::Array(items) => items.iter().any(has_rules),
        _ => false,
    }
}

/// The JSON pointer of a field path as kube-apiserver writes it (`spec.budgets[0].nodes` is
/// `/spec/budgets/0/nodes`).
pub fn field_pointer(field: &str) -> String {
    let mut out = String::new();
    for part in field.split('.').filter(|p| !p.is_empty()) {
        let mut rest = part;
        let name_end = rest.find('[').unwrap_or(rest.len());
        out.push('/');
        out.push_str(&rest[..name_end].replace('~', "~0").replace('/', "~1"));
        rest = &rest[name_end..];
        while let Some(close) = rest.find(']') {
            out.push('/');
            out.push_str(&rest[1..close]);
            rest = &rest[close + 1..];
        }
    }
    out
}

/// Whether `text` matches the schema's `pattern`; `None` (and a warning) for a pattern the regex
/// engine cannot compile, which then refuses nothing.
fn pattern_matches(pattern: &str, text: &str) -> Option<bool> {
    static CACHE: OnceLock<Mutex<HashMap<String, Option<regex::Regex>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
    let re = cache.entry(pattern.to_string()).or_insert_with(|| {
        regex::Regex::new(pattern)
            .inspect_err(
                |e| tracing::warn!(pattern, error = %e, "a CRD pattern could not be compiled; it refuses nothing"),
            )
            .ok()
    });
    re.as_ref().map(|re| re.is_match(text))
}

/// The `openAPIV3Schema` of `version` in a CRD.
pub fn schema_of<'a>(crd: &'a Value, version: &str) -> Option<&'a Value> {
    crd["spec"]["versions"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == version)
        .map(|v| &v["schema"]["openAPIV3Schema"])
        .filter(|s| s.is_object())
}

/// Applies the schema's `default`s to `obj`, as kube-apiserver's structural defaulting does: a
/// missing property with a default gets it, then defaulting continues inside what is there (also
/// inside a default just applied), through objects, maps and list items.
pub fn apply_defaults(schema: &Value, obj: &mut Value) {
    match obj {
        Value::Object(map) => {
            if let Some(props) = schema["properties"].as_object() {
                for (key, prop) in props {
                    if !map.contains_key(key)
                        && let Some(d) = prop.get("default")
                    {
                        map.insert(key.clone(), d.clone());
                    }
                    if let Some(child) = map.get_mut(key) {
                        apply_defaults(prop, child);
                    }
                }
            }
            if let Some(extra) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for child in map.values_mut() {
                    apply_defaults(extra, child);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    apply_defaults(item_schema, item);
                }
            }
        }
        _ => {}
    }
}

/// Evaluates every `x-kubernetes-validations` rule of the schema over `obj` (`old`: the stored
/// object on an update). Returns the rules that failed.
pub fn validate(schema: &Value, obj: &Value, old: Option<&Value>) -> Vec<Violation> {
    let mut out = Vec::new();
    walk(schema, obj, old, "", &mut out);
    out
}

fn walk(schema: &Value, value: &Value, old: Option<&Value>, path: &str, out: &mut Vec<Violation>) {
    for rule in schema["x-kubernetes-validations"].as_array().into_iter().flatten() {
        let Some(text) = rule["rule"].as_str() else { continue };
        let transition = text.contains("oldSelf");
        if transition && old.is_none() {
            continue;
        }
        match evaluate(text, value, old) {
            Ok(true) => {}
            Ok(false) => out.push(Violation {
                field: if path.is_empty() { "<root>".into() } else { path.to_string() },
                message: rule["message"].as_str().map(str::to_string).unwrap_or_else(|| format!("failed rule: {text}")),
                value_type: schema["type"].as_str().unwrap_or("object").to_string(),
            }),
            Err(why) => {
                UNEVALUATED.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(rule = text, field = path, why = %why, "a CRD validation rule could not be evaluated; the write is not refused for it");
            }
        }
    }
    let child_path = |key: &str| if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
    match value {
        Value::Object(map) => {
            if let Some(props) = schema["properties"].as_object() {
                for (key, prop) in props {
                    if let Some(child) = map.get(key) {
                        walk(prop, child, old.and_then(|o| o.get(key)), &child_path(key), out);
                    }
                }
            }
            if let Some(extra) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for (key, child) in map {
                    walk(extra, child, old.and_then(|o| o.get(key)), &child_path(key), out);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk(item_schema, item, None, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// Compiled rules, by text: the same few dozen rules are evaluated on every write.
fn compiled(rule: &str) -> Result<Arc<Program>, String> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Program>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(p) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(rule) {
        return Ok(p.clone());
    }
    let program = Arc::new(Program::compile(rule).map_err(|e| format!("does not parse: {e}"))?);
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(rule.to_string(), program.clone());
    Ok(program)
}

fn evaluate(rule: &str, value: &Value, old: Option<&Value>) -> Result<bool, String> {
    let program = compiled(rule)?;
    let mut ctx = Context::default();
    kubernetes_extensions(&mut ctx);
    ctx.add_variable("self", cel_value(value)?).map_err(|e| e.to_string())?;
    if let Some(o) = old {
        ctx.add_variable("oldSelf", cel_value(o)?).map_err(|e| e.to_string())?;
    }
    match program.execute(&ctx) {
        Ok(Cel::Bool(b)) => Ok(b),
        Ok(other) => Err(format!("evaluates to {other:?}, not a bool")),
        Err(e) => Err(e.to_string()),
    }
}

fn cel_value(v: &Value) -> Result<Cel, String> {
    cel::to_value(v).map_err(|e| format!("the value cannot be given to CEL: {e}"))
}

/// The Kubernetes CEL library functions the Karpenter CRDs use beyond standard CEL: `split`
/// (the strings extension) and `find` (Kubernetes' regex library: the first match, or "").
fn kubernetes_extensions(ctx: &mut Context<'_>) {
    ctx.add_function("split", |This(this): This<Arc<String>>, sep: Arc<String>| -> Result<Cel, cel::ExecutionError> {
        let parts = this.split(sep.as_str()).map(|s| Cel::String(Arc::new(s.to_string()))).collect();
        Ok(Cel::List(Arc::new(parts)))
    });
    ctx.add_function("find", |This(this): This<Arc<String>>, re: Arc<String>| -> Result<Cel, cel::ExecutionError> {
        let re = regex::Regex::new(&re)
            .map_err(|e| cel::ExecutionError::function_error("find", format!("'{re}' is not a valid regex: {e}")))?;
        Ok(Cel::String(Arc::new(re.find(&this).map(|m| m.as_str().to_string()).unwrap_or_default())))
    });
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object",
                "x-kubernetes-validations": [
                    {"rule": "!has(self.replicas) || (!has(self.limits) || size(self.limits) == 0 || (size(self.limits) == 1 && 'nodes' in self.limits))",
                     "message": "only 'limits.nodes' is supported on static NodePools"},
                    {"rule": "has(self.replicas) == has(oldSelf.replicas)", "message": "Cannot transition"}],
                "properties": {
                    "replicas": {"type": "integer"},
                    "limits": {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": true}},
                    "disruption": {"type": "object", "default": {"consolidateAfter": "0s"}, "properties": {
                        "budgets": {"type": "array", "default": [{"nodes": "10%"}], "items": {"type": "object", "properties": {
                            "nodes": {"type": "string", "default": "10%"}}}},
                        "consolidateAfter": {"type": "string"}}},
                    "alias": {"type": "string", "x-kubernetes-validations": [
                        {"rule": "self.split('@')[0] in ['al2023']", "message": "family"},
                        {"rule": "self.find('^[^@]+') == 'al2023'", "message": "find"}]}}}}})
    }

    #[test]
    fn defaults_fill_missing_fields_inside_defaults_too() {
        let mut obj = json!({"spec": {"disruption": {"budgets": [{}]}}});
        apply_defaults(&schema(), &mut obj);
        assert_eq!(obj["spec"]["disruption"]["budgets"][0]["nodes"], "10%");
        let mut bare = json!({"spec": {}});
        apply_defaults(&schema(), &mut bare);
        assert_eq!(bare["spec"]["disruption"], json!({"consolidateAfter": "0s", "budgets": [{"nodes": "10%"}]}));
    }

    #[test]
    fn the_static_nodepool_rules_refuse_cpu_limits_and_mode_changes() {
        let s = schema();
        let dynamic = json!({"spec": {"limits": {"cpu": "0"}}});
        assert!(validate(&s, &dynamic, None).is_empty());
        let static_cpu = json!({"spec": {"replicas": 3, "limits": {"cpu": "0"}}});
        let v = validate(&s, &static_cpu, None);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].field, "spec");
        assert!(v[0].message.contains("limits.nodes"));
        assert!(validate(&s, &json!({"spec": {"replicas": 3, "limits": {"nodes": "0"}}}), None).is_empty());
        let v = validate(&s, &json!({"spec": {}}), Some(&static_cpu));
        assert_eq!(v.iter().map(|x| x.message.as_str()).collect::<Vec<_>>(), ["Cannot transition"]);
    }

    #[test]
    fn kubernetes_string_extensions_evaluate() {
        let before = unevaluated_rules();
        assert!(validate(&schema(), &json!({"spec": {"alias": "al2023@latest"}}), None).is_empty());
        assert_eq!(validate(&schema(), &json!({"spec": {"alias": "al2@latest"}}), None).len(), 2);
        assert_eq!(unevaluated_rules(), before, "split and find are evaluated, not skipped");
    }
}
