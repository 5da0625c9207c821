//! The spec: TOML text -> validated, interpolated [`Spec`]. Every problem becomes a
//! [`SpecError`] pointing at its place in the file.

mod checked;
pub mod error;
mod interp;
pub mod schema;
pub mod tree;
mod workdir;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use miette::{LabeledSpan, NamedSource};
use serde_json::{Map, Value as Json};

pub use error::{SpecError, SpecErrors, Src};
pub use interp::{pieces, stage_refs, substitute_outputs, Piece};
use error::{did_you_mean, to_span};
use schema::{check_table, invalid};
use tree::{Node, Origin, Val};

use crate::exec::retry::{FailureClass, RetryPolicy};
use crate::stages::{fields, Kind};

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
    pub workdir: PathBuf,
    pub backend: String,
    pub jobs: Option<usize>,
    pub kubernetes: Map<String, Json>,
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
    pub params: Map<String, Json>,
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

impl Spec {
    pub fn stage(&self, name: &str) -> Option<&StageSpec> {
        self.stages.iter().find(|s| s.name == name)
    }

    pub fn src(&self) -> Src {
        NamedSource::new(self.path.display().to_string(), self.source.clone())
    }

    pub fn workdir(&self) -> PathBuf {
        self.pipeline.workdir.clone()
    }
}

const TOP: &[&str] = &["pipeline", "vars", "env", "stages", "schedule", "notify"];

/// Reads and validates a spec. `overrides` are `--set key=value` arguments. A spec that passed
/// before, unchanged and with the same overrides, is not checked again (see [`checked`]).
/// Largest spec mflow reads: a 1000-stage spec is 250 KB, and every run record keeps a copy.
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

pub fn load(path: &Path, overrides: &[String]) -> Result<Spec, SpecErrors> {
    let io_error = |source| SpecErrors::new(path, vec![SpecError::Io { path: path.to_path_buf(), source }]);
    // A regular file of bounded size: a FIFO would hang mflow, a huge file fill every record.
    let bytes = crate::cache::read_regular(path, MAX_SPEC_BYTES).map_err(io_error)?;
    let text = String::from_utf8(bytes).map_err(|_| io_error(std::io::Error::new(std::io::ErrorKind::InvalidData, "it is not UTF-8 text")))?;
    let dir = spec_dir(path);
    let key = checked::key(path, &dir, &text, overrides);
    if let Some(key) = &key {
        // The workdir is checked again: what is there may have changed since. When it no longer
        // passes, the parse below reports it at its place in the file.
        if let Some(spec) = checked::read(&dir, path, key).filter(|s| workdir::check(&s.dir, &s.pipeline.workdir).is_ok()) {
            tracing::debug!(spec = %path.display(), "spec unchanged since it was last checked");
            return Ok(Spec { source: Arc::from(text), ..spec });
        }
    }
    let spec = parse_in(path, dir.clone(), &text, overrides)?;
    if let Some(key) = &key {
        checked::write(&dir, path, key, &spec);
    }
    Ok(spec)
}

/// Beside the spec, unless `[pipeline] workdir` names another.
const DEFAULT_WORKDIR: &str = ".mflow";

/// The workdir of the spec at `path` unless it names another, known before the spec is read.
pub fn default_workdir(path: &Path) -> PathBuf {
    spec_dir(path).join(DEFAULT_WORKDIR)
}

/// The spec's directory, canonical where it can be.
fn spec_dir(path: &Path) -> PathBuf {
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
    std::fs::canonicalize(&dir).unwrap_or(dir)
}

pub fn parse(path: &Path, text: &str, overrides: &[String]) -> Result<Spec, SpecErrors> {
    parse_in(path, spec_dir(path), text, overrides)
}

