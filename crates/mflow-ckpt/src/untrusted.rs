//! Opening and quoting files a user hands to mflow.
//!
//! Model directories come from anywhere (downloads, shared disks, other people), so every file
//! is opened only if it is a regular file (a FIFO or device would block a read forever), files
//! named inside a directory must resolve inside it (a link to /etc/shadow must not be copied
//! into an output), whole-file reads are bounded, and error messages quote at most a short
//! excerpt of anything read from a file.
//!
//! The reading itself is the workspace's one reader of files someone else wrote
//! (`mflow_untrusted`); this module gives its refusals this crate's error type.

use std::fs::File;
use std::path::{Path, PathBuf};

use mflow_untrusted::Refusal;
use miette::Diagnostic;
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
pub enum FileError {
    #[error("{file}: cannot open")]
    #[diagnostic(code(mflow::ckpt::file::open), help("check that the file exists and is readable"))]
    Open { file: String, source: std::io::Error },

    #[error("{file}: is a {kind}, not a regular file")]
    #[diagnostic(code(mflow::ckpt::file::not_regular), help("replace it with the regular file it should be; mflow does not read FIFOs, sockets, devices or directories in its place"))]
    NotRegular { file: String, kind: &'static str },

    #[error("{file}: is {size} bytes, more than the {limit} accepted for this kind of file")]
    #[diagnostic(
        code(mflow::ckpt::file::too_large),
        help("check that the path names the right file; config and manifest files are small JSON documents")
    )]
    TooLarge { file: String, size: u64, limit: u64 },

    #[error("{link}: resolves to {target}, outside {dir}")]
    #[diagnostic(
        code(mflow::ckpt::file::escapes),
        help("replace the link with a copy of the file; files of a model directory must resolve inside it")
    )]
    Escapes { link: String, target: String, dir: String },
}

/// The error for `file` from the workspace's reader of untrusted files.
fn file_error(file: &Path, e: std::io::Error) -> FileError {
    let name = file.display().to_string();
    if let Some(r) = mflow_untrusted::refusal(&e) {
        return match r {
            Refusal::NotRegular { kind } => FileError::NotRegular { file: name, kind: kind.trim_start_matches("a ") },
            Refusal::TooLarge { size, limit } => FileError::TooLarge { file: name, size: *size, limit: *limit },
        };
    }
    if let Some(x) = e.get_ref().and_then(|i| i.downcast_ref::<mflow_untrusted::Escapes>()) {
        return FileError::Escapes {
            link: name,
            target: x.target.display().to_string(),
            dir: x.dir.display().to_string(),
        };
    }
    FileError::Open { file: name, source: e }
}

/// Opens `path` for reading only if it is a regular file (`mflow_untrusted::open_regular`).
pub fn open_regular(path: &Path) -> Result<File, FileError> {
    mflow_untrusted::open_regular(path).map_err(|e| file_error(path, e))
}

/// Reads a whole regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    mflow_untrusted::read_bounded(path, limit).map_err(|e| file_error(path, e))
}

/// `dir/name` if it exists and resolves (through any links) to a regular file inside `dir`;
/// `None` if nothing is there; an error naming the link if it points outside `dir`, or if it
/// is not a regular file.
pub fn resolve_inside(dir: &Path, name: &str) -> Result<Option<PathBuf>, FileError> {
    mflow_untrusted::resolve_inside(dir, name).map_err(|e| file_error(&dir.join(name), e))
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

pub use mflow_untrusted::{excerpt, excerpt_of, EXCERPT_CHARS};

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
