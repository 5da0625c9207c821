//! The HTTP side: paths parsed into targets, and a handler per verb (list, create, update,
//! watch, pod logs), discovery and access reviews.

use super::*;

pub(super) fn respond(code: StatusCode, body: Value) -> Response {
    (code, [("content-type", "application/json")], body.to_string()).into_response()
}

pub(super) fn fail((code, body): Failure) -> Response {
    respond(code, body)
}

pub(super) fn not_found(resource: &str, name: &str) -> Response {
    let group = group_of(resource);
    let what = if group.is_empty() { resource.to_string() } else { format!("{resource}.{group}") };
    let mut body = status_body(StatusCode::NOT_FOUND, "NotFound", &format!("{what} \"{name}\" not found"));
    body["details"] = json!({"name": name, "group": group, "kind": resource});
    respond(StatusCode::NOT_FOUND, body)
}

/// Parsed request path: namespace, resource, name, subresource.
pub(super) struct Target {
    pub(super) ns: String,
    pub(super) resource: String,
    pub(super) name: Option<String>,
    pub(super) sub: Option<String>,
}

pub(super) fn parse_path(path: &str) -> Option<Result<Target, String>> {
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

pub(super) async fn dispatch(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let query: HashMap<String, String> =
        Query::<HashMap<String, String>>::try_from_uri(&uri).map(|q| q.0).unwrap_or_default();
    let body = axum::body::to_bytes(req.into_body(), 16 << 20).await.unwrap_or_default();
    shared.inner.lock().unwrap().requests.push(format!("{method} {}", uri.path()));

    if uri.path() == "/version" {
        return respond(
            StatusCode::OK,
            json!({"major": "1", "minor": "35", "gitVersion": "v1.35.0",
            "gitCommit": "fake", "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64"}),
        );
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
        _ => {
            return respond(
                StatusCode::METHOD_NOT_ALLOWED,
                status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", ""),
            )
        }
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
                respond(
                    StatusCode::OK,
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "status": {"phase": "Active"}}),
                )
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

pub(super) fn discovery(shared: &Shared, gv: &str) -> Response {
    if gv != "trainer.kubeflow.org/v1alpha1" || !shared.inner.lock().unwrap().trainer_installed {
        return respond(
            StatusCode::NOT_FOUND,
            status_body(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource"),
        );
    }
    let res = |name: &str, kind: &str, namespaced: bool| {
        json!({"name": name, "singularName": kind.to_lowercase(),
        "namespaced": namespaced, "kind": kind,
        "verbs": ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]})
    };
    respond(
        StatusCode::OK,
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
        "resources": [res("trainjobs", "TrainJob", true), res("trainingruntimes", "TrainingRuntime", true),
                      res("clustertrainingruntimes", "ClusterTrainingRuntime", false)]}),
    )
}

pub(super) fn access_review(shared: &Shared, body: &Bytes) -> Response {
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
pub(super) fn label_selector_matches(selector: &str, labels: &Value) -> bool {
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

pub(super) fn field_selector_matches(selector: &str, obj: &Value) -> bool {
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

pub(super) fn selected(obj: &Value, query: &HashMap<String, String>) -> bool {
    let labels = obj["metadata"].get("labels").cloned().unwrap_or(json!({}));
    query.get("labelSelector").is_none_or(|s| label_selector_matches(s, &labels))
        && query.get("fieldSelector").is_none_or(|s| field_selector_matches(s, obj))
}

pub(super) fn list(shared: &Shared, target: &Target, query: &HashMap<String, String>) -> Response {
    let rv = shared.inner.lock().unwrap().rv;
    let items: Vec<Value> =
        shared.list(&target.resource, &target.ns).into_iter().filter(|o| selected(o, query)).collect();
    let (kind, api_version) = kind_of(&target.resource);
    respond(
        StatusCode::OK,
        json!({"kind": format!("{kind}List"), "apiVersion": api_version,
        "metadata": {"resourceVersion": rv.to_string()}, "items": items}),
    )
}

pub(super) fn create(shared: &Shared, target: &Target, body: &Bytes, query: &HashMap<String, String>) -> Response {
    let mut obj: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()))
        }
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

pub(super) fn update(shared: &Shared, target: &Target, body: &Bytes, query: &HashMap<String, String>) -> Response {
    let name = target.name.clone().unwrap_or_default();
    let mut new: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return respond(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()))
        }
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
        let msg =
            format!("ConfigMap \"{name}\" is invalid: data: Forbidden: field is immutable when `immutable` is set");
        return respond(
            StatusCode::UNPROCESSABLE_ENTITY,
            status_body(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &msg),
        );
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
pub(super) fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for w in warnings {
        if let Ok(value) = format!("299 - {}", json!(w)).parse() {
            response.headers_mut().append("warning", value);
        }
    }
    response
}

/// Watch from `resourceVersion` (exclusive); `0` or none starts with the current objects.
pub(super) fn watch_stream(shared: Arc<Shared>, target: &Target, query: &HashMap<String, String>) -> Response {
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

pub(super) async fn pod_log(shared: Arc<Shared>, target: &Target, query: &HashMap<String, String>) -> Response {
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
                let _ = tx
                    .send(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "API server going down")))
                    .await;
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
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/plain")
        .body(Body::from_stream(stream))
        .unwrap()
}
