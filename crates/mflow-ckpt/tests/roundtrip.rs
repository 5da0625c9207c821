//! HF -> shards -> HF and shards -> shards round trips must give back every tensor bit for bit.

use std::collections::BTreeMap;
use std::path::Path;

use mflow_ckpt::convert::{convert, export};
use mflow_ckpt::presets::{self, Preset};
use mflow_ckpt::st::StFile;
use mflow_ckpt::ModelShape;

/// name -> (dtype, shape, bytes) of every tensor in the safetensors files of a directory.
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let f = StFile::open(&path).unwrap();
            let prefix = if path.file_name().unwrap().to_string_lossy().starts_with("model_tp") {
                format!("{}:", path.file_name().unwrap().to_string_lossy())
            } else {
                String::new()
            };
            for (name, meta) in &f.header.tensors {
                out.insert(
                    format!("{prefix}{name}"),
                    (format!("{:?}", meta.dtype), meta.shape.clone(), f.bytes(meta).to_vec()),
                );
            }
        }
    }
    out
}

fn assert_same(a: &Path, b: &Path) {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.keys().collect::<Vec<_>>(), tb.keys().collect::<Vec<_>>(), "{} vs {}", a.display(), b.display());
    for (name, x) in &ta {
        let y = &tb[name];
        assert_eq!((&x.0, &x.1), (&y.0, &y.1), "{name}");
        assert!(x.2 == y.2, "tensor {name} differs between {} and {}", a.display(), b.display());
    }
}

/// The Llama-3.2-1B feature set (GQA 4:1, tied, llama3 rope scaling, bf16) at a test size.
fn llama_1b_reduced() -> Preset {
    let full = presets::preset("llama-1b").unwrap();
    Preset {
        shape: ModelShape {
            num_layers: 4,
            hidden_size: 256,
            num_attention_heads: 16,
            num_query_groups: 4,
            kv_channels: 16,
            ffn_hidden_size: 512,
            vocab_size: 1000,
            ..full.shape
        },
        dtype: full.dtype,
    }
}

fn round_trip(preset: &Preset, layouts: &[(u32, u32)]) {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    presets::write(preset, &hf, 7).unwrap();
    for &(tp, pp) in layouts {
        let shards = tmp.path().join(format!("tp{tp}pp{pp}"));
        let back = tmp.path().join(format!("back-tp{tp}pp{pp}"));
        convert(&hf, &shards, tp, pp, None).unwrap();
        export(&shards, &back).unwrap();
        assert_same(&hf, &back);
        let config = |d: &Path| {
            serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
        };
        assert_eq!(config(&hf), config(&back));
        assert_eq!(
            std::fs::read(hf.join("tokenizer.json")).unwrap(),
            std::fs::read(back.join("tokenizer.json")).unwrap()
        );
    }
}

const LAYOUTS: &[(u32, u32)] = &[(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)];

#[test]
fn llama_tiny_round_trips_bit_identical() {
    round_trip(&presets::preset("llama-tiny").unwrap(), LAYOUTS);
}

#[test]
fn qwen2_tiny_round_trips_bit_identical() {
    round_trip(&presets::preset("qwen2-tiny").unwrap(), LAYOUTS);
}

#[test]
fn gpt2_tiny_round_trips_bit_identical() {
    round_trip(&presets::preset("gpt2-tiny").unwrap(), LAYOUTS);
}

#[test]
fn llama_1b_shape_reduced_round_trips_bit_identical() {
    round_trip(&llama_1b_reduced(), LAYOUTS);
}

#[test]
fn reshard_tp2_tp1_tp2_is_bit_identical() {
    for name in ["llama-tiny", "qwen2-tiny", "gpt2-tiny"] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = tmp.path().join("hf");
        presets::write(&presets::preset(name).unwrap(), &hf, 1).unwrap();
        let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
        convert(&hf, &a, 2, 1, None).unwrap();
        convert(&a, &b, 1, 1, None).unwrap();
        convert(&b, &c, 2, 1, None).unwrap();
        assert_same(&a, &c);
        // Files are byte-identical too, so their recorded digests match.
        for f in ["model_tp00_pp000.safetensors", "model_tp01_pp000.safetensors"] {
            assert!(std::fs::read(a.join(f)).unwrap() == std::fs::read(c.join(f)).unwrap(), "{name} {f}");
        }
        // And resharding across pipeline stages goes through the same path.
        let (d, e) = (tmp.path().join("d"), tmp.path().join("e"));
        convert(&a, &d, 1, 2, None).unwrap();
        convert(&hf, &e, 1, 2, None).unwrap();
        assert_same(&d, &e);
    }
}

#[test]
fn dtype_conversion_round_trips_through_float32() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    presets::write(&llama_1b_reduced(), &hf, 3).unwrap();
    let (f32s, bf16s, back) = (tmp.path().join("f32"), tmp.path().join("bf16"), tmp.path().join("back"));
    convert(&hf, &f32s, 2, 1, Some(safetensors::Dtype::F32)).unwrap();
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(f32s.join("mflow-checkpoint.json")).unwrap()).unwrap();
    assert_eq!(m["dtype"], "float32");
    // bf16 -> f32 is exact, so going back to bf16 restores the original bits.
    convert(&f32s, &bf16s, 1, 1, Some(safetensors::Dtype::BF16)).unwrap();
    export(&bf16s, &back).unwrap();
    assert_same(&hf, &back);
}

#[test]
fn float16_shards_hold_each_value_rounded_to_float16() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    presets::write(&presets::preset("llama-tiny").unwrap(), &hf, 3).unwrap();
    let (f16s, back) = (tmp.path().join("f16"), tmp.path().join("back"));
    convert(&hf, &f16s, 2, 1, mflow_ckpt::convert::parse_dtype(Some("float16")).unwrap()).unwrap();
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(f16s.join("mflow-checkpoint.json")).unwrap()).unwrap();
    assert_eq!(m["dtype"], "float16");
    export(&f16s, &back).unwrap();
    let (orig, got) = (tensors(&hf), tensors(&back));
    assert_eq!(orig.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, (dtype, shape, bytes)) in &orig {
        assert_eq!(dtype, "F32", "{name}: the preset is float32");
        let (dtype16, shape16, bytes16) = &got[name];
        assert_eq!((dtype16.as_str(), shape16), ("F16", shape), "{name}");
        for (x, y) in bytes.chunks(4).zip(bytes16.chunks(2)) {
            let x = f32::from_le_bytes(x.try_into().unwrap());
            assert_eq!(half::f16::from_f32(x).to_bits(), u16::from_le_bytes([y[0], y[1]]), "{name}: {x}");
        }
    }
}

#[test]
fn presets_are_deterministic_for_a_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let p = presets::preset("llama-tiny").unwrap();
    presets::write(&p, &tmp.path().join("a"), 5).unwrap();
    presets::write(&p, &tmp.path().join("b"), 5).unwrap();
    presets::write(&p, &tmp.path().join("c"), 6).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "config.json"] {
        assert!(
            std::fs::read(tmp.path().join("a").join(f)).unwrap()
                == std::fs::read(tmp.path().join("b").join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(
        std::fs::read(tmp.path().join("a/model.safetensors")).unwrap()
            != std::fs::read(tmp.path().join("c/model.safetensors")).unwrap()
    );
}
