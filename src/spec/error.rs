//! Spec diagnostics. Each one points at the offending place in the spec (or names the `--set`
//! override it came from) and says what to do.

use std::path::PathBuf;
use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceSpan};
use thiserror::Error;

pub type Src = NamedSource<Arc<str>>;

#[derive(Debug, Error, Diagnostic)]
pub enum SpecError {
    #[error("cannot read spec {}", path.display())]
    #[diagnostic(code(mflow::spec::io), help("check that the file exists and is readable"))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid TOML: {message}")]
    #[diagnostic(code(mflow::spec::syntax))]
    Syntax {
        #[source_code]
        src: Src,
        #[label("here")]
        span: Option<SourceSpan>,
        message: String,
    },

    #[error("unknown key `{key}` in {table}")]
    #[diagnostic(code(mflow::spec::unknown_key), help("{help}"))]
    UnknownKey {
        #[source_code]
        src: Src,
        #[label("not a key of {table}")]
        span: Option<SourceSpan>,
        key: String,
        table: String,
        help: String,
    },

    #[error("`{key}` must be {expected}, found {found}")]
    #[diagnostic(code(mflow::spec::wrong_type), help("{help}"))]
    WrongType {
        #[source_code]
        src: Src,
        #[label("expected {expected}")]
        span: Option<SourceSpan>,
        key: String,
        expected: String,
        found: String,
        help: String,
    },

    #[error("missing required key `{key}` in {table}")]
    #[diagnostic(code(mflow::spec::missing_key), help("{help}"))]
    MissingKey {
        #[source_code]
        src: Src,
        #[label("{table} is defined here")]
        span: Option<SourceSpan>,
        key: String,
        table: String,
        help: String,
    },

    #[error("invalid value for `{key}`: {reason}")]
    #[diagnostic(code(mflow::spec::invalid_value), help("{help}"))]
    InvalidValue {
        #[source_code]
        src: Src,
        #[label("{reason}")]
        span: Option<SourceSpan>,
        key: String,
        reason: String,
        help: String,
    },

    #[error("unknown stage kind `{kind}`")]
    #[diagnostic(code(mflow::spec::unknown_kind), help("{help}"))]
    UnknownKind {
        #[source_code]
        src: Src,
        #[label("no such kind")]
        span: Option<SourceSpan>,
        kind: String,
        help: String,
    },

    #[error("stage `{stage}` refers to unknown stage `{name}`")]
    #[diagnostic(code(mflow::spec::unknown_stage), help("{help}"))]
    UnknownStage {
        #[source_code]
        src: Src,
        #[label("no stage named `{name}`")]
        span: Option<SourceSpan>,
        stage: String,
        name: String,
        help: String,
    },

    #[error("unknown variable `{name}`")]
    #[diagnostic(code(mflow::spec::unknown_var), help("{help}"))]
    UnknownVar {
        #[source_code]
        src: Src,
        #[label("`${{vars.{name}}}` is not defined in [vars]")]
        span: Option<SourceSpan>,
        name: String,
        help: String,
    },

    #[error("malformed interpolation `{text}`")]
    #[diagnostic(
        code(mflow::spec::interpolation),
        help("use `${{vars.NAME}}` or `${{stages.STAGE.output}}`; write `$${{` for a literal `${{`")
    )]
    Interpolation {
        #[source_code]
        src: Src,
        #[label("cannot interpolate this")]
        span: Option<SourceSpan>,
        text: String,
    },

    #[error("the stages form a cycle: {cycle}")]
    #[diagnostic(
        code(mflow::spec::cycle),
        help("a stage cannot depend on itself, directly or through others: remove one of these edges")
    )]
    Cycle {
        #[source_code]
        src: Src,
        cycle: String,
        #[label(collection, "edge of the cycle")]
        edges: Vec<LabeledSpan>,
    },

    #[error("invalid stage name `{name}`{}", length_note(name))]
    #[diagnostic(code(mflow::spec::stage_name), help("stage names use letters, digits, `-` and `_`, start with a letter, and have at most 63 characters (Kubernetes label values; the TrainJob names made of pipeline and stage names are shortened to 48 characters with a hash, so that the pod names JobSet derives fit in 63)"))]
    StageName {
        #[source_code]
        src: Src,
        #[label("invalid name")]
        span: Option<SourceSpan>,
        name: String,
    },

    #[error(
        "stages `{first}` and `{second}` both become MFLOW_INPUT_{var} in the environment of the stages that need them"
    )]
    #[diagnostic(
        code(mflow::spec::stage_name_clash),
        help("rename one of them: `-` and `_` are the same in environment variable names, and case does not count")
    )]
    StageNameClash {
        #[source_code]
        src: Src,
        #[label("first here")]
        first_span: Option<SourceSpan>,
        #[label("and here")]
        second_span: Option<SourceSpan>,
        first: String,
        second: String,
        var: String,
    },

    #[error("the spec defines no stages")]
    #[diagnostic(code(mflow::spec::no_stages), help("add at least one `[stages.NAME]` table with a `kind`"))]
    NoStages {
        #[source_code]
        src: Src,
    },

    #[error("`workdir` = \"{value}\" cannot be used: {reason}")]
    #[diagnostic(code(mflow::spec::workdir), help("{help}"))]
    Workdir {
        #[source_code]
        src: Src,
        #[label("mflow writes its cache and run records here")]
        span: Option<SourceSpan>,
        value: String,
        reason: String,
        help: String,
    },

    #[error("invalid override `{arg}`: {reason}")]
    #[diagnostic(code(mflow::spec::set), help("write `--set vars.NAME=VALUE` or `--set stages.STAGE.KEY=VALUE`"))]
    Override { arg: String, reason: String },
}

