//! A stand-in for the AWS Load Balancer Controller's Service, Ingress and Gateway reconcilers
//! (kubernetes-sigs/aws-load-balancer-controller, `controllers/service/service_controller.go`,
//! `controllers/ingress/group_controller.go`, `controllers/gateway/gateway_controller.go`), which
//! the Go module proxy does not serve: what the teardown relies on, made as the real one makes it,
//! against LocalStack's ELBv2 and EC2.
//!
//! - It manages a Service of type LoadBalancer; an Ingress of its class: the annotation
//!   `kubernetes.io/ingress.class: alb`, or an `ingressClassName` whose IngressClass names the
//!   controller `ingress.k8s.aws/alb`; and a Gateway (Gateway API v1) whose GatewayClass names
//!   its controller `gateway.k8s.aws/nlb` or `gateway.k8s.aws/alb` (`pkg/gateway/constants`).
//!   Each gets its finalizer (`service.k8s.aws/resources`, `ingress.k8s.aws/resources`,
//!   `gateway.k8s.aws/nlb`, `gateway.k8s.aws/alb`: `pkg/shared_constants/finalizers.go`) before
//!   anything is made in AWS; then a load balancer (network for a Service and an NLB Gateway,
//!   application for an Ingress and an ALB Gateway), a target group and the load balancer's
//!   managed security group, each tagged `elbv2.k8s.aws/cluster=<cluster>`
//!   (`pkg/deploy/tracking/provider.go`: the cluster is the tag's value),
//!   `<prefix>/stack=<namespace>/<name>` and `<prefix>/resource` (`LoadBalancer`, the port,
//!   `ManagedLBSecurityGroup`), the prefix `service.k8s.aws`, `ingress.k8s.aws`,
//!   `gateway.k8s.aws.nlb` or `gateway.k8s.aws.alb` (`NLBGatewayTagPrefix`,
//!   `ALBGatewayTagPrefix`).
//! - A deleted object: when its attributes annotation
//!   (`service.beta.kubernetes.io/aws-load-balancer-attributes`,
//!   `alb.ingress.kubernetes.io/load-balancer-attributes`; a Gateway has none: its attributes
//!   come from a LoadBalancerConfiguration, not played) turns deletion protection on, the
//!   controller refuses and keeps its finalizer ("deletion_protection is enabled, cannot delete
//!   the service"); otherwise it switches off a protection set on the load balancer alone
//!   (`load_balancer_synthesizer.go`), deletes the load balancer, the target group and the
//!   security group, and only then removes its finalizer.
//! - It acts only while one of its pods (`app.kubernetes.io/name=aws-load-balancer-controller`)
//!   runs on a node that is there (`crate::standin`): evicted with its node's drain, it does
//!   nothing more, and every object it holds stays held, as on EKS.
//!
//! IngressGroups (one load balancer for several Ingresses), a Gateway's routes and listeners,
//! TargetGroupBindings and the shared backend security group are not played.

use std::collections::BTreeMap;
use std::time::Duration;

use aws_sdk_ec2::types::{Filter, ResourceType, Tag, TagSpecification};
use aws_sdk_elasticloadbalancingv2::types::{LoadBalancerAttribute, LoadBalancerTypeEnum, ProtocolEnum, Tag as V2Tag};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::{Ingress, IngressClass};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::{Client, ResourceExt};

use crate::standin::StandIn;

