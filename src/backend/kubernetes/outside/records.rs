//! `mflow runs`, `status`, `logs` and `report` for runs started outside the cluster: the
//! drivers are found by their labels, and their records are read on the volume by the image's
//! own mflow in a volume pod, so that the laptop reads exactly what a local workdir would show.

use std::io::Write;
use std::path::Path;

use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams};
use serde::Deserialize;

use super::volume::{Reader, VolumePod};
use super::RemoteError;
use crate::exit::ExitCode;
use mflow_kube::driver::{ANNOTATION_PIPELINE, ANNOTATION_WORKDIR, LABEL_RUN};

/// A run's driver, as its Job says.
#[derive(Debug, Clone)]
pub struct Driver {
    pub run: String,
    pub pipeline: String,
    pub job: String,
    pub workdir: String,
    pub image: String,
    pub pvc: String,
    pub host_network: bool,
    pub state: &'static str,
    created: i64,
}

/// One line of `mflow --log-format json runs`.
#[derive(Debug, Clone, Deserialize)]
pub struct RunLine {
    pub id: String,
    pub status: String,
    pub pipeline: String,
    pub ran: usize,
    pub cached: usize,
}

impl RunLine {
    /// The driver run this record belongs to: a driver that was started again records
    /// `<run>.2`, `<run>.3`, ...
    fn run(&self) -> &str {
        self.id.split_once('.').map_or(self.id.as_str(), |(r, _)| r)
    }
}

/// Every driver in the namespace, oldest first.
pub async fn drivers(client: &kube::Client, namespace: &str) -> Result<Vec<Driver>, RemoteError> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let listed = jobs
        .list(&ListParams::default().labels(mflow_kube::driver::SELECTOR))
        .await
        .map_err(|e| RemoteError::call("list the drivers", &e))?;
    let mut out: Vec<Driver> = listed.items.iter().filter_map(driver_of).collect();
    out.sort_by(|a, b| (a.created, &a.run).cmp(&(b.created, &b.run)));
    Ok(out)
}

fn driver_of(job: &Job) -> Option<Driver> {
    let meta = &job.metadata;
    let run = meta.labels.as_ref()?.get(LABEL_RUN)?.clone();
    let workdir = meta.annotations.as_ref()?.get(ANNOTATION_WORKDIR)?.clone();
    // Only a workdir on the volume is read through it.
    if !Path::new(&workdir).starts_with(mflow_kube::ARTIFACT_MOUNT) || workdir.split('/').any(|c| c == "..") {
        return None;
    }
    let pod = job.spec.as_ref()?.template.spec.as_ref()?;
    let image = pod.containers.first()?.image.clone()?;
    let pvc =
        pod.volumes.iter().flatten().find_map(|v| v.persistent_volume_claim.as_ref().map(|c| c.claim_name.clone()))?;
    let status = job.status.clone().unwrap_or_default();
    let condition = |t: &str| status.conditions.iter().flatten().any(|c| c.type_ == t && c.status == "True");
    let state = if condition("Complete") {
        "succeeded"
    } else if condition("Failed") {
        "failed"
    } else if status.active.unwrap_or(0) > 0 {
        "running"
    } else {
        "pending"
    };
    Some(Driver {
        job: meta.name.clone()?,
        pipeline: meta.annotations.as_ref()?.get(ANNOTATION_PIPELINE).cloned().unwrap_or_default(),
        run,
        workdir,
        image,
        pvc,
        host_network: pod.host_network == Some(true),
        state,
        created: meta.creation_timestamp.as_ref().map_or(0, |t| t.0.as_second()),
    })
}

/// The driver a run id (or a unique prefix of one) names; the newest one when none is given.
pub fn pick<'a>(drivers: &'a [Driver], run: Option<&str>, namespace: &str) -> Result<&'a Driver, RemoteError> {
    let no_run = || RemoteError::NoRun { run: run.unwrap_or("(latest)").to_string(), namespace: namespace.to_string() };
    let Some(run) = run.filter(|r| *r != "latest") else { return drivers.last().ok_or_else(no_run) };
    let base = run.split_once('.').map_or(run, |(r, _)| r);
    if let Some(d) = drivers.iter().find(|d| d.run == base) {
        return Ok(d);
    }
    match drivers.iter().filter(|d| d.run.starts_with(base)).collect::<Vec<_>>()[..] {
        [d] => Ok(d),
        _ => Err(no_run()),
    }
}

