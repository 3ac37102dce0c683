//! When a Node is a NodeClaim's: the one evidence rule every step that writes to a Node through
//! its claim applies (the inventory's pairing, the cordon, the drain, the release).
//!
//! A claim's `status.nodeName` alone proves nothing. EKS names a node after its private IP and a
//! VPC reuses IPs, so a claim left behind by an uninstalled Karpenter, whose instance is long
//! gone, can name a Node that a managed node group's newer instance registered under the same
//! name. A Node is the claim's only when independent facts agree: it runs on the claim's
//! instance (`spec.providerID` equal to the claim's `status.providerID`) and carries the claim's
//! `karpenter.sh/nodepool` label, which Karpenter puts on every node it registers. (The instance's
//! own tags are the third fact, checked by the EC2 batcher right before a termination.) A claim
//! whose named Node fails the rule is handled as a claim without a node: its instance is settled
//! through EC2, and the other Node is never written.
//!
//! A claim that names no instance yet ([`launch_of_claim`]) may still have one: a launch in
//! flight when the controller went. Its instance carries only the launch's own tags (cluster,
//! NodePool, EC2NodeClass: Karpenter's tagging controller adds `karpenter.sh/nodeclaim` only
//! after the claim has named the instance), so it is the claim's when those tags are the claim's,
//! it was launched after the claim was made, no Node or other claim names it, and it is the only
//! such instance.

use crate::karpenter::ProviderId;

/// What the rule reads of one side, Node or NodeClaim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Facts<'a> {
    /// The instance it names (`spec.providerID` of a Node, `status.providerID` of a claim).
    pub(crate) instance: Option<&'a ProviderId>,
    /// Its `karpenter.sh/nodepool` label.
    pub(crate) nodepool: Option<&'a str>,
}

/// Why a Node is not a NodeClaim's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Mismatch {
    /// The claim names no instance yet, so nothing ties a Node to it.
    #[error("the NodeClaim names no instance")]
    ClaimHasNoInstance,
    /// The claim has no NodePool label (Karpenter labels every claim it makes).
    #[error("the NodeClaim has no karpenter.sh/nodepool label")]
    ClaimHasNoPool,
    /// The Node names no instance.
    #[error("the Node has no spec.providerID")]
    NodeHasNoInstance,
    /// The Node runs on another instance.
    #[error("the Node runs on instance {node}, the NodeClaim's is {claim}")]
    OtherInstance {
        /// The Node's instance id.
        node: String,
        /// The claim's instance id.
        claim: String,
    },
    /// The Node is not labelled as a Karpenter node.
    #[error("the Node has no karpenter.sh/nodepool label (it is not a Karpenter node)")]
    NodeHasNoPool,
    /// The Node is labelled with another pool.
    #[error("the Node is of NodePool {node}, the NodeClaim of {claim}")]
    OtherPool {
        /// The Node's pool.
        node: String,
        /// The claim's pool.
        claim: String,
    },
}

/// Whether the Node with `node`'s facts is the machine of the NodeClaim with `claim`'s: the same
/// instance and the same NodePool, both present on both sides. Fails closed: a missing fact is a
/// mismatch, never a pass.
pub(crate) fn node_is_claims(claim: Facts<'_>, node: Facts<'_>) -> Result<(), Mismatch> {
    let claim_instance = claim.instance.ok_or(Mismatch::ClaimHasNoInstance)?;
    let claim_pool = claim.nodepool.ok_or(Mismatch::ClaimHasNoPool)?;
    let node_instance = node.instance.ok_or(Mismatch::NodeHasNoInstance)?;
    // the zone is part of the id's text but not of its identity: instance ids are unique
    if node_instance.instance_id != claim_instance.instance_id {
        return Err(Mismatch::OtherInstance {
            node: node_instance.instance_id.clone(),
            claim: claim_instance.instance_id.clone(),
        });
    }
    let node_pool = node.nodepool.ok_or(Mismatch::NodeHasNoPool)?;
    if node_pool != claim_pool {
        return Err(Mismatch::OtherPool { node: node_pool.to_string(), claim: claim_pool.to_string() });
    }
    Ok(())
}

/// How much EC2's launch time may precede the claim's creation and still be its launch: the two
/// clocks (the API server's, EC2's) are synchronised but not equal, and both count whole seconds.
pub(crate) const LAUNCH_CLOCK_SKEW_SECS: i64 = 5;

