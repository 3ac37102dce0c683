//! The order in which the drains' evictions reach the API server.
//!
//! Every node drains at once, but the requests go out a bounded number at a time
//! ([`crate::k8s::MAX_REQUESTS_IN_FLIGHT`]), so on a large cluster the evictions queue. A node is
//! empty only once its slowest pod's grace period has passed after that pod's eviction, so the
//! run ends no sooner than the last long-grace pod's eviction plus its grace period. Served first
//! come, first served, a node's second or fifth long-grace pod waits behind every other node's
//! first pod: at 1,000 nodes that put the last 120 s pods 10 s behind the first. The gate serves
//! the waiting evictions longest grace period first across the whole cluster (the longest
//! processing time first rule), ties in the order they came, so the slowest pods start their
//! grace periods first and the short ones, which have time to spare, queue.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Hands out a fixed number of permits, the waiting highest priority first.
#[derive(Clone)]
pub(crate) struct PriorityGate {
    state: Arc<Mutex<State>>,
}

struct State {
    free: usize,
    arrivals: u64,
    waiting: BinaryHeap<Waiter>,
}

struct Waiter {
    priority: i64,
    arrival: u64,
    grant: oneshot::Sender<Permit>,
}

impl Ord for Waiter {
    fn cmp(&self, other: &Self) -> Ordering {
        // the heap pops the greatest: the highest priority, then the earliest arrival
        self.priority.cmp(&other.priority).then_with(|| other.arrival.cmp(&self.arrival))
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
    // the state is a counter and a heap, each change a single call that cannot panic halfway
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Gives a returned permit to the highest waiter still waiting, or back to the pool. The pop and
/// the return happen under one lock, so a permit is free only while nobody waits.
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
        Self { state: Arc::new(Mutex::new(State { free: permits, arrivals: 0, waiting: BinaryHeap::new() })) }
    }

    /// A permit, once every waiter of a higher priority, and every earlier one of the same, has
    /// had one. Cancel-safe: a waiter dropped before its turn takes no permit with it.
    pub(crate) async fn acquire(&self, priority: i64) -> Permit {
        let granted = {
            let mut s = lock(&self.state);
            if s.free > 0 {
                s.free -= 1;
                return Permit { gate: Some(self.state.clone()) };
            }
            let (grant, granted) = oneshot::channel();
            let arrival = s.arrivals;
            s.arrivals += 1;
            s.waiting.push(Waiter { priority, arrival, grant });
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

    /// Starts a waiter that records its name once it holds a permit and keeps it until told.
    fn waiter(
        gate: &PriorityGate,
        name: &'static str,
        priority: i64,
        order: &tokio::sync::mpsc::UnboundedSender<&'static str>,
    ) -> (tokio::task::JoinHandle<()>, oneshot::Sender<()>) {
        let (done, hold) = oneshot::channel::<()>();
        let (gate, order) = (gate.clone(), order.clone());
        let task = tokio::spawn(async move {
            let _permit = gate.acquire(priority).await;
            let _ = order.send(name);
            let _ = hold.await;
        });
        (task, done)
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    #[tokio::test]
    async fn permits_go_at_once_while_free_then_highest_priority_first_and_ties_by_arrival() {
        let gate = PriorityGate::new(2);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_a, release_a) = waiter(&gate, "a", 10, &tx);
        let (_b, release_b) = waiter(&gate, "b", 10, &tx);
        settle().await;
        assert_eq!((order.recv().await, order.recv().await), (Some("a"), Some("b")), "both free permits go at once");
        let mut held = Vec::new();
        for (name, priority) in [("short", 10), ("long-1", 120), ("medium", 30), ("long-2", 120)] {
            held.push(waiter(&gate, name, priority, &tx));
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
    async fn a_waiter_that_gives_up_takes_no_permit_with_it() {
        let gate = PriorityGate::new(1);
        let (tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let (_holder, release_holder) = waiter(&gate, "holder", 0, &tx);
        assert_eq!(order.recv().await, Some("holder"));
        let (quitter, _keep) = waiter(&gate, "quitter", 100, &tx);
        let (_patient, release_patient) = waiter(&gate, "patient", 1, &tx);
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
        let held: Vec<Permit> = futures::future::join_all((0..3).map(|i| gate.acquire(i))).await;
        assert_eq!(gate.free(), 0);
        let fourth = gate.acquire(7);
        tokio::pin!(fourth);
        assert!(tokio::time::timeout(Duration::from_millis(20), &mut fourth).await.is_err(), "none is free");
        drop(held);
        let _fourth = fourth.await;
        assert_eq!(gate.free(), 2, "one held, the other two returned");
    }
}
