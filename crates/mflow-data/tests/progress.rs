//! Tokenizing reports progress in input bytes that end at their total and never read above it,
//! compressed or not, and a file that grew after it was listed counts only what was listed.

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use mflow_data::input::{DocReader, FileFormat, InputFile, ReaderOptions};
use mflow_data::options::{InvalidUtf8, SplitBy};
use mflow_progress::Event;

#[test]
fn tokenize_progress_ends_at_its_total_and_never_reads_above_it() {
    let tmp = tempfile::tempdir().unwrap();
    let text: String = (0..4000).map(|i| format!("document {i} with a few words in it\n")).collect();
    std::fs::write(tmp.path().join("a.txt"), &text).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(text.as_bytes()).unwrap();
    std::fs::write(tmp.path().join("b.txt.gz"), gz.finish().unwrap()).unwrap();
    let path = tmp.path().join("progress.jsonl");
    // The only test in this binary that sets it.
    std::env::set_var(mflow_progress::ENV, &path);
    let pattern = format!("{}/*", tmp.path().display());
    let out = tmp.path().join("out");
    run(&[&pattern, "--tokenizer", "byte-level", "--split-by", "line", "--out", out.to_str().unwrap()]).unwrap();
    std::env::remove_var(mflow_progress::ENV);
    let total = std::fs::metadata(tmp.path().join("a.txt")).unwrap().len()
        + std::fs::metadata(tmp.path().join("b.txt.gz")).unwrap().len();
    let events: Vec<Event> = std::fs::read_to_string(&path).unwrap().lines().filter_map(Event::parse).collect();
    assert!(events.iter().all(|e| e.label == "tokenize" && e.total == Some(total)), "{events:?}");
    assert!(events.iter().all(|e| e.done <= total), "{events:?}");
    assert_eq!(events.last().unwrap().done, total, "{events:?}");
}

#[test]
fn a_file_that_grew_after_it_was_listed_counts_only_its_listed_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("a.txt");
    std::fs::write(&path, "one\ntwo\nthree\nfour\n").unwrap();
    // Listed at 8 bytes; 19 are there when it is read.
    let file = InputFile { path, format: FileFormat::Text, bytes: 8 };
    let opts = ReaderOptions {
        split_by: SplitBy::Line,
        text_key: "text".into(),
        on_invalid_utf8: InvalidUtf8::Fail,
        max_doc_bytes: 1 << 20,
    };
    let counted = Arc::new(AtomicU64::new(0));
    let mut reader = DocReader::new(vec![file], opts, counted.clone());
    let mut docs = 0;
    while reader.next_doc().unwrap().is_some() {
        docs += 1;
    }
    assert_eq!((docs, counted.load(Ordering::Relaxed)), (4, 8));
}
