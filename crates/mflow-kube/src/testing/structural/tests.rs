use super::*;
use serde_json::json;

fn crd(schema: Value) -> Structural {
    let crd = json!({"metadata": {"name": "things.example.com"},
        "spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}});
    Structural::compile(&crd, "v1").unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_supported_function_is_there() {
    let env = Arc::new(Env::stdlib());
    for source in [
        "!false",
        "-(1) == -1",
        "1 != 2",
        "5 % 2 == 1",
        "true && true",
        "2 * 3 == 6",
        "1 + 1 == 2",
        "3 - 1 == 2",
        "4 / 2 == 2",
        "1 <= 1",
        "1 < 2",
        "2 >= 1",
        "2 > 1",
        "(true ? 1 : 2) == 1",
        "[1][0] == 1",
        "false || true",
        "1 in [1]",
        "[1].all(x, x > 0)",
        "size('ab') == 2",
        "'ab'.matches('^a')",
        "'ab'.contains('b')",
        "'ab'.startsWith('a')",
        "'ab'.endsWith('b')",
        "string(1) == '1'",
        "int('2') == 2",
        "uint(2) == uint(2)",
        "double(1) == 1.0",
        "bytes('a') == b'a'",
        "bool('true')",
        "type(1) == int",
        "dyn(1) == 1",
    ] {
        let program = compile(source).unwrap_or_else(|e| panic!("{source}: {e}"));
        let got = program.execute(&Context::with_env(env.clone()));
        assert_eq!(got, Ok(Cel::Bool(true)), "{source}");
    }
    assert!(compile("self.isSorted()").unwrap_err().contains("isSorted"));
    assert!(compile("self.matches(").is_err());
}

#[test]
fn unsupported_rules_are_listed() {
    let crd = json!({"metadata": {"name": "things.example.com"}, "spec": {"versions": [{"name": "v1",
        "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {"type": "object",
            "x-kubernetes-validations": [{"rule": "self.x.isSorted()"}, {"rule": "has(self.x)"},
                {"rule": "true", "messageExpression": "self.y.lowerAscii()"}]}}}}}]}});
    let err = Structural::compile(&crd, "v1").err().expect("must fail");
    let text = err.to_string();
    assert!(text.contains("spec: self.x.isSorted(): unsupported function(s) isSorted"), "{text}");
    assert!(text.contains("spec: messageExpression self.y.lowerAscii()"), "{text}");
    assert!(!text.contains("has(self.x)"), "{text}");
}

#[test]
fn messages_reasons_and_field_paths_are_the_servers() {
    let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object", "properties": {"a": {"type": "string"}}}},
        "x-kubernetes-validations": [
            {"rule": "!has(self.n) || self.n > 0"},
            {"rule": "!has(self.s) || self.s != 'x'", "message": "s must not be x", "reason": "FieldValueForbidden", "fieldPath": ".s"},
            {"rule": "!has(self.o) || has(self.o.a)", "messageExpression": "'o needs a, has ' + string(size(self.o))", "reason": "FieldValueRequired", "fieldPath": ".o['a']"},
            {"rule": "!has(self.s) || self.s != 'y'", "messageExpression": "''", "message": "fallback"}]}}}));
    let obj = json!({"spec": {"n": 0, "s": "x", "o": {}}});
    let (errs, _) = s.validate(&obj, None);
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "spec: Invalid value: failed rule: !has(self.n) || self.n > 0",
            "spec.s: Forbidden: s must not be x",
            "spec.o.a: Required value: o needs a, has 0",
        ]
    );
    let (errs, _) = s.validate(&json!({"spec": {"s": "y"}}), None);
    assert_eq!(errs[0].to_string(), "spec: Invalid value: fallback");
}

#[test]
fn scalars_show_their_value_and_runtime_errors_the_type() {
    let s = crd(json!({"type": "object", "x-kubernetes-validations": [{"rule": "self.spec.missing == 1"}],
        "properties": {"spec": {"type": "object", "properties": {
            "n": {"type": "integer", "x-kubernetes-validations": [{"rule": "self >= 1", "message": "n must be >= 1"}]},
            "s": {"type": "string", "x-kubernetes-validations": [{"rule": "self in ['a', 'b']"}]}}}}}));
    let (errs, _) = s.validate(&json!({"spec": {"n": 0, "s": "c"}}), None);
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "<nil>: Invalid value: \"object\": no such key: missing evaluating rule: self.spec.missing == 1",
            "spec.n: Invalid value: 0: n must be >= 1",
            "spec.s: Invalid value: \"c\": failed rule: self in ['a', 'b']",
        ]
    );
}

