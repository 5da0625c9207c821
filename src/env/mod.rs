//! The machine a run executes on: CPUs, GPUs, and the Python environment of the workloads,
//! provisioned on first use from a pinned lock (`provision.rs`).

mod provision;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use include_dir::{include_dir, Dir};
use miette::Diagnostic;
use thiserror::Error;

/// The Python workloads, embedded so that an installed binary carries them.
pub static WORKLOADS: Dir<'static> = include_dir!("$CARGO_MANIFEST_DIR/workloads/mflow_workloads");

/// The pinned requirements of the workloads.
pub const REQUIREMENTS_LOCK: &str = include_str!("../../workloads/requirements.lock");

#[derive(Debug, Error, Diagnostic)]
pub enum EnvError {
    #[error("cannot provision the Python environment: {message}")]
    #[diagnostic(code(mflow::env::provision), help("mflow needs `python3` (3.11+) with venv and network access to PyPI on first use; or point MFLOW_PYTHON (or `[env] python`) at an interpreter that has torch"))]
    Provision { message: String },
    #[error("cannot provision the Python environment: {step} failed: {message}")]
    #[diagnostic(code(mflow::env::step), help("the tool's own output above says why (the package index unreachable, a hash that does not match, no python3-venv, a full disk); MFLOW_INSTALLER=pip or MFLOW_INSTALLER=uv chooses the installer, MFLOW_PYTHON an interpreter that has torch"))]
    Step { step: String, message: String },
    #[error("MFLOW_INSTALLER=uv, but uv is not on PATH and cannot be installed from PyPI: {message}")]
    #[diagnostic(code(mflow::env::no_uv), help("put uv on PATH (`pip install uv`, or its standalone installer), or leave MFLOW_INSTALLER unset to let pip provision when uv cannot be had"))]
    NoUv { message: String },
    #[error(transparent)]
    #[diagnostic(transparent)]
    Setting(#[from] crate::settings::SettingError),
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
    /// This machine with `gpus` in place of the GPUs it has: for tests and for planning as if
    /// on another machine.
    pub fn with_gpus(self, gpus: Vec<String>) -> Environment {
        Environment { gpus, ..self }
    }

    /// `spec_python`: the spec's `[env] python`; MFLOW_PYTHON wins over it.
    pub fn detect(spec_python: Option<&str>) -> Environment {
        let configured_python =
            std::env::var("MFLOW_PYTHON").ok().filter(|s| !s.is_empty()).or(spec_python.map(str::to_string));
        Environment {
            cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            gpus: detect_gpus(),
            configured_python,
            python: OnceLock::new(),
        }
    }

    /// Stages that run in images (Kubernetes) use the image's `python`: nothing is provisioned
    /// here, and the key still names the configured interpreter or the lock, as a local run's.
    pub fn stages_in_images(self) -> Environment {
        let python = OnceLock::new();
        let _ = python.set(PathBuf::from(self.configured_python.as_deref().unwrap_or("python")));
        Environment { python, ..self }
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
            None => provision::provision()?,
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
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    cache.unwrap_or_else(std::env::temp_dir).join("mflow")
}

/// The mflow binary that native stages run as children. A binary replaced while a run goes on
/// (an upgrade, a rebuild) has a path that names another file or none (`... (deleted)`); the
/// running one is still reachable as `/proc/self/exe`, so the children stay of the run's version.
pub fn mflow_exe() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let proc_exe = Path::new("/proc/self/exe");
    let replaced = !exe.exists()
        || std::fs::metadata(&exe).ok().map(|m| (m.dev(), m.ino()))
            != std::fs::metadata(proc_exe).ok().map(|m| (m.dev(), m.ino()));
    Ok(if replaced && proc_exe.exists() { proc_exe.to_path_buf() } else { exe })
}

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

/// Where the NVIDIA driver lists its GPUs, one directory each.
const DRIVER_GPUS: &str = "/proc/driver/nvidia/gpus";

/// GPUs visible to this process: CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's list.
/// `MFLOW_NVIDIA_GPUS_DIR` stands in for the driver's list (a directory with one entry per
/// GPU), so that tests can plan for a GPU machine on one without GPUs; nothing else reads it.
pub fn detect_gpus() -> Vec<String> {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v.split(',').map(str::trim).filter(|s| !s.is_empty() && *s != "-1").map(str::to_string).collect();
    }
    let dir =
        std::env::var_os("MFLOW_NVIDIA_GPUS_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(DRIVER_GPUS));
    let n = std::fs::read_dir(dir).map(|rd| rd.count()).unwrap_or(0);
    (0..n).map(|i| i.to_string()).collect()
}

/// What is known of one GPU for `mflow doctor`.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInfo {
    pub name: String,
    pub memory_gib: Option<f64>,
}

