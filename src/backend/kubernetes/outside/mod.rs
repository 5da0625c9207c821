//! Runs started where the artifact volume is not mounted (a laptop, a notebook, a CI runner
//! with a kubeconfig): the project is uploaded to the volume, the engine runs in the cluster as
//! a driver Job, and this process follows it with the display of a local run.

mod cancel;
mod download;
mod events;
mod follow;
mod output;
pub mod records;
pub mod upload;
mod volume;

use std::collections::HashSet;

use miette::Diagnostic;
use serde_json::Value as Json;
use thiserror::Error;

use crate::exit::ExitCode;
use crate::plan::Plan;
use crate::reporter::console::Mode;
pub use cancel::cancel;
pub use download::relative;
use events::Follower;
use follow::End;
pub use output::{metrics, output};
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
    #[diagnostic(
        code(mflow::remote::receive),
        help("check the claim's free space and that the image has sh, tar and mv")
    )]
    Receive { message: String },
    #[error("cannot read what the volume sent: {message}")]
    #[diagnostic(code(mflow::remote::stream), help("check the free space where it is written, and try again"))]
    Stream { message: String },
    #[error("the output is {size}, more than the download bound of {max}")]
    #[diagnostic(
        code(mflow::remote::too_large),
        help("set MFLOW_DOWNLOAD_MAX_BYTES to allow more, or read it where the volume is mounted")
    )]
    TooLarge { size: String, max: String },
    #[error("{dir} exists")]
    #[diagnostic(
        code(mflow::remote::exists),
        help("download into a directory that does not exist yet: it appears when the whole output has arrived")
    )]
    Exists { dir: String },
    #[error("{message}")]
    #[diagnostic(code(mflow::remote::in_cluster))]
    InCluster { message: String },
    #[error("no run {run} in namespace {namespace}")]
    #[diagnostic(
        code(mflow::remote::no_run),
        help("`kubectl get jobs -l mflow.dev/component=driver` lists the runs started from outside the cluster")
    )]
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
            RemoteError::Upload(_)
            | RemoteError::Image { .. }
            | RemoteError::NotMflowImage { .. }
            | RemoteError::NoRun { .. }
            | RemoteError::TooLarge { .. }
            | RemoteError::Exists { .. }
            | RemoteError::InCluster { .. } => ExitCode::Invalid,
            _ => ExitCode::Infra,
        }
    }
}

fn setting(spec: &crate::spec::Spec, key: &str) -> Option<String> {
    spec.pipeline.kubernetes.get(key).and_then(Json::as_str).map(str::to_string)
}

fn driver_setting(spec: &crate::spec::Spec, key: &str) -> Option<Json> {
    spec.pipeline.kubernetes.get("driver")?.get(key).cloned()
}

/// `mflow run SPEC --backend kubernetes` from outside the cluster.
/// How a run from outside the cluster goes, as `mflow run` was asked.
pub struct RunOptions {
    pub overrides: Vec<String>,
    pub jobs: Option<usize>,
    pub force: Vec<String>,
    pub verify: bool,
    /// Start the driver and return, printing the run's id.
    pub detach: bool,
    pub mode: Mode,
}

pub async fn run(plan: Plan, args: &RunOptions) -> Result<ExitCode, crate::Error> {
    let (detach, mode) = (args.detach, args.mode);
    let fail = |e: RemoteError| {
        let code = e.exit_code();
        crate::errln!("{:?}", miette::Report::new(e));
        Ok(code)
    };
    // The preflight of a run in the cluster: Trainer, runtimes, the claim, and the rights of a
    // machine outside it; the driver checks the engine's rights when it starts.
    let kube = match crate::backend::kubernetes::Kubernetes::connect_for(&plan, mflow_kube::rbac::OUTSIDE).await {
        Ok(k) => k,
        Err(e) => {
            let code = crate::exit::for_cluster(&e);
            let person = match &e {
                crate::backend::kubernetes::KubernetesError::Kube(mflow_kube::KubeError::Forbidden {
                    rbac_namespace,
                    ..
                }) => Some(rbac_namespace.clone()),
                _ => None,
            };
            crate::errln!("{:?}", miette::Report::new(e));
            if let Some(ns) = person {
                crate::errln!("  from outside the cluster, a person gets these rights from `mflow kube rbac --namespace {ns} --user NAME`");
            }
            return Ok(code);
        }
    };
    let client = kube.backend().client().clone();
    let namespace = kube.backend().namespace().to_string();
    let spec = &plan.spec;
    let pvc = setting(spec, "pvc").unwrap_or_else(|| mflow_kube::DEFAULT_PVC.into());
    let image = setting(spec, "image").unwrap_or_else(|| crate::backend::kubernetes::DEFAULT_IMAGE.into());
    let service_account = driver_setting(spec, "service_account")
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "mflow".into());
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
    let d = mflow_kube::driver::DriverOptions {
        run: run.clone(),
        pipeline: spec.pipeline.name.clone(),
        image,
        pvc,
        service_account,
        project: bundle.tree_dir(),
        spec: bundle.spec.clone(),
        workdir: spec.workdir().display().to_string(),
        overrides: args.overrides.clone(),
        jobs: args.jobs,
        force: args.force.clone(),
        verify: args.verify,
        restarts: driver_setting(spec, "restarts")
            .and_then(|v| v.as_i64())
            .map(|n| n.clamp(0, 100) as i32)
            .unwrap_or(mflow_kube::driver::DEFAULT_RESTARTS),
        host_network,
        env: driver_setting(spec, "env")
            .and_then(|v| v.as_object().cloned())
            .map(|m| m.into_iter().filter_map(|(k, v)| Some((k, v.as_str()?.to_string()))).collect())
            .unwrap_or_default(),
    };
    let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> = kube::Api::namespaced(client.clone(), &namespace);
    if let Err(e) = jobs.create(&Default::default(), &mflow_kube::driver::job(&d)).await {
        return fail(kube.backend().error(e, "create", "jobs", &mflow_kube::driver::job_name(&run)).into());
    }
    crate::errln!("run {run}: driver job/{} in namespace {namespace}", mflow_kube::driver::job_name(&run));
    if detach {
        crate::outln!("{run}");
        crate::errln!("`mflow attach {run}` follows it, `mflow cancel {run}` stops it");
        return Ok(ExitCode::Success);
    }
    let display = Follower::new(mode);
    follow_or_detach(client, &namespace, &run, &display).await
}

