//! Runs started where the artifact volume is not mounted (a laptop, a notebook, a CI runner
//! with a kubeconfig): the project is uploaded to the volume, the engine runs in the cluster as
//! a driver Job, and this process follows it with the display of a local run.

pub mod driver;
mod download;
mod events;
mod follow;
pub mod records;
pub mod upload;
mod volume;

use std::collections::HashSet;
use std::path::Path;

use miette::Diagnostic;
use serde_json::Value as Json;
use thiserror::Error;

use crate::cli::RunArgs;
use crate::exec::display::{Display, Mode};
use crate::exit::ExitCode;
use crate::plan::Plan;
pub use download::relative;
use follow::End;
use upload::{Bundle, UploadError};
use volume::VolumePod;

#[derive(Debug, Error, Diagnostic)]
pub enum RemoteError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Upload(#[from] UploadError),
    #[error("cannot {what}: {message}")]
    #[diagnostic(code(mflow::remote::kube), help("check the kubeconfig context and that you may create pods, pods/exec and Jobs in the namespace (`mflow kube rbac --user NAME`)"))]
    Kube { what: String, message: String },
    #[error("the image {image} cannot be pulled: {reason}")]
    #[diagnostic(code(mflow::remote::image), help("set [pipeline.kubernetes] image to an mflow image the cluster can pull (the default is ghcr.io/mflow-dev/mflow-cpu:<version>)"))]
    Image { image: String, reason: String },
    #[error("the image {image} has no mflow to run: {message}")]
    #[diagnostic(code(mflow::remote::not_mflow), help("set [pipeline.kubernetes] image to an mflow image (mflow on its PATH) of this version: ghcr.io/mflow-dev/mflow-cpu:<version>, or one built from docker/Dockerfile"))]
    NotMflowImage { image: String, message: String },
    #[error("the {what} did not start within 5 minutes: {reason}")]
    #[diagnostic(code(mflow::remote::not_started), help("check the claim (`kubectl get pvc`: a claim without a default StorageClass stays Pending) and the node's capacity"))]
    NotStarted { what: String, reason: String },
    #[error("the claim {pvc} is Pending and names no StorageClass: nothing will provision a volume for it")]
    #[diagnostic(code(mflow::remote::claim_unbound), help("the cluster had no default StorageClass when the claim was made: recreate it with `storageClassName` set (`kubectl get storageclass` lists them), or create a PersistentVolume for it by hand (examples/kubernetes/pvc.yaml)"))]
    ClaimUnbound { pvc: String },
    #[error("the volume did not take the upload: {message}")]
    #[diagnostic(code(mflow::remote::receive), help("check the claim's free space and that the image has sh, tar and mv"))]
    Receive { message: String },
    #[error("cannot read what the volume sent: {message}")]
    #[diagnostic(code(mflow::remote::stream), help("check the free space where it is written, and try again"))]
    Stream { message: String },
    #[error("the output is {size}, more than the download bound of {max}")]
    #[diagnostic(code(mflow::remote::too_large), help("set MFLOW_DOWNLOAD_MAX_BYTES to allow more, or read it where the volume is mounted"))]
    TooLarge { size: String, max: String },
    #[error("{dir} exists")]
    #[diagnostic(code(mflow::remote::exists), help("download into a directory that does not exist yet: it appears when the whole output has arrived"))]
    Exists { dir: String },
    #[error("{message}")]
    #[diagnostic(code(mflow::remote::in_cluster))]
    InCluster { message: String },
    #[error("no run {run} in namespace {namespace}")]
    #[diagnostic(code(mflow::remote::no_run), help("`kubectl get jobs -l mflow.dev/component=driver` lists the runs started from outside the cluster"))]
    NoRun { run: String, namespace: String },
    /// The cluster refused the call as a whole: credentials, certificate, namespace.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Cluster(#[from] mflow_kube::KubeError),
}

impl RemoteError {
    /// A failed call: the connection-wide errors (rejected credentials, an untrusted
    /// certificate, an unreachable server) as such, the rest as `cannot WHAT: why`.
    pub fn call(what: impl Into<String>, e: &kube::Error) -> RemoteError {
        match mflow_kube::KubeError::of_connection(e, &mflow_kube::Target::default()) {
            Some(k) => RemoteError::Cluster(k),
            None => RemoteError::Kube { what: what.into(), message: mflow_kube::describe(e) },
        }
    }

