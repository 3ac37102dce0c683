//! The simulation's own EC2 and IAM calls: what Karpenter itself does in AWS (launch tagged
//! instances, create launch templates and instance profiles, list, terminate, delete).
//!
//! The product's AWS layer never launches or creates anything, and the test bed never borrows
//! the product's reads: the simulated Karpenter must find its instances the way Karpenter does,
//! not the way the tool under test does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aws_sdk_ec2::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_ec2::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_ec2::error::BoxError;
use aws_sdk_ec2::types::{Filter, Instance, InstanceStateName, ResourceType, Tag, TagSpecification};

use crate::karpenter;

/// An EC2 or IAM call that failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{operation}: {message}{}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
pub struct CloudError {
    /// The API operation, e.g. `RunInstances`.
    pub operation: &'static str,
    /// The service's error code, when it answered with one.
    pub code: Option<String>,
    /// The service's message, or the transport failure.
    pub message: String,
}

impl CloudError {
    // EC2's and IAM's SdkError and ProvideErrorMetadata are the same smithy types, so one
    // conversion serves both clients.
    fn from_sdk<E, R>(operation: &'static str, e: aws_sdk_ec2::error::SdkError<E, R>) -> CloudError
    where
        E: aws_sdk_ec2::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug,
    {
        let code = e.as_service_error().and_then(|s| s.code()).map(str::to_string);
        let message = match e.as_service_error().and_then(|s| s.message()) {
            Some(m) => m.to_string(),
            None => aws_sdk_ec2::error::DisplayErrorContext(&e).to_string(),
        };
        CloudError { operation, code, message }
    }

    /// The service's error code.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }
}

/// One instance as the simulation sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimInstance {
    /// `i-…`
    pub id: String,
    /// EC2's state name (`running`, `shutting-down`, `terminated`, …).
    pub state: String,
    /// Tags.
    pub tags: BTreeMap<String, String>,
}

impl SimInstance {
    /// Anything but `terminated` (an unknown state counts as live).
    pub fn is_live(&self) -> bool {
        self.state != InstanceStateName::Terminated.as_str()
    }

    fn from_sdk(i: &Instance) -> SimInstance {
        SimInstance {
            id: i.instance_id().unwrap_or_default().to_string(),
            state: i.state().and_then(|s| s.name()).map(|n| n.as_str().to_string()).unwrap_or_default(),
            tags: i
                .tags()
                .iter()
                .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string())))
                .collect(),
        }
    }
}

/// A launch template Karpenter made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// `lt-…`
    pub id: String,
    /// `karpenter.k8s.aws/…`
    pub name: String,
}

/// Counts EC2 requests as sent (once per attempt, retries included), so a benchmark can tell the
/// simulation's share of EC2's request budget from the tool's.
#[derive(Clone, Debug, Default)]
struct Attempts(Arc<AtomicU64>);

impl Intercept for Attempts {
    fn name(&self) -> &'static str {
        "sandbox-sim EC2 request counter"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The simulation's SDK clients of one region (LocalStack's, in every use).
#[derive(Clone, Debug)]
pub struct Cloud {
    ec2: aws_sdk_ec2::Client,
    iam: aws_sdk_iam::Client,
    eks: aws_sdk_eks::Client,
    ec2_requests: Attempts,
}

/// The tags by which LocalStack (`localstack/launch.py`) sets an EKS cluster's endpoint and
/// certificate authority to the API server the test bed started, as EKS would have made them.
pub const EKS_ENDPOINT_TAG: &str = "testbed.karpenter-teardown/endpoint";
/// See [`EKS_ENDPOINT_TAG`]: base64 of the PEM bundle, as EKS gives `certificateAuthority.data`.
pub const EKS_CA_TAG: &str = "testbed.karpenter-teardown/certificate-authority-data";

/// What the test bed tells EKS of a cluster it stands up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EksSpec {
    /// The API server's URL.
    pub endpoint: String,
    /// The PEM of its certificate authority; `None` for a plain-HTTP server.
    pub ca_pem: Option<String>,
    /// EKS Auto Mode's compute is on.
    pub auto_mode: bool,
}

