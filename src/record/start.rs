//! The files a run's record starts with: its directory, the spec as run, the overrides, and
//! plan.json (written on a thread while the run starts).

use std::path::PathBuf;

use crate::plan::{Decision, StageDecision};
use crate::workdir::Workdir;

pub struct Started {
    pub id: String,
    pub dir: PathBuf,
    plan_writer: std::thread::JoinHandle<std::io::Result<()>>,
}

impl Started {
    /// Waits for plan.json.
    pub fn join(self) {
        let _ = self.plan_writer.join();
    }
}

/// Creates the record of a new run in `workdir`. `all_cached`: every stage was found cached
/// while planning (plan.json may then be the last such run's, linked).
pub fn start(
    workdir: &Workdir,
    source: &str,
    overrides: &[String],
    decisions: Vec<StageDecision>,
    all_cached: bool,
) -> std::io::Result<Started> {
    let id = super::run_id_for(workdir);
    let dir = workdir.run(&id);
    std::fs::create_dir_all(crate::workdir::stages_dir(&dir))?;
    // The spec as run; the same spec as the last run's is a link to that run's copy (a spec
    // of 5,000 stages is more than a megabyte).
    let identity = Some(super::lock::spec_identity(source));
    super::lock::write_linked(workdir, &id, "spec.toml", "spec.last", identity, |p| std::fs::write(p, source))?;
    if !overrides.is_empty() {
        let _ = std::fs::write(dir.join("overrides.txt"), overrides.join("\n"));
    }
    // plan.json is written while the run starts; it is complete before the run ends. The plan
    // of a run where every stage is cached is the last such run's when the same stages had the
    // same keys: a link to that file then.
    let plan_writer = {
        let (workdir, id) = (workdir.clone(), id.clone());
        std::thread::spawn(move || {
            let identity = if all_cached { plan_identity(&decisions) } else { None };
            super::lock::write_linked(&workdir, &id, "plan.json", "plan.last", identity, |p| {
                super::write_json(p, &decisions)
            })
        })
    };
    Ok(Started { id, dir, plan_writer })
}

/// A digest of everything that decides the bytes of plan.json when every stage is cached (the
/// reasons of stages that run would change with the last run's keys): each stage's name, kind,
/// needs, key and engine, and the binary that serializes them. `None` otherwise.
fn plan_identity(decisions: &[StageDecision]) -> Option<String> {
    let mut h = crate::cache::key::PartsHasher::default();
    h.part(b"mflow-plan-identity-1").part(crate::env::binary_identity()?);
    for d in decisions {
        let Decision::Cached { key } = &d.decision else { return None };
        h.part(d.stage.as_bytes()).part(d.kind.as_bytes()).part(d.needs.len().to_string().as_bytes());
        for n in &d.needs {
            h.part(n.as_bytes());
        }
        h.part(key.as_bytes()).part(&serde_json::to_vec(&d.engine).ok()?);
    }
    Some(h.hex())
}
