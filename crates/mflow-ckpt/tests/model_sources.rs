//! `mflow model` sources other than the Hub: `init:PRESET` and `path:DIR`.

use mflow_ckpt::cli::{model, ModelArgs};
use mflow_ckpt::{preset_names, preset_shape, read_shape};

fn args(source: String, dst: &std::path::Path) -> ModelArgs {
    ModelArgs { source, dst: dst.to_path_buf(), seed: 0 }
}

#[test]
fn init_then_path_copies_a_valid_model_and_skips_pickles() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    model(&args("init:qwen2-tiny".into(), &a)).unwrap();
    assert_eq!(read_shape(&a).unwrap(), preset_shape("qwen2-tiny").unwrap());
    std::fs::write(a.join("pytorch_model.bin"), b"pickle").unwrap();
    std::fs::write(a.join("notes.txt"), b"not a model file").unwrap();
    let b = tmp.path().join("b");
    model(&args(format!("path:{}", a.display()), &b)).unwrap();
    let mut names: Vec<String> =
        std::fs::read_dir(&b).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    insta::assert_snapshot!(names.join("\n"));
    assert_eq!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap()
    );
}

#[test]
fn path_with_only_pickles_and_unknown_sources_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    model(&args("init:gpt2-tiny".into(), &a)).unwrap();
    std::fs::remove_file(a.join("model.safetensors")).unwrap();
    std::fs::write(a.join("pytorch_model.bin"), b"pickle").unwrap();
    let b = tmp.path().join("b");
    let err = model(&args(format!("path:{}", a.display()), &b)).unwrap_err();
    assert!(format!("{err:?}").contains("pickle"), "{err:?}");
    assert!(!b.exists());
    let err = model(&args("init:llama-70b".into(), &b)).unwrap_err();
    assert!(err.to_string().contains("init:llama-70b"));
    assert_eq!(preset_names(), ["llama-tiny", "llama-1b", "qwen2-tiny", "gpt2-tiny"]);
}

/// A source directory that is not there is said to be missing (or not a directory), not taken
/// for a model directory without config.json; by model, convert and export alike.
#[test]
fn a_source_directory_that_is_not_there_is_said_to_be_so() {
    let tmp = tempfile::tempdir().unwrap();
    let (nope, file) = (tmp.path().join("nope"), tmp.path().join("file"));
    std::fs::write(&file, b"not a directory").unwrap();
    let out = tmp.path().join("out");
    for (src, problem) in
        [(&nope, "does not exist"), (&file, "is not a directory"), (&file.join("sub"), "does not exist")]
    {
        let errs: [Box<dyn miette::Diagnostic>; 3] = [
            model(&args(format!("path:{}", src.display()), &out)).unwrap_err().into(),
            Box::new(mflow_ckpt::convert::convert(src, &out, 1, 1, None).unwrap_err()),
            Box::new(mflow_ckpt::convert::export(src, &out).unwrap_err()),
        ];
        for err in errs {
            assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::source_dir");
            assert_eq!(err.to_string(), format!("model directory {} {problem}", src.display()));
            assert!(err.help().is_some());
        }
    }
    assert!(!out.exists());
}

/// An error that wraps a system call's error does not say its cause twice: once in its own
/// message and again as the cause that miette shows under it.
#[test]
fn the_cause_of_an_io_error_is_said_once() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    model(&args("init:llama-tiny".into(), &a)).unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(tmp.path().join("file"), b"").unwrap();
    let reports = [
        // A file that is not there (mflow::ckpt::file::open).
        model(&args(format!("path:{}", empty.display()), &tmp.path().join("b"))).unwrap_err(),
        // A destination below a file (mflow::ckpt::io).
        model(&args(format!("path:{}", a.display()), &tmp.path().join("file/b"))).unwrap_err(),
    ];
    for report in reports {
        let chain: Vec<String> = report.chain().map(|e| e.to_string()).collect();
        assert_eq!(chain.len(), 2, "{chain:?}");
        assert!(!chain[0].contains(&chain[1]), "{chain:?}");
    }
}