/// The finalizer the controller puts on a Service it manages.
pub const FINALIZER: &str = "service.k8s.aws/resources";
/// The finalizer it puts on an Ingress it manages alone (not in an explicit IngressGroup).
pub const INGRESS_FINALIZER: &str = "ingress.k8s.aws/resources";
/// The label of its pods (its chart's).
pub const CHART_LABEL: &str = "app.kubernetes.io/name=aws-load-balancer-controller";
/// The annotation that sets a Service's load balancer attributes.
pub const ATTRIBUTES_ANNOTATION: &str = "service.beta.kubernetes.io/aws-load-balancer-attributes";
/// The annotation that sets an Ingress's load balancer attributes.
pub const INGRESS_ATTRIBUTES_ANNOTATION: &str = "alb.ingress.kubernetes.io/load-balancer-attributes";
/// The controller an IngressClass names for it, and its default class annotation value.
const INGRESS_CONTROLLER: &str = "ingress.k8s.aws/alb";
/// The controller a GatewayClass names for its network load balancers (`NLBGatewayController`),
/// also its finalizer on such a Gateway.
pub const NLB_GATEWAY_CONTROLLER: &str = "gateway.k8s.aws/nlb";
/// The same for its application load balancers (`ALBGatewayController`).
pub const ALB_GATEWAY_CONTROLLER: &str = "gateway.k8s.aws/alb";
const INGRESS_CLASS_ANNOTATION: &str = "kubernetes.io/ingress.class";
const PROTECTION: &str = "deletion_protection.enabled";
const TAG_CLUSTER: &str = "elbv2.k8s.aws/cluster";

/// A kind of object the stand-in manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Service,
    Ingress,
    NlbGateway,
    AlbGateway,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Service, Kind::Ingress, Kind::NlbGateway, Kind::AlbGateway];

    fn resource(self) -> ApiResource {
        match self {
            Kind::Service => ApiResource::erase::<Service>(&()),
            Kind::Ingress => ApiResource::erase::<Ingress>(&()),
            Kind::NlbGateway | Kind::AlbGateway => gateway_api("Gateway", "gateways"),
        }
    }

    fn finalizer(self) -> &'static str {
        match self {
            Kind::Service => FINALIZER,
            Kind::Ingress => INGRESS_FINALIZER,
            Kind::NlbGateway => NLB_GATEWAY_CONTROLLER,
            Kind::AlbGateway => ALB_GATEWAY_CONTROLLER,
        }
    }

    /// The prefix of its `<prefix>/stack` and `<prefix>/resource` tags.
    fn prefix(self) -> &'static str {
        match self {
            Kind::Service => "service.k8s.aws",
            Kind::Ingress => "ingress.k8s.aws",
            Kind::NlbGateway => "gateway.k8s.aws.nlb",
            Kind::AlbGateway => "gateway.k8s.aws.alb",
        }
    }

    fn annotation(self) -> Option<&'static str> {
        match self {
            Kind::Service => Some(ATTRIBUTES_ANNOTATION),
            Kind::Ingress => Some(INGRESS_ATTRIBUTES_ANNOTATION),
            Kind::NlbGateway | Kind::AlbGateway => None,
        }
    }

    fn lb_type(self) -> LoadBalancerTypeEnum {
        match self {
            Kind::Service | Kind::NlbGateway => LoadBalancerTypeEnum::Network,
            Kind::Ingress | Kind::AlbGateway => LoadBalancerTypeEnum::Application,
        }
    }

    fn tag(self, what: &str) -> String {
        format!("{}/{what}", self.prefix())
    }
}

/// What the stand-in works with.
#[derive(Clone)]
struct Ctx {
    client: Client,
    v2: aws_sdk_elasticloadbalancingv2::Client,
    ec2: aws_sdk_ec2::Client,
    cluster: String,
}

/// Starts the stand-in for `cluster`, reconciling every `interval`, with `config` for
/// LocalStack's ELBv2 and EC2.
pub fn start(client: Client, config: &aws_config::SdkConfig, cluster: &str, interval: Duration) -> StandIn {
    let ctx = Ctx {
        client: client.clone(),
        v2: aws_sdk_elasticloadbalancingv2::Client::new(config),
        ec2: aws_sdk_ec2::Client::new(config),
        cluster: cluster.to_string(),
    };
    StandIn::spawn(client, CHART_LABEL, "Load Balancer Controller", interval, move || {
        let ctx = ctx.clone();
        async move { reconcile(&ctx).await }
    })
}

