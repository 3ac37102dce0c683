//! EC2 batching for per-machine tasks: terminations are gathered into `TerminateInstances` calls
//! of up to 500 ids, each as large as EC2's termination bucket holds at the time (`aws::pacing`),
//! and one `DescribeInstances` per round answers every task waiting for its
//! instance to reach `terminated` (design §5), instead of one call per machine. Before a batch is
//! terminated, one `DescribeInstances` reads each instance's own tags and operator: whatever the
//! Kubernetes objects said, an instance that is not this cluster's self-managed Karpenter's (EKS
//! Auto Mode's, another cluster's, untagged) is refused and left running. Then each
//! termination's guard is asked, last of all: a machine may have waited its turn for minutes,
//! and one whose node was opened again meanwhile is withdrawn, not sent (design §2, the default
//! plan's cordon and drain).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::aws::ec2::Lookup;
use crate::aws::ec2::TERMINATE_BATCH;
use crate::aws::pacing::{Pace, TerminatePacer};
use crate::aws::{AwsError, Ec2, InstanceInfo, InstanceState};

/// Why a batched call failed for one instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BatchError {
    /// What EC2 (or the batcher) said.
    pub message: String,
    /// Throttling or an AWS server error: running the task again later can succeed.
    pub transient: bool,
    /// EC2 never described the instance: it was neither terminated nor released, and the task
    /// ends blocked, naming it.
    pub unanswered: bool,
}

impl BatchError {
    fn stopped() -> BatchError {
        BatchError { message: "the EC2 batcher stopped".into(), transient: false, unanswered: false }
    }
}

impl From<&AwsError> for BatchError {
    fn from(e: &AwsError) -> BatchError {
        BatchError { message: e.to_string(), transient: e.is_transient(), unanswered: false }
    }
}

type Reply = oneshot::Sender<Result<(), BatchError>>;
type SentReply = oneshot::Sender<Result<Sent, BatchError>>;

/// Asked right before an instance's termination is sent: `Err` says why its machine may no
/// longer go (its node's fence was lifted, or a pod was bound to it, while it waited its turn).
pub type Guard = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What became of a termination asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// EC2 accepted it.
    Accepted,
    /// Not sent: EC2 says, asked by the id itself, that it does not know the instance, and went
    /// on saying so past a fresh launch's describe lag. It is gone.
    Gone,
    /// Not sent: the guard said the machine may no longer go, and why.
    Withdrawn(String),
}

/// A termination asked for: the instance, what must still hold when it is sent, and who waits
/// for the answer.
struct Asked {
    id: String,
    guard: Option<Guard>,
    tx: SentReply,
}

enum Request {
    Terminate(Asked),
    WaitGone(String, Reply),
}

/// Handle to the batching task.
#[derive(Clone)]
pub struct Ec2Batcher {
    tx: mpsc::Sender<Request>,
}

/// How long the batcher gathers requests before calling EC2.
const GATHER: Duration = Duration::from_millis(50);
/// How often it asks EC2 about instances still shutting down.
const POLL: Duration = Duration::from_millis(500);

impl Ec2Batcher {
    /// The handle and the future that does the work (the engine owns and cancels it).
    pub fn start(ec2: Ec2, cluster: String) -> (Ec2Batcher, impl Future<Output = ()> + Send + 'static) {
        let (tx, rx) = mpsc::channel(4096);
        (Ec2Batcher { tx }, run(ec2, cluster, rx))
    }

    /// Terminates one instance (batched with others) once its own tags show it is this
    /// cluster's Karpenter's, and `guard` (asked right before the call that sends it) still lets
    /// it go; an id EC2 does not show is never sent ([`Unseen`]).
    pub async fn terminate(&self, id: &str, guard: Option<Guard>) -> Result<Sent, BatchError> {
        let (tx, rx) = oneshot::channel();
        let asked = Asked { id: id.to_string(), guard, tx };
        self.tx.send(Request::Terminate(asked)).await.map_err(|_| BatchError::stopped())?;
        rx.await.map_err(|_| BatchError::stopped())?
    }

