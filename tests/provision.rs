//! How `mflow env` provisions, where it cannot: each installer's failure is named, and a bad
//! MFLOW_INSTALLER is refused before anything runs. (The successful paths, uv and pip, are what
//! CI's first `mflow env` and benches/provision do.)

use std::process::{Command, Output};

fn env(installer: &str, home: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mflow"))
        .arg("env")
        .env_remove("MFLOW_PYTHON")
        .env("MFLOW_HOME", home)
        .env("MFLOW_INSTALLER", installer)
        // No uv on PATH, and an interpreter that is not there: every step fails at once.
        .env("PATH", "/nonexistent")
        .env("MFLOW_BASE_PYTHON", home.join("no-python"))
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_bad_installer_is_refused_before_anything_runs() {
    let home = tempfile::tempdir().unwrap();
    let o = env("conda", home.path());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("MFLOW_INSTALLER") && stderr(&o).contains("auto, uv or pip"), "{}", stderr(&o));
    assert!(!home.path().join("python").exists(), "nothing provisioned");
}

#[test]
fn pip_names_the_step_that_failed() {
    let home = tempfile::tempdir().unwrap();
    let o = env("pip", home.path());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("mflow::env::step") && e.contains("python -m venv failed"), "{e}");
    assert!(o.stdout.is_empty(), "standard output is the interpreter's path alone");
}

#[test]
fn uv_that_cannot_be_had_is_an_error_when_asked_for() {
    let home = tempfile::tempdir().unwrap();
    let o = env("uv", home.path());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("mflow::env::no_uv"), "{e}");
    assert!(
        !home.path().join("tools").read_dir().is_ok_and(|mut d| d.next().is_some()),
        "no half-installed uv is left"
    );
}

#[test]
fn auto_falls_back_to_pip_when_uv_cannot_be_had() {
    let home = tempfile::tempdir().unwrap();
    let o = env("auto", home.path());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("pip provisions instead") && e.contains("python -m venv failed"), "{e}");
}
