//! The sandbox: an in-memory Kubernetes API server and simulated controllers for tests and demos.

pub mod apiserver;
pub mod controlplane;
pub mod ec2limits;
pub mod ec2proxy;
pub mod karpenter_crds;
pub mod localstack;
pub mod sim;

use std::path::PathBuf;

pub use apiserver::{ApiServer, FaultConfig, ServerOptions};

/// Errors of the sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The listening socket could not be opened.
    #[error("cannot listen on 127.0.0.1:{port}: {source}; pick another port or use 0 for any")]
    Bind {
        /// Requested port.
        port: u16,
        /// Cause.
        source: std::io::Error,
    },
    /// The kubeconfig could not be written.
    #[error("cannot write kubeconfig {path}: {reason}; check that the directory exists and is writable")]
    Kubeconfig {
        /// Target path.
        path: PathBuf,
        /// Cause.
        reason: String,
    },
}
