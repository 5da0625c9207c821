//! The executor: runs a plan's stages in dependency order, in parallel where the DAG and the
//! resource pool allow, skipping verified cache hits and retrying failures by class. It says
//! what happens only as typed run events ([`EventSink`]): it writes neither the display nor the
//! record.

mod frontier;
mod given;
mod progress;
pub mod retry;
pub(crate) mod signals;
mod stage;

pub use signals::AfterStages;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use mflow_contract::event::{Counts, RunEvent, StageGate};
use mflow_contract::lock::KeyParts;
use mflow_contract::record::{RunStatus, StageStatus};
use mflow_contract::{ExitCode, FailureClass};
use tokio::sync::{mpsc, watch};

use crate::backend::{Cancel, Lines, Printed};
use crate::cache::{Lookup, Store};
use crate::env::Environment;
use crate::plan::Plan;

/// Where the executor's events go.
pub trait EventSink: Send + Sync {
    fn emit(&self, event: RunEvent);
}

pub struct Options {
    pub jobs: Option<usize>,
    pub force: Vec<String>,
    pub verify: bool,
    /// The run these options are for.
    pub run: RunIds,
}

/// The run the executor works for: its id and record directory.
pub struct RunIds {
    pub id: String,
    pub dir: PathBuf,
}

/// How a stage ended, for the scheduler.
#[derive(Debug, Clone)]
pub enum StageEnd {
    Done {
        digest: String,
        output: PathBuf,
        cached: bool,
    },
    /// Ended without an output: failed (with its class), skipped, cancelled or interrupted.
    NotDone {
        status: StageStatus,
        class: Option<FailureClass>,
    },
}

impl StageEnd {
    fn failed(class: FailureClass) -> StageEnd {
        let status = if class == FailureClass::Cancelled { StageStatus::Cancelled } else { StageStatus::Failed };
        StageEnd::NotDone { status, class: Some(class) }
    }
}

pub struct RunOutcome {
    pub status: RunStatus,
    pub exit: ExitCode,
    /// The plan that ran, handed back rather than freed here: freeing a large plan is work
    /// that a process about to exit need not do. `None` if a task still held it.
    pub plan: Option<Plan>,
    /// The store, handed back for the same reason (its manifests of a large cache are 3% of
    /// a no-op of 5,000 stages to free); dropping it releases the run's cache locks.
    pub store: Option<Store>,
    /// Signals from the end of the stages on; kept for as long as the command has work left.
    pub after: AfterStages,
}

pub(crate) struct Shared {
    pub plan: Plan,
    pub env: Environment,
    pub store: Store,
    pub run: RunIds,
    pub events: Arc<dyn EventSink>,
    pub lines: Lines,
    pub cancel: watch::Receiver<Cancel>,
    pub verify: bool,
    pub backend: crate::backend::Backend,
}

impl Shared {
    pub fn emit(&self, ev: RunEvent) {
        self.events.emit(ev);
    }

    /// Runs an attempt's job on the backend; every line it printed is said when this returns,
    /// so before the attempt's end is.
    pub async fn run_job(&self, job: &crate::backend::Job) -> crate::backend::Outcome {
        let outcome = self.backend.run(job, self.lines.clone(), self.cancel.clone()).await;
        self.lines.said().await;
        outcome
    }
}

/// What the scheduler keeps while the run goes on.
struct Tally {
    keys: BTreeMap<String, (String, Arc<KeyParts>)>,
    gates: Vec<StageGate>,
}

