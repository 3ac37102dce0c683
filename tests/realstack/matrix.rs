//! The teardown matrix on the full real stack (kube-apiserver, kube-controller-manager,
//! kube-scheduler, kwok) with the real Karpenter provisioning the cluster through LocalStack:
//! the delegate plan, a budget that refuses evictions, a static NodePool, pods that tolerate
//! everything, and a controller that is already gone. Each case starts from pending pods (or a
//! NodePool's replicas) that make the real Karpenter launch its own instances, and each ends with
//! the same checks: every instance Karpenter launched is terminated, its launch templates and
//! instance profile are gone, and nothing outside was touched (another cluster's instance, the
//! node role, the managed node group's node, instance and pods).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aws_sdk_ec2::types::{Filter, InstanceType, ResourceType};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use karpenter_teardown::aws::{AwsClients, InstanceState};
use karpenter_teardown::k8s;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use realstack::RealStack;
use realstack::karpenter::{KarpenterSettings, RealKarpenter};
use sandbox_sim::KarpenterVersion;
use serde_json::{Value, json};

use super::common;
use super::common::e2e::{REGION, count, states};
use super::karpenter::{class_and_pool, infrastructure, node_of, object, phase, spec};

/// How long a case may wait for the real Karpenter to provision, and for a teardown to end.
const PROVISION_DEADLINE: Duration = Duration::from_secs(240);
const TEARDOWN_DEADLINE: Duration = Duration::from_secs(240);

/// Karpenter's log messages that time its provisioning, printed with their times.
const MILESTONES: &[&str] = &[
    "discovered karpenter version",
    "discovered instance types",
    "discovered security groups",
    "found provisionable pod(s)",
    "launched nodeclaim",
    "initialized nodeclaim",
];

/// The label the managed node groups' nodes carry (EKS sets it on every node of a node group).
const NODEGROUP_LABEL: &str = "eks.amazonaws.com/nodegroup";

/// A cluster on the full real stack with Karpenter's CRDs, its network, node role and AMI, an
/// EC2NodeClass and the dynamic NodePool `default`, a managed node group's `system` node (tainted
/// for critical add-ons, running a DNS pod) on an instance of its own, and another cluster's
/// Karpenter instance in the same account.
struct Bed {
    cluster: String,
    s: RealStack,
    admin: kube::Client,
    ec2: aws_sdk_ec2::Client,
    iam: aws_sdk_iam::Client,
    aws: AwsClients,
    ami: String,
    /// The `system` node's instance, of this cluster's managed node group.
    system_instance: String,
    /// An instance of another cluster's Karpenter.
    foreign_instance: String,
    /// The DNS pod on the `system` node.
    dns_pod: String,
}

