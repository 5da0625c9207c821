//! Files a stage reads from outside the DAG (`inputs = [...]`, dataset inputs, `path:` models).
//! Their content digests enter the cache key; a stat cache keeps reruns fast.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use miette::Diagnostic;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::cache::{FileStat, OpenDir};

#[derive(Debug, Error, Diagnostic)]
pub enum InputError {
    #[error("stage `{stage}`: input `{pattern}` matches no file")]
    #[diagnostic(code(mflow::plan::input_missing), help("check the path; relative paths start at the spec's directory"))]
    NoMatch { stage: String, pattern: String },
    #[error("stage `{stage}`: input `{pattern}` leaves the project directory {}", root.display())]
    #[diagnostic(code(mflow::plan::input_escapes), help("keep relative inputs inside the project, or give an absolute path"))]
    Escapes { stage: String, pattern: String, root: PathBuf },
    #[error("stage `{stage}`: input `{}` is a symbolic link to {}, outside the project directory {}", link.display(), target.display(), root.display())]
    #[diagnostic(
        code(mflow::plan::input_link_escapes),
        help("copy the file into the project, or give its absolute path in `inputs` if the stage is meant to read it there")
    )]
    LinkEscapes { stage: String, link: PathBuf, target: PathBuf, root: PathBuf },
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
    /// As last saved; only read while stages are planned, so that threads share it unlocked.
    known: HashMap<String, Stat>,
    /// Files hashed by this run: new, or changed since they were saved.
    fresh: Mutex<HashMap<String, Stat>>,
    /// The directory relative inputs start at, and the same held open to stat from.
    base: PathBuf,
    base_dir: Option<OpenDir>,
    /// The artifact volume is the cluster's, not mounted here: files on it are hashed by the
    /// run's driver there, not by this plan.
    volume_elsewhere: bool,
    /// Directories of matched files, resolved, shared by every stage of the plan: the inputs of
    /// 5,000 stages mostly share one or two directories, and resolving one per stage was 4
    /// failing readlinks each (`canonicalize` walks every component).
    parents: Mutex<HashMap<PathBuf, Option<PathBuf>>>,
}

/// The digest a plan made where the volume is not mounted gives an input on it.
pub const ON_THE_VOLUME: &str = "on-the-volume";

/// The stat cache of a workdir as last saved, which a run reads while its spec loads.
pub struct KnownInputs {
    path: PathBuf,
    stats: HashMap<String, Stat>,
}

impl KnownInputs {
    pub fn read(workdir: &Path) -> KnownInputs {
        let path = workdir.join("state").join("inputs.json");
        let stats = crate::cache::read_regular(&path, crate::cache::MAX_STATE_BYTES).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        KnownInputs { path, stats }
    }
}

impl InputHasher {
    /// The hasher of `workdir`'s inputs, with `known` when it was read from there.
    pub fn open(workdir: &Path, base: &Path, known: Option<KnownInputs>) -> InputHasher {
        let path = workdir.join("state").join("inputs.json");
        let known = match known {
            Some(k) if k.path == path => k,
            _ => KnownInputs::read(workdir),
        };
        InputHasher { path, known: known.stats, fresh: Mutex::default(), base: base.to_path_buf(), base_dir: OpenDir::open(base).ok(), volume_elsewhere: false, parents: Mutex::default() }
    }

    /// Inputs on the artifact volume are left to the cluster (see [`ON_THE_VOLUME`]).
    pub fn volume_elsewhere(mut self, yes: bool) -> Self {
        self.volume_elsewhere = yes;
        self
    }

