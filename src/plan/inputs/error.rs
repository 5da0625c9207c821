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

/// An input error quoted at the place in the spec that names the input (its pattern among the
/// stage's values), when there is one: the code and help are the error's own.
#[derive(Debug)]
pub struct Placed {
    pub error: InputError,
    /// Boxed: errors travel in every `Result` of the plan, which must stay small.
    at: Option<Box<(crate::spec::Src, miette::SourceSpan)>>,
}

impl From<InputError> for Placed {
    fn from(error: InputError) -> Placed {
        Placed { error, at: None }
    }
}

impl Placed {
    /// `error` at the string of `stage`'s table in `spec` that names `pattern` (the first such
    /// value, at any depth), else at the stage's name.
    pub fn in_spec(error: InputError, spec: &crate::spec::Spec, stage: &str) -> Placed {
        let pattern = match &error {
            InputError::NoMatch { pattern, .. }
            | InputError::Escapes { pattern, .. }
            | InputError::TooLarge { pattern, .. }
            | InputError::InWorkdir { pattern, .. }
            | InputError::Pattern { pattern, .. } => Some(pattern.clone()),
            InputError::LinkEscapes { link: path, .. }
            | InputError::LinkLeaves { link: path, .. }
            | InputError::Cycle { path, .. }
            | InputError::NotUtf8 { path, .. }
            | InputError::Io { path, .. } => path.to_str().map(str::to_string),
        };
        let at = crate::spec::place_of_value(spec, stage, pattern.as_deref().unwrap_or("")).map(Box::new);
        Placed { error, at }
    }
}

impl std::fmt::Display for Placed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Placed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

impl Diagnostic for Placed {
    fn code<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        self.error.code()
    }
    fn help<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        self.error.help()
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.at.as_ref().map(|at| &at.0 as &dyn miette::SourceCode)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = miette::LabeledSpan> + '_>> {
        let span = self.at.as_ref()?.1;
        Some(Box::new(std::iter::once(miette::LabeledSpan::new_primary_with_span(Some("this input".into()), span))))
    }
}
