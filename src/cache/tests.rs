//! The store's tests.

use super::staged::{HASH_WINDOW, MAP_FROM};
use super::*;
use crate::workdir::Workdir;
use std::io::Write;

#[test]
fn a_file_hashed_in_windows_has_its_whole_digest() {
    let tmp = tempfile::tempdir().unwrap();
    for len in [0, 5, MAP_FROM as usize, 2 * HASH_WINDOW + 12_345] {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let path = tmp.path().join(format!("f{len}"));
        fs::write(&path, &bytes).unwrap();
        assert_eq!(hash_file(&path).unwrap(), blake3::hash(&bytes).to_hex().to_string(), "{len} bytes");
    }
}

/// A staging directory of `key` holding `files`, with the key's lock.
fn stage_files(store: &Store, key: &str, files: &[(&str, &[u8])]) -> (KeyLock, PathBuf) {
    let lock = store.lock(key).unwrap();
    let st = store.stage(key, "r").unwrap();
    for (path, bytes) in files {
        let p = st.join(path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
    }
    (lock, st)
}

#[test]
fn commit_then_hit_then_corruption_is_a_miss() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    let (_l, st) = stage_files(&store, "k1", &[("sub/a.txt", b"hello")]);
    let m = store.commit(&st, "k1", "s").unwrap();
    assert_eq!(m.files.len(), 1);
    assert!(matches!(store.lookup("k1", true), Lookup::Hit(_)));
    // Same size, other bytes: only a full verify notices.
    fs::write(store.output_dir("k1").join("sub/a.txt"), b"jello").unwrap();
    assert!(matches!(store.lookup("k1", false), Lookup::Hit(_)));
    assert!(matches!(store.lookup("k1", true), Lookup::Corrupt(_)));
    assert!(matches!(store.lookup("k1", false), Lookup::Miss));
}

fn commit_file(store: &Store, key: &str, text: &str) -> Manifest {
    let (_l, st) = stage_files(store, key, &[("f", text.as_bytes())]);
    store.commit(&st, key, "s").unwrap()
}

#[test]
fn a_listed_output_knows_its_size_before_hashing() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    let (_l, st) = stage_files(&store, "k", &[("d/b", &[7u8; 5000]), ("a", b"abc")]);
    let staged = Staged::list(&st).unwrap();
    assert_eq!(staged.bytes(), 5003);
    let m = store.commit_listed(staged, "k", "s").unwrap();
    let paths: Vec<_> = m.files.iter().map(|f| (f.path.as_str(), f.size)).collect();
    assert_eq!(paths, [("a", 3), ("d/b", 5000)]);
    assert_eq!(m.files[0].blake3, blake3::hash(b"abc").to_hex().to_string());
    assert!(matches!(store.lookup("k", true), Lookup::Hit(h) if *h == m));
}

#[test]
fn a_commit_creates_only_the_output_and_one_manifest_line() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    commit_file(&store, "k1", "one");
    commit_file(&store, "k2", "two");
    let names: Vec<String> = fs::read_dir(store.output_dir("k1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert_eq!(names, ["f"]);
    let log = fs::read_to_string(tmp.path().join("cache/.manifests.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 2);
    // Another process (a fresh store) reads the entries from the log.
    let other = Store::open(&Workdir::new(tmp.path())).unwrap();
    assert!(matches!(other.lookup("k2", true), Lookup::Hit(m) if m.files[0].size == 3));
}

#[test]
fn entries_committed_by_another_store_are_seen_and_a_directory_without_manifest_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (Store::open(&Workdir::new(tmp.path())).unwrap(), Store::open(&Workdir::new(tmp.path())).unwrap());
    assert!(matches!(a.lookup("k", false), Lookup::Miss));
    commit_file(&b, "k", "x");
    assert!(matches!(a.lookup("k", false), Lookup::Hit(_)));
    fs::create_dir_all(a.output_dir("stray")).unwrap();
    assert!(matches!(a.lookup("stray", false), Lookup::Corrupt(why) if why.contains("no line")));
    assert!(a.output_dir("stray").exists(), "an entry the log does not know was deleted");
}

#[test]
fn an_unknown_entry_is_kept_when_the_rerun_matches_it_and_set_aside_when_not() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    commit_file(&store, "same", "one");
    commit_file(&store, "other", "two");
    let log = Workdir::new(tmp.path()).manifest_log();
    fs::remove_file(&log).unwrap();
    let fresh = Store::open(&Workdir::new(tmp.path())).unwrap();
    for key in ["same", "other"] {
        assert!(matches!(fresh.lookup(key, false), Lookup::Corrupt(why) if why.contains("is missing")));
        assert!(fresh.output_dir(key).is_dir());
    }
    let kept = fs::metadata(fresh.output_dir("same")).unwrap();
    commit_file(&fresh, "same", "one");
    commit_file(&fresh, "other", "changed");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(fs::metadata(fresh.output_dir("same")).unwrap().ino(), kept.ino(), "an identical entry was replaced");
    assert_eq!(fs::read_to_string(fresh.output_dir("other").join("f")).unwrap(), "changed");
    let aside: Vec<_> =
        fs::read_dir(Workdir::new(tmp.path()).unverified()).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(fs::read_to_string(aside[0].join("f")).unwrap(), "two");
    let again = Store::open(&Workdir::new(tmp.path())).unwrap();
    assert!(matches!(again.lookup("same", true), Lookup::Hit(_)));
    assert!(matches!(again.lookup("other", true), Lookup::Hit(_)));
}

#[test]
fn a_log_that_is_not_a_regular_file_is_refused_by_a_run_and_keeps_every_entry_for_a_look() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    commit_file(&store, "k", "one");
    let log = Workdir::new(tmp.path()).manifest_log();
    fs::remove_file(&log).unwrap();
    fs::create_dir(&log).unwrap();
    let e = Store::open(&Workdir::new(tmp.path())).err().expect("a run refuses a directory in the log's place");
    assert!(e.to_string().contains(".manifests.jsonl") && e.to_string().contains("a directory"), "{e}");
    let look = Store::open_read_only(&Workdir::new(tmp.path()));
    assert!(matches!(look.lookup("k", true), Lookup::Corrupt(why) if why.contains("a directory")));
    assert!(look.output_dir("k").join("f").is_file());
}