/// `parse`, with the spec's directory already found.
fn parse_in(path: &Path, dir: PathBuf, text: &str, overrides: &[String]) -> Result<Spec, SpecErrors> {
    let source: Arc<str> = Arc::from(text);
    let src: Src = NamedSource::new(path.display().to_string(), source.clone());
    let fail = |errors: Vec<SpecError>| SpecErrors::new(path, errors);

    let mut root = tree::parse(text).map_err(|e| {
        fail(vec![SpecError::Syntax { src: src.clone(), span: to_span(e.span()), message: e.message().trim().to_string() }])
    })?;
    let mut errors = Vec::new();
    for arg in overrides {
        if let Err(e) = apply_override(&mut root, arg) {
            errors.push(e);
        }
    }
    if !errors.is_empty() {
        return Err(fail(errors));
    }
    for (key, _) in root.as_table().into_iter().flatten() {
        if !TOP.contains(&key.name.as_str()) {
            errors.push(SpecError::UnknownKey {
                src: src.clone(),
                span: to_span(key.origin.span()),
                key: error::excerpt(&key.name),
                table: "the spec".into(),
                help: did_you_mean(&key.name, TOP, "sections"),
            });
        }
    }

    // [vars]
    let mut var_nodes: BTreeMap<String, Node> = BTreeMap::new();
    if let Some(vars) = root.get("vars") {
        match vars.as_table() {
            Some(t) => {
                for (k, v) in t {
                    var_nodes.insert(k.name.clone(), v.clone());
                }
            }
            None => errors.push(invalid(&src, vars, "vars", "must be a table", "write `[vars]` followed by `name = value` lines")),
        }
    }

    // [pipeline]
    let empty = Node { origin: Origin::File(0..0), value: Val::Table(Vec::new()) };
    let pipeline_node = match root.get("pipeline") {
        Some(n) => n.clone(),
        None => {
            errors.push(SpecError::MissingKey {
                src: src.clone(),
                span: to_span(Some(0..0)),
                key: "pipeline".into(),
                table: "the spec".into(),
                help: "add a `[pipeline]` table with at least `name = \"...\"`".into(),
            });
            empty.clone()
        }
    };
    let p = check_table(&src, &pipeline_node, fields::PIPELINE, "[pipeline]", &mut errors);
    let default_retries = p.get("retries").map(retry_policy).unwrap_or_default();
    let default_timeout = p.get("timeout").and_then(duration);
    let pipeline = Pipeline {
        name: str_of(&p, "name").unwrap_or_default(),
        description: str_of(&p, "description"),
        workdir: dir.join(str_of(&p, "workdir").unwrap_or_else(|| DEFAULT_WORKDIR.into())),
        backend: str_of(&p, "backend").unwrap_or_else(|| "local".into()),
        jobs: p.get("jobs").and_then(Json::as_u64).map(|n| n.max(1) as usize),
        kubernetes: p.get("kubernetes").and_then(Json::as_object).cloned().unwrap_or_default(),
    };
    check_workdir(&src, &dir, &pipeline_node, &pipeline.workdir, &mut errors);
    if let Some(name_node) = pipeline_node.get("name") {
        if let Val::Str(n) = &name_node.value {
            if !valid_name(n) {
                let problem = format!("not a valid name{}", error::length_note(n));
                errors.push(invalid(&src, name_node, "pipeline.name", &problem, "use letters, digits, `-` and `_`, starting with a letter, at most 63 characters (Kubernetes label values; the TrainJob names made of pipeline and stage names are shortened to 48 characters with a hash, so that the pod names JobSet derives fit in 63)"));
            }
        }
    }

    let python = match root.get("env") {
        Some(n) => str_of(&check_table(&src, n, fields::ENV, "[env]", &mut errors), "python"),
        None => None,
    };
    let schedule = root.get("schedule").map(|n| check_table(&src, n, fields::SCHEDULE, "[schedule]", &mut errors));
    let notify = root.get("notify").map(|n| check_table(&src, n, fields::NOTIFY, "[notify]", &mut errors));

    // [stages.*]
    // Taken out of the tree, not copied: it is most of the spec.
    let stages_node = match &mut root.value {
        Val::Table(t) => t.iter().position(|(k, _)| k.name == "stages").map(|i| t.remove(i).1),
        _ => None,
    };
    let stage_entries: Vec<(tree::Key, Node)> = match stages_node {
        Some(Node { value: Val::Table(t), .. }) => t,
        Some(n) => {
            errors.push(invalid(&src, &n, "stages", "must be a table", "write one `[stages.NAME]` table per stage"));
            Vec::new()
        }
        None => Vec::new(),
    };
    if stage_entries.is_empty() && errors.is_empty() {
        errors.push(SpecError::NoStages { src: src.clone() });
    }
    let names: Vec<String> = stage_entries.iter().map(|(k, _)| k.name.clone()).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let name_set: std::collections::HashSet<&str> = name_refs.iter().copied().collect();

    // A stage's output reaches the stages after it as MFLOW_INPUT_<NAME>: two names that map to
    // one variable would hand one of them the other's output.
    let mut vars: std::collections::HashMap<String, (&str, Option<std::ops::Range<usize>>)> = std::collections::HashMap::new();
    // `input_var` is `MFLOW_INPUT_<NAME>`; the message names only `<NAME>`.
    for (key, _) in &stage_entries {
        let var = input_var(&key.name);
        match vars.get(&var) {
            Some((first, first_span)) => errors.push(SpecError::StageNameClash {
                src: src.clone(),
                first_span: to_span(first_span.clone()),
                second_span: to_span(key.origin.span()),
                first: first.to_string(),
                second: key.name.clone(),
                var: var.trim_start_matches("MFLOW_INPUT_").to_string(),
            }),
            None => {
                vars.insert(var, (key.name.as_str(), key.origin.span()));
            }
        }
    }

    let mut stages = Vec::new();
    // (from, to, span) for cycle reports
    let mut edges: Vec<(String, String, Option<std::ops::Range<usize>>)> = Vec::new();
    for (key, mut node) in stage_entries {
        if !valid_name(&key.name) {
            errors.push(SpecError::StageName { src: src.clone(), span: to_span(key.origin.span()), name: key.name.clone() });
            continue;
        }
        let first_edge = edges.len();
        interpolate_vars(&src, &mut node, &var_nodes, &mut errors);
        collect_stage_refs(&src, &key.name, &node, &name_refs, &mut edges, &mut errors);
        let table = format!("[stages.{}]", key.name);
        let kind = match node.get("kind") {
            Some(Node { value: Val::Str(k), .. }) => match Kind::parse(k) {
                Some(kind) => Some(kind),
                None => {
                    errors.push(SpecError::UnknownKind {
                        src: src.clone(),
                        span: to_span(node.get("kind").and_then(Node::span)),
                        kind: k.clone(),
                        help: did_you_mean(k, Kind::NAMES, "kinds"),
                    });
                    None
                }
            },
            _ => None,
        };
        let mut all_fields: Vec<schema::Field> = fields::COMMON.to_vec();
        if let Some(kind) = kind {
            all_fields.extend_from_slice(kind.fields());
        }
        let mut values = check_table(&src, &node, &all_fields, &table, &mut errors);
        // needs: must name stages
        if let Some(Node { value: Val::Array(items), .. }) = node.get("needs") {
            for item in items {
                if let Val::Str(n) = &item.value {
                    if !name_set.contains(n.as_str()) {
                        errors.push(SpecError::UnknownStage {
                            src: src.clone(),
                            span: to_span(item.span()),
                            stage: key.name.clone(),
                            name: n.clone(),
                            help: did_you_mean(n, &name_refs, "stages"),
                        });
                    } else {
                        edges.push((key.name.clone(), n.clone(), item.span()));
                    }
                }
            }
        }
        let Some(kind) = kind else { continue };
        if let Some(Json::Object(g)) = values.get("gates") {
            for (metric, cond) in g {
                if let Err(reason) = crate::exec::gates::Condition::parse(cond.as_str().unwrap_or("")) {
                    let gnode = node.get("gates").and_then(|t| t.get(metric)).unwrap_or(&node);
                    errors.push(invalid(&src, gnode, &format!("gates.{metric}"), reason, "write a comparison such as \"< 40\" or \">= 0.5\""));
                }
            }
        }
        if let Some(Json::Object(r)) = values.get("retries") {
            if let Some(Json::Array(on)) = r.get("on") {
                for c in on {
                    let c = c.as_str().unwrap_or("");
                    if !FailureClass::RETRYABLE.contains(&c) {
                        let rnode = node.get("retries").and_then(|t| t.get("on")).unwrap_or(&node);
                        errors.push(invalid(&src, rnode, "retries.on", format!("`{c}` is not a retryable failure class"), did_you_mean(c, FailureClass::RETRYABLE, "classes")));
                    }
                }
            }
        }
        kind.check(&src, &node, &values, &name_refs, &mut errors);
        // An evaluation baseline is read from another stage's output: that is an edge too.
        if let Some(b) = values.get("baseline").and_then(Json::as_str) {
            if name_set.contains(b) {
                edges.push((key.name.clone(), b.to_string(), node.get("baseline").and_then(Node::span)));
            }
        }

        let mut needs: BTreeSet<String> = BTreeSet::new();
        for (_, to, _) in &edges[first_edge..] {
            needs.insert(to.clone());
        }
        let retries = values.get("retries").map(retry_policy).unwrap_or_else(|| default_retries.clone());
        let timeout = values.get("timeout").and_then(duration).or(default_timeout);
        if let Some(res) = node.get("resources") {
            check_resources(&src, res, &table, &mut errors);
        }
        let resources = values.get("resources").map(resources_of).unwrap_or(Resources { gpus: 0, cpus: 1.0, cpus_given: false, memory: None });
        let common: Vec<&str> = fields::COMMON.iter().map(|f| f.name).collect();
        let take_map = |v: Option<&Json>| -> BTreeMap<String, String> {
            v.and_then(Json::as_object)
                .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string())).collect())
                .unwrap_or_default()
        };
        let stage = StageSpec {
            name: key.name.clone(),
            kind,
            inputs: strs(values.get("inputs")),
            needs: needs.into_iter().collect(),
            retries,
            timeout,
            resources,
            env: take_map(values.get("env")),
            cache: values.get("cache").and_then(Json::as_bool).unwrap_or(true),
            salt: str_of(&values, "salt").unwrap_or_default(),
            gates: take_map(values.get("gates")),
            nodes: values.get("nodes").and_then(Json::as_u64).unwrap_or(1) as u32,
            image: str_of(&values, "image"),
            description: str_of(&values, "description"),
            params: {
                values.retain(|k, _| !common.contains(&k.as_str()));
                values
            },
        };
        stages.push(stage);
    }
    if errors.is_empty() {
        if let Some(cycle) = find_cycle(&names, &edges) {
            let labels = cycle
                .windows(2)
                .filter_map(|w| {
                    edges
                        .iter()
                        .find(|(f, t, _)| f == &w[0] && t == &w[1])
                        .and_then(|(f, t, s)| s.clone().map(|s| LabeledSpan::new(Some(format!("`{f}` needs `{t}`")), s.start, s.end - s.start)))
                })
                .collect();
            errors.push(SpecError::Cycle { src: src.clone(), cycle: cycle.join(" -> "), edges: labels });
        }
    }
    if !errors.is_empty() {
        return Err(fail(errors));
    }
    let vars = var_nodes.iter().map(|(k, n)| (k.clone(), n.value.to_json())).collect();
    Ok(Spec { path: path.to_path_buf(), dir, source, pipeline, vars, python, schedule, notify, stages })
}

