//! mflow's settings from the environment (`MFLOW_*`, listed with their meaning in
//! `mflow_contract::vars`): each read and checked once, as spec values are, so that a bad value
//! is an error naming the variable (exit 2) before anything runs, never a panic or a value
//! silently ignored later.

use std::time::Duration;

use mflow_contract::vars;
use miette::Diagnostic;
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
#[error("{var}={value}: {reason}")]
#[diagnostic(code(mflow::settings::invalid), help("{help}"))]
pub struct SettingError {
    pub var: &'static str,
    /// An excerpt of the value as given.
    pub value: String,
    pub reason: String,
    pub help: String,
}

/// The longest grace period between SIGTERM and SIGKILL.
const MAX_GRACE_S: f64 = 3600.0;
const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// Every setting that is set, checked; the first bad one is the error.
pub fn check() -> Result<(), SettingError> {
    kill_grace()?;
    installer()?;
    for var in [vars::UPLOAD_MAX_BYTES, vars::DOWNLOAD_MAX_BYTES, vars::HUB_MAX_FILE_BYTES] {
        bytes(var, 1)?;
    }
    memory_budget()
}

/// `MFLOW_MEMORY_BUDGET`, read by the readers of files someone else wrote
/// (`mflow_untrusted::budget`), which the native stages also read.
fn memory_budget() -> Result<(), SettingError> {
    let Some(value) = given(vars::MEMORY_BUDGET) else { return Ok(()) };
    match mflow_untrusted::budget::Budget::parse(&value) {
        Ok(_) => Ok(()),
        Err(_) => Err(invalid(
            vars::MEMORY_BUDGET,
            &value,
            "is not an amount of memory".into(),
            "give bytes, or a number with a unit: 512MiB, 64GiB, 2TB; unset, it is half of this machine's memory",
        )),
    }
}

/// Time between SIGTERM and SIGKILL when local stages are stopped (`MFLOW_KILL_GRACE`).
pub fn kill_grace() -> Result<Duration, SettingError> {
    let Some(value) = given(vars::KILL_GRACE) else { return Ok(DEFAULT_GRACE) };
    match value.trim().parse::<f64>() {
        Ok(s) if (0.0..=MAX_GRACE_S).contains(&s) => Ok(Duration::from_secs_f64(s)),
        _ => Err(invalid(
            vars::KILL_GRACE,
            &value,
            format!("is not a number of seconds from 0 to {MAX_GRACE_S}"),
            "give the seconds between SIGTERM and SIGKILL, e.g. 10 (the default) or 2.5",
        )),
    }
}

/// What provisions the Python environment (`MFLOW_INSTALLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installer {
    /// uv when there is one (on PATH, or installed from PyPI), pip otherwise.
    Auto,
    Uv,
    Pip,
}

/// `MFLOW_INSTALLER`: `auto` (the default), `uv` or `pip`.
pub fn installer() -> Result<Installer, SettingError> {
    let Some(value) = given(vars::INSTALLER) else { return Ok(Installer::Auto) };
    match value.trim() {
        "auto" => Ok(Installer::Auto),
        "uv" => Ok(Installer::Uv),
        "pip" => Ok(Installer::Pip),
        _ => Err(invalid(
            vars::INSTALLER,
            &value,
            "is not auto, uv or pip".into(),
            "leave it unset for uv where it can be had and pip otherwise",
        )),
    }
}

/// A size in bytes (`var`), or `default` when it is not set.
pub fn bytes(var: &'static str, default: u64) -> Result<u64, SettingError> {
    let Some(value) = given(var) else { return Ok(default) };
    match value.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(invalid(
            var,
            &value,
            "is not a whole number of bytes above 0".into(),
            "give the bytes as digits, e.g. 2147483648 for 2 GiB",
        )),
    }
}

/// The value of `var` when it is set and not empty.
fn given(var: &str) -> Option<String> {
    std::env::var_os(var).filter(|v| !v.is_empty()).map(|v| v.to_string_lossy().into_owned())
}

fn invalid(var: &'static str, value: &str, reason: String, help: &str) -> SettingError {
    SettingError { var, value: crate::spec::error::excerpt(value), reason, help: help.into() }
}
