//! mflow in CI and on schedules: JUnit files, GitHub step summaries, HTML reports with plots,
//! metric diffs between runs, reproducing a run from its lockfile, Kubernetes CronJobs, and
//! webhook notifications.

pub mod after_run;
mod cron;
pub mod diff;
pub mod junit;
pub mod notify;
pub mod report;
pub mod reporters;
pub mod reproduce;
pub mod run_data;
pub mod schedule;
pub mod summary;

use std::path::PathBuf;

use miette::Diagnostic;
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
pub enum CiError {
    #[error("no run `{run}` in {}", workdir.display())]
    #[diagnostic(code(mflow::ci::no_run), help("`mflow runs --workdir {}` lists the runs; pass --workdir to point at another one", workdir.display()))]
    NoRun { run: String, workdir: PathBuf },
    #[error("run {run} has no readable {file}")]
    #[diagnostic(
        code(mflow::ci::damaged_run),
        help("the run directory may be damaged or from an older mflow; rerun the pipeline")
    )]
    DamagedRun { run: String, file: String },
    #[error("cannot write {}", path.display())]
    #[diagnostic(code(mflow::ci::write), help("check that the directory exists and is writable"))]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot draw the {what} plot: {message}")]
    #[diagnostic(code(mflow::ci::plot), help("this is a bug in mflow's report; the run itself is unaffected"))]
    Plot { what: String, message: String },
    #[error("invalid condition `{condition}`: {message}")]
    #[diagnostic(code(mflow::ci::condition), help("write METRIC OP VALUE, e.g. \"val_loss>+2%\" (relative change), \"loss>+0.1\" (absolute change) or \"val_ppl>40\" (value of the second run); METRIC may be STAGE.METRIC"))]
    Condition { condition: String, message: String },
    #[error("[schedule]: {message}")]
    #[diagnostic(code(mflow::ci::schedule), help("{help}"))]
    Schedule { message: String, help: String },
    #[error(transparent)]
    #[diagnostic(transparent)]
    Output(#[from] crate::user_output::OutputError),
    #[error("Kubernetes: {message}")]
    #[diagnostic(code(mflow::ci::kubernetes), help("{help}"))]
    Kube { message: String, help: String },
}

impl CiError {
    pub fn write(path: &std::path::Path, source: std::io::Error) -> CiError {
        CiError::Write { path: path.to_path_buf(), source }
    }
}

impl CiError {
    pub fn exit_code(&self) -> crate::exit::ExitCode {
        match self {
            // The run named is missing or its record is unreadable: nothing mflow got wrong.
            CiError::NoRun { .. }
            | CiError::DamagedRun { .. }
            | CiError::Condition { .. }
            | CiError::Schedule { .. } => crate::exit::ExitCode::Invalid,
            // A path the user named that mflow refuses, or cannot, write.
            CiError::Output(e) if e.is_users() => crate::exit::ExitCode::Invalid,
            _ => crate::exit::ExitCode::Internal,
        }
    }
}