    /// Waits until EC2 reports the instance `terminated` (or does not know it).
    pub async fn wait_terminated(&self, id: &str) -> Result<(), BatchError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Request::WaitGone(id.to_string(), tx)).await.map_err(|_| BatchError::stopped())?;
        rx.await.map_err(|_| BatchError::stopped())?
    }
}

async fn run(ec2: Ec2, cluster: String, mut rx: mpsc::Receiver<Request>) {
    let mut waiting: HashMap<String, Vec<Reply>> = HashMap::new();
    // terminations asked for and not yet sent, oldest first
    let mut queued: VecDeque<Asked> = VecDeque::new();
    let mut pacer = TerminatePacer::new(Instant::now());
    let mut unseen = Unseen::default();
    let mut next_poll = Instant::now();
    loop {
        // Sleep until a request arrives, the bucket holds enough for the queued terminations, or
        // the instances shutting down are due to be asked about again.
        let bucket_ready =
            (!queued.is_empty()).then(|| match pacer.next(queued.len(), TERMINATE_BATCH, Instant::now()) {
                Pace::Now(_) => Instant::now(),
                Pace::After(d) => Instant::now() + d,
            });
        let poll_due = (!waiting.is_empty()).then_some(next_poll);
        let wake = [bucket_ready, poll_due].into_iter().flatten().min();
        let first = match wake {
            None => match rx.recv().await {
                Some(r) => Some(r),
                None => return,
            },
            Some(at) => match tokio::time::timeout_at(at.into(), rx.recv()).await {
                Ok(Some(r)) => Some(r),
                // every handle is gone: nobody is left to answer
                Ok(None) => return,
                Err(_) => None,
            },
        };
        if let Some(r) = first {
            take(r, &mut queued, &mut waiting);
            let deadline = tokio::time::Instant::now() + GATHER;
            while let Ok(Some(r)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                take(r, &mut queued, &mut waiting);
            }
        }
        // Each call takes long enough for the bucket to hold the next one's worth again, so the
        // instances shutting down are asked about between calls when due: otherwise none of the
        // machines terminated so far would be confirmed, and released, before the last call.
        while let Pace::Now(n) = pacer.next(queued.len(), TERMINATE_BATCH, Instant::now())
            && n > 0
        {
            let batch: Vec<Asked> = queued.drain(..n).collect();
            terminate_batch(&ec2, &cluster, &mut pacer, &mut unseen, batch).await;
            if !waiting.is_empty() && Instant::now() >= next_poll {
                break;
            }
        }
        if !waiting.is_empty() && Instant::now() >= next_poll {
            next_poll = Instant::now() + POLL;
            let ids: Vec<String> = waiting.keys().cloned().collect();
            let asked = Instant::now();
            match ec2.live_instances_by_id(&ids).await {
                Ok(found) => {
                    tracing::debug!(
                        instances = ids.len(),
                        live = found.len(),
                        seconds = asked.elapsed().as_secs_f64(),
                        queued = queued.len(),
                        "terminations polled"
                    );
                    let live: HashMap<&str, InstanceState> =
                        found.iter().filter(|i| i.state.is_live()).map(|i| (i.id.as_str(), i.state)).collect();
                    waiting.retain(|id, txs| {
                        if live.contains_key(id.as_str()) {
                            return true;
                        }
                        for tx in txs.drain(..) {
                            let _ = tx.send(Ok(()));
                        }
                        false
                    });
                }
                Err(e) => fail_unless_transient(&mut waiting, &e),
            }
        }
    }
}

fn take(r: Request, queued: &mut VecDeque<Asked>, waiting: &mut HashMap<String, Vec<Reply>>) {
    match r {
        Request::Terminate(asked) => queued.push_back(asked),
        Request::WaitGone(id, tx) => waiting.entry(id).or_default().push(tx),
    }
}

