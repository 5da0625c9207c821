//! The Hugging Face cache, in the layout `huggingface_hub` (and so transformers) reads and
//! writes, so that a model downloaded by either is downloaded once:
//!
//! ```text
//! <HF_HUB_CACHE>/models--ORG--NAME/blobs/<etag>                  the bytes, once
//!                                 /snapshots/<commit>/<file>     -> ../../blobs/<etag>
//!                                 /refs/<revision>               the commit a branch or tag was at
//! <HF_HUB_CACHE>/.locks/models--ORG--NAME/<etag>.lock            held while a blob is written
//! ```
//!
//! A blob's etag is the sha256 of an LFS file and the git blob id of any other. Blobs found here
//! were written by someone else: each is checked against its etag before it is used.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The cache directory: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`,
/// else `~/.cache/huggingface/hub` (huggingface_hub's order; its older `HUGGINGFACE_HUB_CACHE`
/// too). `None` where none of them is set.
pub fn dir_from_env() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// A blob's name: 40 or 64 lowercase hex digits. Anything else from the Hub's answer would
/// name a path, so it is refused.
pub fn is_etag(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// How a blob's bytes are checked against its etag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    Sha256,
    GitBlob,
}

/// The etag of `path` computed as `kind` says: sha256, or git's blob id (sha1 of
/// `blob LEN\0` and the bytes).
pub fn digest(path: &Path, kind: Check) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    match kind {
        Check::Sha256 => {
            let mut h = Sha256::new();
            std::io::copy(&mut f, &mut h)?;
            Ok(hex::encode(h.finalize()))
        }
        Check::GitBlob => {
            use sha1::Digest as _;
            let len = f.metadata()?.len();
            let mut h = sha1::Sha1::new();
            h.update(format!("blob {len}\0").as_bytes());
            let mut w = Sha1Writer(&mut h);
            std::io::copy(&mut f, &mut w)?;
            Ok(hex::encode(h.finalize()))
        }
    }
}

struct Sha1Writer<'a>(&'a mut sha1::Sha1);

impl Write for Sha1Writer<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        sha1::Digest::update(self.0, buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One model repository's folder in the cache.
pub struct RepoCache {
    dir: PathBuf,
    locks: PathBuf,
}

impl RepoCache {
    /// `repo` is `ORG/NAME`, already checked by `parse_source` (no `..`, no other separator).
    pub fn new(cache: &Path, repo: &str) -> RepoCache {
        let folder = format!("models--{}", repo.replace('/', "--"));
        RepoCache { dir: cache.join(&folder), locks: cache.join(".locks").join(folder) }
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where a blob is written until it is complete (huggingface_hub's name, so that either
    /// resumes what the other began).
    pub fn incomplete(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    pub fn pointer(&self, commit: &str, file: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit).join(file)
    }

    /// Holds the lock on `etag` until the returned file is dropped: two downloads of one blob
    /// (two stages, or mflow and transformers) would write one `.incomplete` file at once.
    pub fn lock(&self, etag: &str) -> std::io::Result<File> {
        std::fs::create_dir_all(&self.locks)?;
        std::fs::create_dir_all(self.dir.join("blobs"))?;
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.locks.join(format!("{etag}.lock")))?;
        f.lock()?;
        Ok(f)
    }

    /// `snapshots/<commit>/<file>` -> `../../blobs/<etag>`, replacing whatever was there.
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> std::io::Result<()> {
        let pointer = self.pointer(commit, file);
        let target = Path::new("../../blobs").join(etag);
        if std::fs::read_link(&pointer).is_ok_and(|t| t == target) {
            return Ok(());
        }
        std::fs::create_dir_all(pointer.parent().expect("a snapshot has a folder"))?;
        let tmp = pointer.with_file_name(format!(".{file}.{}.link", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp)?;
        std::fs::rename(&tmp, &pointer)
    }

    /// `refs/<revision>` holds `commit` (nothing for a revision that is itself a commit).
    pub fn set_ref(&self, revision: &str, commit: &str) -> std::io::Result<()> {
        if revision == commit {
            return Ok(());
        }
        let path = self.dir.join("refs").join(revision);
        std::fs::create_dir_all(path.parent().expect("refs has a folder"))?;
        let tmp = path.with_file_name(format!(".{revision}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, commit)?;
        std::fs::rename(&tmp, &path)
    }
}

/// Puts `blob` at `to`: a hard link where both are on one file system (no second copy of a
/// large model), else a copy.
pub fn place(blob: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::hard_link(blob, to) {
        Ok(()) => Ok(()),
        Err(_) => std::fs::copy(blob, to).map(|_| ()),
    }
}
