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
