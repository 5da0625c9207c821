//! Which workdir a command that reads runs reads: the one it is given (`--workdir`), that of a
//! spec (`--spec`), `.mflow` here, or those of the specs under the current directory, said on
//! standard error so that nobody wonders where the runs came from.

use std::path::{Path, PathBuf};

use super::args::WorkdirArgs;
use super::Printer;
use crate::workdir::Workdir;
use crate::Error;

/// How deep below the current directory specs are looked for.
const SPEC_DEPTH: usize = 2;

impl WorkdirArgs {
    /// The path asked for, for the commands that may read it through a cluster instead.
    pub fn given(&self) -> PathBuf {
        self.workdir.clone().unwrap_or_else(|| PathBuf::from(crate::spec::DEFAULT_WORKDIR))
    }

    /// Every workdir these arguments stand for (one, unless found by looking for specs).
    pub fn resolve(&self, p: &Printer) -> Result<Vec<Workdir>, Error> {
        if let Some(w) = &self.workdir {
            // Every command here reads a workdir's records: a path that holds none is a mistake.
            return match crate::workdir::inspect(w) {
                Ok(crate::workdir::Found::Missing) => Err(Error::usage(
                    format!("there is no workdir at {}", w.display()),
                    "pass the workdir of a spec that has run (`.mflow` beside it unless the spec says otherwise), or --spec SPEC",
                )),
                Ok(_) => Ok(vec![Workdir::new(w)]),
                Err(refusal) => {
                    Err(Error::usage(format!("--workdir is not a workdir mflow may use: {}", refusal.reason), refusal.help))
                }
            };
        }
        if let Some(spec) = &self.spec {
            return Ok(vec![crate::spec::load(spec, &[])?.workdir()]);
        }
        let here = Path::new(crate::spec::DEFAULT_WORKDIR);
        if here.is_dir() {
            return Ok(vec![Workdir::new(here)]);
        }
        let found = specs_with_runs(Path::new("."));
        if found.is_empty() {
            return Err(Error::usage(
                "no workdir here: no .mflow in this directory, and no spec below it has run",
                "pass --spec SPEC (the workdir of that spec) or --workdir DIR",
            ));
        }
        for (spec, workdir) in &found {
            p.note(format!("mflow: reading the runs of {} ({})", workdir.display(), spec.display()));
        }
        Ok(found.into_iter().map(|(_, w)| w).collect())
    }

    /// The one workdir these arguments stand for; several found is a question for the user.
    pub fn resolve_one(&self, p: &Printer) -> Result<Workdir, Error> {
        let mut all = self.resolve(p)?;
        if all.len() > 1 {
            let names: Vec<String> = all.iter().map(|w| w.display().to_string()).collect();
            return Err(Error::usage(
                format!("the specs here have {} workdirs: {}", all.len(), names.join(", ")),
                "say which with --spec SPEC or --workdir DIR",
            ));
        }
        Ok(all.remove(0))
    }
}

/// The specs below `dir` (at most [`SPEC_DEPTH`] levels, hidden directories and `target` aside)
/// whose workdir holds runs, each with that workdir; one entry per workdir.
fn specs_with_runs(dir: &Path) -> Vec<(PathBuf, Workdir)> {
    let mut specs = Vec::new();
    toml_files(dir, SPEC_DEPTH, &mut specs);
    specs.sort();
    let mut found: Vec<(PathBuf, Workdir)> = Vec::new();
    for spec in specs {
        let Some(workdir) = workdir_of(&spec) else { continue };
        if workdir.runs().is_dir() && !found.iter().any(|(_, w)| *w == workdir) {
            found.push((spec, workdir));
        }
    }
    found
}

fn toml_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() && depth > 0 && !name.starts_with('.') && name != "target" {
            toml_files(&e.path(), depth - 1, out);
        } else if t.is_file() && name.ends_with(".toml") {
            out.push(e.path());
        }
    }
}

/// The workdir of a spec, read as plain TOML: a spec (a `[pipeline]` table) whose `workdir`,
/// when it has one, is a string.
fn workdir_of(spec: &Path) -> Option<Workdir> {
    let text = crate::untrusted::read_text(spec, crate::spec::MAX_SPEC_BYTES).ok()?;
    let table: toml::Table = text.parse().ok()?;
    let pipeline = table.get("pipeline")?.as_table()?;
    let dir = spec.parent().unwrap_or(Path::new("."));
    let workdir = match pipeline.get("workdir") {
        Some(w) => dir.join(w.as_str()?),
        None => dir.join(crate::spec::DEFAULT_WORKDIR),
    };
    Some(Workdir::new(workdir))
}
