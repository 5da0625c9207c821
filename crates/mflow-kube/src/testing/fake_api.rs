//! An in-process Kubernetes API server, faithful for the calls mflow makes: create, get, list,
//! watch, update and delete of namespaced and cluster objects; pod log streaming with follow;
//! discovery of the Trainer group; SelfSubjectAccessReview; Status bodies for 400, 403, 404,
//! 409 and 422; resourceVersion and watch resumption from a resourceVersion.
//!
//! Trainer's objects (TrainJob, TrainingRuntime, ClusterTrainingRuntime) are admitted as a
//! Kubernetes v1.35 server with Trainer v2.3 installed admits them, on create and on update:
//! unknown fields refused (`fieldValidation=Strict`, 400), defaults applied, the name, the real
//! CRD schema and its CEL rules checked (422), then Trainer's webhooks: patch times stamped,
//! the runtime must exist and reserved PET_* variables are refused (403).

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
    /// Raised by [`Shared::break_streams`]: streams opened before it end.
    pub generation: u64,
}

pub struct Shared {
    pub inner: Mutex<Inner>,
    changes: broadcast::Sender<Change>,
    /// The resources served from Trainer's CRDs, by plural.
    crds: HashMap<&'static str, Crd>,
}

/// A resource served from a CRD: its schema as JSON Schema and as a structural schema.
struct Crd {
    schema: jsonschema::Validator,
    structural: Structural,
    status_subresource: bool,
}

impl Crd {
    fn load(file: &str) -> Crd {
        let crd = schema::crd(file);
        let structural = Structural::compile(&crd, "v1alpha1").unwrap_or_else(|e| panic!("{e}"));
        let version = crd["spec"]["versions"].as_array().and_then(|v| v.iter().find(|v| v["name"] == "v1alpha1"));
        let status_subresource = version.is_some_and(|v| v["subresources"].get("status").is_some());
        Crd { schema: schema::crd_validator(&crd), structural, status_subresource }
    }
}

/// The `fieldValidation` query parameter of create and update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldValidation {
    Strict,
    Warn,
    Ignore,
}

