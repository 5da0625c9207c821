//! The files of the cache that mflow opens by name (the manifest log, the lock file, the marker)
//! are opened only when they are regular files: a FIFO in their place would block the open
//! (and the command) forever, and a symbolic link would have mflow append to, or lock, a file
//! somewhere else.

use std::fs::{self, File, FileType, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Opens `path` with `opts` when it is a regular file (or absent and `opts` creates it).
pub(super) fn open(path: &Path, opts: &mut OpenOptions) -> io::Result<File> {
    // Checked first for a clear message (opening a directory for writing says only EISDIR);
    // the open itself is safe without it: O_NONBLOCK returns from a FIFO at once instead of
    // waiting for a writer, O_NOFOLLOW refuses a link, and the descriptor's type is checked.
    match fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => return Err(not_regular(m.file_type())),
        _ => {}
    }
    let file = opts.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => io::Error::new(io::ErrorKind::InvalidInput, "it is a symbolic link, not a regular file"),
        _ => e,
    })?;
    let ft = file.metadata()?.file_type();
    if !ft.is_file() {
        return Err(not_regular(ft));
    }
    Ok(file)
}

/// Reads the whole of `path` when it is a regular file of at most `max` bytes. For the state
/// mflow keeps for itself (stat caches, keys, run records): a FIFO there must not hang a run,
/// and a file grown huge must not be read into memory.
pub(crate) fn read_regular(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let file = open(path, OpenOptions::new().read(true))?;
    let len = file.metadata()?.len();
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it is {len} bytes, more than the {max} mflow reads")));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it grew past the {max} bytes mflow reads")));
    }
    Ok(bytes)
}

/// The error for a file of another type where mflow keeps a regular file.
pub(super) fn not_regular(ft: FileType) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("it is {}, not a regular file", kind(ft)))
}

pub(super) fn kind(ft: FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_file() {
        "a regular file"
    } else {
        "a special file"
    }
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
                let e = open(&tmp.path().join(name), OpenOptions::new().read(true).append(write).create(write)).unwrap_err();
                assert!(e.to_string().contains(what), "{name}: {e}");
            }
        }
        assert!(open(&tmp.path().join("file"), OpenOptions::new().read(true)).is_ok());
        assert!(open(&tmp.path().join("new"), OpenOptions::new().append(true).create(true)).is_ok());
    }
}
