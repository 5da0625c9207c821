//! `mflow output SPEC STAGE [--download DIR]` where the artifact volume is not mounted.

use std::path::Path;

use super::upload::{self, Bundle};
use super::volume::VolumePod;
use super::{download, driver_setting, records, setting, RemoteError};
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
) -> Result<ExitCode, crate::Error> {
    let fail = |e: RemoteError| {
        let code = e.exit_code();
        crate::errln!("{:?}", miette::Report::new(e));
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
    if let Err(e) = super::upload(&bundle, client.clone(), &namespace, &pvc, &image, host_network).await {
        return fail(e);
    }
    let pod = match VolumePod::ensure(client, &namespace, &pvc, &image, host_network).await {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let tree = bundle.tree_dir();
    let q = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut script = format!(
        "cd {t} && MFLOW_PROJECT_ROOT={t} exec mflow --log-format json output {} {}",
        q(&format!("{tree}/{}", bundle.spec)),
        q(stage),
        t = q(&tree)
    );
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
    let max = crate::settings::bytes(mflow_contract::vars::DOWNLOAD_MAX_BYTES, download::DEFAULT_MAX_BYTES)
        .unwrap_or(download::DEFAULT_MAX_BYTES);
    let listed = match download::Listed::parse(&String::from_utf8_lossy(&answer.stdout), max) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let Some(dir) = download else {
        crate::outln!("{}", listed.path);
        return Ok(ExitCode::Success);
    };
    let staging = records::staged_beside(dir);
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
            download::unpacker(listed, staging.clone(), bar.clone()),
        )
        .await;
    bar.finish_and_clear();
    let got = match got {
        Ok(o) if o.success => Ok(()),
        Ok(o) => Err(RemoteError::Receive { message: format!("tar in the volume pod failed: {}", o.stderr) }),
        Err(e) => Err(e),
    };
    let placed = got.and_then(|()| {
        std::fs::rename(&staging, dir)
            .map_err(|e| RemoteError::Stream { message: format!("cannot move the download to {}: {e}", dir.display()) })
    });
    if let Err(e) = placed {
        let _ = std::fs::remove_dir_all(&staging);
        return fail(e);
    }
    crate::errln!("download: {files} files ({}), each checked against its digest", upload::human(bytes));
    crate::outln!("{}", dir.display());
    Ok(ExitCode::Success)
}