/// How long EC2 may take to show a launch in `DescribeInstances`, counted from the claim's
/// creation (Karpenter launches within seconds of it). Karpenter's own garbage collection of
/// instances that no NodeClaim names leaves each alone for its first 30 s for the same reason
/// (`nodeclaim/garbagecollection`, 1.0 to 1.14).
pub(crate) const LAUNCH_SHOWS_WITHIN_SECS: i64 = 30;

/// How long to wait before a claim that names no instance, created at `created` (seconds since
/// the epoch), is looked up in EC2, at `now`: until it is [`LAUNCH_SHOWS_WITHIN_SECS`] old, and a
/// second more for the whole seconds both clocks count. `None` once it is old enough. A claim
/// without a creation time, or one that looks made in the future (the API server's clock ahead of
/// ours), waits the whole allowance and no longer: its age is not known.
pub(crate) fn until_a_launch_shows(created: Option<i64>, now: i64) -> Option<std::time::Duration> {
    let age = created.map_or(0, |c| now.saturating_sub(c).max(0));
    let left = LAUNCH_SHOWS_WITHIN_SECS + 1 - age;
    (left > 0).then(|| std::time::Duration::from_secs(left.unsigned_abs()))
}

/// What a claim that names no instance says of its launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch<'a> {
    /// The claim's name (an instance already tagged `karpenter.sh/nodeclaim` must name it).
    pub(crate) claim: &'a str,
    /// Its `karpenter.sh/nodepool` label.
    pub(crate) nodepool: Option<&'a str>,
    /// Its `spec.nodeClassRef.name`.
    pub(crate) nodeclass: Option<&'a str>,
    /// Its creation, in seconds since the epoch.
    pub(crate) created: Option<i64>,
}

/// What EC2 says of one live instance of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launched<'a> {
    pub(crate) id: &'a str,
    /// Its `karpenter.sh/nodepool` tag.
    pub(crate) nodepool: Option<&'a str>,
    /// Its `karpenter.k8s.aws/ec2nodeclass` tag.
    pub(crate) nodeclass: Option<&'a str>,
    /// Its `karpenter.sh/nodeclaim` tag.
    pub(crate) nodeclaim: Option<&'a str>,
    /// Its launch time, in seconds since the epoch.
    pub(crate) launched: Option<i64>,
}

/// Which instance a claim that names none has, by its launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LaunchMatch {
    /// Exactly one instance fits.
    One(String),
    /// None fits (or the claim lacks a fact to match on: then nothing can fit).
    Nothing,
    /// Several fit: which is the claim's cannot be told.
    Several(Vec<String>),
}

/// The instance of the claim `launch` among `live`, EC2's live instances of the cluster, none of
/// which `named` (the instances every Node and NodeClaim names) may hold. Fails closed: a claim
/// without its pool, class or creation time matches nothing, and an instance without a launch
/// time or either tag is never its.
pub(crate) fn launch_of_claim(
    launch: Launch<'_>,
    live: &[Launched<'_>],
    named: &std::collections::BTreeSet<&str>,
) -> LaunchMatch {
    let (Some(pool), Some(class), Some(created)) = (launch.nodepool, launch.nodeclass, launch.created) else {
        return LaunchMatch::Nothing;
    };
    let mut fits: Vec<String> = live
        .iter()
        .filter(|i| !named.contains(i.id))
        .filter(|i| i.nodepool == Some(pool) && i.nodeclass == Some(class))
        .filter(|i| i.nodeclaim.is_none_or(|c| c == launch.claim))
        .filter(|i| i.launched.is_some_and(|t| t >= created - LAUNCH_CLOCK_SKEW_SECS))
        .map(|i| i.id.to_string())
        .collect();
    if fits.len() > 1 {
        return LaunchMatch::Several(fits);
    }
    fits.pop().map_or(LaunchMatch::Nothing, LaunchMatch::One)
}

/// The annotations an EC2NodeClass carries for each NodeClaim of it released with no instance
/// found: `unseen-launch.karpenter-teardown.io/<hash of the claim's name>`, the claim as
/// [`UnseenLaunch`]. Written on the class before the claim goes, it keeps what the class's
/// deletion must look for across a killed run; it goes with the class.
pub(crate) const UNSEEN_LAUNCH_PREFIX: &str = "unseen-launch.karpenter-teardown.io/";

/// A NodeClaim released with no instance found, as its class remembers it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct UnseenLaunch {
    pub(crate) claim: String,
    pub(crate) nodepool: Option<String>,
    /// Its creation, in seconds since the epoch (0 when unknown: every launch is then a
    /// candidate).
    pub(crate) created: i64,
}

