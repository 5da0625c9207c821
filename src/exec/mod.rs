//! The executor: runs a plan's stages in dependency order, in parallel where the DAG and the
//! resource pool allow, skipping verified cache hits, retrying failures by class, and keeping
//! the run record current.

pub mod display;
mod frontier;
pub mod gates;
pub mod pool;
pub mod retry;
mod stage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::{mpsc, watch, Mutex};

use crate::backend::{Cancel, Line};
use crate::cache::key::KeyParts;
use crate::cache::{Lookup, Store};
use crate::env::Environment;
use crate::plan::Plan;
use crate::record::{self, RunRecord, RunStatus, StageRecord, StageStatus};
use display::{Display, Mode};
use retry::FailureClass;

pub struct Options {
    pub jobs: Option<usize>,
    pub force: Vec<String>,
    pub verify: bool,
    pub mode: Mode,
    pub overrides: Vec<String>,
}

/// How a stage ended, for the scheduler.
#[derive(Debug, Clone)]
pub enum StageEnd {
    Done { digest: String, output: PathBuf, cached: bool },
    Failed { class: FailureClass, message: String },
}

/// How stale run.json may be while a run goes on: rewriting it costs time in proportion to the
/// number of stages (a 1000-stage record is about 1 MB).
const RECORD_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

pub struct RunOutcome {
    pub record: RunRecord,
    pub run_dir: PathBuf,
    /// The plan that ran, handed back rather than freed here: freeing a large plan is work
    /// that a process about to exit need not do. `None` if a task still held it.
    pub plan: Option<Plan>,
    /// The store, handed back for the same reason (its manifests of a large cache are 3% of
    /// a no-op of 5,000 stages to free); dropping it releases the run's cache locks.
    pub store: Option<Store>,
}

/// Newest checkpoint iteration a failed attempt of `key` left behind, if any.
pub fn resume_point(workdir: &Path, key: &str) -> Option<u64> {
    // The stage's scratch directory is its own: the note may be anything by now.
    let v = crate::untrusted::read_json(&scratch_dir(workdir, key).join("progress.json"), crate::untrusted::SMALL_JSON)?;
    v.get("checkpoint_iteration")?.as_u64()
}

pub fn scratch_dir(workdir: &Path, key: &str) -> PathBuf {
    workdir.join("scratch").join(key)
}

pub(crate) struct Shared {
    pub plan: Plan,
    pub env: Environment,
    pub store: Store,
    pub run_id: String,
    pub run_dir: PathBuf,
    pub record: Mutex<RunRecord>,
    /// Wakes the record writer; run.json is rewritten at most every `RECORD_INTERVAL`, not on
    /// every transition (a 1000-stage run would otherwise rewrite it thousands of times).
    pub record_changed: tokio::sync::Notify,
    pub display: Arc<std::sync::Mutex<Display>>,
    pub lines: mpsc::UnboundedSender<Line>,
    pub cancel: watch::Receiver<Cancel>,
    pub verify: bool,
    pub backend: crate::backend::Backend,
}

impl Shared {
    pub async fn update(&self, stage: &str, f: impl FnOnce(&mut StageRecord)) {
        let mut rec = self.record.lock().await;
        if let Some(s) = rec.stages.get_mut(stage) {
            f(s);
        }
        self.record_changed.notify_one();
    }

    pub fn show(&self, stage: &str, what: &str, detail: &str) {
        self.display.lock().unwrap().status(stage, what, detail);
    }
}

/// Runs the plan on the spec's backend, connecting to it first.
pub async fn run(mut plan: Plan, env: Environment, opts: Options) -> Result<RunOutcome, crate::Error> {
    crate::backend::choose(&mut plan.spec, None);
    let backend = crate::backend::Backend::for_plan(&plan).await?;
    let store = Store::open(&plan.spec.workdir())?;
    run_on(plan, store, env, opts, backend).await
}

