//! The CI subcommands' arguments and handlers, and the hooks `mflow run` calls when a run ends.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use serde_json::{Map, Value as Json};

use super::run_data::RunData;
use super::CiError;
use crate::exec::display::Mode;
use crate::exit::ExitCode;
use crate::Error;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Run id or unique prefix (default: the latest run).
    pub run: Option<String>,
    #[arg(long, default_value = ".mflow")]
    pub workdir: PathBuf,
    /// The HTML file to write (default: report.html in the run's directory).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Also write each chart as a PNG file into this directory.
    #[arg(long, value_name = "DIR")]
    pub png: Option<PathBuf>,
    #[command(flatten)]
    pub remote: crate::cli::RemoteArgs,
}

#[derive(Subcommand, Debug)]
pub enum MetricsCommand {
    /// Compare the final metrics of two runs, per stage.
    Diff {
        run_a: String,
        run_b: String,
        #[arg(long, default_value = ".mflow")]
        workdir: PathBuf,
        /// Exit with code 4 when this holds, e.g. "val_loss>+2%", "loss>+0.1", "eval.val_ppl>40" (repeatable).
        #[arg(long = "fail-if", value_name = "CONDITION")]
        fail_if: Vec<String>,
    },
}

#[derive(Args, Debug)]
pub struct ReproduceArgs {
    /// Run id or unique prefix.
    pub run: String,
    #[arg(long, default_value = ".mflow")]
    pub workdir: PathBuf,
}

#[derive(Subcommand, Debug)]
pub enum ScheduleCommand {
    /// Print the Kubernetes objects of the spec's [schedule] as YAML.
    Render {
        spec: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Namespace of the objects (default: [pipeline.kubernetes] namespace, else "default").
        #[arg(long)]
        namespace: Option<String>,
    },
    /// Apply them to the cluster with server-side apply.
    Apply {
        spec: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
}

impl CiError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CiError::NoRun { .. } | CiError::Condition { .. } | CiError::Schedule { .. } => ExitCode::Invalid,
            // A path the user named that mflow refuses to write.
            CiError::Output(crate::user_output::OutputError::Owned { .. } | crate::user_output::OutputError::FileType { .. }) => ExitCode::Invalid,
            _ => ExitCode::Internal,
        }
    }
}

/// CI errors are reported here so that their exit codes follow the table.
fn finish(r: Result<ExitCode, CiError>) -> Result<ExitCode, Error> {
    match r {
        Ok(c) => Ok(c),
        Err(e) => {
            let code = e.exit_code();
            eprintln!("{:?}", miette::Report::new(e));
            Ok(code)
        }
    }
}

pub fn report(a: ReportArgs) -> Result<ExitCode, Error> {
    finish((|| -> Result<ExitCode, CiError> {
        let run = RunData::load(&a.workdir, a.run.as_deref())?;
        // A path the user names is the user's; the default is in the run's own record.
        let owned = crate::user_output::Owned::new(&a.workdir);
        let out = match &a.out {
            Some(p) => super::report::Out::User(p, &owned),
            None => super::report::Out::Record(run.dir.join("report.html")),
        };
        let w = super::report::write(&run, out, a.png.as_deref().map(|d| (d, &owned)))?;
        println!("{}", w.html.display());
        for p in w.pngs {
            println!("{}", p.display());
        }
        Ok(ExitCode::Success)
    })())
}

pub fn metrics(c: MetricsCommand) -> Result<ExitCode, Error> {
    let MetricsCommand::Diff { run_a, run_b, workdir, fail_if } = c;
    finish((|| -> Result<ExitCode, CiError> {
        let conditions = fail_if.iter().map(|c| super::diff::Condition::parse(c)).collect::<Result<Vec<_>, _>>()?;
        let a = RunData::load(&workdir, Some(&run_a))?;
        let b = RunData::load(&workdir, Some(&run_b))?;
        println!("A = {}\nB = {}\n", a.id, b.id);
        let out = super::diff::compare(&a.final_metrics(), &b.final_metrics(), &conditions);
        print!("{}", out.table);
        if out.failures.is_empty() {
            if !conditions.is_empty() {
                println!("\nall {} condition(s) passed", conditions.len());
            }
            return Ok(ExitCode::Success);
        }
        eprintln!();
        for f in &out.failures {
            eprintln!("FAIL {f}");
        }
        Ok(ExitCode::GateFailed)
    })())
}