#[test]
fn an_io_error_names_the_path_and_its_cause() {
    let e = io_err("cannot append to the manifest log", Path::new("w/cache/.manifests.jsonl"))(
        io::Error::from_raw_os_error(libc::ENOSPC),
    );
    let text = e.to_string();
    assert!(text.contains("w/cache/.manifests.jsonl") && text.contains("No space left on device"), "{text}");
}

#[test]
fn a_live_store_holds_off_the_exclusive_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    let lock =
        files::open(&Workdir::new(tmp.path()).cache_lock(), fs::OpenOptions::new().read(true).write(true)).unwrap();
    assert!(!ofd_lock(&lock, libc::F_WRLCK, LIVE, 1, false).unwrap());
    assert!(ofd_lock(&lock, libc::F_RDLCK, LIVE, 1, false).unwrap(), "two runs share it");
    let _ = ofd_lock(&lock, libc::F_UNLCK, LIVE, 1, false);
    drop(store);
    assert!(ofd_lock(&lock, libc::F_WRLCK, LIVE, 1, false).unwrap());
}

#[test]
fn a_torn_line_costs_only_its_own_entry() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    commit_file(&store, "k1", "one");
    let log = tmp.path().join("cache/.manifests.jsonl");
    fs::OpenOptions::new().append(true).open(&log).unwrap().write_all(b"{\"version\":1,\"ke").unwrap();
    commit_file(&store, "k2", "two");
    let fresh = Store::open(&Workdir::new(tmp.path())).unwrap();
    assert!(matches!(fresh.lookup("k1", false), Lookup::Hit(_)));
    assert!(matches!(fresh.lookup("k2", false), Lookup::Hit(_)));
}

#[test]
fn compaction_keeps_the_lines_of_existing_entries() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    let reader = Store::open(&Workdir::new(tmp.path())).unwrap();
    commit_file(&store, "k1", "one");
    commit_file(&store, "k2", "two");
    assert!(matches!(reader.lookup("k1", false), Lookup::Hit(_)));
    store.remove("k1").unwrap();
    store.compact().unwrap();
    let log = fs::read_to_string(tmp.path().join("cache/.manifests.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 1);
    assert!(log.contains("\"k2\""));
    // A reader that had the old file open follows the compacted one.
    commit_file(&store, "k3", "three");
    assert!(matches!(reader.lookup("k3", false), Lookup::Hit(_)));
    assert!(matches!(reader.lookup("k2", false), Lookup::Hit(_)));
    assert!(matches!(reader.lookup("k1", true), Lookup::Miss));
}

#[test]
fn manifest_paths_cannot_escape() {
    assert!(safe_join(Path::new("/a"), "../b").is_none());
    assert!(safe_join(Path::new("/a"), "/etc/passwd").is_none());
    assert!(safe_join(Path::new("/a"), "b/c").is_some());
}

#[test]
fn key_lock_is_exclusive() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&Workdir::new(tmp.path())).unwrap();
    let held = store.try_lock("k").unwrap();
    assert!(held.is_some());
    assert!(store.try_lock("k").unwrap().is_none());
    drop(held);
    assert!(store.try_lock("k").unwrap().is_some());
    let _other = store.try_lock("other").unwrap().expect("another key is not blocked");
}
