//! The files of the cache that mflow opens by name (the manifest log, the lock file, the marker)
//! are opened only when they are regular files: a FIFO in their place would block the open
//! (and the command) forever, and a symbolic link would have mflow append to, or lock, a file
//! somewhere else. The opening is the workspace's one reader of untrusted files
//! (`mflow_untrusted`), with links refused.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

pub(crate) use mflow_untrusted::{kind, not_regular};

/// Opens `path` with `opts` when it is a regular file (or absent and `opts` creates it).
pub(super) fn open(path: &Path, opts: &mut OpenOptions) -> io::Result<File> {
    mflow_untrusted::open_with(path, opts, mflow_untrusted::Links::Refuse)
}

/// Reads the whole of `path` when it is a regular file of at most `max` bytes. For the state
/// mflow keeps for itself (stat caches, keys, run records): a FIFO there must not hang a run,
/// and a file grown huge must not be read into memory.
pub(crate) fn read_regular(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    mflow_untrusted::read_bounded_nofollow(path, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_opened_and_a_fifo_does_not_block() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        std::fs::create_dir(tmp.path().join("dir")).unwrap();
        std::fs::write(tmp.path().join("file"), b"x").unwrap();
        std::os::unix::fs::symlink("file", tmp.path().join("link")).unwrap();
        for (name, what) in [("fifo", "a FIFO"), ("dir", "a directory"), ("link", "a symbolic link")] {
            for write in [false, true] {
                let e = open(&tmp.path().join(name), OpenOptions::new().read(true).append(write).create(write))
                    .unwrap_err();
                assert!(e.to_string().contains(what), "{name}: {e}");
            }
        }
        assert!(open(&tmp.path().join("file"), OpenOptions::new().read(true)).is_ok());
        assert!(open(&tmp.path().join("new"), OpenOptions::new().append(true).create(true)).is_ok());
    }
}
