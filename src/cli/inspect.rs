//! The commands that look and change nothing: `plan`, `why`, `validate`, `schema`, `output`,
//! `metrics show`.

use std::path::Path;

use super::args::{OutputArgs, OutputFormat, PlanArgs, SchemaFormat, SpecArgs, WhyArgs};
use super::{load_plan, runtime, user_named, Printer};
use crate::backend::kubernetes::outside;
use crate::exit::ExitCode;
use crate::spec::BackendKind;
use crate::{plan, record, spec, Error};

pub fn plan(a: PlanArgs, p: &Printer) -> Result<ExitCode, Error> {
    let (plan, store) = load_plan(&a.spec.spec, &a.spec.set, a.backend)?;
    let last = record::LastKeys::open(&plan.spec.workdir(), &plan.spec.pipeline.name);
    let mut decisions = plan::decide(&plan, &store, &last, &[], a.verify);
    if plan.spec.pipeline.backend == BackendKind::Kubernetes {
        cluster_cached(&plan.spec, &mut decisions, p);
    }
    if a.format.map_or(p.json(), |f| f == OutputFormat::Json) {
        p.value(&decisions, false);
    } else {
        p.out(&render_plan(&decisions));
        let (root, found) = crate::project::find(&plan.spec.dir);
        // A note for people: standard output stays the plan's table.
        p.note(format!("project: {} ({})", root.display(), found.describe()));
    }
    Ok(ExitCode::Success)
}

pub fn why(a: WhyArgs, p: &Printer) -> Result<ExitCode, Error> {
    let (plan, store) = load_plan(&a.spec, &a.set, None)?;
    let stage = a.stage;
    let i = plan.index(&stage).ok_or_else(|| plan::PlanError::UnknownStage(stage.clone()))?;
    let last = record::LastKeys::open(&plan.spec.workdir(), &plan.spec.pipeline.name);
    let decisions = plan::decide(&plan, &store, &last, &[], false);
    let old = last.get(&stage);
    // Upstream digests as they are now (cached ones), else as last recorded.
    let digest = |d: usize| -> Option<String> {
        let n = &plan.stages[d].spec.name;
        match &decisions[d].decision {
            plan::Decision::Cached { key } => store.manifest(key).map(|m| m.digest.clone()),
            _ => last.get(&stage).and_then(|o| o.upstream.get(n).cloned()),
        }
    };
    match (plan.parts_with(i, &digest), old) {
        (_, None) => p.line(format!("{stage}: never ran in this workdir")),
        (None, Some(_)) => p.line(format!("{stage}: an upstream stage has no recorded output yet")),
        (Some(now), Some(old)) => {
            let diff = crate::cache::key::diff(&now, old);
            let short = crate::cache::key::short;
            if diff.is_empty() {
                p.line(format!("{stage}: key unchanged ({})", short(&now.key())));
            } else {
                p.line(format!("{stage}: key {} -> {}", short(&old.key()), short(&now.key())));
                for line in diff {
                    p.line(format!("  {line}"));
                }
            }
        }
    }
    p.line(format!("decision: {}", describe(&decisions[i].decision)));
    Ok(ExitCode::Success)
}