/// A run id as a shell word: ids are letters, digits, `-` and `.`, and nothing else is let in.
fn word(s: &str) -> Result<&str, RemoteError> {
    if !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')) {
        Ok(s)
    } else {
        Err(RemoteError::Kube {
            what: "name a run or stage".into(),
            message: format!("`{}` is not a run id or stage name", crate::spec::error::excerpt(s)),
        })
    }
}

/// The workdir as a single-quoted shell word.
fn quoted(path: &str) -> String {
    format!("'{}'", path.replace('\'', r"'\''"))
}

/// What one workdir on the volume records, through a volume pod for its driver.
struct Records {
    pod: VolumePod,
    workdir: String,
}

impl Records {
    async fn open(client: &kube::Client, namespace: &str, d: &Driver) -> Result<Records, RemoteError> {
        let pod = VolumePod::ensure(client.clone(), namespace, &d.pvc, &d.image, d.host_network).await?;
        Ok(Records { pod, workdir: d.workdir.clone() })
    }

    async fn runs(&self) -> Result<Vec<RunLine>, RemoteError> {
        let out =
            self.pod.quick(&format!("exec mflow --log-format json runs --workdir {}", quoted(&self.workdir))).await?;
        if !out.success {
            return Err(RemoteError::Receive {
                message: format!("`mflow runs` in the volume pod failed: {}", out.stderr),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    }

    /// The newest record of a driver's run, if it has written one yet.
    async fn newest(&self, d: &Driver) -> Result<Option<String>, RemoteError> {
        Ok(self
            .runs()
            .await?
            .into_iter()
            .filter(|r| r.run() == d.run)
            .map(|r| r.id)
            .max_by(|a, b| attempt(a).cmp(&attempt(b))))
    }

    /// Runs the image's mflow on the workdir; its stdout goes to `stdout` as it comes.
    async fn mflow(&self, args: &str, stdout: Reader) -> Result<bool, RemoteError> {
        let out =
            self.pod.sh_into(&format!("exec mflow {args} --workdir {}", quoted(&self.workdir)), None, stdout).await?;
        if !out.success && !out.stderr.is_empty() {
            crate::errln!("{}", out.stderr);
        }
        Ok(out.success)
    }
}

/// `<run>.N` sorts by N, `<run>` first.
fn attempt(id: &str) -> u32 {
    id.split_once('.').and_then(|(_, n)| n.parse().ok()).unwrap_or(1)
}

fn to_stdout() -> Reader {
    Box::new(|r: &mut dyn std::io::Read| {
        let mut out = std::io::stdout().lock();
        let mut buf = [0u8; 8192];
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                return out.flush();
            }
            out.write_all(&buf[..n])?;
            // A followed log is shown line by line as it comes.
            out.flush()?;
        }
    })
}

/// `mflow runs` against the cluster: every driver, with what its workdir records.
pub async fn runs(client: &kube::Client, namespace: &str, workdir: Option<&Path>) -> Result<ExitCode, RemoteError> {
    let all = drivers(client, namespace).await?;
    let all: Vec<&Driver> = all.iter().filter(|d| workdir.is_none_or(|w| Path::new(&d.workdir) == w)).collect();
    let mut seen: Vec<(&str, &str, &str)> = Vec::new();
    for d in &all {
        let place = (d.workdir.as_str(), d.pvc.as_str(), d.image.as_str());
        if seen.contains(&place) {
            continue;
        }
        seen.push(place);
        let lines = Records::open(client, namespace, d).await?.runs().await?;
        for d in all.iter().filter(|o| (o.workdir.as_str(), o.pvc.as_str(), o.image.as_str()) == place) {
            let mine: Vec<&RunLine> = lines.iter().filter(|l| l.run() == d.run).collect();
            if mine.is_empty() {
                crate::outln!("{}  {:<10} {:<12} no record yet  driver {}", d.run, d.state, d.pipeline, d.state);
            }
            for l in mine {
                crate::outln!(
                    "{}  {:<10} {:<12} ran {}, cached {}  driver {}",
                    l.id,
                    l.status,
                    l.pipeline,
                    l.ran,
                    l.cached,
                    d.state
                );
            }
        }
    }
    if all.is_empty() {
        crate::errln!("no runs started outside the cluster in namespace {namespace}");
    }
    Ok(ExitCode::Success)
}

/// The driver and record of `run`, or why there is none.
async fn open_run(
    client: &kube::Client,
    namespace: &str,
    run: Option<&str>,
) -> Result<(Driver, Records, Option<String>), RemoteError> {
    let all = drivers(client, namespace).await?;
    let d = pick(&all, run, namespace)?.clone();
    let records = Records::open(client, namespace, &d).await?;
    // A restarted driver's records are `<run>.N`: a full id names one of them.
    let id = match run.filter(|r| r.contains('.')) {
        Some(full) => Some(word(full)?.to_string()),
        None => records.newest(&d).await?,
    };
    Ok((d, records, id))
}

fn no_record(d: &Driver) -> ExitCode {
    crate::errln!("run {}: the driver job/{} is {} and has written no record yet", d.run, d.job, d.state);
    ExitCode::Invalid
}

/// `mflow status [RUN]` against the cluster.
pub async fn status(client: &kube::Client, namespace: &str, run: Option<&str>) -> Result<ExitCode, RemoteError> {
    let (d, records, id) = open_run(client, namespace, run).await?;
    let Some(id) = id else { return Ok(no_record(&d)) };
    crate::outln!("driver job/{} in namespace {namespace}: {}", d.job, d.state);
    let ok = records.mflow(&format!("status {}", word(&id)?), to_stdout()).await?;
    Ok(if ok { ExitCode::Success } else { ExitCode::Invalid })
}

/// `mflow logs [RUN] STAGE [--follow]` against the cluster.
pub async fn logs(
    client: &kube::Client,
    namespace: &str,
    run: Option<&str>,
    stage: &str,
    follow: bool,
) -> Result<ExitCode, RemoteError> {
    let (d, records, id) = open_run(client, namespace, run).await?;
    let Some(id) = id else { return Ok(no_record(&d)) };
    let args = format!("logs {} {}{}", word(&id)?, word(stage)?, if follow { " --follow" } else { "" });
    let ok = records.mflow(&args, to_stdout()).await?;
    Ok(if ok { ExitCode::Success } else { ExitCode::Invalid })
}

/// Largest report brought back: reports are a few megabytes.
const MAX_REPORT_BYTES: u64 = 512 << 20;

/// `mflow report [RUN]` against the cluster: written by the image's mflow on the volume, then
/// brought to `out` (default `report-<run>.html` here), staged and renamed.
pub async fn report(
    client: &kube::Client,
    namespace: &str,
    run: Option<&str>,
    out: Option<&Path>,
) -> Result<ExitCode, RemoteError> {
    let (d, records, id) = open_run(client, namespace, run).await?;
    let Some(id) = id else { return Ok(no_record(&d)) };
    let id = word(&id)?.to_string();
    let out = out.map(Path::to_path_buf).unwrap_or_else(|| format!("report-{id}.html").into());
    let staged = staged_beside(&out);
    let file = std::fs::File::create(&staged)
        .map_err(|e| RemoteError::Stream { message: format!("cannot create {}: {e}", staged.display()) })?;
    let script = format!(
        "f=$(mktemp -d) || exit 1\nmflow report {id} --workdir {w} --out \"$f/report.html\" >&2 && cat \"$f/report.html\"\nrc=$?\nrm -rf \"$f\"\nexit $rc",
        w = quoted(&records.workdir)
    );
    let copy: Reader = Box::new(move |r: &mut dyn std::io::Read| {
        let mut w = std::io::BufWriter::new(file);
        let n = std::io::copy(&mut std::io::Read::take(r, MAX_REPORT_BYTES + 1), &mut w)?;
        if n > MAX_REPORT_BYTES {
            return Err(std::io::Error::other(format!(
                "the report is larger than {}",
                super::upload::human(MAX_REPORT_BYTES)
            )));
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()
    });
    let done = records.pod.sh_into(&script, None, copy).await;
    let done = match done {
        Ok(o) if o.success => Ok(()),
        Ok(o) => {
            Err(RemoteError::Receive { message: format!("`mflow report` in the volume pod failed: {}", o.stderr) })
        }
        Err(e) => Err(e),
    };
    let owned = crate::user_output::Owned::new(Path::new(".mflow"));
    let placed = |()| {
        crate::user_output::place(&staged, &out, &owned).map_err(|e| RemoteError::Stream {
            message: format!("{e}: {}", std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default()),
        })
    };
    if let Err(e) = done.and_then(placed) {
        let _ = std::fs::remove_file(&staged);
        return Err(e);
    }
    crate::outln!("{}", out.display());
    Ok(ExitCode::Success)
}

/// Where a file brought from the volume is written before it is renamed to `path`.
pub fn staged_beside(path: &Path) -> std::path::PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    path.with_file_name(format!(".{name}.partial-{:08x}", fastrand::u32(..)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver(run: &str, created: i64) -> Driver {
        Driver {
            run: run.into(),
            pipeline: "p".into(),
            job: format!("mflow-run-{run}"),
            workdir: "/mflow/p".into(),
            image: "i".into(),
            pvc: "c".into(),
            host_network: false,
            state: "running",
            created,
        }
    }

    #[test]
    fn a_run_is_named_by_id_prefix_or_restart_or_defaults_to_the_newest() {
        let all = [driver("20261202-1", 1), driver("20261202-2", 2), driver("20261203-1", 3)];
        assert_eq!(pick(&all, None, "ml").unwrap().run, "20261203-1");
        assert_eq!(pick(&all, Some("20261202-2"), "ml").unwrap().run, "20261202-2");
        assert_eq!(pick(&all, Some("20261202-2.3"), "ml").unwrap().run, "20261202-2");
        assert_eq!(pick(&all, Some("20261203"), "ml").unwrap().run, "20261203-1");
        assert!(pick(&all, Some("20261202"), "ml").is_err(), "an ambiguous prefix");
        assert!(pick(&[], None, "ml").is_err());
    }

    #[test]
    fn only_ids_and_names_reach_the_shell() {
        assert!(word("20261202-120000-000-ab.2").is_ok());
        for bad in ["", "a b", "a;rm", "$(x)", "a'b", "../x"] {
            assert!(word(bad).is_err(), "{bad}");
        }
        assert_eq!(quoted("/mflow/it's"), r"'/mflow/it'\''s'");
        assert_eq!(attempt("r.3"), 3);
        assert_eq!(attempt("r"), 1);
    }

    #[test]
    fn a_driver_is_read_from_its_job() {
        let d = mflow_kube::driver::DriverOptions {
            run: "r1".into(),
            pipeline: "p".into(),
            image: "img".into(),
            pvc: "claim".into(),
            service_account: "mflow".into(),
            project: "/mflow/.mflow-uploads/projects/abc".into(),
            spec: "s.toml".into(),
            workdir: "/mflow/p".into(),
            overrides: vec![],
            jobs: None,
            force: vec![],
            verify: false,
            restarts: 3,
            host_network: true,
            env: Default::default(),
        };
        let mut job = mflow_kube::driver::job(&d);
        let got = driver_of(&job).unwrap();
        assert_eq!(
            (got.run.as_str(), got.workdir.as_str(), got.image.as_str(), got.pvc.as_str(), got.host_network, got.state),
            ("r1", "/mflow/p", "img", "claim", true, "pending")
        );
        // A workdir off the volume, or climbing out of it, is not read.
        for w in ["/etc", "/mflow/../etc"] {
            job.metadata.annotations.as_mut().unwrap().insert(ANNOTATION_WORKDIR.into(), w.into());
            assert!(driver_of(&job).is_none(), "{w}");
        }
    }
}
