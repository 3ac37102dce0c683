//! Positive evidence before every destructive call (design §7): a kubeconfig that reaches some
//! other cluster, `verify --reclaim` against a cluster that still runs, a NodeClaim that names no
//! instance while EC2 holds one for it, and `--max-nodes` counting what EC2 holds.

use k8s_openapi::api::core::v1::Node;
use karpenter_teardown::aws::InstanceState;
use karpenter_teardown::k8s;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use sandbox_sim::generate;
use serde_json::json;

use crate::common::e2e::{Bed, Consent, REGION, Run, bed, run_of, small_world, states, teardown};

/// `karpenter-teardown verify --reclaim` of `cluster` with the bed's kubeconfig and `extra`
/// arguments, held to the shipped IAM policy.
async fn verify_reclaim(b: &Bed, cluster: &str, extra: &[&str]) -> Run {
    let report = b.dir.path().join("verify.json");
    let _ = std::fs::remove_file(&report);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_karpenter-teardown"));
    cmd.args(["verify", "--cluster", cluster, "--region", REGION, "--reclaim", "--kubeconfig"])
        .arg(&b.kubeconfig)
        .arg("--report")
        .arg(&report)
        .args(extra)
        .envs(crate::common::localstack_env())
        .env("AWS_ACCESS_KEY_ID", crate::common::judged_key(cluster, REGION))
        .env("KARPENTER_TEARDOWN_LOG_FORMAT", "json");
    run_of(cmd, &report).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_cluster_is_never_taken_for_another_cluster_of_the_account() {
    // the cluster the user means to leave alone: live, with its Karpenter instances running
    let spec = small_world("e2e-id-other", 3);
    let other = bed(&spec.cluster).await;
    let world = generate(&spec, &other.client, &other.cloud).await.unwrap();
    let theirs = world.karpenter_instance_ids();
    assert_eq!(theirs.len(), 3);
    // the cluster the kubeconfig reaches: empty, no controller, no Karpenter node, a plain context
    let empty = bed(&crate::common::unique_cluster("e2e-id-empty")).await;

    for consent in [Consent::DryRun, Consent::Yes] {
        let run = teardown(&empty, &world.cluster, consent, &["--reclaim"]).await;
        assert_eq!(run.code, 3, "{}", run.dump());
        assert_eq!(run.report["outcome"], "refused", "{}", run.dump());
        let error = run.report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(&format!("is not EKS cluster {}'s endpoint", world.cluster))
                && error.contains("Nothing was changed"),
            "the refusal names what it compared: {error}"
        );
        assert_eq!(run.report["steps"].as_array().map(Vec::len), Some(0), "{}", run.dump());
    }
    // a cluster EKS does not know at all is refused the same way
    let unknown = crate::common::unique_cluster("e2e-id-unknown");
    let run = teardown(&empty, &unknown, Consent::Yes, &["--reclaim"]).await;
    assert_eq!(run.code, 3, "{}", run.dump());
    assert!(run.stderr.contains(&format!("EKS has no cluster named {unknown}")), "{}", run.dump());

    let left = states(&other.aws, &theirs).await;
    assert_eq!(left.len(), 3, "{left:?}");
    assert!(left.values().all(|s| *s == InstanceState::Running), "the other cluster's instances: {left:?}");
    empty.server.shutdown().await;
    other.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reclaim_never_terminates_under_a_live_cluster_and_finishes_once_it_is_gone() {
    let spec = small_world("e2e-id-verify", 3);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let ours = world.karpenter_instance_ids();
    let keep: Vec<String> = world.managed_instance_ids().into_iter().chain(world.decoy_instances.clone()).collect();
    assert_eq!(ours.len(), 3);
    assert!(!keep.is_empty(), "the world has managed and decoy instances");

    // EKS says the cluster runs, and its API (proven by EKS's endpoint) has a Node on each
    let refused = verify_reclaim(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(refused.code, 3, "{}", refused.dump());
    assert!(refused.stderr.contains("karpenter-teardown run"), "says what to use instead: {}", refused.dump());
    for id in &ours {
        assert!(refused.stderr.contains(id), "names {id}: {}", refused.dump());
    }
    let dry = verify_reclaim(&b, &world.cluster, &[]).await;
    assert_eq!(dry.code, 3, "a dry run predicts the refusal: {}", dry.dump());
    let after = states(&b.aws, &ours).await;
    assert_eq!(after.len(), 3);
    assert!(after.values().all(|s| *s == InstanceState::Running), "{after:?}");

    // once EKS no longer knows the cluster, nothing can run on its instances: they may go, as
    // many as --max-nodes allows
    b.cloud.deregister_eks_cluster(&world.cluster).await.unwrap();
    let too_many = verify_reclaim(&b, &world.cluster, &["--yes", "--max-nodes", "2"]).await;
    assert_eq!(too_many.code, 3, "{}", too_many.dump());
    assert!(too_many.stderr.contains("more than --max-nodes 2"), "{}", too_many.dump());
    assert!(states(&b.aws, &ours).await.values().all(|s| *s == InstanceState::Running));
    // `sweep`'s verdict holds for the named cluster too: a protected resource, or one younger
    // than --min-age, keeps everything of it
    let keep_tag = std::collections::BTreeMap::from([("karpenter-teardown.io/keep".to_string(), String::new())]);
    b.cloud.tag_instance(&ours[0], &keep_tag).await.unwrap();
    let protected = verify_reclaim(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(protected.code, 3, "{}", protected.dump());
    assert!(
        protected.stderr.contains("is protected") && protected.stderr.contains(ours[0].as_str()),
        "{}",
        protected.dump()
    );
    let ec2 = aws_sdk_ec2::Client::new(&sandbox_sim::localstack::config_as(REGION, "test").await);
    let untag = aws_sdk_ec2::types::Tag::builder().key("karpenter-teardown.io/keep").build();
    ec2.delete_tags().resources(&ours[0]).tags(untag).send().await.unwrap();
    let young = verify_reclaim(&b, &world.cluster, &["--yes", "--min-age", "1h"]).await;
    assert_eq!(young.code, 3, "{}", young.dump());
    assert!(young.stderr.contains("is too-young") && young.stderr.contains("--min-age 1h"), "{}", young.dump());
    assert!(states(&b.aws, &ours).await.values().all(|s| *s == InstanceState::Running));
    let reclaimed = verify_reclaim(&b, &world.cluster, &["--yes"]).await;
    assert_eq!(reclaimed.code, 0, "{}", reclaimed.dump());
    let gone = states(&b.aws, &ours).await;
    assert_eq!(gone.len(), 3);
    assert!(gone.values().all(|s| *s == InstanceState::Terminated), "{gone:?}");
    let kept = states(&b.aws, &keep).await;
    assert_eq!(kept.len(), keep.len());
    assert!(kept.values().all(|s| *s == InstanceState::Running), "managed and decoy instances: {kept:?}");
    b.server.shutdown().await;
}

/// Makes `n`'s claim name no instance and no node, and removes its Node: a machine whose claim
/// never learnt its instance. Returns the NodeClaims.
async fn forget_instance(b: &Bed, n: &sandbox_sim::world::GeneratedNode) -> Api<DynamicObject> {
    let claims: Api<DynamicObject> = Api::all_with(b.client.clone(), &k8s::nodeclaim_resource());
    let unset = json!({"status": {"providerID": null, "nodeName": null}});
    claims.patch_status(&n.nodeclaim, &PatchParams::default(), &Patch::Merge(&unset)).await.unwrap();
    let nodes: Api<Node> = Api::all(b.client.clone());
    nodes
        .patch(&n.node, &PatchParams::default(), &Patch::Merge(json!({"metadata": {"finalizers": null}})))
        .await
        .unwrap();
    nodes.delete(&n.node, &Default::default()).await.unwrap();
    claims
}

/// A launch in flight when the controller went: `n`'s claim made to name no instance and no
/// node, its instance ended, and `count` instances launched since with the launch's tags only
/// (Karpenter's tagging controller names the claim later). The claims' API and the new ids.
async fn in_flight_launch(
    b: &Bed,
    world: &sandbox_sim::World,
    n: &sandbox_sim::world::GeneratedNode,
    count: i32,
) -> (Api<DynamicObject>, Vec<String>) {
    let claims = forget_instance(b, n).await;
    b.cloud.terminate(std::slice::from_ref(&n.instance_id)).await.unwrap();
    // launched since the claim was made (EC2 and the API server count whole seconds)
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let tags = sandbox_sim::naming::launch_tags(&world.cluster, &n.pool, &n.class);
    let launched = b.cloud.launch_tagged(sandbox_sim::naming::IMAGE_ID, "m5.large", None, count, &tags).await.unwrap();
    let ids: Vec<String> = launched.into_iter().map(|i| i.id).collect();
    assert_eq!(ids.len(), count as usize);
    (claims, ids)
}

/// [`in_flight_launch`] of one instance that every `DescribeInstances` through the EC2 proxy
/// misses until the claim is `shows_at` seconds old; at least 15 s of that are still to come.
async fn launch_shown_late(
    b: &Bed,
    world: &sandbox_sim::World,
    n: &sandbox_sim::world::GeneratedNode,
    shows_at: i64,
) -> (Api<DynamicObject>, Vec<String>) {
    let (claims, late) = in_flight_launch(b, world, n, 1).await;
    let claim = claims.get(&n.nodeclaim).await.unwrap();
    let created = claim.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second()).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let hidden_for = created + shows_at - now;
    assert!(hidden_for > 15, "the world took {} s to make", now - created);
    crate::common::ec2_proxy_control().hide_instances(&late, std::time::Duration::from_secs(hidden_for as u64));
    (claims, late)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodeclaim_that_names_no_instance_is_released_only_after_the_instance_tagged_for_it() {
    let spec = small_world("e2e-ev-claimtag", 3);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    // a claim that names no instance and no node, whose instance carries the claim's tag (written
    // by Karpenter's tagging controller once the claim had named it)
    let n = &world.nodes[0];
    let claims = forget_instance(&b, n).await;
    let claim = claims.get(&n.nodeclaim).await.unwrap();
    assert!(claim.data.pointer("/status/providerID").is_none_or(serde_json::Value::is_null), "{claim:?}");

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let steps = run.report["steps"].as_array().unwrap();
    let released: Vec<&str> = steps
        .iter()
        .filter(|s| s["object"] == n.nodeclaim.as_str() && s["action"] == "discharge-finalizers")
        .filter_map(|s| s["detail"].as_str())
        .collect();
    assert_eq!(released.len(), 1, "{}", run.dump());
    assert!(released[0].contains(&format!("instance {} terminated", n.instance_id)), "{released:?}");
    let states = states(&b.aws, &world.karpenter_instance_ids()).await;
    assert_eq!(states.len(), 3);
    assert!(states.values().all(|s| *s == InstanceState::Terminated), "{states:?}");
    b.server.shutdown().await;
}

/// A launch in flight when the controller went: the claim names no instance, and its instance
/// carries only the launch's tags (Karpenter's tagging controller names the claim later). The
/// instance launched for the claim's pool and class since it was made, that no Node or claim
/// names, is its; two such are refused (which is its cannot be told) and left running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodeclaim_whose_launch_was_in_flight_is_released_only_after_the_instance_launched_for_it() {
    let spec = small_world("e2e-ev-inflight", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let n = &world.nodes[0];
    let (claims, twins) = in_flight_launch(&b, &world, n, 2).await;

    // two fit: the claim keeps its finalizer and both instances run
    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_ne!(run.code, 0, "{}", run.dump());
    let discharged = |run: &Run| -> Vec<(String, String)> {
        run.report["steps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["object"] == n.nodeclaim.as_str() && s["action"] == "discharge-finalizers")
            .map(|s| (s["result"].as_str().unwrap().to_string(), s["detail"].as_str().unwrap().to_string()))
            .collect()
    };
    let first = discharged(&run);
    assert_eq!(first.len(), 1, "{}", run.dump());
    assert_eq!(first[0].0, "failed", "{first:?}");
    assert!(
        first[0].1.contains("EC2 holds 2 launched for its NodePool and EC2NodeClass")
            && twins.iter().all(|id| first[0].1.contains(id.as_str())),
        "{first:?}"
    );
    let running = states(&b.aws, &twins).await;
    assert_eq!(running.len(), 2);
    assert!(running.values().all(|s| *s == InstanceState::Running), "{running:?}");
    assert!(claims.get_opt(&n.nodeclaim).await.unwrap().is_some(), "the claim was released without its instance");

    // one of them ends: the other is the claim's, terminated before the claim is released
    b.cloud.terminate(&twins[..1]).await.unwrap();
    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let second = discharged(&run);
    assert_eq!(second.len(), 1, "{}", run.dump());
    assert_eq!(second[0].0, "done", "{second:?}");
    assert!(
        second[0].1.contains(&format!("instance {} terminated", twins[1]))
            && second[0].1.contains("found by its launch's tags"),
        "{second:?}"
    );
    assert!(claims.get_opt(&n.nodeclaim).await.unwrap().is_none());
    let ended = states(&b.aws, &twins).await;
    assert_eq!(ended.len(), 2);
    assert!(ended.values().all(|s| *s == InstanceState::Terminated), "{ended:?}");
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_nodes_counts_the_live_instances_ec2_holds_without_a_node() {
    let spec = small_world("e2e-ev-radius", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    // two more machines of this cluster's Karpenter that never joined as Nodes
    let n = &world.nodes[0];
    let mut tags = sandbox_sim::world::expected_instance_tags(&world, n);
    tags.insert(karpenter_teardown::karpenter::TAG_NODECLAIM.into(), "never-joined".into());
    let extra = b.cloud.launch_tagged(sandbox_sim::naming::IMAGE_ID, "m5.large", None, 2, &tags).await.unwrap();
    assert_eq!(extra.len(), 2);

    let run = teardown(&b, &world.cluster, Consent::DryRun, &["--max-nodes", "3"]).await;
    assert_eq!(run.code, 3, "2 nodes and 2 instances without one are 4 machines: {}", run.dump());
    assert!(run.stderr.contains("act on 4 Karpenter machines"), "{}", run.dump());
    let run = teardown(&b, &world.cluster, Consent::DryRun, &["--max-nodes", "4"]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let ids: Vec<String> = extra.into_iter().map(|i| i.id).collect();
    b.cloud.terminate(&ids).await.unwrap();
    b.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_describe_does_not_show_is_not_terminated_until_its_tags_are_read() {
    let spec = small_world("e2e-ev-unseen", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let ids = world.karpenter_instance_ids();
    assert_eq!(ids.len(), 2);
    // EC2's describe lags behind a launch: the first machine's instance is not shown for a while
    let proxy = crate::common::ec2_proxy_control();
    proxy.hide_instances(&ids[..1], std::time::Duration::from_secs(8));

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let unseen: Vec<String> = proxy.terminated_unseen().into_iter().filter(|id| ids.contains(id)).collect();
    assert_eq!(unseen, Vec::<String>::new(), "an instance was sent to TerminateInstances unchecked");
    let states = states(&b.aws, &ids).await;
    assert_eq!(states.len(), 2);
    assert!(states.values().all(|s| *s == InstanceState::Terminated), "terminated once shown: {states:?}");
    b.server.shutdown().await;
}

/// A launch EC2 shows late: the claim names no instance, and EC2's describe does not show the
/// instance launched for it for a while. The claim is looked up only once EC2 has had its time
/// to show a launch (30 s from the claim's creation): the instance is found by its launch's tags,
/// terminated, and only then is the claim released; the run ends clean, nothing left in EC2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_ec2_shows_late_is_found_before_its_claim_is_released() {
    let spec = small_world("e2e-ev-shownlate", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let n = &world.nodes[0];
    // hidden from every DescribeInstances until the claim is 29 s old: a look at the claim
    // before the allowance (30 s) has passed cannot see it
    let (claims, late) = launch_shown_late(&b, &world, n, 29).await;

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 0, "{}", run.dump());
    let released: Vec<(String, String)> = run.report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["object"] == n.nodeclaim.as_str() && s["action"] == "discharge-finalizers")
        .map(|s| (s["result"].as_str().unwrap().to_string(), s["detail"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(released.len(), 1, "{}", run.dump());
    assert_eq!(released[0].0, "done", "{released:?}");
    assert!(
        released[0].1.contains(&format!("instance {} terminated", late[0]))
            && released[0].1.contains("found by its launch's tags"),
        "{released:?}"
    );
    assert!(claims.get_opt(&n.nodeclaim).await.unwrap().is_none(), "the claim was released");
    let ended = states(&b.aws, &late).await;
    assert_eq!(ended.get(&late[0]), Some(&InstanceState::Terminated), "{}", run.dump());
    b.server.shutdown().await;
}

/// A launch EC2 shows later than its allowance: the claim is looked up once 30 s old, nothing
/// shows, and it is released as never launched, its class told so first; the instance shows a
/// little later. The run is SIGKILLed while the class waits for its second look, and the next
/// run, which finds no claim left, still takes it: the class stays, with its launch templates and
/// instance profile (the evidence `verify --reclaim` needs), and the run ends blocked naming the
/// instance, which still runs. Deleted at once, the class took its templates and profile with
/// it, and the run ended clean with the instance running: verification's two reads came before
/// EC2 showed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_ec2_shows_after_its_claim_was_released_keeps_its_class_across_a_kill() {
    use tokio::io::AsyncBufReadExt;
    let spec = small_world("e2e-ev-showntoolate", 2);
    let b = bed(&spec.cluster).await;
    let world = generate(&spec, &b.client, &b.cloud).await.unwrap();
    let n = &world.nodes[0];
    // hidden until the claim is 50 s old: past the claim's lookup (at 31 s), before its class's
    // second look (at 62 s)
    let (claims, late) = launch_shown_late(&b, &world, n, 50).await;

    let inv = crate::common::safety::Invocation { args: vec!["--yes"], ..Default::default() };
    let mut cmd = crate::common::safety::command(&b, "run", &world.cluster, &inv);
    cmd.stderr(std::process::Stdio::piped()).stdout(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let waiting = loop {
        let Some(line) = lines.next_line().await.unwrap() else { break false };
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        seen.push(line);
        if v["message"].as_str().is_some_and(|m| m.contains("released with no instance found")) {
            break true;
        }
    };
    assert!(waiting, "the class never waited for its second look:\n{}", seen.join("\n"));
    child.start_kill().unwrap();
    assert_eq!(child.wait().await.unwrap().code(), None, "killed by the signal");
    assert!(claims.get_opt(&n.nodeclaim).await.unwrap().is_none(), "the claim was released before the kill");

    let run = teardown(&b, &world.cluster, Consent::Yes, &[]).await;
    assert_eq!(run.code, 5, "blocked: {}", run.dump());
    let steps = run.report["steps"].as_array().unwrap();
    let of_class: Vec<&serde_json::Value> =
        steps.iter().filter(|s| s["action"] == "delete-nodeclasses" && s["object"] == n.class.as_str()).collect();
    assert_eq!(of_class.len(), 1, "{}", run.dump());
    assert_eq!(of_class[0]["result"], "blocked", "{}", run.dump());
    let detail = of_class[0]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(&late[0]) && detail.contains(&n.nodeclaim), "{detail}");
    // the class, its launch templates and its instance profile stay; the instance runs
    let classes = Api::<DynamicObject>::all_with(b.client.clone(), &k8s::nodeclass_resource());
    assert!(classes.get_opt(&n.class).await.unwrap().is_some(), "the class was deleted");
    let class = world.node_classes.iter().find(|c| c.name == n.class).unwrap();
    let templates = b.aws.ec2.launch_templates(&world.cluster).await.unwrap();
    assert!(templates.iter().any(|t| t.id == class.launch_template_id), "its launch template was deleted");
    let profiles = b.aws.iam.cluster_instance_profiles(REGION, &world.cluster).await.unwrap();
    assert!(profiles.iter().any(|p| p.name == class.instance_profile), "its instance profile was deleted");
    let ended = states(&b.aws, &late).await;
    assert_eq!(ended.get(&late[0]), Some(&InstanceState::Running), "{}", run.dump());
    b.server.shutdown().await;
}
