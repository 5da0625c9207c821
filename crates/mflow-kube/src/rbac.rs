//! The rights mflow needs, in one place: the preflight's access reviews ask for exactly these,
//! and `mflow kube rbac` and `mflow schedule` render the Role and ClusterRole from them.

use serde_json::{json, Value};

use crate::manifest::{LABEL_MANAGED_BY, MANAGED_BY, TRAINER_GROUP};

/// One rule: verbs on a resource (`pods/log` names a subresource).
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
    /// Cluster-scoped resources need a ClusterRole.
    pub cluster: bool,
    /// Why mflow needs it; rendered as a comment.
    pub why: &'static str,
}

/// Every API call mflow makes, as least privilege.
pub const RULES: &[Rule] = &[
    Rule {
        group: TRAINER_GROUP,
        resource: "trainjobs",
        verbs: &["create", "get", "list", "watch", "delete"],
        cluster: false,
        why: "one TrainJob per stage attempt; reattach after a restart; delete on cancel",
    },
    Rule {
        group: "",
        resource: "pods",
        verbs: &["list", "watch"],
        cluster: false,
        why: "running state, failure reasons and ranks come from the trainer pods",
    },
    Rule { group: "", resource: "pods/log", verbs: &["get"], cluster: false, why: "stage output, tagged by rank" },
    Rule {
        group: "",
        resource: "events",
        verbs: &["list"],
        cluster: false,
        why: "why a TrainJob or its pods do not start (sandbox, image pull, scheduling)",
    },
    Rule {
        group: "",
        resource: "configmaps",
        verbs: &["create", "get", "list", "update"],
        cluster: false,
        why: "workload code (content-named) and the cache index",
    },
    Rule {
        group: "",
        resource: "persistentvolumeclaims",
        verbs: &["get"],
        cluster: false,
        why: "preflight: the artifact claim exists",
    },
    Rule {
        group: TRAINER_GROUP,
        resource: "clustertrainingruntimes",
        verbs: &["get", "list"],
        cluster: true,
        why: "preflight: the runtimes the stages name exist",
    },
];

/// What a person outside the cluster does besides: `mflow run` from a laptop uploads through a
/// volume pod and starts a driver Job (which runs the engine with [`RULES`]), and `attach`,
/// `cancel`, `runs`, `status`, `logs`, `report` and `output --download` read through them.
pub const OUTSIDE: &[Rule] = &[
    Rule {
        group: "",
        resource: "pods",
        verbs: &["create", "get", "list", "watch", "delete"],
        cluster: false,
        why: "a short-lived pod that mounts the artifact claim, for uploads and reads; the driver's pods",
    },
    // An exec over WebSocket is a GET: the API server checks `get` as well as `create`.
    Rule {
        group: "",
        resource: "pods/exec",
        verbs: &["create", "get"],
        cluster: false,
        why: "tar streams to and from the volume; a cancel signals the driver",
    },
    Rule {
        group: "",
        resource: "pods/log",
        verbs: &["get"],
        cluster: false,
        why: "the driver's events, rendered as a local run's display",
    },
    Rule {
        group: "batch",
        resource: "jobs",
        verbs: &["create", "get", "list", "delete"],
        cluster: false,
        why: "the driver of each run, found by its labels; deleted by a cancel that cannot signal it",
    },
    Rule {
        group: "",
        resource: "persistentvolumeclaims",
        verbs: &["get"],
        cluster: false,
        why: "preflight: the artifact claim exists",
    },
    Rule {
        group: TRAINER_GROUP,
        resource: "clustertrainingruntimes",
        verbs: &["get", "list"],
        cluster: true,
        why: "preflight: the runtimes the stages name exist",
    },
];

/// (verb, group, resource, subresource) of every right of `rules`, for access reviews.
pub fn needed(
    rules: &'static [Rule],
) -> impl Iterator<Item = (&'static str, &'static str, &'static str, &'static str, bool)> {
    rules.iter().flat_map(|r| {
        let (resource, sub) = r.resource.split_once('/').unwrap_or((r.resource, ""));
        r.verbs.iter().map(move |v| (*v, r.group, resource, sub, r.cluster))
    })
}

/// Who a rendered binding grants the rights to.
#[derive(Debug, Clone, Default)]
pub struct Subjects {
    pub service_accounts: Vec<String>,
    pub users: Vec<String>,
    pub groups: Vec<String>,
}

fn policy_rules(rules: &[Rule], cluster: bool) -> Vec<Value> {
    rules
        .iter()
        .filter(|r| r.cluster == cluster)
        .map(|r| json!({"apiGroups": [r.group], "resources": [r.resource], "verbs": r.verbs}))
        .collect()
}

