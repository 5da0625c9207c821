//! Files mflow writes for the user and files someone else wrote for mflow to read, tried as a
//! hostile or unlucky user would: a FIFO, a link to a device, a huge sparse file, the spec or
//! the cache log named as an output, inputs that link back into themselves. Every command must
//! end soon with a clear word, never hang, and never replace what it was not asked to.

mod common;

use std::os::unix::fs::{symlink, FileTypeExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{code, stderr, stdout, Project};

/// stderr as one line of words: messages are wrapped to the width of a terminal, and the
/// frame of a diagnostic is not part of what it says.
fn said(o: &Output) -> String {
    let frame = |w: &str| w.chars().all(|c| "│╰─▶×├╭╮╯┆·⚠☓".contains(c));
    stderr(o).split_whitespace().filter(|w| !frame(w)).collect::<Vec<_>>().join(" ")
}

/// Far more than any of these commands takes, even on a loaded machine; a hang is forever.
const LIMIT: Duration = Duration::from_secs(120);

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

fn sparse(path: &Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

/// Runs `cmd`, failing the test if it has not ended within [`LIMIT`].
fn within(cmd: impl std::borrow::BorrowMut<Command>) -> Output {
    let mut cmd = cmd;
    let cmd = cmd.borrow_mut();
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output().unwrap()));
    match rx.recv_timeout(LIMIT) {
        Ok(o) => o,
        Err(_) => {
            // SAFETY: killing the child this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{cmd:?} did not end within {LIMIT:?}");
        }
    }
}

fn one(script: &str) -> String {
    format!("[pipeline]\nname = \"x\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", '{script}']\n")
}

const OK: &str = "echo ok > $MFLOW_OUTPUT/out";

fn is_char_device(p: &Path) -> bool {
    std::fs::symlink_metadata(p).unwrap().file_type().is_char_device()
}

// Class 1: paths a user names for output.

