//! The EC2 proxy's IAM check: which caller sent a request (the access key of its SigV4
//! `Authorization` header), which resources the request acts on with their ARNs and current
//! tags (read from LocalStack directly), and the caller's policy's decision on each, so that the
//! proxy answers as AWS would: `UnauthorizedOperation` (EC2) or `AccessDenied` (IAM) when the
//! policy does not allow one of them.
//!
//! Resources per action, as the Service Authorization Reference lists them for the calls the
//! tool makes: `ec2:TerminateInstances` each `instance/<id>`, `ec2:DeleteLaunchTemplate` the
//! `launch-template/<id>`, `ec2:DeleteNetworkInterface` the `network-interface/<id>`, the IAM
//! instance-profile calls `instance-profile<path><name>`, `eks:DescribeCluster` the
//! `cluster/<name>`; `Describe*`/`List*` calls and any other
//! action are judged on `*` without tags. `sts:GetCallerIdentity` needs no permission. A resource
//! that does not exist is not judged: EC2 and IAM answer it with their NotFound error, which
//! LocalStack gives.

use std::collections::BTreeMap;

use crate::cloud::Cloud;
use crate::iampolicy::{Authorization, Decision, Policy};

/// A caller the proxy judges: its policy and the account its resources' ARNs name.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The identity policy attached to it.
    pub policy: Policy,
    /// Its account id (LocalStack's default account is `000000000000`).
    pub account: String,
    /// Its partition (`aws`).
    pub partition: String,
}

/// Who signed a request, from its SigV4 `Authorization` header
/// (`Credential=<key>/<date>/<region>/<service>/aws4_request`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The access key id.
    pub key: String,
    /// The region of the signature.
    pub region: String,
    /// The service of the signature (`ec2`, `iam`, `sts`).
    pub service: String,
}

impl Caller {
    /// Reads the caller from an `Authorization` header value.
    pub fn of(authorization: &str) -> Option<Caller> {
        let cred = authorization.split("Credential=").nth(1)?.split([',', ' ']).next()?;
        let mut parts = cred.split('/');
        let key = parts.next()?.to_string();
        let _date = parts.next()?;
        let region = parts.next()?.to_string();
        let service = parts.next()?.to_string();
        Some(Caller { key, region, service })
    }
}

/// A refusal: the action and the resource the policy does not allow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// `service:Action`.
    pub action: String,
    /// The resource's ARN (or `*`).
    pub resource: String,
}

