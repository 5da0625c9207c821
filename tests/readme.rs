//! The README's commands, in its order, as a newcomer types them: from a fresh clone, and from
//! an unpacked source archive (no .git). The main job runs with fewer iterations (and gates to match) here; every
//! other command is as the README gives it, from the repository's root.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{code, stderr, stdout};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn mflow(root: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mflow"));
    cmd.args(args).current_dir(root).env("CI", "true").env_remove("MFLOW_WORKDIR");
    cmd.output().unwrap()
}

fn ok(o: &Output, what: &str) -> String {
    assert_eq!(code(o), 0, "{what}: {}", stderr(o));
    stdout(o)
}

/// A copy of the repository as a user gets it: a clone, or the files of an archive.
fn copy(kind: &str, into: &Path) -> PathBuf {
    let root = into.join(kind);
    let status = match kind {
        "clone" => Command::new("git").args(["clone", "-q", "--shared"]).arg(repo()).arg(&root).status(),
        _ => {
            std::fs::create_dir_all(&root).unwrap();
            Command::new("sh")
                .arg("-c")
                .arg(format!("git -C '{}' archive HEAD | tar -x -C '{}'", repo().display(), root.display()))
                .status()
        }
    };
    assert!(status.unwrap().success(), "cannot make the {kind}");
    root
}

fn walk(kind: &str) {
    assert!(std::env::var_os("MFLOW_PYTHON").is_some(), "set MFLOW_PYTHON (`mflow env` provisions one)");
    let tmp = tempfile::tempdir().unwrap();
    let root = copy(kind, tmp.path());
    assert_eq!(root.join(".git").exists(), kind == "clone");

    // `mflow plan specs/gpt-tp2.toml`: the project is the checkout, and the inputs are in it.
    let planned = mflow(&root, &["plan", "specs/gpt-tp2.toml"]);
    let plan = ok(&planned, "plan");
    for stage in ["model", "convert", "data", "train", "evaluate", "export"] {
        assert!(plan.contains(stage), "{plan}");
    }
    let how = if kind == "clone" { "the git work tree" } else { "marked by .mflow-project" };
    let project = format!("project: {} ({how})", root.canonicalize().unwrap().display());
    assert!(stderr(&planned).contains(&project), "{}", stderr(&planned));

    // The main job (fewer iterations), then the commands that look at it, from the root.
    let short = [
        "--set",
        "vars.iterations=20",
        "--set",
        "stages.evaluate.gates.val_ppl=< 200",
        "--set",
        "stages.evaluate.gates.val_loss_delta_vs_baseline=< -1.0",
    ];
    let run = mflow(&root, &[&["run", "specs/gpt-tp2.toml"][..], &short].concat());
    let err = stderr(&run);
    assert_eq!(code(&run), 0, "{err}");
    assert!(err.contains("gate evaluate.val_loss_delta_vs_baseline"), "{err}");
    let runs = mflow(&root, &["runs"]);
    let listed = ok(&runs, "runs");
    assert!(listed.lines().any(|l| l.split_whitespace().skip(1).take(2).eq(["succeeded", "gpt-tp2"])), "{listed}");
    assert!(stderr(&runs).contains("reading the runs of"), "which workdir is read is said: {}", stderr(&runs));
    let status = ok(&mflow(&root, &["status"]), "status");
    assert!(status.contains("(gpt-tp2) succeeded") && status.contains("train"), "{status}");
    let logs = ok(&mflow(&root, &["logs", "train"]), "logs");
    assert!(logs.contains("iteration"), "{logs}");
    let out = ok(&mflow(&root, &[&["output", "specs/gpt-tp2.toml", "export"][..], &short].concat()), "output");
    assert!(Path::new(out.trim()).join("config.json").is_file(), "{out}");
    // A second run is a no-op.
    let again = mflow(&root, &[&["run", "specs/gpt-tp2.toml"][..], &short].concat());
    assert!(stderr(&again).contains("0 ran, 7 cached"), "{}", stderr(&again));
}

#[test]
fn the_readme_from_a_fresh_clone() {
    walk("clone");
}

#[test]
fn the_readme_from_an_unpacked_archive() {
    walk("archive");
}
