//! The commands that read run records: `runs`, `status`, `logs`, here or in a cluster.

use std::path::Path;

use super::args::{BackendChoice, LogsArgs, RemoteArgs, RunsArgs, StatusArgs, WorkdirArgs};
use super::{runtime, Printer};
use crate::backend::kubernetes::outside;
use crate::exit::ExitCode;
use crate::record::{self, RunStatus, StageStatus};
use crate::workdir::Workdir;
use crate::{spec, Error};

pub fn runs(a: RunsArgs, p: &Printer) -> Result<ExitCode, Error> {
    let dir = a.workdir.given();
    if wanted(&a.remote, &dir) {
        let w = on_volume(&dir).map(Path::to_path_buf);
        return connect_and(&a.remote, |c, ns| async move { outside::records::runs(&c, &ns, w.as_deref()).await });
    }
    for workdir in a.workdir.resolve(p)? {
        list_runs(&workdir, p);
    }
    Ok(ExitCode::Success)
}

fn list_runs(workdir: &Workdir, p: &Printer) {
    for id in record::list(workdir) {
        let Some(r) = record::load(workdir, &id) else {
            // Listed all the same: its logs and lockfile may still be there (`mflow logs`).
            if p.json() {
                let line = serde_json::json!({"id": id, "workdir": workdir.root(), "status": "damaged", "process_gone": false, "pipeline": null, "started": null, "ran": null, "cached": null});
                p.value(&line, true);
            } else {
                p.line(format!("{id}  {:<10} {:<12} run.json cannot be read", "damaged", "-"));
            }
            continue;
        };
        let c = r.counts();
        if p.json() {
            let line = serde_json::json!({"id": id, "workdir": workdir.root(), "status": r.status, "process_gone": gone(&r), "pipeline": r.pipeline, "started": r.started, "ran": c.ran, "cached": c.cached});
            p.value(&line, true);
        } else {
            p.line(format!("{id}  {:<10} {:<12} ran {}, cached {}", status_word(&r), r.pipeline, c.ran, c.cached));
        }
    }
}

/// The workdir holding run `run` (an id or prefix), or the newest run, of those `a` stands for.
fn workdir_of_run(a: &WorkdirArgs, run: Option<&str>, p: &Printer) -> Result<(Workdir, String), Error> {
    let found: Vec<(Workdir, String)> =
        a.resolve(p)?.into_iter().filter_map(|w| record::resolve(&w, run).map(|id| (w, id))).collect();
    // Run ids sort by their start: the newest is the greatest.
    found
        .into_iter()
        .max_by(|x, y| x.1.cmp(&y.1))
        .ok_or_else(|| Error::usage("no such run", "`mflow runs` lists the runs"))
}

pub fn status(a: StatusArgs, p: &Printer) -> Result<ExitCode, Error> {
    let dir = a.workdir.given();
    if wanted(&a.remote, &dir) {
        let run = a.run;
        return connect_and(&a.remote, |c, ns| async move { outside::records::status(&c, &ns, run.as_deref()).await });
    }
    let (workdir, id) = workdir_of_run(&a.workdir, a.run.as_deref(), p)?;
    let r = record::load(&workdir, &id)
        .ok_or_else(|| Error::usage(format!("run {id} has no readable record"), "the run directory may be damaged"))?;
    if p.json() {
        p.value(&r, false);
        return Ok(ExitCode::Success);
    }
    p.line(format!("run {id} ({}) {}", r.pipeline, status_word(&r)));
    if gone(&r) {
        let pid = r.process.as_ref().map_or(0, |p| p.pid);
        p.note(format!("mflow: the process that ran it (pid {pid}) is gone without ending the run; its record stays as it was then"));
    }
    for name in &r.order {
        let s = &r.stages[name];
        let dur = s.duration_s.map(|d| format!("{d:.1}s")).unwrap_or_default();
        let attempts = if s.attempts.len() > 1 { format!(" ({} attempts)", s.attempts.len()) } else { String::new() };
        let failure = s.failure().unwrap_or_default();
        p.line(format!("  {:<20} {:<10} {:>8}{attempts} {failure}", name, s.status.as_str(), dur));
    }
    Ok(ExitCode::Success)
}

pub fn logs(a: LogsArgs, p: &Printer) -> Result<ExitCode, Error> {
    let dir = a.workdir.given();
    let (run, stage) =
        if a.args.len() == 2 { (Some(a.args[0].clone()), a.args[1].clone()) } else { (None, a.args[0].clone()) };
    if wanted(&a.remote, &dir) {
        let follow = a.follow;
        return connect_and(&a.remote, |c, ns| async move {
            outside::records::logs(&c, &ns, run.as_deref(), &stage, follow).await
        });
    }
    let (workdir, id) = workdir_of_run(&a.workdir, run.as_deref(), p)?;
    if !spec::valid_name(&stage) {
        return Err(Error::usage(format!("invalid stage name `{stage}`"), "give a stage name from the spec"));
    }
    let attempts =
        || record::load(&workdir, &id).map(|r| (r.stages.get(&stage).map(|s| s.attempts.len()).unwrap_or(0), r.status));
    let stage_dir = crate::workdir::stage_dir(&workdir.run(&id), &stage);
    let mut seen = attempts().or_else(|| {
        let found = attempt_logs(&stage_dir);
        if found > 0 {
            p.note(format!("mflow: run {id} has no readable run.json; showing the attempt logs in its directory"));
        }
        // Without a record nothing says the run goes on: nothing to wait for.
        Some((found, RunStatus::Failed))
    });
    // Followed while the run goes on: the stage's first attempt may not be recorded yet.
    while a.follow && matches!(seen, Some((0, RunStatus::Running))) {
        std::thread::sleep(std::time::Duration::from_millis(250));
        seen = attempts();
    }
    let n = seen.map(|(n, _)| n).unwrap_or(0);
    if n == 0 {
        return Err(Error::usage(
            format!("stage `{stage}` has no log in run {id}"),
            "cached stages have no log; see `mflow status`",
        ));
    }
    let log = Log { dir: stage_dir, workdir, id, stage };
    log.print(n, a.follow, p)?;
    Ok(ExitCode::Success)
}

