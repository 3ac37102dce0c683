//! `sweep`: what Karpenter left behind, region by region, by clusters that may no longer exist.
//! Each resource is attributed to the cluster its own tags name; each cluster gets one verdict,
//! the first that matches: protected, uncertain, active, too young, orphaned. Only orphans are
//! reclaimable. `verify --reclaim` of a cluster EKS no longer knows takes the same verdict, so the
//! two paths cannot drift apart. Pure: the drivers read AWS and hand the facts in.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::karpenter;

/// A tag that keeps a resource, and with it its whole cluster, out of every sweep (any value).
pub(crate) const TAG_KEEP: &str = "karpenter-teardown.io/keep";

/// What kind of resource a sweep found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Kind {
    Instance,
    LaunchTemplate,
    InstanceProfile,
}

/// One resource of Karpenter's, as AWS described it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Found {
    pub(crate) kind: Kind,
    /// Instance id, launch template id, instance profile name.
    pub(crate) id: String,
    /// The region it is in (an instance profile: the region its path or tag names).
    pub(crate) region: String,
    /// Its tags.
    #[serde(skip)]
    pub(crate) tags: BTreeMap<String, String>,
    /// An instance profile's path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) path: Option<String>,
    /// When it was launched or created, in seconds since the epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) created: Option<i64>,
    /// An instance's type.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) instance_type: Option<String>,
    /// The AWS service that manages an instance (EKS Auto Mode's): never swept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) managed_by: Option<String>,
}

/// The cluster names a resource's own tags (and an instance profile's path) give, one per
/// generation of Karpenter that wrote them: `eks:eks-cluster-name` (1.0+),
/// `kubernetes.io/cluster/<name>=owned` (every generation), `karpenter.sh/managed-by` (before
/// 1.0), `karpenter.k8s.aws/cluster` (1.0's launch templates), `/karpenter/<region>/<name>/`.
pub(crate) fn cluster_names(found: &Found) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for key in [karpenter::TAG_EKS_CLUSTER, karpenter::TAG_MANAGED_BY, karpenter::TAG_LEGACY_CLUSTER] {
        if let Some(v) = found.tags.get(key).filter(|v| !v.is_empty()) {
            names.insert(v.clone());
        }
    }
    for (k, v) in &found.tags {
        if let Some(name) = k.strip_prefix("kubernetes.io/cluster/")
            && v == "owned"
            && !name.is_empty()
        {
            names.insert(name.to_string());
        }
    }
    if let Some(rest) = found.path.as_deref().and_then(|p| p.strip_prefix("/karpenter/")) {
        let mut parts = rest.split('/');
        if let (Some(_region), Some(name)) = (parts.next(), parts.next())
            && !name.is_empty()
        {
            names.insert(name.to_string());
        }
    }
    names
}

/// Whose a resource is, by its own tags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Every tag that names a cluster names this one.
    Cluster(String),
    /// Its tags name several clusters.
    Disagree(Vec<String>),
    /// No tag names a cluster.
    Unnamed,
}

pub(crate) fn owner_of(found: &Found) -> Owner {
    let names = cluster_names(found);
    match names.len() {
        0 => Owner::Unnamed,
        1 => names.into_iter().next().map_or(Owner::Unnamed, Owner::Cluster),
        _ => Owner::Disagree(names.into_iter().collect()),
    }
}

/// The resources of one region, grouped under the cluster their tags name; resources whose tags
/// disagree are grouped under every name they give, joined with ` | `, and those that name none
/// under `(no cluster tag)`: both groups can only be uncertain.
pub(crate) fn group(found: Vec<Found>) -> BTreeMap<(String, String), Group> {
    let mut out: BTreeMap<(String, String), Group> = BTreeMap::new();
    for f in found {
        let (name, disagree) = match owner_of(&f) {
            Owner::Cluster(c) => (c, false),
            Owner::Disagree(names) => (names.join(" | "), true),
            Owner::Unnamed => (UNNAMED.to_string(), true),
        };
        let g = out.entry((f.region.clone(), name)).or_default();
        g.disagree |= disagree;
        g.found.push(f);
    }
    out
}

