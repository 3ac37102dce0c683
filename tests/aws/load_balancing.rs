//! What the cleanup controllers leave in AWS, found by verification for this cluster only:
//! ELBv2 load balancers and target groups, classic load balancers and their security groups
//! (served by moto through LocalStack, `localstack/launch.py`), and volumes by the tags that
//! name a cluster.

use crate::common;

use std::collections::BTreeSet;

use aws_sdk_ec2::types::{ResourceType, Tag, TagSpecification};
use aws_sdk_elasticloadbalancingv2::types::{LoadBalancerTypeEnum, ProtocolEnum, Tag as V2Tag};

const REGION: &str = "us-west-2";

/// ELBv2, classic ELB and EC2 clients of the test bed, straight to LocalStack.
struct Bed {
    v2: aws_sdk_elasticloadbalancingv2::Client,
    classic: aws_sdk_elasticloadbalancing::Client,
    ec2: aws_sdk_ec2::Client,
    subnets: Vec<String>,
    vpc: String,
}

impl Bed {
    async fn new() -> Bed {
        Bed::in_account("test").await
    }

    /// A bed in the LocalStack account of `access_key` (twelve digits: an account of its own).
    async fn in_account(access_key: &str) -> Bed {
        common::require_localstack();
        let config = sandbox_sim::localstack::config_as(REGION, access_key).await;
        let ec2 = aws_sdk_ec2::Client::new(&config);
        let (subnets, vpc) = common::default_subnets(&config).await;
        Bed {
            v2: aws_sdk_elasticloadbalancingv2::Client::new(&config),
            classic: aws_sdk_elasticloadbalancing::Client::new(&config),
            ec2,
            subnets,
            vpc,
        }
    }

    async fn load_balancer(&self, name: &str, tags: &[(&str, &str)]) -> String {
        let tags = tags.iter().map(|(k, v)| V2Tag::builder().key(*k).value(*v).build());
        let out = self
            .v2
            .create_load_balancer()
            .name(name)
            .r#type(LoadBalancerTypeEnum::Network)
            .set_subnets(Some(self.subnets.clone()))
            .set_tags(Some(tags.collect()))
            .send()
            .await
            .unwrap();
        out.load_balancers()[0].load_balancer_arn().unwrap().to_string()
    }

    async fn target_group(&self, name: &str, tags: &[(&str, &str)]) -> String {
        let tags = tags.iter().map(|(k, v)| V2Tag::builder().key(*k).value(*v).build());
        let out = self
            .v2
            .create_target_group()
            .name(name)
            .protocol(ProtocolEnum::Tcp)
            .port(80)
            .vpc_id(&self.vpc)
            .set_tags(Some(tags.collect()))
            .send()
            .await
            .unwrap();
        out.target_groups()[0].target_group_arn().unwrap().to_string()
    }

    async fn classic_load_balancer(&self, name: &str, tags: &[(&str, &str)]) {
        use aws_sdk_elasticloadbalancing::types::{Listener, Tag as ClassicTag};
        let listener = Listener::builder().protocol("TCP").load_balancer_port(80).instance_port(30080).build().unwrap();
        let tags = tags.iter().map(|(k, v)| ClassicTag::builder().key(*k).value(*v).build().unwrap());
        self.classic
            .create_load_balancer()
            .load_balancer_name(name)
            .listeners(listener)
            .subnets(&self.subnets[0])
            .set_tags(Some(tags.collect()))
            .send()
            .await
            .unwrap();
    }

    async fn security_group(&self, name: &str, tags: &[(&str, &str)]) -> String {
        let spec = TagSpecification::builder()
            .resource_type(ResourceType::SecurityGroup)
            .set_tags(Some(tags.iter().map(|(k, v)| Tag::builder().key(*k).value(*v).build()).collect()))
            .build();
        let out = self
            .ec2
            .create_security_group()
            .group_name(name)
            .description("test bed")
            .vpc_id(&self.vpc)
            .tag_specifications(spec)
            .send()
            .await
            .unwrap();
        out.group_id().unwrap().to_string()
    }

    async fn volume(&self, tags: &[(&str, &str)]) -> String {
        let spec = TagSpecification::builder()
            .resource_type(ResourceType::Volume)
            .set_tags(Some(tags.iter().map(|(k, v)| Tag::builder().key(*k).value(*v).build()).collect()))
            .build();
        let out = self
            .ec2
            .create_volume()
            .availability_zone(format!("{REGION}a"))
            .size(1)
            .tag_specifications(spec)
            .send()
            .await
            .unwrap();
        out.volume_id().unwrap().to_string()
    }
}

/// A short unique suffix: ELB names are at most 32 characters.
fn suffix() -> String {
    let cluster = common::unique_cluster("x");
    let n: u64 = cluster.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    format!("{:08x}", n as u32)
}