impl Cloud {
    /// Clients from a loaded SDK configuration.
    pub fn from_config(config: &aws_config::SdkConfig) -> Cloud {
        let ec2_requests = Attempts::default();
        let ec2 = aws_sdk_ec2::config::Builder::from(config).interceptor(ec2_requests.clone()).build();
        Cloud {
            ec2: aws_sdk_ec2::Client::from_conf(ec2),
            iam: aws_sdk_iam::Client::new(config),
            eks: aws_sdk_eks::Client::new(config),
            ec2_requests,
        }
    }

    /// EC2 requests these clients (and their clones) have sent so far.
    pub fn ec2_requests(&self) -> u64 {
        self.ec2_requests.0.load(Ordering::Relaxed)
    }

    /// The EC2 SDK client, for tests that set up or inspect EC2 directly.
    pub fn ec2_sdk(&self) -> &aws_sdk_ec2::Client {
        &self.ec2
    }

    /// The IAM SDK client, for tests that set up or inspect IAM directly.
    pub fn iam_sdk(&self) -> &aws_sdk_iam::Client {
        &self.iam
    }

    /// Launches `count` instances carrying `tags`, in `zone` when given.
    pub async fn launch_tagged(
        &self,
        image_id: &str,
        instance_type: &str,
        zone: Option<&str>,
        count: i32,
        tags: &BTreeMap<String, String>,
    ) -> Result<Vec<SimInstance>, CloudError> {
        let mut req = self
            .ec2
            .run_instances()
            .image_id(image_id)
            .instance_type(instance_type.into())
            .min_count(count)
            .max_count(count)
            .tag_specifications(tag_spec(ResourceType::Instance, tags));
        if let Some(z) = zone {
            req = req.placement(aws_sdk_ec2::types::Placement::builder().availability_zone(z).build());
        }
        let out = req.send().await.map_err(|e| CloudError::from_sdk("RunInstances", e))?;
        Ok(out.instances().iter().map(SimInstance::from_sdk).collect())
    }

    /// Adds `tags` to an instance (`CreateTags`), as Karpenter's tagging controller does once the
    /// instance is registered.
    pub async fn tag_instance(&self, id: &str, tags: &BTreeMap<String, String>) -> Result<(), CloudError> {
        let tags: Vec<aws_sdk_ec2::types::Tag> =
            tags.iter().map(|(k, v)| aws_sdk_ec2::types::Tag::builder().key(k).value(v).build()).collect();
        self.ec2
            .create_tags()
            .resources(id)
            .set_tags(Some(tags))
            .send()
            .await
            .map_err(|e| CloudError::from_sdk("CreateTags", e))?;
        Ok(())
    }

    /// Creates a tagged launch template; its id.
    pub async fn create_launch_template(
        &self,
        name: &str,
        image_id: &str,
        tags: &BTreeMap<String, String>,
    ) -> Result<String, CloudError> {
        let out = self
            .ec2
            .create_launch_template()
            .launch_template_name(name)
            .launch_template_data(aws_sdk_ec2::types::RequestLaunchTemplateData::builder().image_id(image_id).build())
            .tag_specifications(tag_spec(ResourceType::LaunchTemplate, tags))
            .send()
            .await
            .map_err(|e| CloudError::from_sdk("CreateLaunchTemplate", e))?;
        Ok(out.launch_template().and_then(|l| l.launch_template_id()).unwrap_or_default().to_string())
    }

    /// The id of the launch template named `name`, if it exists.
    pub async fn launch_template_id(&self, name: &str) -> Result<Option<String>, CloudError> {
        match self.ec2.describe_launch_templates().launch_template_names(name).send().await {
            Ok(out) => Ok(out.launch_templates().first().and_then(|l| l.launch_template_id()).map(str::to_string)),
            Err(e) => {
                let e = CloudError::from_sdk("DescribeLaunchTemplates", e);
                if e.code().is_some_and(|c| c.starts_with("InvalidLaunchTemplateName")) { Ok(None) } else { Err(e) }
            }
        }
    }

