//! Where a stage's attempt runs. A backend takes a [`Job`] and returns an [`Outcome`]; it knows
//! nothing of caching, retries or plans.

pub mod local;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::exec::retry::FailureClass;

/// One attempt of one stage, fully resolved.
#[derive(Debug, Clone)]
pub struct Job {
    pub stage: String,
    pub key: String,
    pub attempt: u32,
    /// Commands run in order; the attempt fails at the first that fails.
    pub steps: Vec<Vec<String>>,
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    pub timeout: Option<Duration>,
    /// The attempt's log file (stdout and stderr, interleaved by line).
    pub log: PathBuf,
    /// Where the stage may write `{"class": ..., "message": ...}`.
    pub status_file: PathBuf,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Success,
    Failed { class: FailureClass, message: String },
}

/// How hard to stop running attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cancel {
    None,
    /// SIGTERM, a grace period, then SIGKILL.
    Graceful,
    /// SIGKILL now.
    Immediate,
}

/// A line a stage printed.
#[derive(Debug, Clone)]
pub struct Line {
    pub stage: String,
    pub text: String,
}
