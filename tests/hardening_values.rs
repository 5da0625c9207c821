//! Big values in messages: a 10 MiB value at every key of every section and stage kind, the
//! list of keys taken from the field tables themselves (`stages::fields`, each kind's `FIELDS`),
//! so that a key added later is tried too. Every diagnostic mflow prints quotes an excerpt of
//! what it took from the spec, never the value itself.

mod common;

use std::path::Path;
use std::process::Command;

use mflow::spec::schema::{Field, Ty};
use mflow::stages::{fields, Kind};
use toml::{Table, Value};

/// The value every case puts somewhere.
const BIG: usize = 10 << 20;
/// The most one command may print on standard error about one such spec.
const MAX_STDERR: usize = 6 << 10;

fn big() -> String {
    // Not all one letter: a did-you-mean must not find a near miss in it either.
    "ab".repeat(BIG / 2)
}

/// A spec whose every stage is valid: one of each kind, reading each other as a pipeline does.
fn base() -> Table {
    let text = r#"
[pipeline]
name = "p"

[stages.m]
kind = "model"
source = "init:llama-tiny"

[stages.c]
kind = "convert"
model = "${stages.m.output}"

[stages.d]
kind = "dataset"
tokenizer = "byte-level"
inputs = ["corpus.txt"]

[stages.t]
kind = "train"
model = "${stages.c.output}"
data = "${stages.d.output}"

[stages.e]
kind = "evaluate"
model = "${stages.t.output}"
data = "${stages.d.output}"

[stages.x]
kind = "export"
model = "${stages.t.output}"

[stages.r]
kind = "command"
run = ["true"]
"#;
    text.parse().unwrap()
}

/// The stage of `kind` in [`base`].
fn stage_of(kind: Kind) -> &'static str {
    match kind {
        Kind::Model => "m",
        Kind::Convert => "c",
        Kind::Dataset => "d",
        Kind::Train => "t",
        Kind::Evaluate => "e",
        Kind::Export => "x",
        Kind::Command => "r",
    }
}

/// The big values a key of type `ty` is tried with: itself where a string fits, else a string
/// where something else belongs, in a list, as a map's key and as its value.
fn values(ty: Ty) -> Vec<Value> {
    let s = || Value::String(big());
    match ty {
        Ty::StrList | Ty::List => vec![Value::Array(vec![s()]), s()],
        Ty::StrMap | Ty::Env(_) => {
            let mut by_key = Table::new();
            by_key.insert(big(), Value::String("v".into()));
            let mut by_value = Table::new();
            by_value.insert("k".into(), s());
            vec![Value::Table(by_key), Value::Table(by_value)]
        }
        _ => vec![s()],
    }
}

/// Every (path of keys, value) of `fields` below `at`, tables entered.
fn cases_of(at: &[&str], table: &[Field], out: &mut Vec<(Vec<String>, Value)>) {
    for f in table {
        let mut path: Vec<String> = at.iter().map(|s| s.to_string()).collect();
        path.push(f.name.to_string());
        for v in values(f.ty) {
            out.push((path.clone(), v));
        }
        if let Ty::Table(inner) = f.ty {
            let p: Vec<&str> = path.iter().map(String::as_str).collect();
            cases_of(&p, inner, out);
        }
    }
}

fn all_cases() -> Vec<(Vec<String>, Value)> {
    let mut out = Vec::new();
    cases_of(&["pipeline"], fields::PIPELINE, &mut out);
    cases_of(&["env"], fields::ENV, &mut out);
    cases_of(&["schedule"], fields::SCHEDULE, &mut out);
    cases_of(&["notify"], fields::NOTIFY, &mut out);
    for &kind in Kind::ALL {
        let at = ["stages", stage_of(kind)];
        cases_of(&at, fields::COMMON, &mut out);
        cases_of(&at, kind.fields(), &mut out);
    }
    // Names: a section, a stage, a variable, and a variable's value where a stage uses it.
    out.push((vec![big()], Value::String("x".into())));
    out.push((vec!["stages".into(), big()], Value::Table(Table::new())));
    out.push((vec!["vars".into(), big()], Value::String("x".into())));
    out.push((vec!["vars".into(), "v".into()], Value::String(big())));
    out
}

