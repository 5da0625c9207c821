//! What can go wrong with the store, and the exit code each gives.

use std::io;
use std::path::{Path, PathBuf};

use miette::Diagnostic;
use thiserror::Error;

use crate::exit::ExitCode;
use mflow_contract::FailureClass;

#[derive(Debug, Error, Diagnostic)]
pub enum CacheError {
    /// The cause is part of the message: a stage's failure shows only the message.
    #[error("{op} {}: {cause}", path.display())]
    #[diagnostic(
        code(mflow::cache::io),
        help("check the permissions of the workdir and the free space on its filesystem")
    )]
    Io { op: &'static str, path: PathBuf, cause: io::Error },
    #[error("{op} {}: {cause}", path.display())]
    #[diagnostic(
        code(mflow::cache::not_regular),
        help("mflow keeps a regular file there: move what is in its place elsewhere")
    )]
    NotRegular { op: &'static str, path: PathBuf, cause: io::Error },
    #[error("stage output file name {name} is not valid UTF-8 (shown escaped)")]
    #[diagnostic(
        code(mflow::cache::file_name),
        help("name output files in UTF-8: the manifest and the lockfile record names as text")
    )]
    NotUtf8 { name: String },
    #[error("stage output contains {}, which is not a regular file or directory", path.display())]
    #[diagnostic(
        code(mflow::cache::file_type),
        help("write plain files and directories under $MFLOW_OUTPUT; copy instead of linking")
    )]
    FileType { path: PathBuf },
    #[error("the manifest log {} cannot be used: {cause}", path.display())]
    #[diagnostic(
        code(mflow::cache::log),
        help("mflow keeps a regular file there; `mflow cache repair --workdir {}` moves what is in the way aside and rebuilds the log from the entries", workdir.display())
    )]
    Log { path: PathBuf, workdir: PathBuf, cause: io::Error },
    #[error("{} is not a workdir mflow may use: {reason}", path.display())]
    #[diagnostic(code(mflow::cache::not_workdir), help("{help}"))]
    NotWorkdir { path: PathBuf, reason: String, help: String },
    #[error("the cache of {} is in use by a run (or another `mflow gc` or `mflow cache repair`); nothing was changed", workdir.display())]
    #[diagnostic(
        code(mflow::cache::in_use),
        help("run it again when the run has ended, or pass --wait to wait for it")
    )]
    InUse { workdir: PathBuf },
}

impl CacheError {
    /// Refusals are the caller's to fix (2), a busy cache is to be retried (3), the rest is
    /// the environment (70).
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CacheError::NotWorkdir { .. } => ExitCode::Invalid,
            CacheError::InUse { .. } => ExitCode::Infra,
            _ => ExitCode::Internal,
        }
    }

    /// The class of a stage that failed on this (docs/exit-codes.md): by the system's error
    /// where there is one; a link, a FIFO or a name not in UTF-8 in the output is the stage's
    /// doing and fails every time; a busy cache passes.
    pub fn class(&self) -> FailureClass {
        match self {
            CacheError::Io { cause, .. } | CacheError::NotRegular { cause, .. } | CacheError::Log { cause, .. } => {
                FailureClass::of_io(cause)
            }
            CacheError::NotUtf8 { .. } | CacheError::FileType { .. } | CacheError::NotWorkdir { .. } => {
                FailureClass::User
            }
            CacheError::InUse { .. } => FailureClass::Infra,
        }
    }
}

pub(crate) fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |cause| match cause.kind() {
        // What `files::open` and `hash_file` say of a FIFO, a directory or a link in a file's place.
        io::ErrorKind::InvalidInput => CacheError::NotRegular { op, path: path.to_path_buf(), cause },
        _ => CacheError::Io { op, path: path.to_path_buf(), cause },
    }
}
