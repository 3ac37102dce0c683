//! IAM: the instance profiles Karpenter creates for EC2NodeClasses that use `spec.role`.

use super::AwsError;
use crate::karpenter;

/// An instance profile that belongs to the cluster's Karpenter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InstanceProfileInfo {
    /// Profile name.
    pub name: String,
    /// Profile path.
    pub path: String,
    /// Roles attached to it (removed before the profile can be deleted).
    pub roles: Vec<String>,
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

    /// The cluster's Karpenter instance profiles: under `/karpenter/<region>/<cluster>/` (1.7+)
    /// and, at path `/`, named `<cluster>_<hash>` (before 1.7).
    ///
    /// The path is filtered on the client side too: LocalStack ignores `PathPrefix` and returns
    /// every profile (design §5), and filtering twice is also correct on AWS.
    pub async fn cluster_instance_profiles(
        &self,
        region: &str,
        cluster: &str,
    ) -> Result<Vec<InstanceProfileInfo>, AwsError> {
        let prefix = karpenter::instance_profile_path_prefix(region, cluster);
        let legacy = karpenter::legacy_instance_profile_prefix(cluster);
        let mut out = Vec::new();
        for path_prefix in [prefix.as_str(), "/"] {
            let mut pages = self.client.list_instance_profiles().path_prefix(path_prefix).into_paginator().send();
            while let Some(page) = pages.next().await {
                let page = page.map_err(|e| self.err("ListInstanceProfiles", e))?;
                for p in page.instance_profiles() {
                    let name = p.instance_profile_name();
                    let path = p.path();
                    let ours = if path_prefix == "/" {
                        path == "/" && name.starts_with(&legacy)
                    } else {
                        path.starts_with(&prefix)
                    };
                    if ours && !out.iter().any(|o: &InstanceProfileInfo| o.name == name) {
                        out.push(InstanceProfileInfo {
                            name: name.to_string(),
                            path: path.to_string(),
                            roles: p.roles().iter().map(|r| r.role_name().to_string()).collect(),
                        });
                    }
                }
            }
        }
        Ok(out)
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

    /// Creates an instance profile at `path` (sandbox only: it plays Karpenter).
    pub async fn create_instance_profile(&self, name: &str, path: &str, role: Option<&str>) -> Result<(), AwsError> {
        self.client
            .create_instance_profile()
            .instance_profile_name(name)
            .path(path)
            .send()
            .await
            .map_err(|e| self.err("CreateInstanceProfile", e))?;
        if let Some(role) = role {
            self.client
                .add_role_to_instance_profile()
                .instance_profile_name(name)
                .role_name(role)
                .send()
                .await
                .map_err(|e| self.err("AddRoleToInstanceProfile", e))?;
        }
        Ok(())
    }
}
