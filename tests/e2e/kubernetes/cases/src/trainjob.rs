//! The fields of a Kubeflow Trainer TrainJob (`trainer.kubeflow.org/v1alpha1`, Trainer v2.3)
//! that the cases read.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{ApiResource, GroupVersionKind};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct TrainJob {
    pub metadata: ObjectMeta,
    pub spec: TrainJobSpec,
    #[serde(default)]
    pub status: Option<TrainJobStatus>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TrainJobSpec {
    pub runtime_ref: RuntimeRef,
    #[serde(default)]
    pub trainer: Option<Trainer>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RuntimeRef {
    pub name: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Trainer {
    pub num_nodes: Option<i32>,
    pub num_proc_per_node: Option<i32>,
    pub resources_per_node: Option<ResourceRequirements>,
    #[serde(default)]
    pub env: Vec<EnvVar>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct TrainJobStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
}

impl TrainJob {
    /// The API resource of TrainJobs, for the dynamic client.
    pub fn resource() -> ApiResource {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("trainer.kubeflow.org", "v1alpha1", "TrainJob"),
            "trainjobs",
        )
    }

    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or("")
    }

    pub fn trainer(&self) -> Trainer {
        self.spec.trainer.clone().unwrap_or_default()
    }

    /// Whether the condition `type_` is True (`Complete`, `Failed`, ...).
    pub fn condition(&self, type_: &str) -> bool {
        self.status.iter().flat_map(|s| &s.conditions).any(|c| c.type_ == type_ && c.status == "True")
    }

    /// Whether it is being deleted.
    pub fn deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    /// The CPU request per node, as written (`"2"`).
    pub fn cpus_per_node(&self) -> Option<String> {
        let resources = self.trainer().resources_per_node?;
        resources.requests?.get("cpu").map(|q| q.0.clone())
    }

    pub fn label(&self, name: &str) -> Option<&str> {
        self.metadata.labels.as_ref()?.get(name).map(String::as_str)
    }
}
