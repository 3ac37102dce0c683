//! The tool's interface as users and operators meet it: the command line, plans, bad input,
//! `tf-prune`, and the operator's contract (output without a terminal, the report against its schema,
//! the shipped RBAC and IAM policies).
//!
//! One test binary per area, a module per topic: one link instead of one per file.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod cli;
mod operator;
mod plan;
mod tfprune;
