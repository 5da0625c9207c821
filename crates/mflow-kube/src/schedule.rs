//! The objects of a schedule (`mflow schedule render` and `apply`): a CronJob that runs
//! `mflow run` on a spec (shipped in a ConfigMap) with its workdir on the artifact claim, and a
//! ServiceAccount with least-privilege RBAC that lets it create TrainJobs and follow their pods.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{CronJob, CronJobSpec, JobSpec, JobTemplateSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, EnvFromSource, EnvVar, PersistentVolumeClaimVolumeSource, PodSpec,
    PodTemplateSpec, SecretEnvSource, ServiceAccount, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::expansion::escape;
use crate::manifest::ARTIFACT_MOUNT as ARTIFACTS;
use crate::names::is_rfc1035_label;

/// Where the CronJob mounts the spec ConfigMap (the artifact claim is at `/mflow`).
const SPEC_MOUNT: &str = "/etc/mflow";
/// The ConfigMap key of the spec: the user's file name may hold characters a key may not.
const SPEC_KEY: &str = "spec.toml";

/// What a schedule runs, when, and where; checked by the caller (the cron expression, the
/// time zone, the names).
#[derive(Debug, Clone, Default)]
pub struct ScheduleOptions {
    /// The pipeline's name: the objects are named after it ([`object_name`]).
    pub pipeline: String,
    pub namespace: String,
    pub service_account: String,
    /// The artifact claim, mounted at `/mflow`.
    pub pvc: String,
    /// An mflow image.
    pub image: String,
    /// Standard cron, five fields, or a macro such as `@daily`.
    pub cron: String,
    /// An IANA time zone.
    pub time_zone: Option<String>,
    pub starting_deadline_s: i64,
    pub suspend: bool,
    /// The spec's file name, and its text, shipped in the ConfigMap.
    pub spec_file: String,
    pub spec_source: String,
    /// A Secret whose keys mflow gets as environment variables (`env:NAME` webhooks): what a
    /// ConfigMap must not hold.
    pub secret: Option<String>,
}

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
    if plain.len() <= MAX_OBJECT_NAME && is_rfc1035_label(&plain) {
        return plain;
    }
    let cleaned: String =
        pipeline.to_ascii_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let hash = &blake3::hash(pipeline.as_bytes()).to_hex()[..8];
    let mut head = format!("mflow-{cleaned}");
    head.truncate(MAX_OBJECT_NAME - 1 - hash.len());
    format!("{}-{hash}", head.trim_end_matches('-'))
}

/// The objects of a schedule.
pub fn objects(o: &ScheduleOptions) -> Objects {
    let m = Meta::of(o);
    let (role, role_binding, cluster_role, cluster_role_binding) = rbac(o, &m);
    let config_map = ConfigMap {
        metadata: m.meta(&format!("{}-spec", m.name), true),
        data: Some([(SPEC_KEY.to_string(), o.spec_source.clone())].into_iter().collect()),
        ..Default::default()
    };
    let cron_job = cron_job(o, &m);
    let service_account = ServiceAccount { metadata: m.meta(&o.service_account, true), ..Default::default() };
    Objects { service_account, role, role_binding, cluster_role, cluster_role_binding, config_map, cron_job }
}

/// The name and labels every object of a schedule shares.
struct Meta {
    name: String,
    namespace: String,
    labels: BTreeMap<String, String>,
}

impl Meta {
    fn of(o: &ScheduleOptions) -> Meta {
        let name = object_name(&o.pipeline);
        let labels: BTreeMap<String, String> = [
            ("app.kubernetes.io/name", "mflow".to_string()),
            ("app.kubernetes.io/instance", name.clone()),
            ("app.kubernetes.io/managed-by", "mflow".to_string()),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b))
        .collect();
        Meta { name, namespace: o.namespace.clone(), labels }
    }

    fn meta(&self, n: &str, namespaced: bool) -> ObjectMeta {
        ObjectMeta {
            name: Some(n.to_string()),
            namespace: namespaced.then(|| self.namespace.clone()),
            labels: Some(self.labels.clone()),
            ..Default::default()
        }
    }
}

/// The Role and ClusterRole of the schedule's service account, and their bindings.
fn rbac(o: &ScheduleOptions, m: &Meta) -> (Role, RoleBinding, ClusterRole, ClusterRoleBinding) {
    let (name, namespace) = (&m.name, &m.namespace);
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    // The rights come from the one list the preflight checks (crate::rbac).
    let rules = |cluster: bool| -> Vec<PolicyRule> {
        crate::rbac::RULES
            .iter()
            .filter(|r| r.cluster == cluster)
            .map(|r| rule(&[r.group], &[r.resource], r.verbs))
            .collect()
    };
    let role = Role { metadata: m.meta(name, true), rules: Some(rules(false)) };
    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: o.service_account.clone(),
        namespace: Some(namespace.to_string()),
        ..Default::default()
    };
    let role_binding = RoleBinding {
        metadata: m.meta(name, true),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: name.clone(),
        },
        subjects: Some(vec![subject.clone()]),
    };
    // ClusterTrainingRuntimes are cluster-scoped: reading them needs a (read-only) ClusterRole.
    let cluster_name = format!("{name}-{namespace}");
    let cluster_role =
        ClusterRole { metadata: m.meta(&cluster_name, false), rules: Some(rules(true)), ..Default::default() };
    let cluster_role_binding = ClusterRoleBinding {
        metadata: m.meta(&cluster_name, false),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: cluster_name.clone(),
        },
        subjects: Some(vec![subject]),
    };
    (role, role_binding, cluster_role, cluster_role_binding)
}