/// The highest N of the `attempt-N.log` files in `dir`: the attempts of a stage whose run record
/// cannot be read (an attempt that printed nothing has no file, so the highest counts). Beyond
/// what retries allow (4 classes of at most 1000), a name is not an attempt's.
fn attempt_logs(dir: &Path) -> usize {
    let n = |name: &str| {
        name.strip_prefix("attempt-")?.strip_suffix(".log")?.parse::<usize>().ok().filter(|n| (1..=4001).contains(n))
    };
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| n(&e.file_name().to_string_lossy()))
        .max()
        .unwrap_or(0)
}

/// A run recorded as running whose process ended without finishing its record (killed outright).
fn gone(r: &crate::record::RunRecord) -> bool {
    r.status == RunStatus::Running && r.process.as_ref().and_then(crate::backend::local::still_runs) == Some(false)
}

/// The status a run is shown with: `gone` for a run whose process is gone.
fn status_word(r: &crate::record::RunRecord) -> &'static str {
    if gone(r) {
        "gone"
    } else {
        r.status.as_str()
    }
}

/// Most of an attempt log `mflow logs` prints: the end of a larger log, saying so.
const LOG_SHOWN: u64 = 64 << 20;

/// The attempt logs of a stage of a run.
struct Log {
    dir: std::path::PathBuf,
    workdir: Workdir,
    id: String,
    stage: String,
}

impl Log {
    /// Prints every attempt's log up to `attempts`, following the last while it grows.
    fn print(&self, attempts: usize, follow: bool, p: &Printer) -> Result<(), Error> {
        for n in 1..attempts {
            p.line(format!("--- attempt {n} ---"));
            print_from(&self.dir.join(format!("attempt-{n}.log")), 0, p)?;
        }
        let path = self.dir.join(format!("attempt-{attempts}.log"));
        if attempts > 1 {
            p.line(format!("--- attempt {attempts} ---"));
        }
        let mut pos = 0u64;
        loop {
            let before = pos;
            pos = print_from(&path, pos, p)?;
            if !follow {
                return Ok(());
            }
            let r = record::load(&self.workdir, &self.id);
            let s = r.as_ref().and_then(|r| r.stages.get(&self.stage));
            let still = s.is_some_and(|s| s.status == StageStatus::Running && s.attempts.len() == attempts);
            if !still && pos == before {
                return match s {
                    Some(s) if s.attempts.len() > attempts => self.print(s.attempts.len(), follow, p),
                    _ => Ok(()),
                };
            }
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
    }
}

/// Prints `path` from `pos` on (at most its last [`LOG_SHOWN`] bytes); returns the new position.
/// The log is in the run record, where a stage can reach it: it is read as the one reader of
/// such files does, so a FIFO or a device there is an error, not a hang.
fn print_from(path: &Path, pos: u64, p: &Printer) -> Result<u64, Error> {
    let size = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => m.len(),
        // A stage that has printed nothing has no log file yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(pos),
        _ => 0,
    };
    let mut from = pos;
    if size > pos + LOG_SHOWN {
        from = size - LOG_SHOWN;
        p.note(format!("mflow: {} is {size} bytes; showing its last {LOG_SHOWN}", path.display()));
    }
    let copied = p.stream(|w| crate::untrusted::copy_from(path, from, w)).map_err(|e| Error::io(path, e))?;
    Ok(from + copied)
}

/// Whether the runs asked for are those of a cluster: said with --backend, or implied by
/// --namespace, --context, or a workdir on the volume that is not mounted here.
pub(super) fn wanted(remote: &RemoteArgs, workdir: &Path) -> bool {
    let mount = Path::new(mflow_kube::ARTIFACT_MOUNT);
    remote.backend == Some(BackendChoice::Kubernetes)
        || (remote.backend.is_none()
            && (remote.cluster.namespace.is_some()
                || remote.cluster.context.is_some()
                || (workdir.starts_with(mount) && !mount.is_dir())))
}

/// The workdir to filter the cluster's runs by: one on the volume, if one was given.
pub(super) fn on_volume(workdir: &Path) -> Option<&Path> {
    workdir.starts_with(mflow_kube::ARTIFACT_MOUNT).then_some(workdir)
}

/// Connects to the cluster of `remote` and runs `f` with its client and namespace; a refusal
/// is shown with its exit code.
pub(super) fn connect_and<F, Fut>(remote: &RemoteArgs, f: F) -> Result<ExitCode, Error>
where
    F: FnOnce(kube::Client, String) -> Fut,
    Fut: std::future::Future<Output = Result<ExitCode, outside::RemoteError>>,
{
    runtime()?.block_on(async {
        let kube = outside::connect(remote.cluster.namespace.clone(), remote.cluster.context.clone()).await?;
        match f(kube.client().clone(), kube.namespace().to_string()).await {
            Ok(code) => Ok(code),
            Err(e) => {
                let code = e.exit_code();
                crate::errln!("{:?}", miette::Report::new(e));
                Ok(code)
            }
        }
    })
}
