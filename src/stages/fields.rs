//! The keys of every section and stage kind. docs/spec.md documents the same keys.

use crate::spec::schema::{def, opt, req, Field, Ty};

pub const RETRY: &[Field] = &[
    def("max", Ty::Int, "0", "attempts allowed after the first, per failure class"),
    def("backoff", Ty::Duration, "\"5s\"", "wait before the first retry; doubles each time, with jitter"),
    def("max_backoff", Ty::Duration, "\"5m\"", "cap on the wait between attempts"),
    def("on", Ty::StrList, "[\"infra\", \"timeout\"]", "failure classes that are retried: infra, user, oom, timeout"),
];

pub const RESOURCES: &[Field] = &[
    def("gpus", Ty::Int, "0", "GPUs per node; handed out as disjoint CUDA_VISIBLE_DEVICES sets"),
    def("cpus", Ty::Float, "1", "CPU cores the stage occupies in the local scheduler"),
    opt("memory", Ty::Str, "memory request on Kubernetes, e.g. \"16Gi\""),
];

/// The driver Job of a run started outside the cluster (`mflow run` where /mflow is not mounted).
pub const DRIVER: &[Field] = &[
    def("service_account", Ty::Str, "\"mflow\"", "service account the driver runs as; it needs mflow's RBAC (`mflow kube rbac`)"),
    def("restarts", Ty::Int, "3", "how often the driver starts again after an eviction or a node loss; it reattaches to running TrainJobs"),
    def("host_network", Ty::Bool, "false", "run the driver (and the pod that uploads) in its node's network namespace"),
    opt("env", Ty::StrMap, "extra environment of the driver, e.g. KUBERNETES_SERVICE_HOST where the API server is reached another way"),
];

pub const KUBERNETES: &[Field] = &[
    opt("namespace", Ty::Str, "namespace for TrainJobs (default: the kubeconfig's)"),
    opt("context", Ty::Str, "kubeconfig context"),
    def("pvc", Ty::Str, "\"mflow-artifacts\"", "RWX PersistentVolumeClaim holding artifacts, mounted at /mflow"),
    def("image", Ty::Str, concat!("\"", crate::image_repo!(), "-cpu:", env!("CARGO_PKG_VERSION"), "\""), "image with mflow for CPU stages (mflow's own, of this version)"),
    def("train_image", Ty::Str, concat!("\"", crate::image_repo!(), ":", env!("CARGO_PKG_VERSION"), "\""), "image for GPU stages: torch and megatron-core (mflow's own, of this version)"),
    def("runtime", Ty::Str, "\"mflow-torch\"", "ClusterTrainingRuntime for GPU stages"),
    def("cpu_runtime", Ty::Str, "\"mflow-cpu\"", "ClusterTrainingRuntime for CPU stages"),
    def("start_timeout", Ty::Duration, "\"15m\"", "how long a TrainJob may wait for its pods to start (Kueue queueing aside) before the attempt fails as infra"),
    opt("driver", Ty::Table(DRIVER), "the driver Job of a run started outside the cluster"),
];

pub const PIPELINE: &[Field] = &[
    req("name", Ty::Str, "pipeline name; used in run records and Kubernetes object names"),
    opt("description", Ty::Str, "free text"),
    def("workdir", Ty::Str, "\".mflow\"", "run records and cache, relative to the spec's directory"),
    def("backend", Ty::Enum(&["local", "kubernetes"]), "\"local\"", "where stages run"),
    opt("retries", Ty::Table(RETRY), "default retry policy for every stage"),
    opt("timeout", Ty::Duration, "default timeout for every stage"),
    opt("jobs", Ty::Int, "stages run at the same time (default: number of CPUs)"),
    opt("kubernetes", Ty::Table(KUBERNETES), "settings of the kubernetes backend"),
];

pub const ENV: &[Field] = &[
    opt("python", Ty::Str, "Python interpreter for workloads; skips provisioning (also MFLOW_PYTHON)"),
];

