//! Output bytes do not depend on the thread count, and compressed inputs give the same dataset.

mod common;

use std::io::Write;
use std::path::Path;

use common::*;

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// Several batches' worth of documents of varied length.
fn big_corpus(dir: &Path) -> String {
    let licence = std::fs::read_to_string(fixture("corpus/apache-2.0.txt")).unwrap();
    let words: Vec<&str> = licence.split_whitespace().collect();
    let path = dir.join("big.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    for i in 0..6000usize {
        let start = (i * 37) % words.len();
        let len = 1 + (i * 7919) % 400;
        let text: Vec<&str> = words.iter().cycle().skip(start).take(len).copied().collect();
        writeln!(f, "{}", serde_json::json!({ "text": format!("{i}: {}", text.join(" ")) })).unwrap();
    }
    path.to_string_lossy().to_string()
}

#[test]
fn same_bytes_with_one_and_two_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = big_corpus(tmp.path());
    let mut outputs = Vec::new();
    for threads in ["1", "2", "3"] {
        let out = tmp.path().join(format!("ds{threads}"));
        let s = run(&[
            &corpus,
            "--tokenizer",
            "tests/fixtures/tokenizer",
            "--out",
            out.to_str().unwrap(),
            "--threads",
            threads,
        ])
        .unwrap();
        assert_eq!(s.stats.documents, 6000);
        outputs.push(files(&out));
    }
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[0], outputs[2]);
    let names: Vec<&str> = outputs[0].iter().map(|(n, _)| n.as_str()).collect();
    insta::assert_snapshot!(names.join("\n"));
}

#[test]
fn gzip_and_zstd_inputs_match_plain() {
    let tmp = tempfile::tempdir().unwrap();
    let (jsonl, text) = (fixture("corpus/docs.jsonl"), fixture("corpus/notes.txt"));
    let gz = tmp.path().join("docs.jsonl.gz");
    let mut enc = flate2::write::GzEncoder::new(std::fs::File::create(&gz).unwrap(), flate2::Compression::default());
    enc.write_all(&std::fs::read(&jsonl).unwrap()).unwrap();
    enc.finish().unwrap();
    let zst = tmp.path().join("notes.txt.zst");
    std::fs::write(&zst, zstd::encode_all(&std::fs::read(&text).unwrap()[..], 3).unwrap()).unwrap();

    let plain = tmp.path().join("plain");
    run(&[&jsonl, &text, "--tokenizer", "tests/fixtures/tokenizer", "--out", plain.to_str().unwrap()]).unwrap();
    let packed = tmp.path().join("packed");
    run(&[
        gz.to_str().unwrap(),
        zst.to_str().unwrap(),
        "--tokenizer",
        "tests/fixtures/tokenizer",
        "--out",
        packed.to_str().unwrap(),
    ])
    .unwrap();
    let strip = |v: Vec<(String, Vec<u8>)>| v.into_iter().filter(|(n, _)| n != "stats.json").collect::<Vec<_>>();
    assert_eq!(strip(files(&plain)), strip(files(&packed)));
}

#[test]
fn fills_an_empty_prepared_output_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("prepared");
    std::fs::create_dir(&out).unwrap();
    run(&["tests/fixtures/corpus/notes.txt", "--tokenizer", "byte-level", "--out", out.to_str().unwrap()]).unwrap();
    assert!(out.join("train.idx").is_file());
    assert_no_output(&tmp.path().join("absent"));
}
