//! The record writer: the reporter that keeps run.json current and writes mflow.lock when the
//! run ends. It holds no state of its own but the keys' parts: the record is the dispatcher's
//! fold of the events.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mflow_contract::event::RunEvent;
use mflow_contract::lock::{KeyParts, LockedStage, Lockfile};
use mflow_contract::record::RunRecord;

use crate::reporter::{Reporter, Stamp};

/// How stale run.json may be while a run goes on: rewriting it costs time in proportion to the
/// number of stages (a 1000-stage record is about 1 MB).
pub const RECORD_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// What the writer and the task that rewrites run.json share.
#[derive(Default)]
pub struct Changes {
    pub changed: tokio::sync::Notify,
    /// Set once the final record is written: nothing may be written after it.
    pub finished: AtomicBool,
}

pub struct RecordWriter {
    workdir: crate::workdir::Workdir,
    run_dir: PathBuf,
    /// The lockfile without its stages, which the run's keys fill in.
    lock: Lockfile,
    keys: BTreeMap<String, (String, Arc<KeyParts>)>,
    /// Whether run.json is written when the run starts: a run whose every stage was found
    /// cached while planning ends in milliseconds, and its record is written once, at the end.
    write_at_start: bool,
    changes: Arc<Changes>,
}

impl RecordWriter {
    pub fn new(
        workdir: crate::workdir::Workdir,
        run_dir: PathBuf,
        lock: Lockfile,
        write_at_start: bool,
    ) -> RecordWriter {
        RecordWriter { workdir, run_dir, lock, keys: BTreeMap::new(), write_at_start, changes: Arc::default() }
    }

    pub fn changes(&self) -> Arc<Changes> {
        self.changes.clone()
    }

    fn write_final(&mut self, record: &RunRecord) {
        self.changes.finished.store(true, Ordering::SeqCst);
        let mut lock = std::mem::replace(&mut self.lock, empty_lock());
        lock.stages = std::mem::take(&mut self.keys)
            .into_iter()
            .map(|(name, (key, parts))| {
                let output_digest = record.stages.get(&name).and_then(|s| s.output_digest.clone());
                (name, LockedStage { kind: parts.kind.clone(), key, parts, output_digest })
            })
            .collect();
        // The two largest files of the record, written side by side.
        std::thread::scope(|s| {
            s.spawn(|| super::write_json(&self.run_dir.join("run.json"), record));
            let _ = super::lock::write(&lock, &self.workdir, &record.id);
        });
    }
}

impl Reporter for RecordWriter {
    fn event(&mut self, _run: &str, _at: &Stamp, ev: &RunEvent, record: &RunRecord) {
        match ev {
            RunEvent::RunStarted { .. } => {
                if self.write_at_start {
                    let _ = super::write_json(&self.run_dir.join("run.json"), record);
                }
            }
            RunEvent::StageKeyed { stage, key, parts: Some(parts) } => {
                self.keys.insert(stage.clone(), (key.clone(), parts.clone()));
            }
            RunEvent::RunFinished { .. } => self.write_final(record),
            // Lines and progress change nothing in the record.
            RunEvent::Output { .. } | RunEvent::Progress { .. } => {}
            _ => self.changes.changed.notify_one(),
        }
    }
}

/// Rewrites run.json at most every [`RECORD_INTERVAL`] while the run goes on, from the
/// dispatcher's record; stops once the final record is written.
pub async fn keep_current(dispatcher: Arc<crate::reporter::Dispatcher>, changes: Arc<Changes>, path: PathBuf) {
    loop {
        changes.changed.notified().await;
        // Changes gather for an interval first: a run shorter than that (a no-op) has its
        // record written only at the start and the end.
        tokio::time::sleep(RECORD_INTERVAL).await;
        // No await between this check and the rename: the final write cannot come between.
        if changes.finished.load(Ordering::SeqCst) {
            return;
        }
        let _ = super::write_json(&path, &dispatcher.snapshot());
    }
}

fn empty_lock() -> Lockfile {
    Lockfile {
        version: mflow_contract::lock::FORMAT,
        mflow_version: String::new(),
        pipeline: String::new(),
        spec: String::new(),
        spec_digest: String::new(),
        git_commit: None,
        overrides: vec![],
        environment: BTreeMap::new(),
        stages: BTreeMap::new(),
    }
}
