//! Stages that fail or misbehave. The class a failure gets follows the rule of
//! docs/exit-codes.md at every kind of stage; environment names a process or Kubernetes would
//! take otherwise are refused; an output replaced by a link is refused; a run ends the same
//! when its output streams are gone; records that cannot be read push no run out of
//! `--keep-runs`.

mod common;

use std::io::{Read, Write};
use std::process::{Output, Stdio};

use common::{code, stderr, Project};

/// stderr as one line of words: messages are wrapped to the width of a terminal, and the
/// frame of a diagnostic is not part of what it says.
fn said(o: &Output) -> String {
    let frame = |w: &str| w.chars().all(|c| "│╰─▶×├╭╮╯┆·⚠☓".contains(c));
    stderr(o).split_whitespace().filter(|w| !frame(w)).collect::<Vec<_>>().join(" ")
}

/// One stage of each kind, each reading files named by path, so that none waits for another.
const KINDS: &[(&str, &str)] = &[
    ("cmd", "kind = \"command\"\nrun = [\"true\"]"),
    ("model", "kind = \"model\"\nsource = \"path:m\""),
    ("convert", "kind = \"convert\"\nmodel = \"hf\""),
    ("data", "kind = \"dataset\"\ninputs = [\"corpus.txt\"]\ntokenizer = \"byte-level\""),
    ("train", "kind = \"train\"\nmodel = \"shards\"\ndata = \"ds\""),
    ("evaluate", "kind = \"evaluate\"\nmodel = \"shards\"\ndata = \"ds\""),
    ("export", "kind = \"export\"\nmodel = \"shards\""),
];

/// The files the stages of [`KINDS`] read; what they hold does not matter to these cases.
const FILES: &[&str] = &[
    "m/config.json",
    "m/model.safetensors",
    "hf/config.json",
    "hf/model.safetensors",
    "corpus.txt",
    "shards/mp_rank_00/model.safetensors",
    "shards/mflow_shards.json",
    "ds/train.bin",
    "ds/train.idx",
    "ds/valid.bin",
];

/// A project with every stage of [`KINDS`], each with `extra` added.
fn every_kind(extra: &str) -> Project {
    let mut spec = String::from("[pipeline]\nname = \"classes\"\n");
    for (name, body) in KINDS {
        spec.push_str(&format!("\n[stages.{name}]\n{body}\n{extra}\n"));
    }
    let p = Project::new(&spec);
    for f in FILES {
        let path = p.file(f);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, format!("{{\"file\": \"{f}\"}}")).unwrap();
    }
    p
}

const RETRY_INFRA: &str = "retries = { max = 2, on = [\"infra\"], backoff = \"100ms\" }";

/// `(class, attempts)` of `stage` in the newest record.
fn failed(p: &Project, stage: &str) -> (String, usize) {
    let r = p.latest_record();
    let s = &r["stages"][stage];
    assert_eq!(s["status"], "failed", "{stage}: {s}");
    (s["class"].as_str().unwrap_or_default().to_string(), s["attempts"].as_array().map_or(0, Vec::len))
}

/// A Hub at 127.0.0.1 that answers every request with `status`; the count of requests.
fn hub(status: &'static str) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = n.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(s, "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (port, n)
}

