//! Tools: `doctor`, `env`, `exit-codes`, and the native stage commands run on their own.

use super::Printer;
use crate::env::Environment;
use crate::exit::ExitCode;
use crate::Error;
use mflow_contract::record::RunStatus;
use mflow_contract::FailureClass;

pub fn env(p: &Printer) -> Result<ExitCode, Error> {
    let env = Environment::detect(None);
    p.line(env.python()?.display().to_string());
    Ok(ExitCode::Success)
}

/// `mflow explain CODE`.
pub fn explain(code: &str, p: &Printer) -> Result<ExitCode, Error> {
    let code = code.trim();
    let full = if code.starts_with("mflow::") { code.to_string() } else { format!("mflow::{code}") };
    let Some((code, message, help)) = super::diagnostics::DIAGNOSTICS.iter().find(|(c, _, _)| *c == full) else {
        let known: Vec<&str> = super::diagnostics::DIAGNOSTICS.iter().map(|(c, _, _)| *c).collect();
        return Err(Error::usage(
            format!("no diagnostic `{}`", crate::spec::error::excerpt(code)),
            crate::spec::error::did_you_mean(&full, &known, "codes"),
        ));
    };
    if p.json() {
        p.value(&serde_json::json!({"code": code, "message": message, "help": help}), false);
    } else {
        p.line(format!("{code}\n\n  what it says: {message}\n  what to do:   {help}"));
    }
    Ok(ExitCode::Success)
}

pub fn exit_codes(p: &Printer) -> Result<ExitCode, Error> {
    p.out(&crate::exit::text());
    Ok(ExitCode::Success)
}

/// The native stage commands report their own diagnostics. A failure gets its class by the rule
/// every stage follows (docs/exit-codes.md), said in the stage's status file, where the engine
/// reads it: a Hub that answers 503 or refuses the connection is retried by `on = ["infra"]`.
/// A signal that stops mflow removes what the command was writing ([`remove_staging_on_signals`]).
pub fn native(command: impl FnOnce() -> miette::Result<()>) -> Result<ExitCode, Error> {
    remove_staging_on_signals();
    let Err(report) = command() else { return Ok(ExitCode::Success) };
    crate::errln!("{report:?}");
    let class = native_class(&report);
    report_status(class, &report.to_string());
    let code = report.code().map(|c| c.to_string()).unwrap_or_default();
    Ok(if USAGE.iter().any(|u| code == *u || (u.ends_with("::") && code.starts_with(u))) {
        ExitCode::Invalid
    } else if class == FailureClass::Infra {
        ExitCode::Infra
    } else {
        ExitCode::StageFailed
    })
}

/// Diagnostics (codes, or prefixes ending in `::`) of a command line the command cannot take:
/// exit 2, as for any other invalid command line, while the stage's class stays `user`.
const USAGE: &[&str] = &[
    "mflow::ckpt::dtype_arg",
    "mflow::ckpt::source",
    "mflow::ckpt::parallelism",
    "mflow::data::options::",
    // The same refusal as `options::split_by_jsonl`, where every input is JSONL by its name.
    "mflow::data::input::split_by_jsonl",
    "mflow::data::split::",
    "mflow::data::tokenizer::unknown_eod",
];

/// For a command that writes an output directory through a staging directory
/// (`mflow_untrusted::staging`): from now on, the signals that stop `mflow run` stop it the same
/// way and with the same exit code, 130 for SIGINT and 143 for the others (docs/exit-codes.md),
/// after removing its staging directories; the destination stays as it was. As a stage, it says
/// in its status file the class the engine gives a stage such a signal ends.
pub(super) fn remove_staging_on_signals() {
    let installed = crate::exec::signals::on_first(|caught| {
        let removed = mflow_untrusted::staging::remove_all();
        let (status, what) = match caught.level {
            crate::backend::Cancel::Graceful => (RunStatus::Cancelled, "cancelled"),
            _ => (RunStatus::Interrupted, "interrupted"),
        };
        let names: Vec<String> = removed.iter().map(|d| d.display().to_string()).collect();
        let removed = match names.is_empty() {
            true => String::new(),
            false => format!(": the output was not written; removed {}", names.join(", ")),
        };
        crate::errln!("mflow: {what} ({}){removed}", caught.name);
        report_status(FailureClass::of_signal(caught.number), &format!("{what} by {}", caught.name));
        crate::exit::now(ExitCode::for_ending(status, &[]))
    });
    if let Err(e) = installed {
        tracing::warn!("signals are not caught: an interrupted command leaves its staging directory: {e}");
    }
}

