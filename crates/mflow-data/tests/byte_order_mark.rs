//! A UTF-8 byte order mark at the start of a file, as some editors write it, is no part of the
//! file's text (Python's utf-8-sig reads it so): JSONL parses, and text does not begin with it.
//! One further on is left where it is.

mod common;

use std::io::Write;
use std::path::Path;
use std::sync::{atomic::AtomicU64, Arc};

use common::*;
use mflow_data::input::{DocReader, FileFormat, InputError, InputFile, ReaderOptions};
use mflow_data::options::{InvalidUtf8, SplitBy};

const BOM: &str = "\u{feff}";

/// The texts of the documents of `path`, read as `format` and cut by `split_by`.
fn texts(path: &Path, format: FileFormat, split_by: SplitBy) -> Result<Vec<String>, InputError> {
    let bytes = std::fs::metadata(path).unwrap().len();
    let file = InputFile { path: path.to_path_buf(), format, bytes };
    let opts =
        ReaderOptions { split_by, text_key: "text".into(), on_invalid_utf8: InvalidUtf8::Fail, max_doc_bytes: 1 << 20 };
    let mut reader = DocReader::new(vec![file], opts, Arc::new(AtomicU64::new(0)));
    let mut texts = Vec::new();
    while let Some(doc) = reader.next_doc()? {
        texts.push(doc.text);
    }
    Ok(texts)
}

fn gzip(text: &str) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(text.as_bytes()).unwrap();
    gz.finish().unwrap()
}

#[test]
fn a_byte_order_mark_at_the_start_of_a_text_file_is_not_in_its_first_document() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!("{BOM}first line\nsecond line\n\n{BOM}third, its mark kept\n");
    let (plain, gz) = (tmp.path().join("a.txt"), tmp.path().join("a.txt.gz"));
    std::fs::write(&plain, &text).unwrap();
    std::fs::write(&gz, gzip(&text)).unwrap();
    for path in [&plain, &gz] {
        let by = |split_by| texts(path, FileFormat::Text, split_by).unwrap();
        assert_eq!(by(SplitBy::File), [&text[BOM.len()..]], "{}", path.display());
        assert_eq!(by(SplitBy::Line), ["first line", "second line", &format!("{BOM}third, its mark kept")]);
        assert_eq!(by(SplitBy::BlankLine), ["first line\nsecond line", &format!("{BOM}third, its mark kept")]);
    }
    // A file that is only a mark, or shorter than one, is read as it is.
    std::fs::write(&plain, BOM).unwrap();
    assert!(texts(&plain, FileFormat::Text, SplitBy::File).unwrap().is_empty());
    std::fs::write(&plain, "é").unwrap();
    assert_eq!(texts(&plain, FileFormat::Text, SplitBy::File).unwrap(), ["é"]);
}

#[test]
fn a_jsonl_file_that_starts_with_a_byte_order_mark_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let lines = format!("{BOM}{{\"text\": \"one\"}}\n{{\"text\": \"two\"}}\n");
    let (plain, gz) = (tmp.path().join("a.jsonl"), tmp.path().join("a.jsonl.gz"));
    std::fs::write(&plain, &lines).unwrap();
    std::fs::write(&gz, gzip(&lines)).unwrap();
    for path in [&plain, &gz] {
        assert_eq!(texts(path, FileFormat::Jsonl, SplitBy::File).unwrap(), ["one", "two"], "{}", path.display());
    }
    let out = tmp.path().join("ds");
    let s = run(&[plain.to_str().unwrap(), "--tokenizer", "byte-level", "--out", out.to_str().unwrap()]).unwrap();
    assert_eq!(s.stats.documents, 2);

    // Only at the start of the file: on another line it is what it is, not JSON.
    std::fs::write(&plain, format!("{{\"text\": \"one\"}}\n{BOM}{{\"text\": \"two\"}}\n")).unwrap();
    let err = texts(&plain, FileFormat::Jsonl, SplitBy::File).unwrap_err();
    assert!(matches!(err, InputError::MalformedJson { line: 2, .. }), "{err}");
}