/// The CronJob: `mflow run` on the spec, copied from the ConfigMap onto the claim.
fn cron_job(o: &ScheduleOptions, m: &Meta) -> CronJob {
    let name = &m.name;
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
    // The script holds no `$(` or `$$` for the kubelet to expand; the values are literal.
    let var = |name: &str, value: &str| EnvVar { name: name.into(), value: Some(escape(value)), ..Default::default() };
    let container = Container {
        name: "mflow".into(),
        image: Some(o.image.clone()),
        command: Some(vec!["sh".into(), "-c".into(), script]),
        env: Some(vec![var("CI", "true"), var("PIPELINE_DIR", &dir), var("PIPELINE_SPEC", &o.spec_file)]),
        env_from: o.secret.as_ref().map(|name| {
            vec![EnvFromSource {
                secret_ref: Some(SecretEnvSource { name: name.clone(), optional: Some(false) }),
                ..Default::default()
            }]
        }),
        volume_mounts: Some(vec![
            VolumeMount { name: "artifacts".into(), mount_path: ARTIFACTS.into(), ..Default::default() },
            VolumeMount {
                name: "spec".into(),
                mount_path: SPEC_MOUNT.into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    let pod = PodSpec {
        service_account_name: Some(o.service_account.clone()),
        restart_policy: Some("Never".into()),
        // Time to record the run, write its JUnit file and report after a SIGTERM.
        termination_grace_period_seconds: Some(120),
        containers: vec![container],
        volumes: Some(vec![
            Volume {
                name: "artifacts".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: o.pvc.clone(),
                    read_only: None,
                }),
                ..Default::default()
            },
            Volume {
                name: "spec".into(),
                config_map: Some(ConfigMapVolumeSource { name: format!("{name}-spec"), ..Default::default() }),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    let labels = &m.labels;
    CronJob {
        metadata: m.meta(name, true),
        spec: CronJobSpec {
            schedule: o.cron.clone(),
            time_zone: o.time_zone.clone(),
            concurrency_policy: Some("Forbid".into()),
            starting_deadline_seconds: Some(o.starting_deadline_s),
            suspend: Some(o.suspend),
            successful_jobs_history_limit: Some(3),
            failed_jobs_history_limit: Some(3),
            job_template: JobTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
                spec: Some(JobSpec {
                    // mflow retries stages itself; a rerun of the whole Job would start over.
                    backoff_limit: Some(0),
                    template: PodTemplateSpec {
                        metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
                        spec: Some(pod),
                    },
                    ..Default::default()
                }),
            },
        },
        ..Default::default()
    }
}

/// Applies every object with server-side apply (field manager "mflow"); says each object
/// applied (`kind/name`), or why one was not (`applying KIND NAME: why`).
pub async fn apply(objects: &Objects, client: kube::Client, namespace: &str) -> Result<Vec<String>, String> {
    use kube::api::{Api, Patch, PatchParams};
    let pp = PatchParams::apply("mflow").force();
    let mut done = Vec::new();
    macro_rules! put {
        ($api:expr, $obj:expr, $kind:literal) => {{
            let name = $obj.metadata.name.clone().unwrap_or_default();
            $api.patch(&name, &pp, &Patch::Apply($obj))
                .await
                .map_err(|e| format!("applying {} {name}: {}", $kind, crate::describe(&e)))?;
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

/// A client for kubeconfig `context` (or the default one, or the pod's service account) and
/// the namespace to use: `namespace`, else the context's.
pub async fn client(context: Option<String>, namespace: Option<String>) -> Result<(kube::Client, String), String> {
    let config = match context {
        Some(c) => {
            kube::Config::from_kubeconfig(&kube::config::KubeConfigOptions { context: Some(c), ..Default::default() })
                .await
                .map_err(|e| e.to_string())?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    let namespace = namespace.unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
    Ok((client, namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec's file name reaches the script as it is: no `$(NAME)` or `$$` of the kubelet's.
    #[test]
    fn a_dollar_in_the_spec_file_name_is_not_expanded() {
        let o = ScheduleOptions { pipeline: "p".into(), spec_file: "a$$b$(HOME)$.toml".into(), ..Default::default() };
        let pod = objects(&o).cron_job.spec.job_template.spec.unwrap().template.spec.unwrap();
        let c = &pod.containers[0];
        let env: Vec<(String, String)> =
            c.env.iter().flatten().map(|e| (e.name.clone(), e.value.clone().unwrap_or_default())).collect();
        let lookup = |n: &str| env.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).or(Some("x".into()));
        let spec = &env.iter().find(|(k, _)| k == "PIPELINE_SPEC").unwrap().1;
        assert_eq!(crate::expand(spec, &lookup), "a$$b$(HOME)$.toml");
        for part in c.command.iter().flatten() {
            assert_eq!(&crate::expand(part, &lookup), part, "mflow's script relies on no expansion");
        }
    }

    #[test]
    fn object_names_fit_a_cronjob_and_keep_pipelines_apart() {
        assert_eq!(object_name("nightly"), "mflow-nightly");
        let long = object_name(&"x".repeat(80));
        assert!(long.len() <= MAX_OBJECT_NAME && is_rfc1035_label(&long), "{long}");
        assert_ne!(object_name("Nightly"), object_name("nightly"));
        assert!(is_rfc1035_label(&object_name("A_b")));
    }
}