pub const SCHEDULE: &[Field] = &[
    req("cron", Ty::Str, "cron expression, e.g. \"0 3 * * *\""),
    opt("timezone", Ty::Str, "IANA time zone of the schedule"),
    def("service_account", Ty::Str, "\"mflow\"", "service account the CronJob runs as"),
    def("starting_deadline", Ty::Duration, "\"1h\"", "how late a missed run may still start"),
    def("suspend", Ty::Bool, "false", "render the CronJob suspended"),
];

pub const NOTIFY: &[Field] = &[
    req("webhook", Ty::Str, "URL that receives a JSON summary (POST)"),
    def("on", Ty::StrList, "[\"success\", \"failure\"]", "when to notify"),
    def("timeout", Ty::Duration, "\"10s\"", "per request"),
    def("retries", Ty::Int, "3", "retries with exponential backoff"),
];

/// Keys every stage accepts, whatever its kind.
pub const COMMON: &[Field] = &[
    req("kind", Ty::Str, "command, model, convert, dataset, train, evaluate or export"),
    opt("description", Ty::Str, "free text"),
    def("needs", Ty::StrList, "[]", "stages that must finish first (references in values add edges too)"),
    def("inputs", Ty::StrList, "[]", "files or globs the stage reads, relative to the spec; their content enters the cache key (for `dataset`: the corpus, text or JSONL, gz and zst too)"),
    opt("retries", Ty::Table(RETRY), "retry policy"),
    opt("timeout", Ty::Duration, "kill the attempt after this long"),
    opt("resources", Ty::Table(RESOURCES), "resources the stage needs"),
    def("env", Ty::StrMap, "{}", "extra environment variables"),
    def("cache", Ty::Bool, "true", "false: always rerun"),
    def("salt", Ty::Str, "\"\"", "any text; changing it invalidates the cache entry"),
    def("gates", Ty::StrMap, "{}", "conditions on metrics.json, e.g. val_ppl = \"< 40\""),
    def("nodes", Ty::Int, "1", "nodes (Kubernetes); train and evaluate split their ranks evenly over them"),
    opt("image", Ty::Str, "container image (Kubernetes)"),
];

pub const COMMAND: &[Field] = &[req("run", Ty::StrList, "argv; writes under $MFLOW_OUTPUT, reads $MFLOW_INPUT_<STAGE>")];

pub const MODEL: &[Field] = &[
    req("source", Ty::Str, "hf://ORG/NAME[@REV], path:DIR or init:PRESET"),
    def("seed", Ty::Int, "0", "seed of init: presets"),
];

pub const CONVERT: &[Field] = &[
    req("model", Ty::Str, "HF model or shards, usually \"${stages.NAME.output}\""),
    def("tp", Ty::Int, "1", "tensor-parallel size"),
    def("pp", Ty::Int, "1", "pipeline-parallel size"),
    def("dtype", Ty::Enum(&["keep", "float32", "bfloat16", "float16"]), "\"keep\"", "dtype of the shards"),
];

pub const DATASET: &[Field] = &[
    req("tokenizer", Ty::Str, "\"${stages.MODEL.output}\", a tokenizer.json path, or \"byte-level\""),
    def("format", Ty::Enum(&["auto", "text", "jsonl"]), "\"auto\"", "input format"),
    def("split_by", Ty::Enum(&["file", "line", "blank-line"]), "\"file\"", "how plain text splits into documents"),
    def("text_key", Ty::Str, "\"text\"", "JSONL key holding the text"),
    def("splits", Ty::Str, "\"98,1,1\"", "train,valid,test ratios by document"),
    def("seed", Ty::Int, "1234", "seed of the split"),
    opt("max_doc_tokens", Ty::Int, "truncate longer documents"),
    def("dtype", Ty::Enum(&["auto", "uint16", "int32"]), "\"auto\"", "token dtype"),
    def("on_invalid_utf8", Ty::Enum(&["skip", "fail"]), "\"skip\"", "skip and count, or fail"),
    opt("eod", Ty::Str, "end-of-document token (default: the tokenizer's)"),
];

