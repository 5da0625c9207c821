use super::*;
use std::os::unix::fs::symlink;
use std::time::{Duration, Instant};

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

/// A FIFO, a link to /dev/zero, a directory and a sparse file of 1 TiB: each refused at once.
#[test]
fn hostile_files_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    mkfifo(&d.join("fifo"));
    symlink("/dev/zero", d.join("zero")).unwrap();
    std::fs::create_dir(d.join("dir")).unwrap();
    let sparse = File::create(d.join("sparse")).unwrap();
    sparse.set_len(1 << 40).unwrap();
    std::fs::write(d.join("small"), b"hello").unwrap();
    let t0 = Instant::now();
    for (name, want) in [
        ("fifo", "a FIFO"),
        ("zero", "a character device"),
        ("dir", "a directory"),
        ("sparse", "more than the 1048576"),
    ] {
        let e = read_bounded(&d.join(name), 1 << 20).unwrap_err();
        assert!(e.to_string().contains(want), "{name}: {e}");
        assert!(refusal(&e).is_some(), "{name}: {e:?}");
        if name != "sparse" {
            assert!(read_from(&d.join(name), 0, 10).is_err(), "{name}");
            assert!(copy_from(&d.join(name), 0, &mut io::sink()).is_err(), "{name}");
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(read_bounded(&d.join("small"), 5).unwrap(), b"hello");
    assert!(read_bounded(&d.join("small"), 4).is_err());
    assert_eq!(read_from(&d.join("small"), 2, 2).unwrap(), (b"ll".to_vec(), 5));
    assert_eq!(read_from(&d.join("small"), 9, 2).unwrap(), (vec![], 5));
    // A link to a regular file is followed, unless links are refused.
    symlink("small", d.join("link")).unwrap();
    assert_eq!(read_bounded(&d.join("link"), 5).unwrap(), b"hello");
    let e = read_bounded_nofollow(&d.join("link"), 5).unwrap_err();
    assert!(e.to_string().contains("a symbolic link"), "{e}");
}

#[test]
fn writing_opens_only_regular_files_and_a_fifo_without_reader_does_not_block() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo");
    mkfifo(&fifo);
    let e = open_with(&fifo, OpenOptions::new().append(true), Links::Follow).unwrap_err();
    assert!(e.to_string().contains("a FIFO"), "{e}");
    let e = open_with(&fifo, OpenOptions::new().read(true), Links::Refuse).unwrap_err();
    assert!(e.to_string().contains("a FIFO"), "{e}");
    assert!(open_with(&tmp.path().join("new"), OpenOptions::new().append(true).create(true), Links::Refuse).is_ok());
}

#[test]
fn a_link_out_of_its_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(tmp.path().join("outside"), b"x").unwrap();
    symlink("../outside", dir.join("config.json")).unwrap();
    let e = resolve_inside(&dir, "config.json").unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    assert_eq!(resolve_inside(&dir, "absent").unwrap(), None);
}

#[test]
fn excerpts_are_short() {
    let long = "x".repeat(10_000);
    let e = excerpt(&long);
    assert!(e.len() < 260 && e.ends_with("(10000 bytes in all)"), "{e}");
    assert_eq!(excerpt("short"), "short");
    assert_eq!(excerpt_of(&42), "42");
}

fn repo(d: &Path, head: &str) -> PathBuf {
    let git = d.join(".git");
    std::fs::create_dir_all(git.join("objects")).unwrap();
    std::fs::create_dir_all(git.join("refs/heads")).unwrap();
    std::fs::write(git.join("HEAD"), head).unwrap();
    git
}

const ID: &str = "0123456789abcdef0123456789abcdef01234567";

#[test]
fn head_names_a_commit_through_refs_inside_the_repository_only() {
    let tmp = tempfile::tempdir().unwrap();
    let git = repo(tmp.path(), "ref: refs/heads/main\n");
    assert_eq!(head_commit_of(tmp.path()), None, "an unborn branch");
    std::fs::write(git.join("refs/heads/main"), format!("{ID}\n")).unwrap();
    assert_eq!(head_commit_of(tmp.path()).as_deref(), Some(ID));
    std::fs::remove_file(git.join("refs/heads/main")).unwrap();
    std::fs::write(git.join("packed-refs"), format!("# pack-refs\n{ID} refs/heads/mainx\n{ID} refs/heads/main\n"))
        .unwrap();
    assert_eq!(head_commit_of(tmp.path()).as_deref(), Some(ID));
    // What HEAD may not name: paths out of .git, devices, any file's first line.
    std::fs::write(tmp.path().join("SOME"), "secret text\n").unwrap();
    for head in [
        "ref: ../../dev/zero",
        "ref: ../SOME",
        "ref: SOME",
        "ref: /dev/zero",
        "ref: refs/../../SOME",
        "secret",
        "ref: refs/heads/main.lock",
    ] {
        std::fs::write(git.join("HEAD"), head).unwrap();
        assert_eq!(head_commit_of(tmp.path()), None, "{head}");
    }
    // A ref that is a link to a device, or a FIFO, reads as no commit, at once.
    std::fs::write(git.join("HEAD"), "ref: refs/heads/dev").unwrap();
    symlink("/dev/zero", git.join("refs/heads/dev")).unwrap();
    assert_eq!(head_commit_of(tmp.path()), None);
    std::fs::remove_file(git.join("HEAD")).unwrap();
    mkfifo(&git.join("HEAD"));
    assert_eq!(head_commit_of(tmp.path()), None);
}

