//! `rehearse` end to end: the real binary against sandbox clusters on the real clock,
//! its predictions held to real runs of the same clusters.
//!
//! A binary of its own, its tests one at a time: a prediction of wall time is compared with a
//! real run made minutes later, and the other tests of a binary running beside either of them
//! would load the machine differently for each.

#[path = "../common/mod.rs"]
mod common;

mod rehearse;

/// Held by each test for its whole run.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
