//! The cluster through the Kubernetes client: what the cases read, and what an operator does to
//! it (delete or evict a pod, apply objects, take webhooks away). Every call blocks, and panics
//! with what it was doing when the API server says no.

use std::future::Future;
use std::path::Path;

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{ConfigMap, Node, PersistentVolumeClaim, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, DynamicObject, EvictParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::discovery::{pinned_kind, Scope};
use kube::{Client, Config, Resource};
use serde::de::DeserializeOwned;
use serde::{Deserialize as _, Serialize};

use crate::TrainJob;

/// A client of the cluster in one namespace.
pub struct Cluster {
    rt: tokio::runtime::Runtime,
    client: Client,
    pub namespace: String,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a tokio runtime")
}

async fn client_of(kubeconfig: &Path) -> Result<Client, String> {
    let kc = Kubeconfig::read_from(kubeconfig).map_err(|e| format!("{}: {e}", kubeconfig.display()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.map_err(|e| e.to_string())?;
    Client::try_from(config).map_err(|e| e.to_string())
}

impl Cluster {
    pub fn connect(kubeconfig: &Path, namespace: &str) -> Cluster {
        let rt = runtime();
        let client = rt.block_on(client_of(kubeconfig)).unwrap_or_else(|e| panic!("a client of the cluster: {e}"));
        Cluster { rt, client, namespace: namespace.into() }
    }

    /// Whether the API server accepts this kubeconfig's credentials (`GET /version`).
    pub fn answers_to(kubeconfig: &Path) -> bool {
        runtime().block_on(async {
            match client_of(kubeconfig).await {
                Ok(client) => client.apiserver_version().await.is_ok(),
                Err(_) => false,
            }
        })
    }

    fn call<T>(&self, what: &str, f: impl Future<Output = Result<T, kube::Error>>) -> T {
        self.rt.block_on(f).unwrap_or_else(|e| panic!("{what}: {e}"))
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn list<K>(&self, api: Api<K>, selector: &str, field: Option<&str>) -> Vec<K>
    where
        K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let mut lp = ListParams::default().labels(selector);
        if let Some(field) = field {
            lp = lp.fields(field);
        }
        let what = format!("listing {} {selector}", std::any::type_name::<K>());
        self.call(&what, api.list(&lp)).items
    }

    /// The TrainJobs whose labels match `selector`.
    pub fn trainjobs(&self, selector: &str) -> Vec<TrainJob> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.namespace, &TrainJob::resource());
        let list = self.list(api, selector, None);
        list.iter().map(|o| from_object(o, "TrainJob")).collect()
    }

    pub fn trainjob(&self, name: &str) -> Option<TrainJob> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.namespace, &TrainJob::resource());
        self.call(&format!("getting TrainJob {name}"), api.get_opt(name)).map(|o| from_object(&o, "TrainJob"))
    }

    /// Creates a TrainJob (or any object of the namespace the dynamic client knows) from JSON.
    pub fn create_trainjob(&self, object: serde_json::Value) {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.namespace, &TrainJob::resource());
        let object: DynamicObject = serde_json::from_value(object).expect("a TrainJob object");
        self.call("creating a TrainJob", api.create(&PostParams::default(), &object));
    }

    pub fn delete_trainjob(&self, name: &str) {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.namespace, &TrainJob::resource());
        self.call(&format!("deleting TrainJob {name}"), api.delete(name, &DeleteParams::default()));
    }

    pub fn delete_trainjobs(&self, selector: &str) {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &self.namespace, &TrainJob::resource());
        let lp = ListParams::default().labels(selector);
        self.call(&format!("deleting TrainJobs {selector}"), api.delete_collection(&DeleteParams::default(), &lp));
    }

    pub fn pods(&self, selector: &str) -> Vec<Pod> {
        self.list(self.api(), selector, None)
    }

    pub fn running_pods(&self, selector: &str) -> Vec<Pod> {
        self.list(self.api(), selector, Some("status.phase=Running"))
    }

    /// Deletes a pod as `kubectl delete pod` does; with `wait`, until it is gone (at most 180 s).
    pub fn delete_pod(&self, name: &str, grace_seconds: Option<u32>, wait: bool) {
        let api: Api<Pod> = self.api();
        let dp = DeleteParams { grace_period_seconds: grace_seconds, ..DeleteParams::default() };
        self.call(&format!("deleting pod {name}"), api.delete(name, &dp));
        if wait {
            crate::wait_until(crate::secs(180), &format!("pod {name} to be gone"), || {
                self.call("getting a pod", api.get_opt(name)).is_none()
            });
        }
    }

    /// Evicts a pod through the Eviction API, as a drain does.
    pub fn evict_pod(&self, name: &str, grace_seconds: Option<u32>) {
        let api: Api<Pod> = self.api();
        let delete_options =
            grace_seconds.map(|g| DeleteParams { grace_period_seconds: Some(g), ..Default::default() });
        let ep = EvictParams { delete_options, ..EvictParams::default() };
        self.call(&format!("evicting pod {name}"), api.evict(name, &ep));
    }

    /// The last `tail` lines of a pod's log ("" when it has none).
    pub fn pod_log(&self, name: &str, tail: i64) -> String {
        let api: Api<Pod> = self.api();
        self.rt
            .block_on(api.logs(name, &LogParams { tail_lines: Some(tail), ..LogParams::default() }))
            .unwrap_or_default()
    }

    pub fn configmaps(&self, selector: &str) -> Vec<ConfigMap> {
        self.list(self.api(), selector, None)
    }

    pub fn jobs(&self, selector: &str) -> Vec<Job> {
        self.list(self.api(), selector, None)
    }

    pub fn job(&self, name: &str) -> Option<Job> {
        let api: Api<Job> = self.api();
        self.call(&format!("getting Job {name}"), api.get_opt(name))
    }

    pub fn nodes(&self, selector: &str) -> Vec<Node> {
        self.list(Api::all(self.client.clone()), selector, None)
    }

    pub fn create_node(&self, node: &Node) {
        self.call("creating a Node", Api::<Node>::all(self.client.clone()).create(&PostParams::default(), node));
    }

    pub fn delete_nodes(&self, selector: &str) {
        let api: Api<Node> = Api::all(self.client.clone());
        let lp = ListParams::default().labels(selector);
        self.call(&format!("deleting Nodes {selector}"), api.delete_collection(&DeleteParams::default(), &lp));
    }

    pub fn create_pvc(&self, pvc: &PersistentVolumeClaim) {
        self.call("creating a PersistentVolumeClaim", self.api().create(&PostParams::default(), pvc));
    }

    pub fn delete_pvc(&self, name: &str) {
        let api: Api<PersistentVolumeClaim> = self.api();
        self.call(&format!("deleting PersistentVolumeClaim {name}"), api.delete(name, &DeleteParams::default()));
    }

    pub fn create_service_account(&self, name: &str) {
        let sa = ServiceAccount { metadata: meta(name), ..Default::default() };
        self.call(&format!("creating ServiceAccount {name}"), self.api().create(&PostParams::default(), &sa));
    }

    pub fn delete_service_account(&self, name: &str) {
        let api: Api<ServiceAccount> = self.api();
        self.call(&format!("deleting ServiceAccount {name}"), api.delete(name, &DeleteParams::default()));
    }

    pub fn cronjob(&self, name: &str) -> CronJob {
        self.call(&format!("getting CronJob {name}"), self.api().get(name))
    }

    pub fn replace_cronjob(&self, cronjob: &CronJob) {
        let name = cronjob.metadata.name.clone().unwrap_or_default();
        let what = format!("replacing CronJob {name}");
        self.call(&what, self.api().replace(&name, &PostParams::default(), cronjob));
    }

    pub fn create_job(&self, job: &Job) {
        self.call("creating a Job", self.api().create(&PostParams::default(), job));
    }

    /// The sum of the API server's counter `name` over its series whose labels contain `filter`
    /// (from `/metrics`).
    pub fn metric(&self, name: &str, filter: &str) -> u64 {
        let request = http::Request::get("/metrics").body(Vec::new()).expect("a request");
        let text = self.call("reading /metrics", self.client.request_text(request));
        let series = format!("{name}{{");
        text.lines()
            .filter(|l| l.starts_with(&series) && l.contains(filter))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// Applies every object of a YAML stream (server-side apply, the namespace's by default).
    pub fn apply_yaml(&self, yaml: &str) {
        for result in self.apply(yaml, PatchParams::apply("mflow-e2e").force()) {
            result.unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Sends every object of a YAML stream as a dry run with strict field validation, as
    /// `kubectl apply --dry-run=server --validate=strict` does: the server checks the schema
    /// and admission webhooks check the objects, and nothing is stored. One result per object.
    pub fn dry_run_yaml(&self, yaml: &str) -> Vec<Result<String, String>> {
        self.apply(yaml, PatchParams::apply("mflow-e2e").force().dry_run().validation_strict())
    }

    /// The objects of a YAML stream (`---`-separated documents; empty ones skipped).
    pub fn objects(yaml: &str) -> Vec<DynamicObject> {
        let mut objects = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(yaml) {
            let value = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("not YAML: {e}\n{yaml}"));
            if value.is_null() {
                continue;
            }
            objects.push(serde_yaml::from_value(value).unwrap_or_else(|e| panic!("not an object: {e}")));
        }
        objects
    }

    fn apply(&self, yaml: &str, pp: PatchParams) -> Vec<Result<String, String>> {
        let objects = Self::objects(yaml);
        self.rt.block_on(async {
            let mut results = Vec::new();
            for object in objects {
                let types = object.types.clone().unwrap_or_default();
                let name = object.metadata.name.clone().unwrap_or_default();
                let what = format!("{} {name}", types.kind);
                let gvk = kube::core::GroupVersionKind::try_from(&types).map_err(|e| format!("{what}: {e}"));
                let result = match gvk {
                    Ok(gvk) => match pinned_kind(&self.client, &gvk).await {
                        Ok((resource, caps)) => {
                            let api: Api<DynamicObject> = if caps.scope == Scope::Namespaced {
                                let ns = object.metadata.namespace.clone().unwrap_or_else(|| self.namespace.clone());
                                Api::namespaced_with(self.client.clone(), &ns, &resource)
                            } else {
                                Api::all_with(self.client.clone(), &resource)
                            };
                            api.patch(&name, &pp, &Patch::Apply(&object)).await.map(|_| what.clone())
                        }
                        Err(e) => Err(e),
                    }
                    .map_err(|e| format!("{what}: {e}")),
                    Err(e) => Err(e),
                };
                results.push(result);
            }
            results
        })
    }

    /// Takes away the webhook configurations whose names contain `part` (as when a controller
    /// was never installed) and returns them, to be put back with [`Cluster::restore_webhooks`].
    pub fn remove_webhooks(&self, part: &str) -> Webhooks {
        let validating: Api<ValidatingWebhookConfiguration> = Api::all(self.client.clone());
        let mutating: Api<MutatingWebhookConfiguration> = Api::all(self.client.clone());
        let saved = Webhooks {
            validating: self
                .list(validating.clone(), "", None)
                .into_iter()
                .filter(|w| named(&w.metadata, part))
                .collect(),
            mutating: self.list(mutating.clone(), "", None).into_iter().filter(|w| named(&w.metadata, part)).collect(),
        };
        assert!(!saved.validating.is_empty(), "no validating webhook configuration named after {part}");
        let dp = DeleteParams::default();
        for w in &saved.validating {
            let name = w.metadata.name.as_deref().unwrap_or("");
            self.call(&format!("deleting webhook configuration {name}"), validating.delete(name, &dp));
        }
        for w in &saved.mutating {
            let name = w.metadata.name.as_deref().unwrap_or("");
            self.call(&format!("deleting webhook configuration {name}"), mutating.delete(name, &dp));
        }
        saved
    }

    /// Creates the webhook configurations again.
    pub fn restore_webhooks(&self, saved: Webhooks) -> Result<(), String> {
        let pp = PostParams::default();
        let failed = |e: kube::Error| format!("restoring a webhook configuration: {e}");
        self.rt.block_on(async {
            for mut w in saved.validating {
                w.metadata = fresh(w.metadata);
                Api::all(self.client.clone()).create(&pp, &w).await.map_err(failed)?;
            }
            for mut w in saved.mutating {
                w.metadata = fresh(w.metadata);
                Api::all(self.client.clone()).create(&pp, &w).await.map_err(failed)?;
            }
            Ok(())
        })
    }
}

/// Webhook configurations taken away by [`Cluster::remove_webhooks`].
pub struct Webhooks {
    validating: Vec<ValidatingWebhookConfiguration>,
    mutating: Vec<MutatingWebhookConfiguration>,
}

fn named(meta: &ObjectMeta, part: &str) -> bool {
    meta.name.as_deref().is_some_and(|n| n.to_lowercase().contains(part))
}

/// The metadata of an object to create again: its name, labels and annotations.
fn fresh(meta: ObjectMeta) -> ObjectMeta {
    ObjectMeta { name: meta.name, labels: meta.labels, annotations: meta.annotations, ..ObjectMeta::default() }
}

pub fn meta(name: &str) -> ObjectMeta {
    ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() }
}

fn from_object<T: DeserializeOwned>(object: &impl Serialize, what: &str) -> T {
    let value = serde_json::to_value(object).expect("an object as JSON");
    serde_json::from_value(value).unwrap_or_else(|e| panic!("a {what} of an unexpected shape: {e}"))
}

/// The value of a variable of a pod's first container.
pub fn pod_env(pod: &Pod, name: &str) -> Option<String> {
    pod_var(pod, name)?.value.clone()
}

/// The field a variable of a pod's first container refers to (`valueFrom.fieldRef`).
pub fn pod_env_field(pod: &Pod, name: &str) -> Option<String> {
    Some(pod_var(pod, name)?.value_from.as_ref()?.field_ref.as_ref()?.field_path.clone())
}

fn pod_var<'a>(pod: &'a Pod, name: &str) -> Option<&'a k8s_openapi::api::core::v1::EnvVar> {
    pod.spec.as_ref()?.containers.first()?.env.as_ref()?.iter().find(|e| e.name == name)
}
