//! Every environment variable mflow sets or reads, with what it means. docs/environment.md is
//! generated from [`ALL`], and code names a variable through its constant here, never as a
//! string of its own.

/// Who sets a variable, and who reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// mflow sets it for the processes of a stage (the stage's contract).
    Stage,
    /// The user sets it for mflow.
    Setting,
    /// The user sets it for the Python workloads (tuning and diagnosis).
    Workload,
    /// The user sets it for the `mflow` Python module (`pip install mflow`).
    Module,
    /// mflow sets it for itself in a process it starts (the driver of a run in a cluster, a
    /// stage's process tree).
    Internal,
}

pub struct Var {
    pub name: &'static str,
    pub scope: Scope,
    pub doc: &'static str,
}

macro_rules! vars {
    ($($konst:ident = $name:literal, $scope:ident, $doc:literal;)*) => {
        $(#[doc = $doc] pub const $konst: &str = $name;)*
        /// Every variable, in the order of the reference.
        pub const ALL: &[Var] = &[$(Var { name: $name, scope: Scope::$scope, doc: $doc }),*];
    };
}

vars! {
    OUTPUT = "MFLOW_OUTPUT", Stage, "The directory the stage writes its output into. mflow commits it to the cache when the stage succeeds; nothing outside it is kept.";
    INPUT_PREFIX = "MFLOW_INPUT_", Stage, "The committed output of an upstream stage, by its name in capitals with `-` as `_`.";
    SCRATCH = "MFLOW_SCRATCH", Stage, "A directory that survives a failed attempt of the same key (checkpoints, partial downloads); removed when the stage succeeds.";
    STATUS = "MFLOW_STATUS", Stage, "A file the stage may write one JSON object to: the class of its own failure (`class`, `message`) and its checkpoints (`checkpoint_iteration`, `resumed_from`).";
    PROGRESS = "MFLOW_PROGRESS", Stage, "A file the stage appends progress lines to (`{\"label\", \"done\", \"total\", \"unit\", \"message\"}`); mflow shows them live.";
    METRICS = "MFLOW_METRICS", Stage, "A file the stage appends metric lines to (one JSON object per line); kept in the run record across attempts.";
    ATTEMPT = "MFLOW_ATTEMPT", Stage, "The number of this attempt of the stage, from 1.";
    STAGE = "MFLOW_STAGE", Stage, "The stage's name.";
    RUN_DIR = "MFLOW_RUN_DIR", Stage, "The run's record directory (`WORKDIR/runs/<run-id>`).";
    OUTPUT_FORMAT = "MFLOW_OUTPUT_FORMAT", Setting, "`--output-format` of every command: `text` or `json`.";
    BACKEND = "MFLOW_BACKEND", Setting, "`--backend` of `run` and `plan`: `local` or `kubernetes`.";
    WORKDIR = "MFLOW_WORKDIR", Setting, "`--workdir` of the commands that read a workdir (`runs`, `status`, `logs`, `gc`, ...).";
    COLOR = "MFLOW_COLOR", Setting, "`--color`: `auto`, `always` or `never` (`NO_COLOR` turns `auto` off).";
    HOME = "MFLOW_HOME", Setting, "mflow's own directory: the Python environment it provisions and checked specs. Default `$XDG_CACHE_HOME/mflow`, else `~/.cache/mflow`.";
    PYTHON = "MFLOW_PYTHON", Setting, "The Python interpreter of the workloads; nothing is provisioned. Wins over `[env] python`.";
    BASE_PYTHON = "MFLOW_BASE_PYTHON", Setting, "The interpreter that creates the provisioned environment (default `python3`).";
    INSTALLER = "MFLOW_INSTALLER", Setting, "What provisions the Python environment: `uv` (on PATH, else installed once from PyPI into `MFLOW_HOME/tools`, hashes checked), `pip`, or `auto` (the default: uv where it can be had, pip otherwise).";
    KILL_GRACE = "MFLOW_KILL_GRACE", Setting, "Seconds between SIGTERM and SIGKILL when local stages are stopped (default 10; 0 to 3600).";
    PROJECT_ROOT = "MFLOW_PROJECT_ROOT", Setting, "The directory no input may leave (default: the git work tree holding the spec, else the spec's directory).";
    UPLOAD_MAX_BYTES = "MFLOW_UPLOAD_MAX_BYTES", Setting, "The most a run from outside a cluster uploads to its volume (default 2 GiB).";
    DOWNLOAD_MAX_BYTES = "MFLOW_DOWNLOAD_MAX_BYTES", Setting, "The largest output `mflow output --download` brings back from a cluster (default 64 GiB).";
    HUB_MAX_FILE_BYTES = "MFLOW_HUB_MAX_FILE_BYTES", Setting, "The largest single file downloaded from the Hugging Face Hub (default 100 GB).";
    MEMORY_BUDGET = "MFLOW_MEMORY_BUDGET", Setting, "What a model, shards directory, tokenizer or JSON file someone else wrote may make mflow and its stages hold, computed from the sizes the file declares before any of it is allocated: bytes, or a number with a unit (`512MiB`, `64GiB`, `2TB`). Default: half of the memory the process may use (the smaller of MemTotal and its cgroup's limit).";
    NVIDIA_GPUS_DIR = "MFLOW_NVIDIA_GPUS_DIR", Setting, "A directory with one entry per GPU, in place of the NVIDIA driver's list (for machines whose GPUs mflow cannot see).";
    KUBEFLOW_DIR = "MFLOW_KUBEFLOW_DIR", Setting, "The Kubeflow Trainer CRDs and runtimes the tests validate objects against (default `../shared/kubeflow` beside the repository).";
    RUN_ID = "MFLOW_RUN_ID", Internal, "The id of the run a driver in a cluster records (given by the `mflow run` that started it).";
    ATTEMPT_TAG = "MFLOW_ATTEMPT_TAG", Internal, "A tag every process of a local attempt inherits, by which mflow finds and stops the ones that left its process group.";
    TP_SHM = "MFLOW_TP_SHM", Workload, "`0`: the reference engine's two-rank tensor-parallel all-reduce goes through gloo instead of shared memory.";
    REFERENCE_DEVICE = "MFLOW_REFERENCE_DEVICE", Workload, "`cuda`: the reference engine runs on the GPU (default `cpu`).";
    MEGATRON_KNOBS = "MFLOW_MEGATRON_KNOBS", Workload, "Comma-separated speed knobs of the Megatron-Core engine (`none` for none); docs/benchmarks.md lists them.";
    BIN = "MFLOW_BIN", Module, "The mflow binary the `mflow` Python module runs (default: the one its wheel installed beside it, else `mflow` on PATH).";
}

/// The reference as docs/environment.md holds it.
pub fn markdown() -> String {
    let mut out = String::from(
        "# Environment variables\n\nGenerated from mflow's own list (`mflow_contract::vars`); a test keeps this file equal to it.\n",
    );
    for (scope, title) in [
        (Scope::Stage, "Set by mflow for a stage's processes"),
        (Scope::Setting, "Settings of mflow"),
        (Scope::Workload, "Settings of the Python workloads"),
        (Scope::Module, "Settings of the `mflow` Python module"),
        (Scope::Internal, "Set by mflow for itself"),
    ] {
        out.push_str(&format!("\n## {title}\n\n| variable | meaning |\n|---|---|\n"));
        for v in ALL.iter().filter(|v| v.scope == scope) {
            let name = if v.name.ends_with('_') { format!("{}<STAGE>", v.name) } else { v.name.to_string() };
            out.push_str(&format!("| `{name}` | {} |\n", v.doc));
        }
    }
    out
}