/// The objects that grant mflow its rights in `namespace`: a ServiceAccount per named one, a
/// Role and RoleBinding, and a ClusterRole and ClusterRoleBinding (named `<name>-<namespace>`,
/// so bindings of several namespaces do not overwrite each other) for the cluster-scoped
/// reads. Users and groups are people: they also get the Role `<name>-outside` of [`OUTSIDE`],
/// to run from a machine that does not mount the volume. Service accounts do not need it.
pub fn objects(name: &str, namespace: &str, subjects: &Subjects) -> Vec<Value> {
    let labels = json!({ LABEL_MANAGED_BY: MANAGED_BY });
    let mut subject_list: Vec<Value> = subjects
        .service_accounts
        .iter()
        .map(|sa| json!({"kind": "ServiceAccount", "name": sa, "namespace": namespace}))
        .collect();
    subject_list.extend(
        subjects.users.iter().map(|u| json!({"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": u})),
    );
    subject_list.extend(
        subjects.groups.iter().map(|g| json!({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": g})),
    );
    let cluster_name = format!("{name}-{namespace}");
    let mut out: Vec<Value> = subjects
        .service_accounts
        .iter()
        .map(|sa| json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": namespace, "labels": labels}}))
        .collect();
    out.extend(role_and_binding(name, namespace, &labels, RULES, &subject_list));
    out.push(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": cluster_name, "labels": labels},
        "rules": policy_rules(RULES, true),
    }));
    out.push(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": cluster_name, "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name},
        "subjects": subject_list,
    }));
    let people: Vec<Value> = subject_list.iter().filter(|s| s["kind"] != "ServiceAccount").cloned().collect();
    if !people.is_empty() {
        out.extend(role_and_binding(&format!("{name}-outside"), namespace, &labels, OUTSIDE, &people));
    }
    out
}

/// A namespaced Role of the namespaced `rules` and its RoleBinding to `subjects`.
fn role_and_binding(name: &str, namespace: &str, labels: &Value, rules: &[Rule], subjects: &[Value]) -> [Value; 2] {
    [
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "rules": policy_rules(rules, false),
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": subjects,
        }),
    ]
}

/// The objects of [`objects`] as a YAML stream, after a comment with the reason for every
/// right (`mflow kube rbac`).
pub fn yaml(name: &str, namespace: &str, subjects: &Subjects) -> String {
    let mut out = format!(
        "# Least privilege for mflow in namespace {namespace:?} (`mflow kube rbac`). Rights:\n{}",
        explained(RULES)
    );
    if !subjects.users.is_empty() || !subjects.groups.is_empty() {
        out.push_str(&format!(
            "# And for the users and groups, to run from outside the cluster (Role {name}-outside):\n{}",
            explained(OUTSIDE)
        ));
    }
    for obj in objects(name, namespace, subjects) {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&obj).unwrap_or_default());
    }
    out
}

/// A comment block listing every rule of `rules` and why mflow needs it.
pub fn explained(rules: &[Rule]) -> String {
    rules
        .iter()
        .map(|r| {
            let group = if r.group.is_empty() { "core" } else { r.group };
            format!("#   {} {} ({group}): {}\n", r.resource, r.verbs.join(","), r.why)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_verb_is_reviewed_and_rendered_once() {
        let reviewed: Vec<_> = needed(RULES).collect();
        let rendered: usize = RULES.iter().map(|r| r.verbs.len()).sum();
        assert_eq!(reviewed.len(), rendered);
        assert!(reviewed.contains(&("get", "", "pods", "log", false)));
        assert!(reviewed.contains(&("list", TRAINER_GROUP, "clustertrainingruntimes", "", true)));
        let objs = objects(
            "mflow",
            "team-a",
            &Subjects { service_accounts: vec!["mflow".into()], users: vec!["alice".into()], ..Default::default() },
        );
        let kinds: Vec<&str> = objs.iter().map(|o| o["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
        );
        // The outside rights go to the person only.
        assert_eq!(objs[5]["metadata"]["name"], "mflow-outside");
        assert_eq!(objs[6]["subjects"].as_array().unwrap().len(), 1);
        assert_eq!(objs[6]["subjects"][0]["name"], "alice");
        assert!(serde_json::to_string(&objs[5]).unwrap().contains("pods/exec"));
        let only_sa =
            objects("mflow", "team-a", &Subjects { service_accounts: vec!["mflow".into()], ..Default::default() });
        assert_eq!(only_sa.len(), 5, "a service account gets no outside rights");
        assert_eq!(objs[2]["subjects"][0]["namespace"], "team-a");
        assert_eq!(objs[2]["subjects"][1]["kind"], "User");
        assert_eq!(objs[3]["metadata"]["name"], "mflow-team-a");
        // No verb that mflow does not use (patch was once granted and never used).
        assert!(!serde_json::to_string(&objs).unwrap().contains("patch"));
    }
}
