//! Writing mflow.lock. A lockfile holds what makes a run reproducible and nothing that changes
//! from run to run by itself (no time, no run id), so two runs that locked the same things have
//! the same lockfile. A run whose lockfile would be the last one written links that file instead
//! of serializing it again: the lockfile of a no-op of 1000 stages is 700 KB.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::{write_atomic, write_json, Lockfile};
use crate::workdir::Workdir;

/// Bumped when what `identity` covers changes.
const FORMAT: &[u8] = b"mflow-lock-identity-1";

/// Writes `lock` as the lockfile of run `run`, or links the last lockfile written in this
/// workdir when it has the same identity and is the file that was written (not replaced or
/// edited since).
pub fn write(lock: &Lockfile, workdir: &Workdir, run: &str) -> std::io::Result<()> {
    write_linked(workdir, run, "mflow.lock", "lock.last", identity(lock), |path| write_json(path, lock))
}

/// Writes the record file `name` of run `run` with `write`, or links the last one written in
/// this workdir (remembered in `state/<last>`) when its `identity` (a digest of everything that
/// decides the file's bytes) is the same and the file is still the one that was written.
pub fn write_linked(
    workdir: &Workdir,
    run: &str,
    name: &str,
    last: &str,
    identity: Option<String>,
    write: impl FnOnce(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let path = workdir.run(run).join(name);
    let last_file = workdir.state_file(last);
    if let Some(last) = Last::read(&last_file) {
        let last_path = workdir.run(&last.run).join(name);
        if identity.as_deref() == Some(last.identity.as_str())
            && file_stamp(&last_path).as_deref() == Some(last.stamp.as_str())
            && std::fs::hard_link(&last_path, &path).is_ok()
        {
            return Ok(());
        }
    }
    write(&path)?;
    // Remembered only when the identity is known; a failure here costs the next run a write.
    if let (Some(identity), Some(stamp)) = (identity, file_stamp(&path)) {
        let line = format!("{identity} {stamp} {run}\n");
        let _ = std::fs::create_dir_all(workdir.state()).and_then(|()| write_atomic(&last_file, line.as_bytes()));
    }
    Ok(())
}

/// The identity of a run's copy of its spec, for [`write_linked`]: the copy is the spec's bytes.
pub fn spec_identity(source: &str) -> String {
    let mut h = crate::cache::key::PartsHasher::default();
    h.part(b"mflow-spec-copy-1").part(source.as_bytes());
    h.hex()
}

/// Which file is at `path` and how it was last written: inode, size and mtime.
fn file_stamp(path: &Path) -> Option<String> {
    let m = std::fs::metadata(path).ok()?;
    Some(format!("{}:{}:{}.{}", m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
}

/// The last lockfile written: its identity, its stamp and its run.
struct Last {
    identity: String,
    stamp: String,
    run: String,
}

impl Last {
    fn read(file: &Path) -> Option<Last> {
        let text = String::from_utf8(crate::cache::read_regular(file, 4096).ok()?).ok()?;
        let mut parts = text.trim_end_matches('\n').split(' ');
        let (identity, stamp, run) = (parts.next()?, parts.next()?, parts.next()?);
        // A run id, so that the file linked is a lockfile of this workdir.
        if parts.next().is_some() || !crate::spec::valid_name(&format!("r{run}")) {
            return None;
        }
        Some(Last { identity: identity.into(), stamp: stamp.into(), run: run.into() })
    }
}

/// A digest of everything that decides a lockfile's bytes: the header, each stage's name, kind,
/// key and output digest (a key decides its parts; the order of their parameters follows the
/// spec, whose digest is in the header), and the binary that serializes them. `None` when the
/// binary cannot be identified.
fn identity(lock: &Lockfile) -> Option<String> {
    let mut h = crate::cache::key::PartsHasher::default();
    h.part(FORMAT).part(crate::env::binary_identity()?);
    let header = (
        lock.version,
        &lock.mflow_version,
        &lock.pipeline,
        &lock.spec,
        &lock.spec_digest,
        &lock.git_commit,
        &lock.overrides,
        &lock.environment,
    );
    h.part(&serde_json::to_vec(&header).expect("a lockfile header serializes"));
    for (name, s) in &lock.stages {
        h.part(name.as_bytes())
            .part(s.kind.as_bytes())
            .part(s.key.as_bytes())
            .part(s.output_digest.as_deref().unwrap_or("-").as_bytes());
    }
    Some(h.hex())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::cache::key::KeyParts;
    use crate::record::LockedStage;

    fn lock(salt: &str, digest: Option<&str>) -> Lockfile {
        let parts = KeyParts {
            kind: "command".into(),
            kind_version: 1,
            params: std::sync::Arc::new(serde_json::json!({"run": ["true"], "b": 1})),
            upstream: BTreeMap::new(),
            inputs: Default::default(),
            workload: String::new(),
            environment: String::new(),
            salt: salt.into(),
        };
        let stage = LockedStage {
            kind: "command".into(),
            key: parts.key(),
            parts: std::sync::Arc::new(parts),
            output_digest: digest.map(str::to_string),
        };
        Lockfile {
            version: 1,
            mflow_version: "0".into(),
            pipeline: "p".into(),
            spec: "p.toml".into(),
            spec_digest: "s".into(),
            git_commit: None,
            overrides: vec![],
            environment: BTreeMap::new(),
            stages: BTreeMap::from([("a".to_string(), stage)]),
        }
    }

    /// Writes `lock` as run `id`'s lockfile; returns its path.
    fn write_run(work: &Path, id: &str, lock: &Lockfile) -> std::path::PathBuf {
        let work = Workdir::new(work);
        std::fs::create_dir_all(work.run(id)).unwrap();
        write(lock, &work, id).unwrap();
        work.run(id).join("mflow.lock")
    }

    #[test]
    fn the_same_spec_copy_is_linked_and_another_is_written() {
        let work = tempfile::tempdir().unwrap();
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        let copy = |id: &str, text: &str| {
            let w = Workdir::new(work.path());
            std::fs::create_dir_all(w.run(id)).unwrap();
            write_linked(&w, id, "spec.toml", "spec.last", Some(spec_identity(text)), |p| std::fs::write(p, text))
                .unwrap();
            w.run(id).join("spec.toml")
        };
        let one = copy("1", "a = 1\n");
        let two = copy("2", "a = 1\n");
        assert_eq!(ino(&one), ino(&two), "the same spec is linked");
        let three = copy("3", "a = 2\n");
        assert_ne!(ino(&two), ino(&three));
        assert_eq!(std::fs::read_to_string(&three).unwrap(), "a = 2\n");
        // A copy edited since it was written is not linked.
        std::fs::write(&three, "edited\n").unwrap();
        let four = copy("4", "a = 2\n");
        assert_ne!(ino(&three), ino(&four));
        assert_eq!(std::fs::read_to_string(&four).unwrap(), "a = 2\n");
    }

    #[test]
    fn the_same_lock_is_linked_and_another_is_written() {
        let work = tempfile::tempdir().unwrap();
        let one = write_run(work.path(), "1", &lock("", Some("d")));
        let two = write_run(work.path(), "2", &lock("", Some("d")));
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&one), ino(&two), "an unchanged lockfile is linked");
        // Another output digest is another lockfile.
        let three = write_run(work.path(), "3", &lock("", Some("e")));
        assert_ne!(ino(&three), ino(&two));
        let written: Lockfile = serde_json::from_slice(&std::fs::read(&three).unwrap()).unwrap();
        assert_eq!(written.stages["a"].output_digest.as_deref(), Some("e"));
    }

    #[test]
    fn an_edited_last_lockfile_is_not_linked() {
        let work = tempfile::tempdir().unwrap();
        let one = write_run(work.path(), "1", &lock("", Some("d")));
        // Other bytes in place: the next run writes its own.
        std::fs::write(&one, b"{}").unwrap();
        let two = write_run(work.path(), "2", &lock("", Some("d")));
        let text = std::fs::read_to_string(&two).unwrap();
        let mut expected = Vec::new();
        serde::Serialize::serialize(
            &lock("", Some("d")),
            &mut serde_json::Serializer::with_formatter(&mut expected, super::super::lines::Lines::default()),
        )
        .unwrap();
        assert_eq!(text.as_bytes(), expected.as_slice());
    }

    #[test]
    fn a_last_lockfile_named_outside_the_workdir_is_not_linked() {
        let work = tempfile::tempdir().unwrap();
        write_run(work.path(), "1", &lock("", Some("d")));
        let last = work.path().join("state/lock.last");
        let text = std::fs::read_to_string(&last).unwrap();
        let (head, _) = text.rsplit_once(' ').unwrap();
        for run in ["../../elsewhere", "/etc", "1 2"] {
            std::fs::write(&last, format!("{head} {run}\n")).unwrap();
            assert!(Last::read(&last).is_none(), "{run}");
        }
    }

    #[test]
    fn identity_covers_the_header_and_every_stage() {
        let base = identity(&lock("", Some("d"))).unwrap();
        assert_eq!(identity(&lock("", Some("d"))).unwrap(), base);
        assert_ne!(identity(&lock("x", Some("d"))).unwrap(), base, "another key");
        assert_ne!(identity(&lock("", None)).unwrap(), base, "no output");
        let mut l = lock("", Some("d"));
        l.overrides.push("vars.a=1".into());
        assert_ne!(identity(&l).unwrap(), base, "overrides");
        let mut l = lock("", Some("d"));
        l.git_commit = Some("abc".into());
        assert_ne!(identity(&l).unwrap(), base, "git commit");
    }
}
