//! `mflow gc` and `mflow cache repair`: the commands that remove or move entries.
//!
//! Both act only on what is mflow's: a workdir that `workdir::inspect` accepts, and in its cache
//! only directories whose name is a key. gc deletes only entries that the manifest log knows;
//! repair deletes nothing but byte-identical copies.
//!
//! Exclusion from runs. A run holds a key's lock only while it computes that key, but it needs
//! every entry it committed or found cached until it ends, since the stages after it read them.
//! So every store opened for writing (a run) holds a shared lock on the `LIVE` byte of
//! `cache/.lock` for as long as it lives, and gc and repair take that byte exclusively: they
//! refuse (or wait, with `--wait`) while a run is live, and a run that starts meanwhile waits
//! for them, which takes moments. This was chosen over sparing the entries newer than the oldest
//! live run, which would still delete an older entry that a live run found cached. gc takes
//! each key's lock as well, and skips keys that are locked, for a run of an mflow that predates
//! the run-wide lock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use super::entries::{remove_entry, set_aside};
use super::lock::{lock_key, ofd_lock, LIVE};
use super::{files, io_err, is_key, manifests, CacheError, Manifest, Staged};
use crate::record;
use crate::workdir::{self, Found, Workdir};

/// The cache of a workdir, held so that no run uses it meanwhile.
struct Exclusive {
    workdir: Workdir,
    log: manifests::Log,
    _live: Option<File>,
}

impl Exclusive {
    /// `None` when the workdir has no cache. `write` adopts a workdir of an older mflow (writes
    /// the marker); without it, nothing is created.
    fn take(workdir: &Workdir, wait: bool, write: bool) -> Result<Option<Exclusive>, CacheError> {
        let refuse =
            |reason: String, help: String| CacheError::NotWorkdir { path: workdir.root().to_path_buf(), reason, help };
        match workdir::inspect(workdir.root()).map_err(|r| refuse(r.reason, r.help))? {
            found @ (Found::Missing | Found::Empty) => {
                let what = if found == Found::Missing {
                    "it does not exist".to_string()
                } else {
                    format!("it is empty (no `{}`, `cache/.manifests.jsonl` or `runs/`)", workdir::MARKER)
                };
                return Err(refuse(what, "pass the workdir of a spec (`.mflow` beside it unless `[pipeline] workdir` says otherwise) with --workdir".into()));
            }
            Found::Unmarked if write => workdir::claim(workdir.root())?,
            _ => {}
        }
        if !fs::symlink_metadata(workdir.cache()).is_ok_and(|m| m.is_dir()) {
            return Ok(None);
        }
        let lock = workdir.cache_lock();
        // Without a lock file no run of this mflow has the cache open, so a look needs no lock.
        let live = if write || fs::symlink_metadata(&lock).is_ok() {
            let file = files::open(&lock, OpenOptions::new().read(true).write(true).create(true))
                .map_err(io_err("cannot open the lock file", &lock))?;
            if !ofd_lock(&file, libc::F_WRLCK, LIVE, 1, wait).map_err(io_err("cannot lock", &lock))? {
                return Err(CacheError::InUse { workdir: workdir.root().to_path_buf() });
            }
            Some(file)
        } else {
            None
        };
        Ok(Some(Exclusive { workdir: workdir.clone(), log: manifests::Log::new(workdir.manifest_log()), _live: live }))
    }

    /// The newest manifest of every key in the log, read afresh; `None` when there is no log.
    fn read_log(&mut self) -> Result<Option<BTreeMap<String, Manifest>>, CacheError> {
        self.log.refresh().map_err(|cause| CacheError::Log {
            path: self.log.path().to_path_buf(),
            workdir: self.workdir.root().to_path_buf(),
            cause,
        })?;
        if !self.log.found() {
            return Ok(None);
        }
        Ok(Some(self.log.manifests().map(|m| (m.key.clone(), Manifest::clone(m))).collect()))
    }

    /// The key-named directories of the cache, and the other names in it (not mflow's).
    fn entries(&self) -> Result<(Vec<String>, Vec<String>), CacheError> {
        let (mut keys, mut other) = (Vec::new(), Vec::new());
        let root = self.workdir.cache();
        for e in fs::read_dir(&root).map_err(io_err("cannot list", &root))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            if is_key(&name) && e.file_type().is_ok_and(|t| t.is_dir()) {
                keys.push(name);
            } else {
                other.push(name);
            }
        }
        keys.sort();
        other.sort();
        Ok((keys, other))
    }

    /// Drops the lines of entries that are gone (and of names that are not keys).
    fn compact(&mut self) -> Result<(), CacheError> {
        let workdir = self.workdir.clone();
        self.log
            .compact(|key| is_key(key) && workdir.entry(key).is_dir())
            .map_err(io_err("cannot rewrite the manifest log", self.log.path()))
    }
}