/// The group of resources no tag attributes to a cluster.
const UNNAMED: &str = "(no cluster tag)";

/// The resources of one cluster in one region.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) found: Vec<Found>,
    /// Some resource's tags disagree on the cluster, or name none.
    pub(crate) disagree: bool,
}

/// What EKS says of a cluster name in a region, for these credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EksAnswer {
    /// It exists (`ACTIVE`, `CREATING`, `UPDATING`, `DELETING`, ...), created at `created`.
    Exists { status: String, created: Option<i64> },
    /// `DescribeCluster` answered `ResourceNotFoundException`.
    NotFound,
    /// No answer that can be relied on (access denied, throttled past retries, a region not
    /// enabled), and why.
    Unknown(String),
}

/// A cluster's verdict, first match wins. Only [`Verdict::Orphaned`] is reclaimable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", content = "why", rename_all = "kebab-case")]
pub(crate) enum Verdict {
    /// A resource carries [`TAG_KEEP`].
    Protected(String),
    /// The tags disagree, or EKS could not answer: never taken for absent.
    Uncertain(String),
    /// EKS has the cluster: its own Karpenter, or `run`, owns it.
    Active(String),
    /// Something of it is newer than `--min-age`.
    TooYoung(String),
    /// EKS answers not found, in the region the resources are in, for these credentials, and
    /// every other check passed.
    Orphaned(String),
}

impl Verdict {
    /// Its name in the table and the report.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Verdict::Protected(_) => "protected",
            Verdict::Uncertain(_) => "uncertain",
            Verdict::Active(_) => "active",
            Verdict::TooYoung(_) => "too-young",
            Verdict::Orphaned(_) => "orphaned",
        }
    }

    /// Why.
    pub(crate) fn why(&self) -> &str {
        match self {
            Verdict::Protected(w)
            | Verdict::Uncertain(w)
            | Verdict::Active(w)
            | Verdict::TooYoung(w)
            | Verdict::Orphaned(w) => w,
        }
    }
}

/// Whether the cluster is shown to have run on EKS: only then does EKS's "not found" prove it
/// gone. A self-managed Karpenter cluster on EC2 tags its compute as an EKS cluster's does, and
/// EKS has never heard of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RanOnEks {
    /// The user data of one of its instances or launch templates names an EKS API endpoint.
    Shown(String),
    /// Nothing read shows it.
    NotShown,
    /// The user named the cluster with `--not-eks`: EKS's answer is taken as it is.
    Waived,
}

/// The EKS API endpoint user data names, if any: Karpenter writes the cluster's endpoint into
/// every AMI family's bootstrap (AL2 `--apiserver-endpoint`, AL2023 `apiServerEndpoint`,
/// Bottlerocket `api-server`, Windows `-APIServerEndpoint`), and an EKS cluster's is
/// `https://<id>.<zone>.<region>.eks.amazonaws.com` (`.amazonaws.com.cn` in China).
pub(crate) fn eks_endpoint_in(user_data: &str) -> Option<String> {
    let mut rest = user_data;
    while let Some(at) = rest.find("https://") {
        let url = &rest[at..];
        let end = url
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '<' | '>' | ',' | ';'))
            .unwrap_or(url.len());
        let url = &url[..end];
        let host = url["https://".len()..].split(['/', ':']).next().unwrap_or_default();
        if host.ends_with(".eks.amazonaws.com") || host.ends_with(".eks.amazonaws.com.cn") {
            return Some(url.to_string());
        }
        rest = &rest[at + "https://".len()..];
    }
    None
}

/// What a verdict weighs besides the resources and EKS's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rules {
    /// Now, in seconds since the epoch.
    pub(crate) now: i64,
    /// `--min-age`, in seconds.
    pub(crate) min_age: i64,
}

