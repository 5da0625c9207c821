//! The plan: the spec's stages as a DAG in dependency order, each with the static parts of its
//! cache key. Keys that depend on upstream outputs are completed as those outputs become known.

mod checks;
pub mod inputs;
mod layout;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::path::PathBuf;

use miette::Diagnostic;
use serde::Serialize;
use serde_json::{json, Value as Json};
use thiserror::Error;

use crate::cache::key::KeyParts;
use crate::cache::{Lookup, Store};
use crate::env::Environment;
use crate::spec::{Spec, StageSpec};
use crate::stages::Kind;
use inputs::InputHasher;

#[derive(Debug, Error, Diagnostic)]
pub enum PlanError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Input(#[from] inputs::Placed),
    /// A layout that cannot split its model, at its place in the spec.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Layout(#[from] crate::spec::SpecErrors),
    #[error("stage `{stage}`: {message}")]
    #[diagnostic(code(mflow::plan::invalid), help("{help}"))]
    Invalid { stage: String, message: String, help: String },
    #[error("unknown stage `{0}`")]
    #[diagnostic(code(mflow::plan::unknown_stage), help("`mflow plan SPEC` lists the stages"))]
    UnknownStage(String),
    #[error("--force {0}: stage `{0}` is not one this run runs")]
    #[diagnostic(
        code(mflow::plan::force_unselected),
        help("name it among the stages to run as well, or run without naming stages")
    )]
    NotSelected(String),
    /// The spec is fine; something it names could not be reached (exit code 3, not 2).
    #[error("stage `{stage}`: {message}")]
    #[diagnostic(code(mflow::plan::unavailable), help("{help}"))]
    Unavailable { stage: String, message: String, help: String },
}

#[derive(Debug, Clone)]
pub struct PlannedStage {
    pub spec: StageSpec,
    /// Indices of upstream stages in `Plan::stages`.
    pub deps: Vec<usize>,
    /// Key parts without upstream digests.
    pub parts: KeyParts,
    /// `parts.params` in canonical form, encoded once for every key of the stage.
    pub canonical_params: String,
    /// Added by the planner (an automatic reshard), not written in the spec.
    pub inserted: bool,
    /// The engine of a train or evaluate stage (an export's verification) and why; its name is
    /// in `parts.params`, the reason in no key.
    pub engine: Option<crate::stages::EngineChoice>,
    /// The input files as they were when hashed into `parts.inputs`: a run checks after the
    /// stage that they still are (`exec::given`).
    pub input_stats: Vec<(std::path::PathBuf, crate::cache::FileStat)>,
}

#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: Spec,
    /// Dependency order.
    pub stages: Vec<PlannedStage>,
    pub root: PathBuf,
}

impl Plan {
    pub fn index(&self, name: &str) -> Option<usize> {
        self.stages.iter().position(|s| s.spec.name == name)
    }

    /// The key of stage `i` with `parts` (its own, with upstream digests: `parts_with`).
    pub fn key(&self, i: usize, parts: &KeyParts) -> String {
        parts.key_given(&self.stages[i].canonical_params)
    }

    /// The full key parts of stage `i`, given the digests of its upstream outputs.
    pub fn parts_with(&self, i: usize, digest_of: &dyn Fn(usize) -> Option<String>) -> Option<KeyParts> {
        let s = &self.stages[i];
        let mut parts = s.parts.clone();
        for &d in &s.deps {
            parts.upstream.insert(self.stages[d].spec.name.clone(), digest_of(d)?);
        }
        Some(parts)
    }
}

/// The plan of commands that only look (`plan`, `render`, `why`, `output`): it writes nothing,
/// not even the input stat cache, so that looking at a spec never creates its workdir.
pub fn build(spec: Spec, env: &Environment) -> Result<Plan, PlanError> {
    build_inner(spec, env, None, false)
}

/// The plan of a run, with the workdir's input stat cache when it was read ahead; the inputs'
/// stats are saved for the next run.
pub fn build_with(spec: Spec, env: &Environment, known: Option<inputs::KnownInputs>) -> Result<Plan, PlanError> {
    build_inner(spec, env, known, true)
}

