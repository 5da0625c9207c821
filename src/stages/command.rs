//! `command`: any program, with declared inputs; it writes under `$MFLOW_OUTPUT`.

use serde::{Deserialize, Serialize};

use super::job::{JobContext, JobPlan};
use super::Check;
use crate::spec::schema::{req, Field};

pub const DOC: &str = "any command; writes under $MFLOW_OUTPUT";

pub const FIELDS: &[Field] =
    &[req("run", crate::spec::schema::Ty::StrList, "argv; writes under $MFLOW_OUTPUT, reads $MFLOW_INPUT_<STAGE>")];

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub run: Vec<String>,
}

impl Params {
    pub fn check(&self, cx: &mut Check<'_>) {
        if self.run.is_empty() {
            cx.invalid("run", "is empty", "give the program and its arguments, e.g. run = [\"python3\", \"step.py\"]");
        }
        if let Some(i) = self.run.iter().position(|a| a.contains('\0')) {
            cx.invalid(
                "run",
                format!("argument {i} holds a NUL byte"),
                "no program can be given an argument with a NUL byte in it",
            );
        }
    }

    pub fn job(&self, cx: &JobContext<'_>) -> JobPlan {
        let argv = self.run.iter().map(|a| cx.resolve(a)).collect();
        cx.plan(vec![argv], false)
    }
}
