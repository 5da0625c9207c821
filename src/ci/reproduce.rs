//! `mflow reproduce RUN`: rerun a recorded run from its lockfile. The run directory's copy of the
//! spec and its overrides are used as they were; every pinned digest is checked first (the spec
//! copy, each input file, and the rest of each stage's key), and after the run every stage's key
//! must equal the lockfile's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cache::key::{short, KeyParts};
use crate::env::Environment;
use crate::exit::ExitCode;
use crate::plan::{self, Plan};
use crate::record::{self, Lockfile, RunRecord};
use crate::reporter::console::Mode;
use crate::workdir::Workdir;

use super::run_data::RunData;
use super::CiError;

/// Why a reproduction is refused: each line names the spec, file or stage that moved.
#[derive(Debug)]
pub struct Refusal(pub Vec<String>);

pub struct Prepared {
    pub plan: Plan,
    pub env: Environment,
    pub lock: Lockfile,
}

/// Checks everything that can be checked before running.
pub fn prepare(workdir: &Workdir, run: &str) -> Result<Result<Prepared, Refusal>, CiError> {
    let data = RunData::load(workdir, Some(run))?;
    let lock =
        data.lock.clone().ok_or_else(|| CiError::DamagedRun { run: data.id.clone(), file: "mflow.lock".into() })?;
    let reasons = check_lock(&data.record, &lock);
    if !reasons.is_empty() {
        return Ok(Err(Refusal(reasons)));
    }
    let copy = data.dir.join("spec.toml");
    let text = crate::untrusted::read_text(&copy, crate::spec::MAX_SPEC_BYTES)
        .map_err(|_| CiError::DamagedRun { run: data.id.clone(), file: "spec.toml".into() })?;
    let digest = blake3::hash(text.as_bytes()).to_hex().to_string();
    if digest != lock.spec_digest {
        return Ok(Err(Refusal(vec![format!(
            "spec: the run's copy {} has digest {} but the lockfile pins {}",
            copy.display(),
            short(&digest),
            shown(&lock.spec_digest)
        )])));
    }
    let overrides: Vec<String> =
        crate::untrusted::read_text(&data.dir.join("overrides.txt"), crate::spec::MAX_SPEC_BYTES)
            .map(|s| s.lines().filter(|l| !l.is_empty()).map(str::to_string).collect())
            .unwrap_or_default();
    if overrides != lock.overrides {
        return Ok(Err(Refusal(vec![format!(
            "overrides: overrides.txt says {:?} but the lockfile pins {:?}",
            overrides, lock.overrides
        )])));
    }
    let spec_path = locate_spec(workdir.root(), &lock.spec);
    let mut spec = match crate::spec::parse(&spec_path, &text, &lock.overrides) {
        Ok(s) => s,
        Err(e) => {
            return Ok(Err(Refusal(vec![format!("spec: the recorded spec no longer parses with this mflow: {e}")])))
        }
    };
    // The run's selection: the stages its lockfile pins (a run of some stages pins those and
    // what they need), not the whole spec. Pinned stages the plan inserts (reshards), or that
    // are gone, are the plan comparison's to report.
    let locked: Vec<String> = lock.stages.keys().filter(|n| spec.stage(n).is_some()).cloned().collect();
    if !locked.is_empty() {
        spec.keep_stages_for(&locked).expect("every kept name is a stage");
    }
    if !same_dir(spec.workdir().root(), workdir.root()) {
        return Ok(Err(Refusal(vec![format!(
            "spec: the recorded spec path `{}` does not lead back to the workdir {} (run `mflow reproduce` from the directory the run was started in)",
            lock.spec,
            workdir.display()
        )])));
    }
    let env = Environment::detect(spec.python.as_deref());
    let plan = match plan::build(spec, &env) {
        Ok(p) => p,
        Err(plan::PlanError::Input(e)) => return Ok(Err(Refusal(vec![format!("input: {e}")]))),
        Err(e) => return Ok(Err(Refusal(vec![format!("plan: {e}")]))),
    };
    let reasons = compare_with_lock(&plan, &lock);
    Ok(if reasons.is_empty() { Ok(Prepared { plan, env, lock }) } else { Err(Refusal(reasons)) })
}

/// What the lockfile must say of itself before anything else is read from it: a format this
/// mflow knows, each stage's key derived from its recorded parts as the engine derives it, and
/// the stages the run recorded with their keys (a stage left out would go unreproduced).
fn check_lock(record: &RunRecord, lock: &Lockfile) -> Vec<String> {
    if !(1..=mflow_contract::lock::FORMAT).contains(&lock.version) {
        return vec![format!(
            "lockfile: version {} is not a format this mflow reads (version {} and older)",
            lock.version,
            mflow_contract::lock::FORMAT
        )];
    }
    let mut reasons = Vec::new();
    for (name, locked) in &lock.stages {
        if locked.parts.key() != locked.key {
            reasons.push(format!(
                "stage `{name}`: the lockfile's key {} does not match its own parts (the lockfile was edited)",
                shown(&locked.key)
            ));
        }
        if !record.stages.contains_key(name) {
            reasons.push(format!("stage `{name}`: in the lockfile but not in the run's record (run.json)"));
        }
    }
    for (name, s) in &record.stages {
        let Some(key) = &s.key else { continue };
        match lock.stages.get(name) {
            None => reasons.push(format!(
                "stage `{name}`: the run recorded key {} but the lockfile has no entry for the stage",
                shown(key)
            )),
            Some(l) if &l.key != key => reasons.push(format!(
                "stage `{name}`: the lockfile pins key {} but the run recorded {}",
                shown(&l.key),
                shown(key)
            )),
            Some(_) => {}
        }
    }
    reasons
}

