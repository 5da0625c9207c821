//! The volume pod: a short-lived pod that mounts the artifact claim, for what a machine outside
//! the cluster must do on the volume (upload a project, read run records and outputs) through
//! exec, as `kubectl cp` does.

use k8s_openapi::api::core::v1::{
    Container, PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume as PodVolume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::manifest::{ARTIFACT_MOUNT, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGED_BY};

/// The component label's value on volume pods: `mflow.dev/component=volume` finds them.
pub const COMPONENT: &str = "volume";
/// The label selector of volume pods.
pub const SELECTOR: &str = "mflow.dev/component=volume";
/// The container that commands run in.
pub const CONTAINER: &str = "volume";
/// How long a volume pod lives; commands reuse it until then.
pub const LIFETIME_S: i64 = 3600;

/// One volume pod.
#[derive(Debug, Clone, Default)]
pub struct VolumePodOptions {
    pub name: String,
    /// An mflow image: the commands run in it (`sh`, `tar`, the image's `mflow`).
    pub image: String,
    /// The artifact claim, mounted at [`ARTIFACT_MOUNT`].
    pub pvc: String,
    pub host_network: bool,
}

/// The pod: it sleeps for [`LIFETIME_S`] (its deadline too), mounting the claim.
pub fn pod(o: &VolumePodOptions) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(o.name.clone()),
            labels: Some(
                [(LABEL_MANAGED_BY, MANAGED_BY), (LABEL_COMPONENT, COMPONENT)]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            active_deadline_seconds: Some(LIFETIME_S),
            termination_grace_period_seconds: Some(1),
            host_network: o.host_network.then_some(true),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(o.image.clone()),
                command: Some(vec!["sleep".into(), LIFETIME_S.to_string()]),
                working_dir: Some(ARTIFACT_MOUNT.into()),
                volume_mounts: Some(vec![VolumeMount {
                    name: "artifacts".into(),
                    mount_path: ARTIFACT_MOUNT.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            volumes: Some(vec![PodVolume {
                name: "artifacts".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: o.pvc.clone(),
                    read_only: None,
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Whether `pod` is a volume pod of this image and claim (one that can be reused).
pub fn serves(pod: &Pod, image: &str, pvc: &str) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.containers.first().and_then(|c| c.image.as_deref()) == Some(image)
            && s.volumes
                .iter()
                .flatten()
                .any(|v| v.persistent_volume_claim.as_ref().is_some_and(|c| c.claim_name == pvc))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_pod_mounts_the_claim_and_is_found_again_by_image_and_claim() {
        let o = VolumePodOptions {
            name: "mflow-volume-0000abcd".into(),
            image: "ghcr.io/mflow-dev/mflow-cpu:0.1.0".into(),
            pvc: "mflow-artifacts".into(),
            host_network: false,
        };
        let p = pod(&o);
        let labels = p.metadata.labels.clone().unwrap();
        assert_eq!(labels.get(LABEL_COMPONENT).map(String::as_str), Some(COMPONENT));
        assert_eq!(SELECTOR, format!("{LABEL_COMPONENT}={COMPONENT}"));
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.active_deadline_seconds, Some(LIFETIME_S));
        assert_eq!(spec.host_network, None);
        assert!(serves(&p, &o.image, &o.pvc));
        assert!(!serves(&p, "other", &o.pvc));
        assert!(!serves(&p, &o.image, "other"));
    }
}