/// The verdict on cluster `name`'s `group` in `region`, given EKS's `eks` answer and whether
/// the cluster is shown to have run on EKS (`ran`; read only for what would otherwise be an
/// orphan: [`RanOnEks::Waived`] judges as if shown).
pub(crate) fn verdict(
    name: &str,
    region: &str,
    group: &Group,
    eks: &EksAnswer,
    rules: Rules,
    ran: &RanOnEks,
) -> Verdict {
    if let Some(kept) = group.found.iter().find(|f| f.tags.contains_key(TAG_KEEP)) {
        return Verdict::Protected(format!("{} {} carries {TAG_KEEP}", kind_name(kept.kind), kept.id));
    }
    if group.disagree {
        let odd: Vec<String> = group
            .found
            .iter()
            .filter(|f| !matches!(owner_of(f), Owner::Cluster(_)))
            .map(|f| format!("{} {}", kind_name(f.kind), f.id))
            .collect();
        return Verdict::Uncertain(format!("the tags of {} name no single cluster", odd.join(", ")));
    }
    if let Some(managed) = group.found.iter().find(|f| f.managed_by.is_some()) {
        return Verdict::Uncertain(format!(
            "instance {} is managed by {} (EKS Auto Mode's, not a self-managed Karpenter's)",
            managed.id,
            managed.managed_by.as_deref().unwrap_or_default()
        ));
    }
    match eks {
        EksAnswer::Unknown(why) => {
            return Verdict::Uncertain(format!("EKS could not say whether cluster {name} exists in {region}: {why}"));
        }
        EksAnswer::Exists { status, created } => {
            let earlier = created.map_or(0, |c| {
                group.found.iter().filter(|f| f.kind == Kind::Instance && f.created.is_some_and(|l| l < c)).count()
            });
            let incarnation = if earlier > 0 {
                format!(
                    "; {earlier} instance(s) launched before it was created are an earlier incarnation's, left to `verify --reclaim` of the live cluster"
                )
            } else {
                String::new()
            };
            return Verdict::Active(format!("EKS has cluster {name} in {region} ({status}){incarnation}"));
        }
        EksAnswer::NotFound => {}
    }
    if let Some(unknown) = group.found.iter().find(|f| f.created.is_none()) {
        return Verdict::TooYoung(format!(
            "{} {} has no creation time: its age cannot be told",
            kind_name(unknown.kind),
            unknown.id
        ));
    }
    let youngest = group.found.iter().filter_map(|f| f.created.map(|c| (c, f))).max_by_key(|(c, _)| *c);
    if let Some((created, f)) = youngest
        && rules.now - created < rules.min_age
    {
        return Verdict::TooYoung(format!(
            "{} {} is {} old, younger than --min-age {}",
            kind_name(f.kind),
            f.id,
            humantime::format_duration(std::time::Duration::from_secs((rules.now - created).max(0) as u64)),
            humantime::format_duration(std::time::Duration::from_secs(rules.min_age.max(0) as u64))
        ));
    }
    match ran {
        RanOnEks::NotShown => Verdict::Uncertain(format!(
            "EKS has no cluster {name} in {region}, and nothing shows it ran on EKS (no instance's or launch \
             template's user data names an EKS endpoint): a self-managed cluster cannot be proven gone through \
             EKS; name it with --cluster {name} --not-eks if it is gone"
        )),
        RanOnEks::Shown(endpoint) => Verdict::Orphaned(format!(
            "EKS has no cluster {name} in {region} for these credentials, and its nodes joined the EKS endpoint {endpoint}"
        )),
        RanOnEks::Waived => Verdict::Orphaned(format!(
            "EKS has no cluster {name} in {region} for these credentials (--not-eks: not shown to have run on EKS)"
        )),
    }
}