/// Reads the batch's instances, refuses those that are not this cluster's Karpenter's, and
/// terminates the rest in one call, answering every asker.
async fn terminate_batch(ec2: &Ec2, cluster: &str, pacer: &mut TerminatePacer, unseen: &mut Unseen, batch: Vec<Asked>) {
    let ids: Vec<String> = batch.iter().map(|a| a.id.clone()).collect();
    let asked = Instant::now();
    let found = match ec2.instances_by_id(&ids).await {
        Ok(found) => found,
        Err(e) => {
            for a in batch {
                let _ = a.tx.send(Err(BatchError::from(&e)));
            }
            return;
        }
    };
    let (batch, refused, not_shown) = split_ours(batch, &found, cluster);
    for (tx, err) in refused {
        let _ = tx.send(Err(err));
    }
    for a in not_shown {
        // the filter's silence is not EC2's word: ask about the id itself
        let answer = ec2.lookup(&a.id).await;
        let _ = a.tx.send(unseen.judge(&a.id, &answer, Instant::now()));
    }
    // the last look before the call: a machine may have waited its turn for a long time
    let (batch, withdrawn) = still_wanted(batch);
    for (tx, why) in withdrawn {
        tracing::warn!(why = %why, "termination withdrawn before it was sent");
        let _ = tx.send(Ok(Sent::Withdrawn(why)));
    }
    if batch.is_empty() {
        return;
    }
    let ids: Vec<String> = batch.iter().map(|a| a.id.clone()).collect();
    let read = asked.elapsed();
    let result = ec2.terminate(&ids).await;
    tracing::debug!(
        instances = ids.len(),
        read_seconds = read.as_secs_f64(),
        seconds = asked.elapsed().as_secs_f64(),
        ok = result.is_ok(),
        "termination batch sent"
    );
    match &result {
        Ok(_) => pacer.spent(ids.len(), Instant::now()),
        // The SDK already retried the throttled call; the askers try again later (their tasks
        // retry), and meanwhile the model starts from empty.
        Err(e) if e.is_throttling() => pacer.refused(Instant::now()),
        Err(_) => {}
    }
    for a in batch {
        let r = match &result {
            Ok(out) => match out.failed.iter().find(|(f, _)| *f == a.id) {
                Some((_, e)) => Err(BatchError { message: e.clone(), transient: false, unanswered: false }),
                None => Ok(Sent::Accepted),
            },
            Err(e) => Err(BatchError::from(e)),
        };
        let _ = a.tx.send(r);
    }
}

/// Splits a batch into what may still be sent and what its guard withdraws, with why.
fn still_wanted(batch: Vec<Asked>) -> (Vec<Asked>, Vec<(SentReply, String)>) {
    let mut send = Vec::new();
    let mut withdrawn = Vec::new();
    for a in batch {
        match a.guard.as_ref().map_or(Ok(()), |g| g()) {
            Ok(()) => send.push(a),
            Err(why) => withdrawn.push((a.tx, why)),
        }
    }
    (send, withdrawn)
}

/// What the batch's `DescribeInstances` did not return, and since when: such an instance is
/// never sent to `TerminateInstances`, whose own answer does not check its tags, and a filtered
/// describe's silence is not taken for an answer. The id is asked about on its own
/// ([`crate::aws::ec2::Ec2::lookup`]): only EC2's `InvalidInstanceID.NotFound`, still given
/// [`UNSEEN_GRACE`] after the id was first missing (a fresh launch is not described for some
/// seconds, eventual consistency), says the instance is gone. An id EC2 goes on answering
/// without, or about which the lookup fails, is neither terminated nor released: after the
/// grace its task ends blocked, naming the instance.
#[derive(Debug, Default)]
struct Unseen {
    first_missing: HashMap<String, Instant>,
}

/// How long an instance EC2 does not show is taken to be a fresh one EC2 does not show yet.
const UNSEEN_GRACE: Duration = Duration::from_secs(20);

