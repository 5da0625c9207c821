//! What `mflow run` does after its run ended (its JUnit file and step summary are the run's
//! reporters, `ci::reporters`): the HTML report of `--report` and the webhook of `[notify]`.

use std::path::Path;

use serde_json::{Map, Value as Json};

use super::run_data::RunData;
use crate::workdir::Workdir;

pub fn after_run(
    workdir: &Workdir,
    run: &str,
    spec: &Path,
    report: Option<&Path>,
    notify: Option<&Map<String, Json>>,
    rt: &tokio::runtime::Runtime,
) {
    if report.is_none() && notify.is_none() {
        return;
    }
    let run = match RunData::load(workdir, Some(run)) {
        Ok(r) => r,
        Err(e) => {
            crate::errln!("mflow: warning: {e}");
            return;
        }
    };
    let owned = crate::user_output::Owned::new(workdir.root()).spec(spec);
    if let Some(path) = report {
        if let Err(e) = super::report::write(&run, super::report::Out::User(path, &owned), None) {
            crate::errln!("mflow: warning: {:?}", miette::Report::new(e));
        }
    }
    rt.block_on(super::notify::after_run(notify, &run));
}
