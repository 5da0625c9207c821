//! Run records as docs/formats.md describes them (run.json), and the commands that read them
//! (`runs`, `logs`, `status`) when a record is damaged; gates on nested metrics and the events
//! of a stage whose gate fails.

mod common;

use common::{code, stderr, stdout, Project};

const SPEC: &str = r#"
[pipeline]
name = "records"

[stages.quiet]
kind = "command"
run = ["sh", "-c", "true"]

[stages.fails]
kind = "command"
run = ["sh", "-c", "echo trying; sleep 0.2; exit 3"]
"#;

fn run_dir(p: &Project) -> std::path::PathBuf {
    let runs = p.file(".mflow/runs");
    let mut ids: Vec<_> = std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.path()).collect();
    ids.sort();
    ids.pop().unwrap()
}

#[test]
fn run_json_leaves_unknown_fields_out_and_times_a_failed_stage() {
    let p = Project::new(SPEC);
    let o = p.run(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let text = std::fs::read_to_string(run_dir(&p).join("run.json")).unwrap();
    assert!(!text.contains("null"), "run.json writes null:\n{text}");
    let r = p.latest_record();
    let attempt = &r["stages"]["quiet"]["attempts"][0];
    assert!(attempt.get("message").is_none() && attempt.get("resumed_from").is_none(), "{attempt}");
    // The log is where the attempt's lines go: a stage that printed nothing made no file.
    let log = attempt["log"].as_str().unwrap();
    assert!(!run_dir(&p).join(log).exists());
    let failed = &r["stages"]["fails"];
    assert_eq!(failed["status"], "failed");
    assert!(failed.get("started").is_some() && failed.get("finished").is_some(), "{failed}");
    let d = failed["duration_s"].as_f64().unwrap_or_else(|| panic!("no duration_s: {failed}"));
    assert!((0.15..60.0).contains(&d), "{d}");
}

/// docs/formats.md lists every status run.json can hold, of the run and of a stage.
#[test]
fn the_documented_statuses_are_every_status() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/formats.md")).unwrap();
    let at = doc.find("`run.json`: ").expect("the run.json paragraph");
    let para = &doc[at..at + doc[at..].find("\n\n").unwrap()];
    use mflow_contract::record::{RunStatus, StageStatus};
    let run =
        [RunStatus::Running, RunStatus::Succeeded, RunStatus::Failed, RunStatus::Cancelled, RunStatus::Interrupted];
    for s in run.map(RunStatus::as_str) {
        assert!(para.contains(&format!("`{s}`")), "run status {s} is not documented");
    }
    let (_, stages) = para.split_once("per stage").unwrap();
    for s in [
        StageStatus::Pending,
        StageStatus::Running,
        StageStatus::Cached,
        StageStatus::Succeeded,
        StageStatus::Failed,
        StageStatus::Skipped,
        StageStatus::Cancelled,
        StageStatus::Interrupted,
    ] {
        assert!(stages.contains(&format!("`{}`", s.as_str())), "stage status {} is not documented", s.as_str());
    }
}

/// A truncated run.json: the run is listed as damaged, and its logs are still shown.
#[test]
fn a_damaged_run_is_listed_and_its_logs_still_shown() {
    let p = Project::new(SPEC);
    assert_eq!(code(&p.run(&[])), 1);
    let dir = run_dir(&p);
    let id = dir.file_name().unwrap().to_string_lossy().to_string();
    let record = std::fs::read(dir.join("run.json")).unwrap();
    std::fs::write(dir.join("run.json"), &record[..record.len() / 2]).unwrap();

    let o = p.mflow(&["runs"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains(&id) && stdout(&o).contains("damaged"), "{}", stdout(&o));
    let o = p.mflow(&["--output-format", "json", "runs"]);
    let line: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!((line["id"].as_str(), line["status"].as_str()), (Some(id.as_str()), Some("damaged")));

    let o = p.mflow(&["logs", &id, "fails"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("trying"), "{}{}", stdout(&o), stderr(&o));
    // A stage without log files still has none.
    assert_eq!(code(&p.mflow(&["logs", &id, "quiet"])), 2);
}

const GATED: &str = r#"
[pipeline]
name = "gated"

[stages.eval]
kind = "command"
run = ["sh", "-c", '''printf '{"valid": {"ppl": 30}, "loss.avg": 2}' > "$MFLOW_OUTPUT/metrics.json"''']

[stages.eval.gates]
"valid.ppl" = "< 40"
"loss.avg" = "< 3"
"#;

/// A dotted gate name reaches into nested metrics, as the summary and `metrics diff` do.
#[test]
fn a_gate_reads_a_nested_metric_by_its_dotted_name() {
    let p = Project::new(GATED);
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let gates = &p.latest_record()["stages"]["eval"]["gates"];
    assert_eq!(gates[1]["metric"], "valid.ppl");
    assert_eq!(gates[1]["value"], 30.0, "{gates}");
}

/// A failed gate ends its stage with stage_failed after stage_succeeded (or stage_cached) and
/// gates_checked, as docs/python.md says.
#[test]
fn a_failed_gate_fails_the_stage_after_it_succeeded() {
    let p = Project::new(&GATED.replace("\"< 40\"", "\"< 20\""));
    let events = |o: &std::process::Output| -> Vec<String> {
        stdout(o)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| {
                e["stage"] == "eval"
                    && e["event"].as_str().is_some_and(|e| e.starts_with("stage_") || e == "gates_checked")
            })
            .map(|e| e["event"].as_str().unwrap().to_string())
            .collect()
    };
    for first in ["stage_succeeded", "stage_cached"] {
        let o = p.run(&["--output-format", "json"]);
        assert_eq!(code(&o), 4, "{}", stderr(&o));
        let want = if first == "stage_cached" {
            vec!["stage_keyed", first, "gates_checked", "stage_failed"]
        } else {
            vec!["stage_keyed", "stage_started", first, "gates_checked", "stage_failed"]
        };
        assert_eq!(events(&o), want);
        assert_eq!(p.latest_record()["stages"]["eval"]["status"], "failed");
    }
}