/// Reports a workdir that mflow may not use, at the `workdir` key (or the `[pipeline]` table
/// when the default is refused).
fn check_workdir(src: &Src, dir: &Path, pipeline: &Node, workdir: &Path, errors: &mut Vec<SpecError>) {
    if let Err(r) = workdir::check(dir, workdir) {
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
        errors.push(SpecError::Workdir { src: src.clone(), span: to_span(span), value: error::excerpt(&value), reason: error::excerpt(&reason), help: r.help });
    }
}

// Called once per `--set`; the error is the spec's own diagnostic type, large for its spans.
#[allow(clippy::result_large_err)]
fn apply_override(root: &mut Node, arg: &str) -> Result<(), SpecError> {
    let bad = |reason: &str| SpecError::Override { arg: arg.to_string(), reason: reason.to_string() };
    let (key, value) = arg.split_once('=').ok_or_else(|| bad("expected KEY=VALUE"))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    match path.as_slice() {
        ["vars", _] | ["pipeline", ..] => {}
        ["stages", stage, _, ..] => {
            if root.get("stages").and_then(|s| s.get(stage)).is_none() {
                return Err(bad(&format!("there is no stage `{stage}`")));
            }
        }
        _ => return Err(bad("the key must start with `vars.`, `stages.STAGE.` or `pipeline.`")),
    }
    if path.iter().any(|p| p.is_empty()) {
        return Err(bad("empty key segment"));
    }
    let node = tree::parse_override(value.trim(), arg);
    root.set_path(&path, node).map_err(|e| bad(&e))
}