#[test]
fn transition_rules_see_the_old_value_of_correlated_items_only() {
    let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "keyed": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "string",
                "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "field is immutable"}]}}}},
        "plain": {"type": "array", "items": {"type": "object", "properties": {"v": {"type": "string",
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "field is immutable"}]}}}}}}}}));
    let old = json!({"spec": {"keyed": [{"name": "a", "v": "1"}, {"name": "b", "v": "1"}], "plain": [{"v": "1"}]}});
    let new = json!({"spec": {"keyed": [{"name": "b", "v": "2"}, {"name": "c", "v": "2"}], "plain": [{"v": "2"}]}});
    assert!(s.validate(&new, None).0.is_empty(), "transition rules ran on create");
    let (errs, _) = s.validate(&new, Some(&old));
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(text, ["spec.keyed[0].v: Invalid value: \"2\": field is immutable"]);
}

#[test]
fn failures_on_unchanged_values_are_ratcheted() {
    let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "a": {"type": "string", "x-kubernetes-validations": [{"rule": "self != 'bad'"}]},
        "b": {"type": "string", "x-kubernetes-validations": [{"rule": "self != 'bad'"}]}}}}}));
    let old = json!({"spec": {"a": "bad", "b": "ok"}});
    let new = json!({"spec": {"a": "bad", "b": "bad"}});
    let (errs, warnings) = s.validate(&new, Some(&old));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, "spec.b");
    assert_eq!(warnings.len(), 1);
    assert_eq!(warnings[0].path, "spec.a");
}

#[test]
fn set_and_map_lists_compare_regardless_of_order() {
    let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object",
        "x-kubernetes-validations": [{"rule": "self == oldSelf"}],
        "properties": {"tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
            "cmd": {"type": "array", "items": {"type": "string"}}}}}}));
    let old = json!({"spec": {"tags": ["a", "b"], "cmd": ["x", "y"]}});
    assert!(s.validate(&json!({"spec": {"tags": ["b", "a"], "cmd": ["x", "y"]}}), Some(&old)).0.is_empty());
    assert_eq!(s.validate(&json!({"spec": {"tags": ["a", "b"], "cmd": ["y", "x"]}}), Some(&old)).0.len(), 1);
}

#[test]
fn unknown_fields_are_pruned_and_named() {
    let s = crd(json!({"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object"}, "spec": {"type": "object", "properties": {
            "env": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}}}));
    let mut obj = json!({"metadata": {"name": "x", "labels": {"a": "b"}, "colour": "red"},
        "spec": {"foo": 1, "env": [{"name": "A", "value": "1"}], "labels": {"any": "thing"}}, "extra": true});
    let unknown = s.prune(&mut obj);
    assert_eq!(unknown, ["extra", "spec.env[0].value", "spec.foo", "metadata.colour"]);
    assert_eq!(
        obj,
        json!({"metadata": {"name": "x", "labels": {"a": "b"}},
        "spec": {"env": [{"name": "A"}], "labels": {"any": "thing"}}})
    );
}

#[test]
fn defaults_are_applied_and_stray_nulls_dropped() {
    let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "kind": {"type": "string", "default": "Cluster"}, "n": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "object", "properties": {"replicas": {"type": "integer", "default": 1}}}}}}}}));
    let mut obj = json!({"spec": {"n": null, "items": [{}, {"replicas": 3}]}});
    s.default(&mut obj);
    assert_eq!(obj, json!({"spec": {"kind": "Cluster", "items": [{"replicas": 1}, {"replicas": 3}]}}));
}

#[test]
fn field_paths_normalize() {
    assert_eq!(normalize_field_path(".a.b"), "a.b");
    assert_eq!(normalize_field_path(".a['b.c']"), "a.b.c");
    assert_eq!(normalize_field_path(".a[b]"), "a.b");
}