/// Runs the plan on a backend that is already connected and checked.
pub async fn run_on(mut plan: Plan, store: Store, env: Environment, opts: Options, backend: crate::backend::Backend) -> Result<RunOutcome, crate::Error> {
    crate::backend::choose(&mut plan.spec, None);
    let workdir = plan.spec.workdir();
    let run_id = record::run_id_for(&workdir);
    let run_dir = record::runs_dir(&workdir).join(&run_id);
    std::fs::create_dir_all(run_dir.join("stages")).map_err(|e| crate::Error::io(&run_dir, e))?;
    // The spec as run; the same spec as the last run's is a link to that run's copy (a spec
    // of 5,000 stages is more than a megabyte).
    let source = plan.spec.source.as_bytes();
    record::lock::write_linked(&workdir, &run_id, "spec.toml", "spec.last", Some(record::lock::spec_identity(&plan.spec.source)), |p| std::fs::write(p, source))
        .map_err(|e| crate::Error::io(&run_dir, e))?;
    if !opts.overrides.is_empty() {
        let _ = std::fs::write(run_dir.join("overrides.txt"), opts.overrides.join("\n"));
    }
    let last = record::LastKeys::open(&workdir);
    let mut decisions = crate::plan::decide(&plan, &store, &last, &opts.force, false);
    tracing::debug!("decided");
    let mut planned_keys: Vec<Option<(String, KeyParts)>> = decisions.iter_mut().map(|d| d.keyed.take()).collect();

    let names: Vec<String> = plan.stages.iter().map(|s| s.spec.name.clone()).collect();
    let stages = plan
        .stages
        .iter()
        .map(|s| {
            (
                s.spec.name.clone(),
                StageRecord {
                    kind: s.spec.kind.name().into(),
                    status: StageStatus::Pending,
                    key: None,
                    output: None,
                    output_digest: None,
                    started: None,
                    finished: None,
                    duration_s: None,
                    attempts: vec![],
                    message: None,
                    gates: vec![],
                    metrics: None,
                    verification: None,
                    engine: s.engine.clone(),
                },
            )
        })
        .collect();
    let rec = RunRecord {
        id: run_id.clone(),
        pipeline: plan.spec.pipeline.name.clone(),
        spec: plan.spec.path.display().to_string(),
        started: record::now(),
        finished: None,
        status: RunStatus::Running,
        exit_code: None,
        mflow_version: env!("CARGO_PKG_VERSION").into(),
        stages,
        order: names.clone(),
    };
    let all_cached = !opts.verify && decisions.iter().all(|d| matches!(d.decision, crate::plan::Decision::Cached { .. }));
    // plan.json is written while the run starts; it is complete before the run ends.
    // The plan of a run where every stage is cached is the last such run's when the same
    // stages had the same keys: a link to that file then.
    let plan_writer = {
        let (workdir, run_id) = (workdir.clone(), run_id.clone());
        std::thread::spawn(move || {
            let identity = if all_cached { plan_identity(&decisions) } else { None };
            record::lock::write_linked(&workdir, &run_id, "plan.json", "plan.last", identity, |p| record::write_json(p, &decisions))
        })
    };
    // A run whose every stage was found cached (and is not rehashed) ends in milliseconds: its
    // record is written once, at the end, unless it lasts longer than the writer's interval
    // (the writer below writes it then). Every other run shows in `mflow runs` from its start.
    if !all_cached {
        let _ = record::write_json(&run_dir.join("run.json"), &rec);
    }
    tracing::debug!("run record started");

    let (cancel_tx, cancel_rx) = watch::channel(Cancel::None);
    let (line_tx, mut line_rx) = mpsc::unbounded_channel::<Line>();
    let jobs = opts.jobs.or(plan.spec.pipeline.jobs).unwrap_or(env.cpus).max(1);
    let mut pool = backend.pool(&env);
    let display = Arc::new(std::sync::Mutex::new(Display::new(opts.mode, &names)));
    let shared = Arc::new(Shared {
        display: display.clone(),
        plan,
        env,
        store,
        run_id: run_id.clone(),
        run_dir: run_dir.clone(),
        record: Mutex::new(rec),
        record_changed: tokio::sync::Notify::new(),
        lines: line_tx,
        cancel: cancel_rx,
        verify: opts.verify,
        backend,
    });

    // Output lines go to the display as they arrive.
    let printer = {
        let display = display.clone();
        tokio::spawn(async move {
            while let Some(l) = line_rx.recv().await {
                display.lock().unwrap().line(&l.stage, &l.text);
            }
        })
    };
    let record_writer = {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                shared.record_changed.notified().await;
                // Changes gather for an interval first: a run shorter than that (a no-op) has
                // its record written only at the start and the end.
                tokio::time::sleep(RECORD_INTERVAL).await;
                let rec = shared.record.lock().await.clone();
                // No await between here and the rename, so aborting this task never leaves a
                // write behind that could land after the final one.
                let _ = record::write_json(&shared.run_dir.join("run.json"), &rec);
            }
        })
    };
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signals = tokio::spawn(stop_on_signals(cancel_tx, interrupted.clone()));
    // mflow owns what its stages start, until every stage has ended.
    let owner = crate::backend::local::own_processes();

    let n = shared.plan.stages.len();
    let mut frontier = frontier::Frontier::new(&shared.plan);
    let mut running_count = 0usize;
    let mut missed: Vec<Option<String>> = vec![None; n];
    let mut keys: BTreeMap<String, (String, KeyParts)> = BTreeMap::new();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(usize, StageEnd, pool::Grant)>();
    loop {
        let cancelled = *shared.cancel.borrow() != Cancel::None;
        let mut from = 0;
        while let Some(i) = frontier.next(from) {
            from = i + 1;
            // A stage known to need a slot has nothing to do until one is free.
            if missed[i].is_some() && running_count >= jobs && !cancelled {
                continue;
            }
            let state = &frontier.ends;
            let st = &shared.plan.stages[i];
            let name = st.spec.name.as_str();
            // An upstream that failed, was skipped or cancelled stops this stage.
            if let Some(&d) = st.deps.iter().find(|&&d| matches!(state[d], Some(StageEnd::Failed { .. }))) {
                let up = shared.plan.stages[d].spec.name.clone();
                frontier.end(i, StageEnd::Failed { class: FailureClass::Cancelled, message: format!("upstream `{up}` did not succeed") });
                shared.update(name, |r| {
                    r.status = StageStatus::Skipped;
                    r.message = Some(format!("upstream `{up}` did not succeed"));
                })
                .await;
                shared.show(name, "skipped", &format!("upstream `{up}` did not succeed"));
                continue;
            }
            if cancelled {
                frontier.end(i, StageEnd::Failed { class: FailureClass::Cancelled, message: "run cancelled".into() });
                shared.update(name, |r| r.status = StageStatus::Cancelled).await;
                continue;
            }
            let forced = opts.force.iter().any(|f| f == name);
            // A ready stage waiting for a slot keeps its key and its cache miss; looking
            // again on every pass made scheduling quadratic in the number of ready stages.
            let key = match &missed[i] {
                Some(key) => key.clone(),
                None => {
                    // Planning keyed every stage whose upstream was cached; that key holds
                    // if the upstream outputs are the ones it assumed.
                    let planned = |parts: &KeyParts| {
                        st.deps.iter().all(|&d| matches!(&state[d], Some(StageEnd::Done { digest, .. }) if parts.upstream.get(&shared.plan.stages[d].spec.name) == Some(digest)))
                    };
                    let (key, parts) = match planned_keys[i].take() {
                        Some((key, parts)) if planned(&parts) => (key, parts),
                        _ => {
                            let digest_of = |d: usize| match &state[d] {
                                Some(StageEnd::Done { digest, .. }) => Some(digest.clone()),
                                _ => None,
                            };
                            let parts = shared.plan.parts_with(i, &digest_of).expect("upstream done");
                            (shared.plan.key(i, &parts), parts)
                        }
                    };
                    keys.insert(name.to_string(), (key.clone(), parts));
                    key
                }
            };
            if st.spec.cache && !forced && missed[i].is_none() {
                let lookup = if shared.verify {
                    // A rehash reads the whole entry: off this thread, so that running stages' pipes drain.
                    let (sh, k) = (shared.clone(), key.clone());
                    tokio::task::spawn_blocking(move || sh.store.lookup(&k, true)).await.expect("the lookup does not panic")
                } else {
                    shared.store.lookup(&key, false)
                };
                match lookup {
                    Lookup::Hit(m) => {
                        let output = shared.store.output_dir(&key);
                        shared
                            .update(name, |r| {
                                r.status = StageStatus::Cached;
                                r.key = Some(key.clone());
                                r.output = Some(output.display().to_string());
                                r.output_digest = Some(m.digest.clone());
                            })
                            .await;
                        shared.show(name, "cached", crate::cache::key::short(&key));
                        let end = match stage::check_gates(&shared, i, &output).await {
                            Some(message) => {
                                shared.update(name, |r| {
                                    r.status = StageStatus::Failed;
                                    r.message = Some(format!("gate: {message}"));
                                })
                                .await;
                                shared.show(name, "failed", &format!("gate: {message}"));
                                StageEnd::Failed { class: FailureClass::Gate, message }
                            }
                            None => StageEnd::Done { digest: m.digest.clone(), output, cached: true },
                        };
                        frontier.end(i, end);
                        continue;
                    }
                    Lookup::Corrupt(why) => {
                        tracing::warn!(stage = %name, "cache entry {key} is corrupt ({why}); running again");
                        shared.show(name, "warning", &format!("cache entry corrupt ({why}); running again"));
                    }
                    Lookup::Miss => {}
                }
            }
            missed[i] = Some(key.clone());
            if running_count >= jobs {
                continue;
            }
            if let Err(why) = pool.fits(&st.spec.resources) {
                frontier.end(i, StageEnd::Failed { class: FailureClass::User, message: why.clone() });
                shared.update(name, |r| {
                    r.status = StageStatus::Failed;
                    r.message = Some(why.clone());
                })
                .await;
                shared.show(name, "failed", &why);
                continue;
            }
            let Some(grant) = pool.take(&st.spec.resources) else { continue };
            running_count += 1;
            let upstream: BTreeMap<String, PathBuf> = st
                .deps
                .iter()
                .filter_map(|&d| match &state[d] {
                    Some(StageEnd::Done { output, .. }) => Some((shared.plan.stages[d].spec.name.clone(), output.clone())),
                    _ => None,
                })
                .collect();
            frontier.start(i);
            let shared2 = shared.clone();
            let tx = done_tx.clone();
            tokio::spawn(async move {
                let end = stage::run_stage(shared2, i, key, upstream, &grant, forced).await;
                let _ = tx.send((i, end, grant));
            });
        }
        shared.display.lock().unwrap().flush();
        if running_count == 0 {
            break;
        }
        let Some((i, end, grant)) = done_rx.recv().await else { break };
        pool.give(grant);
        running_count -= 1;
        frontier.end(i, end);
    }
    tracing::debug!("every stage ended");
    drop(owner);
    signals.abort();
    record_writer.abort();
    let _ = record_writer.await;
    drop(done_tx);

    last.save(&keys);
    let _ = plan_writer.join();
    // Every stage has ended: the stage records are taken, not copied (1000s of them).
    let mut rec = {
        let mut shared_rec = shared.record.lock().await;
        let stages = std::mem::take(&mut shared_rec.stages);
        RunRecord { stages, ..shared_rec.clone() }
    };
    let ends: Vec<&StageEnd> = frontier.ends.iter().flatten().collect();
    rec.status = if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
        RunStatus::Interrupted
    } else if *shared.cancel.borrow() != Cancel::None {
        RunStatus::Cancelled
    } else if ends.iter().all(|e| matches!(e, StageEnd::Done { .. })) && ends.len() == n {
        RunStatus::Succeeded
    } else {
        RunStatus::Failed
    };
    rec.finished = Some(record::now());
    let code = crate::exit::for_run(&rec);
    rec.exit_code = Some(code.code());
    // The two largest files of the record, written side by side.
    std::thread::scope(|s| {
        s.spawn(|| record::write_json(&run_dir.join("run.json"), &rec));
        write_lock(&shared, &rec, keys, &opts.overrides);
    });
    tracing::debug!("run record written");
    shared.display.lock().unwrap().finish();
    // The rest of `shared` goes, so that the printer sees its last line.
    let (plan, store) = Arc::try_unwrap(shared).ok().map(|sh| (sh.plan, sh.store)).unzip();
    let _ = printer.await;
    Ok(RunOutcome { record: rec, run_dir, plan, store })
}

