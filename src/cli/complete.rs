//! Shell completions (`mflow completions SHELL`), with the stage names of the spec on the
//! command line completed from the spec itself, and the man page (`mflow man`).

use std::ffi::OsStr;

use clap_complete::engine::{ArgValueCompleter, CompletionCandidate};

use super::args::Shell;
use super::Printer;
use crate::exit::ExitCode;
use crate::Error;

/// The environment variable through which the shell asks mflow for completions.
const COMPLETE_VAR: &str = "COMPLETE";

/// Answers the shell's request for completions, when that is what this process was started for
/// (the registration script starts mflow with `COMPLETE=<shell>`); returns otherwise.
pub fn answer_shell() {
    clap_complete::CompleteEnv::with_factory(super::args::command).var(COMPLETE_VAR).complete();
}

/// `mflow completions SHELL`: the script that registers mflow's completions with the shell.
pub fn completions(shell: Shell) -> Result<ExitCode, Error> {
    // SAFETY: set before any thread is started; the registration below reads it and exits.
    unsafe { std::env::set_var(COMPLETE_VAR, shell.name()) };
    answer_shell();
    Ok(ExitCode::Success)
}

/// `mflow man`: the man page, as roff.
pub fn man(p: &Printer) -> Result<ExitCode, Error> {
    let mut page = Vec::new();
    clap_mangen::Man::new(super::args::command())
        .render(&mut page)
        .map_err(|e| Error::io(std::path::Path::new("man"), e))?;
    p.out(&String::from_utf8_lossy(&page));
    Ok(ExitCode::Success)
}

/// A completer of stage names: those of the spec named on the command line being completed.
pub fn stage_names() -> ArgValueCompleter {
    ArgValueCompleter::new(|current: &OsStr| -> Vec<CompletionCandidate> {
        let current = current.to_string_lossy();
        let Some(spec) = std::env::args().skip(1).find(|a| a.ends_with(".toml")) else { return Vec::new() };
        names_in(std::path::Path::new(&spec))
            .into_iter()
            .filter(|n| n.starts_with(current.as_ref()))
            .map(CompletionCandidate::new)
            .collect()
    })
}

/// The stage names of the spec at `path`, read as plain TOML (a spec with mistakes still
/// completes); none when it cannot be read.
fn names_in(path: &std::path::Path) -> Vec<String> {
    let Ok(text) = crate::untrusted::read_text(path, crate::spec::MAX_SPEC_BYTES) else { return Vec::new() };
    let Ok(table) = text.parse::<toml::Table>() else { return Vec::new() };
    table.get("stages").and_then(toml::Value::as_table).map(|t| t.keys().cloned().collect()).unwrap_or_default()
}