impl FieldValidation {
    /// Without the parameter the real server warns and drops unknown fields; this one refuses
    /// them, so that a test sees what a real cluster would silently lose.
    fn from_query(query: &HashMap<String, String>, options: &str) -> Result<FieldValidation, Failure> {
        match query.get("fieldValidation").map(String::as_str) {
            None | Some("") | Some("Strict") => Ok(FieldValidation::Strict),
            Some("Warn") => Ok(FieldValidation::Warn),
            Some("Ignore") => Ok(FieldValidation::Ignore),
            Some(other) => {
                let e = FieldError {
                    path: "fieldValidation".into(),
                    kind: ErrorKind::NotSupported(json!(other).to_string()),
                    detail: r#"supported values: "", "Ignore", "Strict", "Warn""#.into(),
                };
                let what = format!("{options}.meta.k8s.io");
                Err(invalid_failure(&what, "", "meta.k8s.io", options, std::slice::from_ref(&e), &[e.to_string()]))
            }
        }
    }
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
            let mut body = status_body(StatusCode::CONFLICT, "AlreadyExists", &format!("{what} \"{name}\" already exists"));
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
            self.validate_trainjob(ns, obj)?;
        }
        Ok(warnings)
    }

    /// Trainer's validating webhook for TrainJobs: the runtime must exist, and a torch runtime
    /// injects the PET_* variables itself.
    fn validate_trainjob(&self, ns: &str, obj: &Value) -> Result<(), Failure> {
        let denied = |msg: String| {
            let msg = format!("admission webhook \"validator.trainjob.trainer.kubeflow.org\" denied the request: {msg}");
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
            ("TrainingRuntime", "trainer.kubeflow.org") => ("trainingruntimes", ns, "spec.runtimeRef", "trainingRuntime"),
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
            let mut reserved: Vec<&str> = env
                .iter()
                .filter_map(|e| e["name"].as_str())
                .filter(|n| TORCHRUN_RESERVED_ENV.contains(n))
                .collect();
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
const TORCHRUN_RESERVED_ENV: &[&str] = &["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"];

/// Go's JSON of a corev1.EnvVar: name, value (left out when empty), valueFrom.
fn env_json(env: &Value) -> String {
    let mut out = format!("{{\"name\":{}", env["name"]);
    if let Some(v) = env["value"].as_str().filter(|v| !v.is_empty()) {
        out.push_str(&format!(",\"value\":{}", json!(v)));
    }
    if let Some(from) = env.get("valueFrom") {
        out.push_str(&format!(",\"valueFrom\":{from}"));
    }
    out.push('}');
    out
}

/// Trainer's defaulting webhook: every runtime patch carries the time it was last changed.
fn stamp_patch_times(obj: &mut Value, old: Option<&Value>) {
    let old_patches = old.and_then(|o| o["spec"]["runtimePatches"].as_array()).cloned().unwrap_or_default();
    let Some(patches) = obj["spec"].get_mut("runtimePatches").and_then(Value::as_array_mut) else { return };
    for patch in patches {
        let before = old_patches.iter().find(|p| p["manager"] == patch["manager"]);
        let untimed = |p: &Value| {
            let mut p = p.clone();
            if let Some(m) = p.as_object_mut() {
                m.remove("time");
            }
            p
        };
        match before {
            Some(b) if untimed(b) == untimed(patch) && b.get("time").is_some() => patch["time"] = b["time"].clone(),
            _ if patch.get("time").is_none() => patch["time"] = json!(NOW),
            _ => {}
        }
    }
}

/// The fake cluster's clock.
const NOW: &str = "2026-01-01T00:00:00Z";

/// The name rules of every custom resource (a DNS subdomain).
fn name_errors(obj: &Value) -> Vec<FieldError> {
    let meta = &obj["metadata"];
    let name = meta["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        return if meta["generateName"].as_str().is_some_and(|g| !g.is_empty()) {
            Vec::new()
        } else {
            vec![FieldError {
                path: "metadata.name".into(),
                kind: ErrorKind::Required,
                detail: "name or generateName is required".into(),
            }]
        };
    }
    let shown = Some(json!(name).to_string());
    let mut errors = Vec::new();
    if name.len() > 253 {
        errors.push(FieldError::invalid("metadata.name", shown.clone(), "must be no more than 253 characters"));
    }
    let label = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !name.split('.').all(label) {
        errors.push(FieldError::invalid(
            "metadata.name",
            shown,
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')",
        ));
    }
    errors
}

/// `utilerrors.Aggregate`: one message alone, several in brackets, duplicates once.
fn aggregate(messages: &[String]) -> String {
    let mut seen: Vec<&String> = Vec::new();
    for m in messages {
        if !seen.contains(&m) {
            seen.push(m);
        }
    }
    let joined = seen.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    if seen.len() == 1 {
        joined
    } else {
        format!("[{joined}]")
    }
}

/// A 422 Invalid Status: `Kind.group "name" is invalid: ...`, with a cause per field error.
fn invalid_failure(
    what: &str,
    name: &str,
    group: &str,
    kind: &str,
    errors: &[FieldError],
    messages: &[String],
) -> Failure {
    let code = StatusCode::UNPROCESSABLE_ENTITY;
    let mut body = status_body(code, "Invalid", &format!("{what} {} is invalid: {}", json!(name), aggregate(messages)));
    let causes: Vec<Value> = errors
        .iter()
        .map(|e| json!({"reason": e.cause_reason(), "message": e.body(), "field": e.path}))
        .collect();
    body["details"] = json!({"name": name, "group": group, "kind": kind, "causes": causes});
    (code, body)
}

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
        let listener = tokio::net::TcpListener::bind(self.addr).await.expect("the fake API server's port is free again");
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

fn respond(code: StatusCode, body: Value) -> Response {
    (code, [("content-type", "application/json")], body.to_string()).into_response()
}

fn fail((code, body): Failure) -> Response {
    respond(code, body)
}

fn not_found(resource: &str, name: &str) -> Response {
    let group = group_of(resource);
    let what = if group.is_empty() { resource.to_string() } else { format!("{resource}.{group}") };
    let mut body = status_body(StatusCode::NOT_FOUND, "NotFound", &format!("{what} \"{name}\" not found"));
    body["details"] = json!({"name": name, "group": group, "kind": resource});
    respond(StatusCode::NOT_FOUND, body)
}

/// Parsed request path: namespace, resource, name, subresource.
struct Target {
    ns: String,
    resource: String,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<Result<Target, String>> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => (v.to_string(), rest.to_vec()),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest.to_vec()),
        _ => return None,
    };
    let t = |ns: &str, r: &str, n: Option<&str>, s: Option<&str>| {
        Some(Ok(Target { ns: ns.into(), resource: r.into(), name: n.map(Into::into), sub: s.map(Into::into) }))
    };
    match rest.as_slice() {
        [] => Some(Err(gv.clone())),
        ["namespaces", ns, r] => t(ns, r, None, None),
        ["namespaces", ns, r, n] => t(ns, r, Some(n), None),
        ["namespaces", ns, r, n, s] => t(ns, r, Some(n), Some(s)),
        [r] => t("", r, None, None),
        [r, n] => t("", r, Some(n), None),
        _ => None,
    }
}

