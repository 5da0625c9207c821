//! A stage's retry policy, as the spec gives it: a budget per failure class, with exponential
//! backoff.

use std::time::Duration;

use mflow_contract::FailureClass;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Retries allowed per class.
    pub max: u32,
    pub backoff: Duration,
    pub max_backoff: Duration,
    pub on: Vec<FailureClass>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max: 0,
            backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(300),
            on: vec![FailureClass::Infra, FailureClass::Timeout],
        }
    }
}

impl RetryPolicy {
    pub fn is_default(&self) -> bool {
        *self == RetryPolicy::default()
    }
}
