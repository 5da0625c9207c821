//! Bad input stops with a clear diagnostic that names the file, line, key or token, and leaves
//! no output behind. The messages are snapshotted.

mod common;

use common::*;
use mflow_data::Options;

const TOK: &str = "tests/fixtures/tokenizer";

/// Runs a build expected to fail; returns the rendered error with the temp dir masked.
fn fails(inputs: &[&str], extra: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let mut argv: Vec<&str> = inputs.to_vec();
    let out_s = out.to_str().unwrap().to_string();
    argv.extend(["--out", &out_s]);
    if !extra.contains(&"--tokenizer") {
        argv.extend(["--tokenizer", TOK]);
    }
    argv.extend(extra);
    let err = run(&argv).expect_err("the build must fail");
    assert_no_output(&out);
    render(&err).replace(tmp.path().to_str().unwrap(), "$TMP")
}

#[test]
fn malformed_json_names_file_and_line() {
    insta::assert_snapshot!(fails(&["tests/fixtures/bad/malformed.jsonl"], &[]));
}

#[test]
fn missing_text_key_lists_the_fields() {
    insta::assert_snapshot!(fails(&["tests/fixtures/bad/missing_key.jsonl"], &[]));
}

#[test]
fn text_that_is_not_a_string() {
    insta::assert_snapshot!(fails(&["tests/fixtures/bad/not_string.jsonl"], &[]));
}

#[test]
fn json_line_that_is_not_an_object() {
    insta::assert_snapshot!(fails(&["tests/fixtures/bad/not_object.jsonl"], &[]));
}

#[test]
fn invalid_utf8_fails_when_asked() {
    insta::assert_snapshot!(
        "text",
        fails(&["tests/fixtures/bad/invalid_utf8.txt"], &["--split-by", "line", "--on-invalid-utf8", "fail"])
    );
    insta::assert_snapshot!("jsonl", fails(&["tests/fixtures/bad/invalid_utf8.jsonl"], &["--on-invalid-utf8", "fail"]));
}

#[test]
fn invalid_utf8_is_skipped_and_counted_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let s = run(&[
        "tests/fixtures/bad/invalid_utf8.txt",
        "tests/fixtures/bad/invalid_utf8.jsonl",
        "--tokenizer",
        TOK,
        "--out",
        out.to_str().unwrap(),
        "--split-by",
        "line",
    ])
    .unwrap();
    assert_eq!((s.stats.documents, s.stats.skipped.invalid_utf8), (3, 2));
    let stats: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("stats.json")).unwrap()).unwrap();
    assert_eq!(stats["skipped"]["invalid_utf8"], 2);
}

/// A lone UTF-16 surrogate escape (`\ud800`) has no UTF-8 form: the document is not valid
/// text, as one with invalid UTF-8 bytes is not. A pair, or one in a field not read, is fine.
#[test]
fn a_lone_surrogate_escape_is_invalid_utf8_skipped_and_counted_or_refused_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let input = "tests/fixtures/bad/lone_surrogate.jsonl";
    let s = run(&[input, "--tokenizer", "byte-level", "--out", out.to_str().unwrap()]).unwrap();
    assert_eq!((s.stats.documents, s.stats.skipped.invalid_utf8), (3, 3));
    insta::assert_snapshot!(fails(&[input], &["--on-invalid-utf8", "fail"]));
}

/// With `--format auto`, inputs that are all JSONL by their names refuse an explicit
/// `--split-by` as `--format jsonl` does, rather than ignoring it. `file` (the default) is what
/// JSONL does, and beside a text file the flag cuts that file.
#[test]
fn split_by_where_every_input_is_jsonl_by_its_name_is_refused_naming_one() {
    let jsonl = "tests/fixtures/corpus/docs.jsonl";
    insta::assert_snapshot!(fails(&[jsonl, "tests/fixtures/bad/empty.jsonl"], &["--split-by", "line"]));
    for (inputs, split_by) in [(&[jsonl][..], "file"), (&[jsonl, "tests/fixtures/corpus/notes.txt"], "blank-line")] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ds");
        let mut argv = inputs.to_vec();
        argv.extend(["--tokenizer", TOK, "--out", out.to_str().unwrap(), "--split-by", split_by]);
        run(&argv).unwrap();
    }
}

#[test]
fn empty_corpus() {
    insta::assert_snapshot!(fails(&["tests/fixtures/bad/empty.jsonl"], &[]));
}

#[test]
fn glob_without_matches_and_missing_file() {
    insta::assert_snapshot!("glob", fails(&["tests/fixtures/nothing-here/*.jsonl"], &[]));
    insta::assert_snapshot!("missing", fails(&["tests/fixtures/absent.jsonl"], &[]));
    insta::assert_snapshot!("directory", fails(&["tests/fixtures/corpus"], &[]));
}

