//! One run, from a plan to its record: the record's first files, the dispatcher and its
//! reporters, then the executor, whose events the reporters read.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use mflow_contract::event::{PlannedStage, RunEvent};
use mflow_contract::lock::Lockfile;
use mflow_contract::record::RunRecord;
use mflow_contract::ExitCode;

use crate::cache::Store;
use crate::env::Environment;
use crate::plan::{Decision, Plan};
use crate::record::writer::RecordWriter;
use crate::reporter::console::{Console, Mode};
use crate::reporter::json::JsonLines;
use crate::reporter::{Dispatcher, Reporter};
use crate::workdir::Workdir;

pub struct Options {
    pub jobs: Option<usize>,
    pub force: Vec<String>,
    pub verify: bool,
    pub mode: Mode,
    pub overrides: Vec<String>,
    /// Reporters besides the record writer and the console (JUnit, the CI step summary).
    pub reporters: Vec<Box<dyn Reporter>>,
}

pub struct RunOutcome {
    pub record: RunRecord,
    pub workdir: Workdir,
    pub run_dir: PathBuf,
    pub exit: ExitCode,
    /// Handed back rather than freed: see `exec::RunOutcome`.
    pub plan: Option<Plan>,
    pub store: Option<Store>,
    /// Ends the process at a signal while the caller finishes (report, webhook): keep it.
    pub after: crate::exec::AfterStages,
}

/// Runs the plan on the spec's backend, connecting to it first.
pub async fn run(plan: Plan, env: Environment, opts: Options) -> Result<RunOutcome, crate::Error> {
    let backend = crate::backend::Backend::for_plan(&plan).await?;
    let store = Store::open(&plan.spec.workdir())?;
    run_on(plan, store, env, opts, backend).await
}

/// Runs the plan on a backend that is already connected and checked.
pub async fn run_on(
    plan: Plan,
    store: Store,
    env: Environment,
    opts: Options,
    backend: crate::backend::Backend,
) -> Result<RunOutcome, crate::Error> {
    let workdir = plan.spec.workdir();
    let last = crate::record::LastKeys::open(&workdir, &plan.spec.pipeline.name);
    let mut decisions = crate::plan::decide(&plan, &store, &last, &opts.force, false);
    drop(last);
    let planned: Vec<_> = decisions.iter_mut().map(|d| d.keyed.take()).collect();
    let all_cached = !opts.verify && decisions.iter().all(|d| matches!(d.decision, Decision::Cached { .. }));
    let started = crate::record::start::start(&workdir, &plan.spec.source, &opts.overrides, decisions, all_cached)
        .map_err(|e| crate::Error::io(workdir.root(), e))?;
    tracing::debug!("run record started");

    let writer = RecordWriter::new(workdir.clone(), started.dir.clone(), lock_header(&plan, &env, &opts), !all_cached);
    let changes = writer.changes();
    let mut reporters: Vec<Box<dyn Reporter>> = vec![Box::new(writer)];
    reporters.push(match opts.mode {
        Mode::Json => Box::new(JsonLines::new()),
        mode => Box::new(Console::new(mode)),
    });
    reporters.extend(opts.reporters);
    let dispatcher = Arc::new(Dispatcher::new(&started.id, reporters));
    dispatcher.emit(RunEvent::RunStarted {
        pipeline: plan.spec.pipeline.name.clone(),
        spec: plan.spec.path.display().to_string(),
        record: started.dir.display().to_string(),
        stages: plan
            .stages
            .iter()
            .map(|s| PlannedStage {
                name: s.spec.name.clone(),
                kind: s.spec.kind.name().into(),
                engine: s.engine.clone(),
            })
            .collect(),
        process: crate::backend::local::this_process(),
    });
    let keeper =
        tokio::spawn(crate::record::writer::keep_current(dispatcher.clone(), changes, started.dir.join("run.json")));
    let ids = crate::exec::RunIds { id: started.id.clone(), dir: started.dir.clone() };
    let exec_opts = crate::exec::Options { jobs: opts.jobs, force: opts.force, verify: opts.verify, run: ids };
    let outcome = crate::exec::run(plan, store, env, exec_opts, backend, planned, dispatcher.clone()).await;
    keeper.abort();
    let _ = keeper.await;
    let run_dir = started.dir.clone();
    started.join();
    let record = dispatcher.finish();
    outcome.after.recorded();
    let crate::exec::RunOutcome { exit, plan, store, after, .. } = outcome;
    Ok(RunOutcome { record, workdir, run_dir, exit, plan, store, after })
}

/// The lockfile without its stages: what the run's keys are locked with.
fn lock_header(plan: &Plan, env: &Environment, opts: &Options) -> Lockfile {
    let spec = &plan.spec;
    let mut environment = BTreeMap::new();
    environment.insert("python".into(), env.python_digest());
    environment.insert("gpus".into(), env.gpus.len().to_string());
    environment.insert("os".into(), format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH));
    Lockfile {
        version: mflow_contract::lock::FORMAT,
        mflow_version: env!("CARGO_PKG_VERSION").into(),
        pipeline: spec.pipeline.name.clone(),
        spec: spec.path.display().to_string(),
        spec_digest: blake3::hash(spec.source.as_bytes()).to_hex().to_string(),
        git_commit: crate::record::git_commit(&spec.dir),
        overrides: opts.overrides.clone(),
        environment,
        stages: BTreeMap::new(),
    }
}
