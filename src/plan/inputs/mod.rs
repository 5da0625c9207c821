//! Files a stage reads from outside the DAG (`inputs = [...]`, dataset inputs, `path:` models).
//! Their content digests enter the cache key; a stat cache keeps reruns fast.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

mod error;
mod links;

pub use error::{InputError, Placed};
use links::Links;

use crate::cache::{FileStat, OpenDir};
use mflow_untrusted::walk::WalkError;

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
    /// Off for a check that only finds the files.
    hash: bool,
    /// Directories of matched files, resolved, shared by every stage of the plan: the inputs of
    /// 5,000 stages mostly share one or two directories, and resolving one per stage was 4
    /// failing readlinks each (`canonicalize` walks every component).
    parents: Mutex<HashMap<PathBuf, Option<PathBuf>>>,
    /// mflow's workdir, and its device and inode when it exists: never an input, so that a
    /// glob or directory over the project does not read the cache and the run records.
    workdir: PathBuf,
    workdir_real: Option<PathBuf>,
    workdir_node: Option<(u64, u64)>,
}

/// How deep an input may be walked (`mflow_untrusted::walk::LIMITS`).
pub const MAX_WALK_DEPTH: usize = mflow_untrusted::walk::LIMITS.depth;
/// How many paths one input pattern may match or walk.
pub const MAX_WALK_ENTRIES: usize = mflow_untrusted::walk::LIMITS.entries;

/// The walk of a directory input: links followed, a cycle and a tree past the bounds refused.
fn walk<E>(
    start: &Path,
    stat: &dyn Fn(&Path) -> Option<FileStat>,
    visit: &mut dyn FnMut(&Path, &FileStat, bool) -> Result<bool, E>,
) -> Result<(), WalkError<E>> {
    mflow_untrusted::walk::walk(start, mflow_untrusted::walk::LIMITS, stat, visit)
}

impl mflow_untrusted::walk::Stat for FileStat {
    fn node(&self) -> mflow_untrusted::walk::Node {
        mflow_untrusted::walk::Node { dev: self.dev, ino: self.ino, is_dir: self.is_dir }
    }
}

/// A stage's inputs: digests by path as written, and the stat of each file as it was hashed.
pub type Digested = (BTreeMap<String, String>, Vec<(PathBuf, FileStat)>);

/// The digest a plan made where the volume is not mounted gives an input on it.
pub const ON_THE_VOLUME: &str = "on-the-volume";

/// The stat cache of a workdir as last saved, which a run reads while its spec loads.
pub struct KnownInputs {
    path: PathBuf,
    stats: HashMap<String, Stat>,
}

impl KnownInputs {
    pub fn read(workdir: &crate::workdir::Workdir) -> KnownInputs {
        let path = workdir.state_file("inputs.json");
        let stats = crate::cache::read_regular(&path, crate::cache::MAX_STATE_BYTES)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        KnownInputs { path, stats }
    }
}

impl InputHasher {
    /// The hasher of `workdir`'s inputs, with `known` when it was read from there.
    pub fn open(workdir: &crate::workdir::Workdir, base: &Path, known: Option<KnownInputs>) -> InputHasher {
        let path = workdir.state_file("inputs.json");
        let known = match known {
            Some(k) if k.path == path => k,
            _ => KnownInputs::read(workdir),
        };
        InputHasher {
            path,
            known: known.stats,
            fresh: Mutex::default(),
            base: base.to_path_buf(),
            base_dir: OpenDir::open(base).ok(),
            volume_elsewhere: false,
            hash: true,
            parents: Mutex::default(),
            workdir: workdir.root().to_path_buf(),
            workdir_real: std::fs::canonicalize(workdir.root()).ok(),
            workdir_node: std::fs::metadata(workdir.root()).ok().map(|m| {
                let m = FileStat::from(&m);
                (m.dev, m.ino)
            }),
        }
    }

    /// Finds and checks the inputs without reading them: their digests are left empty.
    pub fn without_hashing(mut self) -> Self {
        self.hash = false;
        self
    }

    /// Inputs on the artifact volume are left to the cluster (see [`ON_THE_VOLUME`]).
    pub fn volume_elsewhere(mut self, yes: bool) -> Self {
        self.volume_elsewhere = yes;
        self
    }

