//! The report's JSON Schema (`deploy/report.schema.json`), checked by a validator for the subset of
//! JSON Schema 2020-12 it uses. Any keyword outside that subset is an error, so the schema cannot
//! silently rely on something not checked here.

use serde_json::Value;

const ANNOTATIONS: &[&str] = &["$schema", "$id", "title", "description", "$defs"];

fn validate(schema: &Value, root: &Value, v: &Value, at: &str, errs: &mut Vec<String>) {
    let Some(obj) = schema.as_object() else {
        errs.push(format!("{at}: schema is not an object"));
        return;
    };
    for (k, s) in obj {
        match k.as_str() {
            "$ref" => {
                let target = s.as_str().and_then(|r| r.strip_prefix('#')).and_then(|p| root.pointer(p));
                match target {
                    Some(t) => validate(t, root, v, at, errs),
                    None => errs.push(format!("{at}: unresolvable $ref {s}")),
                }
            }
            "type" => {
                let types: Vec<&str> = match s {
                    Value::String(t) => vec![t.as_str()],
                    Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
                    _ => vec![],
                };
                let ok = types.iter().any(|t| match *t {
                    "object" => v.is_object(),
                    "array" => v.is_array(),
                    "string" => v.is_string(),
                    "integer" => v.is_i64() || v.is_u64(),
                    "number" => v.is_number(),
                    "boolean" => v.is_boolean(),
                    "null" => v.is_null(),
                    _ => false,
                });
                if !ok {
                    errs.push(format!("{at}: expected type {s}, found {v}"));
                }
            }
            "enum" => {
                if !s.as_array().is_some_and(|e| e.contains(v)) {
                    errs.push(format!("{at}: {v} is not one of {s}"));
                }
            }
            "required" => {
                for r in s.as_array().into_iter().flatten().filter_map(Value::as_str) {
                    if v.is_object() && v.get(r).is_none() {
                        errs.push(format!("{at}: missing required property {r:?}"));
                    }
                }
            }
            "properties" => {
                for (name, sub) in s.as_object().into_iter().flatten() {
                    if let Some(child) = v.get(name).filter(|_| v.is_object()) {
                        validate(sub, root, child, &format!("{at}/{name}"), errs);
                    }
                }
            }
            "additionalProperties" => {
                let known = obj.get("properties").and_then(Value::as_object);
                for (name, child) in v.as_object().into_iter().flatten() {
                    if known.is_some_and(|k| k.contains_key(name)) {
                        continue;
                    }
                    match s {
                        Value::Bool(false) => errs.push(format!("{at}: property {name:?} is not in the schema")),
                        Value::Bool(true) => {}
                        sub => validate(sub, root, child, &format!("{at}/{name}"), errs),
                    }
                }
            }
            "items" => {
                for (i, item) in v.as_array().into_iter().flatten().enumerate() {
                    validate(s, root, item, &format!("{at}/{i}"), errs);
                }
            }
            "minimum" => {
                if let (Some(min), Some(x)) = (s.as_f64(), v.as_f64())
                    && x < min
                {
                    errs.push(format!("{at}: {x} is below the minimum {min}"));
                }
            }
            a if ANNOTATIONS.contains(&a) => {}
            other => errs.push(format!("{at}: keyword {other:?} is not supported by this validator")),
        }
    }
}

fn schema() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/report.schema.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub fn schema_errors(report: &Value) -> Vec<String> {
    let s = schema();
    let mut errs = Vec::new();
    validate(&s, &s, report, "", &mut errs);
    errs
}
