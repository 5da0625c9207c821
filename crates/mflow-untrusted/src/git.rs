//! Reading a git repository without running git: whether a directory is one (what makes a
//! project root), and the commit its HEAD names (what a run records in mflow.lock).
//!
//! Everything read here is someone else's file: HEAD may be a FIFO or name any path
//! (`ref: ../../dev/zero`), a ref file may hold anything. A ref must be a ref name (under
//! `refs/`, no `..`), every file is read through the crate's bounded reader, and only a commit id
//! (40 or 64 hex digits) ever comes out; anything else reads as no commit.

use std::io::{BufRead, BufReader, Read};
use std::path::{Component, Path, PathBuf};

/// Largest HEAD, loose ref, `commondir` or `.git` file read.
const SMALL: u64 = 4096;
/// Largest packed-refs file read (about half a million refs).
const PACKED: u64 = 64 << 20;
/// Symbolic refs followed before giving up.
const MAX_HOPS: usize = 5;

/// What HEAD (or a loose ref) says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// A commit id.
    Commit(String),
    /// A ref name under `refs/` to read next.
    Ref(String),
}

/// Parses the content of HEAD or of a loose ref; `None` for anything that is neither a valid
/// ref name nor a commit id.
pub fn parse_head(bytes: &[u8]) -> Option<Head> {
    let text = std::str::from_utf8(bytes).ok()?;
    let line = text.lines().next()?.trim();
    if let Some(r) = line.strip_prefix("ref:") {
        let r = r.trim();
        return valid_ref(r).then(|| Head::Ref(r.to_string()));
    }
    is_commit(line).then(|| Head::Commit(line.to_string()))
}

/// A commit id: 40 (SHA-1) or 64 (SHA-256) lowercase hex digits.
pub fn is_commit(s: &str) -> bool {
    matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A ref name git itself would accept, under `refs/`: relative, no `.` or `..` component, no
/// component starting with a dot or ending in `.lock`, none of git's forbidden characters.
pub fn valid_ref(r: &str) -> bool {
    if r.len() > 1024
        || !r.starts_with("refs/")
        || r.ends_with('/')
        || r.contains("..")
        || r.contains("@{")
        || r.contains("//")
    {
        return false;
    }
    let bad_char = |c: char| c.is_ascii_control() || " ~^:?*[\\".contains(c);
    if r.chars().any(bad_char) {
        return false;
    }
    Path::new(r).components().all(|c| match c {
        Component::Normal(s) => {
            let s = s.to_string_lossy();
            !s.starts_with('.') && !s.ends_with(".lock")
        }
        _ => false,
    })
}

/// The commit `ref_name` points to in a packed-refs document; the line must name exactly it.
pub fn packed_ref(reader: impl BufRead, ref_name: &str) -> Option<String> {
    for line in reader.split(b'\n') {
        let line = line.ok()?;
        let Ok(line) = std::str::from_utf8(&line) else { continue };
        let mut parts = line.trim_end_matches('\r').splitn(2, ' ');
        if let (Some(id), Some(name)) = (parts.next(), parts.next()) {
            if name == ref_name && is_commit(id) {
                return Some(id.to_string());
            }
        }
    }
    None
}

/// The git directory that the `.git` at `marker` stands for, when it is a repository: a
/// directory with a HEAD file, `objects/` and `refs/` (or, for a linked work tree, a
/// `commondir`), or a `gitdir: PATH` file naming such a directory. An empty `.git`, or one of
/// anything else, is not a repository.
pub fn git_dir(marker: &Path) -> Option<PathBuf> {
    let meta = std::fs::metadata(marker).ok()?;
    let dir = if meta.is_dir() {
        marker.to_path_buf()
    } else if meta.is_file() {
        let text = String::from_utf8(crate::read_bounded(marker, SMALL).ok()?).ok()?;
        let target = text.lines().next()?.strip_prefix("gitdir:")?.trim();
        if target.is_empty() {
            return None;
        }
        marker.parent()?.join(target)
    } else {
        return None;
    };
    let is_dir = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_dir());
    let head_is_file = std::fs::symlink_metadata(dir.join("HEAD")).is_ok_and(|m| m.is_file());
    let store = (is_dir(&dir.join("objects")) && is_dir(&dir.join("refs"))) || common_dir(&dir).is_some();
    (head_is_file && store).then_some(dir)
}

/// The common directory of a linked work tree's git directory (`commondir`), if it has one.
fn common_dir(git: &Path) -> Option<PathBuf> {
    let text = String::from_utf8(crate::read_bounded_nofollow(&git.join("commondir"), SMALL).ok()?).ok()?;
    let common = git.join(text.lines().next()?.trim());
    std::fs::metadata(&common).ok().filter(|m| m.is_dir()).map(|_| common)
}

/// The nearest directory from `dir` up whose `.git` is a repository, and that git directory.
pub fn work_tree(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    dir.ancestors().find_map(|d| git_dir(&d.join(".git")).map(|g| (d.to_path_buf(), g)))
}

/// The commit HEAD names in the git directory `git`; `None` when it names none that can be
/// read (an unborn branch, a damaged or hostile repository).
pub fn head_commit(git: &Path) -> Option<String> {
    let common = common_dir(git);
    let mut head = parse_head(&crate::read_bounded_nofollow(&git.join("HEAD"), SMALL).ok()?)?;
    for _ in 0..MAX_HOPS {
        let name = match head {
            Head::Commit(id) => return Some(id),
            Head::Ref(name) => name,
        };
        // `valid_ref` keeps `name` inside the directory it is joined to; a link there is not
        // followed.
        let loose = [Some(git), common.as_deref()]
            .into_iter()
            .flatten()
            .find_map(|d| crate::read_bounded_nofollow(&d.join(&name), SMALL).ok());
        head = match loose {
            Some(bytes) => parse_head(&bytes)?,
            None => {
                let packed = [Some(git), common.as_deref()].into_iter().flatten().find_map(|d| {
                    crate::open_with(
                        &d.join("packed-refs"),
                        std::fs::OpenOptions::new().read(true),
                        crate::Links::Refuse,
                    )
                    .ok()
                })?;
                return packed_ref(BufReader::new(packed.take(PACKED)), &name);
            }
        };
    }
    None
}

/// The commit of the repository holding `dir`, if any.
pub fn commit_of(dir: &Path) -> Option<String> {
    head_commit(&work_tree(dir)?.1)
}