#[derive(Debug, Default)]
pub struct GcReport {
    /// Removed (or, in a dry run, to be removed), with their sizes.
    pub removed: Vec<(String, u64)>,
    /// Entries a kept run uses.
    pub kept: usize,
    /// Entries another process is computing right now.
    pub locked: Vec<String>,
    /// Names in the cache that the manifest log does not know: left alone.
    pub unknown: Vec<String>,
    /// The log itself is missing, so every entry was unknown.
    pub no_log: Option<PathBuf>,
    /// Runs among the newest whose run.json cannot be read: not counted among those kept.
    pub unreadable: Vec<String>,
}

/// Removes the entries that the manifest log knows and that none of the newest `keep_runs`
/// runs uses.
pub fn gc(workdir: &Workdir, keep_runs: usize, dry_run: bool, wait: bool) -> Result<GcReport, CacheError> {
    let Some(mut ex) = Exclusive::take(workdir, wait, !dry_run)? else { return Ok(GcReport::default()) };
    if !dry_run {
        // No run is live: whatever is staged is left over.
        super::staging::sweep(&ex.workdir, true);
    }
    // Read under the lock: no run can be live, so every record that counts is complete.
    // The newest `keep_runs` records that can be read: a damaged or foreign run.json (newer
    // by its name) takes no real run's place, and is said.
    let (mut keep, mut kept_runs, mut unreadable) = (BTreeSet::new(), 0, Vec::new());
    for id in record::list(workdir).iter().rev() {
        if kept_runs == keep_runs {
            break;
        }
        match record::load(workdir, id).filter(|_| readable(workdir, id, "run.json")) {
            Some(r) => {
                kept_runs += 1;
                keep.extend(r.stages.into_values().filter_map(|s| s.key));
            }
            None => unreadable.push(id.clone()),
        }
    }
    let known = ex.read_log()?;
    let (dirs, other) = ex.entries()?;
    let mut report = GcReport { unknown: other, unreadable, ..GcReport::default() };
    let Some(known) = known else {
        report.no_log = Some(ex.log.path().to_path_buf());
        report.unknown.extend(dirs);
        return Ok(report);
    };
    for key in dirs {
        let Some(m) = known.get(&key) else {
            report.unknown.push(key);
            continue;
        };
        if keep.contains(&key) {
            report.kept += 1;
            continue;
        }
        let Some(_lock) = lock_key(&ex.workdir, &key, false)? else {
            report.locked.push(key);
            continue;
        };
        if !dry_run {
            remove_entry(&ex.workdir, &key)?;
        }
        report.removed.push((key, m.bytes()));
    }
    if !dry_run {
        ex.compact()?;
    }
    report.unknown.sort();
    Ok(report)
}

#[derive(Debug, Default)]
pub struct RepairReport {
    /// What was in the manifest log's place (not a regular file), and where it was moved.
    pub log_moved: Option<(String, PathBuf)>,
    /// Entries whose manifest checks out.
    pub intact: usize,
    /// Entries given their manifest line back: their files match the output digest a run
    /// recorded for their key.
    pub restored: Vec<String>,
    /// Entries moved to `cache/.unverified/`, with where and why.
    pub set_aside: Vec<(String, PathBuf, String)>,
    /// Copies in `cache/.unverified/` removed because the entry of their key holds the same
    /// files.
    pub duplicates: Vec<PathBuf>,
    /// What is still in `cache/.unverified/` for a person to look at.
    pub unverified: Vec<PathBuf>,
    /// Names in the cache that are not mflow's: left alone.
    pub foreign: Vec<String>,
}

