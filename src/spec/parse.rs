//! Parsing a spec: the TOML tree with `--set` applied, then each section checked against its
//! field table, every problem collected with its place in the file.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use miette::{LabeledSpan, NamedSource};
use serde_json::{Map, Value as Json};

use super::error::{self, did_you_mean, to_span};
use super::interp::{collect_stage_refs, interpolate_vars};
use super::schema::{self, check_table, invalid};
use super::tree::{self, Node, Origin, Val};
use super::values::{check_resources, check_schedule, duration, resources_of, retry_policy, str_of, strs};
use super::workdir::check_workdir;
use super::{
    gates, input_var, valid_name, BackendKind, Pipeline, Resources, RetryPolicy, Spec, SpecError, SpecErrors, Src,
    StageSpec,
};
use crate::stages::{fields, Check, Kind, Params};
use mflow_contract::FailureClass;

const TOP: &[&str] = &["pipeline", "vars", "env", "stages", "schedule", "notify"];

/// (from, to, span): an edge between stages, with where the spec makes it, for cycle reports.
type Edge = (String, String, Option<Range<usize>>);

/// A spec on its way from text to [`Spec`]: its source, its directory, and the problems found.
struct Parser {
    src: Src,
    dir: PathBuf,
    errors: Vec<SpecError>,
}

/// The stages' names, as the checks of each stage look them up.
struct Names<'a> {
    refs: Vec<&'a str>,
    set: HashSet<&'a str>,
}

/// What every stage starts from: the pipeline's defaults and the spec's variables.
struct Defaults {
    retries: RetryPolicy,
    timeout: Option<std::time::Duration>,
    vars: BTreeMap<String, Node>,
}

pub(super) fn parse_in(path: &Path, dir: PathBuf, text: &str, overrides: &[String]) -> Result<Spec, SpecErrors> {
    let source: Arc<str> = Arc::from(text);
    let src: Src = NamedSource::new(path.display().to_string(), source.clone());
    let fail = |errors: Vec<SpecError>| SpecErrors::new(path, errors);
    let mut root = tree::parse(text)
        .map_err(|e| fail(vec![SpecError::Syntax { src: src.clone(), span: to_span(e.span), message: e.message }]))?;
    let mut parser = Parser { src, dir, errors: Vec::new() };
    for arg in overrides {
        if let Err(e) = apply_override(&mut root, arg) {
            parser.errors.push(e);
        }
    }
    if !parser.errors.is_empty() {
        return Err(fail(parser.errors));
    }
    parser.top_level_keys(&root);
    let vars = parser.vars(&root);
    let (pipeline, defaults) = parser.pipeline(&root, vars);
    let section = |parser: &mut Parser, name: &str, table: &[schema::Field]| {
        root.get(name).map(|n| check_table(&parser.src, n, table, &format!("[{name}]"), &mut parser.errors))
    };
    let python = section(&mut parser, "env", fields::ENV).and_then(|t| str_of(&t, "python"));
    let schedule = section(&mut parser, "schedule", fields::SCHEDULE);
    if let Some(node) = root.get("schedule") {
        check_schedule(&parser.src, node, &mut parser.errors);
    }
    let notify = section(&mut parser, "notify", fields::NOTIFY);
    let entries = parser.stage_entries(&mut root);
    let stages = parser.stages(entries, &defaults);
    if !parser.errors.is_empty() {
        return Err(fail(parser.errors));
    }
    let vars = defaults.vars.iter().map(|(k, n)| (k.clone(), n.value.to_json())).collect();
    let Parser { dir, .. } = parser;
    Ok(Spec { path: path.to_path_buf(), dir, source, pipeline, vars, python, schedule, notify, stages })
}

impl Parser {
    fn top_level_keys(&mut self, root: &Node) {
        for (key, _) in root.as_table().into_iter().flatten() {
            if !TOP.contains(&key.name.as_str()) {
                self.errors.push(SpecError::UnknownKey {
                    src: self.src.clone(),
                    span: to_span(key.origin.span()),
                    key: error::excerpt(&key.name),
                    table: "the spec".into(),
                    help: did_you_mean(&key.name, TOP, "sections"),
                });
            }
        }
    }

    /// `[vars]`, by name.
    fn vars(&mut self, root: &Node) -> BTreeMap<String, Node> {
        let Some(vars) = root.get("vars") else { return BTreeMap::new() };
        match vars.as_table() {
            Some(t) => t.iter().map(|(k, v)| (k.name.clone(), v.clone())).collect(),
            None => {
                let help = "write `[vars]` followed by `name = value` lines";
                self.errors.push(invalid(&self.src, vars, "vars", "must be a table", help));
                BTreeMap::new()
            }
        }
    }

