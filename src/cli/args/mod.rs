//! Every argument of the `mflow` command, as clap types. Nothing outside `cli` sees them:
//! handlers turn them into the library's own option types.

use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

mod cluster;
pub use cluster::{ClusterArgs, KubeCommand, RemoteArgs, ScheduleCommand};

/// The commands under the headings of `mflow --help`.
pub const GROUPS: &[(&str, &[&str])] = &[
    ("Run", &["run", "plan", "why", "validate", "output"]),
    ("Inspect", &["runs", "status", "logs", "report"]),
    ("Cache", &["gc", "cache"]),
    ("Kubernetes", &["render", "attach", "cancel", "kube"]),
    ("CI", &["metrics", "reproduce", "schedule"]),
    (
        "Tools",
        &[
            "doctor",
            "env",
            "exit-codes",
            "explain",
            "schema",
            "completions",
            "man",
            "model",
            "convert",
            "export",
            "dataset",
        ],
    ),
];

/// The command as it parses and explains itself: its commands listed under [`GROUPS`].
pub fn command() -> clap::Command {
    let cmd = Cli::command();
    let width = cmd.get_subcommands().map(|c| c.get_name().len()).max().unwrap_or(8) + 2;
    let mut listed = String::new();
    for (heading, names) in GROUPS {
        listed.push_str(&format!("{heading} commands:\n"));
        for name in *names {
            let about =
                cmd.find_subcommand(name).and_then(|c| c.get_about()).map(|a| a.to_string()).unwrap_or_default();
            let first = about.lines().next().unwrap_or_default().split(". ").next().unwrap_or_default();
            listed.push_str(&format!("  {name:<width$}{first}\n"));
        }
        listed.push('\n');
    }
    cmd.help_template(format!(
        "{{about-with-newline}}\n{{usage-heading}} {{usage}}\n\n{listed}Options:\n{{options}}{{after-help}}"
    ))
}

#[derive(Parser, Debug)]
#[command(
    name = "mflow",
    version,
    about = "Declarative pipelines for Hugging Face models through Megatron and back",
    after_help = "Examples:\n  mflow run specs/gpt-tp2.toml            run the main job\n  mflow plan specs/gpt-tp2.toml           what a run would do, and why\n  mflow runs                              the runs recorded here\n  mflow logs train                        the newest run's log of stage `train`"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every command takes.
