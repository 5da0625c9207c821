//! `mflow run` and `mflow render`: a spec run here, in a cluster, or shown as the objects a
//! cluster would get.

use super::args::{BackendChoice, RenderArgs, RunArgs};
use super::{load_plan, runtime, user_named, Printer};
use crate::backend::kubernetes::outside;
use crate::exit::ExitCode;
use crate::reporter::console::Mode;
use crate::spec::BackendKind;
use crate::{env::Environment, plan, spec, Error};

pub fn run(args: RunArgs, p: &Printer) -> Result<ExitCode, Error> {
    let path = args.spec.spec.clone();
    // What a run reads whatever its spec says (the default workdir's manifest log and input
    // stat cache) is read while the spec loads; nothing is written before the spec is checked.
    let ahead = {
        let workdir = spec::default_workdir(&path);
        std::thread::spawn(move || (crate::cache::LogRead::read(&workdir), plan::inputs::KnownInputs::read(&workdir)))
    };
    let mut s = spec::load_on(&path, &args.spec.set, args.backend.map(BackendChoice::kind))?;
    if let Some(f) = args.force.iter().find(|f| s.stage(f).is_none()) {
        return Err(plan::PlanError::UnknownStage(f.clone()).into());
    }
    s.keep_stages_for(&args.stages).map_err(plan::PlanError::UnknownStage)?;
    // Refused before anything runs: a report over the spec or into the workdir.
    let owned = crate::user_output::Owned::new(s.workdir().root()).spec(&path);
    for out in args.junit.iter().chain(&args.report) {
        user_named(&owned, out)?;
    }
    if let Some(f) = args.force.iter().find(|f| s.stage(f).is_none()) {
        return Err(plan::PlanError::NotSelected(f.clone()).into());
    }
    let on_cluster = s.pipeline.backend == BackendKind::Kubernetes;
    let env = Environment::detect(s.python.as_deref());
    let env = if on_cluster { env.stages_in_images() } else { env };
    let mode = Mode::detect(p.json(), p.quiet());
    if on_cluster && !args.dry_run && crate::backend::kubernetes::outside_cluster(&s) {
        // Outside the cluster: nothing is written here; the engine runs in the cluster.
        let plan = plan::build(s, &env)?;
        let opts = outside::RunOptions {
            overrides: args.spec.set.clone(),
            jobs: args.jobs,
            force: args.force.clone(),
            verify: args.verify,
            detach: args.detach,
            mode,
        };
        return runtime()?.block_on(outside::run(plan, &opts));
    }
    if args.detach {
        return Err(Error::usage(
            "--detach needs a run started outside the cluster",
            "it applies to `--backend kubernetes` where the artifact volume is not mounted",
        ));
    }
    let notify = s.notify.clone();
    let workdir = s.workdir();
    let store = crate::cache::Store::open(&workdir)?;
    let (log, known) = ahead.join().expect("reading ahead does not panic");
    if !store.adopt(log) {
        store.read_ahead();
    }
    let plan = plan::build_with(s, &env, Some(known))?;
    tracing::debug!(stages = plan.stages.len(), "planned");
    let rt = runtime()?;
    if args.dry_run {
        return dry_run(&plan, &rt, p);
    }
    // The run's JUnit file and the CI step summary read its events, as the console does.
    let mut reporters: Vec<Box<dyn crate::reporter::Reporter>> = vec![];
    if let Some(junit) = &args.junit {
        reporters.push(Box::new(crate::ci::reporters::CiReporter::junit(junit, &workdir, owned.clone())));
    }
    reporters.extend(crate::ci::reporters::CiReporter::step_summary(&workdir, owned).map(|r| Box::new(r) as _));
    let opts = crate::run::Options {
        jobs: args.jobs,
        force: args.force,
        verify: args.verify,
        mode,
        overrides: args.spec.set,
        reporters,
    };
    // A cluster that cannot run the plan is reported before anything starts.
    let backend = match rt.block_on(crate::backend::Backend::for_plan(&plan)) {
        Ok(b) => b,
        Err(e) => {
            let code = crate::exit::for_cluster(&e);
            p.diagnostic(e);
            return Ok(code);
        }
    };
    let outcome = rt.block_on(crate::run::run_on(plan, store, env, opts, backend))?;
    let id = outcome.record.id.clone();
    crate::ci::after_run::after_run(&outcome.workdir, &id, &path, args.report.as_deref(), notify.as_ref(), &rt);
    let code = outcome.exit;
    // The process ends right after (`_exit`): the record, plan and store of a large run are
    // not freed one allocation at a time first.
    std::mem::forget(outcome);
    Ok(code)
}

/// `mflow run --dry-run`: every object to the API server as a server-side dry run.
fn dry_run(plan: &plan::Plan, rt: &tokio::runtime::Runtime, p: &Printer) -> Result<ExitCode, Error> {
    if plan.spec.pipeline.backend != BackendKind::Kubernetes {
        return Err(Error::usage(
            "--dry-run needs the kubernetes backend",
            "pass --backend kubernetes; `mflow plan` shows what a local run would do",
        ));
    }
    let store = crate::cache::Store::open(&plan.spec.workdir())?;
    let results = match rt.block_on(crate::backend::kubernetes::render::dry_run(plan, &store)) {
        Ok(r) => r,
        Err(e) => {
            let code = crate::exit::for_cluster(&e);
            p.diagnostic(e);
            return Ok(code);
        }
    };
    let mut rejected = 0;
    for r in &results {
        let stage = if r.stage.is_empty() { String::new() } else { format!(" (stage {})", r.stage) };
        match &r.result {
            Ok(()) => p.line(format!("{}{stage}: accepted (server-side dry run)", r.name)),
            Err(e) => {
                rejected += 1;
                p.line(format!("{}{stage}: rejected: {}", r.name, e.explain()));
            }
        }
    }
    Ok(if rejected > 0 { ExitCode::Invalid } else { ExitCode::Success })
}

pub fn render(args: RenderArgs, p: &Printer) -> Result<ExitCode, Error> {
    let (plan, store) = load_plan(&args.spec.spec, &args.spec.set, Some(args.backend))?;
    if plan.spec.pipeline.backend != BackendKind::Kubernetes {
        return Err(Error::usage("only the kubernetes backend has objects to render", "pass --backend kubernetes"));
    }
    let yaml = crate::backend::kubernetes::render::render(&plan, &store)
        .map_err(|e| Error::usage(e.to_string(), e.explain()))?;
    p.out(&yaml);
    Ok(ExitCode::Success)
}
