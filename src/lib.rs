//! karpenter-teardown: tears down the compute of a Karpenter-managed EKS cluster safely and in
//! order, and proves through the EC2 API that no instance it was responsible for is left running.
//!
//! The library holds everything; the binary (`src/main.rs`) only parses the command line, hands
//! it to [`commands`] and turns the outcome into an exit code.
#![forbid(unsafe_code)]

pub mod aws;
pub(crate) mod cleanup;
pub mod cli;
pub mod commands;
pub(crate) mod config;
pub mod engine;
pub(crate) mod evidence;
pub mod exit;
pub mod gitops;
pub mod k8s;
pub mod karpenter;
pub mod logging;
pub mod partition;
pub mod plan;
pub(crate) mod progress;
#[cfg(feature = "sandbox")]
pub(crate) mod rehearse;
pub mod report;
pub(crate) mod scheduling;
pub mod snapshot;
pub(crate) mod sweep;
pub(crate) mod tfprune;
pub mod verify;
