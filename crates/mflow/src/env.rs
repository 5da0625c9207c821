//! The machine a run executes on: CPUs, GPUs, and the Python environment of the workloads,
//! provisioned on first use from a pinned lock.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use include_dir::{include_dir, Dir};
use miette::Diagnostic;
use thiserror::Error;

/// The Python workloads, embedded so that an installed binary carries them.
pub static WORKLOADS: Dir<'static> = include_dir!("$CARGO_MANIFEST_DIR/../../workloads/mflow_workloads");

/// The pinned requirements of the workloads.
pub const REQUIREMENTS_LOCK: &str = include_str!("../../../workloads/requirements.lock");

#[derive(Debug, Error, Diagnostic)]
pub enum EnvError {
    #[error("cannot provision the Python environment: {message}")]
    #[diagnostic(code(mflow::env::provision), help("mflow needs `python3` (3.10+) with venv and network access to PyPI on first use; or point MFLOW_PYTHON (or `[env] python`) at an interpreter that has torch"))]
    Provision { message: String },
    #[error("I/O on {}", path.display())]
    #[diagnostic(code(mflow::env::io))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub struct Environment {
    pub cpus: usize,
    pub gpus: Vec<String>,
    configured_python: Option<String>,
    python: OnceLock<PathBuf>,
}

impl Environment {
    /// `spec_python`: the spec's `[env] python`; MFLOW_PYTHON wins over it.
    pub fn detect(spec_python: Option<&str>) -> Environment {
        let configured_python = std::env::var("MFLOW_PYTHON").ok().filter(|s| !s.is_empty()).or(spec_python.map(str::to_string));
        Environment {
            cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            gpus: detect_gpus(),
            configured_python,
            python: OnceLock::new(),
        }
    }

    /// Identity of the Python environment for cache keys (cheap: no interpreter is started).
    pub fn python_digest(&self) -> String {
        match &self.configured_python {
            Some(p) => format!("python:{p}"),
            None => format!("lock:{}", lock_digest()),
        }
    }

    /// The interpreter for workloads, provisioning the venv if needed.
    pub fn python(&self) -> Result<PathBuf, EnvError> {
        if let Some(p) = self.python.get() {
            return Ok(p.clone());
        }
        let p = match &self.configured_python {
            Some(p) => PathBuf::from(p),
            None => provision()?,
        };
        let _ = self.python.set(p.clone());
        Ok(p)
    }

    /// The workloads written out once per content digest; the directory goes on PYTHONPATH.
    pub fn workloads_dir(&self) -> Result<PathBuf, EnvError> {
        let dir = home().join("workloads").join(&workloads_digest()[..16]);
        if dir.join("mflow_workloads").exists() {
            return Ok(dir);
        }
        let staging = dir.with_extension(format!("tmp{}", fastrand::u32(..)));
        let pkg = staging.join("mflow_workloads");
        write_dir(&WORKLOADS, &pkg).map_err(|source| EnvError::Io { path: pkg.clone(), source })?;
        std::fs::create_dir_all(dir.parent().unwrap()).map_err(|source| EnvError::Io { path: dir.clone(), source })?;
        if std::fs::rename(&staging, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        Ok(dir)
    }
}

fn write_dir(d: &Dir<'_>, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for f in d.files() {
        let name = f.path().file_name().unwrap();
        if name.to_string_lossy().ends_with(".pyc") {
            continue;
        }
        std::fs::write(to.join(name), f.contents())?;
    }
    for sub in d.dirs() {
        let name = sub.path().file_name().unwrap();
        if name == "__pycache__" || name == "tests" {
            continue;
        }
        write_dir(sub, &to.join(name))?;
    }
    Ok(())
}

/// Digest of every embedded workload file.
pub fn workloads_digest() -> String {
    static D: OnceLock<String> = OnceLock::new();
    D.get_or_init(|| {
        let mut files = Vec::new();
        fn walk<'a>(d: &'a Dir<'a>, out: &mut Vec<(String, &'a [u8])>) {
            for f in d.files() {
                out.push((f.path().to_string_lossy().to_string(), f.contents()));
            }
            for s in d.dirs() {
                if !s.path().ends_with("__pycache__") {
                    walk(s, out);
                }
            }
        }
        walk(&WORKLOADS, &mut files);
        files.sort();
        let mut h = blake3::Hasher::new();
        for (p, c) in files {
            if p.ends_with(".pyc") {
                continue;
            }
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p.as_bytes());
            h.update(&(c.len() as u64).to_le_bytes());
            h.update(c);
        }
        h.finalize().to_hex().to_string()
    })
    .clone()
}

pub fn lock_digest() -> String {
    blake3::hash(REQUIREMENTS_LOCK.as_bytes()).to_hex().to_string()
}

/// `MFLOW_HOME`, else `$XDG_CACHE_HOME/mflow`, else `~/.cache/mflow`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("MFLOW_HOME") {
        return PathBuf::from(h);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    cache.unwrap_or_else(std::env::temp_dir).join("mflow")
}

/// Creates `home()/python/<lock digest>` with the pinned requirements, once.
fn provision() -> Result<PathBuf, EnvError> {
    let dir = home().join("python").join(&lock_digest()[..16]);
    let python = dir.join("bin").join("python");
    if dir.join(".complete").exists() {
        return Ok(python);
    }
    let err = |message: String| EnvError::Provision { message };
    std::fs::create_dir_all(dir.parent().unwrap()).map_err(|e| err(e.to_string()))?;
    // One provisioner at a time; others wait and reuse its result.
    let lock_path = dir.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| err(e.to_string()))?;
    lock.lock().map_err(|e| err(e.to_string()))?;
    if dir.join(".complete").exists() {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let base = std::env::var("MFLOW_BASE_PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!("mflow: provisioning the Python environment in {} (first use only; this downloads torch)", dir.display());
    run(Command::new(&base).args(["-m", "venv"]).arg(&dir)).map_err(err)?;
    let req = dir.join("requirements.lock");
    std::fs::write(&req, REQUIREMENTS_LOCK).map_err(|e| err(e.to_string()))?;
    run(Command::new(&python).args(["-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-r"]).arg(&req)).map_err(err)?;
    std::fs::write(dir.join(".complete"), lock_digest()).map_err(|e| err(e.to_string()))?;
    Ok(python)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    // stdout carries the interpreter path for `mflow env`; tool chatter goes to stderr.
    let status = cmd.stdout(std::process::Stdio::from(std::io::stderr())).status().map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    if status.success() { Ok(()) } else { Err(format!("{:?} failed with {status}", cmd.get_program())) }
}

/// GPUs visible to this process: CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's list.
/// The running mflow binary (its path, size and mtime), for what must not outlive a rebuild.
/// Found once per process.
pub fn binary_identity() -> Option<&'static [u8]> {
    static IDENTITY: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    let find = || {
        let exe = std::env::current_exe().ok()?;
        let meta = std::fs::metadata(&exe).ok()?;
        let mtime = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
        let mut out = exe.into_os_string().into_encoded_bytes();
        out.push(0);
        out.extend_from_slice(&meta.len().to_le_bytes());
        out.extend_from_slice(&mtime.as_nanos().to_le_bytes());
        Some(out)
    };
    IDENTITY.get_or_init(find).as_deref()
}

pub fn detect_gpus() -> Vec<String> {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v.split(',').map(str::trim).filter(|s| !s.is_empty() && *s != "-1").map(str::to_string).collect();
    }
    let n = std::fs::read_dir("/proc/driver/nvidia/gpus").map(|rd| rd.count()).unwrap_or(0);
    (0..n).map(|i| i.to_string()).collect()
}