/// The bed and the real Karpenter, started with `feature_gates` (`FEATURE_GATES`) when given.
async fn bed(prefix: &str, feature_gates: Option<&str>) -> (Bed, RealKarpenter) {
    let cluster = common::unique_cluster(prefix);
    let s = super::control_plane::full_stack(&cluster).await;
    let admin = s.admin_client().await.unwrap();
    let config = sandbox_sim::localstack::config_as(REGION, "test").await;
    let (ec2, iam) = (aws_sdk_ec2::Client::new(&config), aws_sdk_iam::Client::new(&config));
    let aws = common::localstack(REGION).await;
    let crds = common::e2e::real_crds(KarpenterVersion::V1_14);
    sandbox_sim::world::install_crds(&admin, KarpenterVersion::V1_14, Some(&crds)).await.unwrap();
    let ami = infrastructure(&ec2, &iam, &cluster).await;
    // Karpenter takes half a minute to discover the region, the instance types and the class's
    // resources before it provisions: it starts now, while the rest of the cluster is made
    let karpenter = RealKarpenter::start(
        &s,
        KarpenterSettings {
            cluster_name: cluster.clone(),
            region: REGION.into(),
            aws_endpoint: sandbox_sim::localstack::endpoint(),
            ..KarpenterSettings::default()
        },
        ec2.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    if let Some(gates) = feature_gates {
        karpenter.restart_with_env("FEATURE_GATES", gates).unwrap_or_else(|e| panic!("{e}"));
    }

    let system_instance = instance(
        &ec2,
        &ami,
        &[(&format!("kubernetes.io/cluster/{cluster}"), "owned"), ("eks:nodegroup-name", "system")],
    )
    .await;
    // Another cluster's Karpenter node, tagged as Karpenter tags its own (its cluster's name
    // starts with this one's, so a prefix match would take it)
    let other = format!("{cluster}-b");
    let foreign_instance = instance(
        &ec2,
        &ami,
        &[
            (&format!("kubernetes.io/cluster/{other}"), "owned"),
            ("eks:eks-cluster-name", &other),
            ("karpenter.sh/nodepool", "default"),
            ("karpenter.k8s.aws/ec2nodeclass", "default"),
        ],
    )
    .await;
    node(&admin, "system-0", "system", &system_instance, true).await;
    let dns_pod = dns(&admin).await;
    class_and_pool(&admin, &ami, &cluster).await;
    (Bed { cluster, s, admin, ec2, iam, aws, ami, system_instance, foreign_instance, dns_pod }, karpenter)
}

async fn instance(ec2: &aws_sdk_ec2::Client, ami: &str, tags: &[(&str, &str)]) -> String {
    let out = ec2
        .run_instances()
        .image_id(ami)
        .instance_type(InstanceType::M5Large)
        .min_count(1)
        .max_count(1)
        .tag_specifications(spec(ResourceType::Instance, tags))
        .send()
        .await
        .unwrap();
    out.instances()[0].instance_id().unwrap().to_string()
}

/// A managed node group's Node on `instance`, which kwok makes Ready; `critical` taints it for
/// critical add-ons only, as EKS's guidance for the node group that runs Karpenter has it.
async fn node(admin: &kube::Client, name: &str, group: &str, instance: &str, critical: bool) {
    let resources = json!({"cpu": "4", "memory": "16Gi", "pods": "29"});
    let taints = if critical {
        json!([{"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}])
    } else {
        json!([])
    };
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {NODEGROUP_LABEL: group,
            "kubernetes.io/hostname": name, "topology.kubernetes.io/zone": "us-west-2a"}},
        "spec": {"providerID": format!("aws:///us-west-2a/{instance}"), "taints": taints},
        "status": {"allocatable": resources, "capacity": resources},
    }))
    .unwrap();
    Api::<Node>::all(admin.clone()).create(&PostParams::default(), &node).await.unwrap();
}

/// A DNS pod on the `system` node, which the teardown must leave running; returns its name.
async fn dns(admin: &kube::Client) -> String {
    let labels = json!({"k8s-app": "kube-dns"});
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "coredns"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"nodeSelector": {NODEGROUP_LABEL: "system"},
                "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                "containers": [{"name": "coredns", "image": "registry.k8s.io/coredns/coredns:v1.11.3",
                    "resources": {"requests": {"cpu": "100m"}}}]}}},
    }))
    .unwrap();
    Api::<Deployment>::namespaced(admin.clone(), "kube-system").create(&PostParams::default(), &d).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "kube-system");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = pods.list(&ListParams::default().labels("k8s-app=kube-dns")).await.unwrap();
        if let Some(p) = list.items.iter().find(|p| phase(p) == "Running" && node_of(p) == Some("system-0")) {
            return p.metadata.name.clone().unwrap();
        }
        assert!(Instant::now() < deadline, "the DNS pod did not run on the system node");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