fn build_inner(
    mut spec: Spec,
    env: &Environment,
    known: Option<inputs::KnownInputs>,
    save: bool,
) -> Result<Plan, PlanError> {
    let root = crate::project::root(&spec.dir);
    // The planned stages own the stage specs from here on (a large spec is not copied).
    let mut stage_specs = std::mem::take(&mut spec.stages);
    layout::check(&spec, &stage_specs)?;
    insert_reshards(&mut stage_specs);
    checks::check(&stage_specs)?;
    let order = topo_order(&stage_specs);
    let position: BTreeMap<String, usize> =
        order.iter().enumerate().map(|(pos, &i)| (stage_specs[i].name.clone(), pos)).collect();
    // Parameters resolve on one thread while input files are stat-ed (and hashed when new) on
    // two: the inputs of a large DAG are most of the planning.
    let hasher = InputHasher::open(&spec.workdir(), &spec.dir, known).volume_elsewhere(
        spec.pipeline.backend == crate::spec::BackendKind::Kubernetes
            && crate::backend::kubernetes::outside_cluster(&spec),
    );
    let digest = |&i: &usize| {
        let st = &stage_specs[i];
        let mut patterns = st.inputs.clone();
        patterns.extend(st.typed.external_inputs(&spec.dir));
        hasher.digest(&st.name, &root, &patterns)
    };
    let (params, inputs) = std::thread::scope(|s| {
        let params = s.spawn(|| {
            order
                .iter()
                .map(|&i| {
                    stage_params(&spec, &stage_specs[i], env).map(|(p, engine)| {
                        let canonical = crate::cache::key::canonical(&p);
                        (p, canonical, engine)
                    })
                })
                .collect::<Vec<_>>()
        });
        let (early, late) = order.split_at(order.len() / 2);
        let late = s.spawn(|| late.iter().map(&digest).collect::<Vec<_>>());
        let mut inputs: Vec<_> = early.iter().map(&digest).collect();
        inputs.extend(late.join().expect("input hashing does not panic"));
        if save {
            hasher.save();
        }
        (params.join().expect("parameters resolve without a panic"), inputs)
    });
    // Sized once: grown by doubling, the stages of a large plan were copied into fresh pages
    // again and again (a planned stage is most of a kilobyte).
    let mut stages = Vec::with_capacity(order.len());
    let mut stage_specs: Vec<Option<StageSpec>> = stage_specs.into_iter().map(Some).collect();
    for ((&i, params), inputs) in order.iter().zip(params).zip(inputs) {
        let owned = stage_specs[i].take().expect("each stage once in the order");
        let st = &owned;
        let (params, canonical_params, engine) = params?;
        let (inputs, input_stats) = inputs.map_err(|e| inputs::Placed::in_spec(e, &spec, &st.name))?;
        let parts = KeyParts {
            kind: st.kind.name().to_string(),
            kind_version: st.kind.version(),
            params: std::sync::Arc::new(params),
            upstream: BTreeMap::new(),
            inputs: std::sync::Arc::new(inputs),
            workload: crate::stages::workload_digest(st.kind),
            environment: if st.kind.uses_python() { env.python_digest() } else { String::new() },
            salt: st.salt.clone(),
        };
        // Locally, a stage that asks for more GPUs than the machine has could never start.
        if spec.pipeline.backend != crate::spec::BackendKind::Kubernetes && st.resources.gpus as usize > env.gpus.len()
        {
            return Err(PlanError::Invalid {
                stage: st.name.clone(),
                message: format!(
                    "asks for {} GPUs (resources.gpus), this machine has {}",
                    st.resources.gpus,
                    env.gpus.len()
                ),
                help:
                    "lower resources.gpus, or run on a machine (or with --backend kubernetes, a cluster) that has them"
                        .into(),
            });
        }
        let deps = st.needs.iter().map(|n| position[n]).collect();
        let inserted = st.description.as_deref() == Some(RESHARD_NOTE);
        let mut spec_of_stage = owned;
        // A Megatron stage holds its GPUs in the pool, so that two such stages never share one.
        if engine.as_ref().is_some_and(|e| e.name == "megatron")
            && spec_of_stage.kind.is_distributed()
            && spec_of_stage.resources.gpus == 0
            && spec.pipeline.backend != crate::spec::BackendKind::Kubernetes
        {
            spec_of_stage.resources.gpus = spec_of_stage.typed.world_size() as u32;
        }
        stages.push(PlannedStage { spec: spec_of_stage, deps, parts, canonical_params, inserted, engine, input_stats });
    }
    Ok(Plan { spec, stages, root })
}

