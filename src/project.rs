//! The project a spec belongs to: the directory no input may leave, and that a run from
//! outside a cluster uploads. It is the nearest enclosing directory that holds the marker
//! `.mflow-project` or is a git work tree (whichever is nearer), else the spec's directory; a
//! driver in a cluster names it in `MFLOW_PROJECT_ROOT`.

use std::path::{Path, PathBuf};

/// The file that marks a project's root where there is no git repository (an unpacked source
/// archive, a copy on a shared volume).
pub const MARKER: &str = ".mflow-project";

/// How a project's root was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Setting,
    Marker,
    GitWorkTree,
    SpecDirectory,
}

impl Found {
    pub fn describe(self) -> &'static str {
        match self {
            Found::Setting => "MFLOW_PROJECT_ROOT",
            Found::Marker => "marked by .mflow-project",
            Found::GitWorkTree => "the git work tree",
            Found::SpecDirectory => "the spec's directory: no .mflow-project or git work tree above it",
        }
    }
}

/// The project directory of a spec in `spec_dir`.
pub fn root(spec_dir: &Path) -> PathBuf {
    find(spec_dir).0
}

/// The project directory of a spec in `spec_dir`, and how it was found.
pub fn find(spec_dir: &Path) -> (PathBuf, Found) {
    let abs = std::fs::canonicalize(spec_dir).unwrap_or_else(|_| spec_dir.to_path_buf());
    if let Some(root) = std::env::var_os(mflow_contract::vars::PROJECT_ROOT).map(PathBuf::from) {
        if abs.starts_with(&root) {
            return (root, Found::Setting);
        }
    }
    let marked = abs.ancestors().find(|d| std::fs::symlink_metadata(d.join(MARKER)).is_ok_and(|m| m.is_file()));
    // Only a `.git` that is a repository marks the root: an empty one in a parent directory
    // must not widen the project to that parent.
    let git = mflow_untrusted::git::work_tree(&abs).map(|(root, _)| root);
    match (marked, git) {
        // The nearer one: the deeper path.
        (Some(m), Some(g)) if g.starts_with(m) => (g, Found::GitWorkTree),
        (Some(m), _) => (m.to_path_buf(), Found::Marker),
        (None, Some(g)) => (g, Found::GitWorkTree),
        (None, None) => (abs, Found::SpecDirectory),
    }
}