/// A kind of the Gateway API, v1.
fn gateway_api(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", kind), plural)
}

/// Whether the object's attributes annotation turns deletion protection on.
fn annotated_protection(kind: Kind, obj: &DynamicObject) -> bool {
    kind.annotation().and_then(|a| obj.annotations().get(a)).is_some_and(|v| {
        v.split(',').any(|kv| kv.split_once('=').is_some_and(|(k, v)| k.trim() == PROTECTION && v.trim() == "true"))
    })
}

/// The load balancer's name: `k8s-<namespace>-<name>-<hash>` within ELBv2's 32 characters. The
/// hash takes the cluster's name as the real one's does (`pkg/deploy/elbv2/`), so two clusters'
/// objects of one name and uid (a test server's uids repeat) never share a name in one account.
fn lb_name(cluster: &str, ns: &str, name: &str, uid: &str) -> String {
    let short = |s: &str, n: usize| s.chars().take(n).collect::<String>();
    let hash: u32 =
        cluster.bytes().chain(uid.bytes()).fold(2166136261u32, |h, b| (h ^ u32::from(b)).wrapping_mul(16777619));
    format!("k8s-{}-{}-{hash:08x}", short(ns, 8), short(name, 8))
}

/// The classes that name the controller: IngressClasses, and GatewayClasses by controller.
#[derive(Default)]
struct Classes {
    ingress: Vec<String>,
    nlb_gateway: Vec<String>,
    alb_gateway: Vec<String>,
}

/// Whether the controller manages `obj`: a Service of type LoadBalancer; an Ingress or a Gateway
/// of its class.
fn manages(kind: Kind, obj: &DynamicObject, classes: &Classes) -> bool {
    let class_in =
        |field: &str, names: &[String]| obj.data["spec"][field].as_str().is_some_and(|c| names.iter().any(|n| n == c));
    match kind {
        Kind::Service => obj.data["spec"]["type"] == "LoadBalancer",
        Kind::Ingress => {
            obj.annotations().get(INGRESS_CLASS_ANNOTATION).map(String::as_str) == Some("alb")
                || class_in("ingressClassName", &classes.ingress)
        }
        Kind::NlbGateway => class_in("gatewayClassName", &classes.nlb_gateway),
        Kind::AlbGateway => class_in("gatewayClassName", &classes.alb_gateway),
    }
}

async fn classes(ctx: &Ctx) -> Classes {
    let mut out = Classes::default();
    // a server that serves no IngressClasses (the sandbox's): annotated Ingresses only
    if let Ok(l) = Api::<IngressClass>::all(ctx.client.clone()).list(&ListParams::default()).await {
        out.ingress = l
            .items
            .into_iter()
            .filter(|c| c.spec.as_ref().and_then(|s| s.controller.as_deref()) == Some(INGRESS_CONTROLLER))
            .map(|c| c.name_any())
            .collect();
    }
    // no Gateway API: no Gateways
    let gateway_classes =
        Api::<DynamicObject>::all_with(ctx.client.clone(), &gateway_api("GatewayClass", "gatewayclasses"));
    if let Ok(l) = gateway_classes.list(&ListParams::default()).await {
        for c in l.items {
            match c.data["spec"]["controllerName"].as_str() {
                Some(NLB_GATEWAY_CONTROLLER) => out.nlb_gateway.push(c.name_any()),
                Some(ALB_GATEWAY_CONTROLLER) => out.alb_gateway.push(c.name_any()),
                _ => {}
            }
        }
    }
    out
}