impl Bed {
    /// A namespace and a Deployment of `replicas` pods each asking for `cpu` (`1` takes an
    /// m5.large's room, so each such pod gets a node of its own), with `extra` merged into the
    /// pod spec.
    async fn workload(&self, ns: &str, replicas: usize, cpu: &str, extra: Value) {
        let pp = PostParams::default();
        let namespaces: Api<Namespace> = Api::all(self.admin.clone());
        if namespaces.get_opt(ns).await.unwrap().is_none() {
            namespaces.create(&pp, &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap()).await.unwrap();
        }
        let labels = json!({"app": ns});
        let mut pod_spec = json!({"terminationGracePeriodSeconds": 1,
            "containers": [{"name": ns, "image": "registry.k8s.io/pause:3.10", "resources": {"requests": {"cpu": cpu}}}]});
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            pod_spec[k] = v;
        }
        let d: Deployment = serde_json::from_value(json!({"metadata": {"name": ns}, "spec": {"replicas": replicas,
            "selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}))
        .unwrap();
        Api::<Deployment>::namespaced(self.admin.clone(), ns).create(&pp, &d).await.unwrap();
    }

    /// A PodDisruptionBudget over the namespace's workload.
    async fn budget(&self, ns: &str, max_unavailable: usize) -> Api<PodDisruptionBudget> {
        let pdbs: Api<PodDisruptionBudget> = Api::namespaced(self.admin.clone(), ns);
        let pdb = json!({"metadata": {"name": ns},
            "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": {"app": ns}}}});
        pdbs.create(&PostParams::default(), &serde_json::from_value(pdb).unwrap()).await.unwrap();
        pdbs
    }

    /// Waits until Karpenter's NodeClaims have at least `claims` instances whose Nodes are Ready
    /// and, for each `(namespace, pods)`, that many of the namespace's pods run on Karpenter's
    /// nodes; returns the instances.
    async fn provisioned(&self, karpenter: &RealKarpenter, claims: usize, workloads: &[(&str, usize)]) -> Vec<String> {
        let claim_api: Api<DynamicObject> = Api::all_with(self.admin.clone(), &k8s::nodeclaim_resource());
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let deadline = Instant::now() + PROVISION_DEADLINE;
        let t = Instant::now();
        loop {
            let Some(ids) = super::karpenter::claimed_instances(&claim_api, deadline).await else {
                continue;
            };
            let ready: Vec<String> = nodes
                .list(&ListParams::default().labels("karpenter.sh/nodepool"))
                .await
                .unwrap()
                .items
                .into_iter()
                .filter(|n| {
                    let conditions = n.status.as_ref().and_then(|s| s.conditions.as_ref());
                    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .filter_map(|n| n.metadata.name)
                .collect();
            let mut running = Vec::new();
            for (ns, _) in workloads {
                let pods: Api<Pod> = Api::namespaced(self.admin.clone(), ns);
                let list = pods.list(&ListParams::default()).await.unwrap();
                running.push(
                    list.items
                        .iter()
                        .filter(|p| phase(p) == "Running" && node_of(p).is_some_and(|n| ready.iter().any(|k| k == n)))
                        .count(),
                );
            }
            let placed = workloads.iter().zip(&running).all(|((_, want), got)| got == want);
            if ids.len() >= claims && ready.len() >= claims && placed {
                eprintln!("the real Karpenter provisioned {} node(s) in {:?}", ids.len(), t.elapsed());
                for line in karpenter.log().lines().filter(|l| MILESTONES.iter().any(|m| l.contains(m))) {
                    let v: Value = serde_json::from_str(line).unwrap_or_default();
                    eprintln!("  {} {}", v["time"].as_str().unwrap_or("?"), v["message"].as_str().unwrap_or(line));
                }
                return ids;
            }
            assert!(
                Instant::now() < deadline,
                "{} claims with instances, Ready nodes {ready:?}, running {running:?} of {workloads:?}; Karpenter's log:\n{}\nkube-scheduler:\n{}",
                ids.len(),
                karpenter.log_tail(40),
                self.s.log_tail("kube-scheduler"),
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until the controller's own pod runs on the system node, as its Helm chart places it.
    async fn controller_on_system_node(&self) {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), realstack::karpenter::NAMESPACE);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let list = pods.list(&ListParams::default().labels("app.kubernetes.io/name=karpenter")).await.unwrap();
            let placed: Vec<(&str, Option<&str>)> = list.items.iter().map(|p| (phase(p), node_of(p))).collect();
            if placed == [("Running", Some("system-0"))] {
                return;
            }
            assert!(Instant::now() < deadline, "the controller's pod: {placed:?}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until the namespace's budget counts `healthy` pods and allows `allowed` disruptions.
    async fn budget_computed(pdbs: &Api<PodDisruptionBudget>, name: &str, healthy: i32, allowed: i32) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let status = pdbs.get(name).await.unwrap().status.unwrap_or_default();
            if status.current_healthy == healthy && status.disruptions_allowed == allowed {
                return;
            }
            assert!(Instant::now() < deadline, "the budget was not computed: {status:?}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The tool's run, as its identity, ending within [`TEARDOWN_DEADLINE`].
    async fn teardown(&self, args: &[&str], karpenter: &RealKarpenter) -> common::e2e::Run {
        let run = tokio::time::timeout(TEARDOWN_DEADLINE, super::teardown_with(&self.s, &self.cluster, args))
            .await
            .unwrap_or_else(|_| panic!("the teardown did not end within {TEARDOWN_DEADLINE:?}"));
        assert_eq!(run.code, 0, "{}\nKarpenter:\n{}", run.dump(), karpenter.log_tail(40));
        assert_eq!(run.report["outcome"], "clean", "{}", run.dump());
        run
    }

    /// The instances of this cluster's Karpenter in EC2, by their tags, with their states.
    async fn karpenters_instances(&self) -> BTreeMap<String, Option<String>> {
        let out = self
            .ec2
            .describe_instances()
            .filters(Filter::builder().name("tag:eks:eks-cluster-name").values(&self.cluster).build())
            .filters(Filter::builder().name("tag-key").values("karpenter.sh/nodepool").build())
            .send()
            .await
            .unwrap();
        out.reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter_map(|i| {
                let state = i.state().and_then(|s| s.name()).map(|n| n.as_str().to_string());
                Some((i.instance_id()?.to_string(), state))
            })
            .collect()
    }

    /// The checks every case ends with: `launched` (and every other instance of this cluster's
    /// Karpenter) terminated, no launch template or instance profile left, no Karpenter object or
    /// node left, and the other cluster's instance, the node role, the system node, its instance
    /// and its DNS pod as they were.
    async fn assert_torn_down(&self, launched: &[String], karpenter: &RealKarpenter) {
        assert!(!launched.is_empty());
        let ours = states(&self.aws, launched).await;
        assert!(ours.values().all(|s| *s == InstanceState::Terminated), "Karpenter's instances: {ours:?}");
        let tagged = self.karpenters_instances().await;
        assert!(launched.iter().all(|i| tagged.contains_key(i)), "{launched:?} not all found by tag in {tagged:?}");
        assert!(tagged.values().all(|s| s.as_deref() == Some("terminated")), "by tag: {tagged:?}");
        let others = [self.system_instance.clone(), self.foreign_instance.clone()];
        let others = states(&self.aws, &others).await;
        assert!(others.values().all(|s| *s == InstanceState::Running), "the instances not Karpenter's: {others:?}");
        assert!(self.aws.ec2.launch_templates(&self.cluster).await.unwrap().is_empty(), "launch templates left");
        let profiles = self.aws.iam.cluster_instance_profiles(REGION, &self.cluster).await.unwrap();
        assert!(profiles.is_empty(), "instance profiles left: {profiles:?}");
        // the node role is the cluster's, not Karpenter's
        self.iam.get_role().role_name(format!("{}-node", self.cluster)).send().await.unwrap();
        assert_eq!(count(&self.admin, &k8s::nodeclaim_resource()).await, 0, "NodeClaims left");
        assert_eq!(count(&self.admin, &k8s::nodepool_resource()).await, 0, "NodePools left");
        assert_eq!(count(&self.admin, &k8s::nodeclass_resource()).await, 0, "EC2NodeClasses left");
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let left = nodes.list(&ListParams::default().labels("karpenter.sh/nodepool")).await.unwrap();
        assert!(
            left.items.is_empty(),
            "Karpenter nodes left: {:?}",
            left.items.iter().map(|n| &n.metadata.name).collect::<Vec<_>>()
        );
        let system = nodes.get("system-0").await.unwrap();
        untouched(&system);
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), "kube-system");
        let dns = pods.get(&self.dns_pod).await.unwrap();
        assert!(dns.metadata.deletion_timestamp.is_none() && phase(&dns) == "Running", "the DNS pod: {:?}", dns.status);
        assert!(!karpenter.running(), "Karpenter still runs after the teardown");
        let controller = pods.list(&ListParams::default().labels("app.kubernetes.io/name=karpenter")).await.unwrap();
        assert!(controller.items.is_empty(), "the controller's pod is still there");
    }

    async fn cleanup(self, karpenter: RealKarpenter) {
        drop(karpenter);
        let ids = [self.system_instance.clone(), self.foreign_instance.clone()];
        self.ec2.terminate_instances().set_instance_ids(Some(ids.to_vec())).send().await.unwrap();
    }
}

/// A node the tool must not touch: not cordoned, none of the tool's or Karpenter's taints.
fn untouched(node: &Node) {
    let spec = node.spec.clone().unwrap_or_default();
    assert_ne!(spec.unschedulable, Some(true), "{:?} was cordoned", node.metadata.name);
    let taints: Vec<String> = spec.taints.unwrap_or_default().into_iter().map(|t| t.key).collect();
    assert!(
        taints.iter().all(|k| k == "CriticalAddonsOnly"),
        "{:?} carries taints it was not given: {taints:?}",
        node.metadata.name
    );
}

/// Evictions the API server refused with 429 so far, by its own count
/// (`apiserver_request_total` of the `eviction` subresource).
async fn refused_evictions(admin: &kube::Client) -> u64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = admin.request_text(req).await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("subresource=\"eviction\"")
                && l.contains("code=\"429\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn blockers<'a>(run: &'a common::e2e::Run, kind: &str) -> Vec<&'a str> {
    run.report["blockers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["kind"] == kind)
        .filter_map(|b| b["name"].as_str())
        .collect()
}

fn step_details<'a>(run: &'a common::e2e::Run, step: &str) -> Vec<(&'a str, &'a str)> {
    run.report["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["step"] == step)
        .map(|s| (s["result"].as_str().unwrap_or(""), s["detail"].as_str().unwrap_or("")))
        .collect()
}

fn api_calls(run: &common::e2e::Run, key: &str) -> u64 {
    run.report["api_calls"][key].as_u64().unwrap_or(0)
}

/// The delegate plan: the tool deletes the NodePools and the real Karpenter's own termination
/// controller drains its nodes and terminates their instances; the tool only waits, then finds
/// nothing left to do but remove the controller and the classes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_the_delegate_plan_leaves_draining_and_terminating_to_the_real_karpenter() {
    let t = Instant::now();
    let (b, karpenter) = bed("mx-dlg", None).await;
    b.workload("web", 2, "1", json!({})).await;
    let pdbs = b.budget("web", 2).await;
    let launched = b.provisioned(&karpenter, 2, &[("web", 2)]).await;
    b.controller_on_system_node().await;
    Bed::budget_computed(&pdbs, "web", 2, 2).await;

    let run = b.teardown(&["--plan", "delegate"], &karpenter).await;
    // Karpenter, not the tool, drained and terminated: the wait saw every NodeClaim go, and the
    // tool neither evicted a pod nor asked EC2 to terminate anything
    let waited = step_details(&run, "wait-nodeclaims-gone");
    assert!(
        matches!(waited.as_slice(), [("done", d)] if d.starts_with("Karpenter removed every NodeClaim")),
        "{waited:?}\n{}",
        run.dump()
    );
    let discharged = step_details(&run, "discharge-finalizers");
    assert_eq!(discharged.len(), launched.len(), "{discharged:?}");
    assert!(discharged.iter().all(|d| *d == ("skipped", "already gone")), "{discharged:?}\n{}", run.dump());
    // `ec2:TerminateInstances` counts the preflight's DryRun of the permission check too
    assert!(api_calls(&run, "ec2:TerminateInstances") <= 1, "{}", run.report["api_calls"]);
    assert_eq!(api_calls(&run, "kubernetes:evict"), 0, "{}", run.report["api_calls"]);
    assert!(karpenter.log().contains("deleted nodeclaim"), "{}", karpenter.log_tail(40));
    b.assert_torn_down(&launched, &karpenter).await;
    eprintln!("case took {:?}", t.elapsed());
    b.cleanup(karpenter).await;
}

/// A budget that allows one disruption, on a workload of three replicas on Karpenter's nodes,
/// with the real disruption controller computing it: the tool's first eviction is granted, and
/// the evicted pod's replacement has nowhere to run, so the budget allows nothing. The tool waits
/// on the budget's status and, once it has been silent for the drain's probe interval, asks
/// anyway (src/engine/budgets.rs): the API server refuses that eviction with a 429, its answer
/// while a PodDisruptionBudget allows no disruption (kubernetes.io, API-initiated Eviction).
/// Only then does the cluster get capacity outside Karpenter (a managed node group scales up for
/// the pending pod, as the Cluster Autoscaler would make it); the replacement runs there, the
/// budget allows the next eviction, and the run ends clean with the workload whole on the node
/// group's node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_a_budget_refuses_evictions_until_the_replacement_runs_outside_karpenter() {
    const REPLICAS: usize = 3;
    let t = Instant::now();
    let (b, karpenter) = bed("mx-pdb", None).await;
    b.workload("web", REPLICAS, "1", json!({})).await;
    let pdbs = b.budget("web", 1).await;
    let launched = b.provisioned(&karpenter, REPLICAS, &[("web", REPLICAS)]).await;
    b.controller_on_system_node().await;
    Bed::budget_computed(&pdbs, "web", REPLICAS as i32, 1).await;

    let refused_before = refused_evictions(&b.admin).await;
    let general_instance = instance(
        &b.ec2,
        &b.ami,
        &[(&format!("kubernetes.io/cluster/{}", b.cluster), "owned"), ("eks:nodegroup-name", "general")],
    )
    .await;
    let scale_up = async {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let refused = refused_evictions(&b.admin).await - refused_before;
            if refused > 0 {
                node(&b.admin, "general-0", "general", &general_instance, false).await;
                return refused;
            }
            assert!(Instant::now() < deadline, "the API server refused no eviction while the budget allowed none");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let (run, refused_first) = tokio::join!(b.teardown(&[], &karpenter), scale_up);
    let refused = refused_evictions(&b.admin).await - refused_before;
    let requests = api_calls(&run, "kubernetes:evict");
    eprintln!(
        "{requests} eviction request(s), {refused} refused by the API server ({refused_first} before the scale-up)"
    );
    assert!(refused >= 1);
    // every granted eviction was one the budget allowed: one per replica
    assert_eq!(requests - refused, REPLICAS as u64, "{}", run.dump());

    // the workload is whole again, on the node group's node, which the tool left alone
    let pods: Api<Pod> = Api::namespaced(b.admin.clone(), "web");
    // kube-scheduler's backoff (up to 10 s) and kwok's start, on a loaded machine
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let list = pods.list(&ListParams::default()).await.unwrap();
        let placed: Vec<(&str, Option<&str>)> = list.items.iter().map(|p| (phase(p), node_of(p))).collect();
        if placed.len() == REPLICAS && placed.iter().all(|p| *p == ("Running", Some("general-0"))) {
            break;
        }
        assert!(Instant::now() < deadline, "the workload after the teardown: {placed:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    untouched(&Api::<Node>::all(b.admin.clone()).get("general-0").await.unwrap());
    let general = states(&b.aws, std::slice::from_ref(&general_instance)).await;
    assert_eq!(general[&general_instance], InstanceState::Running, "the node group's instance");
    b.assert_torn_down(&launched, &karpenter).await;
    eprintln!("case took {:?}", t.elapsed());
    b.ec2.terminate_instances().instance_ids(&general_instance).send().await.unwrap();
    b.cleanup(karpenter).await;
}

/// A static NodePool (`spec.replicas`, alpha in Karpenter v1.14 behind the `StaticCapacity`
/// feature gate, off by default: sigs.k8s.io/karpenter pkg/operator/options/options.go): the real
/// Karpenter launches its nodes with no pod asking for them, and the tool's fence (`limits.nodes`
/// at zero, the only limit the CRD's CEL rules allow on a static pool) keeps it from replacing
/// them while the tool tears them down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_a_static_node_pool_is_torn_down_without_replacements() {
    const REPLICAS: usize = 2;
    let t = Instant::now();
    let (b, karpenter) = bed("mx-static", Some("StaticCapacity=true")).await;
    let pools: Api<DynamicObject> = Api::all_with(b.admin.clone(), &k8s::nodepool_resource());
    pools
        .create(
            &PostParams::default(),
            &object(json!({
                "apiVersion": "karpenter.sh/v1", "kind": "NodePool",
                "metadata": {"name": "static"},
                "spec": {
                    "replicas": REPLICAS,
                    "limits": {"nodes": "4"},
                    "template": {"spec": {
                        "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                        "requirements": [
                            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["m5.large"]},
                            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                        ],
                    }},
                    // as for `default`: LocalStack leaves the instances without the template's
                    // security groups, which Karpenter would see as drift
                    "disruption": {"consolidateAfter": "Never", "budgets": [{"nodes": "0"}]},
                },
            })),
        )
        .await
        .unwrap();
    let launched = b.provisioned(&karpenter, REPLICAS, &[]).await;
    assert!(karpenter.log().contains("provisioning nodeclaims to satisfy replica count"), "{}", karpenter.log_tail(40));
    b.controller_on_system_node().await;

    b.teardown(&[], &karpenter).await;
    // the fence held: Karpenter launched nothing besides the pool's replicas
    let tagged = b.karpenters_instances().await;
    assert_eq!(tagged.len(), REPLICAS, "{tagged:?}");
    b.assert_torn_down(&launched, &karpenter).await;
    eprintln!("case took {:?}", t.elapsed());
    b.cleanup(karpenter).await;
}

/// Pods that tolerate every taint (`operator: Exists`, as log shippers and node agents are
/// deployed) come back to a cordoned, tainted node as soon as they are evicted: the tool does not
/// evict them, names them as going with their node, and the run ends clean, as the sandbox's
/// `pods_tolerating_everything_go_with_their_node` holds it to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_pods_tolerating_everything_go_with_the_real_karpenters_nodes() {
    let t = Instant::now();
    let (b, karpenter) = bed("mx-tol", None).await;
    b.workload("web", 2, "1", json!({})).await;
    b.budget("web", 2).await;
    let on_karpenter = json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}});
    b.workload(
        "shipper",
        2,
        "100m",
        json!({"tolerations": [{"operator": "Exists"}], "affinity": {"nodeAffinity": on_karpenter}}),
    )
    .await;
    let launched = b.provisioned(&karpenter, 2, &[("web", 2), ("shipper", 2)]).await;
    b.controller_on_system_node().await;

    let run = b.teardown(&[], &karpenter).await;
    let named = blockers(&run, "pod-goes-with-node");
    assert_eq!(named.iter().filter(|n| n.starts_with("shipper/shipper-")).count(), 2, "{}", run.dump());
    assert!(!named.iter().any(|n| n.starts_with("web/")), "{}", run.dump());
    assert!(run.stdout.contains("went with its node: pod shipper/shipper-"), "{}", run.dump());
    assert!(!run.stdout.contains("blocked by"), "a pod that went with its node blocked nothing:\n{}", run.dump());
    b.assert_torn_down(&launched, &karpenter).await;
    eprintln!("case took {:?}", t.elapsed());
    b.cleanup(karpenter).await;
}