#[derive(Args, Debug, Clone)]
pub struct Global {
    /// Output for programs: text (live on a terminal, plain otherwise) or JSON (JSON lines of
    /// events for `run`, one JSON document for the commands that answer a question).
    #[arg(long, global = true, value_enum, default_value_t = OutputFormat::Text, env = "MFLOW_OUTPUT_FORMAT", alias = "log-format")]
    pub output_format: OutputFormat,
    /// Say less: only failures, warnings and the end of a run.
    #[arg(long, short, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Say more: mflow's own log at debug level (-vv: trace); RUST_LOG, when set, wins.
    #[arg(long, short, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Colour in diagnostics and the live display: auto (a terminal, unless NO_COLOR is set),
    /// always or never.
    #[arg(long, global = true, value_enum, default_value_t = ColorChoice::Auto, env = "MFLOW_COLOR")]
    pub color: ColorChoice,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ColorChoice {
    Auto,
    Always,
    Never,
}

impl ColorChoice {
    /// Whether standard error gets colour.
    pub fn enabled(self) -> bool {
        match self {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => {
                std::io::IsTerminal::is_terminal(&std::io::stderr())
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
            }
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Plan, skip cached stages, run the rest.
    Run(RunArgs),
    /// Show what `run` would do with every stage, and why. Runs nothing.
    Plan(PlanArgs),
    /// Print every Kubernetes object a run would submit, as YAML, without a cluster.
    Render(RenderArgs),
    /// What changed in a stage's cache key since it last ran.
    Why(WhyArgs),
    /// Check a spec without running anything.
    Validate(SpecArgs),
    /// Print the JSON Schema of specs (for editor completion), or the key reference.
    Schema {
        /// json: the JSON Schema; markdown: the key reference of docs/spec.md.
        #[arg(long, value_enum, default_value_t = SchemaFormat::Json)]
        format: SchemaFormat,
    },
    /// Follow a run started outside the cluster again (its driver in the cluster).
    Attach {
        /// The run's id.
        run: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Cancel a run started outside the cluster: its stages stop and their TrainJobs are deleted.
    Cancel {
        /// The run's id.
        run: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// List recorded runs.
    Runs(RunsArgs),
    /// Show one run's stages.
    Status(StatusArgs),
    /// Print a stage's log from a run (default: the latest).
    Logs(LogsArgs),
    /// Print the path of a stage's committed output, or copy the output to a new directory.
    /// A workdir on a cluster's volume that is not mounted here is read through the cluster.
    Output(OutputArgs),
    /// Delete the cache entries (known to the manifest log) that no kept run references.
    /// Refused while a run uses the workdir (exit 3), unless --wait.
    Gc(GcArgs),
    /// Inspect and mend the cache of a workdir.
    #[command(subcommand)]
    Cache(CacheCommand),
    /// Report Python, torch, the GPUs, NCCL and megatron-core, as the Python stages see them.
    Doctor,
    /// Provision the Python environment of the workloads and print its interpreter.
    Env,
    /// Print the table of exit codes.
    ExitCodes,
    /// Explain a diagnostic code (`mflow::plan::input_escapes`, or just `plan::input_escapes`):
    /// what it says and what to do.
    Explain {
        /// The code, as a diagnostic shows it.
        code: String,
    },
    /// Print the script that registers mflow's shell completions (stage names come from the spec).
    #[command(
        after_help = "Examples:\n  mflow completions bash > ~/.local/share/bash-completion/completions/mflow\n  mflow completions zsh > ~/.zfunc/_mflow\n  mflow completions fish > ~/.config/fish/completions/mflow.fish"
    )]
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: Shell,
    },
    /// Print mflow's man page (roff): `mflow man | man -l -`.
    Man,
    /// Get an HF model: hf://ORG/NAME[@REV], path:DIR, or init:PRESET (random weights).
    Model(mflow_ckpt::cli::ModelArgs),
    /// Convert an HF model to Megatron shards for TP x PP, or reshard shards.
    Convert(mflow_ckpt::cli::ConvertArgs),
    /// Export Megatron shards to an HF model directory.
    Export(mflow_ckpt::cli::ExportArgs),
    /// Tokenize text or JSONL into Megatron indexed datasets.
    Dataset(mflow_data::cli::DatasetArgs),
    /// Write a self-contained HTML report of a run: curves, timeline, metrics, lockfile.
    Report(ReportArgs),
    /// Compare the metrics of runs.
    #[command(subcommand)]
    Metrics(MetricsCommand),
    /// Rerun a recorded run from its lockfile, refusing if a pinned digest changed.
    Reproduce(ReproduceArgs),
    /// Kubernetes CronJob (and RBAC) for the spec's [schedule].
    #[command(subcommand)]
    Schedule(ScheduleCommand),
    /// Kubernetes objects mflow needs, rendered for your cluster.
    #[command(subcommand)]
    Kube(KubeCommand),
}

/// A spec and the overrides it is read with.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// The pipeline's TOML spec.
    pub spec: PathBuf,
    /// Override a value of the spec: vars.NAME=VALUE, stages.STAGE.KEY=VALUE or pipeline.KEY=VALUE
    /// (repeatable; the value is TOML, a bare word is a string).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Run only these stages and the stages they need, nothing after them (default: all).
    #[arg(value_name = "STAGE", add = super::complete::stage_names())]
    pub stages: Vec<String>,
    /// Stages running at the same time (default: CPUs).
    #[arg(long, short, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    pub jobs: Option<usize>,
    /// Run this stage even if cached (repeatable).
    #[arg(long, value_name = "STAGE", add = super::complete::stage_names())]
    pub force: Vec<String>,
    /// Rehash cache entries before trusting them.
    #[arg(long)]
    pub verify: bool,
    /// Write a JUnit XML file with one testcase per stage.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// Write the run's HTML report (as `mflow report` does) when the run ends, interrupted too.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Where stages run; overrides `[pipeline] backend`.
    #[arg(long, value_enum, env = "MFLOW_BACKEND")]
    pub backend: Option<BackendChoice>,
    /// Kubernetes: send every object to the API server as a server-side dry run; runs nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Kubernetes, outside the cluster: start the run and return, printing its id.
    #[arg(long)]
    pub detach: bool,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Text for people, JSON for programs (the same as --output-format).
    #[arg(long, value_enum)]
    pub format: Option<OutputFormat>,
    /// Rehash cache entries instead of checking sizes.
    #[arg(long)]
    pub verify: bool,
    /// Where stages run; overrides `[pipeline] backend`.
    #[arg(long, value_enum, env = "MFLOW_BACKEND")]
    pub backend: Option<BackendChoice>,
}

#[derive(Args, Debug)]
pub struct RenderArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// The backend whose objects are rendered (only kubernetes has any).
    #[arg(long, value_enum, default_value_t = BackendChoice::Kubernetes)]
    pub backend: BackendChoice,
}