    /// The launch templates of one EC2NodeClass of `cluster`, found as Karpenter's launch
    /// template provider finds them when the class is deleted: by the class tag, then the
    /// cluster tag of either release (1.0.x `karpenter.k8s.aws/cluster`, later
    /// `eks:eks-cluster-name`).
    pub async fn class_launch_templates(&self, cluster: &str, class: &str) -> Result<Vec<Template>, CloudError> {
        // Asked by the cluster's tags, which are unique to the cluster, and the class checked here:
        // LocalStack pages DescribeLaunchTemplates without a NextToken, so a filter as wide as a
        // class name (every test world has a `class-0`) loses templates once a long-lived
        // LocalStack holds more than a page of them.
        let mut out = Vec::new();
        for cluster_tag in [karpenter::TAG_EKS_CLUSTER, karpenter::TAG_LEGACY_CLUSTER] {
            let filter = Filter::builder().name(format!("tag:{cluster_tag}")).values(cluster).build();
            let mut pages =
                self.ec2.describe_launch_templates().filters(filter).max_results(200).into_paginator().send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| CloudError::from_sdk("DescribeLaunchTemplates", e))?;
                for lt in page.launch_templates() {
                    let of_class =
                        lt.tags().iter().any(|t| t.key() == Some(karpenter::TAG_NODECLASS) && t.value() == Some(class));
                    let id = lt.launch_template_id().unwrap_or_default();
                    if of_class && !out.iter().any(|t: &Template| t.id == id) {
                        out.push(Template {
                            id: id.to_string(),
                            name: lt.launch_template_name().unwrap_or_default().to_string(),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Deletes a launch template; one already gone counts as deleted.
    pub async fn delete_launch_template(&self, id: &str) -> Result<(), CloudError> {
        match self.ec2.delete_launch_template().launch_template_id(id).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = CloudError::from_sdk("DeleteLaunchTemplate", e);
                if e.code().is_some_and(|c| c.starts_with("InvalidLaunchTemplate")) { Ok(()) } else { Err(e) }
            }
        }
    }

    /// Instances by id; ids EC2 no longer knows are absent from the result.
    pub async fn instances_by_id(&self, ids: &[String]) -> Result<Vec<SimInstance>, CloudError> {
        let mut out = Vec::with_capacity(ids.len());
        // EC2 takes at most 200 values in one filter
        for chunk in ids.chunks(200) {
            let f = Filter::builder().name("instance-id").set_values(Some(chunk.to_vec())).build();
            out.extend(self.describe(vec![f]).await?);
        }
        Ok(out)
    }

    /// The cluster's live instances as Karpenter's garbage collection lists them: tagged with the
    /// cluster, a NodePool and an EC2NodeClass, in any state but terminated.
    pub async fn karpenter_instances(&self, cluster: &str) -> Result<Vec<SimInstance>, CloudError> {
        let states = ["pending", "running", "stopping", "stopped", "shutting-down"];
        let f = Filter::builder()
            .name("instance-state-name")
            .set_values(Some(states.iter().map(|s| s.to_string()).collect()))
            .build();
        // tag conditions on the client: the simulated controller's only cluster is the account's
        // only one, so asking EC2 to filter by tag would save nothing here
        Ok(self
            .describe(vec![f])
            .await?
            .into_iter()
            .filter(|i| {
                i.tags.get(karpenter::TAG_EKS_CLUSTER).map(String::as_str) == Some(cluster)
                    && i.tags.contains_key(karpenter::TAG_NODEPOOL)
                    && i.tags.contains_key(karpenter::TAG_NODECLASS)
            })
            .collect())
    }

    async fn describe(&self, filters: Vec<Filter>) -> Result<Vec<SimInstance>, CloudError> {
        // pages of 200: a page is held whole, as XML and then as the SDK's types (a thousand
        // instances were 21 MB of a 1,000-node rehearsal's heap peak)
        let mut pages =
            self.ec2.describe_instances().set_filters(Some(filters)).max_results(200).into_paginator().send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| CloudError::from_sdk("DescribeInstances", e))?;
            for r in page.reservations() {
                out.extend(r.instances().iter().map(SimInstance::from_sdk));
            }
        }
        Ok(out)
    }

    /// Terminates instances (at most 1,000 per call, as EC2 takes); the ids EC2 accepted.
    pub async fn terminate(&self, ids: &[String]) -> Result<Vec<String>, CloudError> {
        let mut accepted = Vec::new();
        for chunk in ids.chunks(1000) {
            let out = self
                .ec2
                .terminate_instances()
                .set_instance_ids(Some(chunk.to_vec()))
                .send()
                .await
                .map_err(|e| CloudError::from_sdk("TerminateInstances", e))?;
            accepted.extend(out.terminating_instances().iter().filter_map(|c| c.instance_id().map(str::to_string)));
        }
        Ok(accepted)
    }

    /// Creates an instance profile at `path` with `tags`.
    pub async fn create_instance_profile(
        &self,
        name: &str,
        path: &str,
        tags: &BTreeMap<String, String>,
    ) -> Result<(), CloudError> {
        let tags = tags
            .iter()
            .map(|(k, v)| aws_sdk_iam::types::Tag::builder().key(k).value(v).build())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CloudError {
                operation: "CreateInstanceProfile",
                code: Some("InvalidTag".into()),
                message: e.to_string(),
            })?;
        self.iam
            .create_instance_profile()
            .instance_profile_name(name)
            .path(path)
            .set_tags(Some(tags))
            .send()
            .await
            .map_err(|e| CloudError::from_sdk("CreateInstanceProfile", e))?;
        Ok(())
    }

