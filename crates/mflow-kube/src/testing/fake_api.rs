//! An in-process Kubernetes API server, faithful for the calls mflow makes: create, get, list,
//! watch, update and delete of namespaced and cluster objects; pod log streaming with follow;
//! discovery of the Trainer group; SelfSubjectAccessReview; Status bodies for 400, 403, 404,
//! 409 and 422; resourceVersion and watch resumption from a resourceVersion.
//!
//! TrainJob creation is admitted like Trainer's webhook does: the body is validated against the
//! real TrainJob CRD schema, the name rules, the reserved PET_* variables and the existence of
//! the referenced ClusterTrainingRuntime.

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
}

pub struct Shared {
    pub inner: Mutex<Inner>,
    changes: broadcast::Sender<Change>,
    trainjob_schema: jsonschema::Validator,
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
        "pods" => ("Pod", "v1"),
        "configmaps" => ("ConfigMap", "v1"),
        "persistentvolumeclaims" => ("PersistentVolumeClaim", "v1"),
        "customresourcedefinitions" => ("CustomResourceDefinition", "apiextensions.k8s.io/v1"),
        _ => ("Unknown", "v1"),
    }
}

fn group_of(resource: &str) -> &'static str {
    match resource {
        "trainjobs" | "clustertrainingruntimes" => "trainer.kubeflow.org",
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
        meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
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
        inner.logs.entry(key).or_default().lines.push(line.into());
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

    /// Trainer's admission of a TrainJob: schema, name, reserved env, runtime existence.
    fn admit_trainjob(&self, obj: &Value) -> Result<(), Failure> {
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        let invalid = |msg: String| {
            let body = status_body(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                &format!("TrainJob.trainer.kubeflow.org \"{name}\" is invalid: {msg}"),
            );
            (StatusCode::UNPROCESSABLE_ENTITY, body)
        };
        let errors = schema::violations(&self.trainjob_schema, obj);
        if !errors.is_empty() {
            return Err(invalid(errors.join("; ")));
        }
        let rfc1035 = name.len() <= 63
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && !name.ends_with('-')
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !rfc1035 {
            return Err(invalid("metadata.name must match RFC 1035 DNS label format".into()));
        }
        for env in obj["spec"]["trainer"]["env"].as_array().into_iter().flatten() {
            let var = env["name"].as_str().unwrap_or_default();
            if var.starts_with("PET_") {
                return Err(invalid(format!(
                    "admission webhook \"validator.trainjob.trainer.kubeflow.org\" denied the request: spec.trainer.env: Invalid value: \"{var}\": must not have reserved envs"
                )));
            }
        }
        let runtime = obj["spec"]["runtimeRef"]["name"].as_str().unwrap_or_default();
        if self.get("clustertrainingruntimes", "", runtime).is_none() {
            return Err(invalid(format!(
                "spec.runtimeRef: Invalid value: \"{runtime}\": specified clusterTrainingRuntime must be created before the TrainJob is created"
            )));
        }
        Ok(())
    }
}

pub struct FakeApi {
    pub shared: Arc<Shared>,
    pub addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FakeApi {
    pub async fn start() -> FakeApi {
        let trainjob_crd = schema::crd("trainer.kubeflow.org_trainjobs.yaml");
        let (changes, _) = broadcast::channel(4096);
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
            }),
            changes,
            trainjob_schema: schema::crd_validator(&trainjob_crd),
        });
        shared.insert("customresourcedefinitions", "", trainjob_crd).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(dispatch).with_state(shared.clone());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        FakeApi { shared, addr, server }
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

    /// Installs a ClusterTrainingRuntime from the shared Kubeflow data or the examples.
    pub fn add_runtime(&self, runtime: Value) {
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
        ("get", _) => {
            let name = target.name.as_deref().unwrap();
            match shared.get(&target.resource, &target.ns, name) {
                Some(obj) => respond(StatusCode::OK, obj),
                None => not_found(&target.resource, name),
            }
        }
        ("create", _) => create(&shared, &target, &body, &query),
        ("update", _) => update(&shared, &target, &body),
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
    let obj: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())),
    };
    if target.resource == "trainjobs" {
        if let Err(f) = shared.admit_trainjob(&obj) {
            return fail(f);
        }
    }
    if query.get("dryRun").is_some() {
        return respond(StatusCode::CREATED, obj);
    }
    match shared.insert(&target.resource, &target.ns, obj) {
        Ok(obj) => respond(StatusCode::CREATED, obj),
        Err(f) => fail(f),
    }
}

fn update(shared: &Shared, target: &Target, body: &Bytes) -> Response {
    let name = target.name.clone().unwrap_or_default();
    let new: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())),
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
    respond(StatusCode::OK, stored)
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
    tokio::spawn(async move {
        let line = |kind: &str, obj: &Value| Bytes::from(format!("{}\n", json!({"type": kind, "object": obj})));
        for (kind, obj) in backlog {
            if selected(&obj, &query) && tx.send(Ok(line(&kind, &obj))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(Duration::from_secs(timeout));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => return,
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
    let statuses = pod["status"]["containerStatuses"].as_array().cloned().unwrap_or_default();
    let Some(status) = statuses.iter().find(|s| s["name"] == container.as_str()) else {
        let msg = format!("container {container} is not valid for pod {name}");
        return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &msg));
    };
    if status["state"].get("running").is_none() && status["state"].get("terminated").is_none() {
        let why = status["state"]["waiting"]["reason"].as_str().unwrap_or("ContainerCreating");
        let msg = format!("container \"{container}\" in pod \"{name}\" is waiting to start: {why}");
        return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &msg));
    }
    let follow = matches!(query.get("follow").map(String::as_str), Some("true" | "1"));
    // Like the kubelet: the log of the container instance running when the request came in.
    let restarts = shared.inner.lock().unwrap().restarts.get(&(target.ns.clone(), name.clone())).copied().unwrap_or(0);
    let key = (target.ns.clone(), name, restarts);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut sent = 0;
        loop {
            let (lines, closed) = {
                let inner = shared.inner.lock().unwrap();
                match inner.logs.get(&key) {
                    Some(log) => (log.lines[sent..].to_vec(), log.closed),
                    None => (Vec::new(), false),
                }
            };
            for line in &lines {
                if tx.send(Ok(Bytes::from(format!("{line}\n")))).await.is_err() {
                    return;
                }
            }
            sent += lines.len();
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