/// Rebuilds the manifest log. An entry the log does not vouch for gets its line back when its
/// files hash to the output digest a run record gives for its key, and is set aside otherwise;
/// nothing but byte-identical copies is deleted.
pub fn repair(workdir: &Workdir, dry_run: bool, wait: bool) -> Result<RepairReport, CacheError> {
    let mut report = RepairReport::default();
    let Some(mut ex) = Exclusive::take(workdir, wait, !dry_run)? else { return Ok(report) };
    let log_path = ex.log.path().to_path_buf();
    // Whatever is in the log's place and cannot be read as the log is moved aside, not deleted.
    let unusable = match fs::symlink_metadata(&log_path) {
        Ok(m) if !m.file_type().is_file() => Some(files::kind(m.file_type()).to_string()),
        Ok(_) => files::open(&log_path, OpenOptions::new().read(true)).err().map(|e| format!("unreadable ({e})")),
        Err(_) => None,
    };
    if let Some(what) = unusable {
        let moved = free_name(&log_path, "damaged");
        if !dry_run {
            fs::rename(&log_path, &moved).map_err(io_err("cannot move aside", &log_path))?;
        }
        report.log_moved = Some((what, moved));
    }
    let known = if report.log_moved.is_some() { Some(BTreeMap::new()) } else { ex.read_log()? }.unwrap_or_default();
    let recorded = recorded_outputs(workdir);
    let (dirs, foreign) = ex.entries()?;
    report.foreign = foreign;
    let store = super::Store::open_read_only(workdir);
    for key in dirs {
        let dir = ex.workdir.entry(&key);
        if let Some(m) = known.get(&key) {
            match store.check_entry(&key, m, false) {
                Ok(()) => report.intact += 1,
                Err(why) => {
                    let aside =
                        if dry_run { ex.workdir.unverified().join(&key) } else { set_aside(&ex.workdir, &key)? };
                    report.set_aside.push((key, aside, format!("it does not match its manifest: {why}")));
                }
            }
            continue;
        }
        match confirmed(&dir, &key, &recorded) {
            Some(m) => {
                if !dry_run {
                    let _appended =
                        ex.log.append(&m).map_err(io_err("cannot append to the manifest log", &log_path))?;
                }
                report.restored.push(key);
            }
            None => {
                let aside = if dry_run { ex.workdir.unverified().join(&key) } else { set_aside(&ex.workdir, &key)? };
                report.set_aside.push((key, aside, "no run record gives its files' digest for its key".into()));
            }
        }
    }
    // What earlier runs set aside: a copy of a committed entry goes, a confirmed one whose
    // place is free goes back.
    let aside_dir = ex.workdir.unverified();
    let mut aside: Vec<PathBuf> = fs::read_dir(&aside_dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    aside.sort();
    // A dry run left a damaged log where it was: there is nothing to read.
    let fresh =
        if dry_run && report.log_moved.is_some() { BTreeMap::new() } else { ex.read_log()?.unwrap_or_default() };
    for path in aside {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let key = name.split('.').next().unwrap_or_default().to_string();
        if !is_key(&key)
            || !fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir())
            || report.set_aside.iter().any(|(_, p, _)| p == &path)
        {
            report.unverified.push(path);
            continue;
        }
        let files = Staged::list(&path).and_then(|s| s.hash()).ok();
        let committed =
            fresh.get(&key).filter(|m| ex.workdir.entry(&key).is_dir() && store.check_entry(&key, m, false).is_ok());
        match (files, committed) {
            (Some(files), Some(m)) if files == m.files => {
                if !dry_run {
                    fs::remove_dir_all(&path).map_err(io_err("cannot remove", &path))?;
                }
                report.duplicates.push(path);
            }
            (Some(_), None) if fs::symlink_metadata(ex.workdir.entry(&key)).is_err() => {
                match confirmed(&path, &key, &recorded) {
                    Some(m) => {
                        if !dry_run {
                            let _appended =
                                ex.log.append(&m).map_err(io_err("cannot append to the manifest log", &log_path))?;
                            let dest = ex.workdir.entry(&key);
                            fs::rename(&path, &dest).map_err(io_err("cannot move back into place", &path))?;
                        }
                        report.restored.push(key);
                    }
                    None => report.unverified.push(path),
                }
            }
            _ => report.unverified.push(path),
        }
    }
    if !dry_run {
        ex.compact()?;
    }
    Ok(report)
}

/// The output digests that run records and lockfiles give for each key, with the stage.
fn recorded_outputs(workdir: &Workdir) -> HashMap<String, Vec<(String, String)>> {
    let mut out: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for id in record::list(workdir) {
        let run = Some(&id).filter(|id| readable(workdir, id, "run.json")).and_then(|id| record::load(workdir, id));
        for (stage, s) in run.map(|r| r.stages).unwrap_or_default() {
            if let (Some(key), Some(digest)) = (s.key, s.output_digest) {
                out.entry(key).or_default().push((stage, digest));
            }
        }
        let lock =
            Some(&id).filter(|id| readable(workdir, id, "mflow.lock")).and_then(|id| record::load_lock(workdir, id));
        for (stage, s) in lock.map(|l| l.stages).unwrap_or_default() {
            if let Some(digest) = s.output_digest {
                out.entry(s.key).or_default().push((stage, digest));
            }
        }
    }
    out
}

/// Whether a file of a run's record is a regular file (a FIFO there would block the read).
fn readable(workdir: &Workdir, id: &str, file: &str) -> bool {
    fs::symlink_metadata(workdir.run(id).join(file)).is_ok_and(|m| m.is_file())
}

/// The manifest of the output in `dir` when its digest is one recorded for `key`.
fn confirmed(dir: &Path, key: &str, recorded: &HashMap<String, Vec<(String, String)>>) -> Option<Manifest> {
    let files = Staged::list(dir).and_then(|s| s.hash()).ok()?;
    let digest = super::digest_of(&files);
    let (stage, _) = recorded.get(key)?.iter().find(|(_, d)| *d == digest)?;
    Some(Manifest { version: 1, key: key.to_string(), stage: stage.clone(), files, digest })
}

/// `path` with `.<what>` and the first free number appended.
fn free_name(path: &Path, what: &str) -> PathBuf {
    let base = path.as_os_str().to_string_lossy().into_owned();
    (1..)
        .map(|n| PathBuf::from(format!("{base}.{what}-{n}")))
        .find(|p| matches!(fs::symlink_metadata(p), Err(e) if e.kind() == io::ErrorKind::NotFound))
        .expect("a free name")
}
