//! The locks of a cache, all on one file (`cache/.lock`): one byte per key, held while the key
//! is computed, so that two runs never compute it at once; and the byte of live runs, held
//! shared by every run and exclusively by `gc` and `cache repair`.

use std::fs::{self, File};
use std::io;

use super::{files, io_err, CacheError};
use crate::workdir::Workdir;

/// The byte of the lock file that every store open for writing holds shared, and that `gc` and
/// `cache repair` take exclusively (see `maintain`). Past every key's byte (`lock_offset`).
pub(super) const LIVE: libc::off_t = 1 << 62;

/// Held while a key is being computed, so two runs never compute the same key at once: an OFD
/// lock on one byte of `cache/.lock` chosen by the key, so that locking creates no file per key.
/// Each lock has its own open file, so two tasks of one process exclude each other too.
pub struct KeyLock {
    _file: File,
}

/// The lock of `key` in the cache of `workdir`, on an open file of its own.
pub(super) fn lock_key(workdir: &Workdir, key: &str, wait: bool) -> Result<Option<KeyLock>, CacheError> {
    let path = workdir.cache_lock();
    let file = files::open(&path, fs::OpenOptions::new().read(true).write(true))
        .map_err(io_err("cannot open the lock file", &path))?;
    match ofd_lock(&file, libc::F_WRLCK, lock_offset(key), 1, wait) {
        Ok(true) => Ok(Some(KeyLock { _file: file })),
        Ok(false) => Ok(None),
        Err(cause) => Err(CacheError::Io { op: "cannot lock", path, cause }),
    }
}

/// Takes the shared run-wide lock, waiting (and saying so) while `gc` or `cache repair` holds it.
pub(super) fn hold_live(file: &File, workdir: &Workdir) -> io::Result<()> {
    if ofd_lock(file, libc::F_RDLCK, LIVE, 1, false)? {
        return Ok(());
    }
    tracing::warn!("waiting for `mflow gc` or `mflow cache repair` on {} to finish", workdir.display());
    ofd_lock(file, libc::F_RDLCK, LIVE, 1, true).map(drop)
}

/// Takes an OFD lock (`kind` is `F_RDLCK` or `F_WRLCK`) on `len` bytes of `file` from `start`
/// (0: to the end); false when `wait` is off and someone else holds it. The lock belongs to the
/// open file, so two opens in one process exclude each other too; closing the file releases it.
pub(super) fn ofd_lock(
    file: &File,
    kind: libc::c_int,
    start: libc::off_t,
    len: libc::off_t,
    wait: bool,
) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero flock is a valid value; the fields that matter are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = start;
    fl.l_len = len;
    let cmd = if wait { libc::F_OFD_SETLKW } else { libc::F_OFD_SETLK };
    loop {
        // SAFETY: fcntl with an OFD lock command reads the flock we own; the fd is open.
        if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &fl) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN | libc::EACCES) if !wait => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// The byte of `cache/.lock` that stands for `key`: 62 bits of its hash, so that two keys share
/// a byte (and wait for each other) with negligible probability.
fn lock_offset(key: &str) -> libc::off_t {
    let h = blake3::hash(key.as_bytes());
    (u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")) >> 2) as libc::off_t
}