    /// `[pipeline]`, and the defaults it gives every stage.
    fn pipeline(&mut self, root: &Node, vars: BTreeMap<String, Node>) -> (Pipeline, Defaults) {
        let node = match root.get("pipeline") {
            Some(n) => n.clone(),
            None => {
                self.errors.push(SpecError::MissingKey {
                    src: self.src.clone(),
                    span: to_span(Some(0..0)),
                    key: "pipeline".into(),
                    table: "the spec".into(),
                    help: "add a `[pipeline]` table with at least `name = \"...\"`".into(),
                });
                Node { origin: Origin::File(0..0), value: Val::Table(Vec::new()) }
            }
        };
        let p = check_table(&self.src, &node, fields::PIPELINE, "[pipeline]", &mut self.errors);
        self.backoffs(&node, &p);
        let defaults = Defaults {
            retries: p.get("retries").map(retry_policy).unwrap_or_default(),
            timeout: p.get("timeout").and_then(duration),
            vars,
        };
        let pipeline = Pipeline {
            name: str_of(&p, "name").unwrap_or_default(),
            description: str_of(&p, "description"),
            workdir: str_of(&p, "workdir").map(PathBuf::from),
            backend: str_of(&p, "backend").as_deref().and_then(BackendKind::parse).unwrap_or(BackendKind::Local),
            jobs: p.get("jobs").and_then(Json::as_u64).map(|n| n.max(1) as usize),
            kubernetes: p.get("kubernetes").and_then(Json::as_object).cloned().unwrap_or_default(),
        };
        // Checked as written, against the spec's directory, whatever the backend.
        let written = BackendKind::Local.workdir(&self.dir, pipeline.workdir.as_deref(), &pipeline.name);
        check_workdir(&self.src, &self.dir, &node, &written, &mut self.errors);
        if let Some(name_node) = node.get("name") {
            if let Val::Str(n) = &name_node.value {
                if !valid_name(n) {
                    let problem = format!("not a valid name{}", error::length_note(n));
                    self.errors.push(invalid(&self.src, name_node, "pipeline.name", &problem, "use letters, digits, `-` and `_`, starting with a letter, at most 63 characters (Kubernetes label values; the TrainJob names made of pipeline and stage names are shortened to 48 characters with a hash, so that the pod names JobSet derives fit in 63)"));
                }
            }
        }
        (pipeline, defaults)
    }

    /// `[stages.*]`, taken out of the tree rather than copied: it is most of the spec.
    fn stage_entries(&mut self, root: &mut Node) -> Vec<(tree::Key, Node)> {
        let node = match &mut root.value {
            Val::Table(t) => t.iter().position(|(k, _)| k.name == "stages").map(|i| t.remove(i).1),
            _ => None,
        };
        let entries = match node {
            Some(Node { value: Val::Table(t), .. }) => t,
            Some(n) => {
                let help = "write one `[stages.NAME]` table per stage";
                self.errors.push(invalid(&self.src, &n, "stages", "must be a table", help));
                Vec::new()
            }
            None => Vec::new(),
        };
        if entries.is_empty() && self.errors.is_empty() {
            self.errors.push(SpecError::NoStages { src: self.src.clone() });
        }
        self.input_variables_are_distinct(&entries);
        entries
    }

    /// A stage's output reaches the stages after it as MFLOW_INPUT_<NAME>: two names that map to
    /// one variable would hand one of them the other's output.
    fn input_variables_are_distinct(&mut self, entries: &[(tree::Key, Node)]) {
        let mut vars: HashMap<String, (&str, Option<Range<usize>>)> = HashMap::new();
        for (key, _) in entries {
            let var = input_var(&key.name);
            match vars.get(&var) {
                // `input_var` is `MFLOW_INPUT_<NAME>`; the message names only `<NAME>`.
                Some((first, first_span)) => self.errors.push(SpecError::StageNameClash {
                    src: self.src.clone(),
                    first_span: to_span(first_span.clone()),
                    second_span: to_span(key.origin.span()),
                    first: first.to_string(),
                    second: key.name.clone(),
                    var: var.trim_start_matches(mflow_contract::vars::INPUT_PREFIX).to_string(),
                }),
                None => {
                    vars.insert(var, (key.name.as_str(), key.origin.span()));
                }
            }
        }
    }

