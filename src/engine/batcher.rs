//! EC2 batching for per-machine tasks: terminations are gathered into `TerminateInstances` calls
//! of up to 500 ids, and one `DescribeInstances` per round answers every task waiting for its
//! instance to reach `terminated` (design §5), instead of one call per machine.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::aws::ec2::TERMINATE_BATCH;
use crate::aws::{AwsError, Ec2, InstanceState};

enum Request {
    Terminate(String, oneshot::Sender<Result<(), String>>),
    WaitGone(String, oneshot::Sender<Result<(), String>>),
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
    pub fn start(ec2: Ec2) -> (Ec2Batcher, impl Future<Output = ()> + Send + 'static) {
        let (tx, rx) = mpsc::channel(4096);
        (Ec2Batcher { tx }, run(ec2, rx))
    }

    /// Terminates one instance (batched with others); unknown ids count as done.
    pub async fn terminate(&self, id: &str) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Request::Terminate(id.to_string(), tx))
            .await
            .map_err(|_| "the EC2 batcher stopped".to_string())?;
        rx.await.map_err(|_| "the EC2 batcher stopped".to_string())?
    }

    /// Waits until EC2 reports the instance `terminated` (or does not know it).
    pub async fn wait_terminated(&self, id: &str) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Request::WaitGone(id.to_string(), tx)).await.map_err(|_| "the EC2 batcher stopped".to_string())?;
        rx.await.map_err(|_| "the EC2 batcher stopped".to_string())?
    }
}

async fn run(ec2: Ec2, mut rx: mpsc::Receiver<Request>) {
    let mut waiting: HashMap<String, Vec<oneshot::Sender<Result<(), String>>>> = HashMap::new();
    loop {
        let first = if waiting.is_empty() {
            match rx.recv().await {
                Some(r) => Some(r),
                None => return,
            }
        } else {
            tokio::time::timeout(POLL, rx.recv()).await.unwrap_or_default()
        };
        let mut terminate: Vec<(String, oneshot::Sender<Result<(), String>>)> = Vec::new();
        let mut take = |r: Request, waiting: &mut HashMap<_, Vec<_>>| match r {
            Request::Terminate(id, tx) => terminate.push((id, tx)),
            Request::WaitGone(id, tx) => waiting.entry(id).or_default().push(tx),
        };
        if let Some(r) = first {
            take(r, &mut waiting);
            let deadline = tokio::time::Instant::now() + GATHER;
            while let Ok(Some(r)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                take(r, &mut waiting);
            }
        }
        while !terminate.is_empty() {
            let rest = terminate.split_off(terminate.len().min(TERMINATE_BATCH));
            let batch = std::mem::replace(&mut terminate, rest);
            let ids: Vec<String> = batch.iter().map(|(id, _)| id.clone()).collect();
            let result = ec2.terminate(&ids).await;
            for (id, tx) in batch {
                let r = match &result {
                    Ok(out) => match out.failed.iter().find(|(f, _)| *f == id) {
                        Some((_, e)) => Err(e.clone()),
                        None => Ok(()),
                    },
                    Err(e) => Err(e.to_string()),
                };
                let _ = tx.send(r);
            }
        }
        if !waiting.is_empty() {
            let ids: Vec<String> = waiting.keys().cloned().collect();
            match ec2.instances_by_id(&ids).await {
                Ok(found) => {
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
                Err(e) => fail_config(&mut waiting, &e),
            }
        }
    }
}

/// A configuration failure (credentials, endpoint) will not heal: tell every waiter. Anything
/// else is retried on the next round.
fn fail_config(waiting: &mut HashMap<String, Vec<oneshot::Sender<Result<(), String>>>>, e: &AwsError) {
    if e.is_configuration() {
        for (_, txs) in waiting.drain() {
            for tx in txs {
                let _ = tx.send(Err(e.to_string()));
            }
        }
    } else {
        tracing::warn!(error = %e, "describing instances failed; retrying");
    }
}