/// Replaces `${vars.X}` in every string of a stage table. A string that is exactly one
/// reference takes the variable's type; otherwise the variable is formatted into the text.
fn interpolate_vars(src: &Src, node: &mut Node, vars: &BTreeMap<String, Node>, errors: &mut Vec<SpecError>) {
    match &mut node.value {
        Val::Str(s) if interp::has_refs(s) => {
            let ps = match pieces(s) {
                Ok(ps) => ps,
                Err(text) => {
                    errors.push(SpecError::Interpolation { src: src.clone(), span: to_span(node.origin.span()), text });
                    return;
                }
            };
            if !ps.iter().any(|p| matches!(p, Piece::Var(_))) {
                return;
            }
            let lookup = |name: &str, errors: &mut Vec<SpecError>| -> Option<Node> {
                let found = vars.get(name).cloned();
                if found.is_none() {
                    let names: Vec<&str> = vars.keys().map(String::as_str).collect();
                    errors.push(SpecError::UnknownVar {
                        src: src.clone(),
                        span: to_span(node.origin.span()),
                        name: name.to_string(),
                        help: did_you_mean(name, &names, "variables"),
                    });
                }
                found
            };
            if let [Piece::Var(name)] = ps.as_slice() {
                if let Some(v) = lookup(name, errors) {
                    node.value = v.value;
                }
                return;
            }
            let mut out = String::new();
            for p in ps {
                match p {
                    Piece::Text(t) => out.push_str(&t),
                    Piece::StageOutput(n) => out.push_str(&format!("${{stages.{n}.output}}")),
                    Piece::Var(name) => match lookup(&name, errors).map(|n| n.value) {
                        Some(Val::Str(s)) => out.push_str(&s),
                        Some(v @ (Val::Int(_) | Val::Float(_) | Val::Bool(_))) => out.push_str(&v.to_json().to_string()),
                        Some(_) => errors.push(invalid(src, node, &format!("vars.{name}"), "only scalars can be formatted into text", "use the variable as the whole value")),
                        None => {}
                    },
                }
            }
            node.value = Val::Str(out);
        }
        Val::Array(items) => items.iter_mut().for_each(|n| interpolate_vars(src, n, vars, errors)),
        Val::Table(t) => t.iter_mut().for_each(|(_, n)| interpolate_vars(src, n, vars, errors)),
        _ => {}
    }
}