async fn dispatch(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let query: HashMap<String, String> =
        Query::<HashMap<String, String>>::try_from_uri(&uri).map(|q| q.0).unwrap_or_default();
    let body = axum::body::to_bytes(req.into_body(), 16 << 20).await.unwrap_or_default();
    shared.inner.lock().unwrap().requests.push(format!("{method} {}", uri.path()));

    if uri.path() == "/version" {
        return respond(StatusCode::OK, json!({"major": "1", "minor": "35", "gitVersion": "v1.35.0",
            "gitCommit": "fake", "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64"}));
    }
    let target = match parse_path(uri.path()) {
        None => return not_found("path", uri.path()),
        Some(Err(gv)) => return discovery(&shared, &gv),
        Some(Ok(t)) => t,
    };
    if target.resource == "selfsubjectaccessreviews" && method == Method::POST {
        return access_review(&shared, &body);
    }
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match (&method, &target.name, watch) {
        (&Method::GET, None, true) => "watch",
        (&Method::GET, None, false) => "list",
        (&Method::GET, Some(_), _) => "get",
        (&Method::POST, _, _) => "create",
        (&Method::PUT, _, _) => "update",
        (&Method::DELETE, _, _) => "delete",
        _ => return respond(StatusCode::METHOD_NOT_ALLOWED, status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "")),
    };
    let full_resource = match &target.sub {
        Some(sub) => format!("{}/{sub}", target.resource),
        None => target.resource.clone(),
    };
    if !Shared::is_allowed(&shared.inner.lock().unwrap(), verb, &full_resource) {
        let group = group_of(&target.resource);
        let what = if group.is_empty() { target.resource.clone() } else { format!("{}.{group}", target.resource) };
        let msg = format!(
            "{what} is forbidden: User \"system:serviceaccount:{}:mflow\" cannot {verb} resource \"{full_resource}\" in API group \"{group}\" in the namespace \"{}\"",
            target.ns, target.ns
        );
        let mut body = status_body(StatusCode::FORBIDDEN, "Forbidden", &msg);
        body["details"] = json!({"group": group, "kind": target.resource});
        return respond(StatusCode::FORBIDDEN, body);
    }
    match (verb, target.sub.as_deref()) {
        ("get", Some("log")) => pod_log(shared, &target, &query).await,
        ("watch", _) => watch_stream(shared, &target, &query),
        ("list", _) => list(&shared, &target, &query),
        // A namespace exists when it holds an object (and the ones every cluster has).
        ("get", _) if target.resource == "namespaces" && target.ns.is_empty() => {
            let name = target.name.as_deref().unwrap();
            let held = shared.inner.lock().unwrap().objects.keys().any(|(_, ns, _)| ns == name);
            if held || ["default", "kube-system", "kube-public"].contains(&name) {
                respond(StatusCode::OK, json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "status": {"phase": "Active"}}))
            } else {
                not_found("namespaces", name)
            }
        }
        ("get", _) => {
            let name = target.name.as_deref().unwrap();
            match shared.get(&target.resource, &target.ns, name) {
                Some(obj) => respond(StatusCode::OK, obj),
                None => not_found(&target.resource, name),
            }
        }
        ("create", _) => create(&shared, &target, &body, &query),
        ("update", _) => update(&shared, &target, &body, &query),
        ("delete", _) => {
            let name = target.name.as_deref().unwrap();
            match shared.remove(&target.resource, &target.ns, name) {
                Some(obj) => respond(StatusCode::OK, obj),
                None => not_found(&target.resource, name),
            }
        }
        _ => not_found(&target.resource, ""),
    }
}