    pub fn exit_code(&self) -> ExitCode {
        match self {
            RemoteError::Cluster(k) => crate::exit::for_kube(k),
            RemoteError::Upload(_) | RemoteError::Image { .. } | RemoteError::NotMflowImage { .. } | RemoteError::NoRun { .. } | RemoteError::TooLarge { .. } | RemoteError::Exists { .. } | RemoteError::InCluster { .. } => {
                ExitCode::Invalid
            }
            _ => ExitCode::Infra,
        }
    }
}

/// Whether a kubernetes run of `spec` needs a driver: its workdir is on the artifact volume,
/// which this machine does not mount. An explicit absolute workdir elsewhere says the volume
/// is mounted there (a shared file system), and the engine runs here.
pub fn needed(spec: &crate::spec::Spec) -> bool {
    let mount = Path::new(mflow_kube::ARTIFACT_MOUNT);
    spec.workdir().starts_with(mount) && !mount.is_dir()
}

fn setting(spec: &crate::spec::Spec, key: &str) -> Option<String> {
    spec.pipeline.kubernetes.get(key).and_then(Json::as_str).map(str::to_string)
}

fn driver_setting(spec: &crate::spec::Spec, key: &str) -> Option<Json> {
    spec.pipeline.kubernetes.get("driver")?.get(key).cloned()
}

fn names(plan: &Plan) -> Vec<String> {
    plan.stages.iter().map(|s| s.spec.name.clone()).collect()
}

/// `mflow run SPEC --backend kubernetes` from outside the cluster.
pub async fn run(plan: Plan, args: &RunArgs, detach: bool, mode: Mode) -> Result<ExitCode, crate::Error> {
    let fail = |e: RemoteError| {
        let code = e.exit_code();
        eprintln!("{:?}", miette::Report::new(e));
        Ok(code)
    };
    // The preflight of a run in the cluster: Trainer, runtimes, the claim, and the rights of a
    // machine outside it; the driver checks the engine's rights when it starts.
    let kube = match crate::backend::kubernetes::Kubernetes::connect_for(&plan, mflow_kube::rbac::OUTSIDE).await {
        Ok(k) => k,
        Err(e) => {
            let code = crate::exit::for_cluster(&e);
            let person = match &e {
                crate::backend::kubernetes::KubernetesError::Kube(mflow_kube::KubeError::Forbidden { rbac_namespace, .. }) => Some(rbac_namespace.clone()),
                _ => None,
            };
            eprintln!("{:?}", miette::Report::new(e));
            if let Some(ns) = person {
                eprintln!("  from outside the cluster, a person gets these rights from `mflow kube rbac --namespace {ns} --user NAME`");
            }
            return Ok(code);
        }
    };
    let client = kube.backend().client().clone();
    let namespace = kube.backend().namespace().to_string();
    let spec = &plan.spec;
    let pvc = setting(spec, "pvc").unwrap_or_else(|| mflow_kube::DEFAULT_PVC.into());
    let image = setting(spec, "image").unwrap_or_else(|| crate::backend::kubernetes::DEFAULT_IMAGE.into());
    let service_account = driver_setting(spec, "service_account").and_then(|v| v.as_str().map(str::to_string)).unwrap_or_else(|| "mflow".into());
    if let Err(e) = mflow_kube::check_service_account(&service_account) {
        return fail(e.into());
    }
    let bundle = match Bundle::of(&plan) {
        Ok(b) => b,
        Err(e) => return fail(e.into()),
    };
    let host_network = driver_setting(spec, "host_network").and_then(|v| v.as_bool()).unwrap_or(false);
    if let Err(e) = upload(&bundle, client.clone(), &namespace, &pvc, &image, host_network).await {
        return fail(e);
    }
    let run = crate::record::new_run_id();
    let d = driver::DriverSpec {
        run: run.clone(),
        pipeline: spec.pipeline.name.clone(),
        image,
        pvc,
        service_account,
        project: bundle.tree_dir(),
        spec: bundle.spec.clone(),
        workdir: spec.workdir().display().to_string(),
        overrides: args.set.clone(),
        jobs: args.jobs,
        force: args.force.clone(),
        verify: args.verify,
        restarts: driver_setting(spec, "restarts").and_then(|v| v.as_i64()).map(|n| n.clamp(0, 100) as i32).unwrap_or(driver::DEFAULT_RESTARTS),
        host_network,
        env: driver_setting(spec, "env")
            .and_then(|v| v.as_object().cloned())
            .map(|m| m.into_iter().filter_map(|(k, v)| Some((k, v.as_str()?.to_string()))).collect())
            .unwrap_or_default(),
    };
    let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> = kube::Api::namespaced(client.clone(), &namespace);
    if let Err(e) = jobs.create(&Default::default(), &driver::job(&d)).await {
        return fail(kube.backend().error(e, "create", "jobs", &driver::job_name(&run)).into());
    }
    eprintln!("run {run}: driver job/{} in namespace {namespace}", driver::job_name(&run));
    if detach {
        println!("{run}");
        eprintln!("`mflow attach {run}` follows it, `mflow cancel {run}` stops it");
        return Ok(ExitCode::Success);
    }
    let mut display = Display::new(mode, &names(&plan));
    follow_or_detach(client, &namespace, &run, &mut display).await
}