/// A digest read from a file, shortened without assuming it is ASCII.
fn shown(d: &str) -> String {
    d.chars().take(12).collect()
}

/// What differs between a key's parts and the lockfile's, in words, to end a line with.
fn differences(new: &KeyParts, old: &KeyParts) -> String {
    let d = crate::cache::key::diff(new, old);
    if d.is_empty() {
        // The same parts: the lockfile's key is not theirs.
        " (the lockfile's key does not match its own parts)".into()
    } else {
        format!(": {}", d.join("; "))
    }
}

/// Input digests first (the usual cause), then any other part of a stage's key, with upstream
/// digests taken from the lockfile.
fn compare_with_lock(plan: &Plan, lock: &Lockfile) -> Vec<String> {
    let mut reasons = Vec::new();
    for (name, locked) in &lock.stages {
        let Some(i) = plan.index(name) else {
            reasons.push(format!("stage `{name}`: in the lockfile but not in the plan"));
            continue;
        };
        let now = &plan.stages[i].parts.inputs;
        for (file, pinned) in locked.parts.inputs.iter() {
            match now.get(file) {
                None => reasons.push(format!(
                    "stage `{name}`: input file `{file}` is no longer an input (pinned {})",
                    shown(pinned)
                )),
                Some(d) if d != pinned => reasons.push(format!(
                    "stage `{name}`: input file `{file}` changed: digest {} but the lockfile pins {}",
                    short(d),
                    shown(pinned)
                )),
                _ => {}
            }
        }
        for file in now.keys().filter(|f| !locked.parts.inputs.contains_key(*f)) {
            reasons.push(format!("stage `{name}`: input file `{file}` is new since the run"));
        }
    }
    if !reasons.is_empty() {
        return reasons;
    }
    let by_index: BTreeMap<usize, &str> =
        plan.stages.iter().enumerate().map(|(i, s)| (i, s.spec.name.as_str())).collect();
    for (name, locked) in &lock.stages {
        let Some(i) = plan.index(name) else { continue };
        let digest_of = |d: usize| by_index.get(&d).and_then(|n| locked.parts.upstream.get(*n).cloned());
        let Some(parts) = plan.parts_with(i, &digest_of) else { continue };
        if parts.key() != locked.key {
            reasons.push(format!(
                "stage `{name}`: key {} no longer matches the lockfile's {}{}",
                short(&parts.key()),
                shown(&locked.key),
                differences(&parts, &locked.parts)
            ));
        }
    }
    reasons
}

/// The spec's recorded path as given at run time: relative to where the run started, which is
/// usually the current directory or the workdir's parent.
fn locate_spec(workdir: &Path, recorded: &str) -> PathBuf {
    let p = PathBuf::from(recorded);
    if p.is_absolute() || p.exists() {
        return p;
    }
    let beside = workdir.parent().map(|d| d.join(p.file_name().unwrap_or_default())).unwrap_or(p.clone());
    if beside.exists() {
        beside
    } else {
        p
    }
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// Runs a prepared reproduction and checks the new keys. Returns the exit code and a report.
pub fn run(prepared: Prepared, mode: Mode) -> Result<(ExitCode, Vec<String>), crate::Error> {
    let Prepared { plan, env, lock } = prepared;
    let rt = tokio::runtime::Runtime::new().map_err(|e| crate::Error::io(Path::new("tokio runtime"), e))?;
    let opts = crate::run::Options {
        jobs: None,
        force: vec![],
        verify: true,
        mode,
        overrides: lock.overrides.clone(),
        reporters: vec![],
    };
    let outcome = rt.block_on(crate::run::run(plan, env, opts))?;
    let code = outcome.exit;
    let mut lines =
        vec![format!("run {} {}", outcome.record.id, format!("{:?}", outcome.record.status).to_lowercase())];
    if code != ExitCode::Success {
        return Ok((code, lines));
    }
    let new: BTreeMap<String, std::sync::Arc<KeyParts>> = record::load_lock(&outcome.workdir, &outcome.record.id)
        .map(|l| l.stages.into_iter().map(|(n, s)| (n, s.parts)).collect())
        .unwrap_or_default();
    let mut mismatched = false;
    for (name, locked) in &lock.stages {
        match new.get(name) {
            Some(parts) if parts.key() == locked.key => {
                lines.push(format!("  {name:<20} key {} matches", shown(&locked.key)))
            }
            Some(parts) => {
                mismatched = true;
                lines.push(format!(
                    "  {name:<20} key {} differs from the lockfile's {}{}",
                    short(&parts.key()),
                    shown(&locked.key),
                    differences(parts, &locked.parts)
                ));
            }
            None => {
                mismatched = true;
                lines.push(format!("  {name:<20} has no key in the new run"));
            }
        }
    }
    Ok((if mismatched { ExitCode::Mismatch } else { ExitCode::Success }, lines))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(salt: &str) -> KeyParts {
        KeyParts {
            kind: "command".into(),
            kind_version: 1,
            params: std::sync::Arc::new(serde_json::json!({"run": ["true"]})),
            upstream: BTreeMap::new(),
            inputs: Default::default(),
            workload: String::new(),
            environment: String::new(),
            salt: salt.into(),
        }
    }

    #[test]
    fn the_same_parts_under_another_key_say_so_rather_than_nothing() {
        assert_eq!(differences(&parts("a"), &parts("a")), " (the lockfile's key does not match its own parts)");
        assert_eq!(differences(&parts("b"), &parts("a")), ": salt: \"a\" -> \"b\"");
        assert_eq!(shown("ééééééééééééééé"), "éééééééééééé", "no panic inside a character");
    }
}