/// Runs the plan on a backend that is already connected and checked. `planned`: the keys that
/// planning computed, by stage index. Every stage ends before this returns, and its last event
/// is `RunFinished`.
pub async fn run(
    plan: Plan,
    store: Store,
    env: Environment,
    opts: Options,
    backend: crate::backend::Backend,
    planned: Vec<Option<(String, KeyParts)>>,
    events: Arc<dyn EventSink>,
) -> RunOutcome {
    let (cancel_tx, cancel_rx) = watch::channel(Cancel::None);
    let (line_tx, line_rx) = Lines::channel();
    let jobs = opts.jobs.or(plan.spec.pipeline.jobs).unwrap_or(env.cpus).max(1);
    let pool = backend.pool(&env);
    let shared = Arc::new(Shared {
        plan,
        env,
        store,
        run: opts.run,
        events: events.clone(),
        lines: line_tx,
        cancel: cancel_rx,
        verify: opts.verify,
        backend,
    });
    let printer = tokio::spawn(print(line_rx, events));
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signals = tokio::spawn(signals::stop_on_signals(cancel_tx, interrupted.clone()));
    // mflow owns what its stages start, until every stage has ended.
    let owner = crate::backend::local::own_processes();

    let (ends, tally) = schedule(&shared, &opts.force, jobs, pool, planned).await;
    tracing::debug!("every stage ended");
    drop(owner);
    // Signals are heard from here on without a gap, and no longer change how the run ended.
    let interrupted = interrupted.load(std::sync::atomic::Ordering::SeqCst);
    let cancelled = *shared.cancel.borrow() != Cancel::None;
    let after = AfterStages::start(cancelled.then_some(if interrupted { Cancel::Detach } else { Cancel::Graceful }));
    signals.abort();
    // Every line the stages printed is said before the run's end.
    shared.lines.said().await;
    printer.abort();

    let workdir = shared.plan.spec.workdir();
    crate::record::LastKeys::open(&workdir, &shared.plan.spec.pipeline.name).save(&tally.keys);
    let status = if interrupted {
        RunStatus::Interrupted
    } else if cancelled {
        RunStatus::Cancelled
    } else if ends.iter().all(|e| matches!(e, Some(StageEnd::Done { .. }))) {
        RunStatus::Succeeded
    } else {
        RunStatus::Failed
    };
    let (counts, classes) = count(&ends);
    let exit = ExitCode::for_ending(status, &classes);
    shared.emit(RunEvent::RunFinished {
        status,
        exit_code: exit.code(),
        counts,
        gates: tally.gates,
        record: shared.run.dir.display().to_string(),
    });
    let (plan, store) = Arc::try_unwrap(shared).ok().map(|sh| (sh.plan, sh.store)).unzip();
    RunOutcome { status, exit, plan, store, after }
}

/// Output lines become events in the order they were sent.
async fn print(mut rx: mpsc::Receiver<Printed>, events: Arc<dyn EventSink>) {
    while let Some(p) = rx.recv().await {
        match p {
            Printed::Line(l, _permit) => {
                events.emit(RunEvent::Output { stage: l.stage, attempt: l.attempt, line: l.text })
            }
            Printed::Said(ack) => {
                let _ = ack.send(());
            }
        }
    }
}

/// Stages by how they ended, and the classes of the failed ones.
fn count(ends: &[Option<StageEnd>]) -> (Counts, Vec<FailureClass>) {
    let mut c = Counts::default();
    let mut classes = vec![];
    for end in ends.iter().flatten() {
        match end {
            StageEnd::Done { cached: true, .. } => c.cached += 1,
            StageEnd::Done { cached: false, .. } => c.ran += 1,
            StageEnd::NotDone { status: StageStatus::Failed, class } => {
                c.failed += 1;
                classes.extend(*class);
            }
            StageEnd::NotDone { status: StageStatus::Interrupted, .. } => c.interrupted += 1,
            StageEnd::NotDone { .. } => c.skipped += 1,
        }
    }
    (c, classes)
}

