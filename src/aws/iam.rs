//! IAM: the instance profiles Karpenter creates for EC2NodeClasses that use `spec.role`.

use std::collections::BTreeMap;

use super::AwsError;
use crate::karpenter;

/// IAM's largest page (`MaxItems` is 1 to 1000 on the List calls).
const IAM_MAX_ITEMS: i32 = 1000;

/// An instance profile that belongs to the cluster's Karpenter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InstanceProfileInfo {
    /// Profile name.
    pub name: String,
    /// Profile path.
    pub path: String,
    /// Roles attached to it (removed before the profile can be deleted).
    pub roles: Vec<String>,
    /// Why it is taken to be the cluster's Karpenter's (location; the tags are always required).
    pub evidence: karpenter::ProfileEvidence,
    /// The EC2NodeClass its `karpenter.k8s.aws/ec2nodeclass` tag names.
    pub nodeclass: String,
    /// All its tags (what a rehearsal seeds its copy with; not part of the report).
    #[serde(skip)]
    pub tags: BTreeMap<String, String>,
    /// When it was created, in seconds since the epoch (not part of the report).
    #[serde(skip)]
    pub created: Option<i64>,
}

/// The IAM client.
#[derive(Clone, Debug)]
pub struct Iam {
    client: aws_sdk_iam::Client,
    endpoint: String,
}

impl Iam {
    pub(crate) fn new(client: aws_sdk_iam::Client, endpoint: String) -> Iam {
        Iam { client, endpoint }
    }

