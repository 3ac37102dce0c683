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
//! The gate therefore gives each node a target: when EC2 can terminate its instance, were the
//! nodes terminated in the order their drains first asked, at EC2's default pace (the first 1,000
//! at once, then 20 a second: [`crate::aws::pacing`]). It serves the waiting evictions earliest
//! deadline first, a pod's deadline being its node's target less its grace period. Up to 1,000
//! nodes every target is now, and the order is longest grace period first. Beyond, nodes empty
//! one after another in time for their turn at EC2, so the termination floor is paid under the
//! drain; the last nodes' long pods still start long before their turn. The targets use no
//! measured rate, so every deadline is comparable with every other, whenever it was computed.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::aws::pacing::{TERMINATE_BUCKET, TERMINATE_REFILL_PER_SEC};

/// Hands out a fixed number of permits, the waiting with the earliest deadline first.
#[derive(Clone)]
pub(crate) struct PriorityGate {
    state: Arc<Mutex<State>>,
}

struct State {
    free: usize,
    arrivals: u64,
    waiting: BinaryHeap<Waiter>,
    /// Each node's place in the order the drains first asked, from 0.
    ranks: HashMap<String, u64>,
}

struct Waiter {
    /// Milliseconds from the first termination; the smallest is served first.
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

/// A pod's deadline in milliseconds after the first termination: its node's turn at EC2's
/// default `TerminateInstances` pace, the node being the `rank`-th to ask, less the pod's grace
/// period.
fn deadline_ms(rank: u64, grace: i64) -> i64 {
    let turn_ms = (rank as f64 - TERMINATE_BUCKET).max(0.0) * 1000.0 / TERMINATE_REFILL_PER_SEC;
    // `as` saturates, and a rank beyond i64's milliseconds is simply last
    (turn_ms as i64).saturating_sub(grace.saturating_mul(1000))
}

/// One of the gate's permits; dropping it hands it to the next waiter.
pub(crate) struct Permit {
    /// `None` once the permit has been handed on, or for the permit of a gate that is gone.
    gate: Option<Arc<Mutex<State>>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(state) = self.gate.take() {
            release(&state);
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // the state is a counter, a map and a heap, each change a single call that cannot panic halfway
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
        match next.grant.send(Permit { gate: Some(state.clone()) }) {
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
                arrivals: 0,
                waiting: BinaryHeap::new(),
                ranks: HashMap::new(),
            })),
        }
    }

    /// A permit for evicting a pod with `grace` seconds from `node`: at once while one is free,
    /// otherwise once every waiter with an earlier deadline, and every earlier one with the same,
    /// has had one. Cancel-safe: a waiter dropped before its turn takes no permit with it.
    pub(crate) async fn acquire(&self, node: &str, grace: i64) -> Permit {
        let granted = {
            let mut s = lock(&self.state);
            // every node takes its place when it first asks, served at once or not; the name is
            // copied only then, not on each of its pods' turns
            let rank = match s.ranks.get(node) {
                Some(rank) => *rank,
                None => {
                    let rank = s.ranks.len() as u64;
                    s.ranks.insert(node.to_string(), rank);
                    rank
                }
            };
            if s.free > 0 {
                s.free -= 1;
                return Permit { gate: Some(self.state.clone()) };
            }
            let deadline = deadline_ms(rank, grace);
            let (grant, granted) = oneshot::channel();
            let arrival = s.arrivals;
            s.arrivals += 1;
            s.waiting.push(Waiter { deadline, arrival, grant });
            granted
        };
        // The sender lives in the heap until a permit is sent through it, and the heap lives as
        // long as `self`, which this future borrows: it cannot be dropped unsent. Were it ever,
        // the caller goes ahead unbounded rather than waiting forever.
        granted.await.unwrap_or(Permit { gate: None })
    }

    #[cfg(test)]
    fn free(&self) -> usize {
        lock(&self.state).free
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Starts a waiter for a pod of `node` that records its name once it holds a permit and keeps
    /// it until told.
    fn waiter(
        gate: &PriorityGate,
        name: &'static str,
        node: &'static str,
        grace: i64,
        order: &tokio::sync::mpsc::UnboundedSender<&'static str>,
    ) -> (tokio::task::JoinHandle<()>, oneshot::Sender<()>) {
        let (done, hold) = oneshot::channel::<()>();
        let (gate, order) = (gate.clone(), order.clone());
        let task = tokio::spawn(async move {
            let _permit = gate.acquire(node, grace).await;
            let _ = order.send(name);
            let _ = hold.await;
        });
        (task, done)
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    #[test]
    fn a_deadline_is_the_node_turn_at_ec2_less_the_grace_period() {
        // the first 1,000 nodes' instances go in EC2's first burst
        assert_eq!(deadline_ms(0, 120), -120_000);
        assert_eq!(deadline_ms(1_000, 10), -10_000);
        // then 20 a second: the 5,000th node's turn is 200 s after the first termination
        assert_eq!(deadline_ms(5_000, 120), 200_000 - 120_000);
        assert_eq!(deadline_ms(5_000, 10), 200_000 - 10_000);
        assert!(deadline_ms(u64::MAX, 0) > deadline_ms(1 << 40, 0), "saturates, still last");
    }

    #[tokio::test]
    async fn permits_go_at_once_while_free_then_longest_grace_first_within_the_first_burst() {
        let gate = PriorityGate::new(2);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_a, release_a) = waiter(&gate, "a", "n1", 10, &tx);
        let (_b, release_b) = waiter(&gate, "b", "n1", 10, &tx);
        settle().await;
        assert_eq!((order.recv().await, order.recv().await), (Some("a"), Some("b")), "both free permits go at once");
        let mut held = Vec::new();
        for (name, node, grace) in
            [("short", "n2", 10), ("long-1", "n3", 120), ("medium", "n4", 30), ("long-2", "n5", 120)]
        {
            held.push(waiter(&gate, name, node, grace, &tx));
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
    async fn beyond_the_first_burst_an_early_node_empties_before_a_late_node_long_pod_starts() {
        let gate = PriorityGate::new(1);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_h, release_holder) = waiter(&gate, "holder", "node-0", 30, &tx);
        assert_eq!(order.recv().await, Some("holder"));
        // nodes 1 to 4,998 have asked before, so that node-4999 is the 5,000th
        {
            let mut s = lock(&gate.state);
            for i in 1..4_999 {
                let next = s.ranks.len() as u64;
                s.ranks.entry(format!("node-{i}")).or_insert(next);
            }
        }
        // node-4999's turn at EC2 is 200 s in: its 120 s pod is due at 80 s, where node-0's
        // 10 s pod is due 10 s before the first termination
        let (_l, release_late) = waiter(&gate, "late-120s", "node-4999", 120, &tx);
        settle().await;
        let (_s, release_short) = waiter(&gate, "early-10s", "node-0", 10, &tx);
        settle().await;
        let _ = release_holder.send(());
        assert_eq!(order.recv().await, Some("early-10s"), "-10 s is due before 80 s");
        let _ = release_short.send(());
        assert_eq!(order.recv().await, Some("late-120s"));
        let _ = release_late.send(());
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_takes_no_permit_with_it() {
        let gate = PriorityGate::new(1);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_holder, release_holder) = waiter(&gate, "holder", "n", 0, &tx);
        assert_eq!(order.recv().await, Some("holder"));
        let (quitter, _keep) = waiter(&gate, "quitter", "n", 100, &tx);
        let (_patient, release_patient) = waiter(&gate, "patient", "n", 1, &tx);
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
        let held: Vec<Permit> = futures::future::join_all((0..3).map(|i| gate.acquire("n", i))).await;
        assert_eq!(gate.free(), 0);
        let fourth = gate.acquire("n", 7);
        tokio::pin!(fourth);
        assert!(tokio::time::timeout(Duration::from_millis(20), &mut fourth).await.is_err(), "none is free");
        drop(held);
        let _fourth = fourth.await;
        assert_eq!(gate.free(), 2, "one held, the other two returned");
    }
}