#[test]
fn hardening_a_user_named_output_that_is_not_a_regular_file_is_written_in_place() {
    let p = Project::new(&one(OK));
    // A character device stays one.
    let o = within(p.cmd(&["run", "spec.toml", "--junit", "/dev/null", "--report", "/dev/null"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!said(&o).contains("warning"), "{}", stderr(&o));
    assert!(is_char_device(Path::new("/dev/null")));
    let o = within(p.cmd(&["report", "--out", "/dev/null"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(is_char_device(Path::new("/dev/null")));

    // A link stays a link; the file it names is written.
    std::fs::write(p.file("target.xml"), "old").unwrap();
    symlink("target.xml", p.file("link.xml")).unwrap();
    std::fs::write(p.file("kept"), "k").unwrap();
    std::fs::hard_link(p.file("kept"), p.file("report.html")).unwrap();
    let o = within(p.cmd(&["run", "spec.toml", "--junit", "link.xml", "--report", "report.html"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(std::fs::symlink_metadata(p.file("link.xml")).unwrap().file_type().is_symlink());
    assert!(std::fs::read_to_string(p.file("target.xml")).unwrap().contains("<testsuites"));
    // A regular file is written in place: its other name sees the report.
    assert!(
        std::fs::read_to_string(p.file("kept")).unwrap().contains("<html"),
        "the report replaced the file instead of writing it"
    );

    // A FIFO with a reader gets the XML and stays a FIFO.
    let fifo = p.file("fifo");
    mkfifo(&fifo);
    let reader = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let o = within(p.cmd(&["run", "spec.toml", "--junit", "fifo"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let mut got = String::new();
    std::io::Read::read_to_string(&mut &reader, &mut got).unwrap();
    assert!(got.contains("<testsuites"), "{got}");
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    drop(reader);

    // Without a reader, and where a directory is named: a warning, at once; the run's code stands.
    std::fs::create_dir(p.file("dir")).unwrap();
    for (path, want) in [("fifo", "a FIFO that no process is reading"), ("dir", "is a directory")] {
        let o = within(p.cmd(&["run", "spec.toml", "--junit", path]));
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        assert!(said(&o).contains("warning") && said(&o).contains(want), "{path}: {}", stderr(&o));
    }
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
}

use std::os::unix::fs::OpenOptionsExt;

#[test]
fn hardening_files_mflow_owns_are_refused_as_user_named_outputs() {
    let p = Project::new(&one(OK));
    assert_eq!(code(&p.run(&[])), 0);
    let spec = std::fs::read(p.file("spec.toml")).unwrap();
    let log = std::fs::read(p.file(".mflow/cache/.manifests.jsonl")).unwrap();
    std::fs::hard_link(p.file("spec.toml"), p.file("same-spec.toml")).unwrap();
    symlink(".mflow", p.file("via")).unwrap();
    let runs = || std::fs::read_dir(p.file(".mflow/runs")).unwrap().count();
    let before = runs();
    for (flag, path) in [
        ("--junit", "spec.toml"),
        ("--report", "./spec.toml"),
        ("--junit", "same-spec.toml"),
        ("--junit", ".mflow/cache/.manifests.jsonl"),
        ("--report", ".mflow/runs/new/report.html"),
        ("--junit", "via/cache/.manifests.jsonl"),
    ] {
        let o = within(p.cmd(&["run", "spec.toml", flag, path]));
        let err = said(&o);
        assert_eq!(code(&o), 2, "{flag} {path}: {err}");
        assert!(err.contains(path) && err.contains("mflow keeps for itself"), "{flag} {path}: {err}");
    }
    assert_eq!(runs(), before, "a run started");
    for (args, path) in [
        (vec!["report", "--out", ".mflow/cache/.manifests.jsonl"], ".mflow/cache/.manifests.jsonl"),
        (vec!["report", "--out", "r.html", "--png", ".mflow/png"], ".mflow/png"),
        (vec!["output", "spec.toml", "a", "--download", ".mflow/cache/copy"], ".mflow/cache/copy"),
    ] {
        let o = within(p.cmd(&args));
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(said(&o).contains(path) && said(&o).contains("mflow keeps for itself"), "{args:?}: {}", stderr(&o));
    }
    assert!(!p.file(".mflow/png").exists() && !p.file(".mflow/cache/copy").exists());
    // The step summary is the CI runner's file, held to the same rule.
    let o = within(p.cmd(&["run", "spec.toml"]).env("GITHUB_STEP_SUMMARY", p.file(".mflow/cache/.manifests.jsonl")));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(said(&o).contains("GITHUB_STEP_SUMMARY") && said(&o).contains("mflow keeps for itself"), "{}", stderr(&o));
    assert_eq!(std::fs::read(p.file("spec.toml")).unwrap(), spec);
    assert_eq!(std::fs::read(p.file(".mflow/cache/.manifests.jsonl")).unwrap(), log);
}

#[test]
fn hardening_the_step_summary_is_appended_in_place_and_a_fifo_there_does_not_hang() {
    let p = Project::new(&one(OK));
    mkfifo(&p.file("summary"));
    let o = within(p.cmd(&["run", "spec.toml"]).env("GITHUB_STEP_SUMMARY", p.file("summary")));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(said(&o).contains("a FIFO that no process is reading"), "{}", stderr(&o));
    let o = within(p.cmd(&["run", "spec.toml"]).env("GITHUB_STEP_SUMMARY", "/dev/null"));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(is_char_device(Path::new("/dev/null")));
}

// Class 4: files someone else wrote.

/// A stage that leaves a FIFO, a link to /dev/zero or a huge sparse file where mflow reads
/// what it wrote about itself: the run ends, and the stage's code is what it would be.
#[test]
fn hardening_files_a_stage_writes_about_itself_never_hang_the_run() {
    const GATE: &str = "gates = { loss = \"< 1\" }\n";
    const RETRY: &str = "retries = { max = 1, backoff = \"10ms\", on = [\"user\"] }\n";
    // (script, spec lines added, exit code)
    let cases = [
        ("mkfifo $MFLOW_STATUS; exit 1", "", 1),
        ("ln -s /dev/zero $MFLOW_STATUS; exit 1", "", 1),
        ("truncate -s 1T $MFLOW_STATUS; exit 1", "", 1),
        ("mkfifo $MFLOW_PROGRESS; sleep 1; echo ok > $MFLOW_OUTPUT/out", "", 0),
        ("ln -s /dev/zero $MFLOW_PROGRESS; sleep 1; echo ok > $MFLOW_OUTPUT/out", "", 0),
        ("truncate -s 1T $MFLOW_PROGRESS; sleep 1; echo ok > $MFLOW_OUTPUT/out", "", 0),
        ("mkfifo $MFLOW_METRICS; echo ok > $MFLOW_OUTPUT/out", "", 0),
        ("ln -s /dev/zero $MFLOW_METRICS; echo ok > $MFLOW_OUTPUT/out", "", 0),
        // In the output, a FIFO or a link is refused by the cache.
        ("mkdir -p $MFLOW_OUTPUT && mkfifo $MFLOW_OUTPUT/metrics.json", GATE, 1),
        ("mkdir -p $MFLOW_OUTPUT && ln -s /dev/zero $MFLOW_OUTPUT/verification.json", "", 1),
        // A metrics.json past the size read: the gate finds no value and fails.
        ("mkdir -p $MFLOW_OUTPUT && truncate -s 300M $MFLOW_OUTPUT/metrics.json", GATE, 4),
        // The checkpoint note a retry reads.
        ("mkdir -p $MFLOW_SCRATCH && rm -f $MFLOW_SCRATCH/progress.json && mkfifo $MFLOW_SCRATCH/progress.json; exit 1", RETRY, 1),
        ("mkdir -p $MFLOW_SCRATCH && ln -sf /dev/zero $MFLOW_SCRATCH/progress.json; exit 1", RETRY, 1),
    ];
    for (script, extra, want) in cases {
        let p = Project::new(&format!("{}{extra}", one(script)));
        let o = within(p.cmd(&["run", "spec.toml"]));
        assert_eq!(code(&o), want, "{script}: {}", stderr(&o));
        let record = p.latest_record();
        assert_ne!(record["status"], "running", "{script}");
        // The record keeps no FIFO or link where a stage's report was.
        for f in walk(&p.file(".mflow/runs")) {
            assert!(std::fs::symlink_metadata(&f).unwrap().is_file(), "{script}: {} in the record", f.display());
        }
        // A second look at the record reads the same files.
        let o = within(p.cmd(&["report", "--out", "r.html"]));
        assert_eq!(code(&o), 0, "{script}: {}", stderr(&o));
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

/// What is read while planning: a `path:` model's config.json, a progress note a failed
/// attempt left in its scratch directory, the checked specs under MFLOW_HOME.
#[test]
fn hardening_plan_time_reads_of_foreign_files_do_not_hang() {
    let spec = "[pipeline]\nname = \"x\"\n\n[stages.m]\nkind = \"model\"\nsource = \"path:m\"\n\n[stages.c]\nkind = \"convert\"\nmodel = \"${stages.m.output}\"\ntp = 2\n";
    let home = tempfile::tempdir().unwrap();
    for how in ["fifo", "zero", "sparse"] {
        let p = Project::new(spec);
        std::fs::create_dir(p.file("m")).unwrap();
        std::fs::write(p.file("m/model.safetensors"), "x").unwrap();
        // Sparse, but not so large that digesting the model directory takes long.
        let put = |f: &Path| match how {
            "fifo" => mkfifo(f),
            "zero" => symlink("/dev/zero", f).unwrap(),
            _ => sparse(f, 2 << 30),
        };
        put(&p.file("m/config.json"));
        let o = within(p.cmd(&["plan", "spec.toml"]).env("MFLOW_HOME", home.path()));
        if how == "zero" {
            // The model directory is an input: a link out of the project is named.
            assert_eq!(code(&o), 2, "{how}: {}", stderr(&o));
            assert!(said(&o).contains("input_link_escapes") && said(&o).contains("config.json"), "{}", stderr(&o));
        } else {
            assert_eq!(code(&o), 0, "{how}: {}", stderr(&o));
        }
        // A checked spec in MFLOW_HOME: the next load parses the file instead.
        let specs = home.path().join("specs");
        let stored: Vec<_> = std::fs::read_dir(&specs).unwrap().flatten().map(|e| e.path()).collect();
        assert!(!stored.is_empty(), "no checked spec in {}", specs.display());
        for f in stored {
            std::fs::remove_file(&f).unwrap();
            put(&f);
        }
        // `validate` checks what `plan` checks, the link included.
        let o = within(p.cmd(&["validate", "spec.toml"]).env("MFLOW_HOME", home.path()));
        assert_eq!(code(&o), if how == "zero" { 2 } else { 0 }, "{how}: {}", stderr(&o));
        for e in std::fs::read_dir(&specs).unwrap().flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
    // A scratch note of a failed attempt.
    let p = Project::new(&one("exit 1"));
    assert_eq!(code(&p.run(&[])), 1);
    let o = p.mflow(&["plan", "spec.toml", "--format", "json"]);
    let plan: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let key = plan[0]["key"].as_str().unwrap().to_string();
    for how in ["fifo", "zero", "sparse"] {
        let dir = p.file(&format!(".mflow/scratch/{key}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let note = dir.join("progress.json");
        match how {
            "fifo" => mkfifo(&note),
            "zero" => symlink("/dev/zero", &note).unwrap(),
            _ => sparse(&note, 1 << 40),
        }
        let o = within(p.cmd(&["plan", "spec.toml"]));
        assert_eq!(code(&o), 0, "{how}: {}", stderr(&o));
        let o = within(p.cmd(&["run", "spec.toml"]));
        assert_eq!(code(&o), 1, "{how}: {}", stderr(&o));
    }
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// `.git/HEAD` and the ref it names: a FIFO, a device, a path out of `.git`, a file that is
/// not a ref. The run ends, and mflow.lock holds a commit id or nothing.
#[test]
fn hardening_the_git_head_is_read_as_someone_elses_file() {
    for head in [
        "fifo",
        "sparse",
        "ref: ../../dev/zero",
        "ref: SOME/FILE",
        "ref: refs/heads/zero",
        "ref: refs/heads/sparse",
        "ref: refs/heads/main",
        "plain",
    ] {
        let p = Project::new(&one(OK));
        let git = p.file(".git");
        std::fs::create_dir_all(git.join("objects")).unwrap();
        std::fs::create_dir_all(git.join("refs/heads")).unwrap();
        std::fs::create_dir_all(p.file("SOME")).unwrap();
        std::fs::write(p.file("SOME/FILE"), "the first line of a secret\n").unwrap();
        symlink("/dev/zero", git.join("refs/heads/zero")).unwrap();
        sparse(&git.join("refs/heads/sparse"), 1 << 40);
        std::fs::write(git.join("refs/heads/main"), format!("{COMMIT}\n")).unwrap();
        match head {
            "fifo" => mkfifo(&git.join("HEAD")),
            "sparse" => sparse(&git.join("HEAD"), 1 << 40),
            "plain" => std::fs::write(git.join("HEAD"), "the first line of a secret\n").unwrap(),
            h => std::fs::write(git.join("HEAD"), h).unwrap(),
        }
        let o = within(p.cmd(&["run", "spec.toml"]));
        assert_eq!(code(&o), 0, "{head}: {}", stderr(&o));
        let runs = p.file(".mflow/runs");
        let id = std::fs::read_dir(&runs).unwrap().next().unwrap().unwrap().file_name();
        let lock = std::fs::read_to_string(runs.join(id).join("mflow.lock")).unwrap();
        assert!(!lock.contains("secret"), "{head}: {lock}");
        let v: serde_json::Value = serde_json::from_str(&lock).unwrap();
        let want = if head == "ref: refs/heads/main" { serde_json::json!(COMMIT) } else { serde_json::Value::Null };
        assert_eq!(v["git_commit"], want, "{head}");
    }
}

/// A record's metrics.jsonl (`mflow report`) and attempt log (`mflow logs`) replaced by a
/// FIFO, a link to /dev/zero or a huge sparse file.
#[test]
fn hardening_record_files_read_back_by_report_and_logs_do_not_hang() {
    let p = Project::new(&one(
        "echo line; echo {\\\"step\\\": 1, \\\"loss\\\": 2} >> $MFLOW_METRICS; echo ok > $MFLOW_OUTPUT/out",
    ));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let runs = p.file(".mflow/runs");
    let id = std::fs::read_dir(&runs).unwrap().next().unwrap().unwrap().file_name();
    let stage = runs.join(id).join("stages/a");
    for name in ["metrics.jsonl", "attempt-1.log"] {
        assert!(stage.join(name).is_file(), "{name}: {:?}", walk(&stage));
    }
    for how in ["fifo", "zero", "sparse"] {
        for name in ["metrics.jsonl", "attempt-1.log"] {
            let f = stage.join(name);
            std::fs::remove_file(&f).unwrap();
            match how {
                "fifo" => mkfifo(&f),
                "zero" => symlink("/dev/zero", &f).unwrap(),
                _ => sparse(&f, 1 << 40),
            }
        }
        let o = within(p.cmd(&["report", "--out", "r.html"]));
        assert_eq!(code(&o), 0, "{how}: {}", stderr(&o));
        let o = within(p.cmd(&["logs", "a"]));
        if how == "sparse" {
            // The end of a log too large to print whole, saying so.
            assert_eq!(code(&o), 0, "{}", stderr(&o));
            assert!(said(&o).contains("showing its last") && o.stdout.len() as u64 <= 64 << 20, "{}", stderr(&o));
        } else {
            assert_ne!(code(&o), 0);
            let want =
                if how == "fifo" { "a FIFO, not a regular file" } else { "a character device, not a regular file" };
            assert!(said(&o).contains("attempt-1.log") && said(&o).contains(want), "{how}: {}", stderr(&o));
        }
    }
}

// Class 5: walking inputs.

fn reading(inputs: &str) -> String {
    format!("[pipeline]\nname = \"x\"\n\n[stages.a]\nkind = \"command\"\ninputs = {inputs}\nrun = [\"sh\", \"-c\", \"echo ok > $MFLOW_OUTPUT/out\"]\n")
}

#[test]
fn hardening_a_directory_of_links_back_to_itself_ends_the_walk_with_an_error() {
    let p = Project::new(&reading(r#"["loop"]"#));
    std::fs::create_dir(p.file("loop")).unwrap();
    std::fs::write(p.file("loop/f"), "f").unwrap();
    symlink(".", p.file("loop/l1")).unwrap();
    symlink(".", p.file("loop/l2")).unwrap();
    for inputs in [r#"["loop"]"#, r#"["loop/**/f"]"#, r#"["loop/**"]"#, r#"["*"]"#] {
        p.write_spec(&reading(inputs));
        let o = within(p.cmd(&["plan", "spec.toml"]));
        let err = said(&o);
        assert_eq!(code(&o), 2, "{inputs}: {err}");
        assert!(err.contains("mflow::plan::input_cycle") && err.contains("loop"), "{inputs}: {err}");
    }
    // A link to a directory beside, not above: no cycle, the files are read.
    std::fs::remove_file(p.file("loop/l1")).unwrap();
    std::fs::remove_file(p.file("loop/l2")).unwrap();
    std::fs::create_dir(p.file("other")).unwrap();
    std::fs::write(p.file("other/g"), "g").unwrap();
    symlink("../other", p.file("loop/o")).unwrap();
    p.write_spec(&reading(r#"["loop", "loop/**/g"]"#));
    let o = within(p.cmd(&["plan", "spec.toml"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn hardening_an_input_deeper_than_the_walk_allows_is_refused() {
    let p = Project::new(&reading(r#"["deep"]"#));
    let mut d = p.file("deep");
    for _ in 0..=mflow::plan::inputs::MAX_WALK_DEPTH {
        d.push("d");
    }
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("f"), "f").unwrap();
    let o = within(p.cmd(&["plan", "spec.toml"]));
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        said(&o).contains("mflow::plan::input_too_large") && said(&o).contains("directories deep"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn hardening_a_glob_under_an_absolute_directory_may_not_follow_a_link_out_of_it() {
    let outside = tempfile::tempdir().unwrap();
    let dir = outside.path().join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("f"), "f").unwrap();
    std::fs::write(outside.path().join("secret"), "s").unwrap();
    let p = Project::new(&reading(&format!("[\"{}/*\"]", dir.display())));
    let o = within(p.cmd(&["plan", "spec.toml"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    symlink("../secret", dir.join("away")).unwrap();
    for inputs in [
        format!("[\"{}/*\"]", dir.display()),
        format!("[\"{}\"]", dir.display()),
        format!("[\"{}/**\"]", dir.display()),
    ] {
        p.write_spec(&reading(&inputs));
        let o = within(p.cmd(&["plan", "spec.toml"]));
        let err = said(&o);
        assert_eq!(code(&o), 2, "{inputs}: {err}");
        assert!(err.contains("mflow::plan::input_link_escapes") && err.contains("away"), "{inputs}: {err}");
    }
}

#[test]
fn hardening_an_empty_git_in_a_parent_does_not_widen_the_project() {
    let top = tempfile::tempdir().unwrap();
    std::fs::create_dir(top.path().join(".git")).unwrap();
    std::fs::write(top.path().join("outside.txt"), "o").unwrap();
    let proj = top.path().join("proj");
    std::fs::create_dir(&proj).unwrap();
    std::fs::write(proj.join("spec.toml"), reading(r#"["../outside.txt"]"#)).unwrap();
    let o = within({
        let mut c = Command::new(env!("CARGO_BIN_EXE_mflow"));
        c.args(["plan", "spec.toml"]).current_dir(&proj).env("CI", "true");
        c
    });
    let err = said(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("mflow::plan::input_escapes"), "{err}");
    // A repository there does make the parent the project.
    for d in ["objects", "refs"] {
        std::fs::create_dir(top.path().join(".git").join(d)).unwrap();
    }
    std::fs::write(top.path().join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
    let o = within({
        let mut c = Command::new(env!("CARGO_BIN_EXE_mflow"));
        c.args(["plan", "spec.toml"]).current_dir(&proj).env("CI", "true");
        c
    });
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// mflow's workdir is never an input: a glob or a directory over the project passes it by, so
/// the stage is cached on its second run; a path into it, however written, is refused.
#[test]
fn hardening_inputs_never_read_the_workdir() {
    let spec = "[pipeline]\nname = \"x\"\n\n[stages.c]\nkind = \"command\"\ninputs = [\"*\"]\nrun = [\"sh\", \"-c\", \"echo hi > $MFLOW_OUTPUT/x\"]\n";
    for inputs in ["*", "**", ".", "./"] {
        let p = Project::new(&spec.replace("\"*\"", &format!("\"{inputs}\"")));
        std::fs::write(p.file("a.txt"), "text").unwrap();
        let first = p.run(&[]);
        assert_eq!(code(&first), 0, "{inputs}: {}", stderr(&first));
        let second = p.run(&[]);
        assert_eq!(code(&second), 0, "{inputs}: {}", stderr(&second));
        assert!(stderr(&second).contains("1 cached"), "{inputs}: the workdir was hashed: {}", stderr(&second));
    }
    let p = Project::new(spec);
    assert_eq!(code(&p.run(&[])), 0);
    std::fs::create_dir_all(p.file("sub")).unwrap();
    symlink(".mflow", p.file("w")).unwrap();
    for inputs in [".mflow/state", "./.mflow/runs", ".mflow", "sub/../.mflow/cache", "w", "w/state"] {
        let o = p.mflow(&["plan", "spec.toml", "--set", &format!("stages.c.inputs=[\"{inputs}\"]")]);
        assert_eq!(code(&o), 2, "{inputs}: {}", stderr(&o));
        assert!(stderr(&o).contains("input_in_workdir"), "{inputs}: {}", stderr(&o));
    }
    // A glob passes the workdir by, through a link too: here it matches nothing else.
    let o = p.mflow(&["plan", "spec.toml", "--set", "stages.c.inputs=[\"w/runs/*\"]"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("matches no file"), "{}", stderr(&o));
}

/// Input keys are names as text: a name that is not UTF-8 is refused wherever the pattern would
/// take it (the glob crate passed it by in silence, a directory walk gave two such names one
/// key), and passed by where the pattern would not.
#[test]
fn hardening_an_input_name_that_is_not_utf8_is_refused_not_passed_by() {
    use std::os::unix::ffi::OsStrExt;
    let p = Project::new(&reading(r#"["d/*"]"#));
    std::fs::create_dir_all(p.file("d/sub")).unwrap();
    std::fs::write(p.file("d/ok.txt"), "ok").unwrap();
    std::fs::write(p.file("d/sub/deep.txt"), "deep").unwrap();
    let o = within(p.cmd(&["plan", "spec.toml"]));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let odd = p.file("d").join(std::ffi::OsStr::from_bytes(b"x\xffy.txt"));
    std::fs::write(&odd, "odd").unwrap();
    for inputs in [r#"["d/*"]"#, r#"["d/*.txt"]"#, r#"["d"]"#, r#"["d/**"]"#, r#"["*/x?y.txt"]"#] {
        p.write_spec(&reading(inputs));
        let o = within(p.cmd(&["plan", "spec.toml"]));
        let err = said(&o);
        assert_eq!(code(&o), 2, "{inputs}: {err}");
        assert!(err.contains("mflow::plan::input_name") && err.contains("not UTF-8"), "{inputs}: {err}");
    }
    // Where the pattern would not take it, it is no input; globs below a directory still match.
    for inputs in [r#"["d/*.md", "d/ok.txt"]"#, r#"["d/s*/*.txt"]"#, r#"["*/sub/deep.txt"]"#] {
        std::fs::write(p.file("d/a.md"), "a").unwrap();
        p.write_spec(&reading(inputs));
        let o = within(p.cmd(&["plan", "spec.toml"]));
        assert_eq!(code(&o), 0, "{inputs}: {}", stderr(&o));
    }
}

/// A FIFO named as an input is named as one, not as a path that matches nothing; met inside
/// a directory input it is passed by, as it holds no content to key.
#[test]
fn hardening_a_fifo_named_as_an_input_is_said_to_be_one() {
    let p = Project::new(&reading(r#"["pipe"]"#));
    mkfifo(&p.file("pipe"));
    let o = within(p.cmd(&["plan", "spec.toml"]));
    let err = said(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("mflow::plan::input_io") && err.contains("pipe") && err.contains("FIFO"), "{err}");
    std::fs::create_dir(p.file("d")).unwrap();
    std::fs::write(p.file("d/f"), "f").unwrap();
    std::fs::rename(p.file("pipe"), p.file("d/pipe")).unwrap();
    p.write_spec(&reading(r#"["d"]"#));
    assert_eq!(code(&within(p.cmd(&["plan", "spec.toml"]))), 0);
}

/// An input the plan refuses is quoted where the spec names it, as other spec errors are.
#[test]
fn hardening_a_refused_input_is_quoted_at_its_place_in_the_spec() {
    let p = Project::new(&reading(r#"["a.txt", "missing/*.txt"]"#));
    std::fs::write(p.file("a.txt"), "a").unwrap();
    let o = within(p.cmd(&["plan", "spec.toml"]));
    let err = said(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("spec.toml:6:") && err.contains("this input") && err.contains("input_missing"), "{err}");
    let o = within(p.cmd(&["validate", "spec.toml"]));
    assert!(said(&o).contains("spec.toml:6:"), "{}", said(&o));
}
