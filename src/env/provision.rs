//! The Python environment of the workloads, made once per lock: a venv under
//! `MFLOW_HOME/python/<lock digest>` holding exactly the hash-pinned `workloads/requirements.lock`
//! (`--require-hashes`). uv makes it where there is one (on PATH, else installed once from PyPI
//! into `MFLOW_HOME/tools/`, itself from the hash-pinned `workloads/requirements-uv.txt`), pip
//! otherwise; `MFLOW_INSTALLER` chooses. Nothing here prints a command line or an environment:
//! an index URL may carry a password.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use super::{home, lock_digest, EnvError, REQUIREMENTS_LOCK};
use crate::settings::Installer as Choice;

/// The uv that provisions where none is on PATH, pinned with the hashes of its wheels.
pub const UV_LOCK: &str = include_str!("../../workloads/requirements-uv.txt");

/// What installs the lock into the venv.
enum Installer {
    Uv(PathBuf),
    Pip,
}

/// Creates `home()/python/<lock digest>` with the pinned requirements, once; its interpreter.
pub fn provision() -> Result<PathBuf, EnvError> {
    let dir = home().join("python").join(&lock_digest()[..16]);
    let python = dir.join("bin").join("python");
    let done = dir.join(".complete");
    if let Ok(marker) = std::fs::read_to_string(&done) {
        // Made by an mflow that did not compile its bytecode: compiled once now, where the
        // environment can be written (two processes doing it at once only repeat the work).
        if marker != complete_marker() && write_marker(&done).is_ok() {
            compile_bytecode(&python, &dir);
        }
        return Ok(python);
    }
    let parent = dir.parent().expect("a directory under home");
    std::fs::create_dir_all(parent).map_err(|source| EnvError::Io { path: parent.to_path_buf(), source })?;
    // One provisioner at a time; others wait and reuse its result.
    let lock_path = dir.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).map_err(|source| EnvError::Io { path: lock_path.clone(), source })?;
    lock.lock().map_err(|source| EnvError::Io { path: lock_path.clone(), source })?;
    if done.exists() {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let started = Instant::now();
    let base = base_python();
    let installer = installer(&base)?;
    let name = match &installer {
        Installer::Uv(_) => "uv",
        Installer::Pip => "pip",
    };
    crate::errln!(
        "mflow: provisioning the Python environment in {} with {name} (first use only; this downloads torch)",
        dir.display()
    );
    let req = dir.join("requirements.lock");
    let write_req =
        || std::fs::write(&req, REQUIREMENTS_LOCK).map_err(|source| EnvError::Io { path: req.clone(), source });
    match &installer {
        Installer::Uv(uv) => {
            step("uv venv", Command::new(uv).args(["venv", "--quiet", "--python"]).arg(&base).arg(&dir))?;
            write_req()?;
            step(
                "uv pip install",
                Command::new(uv)
                    .args(["pip", "install", "--require-hashes", "--python"])
                    .arg(&python)
                    .arg("-r")
                    .arg(&req),
            )?;
        }
        Installer::Pip => {
            step("python -m venv", Command::new(&base).args(["-m", "venv"]).arg(&dir))?;
            write_req()?;
            step(
                "pip install",
                Command::new(&python)
                    .args(["-m", "pip", "install", "--require-hashes", "--no-compile"])
                    .args(PIP_QUIET)
                    .arg("-r")
                    .arg(&req),
            )?;
        }
    }
    compile_bytecode(&python, &dir);
    write_marker(&done)?;
    crate::errln!("mflow: the Python environment is ready ({name}, {:.0}s)", started.elapsed().as_secs_f64());
    Ok(python)
}

/// What `.complete` holds once an environment is ready: the lock it holds, and that its bytecode
/// is compiled (an environment with the lock alone was made before mflow compiled it).
fn complete_marker() -> String {
    format!("{}\nbytecode\n", lock_digest())
}

fn write_marker(done: &Path) -> Result<(), EnvError> {
    std::fs::write(done, complete_marker()).map_err(|source| EnvError::Io { path: done.to_path_buf(), source })
}

