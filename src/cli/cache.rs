//! The commands that maintain a workdir's cache: `gc` and `cache repair`.

use super::args::{CacheCommand, GcArgs};
use super::Printer;
use crate::exit::ExitCode;
use crate::workdir::Workdir;
use crate::Error;

pub fn gc(a: GcArgs, p: &Printer) -> Result<ExitCode, Error> {
    gc_in(&a.workdir.resolve_one(p)?, a.keep_runs, a.dry_run, a.wait, p)
}

pub fn cache(c: CacheCommand, p: &Printer) -> Result<ExitCode, Error> {
    let CacheCommand::Repair { workdir, dry_run, wait } = c;
    repair(&workdir.resolve_one(p)?, dry_run, wait, p)
}

fn gc_in(workdir: &Workdir, keep_runs: usize, dry_run: bool, wait: bool, p: &Printer) -> Result<ExitCode, Error> {
    let r = match crate::cache::gc(workdir, keep_runs, dry_run, wait) {
        Ok(r) => r,
        Err(e) => return Ok(refused(e, p)),
    };
    let verb = if dry_run { "would remove" } else { "removed" };
    for (key, _) in &r.removed {
        if dry_run {
            p.line(format!("would remove {key}"));
        }
    }
    let freed: u64 = r.removed.iter().map(|(_, b)| b).sum();
    p.line(format!(
        "{verb} {} entries, {:.1} MB; kept {} that recent runs use",
        r.removed.len(),
        freed as f64 / 1e6,
        r.kept
    ));
    if !r.locked.is_empty() {
        p.line(format!("left {} entries being computed right now", r.locked.len()));
    }
    if !r.unreadable.is_empty() {
        let n = r.unreadable.len();
        let ids = r.unreadable.iter().take(3).map(|id| crate::spec::error::excerpt(id)).collect::<Vec<_>>().join(", ");
        p.note(format!("mflow: warning: {n} runs have no readable run.json ({ids}); they were passed over, and what only they used was not kept"));
    }
    if let Some(log) = &r.no_log {
        p.note(format!("mflow: the manifest log {} is missing, so no entry is known to be mflow's: nothing was removed; `mflow cache repair --workdir {}` rebuilds it", log.display(), workdir.display()));
    } else if !r.unknown.is_empty() {
        p.note(format!("mflow: left {} names in the cache that the manifest log does not know ({}); `mflow cache repair --workdir {}` looks at them", r.unknown.len(), r.unknown.iter().take(3).cloned().collect::<Vec<_>>().join(", "), workdir.display()));
    }
    Ok(ExitCode::Success)
}

fn repair(workdir: &Workdir, dry_run: bool, wait: bool, p: &Printer) -> Result<ExitCode, Error> {
    let r = match crate::cache::repair(workdir, dry_run, wait) {
        Ok(r) => r,
        Err(e) => return Ok(refused(e, p)),
    };
    let would = if dry_run { "would be " } else { "" };
    if let Some((what, to)) = &r.log_moved {
        p.line(format!("the manifest log was {what}: {would}moved to {}", to.display()));
    }
    for key in &r.restored {
        p.line(format!("{would}restored {key}"));
    }
    for (key, to, why) in &r.set_aside {
        p.line(format!("{would}set aside {key} ({why}): {}", to.display()));
    }
    for path in &r.duplicates {
        p.line(format!("{would}removed {} (the committed entry holds the same files)", path.display()));
    }
    p.line(format!(
        "{} intact, {} {would}restored, {} {would}set aside, {} duplicates {would}removed",
        r.intact,
        r.restored.len(),
        r.set_aside.len(),
        r.duplicates.len()
    ));
    if !r.unverified.is_empty() {
        p.line(format!(
            "{} directories in cache/.unverified/ match no run record: look at them and delete what you do not need",
            r.unverified.len()
        ));
    }
    if !r.foreign.is_empty() {
        p.line(format!(
            "left {} names in the cache that are not mflow entries: {}",
            r.foreign.len(),
            r.foreign.join(", ")
        ));
    }
    Ok(ExitCode::Success)
}

/// A maintenance command that was refused or failed: the diagnostic, and its exit code.
fn refused(e: crate::cache::CacheError, p: &Printer) -> ExitCode {
    let code = e.exit_code();
    p.diagnostic(e);
    code
}
