//! An in-process Kubernetes API server, faithful for the calls mflow makes: create, get, list,
//! watch, update and delete of namespaced and cluster objects; pod log streaming with follow;
//! discovery of the Trainer group; SelfSubjectAccessReview; Status bodies for 400, 403, 404,
//! 409 and 422; resourceVersion and watch resumption from a resourceVersion.
//!
//! Trainer's objects (TrainJob, TrainingRuntime, ClusterTrainingRuntime) are admitted as a
//! Kubernetes v1.35 server with Trainer v2.3 installed admits them, on create and on update:
//! unknown fields refused (`fieldValidation=Strict`, 400), defaults applied, the name, the real
//! CRD schema and its CEL rules checked (422), then Trainer's webhooks: patch times stamped,
//! the runtime must exist and reserved PET_* variables are refused (403). A test may add the
//! cluster's own admission policies ([`Policy`]), which no client can check beforehand (422).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use super::schema;
use super::structural::{ErrorKind, FieldError, Structural};

mod admission;
mod http;
use admission::*;
pub use admission::{FieldValidation, Policy};
use http::*;

#[derive(Clone, Debug)]
pub struct Change {
    pub rv: u64,
    pub resource: String,
    pub ns: String,
    pub kind: &'static str,
    pub object: Value,
}

#[derive(Default)]
pub struct PodLog {
    pub lines: Vec<String>,
    /// When each line was written (`timestamps=true`, `sinceTime`).
    pub times: Vec<k8s_openapi::jiff::Timestamp>,
    pub closed: bool,
}

pub struct Inner {
    rv: u64,
    uid: u64,
    objects: BTreeMap<(String, String, String), Value>,
    history: Vec<Change>,
    /// (verb, resource) pairs the caller is not allowed; resource may be `pods/log`.
    pub denied: HashSet<(String, String)>,
    /// When set, only these (verb, resource) pairs are allowed (an RBAC policy).
    pub allowed: Option<HashSet<(String, String)>>,
    /// Output of each container instance: (namespace, pod, restart count).
    pub logs: HashMap<(String, String, u32), PodLog>,
    /// Restart count of each pod's `node` container.
    pub restarts: HashMap<(String, String), u32>,
    /// `METHOD path` of every request, for assertions.
    pub requests: Vec<String>,
    pub trainer_installed: bool,
    /// The cluster's admission policies for TrainJobs, checked before Trainer's webhooks.
    pub policies: Vec<Policy>,
    /// Raised by [`Shared::break_streams`]: streams opened before it end.
    pub generation: u64,
}

pub struct Shared {
    pub inner: Mutex<Inner>,
    changes: broadcast::Sender<Change>,
    /// The resources served from Trainer's CRDs, by plural.
    crds: HashMap<&'static str, Crd>,
}

pub type Failure = (StatusCode, Value);

pub fn status_body(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code.as_u16()})
}

fn kind_of(resource: &str) -> (&'static str, &'static str) {
    match resource {
        "trainjobs" => ("TrainJob", "trainer.kubeflow.org/v1alpha1"),
        "clustertrainingruntimes" => ("ClusterTrainingRuntime", "trainer.kubeflow.org/v1alpha1"),
        "trainingruntimes" => ("TrainingRuntime", "trainer.kubeflow.org/v1alpha1"),
        "pods" => ("Pod", "v1"),
        "configmaps" => ("ConfigMap", "v1"),
        "events" => ("Event", "v1"),
        "persistentvolumeclaims" => ("PersistentVolumeClaim", "v1"),
        "customresourcedefinitions" => ("CustomResourceDefinition", "apiextensions.k8s.io/v1"),
        _ => ("Unknown", "v1"),
    }
}

fn group_of(resource: &str) -> &'static str {
    match resource {
        "trainjobs" | "clustertrainingruntimes" | "trainingruntimes" => "trainer.kubeflow.org",
        "customresourcedefinitions" => "apiextensions.k8s.io",
        _ => "",
    }
}

impl Shared {
    fn emit(&self, inner: &mut Inner, resource: &str, ns: &str, kind: &'static str, object: Value) {
        let change = Change { rv: inner.rv, resource: resource.into(), ns: ns.into(), kind, object };
        inner.history.push(change.clone());
        let _ = self.changes.send(change);
    }

    pub fn get(&self, resource: &str, ns: &str, name: &str) -> Option<Value> {
        self.inner.lock().unwrap().objects.get(&(resource.into(), ns.into(), name.into())).cloned()
    }

    pub fn list(&self, resource: &str, ns: &str) -> Vec<Value> {
        let inner = self.inner.lock().unwrap();
        inner.objects.iter().filter(|((r, n, _), _)| r == resource && n == ns).map(|(_, v)| v.clone()).collect()
    }