/// The verdict on what `verify --reclaim` found of the named cluster `name`, which EKS no longer
/// has in `region`: the sweep's rules, with every resource's tags required to name that cluster
/// alone. Only [`Verdict::Orphaned`] may be reclaimed.
pub(crate) fn verdict_of_named(name: &str, region: &str, found: Vec<Found>, rules: Rules) -> Verdict {
    let groups = group(found);
    if let Some(((_, other), g)) = groups.iter().find(|((_, n), _)| n != name) {
        let ids: Vec<String> = g.found.iter().map(|f| format!("{} {}", kind_name(f.kind), f.id)).collect();
        return Verdict::Uncertain(format!("the tags of {} name {other}, not {name} alone", ids.join(", ")));
    }
    // the user named the cluster, and `verify` proved EKS's answer for it
    match groups.into_values().next() {
        Some(g) => verdict(name, region, &g, &EksAnswer::NotFound, rules, &RanOnEks::Waived),
        None => Verdict::Orphaned(format!("nothing of cluster {name} is left in {region}")),
    }
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Instance => "instance",
        Kind::LaunchTemplate => "launch template",
        Kind::InstanceProfile => "instance profile",
    }
}

/// Tags whose values differ from one machine of a pool to the next: an IAM condition on their
/// values would be unusual, and asking EC2 once per value would ask once per instance. Whether
/// they are there is kept (a `Null` condition reads just that: a launch in flight has no
/// `karpenter.sh/nodeclaim` yet).
const PER_MACHINE_TAGS: [&str; 2] = ["Name", karpenter::TAG_NODECLAIM];

/// One instance for each kind EC2's dry run could answer differently for under a policy
/// conditioned on resource tags, the zone, the instance type or the market: instances with the
/// same tags (the per-machine ones by their presence only), in one zone, of one type, Spot or
/// on demand alike, are asked about once. Asking about all of them would spend EC2's
/// `TerminateInstances` resource bucket (1,000 instances, 20 a second) on dry runs before the
/// first real termination: 5,000 orphans would be throttled outright.
pub(crate) fn dry_run_sample<'a, T>(instances: &'a [T], kind: impl Fn(&'a T) -> InstanceKind<'a>) -> Vec<&'a T> {
    let mut seen = BTreeSet::new();
    instances
        .iter()
        .filter(|i| {
            let k = kind(i);
            let tags: Vec<(&str, &str)> = k
                .tags
                .iter()
                .map(|(k, v)| (k.as_str(), if PER_MACHINE_TAGS.contains(&k.as_str()) { "" } else { v.as_str() }))
                .collect();
            seen.insert((k.zone, k.instance_type, k.market, tags))
        })
        .collect()
}

/// What an IAM policy could tell instances apart by ([`dry_run_sample`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct InstanceKind<'a> {
    pub(crate) zone: &'a str,
    pub(crate) instance_type: Option<&'a str>,
    /// `spot`, or `None` on demand.
    pub(crate) market: Option<&'a str>,
    pub(crate) tags: &'a BTreeMap<String, String>,
}

/// One instance as its hourly cost needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Billed<'a> {
    pub(crate) instance_type: Option<&'a str>,
    /// EC2's `InstanceLifecycle`: `spot`, `capacity-block`, or `None` on demand.
    pub(crate) market: Option<&'a str>,
    /// Its zone (Spot prices are per zone).
    pub(crate) zone: &'a str,
    /// Pending or running: what bills compute (a stopped instance bills its volumes only).
    pub(crate) running: bool,
}

/// Which price an instance costs: on demand by type, Spot by type and zone.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct PriceKey {
    pub(crate) instance_type: String,
    pub(crate) spot_zone: Option<String>,
}

impl PriceKey {
    /// The price `b` costs, or why it has none to ask for.
    fn of(b: &Billed<'_>) -> Result<PriceKey, String> {
        let instance_type = b.instance_type.ok_or("EC2 gave no instance type")?.to_string();
        match b.market {
            None => Ok(PriceKey { instance_type, spot_zone: None }),
            Some("spot") => Ok(PriceKey { instance_type, spot_zone: Some(b.zone.to_string()) }),
            // a Capacity Block is paid for up front, per reservation, not by the hour used
            Some(other) => Err(format!("a {other} instance has no hourly price")),
        }
    }
}

