//! The order in which the drains' evictions reach the API server.
//!
//! Every node drains at once, but the requests go out a bounded number at a time
//! ([`crate::k8s::MAX_REQUESTS_IN_FLIGHT`]), so on a large cluster the evictions queue. Two things
//! bound the run, and the order serves both:
//!
//! - A node is empty only once its slowest pod's grace period has passed after that pod's
//!   eviction. Served first come, first served, a node's second or fifth long-grace pod waits
//!   behind every other node's first pod: at 1,000 nodes that put the last 120 s pods 10 s behind
//!   the first. So long grace periods go first (the longest processing time first rule).
//! - A node's machine can be released only once the node is empty, and EC2 terminates at a
//!   bounded rate (a bucket of 1,000 refilled at 20 a second). Served longest grace period first
//!   across the whole cluster, every node keeps its 30 s and 10 s pods until the queue is nearly
//!   empty, so when the eviction rate rather than grace periods sets the pace (5,000 nodes), no
//!   node is empty before the last evictions and all the terminations wait until after the drain.
//!
//! The gate therefore gives each node a target, the time at which the evictions queued so far
//! would have emptied it and the nodes seen before it, at the eviction rate the gate measures, and
//! serves the waiting evictions earliest deadline first, a pod's deadline being its node's target
//! less its grace period. While the queue is short against the grace periods (1,000 nodes) the
//! targets lie close together and the order is longest grace period first; once the queue is
//! longer than the grace periods, nodes empty one after another while others still drain, and
//! their releases overlap the drain. Before the first eviction has been answered there is no rate
//! and every target is now: the order is longest grace period first.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// How much each eviction's time moves the smoothed one: hundreds are answered a second on a large
/// cluster, so the estimate follows the server within a second without jumping at one slow answer.
const LATENCY_WEIGHT: f64 = 0.05;

/// Hands out a fixed number of permits, the waiting with the earliest deadline first.
#[derive(Clone)]
pub(crate) struct PriorityGate {
    state: Arc<Mutex<State>>,
}

struct State {
    free: usize,
    /// How many permits the gate has: the eviction rate is this many per request's latency.
    permits: usize,
    arrivals: u64,
    waiting: BinaryHeap<Waiter>,
    /// Each node's target, counted in evictions: the pods of every node seen before it and its own.
    targets: HashMap<String, u64>,
    /// The pods of every node seen so far.
    planned: u64,
    /// How long an eviction holds its permit, smoothed; `None` until the first has come back.
    latency: Option<Duration>,
}

struct Waiter {
    /// Milliseconds from the gate's targets' origin; the smallest is served first.
    deadline: i64,
    arrival: u64,
    grant: oneshot::Sender<Permit>,
}

impl Ord for Waiter {
    fn cmp(&self, other: &Self) -> Ordering {
        // the heap pops the greatest: the earliest deadline, then the earliest arrival
        other.deadline.cmp(&self.deadline).then_with(|| other.arrival.cmp(&self.arrival))
    }
}

impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Waiter {}

/// An eviction's deadline in milliseconds: its node's target, `target` evictions at `permits`
/// per `latency`, less its grace period. Without a latency yet the target is zero for every node,
/// which leaves the grace periods alone to order the queue.
fn deadline_ms(target: u64, permits: usize, latency: Option<Duration>, grace: i64) -> i64 {
    let per_eviction_ms = latency.map_or(0.0, |l| l.as_secs_f64() * 1000.0 / permits.max(1) as f64);
    // `as` saturates: a target beyond i64's milliseconds is simply last
    (target as f64 * per_eviction_ms) as i64 - grace.saturating_mul(1000)
}

/// The smoothed latency after one more eviction took `took`.
fn smoothed(latency: Option<Duration>, took: Duration) -> Duration {
    match latency {
        None => took,
        Some(l) => l.mul_f64(1.0 - LATENCY_WEIGHT) + took.mul_f64(LATENCY_WEIGHT),
    }
}