const ENGINE: Ty = Ty::Enum(&["auto", "reference", "megatron"]);

pub const TRAIN: &[Field] = &[
    req("model", Ty::Str, "shards from a convert stage"),
    req("data", Ty::Str, "a dataset stage's output"),
    def("engine", ENGINE, "\"auto\"", "auto: megatron when the visible GPUs cover the ranks (one each), else reference (CPU)"),
    def("tp", Ty::Int, "1", "tensor-parallel size; a reshard is inserted when the shards differ"),
    def("pp", Ty::Int, "1", "pipeline-parallel size; a reshard is inserted when the shards differ"),
    def("dp", Ty::Int, "1", "data-parallel size"),
    def("iterations", Ty::Int, "100", "optimizer steps"),
    def("seq_length", Ty::Int, "128", "tokens per sample"),
    def("micro_batch_size", Ty::Int, "4", "samples per micro-batch per rank"),
    def("global_batch_size", Ty::Int, "8", "samples per optimizer step"),
    def("lr", Ty::Float, "0.003", "peak learning rate"),
    def("min_lr", Ty::Float, "0.0003", "final learning rate"),
    def("warmup_iterations", Ty::Int, "10", "linear warmup"),
    def("lr_decay", Ty::Enum(&["cosine", "linear", "constant"]), "\"cosine\"", "decay after warmup"),
    def("weight_decay", Ty::Float, "0.1", "AdamW weight decay"),
    def("adam_beta1", Ty::Float, "0.9", "AdamW beta1"),
    def("adam_beta2", Ty::Float, "0.95", "AdamW beta2"),
    def("clip_grad", Ty::Float, "1.0", "gradient-norm clipping"),
    def("seed", Ty::Int, "1234", "seed of data order and dropout"),
    def("precision", Ty::Enum(&["auto", "bf16", "fp32"]), "\"auto\"", "bf16 with megatron, fp32 with reference"),
    def("save_interval", Ty::Int, "25", "checkpoint every N iterations"),
    def("log_interval", Ty::Int, "1", "metrics every N iterations"),
    def("eval_interval", Ty::Int, "25", "validation loss every N iterations"),
    def("eval_iters", Ty::Int, "4", "validation batches per evaluation"),
    def("attention", Ty::Enum(&["sdpa", "local"]), "\"sdpa\"", "core attention implementation"),
];

pub const EVALUATE: &[Field] = &[
    req("model", Ty::Str, "shards to evaluate"),
    req("data", Ty::Str, "a dataset stage's output"),
    def("engine", ENGINE, "\"auto\"", "auto: megatron when the visible GPUs cover the ranks (one each), else reference (CPU)"),
    def("tp", Ty::Int, "1", "tensor-parallel size; a reshard is inserted when the shards differ"),
    def("seq_length", Ty::Int, "128", "tokens per sample"),
    def("micro_batch_size", Ty::Int, "4", "samples per batch"),
    def("eval_iters", Ty::Int, "8", "batches per split"),
    def("splits", Ty::StrList, "[\"valid\", \"test\"]", "dataset splits to evaluate"),
    opt("baseline", Ty::Str, "a stage whose output is an HF model to evaluate on the same data"),
    def("prompts", Ty::StrList, "[]", "prompts for greedy generation"),
    def("max_new_tokens", Ty::Int, "32", "tokens generated per prompt"),
    def("precision", Ty::Enum(&["fp32", "bf16"]), "\"fp32\"", "evaluation precision"),
];

pub const EXPORT: &[Field] = &[
    req("model", Ty::Str, "shards to export"),
    def("verify", Ty::Bool, "true", "load the result with transformers and compare with the shards"),
    def("prompts", Ty::StrList, "[\"The\"]", "prompts whose greedy generations must match"),
    def("max_new_tokens", Ty::Int, "16", "tokens generated per prompt"),
];
