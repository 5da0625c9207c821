//! The engine end to end: the real binary on specs of `command` stages.

mod common;

use std::time::{Duration, Instant};

use common::{code, stderr, Project};

/// A stage that appends its name to `log` and writes an output derived from its upstreams.
fn stage(name: &str, needs: &[&str], extra: &str) -> String {
    let needs = needs.iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", ");
    format!(
        "[stages.{name}]\nkind = \"command\"\nneeds = [{needs}]\nrun = [\"sh\", \"-c\", \"echo {name} >> ../log; for d in $(env | grep ^MFLOW_INPUT_ | sort | cut -d= -f2); do cat $d/out; done > $MFLOW_OUTPUT/out; echo {name}-${{vars.v_{name}}} >> $MFLOW_OUTPUT/out\"]\n{extra}\n"
    )
}

fn diamond() -> String {
    let mut s = String::from("[pipeline]\nname = \"diamond\"\n\n[vars]\nv_a = 1\nv_b = 1\nv_c = 1\nv_d = 1\n\n");
    s += &stage("a", &[], "");
    s += &stage("b", &["a"], "");
    s += &stage("c", &["a"], "");
    s += &stage("d", &["b", "c"], "");
    s
}

fn project(spec: &str) -> Project {
    let p = Project::new("");
    let work = p.path().join("w");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("spec.toml"), spec).unwrap();
    // Stages write ../log relative to the spec's directory.
    Project { dir: rebase(p, "w") }
}

fn rebase(p: Project, sub: &str) -> tempfile::TempDir {
    // Keep the temp dir alive and point the project at its subdirectory by moving files up.
    let d = p.dir;
    let tmp = tempfile::tempdir_in(d.path()).unwrap();
    std::fs::rename(d.path().join(sub).join("spec.toml"), tmp.path().join("spec.toml")).unwrap();
    std::mem::forget(d);
    tmp
}

fn log(p: &Project) -> Vec<String> {
    std::fs::read_to_string(p.path().join("../log")).unwrap_or_default().lines().map(str::to_string).collect()
}

#[test]
fn runs_in_dependency_order_and_reruns_nothing() {
    let p = project(&diamond());
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let order = log(&p);
    let pos = |n: &str| order.iter().position(|x| x == n).unwrap();
    assert!(pos("a") < pos("b") && pos("a") < pos("c") && pos("b") < pos("d") && pos("c") < pos("d"), "{order:?}");
    let o = p.run(&[]);
    assert_eq!(code(&o), 0);
    assert_eq!(log(&p).len(), 4, "the second run executed stages");
    let r = p.latest_record();
    for s in ["a", "b", "c", "d"] {
        assert_eq!(r["stages"][s]["status"], "cached");
    }
}

