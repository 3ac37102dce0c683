//! `sweep`: the driver of [`crate::sweep`]. Reads each region's Karpenter instances, launch
//! templates and instance profiles, asks EKS about each cluster their tags name, prints one
//! verdict per cluster, and with `--yes` reclaims the orphans with `verify --reclaim`'s calls
//! ([`verify::reclaim_instances`], [`verify::reclaim_rest`]): a region's instances all at once,
//! then each orphan's templates, profiles and interfaces.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::{CommandError, fail};
use crate::aws::{AwsClients, EksLookup, InstanceInfo};
use crate::config::{Consent, SweepConfig};
use crate::exit::Exit;
use crate::sweep::{Billed, EksAnswer, Found, Group, HourlyCost, Kind, PriceKey, RanOnEks, Rules, Verdict};
use crate::verify::{self, Leftovers};

/// One cluster's line of the sweep, as the table and the report show it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ClusterSweep {
    pub(crate) region: String,
    pub(crate) cluster: String,
    #[serde(flatten)]
    pub(crate) verdict: Verdict,
    pub(crate) instances: Vec<String>,
    pub(crate) launch_templates: Vec<String>,
    pub(crate) instance_profiles: Vec<String>,
    /// Detached network interfaces tagged for an orphan (read only for orphans).
    pub(crate) network_interfaces: Vec<String>,
    /// Its instances by type (stopped ones too).
    pub(crate) instance_types: BTreeMap<String, usize>,
    /// What its running instances cost an hour, by AWS's prices (never part of the verdict).
    pub(crate) hourly_cost: HourlyCost,
    /// The oldest launch or creation among its resources (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) oldest: Option<String>,
    /// What a `--yes` sweep removes (a dry run), or removed.
    pub(crate) reclaim: Vec<String>,
    /// Whether `reclaim` was carried out.
    pub(crate) reclaimed: bool,
    /// What could not be removed, and why.
    pub(crate) failures: Vec<String>,
}

/// The sweep's JSON report.
#[derive(Debug, Serialize)]
struct SweepReport {
    command: &'static str,
    regions: Vec<String>,
    min_age_seconds: u64,
    dry_run: bool,
    clusters: Vec<ClusterSweep>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    exit_code: u8,
    outcome: String,
}

pub(crate) async fn sweep_command(args: &crate::cli::SweepArgs) -> Exit {
    let config = match SweepConfig::from_args(args) {
        Ok(c) => c,
        Err(e) => return fail(&e.into()),
    };
    let mut clusters = Vec::new();
    let (exit, error) = match sweep(&config, &mut clusters).await {
        Ok(exit) => (exit, None),
        Err(e) => (fail(&e), Some(e.to_string())),
    };
    crate::progress::finish();
    print_table(&clusters);
    let report = SweepReport {
        command: "sweep",
        regions: config.regions.clone(),
        min_age_seconds: config.min_age.as_secs(),
        dry_run: config.consent == Consent::DryRun,
        clusters,
        error,
        exit_code: exit.code(),
        outcome: exit.to_string(),
    };
    println!("{}", summary(&report));
    if let Some(path) = &config.report {
        let written = serde_json::to_vec_pretty(&report)
            .map_err(std::io::Error::other)
            .and_then(|json| std::fs::write(path, json));
        if let Err(source) = written {
            return exit.worst(fail(&CommandError::Report { path: path.display().to_string(), source }));
        }
    }
    exit
}

