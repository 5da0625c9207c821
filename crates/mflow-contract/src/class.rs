//! Failure classes: how a stage attempt ended, in the words a stage may also use in its
//! `MFLOW_STATUS` file. The engine keeps one retry budget per class; the Kubernetes backend
//! derives them from pod and job status.

use serde::{Deserialize, Serialize};

/// Why an attempt failed. Each class has its own retry budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FailureClass {
    /// Preemption, eviction, a lost peer, a spawn failure, an unreachable service: worth
    /// retrying.
    Infra,
    /// The stage's own code or its inputs failed: the same attempt fails again.
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
    pub const ALL: [FailureClass; 6] = [
        FailureClass::Infra,
        FailureClass::User,
        FailureClass::Oom,
        FailureClass::Timeout,
        FailureClass::Cancelled,
        FailureClass::Gate,
    ];

    /// Classes a retry policy may name in `on`.
    pub const RETRYABLE: &'static [&'static str] = &["infra", "user", "oom", "timeout"];

    pub fn parse(s: &str) -> Option<FailureClass> {
        FailureClass::ALL.into_iter().find(|c| c.as_str() == s)
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
}

impl FailureClass {
    /// The class of a failure a system call reported. The rule (docs/exit-codes.md, [`RULE`]):
    /// what may pass on its own (a peer or service not answering, no memory, no process slot,
    /// no file descriptor, a full disk, a busy file) is `infra`, worth retrying; what the same
    /// attempt meets again (a missing file, no right to it, a NUL byte, an argument list or a
    /// path too long, a file of the wrong type) is `user`.
    pub fn of_io(e: &std::io::Error) -> FailureClass {
        use std::io::ErrorKind as K;
        if let Some(errno) = e.raw_os_error() {
            return FailureClass::of_errno(errno);
        }
        match e.kind() {
            K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::HostUnreachable
            | K::NetworkUnreachable
            | K::NetworkDown
            | K::AddrNotAvailable
            | K::BrokenPipe
            | K::TimedOut
            | K::Interrupted
            | K::WouldBlock
            | K::OutOfMemory
            | K::StorageFull
            | K::ResourceBusy
            | K::ExecutableFileBusy => FailureClass::Infra,
            _ => FailureClass::User,
        }
    }

    /// [`FailureClass::of_io`] of an errno value.
    pub fn of_errno(errno: i32) -> FailureClass {
        const PASSING: &[i32] = &[
            libc::EAGAIN,
            libc::EINTR,
            libc::ENOMEM,
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOSPC,
            libc::EDQUOT,
            libc::EROFS,
            libc::EBUSY,
            libc::ETXTBSY,
            libc::EIO,
            libc::ESTALE,
            libc::ECONNREFUSED,
            libc::ECONNRESET,
            libc::ECONNABORTED,
            libc::ENOTCONN,
            libc::EPIPE,
            libc::ETIMEDOUT,
            libc::EHOSTUNREACH,
            libc::EHOSTDOWN,
            libc::ENETUNREACH,
            libc::ENETDOWN,
            libc::ENETRESET,
            libc::EADDRNOTAVAIL,
        ];
        if PASSING.contains(&errno) {
            FailureClass::Infra
        } else {
            FailureClass::User
        }
    }

    /// The class of a process that a signal ended: SIGKILL is the kernel's OOM killer's (`oom`);
    /// SIGTERM, SIGHUP or SIGINT from outside (a node drained, a terminal closed) may pass
    /// (`infra`); any other is a crash (`user`).
    pub fn of_signal(signal: i32) -> FailureClass {
        match signal {
            libc::SIGKILL => FailureClass::Oom,
            libc::SIGTERM | libc::SIGHUP | libc::SIGINT => FailureClass::Infra,
            _ => FailureClass::User,
        }
    }

    /// The class of an HTTP answer: a server that is down, overloaded or asks to wait (5xx,
    /// 408, 429) is `infra`; any other refusal (a wrong name, revision or token) is `user`.
    pub fn of_http_status(status: u16) -> FailureClass {
        if status >= 500 || status == 408 || status == 429 {
            FailureClass::Infra
        } else {
            FailureClass::User
        }
    }
}

/// How a failure gets its class, by what it is, never by its text: `(class, what falls in it)`.
/// docs/exit-codes.md is generated from it.
pub const RULE: &[(&str, &str)] = &[
    (
        "infra",
        "what may pass by itself, worth retrying: a node, pod or peer lost; a connection refused, reset or timed out; a Hub or server answering 5xx, 408 or 429; no memory for a process, no process slot, no file descriptor, a full disk or quota, a read-only or stale volume, a busy file; a stage ended by SIGTERM, SIGHUP or SIGINT from outside",
    ),
    (
        "user",
        "what the same attempt meets again: a command that exits non-zero or crashes; a program, file or model that does not exist (404) or may not be read (401, 403, EACCES); a NUL byte in an argument or environment value; an argument list or environment too long (E2BIG); a path or file name too long (ENAMETOOLONG); a link, FIFO or name not in UTF-8 in a stage's output",
    ),
    ("oom", "killed by SIGKILL (the kernel's OOM killer) or out of CUDA or host memory inside the workload"),
    ("timeout", "the stage's `timeout` reached"),
    ("gate", "a `gates` condition on metrics.json did not hold; never retried"),
];

/// [`RULE`] as docs/exit-codes.md holds it.
pub fn rule_markdown() -> String {
    let mut out = String::from("| class | what gets it |\n|---|---|\n");
    for (class, what) in RULE {
        out.push_str(&format!("| `{class}` | {what} |\n"));
    }
    out
}

impl std::fmt::Display for FailureClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_may_pass_is_infra_and_what_repeats_is_user() {
        use std::io::{Error, ErrorKind};
        for errno in [libc::ECONNREFUSED, libc::ETIMEDOUT, libc::ENOSPC, libc::EMFILE, libc::EAGAIN, libc::ENOMEM] {
            assert_eq!(FailureClass::of_io(&Error::from_raw_os_error(errno)), FailureClass::Infra, "{errno}");
        }
        for errno in
            [libc::E2BIG, libc::ENAMETOOLONG, libc::ENOENT, libc::EACCES, libc::ENOEXEC, libc::ELOOP, libc::EINVAL]
        {
            assert_eq!(FailureClass::of_io(&Error::from_raw_os_error(errno)), FailureClass::User, "{errno}");
        }
        // Errors without an errno: by their kind (a NUL byte is refused before the system is asked).
        assert_eq!(FailureClass::of_io(&Error::from(ErrorKind::ConnectionRefused)), FailureClass::Infra);
        assert_eq!(FailureClass::of_io(&Error::from(ErrorKind::InvalidInput)), FailureClass::User);
        assert_eq!(FailureClass::of_http_status(503), FailureClass::Infra);
        assert_eq!(FailureClass::of_http_status(429), FailureClass::Infra);
        assert_eq!(FailureClass::of_http_status(404), FailureClass::User);
        assert_eq!(FailureClass::of_http_status(401), FailureClass::User);
    }

    #[test]
    fn the_rule_names_every_class_a_failure_can_get() {
        for c in FailureClass::ALL.into_iter().filter(|c| *c != FailureClass::Cancelled) {
            assert!(RULE.iter().any(|(name, _)| *name == c.as_str()), "{c}");
        }
    }
}
