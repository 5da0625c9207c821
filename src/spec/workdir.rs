//! `[pipeline] workdir`: mflow creates, rewrites and removes files there, so a spec may name
//! only a directory that mflow may own (`cache::workdir::inspect`), and a workdir under the
//! spec's directory must stay inside the project once links and `..` are resolved. A directory
//! elsewhere is allowed when written as an absolute path: that is the explicit opt-in.

use std::path::Path;

use crate::cache::workdir::{inspect, resolve, Refusal};

/// Checks the workdir of a spec in `spec_dir` (canonical). Reads only.
pub(super) fn check(spec_dir: &Path, workdir: &Path) -> Result<(), Refusal> {
    // Relative workdirs are joined to the spec's directory; `..` is kept in the join.
    if workdir.starts_with(spec_dir) {
        let real = resolve(workdir);
        if !real.starts_with(spec_dir) {
            let project = crate::plan::inputs::project_root(spec_dir);
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
