//! mflow: a declarative pipeline engine for taking Hugging Face models through Megatron and back.
//!
//! The arrows of the design are the modules: `spec` (TOML -> validated spec) -> `plan` (DAG with
//! cache keys) -> `exec` (scheduling, retries, progress) -> `backend` (where an attempt runs) ->
//! `cache` (content-addressed store) and `record` (run records and lockfiles). `stages` holds
//! the kinds, `env` the machine and the Python environment.

pub mod backend;
pub mod cache;
pub mod ci;
pub mod cli;
pub mod env;
pub mod exec;
pub mod exit;
pub mod plan;
pub mod project;
pub mod record;
pub mod reporter;
pub mod run;
pub mod settings;
pub mod spec;
pub mod stages;
pub mod stdio;
pub mod untrusted;
pub mod user_output;
pub mod workdir;

use std::path::Path;

use miette::Diagnostic;
use thiserror::Error;

/// Errors that end a command.
#[derive(Debug, Error, Diagnostic)]
pub enum Error {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Spec(#[from] spec::SpecErrors),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Plan(#[from] plan::PlanError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Cache(#[from] cache::CacheError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Env(#[from] env::EnvError),
    #[error("I/O on {path}")]
    #[diagnostic(code(mflow::io))]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{message}")]
    #[diagnostic(code(mflow::usage), help("{help}"))]
    Usage { message: String, help: String },
    /// The cluster could not be reached, or refused before anything ran.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Cluster(#[from] backend::kubernetes::KubernetesError),
}

impl Error {
    pub fn io(path: &Path, source: std::io::Error) -> Error {
        Error::Io { path: path.display().to_string(), source }
    }

    pub fn usage(message: impl Into<String>, help: impl Into<String>) -> Error {
        Error::Usage { message: message.into(), help: help.into() }
    }

    pub fn exit_code(&self) -> exit::ExitCode {
        match self {
            Error::Plan(plan::PlanError::Unavailable { .. }) => exit::ExitCode::Infra,
            Error::Cluster(e) => exit::for_cluster(e),
            Error::Spec(_) | Error::Plan(_) | Error::Usage { .. } => exit::ExitCode::Invalid,
            _ => exit::ExitCode::Internal,
        }
    }
}