/// The resources of a request the policy must allow, each with its ARN and tags.
async fn resources(
    cloud: &Cloud,
    p: &Principal,
    caller: &Caller,
    action: &str,
    params: &[(String, String)],
) -> Result<Vec<(String, BTreeMap<String, String>)>, String> {
    let values = |prefix: &str| -> Vec<String> {
        params
            .iter()
            .filter(|(k, _)| k == prefix || k.starts_with(&format!("{prefix}.")))
            .map(|(_, v)| v.clone())
            .collect()
    };
    let ec2_arn = |kind: &str, id: &str| format!("arn:{}:ec2:{}:{}:{kind}/{id}", p.partition, caller.region, p.account);
    let tags_of = |tags: &[aws_sdk_ec2::types::Tag]| -> BTreeMap<String, String> {
        tags.iter().filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or_default().to_string()))).collect()
    };
    let ec2 = cloud.ec2_sdk();
    let mut out = Vec::new();
    match (caller.service.as_str(), action) {
        ("ec2", "TerminateInstances") => {
            let ids = values("InstanceId");
            for chunk in ids.chunks(200) {
                let f =
                    aws_sdk_ec2::types::Filter::builder().name("instance-id").set_values(Some(chunk.to_vec())).build();
                let page = ec2.describe_instances().filters(f).send().await.map_err(|e| format!("{e:?}"))?;
                for i in page.reservations().iter().flat_map(|r| r.instances()) {
                    out.push((ec2_arn("instance", i.instance_id().unwrap_or_default()), tags_of(i.tags())));
                }
            }
        }
        ("ec2", "DeleteNetworkInterface") => {
            for id in values("NetworkInterfaceId") {
                let f = aws_sdk_ec2::types::Filter::builder().name("network-interface-id").values(&id).build();
                let page = ec2.describe_network_interfaces().filters(f).send().await.map_err(|e| format!("{e:?}"))?;
                for ni in page.network_interfaces() {
                    out.push((ec2_arn("network-interface", &id), tags_of(ni.tag_set())));
                }
            }
        }
        ("ec2", "DeleteLaunchTemplate") => {
            let mut req = ec2.describe_launch_templates();
            for id in values("LaunchTemplateId") {
                req = req.launch_template_ids(id);
            }
            for name in values("LaunchTemplateName") {
                req = req.launch_template_names(name);
            }
            // an unknown id or name is EC2's NotFound, answered by LocalStack
            if let Ok(page) = req.send().await {
                for lt in page.launch_templates() {
                    out.push((
                        ec2_arn("launch-template", lt.launch_template_id().unwrap_or_default()),
                        tags_of(lt.tags()),
                    ));
                }
            }
        }
        ("iam", "ListInstanceProfileTags" | "RemoveRoleFromInstanceProfile" | "DeleteInstanceProfile") => {
            for name in values("InstanceProfileName") {
                let Ok(got) = cloud.iam_sdk().get_instance_profile().instance_profile_name(&name).send().await else {
                    continue;
                };
                let path = got.instance_profile().map(|ip| ip.path().to_string()).unwrap_or_else(|| "/".into());
                let tags = cloud
                    .iam_sdk()
                    .list_instance_profile_tags()
                    .instance_profile_name(&name)
                    .send()
                    .await
                    .map(|t| t.tags().iter().map(|t| (t.key().to_string(), t.value().to_string())).collect())
                    .unwrap_or_default();
                out.push((format!("arn:{}:iam::{}:instance-profile{path}{name}", p.partition, p.account), tags));
            }
        }
        ("eks", "DescribeCluster") => {
            for name in values("name") {
                out.push((
                    format!("arn:{}:eks:{}:{}:cluster/{name}", p.partition, caller.region, p.account),
                    BTreeMap::new(),
                ));
            }
        }
        _ => out.push(("*".to_string(), BTreeMap::new())),
    }
    Ok(out)
}

/// The EKS operation of a REST-JSON request the tool makes, with the cluster it names:
/// `GET /clusters/{name}` is `DescribeCluster`.
pub fn eks_operation(method: &http::Method, path: &str) -> Option<(&'static str, String)> {
    let name = path.strip_prefix("/clusters/")?;
    (method == http::Method::GET && !name.is_empty() && !name.contains('/'))
        .then(|| ("DescribeCluster", name.to_string()))
}

/// Judges a request of `caller` for `action` with its query `params` against `p`'s policy:
/// `None` when it is allowed, else the first resource refused.
pub async fn judge(
    cloud: &Cloud,
    p: &Principal,
    caller: &Caller,
    action: &str,
    params: &[(String, String)],
) -> Result<Option<Denial>, String> {
    if caller.service == "sts" && action == "GetCallerIdentity" {
        return Ok(None);
    }
    let iam_action = format!("{}:{action}", caller.service);
    for (resource, tags) in resources(cloud, p, caller, action, params).await? {
        let req = Authorization { action: &iam_action, resource: &resource, region: &caller.region, tags: &tags };
        if p.policy.decide(&req) != Decision::Allow {
            return Ok(Some(Denial { action: iam_action, resource }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caller_is_read_from_the_signature() {
        let h = "AWS4-HMAC-SHA256 Credential=KTD7/20261125/us-west-2/ec2/aws4_request, SignedHeaders=host;x-amz-date, Signature=abc";
        assert_eq!(
            Caller::of(h),
            Some(Caller { key: "KTD7".into(), region: "us-west-2".into(), service: "ec2".into() })
        );
        assert_eq!(Caller::of("Bearer x"), None);
    }

    #[test]
    fn an_eks_describe_is_read_from_its_method_and_path() {
        assert_eq!(eks_operation(&http::Method::GET, "/clusters/prod"), Some(("DescribeCluster", "prod".into())));
        assert_eq!(eks_operation(&http::Method::DELETE, "/clusters/prod"), None);
        assert_eq!(eks_operation(&http::Method::GET, "/clusters/prod/node-groups"), None);
        assert_eq!(eks_operation(&http::Method::GET, "/"), None);
    }
}
