//! `deploy/iam-policy.json` judged as AWS would judge it (the test bed's evaluator,
//! `sandbox_sim::iampolicy`): it must allow every call the tool makes, on the resources it makes
//! them on, and refuse the calls on everything the tool must never touch. A policy too narrow
//! fails a run on AWS halfway; one too wide lets a mistake of the tool reach other owners'
//! resources.

use crate::common;

use std::collections::BTreeMap;

use karpenter_teardown::karpenter;
use sandbox_sim::iampolicy::{Authorization, Decision, Policy};
use serde_json::{Value, json};

const REGION: &str = "us-west-2";
const CLUSTER: &str = "prod";

fn shipped_text() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/iam-policy.json")).unwrap()
}

fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn arn(kind: &str, id: &str) -> String {
    format!("arn:aws:ec2:{REGION}:{}:{kind}/{id}", common::LOCALSTACK_ACCOUNT)
}

fn eks_arn(cluster: &str) -> String {
    format!("arn:aws:eks:{REGION}:{}:cluster/{cluster}", common::LOCALSTACK_ACCOUNT)
}

fn profile_arn(name: &str) -> String {
    format!("arn:aws:iam::{}:instance-profile/karpenter/{REGION}/{CLUSTER}/uid/{name}", common::LOCALSTACK_ACCOUNT)
}

/// One request: what, on which resource, with which tags.
struct Call {
    what: &'static str,
    action: &'static str,
    resource: String,
    tags: BTreeMap<String, String>,
}

fn call(what: &'static str, action: &'static str, resource: String, t: &[(&str, &str)]) -> Call {
    Call { what, action, resource, tags: tags(t) }
}

/// Every call the tool makes, on the resources it makes them on.
fn the_tools_calls() -> Vec<Call> {
    let ours = [
        (karpenter::TAG_EKS_CLUSTER, CLUSTER),
        ("kubernetes.io/cluster/prod", "owned"),
        (karpenter::TAG_NODEPOOL, "default"),
        (karpenter::TAG_NODECLASS, "default"),
    ];
    let cni = [
        (karpenter::TAG_VPC_CNI_CLUSTER, CLUSTER),
        (karpenter::TAG_VPC_CNI_NODE, "i-1"),
        (karpenter::TAG_ENI_OWNER, "amazon-vpc-cni"),
        (karpenter::TAG_VPC_CNI_CREATED_AT, "2026-01-01T00:00:00Z"),
    ];
    let profile = karpenter::instance_profile_tags(CLUSTER, REGION, "default");
    let profile: Vec<(&str, &str)> = profile.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut calls: Vec<Call> = [
        "ec2:DescribeInstances",
        "ec2:DescribeLaunchTemplates",
        "ec2:DescribeNetworkInterfaces",
        "ec2:DescribeVolumes",
        "ec2:DescribeSecurityGroups",
        "elasticloadbalancing:DescribeLoadBalancers",
        "elasticloadbalancing:DescribeTargetGroups",
        "elasticloadbalancing:DescribeTags",
        "elasticloadbalancing:DescribeLoadBalancerAttributes",
        "iam:ListInstanceProfiles",
        "iam:ListInstanceProfileTags",
    ]
    .into_iter()
    .map(|a| call("a read", a, "*".into(), &[]))
    .collect();
    calls.extend([
        call("this cluster", "eks:DescribeCluster", eks_arn(CLUSTER), &[]),
        call("a Karpenter instance", "ec2:TerminateInstances", arn("instance", "i-1"), &ours),
        call("a launch template", "ec2:DeleteLaunchTemplate", arn("launch-template", "lt-1"), &ours),
        call(
            "a Karpenter 1.0 launch template",
            "ec2:DeleteLaunchTemplate",
            arn("launch-template", "lt-2"),
            &[(karpenter::TAG_LEGACY_CLUSTER, CLUSTER)],
        ),
        call("a VPC CNI interface", "ec2:DeleteNetworkInterface", arn("network-interface", "eni-1"), &cni),
        call("a Karpenter interface", "ec2:DeleteNetworkInterface", arn("network-interface", "eni-2"), &ours),
        call("an instance profile's role", "iam:RemoveRoleFromInstanceProfile", profile_arn("prod_1"), &profile),
        call("an instance profile", "iam:DeleteInstanceProfile", profile_arn("prod_1"), &profile),
    ]);
    calls
}