    /// Stores a new object (no admission checks: what a controller or `kubectl apply` does).
    pub fn insert(&self, resource: &str, ns: &str, mut obj: Value) -> Result<Value, Failure> {
        let name = obj["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let mut inner = self.inner.lock().unwrap();
        let id = (resource.to_string(), ns.to_string(), name.clone());
        if inner.objects.contains_key(&id) {
            let group = group_of(resource);
            let what = if group.is_empty() { resource.to_string() } else { format!("{resource}.{group}") };
            let mut body =
                status_body(StatusCode::CONFLICT, "AlreadyExists", &format!("{what} \"{name}\" already exists"));
            body["details"] = json!({"name": name, "kind": resource, "group": group});
            return Err((StatusCode::CONFLICT, body));
        }
        inner.rv += 1;
        inner.uid += 1;
        let (kind, api_version) = kind_of(resource);
        obj["kind"] = json!(kind);
        obj["apiVersion"] = json!(api_version);
        let meta = &mut obj["metadata"];
        if !ns.is_empty() {
            meta["namespace"] = json!(ns);
        }
        meta["uid"] = json!(format!("00000000-0000-0000-0000-{:012}", inner.uid));
        meta["resourceVersion"] = json!(inner.rv.to_string());
        meta["creationTimestamp"] = json!(NOW);
        meta["generation"] = json!(1);
        inner.objects.insert(id, obj.clone());
        self.emit(&mut inner, resource, ns, "ADDED", obj.clone());
        Ok(obj)
    }

    /// Changes an object in place (a controller writing status); no-op when it is gone.
    pub fn modify(&self, resource: &str, ns: &str, name: &str, f: impl FnOnce(&mut Value)) -> bool {
        let mut inner = self.inner.lock().unwrap();
        let id = (resource.to_string(), ns.to_string(), name.to_string());
        let Some(mut obj) = inner.objects.get(&id).cloned() else { return false };
        f(&mut obj);
        inner.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        inner.objects.insert(id, obj.clone());
        self.emit(&mut inner, resource, ns, "MODIFIED", obj);
        true
    }

    pub fn remove(&self, resource: &str, ns: &str, name: &str) -> Option<Value> {
        let mut inner = self.inner.lock().unwrap();
        let mut obj = inner.objects.remove(&(resource.to_string(), ns.to_string(), name.to_string()))?;
        inner.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        self.emit(&mut inner, resource, ns, "DELETED", obj.clone());
        if resource == "trainjobs" {
            // Garbage collection of the JobSet's pods.
            let pods: Vec<String> = inner
                .objects
                .iter()
                .filter(|((r, n, _), p)| {
                    r == "pods" && n == ns && p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == name
                })
                .map(|((_, _, pod), _)| pod.clone())
                .collect();
            drop(inner);
            for pod in pods {
                self.remove("pods", ns, &pod);
            }
        }
        Some(obj)
    }

    fn current_log(inner: &mut Inner, ns: &str, pod: &str) -> (String, String, u32) {
        let restarts = inner.restarts.get(&(ns.to_string(), pod.to_string())).copied().unwrap_or(0);
        (ns.to_string(), pod.to_string(), restarts)
    }

    pub fn append_log(&self, ns: &str, pod: &str, line: &str) {
        let mut inner = self.inner.lock().unwrap();
        let key = Self::current_log(&mut inner, ns, pod);
        let log = inner.logs.entry(key).or_default();
        log.lines.push(line.into());
        log.times.push(k8s_openapi::jiff::Timestamp::now());
    }

    /// Ends every open watch and log stream with an error, as a restarting API server does.
    pub fn break_streams(&self) {
        self.inner.lock().unwrap().generation += 1;
    }

    pub fn close_log(&self, ns: &str, pod: &str) {
        let mut inner = self.inner.lock().unwrap();
        let key = Self::current_log(&mut inner, ns, pod);
        inner.logs.entry(key).or_default().closed = true;
    }

    /// The container restarts: its log so far ends and a new one begins.
    pub fn restart_container(&self, ns: &str, pod: &str) -> u32 {
        self.close_log(ns, pod);
        let mut inner = self.inner.lock().unwrap();
        let count = inner.restarts.entry((ns.to_string(), pod.to_string())).or_insert(0);
        *count += 1;
        *count
    }

    pub fn deny(&self, verb: &str, resource: &str) {
        self.inner.lock().unwrap().denied.insert((verb.into(), resource.into()));
    }

    /// Enforces the rules of RBAC Role and ClusterRole documents: everything else is forbidden.
    pub fn enforce_rbac(&self, roles: &[Value]) {
        let mut allowed = HashSet::new();
        for role in roles.iter().filter(|r| r["kind"] == "Role" || r["kind"] == "ClusterRole") {
            for rule in role["rules"].as_array().into_iter().flatten() {
                for resource in rule["resources"].as_array().into_iter().flatten() {
                    for verb in rule["verbs"].as_array().into_iter().flatten() {
                        allowed.insert((verb.as_str().unwrap().to_string(), resource.as_str().unwrap().to_string()));
                    }
                }
            }
        }
        self.inner.lock().unwrap().allowed = Some(allowed);
    }

    fn is_allowed(inner: &Inner, verb: &str, resource: &str) -> bool {
        let key = (verb.to_string(), resource.to_string());
        !inner.denied.contains(&key) && inner.allowed.as_ref().is_none_or(|a| a.contains(&key))
    }

    pub fn count_requests(&self, prefix: &str) -> usize {
        self.inner.lock().unwrap().requests.iter().filter(|r| r.starts_with(prefix)).count()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// What the API server and Trainer's webhooks do with a body before storing it: the object
    /// is pruned, defaulted and stamped in place; the warnings are the response's.
    pub fn admit(
        &self,
        resource: &str,
        ns: &str,
        obj: &mut Value,
        old: Option<&Value>,
        validation: FieldValidation,
    ) -> Result<Vec<String>, Failure> {
        let Some(crd) = self.crds.get(resource) else { return Ok(Vec::new()) };
        let (kind, _) = kind_of(resource);
        let group = group_of(resource);
        let mut warnings = Vec::new();
        let unknown: Vec<String> =
            crd.structural.prune(obj).iter().map(|p| format!("unknown field {}", json!(p))).collect();
        if !unknown.is_empty() {
            match validation {
                FieldValidation::Strict => {
                    let msg = format!(
                        "{kind} in version \"v1alpha1\" cannot be handled as a {kind}: strict decoding error: {}",
                        unknown.join(", ")
                    );
                    return Err((StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &msg)));
                }
                FieldValidation::Warn => warnings.extend(unknown),
                FieldValidation::Ignore => {}
            }
        }
        // With a status subresource, the main resource never writes status.
        if crd.status_subresource {
            match old.and_then(|o| o.get("status")) {
                Some(status) => obj["status"] = status.clone(),
                None => {
                    if let Some(map) = obj.as_object_mut() {
                        map.remove("status");
                    }
                }
            }
        }
        crd.structural.default(obj);
        if resource == "trainjobs" {
            stamp_patch_times(obj, old);
        }

        let name = obj["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let mut errors = name_errors(obj);
        let (schema_errors, blocking) = schema::check(&crd.schema, obj);
        let mut messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
        messages.extend(schema_errors);
        if blocking {
            let skipped = FieldError::invalid("", Some("\"null\"".into()), "some validation rules were not checked because the object was invalid; correct the existing errors to complete validation");
            messages.push(skipped.to_string());
            errors.push(skipped);
        } else {
            let (failed, ratcheted) = crd.structural.validate(obj, old);
            messages.extend(failed.iter().map(ToString::to_string));
            errors.extend(failed);
            warnings.extend(ratcheted.iter().map(ToString::to_string));
        }
        if !messages.is_empty() {
            return Err(invalid_failure(&format!("{kind}.{group}"), &name, group, kind, &errors, &messages));
        }
        if resource == "trainjobs" {
            let policies = self.inner.lock().unwrap().policies.clone();
            policy_denial(&policies, resource, obj)?;
            self.validate_trainjob(ns, obj)?;
        }
        Ok(warnings)
    }

    /// Trainer's validating webhook for TrainJobs: the runtime must exist, and a torch runtime
    /// injects the PET_* variables itself.
    fn validate_trainjob(&self, ns: &str, obj: &Value) -> Result<(), Failure> {
        let denied = |msg: String| {
            let msg =
                format!("admission webhook \"validator.trainjob.trainer.kubeflow.org\" denied the request: {msg}");
            (StatusCode::FORBIDDEN, status_body(StatusCode::FORBIDDEN, "Forbidden", &msg))
        };
        let reference = &obj["spec"]["runtimeRef"];
        let name = reference["name"].as_str().unwrap_or_default();
        let group = reference["apiGroup"].as_str().unwrap_or("trainer.kubeflow.org");
        let kind = reference["kind"].as_str().unwrap_or("ClusterTrainingRuntime");
        let (resource, scope, path, what) = match (kind, group) {
            ("ClusterTrainingRuntime", "trainer.kubeflow.org") => {
                ("clustertrainingruntimes", "", "spec.RuntimeRef", "clusterTrainingRuntime")
            }
            ("TrainingRuntime", "trainer.kubeflow.org") => {
                ("trainingruntimes", ns, "spec.runtimeRef", "trainingRuntime")
            }
            _ => return Err(denied(format!("unsupported runtime: {kind}.{group}"))),
        };
        let Some(runtime) = self.get(resource, scope, name) else {
            // Go's JSON of the RuntimeRef struct, in its field order.
            let shown = format!("{{\"name\":{},\"apiGroup\":{},\"kind\":{}}}", json!(name), json!(group), json!(kind));
            return Err(denied(format!(
                "{path}: Invalid value: {shown}: {resource}.trainer.kubeflow.org {} not found: specified {what} must be created before the TrainJob is created",
                json!(name)
            )));
        };
        let trainer = &obj["spec"]["trainer"];
        let torchtune = trainer["command"] == json!(["tune", "run"]);
        if runtime["spec"]["mlPolicy"].get("torch").is_some() && !torchtune {
            let env = trainer["env"].as_array().cloned().unwrap_or_default();
            let mut reserved: Vec<&str> =
                env.iter().filter_map(|e| e["name"].as_str()).filter(|n| TORCHRUN_RESERVED_ENV.contains(n)).collect();
            reserved.sort();
            reserved.dedup();
            if !reserved.is_empty() {
                let shown: Vec<String> = env.iter().map(env_json).collect();
                return Err(denied(format!(
                    "spec.trainer.env: Invalid value: [{}]: must not have reserved envs, invalid envs configured: [{}]",
                    shown.join(","),
                    reserved.join(" ")
                )));
            }
        }
        Ok(())
    }
}

/// What Trainer's torch plugin sets on the `node` container (`TorchRunReservedEnvNames`).
const TORCHRUN_RESERVED_ENV: &[&str] =
    &["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"];

pub struct FakeApi {
    pub shared: Arc<Shared>,
    pub addr: SocketAddr,
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves each connection in a task of its own set, so that dropping the set (the server going
/// down) closes them all.
async fn serve(listener: tokio::net::TcpListener, app: Router) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((socket, _)) = listener.accept().await else { continue };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        connections.spawn(async move {
            let io = hyper_util::rt::TokioIo::new(socket);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
        while connections.try_join_next().is_some() {}
    }
}

impl FakeApi {
    pub async fn start() -> FakeApi {
        let trainjob_crd = schema::crd("trainer.kubeflow.org_trainjobs.yaml");
        let (changes, _) = broadcast::channel(4096);
        let crds = HashMap::from([
            ("trainjobs", Crd::load("trainer.kubeflow.org_trainjobs.yaml")),
            ("trainingruntimes", Crd::load("trainer.kubeflow.org_trainingruntimes.yaml")),
            ("clustertrainingruntimes", Crd::load("trainer.kubeflow.org_clustertrainingruntimes.yaml")),
        ]);
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                rv: 100,
                uid: 0,
                objects: BTreeMap::new(),
                history: Vec::new(),
                denied: HashSet::new(),
                allowed: None,
                logs: HashMap::new(),
                restarts: HashMap::new(),
                requests: Vec::new(),
                trainer_installed: true,
                policies: Vec::new(),
                generation: 0,
            }),
            changes,
            crds,
        });
        shared.insert("customresourcedefinitions", "", trainjob_crd).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(dispatch).with_state(shared.clone());
        let server = tokio::spawn(serve(listener, app));
        FakeApi { shared, addr, server: Mutex::new(Some(server)) }
    }

