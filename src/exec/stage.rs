//! One stage from lock to commit: attempts, retries, gates, each said as a run event.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mflow_contract::event::{AttemptEnd, Retry, RunEvent, StageGate};
use mflow_contract::record::AttemptOutcome;
use mflow_contract::workload::StatusReport;
use mflow_contract::FailureClass;
use serde_json::Value as Json;

use super::retry::{RetryState, Verdict};
use super::{Shared, StageEnd};
use crate::backend::pool::Grant;
use crate::backend::{AttemptArea, Cancel, Job, Outcome};
use crate::cache::Lookup;
use crate::stages::{build_job, JobContext};
use crate::untrusted::{RESULT_JSON, SMALL_JSON};

/// What one attempt needs besides the stage.
struct AttemptCx<'a> {
    i: usize,
    key: &'a str,
    upstream: &'a BTreeMap<String, PathBuf>,
    grant: &'a Grant,
    stage_dir: &'a Path,
    scratch: &'a Path,
}

/// How one attempt went, before the retry policy looks at it.
struct Tried {
    outcome: Outcome,
    before: Option<u64>,
    end: AttemptEnd,
    area: AttemptArea,
}

pub(super) async fn run_stage(
    arc: Arc<Shared>,
    i: usize,
    key: String,
    upstream: BTreeMap<String, PathBuf>,
    grant: &Grant,
    forced: bool,
    gates: &mut Vec<StageGate>,
) -> StageEnd {
    let sh = &*arc;
    let st = &sh.plan.stages[i];
    let name = st.spec.name.clone();
    // Wait for the key's lock: another run may be computing the same output right now.
    let lock = loop {
        match sh.store.try_lock(&key) {
            Ok(Some(l)) => break l,
            Ok(None) => {}
            Err(e) => return fail(sh, &name, e.class(), e.to_string()),
        }
        if *sh.cancel.borrow() != Cancel::None {
            return fail(sh, &name, FailureClass::Cancelled, "cancelled".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if st.spec.cache && !forced {
        if let Lookup::Hit(m) = sh.store.lookup(&key, false) {
            return cached(sh, i, &key, &m.digest, true, gates).await;
        }
    }
    // Created only when something is written there (a log line, a kind's config, the files the
    // stage reports through): new inodes are the largest cost of a small stage.
    let stage_dir = crate::workdir::stage_dir(&sh.run.dir, &name);
    // The stage creates its scratch directory when it needs one.
    let scratch = sh.plan.spec.workdir().scratch(&key);
    let started = Instant::now();
    sh.emit(RunEvent::StageStarted { stage: name.clone(), key: key.clone() });
    let cx = AttemptCx { i, key: &key, upstream: &upstream, grant, stage_dir: &stage_dir, scratch: &scratch };
    let mut retry = RetryState::default();
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let tried = match attempt_once(&arc, &cx, attempt).await {
            Ok(t) => t,
            Err((class, message)) => return fail(sh, &name, class, message),
        };
        let Tried { outcome, before, mut end, area } = tried;
        match outcome {
            Outcome::Detached { message } => {
                // An attempt that goes on without mflow keeps its area for the next run.
                if !area.reattachable {
                    sh.store.discard(&area.out);
                }
                sh.emit(RunEvent::AttemptEnded { stage: name.clone(), attempt, end });
                sh.emit(RunEvent::StageInterrupted { stage: name.clone(), message });
                return StageEnd::NotDone { status: mflow_contract::record::StageStatus::Interrupted, class: None };
            }
            Outcome::Success => {
                sh.emit(RunEvent::AttemptEnded { stage: name.clone(), attempt, end });
                return succeed(&arc, i, &area.out, &key, &scratch, started, lock, gates).await;
            }
            Outcome::Failed { class, message } => {
                sh.store.discard(&area.out);
                let verdict = match class {
                    FailureClass::Cancelled | FailureClass::Gate => Verdict::GiveUp(String::new()),
                    _ => retry.on_failure(&st.spec.retries, class, before, end.checkpoint_iteration),
                };
                let wait = match verdict {
                    Verdict::RetryAfter(d) => d,
                    Verdict::GiveUp(why) => {
                        sh.emit(RunEvent::AttemptEnded { stage: name.clone(), attempt, end });
                        let retried = st.spec.retries.max > 0 || st.spec.retries.on.contains(&class);
                        let msg = if retried && !why.is_empty() { format!("{message} ({why})") } else { message };
                        return fail(sh, &name, class, msg);
                    }
                };
                end.retry = Some(Retry { attempt: attempt + 1, after_s: wait.as_secs_f64() });
                sh.emit(RunEvent::AttemptEnded { stage: name.clone(), attempt, end });
                let mut c = sh.cancel.clone();
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = async { let _ = c.wait_for(|l| *l != Cancel::None).await; } => {
                        return fail(sh, &name, FailureClass::Cancelled, "cancelled while waiting to retry".into());
                    }
                }
            }
        }
    }
}

/// Runs one attempt: builds its job, starts it on the backend, and reads what the stage said
/// about itself. `Err` when the job cannot even be built.
async fn attempt_once(arc: &Arc<Shared>, cx: &AttemptCx<'_>, attempt: u32) -> Result<Tried, (FailureClass, String)> {
    let sh = &**arc;
    let st = &sh.plan.stages[cx.i];
    let name = st.spec.name.clone();
    let workdir = sh.plan.spec.workdir();
    let before = {
        let key = cx.key.to_string();
        crate::untrusted::blocking(move || workdir.resume_point(&key)).await
    };
    // The backend says where the output goes before the job is built, so that the job names it.
    let area = sh.backend.attempt_area(&sh.plan.spec.workdir(), &name, cx.key, attempt, &sh.run.id);
    let staging = area.out.clone();
    let job_cx = JobContext {
        stage: &st.spec,
        engine: st.engine.as_ref(),
        output: &staging,
        scratch: cx.scratch,
        attempt_dir: cx.stage_dir,
        config_dir: None,
        attempt,
        spec_dir: &sh.plan.spec.dir,
        env: &sh.env,
        upstream: cx.upstream,
        gpus: &cx.grant.gpus,
        cpus: cx.grant.cpus.max(1.0),
    };
    let plan = build_job(&job_cx).map_err(|e| (FailureClass::User, e))?;
    // Native commands create their output directory themselves (atomically).
    let with_output = !plan.output_created_by_stage;
    sh.store.prepare(cx.key, &area, with_output).map_err(|e| (e.class(), e.to_string()))?;
    let log = cx.stage_dir.join(format!("attempt-{attempt}.log"));
    // The files a stage may write about itself go next to its output, in the attempt's area,
    // and move to the run record afterwards (`keep_reports`).
    let reports = area.dir.clone();
    let status_file = reports.join(REPORTS[0]);
    let progress_file = reports.join(REPORTS[1]);
    let mut env = plan.env.clone();
    env.extend(st.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    use mflow_contract::vars;
    for (var, value) in [
        (vars::OUTPUT, staging.display().to_string()),
        (vars::SCRATCH, cx.scratch.display().to_string()),
        (vars::PROGRESS, progress_file.display().to_string()),
        (vars::METRICS, reports.join(METRICS).display().to_string()),
        (vars::STATUS, status_file.display().to_string()),
        (vars::ATTEMPT, attempt.to_string()),
        (vars::STAGE, name.clone()),
        (vars::RUN_DIR, sh.run.dir.display().to_string()),
    ] {
        env.insert(var.to_string(), value);
    }
    for (up, path) in cx.upstream {
        env.insert(crate::spec::input_var(up), path.display().to_string());
    }
    let job = Job {
        stage: name.clone(),
        key: cx.key.to_string(),
        attempt,
        steps: plan.steps,
        env,
        cwd: plan.cwd,
        timeout: st.spec.timeout,
        log: log.clone(),
        status_file: status_file.clone(),
        area: area.clone(),
    };
    let relative_log = log.strip_prefix(&sh.run.dir).unwrap_or(&log).display().to_string();
    sh.emit(RunEvent::AttemptStarted {
        stage: name.clone(),
        attempt,
        log: relative_log,
        engine: st.engine.clone(),
        resumed_from: before,
    });
    let given = super::given::Upstream::take(cx.upstream);
    let t0 = Instant::now();
    let watcher = tokio::spawn(super::progress::watch(progress_file, name.clone(), attempt, arc.clone()));
    let mut outcome = sh.run_job(&job).await;
    watcher.abort();
    if !matches!(outcome, Outcome::Detached { .. }) {
        let inputs = if outcome == Outcome::Success { &st.input_stats[..] } else { &[] };
        if let Some(failed) = given_changed(sh, inputs, &given) {
            outcome = failed;
        }
    }
    let reported: StatusReport =
        read_json(&status_file, SMALL_JSON).await.and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default();
    {
        let (reports, stage_dir) = (reports.clone(), cx.stage_dir.to_path_buf());
        crate::untrusted::blocking(move || keep_reports(&reports, &stage_dir, attempt)).await;
    }
    let after = reported.checkpoint_iteration.or(before);
    if let Some(a) = after {
        let _ = std::fs::create_dir_all(cx.scratch);
        let note = serde_json::json!({"checkpoint_iteration": a});
        let _ = crate::record::write_json(&sh.plan.spec.workdir().resume_note(cx.key), &note);
    }
    if outcome == Outcome::Success && !staging.is_dir() {
        outcome = Outcome::Failed {
            class: FailureClass::User,
            message: "the stage succeeded but wrote no output directory".into(),
        };
    }
    let (outcome_kind, message) = match &outcome {
        Outcome::Success => (AttemptOutcome::Success, None),
        Outcome::Failed { class, message } => (AttemptOutcome::Failed(*class), Some(message.clone())),
        Outcome::Detached { message } => (AttemptOutcome::Interrupted, Some(message.clone())),
    };
    let end = AttemptEnd {
        outcome: outcome_kind,
        message,
        duration_s: t0.elapsed().as_secs_f64(),
        checkpoint_iteration: after,
        resumed_from: reported.resumed_from,
        retry: None,
        metrics: read_json(&staging.join("metrics.json"), RESULT_JSON).await,
        verification: read_json(&staging.join("verification.json"), RESULT_JSON).await,
    };
    Ok(Tried { outcome, before, end, area })
}

/// The failure of an attempt whose inputs or upstream outputs are not as its key describes them
/// (see [`super::given`]). An upstream output the stage wrote into is removed, to be made again.
fn given_changed(
    sh: &Shared,
    inputs: &[(PathBuf, crate::cache::FileStat)],
    given: &super::given::Upstream,
) -> Option<Outcome> {
    if let Some((stage, dir, why)) = given.changed() {
        let key =
            dir.file_name().and_then(|k| k.to_str()).filter(|_| dir.parent() == Some(&sh.store.workdir().cache()));
        if let Some(key) = key {
            let _ = sh.store.remove(key);
        }
        let message = format!(
            "the stage changed the output of `{stage}` it was given ({why}): a stage reads its upstream outputs and \
             writes only under $MFLOW_OUTPUT; that output is removed, and the next run makes it again"
        );
        return Some(Outcome::Failed { class: FailureClass::User, message });
    }
    let (path, how) = super::given::input_changed(inputs)?;
    let message = format!(
        "input {} {how} while the stage ran; its output is not kept, as its key was made from the file as it was: run again",
        path.display()
    );
    Some(Outcome::Failed { class: FailureClass::User, message })
}

/// Commits a successful attempt's output and checks the stage's gates.
#[allow(clippy::too_many_arguments)]
async fn succeed(
    arc: &Arc<Shared>,
    i: usize,
    staging: &Path,
    key: &str,
    scratch: &Path,
    started: Instant,
    lock: crate::cache::KeyLock,
    gates: &mut Vec<StageGate>,
) -> StageEnd {
    let sh = &**arc;
    let name = &sh.plan.stages[i].spec.name;
    let manifest = match commit(arc, staging, key, name).await {
        Ok(m) => m,
        Err(e) => {
            sh.store.discard(staging);
            return fail(sh, name, e.class(), e.to_string());
        }
    };
    drop(lock);
    let _ = std::fs::remove_dir_all(scratch);
    let output = sh.store.output_dir(key);
    if let Some(warning) = sh.backend.committed(key, name, &output, &manifest.digest).await {
        sh.emit(RunEvent::Warning { stage: Some(name.clone()), message: warning });
    }
    sh.emit(RunEvent::StageSucceeded {
        stage: name.clone(),
        output: output.display().to_string(),
        digest: manifest.digest.clone(),
        duration_s: started.elapsed().as_secs_f64(),
    });
    // A gate judges the result; the result itself stays cached.
    if let Some(message) = check_gates(sh, i, &output, gates).await {
        return fail(sh, name, FailureClass::Gate, message);
    }
    StageEnd::Done { digest: manifest.digest, output, cached: false }
}

/// A stage whose output is in the cache: said so, and its gates checked.
pub(super) async fn cached(
    sh: &Shared,
    i: usize,
    key: &str,
    digest: &str,
    by_another_run: bool,
    gates: &mut Vec<StageGate>,
) -> StageEnd {
    let name = &sh.plan.stages[i].spec.name;
    let output = sh.store.output_dir(key);
    sh.emit(RunEvent::StageCached {
        stage: name.clone(),
        key: key.to_string(),
        output: output.display().to_string(),
        digest: digest.to_string(),
        by_another_run,
    });
    if let Some(message) = check_gates(sh, i, &output, gates).await {
        return fail(sh, name, FailureClass::Gate, message);
    }
    StageEnd::Done { digest: digest.to_string(), output, cached: true }
}

/// Outputs larger than this are hashed on a blocking thread: the runtime has one thread, and
/// hashing there would stall every other stage's output pipes and timers. Smaller ones are
/// hashed in place, because handing work to another thread and back costs more than a small
/// stage itself.
const INLINE_HASH_BYTES: u64 = 4 << 20;

async fn commit(
    arc: &Arc<Shared>,
    staging: &Path,
    key: &str,
    name: &str,
) -> Result<crate::cache::Manifest, crate::cache::CacheError> {
    let staged = crate::cache::Staged::list(staging)?;
    if staged.bytes() <= INLINE_HASH_BYTES {
        return arc.store.commit_listed(staged, key, name);
    }
    let (sh, key, name) = (arc.clone(), key.to_string(), name.to_string());
    match tokio::task::spawn_blocking(move || sh.store.commit_listed(staged, &key, &name)).await {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Status, progress and metrics files, as named in the staging directory.
const REPORTS: [&str; 3] = ["status.json", "progress.jsonl", METRICS];
/// The one report kept across attempts (appended to) rather than per attempt.
const METRICS: &str = "metrics.jsonl";

/// Moves the files the stage wrote about itself from next to its staging directory to the run
/// record: `attempt-N.status.json`, `attempt-N.progress.jsonl`, and `metrics.jsonl` (appended to
/// across attempts). Only regular files are kept: a FIFO, a device or a link in a report's place
/// is removed, so that nothing reading the record later meets it.
fn keep_reports(reports: &Path, stage_dir: &Path, attempt: u32) {
    for name in REPORTS {
        let from = reports.join(name);
        match std::fs::symlink_metadata(&from) {
            Ok(m) if m.is_file() => {}
            Ok(_) => {
                let _ = std::fs::remove_file(&from);
                continue;
            }
            Err(_) => continue,
        }
        let _ = std::fs::create_dir_all(stage_dir);
        let to =
            if name == METRICS { stage_dir.join(name) } else { stage_dir.join(format!("attempt-{attempt}.{name}")) };
        if name == METRICS && to.exists() {
            let to = mflow_untrusted::open_with(
                &to,
                std::fs::OpenOptions::new().append(true),
                mflow_untrusted::Links::Refuse,
            );
            let appended = to.and_then(|mut f| crate::untrusted::copy_from(&from, 0, &mut f));
            if appended.is_ok() {
                let _ = std::fs::remove_file(&from);
            }
        } else {
            let _ = std::fs::rename(&from, &to);
        }
    }
}

/// Checks the stage's gates against the `metrics.json` in its output, says the results, and
/// returns the failure message if any gate failed.
async fn check_gates(sh: &Shared, i: usize, output: &Path, tally: &mut Vec<StageGate>) -> Option<String> {
    let name = sh.plan.stages[i].spec.name.as_str();
    let gates = &sh.plan.stages[i].spec.gates;
    if gates.is_empty() {
        return None;
    }
    let path = output.join("metrics.json");
    let metrics = read_json(&path, RESULT_JSON).await;
    let results = crate::spec::gates::evaluate(gates, metrics.as_ref().unwrap_or(&Json::Null));
    // Why a gate has no value: the file, or the metric in it.
    let file_problem = match &metrics {
        Some(Json::Object(_)) => None,
        Some(_) => Some("metrics.json is not a JSON object".to_string()),
        None => Some(match std::fs::symlink_metadata(&path) {
            Err(_) => "the stage wrote no metrics.json".to_string(),
            Ok(m) if !m.is_file() => "metrics.json is not a regular file".to_string(),
            Ok(m) if m.len() > RESULT_JSON => format!("metrics.json is larger than {} MiB", RESULT_JSON >> 20),
            Ok(_) => "metrics.json is not valid JSON".to_string(),
        }),
    };
    let failed: Vec<String> = results
        .iter()
        .filter(|g| !g.passed)
        .map(|g| {
            match (g.value, &file_problem, metrics.as_ref().and_then(|m| crate::spec::gates::lookup(m, &g.metric))) {
                (Some(v), _, _) => format!("{} = {v:.4} is not {}", g.metric, g.condition),
                (None, Some(problem), _) => format!("{}: {problem}", g.metric),
                (None, None, None) => format!("{}: not in metrics.json", g.metric),
                (None, None, Some(found)) => {
                    format!("{} is {}, not a number", g.metric, crate::spec::error::excerpt_of(&found.to_string(), 60))
                }
            }
        })
        .collect();
    tally.extend(results.iter().map(|g| StageGate { stage: name.to_string(), gate: g.clone() }));
    sh.emit(RunEvent::GatesChecked { stage: name.to_string(), gates: results, metrics });
    if failed.is_empty() {
        None
    } else {
        Some(format!("gate failed: {}", failed.join("; ")))
    }
}

fn fail(sh: &Shared, name: &str, class: FailureClass, message: String) -> StageEnd {
    sh.emit(RunEvent::StageFailed { stage: name.to_string(), class, message });
    StageEnd::failed(class)
}

/// A file the stage wrote about itself, read off the runtime (`crate::untrusted`).
async fn read_json(path: &Path, cap: u64) -> Option<Json> {
    crate::untrusted::read_json_async(path.to_path_buf(), cap).await
}
