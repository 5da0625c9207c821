//! A staged output: its files listed, then hashed (on the runtime's thread for a small output,
//! on another for a large one), and the digest that identifies it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{io_err, CacheError, FileEntry, Manifest};

/// A staged output's files and sizes, listed before anything is hashed, so that the caller
/// can choose where the hashing runs.
pub struct Staged {
    pub(super) dir: PathBuf,
    files: Vec<(String, u64)>,
}

impl Staged {
    pub fn list(dir: &Path) -> Result<Staged, CacheError> {
        // A stage may have put a link (or a file) where its output directory was: the entry
        // would be that link, pointing anywhere, and gc and repair would keep it for ever.
        if !fs::symlink_metadata(dir).map_err(io_err("cannot stat", dir))?.is_dir() {
            return Err(CacheError::FileType { path: dir.to_path_buf() });
        }
        let mut paths = Vec::new();
        walk(dir, dir, &mut paths)?;
        paths.sort();
        let mut files = Vec::with_capacity(paths.len());
        for rel in paths {
            let full = dir.join(&rel);
            let size = fs::metadata(&full).map_err(io_err("cannot stat", &full))?.len();
            files.push((rel, size));
        }
        Ok(Staged { dir: dir.to_path_buf(), files })
    }

    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, size)| size).sum()
    }

    pub(super) fn hash(&self) -> Result<Vec<FileEntry>, CacheError> {
        self.files
            .iter()
            .map(|(rel, size)| {
                let full = self.dir.join(rel);
                let blake3 = hash_file(&full).map_err(io_err("cannot hash", &full))?;
                Ok(FileEntry { path: rel.clone(), size: *size, blake3 })
            })
            .collect()
    }
}

fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), CacheError> {
    for e in fs::read_dir(dir).map_err(io_err("cannot list", dir))? {
        let e = e.map_err(io_err("cannot list", dir))?;
        let ft = e.file_type().map_err(io_err("cannot stat", &e.path()))?;
        let path = e.path();
        if ft.is_dir() {
            walk(base, &path, out)?;
        } else if ft.is_file() {
            let rel = path.strip_prefix(base).expect("under base");
            // Manifests and lockfiles hold names as text: a lossy name would not match the file.
            let rel = rel.to_str().ok_or_else(|| CacheError::NotUtf8 { name: format!("{:?}", rel.as_os_str()) })?;
            out.push(rel.replace('\\', "/"));
        } else {
            return Err(CacheError::FileType { path });
        }
    }
    Ok(())
}

/// Files from this size on are mapped rather than read.
pub(super) const MAP_FROM: u64 = 1 << 20;
/// A mapped file is hashed this much at a time, on all cores.
pub(super) const HASH_WINDOW: usize = 16 << 20;

/// blake3 of a file. A large file is mapped and hashed window by window, and each window is
/// dropped from this process once hashed: mapped pages count in its RSS, and a checkpoint is
/// gigabytes (a whole mapping of one 1 GB file was 1 GB of RSS; a window keeps it at 16 MiB, at
/// the same speed).
pub fn hash_file(path: &Path) -> io::Result<String> {
    let mut h = blake3::Hasher::new();
    // A FIFO in a file's place is refused instead of blocking the open.
    let file = mflow_untrusted::open_regular(path)?;
    let meta = file.metadata()?;
    if meta.len() < MAP_FROM {
        h.update_reader(&file)?;
        return Ok(h.finalize().to_hex().to_string());
    }
    // SAFETY: outputs are not written once their stage has ended, which is when they are hashed.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    let mut start = 0;
    while start < map.len() {
        let end = (start + HASH_WINDOW).min(map.len());
        h.update_rayon(&map[start..end]);
        // SAFETY: the window is not read again; for a file mapping, this only unmaps its pages.
        unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)? };
        start = end;
    }
    Ok(h.finalize().to_hex().to_string())
}

/// The identity of an output: the digest of its file list.
pub fn digest_of(files: &[FileEntry]) -> String {
    let mut h = blake3::Hasher::new();
    for f in files {
        h.update(&(f.path.len() as u64).to_le_bytes());
        h.update(f.path.as_bytes());
        h.update(&f.size.to_le_bytes());
        h.update(f.blake3.as_bytes());
    }
    h.finalize().to_hex().to_string()
}

/// Whether the directory `dir` holds exactly the files of `m`, byte for byte.
pub(super) fn same_files(dir: &Path, m: &Manifest) -> bool {
    Staged::list(dir).and_then(|s| s.hash()).is_ok_and(|files| files == m.files)
}
