//! Opening and quoting files a user hands to mflow.
//!
//! Model directories come from anywhere (downloads, shared disks, other people), so every file
//! is opened only if it is a regular file (a FIFO or device would block a read forever), files
//! named inside a directory must resolve inside it (a link to /etc/shadow must not be copied
//! into an output), whole-file reads are bounded, and error messages quote at most a short
//! excerpt of anything read from a file.
//!
//! This module depends on nothing else in the crate, so the fuzz targets can compile it alone.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use miette::Diagnostic;
use thiserror::Error;

/// Longest excerpt of file content quoted in an error message, in characters.
pub const EXCERPT_CHARS: usize = 200;

#[derive(Debug, Error, Diagnostic)]
pub enum FileError {
    #[error("{file}: cannot open: {source}")]
    #[diagnostic(code(mflow::ckpt::file::open), help("check that the file exists and is readable"))]
    Open { file: String, source: std::io::Error },

    #[error("{file}: is a {kind}, not a regular file")]
    #[diagnostic(code(mflow::ckpt::file::not_regular), help("replace it with the regular file it should be; mflow does not read FIFOs, sockets, devices or directories in its place"))]
    NotRegular { file: String, kind: &'static str },

    #[error("{file}: is {size} bytes, more than the {limit} accepted for this kind of file")]
    #[diagnostic(code(mflow::ckpt::file::too_large), help("check that the path names the right file; config and manifest files are small JSON documents"))]
    TooLarge { file: String, size: u64, limit: u64 },

    #[error("{link}: resolves to {target}, outside {dir}")]
    #[diagnostic(code(mflow::ckpt::file::escapes), help("replace the link with a copy of the file; files of a model directory must resolve inside it"))]
    Escapes { link: String, target: String, dir: String },
}

fn kind(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "directory"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "device"
    } else {
        "non-regular file"
    }
}

/// Opens `path` for reading only if it is a regular file.
///
/// The open is non-blocking, so a FIFO in the file's place returns at once instead of waiting
/// for a writer; the type is then checked on the opened descriptor, so a swap between check and
/// open cannot slip a FIFO in.
pub fn open_regular(path: &Path) -> Result<File, FileError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = path.display().to_string();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags::O_NONBLOCK)
        .open(path)
        .map_err(|source| FileError::Open { file: file.clone(), source })?;
    let meta = f.metadata().map_err(|source| FileError::Open { file: file.clone(), source })?;
    if !meta.is_file() {
        return Err(FileError::NotRegular { file, kind: kind(meta.file_type()) });
    }
    Ok(f)
}

/// The O_NONBLOCK value of the Linux and macOS ABIs, without a libc dependency.
mod libc_flags {
    #[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
    pub const O_NONBLOCK: i32 = 0x4;
    #[cfg(not(any(target_os = "macos", target_os = "ios", target_os = "freebsd")))]
    pub const O_NONBLOCK: i32 = 0o4000;
}

/// Reads a whole regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    let f = open_regular(path)?;
    let file = || path.display().to_string();
    let size = f.metadata().map_err(|source| FileError::Open { file: file(), source })?.len();
    if size > limit {
        return Err(FileError::TooLarge { file: file(), size, limit });
    }
    let mut buf = Vec::with_capacity(size as usize);
    // `take` guards against a file that grows while it is read.
    f.take(limit + 1).read_to_end(&mut buf).map_err(|source| FileError::Open { file: file(), source })?;
    if buf.len() as u64 > limit {
        return Err(FileError::TooLarge { file: file(), size: buf.len() as u64, limit });
    }
    Ok(buf)
}

/// `dir/name` if it exists and resolves (through any links) to a regular file inside `dir`;
/// `None` if nothing is there; an error naming the link if it points outside `dir`, or if it
/// is not a regular file.
pub fn resolve_inside(dir: &Path, name: &str) -> Result<Option<PathBuf>, FileError> {
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(FileError::Open { file: path.display().to_string(), source }),
        Ok(_) => {}
    }
    fn open(p: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
        move |source| FileError::Open { file: p.display().to_string(), source }
    }
    let root = dir.canonicalize().map_err(open(dir))?;
    let target = path.canonicalize().map_err(open(&path))?;
    if !target.starts_with(&root) {
        return Err(FileError::Escapes {
            link: path.display().to_string(),
            target: target.display().to_string(),
            dir: root.display().to_string(),
        });
    }
    let meta = std::fs::metadata(&target).map_err(open(&target))?;
    if !meta.is_file() {
        return Err(FileError::NotRegular { file: path.display().to_string(), kind: kind(meta.file_type()) });
    }
    Ok(Some(target))
}

/// Copies `dir/name` to `to` if it exists, after [`resolve_inside`]; returns whether it did.
/// The bytes are read through the descriptor that was checked, not by path again.
pub fn copy_inside(dir: &Path, name: &str, to: &Path) -> Result<bool, FileError> {
    let Some(src) = resolve_inside(dir, name)? else { return Ok(false) };
    let mut from = open_regular(&src)?;
    let err = |p: &Path| {
        let file = p.display().to_string();
        move |source| FileError::Open { file, source }
    };
    let mut out = File::create(to).map_err(err(to))?;
    std::io::copy(&mut from, &mut out).map_err(err(&src))?;
    Ok(true)
}

/// At most [`EXCERPT_CHARS`] characters of `s`, marking what was cut, for quoting file content
/// in messages.
pub fn excerpt(s: &str) -> String {
    excerpt_of(&s)
}

/// [`excerpt`] of a value's display form, without formatting more of it than is quoted.
pub fn excerpt_of(v: &dyn std::fmt::Display) -> String {
    use std::fmt::Write;
    // Keeps the first bytes written and counts the rest.
    struct Cap {
        out: String,
        total: usize,
    }
    impl Write for Cap {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.total += s.len();
            let mut end = (EXCERPT_CHARS * 4).saturating_sub(self.out.len()).min(s.len());
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            self.out.push_str(&s[..end]);
            Ok(())
        }
    }
    let mut cap = Cap { out: String::new(), total: 0 };
    let _ = write!(cap, "{v}");
    let cut = cap.out.char_indices().nth(EXCERPT_CHARS).map(|(i, _)| i);
    match cut {
        None if cap.total == cap.out.len() => cap.out,
        None => format!("{}... ({} bytes in all)", cap.out, cap.total),
        Some(i) => format!("{}... ({} bytes in all)", &cap.out[..i], cap.total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_are_short() {
        let long = "x".repeat(10_000);
        let e = excerpt(&long);
        assert!(e.len() < 260, "{e}");
        assert!(e.ends_with("(10000 bytes in all)"));
        assert_eq!(excerpt("short"), "short");
        let v = serde_json::Value::String(long);
        let e = excerpt_of(&v);
        assert!(e.len() < 260 && e.ends_with("(10002 bytes in all)"), "{e}");
        assert_eq!(excerpt_of(&42), "42");
    }
}
