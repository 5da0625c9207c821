//! Where the links an input meets may lead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::cache::FileStat;

use super::InputError;

/// Where the links of one input pattern may lead: into the project (`root`, resolved), or,
/// for an absolute input outside it, into what the user named (`scope`).
pub(super) struct Links<'a> {
    pub(super) stage: &'a str,
    pub(super) base: &'a Path,
    pub(super) root: &'a Path,
    /// Directories of matched files, resolved (the hasher's, shared across stages).
    pub(super) parents: &'a Mutex<HashMap<PathBuf, Option<PathBuf>>>,
    pub(super) scope: Option<PathBuf>,
}

impl Links<'_> {
    /// A matched path must resolve inside the project, whichever of its components is a link.
    /// `lstat` is the path's own stat when already taken; a file or directory there (not a
    /// link) is its stat followed too, and is handed back for the caller to use.
    pub(super) fn check_top(&mut self, path: &Path, lstat: Option<FileStat>) -> Result<Option<FileStat>, InputError> {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else { return Ok(None) };
        let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
        let plain = lstat.filter(|m| m.is_file || m.is_dir);
        let in_parent = || {
            let mut parents = self.parents.lock().unwrap();
            parents
                .entry(parent.to_path_buf())
                .or_insert_with(|| std::fs::canonicalize(parent).ok())
                .as_ref()
                .map(|p| p.join(name))
        };
        let resolved = if plain.is_some() {
            in_parent()
        } else {
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).ok(),
                Ok(_) => in_parent(),
                Err(_) => None,
            }
        };
        match resolved {
            Some(target) if !target.starts_with(self.root) => Err(self.escaping_link(path, target)),
            _ => Ok(plain),
        }
    }

    /// A link found while walking a directory input.
    pub(super) fn check_link(&self, link: &Path) -> Result<(), InputError> {
        let Ok(target) = std::fs::canonicalize(link) else { return Ok(()) };
        if target.starts_with(self.root) || self.scope.as_ref().is_some_and(|s| target.starts_with(s)) {
            return Ok(());
        }
        Err(self.error(link, target))
    }

    /// The error for `path`, which resolves to `target`: named by its first component that is
    /// a link leading out of the project.
    fn escaping_link(&self, path: &Path, target: PathBuf) -> InputError {
        let from = path.strip_prefix(self.base).map(|_| self.base).unwrap_or(Path::new(""));
        let mut prefix = from.to_path_buf();
        for c in path.strip_prefix(from).unwrap_or(path).components() {
            prefix.push(c);
            let is_link = std::fs::symlink_metadata(&prefix).is_ok_and(|m| m.file_type().is_symlink());
            if let Some(t) =
                is_link.then(|| std::fs::canonicalize(&prefix).ok()).flatten().filter(|t| !t.starts_with(self.root))
            {
                return self.error(&prefix, t);
            }
        }
        self.error(path, target)
    }

    fn error(&self, link: &Path, target: PathBuf) -> InputError {
        let link = link.strip_prefix(self.base).unwrap_or(link).to_path_buf();
        InputError::LinkEscapes { stage: self.stage.into(), link, target, root: self.root.to_path_buf() }
    }
}