async fn reconcile(ctx: &Ctx) -> Result<(), String> {
    let classes = classes(ctx).await;
    for kind in Kind::ALL {
        let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &kind.resource());
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(kube::Error::Api(s)) if s.code == 404 => continue,
            Err(e) => return Err(e.to_string()),
        };
        for obj in list.items {
            let held = obj.finalizers().iter().any(|f| f == kind.finalizer());
            if obj.metadata.deletion_timestamp.is_some() {
                if held {
                    finalize(ctx, kind, &obj).await?;
                }
            } else if manages(kind, &obj, &classes) {
                if !held {
                    set_finalizers(ctx, kind, &obj, true).await?;
                }
                ensure(ctx, kind, &obj).await?;
            }
        }
    }
    Ok(())
}

fn ns_name(obj: &DynamicObject) -> (String, String) {
    (obj.namespace().unwrap_or_default(), obj.name_any())
}

/// Adds (`hold`) or removes the kind's finalizer, at the object's resourceVersion.
async fn set_finalizers(ctx: &Ctx, kind: Kind, obj: &DynamicObject, hold: bool) -> Result<(), String> {
    let (ns, name) = ns_name(obj);
    let mut finalizers: Vec<String> = obj.finalizers().iter().filter(|f| *f != kind.finalizer()).cloned().collect();
    if hold {
        finalizers.push(kind.finalizer().to_string());
    }
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": obj.resource_version()}});
    Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &ns, &kind.resource())
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The ARNs of the ELBv2 objects tagged for the stack (load balancers, target groups).
async fn stack_arns(ctx: &Ctx, kind: Kind, stack: &str) -> Result<(Vec<String>, Vec<String>), String> {
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
    let tag_stack = kind.tag("stack");
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
                if t.get(TAG_CLUSTER) == Some(&ctx.cluster.as_str()) && t.get(tag_stack.as_str()) == Some(&stack) {
                    out.push(d.resource_arn().unwrap_or_default().to_string());
                }
            }
        }
    }
    Ok(mine)
}

async fn stack_security_groups(ctx: &Ctx, kind: Kind, stack: &str) -> Result<Vec<String>, String> {
    let out = ctx
        .ec2
        .describe_security_groups()
        .filters(Filter::builder().name(format!("tag:{TAG_CLUSTER}")).values(&ctx.cluster).build())
        .filters(Filter::builder().name(format!("tag:{}", kind.tag("stack"))).values(stack).build())
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(out.security_groups().iter().filter_map(|g| g.group_id().map(str::to_string)).collect())
}

