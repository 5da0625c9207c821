//! `mflow output SPEC STAGE [--download DIR]` where the artifact volume is not mounted.

use std::path::Path;

use super::upload::{self, Bundle};
use super::volume::VolumePod;
use super::{download, driver_setting, setting, RemoteError};
use crate::exit::ExitCode;
use crate::plan::Plan;

/// `mflow output SPEC STAGE [--download DIR]` where the volume is not mounted: the project is
/// uploaded as for a run (usually nothing is sent), the image's mflow answers on the volume,
/// and the output is printed as a path there or brought to `DIR`.
pub async fn output(
    plan: &Plan,
    stage: &str,
    set: &[String],
    download: Option<&Path>,
    json: bool,
) -> Result<ExitCode, crate::Error> {
    if let Some(dir) = download.filter(|d| d.symlink_metadata().is_ok()) {
        return Ok(fail(RemoteError::Exists { dir: dir.display().to_string() }));
    }
    let (pod, stdout) = match in_volume_pod(plan, "output", stage, set).await? {
        Ok(answer) => answer,
        Err(e) => return Ok(fail(e)),
    };
    let max = crate::settings::bytes(mflow_contract::vars::DOWNLOAD_MAX_BYTES, download::DEFAULT_MAX_BYTES)
        .unwrap_or(download::DEFAULT_MAX_BYTES);
    let listed = match download::Listed::parse(&String::from_utf8_lossy(&stdout), max) {
        Ok(l) => l,
        Err(e) => return Ok(fail(e)),
    };
    let Some(dir) = download else {
        if json {
            let answer = serde_json::json!({"path": listed.path, "digest": listed.digest, "files": listed.files});
            crate::outln!("{answer}");
        } else {
            crate::outln!("{}", listed.path);
        }
        return Ok(ExitCode::Success);
    };
    // The staging every command that writes an output directory uses (`mflow_untrusted::staging`):
    // a signal removes it (`cli::tools::remove_staging_on_signals`).
    let staging = match mflow_untrusted::staging::Staging::create(dir) {
        Ok(s) => s,
        Err(e) => return Ok(fail(RemoteError::Stream { message: format!("cannot create {e}") })),
    };
    let bar = indicatif::ProgressBar::new(listed.bytes());
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_style(
            indicatif::ProgressStyle::with_template("download [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
                .expect("a valid template"),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let (files, bytes) = (listed.files.len(), listed.bytes());
    let got = pod
        .sh_into(
            &format!("exec tar -C {} -cf - .", q(&listed.path)),
            None,
            download::unpacker(listed, staging.path().to_path_buf(), bar.clone()),
        )
        .await;
    bar.finish_and_clear();
    let got = match got {
        Ok(o) if o.success => Ok(()),
        Ok(o) => Err(RemoteError::Receive { message: format!("tar in the volume pod failed: {}", o.stderr) }),
        Err(e) => Err(e),
    };
    // Dropped uncommitted, the staging directory is removed.
    let placed = got.and_then(|()| {
        staging.commit().map_err(|e| RemoteError::Stream {
            message: format!("cannot move the download to {}: {}", dir.display(), e.source),
        })
    });
    if let Err(e) = placed {
        return Ok(fail(e));
    }
    crate::errln!("download: {files} files ({}), each checked against its digest", upload::human(bytes));
    crate::outln!("{}", dir.display());
    Ok(ExitCode::Success)
}

/// Largest answer of `mflow metrics show` brought back: a stage's metric lines and summary.
const MAX_METRICS_BYTES: usize = 256 << 20;

/// `mflow metrics show SPEC STAGE` where the volume is not mounted: the image's mflow answers
/// in the volume pod, with one JSON document, which is passed on (or said as text).
pub async fn metrics(plan: &Plan, stage: &str, set: &[String], json: bool) -> Result<ExitCode, crate::Error> {
    let (_, stdout) = match in_volume_pod(plan, "metrics show", stage, set).await? {
        Ok(answer) => answer,
        Err(e) => return Ok(fail(e)),
    };
    let parsed = (stdout.len() <= MAX_METRICS_BYTES)
        .then(|| mflow_untrusted::json::parse(&stdout).ok())
        .flatten()
        .filter(serde_json::Value::is_object);
    let Some(answer) = parsed else {
        let message =
            format!("`mflow metrics show` in the volume pod gave no answer mflow reads ({} bytes)", stdout.len());
        return Ok(fail(RemoteError::Stream { message }));
    };
    if json {
        crate::outln!("{answer}");
        return Ok(ExitCode::Success);
    }
    crate::outln!("{}", answer["path"].as_str().unwrap_or_default());
    match answer["run"].as_str() {
        Some(run) => crate::outln!("run {run}: {} metric lines", answer["series"].as_array().map_or(0, Vec::len)),
        None => crate::outln!("no recorded run on the volume committed this output: no metric lines"),
    }
    for (k, v) in answer["summary"].as_object().into_iter().flatten() {
        if v.is_number() || v.is_string() || v.is_boolean() {
            crate::outln!("{k} = {v}");
        }
    }
    Ok(ExitCode::Success)
}

/// Says a failure of the cluster's side and returns its exit code.
fn fail(e: RemoteError) -> ExitCode {
    let code = e.exit_code();
    crate::errln!("{:?}", miette::Report::new(e));
    code
}

/// Runs `mflow --output-format json COMMAND SPEC STAGE --set ...` of the image in the volume
/// pod, on the project as uploaded for a run (usually nothing is sent), and returns the pod and
/// what the command printed. The outer error is the engine's (the cluster cannot be reached),
/// the inner one the cluster's side.
async fn in_volume_pod(
    plan: &Plan,
    command: &str,
    stage: &str,
    set: &[String],
) -> Result<Result<(VolumePod, Vec<u8>), RemoteError>, crate::Error> {
    let spec = &plan.spec;
    let kube = crate::backend::kubernetes::Kubernetes::connect_read_only(spec).await?;
    kube.check_namespace().await.map_err(crate::backend::kubernetes::KubernetesError::from)?;
    let (client, namespace) = (kube.client().clone(), kube.namespace().to_string());
    let pvc = setting(spec, "pvc").unwrap_or_else(|| mflow_kube::DEFAULT_PVC.into());
    let image = setting(spec, "image").unwrap_or_else(|| crate::backend::kubernetes::DEFAULT_IMAGE.into());
    let host_network = driver_setting(spec, "host_network").and_then(|v| v.as_bool()).unwrap_or(false);
    Ok(async {
        let bundle = Bundle::of(plan)?;
        super::upload(&bundle, client.clone(), &namespace, &pvc, &image, host_network).await?;
        let pod = VolumePod::ensure(client, &namespace, &pvc, &image, host_network).await?;
        let tree = bundle.tree_dir();
        let mut script = format!(
            "cd {t} && MFLOW_PROJECT_ROOT={t} exec mflow --output-format json {command} {} {}",
            q(&format!("{tree}/{}", bundle.spec)),
            q(stage),
            t = q(&tree)
        );
        for s in set {
            script.push_str(&format!(" --set {}", q(s)));
        }
        let answer = pod.sh(&script, None).await?;
        if !answer.success {
            return Err(RemoteError::InCluster { message: answer.stderr });
        }
        Ok((pod, answer.stdout))
    }
    .await)
}

/// `s` quoted for the volume pod's shell.
fn q(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
