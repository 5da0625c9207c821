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