#[test]
fn vocabulary_too_large_for_uint16() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("big-vocab.json");
    word_level_tokenizer(&tok, 70_000, &["<|endoftext|>"]);
    let msg = fails(&["tests/fixtures/corpus/notes.txt"], &["--tokenizer", tok.to_str().unwrap(), "--dtype", "uint16"]);
    insta::assert_snapshot!(msg.replace(tmp.path().to_str().unwrap(), "$TMP"));
}

#[test]
fn end_of_document_token_problems() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("no-eos.json");
    word_level_tokenizer(&tok, 10, &["<pad>"]);
    let msg = fails(&["tests/fixtures/corpus/notes.txt"], &["--tokenizer", tok.to_str().unwrap()]);
    insta::assert_snapshot!("none", msg.replace(tmp.path().to_str().unwrap(), "$TMP"));
    insta::assert_snapshot!("unknown", fails(&["tests/fixtures/corpus/notes.txt"], &["--eod", "<|nope|>"]));
}

#[test]
fn bad_tokenizer_paths() {
    insta::assert_snapshot!(
        "not_a_tokenizer",
        fails(&["tests/fixtures/corpus/notes.txt"], &["--tokenizer", "tests/fixtures/corpus"])
    );
    insta::assert_snapshot!(
        "not_json",
        fails(&["tests/fixtures/corpus/notes.txt"], &["--tokenizer", "tests/fixtures/corpus/notes.txt"])
    );
}

#[test]
fn document_larger_than_the_limit() {
    insta::assert_snapshot!(fails(&["tests/fixtures/corpus/notes.txt"], &["--max-doc-bytes", "100"]));
}

#[test]
fn output_that_already_holds_files() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("keep.txt"), "x").unwrap();
    let err = run(&["tests/fixtures/corpus/notes.txt", "--tokenizer", TOK, "--out", tmp.path().to_str().unwrap()])
        .unwrap_err();
    insta::assert_snapshot!(render(&err).replace(tmp.path().to_str().unwrap(), "$TMP"));
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1, "nothing was added");
}

/// An output named by a link, even to an empty directory, is not written through it.
#[test]
fn output_that_is_a_link_is_refused_saying_so() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let link = tmp.path().join("ds");
    std::os::unix::fs::symlink(&empty, &link).unwrap();
    let err =
        run(&["tests/fixtures/corpus/notes.txt", "--tokenizer", TOK, "--out", link.to_str().unwrap()]).unwrap_err();
    insta::assert_snapshot!(render(&err).replace(tmp.path().to_str().unwrap(), "$TMP"));
    assert!(link.symlink_metadata().unwrap().file_type().is_symlink(), "the link stays");
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0, "nothing went through it");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2, "no staging is left");
}

#[test]
fn plan_time_option_checks() {
    let cases = [
        vec!["a.txt", "--tokenizer", TOK, "--out", "o", "--splits", "98,2"],
        vec!["a.txt", "--tokenizer", TOK, "--out", "o", "--splits", "0,0,0"],
        vec!["a.txt", "--tokenizer", TOK, "--out", "o", "--max-doc-tokens", "0"],
        vec!["a.txt", "--tokenizer", "byte-level", "--out", "o", "--eod", "</s>"],
        vec!["a.jsonl", "--tokenizer", TOK, "--out", "o", "--format", "jsonl", "--split-by", "line"],
        vec!["--tokenizer", TOK, "--out", "o"],
    ];
    let rendered: Vec<String> =
        cases.iter().map(|argv| render(&Options::from_args(&args(argv)).expect_err("invalid options"))).collect();
    insta::assert_snapshot!(rendered.join("\n\n"));
}

#[test]
fn nothing_for_the_train_split() {
    insta::assert_snapshot!(fails(&["tests/fixtures/corpus/docs.jsonl"], &["--splits", "0,1,0"]));
}

/// A file named twice (by a glob and by its path, through `./` or a link) is read once: its
/// documents must not land in train and in valid or test as well.
#[test]
fn a_file_named_twice_is_read_once() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let lines: String = (0..50).map(|i| format!("{{\"text\": \"document {i}\"}}\n")).collect();
    std::fs::write(data.join("a.jsonl"), &lines).unwrap();
    std::os::unix::fs::symlink("a.jsonl", data.join("link.jsonl")).unwrap();
    let dir = data.display();
    let named = [format!("{dir}/*.jsonl"), format!("{dir}/./a.jsonl"), format!("{dir}/a.jsonl")];
    let out = tmp.path().join("ds");
    let mut argv: Vec<&str> = named.iter().map(String::as_str).collect();
    argv.extend(["--tokenizer", "byte-level", "--out", out.to_str().unwrap()]);
    run(&argv).unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("dataset.json")).unwrap()).unwrap();
    let docs: u64 = ["train", "valid", "test"].iter().filter_map(|s| stats["splits"][s]["documents"].as_u64()).sum();
    assert_eq!(docs, 50, "{stats}");
}
