//! The output directory appears whole or not at all: everything is written into a staging
//! directory beside the destination and renamed into place at the end. A staging directory
//! that is dropped without being committed is removed.

use std::path::{Path, PathBuf};

use miette::Diagnostic;
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
pub enum OutputError {
    #[error("output {path} already exists and is not an empty directory")]
    #[diagnostic(
        code(mflow::data::output::exists),
        help("remove it or choose another --out; mflow never overwrites a dataset")
    )]
    Exists { path: PathBuf },

    #[error("output {path} is a symbolic link; mflow does not write a dataset through a link")]
    #[diagnostic(
        code(mflow::data::output::link),
        help("choose another --out, or name the directory the link points to (if it is empty)")
    )]
    Link { path: PathBuf },

    #[error("cannot write the output {path}: {source}")]
    #[diagnostic(code(mflow::data::output::io), help("check that the parent directory exists and is writable"))]
    Io { path: PathBuf, source: std::io::Error },
}

/// The staging directory every command that writes an output directory uses
/// ([`mflow_untrusted::staging`]): it also removes what killed processes left beside the
/// destination, and what is being written when the process is asked to stop.
pub struct Staging {
    staged: mflow_untrusted::staging::Staging,
    dest: PathBuf,
}

impl Staging {
    /// Creates `.<name>.staging-<pid>` next to `dest` (creating `dest`'s parents).
    pub fn create(dest: &Path) -> Result<Staging, OutputError> {
        check_free(dest)?;
        let staged = mflow_untrusted::staging::Staging::create(dest).map_err(io_error)?;
        Ok(Staging { staged, dest: dest.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        self.staged.path()
    }

    /// Moves the staged directory to its destination (replacing an empty directory prepared by
    /// the caller: mflow's stage output).
    pub fn commit(self) -> Result<(), OutputError> {
        check_free(&self.dest)?;
        self.staged.commit().map_err(io_error)
    }
}

fn io_error(e: mflow_untrusted::staging::StagingError) -> OutputError {
    OutputError::Io { path: e.path, source: e.source }
}

fn check_free(dest: &Path) -> Result<(), OutputError> {
    use mflow_untrusted::staging::{taken, Taken};
    match taken(dest) {
        Ok(None) => Ok(()),
        Ok(Some(Taken::Link)) => Err(OutputError::Link { path: dest.to_path_buf() }),
        Ok(Some(Taken::NotEmpty)) | Err(_) => Err(OutputError::Exists { path: dest.to_path_buf() }),
    }
}