/// Compiles the environment's modules to bytecode once, so that no stage's process compiles
/// torch's and transformers' modules as it imports them: where Python does not write bytecode
/// back (`PYTHONDONTWRITEBYTECODE`, an environment it cannot write) that doubled each import,
/// 1.7 against 3.8 s for `import torch` (docs/benchmarks.md). Best effort: a file that does not
/// compile (some packages ship test data that is not Python 3) keeps its source only, and a
/// failure here costs speed, not correctness.
fn compile_bytecode(python: &Path, dir: &Path) {
    let status = Command::new(python)
        .args(["-m", "compileall", "-qq", "-j", "0"])
        .arg(dir.join("lib"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !status.as_ref().is_ok_and(|s| s.success()) {
        tracing::debug!(?status, "compileall of {} did not compile every file", dir.display());
    }
}

/// pip without its prompts, its self-update check and its progress bars (a log is not a terminal).
const PIP_QUIET: [&str; 5] = ["--disable-pip-version-check", "--no-input", "--progress-bar", "off", "--no-color"];

/// The interpreter that creates the venv: `MFLOW_BASE_PYTHON`, else `python3`, found on PATH
/// (uv is given a path, so that it never looks for, or downloads, an interpreter of its own).
fn base_python() -> PathBuf {
    let base = std::env::var(mflow_contract::vars::BASE_PYTHON).ok().filter(|s| !s.is_empty());
    let base = base.unwrap_or_else(|| "python3".into());
    if base.contains('/') {
        PathBuf::from(base)
    } else {
        on_path(&base).unwrap_or_else(|| PathBuf::from(base))
    }
}

/// uv unless `MFLOW_INSTALLER=pip`; pip where uv cannot be had, unless `MFLOW_INSTALLER=uv`.
fn installer(base: &Path) -> Result<Installer, EnvError> {
    let choice = crate::settings::installer()?;
    if choice == Choice::Pip {
        return Ok(Installer::Pip);
    }
    if let Some(uv) = on_path("uv") {
        return Ok(Installer::Uv(uv));
    }
    match bootstrap_uv(base) {
        Ok(uv) => Ok(Installer::Uv(uv)),
        Err(message) if choice == Choice::Auto => {
            crate::errln!("mflow: uv cannot be installed ({message}); pip provisions instead");
            Ok(Installer::Pip)
        }
        Err(message) => Err(EnvError::NoUv { message }),
    }
}

/// uv from PyPI, once per pinned version, into `home()/tools/uv-<digest>/bin/uv`: installed by
/// the base interpreter's pip with `--target` (or, where it has no pip, by the pip of a venv made
/// for the purpose), every file checked against the lock's hashes. The directory appears whole
/// (a rename) or not at all.
fn bootstrap_uv(base: &Path) -> Result<PathBuf, String> {
    let digest = blake3::hash(UV_LOCK.as_bytes()).to_hex();
    let dir = home().join("tools").join(format!("uv-{}", &digest[..16]));
    let uv = dir.join("bin").join("uv");
    if uv.is_file() {
        return Ok(uv);
    }
    let staging = dir.with_extension(format!("tmp{}", fastrand::u32(..)));
    let installed = install_uv(base, &staging);
    if installed.is_ok() && std::fs::rename(&staging, &dir).is_err() && !uv.is_file() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(format!("cannot move it into {}", dir.display()));
    }
    let _ = std::fs::remove_dir_all(&staging);
    installed.map(|()| uv)
}

fn install_uv(base: &Path, into: &Path) -> Result<(), String> {
    std::fs::create_dir_all(into).map_err(|e| format!("cannot create {}: {e}", into.display()))?;
    let req = into.join("requirements-uv.txt");
    std::fs::write(&req, UV_LOCK).map_err(|e| format!("cannot write {}: {e}", req.display()))?;
    let has_pip = Command::new(base)
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let pip_python = if has_pip {
        base.to_path_buf()
    } else {
        let venv = into.join("venv");
        step("python -m venv", Command::new(base).args(["-m", "venv"]).arg(&venv)).map_err(|e| e.to_string())?;
        venv.join("bin").join("python")
    };
    let mut pip = Command::new(pip_python);
    pip.args(["-m", "pip", "install", "--require-hashes", "--no-deps", "--only-binary=:all:", "--target"])
        .arg(into)
        .args(PIP_QUIET)
        .arg("-r")
        .arg(&req)
        // --target installs beside the interpreter's own packages, never into them: pip's warning
        // about the root user does not apply.
        .env("PIP_ROOT_USER_ACTION", "ignore");
    step("pip install uv", &mut pip).map_err(|e| e.to_string())
}

/// An executable `name` in a directory of PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Runs one step of provisioning. Its standard output goes to standard error: standard output
/// carries the interpreter's path for `mflow env`.
fn step(what: &str, cmd: &mut Command) -> Result<(), EnvError> {
    let failed = |message: String| EnvError::Step { step: what.to_string(), message };
    let program = cmd.get_program().to_string_lossy().into_owned();
    let status = cmd
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| failed(format!("cannot start {program}: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(failed(format!("{program} ended with {status}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uv_lock_pins_one_version_by_its_hashes() {
        let pins: Vec<&str> = UV_LOCK.lines().filter(|l| l.starts_with("uv==")).collect();
        assert_eq!(pins.len(), 1, "{UV_LOCK}");
        assert!(UV_LOCK.matches("--hash=sha256:").count() >= 4, "the wheels of Linux and macOS, x86_64 and arm64");
    }

    #[test]
    fn every_requirement_of_the_lock_is_pinned_with_hashes() {
        // `--require-hashes` refuses a lock otherwise; the test says which requirement.
        let mut current: Option<&str> = None;
        let mut hashes = 0;
        let check = |name: Option<&str>, hashes: usize| {
            if let Some(n) = name {
                assert!(n.contains("=="), "{n} is not pinned");
                assert!(hashes > 0, "{n} has no hash");
            }
        };
        for line in REQUIREMENTS_LOCK.lines() {
            let t = line.trim();
            if t.starts_with("--hash=sha256:") {
                hashes += 1;
            } else if !t.is_empty() && !t.starts_with('#') {
                check(current, hashes);
                current = Some(t);
                hashes = 0;
            }
        }
        check(current, hashes);
        assert!(REQUIREMENTS_LOCK.lines().any(|l| l.starts_with("torch==")));
        assert!(!REQUIREMENTS_LOCK.lines().any(|l| l.starts_with("pytest==")), "test tools stay out of the stages");
    }
}