/// The plan-time layout checks alone: every tp and pp that cannot split the model it reads.
pub fn check_layouts(spec: &Spec) -> Result<(), crate::spec::SpecErrors> {
    layout::check(spec, &spec.stages)
}

/// What a plan refuses, checked without the network, without hashing and without writing
/// (`mflow validate`): every tp and pp that cannot split the model it reads, the stages'
/// cross-checks, and inputs that are missing or lead out of the project.
pub fn check(spec: &Spec) -> Result<(), PlanError> {
    check_layouts(spec)?;
    let mut stages = spec.stages.clone();
    insert_reshards(&mut stages);
    checks::check(&stages)?;
    let root = crate::project::root(&spec.dir);
    let hasher = InputHasher::open(&spec.workdir(), &spec.dir, None)
        .volume_elsewhere(
            spec.pipeline.backend == crate::spec::BackendKind::Kubernetes
                && crate::backend::kubernetes::outside_cluster(spec),
        )
        .without_hashing();
    for st in &stages {
        let mut patterns = st.inputs.clone();
        patterns.extend(st.typed.external_inputs(&spec.dir));
        hasher.digest(&st.name, &root, &patterns).map_err(|e| inputs::Placed::in_spec(e, spec, &st.name))?;
    }
    Ok(())
}

/// A stage's parameters as they enter its key, and its engine.
fn stage_params(
    spec: &Spec,
    st: &StageSpec,
    env: &Environment,
) -> Result<(Json, Option<crate::stages::EngineChoice>), PlanError> {
    let invalid = |message: String, help: String| PlanError::Invalid { stage: st.name.clone(), message, help };
    let gpus = crate::backend::stage_gpus(spec, st, env);
    let (mut params, mut engine) =
        crate::stages::key_params(st, gpus).map_err(|(message, help)| invalid(message, help))?;
    if spec.pipeline.backend == crate::spec::BackendKind::Kubernetes && matches!(st.kind, Kind::Train | Kind::Evaluate)
    {
        // On a cluster `stage_gpus` counts what the stage requests, not this machine's GPUs.
        if let Some(e) = engine.as_mut() {
            e.reason = format!("kubernetes: resources.gpus x nodes = {gpus}");
        }
    }
    if let Some(src) = params.get("source").and_then(Json::as_str).filter(|s| s.starts_with("hf://")) {
        // The Hub's commit, not the name, identifies the weights.
        let sha = mflow_ckpt::resolve_hf_revision(src).map_err(|e| {
            let (message, help) = (format!("cannot resolve {src}: {e}"), "check the network, HF_ENDPOINT and HF_TOKEN; or pin the revision to a commit sha (hf://ORG/NAME@<40 hex digits>), which needs no network to plan".to_string());
            if mflow_ckpt::hub_unavailable(&e) {
                PlanError::Unavailable { stage: st.name.clone(), message, help }
            } else {
                invalid(message, help)
            }
        })?;
        params["revision_sha"] = json!(sha);
    }
    Ok((params, engine))
}

const RESHARD_NOTE: &str = "inserted by mflow: reshard to the layout the next stage reads";