/// The controller already gone, as a half-done `helm uninstall` leaves a cluster: its Deployment
/// and pod deleted and the process killed after it provisioned, its NodeClaims, Nodes and
/// instances still there with Karpenter's finalizers. The tool terminates the instances itself,
/// confirms through EC2 and discharges the finalizers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_the_tool_finishes_what_a_real_karpenter_that_is_already_gone_left() {
    let t = Instant::now();
    let (b, karpenter) = bed("mx-gone", None).await;
    b.workload("web", 2, "1", json!({})).await;
    b.budget("web", 2).await;
    let launched = b.provisioned(&karpenter, 2, &[("web", 2)]).await;
    b.controller_on_system_node().await;

    let deployments: Api<Deployment> = Api::namespaced(b.admin.clone(), realstack::karpenter::NAMESPACE);
    deployments.delete(realstack::karpenter::NAME, &DeleteParams::default()).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(b.admin.clone(), realstack::karpenter::NAMESPACE);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = pods.list(&ListParams::default().labels("app.kubernetes.io/name=karpenter")).await.unwrap();
        if !karpenter.running() && left.items.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the controller is not gone: {} pod(s)", left.items.len());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let claims: Api<DynamicObject> = Api::all_with(b.admin.clone(), &k8s::nodeclaim_resource());
    assert_eq!(claims.list(&ListParams::default()).await.unwrap().items.len(), launched.len());

    let run = b.teardown(&[], &karpenter).await;
    // Each machine's Node was drained, although a controller killed this early may have lifted a
    // Node's unregistered taint without naming it in its NodeClaim's status yet
    let drained = step_details(&run, "drain");
    assert_eq!(drained.len(), launched.len(), "{drained:?}");
    assert!(drained.iter().all(|(r, _)| *r == "done"), "{drained:?}\n{}", run.dump());
    // and the tool, not Karpenter, terminated each instance and released its Node and NodeClaim
    let discharged = step_details(&run, "discharge-finalizers");
    assert_eq!(discharged.len(), launched.len(), "{discharged:?}");
    for id in &launched {
        let done = format!("instance {id} terminated; Node ");
        assert!(discharged.iter().any(|(r, d)| *r == "done" && d.contains(&done)), "{id}: {discharged:?}");
    }
    assert_eq!(karpenter.starts(), 1, "the controller came back");
    b.assert_torn_down(&launched, &karpenter).await;
    eprintln!("case took {:?}", t.elapsed());
    b.cleanup(karpenter).await;
}

