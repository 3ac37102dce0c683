//! EC2's own time, which LocalStack does not keep: after `TerminateInstances` a real instance
//! stays `shutting-down` for tens of seconds to minutes before it is `terminated`, and
//! `DescribeInstances` is eventually consistent, so a read right after the call may still show
//! the instance as it was (EC2 API Reference, "Eventual consistency in the Amazon EC2 API";
//! EC2 User Guide, "Instance state changes": `shutting-down` precedes `terminated`). LocalStack
//! terminates at once; the EC2 proxy remembers when it forwarded each termination and answers
//! `DescribeInstances` with the state EC2 would show then ([`modeled_state`]), applying the
//! request's state filter to that state rather than LocalStack's ([`split_state_filter`],
//! [`rewrite_instances`]).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// How long EC2 takes over a termination, as the proxy models it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ec2Timing {
    /// How long a terminated instance stays `shutting-down`, counted from `TerminateInstances`.
    pub shutting_down: Duration,
    /// How long after `TerminateInstances` a read still shows the instance's earlier state
    /// (`running`): the eventual consistency of `DescribeInstances`. Within `shutting_down`.
    pub stale_reads: Duration,
}

/// A state as EC2 names and numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// `running`, `shutting-down`, ...
    pub name: &'static str,
    /// 16, 32, ...
    pub code: u16,
}

const RUNNING: State = State { name: "running", code: 16 };
const SHUTTING_DOWN: State = State { name: "shutting-down", code: 32 };

/// The state EC2 would show `since` after the instance's termination, when it shows something
/// else than LocalStack (`None`: LocalStack's answer stands).
pub fn modeled_state(timing: &Ec2Timing, since: Duration) -> Option<State> {
    if since < timing.stale_reads.min(timing.shutting_down) {
        Some(RUNNING)
    } else if since < timing.shutting_down {
        Some(SHUTTING_DOWN)
    } else {
        None
    }
}

/// When each instance's termination was forwarded.
#[derive(Debug, Default)]
pub struct Terminations {
    at: HashMap<String, Instant>,
}

impl Terminations {
    /// Notes the instances of a `TerminateInstances` EC2 accepted at `now` (a later call for the
    /// same instance does not restart its clock, as on EC2).
    pub fn record(&mut self, ids: impl IntoIterator<Item = String>, now: Instant) {
        for id in ids {
            self.at.entry(id).or_insert(now);
        }
    }

    /// The modeled states of the instances whose termination is still under way at `now`.
    pub fn in_flight(&mut self, timing: &Ec2Timing, now: Instant) -> HashMap<String, State> {
        // a termination past every window will never be modeled again
        self.at.retain(|_, at| now.saturating_duration_since(*at) < timing.shutting_down.max(timing.stale_reads));
        self.at
            .iter()
            .filter_map(|(id, at)| Some((id.clone(), modeled_state(timing, now.saturating_duration_since(*at))?)))
            .collect()
    }
}

