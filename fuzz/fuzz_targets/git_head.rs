//! Feeds arbitrary bytes to mflow's git reader: as HEAD, a loose ref and packed-refs of a
//! repository beside a file that is not git's. Only a commit id may come out (never the first
//! line of another file: it goes into mflow.lock), a ref may only name a path inside the
//! repository, and nothing may hang or panic.
#![no_main]

use std::path::{Component, Path, PathBuf};

use libfuzzer_sys::fuzz_target;
use mflow_untrusted::git::{commit_of, is_commit, parse_head, valid_ref, work_tree, Head};

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("mflow-fuzz-git-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join(".git/objects")).unwrap();
    std::fs::create_dir_all(d.join(".git/refs/heads")).unwrap();
    d
}

fuzz_target!(|data: &[u8]| {
    match parse_head(data) {
        Some(Head::Ref(r)) => {
            assert!(valid_ref(&r), "{r:?}");
            assert!(Path::new(&r).components().all(|c| matches!(c, Component::Normal(_))), "{r:?}");
        }
        Some(Head::Commit(c)) => assert!(is_commit(&c)),
        None => {}
    }
    // HEAD | refs/heads/main | packed-refs | a file beside .git, cut at 0xff bytes.
    let mut parts = data.split(|&b| b == 0xff);
    let (head, main, packed, other) = (parts.next().unwrap_or(b""), parts.next().unwrap_or(b""), parts.next().unwrap_or(b""), parts.next().unwrap_or(b""));
    let d = scratch();
    std::fs::write(d.join(".git/HEAD"), head).unwrap();
    std::fs::write(d.join(".git/refs/heads/main"), main).unwrap();
    std::fs::write(d.join(".git/packed-refs"), packed).unwrap();
    std::fs::write(d.join("OTHER"), other).unwrap();
    assert_eq!(work_tree(&d).map(|w| w.0), Some(d.clone()));
    if let Some(c) = commit_of(&d) {
        assert!(is_commit(&c), "{c:?}");
        // It came from git's files, not from the one beside them.
        let from_git = [head, main, packed].iter().any(|f| f.windows(c.len()).any(|w| w == c.as_bytes()));
        assert!(from_git, "{c:?}");
    }
});