fn discovery(shared: &Shared, gv: &str) -> Response {
    if gv != "trainer.kubeflow.org/v1alpha1" || !shared.inner.lock().unwrap().trainer_installed {
        return respond(StatusCode::NOT_FOUND, status_body(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource"));
    }
    let res = |name: &str, kind: &str, namespaced: bool| json!({"name": name, "singularName": kind.to_lowercase(),
        "namespaced": namespaced, "kind": kind,
        "verbs": ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]});
    respond(StatusCode::OK, json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
        "resources": [res("trainjobs", "TrainJob", true), res("trainingruntimes", "TrainingRuntime", true),
                      res("clustertrainingruntimes", "ClusterTrainingRuntime", false)]}))
}

fn access_review(shared: &Shared, body: &Bytes) -> Response {
    let mut review: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let attrs = &review["spec"]["resourceAttributes"];
    let mut resource = attrs["resource"].as_str().unwrap_or_default().to_string();
    if let Some(sub) = attrs["subresource"].as_str().filter(|s| !s.is_empty()) {
        resource = format!("{resource}/{sub}");
    }
    let verb = attrs["verb"].as_str().unwrap_or_default().to_string();
    let allowed = Shared::is_allowed(&shared.inner.lock().unwrap(), &verb, &resource);
    review["status"] = json!({"allowed": allowed});
    review["apiVersion"] = json!("authorization.k8s.io/v1");
    review["kind"] = json!("SelfSubjectAccessReview");
    respond(StatusCode::CREATED, review)
}

/// `a=b`, `a==b`, `a!=b`, `a in (b,c)`, `a notin (b)`, `a`, `!a`, comma-separated.
fn label_selector_matches(selector: &str, labels: &Value) -> bool {
    let mut terms = Vec::new();
    let mut depth = 0;
    let mut current = String::new();
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    terms.push(current);
    terms.iter().map(|t| t.trim()).filter(|t| !t.is_empty()).all(|term| {
        let get = |k: &str| labels.get(k.trim()).and_then(Value::as_str);
        if let Some((k, v)) = term.split_once("!=") {
            get(k) != Some(v.trim())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            get(k) == Some(v.trim())
        } else if let Some((k, set)) = term.split_once(" notin ") {
            let set: Vec<&str> = set.trim().trim_matches(|c| c == '(' || c == ')').split(',').map(str::trim).collect();
            get(k).is_none_or(|v| !set.contains(&v))
        } else if let Some((k, set)) = term.split_once(" in ") {
            let set: Vec<&str> = set.trim().trim_matches(|c| c == '(' || c == ')').split(',').map(str::trim).collect();
            get(k).is_some_and(|v| set.contains(&v))
        } else if let Some(k) = term.strip_prefix('!') {
            get(k).is_none()
        } else {
            get(term).is_some()
        }
    })
}

fn field_selector_matches(selector: &str, obj: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (path, want, eq) = match term.split_once("!=") {
            Some((p, v)) => (p, v, false),
            None => match term.split_once("==").or_else(|| term.split_once('=')) {
                Some((p, v)) => (p, v, true),
                None => return false,
            },
        };
        let pointer = format!("/{}", path.replace('.', "/"));
        let have = obj.pointer(&pointer).and_then(Value::as_str).unwrap_or_default();
        (have == want) == eq
    })
}

fn selected(obj: &Value, query: &HashMap<String, String>) -> bool {
    let labels = obj["metadata"].get("labels").cloned().unwrap_or(json!({}));
    query.get("labelSelector").is_none_or(|s| label_selector_matches(s, &labels))
        && query.get("fieldSelector").is_none_or(|s| field_selector_matches(s, obj))
}