fn collect_stage_refs(
    src: &Src,
    stage: &str,
    node: &Node,
    names: &[&str],
    edges: &mut Vec<(String, String, Option<std::ops::Range<usize>>)>,
    errors: &mut Vec<SpecError>,
) {
    match &node.value {
        Val::Str(s) if interp::has_refs(s) => {
            for p in pieces(s).unwrap_or_default() {
                if let Piece::StageOutput(n) = p {
                    if names.contains(&n.as_str()) {
                        edges.push((stage.to_string(), n, node.span()));
                    } else {
                        errors.push(SpecError::UnknownStage {
                            src: src.clone(),
                            span: to_span(node.span()),
                            stage: stage.to_string(),
                            help: did_you_mean(&n, names, "stages"),
                            name: n,
                        });
                    }
                }
            }
        }
        Val::Array(a) => a.iter().for_each(|n| collect_stage_refs(src, stage, n, names, edges, errors)),
        Val::Table(t) => t.iter().for_each(|(_, n)| collect_stage_refs(src, stage, n, names, edges, errors)),
        _ => {}
    }
}

/// A cycle as a list of names where the first equals the last, if any.
fn find_cycle(names: &[String], edges: &[(String, String, Option<std::ops::Range<usize>>)]) -> Option<Vec<String>> {
    use petgraph::graph::DiGraph;
    let mut g = DiGraph::<&str, ()>::new();
    let idx: BTreeMap<&str, _> = names.iter().map(|n| (n.as_str(), g.add_node(n.as_str()))).collect();
    for (from, to, _) in edges {
        g.update_edge(idx[from.as_str()], idx[to.as_str()], ());
    }
    for scc in petgraph::algo::tarjan_scc(&g) {
        let self_loop = scc.len() == 1 && g.contains_edge(scc[0], scc[0]);
        if scc.len() < 2 && !self_loop {
            continue;
        }
        // Walk inside the component until a node repeats.
        let members: BTreeSet<_> = scc.iter().copied().collect();
        let start = *scc.iter().min_by_key(|n| g[**n]).unwrap();
        let mut path = vec![start];
        let mut cur = start;
        loop {
            let next = g.neighbors(cur).filter(|n| members.contains(n)).min_by_key(|n| g[*n]).unwrap();
            if let Some(pos) = path.iter().position(|n| *n == next) {
                let mut cycle: Vec<String> = path[pos..].iter().map(|n| g[*n].to_string()).collect();
                cycle.push(g[next].to_string());
                return Some(cycle);
            }
            path.push(next);
            cur = next;
        }
    }
    None
}