/// `spec` with `value` at `path`; a section missing on the way is made (`[schedule]` and
/// `[notify]` need their required key for the rest of the table to be read).
fn with(path: &[String], value: Value) -> Table {
    let mut spec = base();
    if path[0] == "vars" && path[1] == "v" {
        spec["stages"]["r"]["run"] = Value::Array(vec!["echo".into(), "${vars.v}".into()]);
    }
    let mut t = &mut spec;
    for (i, key) in path[..path.len() - 1].iter().enumerate() {
        let entry = t.entry(key.clone()).or_insert_with(|| {
            let mut fresh = Table::new();
            match (i, key.as_str()) {
                (0, "schedule") => {
                    fresh.insert("cron".into(), "0 3 * * *".into());
                }
                (0, "notify") => {
                    fresh.insert("webhook".into(), "http://127.0.0.1:9/".into());
                }
                _ => {}
            }
            Value::Table(fresh)
        });
        match entry {
            Value::Table(inner) => t = inner,
            _ => return spec, // a section given as a string by an earlier case: nothing below it
        }
    }
    t.insert(path.last().unwrap().clone(), value);
    spec
}

fn describe(path: &[String], value: &Value) -> String {
    let short = |s: &str| if s.len() > 20 { format!("<{} bytes>", s.len()) } else { s.to_string() };
    let at: Vec<String> = path.iter().map(|p| short(p)).collect();
    let shape = match value {
        Value::String(s) => short(s),
        Value::Array(_) => "[<big>]".into(),
        Value::Table(t) if t.keys().any(|k| k.len() > 20) => "{<big> = ..}".into(),
        Value::Table(_) => "{k = <big>}".into(),
        other => other.to_string(),
    };
    format!("{} = {shape}", at.join("."))
}

fn mflow(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mflow"))
        .args(args)
        .current_dir(dir)
        .env("CI", "true")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

#[test]
fn a_ten_megabyte_value_at_any_key_gives_a_diagnostic_of_a_few_kilobytes() {
    let cases = all_cases();
    assert!(cases.len() > 150, "the field tables gave only {} cases", cases.len());
    let chunks: Vec<Vec<(Vec<String>, Value)>> = {
        let mut c = vec![Vec::new(), Vec::new()];
        for (i, case) in cases.into_iter().enumerate() {
            c[i % 2].push(case);
        }
        c
    };
    let results: Vec<(usize, usize, Vec<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                s.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    std::fs::write(dir.path().join("corpus.txt"), "hello world\n").unwrap();
                    let (mut n, mut largest, mut bad) = (0, 0, Vec::new());
                    for (path, value) in chunk {
                        let what = describe(&path, &value);
                        let spec = with(&path, value);
                        std::fs::write(dir.path().join("spec.toml"), toml::to_string(&spec).unwrap()).unwrap();
                        let mut commands = vec![vec!["plan", "spec.toml"]];
                        if path[0] == "pipeline" && path.get(1).is_some_and(|k| k == "kubernetes") {
                            commands.push(vec!["render", "spec.toml", "--backend", "kubernetes"]);
                        }
                        if path[0] == "schedule" {
                            commands.push(vec!["schedule", "render", "spec.toml"]);
                        }
                        for args in commands {
                            let t0 = std::time::Instant::now();
                            let o = mflow(dir.path(), &args);
                            if std::env::var_os("SHOW_SLOW").is_some() {
                                eprintln!(
                                    "{:.1}s {} `mflow {}` with {what}",
                                    t0.elapsed().as_secs_f64(),
                                    o.stderr.len(),
                                    args[0]
                                );
                            }
                            n += 1;
                            largest = largest.max(o.stderr.len());
                            if o.stderr.len() > MAX_STDERR {
                                let head = String::from_utf8_lossy(&o.stderr[..600]).to_string();
                                bad.push(format!("`mflow {}` with {what}: {} bytes: {head}", args[0], o.stderr.len()));
                            }
                        }
                    }
                    (n, largest, bad)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let n: usize = results.iter().map(|r| r.0).sum();
    let largest = results.iter().map(|r| r.1).max().unwrap_or(0);
    let bad: Vec<String> = results.into_iter().flat_map(|r| r.2).collect();
    eprintln!("{n} commands, largest standard error {largest} bytes");
    assert!(bad.is_empty(), "{} of {n} too large:\n{}", bad.len(), bad.join("\n\n"));
}
