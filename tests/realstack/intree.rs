//! The in-tree path of load balancers with the real component: cloud-provider-aws's service
//! controller (`crates/realstack/ccm`, `--controllers=service`), the one EKS runs in its control
//! plane, against LocalStack on the real control plane. What it makes for Services of type
//! LoadBalancer (a classic load balancer with its `k8s-elb-` security group; a network load
//! balancer with its target group) is what the tool's verification must recognise as this
//! cluster's by positive evidence (`cleanup::judge_load_balancing`), and the drain must not keep
//! it from deleting them afterwards: it runs on no node.

use std::time::{Duration, Instant};

use aws_sdk_ec2::types::Filter;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use super::common;
use super::resume::provisioned;

/// The cloud config of the controller for `cluster`: its VPC and a subnet given, so it builds
/// no instance of its own from the instance metadata service (`newAWSCloud2` in its
/// `pkg/providers/v1/aws.go`), and every AWS service it calls pointed at LocalStack.
fn cloud_config(cluster: &str, vpc: &str, subnet: &str) -> String {
    let endpoint = sandbox_sim::localstack::endpoint();
    let region = common::e2e::REGION;
    let mut text =
        format!("[Global]\nZone = {region}a\nVPC = {vpc}\nSubnetID = {subnet}\nKubernetesClusterID = {cluster}\n");
    // the services' ids in aws-sdk-go-v2, which its ServiceOverride matches
    for (n, service) in ["EC2", "Elastic Load Balancing", "Elastic Load Balancing v2"].iter().enumerate() {
        text.push_str(&format!(
            "[ServiceOverride \"{n}\"]\nService = {service}\nRegion = {region}\nURL = {endpoint}\nSigningRegion = {region}\n"
        ));
    }
    text
}

/// The tool's `verify` of `cluster` (read-only), with its report.
async fn verify(p: &super::resume::Provisioned) -> common::e2e::Run {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["verify", "--cluster", &p.cluster, "--region", common::e2e::REGION, "--report"])
        .arg(&report)
        .envs(common::localstack_env());
    common::e2e::run_of(cmd, &report).await
}

