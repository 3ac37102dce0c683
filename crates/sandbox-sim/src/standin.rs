//! What the stand-ins of the cleanup controllers (`lbc`, `ebscsi`) share: a reconcile loop that
//! acts only while the controller's pod runs on a node that is there, so a drain that evicts the
//! pod stops it, as on EKS.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, ListParams};
use tokio_util::sync::CancellationToken;

/// A running stand-in, until [`StandIn::shutdown`].
pub struct StandIn {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl StandIn {
    /// Runs `pass` every `interval` while a pod labelled `label` runs; `name` names the stand-in
    /// in the log of a pass that failed (tried again at the next).
    pub(crate) fn spawn<F, Fut>(
        client: Client,
        label: &'static str,
        name: &'static str,
        interval: Duration,
        mut pass: F,
    ) -> StandIn
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), String>> + Send,
    {
        let cancel = CancellationToken::new();
        let token = cancel.clone();
        let task = tokio::spawn(async move {
            loop {
                if running_with(&client, label).await
                    && let Err(e) = pass().await
                {
                    tracing::debug!(error = %e, "stand-in {name}: a pass failed; tried again");
                }
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        });
        StandIn { cancel, task }
    }

    /// Stops it.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// True while a pod labelled `label`, not being deleted, is bound to a node that is there.
async fn running_with(client: &Client, label: &str) -> bool {
    let pods: Api<Pod> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let Ok(list) = pods.list(&ListParams::default().labels(label)).await else { return false };
    for p in list.items {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(node) = p.spec.and_then(|s| s.node_name) else { continue };
        if let Ok(Some(n)) = nodes.get_opt(&node).await
            && n.metadata.deletion_timestamp.is_none()
        {
            return true;
        }
    }
    false
}
