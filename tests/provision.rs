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

/// `MFLOW_HOME`'s environment as an mflow that did not compile bytecode left it: a venv whose
/// `bin/python` is the machine's python3, one module and one file that does not compile, and
/// `.complete` holding the lock's digest alone.
fn environment_of_an_earlier_mflow(home: &std::path::Path) -> std::path::PathBuf {
    let digest = blake3::hash(include_bytes!("../workloads/requirements.lock")).to_hex().to_string();
    let dir = home.join("python").join(&digest[..16]);
    let lib = dir.join("lib").join("pkg");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    // The interpreter itself, not a launcher on PATH that goes by its own name (pyenv's shims).
    let python3 = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
    let python3 = String::from_utf8(python3.stdout).unwrap().trim().to_string();
    std::os::unix::fs::symlink(python3, dir.join("bin").join("python")).unwrap();
    std::fs::write(lib.join("module.py"), "VALUE = 1\n").unwrap();
    std::fs::write(lib.join("not_python3.py"), "print 'py2'\n").unwrap();
    std::fs::write(dir.join(".complete"), &digest).unwrap();
    dir
}

#[test]
fn an_environment_of_an_earlier_mflow_gets_its_bytecode_once() {
    let home = tempfile::tempdir().unwrap();
    let dir = environment_of_an_earlier_mflow(home.path());
    let env = || {
        let o = Command::new(env!("CARGO_BIN_EXE_mflow"))
            .arg("env")
            .env_remove("MFLOW_PYTHON")
            .env("MFLOW_HOME", home.path())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), dir.join("bin").join("python").to_string_lossy());
    };
    let cache = dir.join("lib").join("pkg").join("__pycache__");
    let compiled = || std::fs::read_dir(&cache).map_or(0, |d| d.filter(|e| e.is_ok()).count());
    env();
    // The module is compiled though Python writes no bytecode itself here; the file that is not
    // Python 3 is skipped without failing the environment.
    assert_eq!(compiled(), 1, "{cache:?}");
    let marker = std::fs::read_to_string(dir.join(".complete")).unwrap();
    assert!(marker.ends_with("\nbytecode\n"), "{marker:?}");
    std::fs::remove_dir_all(&cache).unwrap();
    env();
    assert_eq!(compiled(), 0, "compiled once, not at every use");
}
