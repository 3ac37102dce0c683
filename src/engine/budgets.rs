//! PodDisruptionBudgets from one watch, and the evictions they allow right now.
//!
//! Asking the Eviction API blindly and retrying refusals once a second sent 1,771 evictions for
//! 800 pods on a PDB-heavy cluster: every refusal is a request that changes nothing, and under API
//! Priority and Fairness it competes with everything else the cluster does. The API server itself
//! decides from the budget's `status.disruptionsAllowed` (and decrements it with every eviction it
//! grants), so the tool reads the same number from a watch and only asks when the budget allows:
//!
//! - a ready pod whose one budget shows `disruptionsAllowed > 0` (at an `observedGeneration` that is
//!   current) is evicted, and the tool counts the disruption against its local copy until the next
//!   status arrives, so parallel drains do not all spend the same allowance;
//! - when the budget shows none, the drain waits for that budget's next status change (a wake-up,
//!   not a poll), and asks the server anyway every [`PROBE`] in case the watch is behind;
//! - everything else (no budget, two budgets, a pod that is not ready, which the server may evict
//!   under `unhealthyPodEvictionPolicy`) goes to the server, which stays the judge.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::{Notify, watch};

use crate::k8s::pods::LabelLookup;

/// How long a budget that allows nothing may stay silent (no status change) before one pod it
/// holds is put to the server anyway.
pub const PROBE: Duration = Duration::from_secs(10);

/// A budget's key, `namespace/name`.
pub type BudgetKey = String;

#[derive(Debug, Clone)]
struct Budget {
    selector: Option<LabelSelector>,
    /// The last status's `disruptionsAllowed` (0 while the status is not current, or after the
    /// server refused an eviction until the next status).
    allowed: i64,
    /// Pods whose eviction the tool asked for (or the server granted) that the last status does
    /// not list in `disruptedPods` yet: the server counted them, the status the tool has not.
    pending: HashMap<String, Instant>,
    /// When the tool last learned something about it: a status arrived, or a probe was sent.
    heard: Instant,
}

impl Budget {
    /// Evictions the tool may still ask for.
    fn left(&self) -> i64 {
        self.allowed - self.pending.len() as i64
    }

    /// The budget's answer for one ready pod it selects at `now`, as a transition of its own
    /// state: an allowance left is reserved for the pod; none left, and nothing heard for
    /// [`PROBE`], the pod probes the server (and the budget counts as heard, so one pod probes at
    /// a time); otherwise wait for its next status.
    fn admit(&mut self, pod: &str, now: Instant) -> Verdict {
        if self.left() > 0 {
            self.pending.insert(pod.to_string(), now);
            Verdict::Ask
        } else if now.saturating_duration_since(self.heard) >= PROBE {
            self.heard = now;
            Verdict::Probe
        } else {
            Verdict::Wait
        }
    }
}

/// [`Budget::admit`]'s answer, before [`Budgets::admit`] names the budget and registers a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ask,
    Probe,
    Wait,
}

/// How long a granted eviction counts against its budget while no status lists it: the API
/// server keeps a disrupted pod in `disruptedPods` until the pod is gone or two minutes pass.
const PENDING_FOR: Duration = Duration::from_secs(120);

/// A budget as a (re)list shows it, with the pods its status lists in `disruptedPods`.
type Listed = (Budget, Vec<String>);

#[derive(Default)]
struct Index {
    /// namespace → name → budget
    by_ns: HashMap<String, BTreeMap<String, Budget>>,
    /// during a (re)list: what was seen so far, with each budget's `disruptedPods`
    relisting: Option<HashMap<String, BTreeMap<String, Listed>>>,
    /// budget → the drains waiting for its next status
    waiters: HashMap<BudgetKey, Vec<Arc<Notify>>>,
}