#[test]
fn hardening_what_repeats_is_the_users_at_every_kind_of_stage() {
    // An environment value longer than one execve(2) string may be (E2BIG) would fail every
    // attempt: refused when the spec is read, at every kind of stage.
    let big = "x".repeat(200_000);
    let p = every_kind(&format!("env = {{ BIG = \"{big}\" }}\n{RETRY_INFRA}"));
    let o = p.run(&[]);
    assert_eq!(code(&o), 2, "{}", said(&o));
    for (stage, _) in KINDS {
        assert!(said(&o).contains(&format!("[stages.{stage}].env.BIG`: 200005 bytes")), "{stage}: {}", said(&o));
    }
    // An argument that long still reaches execve (a command's own): the same attempt meets it
    // again, so `on = ["infra"]` does not retry it.
    let p = every_kind(RETRY_INFRA);
    let spec = std::fs::read_to_string(p.file("spec.toml")).unwrap();
    p.write_spec(&spec.replace("run = [\"true\"]", &format!("run = [\"echo\", \"{big}\"]")));
    let o = p.run(&["cmd"]);
    assert_eq!(code(&o), 1, "{}", said(&o));
    assert_eq!(failed(&p, "cmd"), ("user".to_string(), 1));
    let message = p.latest_record()["stages"]["cmd"]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("cannot start") && message.contains("too long"), "{message}");
    // A NUL byte reaching a command's arguments through a variable: refused when the spec is read.
    let p = every_kind(RETRY_INFRA);
    let mut spec = std::fs::read_to_string(p.file("spec.toml")).unwrap();
    spec = spec.replace("run = [\"true\"]", "run = [\"echo\", \"${vars.v}\"]");
    spec = spec.replace("[pipeline]\n", "[vars]\nv = \"a\\u0000b\"\n\n[pipeline]\n");
    p.write_spec(&spec);
    let o = p.run(&["cmd"]);
    assert_eq!(code(&o), 2, "{}", said(&o));
    assert!(said(&o).contains("NUL byte"), "{}", said(&o));
    // A workdir so deep that the output's path is past PATH_MAX, while the run's record fits.
    let p = Project::new("");
    let mut workdir = p.path().display().to_string();
    while workdir.len() < 3990 {
        workdir.push('/');
        workdir.push_str(&"d".repeat(200));
    }
    workdir.truncate(3990);
    p.write_spec(&format!(
        "[pipeline]\nname = \"deep\"\nworkdir = \"{workdir}\"\n\n[stages.a]\nkind = \"command\"\n\
         run = [\"sh\", \"-c\", \"echo > $MFLOW_OUTPUT/f\"]\n{RETRY_INFRA}\n"
    ));
    let o = p.run(&[]);
    assert_eq!(code(&o), 1, "{}", said(&o));
    assert!(said(&o).contains("a failed: user") && said(&o).contains("File name too long"), "{}", said(&o));
}