/// The annotation key of `claim`'s [`UnseenLaunch`] (FNV-1a of the name: an annotation's name
/// is at most 63 characters, a claim's may be more).
pub(crate) fn unseen_launch_key(claim: &str) -> String {
    let hash = claim.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("{UNSEEN_LAUNCH_PREFIX}{hash:016x}")
}

/// The [`UnseenLaunch`]es among a class's annotations; one that does not parse counts as a
/// launch of unknown pool and age (fails closed).
pub(crate) fn unseen_launches<'a>(
    annotations: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<UnseenLaunch> {
    annotations
        .into_iter()
        .filter(|(k, _)| k.starts_with(UNSEEN_LAUNCH_PREFIX))
        .map(|(k, v)| {
            serde_json::from_str(v).unwrap_or_else(|_| UnseenLaunch {
                claim: format!("(unreadable {k})"),
                nodepool: None,
                created: 0,
            })
        })
        .collect()
}

/// How long the deletion of an EC2NodeClass waits, at `now`, for a second look at EC2 when a
/// NodeClaim of it was released with no instance found: until the newest such claim is two
/// allowances old (62 s). A launch EC2 shows later than its first allowance is then seen while
/// the class, its launch templates (the evidence a reclaim from AWS alone needs) and its
/// instance profile are still there; a claim already that old waits nothing.
pub(crate) fn until_the_class_may_go(launches: &[UnseenLaunch], now: i64) -> Option<std::time::Duration> {
    let newest = launches.iter().map(|l| l.created).max()?;
    let left = 2 * (LAUNCH_SHOWS_WITHIN_SECS + 1) - now.saturating_sub(newest).max(0);
    (left > 0).then(|| std::time::Duration::from_secs(left.unsigned_abs()))
}