/// A digest of everything that decides the bytes of plan.json when every stage is cached (the
/// reasons of stages that run would change with the last run's keys): each stage's name, kind,
/// needs, key and engine, and the binary that serializes them. `None` otherwise.
fn plan_identity(decisions: &[crate::plan::StageDecision]) -> Option<String> {
    let mut h = crate::cache::key::PartsHasher::default();
    h.part(b"mflow-plan-identity-1").part(crate::env::binary_identity()?);
    for d in decisions {
        let crate::plan::Decision::Cached { key } = &d.decision else { return None };
        h.part(d.stage.as_bytes()).part(d.kind.as_bytes()).part(d.needs.len().to_string().as_bytes());
        for n in &d.needs {
            h.part(n.as_bytes());
        }
        h.part(key.as_bytes()).part(&serde_json::to_vec(&d.engine).ok()?);
    }
    Some(h.hex())
}

/// Ctrl-C (SIGINT) cancels: running stages are stopped and their TrainJobs deleted. SIGTERM
/// and SIGHUP (an eviction, a Job deadline, a closed terminal) interrupt: mflow records the run
/// and leaves, TrainJobs keep running for the next `mflow run` to reattach to. A second signal
/// of either kind kills local stage processes at once. Returns on the second signal.
async fn stop_on_signals(cancel: watch::Sender<Cancel>, interrupted: Arc<std::sync::atomic::AtomicBool>) {
    use std::io::Write;
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()), signal(SignalKind::hangup())) else {
        return;
    };
    for count in 1..=2 {
        let level = tokio::select! {
            _ = int.recv() => Cancel::Graceful,
            _ = term.recv() => Cancel::Detach,
            _ = hup.recv() => Cancel::Detach,
        };
        let (level, say) = match (count, level) {
            (1, Cancel::Detach) => (level, "interrupted: stopping local stages, leaving TrainJobs running (`mflow run` again reattaches)"),
            (1, _) => (level, "stopping: terminating running stages (Ctrl-C again to kill)"),
            _ => (Cancel::Immediate, "killing running stages"),
        };
        if count == 1 && level == Cancel::Detach {
            interrupted.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // Not eprintln!: after a hangup the terminal is gone, and a failed write must keep
        // neither the stages from being stopped nor the run from being recorded.
        if writeln!(std::io::stderr(), "mflow: {say}").is_err() {
            stderr_to_null();
        }
        let _ = cancel.send(level);
    }
}