/// The variable that hands a stage's output to the stages that need it: `MFLOW_INPUT_<NAME>`,
/// the name upper-cased with every other character `_`.
pub fn input_var(stage: &str) -> String {
    let name: String = stage.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
    format!("MFLOW_INPUT_{name}")
}

pub fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && n.len() <= 63
}

fn str_of(m: &Map<String, Json>, k: &str) -> Option<String> {
    m.get(k).and_then(Json::as_str).map(str::to_string)
}

fn strs(v: Option<&Json>) -> Vec<String> {
    v.and_then(Json::as_array).map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()).unwrap_or_default()
}

fn duration(v: &Json) -> Option<Duration> {
    humantime::parse_duration(v.as_str()?).ok()
}

fn retry_policy(v: &Json) -> RetryPolicy {
    let d = RetryPolicy::default();
    RetryPolicy {
        max: v.get("max").and_then(Json::as_u64).map(|n| n as u32).unwrap_or(d.max),
        backoff: v.get("backoff").and_then(duration).unwrap_or(d.backoff),
        max_backoff: v.get("max_backoff").and_then(duration).unwrap_or(d.max_backoff),
        on: v.get("on").and_then(Json::as_array).map(|a| a.iter().filter_map(|c| FailureClass::parse(c.as_str()?)).collect()).unwrap_or(d.on),
    }
}

/// Most cores and GPUs one stage may ask for: beyond any machine, and beyond what the
/// scheduler's counts are meant for.
const MAX_CPUS: f64 = 4096.0;
const MAX_GPUS: i64 = 1024;

/// `resources` values that parse but mean nothing: no cores, negative or absurd counts.
fn check_resources(src: &Src, node: &Node, table: &str, errors: &mut Vec<SpecError>) {
    let bad = |errors: &mut Vec<SpecError>, at: &Node, key: &str, reason: String, help: &str| {
        errors.push(SpecError::InvalidValue { src: src.clone(), span: to_span(at.span()), key: format!("{table}.resources.{key}"), reason, help: help.into() })
    };
    if let Some(at) = node.get("cpus") {
        let cpus = match at.value {
            Val::Int(i) => Some(i as f64),
            Val::Float(f) => Some(f),
            _ => None,
        };
        if let Some(c) = cpus.filter(|c| c.is_finite() && (*c <= 0.0 || *c > MAX_CPUS)) {
            let c = if c.abs() >= 1e6 { format!("{c:e}") } else { c.to_string() };
            bad(errors, at, "cpus", format!("{c} cores"), "ask for more than 0 and at most 4096 cores, e.g. 0.5 or 8");
        }
    }
    if let Some(at) = node.get("gpus") {
        if let Val::Int(g) = at.value {
            if !(0..=MAX_GPUS).contains(&g) {
                bad(errors, at, "gpus", format!("{g} GPUs"), "ask for 0 to 1024 GPUs per node");
            }
        }
    }
}

fn resources_of(v: &Json) -> Resources {
    Resources {
        gpus: v.get("gpus").and_then(Json::as_u64).unwrap_or(0) as u32,
        cpus: v.get("cpus").and_then(Json::as_f64).unwrap_or(1.0),
        cpus_given: v.get("cpus").is_some(),
        memory: v.get("memory").and_then(Json::as_str).map(str::to_string),
    }
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
