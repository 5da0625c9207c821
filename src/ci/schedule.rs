//! `[schedule]`: Kubernetes objects that run a spec on a cron schedule. A CronJob runs
//! `mflow run` on the spec (shipped in a ConfigMap) with its workdir on the artifacts PVC; a
//! ServiceAccount with least-privilege RBAC lets it create TrainJobs and follow their pods.
//! `mflow schedule apply` applies the same objects with server-side apply.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{CronJob, CronJobSpec, JobSpec, JobTemplateSpec};
use k8s_openapi::api::core::v1::{ConfigMap, ConfigMapVolumeSource, Container, EnvVar, PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec, ServiceAccount, Volume, VolumeMount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Map, Value as Json};

use super::CiError;
use crate::spec::Spec;

/// Where the CronJob mounts the artifacts PVC and the spec ConfigMap.
const ARTIFACTS: &str = "/mflow";
const SPEC_MOUNT: &str = "/etc/mflow";

/// Every object of a schedule, in apply order.
pub struct Objects {
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
    pub cluster_role: ClusterRole,
    pub cluster_role_binding: ClusterRoleBinding,
    pub config_map: ConfigMap,
    pub cron_job: CronJob,
}

impl Objects {
    /// Multi-document YAML, one object per document.
    pub fn to_yaml(&self) -> String {
        let docs = [
            to_yaml(&self.service_account),
            to_yaml(&self.role),
            to_yaml(&self.role_binding),
            to_yaml(&self.cluster_role),
            to_yaml(&self.cluster_role_binding),
            to_yaml(&self.config_map),
            to_yaml(&self.cron_job),
        ];
        docs.iter().map(|d| format!("---\n{d}")).collect()
    }
}

fn to_yaml<T: serde::Serialize>(v: &T) -> String {
    serde_yaml::to_string(v).expect("Kubernetes objects serialize")
}

/// Longest name of the schedule's objects: a CronJob's name leaves 11 characters for the Jobs
/// it makes.
const MAX_OBJECT_NAME: usize = 52;

/// A DNS-1123 label from the pipeline name, short enough for a CronJob. A name that had to be
/// changed (case, characters, length) gets a hash of the original, so that two pipelines never
/// share objects or a directory on the volume.
pub fn object_name(pipeline: &str) -> String {
    let plain = format!("mflow-{pipeline}");
    if plain.len() <= MAX_OBJECT_NAME && mflow_kube::is_rfc1035_label(&plain) {
        return plain;
    }
    let cleaned: String = pipeline.to_ascii_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let hash = &blake3::hash(pipeline.as_bytes()).to_hex()[..8];
    let mut head = format!("mflow-{cleaned}");
    head.truncate(MAX_OBJECT_NAME - 1 - hash.len());
    format!("{}-{hash}", head.trim_end_matches('-'))
}

/// The ConfigMap key of the spec: the user's file name may hold characters a key may not.
const SPEC_KEY: &str = "spec.toml";

fn names_kubernetes_takes(namespace: &str, service_account: &str) -> Result<(), CiError> {
    let refused = |e: mflow_kube::KubeError| {
        let help = miette::Diagnostic::help(&e).map(|h| h.to_string()).unwrap_or_default();
        CiError::Schedule { message: e.to_string(), help }
    };
    mflow_kube::check_namespace(namespace).map_err(refused)?;
    mflow_kube::check_service_account(service_account).map_err(refused)
}