/// Sweeps every region: reads, judges and (with consent) reclaims; fills `out` as it goes, so a
/// failure still reports what was judged before it.
async fn sweep(config: &SweepConfig, out: &mut Vec<ClusterSweep>) -> Result<Exit, CommandError> {
    let rules = rules_now(config.min_age);
    let mut orphans: Vec<(usize, Leftovers, AwsClients)> = Vec::new();
    for (i, region) in config.regions.iter().enumerate() {
        let aws = AwsClients::connect(region).await?;
        if i == 0
            && let Some(account) = &config.account
        {
            aws.check_account(account).await?;
        }
        let (found, instances) = read_region(&aws, region).await?;
        let first_of_region = out.len();
        for ((region, cluster), group) in crate::sweep::group(found) {
            if !wanted(config, &cluster) {
                continue;
            }
            let eks = if group.disagree { EksAnswer::NotFound } else { ask_eks(&aws, &cluster).await };
            // whether it ran on EKS is read only for what would otherwise be an orphan
            let waived = config.not_eks && config.clusters.contains(&cluster);
            let mut verdict = crate::sweep::verdict(&cluster, &region, &group, &eks, rules, &RanOnEks::Waived);
            if matches!(verdict, Verdict::Orphaned(_)) && !waived {
                let ran = ran_on_eks(&aws, &group).await?;
                verdict = crate::sweep::verdict(&cluster, &region, &group, &eks, rules, &ran);
            }
            tracing::info!(%region, %cluster, verdict = verdict.name(), why = verdict.why(), "sweep");
            let mut line = line_of(&region, &cluster, &group, verdict);
            if matches!(line.verdict, Verdict::Orphaned(_)) {
                let left = reclaim_set(&aws, &cluster, &group, &instances).await?;
                line.network_interfaces = left.network_interfaces.iter().map(|n| n.id.clone()).collect();
                line.reclaim = left.describe();
                orphans.push((out.len(), left, aws.clone()));
            }
            out.push(line);
        }
        // after the verdicts, and apart from them: a price never decides anything
        price_region(&aws, region, &instances, &mut out[first_of_region..]).await;
    }
    let uncertain = out.iter().any(|c| matches!(c.verdict, Verdict::Uncertain(_)));
    let mut exit = if uncertain { Exit::Refused } else { Exit::Clean };
    if orphans.is_empty() {
        return Ok(exit);
    }
    let total: usize = orphans.iter().map(|(_, l, _)| l.instances.len()).sum();
    if let Some(max) = config.max_instances
        && total > max as usize
    {
        eprintln!(
            "error: refusing to sweep: the orphans hold {total} instances, more than --max-instances {max}. Nothing \
             was changed; narrow the sweep with --cluster, or raise --max-instances"
        );
        return Ok(Exit::Refused);
    }
    // the calls the reclaim makes, asked before any of them (also in a dry run, which then
    // says what a real sweep would be refused for)
    let missing = missing_permissions(&orphans, out).await?;
    if !missing.is_empty() {
        eprintln!(
            "error: the credentials may not make every call the reclaim needs: {}. Nothing was changed; grant \
             deploy/iam-policy-sweep.json to this identity",
            missing.join("; ")
        );
        return Ok(Exit::BadInput);
    }
    if config.consent == Consent::DryRun {
        tracing::warn!("without --yes: listing what would be reclaimed, changing nothing");
        return Ok(exit.worst(Exit::Leftovers));
    }
    // Region by region: every orphan's instances first, in one paced stream of terminations and
    // one wait (cluster by cluster, each would wait out its own instances' shutdown), then each
    // orphan's launch templates, profiles and interfaces.
    for region in &config.regions {
        let here: Vec<&(usize, Leftovers, AwsClients)> =
            orphans.iter().filter(|(at, _, _)| out[*at].region == *region).collect();
        let Some((_, _, aws)) = here.first() else { continue };
        let ids: Vec<String> = here.iter().flat_map(|(_, l, _)| l.instances.iter().map(|i| i.id.clone())).collect();
        let mut failed: BTreeMap<String, String> = match verify::reclaim_instances(aws, &ids).await {
            Ok(failed) => failed.into_iter().collect(),
            // the region's terminations stopped (throttled past the pacer's patience, or a read
            // failed while waiting): nothing more is done here, each orphan says why, and the
            // other regions, with buckets of their own, go on; running the sweep again resumes
            Err(e) => {
                tracing::error!(%region, error = %e, "the region's terminations stopped");
                for (at, _, _) in &here {
                    out[*at].failures = vec![format!("terminations in {region} stopped: {e}; run the sweep again")];
                }
                exit = exit.worst(Exit::Failure);
                continue;
            }
        };
        for (at, left, aws) in &here {
            let mut failures: Vec<String> = left.instances.iter().filter_map(|i| failed.remove(&i.id)).collect();
            failures.extend(verify::reclaim_rest(aws, left).await);
            let line = &mut out[*at];
            line.reclaimed = true;
            if !failures.is_empty() {
                exit = exit.worst(Exit::Leftovers);
            }
            line.failures = failures;
        }
    }
    Ok(exit)
}