/// Calls on what the tool must never touch.
fn never() -> Vec<Call> {
    let other = [(karpenter::TAG_EKS_CLUSTER, "staging"), (karpenter::TAG_NODEPOOL, "default")];
    let branch = [
        ("kubernetes.io/cluster/prod", "owned"),
        (karpenter::TAG_ENI_OWNER, karpenter::ENI_OWNER_RESOURCE_CONTROLLER),
        ("vpcresources.k8s.aws/trunk-eni-id", "eni-9"),
        (karpenter::TAG_VPC_CNI_NODE, "i-1"),
    ];
    let staging_cni = [(karpenter::TAG_VPC_CNI_CLUSTER, "staging"), (karpenter::TAG_VPC_CNI_NODE, "i-2")];
    // EKS Auto Mode's, tagged as its compute policy requires, and pessimistically with Karpenter's
    // NodePool and the cluster tags too: only this controller's EC2NodeClass tag tells them apart
    let auto_mode = [
        (karpenter::TAG_EKS_CLUSTER, CLUSTER),
        ("kubernetes.io/cluster/prod", "owned"),
        (karpenter::TAG_NODEPOOL, "general-purpose"),
        ("eks:kubernetes-node-pool-name", "general-purpose"),
        (karpenter::TAG_AUTO_NODECLASS, "default"),
    ];
    vec![
        call("another cluster's instance", "ec2:TerminateInstances", arn("instance", "i-2"), &other),
        call("an EKS Auto Mode instance", "ec2:TerminateInstances", arn("instance", "i-5"), &auto_mode),
        call("an EKS Auto Mode interface", "ec2:DeleteNetworkInterface", arn("network-interface", "eni-6"), &auto_mode),
        call(
            "a managed node group's instance",
            "ec2:TerminateInstances",
            arn("instance", "i-3"),
            &[(karpenter::TAG_EKS_CLUSTER, CLUSTER)],
        ),
        call("an untagged instance", "ec2:TerminateInstances", arn("instance", "i-4"), &[]),
        call("another cluster's launch template", "ec2:DeleteLaunchTemplate", arn("launch-template", "lt-9"), &other),
        call(
            "the VPC resource controller's branch interface",
            "ec2:DeleteNetworkInterface",
            arn("network-interface", "eni-3"),
            &branch,
        ),
        call(
            "an interface with only the cluster tag",
            "ec2:DeleteNetworkInterface",
            arn("network-interface", "eni-4"),
            &[("kubernetes.io/cluster/prod", "owned")],
        ),
        call(
            "another cluster's CNI interface",
            "ec2:DeleteNetworkInterface",
            arn("network-interface", "eni-5"),
            &staging_cni,
        ),
        call(
            "a user's instance profile",
            "iam:DeleteInstanceProfile",
            profile_arn("prod_bastion"),
            &[("kubernetes.io/cluster/prod", "owned")],
        ),
        call("a volume", "ec2:DeleteVolume", arn("volume", "vol-1"), &[(karpenter::TAG_EKS_CLUSTER, CLUSTER)]),
        call("a launch", "ec2:RunInstances", arn("instance", "*"), &[]),
        call(
            "a load balancer of this cluster",
            "elasticloadbalancing:DeleteLoadBalancer",
            format!(
                "arn:aws:elasticloadbalancing:{REGION}:{}:loadbalancer/net/k8s-default-web/1",
                common::LOCALSTACK_ACCOUNT
            ),
            &[("elbv2.k8s.aws/cluster", CLUSTER), ("service.k8s.aws/stack", "default/web")],
        ),
        call(
            "a security group",
            "ec2:DeleteSecurityGroup",
            arn("security-group", "sg-1"),
            &[("elbv2.k8s.aws/cluster", CLUSTER)],
        ),
        call("a role", "iam:DeleteRole", "*".into(), &[]),
        call("another cluster", "eks:DescribeCluster", eks_arn("staging"), &[]),
        call("a cluster's deletion", "eks:DeleteCluster", eks_arn(CLUSTER), &[]),
    ]
}

