//! The test bed itself: the sandbox API server's Kubernetes semantics, real `kubectl` against it,
//! and the simulated Karpenter and GitOps reconcilers.
//!
//! One test binary per area, a module per topic: one link instead of one per file.

#[path = "../common/mod.rs"]
mod common;

mod apiserver;
mod kubectl;
mod sim;
