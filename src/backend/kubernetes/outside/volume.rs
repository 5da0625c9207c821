//! Commands in a volume pod (`mflow_kube::volume`), for what a machine outside the cluster must
//! do on the volume: upload a project, read run records and outputs. They run through exec, as
//! `kubectl cp` does.

use std::time::{Duration, Instant};

use futures::{AsyncBufReadExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, ListParams, PostParams};
use mflow_kube::volume::{VolumePodOptions, CONTAINER, LIFETIME_S};
use tokio::io::AsyncReadExt;

use super::RemoteError;

/// A pod this close to its deadline is not reused.
const REUSE_MARGIN_S: i64 = 600;

pub struct VolumePod {
    client: kube::Client,
    pods: Api<Pod>,
    namespace: String,
    pub name: String,
}

/// What a command in the pod printed, and how it ended.
/// How long a command that answers at once may take, and how often it is asked.
const QUICK_EXEC: Duration = Duration::from_secs(30);
const QUICK_EXEC_ATTEMPTS: u32 = 3;

pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: String,
    pub success: bool,
}

impl VolumePod {
    /// A running volume pod of this image and claim: an existing one, else a new one.
    pub async fn ensure(
        client: kube::Client,
        namespace: &str,
        pvc: &str,
        image: &str,
        host_network: bool,
    ) -> Result<VolumePod, RemoteError> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let call = |verb: &'static str| move |e: kube::Error| RemoteError::call(format!("{verb} the volume pod"), &e);
        let listed =
            pods.list(&ListParams::default().labels(mflow_kube::volume::SELECTOR)).await.map_err(call("list"))?;
        let now = k8s_openapi::jiff::Timestamp::now();
        for p in listed.items {
            let fresh = p
                .metadata
                .creation_timestamp
                .as_ref()
                .is_some_and(|t| now.as_second() - t.0.as_second() < LIFETIME_S - REUSE_MARGIN_S);
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                && p.metadata.deletion_timestamp.is_none();
            if fresh && running && mflow_kube::volume::serves(&p, image, pvc) {
                return Ok(VolumePod {
                    client,
                    pods,
                    namespace: namespace.to_string(),
                    name: p.metadata.name.unwrap_or_default(),
                });
            }
        }
        let name = format!("mflow-volume-{:08x}", fastrand::u32(..));
        let pod = mflow_kube::volume::pod(&VolumePodOptions {
            name: name.clone(),
            image: image.to_string(),
            pvc: pvc.to_string(),
            host_network,
        });
        pods.create(&PostParams::default(), &pod).await.map_err(call("create"))?;
        let vp = VolumePod { client, pods, namespace: namespace.to_string(), name };
        vp.wait_running(image, pvc).await?;
        Ok(vp)
    }

    async fn wait_running(&self, image: &str, pvc: &str) -> Result<(), RemoteError> {
        let t0 = Instant::now();
        let mut last = String::new();
        while t0.elapsed() < Duration::from_secs(300) {
            let p = self.pods.get(&self.name).await.map_err(|e| RemoteError::call("read the volume pod", &e))?;
            let status = p.status.unwrap_or_default();
            if status.phase.as_deref() == Some("Running") {
                return Ok(());
            }
            for c in status.container_statuses.iter().flatten() {
                if let Some(w) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) {
                    let reason = w.reason.clone().unwrap_or_default();
                    if matches!(
                        reason.as_str(),
                        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull"
                    ) {
                        let _ = self.delete().await;
                        return Err(RemoteError::Image {
                            image: image.to_string(),
                            reason: format!("{reason}: {}", w.message.clone().unwrap_or_default()),
                        });
                    }
                    if reason != last {
                        crate::errln!("volume pod {}: {reason}", self.name);
                    }
                    last = reason;
                }
            }
            if let Some(c) =
                status.conditions.iter().flatten().find(|c| c.type_ == "PodScheduled" && c.status == "False")
            {
                last = c.message.clone().unwrap_or_else(|| "unschedulable".into());
                if t0.elapsed() > Duration::from_secs(10) {
                    self.check_claim(pvc).await?;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let _ = self.delete().await;
        let reason = if last.is_empty() { "not scheduled".to_string() } else { last };
        Err(RemoteError::NotStarted { what: format!("volume pod {} (claim {pvc})", self.name), reason })
    }

    /// A claim that waits for a volume no one will provision: it names no StorageClass, so
    /// none was the default when it was made, and only a PersistentVolume made for it by hand
    /// can bind it.
    async fn check_claim(&self, pvc: &str) -> Result<(), RemoteError> {
        let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
            Api::namespaced(self.client.clone(), &self.namespace);
        let Ok(Some(claim)) = claims.get_opt(pvc).await else { return Ok(()) };
        let pending = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
        let class = claim.spec.as_ref().and_then(|s| s.storage_class_name.clone());
        if pending && class.is_none() {
            let _ = self.delete().await;
            return Err(RemoteError::ClaimUnbound { pvc: pvc.to_string() });
        }
        Ok(())
    }

    pub async fn delete(&self) -> Result<(), kube::Error> {
        self.pods.delete(&self.name, &Default::default()).await.map(|_| ())
    }

    /// Runs `sh -c script` in the pod and collects what it prints; `stdin`, when given, is
    /// written by the callback from a blocking thread (a tar stream is written with
    /// `std::io::Write`).
    pub async fn sh(&self, script: &str, stdin: Option<Writer>) -> Result<Output, RemoteError> {
        let (read, collected) = collector();
        let mut out = self.sh_into(script, stdin, read).await?;
        out.stdout = std::mem::take(&mut *collected.lock().unwrap());
        Ok(out)
    }

    /// `sh` of a command that answers at once (a version, a listing). An exec whose stream the
    /// node dropped as it opened is never closed towards mflow (seen right after a pod started),
    /// so an answer that does not come within [`QUICK_EXEC`] is asked for again, twice at most.
    pub async fn quick(&self, script: &str) -> Result<Output, RemoteError> {
        for attempt in 1..=QUICK_EXEC_ATTEMPTS {
            let (read, collected) = collector();
            if let Some(mut out) = self.exec(script, None, read, Some(QUICK_EXEC)).await? {
                out.stdout = std::mem::take(&mut *collected.lock().unwrap());
                return Ok(out);
            }
            tracing::debug!(pod = %self.name, attempt, "no answer from an exec; asking again");
        }
        Err(RemoteError::Kube {
            what: format!("exec in the volume pod {}", self.name),
            message: format!(
                "no answer within {}s, {QUICK_EXEC_ATTEMPTS} times (the node did not run the command)",
                QUICK_EXEC.as_secs()
            ),
        })
    }

    /// `sh`, with stdout handed to `stdout` as it comes, on a blocking thread: a log that is
    /// followed, a tar stream that is unpacked. When `stdout` returns early the stream is closed.
    pub async fn sh_into(&self, script: &str, stdin: Option<Writer>, stdout: Reader) -> Result<Output, RemoteError> {
        Ok(self.exec(script, stdin, stdout, None).await?.expect("no deadline"))
    }

    /// The exec behind `sh`: `None` when `deadline` passed first (the command is stopped).
    async fn exec(
        &self,
        script: &str,
        stdin: Option<Writer>,
        stdout: Reader,
        deadline: Option<Duration>,
    ) -> Result<Option<Output>, RemoteError> {
        let ap = AttachParams::default().container(CONTAINER).stdin(stdin.is_some()).stdout(true).stderr(true);
        let mut proc = self
            .pods
            .exec(&self.name, ["sh", "-c", script], &ap)
            .await
            .map_err(|e| RemoteError::call(format!("exec in the volume pod {}", self.name), &e))?;
        let status = proc.take_status();
        let out = proc.stdout().expect("stdout was requested");
        let mut stderr = proc.stderr().expect("stderr was requested");
        let writer = match (stdin, proc.stdin()) {
            (Some(write), Some(w)) => Some(tokio::task::spawn_blocking(move || {
                let mut sync = tokio_util::io::SyncIoBridge::new(w);
                let r = write(&mut sync);
                let _ = std::io::Write::flush(&mut sync);
                let _ = sync.shutdown();
                r
            })),
            _ => None,
        };
        let reader = tokio::task::spawn_blocking(move || {
            let mut sync = tokio_util::io::SyncIoBridge::new(out);
            let r = stdout(&mut sync);
            // Whatever the callback left unread is drained, so that the command can end.
            if r.is_ok() {
                let _ = std::io::copy(&mut sync, &mut std::io::sink());
            }
            r
        });
        let err = async {
            let mut b = Vec::new();
            // A bounded stderr: a command that prints megabytes of errors is quoted in part.
            let _ = (&mut stderr).take(1 << 20).read_to_end(&mut b).await;
            b
        };
        let ended = async { tokio::join!(reader, err) };
        let (read, err) = match deadline {
            None => ended.await,
            Some(d) => match tokio::time::timeout(d, ended).await {
                Ok(both) => both,
                Err(_) => {
                    // Ends the streams, and with them the blocking reader.
                    proc.abort();
                    return Ok(None);
                }
            },
        };
        let read = read.map_err(|e| std::io::Error::other(e.to_string())).and_then(|r| r);
        let sent = match writer {
            Some(h) => h.await.map_err(|e| std::io::Error::other(e.to_string())).and_then(|r| r),
            None => Ok(()),
        };
        let st = match (&read, status) {
            (Ok(()), Some(s)) => s.await,
            _ => None,
        };
        drop(stderr);
        let _ = proc.join().await;
        let stderr = String::from_utf8_lossy(&err).trim().to_string();
        let with_stderr = |e: std::io::Error| if stderr.is_empty() { e.to_string() } else { format!("{e}: {stderr}") };
        if let Err(e) = sent {
            return Err(RemoteError::Kube { what: "send the upload stream".into(), message: with_stderr(e) });
        }
        if let Err(e) = read {
            return Err(RemoteError::Stream { message: with_stderr(e) });
        }
        let success = st.as_ref().is_some_and(|s| s.status.as_deref() == Some("Success"));
        Ok(Some(Output { stdout: Vec::new(), stderr, success }))
    }
}

/// A reader that keeps what a command prints, and where it keeps it.
fn collector() -> (Reader, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    let collected = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = collected.clone();
    (Box::new(move |r: &mut dyn std::io::Read| r.read_to_end(&mut sink.lock().unwrap()).map(|_| ())), collected)
}

/// Writes a command's stdin, on a blocking thread.
pub type Writer = Box<dyn FnOnce(&mut dyn std::io::Write) -> std::io::Result<()> + Send>;
/// Reads a command's stdout, on a blocking thread.
pub type Reader = Box<dyn FnOnce(&mut dyn std::io::Read) -> std::io::Result<()> + Send>;

/// Lines of a pod's log as they come, until the container ends.
pub async fn follow_log(
    pods: &Api<Pod>,
    name: &str,
    container: &str,
    mut each: impl FnMut(&str),
) -> Result<(), kube::Error> {
    let lp = kube::api::LogParams { follow: true, container: Some(container.to_string()), ..Default::default() };
    let stream = pods.log_stream(name, &lp).await?;
    let mut lines = stream.lines();
    while let Some(line) = lines.try_next().await.map_err(|e| kube::Error::Service(Box::new(e)))? {
        each(&line);
    }
    Ok(())
}