pub fn reproduce(a: ReproduceArgs, json: bool) -> Result<ExitCode, Error> {
    let prepared = match super::reproduce::prepare(&a.workdir, &a.run) {
        Ok(Ok(p)) => p,
        Ok(Err(refusal)) => {
            eprintln!("mflow: reproduce refused: run {} no longer matches its lockfile:", a.run);
            for r in refusal.0 {
                eprintln!("  {r}");
            }
            return Ok(ExitCode::Mismatch);
        }
        Err(e) => return finish(Err(e)),
    };
    eprintln!("mflow: every pinned digest matches; running {} stage(s) of the lockfile", prepared.lock.stages.len());
    let (code, lines) = super::reproduce::run(prepared, Mode::detect(json))?;
    for l in &lines {
        eprintln!("{l}");
    }
    match code {
        ExitCode::Success => eprintln!("reproduced: every stage's key equals the lockfile's"),
        ExitCode::Mismatch => eprintln!("mflow: not reproduced: some stage keys differ from the lockfile's"),
        _ => {}
    }
    Ok(code)
}

pub fn schedule(c: ScheduleCommand) -> Result<ExitCode, Error> {
    match c {
        ScheduleCommand::Render { spec, set, namespace } => {
            let s = crate::spec::load(&spec, &set)?;
            let ns = namespace.or_else(|| s.pipeline.kubernetes.get("namespace").and_then(Json::as_str).map(str::to_string)).unwrap_or_else(|| "default".into());
            finish(super::schedule::render(&s, &ns).map(|o| {
                print!("{}", o.to_yaml());
                ExitCode::Success
            }))
        }
        ScheduleCommand::Apply { spec, set } => {
            let s = crate::spec::load(&spec, &set)?;
            let rt = tokio::runtime::Runtime::new().map_err(|e| Error::io(Path::new("tokio runtime"), e))?;
            finish(rt.block_on(async {
                let (client, ns) = super::schedule::client(&s).await?;
                let objects = super::schedule::render(&s, &ns)?;
                for d in super::schedule::apply(&objects, client, &ns).await? {
                    println!("applied {d} (namespace {ns})");
                }
                Ok(ExitCode::Success)
            }))
        }
    }
}

/// After `mflow run`: the JUnit file, the GitHub step summary and the notification. None of
/// them changes the run's exit code; problems are warnings.
/// `spec` is the spec that was run: none of these may be written over it or into the workdir.
pub fn after_run(run_dir: &Path, spec: &Path, junit: Option<&Path>, report: Option<&Path>, notify: Option<&Map<String, Json>>, rt: &tokio::runtime::Runtime) {
    let wanted = junit.is_some() || report.is_some() || notify.is_some() || std::env::var_os("GITHUB_STEP_SUMMARY").is_some_and(|v| !v.is_empty());
    if !wanted {
        return;
    }
    let (Some(workdir), Some(id)) = (run_dir.parent().and_then(Path::parent), run_dir.file_name()) else { return };
    let run = match RunData::load(workdir, Some(&id.to_string_lossy())) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mflow: warning: {e}");
            return;
        }
    };
    let owned = crate::user_output::Owned::new(workdir).spec(spec);
    if let Some(path) = junit {
        let write = || -> Result<(), CiError> {
            owned.check(path)?;
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| CiError::write(parent, e))?;
            }
            Ok(crate::user_output::write(path, super::junit::render(&run).as_bytes(), &owned)?)
        };
        if let Err(e) = write() {
            eprintln!("mflow: warning: {:?}", miette::Report::new(e));
        }
    }
    if let Some(path) = report {
        if let Err(e) = super::report::write(&run, super::report::Out::User(path, &owned), None) {
            eprintln!("mflow: warning: {:?}", miette::Report::new(e));
        }
    }
    if let Err(e) = super::summary::append_if_requested(&run, &owned) {
        eprintln!("mflow: warning: GITHUB_STEP_SUMMARY: {:?}", miette::Report::new(e));
    }
    rt.block_on(super::notify::after_run(notify, &run));
}