/// What EC2's dry runs refuse of the reclaim's calls on what each orphan holds: terminating its
/// instances (one of each kind a policy could tell apart, `sweep::dry_run_sample`), and
/// deleting one of its launch templates and one of its network interfaces. IAM has no dry run:
/// the instance profiles' deletes are not asked.
async fn missing_permissions(
    orphans: &[(usize, Leftovers, AwsClients)],
    lines: &[ClusterSweep],
) -> Result<Vec<String>, CommandError> {
    use crate::aws::ec2::DryRun;
    let mut missing = Vec::new();
    for (at, left, aws) in orphans {
        let mut answers = Vec::new();
        let sample = crate::sweep::dry_run_sample(&left.instances, kind_of);
        let ids: Vec<String> = sample.iter().map(|i| i.id.clone()).collect();
        for chunk in ids.chunks(crate::aws::ec2::FILTER_VALUES_MAX) {
            answers.push(("ec2:TerminateInstances", aws.ec2.terminate_dry_run(chunk).await?));
        }
        if let Some(lt) = left.launch_templates.first() {
            answers.push(("ec2:DeleteLaunchTemplate", aws.ec2.delete_launch_template_dry_run(&lt.id).await?));
        }
        if let Some(ni) = left.network_interfaces.first() {
            answers.push(("ec2:DeleteNetworkInterface", aws.ec2.delete_network_interface_dry_run(&ni.id).await?));
        }
        for (action, answer) in answers {
            match answer {
                DryRun::Allowed => {}
                DryRun::Denied(why) => missing
                    .push(format!("{action} for cluster {} in {} ({why})", lines[*at].cluster, lines[*at].region)),
                DryRun::Inconclusive(code) => {
                    tracing::info!(action, code = %code, "EC2's dry run answered neither yes nor no; not counted as missing");
                }
            }
        }
    }
    Ok(missing)
}

