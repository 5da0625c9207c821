//! Exit codes not covered by tests/engine.rs (1, 3, 4 and 130 are there), and the documented
//! table staying in step with `mflow exit-codes`.

mod common;

use common::{code, stderr, stdout, Project};

const OK: &str = "[pipeline]\nname = \"x\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"true\"]\n";

#[test]
fn invalid_spec_is_2_and_nothing_runs() {
    let p = Project::new(&OK.replace("run = ", "rnu = "));
    let o = p.run(&[]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(!p.file(".mflow/runs").exists());
    let p = Project::new(OK);
    assert_eq!(code(&p.run(&["--force", "nope"])), 2);
}

#[test]
fn success_is_0() {
    let p = Project::new(OK);
    assert_eq!(code(&p.run(&[])), 0);
}

#[test]
fn internal_error_is_70() {
    // The workdir cannot be created: a file is in the way.
    let p = Project::new(&OK.replace("name = \"x\"", "name = \"x\"\nworkdir = \"blocked/w\""));
    std::fs::write(p.file("blocked"), "a file").unwrap();
    let o = p.run(&[]);
    assert_eq!(code(&o), 70, "{}", stderr(&o));
}

#[test]
fn reproduce_refused_is_5() {
    let p = Project::new(&OK.replace("run = ", "inputs = [\"in.txt\"]\nrun = "));
    std::fs::write(p.file("in.txt"), "1").unwrap();
    assert_eq!(code(&p.run(&[])), 0);
    std::fs::write(p.file("in.txt"), "2").unwrap();
    let id = std::fs::read_dir(p.file(".mflow/runs")).unwrap().flatten().next().unwrap().file_name();
    assert_eq!(code(&p.mflow(&["reproduce", &id.to_string_lossy()])), 5);
}

#[test]
fn documented_table_matches_the_binary() {
    let p = Project::new(OK);
    let table = stdout(&p.mflow(&["exit-codes"]));
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/exit-codes.md")).unwrap();
    for line in table.lines() {
        let code = line.split_whitespace().next().unwrap();
        assert!(doc.contains(&format!("| {code} |")), "docs/exit-codes.md lacks code {code}");
    }
}

#[test]
fn a_hub_outage_at_plan_time_is_3_and_a_pinned_commit_plans_offline() {
    const HUB: &str = "[pipeline]\nname = \"x\"\n\n[stages.model]\nkind = \"model\"\nsource = \"SOURCE\"\n";
    // Nothing listens on this port: the Hub is down.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let endpoint = format!("http://{closed}");
    let p = Project::new(&HUB.replace("SOURCE", "hf://org/tiny"));
    let o = p.cmd(&["plan", "spec.toml"]).env("HF_ENDPOINT", &endpoint).output().unwrap();
    assert_eq!(code(&o), 3, "an unreachable Hub is not a broken spec: {}", stderr(&o));
    assert!(stderr(&o).contains("mflow::plan::unavailable"), "{}", stderr(&o));
    let p = Project::new(&HUB.replace("SOURCE", &format!("hf://org/tiny@{}", "ab".repeat(20))));
    let o = p.cmd(&["plan", "spec.toml"]).env("HF_ENDPOINT", &endpoint).output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn a_link_or_fifo_in_an_output_is_the_stages_error_and_not_retried() {
    for make in ["ln -s /etc/hostname $MFLOW_OUTPUT/link", "mkfifo $MFLOW_OUTPUT/pipe"] {
        let spec = format!("[pipeline]\nname = \"x\"\n\n[stages.a]\nkind = \"command\"\nretries = {{ max = 2, backoff = \"10ms\", on = [\"infra\"] }}\nrun = [\"sh\", \"-c\", \"{make}\"]\n");
        let p = Project::new(&spec);
        let o = p.run(&[]);
        assert_eq!(code(&o), 1, "{make}: {}", stderr(&o));
        let rec = p.latest_record();
        assert_eq!(rec["stages"]["a"]["attempts"].as_array().unwrap().len(), 1, "{make}: retried as infra: {rec:#}");
        assert_eq!(rec["stages"]["a"]["class"], "user", "{rec:#}");
        assert!(rec["stages"]["a"]["message"].as_str().unwrap().starts_with("stage output contains"), "{rec:#}");
        assert!(p.file(".mflow/cache/.staging").read_dir().unwrap().next().is_none(), "{make}: staging left behind");
    }
}

#[test]
fn more_gpus_than_the_machine_has_is_refused_at_plan_time() {
    let p = Project::new(&OK.replace("run = ", "resources = { gpus = 1000 }\nrun = "));
    let o = p.run(&[]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("asks for 1000 GPUs"), "{}", stderr(&o));
    assert!(!p.file(".mflow/runs").exists(), "a run started");
}

#[test]
fn a_spec_that_is_a_fifo_or_huge_is_refused_without_hanging() {
    let p = Project::new(OK);
    let fifo = p.file("fifo.toml");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let mut child = p
        .cmd(&["plan", "fifo.toml"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(20) {
            child.kill().unwrap();
            panic!("mflow hung on a FIFO spec");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("a FIFO, not a regular file"), "{}", stderr(&o));

    let huge = format!("{OK}# {}\n", "x".repeat(17 << 20));
    std::fs::write(p.file("huge.toml"), huge).unwrap();
    let o = p.mflow(&["plan", "huge.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("more than the"), "{}", stderr(&o));
}
