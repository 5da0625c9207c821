//! Bad checkpoints get a clear error naming the file and tensor, and leave nothing behind.

use std::path::Path;
use std::sync::OnceLock;

use mflow_ckpt::convert::{convert, export};
use mflow_ckpt::{check_parallelism, presets, CkptError};
use miette::Diagnostic;
use serde_json::Value;

/// A llama-tiny preset written once and copied per test.
fn pristine() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        presets::write(&presets::preset("llama-tiny").unwrap(), &d.path().join("hf"), 0).unwrap();
        d
    })
    .path()
}

/// A fresh copy of the preset in a new temp dir; returns (tempdir, model dir).
fn model() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(pristine().join("hf")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    (tmp, dir)
}

fn render(err: &CkptError, tmp: &Path) -> String {
    let code = err.code().map(|c| c.to_string()).unwrap_or_default();
    let help = err.help().map(|h| h.to_string()).unwrap_or_default();
    format!("{code}\n{err}\nhelp: {help}").replace(&tmp.display().to_string(), "[TMP]")
}

/// Converts and expects failure; checks that no output or staging directory is left.
fn convert_fails(tmp: &Path, src: &Path, tp: u32, pp: u32) -> String {
    let dst = tmp.join("out");
    let err = convert(src, &dst, tp, pp, None).expect_err("conversion must fail");
    assert!(!dst.exists(), "output directory left behind");
    let leftovers: Vec<_> = std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("staging"))
        .collect();
    assert!(leftovers.is_empty(), "staging left behind: {leftovers:?}");
    render(&err, tmp)
}

/// Rewrites the header of model.safetensors through `edit`, keeping the data bytes.
fn edit_header(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut json = serde_json::to_vec(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Map<String, Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn truncated_safetensors() {
    let (tmp, dir) = model();
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 2, 1));
}

