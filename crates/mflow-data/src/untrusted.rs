//! Opening and quoting files a user hands to mflow's dataset stage.
//!
//! Inputs and tokenizers are opened only if they are regular files (a FIFO would block a read
//! forever), a tokenizer's companion files must resolve inside its directory, and error
//! messages quote at most a short excerpt of anything read from a file.

use std::fs::File;
use std::io::{Error, ErrorKind, Read};
use std::path::{Path, PathBuf};

/// Longest excerpt of file content quoted in an error message, in characters.
pub const EXCERPT_CHARS: usize = 200;

fn kind(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// The error for a path that exists but is not a regular file.
pub fn not_regular(ft: std::fs::FileType) -> Error {
    Error::new(ErrorKind::InvalidInput, format!("is {}, not a regular file; mflow reads only regular files", kind(ft)))
}

/// Opens `path` for reading only if it is a regular file. The open does not block on a FIFO,
/// and the type is checked on the opened descriptor, so nothing can be swapped in between.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    #[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
    const O_NONBLOCK: i32 = 0x4;
    #[cfg(not(any(target_os = "macos", target_os = "ios", target_os = "freebsd")))]
    const O_NONBLOCK: i32 = 0o4000;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(O_NONBLOCK).open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(meta.file_type()));
    }
    Ok(f)
}

/// Reads a whole regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let f = open_regular(path)?;
    let size = f.metadata()?.len();
    let too_large = |n: u64| Error::new(ErrorKind::InvalidData, format!("is {n} bytes, more than the {limit} accepted"));
    if size > limit {
        return Err(too_large(size));
    }
    let mut buf = Vec::with_capacity(size as usize);
    f.take(limit + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > limit {
        return Err(too_large(buf.len() as u64));
    }
    Ok(buf)
}

/// `dir/name` if it exists and resolves, through any links, inside `dir`; `Ok(None)` if
/// nothing is there; an error naming the target if it points outside.
pub fn resolve_inside(dir: &Path, name: &str) -> std::io::Result<Option<PathBuf>> {
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
        Ok(_) => {}
    }
    let root = dir.canonicalize()?;
    let target = path.canonicalize()?;
    if !target.starts_with(&root) {
        let msg = format!("resolves to {}, outside {}; replace the link with a copy of the file", target.display(), root.display());
        return Err(Error::new(ErrorKind::PermissionDenied, msg));
    }
    Ok(Some(target))
}

/// At most [`EXCERPT_CHARS`] characters of `s`, marking what was cut.
pub fn excerpt(s: &str) -> String {
    match s.char_indices().nth(EXCERPT_CHARS) {
        None => s.to_string(),
        Some((cut, _)) => format!("{}... ({} bytes in all)", &s[..cut], s.len()),
    }
}