#[test]
fn hardening_environment_names_and_values_no_process_takes_are_refused_in_the_spec() {
    for (env, want) in [
        ("\"MFLOW_OUTPUT=x\" = \"/tmp\"", "not an environment variable name"),
        ("\"1X\" = \"v\"", "not an environment variable name"),
        ("\"A-B\" = \"v\"", "not an environment variable name"),
        ("\"A.B\" = \"v\"", "not an environment variable name"),
        ("\"\" = \"v\"", "not an environment variable name"),
        ("\"A B\" = \"v\"", "not an environment variable name"),
        ("X = \"a\\u0000b\"", "holds a NUL byte"),
        ("MFLOW_OUTPUT = \"/tmp\"", "mflow sets MFLOW_OUTPUT for each attempt"),
        ("PET_NNODES = \"2\"", "PET_* are torchrun's settings"),
    ] {
        for (stage, _) in KINDS {
            let p = every_kind("");
            let spec = std::fs::read_to_string(p.file("spec.toml")).unwrap();
            let at = spec.find(&format!("[stages.{stage}]\n")).unwrap();
            let end = at + spec[at..].find("\n\n").unwrap_or(spec.len() - at);
            p.write_spec(&format!("{}\nenv = {{ {env} }}{}", &spec[..end], &spec[end..]));
            let o = p.mflow(&["plan", "spec.toml"]);
            assert_eq!(code(&o), 2, "{stage} {env}: {}", said(&o));
            let text = said(&o);
            assert!(text.contains(want) && text.contains("spec.toml"), "{stage} {env}: {text}");
            assert!(text.contains(&format!("stages.{stage}].env")), "{stage} {env}: {text}");
        }
    }
    // The driver's environment on Kubernetes is held to the same names.
    let p = every_kind("");
    let spec = std::fs::read_to_string(p.file("spec.toml")).unwrap().replace(
        "name = \"classes\"\n",
        "name = \"classes\"\n\n[pipeline.kubernetes.driver]\nenv = { \"A=B\" = \"v\" }\n",
    );
    p.write_spec(&spec);
    let o = p.mflow(&["plan", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", said(&o));
    assert!(said(&o).contains("not an environment variable name"), "{}", said(&o));
}

#[test]
fn hardening_a_hub_that_is_down_is_infrastructure_and_retried() {
    let rev = "0123456789abcdef0123456789abcdef01234567";
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (down, _) = hub("503 Service Unavailable");
    let (busy, _) = hub("429 Too Many Requests");
    let (missing, _) = hub("404 Not Found");
    // The Hub client waits and tries again itself before the stage fails: the cases run side by side.
    let retry = "retries = { max = 1, on = [\"infra\"], backoff = \"100ms\" }";
    std::thread::scope(|s| {
        for (port, class, attempts, exit) in
            [(down, "infra", 2, 3), (busy, "infra", 2, 3), (refused, "infra", 2, 3), (missing, "user", 1, 1)]
        {
            s.spawn(move || {
                let p = Project::new(&format!(
                    "[pipeline]\nname = \"hub\"\n\n[stages.m]\nkind = \"model\"\nsource = \"hf://org/name@{rev}\"\n\
                     env = {{ HF_ENDPOINT = \"http://127.0.0.1:{port}\" }}\n{retry}\n"
                ));
                let o = p.run(&[]);
                assert_eq!(code(&o), exit, "{port}: {}", said(&o));
                assert_eq!(failed(&p, "m"), (class.to_string(), attempts), "{port}: {}", said(&o));
            });
        }
    });
}

#[test]
fn hardening_an_output_replaced_by_a_link_is_refused() {
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("f"), "x").unwrap();
    for (script, why) in [
        (
            format!("rm -rf \"$MFLOW_OUTPUT\" && ln -s {} \"$MFLOW_OUTPUT\"", elsewhere.path().display()),
            "not a regular file or directory",
        ),
        ("rm -rf \"$MFLOW_OUTPUT\" && echo x > \"$MFLOW_OUTPUT\"".to_string(), "wrote no output directory"),
    ] {
        let p = Project::new(&format!(
            "[pipeline]\nname = \"link\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", {script:?}]\n{RETRY_INFRA}\n"
        ));
        let o = p.run(&[]);
        assert_eq!(code(&o), 1, "{script}: {}", said(&o));
        assert_eq!(failed(&p, "a"), ("user".to_string(), 1), "{script}");
        assert!(said(&o).contains(why), "{script}: {}", said(&o));
        assert!(elsewhere.path().join("f").is_file());
        assert!(p.cache_keys().is_empty(), "{script}: {:?}", p.cache_keys());
    }
}

#[test]
fn hardening_the_end_of_a_run_does_not_depend_on_its_output_streams() {
    // Many lines, so that the reader is gone long before the run ends.
    let p = Project::new(
        "[pipeline]\nname = \"pipe\"\n\n[stages.a]\nkind = \"command\"\n\
         run = [\"sh\", \"-c\", \"i=0; while [ $i -lt 2000 ]; do echo line $i; echo err $i >&2; i=$((i+1)); done; echo ok > $MFLOW_OUTPUT/f\"]\n\n\
         [stages.b]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"exit 3\"]\nneeds = [\"a\"]\n",
    );
    for (args, exit) in [(vec!["run", "spec.toml", "a"], 0), (vec!["run", "spec.toml"], 1)] {
        let _ = std::fs::remove_file(p.file("j.xml"));
        let _ = std::fs::remove_file(p.file("r.html"));
        let (reader, writer) = std::io::pipe().unwrap();
        let mut args = args.clone();
        args.extend(["--junit", "j.xml", "--report", "r.html", "-v"]);
        let mut child =
            p.cmd(&args).stdout(writer.try_clone().unwrap()).stderr(writer).stdin(Stdio::null()).spawn().unwrap();
        // `| head -c 100`: a little is read, then the reader is gone.
        let mut first = [0u8; 100];
        let mut reader = reader;
        let _ = reader.read(&mut first);
        drop(reader);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(exit), "{args:?}: {status:?}");
        assert!(p.file("j.xml").is_file(), "{args:?}: no JUnit file");
        assert!(p.file("r.html").is_file(), "{args:?}: no report");
    }
}

