//! Parallel layouts at plan time: a tp or pp that cannot split the model is refused at its key
//! (snapshots of fixtures/bad/layout/, whose specs parse but cannot be planned), and a stage
//! that reads shards in another layout than its upstream writes gets a reshard stage.

mod common;

use std::path::Path;
use std::process::Command;

use common::{code, stderr};
use miette::{GraphicalReportHandler, GraphicalTheme};
use serde_json::json;

fn render(err: &dyn miette::Diagnostic) -> String {
    let mut out = String::new();
    GraphicalReportHandler::new_themed(GraphicalTheme::unicode_nocolor())
        .with_width(100)
        .render_report(&mut out, err)
        .unwrap();
    out
}

#[test]
fn bad_layouts() {
    insta::glob!("fixtures/bad/layout/*.toml", |path| {
        let text = std::fs::read_to_string(path).unwrap();
        let mut spec = mflow::spec::parse(path, &text, &[]).expect("the spec parses; its layout is what is wrong");
        // Named as in the other diagnostics, wherever the checkout is.
        spec.path = "spec.toml".into();
        let err = mflow::plan::check_layouts(&spec).expect_err("the layout must be rejected");
        insta::assert_snapshot!(render(&err));
    });
}

/// A value given with --set is not where the file says: the stage is pointed at instead.
#[test]
fn bad_layout_from_set() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad/layout/27-tp-kv-groups.toml");
    let text = std::fs::read_to_string(&path).unwrap().replace("tp = 8", "tp = 2");
    let mut spec = mflow::spec::parse(&path, &text, &["stages.c.pp=3".into()]).unwrap();
    spec.path = "spec.toml".into();
    let err = mflow::plan::check_layouts(&spec).expect_err("pp = 3 does not divide 4 layers");
    insta::assert_snapshot!(render(&err));
}

fn mflow(args: &[&str], home: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mflow")).args(args).env("MFLOW_HOME", home).env("CI", "true").output().unwrap()
}

#[test]
fn bad_layout_exits_2() {
    let home = tempfile::tempdir().unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad/layout/25-pp-layers.toml");
    let o = mflow(&["plan", spec.to_str().unwrap()], home.path());
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("does not divide the model's 4 layers"), "{}", stderr(&o));
}

/// `--set stages.train.pp=2` alone: train reads a reshard of the TP=2 shards into TP=2 PP=2,
/// evaluate a reshard of the PP output into its TP=1, and export the PP output itself.
#[test]
fn train_at_another_layout_reads_a_reshard() {
    let work = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/gpt-tp2.toml");
    let plan_with = |sets: &[&str]| {
        let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        sets.push(format!("pipeline.workdir={}", work.path().display()));
        let spec = mflow::spec::parse(&path, &std::fs::read_to_string(&path).unwrap(), &sets).unwrap();
        mflow::plan::build(spec, &mflow::env::Environment::detect(None)).unwrap()
    };
    let plan = plan_with(&["stages.train.pp=2"]);
    let stage = |n: &str| &plan.stages[plan.index(n).unwrap_or_else(|| panic!("no stage `{n}`"))];
    let reshard = stage("train-reshard");
    assert!(reshard.inserted);
    assert_eq!(reshard.spec.params["model"], json!("${stages.convert.output}"));
    assert_eq!((&reshard.spec.params["tp"], &reshard.spec.params["pp"]), (&json!(2), &json!(2)));
    assert_eq!(stage("train").spec.params["model"], json!("${stages.train-reshard.output}"));
    let eval = stage("evaluate-reshard");
    assert_eq!(eval.spec.params["model"], json!("${stages.train.output}"));
    assert_eq!((&eval.spec.params["tp"], &eval.spec.params["pp"]), (&json!(1), &json!(1)));
    assert_eq!(stage("export").spec.params["model"], json!("${stages.train.output}"));
    assert!(plan.index("train-reshard").unwrap() < plan.index("train").unwrap());

    // The same layout on both sides inserts nothing.
    let plan = plan_with(&["stages.train.pp=2", "stages.convert.pp=2"]);
    assert!(plan.index("train-reshard").is_none());
}

/// An inserted reshard never shares its MFLOW_INPUT_<NAME> variable with a stage of the spec:
/// `evaluate_reshard` and `evaluate-reshard` would both be MFLOW_INPUT_EVALUATE_RESHARD.
#[test]
fn an_inserted_reshard_takes_no_variable_of_a_stage_of_the_spec() {
    let work = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/gpt-tp2.toml");
    for user in ["evaluate_reshard", "Evaluate-Reshard", "EVALUATE_RESHARD"] {
        let text = std::fs::read_to_string(&path).unwrap()
            + &format!("\n[stages.{user}]\nkind = \"command\"\nrun = [\"true\"]\n");
        let sets = vec!["stages.train.pp=2".to_string(), format!("pipeline.workdir={}", work.path().display())];
        let spec = mflow::spec::parse(&path, &text, &sets).unwrap();
        let plan = mflow::plan::build(spec, &mflow::env::Environment::detect(None)).unwrap();
        let mut vars: Vec<String> = plan.stages.iter().map(|s| mflow::spec::input_var(&s.spec.name)).collect();
        let n = vars.len();
        vars.sort();
        vars.dedup();
        assert_eq!(vars.len(), n, "{user}: two stages share a variable: {vars:?}");
        let inserted: Vec<&str> = plan.stages.iter().filter(|s| s.inserted).map(|s| s.spec.name.as_str()).collect();
        assert!(inserted.contains(&"evaluate-reshard-2"), "{user}: {inserted:?}");
    }
}