/// What the budgets say about evicting one pod now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Ask the server; the budget's allowance (if one was counted) is reserved under this key.
    Ask(Option<BudgetKey>),
    /// Ask the server although the budget shows no allowance: nothing was heard of the budget
    /// for [`PROBE`], and the watch may be behind. One pod per budget probes at a time.
    Probe(BudgetKey),
    /// The budget allows no disruption now (`status.disruptionsAllowed` is 0): the drain is woken
    /// when its status changes.
    Wait(BudgetKey),
}

/// The live PodDisruptionBudgets.
#[derive(Clone)]
pub struct Budgets {
    inner: Arc<Mutex<Index>>,
    synced: watch::Sender<bool>,
}

impl Budgets {
    /// Starts the watch; the returned future runs it until dropped (the engine owns it).
    pub fn start(client: kube::Client) -> (Budgets, impl Future<Output = ()> + Send + 'static) {
        let (tx, _) = watch::channel(false);
        let budgets = Budgets { inner: Arc::new(Mutex::new(Index::default())), synced: tx };
        let to = budgets.clone();
        let api: Api<PodDisruptionBudget> = Api::all(client);
        let fut = super::podindex::follow(api, "PodDisruptionBudget", move |ev| to.apply(ev));
        (budgets, fut)
    }

    /// A set of budgets known without a watch (for tests of the decisions).
    pub fn from_list(pdbs: &[PodDisruptionBudget]) -> Budgets {
        let (tx, _) = watch::channel(true);
        let budgets = Budgets { inner: Arc::new(Mutex::new(Index::default())), synced: tx };
        for p in pdbs {
            budgets.apply(watcher::Event::Apply(p.clone()));
        }
        budgets
    }

    fn apply(&self, ev: watcher::Event<PodDisruptionBudget>) {
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match ev {
            watcher::Event::Init => idx.relisting = Some(HashMap::new()),
            watcher::Event::InitApply(p) => {
                if let (Some((ns, name, b, disrupted)), Some(seen)) = (entry(&p), idx.relisting.as_mut()) {
                    seen.entry(ns).or_default().insert(name, (b, disrupted));
                }
            }
            watcher::Event::InitDone => {
                let listed = idx.relisting.take().unwrap_or_default();
                let mut by_ns: HashMap<String, BTreeMap<String, Budget>> = HashMap::new();
                for (ns, budgets) in listed {
                    for (name, (b, disrupted)) in budgets {
                        let old = idx.by_ns.get_mut(&ns).and_then(|m| m.remove(&name));
                        by_ns.entry(ns.clone()).or_default().insert(name, carry_pending(b, old, &disrupted));
                    }
                }
                idx.by_ns = by_ns;
                // anything may have changed while the watch was down
                for (_, ws) in idx.waiters.drain() {
                    ws.iter().for_each(|w| w.notify_one());
                }
                drop(idx);
                self.synced.send_replace(true);
            }
            watcher::Event::Apply(p) => {
                if let Some((ns, name, b, disrupted)) = entry(&p) {
                    let key = format!("{ns}/{name}");
                    let m = idx.by_ns.entry(ns).or_default();
                    let old = m.remove(&name);
                    m.insert(name, carry_pending(b, old, &disrupted));
                    for w in idx.waiters.remove(&key).unwrap_or_default() {
                        w.notify_one();
                    }
                }
            }
            watcher::Event::Delete(p) => {
                if let Some((ns, name, _, _)) = entry(&p) {
                    let key = format!("{ns}/{name}");
                    if let Some(m) = idx.by_ns.get_mut(&ns) {
                        m.remove(&name);
                    }
                    for w in idx.waiters.remove(&key).unwrap_or_default() {
                        w.notify_one();
                    }
                }
            }
        }
    }

