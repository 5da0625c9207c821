//! The CI reporters of a run: its JUnit file (`--junit`) and the GitHub step summary
//! (`GITHUB_STEP_SUMMARY`), written when the run's last event says it ended.

use std::path::{Path, PathBuf};

use mflow_contract::event::RunEvent;
use mflow_contract::record::RunRecord;

use super::run_data::RunData;
use super::CiError;
use crate::reporter::{Reporter, Stamp};
use crate::user_output::Owned;
use crate::workdir::Workdir;

/// What a CI reporter writes once the run ended.
enum Output {
    Junit(PathBuf),
    StepSummary(PathBuf),
}

pub struct CiReporter {
    output: Output,
    workdir: Workdir,
    owned: Owned,
}

impl CiReporter {
    pub fn junit(path: &Path, workdir: &Workdir, owned: Owned) -> CiReporter {
        CiReporter { output: Output::Junit(path.to_path_buf()), workdir: workdir.clone(), owned }
    }

    /// The step summary, when GitHub Actions asks for one.
    pub fn step_summary(workdir: &Workdir, owned: Owned) -> Option<CiReporter> {
        let path = std::env::var_os("GITHUB_STEP_SUMMARY").filter(|p| !p.is_empty())?;
        Some(CiReporter { output: Output::StepSummary(PathBuf::from(path)), workdir: workdir.clone(), owned })
    }

    fn write(&self, run: &RunData) -> Result<(), CiError> {
        match &self.output {
            Output::Junit(path) => {
                self.owned.check(path)?;
                if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent).map_err(|e| {
                        CiError::Output(crate::user_output::OutputError::Io { path: parent.to_path_buf(), source: e })
                    })?;
                }
                Ok(crate::user_output::write(path, super::junit::render(run).as_bytes(), &self.owned)?)
            }
            Output::StepSummary(path) => {
                Ok(crate::user_output::append(path, super::summary::render(run).as_bytes(), &self.owned)?)
            }
        }
    }
}

impl Reporter for CiReporter {
    fn event(&mut self, _run: &str, _at: &Stamp, ev: &RunEvent, record: &RunRecord) {
        let RunEvent::RunFinished { .. } = ev else { return };
        let run = RunData::of(record.clone(), &self.workdir);
        if let Err(e) = self.write(&run) {
            let what = match self.output {
                Output::Junit(_) => "",
                Output::StepSummary(_) => "GITHUB_STEP_SUMMARY: ",
            };
            crate::errln!("mflow: warning: {what}{:?}", miette::Report::new(e));
        }
    }
}
