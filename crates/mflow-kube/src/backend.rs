//! Connecting to the cluster and checking, before any stage runs, that it can run them.

use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::Client;

use crate::error::{api_status, Target};
use crate::manifest::{TRAINER_GROUP, TRAINER_VERSION};
use crate::{KubeError, KubeOptions};

/// Runs stages as TrainJobs in one namespace of one cluster.
#[derive(Clone)]
pub struct KubeBackend {
    pub(crate) client: Client,
    /// Options with the namespace resolved.
    pub(crate) opts: KubeOptions,
    /// The server and the kubeconfig names of the identity, for errors.
    pub(crate) target: Target,
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
        let (config, target) = crate::connect::load(&opts).await?;
        let mut opts = opts;
        if opts.namespace.is_none() {
            opts.namespace = Some(config.default_namespace.clone());
        }
        crate::names::check_namespace(opts.namespace_or_default())?;
        if let Some(sa) = &opts.service_account {
            crate::names::check_service_account(sa)?;
        }
        let client = Client::try_from(config).map_err(|e| KubeError::Kubeconfig {
            path: target.kubeconfig.clone().unwrap_or_else(|| "(in-cluster configuration)".into()),
            message: format!("{}: {}", target.who(), crate::error::chain(&e)),
        })?;
        let backend = KubeBackend { client, opts, target };
        backend
            .client
            .apiserver_version()
            .await
            .map_err(|e| KubeError::from_call(e, "get", "version", "", None, backend.namespace(), &backend.target))?;
        Ok(backend)
    }

    /// A backend over an existing client, for callers that build their own.
    pub fn from_client(client: Client, mut opts: KubeOptions) -> Self {
        if opts.namespace.is_none() {
            opts.namespace = Some(client.default_namespace().to_string());
        }
        KubeBackend { client, opts, target: Target { url: String::from("(client)"), ..Target::default() } }
    }

    /// The server and the kubeconfig context, user and cluster mflow reaches it with.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Maps a client error of any call to what to do about it.
    pub fn error(&self, e: kube::Error, verb: &str, resource: &str, name: &str) -> KubeError {
        self.call_err(e, verb, resource, name)
    }

    /// Whether the working namespace exists: `Some(false)` when the server says it does not,
    /// `None` when it would not say (reading namespaces is a right mflow does not require).
    pub async fn namespace_exists(&self) -> Option<bool> {
        namespace_exists(&self.client, self.namespace()).await
    }

    /// Fails with [`KubeError::NamespaceMissing`] when the server says the working namespace
    /// does not exist.
    pub async fn check_namespace(&self) -> Result<(), KubeError> {
        match self.namespace_exists().await {
            Some(false) => Err(KubeError::NamespaceMissing {
                namespace: self.namespace().to_string(),
                url: self.target.url.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// [`KubeError::NamespaceMissing`] when the working namespace does not exist, else `other`:
    /// for what a missing namespace also looks like (no claim, no rights, no objects).
    pub async fn unless_namespace_missing(&self, other: KubeError) -> KubeError {
        self.check_namespace().await.err().unwrap_or(other)
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
        KubeError::from_call(e, verb, resource, name, Some(self.namespace()), self.namespace(), &self.target)
    }

    /// For calls on cluster-scoped resources (runtimes, CRDs, access reviews).
    pub(crate) fn cluster_call_err(&self, e: kube::Error, verb: &str, resource: &str, name: &str) -> KubeError {
        KubeError::from_call(e, verb, resource, name, None, self.namespace(), &self.target)
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
        // Rights are granted in a namespace, and the claim lives in one: when either is
        // missing, a missing namespace is the better answer.
        match self.check_rights(rules).await {
            Err(e @ KubeError::Forbidden { .. }) => return Err(self.unless_namespace_missing(e).await),
            other => other?,
        }
        for runtime in &self.opts.runtimes {
            self.check_runtime(runtime).await?;
        }
        match self.check_pvc().await {
            Err(e @ KubeError::PvcMissing { .. }) => Err(self.unless_namespace_missing(e).await),
            other => other,
        }
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
            Err(e) => {
                Err(self.cluster_call_err(e, "get", "customresourcedefinitions", "trainjobs.trainer.kubeflow.org"))
            }
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
                let rwx = pvc.spec.and_then(|s| s.access_modes).is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany"));
                if !rwx {
                    tracing::warn!(pvc = %self.opts.pvc, "artifact claim is not ReadWriteMany; multi-node stages cannot share it");
                }
                Ok(())
            }
            Ok(None) => {
                Err(KubeError::PvcMissing { name: self.opts.pvc.clone(), namespace: self.namespace().to_string() })
            }
            Err(e) => Err(self.call_err(e, "get", "persistentvolumeclaims", &self.opts.pvc)),
        }
    }
}

/// Whether namespace `name` exists: `None` when the server would not say.
pub async fn namespace_exists(client: &Client, name: &str) -> Option<bool> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    match namespaces.get_opt(name).await {
        Ok(found) => Some(found.is_some()),
        Err(e) => {
            tracing::debug!(error = %crate::describe(&e), namespace = name, "cannot tell whether the namespace exists");
            None
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