/// Prices the running instances of `lines`, one region's clusters, with AWS's answers: the
/// Price List for on-demand instances, EC2's Spot price history for Spot ones. A price AWS does
/// not give (denied, no such product, no endpoint) leaves those instances unpriced, with why.
async fn price_region(aws: &AwsClients, region: &str, instances: &[InstanceInfo], lines: &mut [ClusterSweep]) {
    let by_id: BTreeMap<&str, &InstanceInfo> = instances.iter().map(|i| (i.id.as_str(), i)).collect();
    let billed_of = |line: &ClusterSweep| -> Vec<Billed<'_>> {
        line.instances.iter().filter_map(|id| by_id.get(id.as_str())).map(|i| billed(i)).collect()
    };
    let keys: BTreeSet<PriceKey> = lines.iter().flat_map(|l| crate::sweep::price_keys(&billed_of(l))).collect();
    let mut prices: BTreeMap<PriceKey, Result<f64, String>> = BTreeMap::new();
    let mut spot: BTreeMap<String, Result<BTreeMap<String, f64>, String>> = BTreeMap::new();
    // the Price List refused or unreachable: not asked again for each type (an endpoint out of
    // reach would cost its timeouts once per type)
    let (mut list_down, mut spot_down): (Option<String>, Option<String>) = (None, None);
    for key in keys {
        let price = match &key.spot_zone {
            None => match &list_down {
                Some(why) => Err(why.clone()),
                None => match aws.pricing.on_demand(region, &key.instance_type).await {
                    Ok(p) => Ok(p),
                    Err(crate::aws::pricing::Unpriced::Service(why)) => {
                        list_down = Some(why.clone());
                        Err(why)
                    }
                    Err(e) => Err(e.why().to_string()),
                },
            },
            Some(zone) => {
                if !spot.contains_key(&key.instance_type) {
                    // refused or unreachable, EC2 says the same of every type: asked once
                    let answer = match &spot_down {
                        Some(why) => Err(why.clone()),
                        None => aws.ec2.spot_prices(&key.instance_type).await.map_err(|e| {
                            let why = if e.is_access_denied() {
                                "ec2:DescribeSpotPriceHistory is not allowed (deploy/iam-policy-sweep.json grants it)"
                                    .to_string()
                            } else {
                                e.to_string()
                            };
                            spot_down = Some(why.clone());
                            why
                        }),
                    };
                    spot.insert(key.instance_type.clone(), answer.map(|r| crate::aws::pricing::newest_by_zone(&r)));
                }
                match spot.get(&key.instance_type) {
                    Some(Ok(zones)) => zones
                        .get(zone)
                        .copied()
                        .ok_or_else(|| format!("EC2 has no Spot price of {} in {zone}", key.instance_type)),
                    Some(Err(why)) => Err(why.clone()),
                    None => Err("not asked".into()),
                }
            }
        };
        prices.insert(key, price);
    }
    let reasons: BTreeSet<&String> = prices.values().filter_map(|p| p.as_ref().err()).collect();
    for why in reasons {
        tracing::warn!(%region, %why, "some running instances are not priced");
    }
    for line in lines.iter_mut() {
        let cost = crate::sweep::hourly_cost(&billed_of(line), &prices);
        line.hourly_cost = cost;
    }
}

/// What the hourly cost of `i` needs.
fn billed(i: &InstanceInfo) -> Billed<'_> {
    use crate::aws::InstanceState;
    Billed {
        instance_type: i.instance_type.as_deref(),
        market: i.market.as_deref(),
        zone: &i.zone,
        running: matches!(i.state, InstanceState::Pending | InstanceState::Running),
    }
}

/// What an IAM policy could tell `i` apart from other instances by.
fn kind_of(i: &InstanceInfo) -> crate::sweep::InstanceKind<'_> {
    crate::sweep::InstanceKind {
        zone: &i.zone,
        instance_type: i.instance_type.as_deref(),
        market: i.market.as_deref(),
        tags: &i.tags,
    }
}

/// The verdicts' rules as of now.
pub(super) fn rules_now(min_age: std::time::Duration) -> Rules {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    Rules { now, min_age: min_age.as_secs() as i64 }
}

fn wanted(config: &SweepConfig, cluster: &str) -> bool {
    // a group of disagreeing tags is named by all of its names: wanted when any is
    let names: Vec<&str> = cluster.split(" | ").collect();
    let named = config.clusters.is_empty() || names.iter().any(|n| config.clusters.contains(*n));
    let excluded = names.iter().any(|n| config.exclude.contains(*n));
    named && !excluded
}

/// Whether the user data of one of the group's instances, or else of its launch templates, names
/// an EKS endpoint; at most a few reads (one answer is enough, and a cluster's nodes share their
/// bootstrap).
async fn ran_on_eks(aws: &AwsClients, group: &Group) -> Result<RanOnEks, CommandError> {
    const READS: usize = 3;
    let of = |kind: Kind| group.found.iter().filter(move |f| f.kind == kind).take(READS);
    for f in of(Kind::Instance) {
        if let Some(endpoint) =
            aws.ec2.instance_user_data(&f.id).await?.as_deref().and_then(crate::sweep::eks_endpoint_in)
        {
            return Ok(RanOnEks::Shown(endpoint));
        }
    }
    for f in of(Kind::LaunchTemplate) {
        if let Some(endpoint) =
            aws.ec2.launch_template_user_data(&f.id).await?.as_deref().and_then(crate::sweep::eks_endpoint_in)
        {
            return Ok(RanOnEks::Shown(endpoint));
        }
    }
    Ok(RanOnEks::NotShown)
}

