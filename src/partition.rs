//! AWS partitions, regions and zones: what the tool derives from a zone name, a region name or an
//! EKS ARN, for every partition (aws, aws-us-gov, aws-cn, the ISO partitions, the European
//! Sovereign Cloud) and every zone kind (Availability, Local and Wavelength Zones).

/// The region an Availability, Local or Wavelength Zone belongs to: the zone name up to and
/// including the first dash-separated part that starts with a digit, cut after that part's
/// digits. `us-west-2a` → `us-west-2`, `us-gov-west-1a` → `us-gov-west-1`, `cn-north-1b` →
/// `cn-north-1`, Local Zone `us-west-2-lax-1a` → `us-west-2`, Wavelength Zone
/// `us-east-1-wl1-bos-wlz-1` → `us-east-1`. `None` when the name has no such part.
///
/// Counting parts (the old rule took the first three) breaks on every partition whose region
/// names have four (`us-gov-west-1`, `us-iso-east-1`, `eusc-de-east-1`).
pub(crate) fn region_of_zone(zone: &str) -> Option<String> {
    let mut region: Vec<&str> = Vec::new();
    for part in zone.split('-') {
        if part.starts_with(|c: char| c.is_ascii_digit()) {
            let digits = part.bytes().take_while(u8::is_ascii_digit).count();
            if region.is_empty() {
                return None;
            }
            region.push(&part[..digits]);
            return Some(region.join("-"));
        }
        if part.is_empty() {
            return None;
        }
        region.push(part);
    }
    None
}

/// The partition a region is in, as ARNs spell it.
pub fn partition_of_region(region: &str) -> &'static str {
    const PREFIXES: [(&str, &str); 7] = [
        ("us-gov-", "aws-us-gov"),
        ("cn-", "aws-cn"),
        ("us-isob-", "aws-iso-b"),
        ("us-isof-", "aws-iso-f"),
        ("eu-isoe-", "aws-iso-e"),
        ("us-iso-", "aws-iso"),
        ("eusc-", "aws-eusc"),
    ];
    PREFIXES.iter().find(|(p, _)| region.starts_with(p)).map_or("aws", |(_, partition)| partition)
}

/// An EKS cluster ARN: `arn:<partition>:eks:<region>:<account>:cluster/<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EksClusterArn {
    /// `aws`, `aws-us-gov`, `aws-cn`, ...
    pub partition: String,
    /// The cluster's region.
    pub region: String,
    /// The account id.
    pub account: String,
    /// The cluster name.
    pub cluster: String,
}

impl EksClusterArn {
    /// Parses an EKS cluster ARN of any partition (what `aws eks update-kubeconfig` names the
    /// context); `None` for anything else.
    pub(crate) fn parse(arn: &str) -> Option<EksClusterArn> {
        let mut parts = arn.splitn(6, ':');
        let (Some("arn"), Some(partition), Some("eks"), Some(region), Some(account), Some(resource)) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        let cluster = resource.strip_prefix("cluster/")?;
        if !partition.starts_with("aws") || region.is_empty() || account.is_empty() || cluster.is_empty() {
            return None;
        }
        Some(EksClusterArn {
            partition: partition.to_string(),
            region: region.to_string(),
            account: account.to_string(),
            cluster: cluster.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_of_every_partition_and_kind_name_their_region() {
        for (zone, region) in [
            ("us-west-2a", "us-west-2"),
            ("eu-central-1b", "eu-central-1"),
            ("ap-southeast-5c", "ap-southeast-5"),
            ("us-gov-west-1a", "us-gov-west-1"),
            ("us-gov-east-1c", "us-gov-east-1"),
            ("cn-north-1a", "cn-north-1"),
            ("cn-northwest-1b", "cn-northwest-1"),
            ("us-iso-east-1a", "us-iso-east-1"),
            ("us-isob-east-1a", "us-isob-east-1"),
            ("eusc-de-east-1a", "eusc-de-east-1"),
            ("us-west-2-lax-1a", "us-west-2"),
            ("us-east-1-bos-1a", "us-east-1"),
            ("us-east-1-wl1-bos-wlz-1", "us-east-1"),
            ("ap-northeast-1-wl1-nrt-wlz-1", "ap-northeast-1"),
        ] {
            assert_eq!(region_of_zone(zone).as_deref(), Some(region), "{zone}");
        }
        for bad in ["", "us", "us-west", "1a", "us--2a", "-1a"] {
            assert_eq!(region_of_zone(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn regions_map_to_their_partitions() {
        for (region, partition) in [
            ("us-west-2", "aws"),
            ("us-east-1", "aws"),
            ("us-gov-west-1", "aws-us-gov"),
            ("cn-north-1", "aws-cn"),
            ("us-iso-east-1", "aws-iso"),
            ("us-isob-east-1", "aws-iso-b"),
            ("eusc-de-east-1", "aws-eusc"),
        ] {
            assert_eq!(partition_of_region(region), partition, "{region}");
        }
    }

    #[test]
    fn eks_arns_of_every_partition_parse() {
        let gov = EksClusterArn::parse("arn:aws-us-gov:eks:us-gov-west-1:123456789012:cluster/prod").unwrap();
        assert_eq!(
            gov,
            EksClusterArn {
                partition: "aws-us-gov".into(),
                region: "us-gov-west-1".into(),
                account: "123456789012".into(),
                cluster: "prod".into()
            }
        );
        let cn = EksClusterArn::parse("arn:aws-cn:eks:cn-north-1:123456789012:cluster/a_b").unwrap();
        assert_eq!((cn.partition.as_str(), cn.cluster.as_str()), ("aws-cn", "a_b"));
        assert!(EksClusterArn::parse("arn:aws:eks:us-west-2:123456789012:cluster/x").is_some());
        for bad in [
            "prod",
            "arn:aws:iam::123456789012:role/x",
            "arn:aws:eks:us-west-2:1:nodegroup/x",
            "arn:aws:eks::1:cluster/",
        ] {
            assert_eq!(EksClusterArn::parse(bad), None, "{bad}");
        }
    }
}
