//! `mflow metrics diff`: final metrics of two runs and `--fail-if` conditions.

mod common;

use common::{code, stderr, stdout, Project};

fn two_runs() -> (Project, String, String) {
    let p = Project::new(include_str!("fixtures/ci/curves.toml"));
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.run(&["--set", "vars.final_loss=2.1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let mut ids: Vec<String> = std::fs::read_dir(p.file(".mflow/runs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    ids.sort();
    (p, ids[0].clone(), ids[1].clone())
}

#[test]
fn table_and_conditions() {
    let (p, a, b) = two_runs();
    let o = p.mflow(&["metrics", "diff", &a, &b]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let table = stdout(&o).replace(&a, "[A]").replace(&b, "[B]");
    insta::assert_snapshot!("ci_metrics_diff", table);

    // 2.0 -> 2.1 is +5%.
    let o = p.mflow(&["metrics", "diff", &a, &b, "--fail-if", "eval.val_loss>+2%"]);
    assert_eq!(code(&o), 4, "{}", stdout(&o));
    assert!(stderr(&o).contains("FAIL eval.val_loss>+2%: eval.val_loss 2 -> 2.1"), "{}", stderr(&o));
    let o = p.mflow(&["metrics", "diff", &a, &b, "--fail-if", "val_loss>+10%", "--fail-if", "val_ppl>+0.5"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // An absolute threshold on B's value, and an unknown metric (which cannot pass).
    assert_eq!(code(&p.mflow(&["metrics", "diff", &a, &b, "--fail-if", "loss<2.05"])), 0);
    let o = p.mflow(&["metrics", "diff", &a, &b, "--fail-if", "accuracy<-1%"]);
    assert_eq!(code(&o), 4);
    assert!(stderr(&o).contains("no stage has metric `accuracy`"));
}

#[test]
fn malformed_condition_is_invalid_usage() {
    let (p, a, b) = two_runs();
    let o = p.mflow(&["metrics", "diff", &a, &b, "--fail-if", "val_loss>2%"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("needs a sign"), "{}", stderr(&o));
}

/// `--output-format json` answers with one document: the runs, both values and the change per
/// stage and metric, and which conditions held; the exit code is the table's.
#[test]
fn json_is_one_document_with_values_changes_and_conditions() {
    let (p, a, b) = two_runs();
    let json = |extra: &[&str]| {
        let mut args = vec!["--output-format", "json", "metrics", "diff", &a, &b];
        args.extend_from_slice(extra);
        let o = p.mflow(&args);
        let doc: serde_json::Value =
            serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {}{}", stdout(&o), stderr(&o)));
        (code(&o), doc)
    };
    let (c, doc) = json(&[]);
    assert_eq!(c, 0);
    assert_eq!((doc["run_a"].as_str(), doc["run_b"].as_str()), (Some(a.as_str()), Some(b.as_str())));
    let m = &doc["stages"]["eval"]["val_loss"];
    assert_eq!((m["a"].as_f64(), m["b"].as_f64()), (Some(2.0), Some(2.1)), "{doc}");
    assert!(
        (m["change"].as_f64().unwrap() - 0.1).abs() < 1e-9
            && (m["change_percent"].as_f64().unwrap() - 5.0).abs() < 1e-9
    );
    assert_eq!(doc["failed"], false);

    let (c, doc) = json(&["--fail-if", "eval.val_loss>+2%", "--fail-if", "val_ppl>+0.5"]);
    assert_eq!(c, 4, "{doc}");
    assert_eq!(doc["failed"], true);
    let held: Vec<(&str, bool)> = doc["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["condition"].as_str().unwrap(), c["held"] == true))
        .collect();
    assert_eq!(held, [("eval.val_loss>+2%", true), ("val_ppl>+0.5", false)]);
    assert!(doc["conditions"][0]["failures"][0].as_str().unwrap().contains("eval.val_loss 2 -> 2.1"), "{doc}");
}
