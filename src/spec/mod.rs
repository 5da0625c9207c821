//! The spec: TOML text -> validated, interpolated [`Spec`]. Every problem becomes a
//! [`SpecError`] pointing at its place in the file.

mod checked;
pub mod error;
pub mod gates;
mod interp;
mod parse;
mod retry;
pub mod schema;
pub mod secret;
pub mod tree;
mod values;
mod view;
mod workdir;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use miette::NamedSource;
use serde_json::{Map, Value as Json};

pub use error::{SpecError, SpecErrors, Src};
pub use interp::{pieces, stage_refs, substitute_outputs, Piece};
pub use view::place_of_value;

use crate::stages::{fields, Kind, Params};
pub use retry::RetryPolicy;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    pub path: PathBuf,
    /// The spec's directory: relative paths in the spec start here.
    pub dir: PathBuf,
    #[serde(skip)]
    pub source: Arc<str>,
    pub pipeline: Pipeline,
    pub vars: Map<String, Json>,
    pub python: Option<String>,
    pub schedule: Option<Map<String, Json>>,
    pub notify: Option<Map<String, Json>>,
    /// In file order.
    pub stages: Vec<StageSpec>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Pipeline {
    pub name: String,
    pub description: Option<String>,
    /// `[pipeline] workdir` as given, in the file or by `--set`; `None` when the spec names
    /// none. [`Spec::workdir`] is where the backend puts it.
    pub workdir: Option<PathBuf>,
    pub backend: BackendKind,
    pub jobs: Option<usize>,
    pub kubernetes: Map<String, Json>,
}

/// Where a pipeline's stages run (`[pipeline] backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Local,
    Kubernetes,
}

