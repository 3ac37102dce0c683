//! `sweep` end to end against LocalStack in two regions of their own: one verdict per cluster,
//! only the orphans reclaimed, a dry run that changes nothing and lists what `--yes` removes,
//! and no reclaim at all without EKS's answer. Every call is held to
//! `deploy/iam-policy-sweep.json` by the enforcing proxy.

use std::collections::BTreeMap;
use std::time::Duration;

use karpenter_teardown::aws::InstanceState;
use serde_json::Value;

use crate::common::e2e::{Run, run_of, states};

/// Regions no other test uses: a region-wide sweep sees only what this test made there.
const A: &str = "eu-north-1";
const B: &str = "ap-southeast-2";

fn sweep_policy_text() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/iam-policy-sweep.json")).unwrap()
}

/// `karpenter-teardown sweep` over both regions, only `clusters`, with `extra`, signing with `key`.
async fn sweep(dir: &std::path::Path, key: &str, clusters: &[&str], extra: &[&str]) -> Run {
    let report = dir.join("sweep.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["sweep", "--region", A, "--region", B, "--report"]).arg(&report);
    for c in clusters {
        cmd.args(["--cluster", c]);
    }
    cmd.args(extra)
        .envs(crate::common::localstack_env())
        .env("AWS_ACCESS_KEY_ID", key)
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

/// The tags Karpenter ≥ 1.0 launches an instance of `cluster` with.
fn launch_tags(cluster: &str) -> BTreeMap<String, String> {
    sandbox_sim::naming::launch_tags(cluster, "default", "default")
}

/// The user data Karpenter writes for AL2023 nodes of an EKS cluster: it names the cluster's
/// EKS endpoint, the evidence that EKS's "not found" means the cluster is gone.
fn eks_user_data(region: &str) -> String {
    format!(
        "apiVersion: node.eks.aws/v1alpha1\nkind: NodeConfig\nspec:\n  cluster:\n    name: x\n    \
         apiServerEndpoint: https://0123456789ABCDEF.gr7.{region}.eks.amazonaws.com\n"
    )
}

/// `count` instances of `tags` in `region`, bootstrapped with `user_data`: their ids.
async fn launch_with(region: &str, count: i32, tags: &BTreeMap<String, String>, user_data: &str) -> Vec<String> {
    launch_of(region, count, aws_sdk_ec2::types::InstanceType::M5Large, None, tags, user_data).await
}

/// `count` instances of `instance_type` (in `market`, on demand when `None`) of `tags` in
/// `region`, bootstrapped with `user_data`: their ids.
async fn launch_of(
    region: &str,
    count: i32,
    instance_type: aws_sdk_ec2::types::InstanceType,
    market: Option<aws_sdk_ec2::types::MarketType>,
    tags: &BTreeMap<String, String>,
    user_data: &str,
) -> Vec<String> {
    use base64::Engine as _;
    let ec2 = aws_sdk_ec2::Client::new(&sandbox_sim::localstack::config_as(region, "test").await);
    let market = market.map(|m| aws_sdk_ec2::types::InstanceMarketOptionsRequest::builder().market_type(m).build());
    let out = ec2
        .run_instances()
        .image_id(sandbox_sim::naming::IMAGE_ID)
        .instance_type(instance_type)
        .min_count(count)
        .max_count(count)
        .set_instance_market_options(market)
        .user_data(base64::engine::general_purpose::STANDARD.encode(user_data))
        .tag_specifications(sandbox_sim::cloud::tag_spec(aws_sdk_ec2::types::ResourceType::Instance, tags))
        .send()
        .await
        .unwrap();
    out.instances().iter().filter_map(|i| i.instance_id().map(str::to_string)).collect()
}

/// `count` instances of an EKS cluster with `tags` in `region`: their ids.
async fn launch(region: &str, count: i32, tags: &BTreeMap<String, String>) -> Vec<String> {
    launch_with(region, count, tags, &eks_user_data(region)).await
}

/// A Karpenter launch template and instance profile of `cluster` in `region`: (template id,
/// profile name).
async fn class_resources(region: &str, cluster: &str) -> (String, String) {
    let cloud = crate::common::cloud(region).await;
    let mut lt_tags = launch_tags(cluster);
    lt_tags.remove(karpenter_teardown::karpenter::TAG_NODEPOOL);
    let lt = eks_launch_template(region, &format!("karpenter.k8s.aws/{cluster}"), &lt_tags).await;
    let profile = format!("{cluster}_1234567");
    let profile_tags = sandbox_sim::karpenter::instance_profile_tags(cluster, region, "default");
    cloud
        .create_instance_profile(&profile, &format!("/karpenter/{region}/{cluster}/uid-1/"), &profile_tags)
        .await
        .unwrap();
    (lt, profile)
}

/// A launch template as Karpenter writes one for an EKS cluster: its user data names the
/// cluster's endpoint. Its id.
async fn eks_launch_template(region: &str, name: &str, tags: &BTreeMap<String, String>) -> String {
    use base64::Engine as _;
    let ec2 = aws_sdk_ec2::Client::new(&sandbox_sim::localstack::config_as(region, "test").await);
    let data = aws_sdk_ec2::types::RequestLaunchTemplateData::builder()
        .image_id(sandbox_sim::naming::IMAGE_ID)
        .user_data(base64::engine::general_purpose::STANDARD.encode(eks_user_data(region)))
        .build();
    let out = ec2
        .create_launch_template()
        .launch_template_name(name)
        .launch_template_data(data)
        .tag_specifications(sandbox_sim::cloud::tag_spec(aws_sdk_ec2::types::ResourceType::LaunchTemplate, tags))
        .send()
        .await
        .unwrap();
    out.launch_template().and_then(|l| l.launch_template_id()).unwrap().to_string()
}

/// The report's line of `cluster` in `region`.
fn line<'a>(run: &'a Run, region: &str, cluster: &str) -> &'a Value {
    run.report["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["region"] == region && c["cluster"] == cluster)
        .unwrap_or_else(|| panic!("no line for {cluster} in {region}: {}", run.dump()))
}

async fn live_states(region: &str, ids: &[String]) -> BTreeMap<String, InstanceState> {
    states(&crate::common::localstack_as_aws(region).await, ids).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_destroyed_clusters_are_reclaimed_each_cluster_with_its_verdict() {
    let name = |p: &str| crate::common::unique_cluster(p);
    let selfmanaged = name("sw-self");
    let (gone, old, torn, kept, live, reborn, elsewhere, young) = (
        name("sw-gone"),
        name("sw-old"),
        name("sw-torn"),
        name("sw-kept"),
        name("sw-live"),
        name("sw-reborn"),
        name("sw-else"),
        name("sw-young"),
    );
    // what a destroyed cluster left in A: a running and a stopped instance, a launch template
    // and an instance profile
    let gone_ids = launch(A, 2, &launch_tags(&gone)).await;
    let ec2 = aws_sdk_ec2::Client::new(&sandbox_sim::localstack::config_as(A, "test").await);
    ec2.stop_instances().instance_ids(&gone_ids[1]).send().await.unwrap();
    let (gone_lt, gone_profile) = class_resources(A, &gone).await;
    // a destroyed cluster of Karpenter before 1.0 (tags `karpenter.sh/managed-by`)
    let old_tags = BTreeMap::from([
        ("karpenter.sh/managed-by".to_string(), old.clone()),
        (karpenter_teardown::karpenter::cluster_tag_key(&old), "owned".to_string()),
        ("karpenter.sh/nodepool".to_string(), "default".to_string()),
        ("karpenter.k8s.aws/ec2nodeclass".to_string(), "default".to_string()),
    ]);
    let old_ids = launch(A, 1, &old_tags).await;
    // tags that disagree on the cluster
    let mut torn_tags = launch_tags(&torn);
    torn_tags.insert(karpenter_teardown::karpenter::cluster_tag_key(&gone), "owned".to_string());
    let torn_ids = launch(A, 1, &torn_tags).await;
    // a protected one
    let mut kept_tags = launch_tags(&kept);
    kept_tags.insert("karpenter-teardown.io/keep".to_string(), "until-audit".to_string());
    let kept_ids = launch(A, 1, &kept_tags).await;
    // a live one, and one recreated under the same name after its instances were launched
    let live_ids = launch(A, 1, &launch_tags(&live)).await;
    crate::common::register_eks(&live, A, "https://live.example", None).await;
    let reborn_ids = launch(A, 1, &launch_tags(&reborn)).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    crate::common::register_eks(&reborn, A, "https://reborn.example", None).await;
    // a self-managed Karpenter on EC2: tagged like an EKS cluster's, joined to its own endpoint
    let self_data = "[settings.kubernetes]\napi-server = \"https://k8s.internal.example:6443\"\n";
    let self_ids = launch_with(A, 1, &launch_tags(&selfmanaged), self_data).await;
    // B: a cluster EKS has in A only, so none in B, where its resources are
    let else_ids = launch(B, 1, &launch_tags(&elsewhere)).await;
    crate::common::register_eks(&elsewhere, A, "https://else.example", None).await;
    // everything above is older than --min-age by the time the young cluster is made
    tokio::time::sleep(Duration::from_secs(20)).await;
    let young_ids = launch(A, 1, &launch_tags(&young)).await;

    let dir = tempfile::tempdir().unwrap();
    let key = crate::common::key_with_policy(crate::common::policy_from(&sweep_policy_text(), "", A));
    let all = [&gone, &old, &torn, &kept, &live, &reborn, &elsewhere, &young, &selfmanaged].map(String::as_str);
    let everything: Vec<String> =
        [&gone_ids, &old_ids, &torn_ids, &kept_ids, &live_ids, &reborn_ids, &young_ids, &self_ids]
            .into_iter()
            .flatten()
            .cloned()
            .collect();

    // the dry run: one verdict per cluster, and what --yes would remove, changing nothing
    let dry = sweep(dir.path(), &key, &all, &["--min-age", "15s"]).await;
    assert_eq!(dry.code, 3, "a cluster is uncertain: {}", dry.dump());
    let clusters = dry.report["clusters"].as_array().map(Vec::len).unwrap_or_default();
    // the torn instance is grouped under both names it gives (torn | gone)
    assert_eq!(clusters, 9, "{}", dry.dump());
    let verdict = |run: &Run, region: &str, c: &str| line(run, region, c)["verdict"].as_str().unwrap().to_string();
    assert_eq!(verdict(&dry, A, &gone), "orphaned", "{}", dry.dump());
    assert_eq!(verdict(&dry, A, &old), "orphaned");
    assert_eq!(verdict(&dry, A, &kept), "protected");
    assert_eq!(verdict(&dry, A, &live), "active");
    assert_eq!(verdict(&dry, A, &reborn), "active");
    assert!(line(&dry, A, &reborn)["why"].as_str().unwrap().contains("earlier incarnation"), "{}", dry.dump());
    assert_eq!(verdict(&dry, A, &young), "too-young");
    assert_eq!(verdict(&dry, B, &elsewhere), "orphaned");
    assert!(line(&dry, A, &gone)["why"].as_str().unwrap().contains(".eks.amazonaws.com"), "{}", dry.dump());
    // EKS never knew the self-managed cluster: not proven gone, unless the user says it was not EKS
    assert_eq!(verdict(&dry, A, &selfmanaged), "uncertain");
    assert!(line(&dry, A, &selfmanaged)["why"].as_str().unwrap().contains("--not-eks"), "{}", dry.dump());

    let mut both = [gone.clone(), torn.clone()];
    both.sort();
    assert_eq!(verdict(&dry, A, &both.join(" | ")), "uncertain");
    let gone_line = line(&dry, A, &gone);
    let would: Vec<&str> = gone_line["reclaim"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    let listed = would.join("\n");
    let gone_lt_name = format!("karpenter.k8s.aws/{gone}");
    for id in gone_ids.iter().chain([&gone_lt_name, &gone_profile]) {
        assert!(listed.contains(id.as_str()), "{id} is listed: {listed}");
    }
    assert_eq!(gone_line["launch_templates"][0], gone_lt.as_str(), "{}", dry.dump());
    assert!(dry.stdout.contains("would reclaim:"), "{}", dry.dump());
    let still = live_states(A, &everything).await;
    assert_eq!(still.len(), everything.len());
    assert!(still.values().all(|s| s.is_live()), "a dry run changed an instance: {still:?}");

    // --yes: the orphans and nothing else
    let run = sweep(dir.path(), &key, &all, &["--min-age", "15s", "--yes"]).await;
    assert_eq!(run.code, 3, "the uncertain cluster still says so: {}", run.dump());
    for c in [&gone, &old] {
        let l = line(&run, A, c);
        assert_eq!(l["reclaimed"], true, "{}", run.dump());
        assert_eq!(l["failures"].as_array().map(Vec::len), Some(0), "{}", run.dump());
    }
    let gone_now = live_states(A, &[gone_ids.clone(), old_ids.clone()].concat()).await;
    assert!(gone_now.values().all(|s| !s.is_live()), "{gone_now:?}");
    let else_now = live_states(B, &else_ids).await;
    assert!(else_now.values().all(|s| !s.is_live()), "{else_now:?}");
    let untouched: Vec<String> =
        [&torn_ids, &kept_ids, &live_ids, &reborn_ids, &young_ids, &self_ids].into_iter().flatten().cloned().collect();
    let kept_now = live_states(A, &untouched).await;
    assert_eq!(kept_now.len(), untouched.len());
    assert!(kept_now.values().all(|s| *s == InstanceState::Running), "{kept_now:?}");
    let cloud = crate::common::cloud(A).await;
    assert_eq!(cloud.launch_template_id(&format!("karpenter.k8s.aws/{gone}")).await.unwrap(), None);
    assert!(!cloud.delete_instance_profile(&gone_profile).await.unwrap(), "the orphan's profile is gone");

    // named with --not-eks, the self-managed cluster is taken as gone when EKS does not know it
    let named = sweep(dir.path(), &key, &[&selfmanaged], &["--min-age", "15s", "--not-eks"]).await;
    assert_eq!(named.code, 4, "a dry run lists it: {}", named.dump());
    assert_eq!(verdict(&named, A, &selfmanaged), "orphaned");

    // run again: nothing orphaned is left (the instance whose tags also name `gone` is left out
    // by --exclude-cluster, whichever of its names the exclusion gives)
    let extra = ["--min-age", "15s", "--yes", "--exclude-cluster", torn.as_str()];
    let again = sweep(dir.path(), &key, &[&gone, &old, &elsewhere], &extra).await;
    assert_eq!(again.code, 0, "{}", again.dump());
    assert_eq!(again.report["clusters"].as_array().map(Vec::len), Some(0), "{}", again.dump());
    cloud.terminate(&untouched).await.unwrap();
}

/// Each cluster's running instances are priced by AWS's answers, apart from the verdicts: on
/// demand by the Price List (served by the proxy as AWS serves it; LocalStack has none), Spot by
/// EC2's Spot price history (LocalStack's), a stopped instance not at all. A type the Price List
/// does not have, or a policy without the pricing statement, leaves instances unpriced with why,
/// and changes no verdict and no exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_cluster_is_priced_by_aws_and_a_price_aws_does_not_give_is_unknown() {
    // a region of this test's own: a region-wide sweep sees only what it made there
    const C: &str = "ca-central-1";
    let (gone, other) = (crate::common::unique_cluster("sw-cost"), crate::common::unique_cluster("sw-cost-c5"));
    crate::common::ec2_proxy_control().serve_prices(Some(sandbox_sim::pricelist::PriceList {
        // m5.large's on-demand Linux price in us-east-1 by the Price List (Karpenter 1.14's
        // generated table), served here for C
        products: [((C.to_string(), "m5.large".to_string()), 0.096)].into(),
    }));
    let mut ids = launch(C, 3, &launch_tags(&gone)).await;
    let ec2 = aws_sdk_ec2::Client::new(&sandbox_sim::localstack::config_as(C, "test").await);
    ec2.stop_instances().instance_ids(&ids[2]).send().await.unwrap();
    use aws_sdk_ec2::types::{InstanceType, MarketType};
    let (tags, data) = (launch_tags(&gone), eks_user_data(C));
    ids.extend(launch_of(C, 1, InstanceType::M5Large, Some(MarketType::Spot), &tags, &data).await);
    assert_eq!(ids.len(), 4);
    ids.extend(launch_of(C, 1, InstanceType::C5Large, None, &launch_tags(&other), &data).await);
    assert_eq!(ids.len(), 5);

    let sweep_in_c = |key: String| {
        let dir = tempfile::tempdir().unwrap();
        let (gone, other) = (gone.clone(), other.clone());
        async move {
            let report = dir.path().join("sweep.json");
            let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
            cmd.args(["sweep", "--region", C, "--min-age", "0s", "--cluster", &gone, "--cluster", &other, "--report"])
                .arg(&report)
                .envs(crate::common::localstack_env())
                .env("AWS_ACCESS_KEY_ID", key)
                .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
            run_of(cmd, &report).await
        }
    };
    let shipped = crate::common::key_with_policy(crate::common::policy_from(&sweep_policy_text(), "", C));
    let priced = sweep_in_c(shipped).await;
    assert_eq!(priced.code, 4, "a dry run with orphans: {}", priced.dump());
    assert_eq!(priced.report["clusters"].as_array().map(Vec::len), Some(2), "{}", priced.dump());
    let cost = |run: &Run, c: &str| line(run, C, c)["hourly_cost"].clone();
    let g = cost(&priced, &gone);
    // two on demand at the listed price, one Spot at EC2's (LocalStack's: $0.00001), the
    // stopped one not at all
    assert_eq!((g["priced"].as_u64(), g["unpriced"].as_u64()), (Some(3), Some(0)), "{}", priced.dump());
    let usd = g["usd"].as_f64().unwrap();
    assert!((usd - (2.0 * 0.096 + 0.00001)).abs() < 1e-9, "{usd}");
    assert!(priced.stdout.contains("$0.19/h"), "{}", priced.dump());
    let c5 = cost(&priced, &other);
    assert_eq!((c5["priced"].as_u64(), c5["unpriced"].as_u64()), (Some(0), Some(1)), "{}", priced.dump());
    assert!(c5["why_unpriced"][0].as_str().unwrap().contains("no such product"), "{c5}");
    assert!(priced.stdout.contains("not priced: 1 running instance(s)"), "{}", priced.dump());

    // without the pricing statement: nothing priced, with why; the verdicts and the exit as before
    let mut policy: Value = serde_json::from_str(&sweep_policy_text()).unwrap();
    let statements = policy["Statement"].as_array_mut().unwrap();
    let before = statements.len();
    statements.retain(|s| s["Sid"] != "PriceRunningInstances");
    assert_eq!(statements.len(), before - 1);
    let unpriced =
        sweep_in_c(crate::common::key_with_policy(crate::common::policy_from(&policy.to_string(), "", C))).await;
    assert_eq!(unpriced.code, priced.code, "{}", unpriced.dump());
    for c in [&gone, &other] {
        assert_eq!(line(&unpriced, C, c)["verdict"], line(&priced, C, c)["verdict"], "{}", unpriced.dump());
        assert_eq!(line(&unpriced, C, c)["reclaim"], line(&priced, C, c)["reclaim"]);
    }
    let g = cost(&unpriced, &gone);
    assert_eq!((g["priced"].as_u64(), g["unpriced"].as_u64()), (Some(0), Some(3)), "{}", unpriced.dump());
    let why = g["why_unpriced"].to_string();
    assert!(
        why.contains("pricing:GetProducts is not allowed")
            && why.contains("ec2:DescribeSpotPriceHistory is not allowed"),
        "{why}"
    );
    crate::common::ec2_proxy_control().serve_prices(None);
    crate::common::cloud(C).await.terminate(&ids).await.unwrap();
}

/// With `eks:DescribeCluster` denied, no cluster can be proven absent: every cluster is
/// uncertain and nothing is deleted, `--yes` or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_eks_answering_every_cluster_is_uncertain_and_nothing_is_deleted() {
    let gone = crate::common::unique_cluster("sw-denied");
    let ids = launch(B, 1, &launch_tags(&gone)).await;
    let mut policy: Value = serde_json::from_str(&sweep_policy_text()).unwrap();
    let statements = policy["Statement"].as_array_mut().unwrap();
    let before = statements.len();
    statements.retain(|s| s["Action"].as_array().is_none_or(|a| !a.iter().any(|x| x == "eks:DescribeCluster")));
    assert_eq!(statements.len(), before - 1, "the sweep policy grants eks:DescribeCluster in one statement");
    let key = crate::common::key_with_policy(crate::common::policy_from(&policy.to_string(), "", B));
    let dir = tempfile::tempdir().unwrap();
    let run = sweep(dir.path(), &key, &[&gone], &["--min-age", "0s", "--yes"]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    let l = line(&run, B, &gone);
    assert_eq!(l["verdict"], "uncertain", "{}", run.dump());
    assert!(l["why"].as_str().unwrap().contains("EKS could not say"), "{}", run.dump());
    assert_eq!(l["reclaimed"], false);
    let now = live_states(B, &ids).await;
    assert_eq!(now.len(), 1);
    assert!(now.values().all(|s| *s == InstanceState::Running), "{now:?}");
    crate::common::cloud(B).await.terminate(&ids).await.unwrap();
}

/// Without the permission to terminate, the sweep is refused before its first call (exit 2,
/// nothing changed), a dry run saying so as well, and names the call and the policy that grants it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_permission_refuses_the_sweep_before_anything_is_deleted() {
    let gone = crate::common::unique_cluster("sw-noperm");
    let ids = launch(B, 1, &launch_tags(&gone)).await;
    let (lt, profile) = class_resources(B, &gone).await;
    let mut policy: Value = serde_json::from_str(&sweep_policy_text()).unwrap();
    let statements = policy["Statement"].as_array_mut().unwrap();
    let before = statements.len();
    statements.retain(|s| s["Action"].as_array().is_none_or(|a| !a.iter().any(|x| x == "ec2:TerminateInstances")));
    assert_eq!(statements.len(), before - 2, "the sweep policy grants ec2:TerminateInstances in two statements");
    let key = crate::common::key_with_policy(crate::common::policy_from(&policy.to_string(), "", B));
    let dir = tempfile::tempdir().unwrap();
    for extra in [&["--min-age", "0s"][..], &["--min-age", "0s", "--yes"][..]] {
        let run = sweep(dir.path(), &key, &[&gone], extra).await;
        assert_eq!(run.code, 2, "{extra:?}: {}", run.dump());
        assert!(
            run.stderr.contains("ec2:TerminateInstances for cluster")
                && run.stderr.contains("deploy/iam-policy-sweep.json")
                && run.stderr.contains("Nothing was changed"),
            "{}",
            run.dump()
        );
        assert_eq!(line(&run, B, &gone)["verdict"], "orphaned", "{}", run.dump());
        assert_eq!(line(&run, B, &gone)["reclaimed"], false);
    }
    let now = live_states(B, &ids).await;
    assert_eq!(now.len(), 1);
    assert!(now.values().all(|s| *s == InstanceState::Running), "{now:?}");
    let cloud = crate::common::cloud(B).await;
    assert_eq!(cloud.launch_template_id(&format!("karpenter.k8s.aws/{gone}")).await.unwrap(), Some(lt.clone()));
    assert!(cloud.delete_instance_profile(&profile).await.unwrap(), "the profile was left");
    cloud.delete_launch_template(&lt).await.unwrap();
    cloud.terminate(&ids).await.unwrap();
}

/// A sweep killed (SIGKILL) in the middle of its reclaim, its instances terminated and the
/// instance profile's delete on the wire, is finished by the next sweep: what is left still
/// proves the cluster an EKS cluster's (the launch templates, whose user data names the EKS
/// endpoint, are deleted last), so it is orphaned again, reclaimed, and a third sweep finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_killed_in_the_middle_of_its_reclaim_is_finished_by_the_next_one() {
    const HELD: &str = "DeleteInstanceProfile";
    let gone = crate::common::unique_cluster("sw-killed");
    let ids = launch(B, 2, &launch_tags(&gone)).await;
    let (lt, profile) = class_resources(B, &gone).await;
    let policy = || crate::common::policy_from(&sweep_policy_text(), "", B);
    let (first, second) = (crate::common::key_with_policy(policy()), crate::common::key_with_policy(policy()));
    let proxy = crate::common::ec2_proxy_control();
    proxy.hold(&first, HELD);
    let dir = tempfile::tempdir().unwrap();

    // the first sweep: stopped for good while its profile delete waits at the proxy
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["sweep", "--region", B, "--cluster", &gone, "--min-age", "0s", "--yes"])
        .envs(crate::common::localstack_env())
        .env("AWS_ACCESS_KEY_ID", &first)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let held = tokio::time::timeout(Duration::from_secs(120), async {
        while proxy.held(&first, HELD) == 0 {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(status);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    })
    .await;
    assert!(matches!(held, Ok(Ok(()))), "the first sweep never reached {HELD}: {held:?}");
    child.start_kill().unwrap();
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), None, "killed by a signal, not ended by itself");
    let now = live_states(B, &ids).await;
    assert_eq!(now.len(), 2);
    assert!(now.values().all(|s| !s.is_live()), "the instances went first: {now:?}");
    let cloud = crate::common::cloud(B).await;
    let lt_name = format!("karpenter.k8s.aws/{gone}");
    assert_eq!(cloud.launch_template_id(&lt_name).await.unwrap(), Some(lt.clone()), "the template is still there");

    // the next sweep (another identity: the first one's held call is still on the wire)
    let resumed = sweep(dir.path(), &second, &[&gone], &["--min-age", "0s", "--yes"]).await;
    assert_eq!(resumed.code, 0, "{}", resumed.dump());
    assert_eq!(resumed.report["clusters"].as_array().map(Vec::len), Some(1), "{}", resumed.dump());
    let l = line(&resumed, B, &gone);
    assert_eq!(l["verdict"], "orphaned", "{}", resumed.dump());
    assert_eq!(l["reclaimed"], true, "{}", resumed.dump());
    assert_eq!(l["failures"].as_array().map(Vec::len), Some(0), "{}", resumed.dump());
    assert_eq!(cloud.launch_template_id(&lt_name).await.unwrap(), None);
    assert!(!cloud.delete_instance_profile(&profile).await.unwrap(), "the profile is gone");

    // and nothing is left for a third
    let third = sweep(dir.path(), &second, &[&gone], &["--min-age", "0s", "--yes"]).await;
    assert_eq!(third.code, 0, "{}", third.dump());
    assert_eq!(third.report["clusters"].as_array().map(Vec::len), Some(0), "{}", third.dump());
    proxy.release(&first, HELD);
}