/// The live instances (`live`, of the class's cluster and with its tag) that may be the launch of
/// one of `launches`, claims of `class` released with no instance found, none of which `named`
/// (every Node's and NodeClaim's instance) may hold: by [`launch_of_claim`]'s rule, but with a
/// missing pool or creation time matching more, never less. Each with the claim it may be.
pub(crate) fn launches_shown(
    launches: &[UnseenLaunch],
    class: &str,
    live: &[Launched<'_>],
    named: &std::collections::BTreeSet<&str>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for l in launches {
        for i in live.iter().filter(|i| !named.contains(i.id) && i.nodeclass == Some(class)) {
            let pool_fits = l.nodepool.is_none() || i.nodepool == l.nodepool.as_deref();
            let claim_fits = i.nodeclaim.is_none_or(|c| c == l.claim);
            let time_fits = i.launched.is_none_or(|t| t >= l.created - LAUNCH_CLOCK_SKEW_SECS);
            if pool_fits && claim_fits && time_fits {
                out.push((i.id.to_string(), l.claim.clone()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pid(id: &str) -> ProviderId {
        ProviderId { zone: "us-west-2a".into(), instance_id: id.into() }
    }

    fn facts<'a>(instance: Option<&'a ProviderId>, pool: Option<&'a str>) -> Facts<'a> {
        Facts { instance, nodepool: pool }
    }

    #[test]
    fn a_node_is_a_claims_only_on_the_same_instance_and_pool() {
        let (a, b) = (pid("i-0aaa"), pid("i-0bbb"));
        assert_eq!(node_is_claims(facts(Some(&a), Some("web")), facts(Some(&a), Some("web"))), Ok(()));
        // the reused name: a managed node group's node on another instance, without the label
        assert_eq!(
            node_is_claims(facts(Some(&a), Some("web")), facts(Some(&b), None)),
            Err(Mismatch::OtherInstance { node: "i-0bbb".into(), claim: "i-0aaa".into() })
        );
        assert_eq!(node_is_claims(facts(Some(&a), Some("web")), facts(Some(&a), None)), Err(Mismatch::NodeHasNoPool));
        assert_eq!(
            node_is_claims(facts(Some(&a), Some("web")), facts(Some(&a), Some("batch"))),
            Err(Mismatch::OtherPool { node: "batch".into(), claim: "web".into() })
        );
    }

    #[test]
    fn a_missing_fact_on_either_side_is_a_mismatch_never_a_pass() {
        let a = pid("i-0aaa");
        let node = facts(Some(&a), Some("web"));
        assert_eq!(node_is_claims(facts(None, Some("web")), node), Err(Mismatch::ClaimHasNoInstance));
        assert_eq!(node_is_claims(facts(Some(&a), None), node), Err(Mismatch::ClaimHasNoPool));
        assert_eq!(
            node_is_claims(facts(Some(&a), Some("web")), facts(None, Some("web"))),
            Err(Mismatch::NodeHasNoInstance)
        );
    }

    fn launched<'a>(id: &'a str, pool: &'a str, class: &'a str, claim: Option<&'a str>, at: i64) -> Launched<'a> {
        Launched { id, nodepool: Some(pool), nodeclass: Some(class), nodeclaim: claim, launched: Some(at) }
    }

    #[test]
    fn a_claim_without_an_instance_has_the_one_launch_its_tags_and_time_agree_on() {
        let claim =
            Launch { claim: "web-abcde", nodepool: Some("web"), nodeclass: Some("default"), created: Some(1_000) };
        let none = std::collections::BTreeSet::new();
        let mine = launched("i-1", "web", "default", None, 1_002);
        let other_pool = launched("i-2", "batch", "default", None, 1_002);
        let other_class = launched("i-3", "web", "gpu", None, 1_002);
        let older = launched("i-4", "web", "default", None, 900);
        let other_claim = launched("i-5", "web", "default", Some("web-zzzzz"), 1_002);
        let live = [mine, other_pool, other_class, older, other_claim];
        assert_eq!(launch_of_claim(claim, &live, &none), LaunchMatch::One("i-1".into()));
        // tagged for it already: its own
        let tagged = launched("i-6", "web", "default", Some("web-abcde"), 1_002);
        assert_eq!(launch_of_claim(claim, &[tagged], &none), LaunchMatch::One("i-6".into()));
        // a launch a second or two before the claim's whole-second creation still counts
        let skewed = launched("i-7", "web", "default", None, 1_000 - LAUNCH_CLOCK_SKEW_SECS);
        assert_eq!(launch_of_claim(claim, &[skewed], &none), LaunchMatch::One("i-7".into()));
        // an instance a Node or another claim names is theirs
        let named = std::collections::BTreeSet::from(["i-1"]);
        assert_eq!(launch_of_claim(claim, &live, &named), LaunchMatch::Nothing);
        // two fit: which one cannot be told
        let twin = launched("i-8", "web", "default", None, 1_010);
        assert_eq!(
            launch_of_claim(claim, &[mine, twin], &none),
            LaunchMatch::Several(vec!["i-1".into(), "i-8".into()])
        );
    }

    #[test]
    fn a_launch_missing_a_fact_on_either_side_matches_nothing() {
        let none = std::collections::BTreeSet::new();
        let full =
            Launch { claim: "web-abcde", nodepool: Some("web"), nodeclass: Some("default"), created: Some(1_000) };
        let mine = launched("i-1", "web", "default", None, 1_002);
        for claim in
            [Launch { nodepool: None, ..full }, Launch { nodeclass: None, ..full }, Launch { created: None, ..full }]
        {
            assert_eq!(launch_of_claim(claim, &[mine], &none), LaunchMatch::Nothing, "{claim:?}");
        }
        for instance in [
            Launched { launched: None, ..mine },
            Launched { nodepool: None, ..mine },
            Launched { nodeclass: None, ..mine },
        ] {
            assert_eq!(launch_of_claim(full, &[instance], &none), LaunchMatch::Nothing, "{instance:?}");
        }
    }

    #[test]
    fn the_zone_in_a_provider_id_does_not_decide() {
        let a = pid("i-0aaa");
        let elsewhere = ProviderId { zone: String::new(), instance_id: "i-0aaa".into() };
        assert_eq!(node_is_claims(facts(Some(&a), Some("web")), facts(Some(&elsewhere), Some("web"))), Ok(()));
    }

    #[test]
    fn a_new_claim_is_looked_up_only_once_ec2_has_had_its_time_to_show_a_launch() {
        let now = 1_800_000_000;
        assert_eq!(until_a_launch_shows(Some(now - 3), now), Some(std::time::Duration::from_secs(28)));
        assert_eq!(until_a_launch_shows(Some(now - 30), now), Some(std::time::Duration::from_secs(1)));
        assert_eq!(until_a_launch_shows(Some(now - 31), now), None);
        assert_eq!(until_a_launch_shows(Some(now - 3600), now), None);
        // the API server's clock ahead of ours: the whole allowance, however far ahead
        assert_eq!(until_a_launch_shows(Some(now + 2), now), Some(std::time::Duration::from_secs(31)));
        assert_eq!(until_a_launch_shows(Some(now + 3600), now), Some(std::time::Duration::from_secs(31)));
        assert_eq!(until_a_launch_shows(None, now), Some(std::time::Duration::from_secs(31)));
    }

    fn unseen(claim: &str, pool: Option<&str>, created: i64) -> UnseenLaunch {
        UnseenLaunch { claim: claim.into(), nodepool: pool.map(str::to_string), created }
    }

    #[test]
    fn a_class_whose_claim_was_released_unlaunched_waits_until_the_claim_is_two_allowances_old() {
        let now = 1_800_000_000;
        let s = std::time::Duration::from_secs;
        assert_eq!(until_the_class_may_go(&[], now), None, "nothing released unlaunched: no wait");
        assert_eq!(until_the_class_may_go(&[unseen("a", None, now - 31)], now), Some(s(31)));
        assert_eq!(until_the_class_may_go(&[unseen("a", None, now - 61)], now), Some(s(1)));
        assert_eq!(until_the_class_may_go(&[unseen("a", None, now - 62)], now), None);
        assert_eq!(until_the_class_may_go(&[unseen("a", None, now - 3600)], now), None, "a stale claim waits nothing");
        // the newest claim decides; one from the future waits the whole of it
        assert_eq!(
            until_the_class_may_go(&[unseen("a", None, now - 3600), unseen("b", None, now - 40)], now),
            Some(s(22))
        );
        assert_eq!(until_the_class_may_go(&[unseen("a", None, now + 5)], now), Some(s(62)));
    }

    #[test]
    fn a_class_stays_while_an_instance_that_may_be_a_released_claims_launch_runs() {
        let named: std::collections::BTreeSet<&str> = ["i-1"].into();
        let live = [
            launched("i-1", "web", "default", None, 100),
            launched("i-2", "web", "default", None, 100),
            launched("i-3", "web", "default", None, 10),
            launched("i-4", "batch", "default", None, 100),
            launched("i-5", "web", "default", Some("web-other"), 100),
            launched("i-6", "web", "gpu", None, 100),
        ];
        let claim = [unseen("web-a", Some("web"), 90)];
        assert_eq!(
            launches_shown(&claim, "default", &live, &named),
            [("i-2".to_string(), "web-a".to_string())],
            "named, launched before the claim, another pool, another claim's, another class: not its launch"
        );
        // what is not known matches more, never less
        let unknown = [unseen("web-a", None, 0)];
        let shown: Vec<String> =
            launches_shown(&unknown, "default", &live, &named).into_iter().map(|(i, _)| i).collect();
        assert_eq!(shown, ["i-2", "i-3", "i-4"]);
        assert!(launches_shown(&[], "default", &live, &named).is_empty());
    }

    #[test]
    fn an_unseen_launch_is_kept_under_a_short_key_and_read_back_failing_closed() {
        let key = unseen_launch_key(&"x".repeat(200));
        assert!(key.starts_with(UNSEEN_LAUNCH_PREFIX) && key.len() - UNSEEN_LAUNCH_PREFIX.len() == 16, "{key}");
        assert_eq!(key, unseen_launch_key(&"x".repeat(200)), "the same claim, the same key");
        assert_ne!(unseen_launch_key("web-a"), unseen_launch_key("web-b"));
        let record = unseen("web-a", Some("web"), 90);
        let annotations: std::collections::BTreeMap<String, String> = [
            (unseen_launch_key("web-a"), serde_json::to_string(&record).unwrap()),
            (format!("{UNSEEN_LAUNCH_PREFIX}garbled"), "{".into()),
            ("other".into(), "x".into()),
        ]
        .into();
        let read = unseen_launches(&annotations);
        assert_eq!(read.len(), 2);
        assert!(read.contains(&record));
        assert!(read.iter().any(|l| l.created == 0 && l.nodepool.is_none()), "{read:?}");
    }
}
