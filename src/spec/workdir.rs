//! `[pipeline] workdir`: mflow creates, rewrites and removes files there, so a spec may name
//! only a directory that mflow may own (`workdir::inspect`), and a workdir under the
//! spec's directory must stay inside the project once links and `..` are resolved. A directory
//! elsewhere is allowed when written as an absolute path: that is the explicit opt-in.

use std::path::Path;

use super::error::{to_span, SpecError, Src};
use super::tree::{Node, Origin, Val};
use super::DEFAULT_WORKDIR;
use crate::workdir::{inspect, resolve, Refusal};

/// Checks the workdir of a spec in `spec_dir` (canonical). Reads only.
pub(super) fn check(spec_dir: &Path, workdir: &Path) -> Result<(), Refusal> {
    // Relative workdirs are joined to the spec's directory; `..` is kept in the join.
    if workdir.starts_with(spec_dir) {
        let real = resolve(workdir);
        if !real.starts_with(spec_dir) {
            let project = crate::project::root(spec_dir);
            if !real.starts_with(&project) {
                return Err(Refusal {
                    reason: format!("it resolves to {}, outside the project {}", real.display(), project.display()),
                    help: "keep a relative workdir inside the project (the enclosing git work tree, else the spec's directory), or write an absolute path to use a directory elsewhere".into(),
                });
            }
        }
    }
    inspect(workdir).map(drop)
}

/// Reports a workdir that mflow may not use, at the `workdir` key (or the `[pipeline]` table
/// when the default is refused).
pub(super) fn check_workdir(src: &Src, dir: &Path, pipeline: &Node, workdir: &Path, errors: &mut Vec<SpecError>) {
    if let Err(r) = check(dir, workdir) {
        let node = pipeline.get("workdir");
        let value = match node.map(|n| &n.value) {
            Some(Val::Str(s)) => s.clone(),
            _ => DEFAULT_WORKDIR.to_string(),
        };
        // A `--set pipeline.workdir=...` has no place in the file; the message names it.
        let (span, reason) = match node.map(|n| &n.origin) {
            Some(Origin::Override(arg)) => (None, format!("{} (from `--set {arg}`)", r.reason)),
            Some(_) => (node.and_then(Node::span), r.reason),
            None => (pipeline.span(), r.reason),
        };
        errors.push(SpecError::Workdir {
            src: src.clone(),
            span: to_span(span),
            value: super::error::excerpt(&value),
            reason: super::error::excerpt(&reason),
            help: r.help,
        });
    }
}