/// Splits a `DescribeInstances` query body into the body to send upstream without its
/// `instance-state-name`/`instance-state-code` filter (the remaining filters renumbered from 1,
/// since a gap ends the list for EC2's parser) and the states that filter asked for (names, and
/// codes as numbers), or `None` when it has no state filter.
pub fn split_state_filter(body: &str) -> (String, Option<BTreeSet<String>>) {
    let pairs: Vec<(String, String)> =
        form_urlencoded::parse(body.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    let mut filters: std::collections::BTreeMap<u32, (Option<String>, Vec<String>)> = Default::default();
    let mut rest = Vec::new();
    for (k, v) in &pairs {
        if let Some(after) = k.strip_prefix("Filter.")
            && let Some((n, field)) = after.split_once('.')
            && let Ok(n) = n.parse::<u32>()
        {
            let f = filters.entry(n).or_default();
            if field == "Name" {
                f.0 = Some(v.clone());
            } else {
                f.1.push(v.clone());
            }
        } else {
            rest.push((k.clone(), v.clone()));
        }
    }
    let mut states: Option<BTreeSet<String>> = None;
    let mut out = form_urlencoded::Serializer::new(String::new());
    out.extend_pairs(rest.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut next = 1;
    for (name, values) in filters.into_values() {
        match name.as_deref() {
            Some("instance-state-name" | "instance-state-code") => {
                states.get_or_insert_default().extend(values);
            }
            _ => {
                out.append_pair(&format!("Filter.{next}.Name"), name.as_deref().unwrap_or_default());
                for (i, v) in values.iter().enumerate() {
                    out.append_pair(&format!("Filter.{next}.Value.{}", i + 1), v);
                }
                next += 1;
            }
        }
    }
    (out.finish(), states)
}

/// One instance of a `DescribeInstances` answer: where its `<item>` is, and its state's text.
#[derive(Debug)]
struct InstanceItem {
    span: (usize, usize),
    id: String,
    code: Option<(usize, usize)>,
    name: Option<(usize, usize)>,
}

fn instance_items(xml: &str) -> Result<Vec<InstanceItem>, xmlparser::Error> {
    use xmlparser::{ElementEnd, Token};
    let mut path: Vec<String> = Vec::new();
    let mut items: Vec<InstanceItem> = Vec::new();
    let mut current: Option<(usize, InstanceItem)> = None;
    for token in xmlparser::Tokenizer::from(xml) {
        match token? {
            Token::ElementStart { local, span, .. } => {
                path.push(local.as_str().to_string());
                let n = path.len();
                if current.is_none() && local.as_str() == "item" && n >= 2 && path[n - 2] == "instancesSet" {
                    let item =
                        InstanceItem { span: (span.start(), span.end()), id: String::new(), code: None, name: None };
                    current = Some((n, item));
                }
            }
            Token::ElementEnd { end, span } => {
                let closes = !matches!(end, ElementEnd::Open);
                if closes {
                    if let Some((depth, item)) = &mut current
                        && path.len() == *depth
                    {
                        item.span.1 = span.end();
                        if let Some((_, done)) = current.take() {
                            items.push(done);
                        }
                    }
                    path.pop();
                }
            }
            Token::Text { text } => {
                if let Some((depth, item)) = &mut current {
                    let rel: Vec<&str> = path[*depth..].iter().map(String::as_str).collect();
                    let at = (text.start(), text.end());
                    match rel.as_slice() {
                        ["instanceId"] => item.id = text.as_str().trim().to_string(),
                        ["instanceState", "code"] => item.code = Some(at),
                        ["instanceState", "name"] => item.name = Some(at),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok(items)
}

/// Leaves the instances `hidden` out of a `DescribeInstances` answer, as EC2's describe does for
/// a moment after a launch. An answer that is not well-formed XML is returned as it came.
pub fn drop_instances(xml: &str, hidden: &BTreeSet<String>) -> String {
    let Ok(items) = instance_items(xml) else {
        return xml.to_string();
    };
    let mut out = xml.to_string();
    // from the last to the first, so that earlier offsets stay valid
    for item in items.iter().rev().filter(|i| hidden.contains(&i.id)) {
        out.replace_range(item.span.0..item.span.1, "");
    }
    out
}

/// Rewrites a `DescribeInstances` answer: each instance in `modeled` shows its modeled state, and
/// when the request filtered by state (`wanted`, names or codes) the instances whose shown state
/// it does not ask for are dropped, as EC2 would not have returned them. A reservation left
/// without instances stays in the answer, empty. An answer that is not well-formed XML is
/// returned as it came.
pub fn rewrite_instances(xml: &str, modeled: &HashMap<String, State>, wanted: Option<&BTreeSet<String>>) -> String {
    let Ok(items) = instance_items(xml) else {
        return xml.to_string();
    };
    let mut out = xml.to_string();
    // from the last to the first, so that earlier offsets stay valid
    for item in items.iter().rev() {
        let slice = |s: Option<(usize, usize)>| s.map(|(a, b)| xml[a..b].trim().to_string());
        let (upstream_name, upstream_code) = (slice(item.name), slice(item.code));
        let shown = modeled.get(&item.id);
        let (name, code) = match shown {
            Some(s) => (Some(s.name.to_string()), Some(s.code.to_string())),
            None => (upstream_name, upstream_code),
        };
        if let Some(wanted) = wanted {
            let asked =
                name.as_ref().is_some_and(|n| wanted.contains(n)) || code.as_ref().is_some_and(|c| wanted.contains(c));
            if !asked {
                out.replace_range(item.span.0..item.span.1, "");
                continue;
            }
        }
        if let Some(s) = shown {
            // name comes after code in EC2's answer; replace the later span first
            let mut spans: Vec<((usize, usize), String)> = Vec::new();
            if let Some(c) = item.code {
                spans.push((c, s.code.to_string()));
            }
            if let Some(n) = item.name {
                spans.push((n, s.name.to_string()));
            }
            spans.sort_by_key(|((a, _), _)| std::cmp::Reverse(*a));
            for ((a, b), text) in spans {
                out.replace_range(a..b, &text);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(instances: &[(&str, u16, &str)]) -> String {
        let items: String = instances
            .iter()
            .map(|(id, code, name)| {
                format!(
                    "<item><instanceId>{id}</instanceId><tagSet><item><key>k</key><value>v</value></item></tagSet><instanceState><code>{code}</code><name>{name}</name></instanceState></item>"
                )
            })
            .collect();
        format!(
            "<?xml version=\"1.0\"?><DescribeInstancesResponse><reservationSet><item><reservationId>r-1</reservationId><groupSet/><instancesSet>{items}</instancesSet></item></reservationSet></DescribeInstancesResponse>"
        )
    }

    #[test]
    fn hidden_instances_are_left_out_of_an_answer() {
        let xml = answer(&[("i-1", 16, "running"), ("i-2", 16, "running")]);
        let out = drop_instances(&xml, &BTreeSet::from(["i-2".to_string()]));
        assert!(out.contains("i-1") && !out.contains("i-2"), "{out}");
        assert_eq!(instance_items(&out).unwrap().len(), 1);
    }

    #[test]
    fn a_termination_reads_running_then_shutting_down_then_as_localstack_says() {
        let t = Ec2Timing { shutting_down: Duration::from_secs(60), stale_reads: Duration::from_secs(2) };
        assert_eq!(modeled_state(&t, Duration::from_secs(1)), Some(RUNNING));
        assert_eq!(modeled_state(&t, Duration::from_secs(30)), Some(SHUTTING_DOWN));
        assert_eq!(modeled_state(&t, Duration::from_secs(61)), None);
        assert_eq!(modeled_state(&Ec2Timing::default(), Duration::ZERO), None, "no timing: LocalStack's own");
        let mut terms = Terminations::default();
        let t0 = Instant::now();
        terms.record(["i-1".to_string()], t0);
        terms.record(["i-1".to_string()], t0 + Duration::from_secs(50));
        assert_eq!(terms.in_flight(&t, t0 + Duration::from_secs(59)).get("i-1"), Some(&SHUTTING_DOWN));
        assert!(terms.in_flight(&t, t0 + Duration::from_secs(61)).is_empty(), "a repeated call keeps the first clock");
    }

    #[test]
    fn the_state_filter_is_taken_off_and_the_other_filters_renumbered() {
        let body = "Action=DescribeInstances&Filter.1.Name=tag%3Aeks%3Aeks-cluster-name&Filter.1.Value.1=prod&Filter.2.Name=instance-state-name&Filter.2.Value.1=running&Filter.2.Value.2=shutting-down&Filter.3.Name=tag-key&Filter.3.Value.1=karpenter.sh%2Fnodepool&MaxResults=1000";
        let (upstream, states) = split_state_filter(body);
        assert_eq!(states, Some(BTreeSet::from(["running".to_string(), "shutting-down".to_string()])));
        let parsed: Vec<(String, String)> =
            form_urlencoded::parse(upstream.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        assert!(parsed.contains(&("Filter.2.Name".into(), "tag-key".into())), "{parsed:?}");
        assert!(parsed.contains(&("Filter.1.Value.1".into(), "prod".into())));
        assert!(!upstream.contains("instance-state"));
        assert!(parsed.contains(&("MaxResults".into(), "1000".into())));
        assert_eq!(
            split_state_filter("Action=DescribeInstances&Filter.1.Name=instance-id&Filter.1.Value.1=i-1").1,
            None
        );
    }

    #[test]
    fn answers_show_the_modeled_state_and_obey_the_state_filter() {
        let xml = answer(&[("i-1", 48, "terminated"), ("i-2", 16, "running"), ("i-3", 48, "terminated")]);
        let modeled = HashMap::from([("i-1".to_string(), SHUTTING_DOWN)]);
        let all = rewrite_instances(&xml, &modeled, None);
        assert!(all.contains("<instanceId>i-1</instanceId><tagSet><item><key>k</key><value>v</value></item></tagSet><instanceState><code>32</code><name>shutting-down</name>"), "{all}");
        assert!(all.contains("<code>48</code><name>terminated</name>"), "i-3 is as LocalStack says: {all}");
        let live = BTreeSet::from(["running".to_string(), "shutting-down".to_string()]);
        let filtered = rewrite_instances(&xml, &modeled, Some(&live));
        assert!(filtered.contains("i-1") && filtered.contains("i-2"), "{filtered}");
        assert!(!filtered.contains("i-3"), "terminated is not asked for: {filtered}");
        let codes = BTreeSet::from(["48".to_string()]);
        let terminated = rewrite_instances(&xml, &modeled, Some(&codes));
        assert!(!terminated.contains("i-1") && terminated.contains("i-3"), "{terminated}");
        assert_eq!(rewrite_instances("not xml <", &modeled, None), "not xml <");
    }
}
