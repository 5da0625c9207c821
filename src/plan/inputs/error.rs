//! Why a stage's inputs were refused.

use std::path::PathBuf;

use miette::Diagnostic;
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
pub enum InputError {
    #[error("stage `{stage}`: input `{pattern}` matches no file")]
    #[diagnostic(
        code(mflow::plan::input_missing),
        help("check the path; relative paths start at the spec's directory")
    )]
    NoMatch { stage: String, pattern: String },
    #[error("stage `{stage}`: input `{pattern}` leaves the project directory {}", root.display())]
    #[diagnostic(
        code(mflow::plan::input_escapes),
        help("keep relative inputs inside the project, or give an absolute path")
    )]
    Escapes { stage: String, pattern: String, root: PathBuf },
    #[error("stage `{stage}`: input `{}` is a symbolic link to {}, outside the project directory {}", link.display(), target.display(), root.display())]
    #[diagnostic(
        code(mflow::plan::input_link_escapes),
        help("copy the file into the project, or give its absolute path in `inputs` if the stage is meant to read it there")
    )]
    LinkEscapes { stage: String, link: PathBuf, target: PathBuf, root: PathBuf },
    #[error("stage `{stage}`: input `{}` is a symbolic link to {}, outside {}, the directory the input names", link.display(), target.display(), dir.display())]
    #[diagnostic(code(mflow::plan::input_link_escapes), help("name the files the stage reads themselves, or copy them into {}", dir.display()))]
    LinkLeaves { stage: String, link: PathBuf, target: PathBuf, dir: PathBuf },
    #[error("stage `{stage}`: input directory `{}` leads back into itself through a symbolic link", path.display())]
    #[diagnostic(code(mflow::plan::input_cycle), help("remove the link, or name the files below it in `inputs`"))]
    Cycle { stage: String, path: PathBuf },
    #[error("stage `{stage}`: input `{pattern}` {what}")]
    #[diagnostic(
        code(mflow::plan::input_too_large),
        help("name fewer files: a narrower path or glob, or an archive of the directory")
    )]
    TooLarge { stage: String, pattern: String, what: String },
    #[error("stage `{stage}`: input `{pattern}` is inside mflow's workdir {}", workdir.display())]
    #[diagnostic(
        code(mflow::plan::input_in_workdir),
        help("read another stage's result through `stages.NAME.output` in its parameters: the workdir's files change with every run")
    )]
    InWorkdir { stage: String, pattern: String, workdir: PathBuf },
    #[error("stage `{stage}`: input {} has a name that is not UTF-8", path.display())]
    #[diagnostic(
        code(mflow::plan::input_name),
        help("rename it: a stage's inputs are keyed by their names as text, and two such names could share one")
    )]
    NotUtf8 { stage: String, path: PathBuf },
    #[error("stage `{stage}`: invalid input pattern `{pattern}`: {reason}")]
    #[diagnostic(code(mflow::plan::input_pattern))]
    Pattern { stage: String, pattern: String, reason: String },
    #[error("stage `{stage}`: cannot read input {}", path.display())]
    #[diagnostic(code(mflow::plan::input_io))]
    Io {
        stage: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