#[test]
fn header_length_past_end_of_file() {
    let (tmp, dir) = model();
    let mut bytes = 5_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(br#"{"a":1}"#);
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn overlapping_data_offsets() {
    let (tmp, dir) = model();
    edit_header(&dir, |h| {
        let first = h["model.layers.0.input_layernorm.weight"]["data_offsets"].clone();
        h["model.layers.1.input_layernorm.weight"]["data_offsets"] = first;
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn data_offsets_out_of_range() {
    let (tmp, dir) = model();
    edit_header(&dir, |h| {
        let (name, end) = h
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.get("data_offsets")?[1].as_u64()?)))
            .max_by_key(|(_, e)| *e)
            .unwrap();
        h[&name]["data_offsets"][1] = Value::from(end + 4096);
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn dtype_mismatch() {
    let (tmp, dir) = model();
    edit_header(&dir, |h| {
        let t = &mut h["model.layers.2.post_attention_layernorm.weight"];
        t["dtype"] = "BF16".into();
        t["shape"] = serde_json::json!([512]);
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn missing_tensor() {
    let (tmp, dir) = model();
    edit_config(&dir, |c| {
        c.insert("tie_word_embeddings".into(), false.into());
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn unexpected_tensor() {
    let (tmp, dir) = model();
    edit_header(&dir, |h| {
        let v = h.remove("model.layers.3.mlp.up_proj.weight").unwrap();
        h.insert("model.layers.3.mlp.extra_proj.weight".into(), v);
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn config_and_shape_disagree() {
    let (tmp, dir) = model();
    edit_config(&dir, |c| {
        c.insert("intermediate_size".into(), 700.into());
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn vocab_larger_than_embedding() {
    let (tmp, dir) = model();
    edit_config(&dir, |c| {
        c.insert("vocab_size".into(), 2000.into());
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn unsupported_architecture() {
    let (tmp, dir) = model();
    edit_config(&dir, |c| {
        c.insert("model_type".into(), "mixtral".into());
    });
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn tp_not_dividing_heads() {
    let (tmp, dir) = model();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 3, 1));
}

#[test]
fn tp_not_dividing_kv_groups() {
    let (tmp, dir) = model();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 8, 1));
}

#[test]
fn tp_not_dividing_ffn() {
    let mut shape = presets::shape("llama-tiny").unwrap();
    shape.ffn_hidden_size = 690;
    let err = check_parallelism(&shape, 4, 1).unwrap_err();
    insta::assert_snapshot!(render(&err, Path::new("/nonexistent")));
}

#[test]
fn pp_not_dividing_layers() {
    let (tmp, dir) = model();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 3));
}

#[test]
fn pickle_checkpoints_are_refused() {
    let (tmp, dir) = model();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("pytorch_model.bin"), b"PK\x03\x04 not opened").unwrap();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

#[test]
fn damaged_shards_are_refused_on_export() {
    let (tmp, dir) = model();
    let shards = tmp.path().join("shards");
    convert(&dir, &shards, 2, 1, None).unwrap();
    let f = shards.join("model_tp01_pp000.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&f, bytes).unwrap();
    let dst = tmp.path().join("back");
    let err = export(&shards, &dst).unwrap_err();
    assert!(!dst.exists());
    // The digests differ from run to run; keep the rest of the message.
    let hex = |w: &str| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit());
    let text: Vec<String> = render(&err, tmp.path())
        .lines()
        .map(|l| l.split(' ').map(|w| if hex(w) { "[BLAKE3]" } else { w }).collect::<Vec<_>>().join(" "))
        .collect();
    insta::assert_snapshot!(text.join("\n"));
}

#[test]
fn existing_destination_is_not_overwritten() {
    let (tmp, dir) = model();
    let dst = tmp.path().join("taken");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("keep.txt"), b"mine").unwrap();
    let err = convert(&dir, &dst, 1, 1, None).unwrap_err();
    assert_eq!(std::fs::read(dst.join("keep.txt")).unwrap(), b"mine");
    insta::assert_snapshot!(render(&err, tmp.path()));
}

/// A destination named by a link, even to an empty directory, is refused naming it, and
/// nothing is written through it: by convert, export and model alike.
#[test]
fn a_destination_that_is_a_link_is_refused_saying_so() {
    let (tmp, dir) = model();
    let shards = tmp.path().join("shards");
    convert(&dir, &shards, 1, 1, None).unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let model_args =
        |dst: &Path| mflow_ckpt::cli::ModelArgs { source: "init:llama-tiny".into(), dst: dst.into(), seed: 0 };
    for target in [empty.clone(), tmp.path().join("nowhere")] {
        let link = tmp.path().join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let errs: [Box<dyn Diagnostic>; 3] = [
            Box::new(convert(&dir, &link, 1, 1, None).unwrap_err()),
            Box::new(export(&shards, &link).unwrap_err()),
            mflow_ckpt::cli::model(&model_args(&link)).unwrap_err().into(),
        ];
        for err in errs {
            let code = err.code().map(|c| c.to_string()).unwrap_or_default();
            let text = format!("{code}\n{err}").replace(&tmp.path().display().to_string(), "[TMP]");
            assert_eq!(
                text,
                "mflow::ckpt::destination_link\n[TMP]/link: is a symbolic link; mflow does not write an output through a link"
            );
            assert!(err.help().is_some());
        }
        assert_eq!(std::fs::read_link(&link).unwrap(), target, "the link stays");
        assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0, "nothing went through it");
        assert!(!std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains("staging")));
    }
}

/// Rewrites model.safetensors of `dir` as `name`, with the tensors `extra` gives (new name, copy of).
fn write_weights(dir: &Path, name: &str, extra: &[(&str, &str)]) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    for (new, of) in extra {
        tensors.push((new.to_string(), st.tensor(of).unwrap()));
    }
    let out = safetensors::serialize(tensors, &None).unwrap();
    std::fs::write(dir.join(name), out).unwrap();
}

#[test]
fn a_tensor_in_two_files_of_a_sharded_model_is_refused_naming_both() {
    let (tmp, dir) = model();
    let names: Vec<String> = {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        safetensors::SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(String::from).collect()
    };
    // Both shards hold every tensor; the index names the second for one of them only.
    write_weights(&dir, "model-00001-of-00002.safetensors", &[]);
    write_weights(&dir, "model-00002-of-00002.safetensors", &[]);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    for (i, n) in names.iter().enumerate() {
        let file = if i == 0 { "model-00002-of-00002.safetensors" } else { "model-00001-of-00002.safetensors" };
        map.insert(n.clone(), Value::String(file.into()));
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let out = convert_fails(tmp.path(), &dir, 2, 1);
    assert!(out.starts_with("mflow::ckpt::ambiguous_tensor\n"), "{out}");
    assert!(out.contains("is held twice: in [TMP]/hf/model-00001-of-00002.safetensors and in [TMP]/hf/model-00002-of-00002.safetensors"), "{out}");
    assert!(out.contains("model.safetensors.index.json names model-0000"), "{out}");
}

#[test]
fn a_gpt2_tensor_under_both_spellings_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    presets::write(&presets::preset("gpt2-tiny").unwrap(), &dir, 0).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let full = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .find(|n| n.starts_with("transformer.h.0."))
        .unwrap()
        .to_string();
    let short = full.trim_start_matches("transformer.").to_string();
    write_weights(&dir, "model.safetensors.new", &[(&short, &full)]);
    std::fs::rename(dir.join("model.safetensors.new"), dir.join("model.safetensors")).unwrap();
    let out = convert_fails(tmp.path(), &dir, 1, 1);
    assert!(out.starts_with("mflow::ckpt::ambiguous_tensor\n"), "{out}");
    assert!(out.contains(&format!("tensor `{full}` is held twice")), "{out}");
    assert!(out.contains(&format!("(as `{short}`)")), "{out}");
}

/// Splits model.safetensors of `dir` into two shards, tensors `first` (renamed as given) in the
/// first and the rest in the second, with an index that says so; `index` may rewrite its map.
fn split_in_two(dir: &Path, first: &[(&str, &str)], index: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (a, b) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    let mut map = serde_json::Map::new();
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for (name, view) in st.tensors() {
        match first.iter().find(|(of, _)| *of == name) {
            Some((_, as_)) => {
                map.insert(as_.to_string(), Value::String(a.into()));
                one.push((as_.to_string(), view));
            }
            None => {
                map.insert(name.clone(), Value::String(b.into()));
                two.push((name, view));
            }
        }
    }
    index(&mut map);
    std::fs::write(dir.join(a), safetensors::serialize(one, &None).unwrap()).unwrap();
    std::fs::write(dir.join(b), safetensors::serialize(two, &None).unwrap()).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": map}).to_string();
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
}

/// transformers loads model.safetensors where an index is beside it: which one the user means
/// is not known, so neither is taken.
#[test]
fn a_single_weights_file_beside_an_index_is_refused() {
    let (tmp, dir) = model();
    let single = std::fs::read(dir.join("model.safetensors")).unwrap();
    split_in_two(&dir, &[("model.norm.weight", "model.norm.weight")], |_| {});
    std::fs::write(dir.join("model.safetensors"), single).unwrap();
    let out = convert_fails(tmp.path(), &dir, 1, 1);
    assert!(out.starts_with("mflow::ckpt::two_weights\n"), "{out}");
    assert!(out.contains("holds both model.safetensors and model.safetensors.index.json"), "{out}");
}

#[test]
fn a_tensor_found_in_another_file_than_the_index_names_is_refused_naming_both() {
    let (tmp, dir) = model();
    let (t, u) = ("model.layers.0.input_layernorm.weight", "model.norm.weight");
    split_in_two(&dir, &[(t, t), (u, u)], |map| {
        map.insert(t.into(), Value::String("model-00002-of-00002.safetensors".into()));
    });
    let out = convert_fails(tmp.path(), &dir, 1, 1);
    assert!(out.starts_with("mflow::ckpt::index_mismatch\n"), "{out}");
    assert!(
        out.contains(&format!(
            "[TMP]/hf/model.safetensors.index.json: `weight_map` names [TMP]/hf/model-00002-of-00002.safetensors for \
             tensor `{t}`, but it is in [TMP]/hf/model-00001-of-00002.safetensors"
        )),
        "{out}"
    );
}

#[test]
fn an_index_entry_for_a_tensor_no_file_holds_is_refused_naming_it() {
    let (tmp, dir) = model();
    let t = "model.layers.0.mlp.extra_proj.weight";
    split_in_two(&dir, &[("model.norm.weight", "model.norm.weight")], |map| {
        map.insert(t.into(), Value::String("model-00002-of-00002.safetensors".into()));
    });
    let out = convert_fails(tmp.path(), &dir, 1, 1);
    assert_eq!(
        out.lines().take(2).collect::<Vec<_>>(),
        [
            "mflow::ckpt::index_unheld_tensor",
            &format!(
                "[TMP]/hf/model.safetensors.index.json: `weight_map` names [TMP]/hf/model-00002-of-00002.safetensors \
                 for tensor `{t}`, but no weight file holds it"
            )
        ]
    );
}

#[test]
fn a_gpt2_tensor_under_both_spellings_in_two_shards_is_refused_naming_both_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    presets::write(&presets::preset("gpt2-tiny").unwrap(), &dir, 0).unwrap();
    let full = "transformer.h.0.ln_1.weight";
    // The first shard holds `h.0.ln_1.weight`, the second `transformer.h.0.ln_1.weight` as well.
    split_in_two(&dir, &[(full, "h.0.ln_1.weight")], |_| {});
    let b = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&b).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let copy = std::fs::read(dir.join("model-00001-of-00002.safetensors")).unwrap();
    let one = safetensors::SafeTensors::deserialize(&copy).unwrap();
    let mut tensors = st.tensors();
    tensors.push((full.into(), one.tensor("h.0.ln_1.weight").unwrap()));
    std::fs::write(&b, safetensors::serialize(tensors, &None).unwrap()).unwrap();
    let out = convert_fails(tmp.path(), &dir, 1, 1);
    assert!(out.starts_with("mflow::ckpt::ambiguous_tensor\n"), "{out}");
    assert!(
        out.contains(&format!(
            "tensor `{full}` is held twice: in [TMP]/hf/model-00001-of-00002.safetensors (as `h.0.ln_1.weight`) and in \
             [TMP]/hf/model-00002-of-00002.safetensors"
        )),
        "{out}"
    );
}

#[test]
fn a_rank_listed_twice_in_a_shards_manifest_is_refused() {
    let (tmp, dir) = model();
    let shards = tmp.path().join("shards");
    convert(&dir, &shards, 2, 1, None).unwrap();
    let path = shards.join("mflow-checkpoint.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let first = m["files"][0].clone();
    m["files"][1] = first;
    std::fs::write(&path, m.to_string()).unwrap();
    let err = export(&shards, &tmp.path().join("back")).unwrap_err();
    let out = render(&err, tmp.path());
    assert!(
        out.contains("mflow-checkpoint.json: `files`: must list each of the 2 (tp, pp) ranks exactly once"),
        "{out}"
    );
}

/// A shards directory's model config and manifest are covered by no digest; export writes the
/// config out beside the weights, so the two must agree on the shape the weights have.
#[test]
fn a_shards_config_or_manifest_that_disagree_are_refused() {
    let (tmp, dir) = model();
    let shards = tmp.path().join("shards");
    convert(&dir, &shards, 2, 1, None).unwrap();
    type Edit = (&'static str, &'static str, fn(&mut Value));
    let edits: [Edit; 4] = [
        ("hf_config.json", "model.num_layers", |v| v["num_hidden_layers"] = 2.into()),
        ("hf_config.json", "model.rotary_base", |v| v["rope_parameters"]["rope_theta"] = 1234.5.into()),
        ("mflow-checkpoint.json", "model.vocab_size", |v| v["model"]["vocab_size"] = 1000.into()),
        ("mflow-checkpoint.json", "architecture", |v| v["architecture"] = "qwen2".into()),
    ];
    for (file, key, edit) in edits {
        let path = shards.join(file);
        let before = std::fs::read_to_string(&path).unwrap();
        let mut v: Value = serde_json::from_str(&before).unwrap();
        edit(&mut v);
        std::fs::write(&path, v.to_string()).unwrap();
        let Err(err) = export(&shards, &tmp.path().join("back")) else { panic!("{file}: {key} was not refused") };
        let out = render(&err, tmp.path());
        assert!(out.starts_with("mflow::ckpt::config\n"), "{file}: {out}");
        assert!(
            out.contains(&format!("mflow-checkpoint.json: `{key}`: is ")) && out.contains("hf_config.json says"),
            "{file}: {out}"
        );
        assert!(!tmp.path().join("back").exists());
        std::fs::write(&path, before).unwrap();
    }
    export(&shards, &tmp.path().join("back")).unwrap();
}

#[test]
fn tied_output_layer_of_another_shape() {
    let (tmp, dir) = model();
    edit_config(&dir, |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    // An `lm_head.weight` of 4 values appended after the data.
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let data = bytes.len() - 8 - n;
    edit_header(&dir, |h| {
        h.insert(
            "lm_head.weight".into(),
            serde_json::json!({"dtype": "F32", "shape": [4], "data_offsets": [data, data + 16]}),
        );
    });
    let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, &[0u8; 16]).unwrap();
    insta::assert_snapshot!(convert_fails(tmp.path(), &dir, 1, 1));
}

/// Changes one byte of `tensor` in the rank file `file` of `shards`, and records the file's new
/// digest in the manifest, as a consistent but wrong checkpoint would have it.
fn change_in_rank_file(shards: &Path, file: &str, tensor: &str) {
    let path = shards.join(file);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + start] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let manifest = shards.join("mflow-checkpoint.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        if f["path"] == file {
            f["blake3"] = blake3::hash(&bytes).to_hex().to_string().into();
        }
    }
    std::fs::write(&manifest, m.to_string()).unwrap();
}

/// Export and resharding read one copy of replicated weights: the others must hold the same.
#[test]
fn copies_of_the_same_weights_that_differ_are_refused() {
    let (tmp, dir) = model();
    let shards = tmp.path().join("shards");
    convert(&dir, &shards, 2, 2, None).unwrap();
    let files: Vec<String> = std::fs::read_dir(&shards)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    let last_stage =
        |tp: u32| files.iter().find(|f| f.contains(&format!("tp{tp:02}")) && f.contains("pp001")).unwrap().clone();
    for (file, tensor) in [(last_stage(0), "output_layer.weight"), (last_stage(1), "decoder.final_layernorm.weight")] {
        let copy = tmp.path().join("copy");
        let _ = std::fs::remove_dir_all(&copy);
        std::fs::create_dir(&copy).unwrap();
        for e in std::fs::read_dir(&shards).unwrap().flatten() {
            if e.path().is_file() {
                std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
            } else {
                let sub = copy.join(e.file_name());
                std::fs::create_dir(&sub).unwrap();
                for f in std::fs::read_dir(e.path()).unwrap().flatten() {
                    std::fs::copy(f.path(), sub.join(f.file_name())).unwrap();
                }
            }
        }
        change_in_rank_file(&copy, &file, tensor);
        for err in [
            export(&copy, &tmp.path().join("back")).unwrap_err(),
            convert(&copy, &tmp.path().join("re"), 1, 1, None).unwrap_err(),
        ] {
            let out = render(&err, tmp.path());
            assert!(out.starts_with("mflow::ckpt::replicas\n"), "{tensor}: {out}");
            assert!(
                out.contains(&format!("`{tensor}` of [TMP]/copy/{file}")) && out.contains("but they differ"),
                "{out}"
            );
        }
        assert!(!tmp.path().join("back").exists() && !tmp.path().join("re").exists());
    }
    export(&shards, &tmp.path().join("back")).unwrap();
}
