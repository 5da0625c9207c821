//! Connecting to the cluster and checking, before any stage runs, that it can run them.

use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, Config};

use crate::error::api_status;
use crate::manifest::{TRAINER_GROUP, TRAINER_VERSION};
use crate::{KubeError, KubeOptions};

/// Runs stages as TrainJobs in one namespace of one cluster.
#[derive(Clone)]
pub struct KubeBackend {
    pub(crate) client: Client,
    /// Options with the namespace resolved.
    pub(crate) opts: KubeOptions,
    pub(crate) url: String,
}

pub(crate) fn trainjob_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(TRAINER_GROUP, TRAINER_VERSION, "TrainJob"), "trainjobs")
}

pub(crate) fn runtime_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(TRAINER_GROUP, TRAINER_VERSION, "ClusterTrainingRuntime"),
        "clustertrainingruntimes",
    )
}

impl KubeBackend {
    /// Loads the client configuration (the kubeconfig named in the options, `KUBECONFIG`,
    /// `~/.kube/config`, or the in-cluster service account) and checks that the API server answers.
    pub async fn connect(opts: KubeOptions) -> Result<Self, KubeError> {
        let config_err = |e: &dyn std::fmt::Display| KubeError::Config { message: e.to_string() };
        let kc_opts = KubeConfigOptions { context: opts.context.clone(), ..Default::default() };
        let config = match &opts.kubeconfig {
            Some(path) => {
                let kubeconfig = Kubeconfig::read_from(path)
                    .map_err(|e| KubeError::Config { message: format!("{}: {e}", path.display()) })?;
                Config::from_custom_kubeconfig(kubeconfig, &kc_opts).await.map_err(|e| config_err(&e))?
            }
            None if opts.context.is_some() => Config::from_kubeconfig(&kc_opts).await.map_err(|e| config_err(&e))?,
            None => Config::infer().await.map_err(|e| config_err(&e))?,
        };
        let mut opts = opts;
        if opts.namespace.is_none() {
            opts.namespace = Some(config.default_namespace.clone());
        }
        let url = config.cluster_url.to_string();
        let client = Client::try_from(config).map_err(|e| config_err(&e))?;
        let backend = KubeBackend { client, opts, url };
        backend
            .client
            .apiserver_version()
            .await
            .map_err(|e| KubeError::from_call(e, "get", "version", "", None, backend.namespace(), &backend.url))?;
        Ok(backend)
    }

    /// A backend over an existing client, for callers that build their own.
    pub fn from_client(client: Client, mut opts: KubeOptions) -> Self {
        if opts.namespace.is_none() {
            opts.namespace = Some(client.default_namespace().to_string());
        }
        KubeBackend { client, opts, url: String::from("(client)") }
    }

    pub fn namespace(&self) -> &str {
        self.opts.namespace_or_default()
    }

    /// The API client, for callers that manage their own objects (the driver of a run started
    /// outside the cluster).
    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn options(&self) -> &KubeOptions {
        &self.opts
    }

    pub(crate) fn call_err(&self, e: kube::Error, verb: &str, resource: &str, name: &str) -> KubeError {
        KubeError::from_call(e, verb, resource, name, Some(self.namespace()), self.namespace(), &self.url)
    }

    /// For calls on cluster-scoped resources (runtimes, CRDs, access reviews).
    pub(crate) fn cluster_call_err(&self, e: kube::Error, verb: &str, resource: &str, name: &str) -> KubeError {
        KubeError::from_call(e, verb, resource, name, None, self.namespace(), &self.url)
    }

    /// Checks everything a stage needs before the first one is submitted: the Trainer API and its
    /// version, the permissions of [`crate::RBAC_EXAMPLE`], the runtimes named in the options, and
    /// the artifact claim.
    pub async fn preflight(&self) -> Result<(), KubeError> {
        self.preflight_for(crate::rbac::RULES).await
    }

    /// The preflight with the rights of `rules`: [`crate::rbac::OUTSIDE`] for a machine that
    /// starts a driver, whose own engine checks [`crate::rbac::RULES`] in the cluster.
    pub async fn preflight_for(&self, rules: &'static [crate::rbac::Rule]) -> Result<(), KubeError> {
        self.check_trainer_api().await?;
        self.check_rights(rules).await?;
        for runtime in &self.opts.runtimes {
            self.check_runtime(runtime).await?;
        }
        self.check_pvc().await
    }