/// The scheduling loop: starts ready stages bounded by `jobs` and the resource pool, until every
/// stage has ended.
async fn schedule(
    shared: &Arc<Shared>,
    force: &[String],
    jobs: usize,
    mut pool: crate::backend::pool::Pool,
    mut planned: Vec<Option<(String, KeyParts)>>,
) -> (Vec<Option<StageEnd>>, Tally) {
    let n = shared.plan.stages.len();
    let mut frontier = frontier::Frontier::new(&shared.plan);
    let mut running = 0usize;
    let mut missed: Vec<Option<String>> = vec![None; n];
    let mut tally = Tally { keys: BTreeMap::new(), gates: vec![] };
    let (done_tx, mut done_rx) =
        mpsc::unbounded_channel::<(usize, StageEnd, Vec<StageGate>, crate::backend::pool::Grant)>();
    loop {
        let cancelled = *shared.cancel.borrow() != Cancel::None;
        let mut from = 0;
        while let Some(i) = frontier.next(from) {
            from = i + 1;
            // A stage known to need a slot has nothing to do until one is free.
            if missed[i].is_some() && running >= jobs && !cancelled {
                continue;
            }
            let st = &shared.plan.stages[i];
            let name = st.spec.name.as_str();
            // An upstream that failed, was skipped or cancelled stops this stage.
            if let Some(&d) = st.deps.iter().find(|&&d| matches!(frontier.ends[d], Some(StageEnd::NotDone { .. }))) {
                let up = &shared.plan.stages[d].spec.name;
                shared.emit(RunEvent::StageSkipped {
                    stage: name.to_string(),
                    reason: format!("upstream `{up}` did not succeed"),
                });
                frontier.end(i, StageEnd::NotDone { status: StageStatus::Skipped, class: None });
                continue;
            }
            if cancelled {
                shared.emit(RunEvent::StageCancelled { stage: name.to_string() });
                frontier.end(i, StageEnd::NotDone { status: StageStatus::Cancelled, class: None });
                continue;
            }
            let forced = force.iter().any(|f| f == name);
            // A ready stage waiting for a slot keeps its key and its cache miss; looking
            // again on every pass made scheduling quadratic in the number of ready stages.
            let key = match &missed[i] {
                Some(key) => key.clone(),
                None => key_stage(shared, i, &frontier.ends, &mut planned, &mut tally),
            };
            if st.spec.cache && !forced && missed[i].is_none() {
                if let Some(end) = look_up(shared, i, &key, &mut tally).await {
                    frontier.end(i, end);
                    continue;
                }
            }
            missed[i] = Some(key.clone());
            if running >= jobs {
                continue;
            }
            if let Err(why) = pool.fits(&st.spec.resources) {
                shared.emit(RunEvent::StageFailed { stage: name.to_string(), class: FailureClass::User, message: why });
                frontier.end(i, StageEnd::failed(FailureClass::User));
                continue;
            }
            let Some(grant) = pool.take(&st.spec.resources) else { continue };
            running += 1;
            let upstream: BTreeMap<String, PathBuf> = st
                .deps
                .iter()
                .filter_map(|&d| match &frontier.ends[d] {
                    Some(StageEnd::Done { output, .. }) => {
                        Some((shared.plan.stages[d].spec.name.clone(), output.clone()))
                    }
                    _ => None,
                })
                .collect();
            frontier.start(i);
            let (shared2, tx) = (shared.clone(), done_tx.clone());
            tokio::spawn(async move {
                let mut gates = vec![];
                let end = stage::run_stage(shared2, i, key, upstream, &grant, forced, &mut gates).await;
                let _ = tx.send((i, end, gates, grant));
            });
        }
        if running == 0 {
            break;
        }
        let Some((i, end, gates, grant)) = done_rx.recv().await else { break };
        tally.gates.extend(gates);
        pool.give(grant);
        running -= 1;
        frontier.end(i, end);
    }
    (frontier.ends, tally)
}

/// Stage `i`'s key, now that its upstream stages have ended: planning keyed every stage whose
/// upstream was cached, and that key holds if the upstream outputs are the ones it assumed.
fn key_stage(
    shared: &Shared,
    i: usize,
    ends: &[Option<StageEnd>],
    planned: &mut [Option<(String, KeyParts)>],
    tally: &mut Tally,
) -> String {
    let st = &shared.plan.stages[i];
    let digest_of = |d: usize| match &ends[d] {
        Some(StageEnd::Done { digest, .. }) => Some(digest.clone()),
        _ => None,
    };
    let assumed = |parts: &KeyParts| {
        st.deps.iter().all(|&d| {
            digest_of(d).is_some_and(|digest| parts.upstream.get(&shared.plan.stages[d].spec.name) == Some(&digest))
        })
    };
    let (key, parts) = match planned[i].take() {
        Some((key, parts)) if assumed(&parts) => (key, parts),
        _ => {
            let parts = shared.plan.parts_with(i, &digest_of).expect("upstream done");
            (shared.plan.key(i, &parts), parts)
        }
    };
    let parts = Arc::new(parts);
    let name = st.spec.name.clone();
    shared.emit(RunEvent::StageKeyed { stage: name.clone(), key: key.clone(), parts: Some(parts.clone()) });
    tally.keys.insert(name, (key.clone(), parts));
    key
}

/// Stage `i`'s cache entry, if it has a good one: the stage ends there (its gates checked).
async fn look_up(shared: &Arc<Shared>, i: usize, key: &str, tally: &mut Tally) -> Option<StageEnd> {
    let name = &shared.plan.stages[i].spec.name;
    let lookup = if shared.verify {
        // A rehash reads the whole entry: off this thread, so that running stages' pipes drain.
        let (sh, k) = (shared.clone(), key.to_string());
        tokio::task::spawn_blocking(move || sh.store.lookup(&k, true)).await.expect("the lookup does not panic")
    } else {
        shared.store.lookup(key, false)
    };
    match lookup {
        Lookup::Hit(m) => Some(stage::cached(shared, i, key, &m.digest, false, &mut tally.gates).await),
        Lookup::Corrupt(why) => {
            tracing::warn!(stage = %name, "cache entry {key} is corrupt ({why}); running again");
            let message = format!("cache entry corrupt ({why}); running again");
            shared.emit(RunEvent::Warning { stage: Some(name.clone()), message });
            None
        }
        Lookup::Miss => None,
    }
}
