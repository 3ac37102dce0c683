//! Counting one identity's requests on the real kube-apiserver. `apiserver_request_total` has no
//! label for the user or the client (its labels are verb, dry_run, group, version, resource,
//! subresource, scope, component and code: k8s.io/apiserver pkg/endpoints/metrics/metrics.go), and
//! the control plane's own components (the scheduler binding pods, kwok reporting their status,
//! the ReplicaSet controller recreating them) dominate it. API Priority and Fairness does classify
//! every request by its user and groups, and counts it under its FlowSchema's name
//! (`apiserver_flowcontrol_dispatched_requests_total{priority_level, flow_schema}`, k8s.io/apiserver
//! pkg/util/flowcontrol/metrics/metrics.go). A FlowSchema of its own for a group therefore counts
//! exactly that group's requests.

use k8s_openapi::api::flowcontrol::v1::FlowSchema;
use serde_json::json;

/// The metric APF counts each request it lets through under, by FlowSchema.
pub const DISPATCHED: &str = "apiserver_flowcontrol_dispatched_requests_total";

/// A FlowSchema named `name` that matches every request of `group` and sends it to the
/// `global-default` priority level: the level kube-apiserver's suggested `global-default`
/// FlowSchema (matching precedence 9900, every authenticated user) sends such a user to
/// (k8s.io/apiserver pkg/apis/flowcontrol/bootstrap/default.go), so the requests are queued and
/// limited as before and only counted apart. Precedence 8000 wins over `global-default` and does
/// not reach below the schemas of system components, leader election and probes (2 to 1000).
pub fn counting_flow_schema(name: &str, group: &str) -> Result<FlowSchema, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "priorityLevelConfiguration": {"name": "global-default"},
            "matchingPrecedence": 8000,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{
                "subjects": [{"kind": "Group", "group": {"name": group}}],
                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                    "clusterScope": true, "namespaces": ["*"]}],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }],
        },
    }))
}

/// The requests APF dispatched under FlowSchema `schema`, summed over priority levels, from the
/// Prometheus text of `/metrics`; 0 before the first one.
pub fn dispatched_under(metrics: &str, schema: &str) -> u64 {
    let label = format!("flow_schema=\"{schema}\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(DISPATCHED))
        .filter_map(|rest| rest.strip_prefix('{'))
        .filter_map(|rest| rest.split_once('}'))
        .filter(|(labels, _)| labels.split(',').any(|l| l == label))
        // counters print as integers or in exponent form (1.2345e+06)
        .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_named_schema_is_counted_over_every_priority_level() {
        let text = "\
# HELP apiserver_flowcontrol_dispatched_requests_total [BETA] Number of requests executed by API Priority and Fairness subsystem
# TYPE apiserver_flowcontrol_dispatched_requests_total counter
apiserver_flowcontrol_dispatched_requests_total{flow_schema=\"exempt\",priority_level=\"exempt\"} 5412
apiserver_flowcontrol_dispatched_requests_total{flow_schema=\"bench\",priority_level=\"global-default\"} 1.2345e+06
apiserver_flowcontrol_dispatched_requests_total{flow_schema=\"bench\",priority_level=\"catch-all\"} 7
apiserver_flowcontrol_dispatched_requests_total{flow_schema=\"bench-other\",priority_level=\"global-default\"} 99
apiserver_flowcontrol_dispatched_requests_total_extra{flow_schema=\"bench\",priority_level=\"global-default\"} 1000
apiserver_flowcontrol_rejected_requests_total{flow_schema=\"bench\",priority_level=\"global-default\",reason=\"queue-full\"} 3
";
        assert_eq!(dispatched_under(text, "bench"), 1_234_507);
        assert_eq!(dispatched_under(text, "missing"), 0);
    }

    #[test]
    fn the_schema_counts_the_group_at_the_default_level_before_global_default() {
        let fs = counting_flow_schema("bench", "karpenter-teardown").unwrap();
        let spec = fs.spec.unwrap();
        assert_eq!(spec.priority_level_configuration.name, "global-default");
        let precedence = spec.matching_precedence.unwrap();
        assert!(precedence < 9900 && precedence > 1000, "{precedence}");
        let rule = &spec.rules.unwrap()[0];
        let subject = &rule.subjects[0];
        assert_eq!(subject.group.as_ref().unwrap().name, "karpenter-teardown");
        assert!(rule.non_resource_rules.as_ref().is_some_and(|r| r[0].non_resource_urls == ["*"]));
    }
}
