//! Entries leaving their place: removed through the trash, or set aside where nothing deletes
//! them.

use std::fs;
use std::path::PathBuf;

use super::{io_err, CacheError};
use crate::workdir::Workdir;

/// Moves an entry into `.trash` (so that it leaves its place at once), then deletes it.
pub(super) fn remove_entry(workdir: &Workdir, key: &str) -> Result<(), CacheError> {
    let dir = workdir.entry(key);
    let trash_dir = workdir.trash();
    fs::create_dir_all(&trash_dir).map_err(io_err("cannot create", &trash_dir))?;
    let trash = trash_dir.join(format!("{key}.{}", fastrand::u64(..)));
    fs::rename(&dir, &trash).map_err(io_err("cannot move the entry to the trash:", &dir))?;
    fs::remove_dir_all(&trash).map_err(io_err("cannot remove", &trash))
}

/// Moves the entry of `key` to `.unverified/<key>.<n>`: out of the way of a new entry, and out
/// of reach of everything that deletes.
pub(super) fn set_aside(workdir: &Workdir, key: &str) -> Result<PathBuf, CacheError> {
    let dir = workdir.entry(key);
    let aside_dir = workdir.unverified();
    fs::create_dir_all(&aside_dir).map_err(io_err("cannot create", &aside_dir))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let aside = aside_dir.join(format!("{key}.{stamp}-{:04x}", fastrand::u16(..)));
    fs::rename(&dir, &aside).map_err(io_err("cannot set aside", &dir))?;
    Ok(aside)
}
