//! `mflow cancel RUN` for a run started outside the cluster.

use super::events::Follower;
use super::follow::{self, End};
use super::{connect, RemoteError};
use crate::exit::ExitCode;
use crate::reporter::console::Mode;

/// `mflow cancel RUN`: the driver's engine hears SIGINT, as at a terminal, deletes its
/// TrainJobs and records the run as cancelled; a driver that is not running is deleted.
pub async fn cancel(run: &str, namespace: Option<String>, context: Option<String>) -> Result<ExitCode, crate::Error> {
    use k8s_openapi::api::core::v1::Pod;
    let kube = connect(namespace, context).await?;
    let ns = kube.namespace().to_string();
    let pods: kube::Api<Pod> = kube::Api::namespaced(kube.client().clone(), &ns);
    let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> = kube::Api::namespaced(kube.client().clone(), &ns);
    let name = mflow_kube::driver::job_name(run);
    let err = |what: &str, e: kube::Error| match mflow_kube::KubeError::of_connection(&e, kube.target()) {
        Some(k) => crate::Error::Cluster(k.into()),
        None => crate::Error::usage(
            format!("cannot {what}: {}", mflow_kube::describe(&e)),
            "check the rights on pods/exec and Jobs in the namespace",
        ),
    };
    if jobs.get_opt(&name).await.map_err(|e| err("read the driver Job", e))?.is_none() {
        let e = RemoteError::NoRun { run: run.into(), namespace: ns };
        let code = e.exit_code();
        crate::errln!("{:?}", miette::Report::new(e));
        return Ok(code);
    }
    let listed = pods
        .list(&kube::api::ListParams::default().labels(&format!("job-name={name}")))
        .await
        .map_err(|e| err("list the driver's pods", e))?;
    let running = listed.items.iter().find(|p| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") && p.metadata.deletion_timestamp.is_none()
    });
    if let Some(p) = running {
        let pod = p.metadata.name.clone().unwrap_or_default();
        let ap = kube::api::AttachParams::default().container(mflow_kube::driver::CONTAINER).stdout(false).stderr(true);
        let mut proc =
            pods.exec(&pod, ["sh", "-c", "kill -INT 1"], &ap).await.map_err(|e| err("signal the driver", e))?;
        let status = proc.take_status();
        let _ = proc.join().await;
        if let Some(s) = status {
            if let Some(st) = s.await.filter(|st| st.status.as_deref() != Some("Success")) {
                return Err(crate::Error::usage(
                    format!("cannot signal the driver pod {pod}: {}", st.message.unwrap_or_default()),
                    "the image needs sh; `kubectl delete job` stops the driver without cancelling its TrainJobs",
                ));
            }
        }
        crate::errln!("run {run}: cancelling (the driver stops its stages and deletes their TrainJobs)");
        let display = Follower::new(Mode::detect(false, false));
        let end = tokio::time::timeout(
            std::time::Duration::from_secs(180),
            follow::follow(kube.client().clone(), &ns, run, &display),
        )
        .await;
        return Ok(match end {
            Ok(Ok(End::Exited(ExitCode::Cancelled))) => {
                crate::errln!("run {run} cancelled");
                ExitCode::Success
            }
            Ok(Ok(End::Exited(code))) if code != ExitCode::Cancelled => {
                crate::errln!("run {run} ended before the cancel took effect (exit {})", code.code());
                ExitCode::Success
            }
            _ => {
                crate::errln!("mflow: run {run} did not end within 3 minutes of the cancel");
                ExitCode::Infra
            }
        });
    }
    let dp = kube::api::DeleteParams {
        propagation_policy: Some(kube::api::PropagationPolicy::Background),
        ..Default::default()
    };
    jobs.delete(&name, &dp).await.map_err(|e| err("delete the driver Job", e))?;
    crate::errln!("run {run}: its driver was not running; job/{name} deleted");
    Ok(ExitCode::Success)
}