    /// Waits until the first full list has been read.
    pub async fn synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Whether to ask the server to evict pod `pod` in `namespace` with `labels` at `now`
    /// (decided by [`Budget::admit`]); `ready` says whether the pod counts as healthy for its
    /// budget. A `Wait` registers `wake` to be notified at the budget's next status change.
    pub fn admit(
        &self,
        namespace: &str,
        pod: &str,
        labels: &impl LabelLookup,
        ready: bool,
        now: Instant,
        wake: &Arc<Notify>,
    ) -> Admission {
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(budgets) = idx.by_ns.get_mut(namespace) else { return Admission::Ask(None) };
        let mut matching = budgets.iter_mut().filter(|(_, b)| b.selector.as_ref().is_some_and(|s| selects(s, labels)));
        let (Some((name, budget)), None) = (matching.next(), matching.next()) else {
            // none, or several (which the server refuses with a 500 the drain reports)
            return Admission::Ask(None);
        };
        if !ready {
            // an unhealthy pod does not spend the allowance and may be evictable anyway
            return Admission::Ask(None);
        }
        let key = format!("{namespace}/{name}");
        match budget.admit(pod, now) {
            Verdict::Ask => Admission::Ask(Some(key)),
            Verdict::Probe => Admission::Probe(key),
            Verdict::Wait => {
                idx.waiters.entry(key.clone()).or_default().push(wake.clone());
                Admission::Wait(key)
            }
        }
    }

    /// Gives back an allowance the server did not spend (the pod was gone, the request failed).
    pub fn release(&self, key: &BudgetKey, pod: &str) {
        self.with_budget(key, |b| {
            b.pending.remove(pod);
        });
    }

    /// The server refused on this budget: it allows nothing until its next status says so.
    pub fn refused(&self, key: &BudgetKey, pod: &str) {
        self.with_budget(key, |b| {
            b.pending.remove(pod);
            b.allowed = 0;
            b.heard = Instant::now();
        });
    }

    fn with_budget(&self, key: &BudgetKey, f: impl FnOnce(&mut Budget)) {
        let Some((ns, name)) = key.split_once('/') else { return };
        let mut idx = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = idx.by_ns.get_mut(ns).and_then(|m| m.get_mut(name)) {
            f(b);
        }
    }
}

fn entry(p: &PodDisruptionBudget) -> Option<(String, String, Budget, Vec<String>)> {
    let ns = p.metadata.namespace.clone()?;
    let name = p.metadata.name.clone()?;
    let status = p.status.as_ref();
    // the Eviction API refuses while the disruption controller has not processed the current
    // spec (`observedGeneration < generation`): so does the tool
    let current = status.and_then(|s| s.observed_generation).unwrap_or(0) >= p.metadata.generation.unwrap_or(0);
    let allowed = if current { status.map(|s| i64::from(s.disruptions_allowed)).unwrap_or(0) } else { 0 };
    let disrupted =
        status.and_then(|s| s.disrupted_pods.as_ref()).map(|d| d.keys().cloned().collect()).unwrap_or_default();
    let budget = Budget {
        selector: p.spec.as_ref().and_then(|s| s.selector.clone()),
        allowed,
        pending: HashMap::new(),
        heard: Instant::now(),
    };
    Some((ns, name, budget, disrupted))
}

/// A new status replaces the old one, but evictions the tool was granted that it does not list
/// in `disruptedPods` yet still count: the watch can deliver a status written before the
/// server granted them (without this, parallel drains spent the same allowance twice and about
/// one eviction in five was refused).
fn carry_pending(mut new: Budget, old: Option<Budget>, disrupted: &[String]) -> Budget {
    if let Some(old) = old {
        new.pending = old
            .pending
            .into_iter()
            .filter(|(pod, at)| !disrupted.contains(pod) && at.elapsed() < PENDING_FOR)
            .collect();
    }
    new
}