/// EKS's answer for `cluster` in the clients' region; any error is no answer.
async fn ask_eks(aws: &AwsClients, cluster: &str) -> EksAnswer {
    match aws.eks.describe_cluster(cluster).await {
        Ok(EksLookup::NotFound) => EksAnswer::NotFound,
        Ok(EksLookup::Found(c)) => EksAnswer::Exists { status: c.status, created: c.created },
        Err(e) => EksAnswer::Unknown(e.to_string()),
    }
}

/// Every Karpenter instance, launch template and instance profile of the region, as facts for
/// the verdicts; the instances also as read, for the reclaim.
async fn read_region(aws: &AwsClients, region: &str) -> Result<(Vec<Found>, Vec<InstanceInfo>), CommandError> {
    let (instances, launch_templates, instance_profiles) = tokio::try_join!(
        aws.ec2.karpenter_instances_anywhere(),
        aws.ec2.karpenter_launch_templates_anywhere(),
        aws.iam.karpenter_instance_profiles_anywhere(region),
    )?;
    let read = Leftovers { instances, launch_templates, instance_profiles, ..Leftovers::default() };
    Ok((found_in(&read, region), read.instances))
}

/// The instances, launch templates and instance profiles of `left`, in `region`, as facts for
/// the verdicts.
pub(super) fn found_in(left: &Leftovers, region: &str) -> Vec<Found> {
    let mut found = Vec::new();
    for i in &left.instances {
        found.push(Found {
            kind: Kind::Instance,
            id: i.id.clone(),
            region: region.to_string(),
            tags: i.tags.clone(),
            path: None,
            created: i.launched,
            instance_type: i.instance_type.clone(),
            managed_by: i.managed_by.clone(),
        });
    }
    for lt in &left.launch_templates {
        found.push(Found {
            kind: Kind::LaunchTemplate,
            id: lt.id.clone(),
            region: region.to_string(),
            tags: lt.tags.clone(),
            path: None,
            created: lt.created,
            instance_type: None,
            managed_by: None,
        });
    }
    for p in &left.instance_profiles {
        found.push(Found {
            kind: Kind::InstanceProfile,
            id: p.name.clone(),
            region: region.to_string(),
            tags: p.tags.clone(),
            path: Some(p.path.clone()),
            created: p.created,
            instance_type: None,
            managed_by: None,
        });
    }
    found
}

/// What reclaiming an orphan removes: exactly the instances, launch templates and instance
/// profiles judged (re-read by the cluster's own lookups, which hold every evidence rule
/// `verify` holds), and its detached network interfaces that the tool may delete.
async fn reclaim_set(
    aws: &AwsClients,
    cluster: &str,
    group: &Group,
    instances: &[InstanceInfo],
) -> Result<Leftovers, CommandError> {
    let ids = |kind: Kind| -> BTreeSet<&str> {
        group.found.iter().filter(|f| f.kind == kind).map(|f| f.id.as_str()).collect()
    };
    let (instance_ids, template_ids, profile_names) =
        (ids(Kind::Instance), ids(Kind::LaunchTemplate), ids(Kind::InstanceProfile));
    let (templates, profiles, (interfaces, _left_alone)) = tokio::try_join!(
        aws.ec2.launch_templates(cluster),
        aws.iam.cluster_instance_profiles(aws.region(), cluster),
        aws.ec2.detached_network_interfaces(cluster),
    )?;
    Ok(Leftovers {
        instances: instances.iter().filter(|i| instance_ids.contains(i.id.as_str())).cloned().collect(),
        launch_templates: templates.into_iter().filter(|t| template_ids.contains(t.id.as_str())).collect(),
        instance_profiles: profiles.into_iter().filter(|p| profile_names.contains(p.name.as_str())).collect(),
        network_interfaces: interfaces,
        ..Leftovers::default()
    })
}

