//! The manifest log, `cache/.manifests.jsonl`: one JSON line per committed entry. A line is
//! appended before its entry's directory is renamed into place, so committing creates no file
//! besides the output itself, and one read of the log replaces opening a manifest per entry.
//!
//! Appends hold a shared lock on the log from the append to the rename; `gc` compacts the log
//! under the exclusive lock and renames the compacted copy over it, which readers notice by
//! the new inode.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::Arc;

use super::Manifest;

pub(super) struct Log {
    path: PathBuf,
    open: Option<Reader>,
}

/// The log as read so far through one open file.
struct Reader {
    file: File,
    ino: u64,
    read: u64,
    known: HashMap<String, Arc<Manifest>>,
}

/// Keeps the shared lock of an append until the entry is in place.
pub(super) struct AppendGuard {
    _file: File,
}

impl Log {
    pub fn new(path: PathBuf) -> Log {
        Log { path, open: None }
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Whether the last read found a log (false: none, or it could not be read).
    pub fn found(&self) -> bool {
        self.open.is_some()
    }

    /// The newest manifest of every key among the lines read so far.
    pub fn manifests(&self) -> impl Iterator<Item = &Arc<Manifest>> {
        self.open.iter().flat_map(|r| r.known.values())
    }

    /// Fails unless the log is absent or a regular file this process can read and append to:
    /// a run finds out before its first commit.
    pub fn check_usable(&self) -> io::Result<()> {
        match fs::symlink_metadata(&self.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
            Ok(_) => super::files::open(&self.path, OpenOptions::new().read(true).append(true)).map(drop),
        }
    }

    /// The newest manifest of `key` among the lines read so far, reading the log's new lines
    /// first when `key` is not among them (or when `fresh` asks for the newest state).
    pub fn get(&mut self, key: &str, fresh: bool) -> io::Result<Option<Arc<Manifest>>> {
        if !fresh {
            if let Some(m) = self.open.as_ref().and_then(|r| r.known.get(key)) {
                return Ok(Some(m.clone()));
            }
        }
        self.refresh()?;
        Ok(self.open.as_ref().and_then(|r| r.known.get(key)).cloned())
    }

    /// Reads what was appended since the last read; starts over after a compaction.
    pub fn refresh(&mut self) -> io::Result<()> {
        let ino = match fs::symlink_metadata(&self.path) {
            Ok(m) if !m.file_type().is_file() => {
                self.open = None;
                return Err(super::files::not_regular(m.file_type()));
            }
            Ok(m) => m.ino(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.open = None;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if self.open.as_ref().map(|r| r.ino) != Some(ino) {
            let file = super::files::open(&self.path, OpenOptions::new().read(true))?;
            let ino = file.metadata()?.ino();
            self.open = Some(Reader { file, ino, read: 0, known: HashMap::new() });
        }
        let r = self.open.as_mut().expect("opened above");
        let len = r.file.metadata()?.len();
        if len <= r.read {
            return Ok(());
        }
        let mut buf = vec![0u8; (len - r.read) as usize];
        r.file.read_exact_at(&mut buf, r.read)?;
        // A line still being written is read next time.
        let end = buf.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
        // A line that does not parse (a torn write before a crash) stands for no entry.
        let mut add = |m: serde_json::Result<Manifest>| {
            if let Ok(m) = m {
                r.known.insert(m.key.clone(), Arc::new(m));
            }
        };
        match std::str::from_utf8(&buf[..end]) {
            // Checked as a whole, so that serde_json need not check every string of every line.
            Ok(text) => text.split('\n').filter(|l| !l.is_empty()).for_each(|l| add(serde_json::from_str(l))),
            Err(_) => {
                buf[..end].split(|&b| b == b'\n').filter(|l| !l.is_empty()).for_each(|l| add(serde_json::from_slice(l)))
            }
        }
        r.read += end as u64;
        Ok(())
    }

    /// Appends `m` as one line. The returned guard holds the log's shared lock: keep it until
    /// the entry's directory is in place, so that a compaction cannot drop the line before.
    pub fn append(&mut self, m: &Manifest) -> io::Result<AppendGuard> {
        let mut line = serde_json::to_vec(m).expect("a manifest serializes");
        line.push(b'\n');
        let file = self.locked(libc::F_RDLCK)?;
        // After a write torn by a crash, start on a line of its own.
        let len = file.metadata()?.len();
        let mut last = [b'\n'];
        if len > 0 {
            file.read_exact_at(&mut last, len - 1)?;
        }
        if last[0] != b'\n' {
            line.insert(0, b'\n');
        }
        (&file).write_all(&line)?;
        if let Some(r) = self.open.as_mut() {
            r.known.insert(m.key.clone(), Arc::new(m.clone()));
        }
        Ok(AppendGuard { _file: file })
    }

    /// Rewrites the log with the newest line of each key that `keep` accepts.
    pub fn compact(&mut self, keep: impl Fn(&str) -> bool) -> io::Result<()> {
        // A compaction never creates a log: without one, there are no lines to keep.
        if fs::symlink_metadata(&self.path).is_err() {
            return Ok(());
        }
        let _lock = self.locked(libc::F_WRLCK)?;
        self.open = None;
        self.refresh()?;
        let Some(r) = self.open.take() else {
            return Ok(());
        };
        let mut kept: Vec<&Manifest> = r.known.values().map(|m| &**m).filter(|m| keep(&m.key)).collect();
        kept.sort_by(|a, b| a.key.cmp(&b.key));
        let mut text = Vec::new();
        for m in kept {
            text.extend(serde_json::to_vec(m).expect("a manifest serializes"));
            text.push(b'\n');
        }
        // Created afresh, so that whatever was left at this name (a link, a FIFO) is not written through.
        let tmp = self.path.with_extension("jsonl.tmp");
        let _ = fs::remove_file(&tmp);
        OpenOptions::new().write(true).create_new(true).open(&tmp)?.write_all(&text)?;
        fs::rename(&tmp, &self.path)
    }

    /// The log opened for appending, locked (`F_RDLCK` shared, `F_WRLCK` exclusive). Retries
    /// when a compaction replaced the file between the open and the lock.
    fn locked(&self, kind: libc::c_int) -> io::Result<File> {
        loop {
            let file = super::files::open(&self.path, OpenOptions::new().read(true).append(true).create(true))?;
            super::ofd_lock(&file, kind, 0, 0, true)?;
            if fs::symlink_metadata(&self.path).map(|m| m.ino()).ok() == Some(file.metadata()?.ino()) {
                return Ok(file);
            }
        }
    }
}