/// Sends what the volume lacks; says what it sent.
async fn upload(
    bundle: &Bundle,
    client: kube::Client,
    namespace: &str,
    pvc: &str,
    image: &str,
    host_network: bool,
) -> Result<(), RemoteError> {
    let pod = VolumePod::ensure(client, namespace, pvc, image, host_network).await?;
    check_image(&pod, image).await?;
    let probe = pod.quick(&bundle.probe_script()).await?;
    let listed = String::from_utf8_lossy(&probe.stdout).to_string();
    let mut lines = listed.lines().peekable();
    if lines.peek() == Some(&"tree") {
        crate::errln!("upload: nothing to send, the project is on the volume ({} files)", bundle.files.len());
        return Ok(());
    }
    let present: HashSet<String> = lines.map(str::to_string).collect();
    let missing: Vec<upload::File> = bundle.missing(&present).into_iter().cloned().collect();
    let max = crate::settings::bytes(mflow_contract::vars::UPLOAD_MAX_BYTES, upload::DEFAULT_MAX_BYTES)
        .unwrap_or(upload::DEFAULT_MAX_BYTES);
    let total = Bundle::check_size(&missing.iter().collect::<Vec<_>>(), max)?;
    let bar = indicatif::ProgressBar::new(total);
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_style(
            indicatif::ProgressStyle::with_template("upload [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
                .expect("a valid template"),
        );
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
            if failed {
                Err(std::io::Error::other("upload stream"))
            } else {
                Ok(())
            }
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
    crate::errln!("upload: sent {sent_files} of {} files ({})", bundle.files.len(), upload::human(total));
    Ok(())
}

/// The driver runs the image's mflow: one that is missing fails here, before anything is
/// sent; another version than this one is said, since the run is the image's.
async fn check_image(pod: &VolumePod, image: &str) -> Result<(), RemoteError> {
    let out = pod.quick("exec mflow --version").await?;
    let theirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.success || !theirs.starts_with("mflow ") {
        return Err(RemoteError::NotMflowImage {
            image: image.to_string(),
            message: if out.stderr.is_empty() { theirs } else { out.stderr },
        });
    }
    let ours = format!("mflow {}", env!("CARGO_PKG_VERSION"));
    if theirs != ours {
        crate::errln!("warning: the image {image} has {theirs} and this is {ours}; the run is the image's");
    }
    Ok(())
}

/// Follows a driver to its end; Ctrl-C leaves it running and says how to come back.
async fn follow_or_detach(
    client: kube::Client,
    namespace: &str,
    run: &str,
    display: &Follower,
) -> Result<ExitCode, crate::Error> {
    let end = tokio::select! {
        end = follow::follow(client, namespace, run, display) => end,
        _ = tokio::signal::ctrl_c() => {
            display.finish();
            crate::errln!("detached: run {run} goes on in the cluster; `mflow attach {run}` follows it again, `mflow cancel {run}` stops it");
            return Ok(ExitCode::Interrupted);
        }
    };
    Ok(match end {
        Ok(End::Exited(code)) => code,
        Ok(End::RestartsRanOut(why)) => {
            crate::errln!("mflow: the driver of run {run} was stopped (eviction or node loss) more often than its restarts allow: {why}");
            crate::errln!("  help: `mflow run` again reattaches to the TrainJobs still running; [pipeline.kubernetes.driver] restarts allows more");
            ExitCode::Infra
        }
        Ok(End::NotMflow(why)) => {
            crate::errln!("mflow: the driver of run {run} did not start mflow: {why}");
            crate::errln!(
                "  help: [pipeline.kubernetes] image must be an mflow image (mflow on its PATH) of this version"
            );
            ExitCode::Infra
        }
        Err(e) => {
            let code = e.exit_code();
            crate::errln!("{:?}", miette::Report::new(e));
            code
        }
    })
}

/// Connects for a command that reads runs in the cluster; its errors, and their exit codes,
/// are those of every other command (`crate::exit::for_cluster`). A namespace that does not
/// exist is said as such rather than as a namespace without runs.
pub async fn connect(
    namespace: Option<String>,
    context: Option<String>,
) -> Result<mflow_kube::KubeBackend, crate::Error> {
    let opts = mflow_kube::KubeOptions { namespace, context, ..Default::default() };
    let kube =
        mflow_kube::KubeBackend::connect(opts).await.map_err(crate::backend::kubernetes::KubernetesError::from)?;
    kube.check_namespace().await.map_err(crate::backend::kubernetes::KubernetesError::from)?;
    Ok(kube)
}

/// `mflow attach RUN`.
pub async fn attach(
    run: &str,
    namespace: Option<String>,
    context: Option<String>,
    mode: Mode,
) -> Result<ExitCode, crate::Error> {
    let kube = connect(namespace, context).await?;
    let display = Follower::new(mode);
    follow_or_detach(kube.client().clone(), kube.namespace(), run, &display).await
}