/// The controller gone before it registered its nodes, as when it is uninstalled in the minute
/// between an instance's launch and its kubelet joining: the NodeClaims have instances but name
/// no Node, and the Nodes still carry `karpenter.sh/unregistered`, which pods that tolerate
/// everything do not keep off. An admission policy refuses Karpenter's writes to Nodes so that
/// its registration cannot win the race against its removal. The tool finds each Node by its
/// claim's instance, fences and drains it (its pods go with it), and releases it: clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_nodes_the_real_karpenter_never_registered_are_drained_and_released() {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    let t = Instant::now();
    let (b, karpenter) = bed("mx-unreg", None).await;
    let pp = PostParams::default();
    let karpenter_user =
        format!("system:serviceaccount:{}:{}", realstack::karpenter::NAMESPACE, realstack::karpenter::NAME);
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": "no-registration"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["UPDATE"], "resources": ["nodes"]}]},
            "validations": [{"expression": format!("request.userInfo.username != '{karpenter_user}'"),
                "message": "Karpenter may not register nodes in this test"}],
        },
    }))
    .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(b.admin.clone()).create(&pp, &policy).await.unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": "no-registration"},
        "spec": {"policyName": "no-registration", "validationActions": ["Deny"]},
    }))
    .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(b.admin.clone()).create(&pp, &binding).await.unwrap();

    let on_karpenter = json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "karpenter.sh/nodepool", "operator": "Exists"}]}]}});
    b.workload(
        "agent",
        2,
        "1",
        json!({"tolerations": [{"operator": "Exists"}], "affinity": {"nodeAffinity": on_karpenter}}),
    )
    .await;
    let launched = b.provisioned(&karpenter, 2, &[("agent", 2)]).await;
    let claims: Api<DynamicObject> = Api::all_with(b.admin.clone(), &k8s::nodeclaim_resource());
    let list = claims.list(&ListParams::default()).await.unwrap();
    assert!(list.items.iter().all(|c| c.data["status"]["nodeName"].is_null()), "a NodeClaim was registered");

    let deployments: Api<Deployment> = Api::namespaced(b.admin.clone(), realstack::karpenter::NAMESPACE);
    deployments.delete(realstack::karpenter::NAME, &DeleteParams::default()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while karpenter.running() {
        assert!(Instant::now() < deadline, "the controller is still running");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let run = b.teardown(&[], &karpenter).await;
    let drained = step_details(&run, "drain");
    assert_eq!(drained.len(), launched.len(), "{drained:?}");
    assert!(drained.iter().all(|(r, _)| *r == "done"), "{drained:?}\n{}", run.dump());
    let named = blockers(&run, "pod-goes-with-node");
    assert_eq!(named.iter().filter(|n| n.starts_with("agent/agent-")).count(), 2, "{}", run.dump());
    b.assert_torn_down(&launched, &karpenter).await;
    eprintln!("case took {:?}", t.elapsed());
    b.cleanup(karpenter).await;
}