/// A stage that reads shards (train, evaluate) in a layout other than the one its `model`
/// stage writes (convert, train) gets a reshard stage in between, so users never convert by
/// hand. Each kind says which layouts it reads and writes; nothing here is per kind.
fn insert_reshards(stages: &mut Vec<StageSpec>) {
    let mut added = Vec::new();
    for st in stages.iter() {
        let Some(want) = st.typed.reads_shards() else { continue };
        let Some(up) = layout::upstream(st, stages) else { continue };
        match up.typed.writes_shards() {
            Some(have) if have != want => added.push((st.name.clone(), up.name.clone(), want, up.retries.clone())),
            _ => {}
        }
    }
    for (consumer, src, (tp, pp), retries) in added {
        // `<stage>-reshard`, unless a stage of the spec has that name or one that is the same
        // MFLOW_INPUT_<NAME> variable (`evaluate_reshard`): the two outputs would share it.
        let mut name = format!("{consumer}-reshard");
        let mut n = 2;
        let taken = |name: &str, stages: &[StageSpec]| {
            let var = crate::spec::input_var(name);
            stages.iter().any(|s| crate::spec::input_var(&s.name) == var)
        };
        while taken(&name, stages) {
            name = format!("{consumer}-reshard-{n}");
            n += 1;
        }
        let params = crate::stages::convert::Params::reshard(format!("${{stages.{src}.output}}"), tp, pp);
        let table = serde_json::to_value(&params).ok().and_then(|v| v.as_object().cloned()).expect("a table");
        let mut reshard = StageSpec::test_stage(&name, Kind::Convert, table);
        reshard.needs = vec![src.clone()];
        reshard.retries = retries;
        reshard.description = Some(RESHARD_NOTE.into());
        let st = stages.iter_mut().find(|s| s.name == consumer).expect("exists");
        st.set_model(format!("${{stages.{name}.output}}"));
        st.needs.push(name.clone());
        st.needs.sort();
        st.needs.dedup();
        stages.push(reshard);
    }
}