#[test]
fn a_changed_parameter_reruns_exactly_its_downstream_cone() {
    let p = project(&diamond());
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.run(&["--set", "vars.v_b=2"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let order = log(&p);
    assert_eq!(&order[4..], &["b".to_string(), "d".to_string()], "{order:?}");
    let r = p.latest_record();
    assert_eq!(r["stages"]["a"]["status"], "cached");
    assert_eq!(r["stages"]["c"]["status"], "cached");
}

#[test]
fn independent_stages_overlap_in_time() {
    let spec = r#"
[pipeline]
name = "par"
[stages.x]
kind = "command"
run = ["sh", "-c", "date +%s.%N > $MFLOW_OUTPUT/start; sleep 1; date +%s.%N > $MFLOW_OUTPUT/end"]
[stages.y]
kind = "command"
run = ["sh", "-c", "date +%s.%N > $MFLOW_OUTPUT/start; sleep 1; date +%s.%N > $MFLOW_OUTPUT/end"]
"#;
    let p = Project::new(spec);
    let t = Instant::now();
    let o = p.run(&["--jobs", "2"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(t.elapsed() < Duration::from_millis(1900), "stages did not overlap: {:?}", t.elapsed());
    let r = p.latest_record();
    let read = |s: &str, f: &str| -> f64 {
        let out = r["stages"][s]["output"].as_str().unwrap();
        std::fs::read_to_string(format!("{out}/{f}")).unwrap().trim().parse().unwrap()
    };
    assert!(read("x", "start") < read("y", "end") && read("y", "start") < read("x", "end"));
}

fn flaky(max: u32, on: &str, fails: u32) -> String {
    format!(
        r#"
[pipeline]
name = "flaky"
[stages.f]
kind = "command"
retries = {{ max = {max}, backoff = "10ms", on = [{on}] }}
run = ["sh", "-c", "echo x >> ../attempts; n=$(wc -l < ../attempts); if [ $n -le {fails} ]; then echo failing $n; exit 3; fi; echo ok > $MFLOW_OUTPUT/ok"]
"#
    )
}

fn attempts(p: &Project) -> usize {
    std::fs::read_to_string(p.path().join("../attempts")).unwrap_or_default().lines().count()
}

#[test]
fn a_stage_that_fails_twice_then_succeeds() {
    let p = project(&flaky(2, "\"user\"", 2));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(attempts(&p), 3);
    let r = p.latest_record();
    let a = r["stages"]["f"]["attempts"].as_array().unwrap();
    assert_eq!(a.iter().map(|x| x["outcome"].as_str().unwrap()).collect::<Vec<_>>(), ["user", "user", "success"]);
}

#[test]
fn a_retry_budget_runs_out() {
    let p = project(&flaky(1, "\"user\"", 10));
    let o = p.run(&[]);
    assert_eq!(code(&o), 1);
    assert_eq!(attempts(&p), 2);
    assert!(stderr(&o).contains("retries exhausted"), "{}", stderr(&o));
    assert!(p.cache_keys().is_empty(), "a failure was cached");
}

#[test]
fn a_class_that_is_not_retried() {
    let p = project(&flaky(3, "\"infra\"", 10));
    let o = p.run(&[]);
    assert_eq!(code(&o), 1);
    assert_eq!(attempts(&p), 1);
}

#[test]
fn a_stage_reports_its_own_failure_class() {
    let spec = r#"
[pipeline]
name = "cls"
[stages.f]
kind = "command"
retries = { max = 1, backoff = "10ms", on = ["infra"] }
run = ["sh", "-c", "echo x >> ../attempts; echo '{\"class\": \"infra\", \"message\": \"lost a peer\"}' > $MFLOW_STATUS; exit 1"]
"#;
    let p = project(spec);
    let o = p.run(&[]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert_eq!(attempts(&p), 2);
    assert!(stderr(&o).contains("lost a peer"));
}

#[test]
fn a_stage_cannot_claim_to_be_cancelled() {
    // Only the user cancels (exit 130); the stage's exit decides instead.
    let spec = r#"
[pipeline]
name = "cls"
[stages.f]
kind = "command"
run = ["sh", "-c", "echo '{\"class\": \"cancelled\", \"message\": \"meh\"}' > $MFLOW_STATUS; exit 1"]
"#;
    let o = project(spec).run(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("exited with status 1"), "{}", stderr(&o));
}

#[test]
fn a_timeout_kills_the_stage() {
    let spec = r#"
[pipeline]
name = "slow"
[stages.s]
kind = "command"
timeout = "300ms"
run = ["sh", "-c", "sleep 30"]
"#;
    let p = Project::new(spec);
    let t = Instant::now();
    let o = p.run(&[]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(stderr(&o).contains("timed out"), "{}", stderr(&o));
}

#[test]
fn a_failed_gate_has_its_own_exit_code() {
    let spec = r#"
[pipeline]
name = "gate"
[stages.e]
kind = "command"
gates = { val_ppl = "< 40" }
run = ["sh", "-c", "echo '{\"val_ppl\": 52.5}' > $MFLOW_OUTPUT/metrics.json"]
"#;
    let p = Project::new(spec);
    let o = p.run(&[]);
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(stderr(&o).contains("gate e.val_ppl < 40 : 52.5000 -> FAIL"), "{}", stderr(&o));
}

/// Alive and not a zombie waiting to be reaped.
fn pid_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

fn wait_for(path: &std::path::Path) -> String {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{} never appeared", path.display());
}

const LONG: &str = r#"
[pipeline]
name = "long"
[stages.first]
kind = "command"
run = ["sh", "-c", "echo ok > $MFLOW_OUTPUT/ok"]
[stages.sleepy]
kind = "command"
needs = ["first"]
run = ["sh", "-c", "sleep 60 & echo $! > ../child.pid; echo $$ >> ../started; echo partial > $MFLOW_OUTPUT/partial; wait"]
"#;

#[test]
fn sigint_stops_children_and_records_cancelled() {
    let p = project(LONG);
    let mut child = p.cmd(&["run", "spec.toml"]).stderr(std::process::Stdio::piped()).spawn().unwrap();
    wait_for(&p.path().join("../started"));
    let grandchild: i32 = std::fs::read_to_string(p.path().join("../child.pid")).unwrap().trim().parse().unwrap();
    // SAFETY: sends SIGINT to the mflow process we started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!pid_alive(grandchild), "a stage's child survived the cancel");
    let r = p.latest_record();
    assert_eq!(r["status"], "cancelled");
    assert_eq!(r["stages"]["sleepy"]["status"], "cancelled");
    assert_eq!(p.cache_keys().len(), 1, "only `first` may be committed");
    let staging = std::fs::read_dir(p.path().join(".mflow/cache/.staging")).unwrap().count();
    assert_eq!(staging, 0, "a partial entry was left in staging");
}

#[test]
fn sigkill_mid_stage_then_a_rerun_completes_consistently() {
    let p = project(LONG);
    let mut child = p.cmd(&["run", "spec.toml"]).spawn().unwrap();
    wait_for(&p.path().join("../started"));
    child.kill().unwrap();
    child.wait().unwrap();
    let grandchild: i32 = std::fs::read_to_string(p.path().join("../child.pid")).unwrap().trim().parse().unwrap();
    // SAFETY: cleaning up the orphaned sleep of the killed run.
    unsafe { libc::kill(grandchild, libc::SIGKILL) };
    let fast = LONG.replace("sleep 60 & echo $! > ../child.pid; ", "");
    p.write_spec(&fast);
    let o = p.run(&["--verify"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let r = p.latest_record();
    assert_eq!(r["stages"]["first"]["status"], "cached");
    assert_eq!(r["stages"]["sleepy"]["status"], "succeeded");
    let o = p.run(&["--verify"]);
    assert_eq!(code(&o), 0);
    assert_eq!(p.latest_record()["stages"]["sleepy"]["status"], "cached");
}

#[test]
fn a_corrupted_cache_entry_is_detected_and_rerun() {
    let p = project(&diamond());
    assert_eq!(code(&p.run(&[])), 0);
    let r = p.latest_record();
    let out = r["stages"]["c"]["output"].as_str().unwrap().to_string();
    // Same size, different bytes: only --verify can tell.
    let f = format!("{out}/out");
    let text = std::fs::read_to_string(&f).unwrap();
    std::fs::write(&f, text.replace('c', "x")).unwrap();
    let o = p.run(&["--verify"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("corrupt"), "{}", stderr(&o));
    assert_eq!(log(&p)[4..], ["c".to_string()]);
    // A truncated file is caught by the default fast check.
    std::fs::write(&f, "").unwrap();
    let o = p.run(&[]);
    assert_eq!(code(&o), 0);
    assert_eq!(log(&p)[5..], ["c".to_string()]);
}

#[test]
fn two_concurrent_runs_compute_each_key_once() {
    let spec = r#"
[pipeline]
name = "twice"
[stages.slow]
kind = "command"
run = ["sh", "-c", "echo x >> ../count; sleep 1; echo done > $MFLOW_OUTPUT/done"]
[stages.after]
kind = "command"
needs = ["slow"]
run = ["sh", "-c", "echo y >> ../count; cp $MFLOW_INPUT_SLOW/done $MFLOW_OUTPUT/"]
"#;
    let p = project(spec);
    let a = p.cmd(&["run", "spec.toml"]).spawn().unwrap();
    let b = p.cmd(&["run", "spec.toml"]).spawn().unwrap();
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert_eq!((code(&a), code(&b)), (0, 0));
    let count = std::fs::read_to_string(p.path().join("../count")).unwrap();
    assert_eq!(count.lines().count(), 2, "a key ran twice: {count:?}");
}

#[test]
fn plan_says_what_would_run_and_why() {
    let p = project(&diamond());
    let o = p.mflow(&["plan", "spec.toml"]);
    assert_eq!(common::stdout(&o), "a  command   run     never ran\nb  command   run     upstream `a` runs first\nc  command   run     upstream `a` runs first\nd  command   run     upstream `b` runs first\n");
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.mflow(&["plan", "spec.toml", "--set", "vars.v_c=5", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["action"], "cached");
    assert_eq!(v[2]["action"], "run");
    assert!(v[2]["reason"].as_str().unwrap().starts_with("parameter `run`"));
    let o = p.mflow(&["why", "spec.toml", "c", "--set", "vars.v_c=5"]);
    assert!(common::stdout(&o).contains("parameter `run`"), "{}", common::stdout(&o));
    let o = p.mflow(&["output", "spec.toml", "d"]);
    assert_eq!(code(&o), 0);
    assert!(std::path::Path::new(common::stdout(&o).trim()).join("out").exists());
}

/// A stage is handed its upstream outputs in place: one that writes there fails, and the output
/// it wrote into is removed and made again, never served as it was left.
#[test]
fn a_stage_that_writes_into_an_upstream_output_fails_and_that_output_is_made_again() {
    let spec = r#"
[pipeline]
name = "given"
[stages.up]
kind = "command"
run = ["sh", "-c", "echo x >> ../made; echo orig > $MFLOW_OUTPUT/f"]
[stages.down]
kind = "command"
needs = ["up"]
run = ["sh", "-c", "echo EVIL > $MFLOW_INPUT_UP/f; echo ok > $MFLOW_OUTPUT/o"]
[stages.reader]
kind = "command"
needs = ["up"]
run = ["sh", "-c", "cp $MFLOW_INPUT_UP/f $MFLOW_OUTPUT/f"]
"#;
    let p = project(spec);
    let o = p.mflow(&["run", "spec.toml", "-j", "1", "down"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("changed the output of `up`") && stderr(&o).contains("`f` was written"),
        "{}",
        stderr(&o)
    );
    // `up` runs again rather than serving what `down` left.
    let o = p.mflow(&["run", "spec.toml", "reader"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let made = std::fs::read_to_string(p.path().join("../made")).unwrap();
    assert_eq!(made.lines().count(), 2, "up ran again");
    let out = common::stdout(&p.mflow(&["output", "spec.toml", "reader"]));
    assert_eq!(std::fs::read_to_string(std::path::Path::new(out.trim()).join("f")).unwrap(), "orig\n");
}

/// An input is hashed before its stage runs; one that changes while it runs (here the stage
/// itself writes it) leaves no output under the key of its old content.
#[test]
fn an_input_changed_while_its_stage_runs_is_not_committed_under_its_old_key() {
    let spec = r#"
[pipeline]
name = "given"
[stages.a]
kind = "command"
inputs = ["in.txt"]
run = ["sh", "-c", "cp in.txt $MFLOW_OUTPUT/copy; echo v2 > in.txt"]
"#;
    let p = project(spec);
    std::fs::write(p.file("in.txt"), "v1\n").unwrap();
    let o = p.run(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("in.txt changed while the stage ran"), "{}", stderr(&o));
    // Nothing was kept: the next run (of v2) runs, and then is cached.
    let o = p.run(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    std::fs::write(p.file("in.txt"), "v1\n").unwrap();
    let o = p.mflow(&["plan", "spec.toml"]);
    assert!(!common::stdout(&o).contains("cached"), "{}", common::stdout(&o));
}

/// Specs beside each other share a workdir, and often stage names: each pipeline's reasons
/// compare with its own last keys, not with another spec's stage of the same name.
#[test]
fn why_compares_with_the_same_pipelines_last_run() {
    let spec = |name: &str, say: &str| {
        format!("[pipeline]\nname = \"{name}\"\n[vars]\nlr = \"0.1\"\n[stages.train]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo {say} > $MFLOW_OUTPUT/out\"]\n")
    };
    let p = project(&spec("alpha", "alpha-${vars.lr}"));
    assert_eq!(code(&p.run(&[])), 0);
    std::fs::write(p.file("beta.toml"), spec("beta", "beta")).unwrap();
    assert_eq!(code(&p.mflow(&["run", "beta.toml"])), 0);
    let o = p.mflow(&["why", "spec.toml", "train", "--set", "vars.lr=\"0.2\""]);
    let why = common::stdout(&o);
    assert!(why.contains("alpha-0.1") && why.contains("alpha-0.2") && !why.contains("beta"), "{why}");
    // Each pipeline's run found its own stage cached.
    let o = p.mflow(&["plan", "beta.toml"]);
    assert!(common::stdout(&o).contains("cached"), "{}", common::stdout(&o));
}

/// `output --download` copies the committed output into a new directory, checked against its
/// manifest; `--log-format json` lists the files with their digests (what a laptop reads of a
/// cluster's output before fetching it).
#[test]
fn an_output_is_listed_and_copied_whole() {
    let p = project(&diamond());
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.mflow(&["--log-format", "json", "output", "spec.toml", "d"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let path = std::path::PathBuf::from(v["path"].as_str().unwrap());
    assert_eq!(v["files"][0]["path"], "out");
    assert_eq!(v["files"][0]["blake3"].as_str().unwrap().len(), 64);
    assert_eq!(v["digest"].as_str().unwrap().len(), 64);

    let to = p.path().join("copy");
    let o = p.mflow(&["output", "spec.toml", "d", "--download", to.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(std::fs::read(to.join("out")).unwrap(), std::fs::read(path.join("out")).unwrap());
    let o = p.mflow(&["output", "spec.toml", "d", "--download", to.to_str().unwrap()]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("exists"), "{}", stderr(&o));
    // Nothing staged is left beside it.
    let left: Vec<String> = std::fs::read_dir(p.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `metrics show`: the output's metrics.json and the metric lines of the run that computed it,
/// the same after a cached rerun; a stage without a committed output for the spec as it is now
/// is refused.
#[test]
fn metrics_show_gives_the_summary_and_the_lines_of_the_run_that_computed_them() {
    let spec = "[pipeline]\nname = \"m\"\n[vars]\nn = 2\n[stages.fit]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \
        \"for i in $(seq ${vars.n}); do echo '{\\\"iteration\\\": '$i', \\\"loss\\\": '$((10 - i))'}' >> $MFLOW_METRICS; done; \
        echo '{\\\"val_loss\\\": 1.5}' > $MFLOW_OUTPUT/metrics.json\"]\n";
    let p = project(spec);
    assert_eq!(code(&p.run(&[])), 0);
    let show = |extra: &[&str]| {
        let mut args = vec!["--output-format", "json", "metrics", "show", "spec.toml", "fit"];
        args.extend_from_slice(extra);
        p.mflow(&args)
    };
    let o = show(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let first = v["run"].as_str().unwrap().to_string();
    assert_eq!(v["summary"], serde_json::json!({"val_loss": 1.5}));
    assert_eq!(v["series"], serde_json::json!([{"iteration": 1, "loss": 9}, {"iteration": 2, "loss": 8}]));
    assert!(std::path::Path::new(v["path"].as_str().unwrap()).join("metrics.json").is_file());
    assert_eq!(v["digest"].as_str().unwrap().len(), 64);

    // A cached rerun computed nothing: the lines are still those of the first run.
    assert_eq!(code(&p.run(&[])), 0);
    let v: serde_json::Value = serde_json::from_slice(&show(&[]).stdout).unwrap();
    assert_eq!(v["run"].as_str(), Some(first.as_str()));

    let text = common::stdout(&p.mflow(&["metrics", "show", "spec.toml", "fit"]));
    assert!(text.contains(&format!("run {first}: 2 metric lines")) && text.contains("val_loss = 1.5"), "{text}");
    let o = show(&["--set", "vars.n=3"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("no committed output"), "{}", stderr(&o));
}

#[test]
fn gc_keeps_what_recent_runs_use() {
    let p = project(&diamond());
    assert_eq!(code(&p.run(&[])), 0);
    assert_eq!(code(&p.run(&["--set", "vars.v_a=9"])), 0);
    assert_eq!(p.cache_keys().len(), 8);
    let o = p.mflow(&["gc", "--keep-runs", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(p.cache_keys().len(), 4);
    // The manifest log keeps a line for each remaining entry only.
    let manifests = std::fs::read_to_string(p.file(".mflow/cache/.manifests.jsonl")).unwrap();
    let mut logged: Vec<String> = manifests
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["key"].as_str().unwrap().to_string())
        .collect();
    logged.sort();
    assert_eq!(logged, p.cache_keys());
    let o = p.run(&["--set", "vars.v_a=9"]);
    assert_eq!(code(&o), 0);
    assert_eq!(log(&p).len(), 8, "gc removed an entry the kept run uses");
}

#[test]
fn inputs_enter_the_key() {
    let spec = r#"
[pipeline]
name = "inputs"
[stages.read]
kind = "command"
inputs = ["data/*.txt"]
run = ["sh", "-c", "echo x >> ../count; cat data/*.txt > $MFLOW_OUTPUT/all"]
"#;
    let p = project(spec);
    std::fs::create_dir_all(p.path().join("data")).unwrap();
    std::fs::write(p.path().join("data/a.txt"), "one").unwrap();
    assert_eq!(code(&p.run(&[])), 0);
    assert_eq!(code(&p.run(&[])), 0);
    std::fs::write(p.path().join("data/a.txt"), "two").unwrap();
    assert_eq!(code(&p.run(&[])), 0);
    let count = std::fs::read_to_string(p.path().join("../count")).unwrap();
    assert_eq!(count.lines().count(), 2);
}

/// What a run reads before its spec is checked comes from the default workdir; a spec that
/// names its own must be planned from that one alone.
#[test]
fn a_spec_with_its_own_workdir_is_planned_from_it() {
    let spec = r#"
[pipeline]
name = "own"
workdir = "state-here"
[stages.read]
kind = "command"
inputs = ["a.txt"]
run = ["sh", "-c", "echo x >> ../count; cat a.txt > $MFLOW_OUTPUT/all"]
[stages.after]
kind = "command"
needs = ["read"]
run = ["sh", "-c", "echo y >> ../count; cp $MFLOW_INPUT_READ/all $MFLOW_OUTPUT/"]
"#;
    let p = project(spec);
    std::fs::write(p.path().join("a.txt"), "one").unwrap();
    assert_eq!(code(&p.mflow(&["run", "spec.toml"])), 0);
    // A default workdir with other state is not read.
    std::fs::create_dir_all(p.path().join(".mflow/cache")).unwrap();
    std::fs::create_dir_all(p.path().join(".mflow/state")).unwrap();
    std::fs::write(p.path().join(".mflow/cache/.manifests.jsonl"), "{\"not\": \"a manifest\"}\n").unwrap();
    std::fs::write(p.path().join(".mflow/state/inputs.json"), "{}").unwrap();
    assert_eq!(code(&p.mflow(&["run", "spec.toml"])), 0);
    let count = || std::fs::read_to_string(p.path().join("../count")).unwrap().lines().count();
    assert_eq!(count(), 2, "the second run executed stages");
    std::fs::write(p.path().join("a.txt"), "two").unwrap();
    assert_eq!(code(&p.mflow(&["run", "spec.toml"])), 0);
    assert_eq!(count(), 4, "a changed input reruns its stage and the one after");
    assert!(p.path().join("state-here/runs").is_dir());
    assert!(!p.path().join(".mflow/runs").exists());
}

#[test]
fn logs_and_status_show_a_run() {
    let p = project(&flaky(2, "\"user\"", 1));
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.mflow(&["logs", "f"]);
    assert_eq!(common::stdout(&o), "--- attempt 1 ---\nfailing 1\n--- attempt 2 ---\n");
    let o = p.mflow(&["status"]);
    assert!(common::stdout(&o).contains("(2 attempts)"), "{}", common::stdout(&o));
}

/// A spec that passed its checks is not checked again while it, its overrides and the binary
/// stay the same; any edit is checked (and a mistake reported) as before.
#[test]
fn an_unchanged_spec_is_not_checked_again() {
    let p = project(&diamond());
    let home = tempfile::tempdir().unwrap();
    let validate = |extra: &[&str]| {
        let mut args = vec!["validate", "spec.toml"];
        args.extend_from_slice(extra);
        p.cmd(&args).env("MFLOW_HOME", home.path()).env("RUST_LOG", "mflow::spec=debug").output().unwrap()
    };
    let reused = |o: &std::process::Output| stderr(o).contains("spec unchanged since it was last checked");

    let first = validate(&[]);
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    assert!(!reused(&first));
    assert_eq!(std::fs::read_dir(home.path().join("specs")).unwrap().count(), 1);
    assert!(reused(&validate(&[])));

    // Another override is another spec.
    let set = validate(&["--set", "vars.v_a=2"]);
    assert_eq!(code(&set), 0, "{}", stderr(&set));
    assert!(!reused(&set));

    // An edit is checked: the mistake is reported, and nothing stale is used.
    p.write_spec(&diamond().replace("needs = [\"a\"]", "neds = [\"a\"]"));
    let bad = validate(&[]);
    assert_ne!(code(&bad), 0);
    assert!(stderr(&bad).contains("unknown key `neds`"), "{}", stderr(&bad));

    // A damaged stored form is passed over and replaced.
    p.write_spec(&diamond());
    let stored = std::fs::read_dir(home.path().join("specs")).unwrap().next().unwrap().unwrap().path();
    assert_eq!(code(&validate(&[])), 0);
    let text = std::fs::read_to_string(&stored).unwrap();
    std::fs::write(&stored, &text[..text.len() / 2]).unwrap();
    let damaged = validate(&[]);
    assert_eq!(code(&damaged), 0, "{}", stderr(&damaged));
    assert!(!reused(&damaged));
    assert!(reused(&validate(&[])));
}

/// Python warnings a stage repeats reach the console once, shortened and without the source line
/// Python quotes under each; the attempt log keeps every line as printed.
#[test]
fn a_repeated_python_warning_is_shown_once_and_logged_whole() {
    let spec = r#"
[pipeline]
name = "warn"
[stages.w]
kind = "command"
run = ["sh", "-c", "for i in 1 2 3; do echo '/usr/lib/python3/dist-packages/megatron/core/utils.py:123: UserWarning: Transformer Engine is not installed' >&2; echo '  warnings.warn(\"Transformer Engine is not installed\")' >&2; done; echo 'step 1: loss 2.5, 0 warnings'; echo ok > $MFLOW_OUTPUT/ok"]
"#;
    let p = Project::new(spec);
    let o = p.run(&[]);
    let err = stderr(&o);
    assert_eq!(code(&o), 0, "{err}");
    assert_eq!(
        err.matches("warning (shown once): UserWarning: Transformer Engine is not installed").count(),
        1,
        "{err}"
    );
    assert!(!err.contains("utils.py:123") && !err.contains("warnings.warn("), "{err}");
    assert!(err.contains("w | step 1: loss 2.5, 0 warnings"), "{err}");

    let r = p.latest_record();
    let runs = p.file(".mflow/runs").join(r["id"].as_str().unwrap());
    let log = std::fs::read_to_string(runs.join(r["stages"]["w"]["attempts"][0]["log"].as_str().unwrap())).unwrap();
    // stdout and stderr are read apart, so the normal line's place among the others may vary.
    let mut logged: Vec<&str> = log.lines().collect();
    logged.sort_unstable();
    let mut printed = [
        "/usr/lib/python3/dist-packages/megatron/core/utils.py:123: UserWarning: Transformer Engine is not installed",
        "  warnings.warn(\"Transformer Engine is not installed\")",
    ]
    .repeat(3);
    printed.push("step 1: loss 2.5, 0 warnings");
    printed.sort_unstable();
    assert_eq!(logged, printed);
}

/// The binary removed while a run goes on (an upgrade, a rebuild): the native stages that start
/// later still run, as the run's own version.
#[test]
fn native_stages_run_after_the_binary_was_replaced() {
    let p = Project::new(
        "[pipeline]\nname = \"upgrade\"\n\n[stages.wait]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"sleep 2; echo ok > $MFLOW_OUTPUT/x\"]\n\n[stages.model]\nkind = \"model\"\nneeds = [\"wait\"]\nsource = \"init:llama-tiny\"\n",
    );
    let exe = p.path().join("mflow");
    std::fs::copy(env!("CARGO_BIN_EXE_mflow"), &exe).unwrap();
    let child = std::process::Command::new(&exe)
        .args(["run", "spec.toml"])
        .current_dir(p.path())
        .env("CI", "true")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    std::fs::remove_file(&exe).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(p.latest_record()["stages"]["model"]["status"] == "succeeded");
}

/// `mflow run SPEC STAGE...` runs those stages and what they need, and nothing after them; a
/// name that is no stage is refused before anything runs.
#[test]
fn named_stages_run_with_what_they_need_and_nothing_after() {
    let p = project(&diamond());
    let o = p.cmd(&["run", "spec.toml", "b"]).output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let mut ran = log(&p);
    ran.sort();
    assert_eq!(ran, ["a", "b"]);
    let r = p.latest_record();
    let stages: Vec<&String> = r["stages"].as_object().unwrap().keys().collect();
    assert_eq!(stages, ["a", "b"], "the record holds the stages of this run");
    let o = p.cmd(&["run", "spec.toml", "d", "c"]).output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(log(&p).len(), 4, "a and b were cached, c and d ran");
    let o = p.cmd(&["run", "spec.toml", "nope"]).output().unwrap();
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("unknown stage `nope`"), "{}", stderr(&o));
}

/// `--force` of a stage the run does not select says so, rather than "unknown stage".
#[test]
fn force_of_a_stage_outside_the_selection_says_so() {
    let p = project(&diamond());
    let o = p.mflow(&["run", "spec.toml", "b", "--force", "c"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("force_unselected") && stderr(&o).contains("not one this run runs"), "{}", stderr(&o));
    let o = p.mflow(&["run", "spec.toml", "b", "--force", "nope"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("unknown stage `nope`"), "{}", stderr(&o));
    assert_eq!(code(&p.mflow(&["run", "spec.toml", "b", "--force", "a"])), 0);
}

/// A stage with `cache = false` runs every time, and its newest output is still the one
/// `mflow output` names.
#[test]
fn the_output_of_an_uncached_stage_is_found() {
    let spec = "[pipeline]\nname = \"u\"\n[stages.a]\nkind = \"command\"\ncache = false\nrun = [\"sh\", \"-c\", \"echo hi > $MFLOW_OUTPUT/x\"]\n";
    let p = project(spec);
    let o = p.mflow(&["output", "spec.toml", "a"]);
    assert_eq!(code(&o), 2, "before any run: {}", stderr(&o));
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.mflow(&["output", "spec.toml", "a"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let dir = common::stdout(&o);
    assert_eq!(std::fs::read_to_string(std::path::Path::new(dir.trim()).join("x")).unwrap(), "hi\n");
}