/// One of the gate's permits; dropping it hands it to the next waiter.
pub(crate) struct Permit {
    /// `None` once the permit has been handed on, or for the permit of a gate that is gone.
    gate: Option<Arc<Mutex<State>>>,
    granted: Instant,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(state) = self.gate.take() {
            let took = self.granted.elapsed();
            {
                let mut s = lock(&state);
                s.latency = Some(smoothed(s.latency, took));
            }
            release(&state);
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // the state is counters, a map and a heap, each change a single call that cannot panic halfway
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Gives a returned permit to the waiter with the earliest deadline still waiting, or back to the
/// pool. The pop and the return happen under one lock, so a permit is free only while nobody
/// waits.
fn release(state: &Arc<Mutex<State>>) {
    loop {
        let next = {
            let mut s = lock(state);
            match s.waiting.pop() {
                Some(w) => w,
                None => {
                    s.free += 1;
                    return;
                }
            }
        };
        match next.grant.send(Permit { gate: Some(state.clone()), granted: Instant::now() }) {
            Ok(()) => return,
            // the waiter gave up (its drain ended or was cancelled): the next one gets it
            Err(mut unsent) => unsent.gate = None,
        }
    }
}

impl PriorityGate {
    pub(crate) fn new(permits: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                free: permits,
                permits,
                arrivals: 0,
                waiting: BinaryHeap::new(),
                targets: HashMap::new(),
                planned: 0,
                latency: None,
            })),
        }
    }

    /// A permit for evicting a pod with `grace` seconds from `node`, which had `node_pods` pods to
    /// evict when its drain first asked: at once while one is free, otherwise once every waiter
    /// with an earlier deadline, and every earlier one with the same, has had one. Cancel-safe: a
    /// waiter dropped before its turn takes no permit with it.
    pub(crate) async fn acquire(&self, node: &str, node_pods: usize, grace: i64) -> Permit {
        let granted = {
            let mut s = lock(&self.state);
            // every node takes its place in the schedule when it first asks, served at once or not
            let target = match s.targets.get(node) {
                Some(t) => *t,
                None => {
                    s.planned += node_pods as u64;
                    let t = s.planned;
                    s.targets.insert(node.to_string(), t);
                    t
                }
            };
            if s.free > 0 {
                s.free -= 1;
                return Permit { gate: Some(self.state.clone()), granted: Instant::now() };
            }
            let deadline = deadline_ms(target, s.permits, s.latency, grace);
            let (grant, granted) = oneshot::channel();
            let arrival = s.arrivals;
            s.arrivals += 1;
            s.waiting.push(Waiter { deadline, arrival, grant });
            granted
        };
        // The sender lives in the heap until a permit is sent through it, and the heap lives as
        // long as `self`, which this future borrows: it cannot be dropped unsent. Were it ever,
        // the caller goes ahead unbounded rather than waiting forever.
        granted.await.unwrap_or(Permit { gate: None, granted: Instant::now() })
    }

    #[cfg(test)]
    fn free(&self) -> usize {
        lock(&self.state).free
    }

    #[cfg(test)]
    fn assume_latency(&self, latency: Duration) {
        lock(&self.state).latency = Some(latency);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Starts a waiter for a pod of `node` (with `node_pods` pods) that records its name once it
    /// holds a permit and keeps it until told.
    fn waiter(
        gate: &PriorityGate,
        name: &'static str,
        (node, node_pods): (&'static str, usize),
        grace: i64,
        order: &tokio::sync::mpsc::UnboundedSender<&'static str>,
    ) -> (tokio::task::JoinHandle<()>, oneshot::Sender<()>) {
        let (done, hold) = oneshot::channel::<()>();
        let (gate, order) = (gate.clone(), order.clone());
        let task = tokio::spawn(async move {
            let _permit = gate.acquire(node, node_pods, grace).await;
            let _ = order.send(name);
            let _ = hold.await;
        });
        (task, done)
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    #[test]
    fn a_deadline_is_the_node_target_at_the_measured_rate_less_the_grace_period() {
        // no rate yet: the grace period alone
        assert_eq!(deadline_ms(5_000, 64, None, 120), -120_000);
        // 64 permits each held 640 ms: 100 evictions a second, so the 5,000th is due at 50 s
        assert_eq!(deadline_ms(5_000, 64, Some(Duration::from_millis(640)), 120), 50_000 - 120_000);
        assert_eq!(deadline_ms(5_000, 64, Some(Duration::from_millis(640)), 10), 50_000 - 10_000);
        assert_eq!(deadline_ms(u64::MAX, 1, Some(Duration::from_secs(1)), 0), i64::MAX, "saturates");
    }

    #[test]
    fn the_latency_follows_the_answers_slowly() {
        let first = smoothed(None, Duration::from_millis(200));
        assert_eq!(first, Duration::from_millis(200));
        let next = smoothed(Some(first), Duration::from_millis(1_200));
        assert_eq!(next, Duration::from_millis(250), "one slow answer moves it by a twentieth");
    }

    #[tokio::test]
    async fn permits_go_at_once_while_free_then_longest_grace_first_while_no_rate_is_known() {
        let gate = PriorityGate::new(2);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_a, release_a) = waiter(&gate, "a", ("n1", 2), 10, &tx);
        let (_b, release_b) = waiter(&gate, "b", ("n1", 2), 10, &tx);
        settle().await;
        assert_eq!((order.recv().await, order.recv().await), (Some("a"), Some("b")), "both free permits go at once");
        let mut held = Vec::new();
        let queued = [("short", "n2", 10), ("long-1", "n3", 120), ("medium", "n4", 30), ("long-2", "n5", 120)];
        for (name, node, grace) in queued {
            held.push(waiter(&gate, name, (node, 1_000), grace, &tx));
            settle().await;
        }
        assert!(order.try_recv().is_err(), "no permit is free");
        let _ = release_a.send(());
        let _ = release_b.send(());
        let mut granted = vec![order.recv().await, order.recv().await];
        assert_eq!(granted, [Some("long-1"), Some("long-2")], "longest first, ties in their order");
        // the two long ones, which hold the permits now
        for i in [3, 1] {
            let (_, release) = held.remove(i);
            let _ = release.send(());
        }
        granted = vec![order.recv().await, order.recv().await];
        assert_eq!(granted, [Some("medium"), Some("short")]);
    }

    #[tokio::test]
    async fn once_the_rate_is_known_an_early_node_empties_before_a_late_node_long_pod_starts() {
        // one permit, each eviction one second: a node's target is its place in the queue, in seconds
        let gate = PriorityGate::new(1);
        gate.assume_latency(Duration::from_secs(1));
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_h, release_holder) = waiter(&gate, "holder", ("early", 2), 30, &tx);
        assert_eq!(order.recv().await, Some("holder"));
        // `early` is due at 2 s, `late` (300 pods behind it) at 302 s
        let (_l, release_late) = waiter(&gate, "late-120s", ("late", 300), 120, &tx);
        settle().await;
        let (_s, release_short) = waiter(&gate, "early-10s", ("early", 2), 10, &tx);
        settle().await;
        let _ = release_holder.send(());
        assert_eq!(order.recv().await, Some("early-10s"), "2 - 10 s is due before 302 - 120 s");
        let _ = release_short.send(());
        assert_eq!(order.recv().await, Some("late-120s"));
        let _ = release_late.send(());
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_takes_no_permit_with_it() {
        let gate = PriorityGate::new(1);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_holder, release_holder) = waiter(&gate, "holder", ("n", 3), 0, &tx);
        assert_eq!(order.recv().await, Some("holder"));
        let (quitter, _keep) = waiter(&gate, "quitter", ("n", 3), 100, &tx);
        let (_patient, release_patient) = waiter(&gate, "patient", ("n", 3), 1, &tx);
        settle().await;
        quitter.abort();
        settle().await;
        let _ = release_holder.send(());
        assert_eq!(order.recv().await, Some("patient"), "the permit skips the waiter that left");
        let _ = release_patient.send(());
        settle().await;
        assert_eq!(gate.free(), 1, "every permit came back");
    }

    #[tokio::test]
    async fn permits_come_back_when_dropped_and_are_never_more_than_the_gate_has() {
        let gate = PriorityGate::new(3);
        let held: Vec<Permit> = futures::future::join_all((0..3).map(|i| gate.acquire("n", 4, i))).await;
        assert_eq!(gate.free(), 0);
        let fourth = gate.acquire("n", 4, 7);
        tokio::pin!(fourth);
        assert!(tokio::time::timeout(Duration::from_millis(20), &mut fourth).await.is_err(), "none is free");
        drop(held);
        let _fourth = fourth.await;
        assert_eq!(gate.free(), 2, "one held, the other two returned");
        assert!(lock(&gate.state).latency.is_some(), "the returned permits measured their time");
    }
}