fn line_of(region: &str, cluster: &str, group: &Group, verdict: Verdict) -> ClusterSweep {
    let of =
        |kind: Kind| -> Vec<String> { group.found.iter().filter(|f| f.kind == kind).map(|f| f.id.clone()).collect() };
    let mut instance_types = BTreeMap::new();
    for f in group.found.iter().filter(|f| f.kind == Kind::Instance) {
        *instance_types.entry(f.instance_type.clone().unwrap_or_else(|| "unknown".into())).or_insert(0) += 1;
    }
    let oldest = group.found.iter().filter_map(|f| f.created).min().map(|secs| {
        humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs.max(0) as u64))
            .to_string()
    });
    ClusterSweep {
        region: region.to_string(),
        cluster: cluster.to_string(),
        verdict,
        instances: of(Kind::Instance),
        launch_templates: of(Kind::LaunchTemplate),
        instance_profiles: of(Kind::InstanceProfile),
        network_interfaces: Vec::new(),
        instance_types,
        hourly_cost: HourlyCost::default(),
        oldest,
        reclaim: Vec::new(),
        reclaimed: false,
        failures: Vec::new(),
    }
}

fn print_table(clusters: &[ClusterSweep]) {
    if clusters.is_empty() {
        println!("no Karpenter instance, launch template or instance profile found");
        return;
    }
    println!(
        "{:<14} {:<28} {:<10} {:>9} {:>9} {:>8}  {:<20}  {:>9}  WHY",
        "REGION", "CLUSTER", "VERDICT", "INSTANCES", "TEMPLATES", "PROFILES", "OLDEST", "COST"
    );
    for c in clusters {
        println!(
            "{:<14} {:<28} {:<10} {:>9} {:>9} {:>8}  {:<20}  {:>9}  {}",
            c.region,
            c.cluster,
            c.verdict.name(),
            c.instances.len(),
            c.launch_templates.len(),
            c.instance_profiles.len(),
            c.oldest.as_deref().unwrap_or("-"),
            c.hourly_cost.cell(),
            c.verdict.why()
        );
        if !c.instance_types.is_empty() {
            let types: Vec<String> = c.instance_types.iter().map(|(t, n)| format!("{n} × {t}")).collect();
            println!("    instances: {}", types.join(", "));
        }
        if c.hourly_cost.unpriced > 0 {
            let why: Vec<&str> = c.hourly_cost.why_unpriced.iter().map(String::as_str).collect();
            println!("    not priced: {} running instance(s): {}", c.hourly_cost.unpriced, why.join("; "));
        }
        for r in &c.reclaim {
            println!("    {} {r}", if c.reclaimed { "reclaimed:" } else { "would reclaim:" });
        }
        for f in &c.failures {
            println!("    not reclaimed: {f}");
        }
    }
}

fn summary(report: &SweepReport) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &report.clusters {
        *counts.entry(c.verdict.name()).or_insert(0) += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(v, n)| format!("{n} {v}")).collect();
    format!(
        "sweep of {} ({}): {} cluster(s){}{}, exit {}",
        report.regions.join(", "),
        if report.dry_run { "dry run" } else { "--yes" },
        report.clusters.len(),
        if counts.is_empty() { String::new() } else { format!(": {}", counts.join(", ")) },
        if report.dry_run && report.clusters.iter().any(|c| !c.reclaim.is_empty()) {
            "; run again with --yes to reclaim the orphans"
        } else {
            ""
        },
        report.exit_code
    )
}