impl Unseen {
    fn judge(&mut self, id: &str, answer: &Result<Lookup, AwsError>, now: Instant) -> Result<Sent, BatchError> {
        let since = *self.first_missing.entry(id.to_string()).or_insert(now);
        let waited = now.duration_since(since) >= UNSEEN_GRACE;
        let again = |what: String| BatchError {
            message: format!("{what}: it is not terminated unchecked; asking again"),
            transient: true,
            unanswered: false,
        };
        match answer {
            Ok(Lookup::Shown(_)) => Err(again(format!("EC2 shows instance {id} only when asked by its id"))),
            Ok(Lookup::Unknown) if waited => {
                tracing::info!(instance = %id, "EC2 says it does not know the instance: gone, nothing to terminate");
                Ok(Sent::Gone)
            }
            Ok(Lookup::Unknown) => Err(again(format!("EC2 does not know instance {id} (yet)"))),
            Ok(Lookup::Silent) | Err(_) if waited => Err(BatchError {
                message: format!(
                    "EC2 has not described instance {id} for {} ({}): it was neither terminated nor released; check it in EC2 and run again",
                    humantime::format_duration(UNSEEN_GRACE),
                    match answer {
                        Err(e) => format!("asked by its id: {e}"),
                        _ => "asked by its id, it answered without it".into(),
                    }
                ),
                transient: false,
                unanswered: true,
            }),
            Ok(Lookup::Silent) => Err(again(format!("EC2's DescribeInstances does not show instance {id} (yet)"))),
            Err(e) => Err(again(format!("asking EC2 about instance {id} failed ({e})"))),
        }
    }
}

/// Splits a batch into the instances that may be terminated (this cluster's Karpenter's, as
/// their own tags show), the refusals of the others, each naming whose the instance is, and the
/// ids EC2 did not return (never terminated unchecked: [`Unseen`]).
fn split_ours(
    batch: Vec<Asked>,
    found: &[InstanceInfo],
    cluster: &str,
) -> (Vec<Asked>, Vec<(SentReply, BatchError)>, Vec<Asked>) {
    let mut ours = Vec::new();
    let mut refused = Vec::new();
    let mut not_shown = Vec::new();
    for a in batch {
        let id = a.id.as_str();
        match found.iter().find(|i| i.id == id).map(|i| i.is_karpenters(cluster)) {
            Some(Err(why)) => {
                tracing::warn!(instance = %id, why = %why, "refusing to terminate an instance that is not this cluster's Karpenter's");
                let message = format!(
                    "instance {id} is not this cluster's self-managed Karpenter's ({why}); it was left running"
                );
                refused.push((a.tx, BatchError { message, transient: false, unanswered: false }));
            }
            Some(Ok(())) => ours.push(a),
            None => not_shown.push(a),
        }
    }
    (ours, refused, not_shown)
}

