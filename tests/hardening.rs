//! What a spec or a stage can slip past the engine: input links that leave the project, output
//! names that are not text, and files written beside the output in the staging area.

mod common;

use std::os::unix::fs::symlink;

use common::{code, stderr, Project};

fn reading(inputs: &str) -> String {
    format!("[pipeline]\nname = \"x\"\n\n[stages.a]\nkind = \"command\"\ninputs = {inputs}\nrun = [\"sh\", \"-c\", \"echo ok > $MFLOW_OUTPUT/out\"]\n")
}

#[test]
fn an_input_linked_outside_the_project_is_refused_naming_the_link() {
    let p = Project::new(&reading(r#"["data/x.txt"]"#));
    std::fs::create_dir(p.file("data")).unwrap();
    symlink("/etc/passwd", p.file("data/x.txt")).unwrap();
    let o = p.run(&[]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "{err}");
    for want in ["mflow::plan::input_link_escapes", "data/x.txt", "/etc/passwd", "copy the file into the project"] {
        assert!(err.contains(want), "no {want:?} in: {err}");
    }
    assert!(!p.file(".mflow/runs").exists(), "a run started");
}

#[test]
fn links_in_a_walked_directory_input_must_stay_in_the_project() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "s").unwrap();
    let p = Project::new(&reading(r#"["data"]"#));
    std::fs::create_dir_all(p.file("data/sub")).unwrap();
    std::fs::write(p.file("other.txt"), "o").unwrap();
    // A link that stays inside the project is fine.
    symlink("../../other.txt", p.file("data/sub/ok")).unwrap();
    let o = p.mflow(&["plan", "spec.toml"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));

    symlink(outside.path().join("secret"), p.file("data/sub/leak")).unwrap();
    let o = p.mflow(&["plan", "spec.toml"]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("mflow::plan::input_link_escapes") && err.contains("data/sub/leak"), "{err}");

    // So does a directory link on the way to a named file.
    std::fs::remove_file(p.file("data/sub/leak")).unwrap();
    symlink(outside.path(), p.file("far")).unwrap();
    p.write_spec(&reading(r#"["far/secret"]"#));
    let o = p.mflow(&["plan", "spec.toml"]);
    let err = stderr(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("input `far` is a symbolic link to"), "{err}");
}

#[test]
fn an_absolute_input_outside_the_project_stays_allowed() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir(outside.path().join("d")).unwrap();
    std::fs::write(outside.path().join("d/f"), "f").unwrap();
    std::fs::write(outside.path().join("g"), "g").unwrap();
    symlink("f", outside.path().join("d/link")).unwrap();
    let p = Project::new(&reading(&format!("[\"{}\"]", outside.path().join("d").display())));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // A link in it still may not lead elsewhere: that was not written explicitly.
    symlink("../g", outside.path().join("d/away")).unwrap();
    let o = p.mflow(&["plan", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("d/away"), "{}", stderr(&o));
}

#[test]
fn an_output_name_not_in_utf8_fails_the_stage_saying_so() {
    let spec = "[pipeline]\nname = \"x\"\n\n[stages.names]\nkind = \"command\"\nretries = { max = 2, backoff = \"10ms\", on = [\"infra\"] }\n\
                run = [\"sh\", \"-c\", 'printf x > \"$MFLOW_OUTPUT/$(printf \"a\\377b\")\"']\n";
    let p = Project::new(spec);
    let o = p.run(&[]);
    let err = stderr(&o);
    assert_eq!(code(&o), 1, "{err}");
    let rec = p.latest_record();
    let stage = &rec["stages"]["names"];
    assert_eq!(stage["attempts"].as_array().unwrap().len(), 1, "retried as infra: {rec:#}");
    let message = stage["message"].as_str().unwrap();
    assert_eq!(stage["class"], "user", "{rec:#}");
    assert!(message.starts_with("stage output file name \"a\\xFFb\" is not valid UTF-8"), "{message}");
    assert!(err.contains("names") && err.contains("not valid UTF-8"), "{err}");
    assert!(p.file(".mflow/cache/.staging").read_dir().unwrap().next().is_none(), "staging left behind");
}

#[test]
fn files_written_beside_the_output_do_not_stay_in_staging() {
    let spec = "[pipeline]\nname = \"x\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo j > $MFLOW_OUTPUT/../junk && echo ok > $MFLOW_OUTPUT/out\"]\n\n\
                [stages.b]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo j > $MFLOW_OUTPUT/../junk; exit 1\"]\n";
    let p = Project::new(spec);
    let staging = p.file(".mflow/cache/.staging");
    let left = || std::fs::read_dir(&staging).unwrap().map(|e| e.unwrap().file_name()).collect::<Vec<_>>();
    let o = p.run(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_eq!(left(), Vec::<std::ffi::OsString>::new(), "after success and failure");

    // Leftovers of runs that are over: a killed attempt's directory, and a stray name.
    std::fs::create_dir_all(staging.join(format!("{}.dead/out", "ab".repeat(32)))).unwrap();
    std::fs::write(staging.join("stray"), "s").unwrap();
    let o = p.run(&[]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_eq!(left(), Vec::<std::ffi::OsString>::new(), "a later run clears them");

    std::fs::write(staging.join("stray"), "s").unwrap();
    let o = p.mflow(&["gc", "--workdir", ".mflow"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(left(), Vec::<std::ffi::OsString>::new(), "gc clears them");
}
