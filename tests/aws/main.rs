//! The product's own EC2/IAM layer against LocalStack through the real SDK.
//!
//! One test binary per area, a module per topic: one link instead of one per file.

#[path = "../common/mod.rs"]
mod common;

mod emulator;
mod load_balancing;
mod localstack;
mod policy;