/// Makes the object's load balancer, target group and security group, once.
async fn ensure(ctx: &Ctx, kind: Kind, obj: &DynamicObject) -> Result<(), String> {
    let (ns, name) = ns_name(obj);
    let stack = format!("{ns}/{name}");
    if !stack_arns(ctx, kind, &stack).await?.0.is_empty() {
        return Ok(());
    }
    // two subnets of different zones, as an application load balancer needs
    let mut subnets: Vec<String> = Vec::new();
    let mut zones: Vec<String> = Vec::new();
    for s in ctx.ec2.describe_subnets().send().await.map_err(|e| format!("{e:?}"))?.subnets() {
        let zone = s.availability_zone().unwrap_or_default().to_string();
        if subnets.len() < 2 && !zones.contains(&zone) {
            zones.push(zone);
            subnets.extend(s.subnet_id().map(str::to_string));
        }
    }
    let vpc = ctx.ec2.describe_vpcs().send().await.map_err(|e| format!("{e:?}"))?.vpcs()[0]
        .vpc_id()
        .unwrap_or_default()
        .to_string();
    let (tag_stack, tag_resource) = (kind.tag("stack"), kind.tag("resource"));
    let v2_tags = |resource: &str| {
        [(TAG_CLUSTER, ctx.cluster.as_str()), (tag_stack.as_str(), stack.as_str()), (tag_resource.as_str(), resource)]
            .iter()
            .map(|(k, v)| V2Tag::builder().key(*k).value(*v).build())
            .collect::<Vec<_>>()
    };
    let lb_name = lb_name(&ctx.cluster, &ns, &name, &obj.uid().unwrap_or_default());
    let sg_tags = TagSpecification::builder()
        .resource_type(ResourceType::SecurityGroup)
        .set_tags(Some(
            [
                (TAG_CLUSTER, ctx.cluster.as_str()),
                (tag_stack.as_str(), stack.as_str()),
                (tag_resource.as_str(), "ManagedLBSecurityGroup"),
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
    let protocol = match kind.lb_type() {
        LoadBalancerTypeEnum::Network => ProtocolEnum::Tcp,
        _ => ProtocolEnum::Http,
    };
    ctx.v2
        .create_target_group()
        .name(&lb_name)
        .protocol(protocol)
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
        .r#type(kind.lb_type())
        .set_subnets(Some(subnets))
        .set_tags(Some(v2_tags("LoadBalancer")))
        .send()
        .await
        .map_err(|e| format!("{e:?}"))?;
    if annotated_protection(kind, obj) {
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

/// Deletes the object's AWS objects and then its finalizer, unless its annotation protects it.
async fn finalize(ctx: &Ctx, kind: Kind, obj: &DynamicObject) -> Result<(), String> {
    let (ns, name) = ns_name(obj);
    if annotated_protection(kind, obj) {
        tracing::info!(object = %format!("{ns}/{name}"), "deletion_protection is enabled, cannot delete it");
        return Ok(());
    }
    let stack = format!("{ns}/{name}");
    let (lbs, tgs) = stack_arns(ctx, kind, &stack).await?;
    for arn in &lbs {
        set_protection(ctx, arn, false).await?;
        ctx.v2.delete_load_balancer().load_balancer_arn(arn).send().await.map_err(|e| format!("{e:?}"))?;
    }
    for arn in &tgs {
        ctx.v2.delete_target_group().target_group_arn(arn).send().await.map_err(|e| format!("{e:?}"))?;
    }
    for id in stack_security_groups(ctx, kind, &stack).await? {
        ctx.ec2.delete_security_group().group_id(id).send().await.map_err(|e| format!("{e:?}"))?;
    }
    set_finalizers(ctx, kind, obj, false).await
}

/// The Gateway API's module and the release whose standard Gateway CRD the tests install: the
/// newest the Go module proxy serves that Go 1.26 downloads (the Load Balancer Controller's
/// Gateway support asks for a v1 standard install).
const GATEWAY_API: (&str, &str, &str) =
    ("sigs.k8s.io/gateway-api", "v1.6.3", "h1:lKpJa5bGlraC/QeACvCpsHLdmO6y0iKfzVl6gzaFEYc=");
const GATEWAY_CRDS: [(&str, &str); 2] = [
    ("config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml", "gatewayclasses.gateway.networking.k8s.io"),
    ("config/crd/standard/gateway.networking.k8s.io_gateways.yaml", "gateways.gateway.networking.k8s.io"),
];

/// The Gateway API's own GatewayClass and Gateway CRDs, read from its release in Go's module
/// cache at a pinned checksum, as the tests read Karpenter's: never copied into this repository.
pub fn gateway_crds() -> Result<Vec<serde_json::Value>, String> {
    let (module, version, sum) = GATEWAY_API;
    let dir = crate::karpenter_crds::go_module_dir(module, version, sum)
        .map_err(|e| format!("cannot get {module}@{version} from Go's module cache: {e}"))?;
    let mut out = Vec::new();
    for (file, name) in GATEWAY_CRDS {
        let text = std::fs::read_to_string(dir.join(file)).map_err(|e| format!("{file}: {e}"))?;
        let crd: serde_json::Value = serde_saphyr::from_str(&text).map_err(|e| format!("{file}: {e}"))?;
        if crd["metadata"]["name"] != name {
            return Err(format!("{file} is not the CRD {name}"));
        }
        out.push(crd);
    }
    Ok(out)
}
