//! The command line: clap types (`args`), the printer that all output goes through, and one file
//! per group of commands. Handlers turn arguments into the library's own options; nothing
//! outside `cli` sees a clap type.

pub mod args;
pub mod bounded;
mod cache;
mod ci;
mod cluster;
pub mod complete;
mod diagnostics;
mod inspect;
mod printer;
mod records;
mod run;
mod tools;
mod workdirs;

use std::path::Path;

pub use args::Cli;
use args::{BackendChoice, Command};
pub use printer::Printer;

use crate::env::Environment;
use crate::exit::ExitCode;
use crate::{plan, spec, Error};

pub fn main(cli: Cli) -> Result<ExitCode, Error> {
    let p = Printer::new(cli.global.output_format, cli.global.quiet);
    if let Err(e) = crate::settings::check() {
        p.diagnostic(e);
        return Ok(ExitCode::Invalid);
    }
    match cli.command {
        Command::Run(a) => run::run(a, &p),
        Command::Render(a) => run::render(a, &p),
        Command::Plan(a) => inspect::plan(a, &p),
        Command::Why(a) => inspect::why(a, &p),
        Command::Validate(a) => inspect::validate(a, &p),
        Command::Schema { format } => inspect::schema(format, &p),
        Command::Output(a) => inspect::output(a, &p),
        Command::Runs(a) => records::runs(a, &p),
        Command::Status(a) => records::status(a, &p),
        Command::Logs(a) => records::logs(a, &p),
        Command::Gc(a) => cache::gc(a, &p),
        Command::Cache(c) => cache::cache(c, &p),
        Command::Attach { run, cluster } => cluster::attach(&run, cluster, &p),
        Command::Cancel { run, cluster } => cluster::cancel(&run, cluster),
        Command::Kube(c) => cluster::kube(c, &p),
        Command::Report(a) => ci::report(a, &p),
        Command::Metrics(c) => ci::metrics(c, &p),
        Command::Reproduce(a) => ci::reproduce(a, &p),
        Command::Schedule(c) => ci::schedule(c, &p),
        Command::Doctor => tools::doctor(&p),
        Command::Env => tools::env(&p),
        Command::ExitCodes => tools::exit_codes(&p),
        Command::Explain { code } => tools::explain(&code, &p),
        Command::Completions { shell } => complete::completions(shell),
        Command::Man => complete::man(&p),
        Command::Model(a) => tools::native(|| mflow_ckpt::cli::model(&a)),
        Command::Convert(a) => tools::native(|| mflow_ckpt::cli::convert(&a)),
        Command::Export(a) => tools::native(|| mflow_ckpt::cli::export(&a)),
        Command::Dataset(a) => tools::native(|| mflow_data::cli::run(&a)),
    }
}

/// The plan of a spec for the commands that only look: they create nothing in the workdir and
/// remove nothing.
fn load_plan(
    path: &Path,
    set: &[String],
    backend: Option<BackendChoice>,
) -> Result<(plan::Plan, crate::cache::Store), Error> {
    let s = spec::load_on(path, set, backend.map(BackendChoice::kind))?;
    let env = Environment::detect(s.python.as_deref());
    let store = crate::cache::Store::open_read_only(&s.workdir());
    Ok((plan::build(s, &env)?, store))
}

/// A runtime for the commands that talk to a cluster; everything runs on this thread.
fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io(Path::new("tokio runtime"), e))
}

/// A path the user named for mflow to write, refused when it is something mflow keeps.
fn user_named(owned: &crate::user_output::Owned, path: &Path) -> Result<(), Error> {
    owned
        .check(path)
        .map_err(|e| Error::usage(e.to_string(), "name a path outside the workdir and MFLOW_HOME, other than the spec"))
}
