//! End to end: the real binary against the sandbox API server, the simulated Karpenter and
//! LocalStack: the default plan, the other plans, resuming after a kill, faults, and the field
//! reports.
//!
//! One test binary per area, a module per topic: one link instead of one per file.

#[path = "../common/mod.rs"]
mod common;

mod admission;
mod cleanup;
mod default_plan;
mod ec2_time;
mod evidence;
mod faults;
mod field_reports;
mod gitops;
mod not_ours;
mod ours;
mod plans;
mod resume;
mod sweep;