#[tokio::test]
async fn verification_reports_only_this_clusters_load_balancers_security_groups_and_volumes() {
    let bed = Bed::new().await;
    let cluster = common::unique_cluster("lbv");
    let other = common::unique_cluster("lbo");
    let s = suffix();
    let lbc = |c: &'static str, stack: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![
            ("elbv2.k8s.aws/cluster", c),
            ("service.k8s.aws/stack", stack),
            ("service.k8s.aws/resource", "LoadBalancer"),
        ]
    };
    // leak the names: the tags are &'static, and a test process is short-lived
    let c: &'static str = Box::leak(cluster.clone().into_boxed_str());
    let o: &'static str = Box::leak(other.clone().into_boxed_str());
    let owned: &'static str = Box::leak(format!("kubernetes.io/cluster/{c}").into_boxed_str());
    let others_owned: &'static str = Box::leak(format!("kubernetes.io/cluster/{o}").into_boxed_str());

    // this cluster's: the Load Balancer Controller's load balancer, target group, managed and
    // backend security groups; the in-tree controller's classic load balancer and its group
    let mine = [
        bed.load_balancer(&format!("k8s-web-{s}"), &lbc(c, "default/web")).await,
        bed.target_group(&format!("k8s-web-{s}"), &lbc(c, "default/web")).await,
        bed.security_group(
            &format!("k8s-default-web-{s}"),
            &[
                ("elbv2.k8s.aws/cluster", c),
                ("ingress.k8s.aws/stack", "default/web"),
                ("ingress.k8s.aws/resource", "ManagedLBSecurityGroup"),
            ],
        )
        .await,
        bed.security_group(
            &format!("k8s-traffic-{s}"),
            &[("elbv2.k8s.aws/cluster", c), ("elbv2.k8s.aws/resource", "backend-sg")],
        )
        .await,
        {
            let name = format!("a{s}");
            bed.classic_load_balancer(&name, &[(owned, "owned"), ("kubernetes.io/service-name", "default/legacy")])
                .await;
            name
        },
        bed.security_group(&format!("k8s-elb-a{s}"), &[(owned, "owned")]).await,
    ];
    // not this cluster's cleanup controllers': another cluster's, a user's load balancer and
    // Terraform's node security group with the cluster tag alone, a shared-tagged classic one
    let theirs = [
        bed.load_balancer(&format!("k8s-other-{s}"), &lbc(o, "default/web")).await,
        bed.load_balancer(&format!("user-{s}"), &[(owned, "owned")]).await,
        bed.load_balancer(&format!("half-{s}"), &[("elbv2.k8s.aws/cluster", c)]).await,
        bed.target_group(&format!("k8s-other-{s}"), &lbc(o, "default/web")).await,
        bed.security_group(&format!("node-{s}"), &[(owned, "owned")]).await,
        bed.security_group(&format!("k8s-elb-b{s}"), &[(others_owned, "owned")]).await,
        {
            let name = format!("b{s}");
            bed.classic_load_balancer(&name, &[(owned, "shared"), ("kubernetes.io/service-name", "default/x")]).await;
            name
        },
    ];
    // volumes: named for this cluster by the EBS CSI driver's cluster-name tag; the driver's
    // `ebs.csi.aws.com/cluster=true` names no cluster; another cluster's
    let named = bed.volume(&[("ebs.csi.aws.com/cluster-name", c), ("ebs.csi.aws.com/cluster", "true")]).await;
    let any_cluster = bed.volume(&[("ebs.csi.aws.com/cluster", "true"), ("CSIVolumeName", "pvc-1")]).await;
    let others = bed.volume(&[("ebs.csi.aws.com/cluster-name", o)]).await;

    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("report.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"))
        .args(["verify", "--cluster", &cluster, "--region", REGION, "--report"])
        .arg(&report_path)
        .envs(common::localstack_env())
        // held to deploy/iam-policy.json: a read the policy does not allow fails here as on AWS
        .env("AWS_ACCESS_KEY_ID", common::judged_key(&cluster, REGION))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // reported, not counted: their controllers delete them with their Services and Ingresses
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(common::schema::schema_errors(&report), Vec::<String>::new());
    let found = report["leftovers"]["load_balancing"].as_array().unwrap();
    assert_eq!(found.len(), mine.len(), "{found:#?}");
    let ids: BTreeSet<&str> = found.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, mine.iter().map(String::as_str).collect(), "{found:#?}");
    for t in &theirs {
        assert!(!ids.contains(t.as_str()), "{t} is not this cluster's cleanup controllers'");
    }
    let owners: BTreeSet<&str> = found.iter().map(|l| l["owner"].as_str().unwrap()).collect();
    assert_eq!(owners, BTreeSet::from(["the AWS Load Balancer Controller", "the in-tree service controller"]));
    let classic = found.iter().find(|l| l["kind"] == "classic-load-balancer").unwrap();
    assert_eq!(classic["made_for"], "Service default/legacy");

    let volumes: Vec<&str> =
        report["leftovers"]["volumes"].as_array().unwrap().iter().map(|v| v["id"].as_str().unwrap()).collect();
    assert_eq!(volumes, vec![named.as_str()], "only the volume named for this cluster");
    assert!(!volumes.contains(&any_cluster.as_str()) && !volumes.contains(&others.as_str()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("6 load balancer(s), target group(s) and security group(s)"), "{stdout}");
    for action in [
        "elasticloadbalancing:DescribeLoadBalancers",
        "elasticloadbalancing:DescribeTargetGroups",
        "elasticloadbalancing:DescribeTags",
        "ec2:DescribeSecurityGroups",
    ] {
        assert!(report["api_calls"][action].as_u64().unwrap_or(0) >= 1, "{action}: {}", report["api_calls"]);
    }

    // nothing of theirs or ours was deleted by the read
    let listed = bed.v2.describe_load_balancers().send().await.unwrap();
    let arns: BTreeSet<&str> = listed.load_balancers().iter().filter_map(|l| l.load_balancer_arn()).collect();
    assert!(arns.contains(mine[0].as_str()) && arns.contains(theirs[0].as_str()));
    for arn in [&mine[0], &theirs[0], &theirs[1], &theirs[2]] {
        bed.v2.delete_load_balancer().load_balancer_arn(arn).send().await.unwrap();
    }
    for arn in [&mine[1], &theirs[3]] {
        bed.v2.delete_target_group().target_group_arn(arn).send().await.unwrap();
    }
    for name in [&mine[4], &theirs[6]] {
        bed.classic.delete_load_balancer().load_balancer_name(name).send().await.unwrap();
    }
    for id in [&mine[2], &mine[3], &mine[5], &theirs[4], &theirs[5]] {
        bed.ec2.delete_security_group().group_id(id).send().await.unwrap();
    }
    for id in [&named, &any_cluster, &others] {
        bed.ec2.delete_volume().volume_id(id).send().await.unwrap();
    }
}