pub fn render(spec: &Spec, namespace: &str) -> Result<Objects, CiError> {
    let sched = spec.schedule.as_ref().ok_or_else(|| CiError::Schedule { message: "the spec has no [schedule] section".into(), help: "add [schedule] with cron = \"0 3 * * *\"".into() })?;
    let cron = str_of(sched, "cron").unwrap_or_default();
    check_cron(&cron)?;
    let time_zone = str_of(sched, "timezone");
    if let Some(tz) = &time_zone {
        jiff::tz::TimeZone::get(tz).map_err(|_| CiError::Schedule { message: format!("timezone `{tz}` is not an IANA time zone"), help: "use a name like \"Europe/Berlin\" or \"UTC\"".into() })?;
    }
    let service_account = str_of(sched, "service_account").unwrap_or_else(|| "mflow".into());
    names_kubernetes_takes(namespace, &service_account)?;
    let deadline = match str_of(sched, "starting_deadline") {
        Some(d) => humantime::parse_duration(&d).map_err(|e| CiError::Schedule { message: format!("starting_deadline `{d}`: {e}"), help: "write a duration such as \"1h\"".into() })?.as_secs() as i64,
        None => 3600,
    };
    let suspend = sched.get("suspend").and_then(Json::as_bool).unwrap_or(false);
    let k = &spec.pipeline.kubernetes;
    let pvc = k.get("pvc").and_then(Json::as_str).unwrap_or("mflow-artifacts").to_string();
    let image = k.get("image").and_then(Json::as_str).map(str::to_string).unwrap_or_else(|| format!("ghcr.io/mflow-dev/mflow:{}", env!("CARGO_PKG_VERSION")));
    let name = object_name(&spec.pipeline.name);
    let labels: BTreeMap<String, String> = [
        ("app.kubernetes.io/name", "mflow".to_string()),
        ("app.kubernetes.io/instance", name.clone()),
        ("app.kubernetes.io/managed-by", "mflow".to_string()),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b))
    .collect();
    let meta = |n: &str, namespaced: bool| ObjectMeta { name: Some(n.to_string()), namespace: namespaced.then(|| namespace.to_string()), labels: Some(labels.clone()), ..Default::default() };
    let file = spec.path.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_else(|| "spec.toml".into());

    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    // The rights come from the one list the preflight checks (mflow_kube::rbac).
    let rules = |cluster: bool| -> Vec<PolicyRule> {
        mflow_kube::rbac::RULES.iter().filter(|r| r.cluster == cluster).map(|r| rule(&[r.group], &[r.resource], r.verbs)).collect()
    };
    let role = Role { metadata: meta(&name, true), rules: Some(rules(false)) };
    let subject = Subject { kind: "ServiceAccount".into(), name: service_account.clone(), namespace: Some(namespace.to_string()), ..Default::default() };
    let role_binding = RoleBinding {
        metadata: meta(&name, true),
        role_ref: RoleRef { api_group: Some("rbac.authorization.k8s.io".into()), kind: "Role".into(), name: name.clone() },
        subjects: Some(vec![subject.clone()]),
    };
    // ClusterTrainingRuntimes are cluster-scoped: reading them needs a (read-only) ClusterRole.
    let cluster_name = format!("{name}-{namespace}");
    let cluster_role = ClusterRole { metadata: meta(&cluster_name, false), rules: Some(rules(true)), ..Default::default() };
    let cluster_role_binding = ClusterRoleBinding {
        metadata: meta(&cluster_name, false),
        role_ref: RoleRef { api_group: Some("rbac.authorization.k8s.io".into()), kind: "ClusterRole".into(), name: cluster_name.clone() },
        subjects: Some(vec![subject]),
    };
    let config_map = ConfigMap { metadata: meta(&format!("{name}-spec"), true), data: Some([(SPEC_KEY.to_string(), spec.source.to_string())].into_iter().collect()), ..Default::default() };

    // The spec is copied onto the PVC so that its relative workdir and inputs live there; the
    // report and JUnit file of the latest run are written next to it.
    let dir = format!("{ARTIFACTS}/pipelines/{name}");
    // `exec`: mflow becomes the container's main process, so the SIGTERM of a deadline, a
    // drain or an eviction reaches it; it then records the run, writes the JUnit file and the
    // report, and leaves its TrainJobs running for the next scheduled run to reattach to.
    // The names reach the script as variables, quoted where used: a spec's file name is data,
    // never shell syntax.
    let script = format!(
        "set -eu\nmkdir -p \"$PIPELINE_DIR\"\ncp {SPEC_MOUNT}/{SPEC_KEY} \"$PIPELINE_DIR/$PIPELINE_SPEC\"\ncd \"$PIPELINE_DIR\"\nexec mflow run \"./$PIPELINE_SPEC\" --junit junit.xml --report report.html\n"
    );
    let var = |name: &str, value: &str| EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() };
    let container = Container {
        name: "mflow".into(),
        image: Some(image),
        command: Some(vec!["sh".into(), "-c".into(), script]),
        env: Some(vec![var("CI", "true"), var("PIPELINE_DIR", &dir), var("PIPELINE_SPEC", &file)]),
        volume_mounts: Some(vec![
            VolumeMount { name: "artifacts".into(), mount_path: ARTIFACTS.into(), ..Default::default() },
            VolumeMount { name: "spec".into(), mount_path: SPEC_MOUNT.into(), read_only: Some(true), ..Default::default() },
        ]),
        ..Default::default()
    };
    let pod = PodSpec {
        service_account_name: Some(service_account.clone()),
        restart_policy: Some("Never".into()),
        // Time to record the run, write its JUnit file and report after a SIGTERM.
        termination_grace_period_seconds: Some(120),
        containers: vec![container],
        volumes: Some(vec![
            Volume { name: "artifacts".into(), persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource { claim_name: pvc, read_only: None }), ..Default::default() },
            Volume { name: "spec".into(), config_map: Some(ConfigMapVolumeSource { name: format!("{name}-spec"), ..Default::default() }), ..Default::default() },
        ]),
        ..Default::default()
    };
    let cron_job = CronJob {
        metadata: meta(&name, true),
        spec: CronJobSpec {
            schedule: cron,
            time_zone,
            concurrency_policy: Some("Forbid".into()),
            starting_deadline_seconds: Some(deadline),
            suspend: Some(suspend),
            successful_jobs_history_limit: Some(3),
            failed_jobs_history_limit: Some(3),
            job_template: JobTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
                spec: Some(JobSpec {
                    // mflow retries stages itself; a rerun of the whole Job would start over.
                    backoff_limit: Some(0),
                    template: PodTemplateSpec { metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }), spec: Some(pod) },
                    ..Default::default()
                }),
            },
        },
        ..Default::default()
    };
    let service_account = ServiceAccount { metadata: meta(&service_account, true), ..Default::default() };
    Ok(Objects { service_account, role, role_binding, cluster_role, cluster_role_binding, config_map, cron_job })
}

