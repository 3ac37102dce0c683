//! Elastic Load Balancing (ELBv2 and classic) and the security groups the cleanup controllers
//! make: read for verification, each object judged this cluster's or not by
//! [`crate::cleanup::judge_load_balancing`].

use std::collections::BTreeMap;

use super::AwsError;
use super::ec2::Ec2;
use crate::cleanup::{LbKind, TAG_LBC_CLUSTER, judge_load_balancing};

/// The most ARNs or names one `DescribeTags` takes (both APIs).
const DESCRIBE_TAGS_MAX: usize = 20;
/// The largest page `DescribeLoadBalancers` and `DescribeTargetGroups` return (both APIs).
const DESCRIBE_PAGE: i32 = 400;

/// A load balancer, target group or security group a cleanup controller made for this cluster.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct LoadBalancing {
    /// What it is.
    pub kind: LbKind,
    /// Its ARN (ELBv2), name (classic) or `sg-…` id.
    pub id: String,
    /// Its name.
    pub name: String,
    /// The controller that made it.
    pub owner: String,
    /// What it was made for (its stack tag, Service or load balancer).
    pub made_for: String,
}

/// Whether an error code says the object asked about no longer exists (both APIs answer a
/// missing load balancer with `LoadBalancerNotFound`, ELBv2 a missing target group with
/// `TargetGroupNotFound`).
fn gone(code: &str) -> bool {
    matches!(code, "LoadBalancerNotFound" | "TargetGroupNotFound")
}

