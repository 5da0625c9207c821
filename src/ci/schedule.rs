//! `[schedule]`: a spec run on a cron schedule in a cluster. The objects (a CronJob that runs
//! `mflow run` on the spec, shipped in a ConfigMap, with its workdir on the artifacts PVC, and a
//! ServiceAccount with least-privilege RBAC) are built by `mflow_kube::schedule`; this module
//! checks the spec's `[schedule]` and fills their options. `mflow schedule apply` applies the
//! same objects with server-side apply.

use serde_json::{Map, Value as Json};

use super::CiError;
use crate::spec::Spec;

pub use mflow_kube::schedule::{object_name, Objects};

fn names_kubernetes_takes(namespace: &str, service_account: &str) -> Result<(), CiError> {
    let refused = |e: mflow_kube::KubeError| {
        let help = miette::Diagnostic::help(&e).map(|h| h.to_string()).unwrap_or_default();
        CiError::Schedule { message: e.to_string(), help }
    };
    mflow_kube::check_namespace(namespace).map_err(refused)?;
    mflow_kube::check_service_account(service_account).map_err(refused)
}

pub fn render(spec: &Spec, namespace: &str) -> Result<Objects, CiError> {
    let sched = spec.schedule.as_ref().ok_or_else(|| CiError::Schedule {
        message: "the spec has no [schedule] section".into(),
        help: "add [schedule] with cron = \"0 3 * * *\"".into(),
    })?;
    let cron = str_of(sched, "cron").unwrap_or_default();
    check_cron(&cron)?;
    let time_zone = str_of(sched, "timezone");
    if let Some(tz) = &time_zone {
        // The controller loads the zone by its exact name: `europe/berlin` is no zone there.
        let found = jiff::tz::TimeZone::get(tz).ok();
        let named = found.as_ref().and_then(|z| z.iana_name()).map(str::to_string);
        if named.as_deref() != Some(tz.as_str()) {
            let help = match named {
                Some(name) => format!("names are case-sensitive: write \"{name}\""),
                None => "use a name like \"Europe/Berlin\" or \"UTC\"".into(),
            };
            return Err(CiError::Schedule { message: format!("timezone `{tz}` is not an IANA time zone"), help });
        }
    }
    let service_account = str_of(sched, "service_account").unwrap_or_else(|| "mflow".into());
    names_kubernetes_takes(namespace, &service_account)?;
    let deadline = match str_of(sched, "starting_deadline") {
        Some(d) => humantime::parse_duration(&d)
            .map_err(|e| CiError::Schedule {
                message: format!("starting_deadline `{d}`: {e}"),
                help: "write a duration such as \"1h\"".into(),
            })?
            .as_secs() as i64,
        None => 3600,
    };
    let suspend = sched.get("suspend").and_then(Json::as_bool).unwrap_or(false);
    let secret = str_of(sched, "secret");
    webhook_reaches_the_cron_job(spec, secret.as_deref())?;
    let k = &spec.pipeline.kubernetes;
    let pvc = k.get("pvc").and_then(Json::as_str).unwrap_or(mflow_kube::DEFAULT_PVC).to_string();
    let image = k
        .get("image")
        .and_then(Json::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| crate::backend::kubernetes::DEFAULT_TRAIN_IMAGE.into());
    let file = spec.path.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_else(|| "spec.toml".into());
    Ok(mflow_kube::schedule::objects(&mflow_kube::schedule::ScheduleOptions {
        pipeline: spec.pipeline.name.clone(),
        namespace: namespace.to_string(),
        service_account,
        pvc,
        image,
        cron,
        time_zone,
        starting_deadline_s: deadline,
        suspend,
        spec_file: file,
        spec_source: spec.source.to_string(),
        secret,
    }))
}

/// The spec is shipped in a ConfigMap, which anyone who may read the namespace's ConfigMaps
/// reads: a webhook URL (a secret) must come from a Secret instead, as `env:NAME` with NAME
/// among the keys of `[schedule] secret`.
fn webhook_reaches_the_cron_job(spec: &Spec, secret: Option<&str>) -> Result<(), CiError> {
    let Some(webhook) = spec.notify.as_ref().and_then(|n| str_of(n, "webhook")) else { return Ok(()) };
    match (webhook.strip_prefix("env:"), secret) {
        (Some(_), Some(_)) => Ok(()),
        (Some(var), None) => Err(CiError::Schedule {
            message: format!("[notify] webhook reads {var}, which the CronJob's run would not have"),
            help: format!("name a Secret holding the key {var} in [schedule] secret = \"NAME\": its keys become the run's environment"),
        }),
        (None, _) => Err(CiError::Schedule {
            message: "[notify] webhook: a scheduled spec is stored in a ConfigMap, which would hold the webhook's URL in the clear".into(),
            help: "write webhook = \"env:MFLOW_WEBHOOK\", keep the URL in a Secret under that key (kubectl create secret generic NAME --from-literal=MFLOW_WEBHOOK=URL), and set [schedule] secret = \"NAME\"".into(),
        }),
    }
}

fn str_of(t: &Map<String, Json>, k: &str) -> Option<String> {
    t.get(k).and_then(Json::as_str).map(str::to_string)
}

/// Five fields of standard cron, or a descriptor such as @daily, as the CronJob controller reads
/// them ([`super::cron`]).
pub fn check_cron(cron: &str) -> Result<(), CiError> {
    match super::cron::problem(cron) {
        None => Ok(()),
        Some(why) => Err(CiError::Schedule {
            message: format!("cron `{cron}`: {why}"),
            help: "write five fields: minute hour day-of-month month day-of-week (0-6, Sunday is 0), e.g. \"0 3 * * *\", or @hourly/@daily/@weekly/@monthly/@yearly or @every 1h".into(),
        }),
    }
}

/// Applies every object with server-side apply (field manager "mflow").
pub async fn apply(objects: &Objects, client: kube::Client, namespace: &str) -> Result<Vec<String>, CiError> {
    mflow_kube::schedule::apply(objects, client, namespace).await.map_err(|message| CiError::Kube {
        message,
        help: "check the kubeconfig context and that you may create ServiceAccounts, RBAC objects, ConfigMaps and CronJobs in the namespace".into(),
    })
}

/// A client for the spec's [pipeline.kubernetes] context (or the default one) and the namespace
/// to use: the spec's, else the context's.
pub async fn client(spec: &Spec) -> Result<(kube::Client, String), CiError> {
    let k = &spec.pipeline.kubernetes;
    let setting = |key: &str| k.get(key).and_then(Json::as_str).map(str::to_string);
    mflow_kube::schedule::client(setting("context"), setting("namespace")).await.map_err(|e| CiError::Kube {
        message: format!("no cluster configuration: {e}"),
        help: "set KUBECONFIG or run inside a cluster; [pipeline.kubernetes] context picks a kubeconfig context".into(),
    })
}
