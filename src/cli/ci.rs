//! The CI commands: `report`, `metrics diff`, `reproduce`, `schedule`.

use std::path::Path;

use serde_json::Value as Json;

use super::args::{MetricsCommand, ReportArgs, ReproduceArgs, ScheduleCommand};
use super::records::{connect_and, wanted};
use super::{user_named, Printer};
use crate::backend::kubernetes::outside;
use crate::ci::run_data::RunData;
use crate::ci::CiError;
use crate::exit::ExitCode;
use crate::reporter::console::Mode;
use crate::Error;

/// CI errors are reported here so that their exit codes follow the table.
fn finish(r: Result<ExitCode, CiError>) -> Result<ExitCode, Error> {
    match r {
        Ok(c) => Ok(c),
        Err(e) => {
            let code = e.exit_code();
            crate::errln!("{:?}", miette::Report::new(e));
            Ok(code)
        }
    }
}

pub fn report(a: ReportArgs, p: &Printer) -> Result<ExitCode, Error> {
    let dir = a.workdir.given();
    if wanted(&a.remote, &dir) {
        if a.png.is_some() {
            return Err(Error::usage(
                "--png is not available for a run in the cluster",
                "bring the report here without --png; its charts are in the HTML",
            ));
        }
        let (run, out) = (a.run.clone(), a.out.clone());
        if let Some(o) = &out {
            user_named(&crate::user_output::Owned::new(&dir), o)?;
        }
        return connect_and(&a.remote, |c, ns| async move {
            outside::records::report(&c, &ns, run.as_deref(), out.as_deref()).await
        });
    }
    let workdir = a.workdir.resolve_one(p)?;
    finish((|| -> Result<ExitCode, CiError> {
        let run = RunData::load(&workdir, a.run.as_deref())?;
        // A path the user names is the user's; the default is in the run's own record.
        let owned = crate::user_output::Owned::new(workdir.root());
        let out = match &a.out {
            Some(path) => crate::ci::report::Out::User(path, &owned),
            None => crate::ci::report::Out::Record(run.dir.join("report.html")),
        };
        let w = crate::ci::report::write(&run, out, a.png.as_deref().map(|d| (d, &owned)))?;
        p.line(w.html.display().to_string());
        for png in w.pngs {
            p.line(png.display().to_string());
        }
        Ok(ExitCode::Success)
    })())
}

pub fn metrics(c: MetricsCommand, p: &Printer) -> Result<ExitCode, Error> {
    let (run_a, run_b, workdir, fail_if) = match c {
        MetricsCommand::Show(a) => return super::inspect::stage_metrics(a, p),
        MetricsCommand::Diff { run_a, run_b, workdir, fail_if } => (run_a, run_b, workdir, fail_if),
    };
    let workdir = workdir.resolve_one(p)?;
    finish((|| -> Result<ExitCode, CiError> {
        let conditions = fail_if.iter().map(|c| crate::ci::diff::Condition::parse(c)).collect::<Result<Vec<_>, _>>()?;
        let a = RunData::load(&workdir, Some(&run_a))?;
        let b = RunData::load(&workdir, Some(&run_b))?;
        let out = crate::ci::diff::compare(&a.final_metrics(), &b.final_metrics(), &conditions);
        let failed = out.failures().next().is_some();
        if p.json() {
            p.value(&out.json(&a.id, &b.id), false);
        } else {
            p.line(format!("A = {}\nB = {}\n", a.id, b.id));
            p.out(&out.table());
            if !failed && !conditions.is_empty() {
                p.line(format!("\nall {} condition(s) passed", conditions.len()));
            }
        }
        if !failed {
            return Ok(ExitCode::Success);
        }
        p.note("");
        for f in out.failures() {
            p.note(format!("FAIL {f}"));
        }
        Ok(ExitCode::GateFailed)
    })())
}

pub fn reproduce(a: ReproduceArgs, p: &Printer) -> Result<ExitCode, Error> {
    let prepared = match crate::ci::reproduce::prepare(&a.workdir.resolve_one(p)?, &a.run) {
        Ok(Ok(p)) => p,
        Ok(Err(refusal)) => {
            p.note(format!("mflow: reproduce refused: run {} no longer matches its lockfile:", a.run));
            for r in refusal.0 {
                p.note(format!("  {r}"));
            }
            return Ok(ExitCode::Mismatch);
        }
        Err(e) => return finish(Err(e)),
    };
    p.note(format!(
        "mflow: every pinned digest matches; running {} stage(s) of the lockfile",
        prepared.lock.stages.len()
    ));
    let (code, lines) = crate::ci::reproduce::run(prepared, Mode::detect(p.json(), p.quiet()))?;
    for l in &lines {
        p.note(l);
    }
    match code {
        ExitCode::Success => p.note("reproduced: every stage's key equals the lockfile's"),
        ExitCode::Mismatch => p.note("mflow: not reproduced: some stage keys differ from the lockfile's"),
        _ => {}
    }
    Ok(code)
}

pub fn schedule(c: ScheduleCommand, p: &Printer) -> Result<ExitCode, Error> {
    match c {
        ScheduleCommand::Render { spec, namespace } => {
            let s = crate::spec::load(&spec.spec, &spec.set)?;
            let ns = namespace
                .or_else(|| s.pipeline.kubernetes.get("namespace").and_then(Json::as_str).map(str::to_string))
                .unwrap_or_else(|| "default".into());
            finish(crate::ci::schedule::render(&s, &ns).map(|o| {
                p.out(&o.to_yaml());
                ExitCode::Success
            }))
        }
        ScheduleCommand::Apply { spec } => {
            let s = crate::spec::load(&spec.spec, &spec.set)?;
            let rt = tokio::runtime::Runtime::new().map_err(|e| Error::io(Path::new("tokio runtime"), e))?;
            finish(rt.block_on(async {
                let (client, ns) = crate::ci::schedule::client(&s).await?;
                let objects = crate::ci::schedule::render(&s, &ns)?;
                for d in crate::ci::schedule::apply(&objects, client, &ns).await? {
                    p.line(format!("applied {d} (namespace {ns})"));
                }
                Ok(ExitCode::Success)
            }))
        }
    }
}
