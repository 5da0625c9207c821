//! Files a stage reads from outside the DAG (`inputs = [...]`, dataset inputs, `path:` models).
//! Their content digests enter the cache key; a stat cache keeps reruns fast.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use miette::Diagnostic;
use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
pub enum InputError {
    #[error("stage `{stage}`: input `{pattern}` matches no file")]
    #[diagnostic(code(mflow::plan::input_missing), help("check the path; relative paths start at the spec's directory"))]
    NoMatch { stage: String, pattern: String },
    #[error("stage `{stage}`: input `{pattern}` leaves the project directory {}", root.display())]
    #[diagnostic(code(mflow::plan::input_escapes), help("keep relative inputs inside the project, or give an absolute path"))]
    Escapes { stage: String, pattern: String, root: PathBuf },
    #[error("stage `{stage}`: invalid input pattern `{pattern}`: {reason}")]
    #[diagnostic(code(mflow::plan::input_pattern))]
    Pattern { stage: String, pattern: String, reason: String },
    #[error("stage `{stage}`: cannot read input {}", path.display())]
    #[diagnostic(code(mflow::plan::input_io))]
    Io {
        stage: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Stat {
    size: u64,
    mtime_ns: i128,
    digest: String,
}

/// Digests of input files, remembered by (path, size, mtime) in `WORKDIR/state/inputs.json`.
pub struct InputHasher {
    path: PathBuf,
    known: Mutex<BTreeMap<String, Stat>>,
    dirty: Mutex<bool>,
}

impl InputHasher {
    pub fn open(workdir: &Path) -> InputHasher {
        let path = workdir.join("state").join("inputs.json");
        let known = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        InputHasher { path, known: Mutex::new(known), dirty: Mutex::new(false) }
    }

    /// Expands `patterns` (relative to `base`, which must not be left) and digests every file.
    /// Directories are walked. Keys of the result are the paths as the user wrote them, resolved.
    pub fn digest(&self, stage: &str, base: &Path, root: &Path, patterns: &[String]) -> Result<BTreeMap<String, String>, InputError> {
        let mut out = BTreeMap::new();
        for pattern in patterns {
            let p = Path::new(pattern);
            // `base` is inside `root`, so only a `..` can lead out of it.
            if !p.is_absolute() && p.components().any(|c| c == Component::ParentDir) && escapes(&base.join(p), root) {
                return Err(InputError::Escapes { stage: stage.into(), pattern: pattern.clone(), root: root.to_path_buf() });
            }
            let full = base.join(p);
            let mut files = Vec::new();
            if pattern.contains(['*', '?', '[']) {
                let paths = glob::glob(&full.to_string_lossy())
                    .map_err(|e| InputError::Pattern { stage: stage.into(), pattern: pattern.clone(), reason: e.to_string() })?;
                for entry in paths.flatten() {
                    collect(&entry, &mut files);
                }
            } else {
                // A plain path: no glob walk over its ancestors.
                collect(&full, &mut files);
            }
            if files.is_empty() {
                return Err(InputError::NoMatch { stage: stage.into(), pattern: pattern.clone() });
            }
            for (f, meta) in files {
                let rel = f.strip_prefix(base).map(|r| r.to_string_lossy().to_string()).unwrap_or_else(|_| f.to_string_lossy().to_string());
                let d = self.file(&f, &meta).map_err(|source| InputError::Io { stage: stage.into(), path: f.clone(), source })?;
                out.insert(rel, d);
            }
        }
        Ok(out)
    }

    fn file(&self, path: &Path, meta: &std::fs::Metadata) -> std::io::Result<String> {
        let mtime_ns = meta
            .modified()?
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i128)
            .unwrap_or(0);
        let key = path.to_string_lossy().to_string();
        if let Some(s) = self.known.lock().unwrap().get(&key) {
            if s.size == meta.len() && s.mtime_ns == mtime_ns {
                return Ok(s.digest.clone());
            }
        }
        let digest = crate::cache::hash_file(path)?;
        self.known.lock().unwrap().insert(key, Stat { size: meta.len(), mtime_ns, digest: digest.clone() });
        *self.dirty.lock().unwrap() = true;
        Ok(digest)
    }

    pub fn save(&self) {
        if !*self.dirty.lock().unwrap() {
            return;
        }
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let json = serde_json::to_vec(&*self.known.lock().unwrap()).unwrap_or_default();
        let _ = crate::record::write_atomic(&self.path, &json);
    }
}

fn collect(path: &Path, out: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    let Ok(meta) = std::fs::metadata(path) else { return };
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path).into_iter().flatten().flatten().map(|e| e.path()).collect();
        entries.sort();
        for e in entries {
            collect(&e, out);
        }
    } else if meta.is_file() {
        out.push((path.to_path_buf(), meta));
    }
}

/// Whether `path` (lexically normalised) is outside `root`.
pub fn escapes(path: &Path, root: &Path) -> bool {
    let norm = |p: &Path| {
        let mut out = Vec::new();
        for c in p.components() {
            match c {
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                other => out.push(other.as_os_str().to_owned()),
            }
        }
        out
    };
    let abs = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(p) };
    !norm(&abs(path)).starts_with(&norm(&abs(root)))
}

/// The project directory: the enclosing git work tree, else the spec's directory.
pub fn project_root(spec_dir: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(spec_dir).unwrap_or_else(|_| spec_dir.to_path_buf());
    let mut cur = Some(abs.as_path());
    while let Some(d) = cur {
        if d.join(".git").exists() {
            return d.to_path_buf();
        }
        cur = d.parent();
    }
    abs
}