    async fn check_trainer_api(&self) -> Result<(), KubeError> {
        let gv = format!("{TRAINER_GROUP}/{TRAINER_VERSION}");
        let resources = match self.client.list_api_group_resources(&gv).await {
            Ok(list) => list.resources,
            Err(e) if api_status(&e).is_some_and(|s| s.is_not_found()) => {
                return Err(KubeError::TrainerMissing { resource: "trainjobs".into() })
            }
            Err(e) => return Err(self.cluster_call_err(e, "get", "API discovery", &gv)),
        };
        for needed in ["trainjobs", "clustertrainingruntimes"] {
            if !resources.iter().any(|r| r.name == needed) {
                return Err(KubeError::TrainerMissing { resource: needed.into() });
            }
        }
        // The CRD schema tells the version; reading it needs cluster-wide rights that mflow
        // does not require, so a refusal only skips this check.
        let crds: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        match crds.get_opt("trainjobs.trainer.kubeflow.org").await {
            Ok(Some(crd)) => check_crd_version(&crd),
            Ok(None) => Err(KubeError::TrainerMissing { resource: "trainjobs".into() }),
            Err(e) if api_status(&e).is_some_and(|s| s.is_forbidden()) => {
                tracing::debug!("cannot read the TrainJob CRD; skipping the Trainer version check");
                Ok(())
            }
            Err(e) => Err(self.cluster_call_err(e, "get", "customresourcedefinitions", "trainjobs.trainer.kubeflow.org")),
        }
    }

    /// Asks the API server whether this identity has every right of `rules`.
    pub async fn check_rights(&self, rules: &'static [crate::rbac::Rule]) -> Result<(), KubeError> {
        let reviews: Api<SelfSubjectAccessReview> = Api::all(self.client.clone());
        let mut denied = Vec::new();
        for (verb, group, resource, sub, cluster) in crate::rbac::needed(rules) {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        namespace: (!cluster).then(|| self.namespace().to_string()),
                        verb: Some(verb.to_string()),
                        group: Some(group.to_string()),
                        resource: Some(resource.to_string()),
                        subresource: (!sub.is_empty()).then(|| sub.to_string()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let answer = reviews
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| self.cluster_call_err(e, "create", "selfsubjectaccessreviews", ""))?;
            if !answer.status.is_some_and(|s| s.allowed) {
                let full = if sub.is_empty() { resource.to_string() } else { format!("{resource}/{sub}") };
                denied.push((verb.to_string(), full, cluster));
            }
        }
        match denied.first() {
            None => Ok(()),
            Some((verb, resource, cluster)) => Err(KubeError::Forbidden {
                verb: verb.clone(),
                resource: resource.clone(),
                namespace: (!cluster).then(|| self.namespace().to_string()),
                rbac_namespace: self.namespace().to_string(),
                message: format!(
                    "the preflight's access review denies: {}",
                    denied.iter().map(|(v, r, _)| format!("{v} {r}")).collect::<Vec<_>>().join(", ")
                ),
            }),
        }
    }

    /// Fails with the list of existing runtimes when `name` is not a ClusterTrainingRuntime.
    pub async fn check_runtime(&self, name: &str) -> Result<(), KubeError> {
        let runtimes: Api<DynamicObject> = Api::all_with(self.client.clone(), &runtime_resource());
        match runtimes.get_opt(name).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => {
                let available = runtimes
                    .list(&ListParams::default())
                    .await
                    .map(|list| list.items.into_iter().filter_map(|r| r.metadata.name).collect())
                    .unwrap_or_default();
                Err(KubeError::RuntimeMissing { name: name.to_string(), available })
            }
            Err(e) => Err(self.cluster_call_err(e, "get", "clustertrainingruntimes", name)),
        }
    }

    async fn check_pvc(&self) -> Result<(), KubeError> {
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), self.namespace());
        match pvcs.get_opt(&self.opts.pvc).await {
            Ok(Some(pvc)) => {
                let rwx = pvc
                    .spec
                    .and_then(|s| s.access_modes)
                    .is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany"));
                if !rwx {
                    tracing::warn!(pvc = %self.opts.pvc, "artifact claim is not ReadWriteMany; multi-node stages cannot share it");
                }
                Ok(())
            }
            Ok(None) => Err(KubeError::PvcMissing { name: self.opts.pvc.clone(), namespace: self.namespace().to_string() }),
            Err(e) => Err(self.call_err(e, "get", "persistentvolumeclaims", &self.opts.pvc)),
        }
    }
}

/// v2.2 replaced `podTemplateOverrides` with `runtimePatches`, which mflow relies on.
fn check_crd_version(crd: &CustomResourceDefinition) -> Result<(), KubeError> {
    let Some(version) = crd.spec.versions.iter().find(|v| v.name == TRAINER_VERSION) else {
        return Err(KubeError::TrainerTooOld { found: "no v1alpha1 TrainJob version".into() });
    };
    let spec_props = version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| s.properties.as_ref())
        .and_then(|p| p.get("spec"))
        .and_then(|s| s.properties.as_ref());
    let Some(props) = spec_props else { return Ok(()) };
    if props.contains_key("runtimePatches") {
        return Ok(());
    }
    let found = if props.contains_key("podTemplateOverrides") {
        "v2.1 (TrainJob has podTemplateOverrides, not runtimePatches)"
    } else if props.contains_key("podSpecOverrides") {
        "v2.0 (TrainJob has podSpecOverrides, not runtimePatches)"
    } else {
        "a TrainJob CRD without runtimePatches"
    };
    Err(KubeError::TrainerTooOld { found: found.into() })
}