    /// Expands `patterns` (relative to `base`, which must not be left) and digests every file.
    /// Directories are walked. Keys of the result are the paths as the user wrote them, resolved.
    pub fn digest(&self, stage: &str, root: &Path, patterns: &[String]) -> Result<BTreeMap<String, String>, InputError> {
        let base = self.base.as_path();
        let mut out = BTreeMap::new();
        for pattern in patterns {
            let p = Path::new(pattern);
            if self.volume_elsewhere && p.is_absolute() && p.starts_with(mflow_kube::ARTIFACT_MOUNT) {
                out.insert(pattern.clone(), ON_THE_VOLUME.to_string());
                continue;
            }
            // `base` is inside `root`, so only a `..` can lead out of it.
            if !p.is_absolute() && p.components().any(|c| c == Component::ParentDir) && escapes(&base.join(p), root) {
                return Err(InputError::Escapes { stage: stage.into(), pattern: pattern.clone(), root: root.to_path_buf() });
            }
            let full = base.join(p);
            // An absolute path outside the project is the user's choice, links on the way included.
            let explicit = p.is_absolute() && escapes(&full, root);
            let mut links = Links { stage, base, root, parents: &self.parents, scope: None };
            let mut files = Vec::new();
            let mut add = |entry: &Path, links: &mut Links| -> Result<(), InputError> {
                let known = if explicit {
                    links.scope = std::fs::canonicalize(entry).ok();
                    None
                } else {
                    links.check_top(entry, self.lstat(entry))?
                };
                let meta = known.or_else(|| self.stat(entry));
                self.collect_stat(entry, meta, links, &mut files)
            };
            if pattern.contains(['*', '?', '[']) {
                let paths = glob::glob(&full.to_string_lossy())
                    .map_err(|e| InputError::Pattern { stage: stage.into(), pattern: pattern.clone(), reason: e.to_string() })?;
                for entry in paths.flatten() {
                    add(&entry, &mut links)?;
                }
            } else {
                // A plain path: no glob walk over its ancestors.
                add(&full, &mut links)?;
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

    fn file(&self, path: &Path, meta: &FileStat) -> std::io::Result<String> {
        let mtime_ns = meta.mtime_ns;
        let key = path.to_string_lossy().to_string();
        let same = |s: &&Stat| s.size == meta.len && s.mtime_ns == mtime_ns;
        if let Some(s) = self.known.get(&key).filter(same) {
            return Ok(s.digest.clone());
        }
        if let Some(s) = self.fresh.lock().unwrap().get(&key).filter(same) {
            return Ok(s.digest.clone());
        }
        let digest = crate::cache::hash_file(path)?;
        self.fresh.lock().unwrap().insert(key, Stat { size: meta.len, mtime_ns, digest: digest.clone() });
        Ok(digest)
    }

    pub fn save(&self) {
        let fresh = std::mem::take(&mut *self.fresh.lock().unwrap());
        if fresh.is_empty() {
            return;
        }
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // Sorted on disk, so that the file is the same for the same files.
        let mut all: BTreeMap<&String, &Stat> = self.known.iter().collect();
        all.extend(fresh.iter());
        let json = serde_json::to_vec(&all).unwrap_or_default();
        let _ = crate::record::write_atomic(&self.path, &json);
    }

    /// The files at `path` (the file itself, or every file below a directory), with their stats.
    /// A link met in a directory is checked by `links` before it is followed.
    fn collect(&self, path: &Path, links: &Links, out: &mut Vec<(PathBuf, FileStat)>) -> Result<(), InputError> {
        self.collect_stat(path, self.stat(path), links, out)
    }

    /// [`Self::collect`] with the stat of `path` already taken.
    fn collect_stat(&self, path: &Path, meta: Option<FileStat>, links: &Links, out: &mut Vec<(PathBuf, FileStat)>) -> Result<(), InputError> {
        let Some(meta) = meta else { return Ok(()) };
        if meta.is_dir {
            let mut entries: Vec<(PathBuf, bool)> =
                std::fs::read_dir(path).into_iter().flatten().flatten().map(|e| (e.path(), e.file_type().is_ok_and(|t| t.is_symlink()))).collect();
            entries.sort();
            for (e, is_link) in entries {
                if is_link {
                    links.check_link(&e)?;
                }
                self.collect(&e, links, out)?;
            }
        } else if meta.is_file {
            out.push((path.to_path_buf(), meta));
        }
        Ok(())
    }

    /// Stats `path` itself (a link is not followed) from the open base directory, when it lies
    /// below it; `None` elsewhere.
    fn lstat(&self, path: &Path) -> Option<FileStat> {
        match (&self.base_dir, path.strip_prefix(&self.base)) {
            (Some(dir), Ok(rel)) if !rel.as_os_str().is_empty() => dir.lstat(rel).ok(),
            _ => None,
        }
    }

    /// Stats `path` from the open base directory when it lies below it.
    fn stat(&self, path: &Path) -> Option<FileStat> {
        match (&self.base_dir, path.strip_prefix(&self.base)) {
            (Some(dir), Ok(rel)) if !rel.as_os_str().is_empty() => dir.stat(rel).ok(),
            _ => std::fs::metadata(path).ok().map(|m| FileStat::from(&m)),
        }
    }
}

/// Where the links of one input pattern may lead: into the project (`root`, resolved), or,
/// for an absolute input outside it, into what the user named (`scope`).
struct Links<'a> {
    stage: &'a str,
    base: &'a Path,
    root: &'a Path,
    /// Directories of matched files, resolved (the hasher's, shared across stages).
    parents: &'a Mutex<HashMap<PathBuf, Option<PathBuf>>>,
    scope: Option<PathBuf>,
}

impl Links<'_> {
    /// A matched path must resolve inside the project, whichever of its components is a link.
    /// `lstat` is the path's own stat when already taken; a file or directory there (not a
    /// link) is its stat followed too, and is handed back for the caller to use.
    fn check_top(&mut self, path: &Path, lstat: Option<FileStat>) -> Result<Option<FileStat>, InputError> {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else { return Ok(None) };
        let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
        let plain = lstat.filter(|m| m.is_file || m.is_dir);
        let in_parent = || {
            let mut parents = self.parents.lock().unwrap();
            parents.entry(parent.to_path_buf()).or_insert_with(|| std::fs::canonicalize(parent).ok()).as_ref().map(|p| p.join(name))
        };
        let resolved = if plain.is_some() {
            in_parent()
        } else {
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).ok(),
                Ok(_) => in_parent(),
                Err(_) => None,
            }
        };
        match resolved {
            Some(target) if !target.starts_with(self.root) => Err(self.escaping_link(path, target)),
            _ => Ok(plain),
        }
    }

    /// A link found while walking a directory input.
    fn check_link(&self, link: &Path) -> Result<(), InputError> {
        let Ok(target) = std::fs::canonicalize(link) else { return Ok(()) };
        if target.starts_with(self.root) || self.scope.as_ref().is_some_and(|s| target.starts_with(s)) {
            return Ok(());
        }
        Err(self.error(link, target))
    }

    /// The error for `path`, which resolves to `target`: named by its first component that is
    /// a link leading out of the project.
    fn escaping_link(&self, path: &Path, target: PathBuf) -> InputError {
        let from = path.strip_prefix(self.base).map(|_| self.base).unwrap_or(Path::new(""));
        let mut prefix = from.to_path_buf();
        for c in path.strip_prefix(from).unwrap_or(path).components() {
            prefix.push(c);
            let is_link = std::fs::symlink_metadata(&prefix).is_ok_and(|m| m.file_type().is_symlink());
            if let Some(t) = is_link.then(|| std::fs::canonicalize(&prefix).ok()).flatten().filter(|t| !t.starts_with(self.root)) {
                return self.error(&prefix, t);
            }
        }
        self.error(path, target)
    }

    fn error(&self, link: &Path, target: PathBuf) -> InputError {
        let link = link.strip_prefix(self.base).unwrap_or(link).to_path_buf();
        InputError::LinkEscapes { stage: self.stage.into(), link, target, root: self.root.to_path_buf() }
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

/// The project directory: the enclosing git work tree, else the spec's directory. A project
/// uploaded to the artifact volume has no `.git`; its driver names the root in
/// `MFLOW_PROJECT_ROOT`.
pub fn project_root(spec_dir: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(spec_dir).unwrap_or_else(|_| spec_dir.to_path_buf());
    if let Some(root) = std::env::var_os("MFLOW_PROJECT_ROOT").map(PathBuf::from) {
        if abs.starts_with(&root) {
            return root;
        }
    }
    let mut cur = Some(abs.as_path());
    while let Some(d) = cur {
        if d.join(".git").exists() {
            return d.to_path_buf();
        }
        cur = d.parent();
    }
    abs
}