fn list(shared: &Shared, target: &Target, query: &HashMap<String, String>) -> Response {
    let rv = shared.inner.lock().unwrap().rv;
    let items: Vec<Value> =
        shared.list(&target.resource, &target.ns).into_iter().filter(|o| selected(o, query)).collect();
    let (kind, api_version) = kind_of(&target.resource);
    respond(StatusCode::OK, json!({"kind": format!("{kind}List"), "apiVersion": api_version,
        "metadata": {"resourceVersion": rv.to_string()}, "items": items}))
}

fn create(shared: &Shared, target: &Target, body: &Bytes, query: &HashMap<String, String>) -> Response {
    let mut obj: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())),
    };
    let warnings = match FieldValidation::from_query(query, "CreateOptions")
        .and_then(|v| shared.admit(&target.resource, &target.ns, &mut obj, None, v))
    {
        Ok(w) => w,
        Err(f) => return fail(f),
    };
    if query.get("dryRun").is_some() {
        return with_warnings(respond(StatusCode::CREATED, obj), &warnings);
    }
    match shared.insert(&target.resource, &target.ns, obj) {
        Ok(obj) => with_warnings(respond(StatusCode::CREATED, obj), &warnings),
        Err(f) => fail(f),
    }
}

fn update(shared: &Shared, target: &Target, body: &Bytes, query: &HashMap<String, String>) -> Response {
    let name = target.name.clone().unwrap_or_default();
    let mut new: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())),
    };
    let validation = match FieldValidation::from_query(query, "UpdateOptions") {
        Ok(v) => v,
        Err(f) => return fail(f),
    };
    let Some(old) = shared.get(&target.resource, &target.ns, &name) else {
        return not_found(&target.resource, &name);
    };
    if new["metadata"]["resourceVersion"] != old["metadata"]["resourceVersion"] {
        let msg = format!("Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", target.resource);
        return respond(StatusCode::CONFLICT, status_body(StatusCode::CONFLICT, "Conflict", &msg));
    }
    if old["immutable"] == json!(true) && (new["data"] != old["data"] || new["binaryData"] != old["binaryData"]) {
        let msg = format!("ConfigMap \"{name}\" is invalid: data: Forbidden: field is immutable when `immutable` is set");
        return respond(StatusCode::UNPROCESSABLE_ENTITY, status_body(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &msg));
    }
    let warnings = match shared.admit(&target.resource, &target.ns, &mut new, Some(&old), validation) {
        Ok(w) => w,
        Err(f) => return fail(f),
    };
    let mut stored = Value::Null;
    shared.modify(&target.resource, &target.ns, &name, |obj| {
        let meta = obj["metadata"].clone();
        *obj = new.clone();
        obj["metadata"]["uid"] = meta["uid"].clone();
        obj["metadata"]["creationTimestamp"] = meta["creationTimestamp"].clone();
        obj["metadata"]["namespace"] = meta["namespace"].clone();
        let (kind, api_version) = kind_of(&target.resource);
        obj["kind"] = json!(kind);
        obj["apiVersion"] = json!(api_version);
        stored = obj.clone();
    });
    stored = shared.get(&target.resource, &target.ns, &name).unwrap_or(stored);
    with_warnings(respond(StatusCode::OK, stored), &warnings)
}

/// One `Warning: 299 - "..."` header per warning, as the API server sends them.
fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for w in warnings {
        if let Ok(value) = format!("299 - {}", json!(w)).parse() {
            response.headers_mut().append("warning", value);
        }
    }
    response
}