    /// Every stage, and the check that the stages make no cycle.
    fn stages(&mut self, entries: Vec<(tree::Key, Node)>, defaults: &Defaults) -> Vec<StageSpec> {
        let all: Vec<String> = entries.iter().map(|(k, _)| k.name.clone()).collect();
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        let names = Names { set: refs.iter().copied().collect(), refs };
        let mut stages = Vec::new();
        let mut edges: Vec<Edge> = Vec::new();
        for (key, mut node) in entries {
            if !valid_name(&key.name) {
                let span = to_span(key.origin.span());
                self.errors.push(SpecError::StageName { src: self.src.clone(), span, name: key.name.clone() });
                continue;
            }
            interpolate_vars(&self.src, &mut node, &defaults.vars, &mut self.errors);
            if let Some(stage) = self.stage(&key, &node, &names, defaults, &mut edges) {
                stages.push(stage);
            }
        }
        if self.errors.is_empty() {
            self.no_cycle(&all, &edges);
        }
        stages
    }

    /// One stage: its table checked, its edges collected, its values read.
    fn stage(
        &mut self,
        key: &tree::Key,
        node: &Node,
        names: &Names<'_>,
        defaults: &Defaults,
        edges: &mut Vec<Edge>,
    ) -> Option<StageSpec> {
        let first_edge = edges.len();
        collect_stage_refs(&self.src, &key.name, node, &names.refs, edges, &mut self.errors);
        let table = format!("[stages.{}]", key.name);
        let kind = self.kind(node);
        let mut all_fields: Vec<schema::Field> = fields::COMMON.to_vec();
        if let Some(kind) = kind {
            all_fields.extend_from_slice(kind.fields());
        }
        let values = check_table(&self.src, node, &all_fields, &table, &mut self.errors);
        self.needs(key, node, names, edges);
        let kind = kind?;
        self.gates_and_retries(node, &values);
        // The kind's own parameters, typed once; their checks beyond types.
        let common: Vec<&str> = fields::COMMON.iter().map(|f| f.name).collect();
        let own: Map<String, Json> =
            values.iter().filter(|(k, _)| !common.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
        let typed = self.typed(kind, &own, node, &names.refs, values.get("nodes").and_then(Json::as_u64).unwrap_or(1));
        // An evaluation baseline is read from another stage's output: that is an edge too.
        if let Some(b) = values.get("baseline").and_then(Json::as_str).filter(|b| names.set.contains(b)) {
            edges.push((key.name.clone(), b.to_string(), node.get("baseline").and_then(Node::span)));
        }
        let needs: BTreeSet<String> = edges[first_edge..].iter().map(|(_, to, _)| to.clone()).collect();
        if let Some(res) = node.get("resources") {
            check_resources(&self.src, res, &table, &mut self.errors);
        }
        let take_map = |v: Option<&Json>| -> BTreeMap<String, String> {
            v.and_then(Json::as_object)
                .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string())).collect())
                .unwrap_or_default()
        };
        Some(StageSpec {
            name: key.name.clone(),
            kind,
            inputs: strs(values.get("inputs")),
            needs: needs.into_iter().collect(),
            retries: values.get("retries").map(retry_policy).unwrap_or_else(|| defaults.retries.clone()),
            timeout: values.get("timeout").and_then(duration).or(defaults.timeout),
            resources: values.get("resources").map(resources_of).unwrap_or(Resources {
                gpus: 0,
                cpus: 1.0,
                cpus_given: false,
                memory: None,
            }),
            env: take_map(values.get("env")),
            cache: values.get("cache").and_then(Json::as_bool).unwrap_or(true),
            salt: str_of(&values, "salt").unwrap_or_default(),
            gates: take_map(values.get("gates")),
            nodes: values.get("nodes").and_then(Json::as_u64).unwrap_or(1) as u32,
            image: str_of(&values, "image"),
            description: str_of(&values, "description"),
            params: own,
            typed,
        })
    }

    /// The stage's `kind`, when it is one.
    fn kind(&mut self, node: &Node) -> Option<Kind> {
        let Some(Node { value: Val::Str(k), .. }) = node.get("kind") else { return None };
        let kind = Kind::parse(k);
        if kind.is_none() {
            self.errors.push(SpecError::UnknownKind {
                src: self.src.clone(),
                span: to_span(node.get("kind").and_then(Node::span)),
                kind: k.clone(),
                help: did_you_mean(k, Kind::NAMES, "kinds"),
            });
        }
        kind
    }

    /// `needs` must name stages; each one is an edge.
    fn needs(&mut self, key: &tree::Key, node: &Node, names: &Names<'_>, edges: &mut Vec<Edge>) {
        let Some(Node { value: Val::Array(items), .. }) = node.get("needs") else { return };
        for item in items {
            let Val::Str(n) = &item.value else { continue };
            if names.set.contains(n.as_str()) {
                edges.push((key.name.clone(), n.clone(), item.span()));
            } else {
                self.errors.push(SpecError::UnknownStage {
                    src: self.src.clone(),
                    span: to_span(item.span()),
                    stage: key.name.clone(),
                    name: n.clone(),
                    help: did_you_mean(n, &names.refs, "stages"),
                });
            }
        }
    }

    fn gates_and_retries(&mut self, node: &Node, values: &Map<String, Json>) {
        for (metric, cond) in values.get("gates").and_then(Json::as_object).into_iter().flatten() {
            if let Err(reason) = gates::Condition::parse(cond.as_str().unwrap_or("")) {
                let at = node.get("gates").and_then(|t| t.get(metric)).unwrap_or(node);
                let help = "write a comparison such as \"< 40\" or \">= 0.5\"";
                self.errors.push(invalid(&self.src, at, &format!("gates.{metric}"), reason, help));
            }
        }
        self.backoffs(node, values);
        let on = values.get("retries").and_then(|r| r.get("on")).and_then(Json::as_array);
        for c in on.into_iter().flatten() {
            let c = c.as_str().unwrap_or("");
            if !FailureClass::RETRYABLE.contains(&c) {
                let at = node.get("retries").and_then(|t| t.get("on")).unwrap_or(node);
                let reason = format!("`{c}` is not a retryable failure class");
                let help = did_you_mean(c, FailureClass::RETRYABLE, "classes");
                self.errors.push(invalid(&self.src, at, "retries.on", reason, help));
            }
        }
    }

    /// A `retries` table whose first wait is above its cap (given, or the default): the cap
    /// would win in silence.
    fn backoffs(&mut self, node: &Node, values: &Map<String, Json>) {
        let Some(r) = values.get("retries") else { return };
        let policy = retry_policy(r);
        if policy.backoff <= policy.max_backoff {
            return;
        }
        let table = node.get("retries");
        let (key, at) = match table.and_then(|t| t.get("max_backoff")) {
            Some(at) => ("retries.max_backoff", at),
            None => ("retries.backoff", table.and_then(|t| t.get("backoff")).unwrap_or(node)),
        };
        let show = |d: std::time::Duration| humantime::format_duration(d).to_string();
        let reason = format!("backoff {} is above max_backoff {}", show(policy.backoff), show(policy.max_backoff));
        self.errors.push(invalid(&self.src, at, key, reason, "make max_backoff at least backoff: it caps every wait"));
    }

    /// The kind's parameters, typed, and their checks beyond types.
    fn typed(&mut self, kind: Kind, own: &Map<String, Json>, node: &Node, stages: &[&str], nodes: u64) -> Params {
        match Params::of(kind, own) {
            Ok(t) => {
                let src = self.src.clone();
                t.check(&mut Check { src: &src, node, stages, nodes, errors: &mut self.errors });
                t
            }
            // A value of the wrong type was reported already; the typed checks need every value.
            Err(_) if !self.errors.is_empty() => Params::default(),
            Err(e) => {
                let help = "this is a defect of mflow: the kind's field table and its parameters disagree";
                self.errors.push(invalid(&self.src, node, "kind", e, help));
                Params::default()
            }
        }
    }

    fn no_cycle(&mut self, names: &[String], edges: &[Edge]) {
        let Some(cycle) = find_cycle(names, edges) else { return };
        let labels = cycle
            .windows(2)
            .filter_map(|w| {
                let (f, t, s) = edges.iter().find(|(f, t, _)| f == &w[0] && t == &w[1])?;
                s.clone().map(|s| LabeledSpan::new(Some(format!("`{f}` needs `{t}`")), s.start, s.end - s.start))
            })
            .collect();
        self.errors.push(SpecError::Cycle { src: self.src.clone(), cycle: cycle.join(" -> "), edges: labels });
    }
}