/// What `read` answers for `keys` (ARNs or names), asked `DESCRIBE_TAGS_MAX` at a time. Both
/// APIs' `DescribeTags` fail the whole call when one object it names is gone
/// (`LoadBalancerNotFound`, `TargetGroupNotFound`), which happens to whatever a controller
/// deletes between the listing and this call (a release waits for exactly that): such a chunk is
/// asked again a key at a time, and what is gone is left out.
async fn asked_around_the_gone<T, F, Fut>(keys: &[String], read: F) -> Result<Vec<T>, AwsError>
where
    F: Fn(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<T>, AwsError>>,
{
    let mut out = Vec::new();
    for chunk in keys.chunks(DESCRIBE_TAGS_MAX) {
        match read(chunk.to_vec()).await {
            Ok(found) => out.extend(found),
            Err(e) if e.code().is_some_and(gone) => {
                for key in chunk {
                    match read(vec![key.clone()]).await {
                        Ok(found) => out.extend(found),
                        Err(e) if e.code().is_some_and(gone) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// An object as read, before it is judged.
struct Tagged {
    id: String,
    name: String,
    tags: BTreeMap<String, String>,
}

fn judged(kind: LbKind, found: Vec<Tagged>, cluster: &str) -> Vec<LoadBalancing> {
    let mut out: Vec<LoadBalancing> = found
        .into_iter()
        .filter_map(|t| {
            judge_load_balancing(kind, &t.name, &t.tags, cluster).map(|(owner, made_for)| LoadBalancing {
                kind,
                id: t.id,
                name: t.name,
                owner: owner.to_string(),
                made_for,
            })
        })
        .collect();
    out.sort();
    out
}

/// The ELBv2 and classic ELB clients of one region.
#[derive(Clone, Debug)]
pub struct Elb {
    v2: aws_sdk_elasticloadbalancingv2::Client,
    classic: aws_sdk_elasticloadbalancing::Client,
    endpoint: String,
}

impl Elb {
    pub(crate) fn new(
        v2: aws_sdk_elasticloadbalancingv2::Client,
        classic: aws_sdk_elasticloadbalancing::Client,
        endpoint: String,
    ) -> Elb {
        Elb { v2, classic, endpoint }
    }

    fn err<E, R>(&self, op: &'static str, e: aws_sdk_ec2::error::SdkError<E, R>) -> AwsError
    where
        E: aws_sdk_ec2::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug,
    {
        AwsError::from_sdk("elasticloadbalancing", op, &self.endpoint, e)
    }

    /// Tags of ELBv2 objects by ARN, 20 to a call ([`asked_around_the_gone`]).
    async fn v2_tags(&self, arns: &[String]) -> Result<BTreeMap<String, BTreeMap<String, String>>, AwsError> {
        Ok(asked_around_the_gone(arns, |chunk| self.v2_tags_of(chunk)).await?.into_iter().collect())
    }

    async fn v2_tags_of(&self, arns: Vec<String>) -> Result<Vec<(String, BTreeMap<String, String>)>, AwsError> {
        let got = self
            .v2
            .describe_tags()
            .set_resource_arns(Some(arns))
            .send()
            .await
            .map_err(|e| self.err("DescribeTags", e))?;
        Ok(got
            .tag_descriptions()
            .iter()
            .map(|d| {
                let tags = d
                    .tags()
                    .iter()
                    .map(|t| (t.key().unwrap_or_default().to_string(), t.value().unwrap_or_default().to_string()))
                    .collect();
                (d.resource_arn().unwrap_or_default().to_string(), tags)
            })
            .collect())
    }

    async fn with_v2_tags(&self, named: Vec<(String, String)>) -> Result<Vec<Tagged>, AwsError> {
        let arns: Vec<String> = named.iter().map(|(arn, _)| arn.clone()).collect();
        let mut tags = self.v2_tags(&arns).await?;
        Ok(named
            .into_iter()
            .map(|(id, name)| Tagged { tags: tags.remove(&id).unwrap_or_default(), id, name })
            .collect())
    }

    /// This cluster's ELBv2 load balancers (every one of the region is read: ELBv2 cannot filter
    /// by tag).
    pub(crate) async fn load_balancers(&self, cluster: &str) -> Result<Vec<LoadBalancing>, AwsError> {
        let mut pages = self.v2.describe_load_balancers().page_size(DESCRIBE_PAGE).into_paginator().send();
        let mut named = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("DescribeLoadBalancers", e))?;
            for lb in page.load_balancers() {
                named.push((
                    lb.load_balancer_arn().unwrap_or_default().to_string(),
                    lb.load_balancer_name().unwrap_or_default().to_string(),
                ));
            }
        }
        Ok(judged(LbKind::LoadBalancer, self.with_v2_tags(named).await?, cluster))
    }

    /// This cluster's ELBv2 target groups.
    pub(crate) async fn target_groups(&self, cluster: &str) -> Result<Vec<LoadBalancing>, AwsError> {
        let mut pages = self.v2.describe_target_groups().page_size(DESCRIBE_PAGE).into_paginator().send();
        let mut named = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("DescribeTargetGroups", e))?;
            for tg in page.target_groups() {
                named.push((
                    tg.target_group_arn().unwrap_or_default().to_string(),
                    tg.target_group_name().unwrap_or_default().to_string(),
                ));
            }
        }
        Ok(judged(LbKind::TargetGroup, self.with_v2_tags(named).await?, cluster))
    }

    /// Whether an ELBv2 load balancer has deletion protection on (`deletion_protection.enabled`).
    /// One already gone has none.
    pub(crate) async fn deletion_protection(&self, arn: &str) -> Result<bool, AwsError> {
        match self.v2.describe_load_balancer_attributes().load_balancer_arn(arn).send().await {
            Ok(out) => Ok(out
                .attributes()
                .iter()
                .any(|a| a.key() == Some("deletion_protection.enabled") && a.value() == Some("true"))),
            Err(e) => {
                let e = self.err("DescribeLoadBalancerAttributes", e);
                if e.code() == Some("LoadBalancerNotFound") { Ok(false) } else { Err(e) }
            }
        }
    }

    /// This cluster's classic load balancers.
    pub(crate) async fn classic_load_balancers(&self, cluster: &str) -> Result<Vec<LoadBalancing>, AwsError> {
        let mut pages = self.classic.describe_load_balancers().page_size(DESCRIBE_PAGE).into_paginator().send();
        let mut names = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("DescribeLoadBalancers", e))?;
            names.extend(
                page.load_balancer_descriptions().iter().filter_map(|d| d.load_balancer_name()).map(str::to_string),
            );
        }
        let found = asked_around_the_gone(&names, |chunk| self.classic_tags_of(chunk)).await?;
        Ok(judged(LbKind::ClassicLoadBalancer, found, cluster))
    }

    async fn classic_tags_of(&self, names: Vec<String>) -> Result<Vec<Tagged>, AwsError> {
        let got = self
            .classic
            .describe_tags()
            .set_load_balancer_names(Some(names))
            .send()
            .await
            .map_err(|e| self.err("DescribeTags", e))?;
        Ok(got
            .tag_descriptions()
            .iter()
            .map(|d| {
                let name = d.load_balancer_name().unwrap_or_default().to_string();
                let tags =
                    d.tags().iter().map(|t| (t.key().to_string(), t.value().unwrap_or_default().to_string())).collect();
                Tagged { id: name.clone(), name, tags }
            })
            .collect())
    }
}

impl Ec2 {
    /// This cluster's cleanup controllers' security groups: EC2 narrows them to those tagged
    /// with the cluster by either controller, [`judge_load_balancing`] decides.
    pub(crate) async fn load_balancing_security_groups(&self, cluster: &str) -> Result<Vec<LoadBalancing>, AwsError> {
        let mut found: BTreeMap<String, Tagged> = BTreeMap::new();
        let key = crate::karpenter::cluster_tag_key(cluster);
        for (tag, value) in [(TAG_LBC_CLUSTER, cluster), (key.as_str(), "owned")] {
            for (id, name, tags) in self.security_groups_tagged(tag, value).await? {
                found.insert(id.clone(), Tagged { id, name, tags });
            }
        }
        Ok(judged(LbKind::SecurityGroup, found.into_values().collect(), cluster))
    }
}
