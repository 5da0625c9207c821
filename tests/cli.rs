//! The command line as a user meets it: every argument explained, the commands under their
//! headings, completions that know the spec's stages, the man page, `mflow explain`, and output
//! that survives a reader that goes away.

mod common;

use common::{code, stderr, stdout, Project};

#[test]
fn every_argument_of_every_command_has_help_text() {
    fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                missing.push(format!("{path} <{id}>"));
            }
        }
        for sub in cmd.get_subcommands() {
            if sub.get_about().is_none() && sub.get_name() != "help" {
                missing.push(format!("{path} {} (no about)", sub.get_name()));
            }
            walk(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }
    let mut missing = Vec::new();
    walk(&mflow::cli::args::command(), "mflow", &mut missing);
    assert!(missing.is_empty(), "arguments without help text:\n{}", missing.join("\n"));
}

#[test]
fn every_command_is_under_one_heading() {
    let cmd = mflow::cli::args::command();
    let listed: Vec<&str> = mflow::cli::args::GROUPS.iter().flat_map(|(_, names)| names.iter().copied()).collect();
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let n = listed.iter().filter(|l| **l == sub.get_name()).count();
        assert_eq!(n, 1, "`{}` is under {n} headings", sub.get_name());
    }
    let p = Project::new("");
    let help = stdout(&p.mflow(&["--help"]));
    for (heading, _) in mflow::cli::args::GROUPS {
        assert!(help.contains(&format!("{heading} commands:")), "{help}");
    }
    assert!(help.contains("Examples:"), "{help}");
}

const THREE: &str = "[pipeline]\nname = \"x\"\n[stages.train]\nkind = \"command\"\nrun = [\"true\"]\n[stages.tokenize]\nkind = \"command\"\nrun = [\"true\"]\n[stages.other]\nkind = \"command\"\nrun = [\"true\"]\n";

#[test]
fn completions_know_the_stages_of_the_spec_on_the_line() {
    let p = Project::new(THREE);
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let o = p.mflow(&["completions", shell]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        assert!(stdout(&o).contains("mflow"), "{shell}: {}", stdout(&o));
    }
    // What the registered script asks of mflow when a stage name is completed (fish's protocol).
    for args in [&["run", "spec.toml", "t"][..], &["why", "spec.toml", "t"], &["run", "spec.toml", "--force", "t"]] {
        let mut full = vec!["--", "mflow"];
        full.extend_from_slice(args);
        let o = p.cmd(&full).env("COMPLETE", "fish").output().unwrap();
        let mut names: Vec<String> = stdout(&o).lines().map(|l| l.split('\t').next().unwrap().to_string()).collect();
        names.sort();
        assert_eq!(names, ["tokenize", "train"], "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn the_man_page_renders() {
    let p = Project::new("");
    let o = p.mflow(&["man"]);
    assert_eq!(code(&o), 0);
    let page = stdout(&o);
    assert!(page.starts_with(".ie \\n(.g") || page.contains(".TH mflow"), "{}", &page[..page.len().min(200)]);
    assert!(page.contains("completions"));
}

#[test]
fn explain_prints_a_diagnostics_words_and_refuses_an_unknown_code() {
    let p = Project::new("");
    let o = p.mflow(&["explain", "mflow::plan::input_escapes"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("leaves the project directory"), "{}", stdout(&o));
    let short = p.mflow(&["explain", "plan::input_escapes"]);
    assert_eq!(stdout(&short), stdout(&o));
    let o = p.mflow(&["explain", "plan::input_escape"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("mflow::plan::input_escapes"), "a near code is suggested: {}", stderr(&o));
}

/// A reader that stops reading (`| head -1`) ends a command quietly with its own exit code.
#[test]
fn a_closed_pipe_is_a_clean_end() {
    let p = Project::new(THREE);
    let bin = env!("CARGO_BIN_EXE_mflow");
    for cmd in ["plan spec.toml --output-format json", "plan spec.toml", "schema", "man", "exit-codes"] {
        let o = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("'{bin}' {cmd} | head -c 1 >/dev/null; echo \"exit=${{PIPESTATUS[0]}}\""))
            .current_dir(p.path())
            .output()
            .unwrap();
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{cmd}: {err}");
        assert!(!err.contains("Broken pipe"), "{cmd}: {err}");
        assert_eq!(stdout(&o).trim(), "exit=0", "{cmd}: {err}");
    }
}

/// `--jobs 0` would run nothing and wait forever: refused as `[pipeline] jobs = 0` is.
#[test]
fn jobs_of_zero_is_a_usage_error() {
    let p = Project::new("[pipeline]\nname = \"j\"\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n");
    for jobs in ["0", "-1", "99999"] {
        let o = p.mflow(&["run", "spec.toml", "--jobs", jobs]);
        assert_eq!(code(&o), 2, "{jobs}: {}", stderr(&o));
        assert!(stderr(&o).contains("--jobs") || stderr(&o).contains("unexpected argument"), "{}", stderr(&o));
    }
    assert_eq!(code(&p.mflow(&["run", "spec.toml", "-j", "1"])), 0);
}

/// The standalone tools take a bad flag value as any command does (exit 2), and a failure of
/// the work itself as a stage's (exit 1).
#[test]
fn a_tools_bad_flag_value_exits_2_and_its_failed_work_exits_1() {
    let p = Project::new("[pipeline]\nname = \"t\"\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n");
    std::fs::write(p.file("c.jsonl"), "{\"text\": \"hello\"}\n").unwrap();
    assert_eq!(code(&p.mflow(&["model", "init:llama-tiny", "m"])), 0);
    for args in [
        &["model", "init:nope", "x"][..],
        &["convert", "m", "s", "--pp", "3"],
        &["convert", "m", "s", "--dtype", "int8"],
        &["dataset", "c.jsonl", "--tokenizer", "byte-level", "--out", "d", "--splits", "0,0,0"],
        &["dataset", "c.jsonl", "--tokenizer", "m", "--out", "d", "--eod", "<no such token>"],
        &["dataset", "c.jsonl", "--tokenizer", "byte-level", "--out", "d", "--text-key", ""],
        &["dataset", "c.jsonl", "--tokenizer", "byte-level", "--out", "d", "--split-by", "line"],
    ] {
        let o = p.mflow(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(!p.file("x").exists() && !p.file("s").exists() && !p.file("d").exists(), "{args:?}");
    }
    // A corpus line that is not JSON is the work's failure, not the command line's.
    std::fs::write(p.file("c.jsonl"), "{not json\n").unwrap();
    let o = p.mflow(&["dataset", "c.jsonl", "--tokenizer", "byte-level", "--out", "d"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
}
