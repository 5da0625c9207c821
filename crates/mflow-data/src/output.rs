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

    #[error("cannot write the output {path}: {source}")]
    #[diagnostic(code(mflow::data::output::io), help("check that the parent directory exists and is writable"))]
    Io { path: PathBuf, source: std::io::Error },
}

pub struct Staging {
    dir: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl Staging {
    /// Creates `.<name>.staging-<pid>` next to `dest` (creating `dest`'s parents).
    pub fn create(dest: &Path) -> Result<Staging, OutputError> {
        check_free(dest)?;
        let io = |source| OutputError::Io { path: dest.to_path_buf(), source };
        let name = dest.file_name().ok_or_else(|| io(std::io::Error::other("the path has no file name")))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(io)?;
        let mut staged = std::ffi::OsString::from(".");
        staged.push(name);
        staged.push(format!(".staging-{}", std::process::id()));
        let dir = parent.join(staged);
        if dir.exists() {
            // left by an earlier process with the same id that was killed
            std::fs::remove_dir_all(&dir).map_err(io)?;
        }
        std::fs::create_dir(&dir).map_err(io)?;
        Ok(Staging { dir, dest: dest.to_path_buf(), committed: false })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Moves the staged directory to its destination.
    pub fn commit(mut self) -> Result<(), OutputError> {
        check_free(&self.dest)?;
        if self.dest.is_dir() {
            // an empty directory prepared by the caller (mflow's stage output) is replaced
            std::fs::remove_dir(&self.dest).map_err(|source| OutputError::Io { path: self.dest.clone(), source })?;
        }
        std::fs::rename(&self.dir, &self.dest).map_err(|source| OutputError::Io { path: self.dest.clone(), source })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn check_free(dest: &Path) -> Result<(), OutputError> {
    let exists = || OutputError::Exists { path: dest.to_path_buf() };
    match std::fs::symlink_metadata(dest) {
        Err(_) => Ok(()),
        Ok(m) if m.is_dir() => match std::fs::read_dir(dest).map(|mut entries| entries.next().is_none()) {
            Ok(true) => Ok(()),
            _ => Err(exists()),
        },
        Ok(_) => Err(exists()),
    }
}
