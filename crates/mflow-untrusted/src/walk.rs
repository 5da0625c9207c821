//! Walking a directory tree someone else made. Links are followed, so a link back to a
//! directory on the current path (`l1 -> .`) would walk forever, and two of them double the
//! paths at every level: the walk knows the directories on its path by device and inode and
//! stops at a cycle, and it is bounded in entries and depth, each with an error that says so.

use std::path::{Path, PathBuf};

/// What the walk needs to know of a path, links followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub dev: u64,
    pub ino: u64,
    pub is_dir: bool,
}

/// A stat of the caller's kind, which says at least this much.
pub trait Stat {
    fn node(&self) -> Node;
}

impl Stat for Node {
    fn node(&self) -> Node {
        *self
    }
}

/// How far a walk may go.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Files and directories seen, the start included.
    pub entries: usize,
    /// Directories below the start.
    pub depth: usize,
}

/// About a million entries, 256 directories deep: far past a real input, and still a walk
/// that ends in seconds.
pub const LIMITS: Limits = Limits { entries: 1_000_000, depth: 256 };

#[derive(Debug)]
pub enum WalkError<E> {
    /// `path` is a directory already on the path from the start to it, through a link.
    Cycle {
        path: PathBuf,
    },
    TooMany {
        limit: usize,
    },
    TooDeep {
        limit: usize,
    },
    /// What the visitor said.
    Visit(E),
}

impl<E: std::fmt::Display> std::fmt::Display for WalkError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WalkError::Cycle { path } => {
                write!(f, "{} leads back into a directory above it through a symbolic link", path.display())
            }
            WalkError::TooMany { limit } => write!(f, "holds more than {limit} files and directories"),
            WalkError::TooDeep { limit } => write!(f, "is nested more than {limit} directories deep"),
            WalkError::Visit(e) => e.fmt(f),
        }
    }
}

/// Walks `start` depth first, entries of a directory in name order. `stat` says what a path
/// is (links followed; `None`: gone or unreadable, skipped). `visit` is called for every path
/// with its node and whether the path itself is a symbolic link, and says whether to enter a
/// directory. The start is visited too.
pub fn walk<S: Stat, E>(
    start: &Path,
    limits: Limits,
    stat: &dyn Fn(&Path) -> Option<S>,
    visit: &mut dyn FnMut(&Path, &S, bool) -> Result<bool, E>,
) -> Result<(), WalkError<E>> {
    let Some(st) = stat(start) else { return Ok(()) };
    let node = st.node();
    let is_link = std::fs::symlink_metadata(start).is_ok_and(|m| m.file_type().is_symlink());
    let mut seen = 1usize;
    if !visit(start, &st, is_link).map_err(WalkError::Visit)? || !node.is_dir {
        return Ok(());
    }
    // Directories entered, with their entries still to visit (reversed, so `pop` is in order).
    let mut path = vec![(node.dev, node.ino)];
    let mut stack = vec![list(start)];
    while let Some(todo) = stack.last_mut() {
        let Some((entry, is_link)) = todo.pop() else {
            stack.pop();
            path.pop();
            continue;
        };
        seen += 1;
        if seen > limits.entries {
            return Err(WalkError::TooMany { limit: limits.entries });
        }
        let Some(st) = stat(&entry) else { continue };
        let node = st.node();
        if !visit(&entry, &st, is_link).map_err(WalkError::Visit)? || !node.is_dir {
            continue;
        }
        if path.contains(&(node.dev, node.ino)) {
            return Err(WalkError::Cycle { path: entry });
        }
        if path.len() > limits.depth {
            return Err(WalkError::TooDeep { limit: limits.depth });
        }
        path.push((node.dev, node.ino));
        stack.push(list(&entry));
    }
    Ok(())
}

/// The entries of `dir` in reverse name order, each with whether it is a symbolic link.
fn list(dir: &Path) -> Vec<(PathBuf, bool)> {
    let mut entries: Vec<(PathBuf, bool)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| (e.path(), e.file_type().is_ok_and(|t| t.is_symlink())))
        .collect();
    entries.sort_by(|a, b| b.0.cmp(&a.0));
    entries
}

/// [`Node`] of `path` from `std::fs::metadata`.
pub fn stat(path: &Path) -> Option<Node> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| Node { dev: m.dev(), ino: m.ino(), is_dir: m.is_dir() })
}