/// A load balancer deleted between ELBv2's listing and the read of its tags fails ELBv2's whole
/// `DescribeTags` call (`LoadBalancerNotFound`); a release's reads meet exactly that while the
/// controller deletes. Verification asks again for each, and finds the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_deleted_while_its_tags_are_read_leaves_the_rest_found() {
    use karpenter_teardown::aws::AwsClients;
    use sandbox_sim::ec2proxy::{Ec2Proxy, ProxyFaults};
    // an account of its own: the read covers every load balancer of the region
    let account = "624681357900";
    let bed = Bed::in_account(account).await;
    let cluster = common::unique_cluster("lbg");
    let s = suffix();
    let tags = [("elbv2.k8s.aws/cluster", cluster.as_str()), ("service.k8s.aws/stack", "shop/front")];
    let going = bed.load_balancer(&format!("k8s-going-{s}"), &tags).await;
    let staying = bed.load_balancer(&format!("k8s-staying-{s}"), &tags).await;
    let proxy = Ec2Proxy::start(common::LOCALSTACK, ProxyFaults::default()).await.unwrap();
    // the tags are read seconds after the listing, as a busy region's would be
    proxy.control().delay_action("DescribeTags", std::time::Duration::from_secs(3));
    let config = sandbox_sim::localstack::config_at(&proxy.url(), REGION, account).await;
    let tool = AwsClients::from_config(&config).await.unwrap();
    let read = tokio::spawn({
        let (tool, cluster) = (tool.clone(), cluster.clone());
        async move { karpenter_teardown::verify::load_balancing(&tool, &cluster).await }
    });
    // deleted once listed, while its tags are asked for
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while proxy.actions().get("DescribeTags").copied().unwrap_or(0) == 0 {
        assert!(std::time::Instant::now() < deadline, "the tags were never asked for: {:?}", proxy.actions());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    bed.v2.delete_load_balancer().load_balancer_arn(&going).send().await.unwrap();
    let found = read.await.unwrap().expect("a load balancer gone mid-read is no error");
    let ids: Vec<&str> = found.iter().map(|l| l.id.as_str()).collect();
    assert_eq!(ids, [staying.as_str()], "{found:?}");
    // the call that named the deleted one, then one call per load balancer
    assert_eq!(proxy.actions().get("DescribeTags").copied(), Some(3), "{:?}", proxy.actions());
    bed.v2.delete_load_balancer().load_balancer_arn(&staying).send().await.unwrap();
    proxy.shutdown().await;
}