/// What is wrong with a policy document in the shipped one's form: the tool's calls it refuses
/// (too narrow) and the forbidden calls it allows (too wide).
fn policy_faults(text: &str) -> Vec<String> {
    let policy: Policy = common::policy_from(text, CLUSTER, REGION);
    let decide = |c: &Call| {
        policy.decide(&Authorization { action: c.action, resource: &c.resource, region: REGION, tags: &c.tags })
    };
    let mut faults = Vec::new();
    for c in the_tools_calls() {
        if decide(&c) != Decision::Allow {
            faults.push(format!("too narrow: refuses {} on {}", c.action, c.what));
        }
    }
    for c in never() {
        if decide(&c) == Decision::Allow {
            faults.push(format!("too wide: allows {} on {}", c.action, c.what));
        }
    }
    faults
}

fn with_statements(edit: impl FnOnce(&mut Vec<Value>)) -> String {
    let mut doc: Value = serde_json::from_str(&shipped_text()).unwrap();
    edit(doc["Statement"].as_array_mut().unwrap());
    doc.to_string()
}

#[test]
fn the_shipped_policy_allows_what_the_tool_does_and_nothing_else() {
    assert_eq!(policy_faults(&shipped_text()), Vec::<String>::new());
}

#[test]
fn a_policy_too_narrow_or_too_wide_is_caught() {
    // the statement the policy had: every interface tagged kubernetes.io/cluster/<c>, and none
    // of the VPC CNI's (which carry cluster.k8s.amazonaws.com/name instead)
    let cluster_tag_only = with_statements(|st| {
        st.retain(|s| s["Action"] != json!(["ec2:DeleteNetworkInterface"]));
        st.push(json!({
            "Effect": "Allow",
            "Action": ["ec2:DeleteNetworkInterface"],
            "Resource": "arn:PARTITION:ec2:REGION:ACCOUNT_ID:network-interface/*",
            "Condition": { "Null": { "aws:ResourceTag/kubernetes.io/cluster/CLUSTER_NAME": "false" } }
        }));
    });
    let faults = policy_faults(&cluster_tag_only);
    assert!(
        faults.contains(&"too narrow: refuses ec2:DeleteNetworkInterface on a VPC CNI interface".to_string()),
        "{faults:?}"
    );
    assert!(
        faults.contains(
            &"too wide: allows ec2:DeleteNetworkInterface on the VPC resource controller's branch interface"
                .to_string()
        ),
        "{faults:?}"
    );
    // termination by the cluster's tag alone reaches the managed node groups
    let cluster_only = with_statements(|st| {
        for s in st.iter_mut().filter(|s| s["Action"] == json!(["ec2:TerminateInstances"])) {
            s["Condition"].as_object_mut().unwrap().remove("Null");
        }
    });
    assert_eq!(
        policy_faults(&cluster_only),
        [
            "too wide: allows ec2:TerminateInstances on an EKS Auto Mode instance",
            "too wide: allows ec2:TerminateInstances on a managed node group's instance"
        ]
    );
    // termination on Karpenter's NodePool tag without the EC2NodeClass tag reaches EKS Auto
    // Mode's instances
    let nodepool_only = with_statements(|st| {
        for s in st.iter_mut().filter(|s| s["Action"] == json!(["ec2:TerminateInstances"])) {
            s["Condition"]["Null"].as_object_mut().unwrap().remove("aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass");
        }
    });
    assert_eq!(policy_faults(&nodepool_only), ["too wide: allows ec2:TerminateInstances on an EKS Auto Mode instance"]);
    // a policy without the IAM statement cannot reclaim instance profiles
    let no_iam = with_statements(|st| st.retain(|s| s["Sid"] != "DeleteThisClustersKarpenterInstanceProfiles"));
    assert_eq!(
        policy_faults(&no_iam),
        [
            "too narrow: refuses iam:RemoveRoleFromInstanceProfile on an instance profile's role",
            "too narrow: refuses iam:DeleteInstanceProfile on an instance profile"
        ]
    );
}
