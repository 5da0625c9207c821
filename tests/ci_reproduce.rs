//! `mflow reproduce`: rerun from the lockfile; refuse (exit 5) when a pinned digest moved.

mod common;

use common::{code, stderr, Project};

const SPEC: &str = r#"
[pipeline]
name = "repro"

[vars]
greeting = "hello"

[stages.read]
kind = "command"
inputs = ["data.txt"]
run = ["sh", "-c", "cat data.txt > $MFLOW_OUTPUT/copy; echo ${vars.greeting} >> $MFLOW_OUTPUT/copy"]

[stages.count]
kind = "command"
needs = ["read"]
run = ["sh", "-c", "wc -l < $MFLOW_INPUT_READ/copy > $MFLOW_OUTPUT/n"]
"#;

fn project() -> Project {
    let p = Project::new(SPEC);
    std::fs::write(p.file("data.txt"), "one\ntwo\n").unwrap();
    let o = p.run(&["--set", "vars.greeting=hi"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    p
}

fn first_run(p: &Project) -> String {
    let mut ids: Vec<String> = std::fs::read_dir(p.file(".mflow/runs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    ids.sort();
    ids[0].clone()
}

#[test]
fn reproduces_with_the_recorded_overrides_and_matching_keys() {
    let p = project();
    let id = first_run(&p);
    // The spec file changing afterwards does not matter: the run's own copy is used.
    std::fs::write(p.file("spec.toml"), SPEC.replace("hello", "changed")).unwrap();
    let o = p.mflow(&["reproduce", &id]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("reproduced: every stage's key equals the lockfile's"), "{err}");
    assert!(err.contains("read") && err.contains("count"));
    let r = p.latest_record();
    assert_eq!(r["stages"]["read"]["status"], "cached");
}

/// A run of some stages reproduces those stages: a stage the run did not pin is not run, and
/// its input changing since is no reason to refuse.
#[test]
fn a_run_of_some_stages_reproduces_those_stages() {
    let spec =
        format!("{SPEC}\n[stages.other]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo o > $MFLOW_OUTPUT/o\"]\n");
    let p = Project::new(&spec);
    std::fs::write(p.file("data.txt"), "one\n").unwrap();
    let o = p.mflow(&["run", "spec.toml", "other"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let id = first_run(&p);
    std::fs::write(p.file("data.txt"), "changed\n").unwrap();
    let o = p.mflow(&["reproduce", &id]);
    let err = stderr(&o);
    assert_eq!(code(&o), 0, "{err}");
    assert!(err.contains("running 1 stage(s)") && err.contains("reproduced"), "{err}");
    let r = p.latest_record();
    assert!(r["stages"].get("read").is_none() && r["stages"].get("count").is_none(), "{r}");
}

#[test]
fn a_changed_input_file_is_refused_by_name() {
    let p = project();
    let id = first_run(&p);
    std::fs::write(p.file("data.txt"), "one\ntwo\nthree\n").unwrap();
    let o = p.mflow(&["reproduce", &id]);
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    assert!(stderr(&o).contains("stage `read`: input file `data.txt` changed"), "{}", stderr(&o));
    assert_eq!(std::fs::read_dir(p.file(".mflow/runs")).unwrap().count(), 1, "a refused reproduction must not run");
}

#[test]
fn a_tampered_spec_copy_is_refused() {
    let p = project();
    let id = first_run(&p);
    let copy = p.file(&format!(".mflow/runs/{id}/spec.toml"));
    std::fs::write(&copy, SPEC.replace("wc -l", "wc -c")).unwrap();
    let o = p.mflow(&["reproduce", &id]);
    assert_eq!(code(&o), 5);
    assert!(stderr(&o).contains("spec: the run's copy"), "{}", stderr(&o));
}

/// Edits `run`'s lockfile with `edit` (on its JSON).
fn edit_lock(p: &Project, run: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = p.file(&format!(".mflow/runs/{run}/mflow.lock"));
    let mut lock: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut lock);
    // A fresh file: the lockfile may be a hard link shared with later runs.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, serde_json::to_string_pretty(&lock).unwrap()).unwrap();
}

fn refused(p: &Project, run: &str) -> String {
    let o = p.mflow(&["reproduce", run]);
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    assert_eq!(std::fs::read_dir(p.file(".mflow/runs")).unwrap().count(), 1, "a refused reproduction must not run");
    stderr(&o)
}

#[test]
fn a_lockfile_of_an_unknown_version_is_refused() {
    let p = project();
    let id = first_run(&p);
    edit_lock(&p, &id, |l| l["version"] = 99.into());
    let err = refused(&p, &id);
    assert!(err.contains("lockfile: version 99 is not a format this mflow reads"), "{err}");
}

/// The key is computed again from the recorded parts, as the engine computes it.
#[test]
fn parts_edited_without_their_key_are_refused_naming_the_stage() {
    let p = project();
    let id = first_run(&p);
    edit_lock(&p, &id, |l| l["stages"]["count"]["parts"]["salt"] = "edited".into());
    let err = refused(&p, &id);
    assert!(err.contains("stage `count`: the lockfile's key") && err.contains("does not match its own parts"), "{err}");
    assert!(!err.contains(": \n") && !err.trim_end().ends_with(':'), "an empty difference: {err}");
}

/// A stage the run recorded with a key must be in its lockfile: left out, it would not be
/// reproduced, and the rest would say "reproduced".
#[test]
fn a_stage_deleted_from_the_lockfile_is_refused() {
    let p = project();
    let id = first_run(&p);
    edit_lock(&p, &id, |l| {
        l["stages"].as_object_mut().unwrap().remove("count");
    });
    let err = refused(&p, &id);
    assert!(err.contains("stage `count`: the run recorded key") && err.contains("no entry"), "{err}");
    assert!(!err.contains("reproduced"), "{err}");
}
