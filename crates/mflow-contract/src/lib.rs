//! mflow's public surface, as types. Everything a script, a CI system, a notebook or a stage's
//! own code may read or write is defined here, once:
//!
//! - [`exit`]: the exit codes (`mflow exit-codes`, docs/exit-codes.md);
//! - [`event`]: the run events a run emits (the console, JSON lines, JUnit and the follower of a
//!   run in a cluster all read them);
//! - [`record`] and [`lock`]: run.json and mflow.lock, with their format versions;
//! - [`workload`]: the stage <-> workload protocol (the configs mflow writes for the Python
//!   workloads, with their JSON Schemas; the status and progress files a stage writes);
//! - [`vars`]: every `MFLOW_*` environment variable, with its meaning (docs/environment.md).
//!
//! The crate holds data and the rules that define it (how a cache key is derived from its
//! parts, how an exit code follows from a record); it does no I/O.

pub mod class;
pub mod event;
pub mod exit;
pub mod lock;
pub mod record;
pub mod vars;
pub mod workload;

pub use class::FailureClass;
pub use exit::ExitCode;