/// Every problem found in one spec, reported together.
#[derive(Debug, Error, Diagnostic)]
#[error("{} in {}", count(self.errors.len()), self.path)]
#[diagnostic(code(mflow::spec::invalid))]
pub struct SpecErrors {
    pub path: String,
    #[related]
    pub errors: Vec<SpecError>,
}

impl SpecErrors {
    /// The errors of the spec at `path`, each with its quotes bounded.
    pub fn new(path: &std::path::Path, errors: Vec<SpecError>) -> Self {
        let mut views = Vec::new();
        let errors = errors.into_iter().map(|e| e.bounded().shown(&mut views)).collect();
        SpecErrors { path: path.display().to_string(), errors }
    }
}

impl SpecError {
    /// Cuts every text a message quotes from the spec to an excerpt, whatever built it: a name,
    /// value or candidate list of megabytes must not make a message of megabytes. The match is
    /// exhaustive so that a new kind of error cannot skip it.
    fn bounded(mut self) -> Self {
        let texts: Vec<&mut String> = match &mut self {
            SpecError::Io { .. } | SpecError::NoStages { .. } => vec![],
            SpecError::Syntax { message, .. } => vec![message],
            SpecError::UnknownKey { key, table, help, .. } => vec![key, table, help],
            SpecError::WrongType { key, expected, found, help, .. } => vec![key, expected, found, help],
            SpecError::MissingKey { key, table, help, .. } => vec![key, table, help],
            SpecError::InvalidValue { key, reason, help, .. } => vec![key, reason, help],
            SpecError::UnknownKind { kind, help, .. } => vec![kind, help],
            SpecError::UnknownStage { stage, name, help, .. } => vec![stage, name, help],
            SpecError::UnknownVar { name, help, .. } => vec![name, help],
            SpecError::Interpolation { text, .. } => vec![text],
            SpecError::Cycle { cycle, edges, .. } => {
                edges.truncate(MAX_LABELS);
                vec![cycle]
            }
            SpecError::StageName { name, .. } => vec![name],
            SpecError::StageNameClash { first, second, var, .. } => vec![first, second, var],
            SpecError::Workdir { value, reason, help, .. } => vec![value, reason, help],
            SpecError::Override { arg, reason } => vec![arg, reason],
        };
        for text in texts {
            if text.chars().nth(MAX_QUOTE).is_some() {
                *text = excerpt_of(text, MAX_QUOTE);
            }
        }
        self
    }
}

impl SpecError {
    /// The error as its diagnostic quotes the spec: from a view whose long lines are cut
    /// (`view`), its labels moved to match; one view per spec text (`views`).
    fn shown(mut self, views: &mut Vec<(Arc<str>, super::view::View)>) -> Self {
        let (src, spans, edges): (Option<&mut Src>, Vec<&mut Option<SourceSpan>>, Option<&mut Vec<LabeledSpan>>) =
            match &mut self {
                SpecError::Io { .. } | SpecError::Override { .. } => (None, vec![], None),
                SpecError::NoStages { src } => (Some(src), vec![], None),
                SpecError::Cycle { src, edges, .. } => (Some(src), vec![], Some(edges)),
                SpecError::StageNameClash { src, first_span, second_span, .. } => {
                    (Some(src), vec![first_span, second_span], None)
                }
                SpecError::Syntax { src, span, .. }
                | SpecError::UnknownKey { src, span, .. }
                | SpecError::WrongType { src, span, .. }
                | SpecError::MissingKey { src, span, .. }
                | SpecError::InvalidValue { src, span, .. }
                | SpecError::UnknownKind { src, span, .. }
                | SpecError::UnknownStage { src, span, .. }
                | SpecError::UnknownVar { src, span, .. }
                | SpecError::Interpolation { src, span, .. }
                | SpecError::StageName { src, span, .. }
                | SpecError::Workdir { src, span, .. } => (Some(src), vec![span], None),
            };
        let Some(src) = src else { return self };
        let text = src.inner().clone();
        let i = match views.iter().position(|(t, _)| Arc::ptr_eq(t, &text)) {
            Some(i) => i,
            None => {
                views.push((text.clone(), super::view::View::of(&text)));
                views.len() - 1
            }
        };
        let view = &views[i].1;
        let Some(shown) = view.text() else { return self };
        for span in spans.into_iter().flatten() {
            *span = view.span(*span);
        }
        for edge in edges.into_iter().flatten() {
            *edge = view.label(edge);
        }
        *src = NamedSource::new(src.name(), shown.clone());
        self
    }
}