/// Sends what the volume lacks; says what it sent.
async fn upload(bundle: &Bundle, client: kube::Client, namespace: &str, pvc: &str, image: &str, host_network: bool) -> Result<(), RemoteError> {
    let pod = VolumePod::ensure(client, namespace, pvc, image, host_network).await?;
    check_image(&pod, image).await?;
    let probe = pod.quick(&bundle.probe_script()).await?;
    let listed = String::from_utf8_lossy(&probe.stdout).to_string();
    let mut lines = listed.lines().peekable();
    if lines.peek() == Some(&"tree") {
        eprintln!("upload: nothing to send, the project is on the volume ({} files)", bundle.files.len());
        return Ok(());
    }
    let present: HashSet<String> = lines.map(str::to_string).collect();
    let missing: Vec<upload::File> = bundle.missing(&present).into_iter().cloned().collect();
    let max = std::env::var("MFLOW_UPLOAD_MAX_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(upload::DEFAULT_MAX_BYTES);
    let total = Bundle::check_size(&missing.iter().collect::<Vec<_>>(), max)?;
    let bar = indicatif::ProgressBar::new(total);
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_style(indicatif::ProgressStyle::with_template("upload [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}").expect("a valid template"));
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let nonce = format!("{:016x}", fastrand::u64(..));
    let sent = std::sync::Arc::new(std::sync::Mutex::new(None));
    let stream = {
        let (b, sent, bar, nonce) = (bundle.clone(), sent.clone(), bar.clone(), nonce.clone());
        Box::new(move |w: &mut dyn std::io::Write| {
            let r = b.write_tar(&missing.iter().collect::<Vec<_>>(), &nonce, bar.wrap_write(w));
            let failed = r.is_err();
            *sent.lock().unwrap() = Some(r);
            if failed { Err(std::io::Error::other("upload stream")) } else { Ok(()) }
        }) as volume::Writer
    };
    let out = pod.sh(&bundle.receive_script(&nonce), Some(stream)).await;
    bar.finish_and_clear();
    if let Some(Err(e)) = sent.lock().unwrap().take() {
        return Err(e.into());
    }
    let out = out?;
    if !out.success {
        return Err(RemoteError::Receive { message: out.stderr });
    }
    let sent_files = bundle.files.iter().filter(|f| !present.contains(&f.digest)).count();
    eprintln!("upload: sent {sent_files} of {} files ({})", bundle.files.len(), upload::human(total));
    Ok(())
}

/// The driver runs the image's mflow: one that is missing fails here, before anything is
/// sent; another version than this one is said, since the run is the image's.
async fn check_image(pod: &VolumePod, image: &str) -> Result<(), RemoteError> {
    let out = pod.quick("exec mflow --version").await?;
    let theirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.success || !theirs.starts_with("mflow ") {
        return Err(RemoteError::NotMflowImage { image: image.to_string(), message: if out.stderr.is_empty() { theirs } else { out.stderr } });
    }
    let ours = format!("mflow {}", env!("CARGO_PKG_VERSION"));
    if theirs != ours {
        eprintln!("warning: the image {image} has {theirs} and this is {ours}; the run is the image's");
    }
    Ok(())
}

/// Follows a driver to its end; Ctrl-C leaves it running and says how to come back.
async fn follow_or_detach(client: kube::Client, namespace: &str, run: &str, display: &mut Display) -> Result<ExitCode, crate::Error> {
    let end = tokio::select! {
        end = follow::follow(client, namespace, run, display) => end,
        _ = tokio::signal::ctrl_c() => {
            display.finish();
            eprintln!("detached: run {run} goes on in the cluster; `mflow attach {run}` follows it again, `mflow cancel {run}` stops it");
            return Ok(ExitCode::Interrupted);
        }
    };
    Ok(match end {
        Ok(End::Exited(code)) => code,
        Ok(End::RestartsRanOut(why)) => {
            eprintln!("mflow: the driver of run {run} was stopped (eviction or node loss) more often than its restarts allow: {why}");
            eprintln!("  help: `mflow run` again reattaches to the TrainJobs still running; [pipeline.kubernetes.driver] restarts allows more");
            ExitCode::Infra
        }
        Ok(End::NotMflow(why)) => {
            eprintln!("mflow: the driver of run {run} did not start mflow: {why}");
            eprintln!("  help: [pipeline.kubernetes] image must be an mflow image (mflow on its PATH) of this version");
            ExitCode::Infra
        }
        Err(e) => {
            let code = e.exit_code();
            eprintln!("{:?}", miette::Report::new(e));
            code
        }
    })
}

/// `mflow output SPEC STAGE [--download DIR]` where the volume is not mounted: the project is
/// uploaded as for a run (usually nothing is sent), the image's mflow answers on the volume,
/// and the output is printed as a path there or brought to `DIR`.
pub async fn output(plan: &Plan, stage: &str, set: &[String], download: Option<&Path>) -> Result<ExitCode, crate::Error> {
    let fail = |e: RemoteError| {
        let code = e.exit_code();
        eprintln!("{:?}", miette::Report::new(e));
        Ok(code)
    };
    if let Some(dir) = download.filter(|d| d.symlink_metadata().is_ok()) {
        return fail(RemoteError::Exists { dir: dir.display().to_string() });
    }
    let spec = &plan.spec;
    let kube = crate::backend::kubernetes::Kubernetes::connect_read_only(spec).await?;
    kube.check_namespace().await.map_err(crate::backend::kubernetes::KubernetesError::from)?;
    let (client, namespace) = (kube.client().clone(), kube.namespace().to_string());
    let pvc = setting(spec, "pvc").unwrap_or_else(|| mflow_kube::DEFAULT_PVC.into());
    let image = setting(spec, "image").unwrap_or_else(|| crate::backend::kubernetes::DEFAULT_IMAGE.into());
    let host_network = driver_setting(spec, "host_network").and_then(|v| v.as_bool()).unwrap_or(false);
    let bundle = match Bundle::of(plan) {
        Ok(b) => b,
        Err(e) => return fail(e.into()),
    };
    if let Err(e) = upload(&bundle, client.clone(), &namespace, &pvc, &image, host_network).await {
        return fail(e);
    }
    let pod = match VolumePod::ensure(client, &namespace, &pvc, &image, host_network).await {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let tree = bundle.tree_dir();
    let q = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut script = format!("cd {t} && MFLOW_PROJECT_ROOT={t} exec mflow --log-format json output {} {}", q(&format!("{tree}/{}", bundle.spec)), q(stage), t = q(&tree));
    for s in set {
        script.push_str(&format!(" --set {}", q(s)));
    }
    let answer = match pod.sh(&script, None).await {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    if !answer.success {
        return fail(RemoteError::InCluster { message: answer.stderr });
    }
    let max = std::env::var("MFLOW_DOWNLOAD_MAX_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(download::DEFAULT_MAX_BYTES);
    let listed = match download::Listed::parse(&String::from_utf8_lossy(&answer.stdout), max) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let Some(dir) = download else {
        println!("{}", listed.path);
        return Ok(ExitCode::Success);
    };
    let staging = records::staged_beside(dir);
    let bar = indicatif::ProgressBar::new(listed.bytes());
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_style(indicatif::ProgressStyle::with_template("download [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}").expect("a valid template"));
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let (files, bytes) = (listed.files.len(), listed.bytes());
    let got = pod.sh_into(&format!("exec tar -C {} -cf - .", q(&listed.path)), None, download::unpacker(listed, staging.clone(), bar.clone())).await;
    bar.finish_and_clear();
    let got = match got {
        Ok(o) if o.success => Ok(()),
        Ok(o) => Err(RemoteError::Receive { message: format!("tar in the volume pod failed: {}", o.stderr) }),
        Err(e) => Err(e),
    };
    let placed = got.and_then(|()| std::fs::rename(&staging, dir).map_err(|e| RemoteError::Stream { message: format!("cannot move the download to {}: {e}", dir.display()) }));
    if let Err(e) = placed {
        let _ = std::fs::remove_dir_all(&staging);
        return fail(e);
    }
    eprintln!("download: {files} files ({}), each checked against its digest", upload::human(bytes));
    println!("{}", dir.display());
    Ok(ExitCode::Success)
}

/// Connects for a command that reads runs in the cluster; its errors, and their exit codes,
/// are those of every other command (`crate::exit::for_cluster`). A namespace that does not
/// exist is said as such rather than as a namespace without runs.
pub async fn connect(namespace: Option<String>, context: Option<String>) -> Result<mflow_kube::KubeBackend, crate::Error> {
    let opts = mflow_kube::KubeOptions { namespace, context, ..Default::default() };
    let kube = mflow_kube::KubeBackend::connect(opts).await.map_err(crate::backend::kubernetes::KubernetesError::from)?;
    kube.check_namespace().await.map_err(crate::backend::kubernetes::KubernetesError::from)?;
    Ok(kube)
}

/// `mflow attach RUN`.
pub async fn attach(run: &str, namespace: Option<String>, context: Option<String>, mode: Mode) -> Result<ExitCode, crate::Error> {
    let kube = connect(namespace, context).await?;
    let mut display = Display::new(mode, &[]);
    follow_or_detach(kube.client().clone(), kube.namespace(), run, &mut display).await
}

/// `mflow cancel RUN`: the driver's engine hears SIGINT, as at a terminal, deletes its
/// TrainJobs and records the run as cancelled; a driver that is not running is deleted.
pub async fn cancel(run: &str, namespace: Option<String>, context: Option<String>) -> Result<ExitCode, crate::Error> {
    use k8s_openapi::api::core::v1::Pod;
    let kube = connect(namespace, context).await?;
    let ns = kube.namespace().to_string();
    let pods: kube::Api<Pod> = kube::Api::namespaced(kube.client().clone(), &ns);
    let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> = kube::Api::namespaced(kube.client().clone(), &ns);
    let name = driver::job_name(run);
    let err = |what: &str, e: kube::Error| match mflow_kube::KubeError::of_connection(&e, kube.target()) {
        Some(k) => crate::Error::Cluster(k.into()),
        None => crate::Error::usage(format!("cannot {what}: {}", mflow_kube::describe(&e)), "check the rights on pods/exec and Jobs in the namespace"),
    };
    if jobs.get_opt(&name).await.map_err(|e| err("read the driver Job", e))?.is_none() {
        let e = RemoteError::NoRun { run: run.into(), namespace: ns };
        let code = e.exit_code();
        eprintln!("{:?}", miette::Report::new(e));
        return Ok(code);
    }
    let listed = pods.list(&kube::api::ListParams::default().labels(&format!("job-name={name}"))).await.map_err(|e| err("list the driver's pods", e))?;
    let running = listed.items.iter().find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") && p.metadata.deletion_timestamp.is_none());
    if let Some(p) = running {
        let pod = p.metadata.name.clone().unwrap_or_default();
        let ap = kube::api::AttachParams::default().container(driver::CONTAINER).stdout(false).stderr(true);
        let mut proc = pods.exec(&pod, ["sh", "-c", "kill -INT 1"], &ap).await.map_err(|e| err("signal the driver", e))?;
        let status = proc.take_status();
        let _ = proc.join().await;
        if let Some(s) = status {
            if let Some(st) = s.await.filter(|st| st.status.as_deref() != Some("Success")) {
                return Err(crate::Error::usage(format!("cannot signal the driver pod {pod}: {}", st.message.unwrap_or_default()), "the image needs sh; `kubectl delete job` stops the driver without cancelling its TrainJobs"));
            }
        }
        eprintln!("run {run}: cancelling (the driver stops its stages and deletes their TrainJobs)");
        let mut display = Display::new(Mode::detect(false), &[]);
        let end = tokio::time::timeout(std::time::Duration::from_secs(180), follow::follow(kube.client().clone(), &ns, run, &mut display)).await;
        return Ok(match end {
            Ok(Ok(End::Exited(ExitCode::Cancelled))) => {
                eprintln!("run {run} cancelled");
                ExitCode::Success
            }
            Ok(Ok(End::Exited(code))) if code != ExitCode::Cancelled => {
                eprintln!("run {run} ended before the cancel took effect (exit {})", code.code());
                ExitCode::Success
            }
            _ => {
                eprintln!("mflow: run {run} did not end within 3 minutes of the cancel");
                ExitCode::Infra
            }
        });
    }
    let dp = kube::api::DeleteParams { propagation_policy: Some(kube::api::PropagationPolicy::Background), ..Default::default() };
    jobs.delete(&name, &dp).await.map_err(|e| err("delete the driver Job", e))?;
    eprintln!("run {run}: its driver was not running; job/{name} deleted");
    Ok(ExitCode::Success)
}