/// Only throttling and AWS's own server errors heal by themselves: those are retried on the next
/// round. Anything else (credentials, endpoint, a request EC2 refuses such as
/// `FilterLimitExceeded`) fails the same way every round, so every waiter is told at once instead
/// of the batcher asking for ever.
fn fail_unless_transient(waiting: &mut HashMap<String, Vec<Reply>>, e: &AwsError) {
    if !e.is_transient() {
        for (_, txs) in waiting.drain() {
            for tx in txs {
                let _ = tx.send(Err(BatchError::from(e)));
            }
        }
    } else {
        tracing::warn!(error = %e, "describing instances failed; retrying");
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::karpenter;

    fn instance(id: &str, tags: &[(&str, &str)], managed_by: Option<&str>) -> InstanceInfo {
        InstanceInfo {
            id: id.into(),
            state: InstanceState::Running,
            zone: "us-west-2a".into(),
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            managed_by: managed_by.map(str::to_string),
            launched: None,
            instance_type: None,
            market: None,
        }
    }

    #[test]
    fn only_this_clusters_karpenter_instances_reach_terminate() {
        let ours =
            [(karpenter::TAG_EKS_CLUSTER, "prod"), (karpenter::TAG_NODEPOOL, "web"), (karpenter::TAG_NODECLASS, "d")];
        let found = vec![
            instance("i-ours", &ours, None),
            instance("i-auto", &ours, Some("eks.amazonaws.com")),
            instance("i-other", &[(karpenter::TAG_EKS_CLUSTER, "staging")], None),
        ];
        let mut replies = Vec::new();
        let batch: Vec<Asked> = ["i-ours", "i-auto", "i-other", "i-gone"]
            .into_iter()
            .map(|id| {
                let (tx, rx) = oneshot::channel();
                replies.push((id, rx));
                Asked { id: id.to_string(), guard: None, tx }
            })
            .collect();
        let (ours, refused, not_shown) = split_ours(batch, &found, "prod");
        let ids: Vec<&str> = ours.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(ids, ["i-ours"]);
        let unseen: Vec<&str> = not_shown.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(unseen, ["i-gone"], "an id DescribeInstances did not return is never sent unchecked");
        let messages: Vec<String> = refused.iter().map(|(_, e)| e.message.clone()).collect();
        assert_eq!(messages.len(), 2);
        assert!(messages[0].contains("i-auto") && messages[0].contains("EKS Auto Mode"), "{messages:?}");
        assert!(messages[1].contains("i-other") && messages[1].contains("staging"), "{messages:?}");
    }

    #[test]
    fn a_guard_that_no_longer_lets_its_machine_go_withdraws_it_from_the_batch() {
        let (held_tx, mut held_rx) = oneshot::channel();
        let (clear_tx, _clear_rx) = oneshot::channel();
        let (free_tx, _free_rx) = oneshot::channel();
        let batch = vec![
            Asked { id: "i-held".into(), guard: Some(Box::new(|| Err("a pod was bound".into()))), tx: held_tx },
            Asked { id: "i-clear".into(), guard: Some(Box::new(|| Ok(()))), tx: clear_tx },
            Asked { id: "i-free".into(), guard: None, tx: free_tx },
        ];
        let (send, withdrawn) = still_wanted(batch);
        let ids: Vec<&str> = send.iter().map(|a| a.id.as_str()).collect();
        assert_eq!(ids, ["i-clear", "i-free"]);
        assert_eq!(withdrawn.len(), 1);
        let (tx, why) = withdrawn.into_iter().next().unwrap();
        assert_eq!(why, "a pod was bound");
        tx.send(Ok(Sent::Withdrawn(why))).unwrap();
        assert_eq!(held_rx.try_recv().unwrap(), Ok(Sent::Withdrawn("a pod was bound".into())));
    }

    #[test]
    fn only_ec2s_own_not_found_past_the_grace_takes_an_unseen_instance_as_gone() {
        let mut unseen = Unseen::default();
        let t0 = Instant::now();
        let unknown = Ok(Lookup::Unknown);
        let first = unseen.judge("i-fresh", &unknown, t0);
        assert!(first.as_ref().is_err_and(|e| e.transient), "{first:?}");
        assert!(unseen.judge("i-fresh", &unknown, t0 + UNSEEN_GRACE / 2).is_err(), "still inside the grace");
        assert_eq!(unseen.judge("i-fresh", &unknown, t0 + UNSEEN_GRACE), Ok(Sent::Gone), "EC2 says it is unknown");
        assert!(unseen.judge("i-other", &unknown, t0 + UNSEEN_GRACE).is_err(), "each id has its own grace");
    }

    #[test]
    fn ec2s_silence_is_never_taken_for_gone_and_ends_blocked_after_the_grace() {
        let mut unseen = Unseen::default();
        let t0 = Instant::now();
        let silent = Ok(Lookup::Silent);
        assert!(unseen.judge("i-quiet", &silent, t0).is_err_and(|e| e.transient && !e.unanswered));
        let after = unseen.judge("i-quiet", &silent, t0 + UNSEEN_GRACE);
        let e = after.expect_err("silence is no answer");
        assert!(!e.transient && e.unanswered, "{e:?}");
        assert!(e.message.contains("i-quiet") && e.message.contains("neither terminated nor released"), "{e:?}");
        // a lookup that fails is no answer either
        let failed: Result<Lookup, AwsError> = Err(AwsError::Api {
            service: "ec2",
            operation: "DescribeInstances",
            code: "InternalError".into(),
            message: "boom".into(),
        });
        assert!(unseen.judge("i-err", &failed, t0).is_err_and(|e| e.transient));
        assert!(unseen.judge("i-err", &failed, t0 + UNSEEN_GRACE).is_err_and(|e| e.unanswered));
        // shown when asked by its id: asked again, never taken as gone
        let shown = Ok(Lookup::Shown(instance("i-late", &[], None)));
        assert!(unseen.judge("i-late", &shown, t0 + UNSEEN_GRACE * 2).is_err_and(|e| e.transient));
    }
}