fn head_commit_of(d: &Path) -> Option<String> {
    git::commit_of(d)
}

#[test]
fn an_empty_or_bogus_git_is_not_a_repository() {
    let tmp = tempfile::tempdir().unwrap();
    let sub = tmp.path().join("a/b");
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::create_dir(tmp.path().join("a/.git")).unwrap();
    assert_eq!(git::work_tree(&sub), None);
    std::fs::write(tmp.path().join("a/b/.git"), "not a gitdir line").unwrap();
    assert_eq!(git::work_tree(&sub), None);
    repo(tmp.path(), &format!("{ID}\n"));
    assert_eq!(git::work_tree(&sub).map(|w| w.0), Some(tmp.path().to_path_buf()));
    // A linked work tree: `.git` is a file naming its git directory.
    let wt = tmp.path().join(".git/worktrees/w");
    std::fs::create_dir_all(&wt).unwrap();
    std::fs::write(wt.join("HEAD"), format!("{ID}\n")).unwrap();
    std::fs::write(wt.join("commondir"), "../..\n").unwrap();
    std::fs::write(tmp.path().join("a/b/.git"), format!("gitdir: {}\n", wt.display())).unwrap();
    assert_eq!(git::work_tree(&sub).map(|w| w.0), Some(sub.clone()));
    assert_eq!(git::commit_of(&sub).as_deref(), Some(ID));
}

#[test]
fn ref_names_are_checked_as_git_does() {
    for ok in ["refs/heads/main", "refs/heads/feature/x-1", "refs/tags/v1.0"] {
        assert!(git::valid_ref(ok), "{ok}");
    }
    for bad in [
        "",
        "HEAD",
        "SOME/FILE",
        "refs/",
        "refs/../x",
        "refs/heads/.hidden",
        "/refs/x",
        "refs//x",
        "refs/x y",
        "refs/a\0b",
        "refs/a.lock",
    ] {
        assert!(!git::valid_ref(bad), "{bad:?}");
    }
    assert_eq!(git::parse_head(b"ref: refs/heads/m\n"), Some(git::Head::Ref("refs/heads/m".into())));
    assert_eq!(git::parse_head(ID.as_bytes()), Some(git::Head::Commit(ID.into())));
    assert_eq!(git::parse_head(b"\xff"), None);
}

fn walked(start: &Path, limits: walk::Limits) -> Result<Vec<PathBuf>, walk::WalkError<()>> {
    let mut seen = Vec::new();
    walk::walk(start, limits, &walk::stat, &mut |p: &Path, _: &walk::Node, _| {
        seen.push(p.to_path_buf());
        Ok(true)
    })
    .map(|()| seen)
}

#[test]
fn a_walk_stops_at_a_cycle_of_links_and_at_its_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("loop");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("f"), "f").unwrap();
    symlink(".", d.join("l1")).unwrap();
    symlink(".", d.join("l2")).unwrap();
    let t0 = Instant::now();
    match walked(&d, walk::LIMITS) {
        Err(walk::WalkError::Cycle { path }) => assert_eq!(path, d.join("l1")),
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(1));
    std::fs::remove_file(d.join("l1")).unwrap();
    std::fs::remove_file(d.join("l2")).unwrap();
    // A link to a directory beside is walked; twice through two links is no cycle.
    std::fs::create_dir(tmp.path().join("side")).unwrap();
    std::fs::write(tmp.path().join("side/g"), "g").unwrap();
    symlink("../side", d.join("a")).unwrap();
    symlink("../side", d.join("b")).unwrap();
    let seen = walked(&d, walk::LIMITS).unwrap();
    assert_eq!(seen, [d.clone(), d.join("a"), d.join("a/g"), d.join("b"), d.join("b/g"), d.join("f")]);
    assert!(matches!(walked(&d, walk::Limits { entries: 5, depth: 9 }), Err(walk::WalkError::TooMany { limit: 5 })));
    assert!(matches!(walked(&d, walk::Limits { entries: 9, depth: 0 }), Err(walk::WalkError::TooDeep { limit: 0 })));
    assert_eq!(walked(&d, walk::Limits { entries: 6, depth: 1 }).unwrap().len(), 6);
}

#[global_allocator]
static COUNTING: counting::Counting = counting::Counting;
