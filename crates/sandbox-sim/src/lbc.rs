//! A stand-in for the AWS Load Balancer Controller's Service reconciler
//! (kubernetes-sigs/aws-load-balancer-controller, `controllers/service/service_controller.go`),
//! which the Go module proxy does not serve: what the teardown relies on, made as the real one
//! makes it, against LocalStack's ELBv2 and EC2.
//!
//! - A Service of type LoadBalancer gets the finalizer `service.k8s.aws/resources`
//!   (`serviceFinalizer`) before anything is made in AWS; then a network load balancer, a target
//!   group and the load balancer's managed security group, each tagged `elbv2.k8s.aws/cluster=<
//!   cluster>` (`pkg/deploy/tracking/provider.go`: the cluster is the tag's value),
//!   `service.k8s.aws/stack=<namespace>/<name>` and `service.k8s.aws/resource` (`LoadBalancer`,
//!   the port, `ManagedLBSecurityGroup`).
//! - A deleted Service: when its `service.beta.kubernetes.io/aws-load-balancer-attributes`
//!   annotation turns deletion protection on, the controller refuses and keeps its finalizer
//!   ("deletion_protection is enabled, cannot delete the service"); otherwise it switches off a
//!   protection set on the load balancer alone (`load_balancer_synthesizer.go`), deletes the load
//!   balancer, the target group and the security group, and only then removes its finalizer.
//! - It acts only while one of its pods (`app.kubernetes.io/name=aws-load-balancer-controller`)
//!   runs on a node that is there: evicted with its node's drain, it does nothing more, and every
//!   Service it holds stays held, as on EKS.
//!
//! Ingresses, Gateways, TargetGroupBindings and the shared backend security group are not played.

use std::collections::BTreeMap;
use std::time::Duration;

use aws_sdk_ec2::types::{Filter, ResourceType, Tag, TagSpecification};
use aws_sdk_elasticloadbalancingv2::types::{LoadBalancerAttribute, LoadBalancerTypeEnum, ProtocolEnum, Tag as V2Tag};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

/// The finalizer the controller puts on a Service it manages.
pub const FINALIZER: &str = "service.k8s.aws/resources";
/// The label of its pods (its chart's).
pub const CHART_LABEL: &str = "app.kubernetes.io/name=aws-load-balancer-controller";
/// The annotation that sets load balancer attributes.
pub const ATTRIBUTES_ANNOTATION: &str = "service.beta.kubernetes.io/aws-load-balancer-attributes";
const PROTECTION: &str = "deletion_protection.enabled";
const TAG_CLUSTER: &str = "elbv2.k8s.aws/cluster";
const TAG_STACK: &str = "service.k8s.aws/stack";
const TAG_RESOURCE: &str = "service.k8s.aws/resource";

