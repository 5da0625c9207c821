//! A directory held open, so that the files under it are looked up from it rather than from
//! the filesystem root. A no-op run stats every input and every cached file; from the open
//! directory, each stat walks only the components below it (the path walk was most of a stat).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub struct OpenDir {
    fd: OwnedFd,
}

/// What a stat says of a file, in the terms the cache and the input hasher use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FileStat {
    pub len: u64,
    /// Nanoseconds since the epoch; 0 before it.
    pub mtime_ns: i128,
    pub is_dir: bool,
    pub is_file: bool,
    /// Device and inode: what identifies a directory already on a walk's path.
    pub dev: u64,
    pub ino: u64,
}

impl From<&std::fs::Metadata> for FileStat {
    fn from(m: &std::fs::Metadata) -> FileStat {
        let mtime_ns = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as i128);
        use std::os::unix::fs::MetadataExt;
        FileStat { len: m.len(), mtime_ns, is_dir: m.is_dir(), is_file: m.is_file(), dev: m.dev(), ino: m.ino() }
    }
}

impl OpenDir {
    pub fn open(path: &Path) -> io::Result<OpenDir> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
        // SAFETY: `c` is a valid NUL-terminated path; the descriptor returned is owned below.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        Ok(OpenDir { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Stats `rel` below the directory, following symbolic links as `fs::metadata` does.
    /// `rel` must be relative; an absolute path is looked up from the root.
    pub fn stat(&self, rel: &Path) -> io::Result<FileStat> {
        self.stat_with(rel, 0)
    }

    /// Stats `rel` itself: a symbolic link is not followed (and is neither a file nor a directory).
    pub fn lstat(&self, rel: &Path) -> io::Result<FileStat> {
        self.stat_with(rel, libc::AT_SYMLINK_NOFOLLOW)
    }

    fn stat_with(&self, rel: &Path, flags: libc::c_int) -> io::Result<FileStat> {
        let c = CString::new(rel.as_os_str().as_bytes()).map_err(io::Error::other)?;
        // SAFETY: an all-zero `stat` is a valid value for the kernel to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: the descriptor is open for this struct's life, `c` is NUL-terminated, `st` is writable.
        if unsafe { libc::fstatat(self.fd.as_raw_fd(), c.as_ptr(), &mut st, flags) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let kind = st.st_mode & libc::S_IFMT;
        let mtime_ns =
            if st.st_mtime >= 0 { st.st_mtime as i128 * 1_000_000_000 + st.st_mtime_nsec as i128 } else { 0 };
        Ok(FileStat {
            len: st.st_size as u64,
            mtime_ns,
            is_dir: kind == libc::S_IFDIR,
            is_file: kind == libc::S_IFREG,
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_from_the_open_directory_agrees_with_fs_metadata() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/f"), b"12345").unwrap();
        std::os::unix::fs::symlink("sub/f", dir.path().join("link")).unwrap();
        let open = OpenDir::open(dir.path()).unwrap();
        for rel in ["sub/f", "link", "sub"] {
            let m = std::fs::metadata(dir.path().join(rel)).unwrap();
            assert_eq!(open.stat(Path::new(rel)).unwrap(), FileStat::from(&m), "{rel}");
            assert!(FileStat::from(&m).mtime_ns > 0);
        }
        assert_eq!(open.stat(Path::new("missing")).unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