fn str_of(t: &Map<String, Json>, k: &str) -> Option<String> {
    t.get(k).and_then(Json::as_str).map(str::to_string)
}

/// Five fields of standard cron (as the CronJob controller reads them) or a macro like @daily.
pub fn check_cron(cron: &str) -> Result<(), CiError> {
    let bad = |why: String| CiError::Schedule { message: format!("cron `{cron}`: {why}"), help: "write five fields: minute hour day-of-month month day-of-week, e.g. \"0 3 * * *\", or @hourly/@daily/@weekly/@monthly/@yearly".into() };
    if cron.starts_with('@') {
        return match cron {
            "@yearly" | "@annually" | "@monthly" | "@weekly" | "@daily" | "@midnight" | "@hourly" => Ok(()),
            _ => Err(bad("unknown macro".into())),
        };
    }
    let fields: Vec<&str> = cron.split_whitespace().collect();
    if fields.len() != 5 {
        return Err(bad(format!("{} fields, expected 5", fields.len())));
    }
    let limits = [("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7)];
    for (f, (what, lo, hi)) in fields.iter().zip(limits) {
        for part in f.split(',') {
            let (range, step) = match part.split_once('/') {
                Some((r, s)) => (r, Some(s)),
                None => (part, None),
            };
            if let Some(s) = step {
                if s.parse::<u32>().map_or(true, |s| s == 0) {
                    return Err(bad(format!("{what}: step `{s}` is not a positive number")));
                }
            }
            if range == "*" || range == "?" {
                continue;
            }
            for v in range.split('-') {
                let ok = match v.parse::<u32>() {
                    Ok(n) => (lo..=hi).contains(&n),
                    // Names of months and weekdays (JAN, MON, ...).
                    Err(_) => v.len() == 3 && v.chars().all(|c| c.is_ascii_alphabetic()) && (what == "month" || what == "day of week"),
                };
                if !ok {
                    return Err(bad(format!("{what}: `{v}` is outside {lo}-{hi}")));
                }
            }
        }
    }
    Ok(())
}

/// Applies every object with server-side apply (field manager "mflow").
pub async fn apply(objects: &Objects, client: kube::Client, namespace: &str) -> Result<Vec<String>, CiError> {
    use kube::api::{Api, Patch, PatchParams};
    let pp = PatchParams::apply("mflow").force();
    let mut done = Vec::new();
    macro_rules! put {
        ($api:expr, $obj:expr, $kind:literal) => {{
            let name = $obj.metadata.name.clone().unwrap_or_default();
            $api.patch(&name, &pp, &Patch::Apply($obj)).await.map_err(|e| CiError::Kube {
                message: format!("applying {} {name}: {}", $kind, mflow_kube::describe(&e)),
                help: "check the kubeconfig context and that you may create ServiceAccounts, RBAC objects, ConfigMaps and CronJobs in the namespace".into(),
            })?;
            done.push(format!("{}/{name}", $kind));
        }};
    }
    put!(Api::<ServiceAccount>::namespaced(client.clone(), namespace), &objects.service_account, "serviceaccount");
    put!(Api::<Role>::namespaced(client.clone(), namespace), &objects.role, "role");
    put!(Api::<RoleBinding>::namespaced(client.clone(), namespace), &objects.role_binding, "rolebinding");
    put!(Api::<ClusterRole>::all(client.clone()), &objects.cluster_role, "clusterrole");
    put!(Api::<ClusterRoleBinding>::all(client.clone()), &objects.cluster_role_binding, "clusterrolebinding");
    put!(Api::<ConfigMap>::namespaced(client.clone(), namespace), &objects.config_map, "configmap");
    put!(Api::<CronJob>::namespaced(client.clone(), namespace), &objects.cron_job, "cronjob");
    Ok(done)
}

/// A client for the spec's [pipeline.kubernetes] context (or the default one) and the namespace
/// to use: the spec's, else the context's.
pub async fn client(spec: &Spec) -> Result<(kube::Client, String), CiError> {
    let k = &spec.pipeline.kubernetes;
    let context = k.get("context").and_then(Json::as_str).map(str::to_string);
    let err = |e: String| CiError::Kube { message: format!("no cluster configuration: {e}"), help: "set KUBECONFIG or run inside a cluster; [pipeline.kubernetes] context picks a kubeconfig context".into() };
    let config = match context {
        Some(c) => kube::Config::from_kubeconfig(&kube::config::KubeConfigOptions { context: Some(c), ..Default::default() }).await.map_err(|e| err(e.to_string()))?,
        None => kube::Config::infer().await.map_err(|e| err(e.to_string()))?,
    };
    let namespace = k.get("namespace").and_then(Json::as_str).map(str::to_string).unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).map_err(|e| err(e.to_string()))?;
    Ok((client, namespace))
}