/// The stand-in, running until [`StandInLbc::shutdown`].
pub struct StandInLbc {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// What the stand-in works with.
#[derive(Clone)]
struct Ctx {
    client: Client,
    v2: aws_sdk_elasticloadbalancingv2::Client,
    ec2: aws_sdk_ec2::Client,
    cluster: String,
}

impl StandInLbc {
    /// Starts reconciling every `interval`, with `config` for LocalStack's ELBv2 and EC2.
    pub fn start(client: Client, config: &aws_config::SdkConfig, cluster: &str, interval: Duration) -> StandInLbc {
        let ctx = Ctx {
            client,
            v2: aws_sdk_elasticloadbalancingv2::Client::new(config),
            ec2: aws_sdk_ec2::Client::new(config),
            cluster: cluster.to_string(),
        };
        let cancel = CancellationToken::new();
        let token = cancel.clone();
        let task = tokio::spawn(async move {
            loop {
                if running(&ctx.client).await
                    && let Err(e) = reconcile(&ctx).await
                {
                    tracing::debug!(error = %e, "stand-in Load Balancer Controller: a pass failed; tried again");
                }
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        });
        StandInLbc { cancel, task }
    }

    /// Stops it.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// True while a pod of the controller, not being deleted, is bound to a node that is there.
async fn running(client: &Client) -> bool {
    running_with(client, CHART_LABEL).await
}

/// True while a pod labelled `label`, not being deleted, is bound to a node that is there: how
/// the stand-ins stop acting when the drain evicts their controller, as the real ones do.
pub(crate) async fn running_with(client: &Client, label: &str) -> bool {
    let pods: Api<Pod> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let Ok(list) = pods.list(&ListParams::default().labels(label)).await else { return false };
    for p in list.items {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(node) = p.spec.and_then(|s| s.node_name) else { continue };
        if let Ok(Some(n)) = nodes.get_opt(&node).await
            && n.metadata.deletion_timestamp.is_none()
        {
            return true;
        }
    }
    false
}

/// Whether the Service's annotation turns deletion protection on.
pub fn annotated_protection(svc: &Service) -> bool {
    svc.annotations().get(ATTRIBUTES_ANNOTATION).is_some_and(|v| {
        v.split(',').any(|kv| kv.split_once('=').is_some_and(|(k, v)| k.trim() == PROTECTION && v.trim() == "true"))
    })
}

/// The load balancer's name: `k8s-<namespace>-<name>-<hash>` within ELBv2's 32 characters.
fn lb_name(ns: &str, name: &str, uid: &str) -> String {
    let short = |s: &str, n: usize| s.chars().take(n).collect::<String>();
    let hash: u32 = uid.bytes().fold(2166136261u32, |h, b| (h ^ u32::from(b)).wrapping_mul(16777619));
    format!("k8s-{}-{}-{hash:08x}", short(ns, 8), short(name, 8))
}

async fn reconcile(ctx: &Ctx) -> Result<(), String> {
    let services: Api<Service> = Api::all(ctx.client.clone());
    let list = services.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
    for svc in list.items {
        let is_lb = svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer");
        let held = svc.finalizers().iter().any(|f| f == FINALIZER);
        if svc.metadata.deletion_timestamp.is_some() {
            if held {
                finalize(ctx, &svc).await?;
            }
        } else if is_lb {
            if !held {
                add_finalizer(ctx, &svc).await?;
            }
            ensure(ctx, &svc).await?;
        }
    }
    Ok(())
}

fn ns_name(svc: &Service) -> (String, String) {
    (svc.namespace().unwrap_or_default(), svc.name_any())
}

async fn add_finalizer(ctx: &Ctx, svc: &Service) -> Result<(), String> {
    let (ns, name) = ns_name(svc);
    let mut finalizers = svc.finalizers().to_vec();
    finalizers.push(FINALIZER.to_string());
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": svc.resource_version()}});
    Api::<Service>::namespaced(ctx.client.clone(), &ns)
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The ARNs of the ELBv2 objects tagged for the Service's stack (load balancers, target groups).
async fn stack_arns(ctx: &Ctx, stack: &str) -> Result<(Vec<String>, Vec<String>), String> {
    let lbs: Vec<String> = ctx
        .v2
        .describe_load_balancers()
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?
        .load_balancers()
        .iter()
        .filter_map(|l| l.load_balancer_arn().map(str::to_string))
        .collect();
    let tgs: Vec<String> = ctx
        .v2
        .describe_target_groups()
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?
        .target_groups()
        .iter()
        .filter_map(|t| t.target_group_arn().map(str::to_string))
        .collect();
    let mut mine = (Vec::new(), Vec::new());
    for (arns, out) in [(lbs, &mut mine.0), (tgs, &mut mine.1)] {
        for chunk in arns.chunks(20) {
            let tags = ctx
                .v2
                .describe_tags()
                .set_resource_arns(Some(chunk.to_vec()))
                .send()
                .await
                .map_err(|e| format!("{e:?}"))?;
            for d in tags.tag_descriptions() {
                let t: BTreeMap<&str, &str> =
                    d.tags().iter().filter_map(|t| Some((t.key()?, t.value().unwrap_or_default()))).collect();
                if t.get(TAG_CLUSTER) == Some(&ctx.cluster.as_str()) && t.get(TAG_STACK) == Some(&stack) {
                    out.push(d.resource_arn().unwrap_or_default().to_string());
                }
            }
        }
    }
    Ok(mine)
}

async fn stack_security_groups(ctx: &Ctx, stack: &str) -> Result<Vec<String>, String> {
    let out = ctx
        .ec2
        .describe_security_groups()
        .filters(Filter::builder().name(format!("tag:{TAG_CLUSTER}")).values(&ctx.cluster).build())
        .filters(Filter::builder().name(format!("tag:{TAG_STACK}")).values(stack).build())
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(out.security_groups().iter().filter_map(|g| g.group_id().map(str::to_string)).collect())
}

/// Makes the Service's load balancer, target group and security group, once.
async fn ensure(ctx: &Ctx, svc: &Service) -> Result<(), String> {
    let (ns, name) = ns_name(svc);
    let stack = format!("{ns}/{name}");
    if !stack_arns(ctx, &stack).await?.0.is_empty() {
        return Ok(());
    }
    let subnets: Vec<String> = ctx
        .ec2
        .describe_subnets()
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?
        .subnets()
        .iter()
        .filter_map(|s| s.subnet_id().map(str::to_string))
        .take(2)
        .collect();
    let vpc = ctx.ec2.describe_vpcs().send().await.map_err(|e| format!("{e:?}"))?.vpcs()[0]
        .vpc_id()
        .unwrap_or_default()
        .to_string();
    let v2_tags = |resource: &str| {
        [(TAG_CLUSTER, ctx.cluster.as_str()), (TAG_STACK, stack.as_str()), (TAG_RESOURCE, resource)]
            .iter()
            .map(|(k, v)| V2Tag::builder().key(*k).value(*v).build())
            .collect::<Vec<_>>()
    };
    let lb_name = lb_name(&ns, &name, &svc.uid().unwrap_or_default());
    let sg_tags = TagSpecification::builder()
        .resource_type(ResourceType::SecurityGroup)
        .set_tags(Some(
            [
                (TAG_CLUSTER, ctx.cluster.as_str()),
                (TAG_STACK, stack.as_str()),
                (TAG_RESOURCE, "ManagedLBSecurityGroup"),
            ]
            .iter()
            .map(|(k, v)| Tag::builder().key(*k).value(*v).build())
            .collect(),
        ))
        .build();
    ctx.ec2
        .create_security_group()
        .group_name(&lb_name)
        .description(format!("[k8s] Managed SecurityGroup for LoadBalancer {stack}"))
        .vpc_id(&vpc)
        .tag_specifications(sg_tags)
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    ctx.v2
        .create_target_group()
        .name(&lb_name)
        .protocol(ProtocolEnum::Tcp)
        .port(80)
        .vpc_id(&vpc)
        .set_tags(Some(v2_tags("80")))
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let lb = ctx
        .v2
        .create_load_balancer()
        .name(&lb_name)
        .r#type(LoadBalancerTypeEnum::Network)
        .set_subnets(Some(subnets))
        .set_tags(Some(v2_tags("LoadBalancer")))
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    if annotated_protection(svc) {
        let arn = lb.load_balancers().first().and_then(|l| l.load_balancer_arn()).unwrap_or_default();
        set_protection(ctx, arn, true).await?;
    }
    Ok(())
}

async fn set_protection(ctx: &Ctx, arn: &str, on: bool) -> Result<(), String> {
    let attribute = LoadBalancerAttribute::builder().key(PROTECTION).value(on.to_string()).build();
    ctx.v2
        .modify_load_balancer_attributes()
        .load_balancer_arn(arn)
        .attributes(attribute)
        .send()
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

/// Deletes the Service's AWS objects and then its finalizer, unless its annotation protects it.
async fn finalize(ctx: &Ctx, svc: &Service) -> Result<(), String> {
    let (ns, name) = ns_name(svc);
    if annotated_protection(svc) {
        tracing::info!(service = %format!("{ns}/{name}"), "deletion_protection is enabled, cannot delete the service");
        return Ok(());
    }
    let stack = format!("{ns}/{name}");
    let (lbs, tgs) = stack_arns(ctx, &stack).await?;
    for arn in &lbs {
        set_protection(ctx, arn, false).await?;
        ctx.v2.delete_load_balancer().load_balancer_arn(arn).send().await.map_err(|e| format!("{e:?}"))?;
    }
    for arn in &tgs {
        ctx.v2.delete_target_group().target_group_arn(arn).send().await.map_err(|e| format!("{e:?}"))?;
    }
    for id in stack_security_groups(ctx, &stack).await? {
        ctx.ec2.delete_security_group().group_id(id).send().await.map_err(|e| format!("{e:?}"))?;
    }
    let finalizers: Vec<String> = svc.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": svc.resource_version()}});
    Api::<Service>::namespaced(ctx.client.clone(), &ns)
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The Gateway API's module and the release whose standard Gateway CRD the tests install: the
/// newest the Go module proxy serves that Go 1.26 downloads (the Load Balancer Controller's
/// Gateway support asks for a v1 standard install).
const GATEWAY_API: (&str, &str, &str) =
    ("sigs.k8s.io/gateway-api", "v1.6.3", "h1:lKpJa5bGlraC/QeACvCpsHLdmO6y0iKfzVl6gzaFEYc=");
const GATEWAY_CRD: &str = "config/crd/standard/gateway.networking.k8s.io_gateways.yaml";

/// The Gateway API's own Gateway CRD (`gateways.gateway.networking.k8s.io`), read from its
/// release in Go's module cache at a pinned checksum, as the tests read Karpenter's: never
/// copied into this repository.
pub fn gateway_crd() -> Result<serde_json::Value, String> {
    let (module, version, sum) = GATEWAY_API;
    let dir = crate::karpenter_crds::go_module_dir(module, version, sum)
        .map_err(|e| format!("cannot get {module}@{version} from Go's module cache: {e}"))?;
    let text = std::fs::read_to_string(dir.join(GATEWAY_CRD)).map_err(|e| format!("{GATEWAY_CRD}: {e}"))?;
    let crd: serde_json::Value = serde_saphyr::from_str(&text).map_err(|e| format!("{GATEWAY_CRD}: {e}"))?;
    if crd["metadata"]["name"] != "gateways.gateway.networking.k8s.io" {
        return Err(format!("{GATEWAY_CRD} is not the Gateway CRD"));
    }
    Ok(crd)
}