pub fn validate(a: SpecArgs, p: &Printer) -> Result<ExitCode, Error> {
    let checked =
        spec::load(&a.spec, &a.set).map_err(Error::from).and_then(|s| plan::check(&s).map(|()| s).map_err(Error::from));
    let s = match checked {
        Ok(s) => s,
        Err(e) if p.json() => {
            // Programs read standard output: the verdict goes there too, the diagnostic as JSON.
            let mut text = String::new();
            let _ = miette::JSONReportHandler::new().render_report(&mut text, &e);
            let error = serde_json::from_str::<serde_json::Value>(&text).unwrap_or(serde_json::Value::String(text));
            p.value(&serde_json::json!({"spec": a.spec, "valid": false, "error": error}), false);
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    if p.json() {
        p.value(&serde_json::json!({"spec": a.spec, "valid": true, "stages": s.stages.len()}), false);
    } else {
        p.line(format!("{}: ok ({} stages)", a.spec.display(), s.stages.len()));
    }
    Ok(ExitCode::Success)
}

pub fn schema(format: SchemaFormat, p: &Printer) -> Result<ExitCode, Error> {
    match format {
        SchemaFormat::Json => p.value(&spec::json_schema(), false),
        SchemaFormat::Markdown => p.out(&spec::reference_markdown()),
    }
    Ok(ExitCode::Success)
}

pub fn output(a: OutputArgs, p: &Printer) -> Result<ExitCode, Error> {
    let (plan, store) = load_plan(&a.spec, &a.set, None)?;
    let stage = a.stage;
    let i = plan.index(&stage).ok_or_else(|| plan::PlanError::UnknownStage(stage.clone()))?;
    if let Some(to) = &a.download {
        user_named(&crate::user_output::Owned::new(plan.spec.workdir().root()).spec(&a.spec), to)?;
        super::tools::remove_staging_on_signals();
    }
    if plan.spec.pipeline.backend == BackendKind::Kubernetes && crate::backend::kubernetes::outside_cluster(&plan.spec)
    {
        return runtime()?.block_on(outside::output(&plan, &stage, &a.set, a.download.as_deref(), p.json()));
    }
    let key = committed_key(&plan, &store, i, &a.spec)?;
    let dir = store.output_dir(&key);
    let manifest = store.manifest(&key);
    if let Some(to) = a.download {
        let m = manifest.ok_or_else(|| {
            Error::usage(format!("stage `{stage}` has no manifest to copy by"), "`mflow cache repair` restores it")
        })?;
        copy_output(&dir, &m, &to)?;
        p.line(to.display().to_string());
    } else if p.json() {
        let (digest, files) = manifest.map(|m| (m.digest.clone(), m.files.clone())).unwrap_or_default();
        p.value(&serde_json::json!({"path": dir, "digest": digest, "files": files}), true);
    } else {
        p.line(dir.display().to_string());
    }
    Ok(ExitCode::Success)
}

/// The key of stage `i`'s committed output for the spec as it is now.
fn committed_key(plan: &plan::Plan, store: &crate::cache::Store, i: usize, spec: &Path) -> Result<String, Error> {
    let decisions =
        plan::decide(plan, store, &record::LastKeys::open(&plan.spec.workdir(), &plan.spec.pipeline.name), &[], false);
    match &decisions[i].decision {
        plan::Decision::Cached { key } => Ok(key.clone()),
        // Never reused, but its newest output for this key is committed all the same.
        plan::Decision::Run { key: Some(key), .. }
            if !plan.stages[i].spec.cache && matches!(store.lookup(key, false), crate::cache::Lookup::Hit(_)) =>
        {
            Ok(key.clone())
        }
        d => Err(Error::usage(
            format!(
                "stage `{}` has no committed output for the current spec ({})",
                plan.stages[i].spec.name,
                describe(d)
            ),
            format!("run `mflow run {}` first", spec.display()),
        )),
    }
}

/// `mflow metrics show SPEC STAGE`: the summary (metrics.json) of a stage's committed output,
/// and the metric lines of the newest run that committed it. From outside a cluster, the image's
/// mflow answers in the volume pod.
pub fn stage_metrics(a: OutputArgs, p: &Printer) -> Result<ExitCode, Error> {
    let (plan, store) = load_plan(&a.spec, &a.set, None)?;
    let i = plan.index(&a.stage).ok_or_else(|| plan::PlanError::UnknownStage(a.stage.clone()))?;
    if plan.spec.pipeline.backend == BackendKind::Kubernetes && crate::backend::kubernetes::outside_cluster(&plan.spec)
    {
        return runtime()?.block_on(outside::metrics(&plan, &a.stage, &a.set, p.json()));
    }
    let key = committed_key(&plan, &store, i, &a.spec)?;
    let dir = store.output_dir(&key);
    let digest = store.manifest(&key).map(|m| m.digest.clone()).unwrap_or_default();
    let summary = crate::untrusted::read_json(&dir.join("metrics.json"), crate::untrusted::RESULT_JSON);
    let workdir = plan.spec.workdir();
    let run = record::list(&workdir).into_iter().rev().find(|id| {
        record::load(&workdir, id).and_then(|r| r.stages.get(&a.stage).cloned()).is_some_and(|s| {
            s.status == record::StageStatus::Succeeded && s.output_digest.as_deref() == Some(digest.as_str())
        })
    });
    let series = run.as_ref().map_or_else(Vec::new, |id| {
        crate::ci::run_data::read_series(&crate::workdir::stage_dir(&workdir.run(id), &a.stage).join("metrics.jsonl"))
    });
    if p.json() {
        let answer = serde_json::json!({
            "stage": a.stage, "path": dir, "digest": digest, "run": run, "summary": summary, "series": series,
        });
        p.value(&answer, true);
        return Ok(ExitCode::Success);
    }
    p.line(dir.display().to_string());
    match &run {
        Some(id) => p.line(format!("run {id}: {} metric lines", series.len())),
        None => p.line("no recorded run here committed this output: no metric lines"),
    }
    for (k, v) in summary.as_ref().and_then(|s| s.as_object()).into_iter().flatten() {
        if v.is_number() || v.is_string() || v.is_boolean() {
            p.line(format!("{k} = {v}"));
        }
    }
    Ok(ExitCode::Success)
}

/// Copies a committed output to `to` (which must not exist) through a staging directory
/// (`mflow_untrusted::staging`), checking every file against its manifest.
fn copy_output(dir: &Path, m: &crate::cache::Manifest, to: &Path) -> Result<(), Error> {
    use mflow_untrusted::staging::{self, Staging, StagingError};
    if to.symlink_metadata().is_ok() {
        return Err(Error::usage(format!("{} exists", to.display()), "copy into a directory that does not exist yet"));
    }
    let failed = |e: StagingError| match crate::user_output::users_fault(&e.source) {
        true => Error::usage(
            format!("cannot write {}: {}", e.path.display(), e.source),
            "name a new directory inside one that exists and is writable",
        ),
        false => Error::io(&e.path, e.source),
    };
    let staging = Staging::create(to).map_err(failed)?;
    for f in &m.files {
        let rel = outside::relative(&f.path).ok_or_else(|| {
            Error::usage(
                format!("the manifest of {} lists a file outside it: {}", dir.display(), spec::error::excerpt(&f.path)),
                "`mflow cache repair` rebuilds the manifest log",
            )
        })?;
        let (from, dest) = (dir.join(&rel), staging.path().join(&rel));
        if let Some(parent) = rel.parent() {
            staging::create_dir_below(staging.path(), parent)
                .map_err(|e| Error::io(&staging.path().join(parent), e))?;
        }
        std::fs::copy(&from, &dest).map_err(|e| Error::io(&from, e))?;
        if crate::cache::hash_file(&dest).map_err(|e| Error::io(&dest, e))? != f.blake3 {
            return Err(Error::usage(
                format!("{} differs from the digest its manifest records", from.display()),
                "`mflow run --verify` rebuilds a damaged entry",
            ));
        }
    }
    staging.commit().map_err(failed)
}

/// Stages that would run because this machine lacks their output, but that the cluster's cache
/// index lists, are reported as cached in the cluster.
fn cluster_cached(spec: &spec::Spec, decisions: &mut [plan::StageDecision], p: &Printer) {
    let Ok(rt) = tokio::runtime::Runtime::new() else { return };
    let kube = match rt.block_on(crate::backend::kubernetes::Kubernetes::connect_read_only(spec)) {
        Ok(k) => k,
        Err(e) => {
            p.note(format!("mflow: cannot read the cluster's cache index: {}", e.explain()));
            return;
        }
    };
    for d in decisions.iter_mut() {
        let plan::Decision::Run { key: Some(key), reason } = &mut d.decision else { continue };
        match rt.block_on(kube.cache_get(&spec.pipeline.name, key)) {
            Ok(Some(entry)) => *reason = format!("cached in the cluster ({}), not visible from here", entry.output),
            Ok(None) => {}
            Err(e) => p.note(format!("mflow: cannot read the cluster's cache index: {e}")),
        }
    }
}

fn describe(d: &plan::Decision) -> String {
    match d {
        plan::Decision::Cached { key } => format!("cached ({})", crate::cache::key::short(key)),
        plan::Decision::Run { reason, .. } => format!("run: {reason}"),
        plan::Decision::Resume { iteration, .. } => format!("resume from checkpoint iteration {iteration}"),
    }
}

pub fn render_plan(decisions: &[plan::StageDecision]) -> String {
    let w = decisions.iter().map(|d| d.stage.len()).max().unwrap_or(5);
    let mut out = String::new();
    for d in decisions {
        let (action, why) = match &d.decision {
            plan::Decision::Cached { key } => ("cached", crate::cache::key::short(key).to_string()),
            plan::Decision::Run { reason, .. } => ("run", reason.clone()),
            plan::Decision::Resume { iteration, .. } => ("resume", format!("from checkpoint iteration {iteration}")),
        };
        out.push_str(&format!("{:<w$}  {:<9} {:<7} {}\n", d.stage, d.kind, action, why));
    }
    // Which engine each stage runs and why, below the table: the same line a run prints.
    let engines: Vec<_> = decisions.iter().filter_map(|d| Some((&d.stage, d.engine.as_ref()?))).collect();
    if !engines.is_empty() {
        out.push('\n');
        for (stage, engine) in engines {
            out.push_str(&format!("{stage}: {engine}\n"));
        }
    }
    out
}
