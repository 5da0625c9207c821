//! One stage from lock to commit: attempts, retries, gates, and the record of each.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value as Json;

use super::pool::Grant;
use super::retry::{FailureClass, RetryState, Verdict};
use super::{scratch_dir, Shared, StageEnd};
use crate::backend::{Cancel, Job, Outcome};
use crate::cache::Lookup;
use crate::record::{self, Attempt, StageStatus};
use crate::stages::{build_job, JobContext};
use crate::untrusted::{PROGRESS_PIECE, RESULT_JSON, SMALL_JSON};

pub(super) async fn run_stage(arc: std::sync::Arc<Shared>, i: usize, key: String, upstream: BTreeMap<String, PathBuf>, grant: &Grant, forced: bool) -> StageEnd {
    let sh = &*arc;
    let st = &sh.plan.stages[i];
    let name = st.spec.name.clone();
    let workdir = sh.plan.spec.workdir();
    // Wait for the key's lock: another run may be computing the same output right now.
    let lock = loop {
        match sh.store.try_lock(&key) {
            Ok(Some(l)) => break l,
            Ok(None) => {}
            Err(e) => return fail(sh, &name, FailureClass::Infra, e.to_string()).await,
        }
        if *sh.cancel.borrow() != Cancel::None {
            return fail(sh, &name, FailureClass::Cancelled, "cancelled".into()).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if st.spec.cache && !forced {
        if let Lookup::Hit(m) = sh.store.lookup(&key, false) {
            let output = sh.store.output_dir(&key);
            sh.update(&name, |r| {
                r.status = StageStatus::Cached;
                r.key = Some(key.clone());
                r.output = Some(output.display().to_string());
                r.output_digest = Some(m.digest.clone());
            })
            .await;
            sh.show(&name, "cached", "computed by another run");
            if let Some(message) = check_gates(sh, i, &output).await {
                return fail(sh, &name, FailureClass::Gate, message).await;
            }
            return StageEnd::Done { digest: m.digest.clone(), output, cached: true };
        }
    }
    // Created only when something is written there (a log line, a kind's config, the files the
    // stage reports through): new inodes are the largest cost of a small stage.
    let stage_dir = sh.run_dir.join("stages").join(&name);
    // The stage creates its scratch directory when it needs one.
    let scratch = scratch_dir(&workdir, &key);
    let started = Instant::now();
    sh.update(&name, |r| {
        r.status = StageStatus::Running;
        r.key = Some(key.clone());
        r.started = Some(record::now());
    })
    .await;

    let params = crate::spec::substitute_outputs(&st.parts.params, &|n| upstream.get(n).map(|p| p.display().to_string()).unwrap_or_default());
    let mut retry = RetryState::default();
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let before = {
            let (workdir, key) = (workdir.clone(), key.clone());
            crate::untrusted::blocking(move || super::resume_point(&workdir, &key)).await
        };
        let staging = match sh.store.stage(&key, &sh.run_id) {
            Ok(s) => s,
            Err(e) => return fail(sh, &name, FailureClass::Infra, e.to_string()).await,
        };
        let out = staging.clone();
        let cx = JobContext {
            stage: &st.spec,
            params: &params,
            output: &out,
            scratch: &scratch,
            attempt_dir: &stage_dir,
            attempt,
            spec_dir: &sh.plan.spec.dir,
            env: &sh.env,
            upstream: &upstream,
            gpus: &grant.gpus,
            cpus: grant.cpus.max(1.0),
        };
        let plan = match build_job(&cx) {
            Ok(p) => p,
            Err(e) => {
                sh.store.discard(&staging);
                return fail(sh, &name, FailureClass::User, e).await;
            }
        };
        if plan.output_created_by_stage {
            let _ = std::fs::remove_dir(&out);
        }
        let log = stage_dir.join(format!("attempt-{attempt}.log"));
        // The files a stage may write about itself go next to its staging directory, which
        // exists already, and move to the run record afterwards (`keep_reports`).
        let reports = sh.store.attempt_dir(&staging).to_path_buf();
        let status_file = report_path(&reports, REPORTS[0]);
        let progress_file = report_path(&reports, REPORTS[1]);
        let mut env = plan.env.clone();
        env.extend(st.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.insert("MFLOW_OUTPUT".into(), out.display().to_string());
        env.insert("MFLOW_SCRATCH".into(), scratch.display().to_string());
        env.insert("MFLOW_PROGRESS".into(), progress_file.display().to_string());
        env.insert("MFLOW_METRICS".into(), report_path(&reports, METRICS).display().to_string());
        env.insert("MFLOW_STATUS".into(), status_file.display().to_string());
        env.insert("MFLOW_ATTEMPT".into(), attempt.to_string());
        env.insert("MFLOW_STAGE".into(), name.clone());
        env.insert("MFLOW_RUN_DIR".into(), sh.run_dir.display().to_string());
        for (up, path) in &upstream {
            env.insert(crate::spec::input_var(up), path.display().to_string());
        }
        let job = Job { stage: name.clone(), key: key.clone(), attempt, steps: plan.steps, env, cwd: plan.cwd, timeout: st.spec.timeout, log: log.clone(), status_file: status_file.clone() };
        // The engine goes on the line that says the stage started: where a reader looks first.
        let detail = [(attempt > 1).then(|| format!("attempt {attempt}")), st.engine.as_ref().map(ToString::to_string)];
        sh.show(&name, "started", &detail.into_iter().flatten().collect::<Vec<_>>().join("; "));
        let attempt_started = record::now();
        let t0 = Instant::now();
        sh.update(&name, |r| {
            r.attempts.push(Attempt {
                n: attempt,
                started: attempt_started.clone(),
                finished: None,
                duration_s: None,
                outcome: None,
                message: None,
                log: log.strip_prefix(&sh.run_dir).unwrap_or(&log).display().to_string(),
                resumed_from: before,
                checkpoint_iteration: None,
            })
        })
        .await;

        let watcher = tokio::spawn(watch_progress(progress_file.clone(), name.clone(), arc.clone()));
        let mut outcome = sh.backend.run(&job, sh.lines.clone(), sh.cancel.clone()).await;
        watcher.abort();
        let reported = read_json(&status_file, SMALL_JSON).await;
        {
            let (reports, stage_dir) = (reports.clone(), stage_dir.clone());
            crate::untrusted::blocking(move || keep_reports(&reports, &stage_dir, attempt)).await;
        }
        let after = reported.as_ref().and_then(|v| v.get("checkpoint_iteration")).and_then(Json::as_u64).or(before);
        let resumed_from = reported.as_ref().and_then(|v| v.get("resumed_from")).and_then(Json::as_u64);
        if let Some(a) = after {
            let _ = std::fs::create_dir_all(&scratch);
            let _ = record::write_json(&scratch.join("progress.json"), &serde_json::json!({"checkpoint_iteration": a}));
        }

        if outcome == Outcome::Success && !out.is_dir() {
            outcome = Outcome::Failed { class: FailureClass::User, message: "the stage succeeded but wrote no output directory".into() };
        }
        let metrics = read_json(&out.join("metrics.json"), RESULT_JSON).await;
        let verification = read_json(&out.join("verification.json"), RESULT_JSON).await;
        let (outcome_str, message) = match &outcome {
            Outcome::Success => ("success".to_string(), None),
            Outcome::Failed { class, message } => (class.to_string(), Some(message.clone())),
            Outcome::Detached { message } => ("interrupted".to_string(), Some(message.clone())),
        };
        let dur = t0.elapsed().as_secs_f64();
        sh.update(&name, |r| {
            if let Some(a) = r.attempts.last_mut() {
                a.finished = Some(record::now());
                a.duration_s = Some(dur);
                a.outcome = Some(outcome_str.clone());
                a.message = message.clone();
                a.checkpoint_iteration = after;
                if resumed_from.is_some() {
                    a.resumed_from = resumed_from;
                }
            }
            r.metrics = metrics.clone();
            r.verification = verification.clone();
        })
        .await;

        match outcome {
            Outcome::Detached { message } => {
                sh.store.discard(&staging);
                sh.update(&name, |r| {
                    r.status = StageStatus::Interrupted;
                    r.message = Some(message.clone());
                })
                .await;
                sh.show(&name, "interrupted", &message);
                return StageEnd::Failed { class: FailureClass::Cancelled, message };
            }
            Outcome::Success => {
                let manifest = match commit(&arc, &staging, &key, &name).await {
                    Ok(m) => m,
                    Err(e) => {
                        sh.store.discard(&staging);
                        // A link, a FIFO or a name not in UTF-8 in the output is the stage's doing, and fails every time.
                        let class = if matches!(e, crate::cache::CacheError::FileType { .. } | crate::cache::CacheError::NotUtf8 { .. }) { FailureClass::User } else { FailureClass::Infra };
                        return fail(sh, &name, class, e.to_string()).await;
                    }
                };
                drop(lock);
                let _ = std::fs::remove_dir_all(&scratch);
                let output = sh.store.output_dir(&key);
                if let Some(warning) = sh.backend.committed(&key, &name, &output, &manifest.digest).await {
                    sh.show(&name, "warning", &warning);
                }
                let total = started.elapsed().as_secs_f64();
                sh.update(&name, |r| {
                    r.status = StageStatus::Succeeded;
                    r.output = Some(output.display().to_string());
                    r.output_digest = Some(manifest.digest.clone());
                    r.finished = Some(record::now());
                    r.duration_s = Some(total);
                })
                .await;
                sh.show(&name, "succeeded", &format!("{:.1}s", total));
                // A gate judges the result; the result itself stays cached.
                if let Some(message) = check_gates(sh, i, &output).await {
                    return fail(sh, &name, FailureClass::Gate, message).await;
                }
                return StageEnd::Done { digest: manifest.digest, output, cached: false };
            }
            Outcome::Failed { class, message } => {
                sh.store.discard(&staging);
                if class == FailureClass::Cancelled || class == FailureClass::Gate {
                    return fail(sh, &name, class, message).await;
                }
                match retry.on_failure(&st.spec.retries, class, before, after) {
                    Verdict::GiveUp(why) => {
                        let msg = if st.spec.retries.max > 0 || st.spec.retries.on.contains(&class) { format!("{message} ({why})") } else { message };
                        return fail(sh, &name, class, msg).await;
                    }
                    Verdict::RetryAfter(d) => {
                        sh.show(&name, "retrying", &format!("{class}: {message}; attempt {} in {}", attempt + 1, humantime::format_duration(Duration::from_millis(d.as_millis() as u64))));
                        let mut c = sh.cancel.clone();
                        tokio::select! {
                            _ = tokio::time::sleep(d) => {}
                            _ = async { let _ = c.wait_for(|l| *l != Cancel::None).await; } => {
                                return fail(sh, &name, FailureClass::Cancelled, "cancelled while waiting to retry".into()).await;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Outputs larger than this are hashed on a blocking thread: the runtime has one thread, and
/// hashing there would stall every other stage's output pipes and timers. Smaller ones are
/// hashed in place, because handing work to another thread and back costs more than a small
/// stage itself.
const INLINE_HASH_BYTES: u64 = 4 << 20;

async fn commit(arc: &std::sync::Arc<Shared>, staging: &std::path::Path, key: &str, name: &str) -> Result<crate::cache::Manifest, crate::cache::CacheError> {
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

/// Where a stage writes report `name`: in its attempt's directory `reports`, beside the
/// output, so that it goes with the attempt.
fn report_path(reports: &std::path::Path, name: &str) -> PathBuf {
    reports.join(name)
}

/// Moves the files the stage wrote about itself from next to its staging directory to the run record:
/// `attempt-N.status.json`, `attempt-N.progress.jsonl`, and `metrics.jsonl` (appended to across
/// attempts).
/// Only regular files are kept: a FIFO, a device or a link in a report's place is removed, so
/// that nothing reading the record later meets it.
fn keep_reports(reports: &std::path::Path, stage_dir: &std::path::Path, attempt: u32) {
    for name in REPORTS {
        let from = report_path(reports, name);
        match std::fs::symlink_metadata(&from) {
            Ok(m) if m.is_file() => {}
            Ok(_) => {
                let _ = std::fs::remove_file(&from);
                continue;
            }
            Err(_) => continue,
        }
        let _ = std::fs::create_dir_all(stage_dir);
        let to = if name == METRICS { stage_dir.join(name) } else { stage_dir.join(format!("attempt-{attempt}.{name}")) };
        if name == METRICS && to.exists() {
            let to = mflow_untrusted::open_with(&to, std::fs::OpenOptions::new().append(true), mflow_untrusted::Links::Refuse);
            let appended = to.and_then(|mut f| crate::untrusted::copy_from(&from, 0, &mut f));
            if appended.is_ok() {
                let _ = std::fs::remove_file(&from);
            }
        } else {
            let _ = std::fs::rename(&from, &to);
        }
    }
}

/// Checks the stage's gates against the `metrics.json` in its output, records the results, and
/// returns the failure message if any gate failed.
pub(super) async fn check_gates(sh: &Shared, i: usize, output: &std::path::Path) -> Option<String> {
    let name = sh.plan.stages[i].spec.name.as_str();
    let gates = &sh.plan.stages[i].spec.gates;
    if gates.is_empty() {
        return None;
    }
    let metrics = read_json(&output.join("metrics.json"), RESULT_JSON).await.unwrap_or(Json::Null);
    let results = crate::exec::gates::evaluate(gates, &metrics);
    let failed: Vec<String> = results
        .iter()
        .filter(|g| !g.passed)
        .map(|g| format!("{} = {} is not {}", g.metric, g.value.map(|v| format!("{v:.4}")).unwrap_or("missing".into()), g.condition))
        .collect();
    sh.update(name, |r| {
        r.gates = results.clone();
        if r.metrics.is_none() {
            r.metrics = Some(metrics.clone());
        }
    })
    .await;
    if failed.is_empty() { None } else { Some(format!("gate failed: {}", failed.join("; "))) }
}

async fn fail(sh: &Shared, name: &str, class: FailureClass, message: String) -> StageEnd {
    let status = if class == FailureClass::Cancelled { StageStatus::Cancelled } else { StageStatus::Failed };
    sh.update(name, |r| {
        r.status = status;
        r.message = Some(format!("{class}: {message}"));
        r.finished = Some(record::now());
    })
    .await;
    sh.show(name, if status == StageStatus::Cancelled { "cancelled" } else { "failed" }, &format!("{class}: {message}"));
    StageEnd::Failed { class, message }
}

/// A file the stage wrote about itself, read off the runtime (`crate::untrusted`).
async fn read_json(path: &std::path::Path, cap: u64) -> Option<Json> {
    crate::untrusted::read_json_async(path.to_path_buf(), cap).await
}


/// Follows the stage's progress file and forwards the newest event to the display.
async fn watch_progress(path: PathBuf, stage: String, sh: std::sync::Arc<Shared>) {
    let t0 = Instant::now();
    let mut offset = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Only what was appended since the last look, a bounded piece at a time.
        let p = path.clone();
        let Ok((new, size)) = crate::untrusted::blocking(move || crate::untrusted::read_from(&p, offset, PROGRESS_PIECE)).await else { continue };
        if new.is_empty() {
            continue;
        }
        let end = new.iter().rposition(|&b| b == b'\n').map(|p| p + 1).unwrap_or(0);
        // A piece without a line end, as large as a piece can be, is skipped rather than waited on.
        let end = if end == 0 && new.len() as u64 == PROGRESS_PIECE { new.len() } else { end };
        offset += end as u64;
        if offset < size.saturating_sub(PROGRESS_PIECE) {
            // Far behind: only the newest events matter to the display.
            offset = size - PROGRESS_PIECE;
            continue;
        }
        if let Some(ev) = std::str::from_utf8(&new[..end]).ok().and_then(|s| s.lines().rev().find_map(mflow_progress::Event::parse)) {
            sh.display.lock().unwrap().progress(&stage, &ev, t0.elapsed());
        }
    }
}
