//! What mflow may destroy: `gc` against a live run, `gc` on directories that are not mflow's,
//! a manifest log or lock file that is missing or not a regular file, and workdirs mflow must
//! not write to. The real binary throughout; every command is bounded by a timeout, so a hang
//! fails the test instead of stalling it.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{code, stderr, stdout, Project};

const LIMIT: Duration = Duration::from_secs(30);

/// Runs `cmd`, killing it and failing the test if it has not ended within `LIMIT`.
fn bounded(cmd: &mut Command) -> Output {
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    wait_bounded(child, &format!("{cmd:?}"))
}

fn wait_bounded(mut child: Child, what: &str) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > LIMIT {
            child.kill().unwrap();
            panic!("{what} hung for {LIMIT:?}: {}", stderr(&child.wait_with_output().unwrap()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn mflow(p: &Project, args: &[&str]) -> Output {
    bounded(&mut p.cmd(args))
}

/// A chain `a -> b -> c`: each stage copies its upstream's output and adds its own line, so a
/// stage fails when an upstream entry is gone.
fn chain(extra: &str) -> String {
    format!(
        r#"[pipeline]
name = "chain"
{extra}
[vars]
v = 1

[stages.a]
kind = "command"
run = ["sh", "-c", "echo a-${{vars.v}} > $MFLOW_OUTPUT/out"]

[stages.b]
kind = "command"
needs = ["a"]
run = ["sh", "-c", "cat $MFLOW_INPUT_A/out > $MFLOW_OUTPUT/out && echo b >> $MFLOW_OUTPUT/out"]

[stages.c]
kind = "command"
needs = ["b"]
run = ["sh", "-c", "cat $MFLOW_INPUT_B/out > $MFLOW_OUTPUT/out && echo c >> $MFLOW_OUTPUT/out"]
"#
    )
}

fn cache(p: &Project) -> PathBuf {
    p.file(".mflow/cache")
}

fn log(p: &Project) -> PathBuf {
    cache(p).join(".manifests.jsonl")
}

/// Every name in `dir`, recursively, relative to it.
fn tree(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            out.insert(p.strip_prefix(base).unwrap().display().to_string());
            if e.file_type().unwrap().is_dir() {
                walk(base, &p, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// The keys of the stages of the latest run, by stage.
fn keys(p: &Project) -> Vec<(String, String)> {
    let r = p.latest_record();
    r["stages"].as_object().unwrap().iter().map(|(n, s)| (n.clone(), s["key"].as_str().unwrap().to_string())).collect()
}

/// stderr as one line: diagnostics wrap long messages, and a test looks for phrases.
fn err(o: &Output) -> String {
    stderr(o).replace(['│', '·', '╰', '─'], " ").split_whitespace().collect::<Vec<_>>().join(" ")
}

fn assert_ok(o: &Output) {
    assert_eq!(code(o), 0, "stdout:\n{}\nstderr:\n{}", stdout(o), stderr(o));
}

#[test]
fn gc_during_a_run_removes_nothing_the_run_committed_or_found_cached() {
    // `a` is cached from the first run and read by `c` at the very end; `b` commits while gc
    // is tried, and `c` reads it after.
    let spec = r#"[pipeline]
name = "live"

[vars]
v = 1

[stages.a]
kind = "command"
run = ["sh", "-c", "echo a > $MFLOW_OUTPUT/out"]

[stages.b]
kind = "command"
needs = ["a"]
run = ["sh", "-c", "echo b-${vars.v} > $MFLOW_OUTPUT/out"]

[stages.wait]
kind = "command"
needs = ["b"]
run = ["sh", "-c", "touch started-${vars.v}; sleep 1.5; echo w-${vars.v} > $MFLOW_OUTPUT/out"]

[stages.c]
kind = "command"
needs = ["a", "b", "wait"]
run = ["sh", "-c", "cat $MFLOW_INPUT_A/out $MFLOW_INPUT_B/out $MFLOW_INPUT_WAIT/out > $MFLOW_OUTPUT/out"]
"#;
    let p = Project::new(spec);
    // Stages run in the spec's directory.
    let started = |v: u32| p.file(&format!("started-{v}"));
    assert_ok(&mflow(&p, &["run", "spec.toml"]));
    let first: BTreeSet<String> = keys(&p).into_iter().map(|(_, k)| k).collect();

    let run = p
        .cmd(&["run", "spec.toml", "--set", "vars.v=2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !started(2).exists() {
        assert!(t.elapsed() < LIMIT, "the run never reached its slow stage");
        std::thread::sleep(Duration::from_millis(10));
    }
    // While the run is live, gc deletes nothing, whatever it is told to keep.
    let refused = mflow(&p, &["gc", "--keep-runs", "0"]);
    assert_eq!(code(&refused), 3, "{}", stderr(&refused));
    assert!(err(&refused).contains("is in use by a run"), "{}", stderr(&refused));
    // With --wait it waits for the run, then keeps what the newest run uses.
    let waiting =
        p.cmd(&["gc", "--keep-runs", "1", "--wait"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let run = wait_bounded(run, "run");
    assert_ok(&run);
    let gc = wait_bounded(waiting, "gc --wait");
    assert_ok(&gc);

    let r = p.latest_record();
    assert_eq!(r["stages"]["a"]["status"], "cached");
    assert_eq!(
        std::fs::read_to_string(Path::new(r["stages"]["c"]["output"].as_str().unwrap()).join("out")).unwrap(),
        "a\nb-2\nw-2\n"
    );
    let second: BTreeSet<String> = keys(&p).into_iter().map(|(_, k)| k).collect();
    for key in &second {
        assert!(cache(&p).join(key).is_dir(), "gc removed {key}, which the run used");
    }
    // What only the first run used went once the run had ended.
    let gone: Vec<&String> = first.difference(&second).collect();
    assert_eq!(gone.len(), 3);
    for key in gone {
        assert!(!cache(&p).join(key).exists(), "{key} was kept");
    }
    assert!(stdout(&gc).contains("removed 3 entries"), "{}", stdout(&gc));
    // The next run finds everything it needs.
    let again = mflow(&p, &["run", "spec.toml", "--set", "vars.v=2"]);
    assert_ok(&again);
    assert!(p.latest_record()["stages"].as_object().unwrap().values().all(|s| s["status"] == "cached"));
}

#[test]
fn gc_refuses_what_is_not_an_mflow_workdir_and_deletes_nothing() {
    let p = Project::new("");
    let foreign = p.file("data");
    let key = "ab".repeat(32);
    std::fs::create_dir_all(foreign.join("cache").join(&key)).unwrap();
    std::fs::write(foreign.join("cache").join(&key).join("weights.bin"), "precious").unwrap();
    std::fs::write(foreign.join("cache/notes.txt"), "mine").unwrap();
    std::fs::write(foreign.join("readme"), "mine").unwrap();
    let before = tree(&foreign);
    for args in [
        vec!["gc", "--workdir", "data"],
        vec!["gc", "--workdir", "data", "--keep-runs", "0"],
        vec!["cache", "repair", "--workdir", "data"],
    ] {
        let o = mflow(&p, &args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(err(&o).contains("not a workdir mflow may use"), "{}", stderr(&o));
        assert_eq!(tree(&foreign), before, "{args:?} changed the directory");
    }
    for dir in ["missing", "/", "/etc"] {
        let o = mflow(&p, &["gc", "--workdir", dir]);
        assert_eq!(code(&o), 2, "{dir}: {}", stderr(&o));
    }
    assert!(!p.file("missing").exists());
}

#[test]
fn gc_removes_only_entries_the_manifest_log_knows() {
    let p = Project::new(&chain(""));
    assert_ok(&mflow(&p, &["run", "spec.toml"]));
    let ours: Vec<String> = keys(&p).into_iter().map(|(_, k)| k).collect();
    // Things mflow never wrote, among them a key-shaped directory and a forged manifest line
    // whose key points out of the cache.
    let stray = "cd".repeat(32);
    std::fs::create_dir_all(cache(&p).join(&stray)).unwrap();
    std::fs::write(cache(&p).join(&stray).join("f"), "x").unwrap();
    std::fs::write(cache(&p).join("notes.txt"), "x").unwrap();
    std::fs::create_dir_all(cache(&p).join("mine")).unwrap();
    std::fs::create_dir_all(p.file("victim")).unwrap();
    std::fs::write(p.file("victim/f"), "x").unwrap();
    let forged = serde_json::json!({"version": 1, "key": "../../victim", "stage": "a", "files": [], "digest": "0"});
    let mut text = std::fs::read_to_string(log(&p)).unwrap();
    text.push_str(&format!("{forged}\n"));
    std::fs::write(log(&p), text).unwrap();

    let dry = mflow(&p, &["gc", "--keep-runs", "0", "--dry-run"]);
    assert_ok(&dry);
    assert!(stdout(&dry).contains("would remove 3 entries"), "{}", stdout(&dry));
    assert!(ours.iter().all(|k| cache(&p).join(k).is_dir()), "a dry run removed something");
    let o = mflow(&p, &["gc", "--keep-runs", "0"]);
    assert_ok(&o);
    assert!(stdout(&o).contains("removed 3 entries"), "{}", stdout(&o));
    assert!(err(&o).contains("does not know"), "{}", stderr(&o));
    for k in &ours {
        assert!(!cache(&p).join(k).exists(), "{k} was kept");
    }
    assert!(cache(&p).join(&stray).join("f").is_file());
    assert!(cache(&p).join("notes.txt").is_file());
    assert!(cache(&p).join("mine").is_dir());
    assert!(p.file("victim/f").is_file());
    assert_eq!(std::fs::read_to_string(log(&p)).unwrap(), "", "the log kept lines of removed entries");
}

/// What takes the manifest log's (or the lock file's) place in the trials below.
#[derive(Debug, Clone, Copy)]
enum Broken {
    Missing,
    Directory,
    Fifo,
}

fn break_file(path: &Path, how: Broken) {
    std::fs::remove_file(path).unwrap();
    match how {
        Broken::Missing => {}
        Broken::Directory => std::fs::create_dir(path).unwrap(),
        Broken::Fifo => mkfifo(path),
    }
}

/// A project with a committed chain, and the entry directories it has.
fn committed() -> (Project, Vec<String>) {
    let p = Project::new(&chain(""));
    assert_ok(&mflow(&p, &["run", "spec.toml"]));
    let keys: Vec<String> = keys(&p).into_iter().map(|(_, k)| k).collect();
    (p, keys)
}

fn assert_entries_remain(p: &Project, keys: &[String], when: &str) {
    for k in keys {
        let f = cache(p).join(k).join("out");
        assert!(f.is_file(), "{when}: the entry {k} was removed");
    }
}

#[test]
fn a_missing_log_leaves_every_entry_in_place_and_the_rerun_restores_it() {
    let (p, keys) = committed();
    break_file(&log(&p), Broken::Missing);
    let plan = mflow(&p, &["plan", "spec.toml"]);
    assert_ok(&plan);
    assert!(stdout(&plan).contains(".manifests.jsonl is missing"), "{}", stdout(&plan));
    assert!(err(&plan).contains(".manifests.jsonl"), "{}", stderr(&plan));
    assert_entries_remain(&p, &keys, "plan");
    assert!(!log(&p).exists(), "plan wrote the log");
    let run = mflow(&p, &["run", "spec.toml"]);
    assert_ok(&run);
    assert!(err(&run).contains(".manifests.jsonl"), "{}", stderr(&run));
    assert_entries_remain(&p, &keys, "run");
    // The stages reran into new staging; their identical outputs kept the old directories.
    let logged = std::fs::read_to_string(log(&p)).unwrap();
    assert!(keys.iter().all(|k| logged.contains(k.as_str())), "{logged}");
    assert!(!cache(&p).join(".unverified").exists());
    let again = mflow(&p, &["run", "spec.toml"]);
    assert_ok(&again);
    assert!(p.latest_record()["stages"].as_object().unwrap().values().all(|s| s["status"] == "cached"));
}

#[test]
fn a_log_that_is_a_directory_or_a_fifo_hangs_nothing_and_destroys_nothing() {
    for how in [Broken::Directory, Broken::Fifo] {
        let (p, keys) = committed();
        break_file(&log(&p), how);
        let plan = mflow(&p, &["plan", "spec.toml"]);
        assert_ok(&plan);
        assert!(err(&plan).contains(".manifests.jsonl"), "{how:?}: {}", stderr(&plan));
        assert!(stdout(&plan).contains("cannot be read"), "{how:?}: {}", stdout(&plan));
        assert_entries_remain(&p, &keys, "plan");
        for cmd in [vec!["run", "spec.toml"], vec!["why", "spec.toml", "c"], vec!["output", "spec.toml", "c"]] {
            let o = mflow(&p, &cmd);
            assert_entries_remain(&p, &keys, cmd[0]);
            if cmd[0] == "run" {
                assert_eq!(code(&o), 70, "{how:?}: {}", stderr(&o));
                assert!(
                    err(&o).contains(".manifests.jsonl") && err(&o).contains("cache repair"),
                    "{how:?}: {}",
                    stderr(&o)
                );
            }
        }
        let gc = mflow(&p, &["gc", "--keep-runs", "0"]);
        assert_eq!(code(&gc), 70, "{how:?}: {}", stderr(&gc));
        assert!(err(&gc).contains(".manifests.jsonl"), "{}", stderr(&gc));
        assert_entries_remain(&p, &keys, "gc");
        // Repair moves the thing aside and restores every entry the run record confirms.
        let repair = mflow(&p, &["cache", "repair"]);
        assert_ok(&repair);
        assert!(stdout(&repair).contains("0 intact, 3 restored, 0 set aside"), "{how:?}: {}", stdout(&repair));
        assert!(cache(&p).join(".manifests.jsonl.damaged-1").exists());
        let run = mflow(&p, &["run", "spec.toml"]);
        assert_ok(&run);
        assert!(p.latest_record()["stages"].as_object().unwrap().values().all(|s| s["status"] == "cached"), "{how:?}");
    }
}

#[test]
fn a_lock_file_that_is_a_fifo_or_a_directory_is_reported_by_name() {
    for how in [Broken::Fifo, Broken::Directory] {
        let (p, keys) = committed();
        let lock = cache(&p).join(".lock");
        break_file(&lock, how);
        let plan = mflow(&p, &["plan", "spec.toml"]);
        assert_ok(&plan);
        let run = mflow(&p, &["run", "spec.toml"]);
        assert_eq!(code(&run), 70, "{how:?}: {}", stderr(&run));
        assert!(err(&run).contains(".lock") && err(&run).contains("not a regular file"), "{how:?}: {}", stderr(&run));
        let gc = mflow(&p, &["gc", "--keep-runs", "0"]);
        assert_eq!(code(&gc), 70, "{how:?}: {}", stderr(&gc));
        assert!(err(&gc).contains(".lock"), "{how:?}: {}", stderr(&gc));
        assert_entries_remain(&p, &keys, "run and gc");
    }
}

#[test]
fn entries_the_log_does_not_vouch_for_are_set_aside_never_deleted() {
    let (p, keys) = committed();
    // A log that lost its lines (an empty file): the stage `a` now writes something else.
    std::fs::write(log(&p), "").unwrap();
    let run = mflow(
        &p,
        &[
            "run",
            "spec.toml",
            "--set",
            "vars.v=1",
            "--set",
            "stages.a.run=[\"sh\", \"-c\", \"echo other > $MFLOW_OUTPUT/out\"]",
        ],
    );
    assert_ok(&run);
    // `a` has a new key (its command changed); `b` and `c` changed with it.
    assert_entries_remain(&p, &keys, "run");
    let run = mflow(&p, &["run", "spec.toml"]);
    assert_ok(&run);
    assert_entries_remain(&p, &keys, "the rerun of the first spec");
    assert!(p.latest_record()["stages"].as_object().unwrap().values().all(|s| s["status"] == "succeeded"));
    // A stage whose rerun differs from the unlisted directory of its key: the old one is set aside.
    let (p, keys) = committed();
    std::fs::write(log(&p), "").unwrap();
    let a = &keys[0];
    std::fs::write(cache(&p).join(a).join("out"), "edited by hand\n").unwrap();
    assert_ok(&mflow(&p, &["run", "spec.toml"]));
    assert_eq!(std::fs::read_to_string(cache(&p).join(a).join("out")).unwrap(), "a-1\n");
    let aside: Vec<PathBuf> =
        std::fs::read_dir(cache(&p).join(".unverified")).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(std::fs::read_to_string(aside[0].join("out")).unwrap(), "edited by hand\n");
    // Repair keeps it: no run record confirms those bytes.
    let repair = mflow(&p, &["cache", "repair"]);
    assert_ok(&repair);
    assert!(aside[0].join("out").is_file());
    assert!(stdout(&repair).contains("match no run record"), "{}", stdout(&repair));
}

#[test]
fn a_commit_error_names_the_file_and_its_cause() {
    // The stage puts a directory where the log is, after the run checked it.
    let spec = chain("").replace(
        "echo a-${vars.v} > $MFLOW_OUTPUT/out",
        "echo a > $MFLOW_OUTPUT/out; L=$MFLOW_OUTPUT/../../../.manifests.jsonl; rm -rf $L; mkdir -p $L",
    );
    let p = Project::new(&spec);
    let o = mflow(&p, &["run", "spec.toml"]);
    assert_ne!(code(&o), 0);
    let message = p.latest_record()["stages"]["a"]["message"].as_str().unwrap().to_string();
    assert!(message.contains(".manifests.jsonl") && message.contains("a directory, not a regular file"), "{message}");
}

#[test]
fn workdirs_mflow_does_not_own_are_refused_at_load() {
    let p = Project::new("");
    let project = p.file("project");
    std::fs::create_dir_all(project.join("foreign")).unwrap();
    std::fs::write(project.join("foreign/thesis.tex"), "mine").unwrap();
    let outside = p.file("outside");
    for (workdir, says) in [
        ("/", "root directory"),
        ("/etc", "system directory"),
        ("../outside", "outside the project"),
        ("foreign", "not empty"),
    ] {
        std::fs::write(project.join("spec.toml"), chain(&format!("workdir = {workdir:?}"))).unwrap();
        let before = tree(p.path());
        for cmd in ["run", "plan", "validate"] {
            let o = bounded(
                Command::new(env!("CARGO_BIN_EXE_mflow"))
                    .args([cmd, "spec.toml"])
                    .current_dir(&project)
                    .env("CI", "true"),
            );
            assert_eq!(code(&o), 2, "{cmd} with workdir {workdir}: {}", stderr(&o));
            let text = err(&o);
            assert!(
                text.contains("mflow::spec::workdir")
                    && text.contains(&format!("workdir = {workdir:?}"))
                    && text.contains(says),
                "{workdir}: {text}"
            );
        }
        assert_eq!(tree(p.path()), before, "workdir {workdir}: something was written");
        assert!(!outside.exists());
    }
    // Through --set too.
    std::fs::write(project.join("spec.toml"), chain("")).unwrap();
    let o = bounded(
        Command::new(env!("CARGO_BIN_EXE_mflow"))
            .args(["run", "spec.toml", "--set", "pipeline.workdir=/etc"])
            .current_dir(&project)
            .env("CI", "true"),
    );
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(err(&o).contains("--set pipeline.workdir=/etc"), "{}", stderr(&o));
    // An absolute path elsewhere is the explicit way out of the project.
    let o = bounded(
        Command::new(env!("CARGO_BIN_EXE_mflow"))
            .args(["run", "spec.toml", "--set", &format!("pipeline.workdir={}", outside.display())])
            .current_dir(&project)
            .env("CI", "true"),
    );
    assert_ok(&o);
    assert!(outside.join(".mflow-workdir").is_file());
}

#[test]
fn a_checked_spec_is_refused_once_its_workdir_is_no_longer_mflows() {
    let p = Project::new(&chain("workdir = \"w\""));
    assert_ok(&mflow(&p, &["run", "spec.toml"]));
    // The same spec, unchanged, whose workdir was replaced by someone else's directory.
    std::fs::rename(p.file("w"), p.file("w.old")).unwrap();
    std::fs::create_dir_all(p.file("w")).unwrap();
    std::fs::write(p.file("w/thesis.tex"), "mine").unwrap();
    let o = mflow(&p, &["run", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(err(&o).contains("workdir = \"w\""), "{}", stderr(&o));
    assert_eq!(tree(&p.file("w")), BTreeSet::from(["thesis.tex".to_string()]));
}

#[test]
fn a_workdir_of_an_older_mflow_is_adopted() {
    let (p, _) = committed();
    let marker = p.file(".mflow/.mflow-workdir");
    assert!(marker.is_file());
    std::fs::remove_file(&marker).unwrap();
    // Looking writes nothing; running adopts it.
    assert_ok(&mflow(&p, &["plan", "spec.toml"]));
    assert!(!marker.exists());
    let o = mflow(&p, &["run", "spec.toml"]);
    assert_ok(&o);
    assert!(p.latest_record()["stages"].as_object().unwrap().values().all(|s| s["status"] == "cached"));
    assert!(marker.is_file());
    // So does gc, on a workdir with only run records.
    std::fs::remove_file(&marker).unwrap();
    std::fs::remove_dir_all(cache(&p)).unwrap();
    assert_ok(&mflow(&p, &["gc"]));
    assert!(marker.is_file());
}

#[test]
fn fifos_in_place_of_mflows_state_files_hang_nothing() {
    let (p, keys) = committed();
    let state = p.file(".mflow/state");
    for name in ["inputs.json", "keys-chain.index", "keys-chain.json", "lock.last"] {
        let f = state.join(name);
        let _ = std::fs::remove_file(&f);
        mkfifo(&f);
    }
    assert_ok(&mflow(&p, &["plan", "spec.toml"]));
    assert_ok(&mflow(&p, &["run", "spec.toml"]));
    assert_entries_remain(&p, &keys, "after runs with FIFOs for state files");
}