/// `gpus: 1 visible (index 0: NVIDIA H200, 140 GiB)`: `ids` as `detect_gpus` finds them
/// (indices, or UUIDs from CUDA_VISIBLE_DEVICES), `info` what is known of each, in that order.
/// A GPU without information is named by its index alone.
pub fn describe_gpus(ids: &[String], info: &[Option<GpuInfo>]) -> String {
    if ids.is_empty() {
        return "gpus: none visible".into();
    }
    if info.iter().all(Option::is_none) && ids.iter().all(|id| id.bytes().all(|b| b.is_ascii_digit())) {
        return format!("gpus: {} visible (index {})", ids.len(), ids.join(", "));
    }
    let each: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            // CUDA_VISIBLE_DEVICES may name a GPU by UUID (GPU-...) instead of its index.
            let id = if id.bytes().all(|b| b.is_ascii_digit()) { format!("index {id}") } else { id.clone() };
            match info.get(i).and_then(Option::as_ref) {
                Some(GpuInfo { name, memory_gib: Some(m) }) => format!("{id}: {name}, {m:.0} GiB"),
                Some(GpuInfo { name, memory_gib: None }) => format!("{id}: {name}"),
                None => id,
            }
        })
        .collect();
    format!("gpus: {} visible ({})", ids.len(), each.join("; "))
}

/// Names and memory of the GPUs `ids` from `nvidia-smi`, for when torch cannot say (a CPU
/// build of torch, or none); `None` where nvidia-smi is absent or does not list the GPU.
pub fn nvidia_smi_gpus(ids: &[String]) -> Vec<Option<GpuInfo>> {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"])
        .stderr(std::process::Stdio::null())
        .output();
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        _ => String::new(),
    };
    parse_nvidia_smi(&text, ids)
}

fn parse_nvidia_smi(text: &str, ids: &[String]) -> Vec<Option<GpuInfo>> {
    let rows: Vec<Vec<&str>> =
        text.lines().map(|l| l.split(',').map(str::trim).collect::<Vec<_>>()).filter(|r| r.len() == 4).collect();
    ids.iter()
        .map(|id| {
            // nvidia-smi ignores CUDA_VISIBLE_DEVICES: its rows are matched by index or UUID.
            let row = rows
                .iter()
                .find(|r| r[0] == id || r[1] == id || (id.starts_with("GPU-") && r[1].starts_with(id.as_str())))?;
            Some(GpuInfo { name: row[2].to_string(), memory_gib: row[3].parse::<f64>().ok().map(|mib| mib / 1024.0) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> Option<GpuInfo> {
        Some(GpuInfo { name: "NVIDIA H200".into(), memory_gib: Some(139.8) })
    }

    #[test]
    fn gpu_line_names_indices_with_what_is_known() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(describe_gpus(&[], &[]), "gpus: none visible");
        assert_eq!(describe_gpus(&ids(&["0"]), &[h200()]), "gpus: 1 visible (index 0: NVIDIA H200, 140 GiB)");
        // CUDA_VISIBLE_DEVICES=2,3: the indices are those, not 0 and 1.
        assert_eq!(
            describe_gpus(&ids(&["2", "3"]), &[h200(), h200()]),
            "gpus: 2 visible (index 2: NVIDIA H200, 140 GiB; index 3: NVIDIA H200, 140 GiB)"
        );
        assert_eq!(describe_gpus(&ids(&["0", "1"]), &[]), "gpus: 2 visible (index 0, 1)");
        let no_memory = Some(GpuInfo { name: "NVIDIA A10".into(), memory_gib: None });
        assert_eq!(
            describe_gpus(&ids(&["GPU-5f1c", "1"]), &[no_memory, None]),
            "gpus: 2 visible (GPU-5f1c: NVIDIA A10; index 1)"
        );
    }

    #[test]
    fn nvidia_smi_rows_are_matched_by_index_or_uuid() {
        let text = "0, GPU-aaaa-1111, NVIDIA H200, 143771\n1, GPU-bbbb-2222, NVIDIA H200, 143771\n";
        let ids = vec!["1".to_string(), "GPU-aaaa".to_string(), "7".to_string()];
        let got = parse_nvidia_smi(text, &ids);
        assert_eq!(got[0].as_ref().unwrap().name, "NVIDIA H200");
        assert!((got[0].as_ref().unwrap().memory_gib.unwrap() - 140.4).abs() < 0.1);
        assert!(got[1].is_some(), "a UUID prefix names a GPU");
        assert_eq!(got[2], None);
        assert_eq!(parse_nvidia_smi("", &ids), vec![None, None, None]);
    }
}