#[derive(Args, Debug)]
pub struct WhyArgs {
    /// The pipeline's TOML spec.
    pub spec: PathBuf,
    /// The stage whose key is explained.
    #[arg(add = super::complete::stage_names())]
    pub stage: String,
    /// Override a value of the spec, as `run --set` does.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

#[derive(Args, Debug)]
pub struct OutputArgs {
    /// The pipeline's TOML spec.
    pub spec: PathBuf,
    /// The stage whose output is printed or copied.
    #[arg(add = super::complete::stage_names())]
    pub stage: String,
    /// Override a value of the spec, as `run --set` does.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Copy the output into DIR (which must not exist), each file checked against its digest.
    #[arg(long, value_name = "DIR")]
    pub download: Option<PathBuf>,
}

/// The workdir a command reads.
#[derive(Args, Debug, Clone)]
pub struct WorkdirArgs {
    /// The workdir of the runs (default: that of --spec, else .mflow here, else those of the
    /// specs below this directory).
    #[arg(long, env = "MFLOW_WORKDIR")]
    pub workdir: Option<PathBuf>,
    /// The spec whose workdir is read (`.mflow` beside it, unless `[pipeline] workdir` says
    /// otherwise).
    #[arg(long, conflicts_with = "workdir")]
    pub spec: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct RunsArgs {
    #[command(flatten)]
    pub workdir: WorkdirArgs,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Run id or unique prefix (default: the latest run).
    pub run: Option<String>,
    #[command(flatten)]
    pub workdir: WorkdirArgs,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Args, Debug)]
pub struct LogsArgs {
    /// [RUN] STAGE: the stage, in a run given by id or prefix (default: the latest run).
    #[arg(num_args = 1..=2, required = true, value_name = "[RUN] STAGE")]
    pub args: Vec<String>,
    #[command(flatten)]
    pub workdir: WorkdirArgs,
    /// Keep printing as the log grows.
    #[arg(long, short)]
    pub follow: bool,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Args, Debug)]
pub struct GcArgs {
    #[command(flatten)]
    pub workdir: WorkdirArgs,
    /// Runs whose outputs are kept.
    #[arg(long, default_value_t = 10)]
    pub keep_runs: usize,
    /// Say what would be removed; remove nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Wait for the runs using the workdir to end instead of refusing.
    #[arg(long)]
    pub wait: bool,
}

#[derive(Subcommand, Debug)]
pub enum CacheCommand {
    /// Rebuild the manifest log: entries whose files match the output digest recorded for their
    /// key get their line back, the others are moved to cache/.unverified/. Deletes nothing but
    /// byte-identical copies.
    Repair {
        #[command(flatten)]
        workdir: WorkdirArgs,
        /// Say what would be done, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Wait for the runs using the workdir to end instead of refusing.
        #[arg(long)]
        wait: bool,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum BackendChoice {
    Local,
    Kubernetes,
}

impl BackendChoice {
    pub fn kind(self) -> crate::spec::BackendKind {
        match self {
            BackendChoice::Local => crate::spec::BackendKind::Local,
            BackendChoice::Kubernetes => crate::spec::BackendKind::Kubernetes,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
    Elvish,
    Powershell,
}

impl Shell {
    pub fn name(self) -> &'static str {
        match self {
            Shell::Bash => "bash",
            Shell::Zsh => "zsh",
            Shell::Fish => "fish",
            Shell::Elvish => "elvish",
            Shell::Powershell => "powershell",
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum SchemaFormat {
    Json,
    Markdown,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Run id or unique prefix (default: the latest run).
    pub run: Option<String>,
    #[command(flatten)]
    pub workdir: WorkdirArgs,
    /// The HTML file to write (default: report.html in the run's directory).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Also write each chart as a PNG file into this directory.
    #[arg(long, value_name = "DIR")]
    pub png: Option<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Subcommand, Debug)]
pub enum MetricsCommand {
    /// The metrics of a stage's committed output: its summary (metrics.json) and the lines that
    /// the run which computed it logged (from a cluster's volume when the run is there).
    Show(OutputArgs),
    /// Compare the final metrics of two runs, per stage.
    Diff {
        /// The first run (id or unique prefix).
        run_a: String,
        /// The second run (id or unique prefix).
        run_b: String,
        #[command(flatten)]
        workdir: WorkdirArgs,
        /// Exit with code 4 when this holds, e.g. "val_loss>+2%", "loss>+0.1", "eval.val_ppl>40" (repeatable).
        #[arg(long = "fail-if", value_name = "CONDITION")]
        fail_if: Vec<String>,
    },
}

#[derive(Args, Debug)]
pub struct ReproduceArgs {
    /// Run id or unique prefix.
    pub run: String,
    #[command(flatten)]
    pub workdir: WorkdirArgs,
}