/// What verification reports of load balancing, as (kind, name, owner, made for), sorted.
fn load_balancing(run: &common::e2e::Run) -> Vec<(String, String, String, String)> {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let mut out: Vec<_> = run.report["leftovers"]["load_balancing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (s(&l["kind"]), s(&l["name"]), s(&l["owner"]), s(&l["made_for"])))
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_in_tree_service_controllers_load_balancers_are_this_clusters_and_outlive_no_drain() {
    let mut p = provisioned("rint", &super::shipped_rbac_yaml(), 2).await;
    let subnets = p
        .ec2
        .describe_subnets()
        .filters(Filter::builder().name("tag:karpenter.sh/discovery").values(&p.cluster).build())
        .send()
        .await
        .unwrap();
    let subnet = &subnets.subnets()[0];
    let (vpc, subnet) = (subnet.vpc_id().unwrap().to_string(), subnet.subnet_id().unwrap().to_string());
    let env: Vec<(String, String)> = [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", common::e2e::REGION),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    p.s.start_cloud_controller(&cloud_config(&p.cluster, &vpc, &subnet), &env).await.unwrap_or_else(|e| panic!("{e}"));

    // an internal classic load balancer and an internal network load balancer (the VPC has no
    // internet gateway for public ones)
    let pp = PostParams::default();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "shop"}})).unwrap();
    Api::<Namespace>::all(p.admin.clone()).create(&pp, &ns).await.unwrap();
    let services: Api<Service> = Api::namespaced(p.admin.clone(), "shop");
    for (name, nlb) in [("front", false), ("edge", true)] {
        let mut annotations = json!({"service.beta.kubernetes.io/aws-load-balancer-internal": "true"});
        if nlb {
            annotations["service.beta.kubernetes.io/aws-load-balancer-type"] = json!("nlb");
        }
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 80}]},
        }))
        .unwrap();
        services.create(&pp, &svc).await.unwrap();
    }
    let mut hostnames = Vec::new();
    for name in ["front", "edge"] {
        let deadline = Instant::now() + Duration::from_secs(120);
        hostnames.push(loop {
            let s = services.get(name).await.unwrap();
            let ingress = s.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default();
            if let Some(h) = ingress.first().and_then(|i| i.hostname.clone()) {
                break h;
            }
            assert!(
                Instant::now() < deadline,
                "no load balancer for Service {name}: {}",
                p.s.log_tail("cloud-controller-manager")
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        });
        let finalizers = services.get(name).await.unwrap().metadata.finalizers.unwrap_or_default();
        assert_eq!(finalizers, ["service.kubernetes.io/load-balancer-cleanup"]);
    }

    // what the real controller made: for `front` a classic load balancer and its own security
    // group; for `edge` a network load balancer and a target group
    let config = sandbox_sim::localstack::config_as(common::e2e::REGION, "test").await;
    let elb = aws_sdk_elasticloadbalancing::Client::new(&config);
    let lbs = elb.describe_load_balancers().send().await.unwrap();
    let classic: Vec<&str> = lbs
        .load_balancer_descriptions()
        .iter()
        .filter(|l| l.dns_name() == Some(hostnames[0].as_str()))
        .filter_map(|l| l.load_balancer_name())
        .collect();
    assert_eq!(classic.len(), 1, "{lbs:?}");
    let classic = classic[0].to_string();
    let sg = format!("k8s-elb-{classic}");
    let groups = p.ec2.describe_security_groups().filters(Filter::builder().name("group-name").values(&sg).build());
    assert_eq!(groups.send().await.unwrap().security_groups().len(), 1, "no security group {sg}");
    let v2 = aws_sdk_elasticloadbalancingv2::Client::new(&config);
    let lbs = v2.describe_load_balancers().send().await.unwrap();
    let nlb: Vec<_> = lbs.load_balancers().iter().filter(|l| l.dns_name() == Some(hostnames[1].as_str())).collect();
    assert_eq!(nlb.len(), 1, "{lbs:?}");
    let (nlb, arn) = (nlb[0].load_balancer_name().unwrap().to_string(), nlb[0].load_balancer_arn().unwrap());
    let groups = v2.describe_target_groups().load_balancer_arn(arn).send().await.unwrap();
    let target_groups: Vec<String> =
        groups.target_groups().iter().filter_map(|t| t.target_group_name().map(String::from)).collect();
    assert_eq!(target_groups.len(), 1, "one port, one target group: {target_groups:?}");

    // verification names exactly those four, as the in-tree controller's, by their own tags
    // (exit 4: Karpenter's instances still run)
    let read = verify(&p).await;
    assert_eq!(read.code, 4, "{}", read.dump());
    let owner = "the in-tree service controller".to_string();
    let made = |kind: &str, name: &str, made_for: &str| {
        (kind.to_string(), name.to_string(), owner.clone(), made_for.to_string())
    };
    let expected = [
        made("classic-load-balancer", &classic, "Service shop/front"),
        made("load-balancer", &nlb, "Service shop/edge"),
        made("security-group", &sg, &format!("load balancer {classic}")),
        made("target-group", &target_groups[0], "Service shop/edge"),
    ];
    assert_eq!(load_balancing(&read), expected, "{}", read.dump());

    // the teardown is not refused for them (the controller runs in the control plane, on no
    // node) and reports them, touching none
    let run = super::admission::teardown(&p, true).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    p.assert_torn_down(&p.instances).await;
    assert_eq!(load_balancing(&run), expected, "{}", run.dump());

    // after the drain the controller still deletes them with their Services
    for name in ["front", "edge"] {
        services.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    for name in ["front", "edge"] {
        while services.get_opt(name).await.unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "Service {name} was not released: {}",
                p.s.log_tail("cloud-controller-manager")
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let after = verify(&p).await;
    assert_eq!(after.code, 0, "{}", after.dump());
    assert_eq!(load_balancing(&after), [], "{}", after.dump());
    p.end().await;
}
