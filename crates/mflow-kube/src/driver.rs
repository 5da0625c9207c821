//! The driver: the engine of a run started outside the cluster, as a batch/v1 Job in it.
//!
//! A Job rather than a TrainJob: the engine is one process with no rendezvous, and a Job's
//! `podFailurePolicy` says exactly when to start it again. The engine's own exit codes are
//! final (a failed stage, a cancel); a pod that was evicted, deleted or lost with its node ends
//! with SIGTERM (143) or SIGKILL (137), or carries `DisruptionTarget`, and is replaced. The new
//! engine reattaches to the TrainJobs that are still running: their names are their keys.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement, PodFailurePolicyOnPodConditionsPattern,
    PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::classify::{DISRUPTION_CONDITION, SIGNAL_EXIT_CODES};
use crate::expansion::escape;
use crate::manifest::{ANN_PIPELINE, ARTIFACT_MOUNT, LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_PIPELINE, MANAGED_BY};
use crate::names::label_value;

pub const LABEL_RUN: &str = "mflow.dev/run";
/// The component label's value on drivers: `mflow.dev/component=driver` finds them.
pub const COMPONENT: &str = "driver";
/// The label selector of drivers.
pub const SELECTOR: &str = "mflow.dev/component=driver";
pub const CONTAINER: &str = "mflow";
pub const ANNOTATION_PIPELINE: &str = ANN_PIPELINE;
pub const ANNOTATION_PROJECT: &str = "mflow.dev/project";
pub const ANNOTATION_WORKDIR: &str = "mflow.dev/workdir";
/// Restarts after evictions and node losses (`[pipeline.kubernetes] driver_restarts`).
pub const DEFAULT_RESTARTS: i32 = 3;

/// What the driver runs, and where.
#[derive(Debug, Clone, Default)]
pub struct DriverOptions {
    pub run: String,
    pub pipeline: String,
    pub image: String,
    pub pvc: String,
    pub service_account: String,
    /// The uploaded project on the volume, and the spec inside it.
    pub project: String,
    pub spec: String,
    /// The run's workdir on the volume: where its record is.
    pub workdir: String,
    pub overrides: Vec<String>,
    pub jobs: Option<usize>,
    pub force: Vec<String>,
    pub verify: bool,
    pub restarts: i32,
    pub host_network: bool,
    pub env: BTreeMap<String, String>,
}

/// The Job's name for a run id.
pub fn job_name(run: &str) -> String {
    format!("mflow-run-{}", run.to_ascii_lowercase().replace('.', "-"))
}

pub fn labels(run: &str, pipeline: &str) -> BTreeMap<String, String> {
    [
        (LABEL_MANAGED_BY, MANAGED_BY.to_string()),
        (LABEL_COMPONENT, COMPONENT.to_string()),
        (LABEL_RUN, run.to_string()),
        (LABEL_PIPELINE, label_value(pipeline)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The driver's Job.
pub fn job(d: &DriverOptions) -> Job {
    let labels = labels(&d.run, &d.pipeline);
    let mut args = vec![
        "run".to_string(),
        format!("{}/{}", d.project, d.spec),
        "--backend".into(),
        "kubernetes".into(),
        "--log-format".into(),
        "json".into(),
    ];
    for o in &d.overrides {
        args.extend(["--set".to_string(), o.clone()]);
    }
    for f in &d.force {
        args.extend(["--force".to_string(), f.clone()]);
    }
    if let Some(j) = d.jobs {
        args.extend(["--jobs".to_string(), j.to_string()]);
    }
    if d.verify {
        args.push("--verify".into());
    }
    // The arguments (`--set` overrides, paths) and values are literal: no kubelet expansion.
    let args = args.iter().map(|a| escape(a)).collect();
    let env = |k: &str, v: &str| EnvVar { name: k.into(), value: Some(escape(v)), ..Default::default() };
    let container = Container {
        name: CONTAINER.into(),
        image: Some(d.image.clone()),
        command: Some(vec!["mflow".into()]),
        args: Some(args),
        working_dir: Some(d.project.clone()),
        env: Some(
            [env("MFLOW_RUN_ID", &d.run), env("MFLOW_PROJECT_ROOT", &d.project), env("NO_COLOR", "1")]
                .into_iter()
                .chain(d.env.iter().filter(|(k, _)| !k.starts_with("MFLOW_")).map(|(k, v)| env(k, v)))
                .collect(),
        ),
        volume_mounts: Some(vec![VolumeMount {
            name: "artifacts".into(),
            mount_path: ARTIFACT_MOUNT.into(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let pod = PodSpec {
        service_account_name: Some(d.service_account.clone()),
        restart_policy: Some("Never".into()),
        // Time to record the run and leave the TrainJobs running after a SIGTERM.
        termination_grace_period_seconds: Some(120),
        containers: vec![container],
        host_network: d.host_network.then_some(true),
        volumes: Some(vec![Volume {
            name: "artifacts".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: d.pvc.clone(),
                read_only: None,
            }),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let policy = PodFailurePolicy {
        rules: vec![
            PodFailurePolicyRule {
                action: "Count".into(),
                on_pod_conditions: Some(vec![PodFailurePolicyOnPodConditionsPattern {
                    type_: DISRUPTION_CONDITION.into(),
                    status: Some("True".into()),
                }]),
                ..Default::default()
            },
            PodFailurePolicyRule {
                action: "FailJob".into(),
                on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                    container_name: Some(CONTAINER.into()),
                    operator: "NotIn".into(),
                    values: SIGNAL_EXIT_CODES.to_vec(),
                }),
                ..Default::default()
            },
        ],
    };
    Job {
        metadata: ObjectMeta {
            name: Some(job_name(&d.run)),
            labels: Some(labels.clone()),
            annotations: Some(
                [
                    (ANNOTATION_PIPELINE, &d.pipeline),
                    (ANNOTATION_PROJECT, &d.project),
                    (ANNOTATION_WORKDIR, &d.workdir),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            ),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(d.restarts),
            pod_failure_policy: Some(policy),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels), ..Default::default() }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DriverOptions {
        DriverOptions {
            run: "20261202-120000-000-ab".into(),
            pipeline: "gpt tp2".into(),
            image: "ghcr.io/mflow-dev/mflow-cpu:0.1.0".into(),
            pvc: "mflow-artifacts".into(),
            service_account: "mflow".into(),
            project: "/mflow/.mflow-uploads/projects/abc".into(),
            spec: "specs/gpt.toml".into(),
            workdir: "/mflow/gpt".into(),
            overrides: vec!["vars.lr=1e-4".into()],
            jobs: None,
            force: vec![],
            verify: false,
            restarts: 3,
            host_network: false,
            env: BTreeMap::new(),
        }
    }

    #[test]
    fn the_driver_job_runs_the_uploaded_spec_and_restarts_only_after_signals() {
        let j = job(&spec());
        insta::assert_yaml_snapshot!(j);
    }

    #[test]
    fn drivers_are_found_by_their_labels() {
        let j = job(&spec());
        let labels = j.metadata.labels.unwrap();
        assert_eq!(SELECTOR, format!("{LABEL_COMPONENT}={}", labels[LABEL_COMPONENT]));
        assert_eq!(labels[LABEL_RUN], "20261202-120000-000-ab");
    }

    #[test]
    fn job_names_are_dns_labels() {
        let n = job_name("20261202-120000-000-AB.2");
        assert!(crate::is_rfc1035_label(&n), "{n}");
    }
}