#[test]
fn hardening_records_that_cannot_be_read_push_no_run_out_of_keep_runs() {
    let p = Project::new(
        "[pipeline]\nname = \"gc\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo ${vars.v} > $MFLOW_OUTPUT/f\"]\n\n[vars]\nv = \"1\"\n",
    );
    for v in ["1", "2"] {
        let o = p.run(&["--set", &format!("vars.v={v}")]);
        assert_eq!(code(&o), 0, "{}", said(&o));
    }
    assert_eq!(p.cache_keys().len(), 2);
    // Ten records newer by their names, each cut short.
    let runs = p.file(".mflow/runs");
    let mut ids: Vec<String> =
        std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    ids.sort();
    let newest = ids.last().unwrap().clone();
    let full = std::fs::read_to_string(runs.join(&newest).join("run.json")).unwrap();
    for i in 0..10 {
        let fake = runs.join(format!("{newest}{i}"));
        std::fs::create_dir_all(&fake).unwrap();
        std::fs::write(fake.join("run.json"), &full[..full.len() / 2]).unwrap();
    }
    let o = p.mflow(&["gc", "--workdir", ".mflow", "--keep-runs", "2"]);
    assert_eq!(code(&o), 0, "{}", said(&o));
    assert_eq!(p.cache_keys().len(), 2, "gc removed what the two real runs use: {}", said(&o));
    assert!(said(&o).contains("10 runs have no readable run.json"), "{}", said(&o));
    let o = p.mflow(&["gc", "--workdir", ".mflow", "--keep-runs", "1"]);
    assert_eq!(code(&o), 0, "{}", said(&o));
    assert_eq!(p.cache_keys().len(), 1, "{}", said(&o));
}

#[test]
fn hardening_names_kubernetes_refuses_are_refused_at_render() {
    for (line, want) in [
        ("namespace = \"ML team\"", "namespace"),
        (&*format!("namespace = \"{}\"", "n".repeat(64)), "namespace"),
        ("[pipeline.kubernetes.driver]\nservice_account = \"Mflow_Driver\"", "service account"),
    ] {
        let p = Project::new(&format!(
            "[pipeline]\nname = \"k\"\n\n[pipeline.kubernetes]\n{line}\n\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n"
        ));
        let o = p.mflow(&["render", "spec.toml", "--backend", "kubernetes"]);
        assert_eq!(code(&o), 2, "{line}: {}", said(&o));
        assert!(said(&o).contains(want), "{line}: {}", said(&o));
    }
}

#[test]
fn hardening_a_line_without_an_end_is_read_a_piece_at_a_time() {
    // 128 MiB without a line end: mflow holds a piece of it at a time, and the log says so.
    let p = Project::new(
        "[pipeline]\nname = \"line\"\n\n[stages.a]\nkind = \"command\"\n\
         run = [\"sh\", \"-c\", \"head -c 134217728 /dev/zero | tr '\\\\000' x; echo ok > $MFLOW_OUTPUT/f\"]\n",
    );
    let mut child =
        p.cmd(&["run", "spec.toml"]).stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null()).spawn().unwrap();
    let status = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    while child.try_wait().unwrap().is_none() {
        let text = std::fs::read_to_string(&status).unwrap_or_default();
        if let Some(kib) = text.lines().find_map(|l| l.strip_prefix("VmHWM:")) {
            peak_kib = peak_kib.max(kib.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(child.wait().unwrap().success());
    assert!(peak_kib > 0 && peak_kib < 100 << 10, "mflow's peak resident size was {peak_kib} KiB");
    let runs = p.file(".mflow/runs");
    let run = std::fs::read_dir(&runs).unwrap().next().unwrap().unwrap().path();
    let log = run.join("stages/a/attempt-1.log");
    let said = std::process::Command::new("grep").arg("-c").arg("is split into lines").arg(&log).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&said.stdout).trim(), "1", "{}", log.display());
}