/// Points standard error at /dev/null: every later message of the run (the summary, warnings)
/// would otherwise fail, and `eprintln!` panics when it does.
fn stderr_to_null() {
    use std::os::fd::AsRawFd;
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2(2) on two descriptors that are open; it replaces fd 2 atomically.
        unsafe { libc::dup2(null.as_raw_fd(), libc::STDERR_FILENO) };
    }
}

fn write_lock(shared: &Shared, rec: &RunRecord, keys: BTreeMap<String, (String, KeyParts)>, overrides: &[String]) {
    let spec = &shared.plan.spec;
    let stages = keys
        .into_iter()
        .map(|(name, (key, parts))| {
            let sr = rec.stages.get(&name);
            let locked = record::LockedStage { kind: parts.kind.clone(), key, parts, output_digest: sr.and_then(|s| s.output_digest.clone()) };
            (name, locked)
        })
        .collect();
    let mut environment = BTreeMap::new();
    environment.insert("python".into(), shared.env.python_digest());
    environment.insert("gpus".into(), shared.env.gpus.len().to_string());
    environment.insert("os".into(), format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH));
    let lock = record::Lockfile {
        version: 1,
        mflow_version: env!("CARGO_PKG_VERSION").into(),
        pipeline: spec.pipeline.name.clone(),
        spec: spec.path.display().to_string(),
        spec_digest: blake3::hash(spec.source.as_bytes()).to_hex().to_string(),
        git_commit: record::git_commit(&spec.dir),
        overrides: overrides.to_vec(),
        environment,
        stages,
    };
    let _ = record::lock::write(&lock, &spec.workdir(), &shared.run_id);
}