impl BackendKind {
    pub const ALL: [BackendKind; 2] = [BackendKind::Local, BackendKind::Kubernetes];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Local => "local",
            BackendKind::Kubernetes => "kubernetes",
        }
    }

    /// The backend of `[pipeline] backend = "NAME"`.
    pub fn parse(name: &str) -> Option<BackendKind> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }

    /// The workdir of pipeline `pipeline` on this backend, given `[pipeline] workdir` (if any)
    /// and the spec's directory. Locally: the given one against the spec's directory, else
    /// `.mflow` beside the spec. On Kubernetes the workdir is on the artifact volume: the given
    /// one when it is absolute (the volume mounted there), else `/mflow/<pipeline>`.
    pub fn workdir(self, spec_dir: &Path, given: Option<&Path>, pipeline: &str) -> PathBuf {
        match (self, given) {
            (BackendKind::Kubernetes, Some(w)) if w.is_absolute() => w.to_path_buf(),
            (BackendKind::Kubernetes, _) => Path::new(mflow_kube::ARTIFACT_MOUNT).join(pipeline),
            (BackendKind::Local, _) => spec_dir.join(given.unwrap_or(Path::new(DEFAULT_WORKDIR))),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Resources {
    pub gpus: u32,
    pub cpus: f64,
    /// `cpus` was given in the spec (else it is the default of 1).
    #[serde(default)]
    pub cpus_given: bool,
    pub memory: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StageSpec {
    pub name: String,
    pub kind: Kind,
    /// Kind-specific parameters with defaults filled in; `${stages.X.output}` left in place.
    /// They enter the cache key as they are.
    pub params: Map<String, Json>,
    /// The same parameters, typed: what code reads. A checked spec read back types them again.
    #[serde(skip)]
    pub typed: Params,
    /// Explicit and implicit dependencies, sorted.
    pub needs: Vec<String>,
    pub inputs: Vec<String>,
    // The checked form leaves out what most stages leave unset.
    #[serde(default, skip_serializing_if = "RetryPolicy::is_default")]
    pub retries: RetryPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Duration>,
    pub resources: Resources,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    pub cache: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub salt: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gates: BTreeMap<String, String>,
    pub nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

impl StageSpec {
    /// A stage with default settings and these parameters (tests and stages planning adds).
    pub fn test_stage(name: &str, kind: Kind, params: Map<String, Json>) -> StageSpec {
        StageSpec {
            name: name.into(),
            kind,
            typed: Params::of(kind, &params).expect("parameters of the kind"),
            params,
            needs: vec![],
            inputs: vec![],
            retries: Default::default(),
            timeout: None,
            resources: Resources { gpus: 0, cpus: 1.0, cpus_given: false, memory: None },
            env: BTreeMap::new(),
            cache: true,
            salt: String::new(),
            gates: BTreeMap::new(),
            nodes: 1,
            image: None,
            description: None,
        }
    }

    /// Points the stage at another `model`, in its parameters and its key's.
    pub fn set_model(&mut self, model: String) {
        self.params.insert("model".into(), Json::String(model.clone()));
        self.typed.set_model(model);
    }
}

impl Spec {
    pub fn stage(&self, name: &str) -> Option<&StageSpec> {
        self.stages.iter().find(|s| s.name == name)
    }

    /// Keeps only the stages `wanted` and those they need, at any depth (`mflow run SPEC
    /// STAGE...`); the first name that is no stage is the error.
    pub fn keep_stages_for(&mut self, wanted: &[String]) -> Result<(), String> {
        if wanted.is_empty() {
            return Ok(());
        }
        let mut keep: std::collections::BTreeSet<String> = Default::default();
        let mut todo: Vec<String> = wanted.to_vec();
        while let Some(name) = todo.pop() {
            let st = self.stage(&name).ok_or_else(|| name.clone())?;
            if keep.insert(name) {
                todo.extend(st.needs.iter().cloned());
            }
        }
        self.stages.retain(|s| keep.contains(&s.name));
        Ok(())
    }

    pub fn src(&self) -> Src {
        NamedSource::new(self.path.display().to_string(), self.source.clone())
    }

    /// The workdir, where this spec's backend puts it ([`BackendKind::workdir`]).
    pub fn workdir(&self) -> crate::workdir::Workdir {
        let p = &self.pipeline;
        crate::workdir::Workdir::new(p.backend.workdir(&self.dir, p.workdir.as_deref(), &p.name))
    }

    /// The workdir as written, against the spec's directory: what the spec is checked with when
    /// it loads, whatever its backend.
    fn workdir_as_written(&self) -> PathBuf {
        BackendKind::Local.workdir(&self.dir, self.pipeline.workdir.as_deref(), &self.pipeline.name)
    }
}

/// Reads and validates a spec. `overrides` are `--set key=value` arguments. A spec that passed
/// before, unchanged and with the same overrides, is not checked again (see [`checked`]).
/// Largest spec mflow reads: a 1000-stage spec is 250 KB, and every run record keeps a copy.
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

pub fn load(path: &Path, overrides: &[String]) -> Result<Spec, SpecErrors> {
    let io_error = |source| SpecErrors::new(path, vec![SpecError::Io { path: path.to_path_buf(), source }]);
    // A regular file of bounded size: a FIFO would hang mflow, a huge file fill every record.
    let bytes = crate::cache::read_regular(path, MAX_SPEC_BYTES).map_err(io_error)?;
    let text = String::from_utf8(bytes)
        .map_err(|_| io_error(std::io::Error::new(std::io::ErrorKind::InvalidData, "it is not UTF-8 text")))?;
    let dir = spec_dir(path);
    let key = checked::key(path, &dir, &text, overrides);
    if let Some(key) = &key {
        // The workdir is checked again: what is there may have changed since. When it no longer
        // passes, the parse below reports it at its place in the file.
        if let Some(spec) =
            checked::read(&dir, path, key).filter(|s| workdir::check(&s.dir, &s.workdir_as_written()).is_ok())
        {
            tracing::debug!(spec = %path.display(), "spec unchanged since it was last checked");
            return Ok(Spec { source: Arc::from(text), ..spec });
        }
    }
    let spec = parse::parse_in(path, dir.clone(), &text, overrides)?;
    if let Some(key) = &key {
        checked::write(&dir, path, key, &spec);
    }
    Ok(spec)
}

/// Reads a spec for a command that runs it on `backend` when it names one (`--backend`), else
/// on the spec's own `[pipeline] backend`; the workdir follows from the backend.
pub fn load_on(path: &Path, overrides: &[String], backend: Option<BackendKind>) -> Result<Spec, SpecErrors> {
    let mut spec = load(path, overrides)?;
    if let Some(b) = backend {
        spec.pipeline.backend = b;
    }
    Ok(spec)
}

/// Beside the spec, unless `[pipeline] workdir` names another.
pub const DEFAULT_WORKDIR: &str = ".mflow";

/// The workdir of the spec at `path` unless it names another, known before the spec is read.
pub fn default_workdir(path: &Path) -> crate::workdir::Workdir {
    crate::workdir::Workdir::new(spec_dir(path).join(DEFAULT_WORKDIR))
}

/// The spec's directory, canonical where it can be.
fn spec_dir(path: &Path) -> PathBuf {
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
    std::fs::canonicalize(&dir).unwrap_or(dir)
}

pub fn parse(path: &Path, text: &str, overrides: &[String]) -> Result<Spec, SpecErrors> {
    parse::parse_in(path, spec_dir(path), text, overrides)
}

/// The variable that hands a stage's output to the stages that need it: `MFLOW_INPUT_<NAME>`,
/// the name upper-cased with every other character `_`.
pub fn input_var(stage: &str) -> String {
    let name: String =
        stage.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
    format!("MFLOW_INPUT_{name}")
}

pub fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && n.len() <= 63
}

/// JSON Schema of the whole spec, for editors (taplo / Even Better TOML).
pub fn json_schema() -> Json {
    use serde_json::json;
    let stage_variants: Vec<Json> = Kind::ALL
        .iter()
        .map(|k| {
            let mut f = fields::COMMON.to_vec();
            f.extend_from_slice(k.fields());
            let mut s = schema::json_schema(&f);
            s["properties"]["kind"] = json!({"const": k.name(), "description": k.doc()});
            s["title"] = json!(format!("{} stage", k.name()));
            s
        })
        .collect();
    json!({
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "mflow spec",
        "type": "object",
        "additionalProperties": false,
        "required": ["pipeline", "stages"],
        "properties": {
            "pipeline": schema::json_schema(fields::PIPELINE),
            "vars": {"type": "object", "description": "typed values, used as ${vars.NAME}"},
            "env": schema::json_schema(fields::ENV),
            "schedule": schema::json_schema(fields::SCHEDULE),
            "notify": schema::json_schema(fields::NOTIFY),
            "stages": {"type": "object", "additionalProperties": {"oneOf": stage_variants}},
        }
    })
}

/// The key reference of docs/spec.md, generated from the field tables.
pub fn reference_markdown() -> String {
    use crate::stages::fields as f;
    let mut out = String::new();
    let section = |out: &mut String, title: &str, fields: &[schema::Field]| {
        out.push_str(&format!("### {title}\n\n{}\n", schema::markdown(fields)));
    };
    section(&mut out, "`[pipeline]`", f::PIPELINE);
    section(&mut out, "`[pipeline.retries]` and a stage's `retries`", f::RETRY);
    section(&mut out, "`[pipeline.kubernetes]`", f::KUBERNETES);
    section(&mut out, "`[env]`", f::ENV);
    section(&mut out, "`[schedule]`", f::SCHEDULE);
    section(&mut out, "`[notify]`", f::NOTIFY);
    section(&mut out, "Every stage", f::COMMON);
    section(&mut out, "A stage's `resources`", f::RESOURCES);
    for k in Kind::ALL {
        section(&mut out, &format!("`kind = \"{}\"`: {}", k.name(), k.doc()), k.fields());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workdir_follows_the_backend_and_whether_one_was_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.toml");
        let text = "[pipeline]\nname = \"p\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n";
        let workdir = |set: &[&str], backend: Option<BackendKind>| {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            let mut spec = parse(&path, text, &set).unwrap();
            if let Some(b) = backend {
                spec.pipeline.backend = b;
            }
            spec.workdir().root().to_path_buf()
        };
        let here = spec_dir(&path);
        assert_eq!(workdir(&[], None), here.join(".mflow"));
        assert_eq!(workdir(&["pipeline.workdir=w"], None), here.join("w"));
        let k8s = Some(BackendKind::Kubernetes);
        assert_eq!(workdir(&[], k8s), Path::new("/mflow/p"));
        assert_eq!(workdir(&["pipeline.workdir=w"], k8s), Path::new("/mflow/p"), "a relative one is not on the volume");
        assert_eq!(workdir(&["pipeline.workdir=/shared/p"], k8s), Path::new("/shared/p"), "--set gives one too");
        let written = text.replace("name = \"p\"", "name = \"p\"\nbackend = \"kubernetes\"\nworkdir = \"/shared/q\"");
        let spec = parse(&path, &written, &[]).unwrap();
        assert_eq!(spec.workdir().root(), Path::new("/shared/q"));
        assert_eq!(BackendKind::parse("kubernetes"), Some(BackendKind::Kubernetes));
        assert_eq!(BackendKind::parse("cluster"), None);
    }
}