/// Says the class of the failure in the stage's status file, when run as a stage.
fn report_status(class: FailureClass, message: &str) {
    if let Some(path) = std::env::var_os(mflow_contract::vars::STATUS) {
        let status = mflow_contract::workload::StatusReport {
            class: Some(class),
            message: Some(crate::spec::error::excerpt_of(message, crate::spec::error::MAX_QUOTE)),
            ..Default::default()
        };
        let _ = crate::record::write_json(std::path::Path::new(&path), &status);
    }
}

/// The class of a native command's failure: an HTTP answer by its status, a connection that
/// failed as infra, a system call's error by its errno; anything else is the stage's (user).
fn native_class(report: &miette::Report) -> FailureClass {
    use mflow_ckpt::hub::HubError;
    match report.downcast_ref::<mflow_ckpt::CkptError>() {
        Some(mflow_ckpt::CkptError::Hub(HubError::Status { status, .. })) => {
            return FailureClass::of_http_status(*status)
        }
        Some(mflow_ckpt::CkptError::Hub(HubError::Http { .. })) => return FailureClass::Infra,
        _ => {}
    }
    report.chain().find_map(|e| e.downcast_ref::<std::io::Error>()).map_or(FailureClass::User, FailureClass::of_io)
}

pub fn doctor(p: &Printer) -> Result<ExitCode, Error> {
    let env = Environment::detect(None);
    let python = env.python()?;
    // The probe gets what a Python stage gets (`stages::python_env`): the same PYTHONPATH, with
    // the user's own after the workloads, so that it finds the modules that the stages import.
    let stage_env = crate::stages::python_env(&env)?;
    let out = std::process::Command::new(&python)
        .args(["-m", "mflow_workloads.doctor"])
        .envs(&stage_env)
        .output()
        .map_err(|e| Error::io(&python, e))?;
    let probe: Option<serde_json::Value> = serde_json::from_slice(&out.stdout).ok();
    // torch's view of the GPUs when it sees the same ones (CUDA_VISIBLE_DEVICES is inherited),
    // else nvidia-smi's; else indices alone.
    let torch_gpus: Vec<Option<crate::env::GpuInfo>> = probe
        .as_ref()
        .and_then(|p| p["cuda_devices"].as_array())
        .map(|d| {
            d.iter()
                .map(|g| {
                    Some(crate::env::GpuInfo {
                        name: g["name"].as_str()?.to_string(),
                        memory_gib: g["memory_gib"].as_f64(),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let gpus = if !env.gpus.is_empty() && torch_gpus.len() == env.gpus.len() {
        torch_gpus
    } else {
        crate::env::nvidia_smi_gpus(&env.gpus)
    };
    p.line(format!("mflow {}", env!("CARGO_PKG_VERSION")));
    p.line(format!("cpus: {}", env.cpus));
    p.line(crate::env::describe_gpus(&env.gpus, &gpus));
    p.line(format!("python environment: {}", env.python_digest()));
    p.line(format!("python: {}", python.display()));
    let here = std::env::current_dir().unwrap_or_default();
    let (root, found) = crate::project::find(&here);
    p.line(format!("project (of a spec here): {} ({})", root.display(), found.describe()));
    p.line(format!("PYTHONPATH (as the stages get it): {}", stage_env["PYTHONPATH"]));
    p.out(&String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        p.note(String::from_utf8_lossy(&out.stderr).trim_end());
        return Ok(ExitCode::Internal);
    }
    Ok(ExitCode::Success)
}