    /// Expands `patterns` (relative to `base`, which must not be left) and digests every file.
    /// Directories are walked. Keys of the result are the paths as the user wrote them, resolved;
    /// with each file's stat as it was hashed, which the run compares after the stage.
    pub fn digest(&self, stage: &str, root: &Path, patterns: &[String]) -> Result<Digested, InputError> {
        let base = self.base.as_path();
        let mut out = BTreeMap::new();
        let mut stats = Vec::new();
        for pattern in patterns {
            let p = Path::new(pattern);
            if pattern.is_empty() {
                return Err(InputError::Pattern {
                    stage: stage.into(),
                    pattern: String::new(),
                    reason: "empty".into(),
                });
            }
            if self.volume_elsewhere && p.is_absolute() && p.starts_with(mflow_kube::ARTIFACT_MOUNT) {
                out.insert(pattern.clone(), ON_THE_VOLUME.to_string());
                continue;
            }
            // `base` is inside `root`, so only a `..` can lead out of it.
            if !p.is_absolute() && p.components().any(|c| c == Component::ParentDir) && escapes(&base.join(p), root) {
                return Err(InputError::Escapes {
                    stage: stage.into(),
                    pattern: pattern.clone(),
                    root: root.to_path_buf(),
                });
            }
            let full = base.join(p);
            // An absolute path outside the project is the user's choice, links on the way included.
            let explicit = p.is_absolute() && escapes(&full, root);
            let is_glob = pattern.contains(['*', '?', '[']);
            // What a glob's matches may lead to: the directory it names before its first
            // wildcard, as a link in that directory named by itself may.
            let glob_scope = if explicit && is_glob { std::fs::canonicalize(literal_prefix(&full)).ok() } else { None };
            let mut links = Links { stage, base, root, parents: &self.parents, scope: None };
            let mut files = Vec::new();
            let mut add = |entry: &Path, links: &mut Links| -> Result<(), InputError> {
                if self.in_workdir(entry) {
                    return self.workdir_met(stage, pattern, is_glob);
                }
                let known = if explicit {
                    let real = std::fs::canonicalize(entry).ok();
                    if let (Some(scope), Some(real)) = (&glob_scope, &real) {
                        if !real.starts_with(scope) {
                            return Err(InputError::LinkLeaves {
                                stage: stage.into(),
                                link: entry.to_path_buf(),
                                target: real.clone(),
                                dir: scope.clone(),
                            });
                        }
                    }
                    links.scope = glob_scope.clone().or(real);
                    None
                } else {
                    links.check_top(entry, self.lstat(entry))?
                };
                let meta = known.or_else(|| self.stat(entry));
                if meta.is_some_and(|m| self.is_workdir(&m)) {
                    return self.workdir_met(stage, pattern, is_glob);
                }
                self.collect_stat(entry, meta, links, &mut files).map_err(|e| e.for_pattern(pattern))
            };
            if is_glob {
                let bad = |e: glob::PatternError| InputError::Pattern {
                    stage: stage.into(),
                    pattern: pattern.clone(),
                    reason: e.to_string(),
                };
                // The glob crate follows links below `**` without end, and passes names that
                // are not UTF-8 by in silence; this walk stops at a cycle and at the walk's
                // bounds, and refuses such a name where the pattern would match it.
                if pattern.contains("**") {
                    links.scope = glob_scope.clone();
                }
                let matcher = glob::Pattern::new(&full.to_string_lossy()).map_err(bad)?;
                for entry in self.glob_walk(stage, &full, matcher, &links).map_err(|e| e.for_pattern(pattern))? {
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
                // Keys are text: two names that differ only in bytes that are not UTF-8 would share one.
                let rel = f.strip_prefix(base).unwrap_or(&f);
                let Some(rel) = rel.to_str().map(str::to_string) else {
                    return Err(InputError::NotUtf8 { stage: stage.into(), path: f });
                };
                if !self.hash {
                    out.insert(rel, String::new());
                    continue;
                }
                let d = self.file(&f, &meta).map_err(|source| InputError::Io {
                    stage: stage.into(),
                    path: f.clone(),
                    source,
                })?;
                out.insert(rel, d);
                stats.push((f, meta));
            }
        }
        Ok((out, stats))
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
    /// A link met in a directory is checked by `links` before it is followed. `meta` is the
    /// stat of `path`, links followed.
    fn collect_stat(
        &self,
        path: &Path,
        meta: Option<FileStat>,
        links: &Links,
        out: &mut Vec<(PathBuf, FileStat)>,
    ) -> Result<(), InputError> {
        match meta {
            Some(m) if m.is_dir => {}
            Some(m) if m.is_file => {
                out.push((path.to_path_buf(), m));
                return Ok(());
            }
            // A FIFO, socket or device: named as such, not as a path that matches nothing.
            Some(_) => {
                let kind = std::fs::metadata(path).map(|m| m.file_type());
                let source = kind.map_or_else(|e| e, mflow_untrusted::not_regular);
                return Err(InputError::Io { stage: links.stage.into(), path: path.to_path_buf(), source });
            }
            None => return Ok(()),
        }
        // The walk every input shares: a cycle of links, or a tree past its bounds, is an error.
        let mut visit = |p: &Path, m: &FileStat, is_link: bool| -> Result<bool, InputError> {
            if self.is_workdir(m) {
                return Ok(false);
            }
            if is_link {
                links.check_link(p)?;
            }
            if p.to_str().is_none() {
                return Err(InputError::NotUtf8 { stage: links.stage.into(), path: p.to_path_buf() });
            }
            if m.is_file {
                out.push((p.to_path_buf(), *m));
            }
            Ok(m.is_dir)
        };
        walk(path, &|p| self.stat(p), &mut visit).map_err(|e| self.walk_error(links.stage, e))
    }

    fn walk_error(&self, stage: &str, e: WalkError<InputError>) -> InputError {
        let stage = stage.to_string();
        match e {
            WalkError::Cycle { path } => {
                InputError::Cycle { stage, path: path.strip_prefix(&self.base).map(Path::to_path_buf).unwrap_or(path) }
            }
            WalkError::Visit(e) => e,
            other => InputError::TooLarge { stage, pattern: String::new(), what: other.to_string() },
        }
    }

    /// The paths below the literal directory of the glob `full` that `pattern` matches, as
    /// `glob::glob` finds them (`*` within a component, `**` across them), walked once as inputs
    /// are walked: no deeper than the pattern's components without `**`; a link to a directory
    /// is checked by `links` before the walk enters it. A path that is not UTF-8 and that the
    /// pattern matches once its bytes are replaced is refused, not passed by.
    fn glob_walk(
        &self,
        stage: &str,
        full: &Path,
        pattern: glob::Pattern,
        links: &Links,
    ) -> Result<Vec<PathBuf>, InputError> {
        let opts = glob::MatchOptions {
            case_sensitive: true,
            require_literal_separator: true,
            require_literal_leading_dot: false,
        };
        let start = literal_prefix(full);
        let top = start.components().count();
        // Without `**`, a directory is entered only where its name matches its component.
        let parts: Option<Vec<glob::Pattern>> = (!full.to_string_lossy().contains("**")).then(|| {
            full.components()
                .skip(top)
                .filter_map(|c| glob::Pattern::new(&c.as_os_str().to_string_lossy()).ok())
                .collect()
        });
        let enter = |p: &Path| {
            let Some(parts) = &parts else { return true };
            let depth = p.components().count() - top;
            match depth.checked_sub(1) {
                None => true,
                Some(k) => {
                    k + 1 < parts.len()
                        && p.file_name().is_some_and(|n| parts[k].matches_with(&n.to_string_lossy(), opts))
                }
            }
        };
        let mut out = Vec::new();
        let mut visit = |p: &Path, m: &FileStat, is_link: bool| -> Result<bool, InputError> {
            if self.is_workdir(m) {
                return Ok(false);
            }
            match p.to_str() {
                Some(text) if pattern.matches_with(text, opts) => out.push(p.to_path_buf()),
                Some(_) => {}
                None if pattern.matches_with(&p.to_string_lossy(), opts) => {
                    return Err(InputError::NotUtf8 { stage: stage.into(), path: p.to_path_buf() })
                }
                None => {}
            }
            if is_link && m.is_dir {
                links.check_link(p)?;
            }
            Ok(m.is_dir && enter(p))
        };
        walk(&start, &|p| self.stat(p), &mut visit).map_err(|e| self.walk_error(stage, e))?;
        out.sort();
        Ok(out)
    }

    /// A glob over the project passes the workdir by; a path into it is refused.
    fn workdir_met(&self, stage: &str, pattern: &str, is_glob: bool) -> Result<(), InputError> {
        match is_glob {
            true => Ok(()),
            false => Err(InputError::InWorkdir {
                stage: stage.into(),
                pattern: pattern.into(),
                workdir: self.workdir.clone(),
            }),
        }
    }

    /// Whether a directory met on a walk is the workdir.
    fn is_workdir(&self, m: &FileStat) -> bool {
        m.is_dir && self.workdir_node == Some((m.dev, m.ino))
    }

    /// Whether `path` lies in the workdir: as written (both start at the spec's directory), or
    /// once its directory is resolved (`..`, links), from the cache of resolved directories the
    /// link checks share. The workdir itself, under another name, is found by its inode.
    fn in_workdir(&self, path: &Path) -> bool {
        if path.starts_with(&self.workdir) {
            return true;
        }
        let (Some(real), Some(parent), Some(name)) = (&self.workdir_real, path.parent(), path.file_name()) else {
            return false;
        };
        let mut parents = self.parents.lock().unwrap();
        let resolved = parents.entry(parent.to_path_buf()).or_insert_with(|| std::fs::canonicalize(parent).ok());
        resolved.as_ref().is_some_and(|p| {
            p.starts_with(real) || (Some(p.as_path()) == real.parent() && Some(name) == real.file_name())
        })
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

impl InputError {
    /// Names the pattern in an error raised below it, where the pattern was not known.
    fn for_pattern(self, p: &str) -> InputError {
        match self {
            InputError::TooLarge { stage, pattern, what } if pattern.is_empty() => {
                InputError::TooLarge { stage, pattern: p.to_string(), what }
            }
            other => other,
        }
    }
}

/// The components of a glob before the first that holds a wildcard: the directory it names.
fn literal_prefix(pattern: &Path) -> PathBuf {
    pattern.components().take_while(|c| !c.as_os_str().to_string_lossy().contains(['*', '?', '['])).collect()
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
    let abs =
        |p: &Path| if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(p) };
    !norm(&abs(path)).starts_with(&norm(&abs(root)))
}
