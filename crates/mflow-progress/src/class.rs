//! Failure classes: how a stage attempt ended, in the words a stage may also use in its
//! `MFLOW_STATUS` file. The engine keeps one retry budget per class; the Kubernetes backend
//! derives them from pod and job status.

use serde::{Deserialize, Serialize};

/// Why an attempt failed. Each class has its own retry budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureClass {
    /// Preemption, eviction, a lost peer, a spawn failure: worth retrying.
    Infra,
    /// The stage's own code failed.
    User,
    /// Killed for memory.
    Oom,
    /// Ran past its timeout.
    Timeout,
    /// Stopped by the user.
    Cancelled,
    /// A metric gate failed; never retried.
    Gate,
}

impl FailureClass {
    pub fn parse(s: &str) -> Option<FailureClass> {
        Some(match s {
            "infra" => FailureClass::Infra,
            "user" => FailureClass::User,
            "oom" => FailureClass::Oom,
            "timeout" => FailureClass::Timeout,
            "cancelled" => FailureClass::Cancelled,
            "gate" => FailureClass::Gate,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Infra => "infra",
            FailureClass::User => "user",
            FailureClass::Oom => "oom",
            FailureClass::Timeout => "timeout",
            FailureClass::Cancelled => "cancelled",
            FailureClass::Gate => "gate",
        }
    }

    /// Classes a policy may name in `on`.
    pub const RETRYABLE: &'static [&'static str] = &["infra", "user", "oom", "timeout"];
}

impl std::fmt::Display for FailureClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