    /// The API server goes down: its port refuses connections and open ones are cut.
    pub fn stop(&self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
        self.shared.break_streams();
    }

    /// The API server comes back on the same address, with the same objects.
    pub async fn start_again(&self) {
        self.stop();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let listener =
            tokio::net::TcpListener::bind(self.addr).await.expect("the fake API server's port is free again");
        let app = Router::new().fallback(dispatch).with_state(self.shared.clone());
        *self.server.lock().unwrap() = Some(tokio::spawn(serve(listener, app)));
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig file pointing at this server, with a bearer token.
    pub fn kubeconfig(&self, dir: &std::path::Path, namespace: &str) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: mflow\n    namespace: {namespace}\nusers:\n- name: mflow\n  user:\n    token: not-a-real-token\n",
            self.url()
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Installs a ClusterTrainingRuntime from the shared Kubeflow data or the examples, as
    /// `kubectl apply` would: a runtime the server refuses fails the test.
    pub fn add_runtime(&self, mut runtime: Value) {
        let name = runtime["metadata"]["name"].as_str().unwrap_or_default().to_string();
        if let Err((code, body)) =
            self.shared.admit("clustertrainingruntimes", "", &mut runtime, None, FieldValidation::Strict)
        {
            panic!("ClusterTrainingRuntime {name:?} refused ({code}): {}", body["message"]);
        }
        self.shared.insert("clustertrainingruntimes", "", runtime).unwrap();
    }

    pub fn add_pvc(&self, ns: &str, name: &str) {
        let pvc = json!({"metadata": {"name": name}, "spec": {"accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "100Gi"}}}});
        self.shared.insert("persistentvolumeclaims", ns, pvc).unwrap();
    }
}