/// Longest text one field of a message quotes: enough for a sentence of reasons or a list of
/// twenty keys.
pub const MAX_QUOTE: usize = 600;
/// Most edges a cycle's diagnostic labels.
const MAX_LABELS: usize = 32;

fn count(n: usize) -> String {
    if n == 1 {
        "1 problem".into()
    } else {
        format!("{n} problems")
    }
}

pub fn to_span(r: Option<std::ops::Range<usize>>) -> Option<SourceSpan> {
    r.map(|r| SourceSpan::from(r.start..r.end))
}

/// "did you mean" help from a set of candidates.
pub fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(word, c), c))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

pub fn did_you_mean(word: &str, candidates: &[&str], what: &str) -> String {
    match suggest(word, candidates.iter().copied()) {
        Some(s) => format!("did you mean `{s}`?"),
        None if candidates.is_empty() => format!("there are no {what}"),
        None => format!("valid {what}: {}", candidates.join(", ")),
    }
}

/// At most 120 characters of text from a spec, for messages: a 5000-character key or path is
/// shown by its start and its size, not in full.
pub fn excerpt(text: &str) -> String {
    excerpt_of(text, 120)
}

/// At most `max` characters of `text`, then its size.
pub fn excerpt_of(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((end, _)) => format!("{}… ({} bytes)", &text[..end], text.len()),
    }
}

/// ` (70 characters; at most 63)` for a name over the limit of names in a spec.
pub fn length_note(name: &str) -> String {
    if name.len() > 63 {
        format!(" ({} characters; at most 63)", name.len())
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_quote_long_keys_and_paths_by_excerpt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let long = "k".repeat(5000);
        let specs = [
            format!("[pipeline]\nname = \"p\"\n{long} = 1\n\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n"),
            format!("[pipeline]\nname = \"p\"\nworkdir = \"/proc/{long}\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n"),
        ];
        for text in specs {
            let e = crate::spec::parse(&path, &text, &[]).unwrap_err();
            for err in &e.errors {
                let msg = err.to_string();
                assert!(msg.len() < 600, "{} bytes: {}", msg.len(), super::excerpt(&msg));
                assert!(msg.contains("(5000 bytes)") || msg.contains("(5006 bytes)"), "{msg}");
            }
        }
    }

    /// Every other place a spec's text reaches a message: names, kinds, interpolations, and the
    /// candidate lists of the help.
    #[test]
    fn every_message_and_help_stays_short() {
        use miette::Diagnostic;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.toml");
        let long = "k".repeat(5000);
        let many: String =
            (0..3000).map(|i| format!("[stages.s{i}]\nkind = \"command\"\nrun = [\"true\"]\n")).collect();
        let head = "[pipeline]\nname = \"p\"\n";
        let specs = [
            format!("{head}[stages.a]\nkind = \"{long}\"\n"),
            format!("{head}[stages.a]\nkind = \"command\"\nrun = [\"true\"]\nneeds = [\"{long}\"]\n"),
            format!("{head}[stages.a]\nkind = \"command\"\nrun = [\"${{vars.{long}}}\"]\n"),
            format!("{head}[stages.a]\nkind = \"command\"\nrun = [\"${{{long}\"]\n"),
            format!("{head}[stages.a{long}]\nkind = \"command\"\nrun = [\"true\"]\n"),
            format!("{head}{many}[stages.a]\nkind = \"command\"\nrun = [\"true\"]\nneeds = [\"zzzz\"]\n"),
        ];
        for text in specs {
            let e = crate::spec::parse(&path, &text, &[]).unwrap_err();
            for err in &e.errors {
                let msg = err.to_string();
                assert!(msg.len() < 1500, "{} bytes: {}", msg.len(), super::excerpt(&msg));
                let help = err.help().map(|h| h.to_string()).unwrap_or_default();
                assert!(help.len() < 1500, "help of {} bytes: {}", help.len(), super::excerpt(&help));
            }
        }
    }
}