/// Kahn's algorithm, ties broken by file order, so plans read like the spec.
fn topo_order(stages: &[StageSpec]) -> Vec<usize> {
    // Kahn's algorithm taking the lowest ready index first, so the order follows the spec.
    let index: HashMap<&str, usize> = stages.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
    let mut dependents = vec![Vec::new(); stages.len()];
    let mut indeg = vec![0usize; stages.len()];
    for (j, s) in stages.iter().enumerate() {
        for n in &s.needs {
            if let Some(&i) = index.get(n.as_str()) {
                dependents[i].push(j);
                indeg[j] += 1;
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..stages.len()).filter(|&i| indeg[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(stages.len());
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &j in &dependents[i] {
            indeg[j] -= 1;
            if indeg[j] == 0 {
                ready.push(Reverse(j));
            }
        }
    }
    order
}

/// What `mflow run` would do with a stage, and why.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Decision {
    Cached { key: String },
    Run { key: Option<String>, reason: String },
    Resume { key: String, iteration: u64 },
}

#[derive(Debug, Clone, Serialize)]
pub struct StageDecision {
    pub stage: String,
    pub kind: String,
    pub needs: Vec<String>,
    #[serde(flatten)]
    pub decision: Decision,
    /// The engine chosen for the stage and why (`PlannedStage::engine`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::stages::EngineChoice>,
    /// The key and its parts when known, so that running does not compute them again.
    #[serde(skip)]
    pub keyed: Option<(String, KeyParts)>,
}

/// Decides every stage without running anything.
///
/// The first pass keys every stage as if each entry found in the manifest log checks out,
/// while those entries are checked on a second thread. The second pass decides in dependency
/// order and keeps a first-pass key wherever the upstream digests it assumed were found.
pub fn decide(
    plan: &Plan,
    store: &Store,
    last: &crate::record::LastKeys,
    force: &[String],
    verify: bool,
) -> Vec<StageDecision> {
    let n = plan.stages.len();
    let mut first = key_ahead(plan, store, force, verify);
    let mut digests: Vec<Option<String>> = vec![None; n];
    let mut out = Vec::with_capacity(n);
    for (i, s) in plan.stages.iter().enumerate() {
        let name = &s.spec.name;
        let mut keyed = None;
        let upstream_known = s.deps.iter().all(|&d| digests[d].is_some());
        let decision = if !upstream_known {
            let up = s
                .deps
                .iter()
                .find(|&&d| digests[d].is_none())
                .map(|&d| plan.stages[d].spec.name.clone())
                .unwrap_or_default();
            Decision::Run { key: None, reason: format!("upstream `{up}` runs first") }
        } else {
            // The first pass's key holds when it assumed the digests that were found.
            let (key, parts) = match first[i].take() {
                Some((key, parts))
                    if s.deps.iter().all(|&d| parts.upstream.get(&plan.stages[d].spec.name) == digests[d].as_ref()) =>
                {
                    (key, parts)
                }
                _ => {
                    let parts = plan.parts_with(i, &|d| digests[d].clone()).expect("upstream digests known");
                    (plan.key(i, &parts), parts)
                }
            };
            let run = |reason: String| Decision::Run { key: Some(key.clone()), reason };
            let decision = if force.iter().any(|f| f == name) {
                run("forced".into())
            } else if !s.spec.cache {
                run("cache = false".into())
            } else {
                // Entries the first pass checked are found at once.
                match store.lookup(&key, verify) {
                    Lookup::Hit(m) => {
                        digests[i] = Some(m.digest.clone());
                        Decision::Cached { key: key.clone() }
                    }
                    Lookup::Corrupt(why) => run(format!("cache entry was corrupt ({why})")),
                    Lookup::Miss => match plan.spec.workdir().resume_point(&key) {
                        Some(iteration) => Decision::Resume { key: key.clone(), iteration },
                        None => run(reason(last.get(name), &parts)),
                    },
                }
            };
            keyed = Some((key, parts));
            decision
        };
        out.push(StageDecision {
            stage: name.clone(),
            kind: s.spec.kind.name().into(),
            needs: s.spec.needs.clone(),
            decision,
            engine: s.engine.clone(),
            keyed,
        });
    }
    out
}

/// Every stage's key and parts, assuming that each entry in the manifest log checks out: the
/// entries are checked (sizes only, not with `verify`) meanwhile, and what checks out is
/// remembered by the store. A stage whose upstream has no entry gets no key here.
fn key_ahead(plan: &Plan, store: &Store, force: &[String], verify: bool) -> Vec<Option<(String, KeyParts)>> {
    // Entries go to the checker in batches: waking it for each one would cost more than a
    // check. Once every stage is keyed, this thread takes batches from the same queue.
    const BATCH: usize = 32;
    let (tx, rx) = std::sync::mpsc::channel::<Vec<(String, std::sync::Arc<crate::cache::Manifest>)>>();
    let queue = std::sync::Mutex::new(rx);
    let check_all = || loop {
        let Ok(batch) = queue.lock().unwrap().recv() else { break };
        for (key, m) in batch {
            store.accept(&key, m);
        }
    };
    let cacheable = |i: usize| plan.stages[i].spec.cache && !force.iter().any(|f| *f == plan.stages[i].spec.name);
    std::thread::scope(|s| {
        s.spawn(check_all);
        let mut assumed: Vec<Option<String>> = vec![None; plan.stages.len()];
        let mut keyed = Vec::with_capacity(plan.stages.len());
        let mut batch = Vec::with_capacity(BATCH);
        for i in 0..plan.stages.len() {
            let k = plan.parts_with(i, &|d| assumed[d].clone()).map(|parts| (plan.key(i, &parts), parts));
            if let Some((key, m)) =
                k.as_ref().filter(|_| cacheable(i)).and_then(|(key, _)| Some((key, store.manifest(key)?)))
            {
                assumed[i] = Some(m.digest.clone());
                // `--verify` rehashes every entry when deciding instead.
                if !verify {
                    batch.push((key.clone(), m));
                }
                if batch.len() == BATCH {
                    let _ = tx.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)));
                }
            }
            keyed.push(k);
        }
        let _ = tx.send(batch);
        drop(tx);
        check_all();
        keyed
    })
}

fn reason(last: Option<&KeyParts>, now: &KeyParts) -> String {
    match last {
        None => "never ran".into(),
        Some(old) => {
            let d = crate::cache::key::diff(now, old);
            if d.is_empty() {
                "no cache entry (removed or never committed)".into()
            } else {
                d.join("; ")
            }
        }
    }
}
