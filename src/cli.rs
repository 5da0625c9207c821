//! The command line. Each subcommand is a thin layer over the library.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use crate::exec::display::Mode;
use crate::exit::ExitCode;
use crate::record::{self, StageStatus};
use crate::{env::Environment, plan, spec, Error};

#[derive(Parser, Debug)]
#[command(name = "mflow", version, about = "Declarative pipelines for Hugging Face models through Megatron and back")]
pub struct Cli {
    /// Output of progress and events: text (live on a terminal, plain otherwise) or json lines.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Plan, skip cached stages, run the rest.
    Run(RunArgs),
    /// Show what `run` would do with every stage, and why. Runs nothing.
    Plan {
        spec: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
        format: PlanFormat,
        /// Rehash cache entries instead of checking sizes.
        #[arg(long)]
        verify: bool,
        /// Where stages run; overrides `[pipeline] backend`.
        #[arg(long, value_enum)]
        backend: Option<BackendChoice>,
    },
    /// Print every Kubernetes object a run would submit, as YAML, without a cluster.
    Render {
        spec: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        #[arg(long, value_enum, default_value_t = BackendChoice::Kubernetes)]
        backend: BackendChoice,
    },
    /// What changed in a stage's cache key since it last ran.
    Why {
        spec: PathBuf,
        stage: String,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Check a spec without running anything.
    Validate {
        spec: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Print the JSON Schema of specs (for editor completion), or the key reference.
    Schema {
        #[arg(long, value_enum, default_value_t = SchemaFormat::Json)]
        format: SchemaFormat,
    },
    /// Follow a run started outside the cluster again (its driver in the cluster).
    Attach {
        run: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Cancel a run started outside the cluster: its stages stop and their TrainJobs are deleted.
    Cancel {
        run: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// List recorded runs.
    Runs {
        #[arg(long, default_value = ".mflow")]
        workdir: PathBuf,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Show one run's stages.
    Status {
        run: Option<String>,
        #[arg(long, default_value = ".mflow")]
        workdir: PathBuf,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Print a stage's log from a run (default: the latest).
    Logs {
        /// [RUN] STAGE
        #[arg(num_args = 1..=2, required = true)]
        args: Vec<String>,
        #[arg(long, default_value = ".mflow")]
        workdir: PathBuf,
        /// Keep printing as the log grows.
        #[arg(long, short)]
        follow: bool,
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Print the path of a stage's committed output, or copy the output to a new directory.
    /// A workdir on a cluster's volume that is not mounted here is read through the cluster.
    Output {
        spec: PathBuf,
        stage: String,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Copy the output into DIR (which must not exist), each file checked against its digest.
        #[arg(long, value_name = "DIR")]
        download: Option<PathBuf>,
    },
    /// Delete the cache entries (known to the manifest log) that no kept run references.
    /// Refused while a run uses the workdir (exit 3), unless --wait.
    Gc {
        #[arg(long, default_value = ".mflow")]
        workdir: PathBuf,
        /// Runs whose outputs are kept.
        #[arg(long, default_value_t = 10)]
        keep_runs: usize,
        #[arg(long)]
        dry_run: bool,
        /// Wait for the runs using the workdir to end instead of refusing.
        #[arg(long)]
        wait: bool,
    },
    /// Inspect and mend the cache of a workdir.
    #[command(subcommand)]
    Cache(CacheCommand),
    /// Report Python, torch, the GPUs, NCCL and megatron-core, as the Python stages see them.
    Doctor,
    /// Provision the Python environment of the workloads and print its interpreter.
    Env,
    /// Print the table of exit codes.
    ExitCodes,
    /// Get an HF model: hf://ORG/NAME[@REV], path:DIR, or init:PRESET (random weights).
    Model(mflow_ckpt::cli::ModelArgs),
    /// Convert an HF model to Megatron shards for TP x PP, or reshard shards.
    Convert(mflow_ckpt::cli::ConvertArgs),
    /// Export Megatron shards to an HF model directory.
    Export(mflow_ckpt::cli::ExportArgs),
    /// Tokenize text or JSONL into Megatron indexed datasets.
    Dataset(mflow_data::cli::DatasetArgs),
    /// Write a self-contained HTML report of a run: curves, timeline, metrics, lockfile.
    Report(crate::ci::commands::ReportArgs),
    /// Compare the metrics of runs.
    #[command(subcommand)]
    Metrics(crate::ci::commands::MetricsCommand),
    /// Rerun a recorded run from its lockfile, refusing if a pinned digest changed.
    Reproduce(crate::ci::commands::ReproduceArgs),
    /// Kubernetes CronJob (and RBAC) for the spec's [schedule].
    #[command(subcommand)]
    Schedule(crate::ci::commands::ScheduleCommand),
    /// Kubernetes objects mflow needs, rendered for your cluster.
    #[command(subcommand)]
    Kube(KubeCommand),
}

#[derive(Subcommand, Debug)]
pub enum CacheCommand {
    /// Rebuild the manifest log: entries whose files match the output digest recorded for their
    /// key get their line back, the others are moved to cache/.unverified/. Deletes nothing but
    /// byte-identical copies.
    Repair {
        #[arg(long, default_value = ".mflow")]
        workdir: PathBuf,
        /// Say what would be done, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Wait for the runs using the workdir to end instead of refusing.
        #[arg(long)]
        wait: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum KubeCommand {
    /// The least-privilege RBAC of mflow in one namespace, as YAML for `kubectl apply -f -`:
    /// exactly the rights the preflight checks.
    Rbac {
        /// The namespace mflow runs TrainJobs in.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// ServiceAccount to create and bind (repeatable; default `mflow` when no subject is given).
        #[arg(long = "service-account", value_name = "NAME")]
        service_accounts: Vec<String>,
        /// User to bind, e.g. the person running mflow from a laptop (repeatable).
        #[arg(long = "user", value_name = "NAME")]
        users: Vec<String>,
        /// Group to bind (repeatable).
        #[arg(long = "group", value_name = "NAME")]
        groups: Vec<String>,
        /// Name of the Role and RoleBinding (the cluster-wide ones get `-<namespace>` appended).
        #[arg(long, default_value = "mflow")]
        name: String,
    },
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    pub spec: PathBuf,
    /// Override a value: vars.NAME=VALUE or stages.STAGE.KEY=VALUE.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Stages running at the same time (default: CPUs).
    #[arg(long, short)]
    pub jobs: Option<usize>,
    /// Run this stage even if cached (repeatable).
    #[arg(long)]
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
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    /// Kubernetes: send every object to the API server as a server-side dry run; runs nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Kubernetes, outside the cluster: start the run and return, printing its id.
    #[arg(long)]
    pub detach: bool,
}

/// Records of runs started outside the cluster, read through it.
#[derive(clap::Args, Debug)]
pub struct RemoteArgs {
    /// `kubernetes`: the runs started from outside the cluster (by `mflow run --backend
    /// kubernetes` where the volume is not mounted), read on its volume. Implied by
    /// --namespace, --context, or a --workdir on the volume that is not mounted here.
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

impl RemoteArgs {
    pub fn wanted(&self, workdir: &Path) -> bool {
        let mount = Path::new(mflow_kube::ARTIFACT_MOUNT);
        self.backend == Some(BackendChoice::Kubernetes)
            || (self.backend.is_none() && (self.cluster.namespace.is_some() || self.cluster.context.is_some() || (workdir.starts_with(mount) && !mount.is_dir())))
    }

    /// The workdir to filter the cluster's runs by: one on the volume, if one was given.
    fn workdir<'a>(&self, workdir: &'a Path) -> Option<&'a Path> {
        workdir.starts_with(mflow_kube::ARTIFACT_MOUNT).then_some(workdir)
    }

    fn connect_and<F, Fut>(&self, f: F) -> Result<ExitCode, Error>
    where
        F: FnOnce(kube::Client, String) -> Fut,
        Fut: std::future::Future<Output = Result<ExitCode, crate::remote::RemoteError>>,
    {
        runtime()?.block_on(async {
            let kube = crate::remote::connect(self.cluster.namespace.clone(), self.cluster.context.clone()).await?;
            match f(kube.client().clone(), kube.namespace().to_string()).await {
                Ok(code) => Ok(code),
                Err(e) => {
                    let code = e.exit_code();
                    eprintln!("{:?}", miette::Report::new(e));
                    Ok(code)
                }
            }
        })
    }
}

/// Which cluster a run outside it lives in.
#[derive(clap::Args, Debug)]
pub struct ClusterArgs {
    /// Namespace of the run (default: the kubeconfig context's).
    #[arg(long, short)]
    pub namespace: Option<String>,
    /// Kubeconfig context (default: the current one).
    #[arg(long)]
    pub context: Option<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum BackendChoice {
    Local,
    Kubernetes,
}

impl BackendChoice {
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Local => "local",
            BackendChoice::Kubernetes => "kubernetes",
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum SchemaFormat {
    Json,
    Markdown,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum PlanFormat {
    Text,
    Json,
}

pub fn main(cli: Cli) -> Result<ExitCode, Error> {
    match cli.command {
        Command::Run(args) => run(args, cli.log_format),
        Command::Render { spec, set, backend } => {
            let (plan, store) = load_plan(&spec, &set, Some(backend))?;
            if plan.spec.pipeline.backend != "kubernetes" {
                return Err(Error::usage("only the kubernetes backend has objects to render", "pass --backend kubernetes"));
            }
            let yaml = crate::backend::kubernetes::render::render(&plan, &store).map_err(|e| Error::usage(e.to_string(), e.explain()))?;
            print!("{yaml}");
            Ok(ExitCode::Success)
        }
        Command::Plan { spec, set, format, verify, backend } => {
            let (plan, store) = load_plan(&spec, &set, backend)?;
            let last = record::LastKeys::open(&plan.spec.workdir());
            let mut decisions = plan::decide(&plan, &store, &last, &[], verify);
            if plan.spec.pipeline.backend == "kubernetes" {
                cluster_cached(&plan.spec, &mut decisions);
            }
            match format {
                PlanFormat::Json => println!("{}", serde_json::to_string_pretty(&decisions).unwrap()),
                PlanFormat::Text => print!("{}", render_plan(&decisions)),
            }
            Ok(ExitCode::Success)
        }
        Command::Why { spec, stage, set } => {
            let (plan, store) = load_plan(&spec, &set, None)?;
            let i = plan.index(&stage).ok_or_else(|| plan::PlanError::UnknownStage(stage.clone()))?;
            let last = record::LastKeys::open(&plan.spec.workdir());
            let decisions = plan::decide(&plan, &store, &last, &[], false);
            let d = &decisions[i];
            let old = last.get(&stage);
            // Upstream digests as they are now (cached ones), else as last recorded.
            let digest = |d: usize| -> Option<String> {
                let n = &plan.stages[d].spec.name;
                match &decisions[d].decision {
                    plan::Decision::Cached { key } => store.manifest(key).map(|m| m.digest.clone()),
                    _ => last.get(&stage).and_then(|o| o.upstream.get(n).cloned()),
                }
            };
            match (plan.parts_with(i, &digest), old) {
                (_, None) => println!("{stage}: never ran in this workdir"),
                (None, Some(_)) => println!("{stage}: an upstream stage has no recorded output yet"),
                (Some(now), Some(old)) => {
                    let diff = now.diff(old);
                    if diff.is_empty() {
                        println!("{stage}: key unchanged ({})", crate::cache::key::short(&now.key()));
                    } else {
                        println!("{stage}: key {} -> {}", crate::cache::key::short(&old.key()), crate::cache::key::short(&now.key()));
                        for line in diff {
                            println!("  {line}");
                        }
                    }
                }
            }
            println!("decision: {}", describe(&d.decision));
            Ok(ExitCode::Success)
        }
        Command::Validate { spec, set } => {
            let s = spec::load(&spec, &set)?;
            println!("{}: ok ({} stages)", spec.display(), s.stages.len());
            Ok(ExitCode::Success)
        }
        Command::Schema { format } => {
            match format {
                SchemaFormat::Json => println!("{}", serde_json::to_string_pretty(&spec::json_schema()).unwrap()),
                SchemaFormat::Markdown => print!("{}", spec::reference_markdown()),
            }
            Ok(ExitCode::Success)
        }
        Command::Attach { run, cluster } => {
            let rt = runtime()?;
            rt.block_on(crate::remote::attach(&run, cluster.namespace, cluster.context, Mode::detect(cli.log_format == LogFormat::Json)))
        }
        Command::Cancel { run, cluster } => runtime()?.block_on(crate::remote::cancel(&run, cluster.namespace, cluster.context)),
        Command::Runs { workdir, remote } if remote.wanted(&workdir) => {
            let w = remote.workdir(&workdir).map(Path::to_path_buf);
            remote.connect_and(|c, ns| async move { crate::remote::records::runs(&c, &ns, w.as_deref()).await })
        }
        Command::Status { run, workdir, remote } if remote.wanted(&workdir) => remote.connect_and(|c, ns| async move { crate::remote::records::status(&c, &ns, run.as_deref()).await }),
        Command::Logs { args, workdir, follow, remote } if remote.wanted(&workdir) => {
            let (run, stage) = if args.len() == 2 { (Some(args[0].clone()), args[1].clone()) } else { (None, args[0].clone()) };
            remote.connect_and(|c, ns| async move { crate::remote::records::logs(&c, &ns, run.as_deref(), &stage, follow).await })
        }
        Command::Report(a) if a.remote.wanted(&a.workdir) => {
            if a.png.is_some() {
                return Err(Error::usage("--png is not available for a run in the cluster", "bring the report here without --png; its charts are in the HTML"));
            }
            let (run, out) = (a.run.clone(), a.out.clone());
            if let Some(o) = &out {
                user_named(&crate::user_output::Owned::new(&a.workdir), o)?;
            }
            a.remote.connect_and(|c, ns| async move { crate::remote::records::report(&c, &ns, run.as_deref(), out.as_deref()).await })
        }
        Command::Runs { workdir, .. } => {
            let json = cli.log_format == LogFormat::Json;
            for id in record::list(&workdir) {
                if let Some(r) = record::load(&workdir, &id) {
                    let ran = r.stages.values().filter(|s| s.status == StageStatus::Succeeded).count();
                    let cached = r.stages.values().filter(|s| s.status == StageStatus::Cached).count();
                    let status = format!("{:?}", r.status).to_lowercase();
                    if json {
                        println!("{}", serde_json::json!({"id": id, "status": status, "pipeline": r.pipeline, "started": r.started, "ran": ran, "cached": cached}));
                    } else {
                        println!("{id}  {status:<10} {:<12} ran {ran}, cached {cached}", r.pipeline);
                    }
                }
            }
            Ok(ExitCode::Success)
        }
        Command::Status { run, workdir, .. } => {
            let id = record::resolve(&workdir, run.as_deref()).ok_or_else(|| Error::usage("no such run", "`mflow runs` lists the runs"))?;
            let r = record::load(&workdir, &id).ok_or_else(|| Error::usage(format!("run {id} has no readable record"), "the run directory may be damaged"))?;
            println!("run {id} ({}) {:?}", r.pipeline, r.status);
            for name in &r.order {
                let s = &r.stages[name];
                let dur = s.duration_s.map(|d| format!("{d:.1}s")).unwrap_or_default();
                let attempts = if s.attempts.len() > 1 { format!(" ({} attempts)", s.attempts.len()) } else { String::new() };
                println!("  {:<20} {:<10} {:>8}{attempts} {}", name, format!("{:?}", s.status).to_lowercase(), dur, s.message.clone().unwrap_or_default());
            }
            Ok(ExitCode::Success)
        }
        Command::Logs { args, workdir, follow, .. } => {
            let (run, stage) = if args.len() == 2 { (Some(args[0].as_str()), args[1].clone()) } else { (None, args[0].clone()) };
            let id = record::resolve(&workdir, run).ok_or_else(|| Error::usage("no such run", "`mflow runs` lists the runs"))?;
            if !spec::valid_name(&stage) {
                return Err(Error::usage(format!("invalid stage name `{stage}`"), "give a stage name from the spec"));
            }
            let dir = record::runs_dir(&workdir).join(&id).join("stages").join(&stage);
            let attempts = || record::load(&workdir, &id).map(|r| (r.stages.get(&stage).map(|s| s.attempts.len()).unwrap_or(0), r.status));
            let mut seen = attempts();
            // Followed while the run goes on: the stage's first attempt may not be recorded yet.
            while follow && matches!(seen, Some((0, record::RunStatus::Running))) {
                std::thread::sleep(std::time::Duration::from_millis(250));
                seen = attempts();
            }
            let n = seen.map(|(n, _)| n).unwrap_or(0);
            if n == 0 {
                return Err(Error::usage(format!("stage `{stage}` has no log in run {id}"), "cached stages have no log; see `mflow status`"));
            }
            print_logs(&dir, n, follow, &workdir, &id, &stage)?;
            Ok(ExitCode::Success)
        }
        Command::Output { spec, stage, set, download } => {
            let (plan, store) = load_plan(&spec, &set, None)?;
            let i = plan.index(&stage).ok_or_else(|| plan::PlanError::UnknownStage(stage.clone()))?;
            if let Some(to) = &download {
                user_named(&crate::user_output::Owned::new(&plan.spec.workdir()).spec(&spec), to)?;
            }
            if plan.spec.pipeline.backend == "kubernetes" && crate::remote::needed(&plan.spec) {
                return runtime()?.block_on(crate::remote::output(&plan, &stage, &set, download.as_deref()));
            }
            let decisions = plan::decide(&plan, &store, &record::LastKeys::open(&plan.spec.workdir()), &[], false);
            match &decisions[i].decision {
                plan::Decision::Cached { key } => {
                    let dir = store.output_dir(key);
                    let manifest = store.manifest(key);
                    if let Some(to) = download {
                        let m = manifest.ok_or_else(|| Error::usage(format!("stage `{stage}` has no manifest to copy by"), "`mflow cache repair` restores it"))?;
                        copy_output(&dir, &m, &to)?;
                        println!("{}", to.display());
                    } else if cli.log_format == LogFormat::Json {
                        let (digest, files) = manifest.map(|m| (m.digest.clone(), m.files.clone())).unwrap_or_default();
                        println!("{}", serde_json::json!({"path": dir, "digest": digest, "files": files}));
                    } else {
                        println!("{}", dir.display());
                    }
                    Ok(ExitCode::Success)
                }
                d => Err(Error::usage(format!("stage `{stage}` has no committed output for the current spec ({})", describe(d)), format!("run `mflow run {}` first", spec.display()))),
            }
        }
        Command::Gc { workdir, keep_runs, dry_run, wait } => gc(&workdir, keep_runs, dry_run, wait),
        Command::Cache(CacheCommand::Repair { workdir, dry_run, wait }) => repair(&workdir, dry_run, wait),
        Command::Doctor => doctor(),
        Command::Env => {
            let env = Environment::detect(None);
            println!("{}", env.python()?.display());
            Ok(ExitCode::Success)
        }
        Command::Model(a) => native(mflow_ckpt::cli::model(&a)),
        Command::Convert(a) => native(mflow_ckpt::cli::convert(&a)),
        Command::Export(a) => native(mflow_ckpt::cli::export(&a)),
        Command::Dataset(a) => native(mflow_data::cli::run(&a)),
        Command::Report(a) => crate::ci::commands::report(a),
        Command::Metrics(c) => crate::ci::commands::metrics(c),
        Command::Reproduce(a) => crate::ci::commands::reproduce(a, cli.log_format == LogFormat::Json),
        Command::Schedule(c) => crate::ci::commands::schedule(c),
        Command::Kube(KubeCommand::Rbac { namespace, mut service_accounts, users, groups, name }) => {
            if service_accounts.is_empty() && users.is_empty() && groups.is_empty() {
                service_accounts.push("mflow".into());
            }
            let subjects = mflow_kube::rbac::Subjects { service_accounts, users, groups };
            print!("{}", rbac_yaml(&name, &namespace, &subjects));
            Ok(ExitCode::Success)
        }
        Command::ExitCodes => {
            for (code, what) in ExitCode::TABLE {
                println!("{code:>4}  {what}");
            }
            Ok(ExitCode::Success)
        }
    }
}

/// Copies a committed output to `to` (which must not exist) through a staging directory,
/// checking every file against its manifest.
fn copy_output(dir: &Path, m: &crate::cache::Manifest, to: &Path) -> Result<(), Error> {
    if to.symlink_metadata().is_ok() {
        return Err(Error::usage(format!("{} exists", to.display()), "copy into a directory that does not exist yet"));
    }
    let staging = crate::remote::records::staged_beside(to);
    let copied = (|| -> Result<(), Error> {
        for f in &m.files {
            let rel = crate::remote::relative(&f.path).ok_or_else(|| Error::usage(format!("the manifest of {} lists a file outside it: {}", dir.display(), spec::error::excerpt(&f.path)), "`mflow cache repair` rebuilds the manifest log"))?;
            let (from, dest) = (dir.join(&rel), staging.join(&rel));
            if let Some(p) = dest.parent() {
                std::fs::create_dir_all(p).map_err(|e| Error::io(p, e))?;
            }
            std::fs::copy(&from, &dest).map_err(|e| Error::io(&from, e))?;
            if crate::cache::hash_file(&dest).map_err(|e| Error::io(&dest, e))? != f.blake3 {
                return Err(Error::usage(format!("{} differs from the digest its manifest records", from.display()), "`mflow run --verify` rebuilds a damaged entry"));
            }
        }
        std::fs::create_dir_all(&staging).map_err(|e| Error::io(&staging, e))?;
        std::fs::rename(&staging, to).map_err(|e| Error::io(to, e))
    })();
    if copied.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    copied
}

/// The native stage commands report their own diagnostics; a failure is the stage's.
fn native(r: miette::Result<()>) -> Result<ExitCode, Error> {
    match r {
        Ok(()) => Ok(ExitCode::Success),
        Err(report) => {
            eprintln!("{report:?}");
            Ok(ExitCode::StageFailed)
        }
    }
}

/// The RBAC objects as a YAML stream, with the reason for every right.
pub fn rbac_yaml(name: &str, namespace: &str, subjects: &mflow_kube::rbac::Subjects) -> String {
    let mut out = format!("# Least privilege for mflow in namespace {namespace:?} (`mflow kube rbac`). Rights:\n{}", mflow_kube::rbac::explained(mflow_kube::rbac::RULES));
    if !subjects.users.is_empty() || !subjects.groups.is_empty() {
        out.push_str(&format!("# And for the users and groups, to run from outside the cluster (Role {name}-outside):\n{}", mflow_kube::rbac::explained(mflow_kube::rbac::OUTSIDE)));
    }
    for obj in mflow_kube::rbac::objects(name, namespace, subjects) {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&obj).unwrap_or_default());
    }
    out
}

fn load_plan(path: &Path, set: &[String], backend: Option<BackendChoice>) -> Result<(plan::Plan, crate::cache::Store), Error> {
    let mut s = spec::load(path, set)?;
    crate::backend::choose(&mut s, backend.map(BackendChoice::name));
    let env = Environment::detect(s.python.as_deref());
    // These commands only look: they create nothing in the workdir and remove nothing.
    let store = crate::cache::Store::open_read_only(&s.workdir());
    Ok((plan::build(s, &env)?, store))
}

fn run(args: RunArgs, format: LogFormat) -> Result<ExitCode, Error> {
    // What a run reads whatever its spec says (the default workdir's manifest log and input
    // stat cache) is read while the spec loads; nothing is written before the spec is checked.
    let ahead = {
        let workdir = spec::default_workdir(&args.spec);
        std::thread::spawn(move || (crate::cache::LogRead::read(&workdir), plan::inputs::KnownInputs::read(&workdir)))
    };
    let mut s = spec::load(&args.spec, &args.set)?;
    // Refused before anything runs: a report over the spec or into the workdir.
    let owned = crate::user_output::Owned::new(&s.workdir()).spec(&args.spec);
    for p in args.junit.iter().chain(&args.report) {
        user_named(&owned, p)?;
    }
    crate::backend::choose(&mut s, args.backend.map(BackendChoice::name));
    for f in &args.force {
        if s.stage(f).is_none() {
            return Err(plan::PlanError::UnknownStage(f.clone()).into());
        }
    }
    let env = Environment::detect(s.python.as_deref());
    let env = if s.pipeline.backend == "kubernetes" { env.stages_in_images() } else { env };
    if s.pipeline.backend == "kubernetes" && !args.dry_run && crate::remote::needed(&s) {
        // Outside the cluster: nothing is written here; the engine runs in the cluster.
        let plan = plan::build(s, &env)?;
        let mode = Mode::detect(format == LogFormat::Json);
        return runtime()?.block_on(crate::remote::run(plan, &args, args.detach, mode));
    }
    if args.detach {
        return Err(Error::usage("--detach needs a run started outside the cluster", "it applies to `--backend kubernetes` where the artifact volume is not mounted"));
    }
    let notify = s.notify.clone();
    let store = crate::cache::Store::open(&s.workdir())?;
    let (log, known) = ahead.join().expect("reading ahead does not panic");
    if !store.adopt(log) {
        store.read_ahead();
    }
    let plan = plan::build_with(s, &env, Some(known))?;
    tracing::debug!(stages = plan.stages.len(), "planned");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| Error::io(Path::new("tokio runtime"), e))?;
    if args.dry_run {
        return dry_run(&plan, &rt);
    }
    let opts = crate::exec::Options { jobs: args.jobs, force: args.force, verify: args.verify, mode: Mode::detect(format == LogFormat::Json), overrides: args.set };
    // A cluster that cannot run the plan is reported before anything starts.
    let backend = match rt.block_on(crate::backend::Backend::for_plan(&plan)) {
        Ok(b) => b,
        Err(e) => {
            let code = crate::exit::for_cluster(&e);
            eprintln!("{:?}", miette::Report::new(e));
            return Ok(code);
        }
    };
    let outcome = rt.block_on(crate::exec::run_on(plan, store, env, opts, backend))?;
    let r = &outcome.record;
    let count = |st: StageStatus| r.stages.values().filter(|s| s.status == st).count();
    eprintln!(
        "run {} {}: {} ran, {} cached, {} failed, {} skipped{}  (record: {})",
        r.id,
        format!("{:?}", r.status).to_lowercase(),
        count(StageStatus::Succeeded),
        count(StageStatus::Cached),
        count(StageStatus::Failed),
        count(StageStatus::Skipped) + count(StageStatus::Cancelled),
        match count(StageStatus::Interrupted) {
            0 => String::new(),
            n => format!(", {n} left running on the cluster (run again to reattach)"),
        },
        outcome.run_dir.display()
    );
    for (name, s) in &r.stages {
        for g in &s.gates {
            eprintln!("  gate {name}.{} {} : {} -> {}", g.metric, g.condition, g.value.map(|v| format!("{v:.4}")).unwrap_or("missing".into()), if g.passed { "pass" } else { "FAIL" });
        }
    }
    crate::ci::commands::after_run(&outcome.run_dir, &args.spec, args.junit.as_deref(), args.report.as_deref(), notify.as_ref(), &rt);
    let code = crate::exit::for_run(r);
    // The process ends right after (`_exit`): the record, plan and store of a large run are
    // not freed one allocation at a time first.
    std::mem::forget(outcome);
    Ok(code)
}

/// A path the user named for mflow to write, refused when it is something mflow keeps.
fn user_named(owned: &crate::user_output::Owned, path: &Path) -> Result<(), Error> {
    owned.check(path).map_err(|e| Error::usage(e.to_string(), "name a path outside the workdir and MFLOW_HOME, other than the spec"))
}

fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| Error::io(Path::new("tokio runtime"), e))
}

fn dry_run(plan: &plan::Plan, rt: &tokio::runtime::Runtime) -> Result<ExitCode, Error> {
    if plan.spec.pipeline.backend != "kubernetes" {
        return Err(Error::usage("--dry-run needs the kubernetes backend", "pass --backend kubernetes; `mflow plan` shows what a local run would do"));
    }
    let store = crate::cache::Store::open(&plan.spec.workdir())?;
    let results = match rt.block_on(crate::backend::kubernetes::render::dry_run(plan, &store)) {
        Ok(r) => r,
        Err(e) => {
            let code = crate::exit::for_cluster(&e);
            eprintln!("{:?}", miette::Report::new(e));
            return Ok(code);
        }
    };
    let mut rejected = 0;
    for r in &results {
        let stage = if r.stage.is_empty() { String::new() } else { format!(" (stage {})", r.stage) };
        match &r.result {
            Ok(()) => println!("{}{stage}: accepted (server-side dry run)", r.name),
            Err(e) => {
                rejected += 1;
                println!("{}{stage}: rejected: {}", r.name, e.explain());
            }
        }
    }
    Ok(if rejected > 0 { ExitCode::Invalid } else { ExitCode::Success })
}

/// Stages that would run because this machine lacks their output, but that the cluster's cache
/// index lists, are reported as cached in the cluster.
fn cluster_cached(spec: &spec::Spec, decisions: &mut [plan::StageDecision]) {
    let Ok(rt) = tokio::runtime::Runtime::new() else { return };
    let kube = match rt.block_on(crate::backend::kubernetes::Kubernetes::connect_read_only(spec)) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("mflow: cannot read the cluster's cache index: {}", e.explain());
            return;
        }
    };
    for d in decisions.iter_mut() {
        let plan::Decision::Run { key: Some(key), reason } = &mut d.decision else { continue };
        match rt.block_on(kube.cache_get(&spec.pipeline.name, key)) {
            Ok(Some(entry)) => *reason = format!("cached in the cluster ({}), not visible from here", entry.output),
            Ok(None) => {}
            Err(e) => eprintln!("mflow: cannot read the cluster's cache index: {e}"),
        }
    }
}

fn describe(d: &plan::Decision) -> String {
    match d {
        plan::Decision::Cached { key } => format!("cached ({})", crate::cache::key::short(key)),
        plan::Decision::Run { reason, .. } => format!("run: {reason}"),
        plan::Decision::Resume { iteration, .. } => format!("resume from checkpoint iteration {iteration}"),
    }
}

pub fn render_plan(decisions: &[plan::StageDecision]) -> String {
    let w = decisions.iter().map(|d| d.stage.len()).max().unwrap_or(5);
    let mut out = String::new();
    for d in decisions {
        let (action, why) = match &d.decision {
            plan::Decision::Cached { key } => ("cached", crate::cache::key::short(key).to_string()),
            plan::Decision::Run { reason, .. } => ("run", reason.clone()),
            plan::Decision::Resume { iteration, .. } => ("resume", format!("from checkpoint iteration {iteration}")),
        };
        out.push_str(&format!("{:<w$}  {:<9} {:<7} {}\n", d.stage, d.kind, action, why));
    }
    // Which engine each stage runs and why, below the table: the same line a run prints.
    let engines: Vec<_> = decisions.iter().filter_map(|d| Some((&d.stage, d.engine.as_ref()?))).collect();
    if !engines.is_empty() {
        out.push('\n');
        for (stage, engine) in engines {
            out.push_str(&format!("{stage}: {engine}\n"));
        }
    }
    out
}

/// Most of an attempt log `mflow logs` prints: the end of a larger log, saying so.
const LOG_SHOWN: u64 = 64 << 20;

/// Prints `path` from `pos` on (at most its last [`LOG_SHOWN`] bytes); returns the new position.
/// The log is in the run record, where a stage can reach it: it is read as the one reader of
/// such files does, so a FIFO or a device there is an error, not a hang.
fn print_log_from(path: &Path, pos: u64) -> Result<u64, Error> {
    use std::io::Write;
    let size = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => m.len(),
        // A stage that has printed nothing has no log file yet.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(pos),
        _ => 0,
    };
    let mut from = pos;
    if size > pos + LOG_SHOWN {
        from = size - LOG_SHOWN;
        eprintln!("mflow: {} is {size} bytes; showing its last {LOG_SHOWN}", path.display());
    }
    let mut out = std::io::stdout().lock();
    let copied = crate::untrusted::copy_from(path, from, &mut out).map_err(|e| Error::io(path, e))?;
    out.flush().ok();
    Ok(from + copied)
}

fn print_logs(dir: &Path, attempts: usize, follow: bool, workdir: &Path, id: &str, stage: &str) -> Result<(), Error> {
    for n in 1..attempts {
        let p = dir.join(format!("attempt-{n}.log"));
        println!("--- attempt {n} ---");
        print_log_from(&p, 0)?;
    }
    let p = dir.join(format!("attempt-{attempts}.log"));
    if attempts > 1 {
        println!("--- attempt {attempts} ---");
    }
    let mut pos = 0u64;
    loop {
        let before = pos;
        pos = print_log_from(&p, pos)?;
        if !follow {
            return Ok(());
        }
        let r = record::load(workdir, id);
        let s = r.as_ref().and_then(|r| r.stages.get(stage));
        let still = s.is_some_and(|s| s.status == StageStatus::Running && s.attempts.len() == attempts);
        if !still && pos == before {
            if let Some(s) = s {
                if s.attempts.len() > attempts {
                    return print_logs(dir, s.attempts.len(), follow, workdir, id, stage);
                }
            }
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
}

fn gc(workdir: &Path, keep_runs: usize, dry_run: bool, wait: bool) -> Result<ExitCode, Error> {
    let r = match crate::cache::gc(workdir, keep_runs, dry_run, wait) {
        Ok(r) => r,
        Err(e) => return Ok(refused(e)),
    };
    let verb = if dry_run { "would remove" } else { "removed" };
    for (key, _) in &r.removed {
        if dry_run {
            println!("would remove {key}");
        }
    }
    let freed: u64 = r.removed.iter().map(|(_, b)| b).sum();
    println!("{verb} {} entries, {:.1} MB; kept {} that recent runs use", r.removed.len(), freed as f64 / 1e6, r.kept);
    if !r.locked.is_empty() {
        println!("left {} entries being computed right now", r.locked.len());
    }
    if let Some(log) = &r.no_log {
        eprintln!("mflow: the manifest log {} is missing, so no entry is known to be mflow's: nothing was removed; `mflow cache repair --workdir {}` rebuilds it", log.display(), workdir.display());
    } else if !r.unknown.is_empty() {
        eprintln!("mflow: left {} names in the cache that the manifest log does not know ({}); `mflow cache repair --workdir {}` looks at them", r.unknown.len(), r.unknown.iter().take(3).cloned().collect::<Vec<_>>().join(", "), workdir.display());
    }
    Ok(ExitCode::Success)
}

fn repair(workdir: &Path, dry_run: bool, wait: bool) -> Result<ExitCode, Error> {
    let r = match crate::cache::repair(workdir, dry_run, wait) {
        Ok(r) => r,
        Err(e) => return Ok(refused(e)),
    };
    let would = if dry_run { "would be " } else { "" };
    if let Some((what, to)) = &r.log_moved {
        println!("the manifest log was {what}: {would}moved to {}", to.display());
    }
    for key in &r.restored {
        println!("{would}restored {key}");
    }
    for (key, to, why) in &r.set_aside {
        println!("{would}set aside {key} ({why}): {}", to.display());
    }
    for path in &r.duplicates {
        println!("{would}removed {} (the committed entry holds the same files)", path.display());
    }
    println!(
        "{} intact, {} {would}restored, {} {would}set aside, {} duplicates {would}removed",
        r.intact,
        r.restored.len(),
        r.set_aside.len(),
        r.duplicates.len()
    );
    if !r.unverified.is_empty() {
        println!("{} directories in cache/.unverified/ match no run record: look at them and delete what you do not need", r.unverified.len());
    }
    if !r.foreign.is_empty() {
        println!("left {} names in the cache that are not mflow entries: {}", r.foreign.len(), r.foreign.join(", "));
    }
    Ok(ExitCode::Success)
}

/// A maintenance command that was refused or failed: the diagnostic, and its exit code.
fn refused(e: crate::cache::CacheError) -> ExitCode {
    let code = e.exit_code();
    eprintln!("{:?}", miette::Report::new(e));
    code
}

fn doctor() -> Result<ExitCode, Error> {
    let env = Environment::detect(None);
    let python = env.python()?;
    // The probe gets what a Python stage gets (`stages::python_env`): the same PYTHONPATH, with
    // the user's own after the workloads, so that it finds the modules that the stages import.
    let stage_env = crate::stages::python_env(&env)?;
    let out = std::process::Command::new(&python).args(["-m", "mflow_workloads.doctor"]).envs(&stage_env).output().map_err(|e| Error::io(&python, e))?;
    let probe: Option<serde_json::Value> = serde_json::from_slice(&out.stdout).ok();
    // torch's view of the GPUs when it sees the same ones (CUDA_VISIBLE_DEVICES is inherited),
    // else nvidia-smi's; else indices alone.
    let torch_gpus: Vec<Option<crate::env::GpuInfo>> = probe
        .as_ref()
        .and_then(|p| p["cuda_devices"].as_array())
        .map(|d| d.iter().map(|g| Some(crate::env::GpuInfo { name: g["name"].as_str()?.to_string(), memory_gib: g["memory_gib"].as_f64() })).collect())
        .unwrap_or_default();
    let gpus = if !env.gpus.is_empty() && torch_gpus.len() == env.gpus.len() { torch_gpus } else { crate::env::nvidia_smi_gpus(&env.gpus) };
    println!("mflow {}", env!("CARGO_PKG_VERSION"));
    println!("cpus: {}", env.cpus);
    println!("{}", crate::env::describe_gpus(&env.gpus, &gpus));
    println!("python environment: {}", env.python_digest());
    println!("python: {}", python.display());
    println!("PYTHONPATH (as the stages get it): {}", stage_env["PYTHONPATH"]);
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        return Ok(ExitCode::Internal);
    }
    Ok(ExitCode::Success)
}