/// The prices `instances` need asked for: one per type on demand, one per type and zone on Spot.
pub(crate) fn price_keys(instances: &[Billed<'_>]) -> BTreeSet<PriceKey> {
    instances.iter().filter(|b| b.running).filter_map(|b| PriceKey::of(b).ok()).collect()
}

/// What a cluster's running instances cost an hour, by AWS's prices. Informative only: no
/// verdict and no exit code depends on it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct HourlyCost {
    /// The hourly price in US dollars of the running instances that have one.
    pub(crate) usd: f64,
    /// How many running instances are in `usd`.
    pub(crate) priced: usize,
    /// How many running instances have no price, and why.
    pub(crate) unpriced: usize,
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub(crate) why_unpriced: BTreeSet<String>,
}

impl HourlyCost {
    /// The table's cell: `-` with nothing running, a sum only when every running instance is
    /// priced, else a lower bound or `unknown`.
    pub(crate) fn cell(&self) -> String {
        match (self.priced, self.unpriced) {
            (0, 0) => "-".into(),
            (_, 0) => format!("${:.2}/h", self.usd),
            (0, _) => "unknown".into(),
            (_, n) => format!(">= ${:.2}/h, {n} unpriced", self.usd),
        }
    }
}

/// Sums `instances`' hourly prices from `prices` (each a price, or why AWS gave none).
pub(crate) fn hourly_cost(instances: &[Billed<'_>], prices: &BTreeMap<PriceKey, Result<f64, String>>) -> HourlyCost {
    let mut cost = HourlyCost::default();
    for b in instances.iter().filter(|b| b.running) {
        let price =
            PriceKey::of(b).and_then(|key| prices.get(&key).cloned().unwrap_or_else(|| Err("not asked".to_string())));
        match price {
            Ok(usd) => {
                cost.usd += usd;
                cost.priced += 1;
            }
            Err(why) => {
                cost.unpriced += 1;
                cost.why_unpriced.insert(why);
            }
        }
    }
    cost
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(kind: Kind, id: &str, tags: &[(&str, &str)], created: Option<i64>) -> Found {
        Found {
            kind,
            id: id.into(),
            region: "eu-west-1".into(),
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            path: None,
            created,
            instance_type: Some("m5.large".into()),
            managed_by: None,
        }
    }

    fn tags_of(cluster: &str) -> Vec<(String, String)> {
        vec![
            (karpenter::TAG_EKS_CLUSTER.into(), cluster.into()),
            (format!("kubernetes.io/cluster/{cluster}"), "owned".into()),
            (karpenter::TAG_NODEPOOL.into(), "default".into()),
        ]
    }

    fn instance(id: &str, cluster: &str, created: i64) -> Found {
        let tags = tags_of(cluster);
        let tags: Vec<(&str, &str)> = tags.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        found(Kind::Instance, id, &tags, Some(created))
    }

    const DAY: i64 = 86_400;
    const NOW: i64 = 100 * DAY;
    const RULES: Rules = Rules { now: NOW, min_age: DAY };
    const SHOWN: RanOnEks = RanOnEks::Waived;

    fn one(f: Vec<Found>) -> Group {
        let groups = group(f);
        assert_eq!(groups.len(), 1, "{groups:?}");
        groups.into_values().next().unwrap()
    }

    #[test]
    fn every_generation_of_tags_names_its_cluster() {
        let v1 = instance("i-1", "prod", NOW - 2 * DAY);
        assert_eq!(owner_of(&v1), Owner::Cluster("prod".into()));
        let pre_1_0 = found(
            Kind::Instance,
            "i-2",
            &[
                ("karpenter.sh/managed-by", "old"),
                ("kubernetes.io/cluster/old", "owned"),
                ("karpenter.sh/nodepool", "x"),
            ],
            None,
        );
        assert_eq!(owner_of(&pre_1_0), Owner::Cluster("old".into()));
        let lt_1_0 = found(Kind::LaunchTemplate, "lt-1", &[("karpenter.k8s.aws/cluster", "mid")], None);
        assert_eq!(owner_of(&lt_1_0), Owner::Cluster("mid".into()));
        let profile = Found {
            path: Some("/karpenter/eu-west-1/new/abc/".into()),
            ..found(Kind::InstanceProfile, "new_1", &[("kubernetes.io/cluster/new", "owned")], None)
        };
        assert_eq!(owner_of(&profile), Owner::Cluster("new".into()));
        // `shared` is not ownership
        let shared = found(Kind::Instance, "i-3", &[("kubernetes.io/cluster/x", "shared")], None);
        assert_eq!(owner_of(&shared), Owner::Unnamed);
        let torn = found(
            Kind::Instance,
            "i-4",
            &[(karpenter::TAG_EKS_CLUSTER, "a"), ("kubernetes.io/cluster/b", "owned")],
            Some(NOW - 2 * DAY),
        );
        assert_eq!(owner_of(&torn), Owner::Disagree(vec!["a".into(), "b".into()]));
    }

    #[test]
    fn one_verdict_per_cluster_first_match_wins() {
        let old = one(vec![instance("i-1", "gone", NOW - 3 * DAY)]);
        assert!(matches!(
            verdict("gone", "eu-west-1", &old, &EksAnswer::NotFound, RULES, &SHOWN),
            Verdict::Orphaned(_)
        ));
        // EKS cannot answer: uncertain, never absent
        let denied = EksAnswer::Unknown("AccessDeniedException".into());
        assert!(matches!(verdict("gone", "eu-west-1", &old, &denied, RULES, &SHOWN), Verdict::Uncertain(_)));
        // EKS has it: active, and an earlier incarnation's instances are named as such
        let live = EksAnswer::Exists { status: "ACTIVE".into(), created: Some(NOW - DAY) };
        let v = verdict("gone", "eu-west-1", &old, &live, RULES, &SHOWN);
        assert!(matches!(&v, Verdict::Active(w) if w.contains("earlier incarnation")), "{v:?}");
        // young: one resource newer than --min-age holds the whole cluster back
        let young = one(vec![instance("i-1", "gone", NOW - 3 * DAY), instance("i-2", "gone", NOW - 60)]);
        let v = verdict("gone", "eu-west-1", &young, &EksAnswer::NotFound, RULES, &SHOWN);
        assert!(matches!(&v, Verdict::TooYoung(w) if w.contains("i-2")), "{v:?}");
        // an age that cannot be told is not old
        let mut unknown = instance("i-3", "gone", 0);
        unknown.created = None;
        let v = verdict("gone", "eu-west-1", &one(vec![unknown]), &EksAnswer::NotFound, RULES, &SHOWN);
        assert!(matches!(v, Verdict::TooYoung(_)), "{v:?}");
        // protected beats everything, whatever EKS says
        let mut kept = instance("i-4", "gone", NOW - 3 * DAY);
        kept.tags.insert(TAG_KEEP.into(), String::new());
        let g = one(vec![kept, instance("i-5", "gone", NOW - 3 * DAY)]);
        assert!(matches!(verdict("gone", "eu-west-1", &g, &EksAnswer::NotFound, RULES, &SHOWN), Verdict::Protected(_)));
        // an EKS Auto Mode instance is never a self-managed Karpenter's orphan
        let mut managed = instance("i-6", "gone", NOW - 3 * DAY);
        managed.managed_by = Some("eks.amazonaws.com".into());
        let v = verdict("gone", "eu-west-1", &one(vec![managed]), &EksAnswer::NotFound, RULES, &SHOWN);
        assert!(matches!(v, Verdict::Uncertain(_)), "{v:?}");
    }

    #[test]
    fn eks_not_knowing_a_cluster_proves_it_gone_only_when_it_ran_on_eks() {
        let old = one(vec![instance("i-1", "gone", NOW - 3 * DAY)]);
        let at = |ran: &RanOnEks| verdict("gone", "eu-west-1", &old, &EksAnswer::NotFound, RULES, ran);
        assert!(matches!(at(&RanOnEks::NotShown), Verdict::Uncertain(w) if w.contains("--not-eks")));
        let shown = RanOnEks::Shown("https://ABC.gr7.eu-west-1.eks.amazonaws.com".into());
        assert!(matches!(at(&shown), Verdict::Orphaned(w) if w.contains("ABC.gr7")));
        assert!(matches!(at(&RanOnEks::Waived), Verdict::Orphaned(_)));
        // every AMI family's bootstrap names the endpoint its own way
        let al2 = "#!/bin/bash\n/etc/eks/bootstrap.sh 'gone' --apiserver-endpoint 'https://ABC.gr7.eu-west-1.eks.amazonaws.com' --b64-cluster-ca 'x'";
        let al2023 = "apiVersion: node.eks.aws/v1alpha1\nkind: NodeConfig\nspec:\n  cluster:\n    apiServerEndpoint: https://ABC.yl4.eu-west-1.eks.amazonaws.com\n";
        let bottlerocket = "[settings.kubernetes]\napi-server = \"https://ABC.sk1.cn-north-1.eks.amazonaws.com.cn\"\n";
        assert_eq!(eks_endpoint_in(al2).as_deref(), Some("https://ABC.gr7.eu-west-1.eks.amazonaws.com"));
        assert_eq!(eks_endpoint_in(al2023).as_deref(), Some("https://ABC.yl4.eu-west-1.eks.amazonaws.com"));
        assert_eq!(eks_endpoint_in(bottlerocket).as_deref(), Some("https://ABC.sk1.cn-north-1.eks.amazonaws.com.cn"));
        // a self-managed control plane, or a look-alike host, is no EKS endpoint
        assert_eq!(eks_endpoint_in("api-server = \"https://k8s.internal.example:6443\""), None);
        assert_eq!(eks_endpoint_in("https://eks.amazonaws.com.evil.example/"), None);
        assert_eq!(eks_endpoint_in(""), None);
    }

    #[test]
    fn disagreeing_tags_make_their_own_uncertain_group() {
        let torn = found(
            Kind::Instance,
            "i-4",
            &[(karpenter::TAG_EKS_CLUSTER, "a"), ("kubernetes.io/cluster/b", "owned")],
            Some(NOW - 3 * DAY),
        );
        let groups = group(vec![torn, instance("i-1", "a", NOW - 3 * DAY)]);
        assert_eq!(groups.len(), 2, "{groups:?}");
        let key = ("eu-west-1".to_string(), "a | b".to_string());
        let g = &groups[&key];
        assert!(g.disagree);
        let v = verdict(&key.1, "eu-west-1", g, &EksAnswer::NotFound, RULES, &SHOWN);
        assert!(matches!(&v, Verdict::Uncertain(w) if w.contains("i-4")), "{v:?}");
        // the cluster the tags agree on is judged on its own resources
        let a = &groups[&("eu-west-1".to_string(), "a".to_string())];
        assert!(matches!(verdict("a", "eu-west-1", a, &EksAnswer::NotFound, RULES, &SHOWN), Verdict::Orphaned(_)));
    }

    #[test]
    fn the_hourly_cost_sums_running_instances_and_says_what_it_could_not_price() {
        let billed = |t: Option<&'static str>, spot: Option<&'static str>, running: bool| Billed {
            instance_type: t,
            market: spot.map(|_| "spot"),
            zone: spot.unwrap_or("us-west-2a"),
            running,
        };
        let instances = [
            billed(Some("m5.large"), None, true),
            billed(Some("m5.large"), None, true),
            billed(Some("m5.large"), Some("us-west-2a"), true),
            billed(Some("m5.large"), Some("us-west-2b"), true),
            billed(Some("c5.xlarge"), None, false),
            billed(None, None, true),
            Billed { market: Some("capacity-block"), ..billed(Some("p5.48xlarge"), None, true) },
        ];
        let keys = price_keys(&instances);
        let key = |t: &str, z: Option<&str>| PriceKey { instance_type: t.into(), spot_zone: z.map(str::to_string) };
        assert_eq!(
            keys.into_iter().collect::<Vec<_>>(),
            [key("m5.large", None), key("m5.large", Some("us-west-2a")), key("m5.large", Some("us-west-2b"))],
            "one price per type on demand, per type and zone on Spot; none for what is stopped"
        );
        let mut prices = BTreeMap::new();
        prices.insert(key("m5.large", None), Ok(0.096));
        prices.insert(key("m5.large", Some("us-west-2a")), Ok(0.04));
        prices.insert(key("m5.large", Some("us-west-2b")), Err("no Spot price for us-west-2b".to_string()));
        let cost = hourly_cost(&instances, &prices);
        assert_eq!((cost.priced, cost.unpriced), (3, 3));
        assert!((cost.usd - 0.232).abs() < 1e-9, "{}", cost.usd);
        assert_eq!(cost.why_unpriced.len(), 3, "{:?}", cost.why_unpriced);
        assert!(cost.why_unpriced.iter().any(|w| w.contains("capacity-block")), "{:?}", cost.why_unpriced);
        assert_eq!(cost.cell(), ">= $0.23/h, 3 unpriced");
        let all = hourly_cost(&instances[..3], &prices);
        assert_eq!(all.cell(), "$0.23/h");
        assert_eq!(hourly_cost(&instances[4..5], &prices).cell(), "-", "nothing running");
        assert_eq!(hourly_cost(&instances[3..4], &prices).cell(), "unknown");
    }

    #[test]
    fn a_dry_run_asks_once_per_kind_of_instance_not_once_per_instance() {
        struct I {
            id: String,
            zone: &'static str,
            kind: &'static str,
            market: Option<&'static str>,
            tags: BTreeMap<String, String>,
        }
        let instance = |id: &str, zone: &'static str, kind: &'static str, pool: &str| I {
            id: id.into(),
            zone,
            kind,
            market: None,
            tags: [
                ("Name", format!("node-{id}")),
                (karpenter::TAG_NODECLAIM, format!("claim-{id}")),
                (karpenter::TAG_NODEPOOL, pool.to_string()),
                (karpenter::TAG_EKS_CLUSTER, "c".to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        };
        let mut all: Vec<I> =
            (0..100).map(|n| instance(&format!("i-{n}"), "eu-west-3a", "m5.large", "default")).collect();
        all.push(instance("i-zone", "eu-west-3b", "m5.large", "default"));
        all.push(instance("i-type", "eu-west-3a", "c5.large", "default"));
        all.push(instance("i-pool", "eu-west-3a", "m5.large", "gpu"));
        let mut spot = instance("i-spot", "eu-west-3a", "m5.large", "default");
        spot.market = Some("spot");
        all.push(spot);
        // a launch in flight: no claim tag yet, which a `Null` condition tells apart
        let mut in_flight = instance("i-inflight", "eu-west-3a", "m5.large", "default");
        in_flight.tags.remove(karpenter::TAG_NODECLAIM);
        all.push(in_flight);
        fn kind(i: &I) -> InstanceKind<'_> {
            InstanceKind { zone: i.zone, instance_type: Some(i.kind), market: i.market, tags: &i.tags }
        }
        let asked: Vec<&str> = dry_run_sample(&all, kind).iter().map(|i| i.id.as_str()).collect();
        assert_eq!(asked.len(), 6, "{asked:?}");
        assert_eq!(asked, ["i-0", "i-zone", "i-type", "i-pool", "i-spot", "i-inflight"]);
    }
}
