//! A report drawn as a timeline: a Mermaid Gantt chart of the run's steps, each step's slowest
//! machines beside it, and what did not end `done` marked critical, so that a CI job can publish
//! it next to the JSON and a person can see where the time went and what stopped the run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::SystemTime;

use serde_json::Value;

/// How many of a per-machine step's slowest tasks are drawn beside the step.
const SLOWEST: usize = 3;

/// Why a file cannot be drawn.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TimelineError {
    /// Not a report of this tool (or a run that recorded no step).
    #[error("{0}: is this a report written by `karpenter-teardown run --report`?")]
    NotAReport(String),
}

/// One task of the report, on the run's clock (milliseconds since the first task started).
#[derive(Debug, Clone, PartialEq)]
struct Bar {
    step: String,
    object: Option<String>,
    result: String,
    from_ms: u64,
    to_ms: u64,
    /// A task of a machine found after the plan was expanded.
    late: bool,
}

/// The report as a Mermaid Gantt chart.
pub fn timeline(report: &Value) -> Result<String, TimelineError> {
    let steps =
        report["steps"].as_array().ok_or_else(|| TimelineError::NotAReport("the file has no `steps` list".into()))?;
    let mut read = Vec::with_capacity(steps.len());
    for (i, s) in steps.iter().enumerate() {
        let time = |k: &str| {
            s[k].as_str()
                .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
                .ok_or_else(|| TimelineError::NotAReport(format!("step record {i} has no `{k}` time")))
        };
        let step = s["step"]
            .as_str()
            .ok_or_else(|| TimelineError::NotAReport(format!("step record {i} has no `step`")))?
            .to_string();
        read.push((
            step,
            s["object"].as_str().map(str::to_string),
            s["result"].as_str().unwrap_or("?"),
            time("started")?,
            time("finished")?,
            s["found_late"].is_string(),
        ));
    }
    let Some(t0) = read.iter().map(|r| r.3).min() else {
        return Err(TimelineError::NotAReport("the run recorded no step".into()));
    };
    let ms = |t: SystemTime| t.duration_since(t0).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let bars: Vec<Bar> = read
        .into_iter()
        .map(|(step, object, result, from, to, late)| Bar {
            step,
            object,
            result: result.to_string(),
            from_ms: ms(from),
            to_ms: ms(to).max(ms(from)),
            late,
        })
        .collect();

    // steps in the order they started
    let mut by_step: BTreeMap<&str, Vec<&Bar>> = BTreeMap::new();
    for b in &bars {
        by_step.entry(b.step.as_str()).or_default().push(b);
    }
    let mut order: Vec<(&str, Vec<&Bar>)> = by_step.into_iter().collect();
    order.sort_by_key(|(name, tasks)| (tasks.iter().map(|b| b.from_ms).min().unwrap_or(0), *name));

    let mut out = String::from("gantt\n");
    let cluster = label(report["cluster"].as_str().unwrap_or("?"));
    let outcome = label(report["outcome"].as_str().unwrap_or("?"));
    let _ = writeln!(out, "    title karpenter-teardown run of {cluster}: {outcome}");
    out.push_str("    dateFormat x\n    axisFormat %M:%S\n");
    for (step, tasks) in order {
        let _ = writeln!(out, "    section {}", label(step));
        let from = tasks.iter().map(|b| b.from_ms).min().unwrap_or(0);
        let to = tasks.iter().map(|b| b.to_ms).max().unwrap_or(from);
        let not_done = tasks.iter().filter(|b| b.result != "done").count();
        let mut name = if tasks.len() > 1 || tasks[0].object.is_some() {
            format!("{} ({} task(s))", label(step), tasks.len())
        } else {
            label(step)
        };
        if not_done > 0 {
            let _ = write!(name, ", {not_done} not done");
        }
        let tag = if not_done > 0 { "crit, " } else { "" };
        let _ = writeln!(out, "    {name} : {tag}{from}, {}", to.max(from + 1));
        if tasks.iter().all(|b| b.object.is_none()) {
            continue;
        }
        // the slowest machines, and every one that did not end done or was found late
        let mut shown: Vec<&Bar> = tasks.clone();
        shown.sort_by_key(|b| std::cmp::Reverse(b.to_ms - b.from_ms));
        let mut picked: Vec<&Bar> = shown.iter().take(SLOWEST).copied().collect();
        picked.extend(shown.iter().skip(SLOWEST).filter(|b| b.result != "done" || b.late).take(10));
        for b in picked {
            let late = if b.late { " (found late)" } else { "" };
            let object = format!("{}{}", label(b.object.as_deref().unwrap_or("-")), label(late));
            let (tag, result) =
                if b.result == "done" { ("", String::new()) } else { ("crit, ", format!(" {}", b.result)) };
            let _ = writeln!(out, "    {object}{result} : {tag}{}, {}", b.from_ms, b.to_ms.max(b.from_ms + 1));
        }
    }
    Ok(out)
}

/// Text Mermaid shows as it is in a task's or section's name: no `:` (it ends the name), `;`
/// or `#` (comments and entities).
fn label(s: &str) -> String {
    s.chars().map(|c| if matches!(c, ':' | ';' | '#') { ' ' } else { c }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(step: &str, object: Option<&str>, from: &str, to: &str, result: &str) -> Value {
        json!({"step": step, "action": step, "object": object, "started": format!("2026-11-28T10:00:{from}Z"),
            "finished": format!("2026-11-28T10:00:{to}Z"), "result": result, "attempts": 1, "detail": ""})
    }

    #[test]
    fn steps_are_drawn_in_the_order_they_started_with_the_slowest_and_the_blocked_machines() {
        let report = json!({"cluster": "prod", "outcome": "blocked", "steps": [
            record("preflight", None, "00.000", "00.500", "done"),
            record("drain", Some("web-a"), "01.000", "03.000", "done"),
            record("drain", Some("web-b"), "01.000", "09.000", "done"),
            record("drain", Some("web-c"), "01.000", "02.000", "done"),
            record("drain", Some("web-d"), "01.000", "05.000", "done"),
            record("drain", Some("web-e"), "01.000", "01.500", "blocked"),
            record("fence", None, "00.500", "01.000", "done"),
        ]});
        let chart = timeline(&report).unwrap();
        let lines: Vec<&str> = chart.lines().collect();
        assert_eq!(
            lines,
            [
                "gantt",
                "    title karpenter-teardown run of prod: blocked",
                "    dateFormat x",
                "    axisFormat %M:%S",
                "    section preflight",
                "    preflight : 0, 500",
                "    section fence",
                "    fence : 500, 1000",
                "    section drain",
                "    drain (5 task(s)), 1 not done : crit, 1000, 9000",
                "    web-b : 1000, 9000",
                "    web-d : 1000, 5000",
                "    web-a : 1000, 3000",
                "    web-e blocked : crit, 1000, 1500",
            ]
        );
    }

    #[test]
    fn a_file_that_is_not_a_report_says_so() {
        assert!(matches!(timeline(&json!({"kind": "Pod"})), Err(TimelineError::NotAReport(_))));
        assert!(matches!(timeline(&json!({"steps": []})), Err(TimelineError::NotAReport(_))));
        let no_time = json!({"steps": [{"step": "verify", "started": "then"}]});
        assert_eq!(timeline(&no_time), Err(TimelineError::NotAReport("step record 0 has no `started` time".into())));
    }

    #[test]
    fn names_lose_what_would_break_the_chart() {
        assert_eq!(label("node/a:b;c#d"), "node/a b c d");
    }
}