/// Watch from `resourceVersion` (exclusive); `0` or none starts with the current objects.
fn watch_stream(shared: Arc<Shared>, target: &Target, query: &HashMap<String, String>) -> Response {
    let start: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let timeout = query.get("timeoutSeconds").and_then(|v| v.parse().ok()).unwrap_or(290u64);
    let (resource, ns) = (target.resource.clone(), target.ns.clone());
    let (mut changes, backlog) = {
        let inner = shared.inner.lock().unwrap();
        let rx = shared.changes.subscribe();
        let backlog: Vec<(String, Value)> = if start == 0 {
            inner
                .objects
                .iter()
                .filter(|((r, n, _), _)| *r == resource && *n == ns)
                .map(|(_, o)| ("ADDED".to_string(), o.clone()))
                .collect()
        } else {
            inner
                .history
                .iter()
                .filter(|c| c.rv > start && c.resource == resource && c.ns == ns)
                .map(|c| (c.kind.to_string(), c.object.clone()))
                .collect()
        };
        (rx, backlog)
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let query = query.clone();
    let generation = shared.inner.lock().unwrap().generation;
    tokio::spawn(async move {
        let line = |kind: &str, obj: &Value| Bytes::from(format!("{}\n", json!({"type": kind, "object": obj})));
        for (kind, obj) in backlog {
            if selected(&obj, &query) && tx.send(Ok(line(&kind, &obj))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(Duration::from_secs(timeout));
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = tick.tick() => {
                    if shared.inner.lock().unwrap().generation != generation {
                        let _ = tx.send(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "API server going down"))).await;
                        return;
                    }
                }
                change = changes.recv() => match change {
                    Ok(c) if c.resource == resource && c.ns == ns && selected(&c.object, &query) => {
                        if tx.send(Ok(line(c.kind, &c.object))).await.is_err() { return; }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                },
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn pod_log(shared: Arc<Shared>, target: &Target, query: &HashMap<String, String>) -> Response {
    let name = target.name.clone().unwrap_or_default();
    let Some(pod) = shared.get("pods", &target.ns, &name) else { return not_found("pods", &name) };
    let container = query.get("container").cloned().unwrap_or_else(|| "node".into());
    let flag = |k: &str| matches!(query.get(k).map(String::as_str), Some("true" | "1"));
    let (follow, previous, timestamps) = (flag("follow"), flag("previous"), flag("timestamps"));
    let bad = |msg: String| respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &msg));
    let statuses = pod["status"]["containerStatuses"].as_array().cloned().unwrap_or_default();
    let Some(status) = statuses.iter().find(|s| s["name"] == container.as_str()) else {
        return bad(format!("container {container} is not valid for pod {name}"));
    };
    if !previous && status["state"].get("running").is_none() && status["state"].get("terminated").is_none() {
        let why = status["state"]["waiting"]["reason"].as_str().unwrap_or("ContainerCreating");
        return bad(format!("container \"{container}\" in pod \"{name}\" is waiting to start: {why}"));
    }
    // Like the API server: sinceTime in whole seconds.
    let since = match query.get("sinceTime").map(|t| t.parse::<k8s_openapi::jiff::Timestamp>()) {
        None => None,
        Some(Ok(t)) if t.subsec_nanosecond() == 0 => Some(t),
        Some(_) => return bad(format!("sinceTime must be RFC 3339 in whole seconds: {:?}", query["sinceTime"])),
    };
    // Like the kubelet: the log of the container instance running when the request came in.
    let (restarts, generation) = {
        let inner = shared.inner.lock().unwrap();
        (inner.restarts.get(&(target.ns.clone(), name.clone())).copied().unwrap_or(0), inner.generation)
    };
    let restarts = match (previous, restarts) {
        (false, r) => r,
        (true, 0) => return bad(format!("previous terminated container \"{container}\" in pod \"{name}\" not found")),
        (true, r) => r - 1,
    };
    let key = (target.ns.clone(), name, restarts);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut sent = 0;
        loop {
            let (lines, closed, broken) = {
                let inner = shared.inner.lock().unwrap();
                let broken = inner.generation != generation;
                match inner.logs.get(&key) {
                    Some(log) => {
                        let lines: Vec<(k8s_openapi::jiff::Timestamp, String)> =
                            log.times[sent..].iter().copied().zip(log.lines[sent..].iter().cloned()).collect();
                        (lines, log.closed || previous, broken)
                    }
                    None => (Vec::new(), previous, broken),
                }
            };
            if broken {
                let _ = tx.send(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "API server going down"))).await;
                return;
            }
            for (time, line) in &lines {
                sent += 1;
                if since.is_some_and(|s| *time < s) {
                    continue;
                }
                let text = if timestamps { format!("{time} {line}\n") } else { format!("{line}\n") };
                if tx.send(Ok(Bytes::from(text))).await.is_err() {
                    return;
                }
            }
            let gone = shared.get("pods", &key.0, &key.1).is_none();
            if !follow || closed || gone {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    Response::builder().status(StatusCode::OK).header("content-type", "text/plain").body(Body::from_stream(stream)).unwrap()
}