    fn err<E, R>(&self, op: &'static str, e: aws_sdk_iam::error::SdkError<E, R>) -> AwsError
    where
        E: aws_sdk_iam::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug,
    {
        AwsError::from_sdk("iam", op, &self.endpoint, e)
    }

    /// The cluster's Karpenter instance profiles, each on evidence (README, "What a run does",
    /// verify): located where this cluster's Karpenter puts them
    /// ([`karpenter::instance_profile_location`]) and carrying every tag Karpenter's own IAM
    /// policy requires to delete one ([`karpenter::missing_instance_profile_tags`]), read with
    /// `ListInstanceProfileTags` because `ListInstanceProfiles` returns no tags. A candidate that
    /// lacks a tag is logged and left alone: it is reported by no one and deleted by no one.
    ///
    /// The path is filtered on the client side too: LocalStack ignores `PathPrefix` and returns
    /// every profile (design §5), and filtering twice is also correct on AWS.
    pub async fn cluster_instance_profiles(
        &self,
        region: &str,
        cluster: &str,
    ) -> Result<Vec<InstanceProfileInfo>, AwsError> {
        let prefix = karpenter::instance_profile_path_prefix(region, cluster);
        let mut candidates: Vec<(InstanceProfileInfo, String)> = Vec::new();
        for path_prefix in [prefix.as_str(), "/"] {
            for p in self.profiles_under(path_prefix).await? {
                let name = p.instance_profile_name();
                let Some(evidence) = karpenter::instance_profile_location(name, p.path(), cluster, region) else {
                    continue;
                };
                if candidates.iter().any(|(o, _)| o.name == name) {
                    continue;
                }
                candidates.push((profile_info(&p, evidence), cluster.to_string()));
            }
        }
        self.tagged_as_karpenters(candidates, region).await
    }

    /// Every instance profile Karpenter made for any cluster in `region`, each with the cluster
    /// its location names: under `/karpenter/<region>/<cluster>/` (≥ 1.7), or at `/` named
    /// `<cluster>_<digits>` (≤ 1.6) and tagged `topology.kubernetes.io/region=<region>`; every
    /// tag Karpenter's own IAM policy requires to delete one must name that cluster too. What
    /// `sweep` attributes; the tags decide in the end.
    pub async fn karpenter_instance_profiles_anywhere(
        &self,
        region: &str,
    ) -> Result<Vec<InstanceProfileInfo>, AwsError> {
        let prefix = format!("/karpenter/{region}/");
        let mut candidates: Vec<(InstanceProfileInfo, String)> = Vec::new();
        for path_prefix in [prefix.as_str(), "/"] {
            for p in self.profiles_under(path_prefix).await? {
                let (name, path) = (p.instance_profile_name(), p.path());
                let cluster = match path.strip_prefix(prefix.as_str()) {
                    Some(rest) => rest.split('/').next().unwrap_or_default().to_string(),
                    None if path == "/" => karpenter::legacy_profile_cluster(name).unwrap_or_default(),
                    None => String::new(),
                };
                if cluster.is_empty() || candidates.iter().any(|(o, _)| o.name == name) {
                    continue;
                }
                let Some(evidence) = karpenter::instance_profile_location(name, path, &cluster, region) else {
                    continue;
                };
                candidates.push((profile_info(&p, evidence), cluster));
            }
        }
        self.tagged_as_karpenters(candidates, region).await
    }

    /// Of `candidates` (each with the cluster its location names), those that carry every tag
    /// Karpenter's own IAM policy requires to delete one for that cluster, read with
    /// `ListInstanceProfileTags` (`ListInstanceProfiles` returns no tags). One that lacks a tag is
    /// logged and left alone: it is reported by no one and deleted by no one.
    async fn tagged_as_karpenters(
        &self,
        candidates: Vec<(InstanceProfileInfo, String)>,
        region: &str,
    ) -> Result<Vec<InstanceProfileInfo>, AwsError> {
        let mut out = Vec::new();
        for (mut profile, cluster) in candidates {
            let Some(tags) = self.instance_profile_tags(&profile.name).await? else {
                continue; // deleted since it was listed
            };
            let missing = karpenter::missing_instance_profile_tags(&tags, &cluster, region);
            if !missing.is_empty() {
                tracing::info!(
                    instance_profile = %profile.name,
                    path = %profile.path,
                    missing = %missing.join(", "),
                    "an instance profile where a cluster's Karpenter keeps its own lacks Karpenter's tags: not this tool's to report or delete"
                );
                continue;
            }
            profile.nodeclass = tags.get(karpenter::TAG_NODECLASS).cloned().unwrap_or_default();
            profile.tags = tags;
            out.push(profile);
        }
        Ok(out)
    }

    /// Every instance profile under `path_prefix`, all pages.
    async fn profiles_under(&self, path_prefix: &str) -> Result<Vec<aws_sdk_iam::types::InstanceProfile>, AwsError> {
        let mut out = Vec::new();
        let mut pages = self
            .client
            .list_instance_profiles()
            .path_prefix(path_prefix)
            .max_items(IAM_MAX_ITEMS)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.err("ListInstanceProfiles", e))?;
            out.extend(page.instance_profiles().iter().cloned());
        }
        Ok(out)
    }

    /// All tags of a profile, or `None` when it no longer exists.
    async fn instance_profile_tags(&self, name: &str) -> Result<Option<BTreeMap<String, String>>, AwsError> {
        let mut tags = BTreeMap::new();
        let mut pages = self
            .client
            .list_instance_profile_tags()
            .instance_profile_name(name)
            .max_items(IAM_MAX_ITEMS)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            match page {
                Ok(page) => tags.extend(page.tags().iter().map(|t| (t.key().to_string(), t.value().to_string()))),
                Err(e) => {
                    let e = self.err("ListInstanceProfileTags", e);
                    return if e.code() == Some("NoSuchEntity") { Ok(None) } else { Err(e) };
                }
            }
        }
        Ok(Some(tags))
    }

    /// Removes the profile's roles, then deletes it; a profile or role already gone counts as done.
    pub async fn delete_instance_profile(&self, profile: &InstanceProfileInfo) -> Result<(), AwsError> {
        for role in &profile.roles {
            if let Err(e) = self
                .client
                .remove_role_from_instance_profile()
                .instance_profile_name(&profile.name)
                .role_name(role)
                .send()
                .await
            {
                let e = self.err("RemoveRoleFromInstanceProfile", e);
                if e.code() != Some("NoSuchEntity") {
                    return Err(e);
                }
            }
        }
        match self.client.delete_instance_profile().instance_profile_name(&profile.name).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = self.err("DeleteInstanceProfile", e);
                if e.code() == Some("NoSuchEntity") { Ok(()) } else { Err(e) }
            }
        }
    }
}

/// A listed profile as the tool reports it, its tags not read yet.
fn profile_info(p: &aws_sdk_iam::types::InstanceProfile, evidence: karpenter::ProfileEvidence) -> InstanceProfileInfo {
    InstanceProfileInfo {
        name: p.instance_profile_name().to_string(),
        path: p.path().to_string(),
        roles: p.roles().iter().map(|r| r.role_name().to_string()).collect(),
        evidence,
        nodeclass: String::new(),
        tags: BTreeMap::new(),
        created: Some(p.create_date().secs()),
    }
}