// Called once per `--set`; the error is the spec's own diagnostic type, large for its spans.
#[allow(clippy::result_large_err)]
fn apply_override(root: &mut Node, arg: &str) -> Result<(), SpecError> {
    let shown = super::secret::shown_override(arg);
    let bad = |reason: &str| SpecError::Override { arg: shown.clone(), reason: reason.to_string() };
    let (key, value) = arg.split_once('=').ok_or_else(|| bad("expected KEY=VALUE"))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    match path.as_slice() {
        ["vars", name] => {
            let vars = root.get("vars").and_then(Node::as_table);
            if !vars.is_some_and(|t| t.iter().any(|(k, _)| k.name == *name)) {
                let names: Vec<&str> = vars.into_iter().flatten().map(|(k, _)| k.name.as_str()).collect();
                let hint = super::error::did_you_mean(name, &names, "variables");
                return Err(bad(&format!("the spec has no variable `{name}` under [vars]; {hint}")));
            }
        }
        ["vars", _, _, ..] => return Err(bad("a variable is set whole: write `--set vars.NAME=VALUE`")),
        ["pipeline", ..] => {}
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
    let node = tree::parse_override(value.trim(), &shown).map_err(|e| bad(&e))?;
    root.set_path(&path, node).map_err(|e| bad(&e))
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