    /// Deletes the instance profile `name` after removing its roles, as Karpenter does when it
    /// finalizes an EC2NodeClass; one already gone counts as deleted. True when it existed.
    pub async fn delete_instance_profile(&self, name: &str) -> Result<bool, CloudError> {
        let profile = match self.iam.get_instance_profile().instance_profile_name(name).send().await {
            Ok(out) => out.instance_profile,
            Err(e) => {
                let e = CloudError::from_sdk("GetInstanceProfile", e);
                return if e.code() == Some("NoSuchEntity") { Ok(false) } else { Err(e) };
            }
        };
        for role in profile.iter().flat_map(|p| p.roles()) {
            let removed = self
                .iam
                .remove_role_from_instance_profile()
                .instance_profile_name(name)
                .role_name(role.role_name())
                .send()
                .await;
            if let Err(e) = removed {
                let e = CloudError::from_sdk("RemoveRoleFromInstanceProfile", e);
                if e.code() != Some("NoSuchEntity") {
                    return Err(e);
                }
            }
        }
        match self.iam.delete_instance_profile().instance_profile_name(name).send().await {
            Ok(_) => Ok(true),
            Err(e) => {
                let e = CloudError::from_sdk("DeleteInstanceProfile", e);
                if e.code() == Some("NoSuchEntity") { Ok(false) } else { Err(e) }
            }
        }
    }

    /// Makes EKS know cluster `name` with the endpoint and certificate authority of the API
    /// server the test bed started (replacing one of the same name), as `eksctl` or Terraform
    /// would have created it: what the tool proves a kubeconfig against.
    pub async fn register_eks_cluster(&self, name: &str, spec: &EksSpec) -> Result<(), CloudError> {
        use aws_sdk_eks::types::{ComputeConfigRequest, VpcConfigRequest};
        use base64::Engine as _;
        self.deregister_eks_cluster(name).await?;
        let mut req = self
            .eks
            .create_cluster()
            .name(name)
            .role_arn("arn:aws:iam::000000000000:role/eks-cluster")
            .resources_vpc_config(VpcConfigRequest::builder().build())
            .tags(EKS_ENDPOINT_TAG, &spec.endpoint);
        if let Some(pem) = &spec.ca_pem {
            req = req.tags(EKS_CA_TAG, base64::engine::general_purpose::STANDARD.encode(pem));
        }
        if spec.auto_mode {
            req =
                req.compute_config(ComputeConfigRequest::builder().enabled(true).node_pools("general-purpose").build());
        }
        req.send().await.map(|_| ()).map_err(|e| CloudError::from_sdk("CreateCluster", e))
    }

    /// Makes EKS forget cluster `name` (as `aws eks delete-cluster` once done); one it does not
    /// know is already forgotten.
    pub async fn deregister_eks_cluster(&self, name: &str) -> Result<(), CloudError> {
        match self.eks.delete_cluster().name(name).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = CloudError::from_sdk("DeleteCluster", e);
                if e.code() == Some("ResourceNotFoundException") { Ok(()) } else { Err(e) }
            }
        }
    }

    /// Proves the endpoint answers (EC2 DescribeAvailabilityZones).
    pub async fn ping(&self) -> Result<(), CloudError> {
        self.ec2
            .describe_availability_zones()
            .send()
            .await
            .map(|_| ())
            .map_err(|e| CloudError::from_sdk("DescribeAvailabilityZones", e))
    }
}

/// `tags` on a resource of `kind` as it is created.
pub fn tag_spec(kind: ResourceType, tags: &BTreeMap<String, String>) -> TagSpecification {
    TagSpecification::builder()
        .resource_type(kind)
        .set_tags(Some(tags.iter().map(|(k, v)| Tag::builder().key(k).value(v).build()).collect()))
        .build()
}
