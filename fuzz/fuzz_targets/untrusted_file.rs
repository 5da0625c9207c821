//! Puts arbitrary bytes, a FIFO, a link to /dev/zero, a directory, a huge sparse file, a link
//! to itself or a link out of its directory where mflow reads a file someone else wrote, and
//! reads it through `mflow_untrusted` with an arbitrary cap and offset. Every read must end at
//! once, with the file's own bytes within the cap or with a refusal, and never panic.
#![no_main]

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use mflow_untrusted::{open_with, read_bounded, read_from, read_text, resolve_inside, Links};

/// A fresh directory for this input, under one per process.
fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("mflow-fuzz-untrusted-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("dir")).unwrap();
    d
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 6 {
        return;
    }
    let kind = data[0] % 7;
    let cap = u16::from_le_bytes([data[1], data[2]]) as u64;
    let offset = u16::from_le_bytes([data[3], data[4]]) as u64;
    let body = &data[5..];
    let root = scratch();
    let dir = root.join("dir");
    let f = dir.join("f");
    match kind {
        0 => std::fs::write(&f, body).unwrap(),
        1 => mkfifo(&f),
        2 => symlink("/dev/zero", &f).unwrap(),
        3 => std::fs::create_dir(&f).unwrap(),
        // Up to a terabyte, nothing on disk.
        4 => std::fs::File::create(&f).unwrap().set_len(u32::from_le_bytes([body.first().copied().unwrap_or(0), 0, 0, 1]) as u64 * 4096).unwrap(),
        5 => symlink("f", &f).unwrap(),
        _ => {
            std::fs::write(root.join("outside"), body).unwrap();
            symlink("../outside", &f).unwrap();
        }
    }
    // The bytes the file holds, for the kinds that are (or lead to) a regular file.
    let content: Option<Vec<u8>> = match kind {
        0 | 6 => Some(body.to_vec()),
        4 => Some(Vec::new()),
        _ => None,
    };
    let size = std::fs::metadata(&f).map(|m| m.len()).unwrap_or(0);
    let t0 = Instant::now();
    match read_bounded(&f, cap) {
        Ok(b) => {
            assert!(content.is_some() && size <= cap, "kind {kind} was read whole");
            assert_eq!(Some(b), content);
        }
        Err(e) => assert!(content.is_none() || size > cap, "kind {kind}: {e}"),
    }
    match read_from(&f, offset, cap) {
        Ok((b, got_size)) => {
            assert!(content.is_some(), "kind {kind} was read");
            assert_eq!(got_size, size);
            assert_eq!(b.len() as u64, cap.min(size.saturating_sub(offset)));
            if kind != 4 {
                let from = (offset as usize).min(body.len());
                assert_eq!(b, &body[from..from + b.len()]);
            } else {
                assert!(b.iter().all(|&x| x == 0));
            }
        }
        Err(e) => assert!(content.is_none(), "kind {kind}: {e}"),
    }
    if let Ok(t) = read_text(&f, cap) {
        assert_eq!(Some(t.into_bytes()), content);
    }
    // Files mflow keeps for itself: a link is refused too.
    let own = open_with(&f, std::fs::OpenOptions::new().read(true), Links::Refuse);
    assert_eq!(own.is_ok(), kind == 0 || kind == 4, "kind {kind}: {own:?}");
    // Inside a directory, a link may not lead out of it.
    let inside = resolve_inside(&dir, "f");
    match kind {
        0 | 4 => assert_eq!(inside.unwrap(), Some(f.canonicalize().unwrap())),
        6 => assert!(inside.is_err()),
        _ => assert!(!matches!(inside, Ok(Some(_)))),
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "kind {kind}: {:?}", t0.elapsed());
});