/// Kubernetes label-selector matching (`metav1.LabelSelectorAsSelector`): every `matchLabels`
/// pair and every `matchExpressions` requirement must hold; an empty selector selects every pod
/// (policy/v1 semantics; a budget without a selector selects none, see [`Budgets::admit`]).
pub fn selects(s: &LabelSelector, labels: &impl LabelLookup) -> bool {
    s.match_labels.as_ref().is_none_or(|m| m.iter().all(|(k, v)| labels.label(k) == Some(v.as_str())))
        && s.match_expressions.as_ref().is_none_or(|es| {
            es.iter().all(|e| {
                let v = labels.label(&e.key);
                let vals = e.values.as_deref().unwrap_or_default();
                match e.operator.as_str() {
                    "In" => v.is_some_and(|v| vals.iter().any(|x| x == v)),
                    "NotIn" => v.is_none_or(|v| !vals.iter().any(|x| x == v)),
                    "Exists" => v.is_some(),
                    "DoesNotExist" => v.is_none(),
                    _ => false,
                }
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::pods::Labels;
    use serde_json::json;

    fn pdb(name: &str, app: &str, allowed: i32, generation: i64, observed: i64) -> PodDisruptionBudget {
        disrupted(name, app, allowed, generation, observed, &[])
    }

    fn disrupted(
        name: &str,
        app: &str,
        allowed: i32,
        generation: i64,
        observed: i64,
        pods: &[&str],
    ) -> PodDisruptionBudget {
        let disrupted: serde_json::Map<String, serde_json::Value> =
            pods.iter().map(|p| (p.to_string(), json!("2026-11-23T18:00:00Z"))).collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "generation": generation},
            "spec": {"selector": {"matchLabels": {"app": app}}, "maxUnavailable": 1},
            "status": {"disruptionsAllowed": allowed, "observedGeneration": observed, "disruptedPods": disrupted,
                       "currentHealthy": 3, "desiredHealthy": 2, "expectedPods": 3},
        }))
        .unwrap()
    }

    fn labels(app: &str) -> BTreeMap<String, String> {
        [("app".to_string(), app.to_string())].into()
    }

    #[test]
    fn an_allowance_is_spent_once_and_then_the_drain_waits_for_the_next_status() {
        let b = Budgets::from_list(&[pdb("web", "web", 1, 1, 1)]);
        let wake = Arc::new(Notify::new());
        assert_eq!(
            b.admit("ns", "web-0", &labels("web"), true, Instant::now(), &wake),
            Admission::Ask(Some("ns/web".into()))
        );
        assert_eq!(
            b.admit("ns", "web-1", &labels("web"), true, Instant::now(), &wake),
            Admission::Wait("ns/web".into())
        );
        // a status written before the server granted web-0 (delivered late) still allows one:
        // web-0 is not in its disruptedPods, so it still counts, and nothing more is allowed
        b.apply(watcher::Event::Apply(pdb("web", "web", 1, 1, 1)));
        assert!(futures::FutureExt::now_or_never(wake.notified()).is_some(), "the waiting drain was woken");
        assert!(matches!(b.admit("ns", "web-1", &labels("web"), true, Instant::now(), &wake), Admission::Wait(_)));
        // the status that lists web-0 as disrupted, then the one after its replacement is ready
        b.apply(watcher::Event::Apply(disrupted("web", "web", 0, 1, 1, &["web-0"])));
        assert!(matches!(b.admit("ns", "web-1", &labels("web"), true, Instant::now(), &wake), Admission::Wait(_)));
        b.apply(watcher::Event::Apply(pdb("web", "web", 1, 1, 1)));
        assert_eq!(
            b.admit("ns", "web-1", &labels("web"), true, Instant::now(), &wake),
            Admission::Ask(Some("ns/web".into()))
        );
    }

    #[test]
    fn a_silent_budget_is_probed_by_one_pod_at_a_time() {
        let b = Budgets::from_list(&[pdb("web", "web", 0, 1, 1)]);
        let wake = Arc::new(Notify::new());
        assert!(matches!(b.admit("ns", "web-0", &labels("web"), true, Instant::now(), &wake), Admission::Wait(_)));
        let later = Instant::now() + PROBE;
        assert_eq!(b.admit("ns", "web-0", &labels("web"), true, later, &wake), Admission::Probe("ns/web".into()));
        assert!(
            matches!(b.admit("ns", "web-1", &labels("web"), true, later, &wake), Admission::Wait(_)),
            "one probe per budget"
        );
    }

    #[test]
    fn a_refusal_zeroes_the_allowance_and_a_release_gives_it_back() {
        let b = Budgets::from_list(&[pdb("web", "web", 2, 1, 1)]);
        let wake = Arc::new(Notify::new());
        let Admission::Ask(Some(key)) = b.admit("ns", "web-0", &labels("web"), true, Instant::now(), &wake) else {
            panic!()
        };
        b.release(&key, "web-0");
        let Admission::Ask(Some(_)) = b.admit("ns", "web-1", &labels("web"), true, Instant::now(), &wake) else {
            panic!()
        };
        let Admission::Ask(Some(_)) = b.admit("ns", "web-2", &labels("web"), true, Instant::now(), &wake) else {
            panic!()
        };
        b.refused(&key, "web-2");
        assert!(matches!(b.admit("ns", "web-3", &labels("web"), true, Instant::now(), &wake), Admission::Wait(_)));
    }

    #[test]
    fn the_server_decides_for_unready_pods_unbudgeted_pods_two_budgets_and_stale_status() {
        let b = Budgets::from_list(&[pdb("a", "a", 0, 1, 1), pdb("b1", "b", 1, 1, 1), pdb("b2", "b", 1, 1, 1)]);
        let wake = Arc::new(Notify::new());
        assert_eq!(
            b.admit("ns", "p", &labels("a"), false, Instant::now(), &wake),
            Admission::Ask(None),
            "unready: the server may allow it"
        );
        assert_eq!(b.admit("ns", "p", &labels("none"), true, Instant::now(), &wake), Admission::Ask(None));
        assert_eq!(
            b.admit("other", "p", &labels("a"), true, Instant::now(), &wake),
            Admission::Ask(None),
            "budgets are per namespace"
        );
        assert_eq!(
            b.admit("ns", "p", &labels("b"), true, Instant::now(), &wake),
            Admission::Ask(None),
            "two budgets: the server's 500"
        );
        assert!(matches!(b.admit("ns", "p", &labels("a"), true, Instant::now(), &wake), Admission::Wait(_)));
        let stale = Budgets::from_list(&[pdb("s", "s", 5, 2, 1)]);
        assert!(
            matches!(stale.admit("ns", "p", &labels("s"), true, Instant::now(), &wake), Admission::Wait(_)),
            "not yet observed"
        );
    }

    #[test]
    fn selectors_match_like_kubernetes() {
        let sel: LabelSelector = serde_json::from_value(json!({
            "matchLabels": {"app": "web"},
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]},
                                 {"key": "canary", "operator": "DoesNotExist"}]
        }))
        .unwrap();
        let l = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert!(selects(&sel, &l(&[("app", "web"), ("tier", "a")])));
        assert!(!selects(&sel, &l(&[("app", "web"), ("tier", "c")])));
        assert!(!selects(&sel, &l(&[("app", "web"), ("tier", "a"), ("canary", "1")])));
        assert!(selects(&LabelSelector::default(), &l(&[])), "an empty selector selects everything");

        // the compact labels of the pod index answer as the map they were made from
        let compact = |pairs: &[(&str, &str)]| Labels::from(&l(pairs));
        let sts = [("tier", "b"), ("app", "web"), ("apps.kubernetes.io/pod-index", "3"), ("zone", "x")];
        assert!(selects(&sel, &compact(&sts)));
        assert!(!selects(&sel, &compact(&[("app", "web"), ("tier", "c")])));
        assert!(!selects(&sel, &compact(&[("app", "web"), ("canary", "1"), ("tier", "a")])));
        assert!(!selects(&sel, &compact(&[("tier", "a")])), "matchLabels app=web is missing");
        assert_eq!(compact(&sts).get("zone"), Some("x"));
        assert_eq!(compact(&sts).get("apps.kubernetes.io/pod-index"), Some("3"));
        assert_eq!(compact(&sts).get("app.kubernetes.io/name"), None);
    }
}
