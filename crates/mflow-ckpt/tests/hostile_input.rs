//! Hostile model directories: sizes that would make mflow allocate without bound, FIFOs in
//! place of files, links out of the directory, repeated tensor names, impossible config values
//! and huge strings. Each must end in a short error that names the file and key or tensor,
//! quickly, within a bounded amount of memory, and with nothing left behind.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mflow_ckpt::convert::{convert, export};
use mflow_ckpt::{cli, presets, st, CkptError};
use miette::Diagnostic;
use serde_json::Value;

/// Errors must stay well below this many bytes, whatever the files hold.
const MAX_MESSAGE: usize = 1500;

fn pristine() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        presets::write(&presets::preset("llama-tiny").unwrap(), &d.path().join("hf"), 0).unwrap();
        convert(&d.path().join("hf"), &d.path().join("shards"), 1, 2, None).unwrap();
        d
    })
    .path()
}

/// A fresh copy of the preset (`name` = "hf") or of its shards ("shards").
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    copy_dir(&pristine().join(name), &dir);
    (tmp, dir)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let mut v: serde_json::Map<String, Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
}

/// Code and message of an error, with the temp dir masked.
fn render(err: &CkptError, tmp: &Path) -> String {
    let code = err.code().map(|c| c.to_string()).unwrap_or_default();
    format!("{code}: {err}").replace(&tmp.display().to_string(), "[TMP]")
}

/// Runs `f` on a thread and fails the test if it does not return within `secs` (a hang on a
/// FIFO would otherwise hang the test run).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).expect("did not return in time (blocked?)")
}

/// Converts, expecting an error that is short and quick; checks nothing is left behind.
fn convert_fails(tmp: &Path, src: &Path) -> String {
    let dst = tmp.join("out");
    let (s, d) = (src.to_path_buf(), dst.clone());
    let start = Instant::now();
    let err = match within(30, move || convert(&s, &d, 1, 1, None)) {
        Ok(()) => panic!("conversion of {} must fail", src.display()),
        Err(e) => e,
    };
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    assert!(!dst.exists(), "output directory left behind");
    let text = render(&err, tmp);
    assert!(text.len() < MAX_MESSAGE, "{} byte message: {}", text.len(), &text[..MAX_MESSAGE]);
    text
}

/// Re-runs this test binary on test `name` with its address space limited to `mib`, so that
/// an unbounded allocation aborts the child instead of exhausting the machine. The child sees
/// MFLOW_TEST_CHILD=1 and does the work; the parent checks that it passed.
fn in_child_with_memory_limit(name: &str, mib: u64) -> bool {
    if std::env::var_os("MFLOW_TEST_CHILD").is_some() {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let script = format!("ulimit -v {} && exec \"$0\" --exact {name} --nocapture --test-threads 1", mib * 1024);
    let out = Command::new("sh").arg("-c").arg(script).arg(&exe).env("MFLOW_TEST_CHILD", "1").output().unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("1 passed"), "child under a {mib} MiB limit failed:\n{log}");
    false
}

#[test]
fn ten_million_layers_in_config_json_fail_fast_in_bounded_memory() {
    if !in_child_with_memory_limit("ten_million_layers_in_config_json_fail_fast_in_bounded_memory", 2048) {
        return;
    }
    let (tmp, dir) = copy_of("hf");
    edit_json(&dir.join("config.json"), |c| {
        c.insert("num_hidden_layers".into(), 10_000_000.into());
    });
    let text = convert_fails(tmp.path(), &dir);
    assert!(text.starts_with("mflow::ckpt::too_large") && text.contains("`num_hidden_layers` = 10000000"), "{text}");
    // Within the bound but not what the weights hold: refused before planning 4000 layers.
    edit_json(&dir.join("config.json"), |c| {
        c.insert("num_hidden_layers".into(), 4000.into());
    });
    let text = convert_fails(tmp.path(), &dir);
    assert!(
        text.starts_with("mflow::ckpt::count")
            && text.contains("`num_hidden_layers` is 4000 but the weights hold 4 layers"),
        "{text}"
    );
}

#[test]
fn ten_million_layers_in_the_manifest_fail_fast_in_bounded_memory() {
    if !in_child_with_memory_limit("ten_million_layers_in_the_manifest_fail_fast_in_bounded_memory", 2048) {
        return;
    }
    let (tmp, dir) = copy_of("shards");
    let manifest = dir.join("mflow-checkpoint.json");
    let pristine_manifest = std::fs::read(&manifest).unwrap();
    type Edit = fn(&mut serde_json::Map<String, Value>);
    let cases: [(&str, Edit); 7] = [
        ("mflow::ckpt::too_large", |m| m["model"]["num_layers"] = 10_000_000.into()),
        ("mflow::ckpt::count", |m| {
            m["model"]["num_layers"] = 400.into();
            m["layers_per_stage"] = serde_json::json!([200, 200]);
        }),
        ("mflow::ckpt::config", |m| m["layers_per_stage"] = serde_json::json!([2, 2, 2])),
        ("mflow::ckpt::config", |m| m["pp"] = 4.into()),
        ("mflow::ckpt::too_large", |m| m["pp"] = 4_000_000_000u64.into()),
        ("mflow::ckpt::too_large", |m| {
            m["tp"] = 4_000_000_000u64.into();
            m["pp"] = 4_000_000_000u64.into();
        }),
        ("mflow::ckpt::too_large", |m| m["model"]["vocab_size"] = (1u64 << 40).into()),
    ];
    for (code, edit) in cases {
        std::fs::write(&manifest, &pristine_manifest).unwrap();
        edit_json(&manifest, edit);
        let dst = tmp.path().join("back");
        let start = Instant::now();
        let err = export(&dir, &dst).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(!dst.exists());
        let text = render(&err, tmp.path());
        assert!(text.starts_with(code) && text.contains("mflow-checkpoint.json"), "{text}");
        assert!(text.len() < MAX_MESSAGE);
    }
}

/// A header of a million (empty) tensors, about 50 MB: under the header byte limit, so the
/// tensor count is what must stop it.
#[test]
fn a_million_tensors_in_a_header_are_refused_in_bounded_memory() {
    if !in_child_with_memory_limit("a_million_tensors_in_a_header_are_refused_in_bounded_memory", 1024) {
        return;
    }
    let mut json = String::from("{");
    for i in 0..1_000_000 {
        json.push_str(&format!("\"t{i}\":{{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}},"));
    }
    json.pop();
    json.push('}');
    let mut buf = (json.len() as u64).to_le_bytes().to_vec();
    buf.extend_from_slice(json.as_bytes());
    drop(json);
    let err = st::parse("model.safetensors", &buf).unwrap_err();
    assert_eq!(err.to_string(), format!("model.safetensors: header lists more than {} tensors", st::MAX_TENSORS));
}

#[test]
fn repeated_tensor_names_are_refused() {
    let (tmp, dir) = copy_of("hf");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    // Same length, so the data offsets stay valid: only the repeated name is wrong.
    let header = header.replace("model.layers.1.input_layernorm.weight", "model.layers.0.input_layernorm.weight");
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let text = convert_fails(tmp.path(), &dir);
    assert_eq!(
        text,
        "mflow::ckpt::safetensors::duplicate: [TMP]/hf/model.safetensors: tensor `model.layers.0.input_layernorm.weight` is listed twice in the header"
    );
}

#[test]
fn impossible_config_values_are_refused_naming_the_key() {
    let (tmp, dir) = copy_of("hf");
    let config = dir.join("config.json");
    let pristine_config = std::fs::read(&config).unwrap();
    // (key, value, the key the error must name)
    let cases: &[(&str, Value, &str)] = &[
        ("rms_norm_eps", Value::from(-1), "rms_norm_eps"),
        ("rms_norm_eps", Value::from(0), "rms_norm_eps"),
        ("rms_norm_eps", Value::from(2.0), "layernorm_epsilon"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": -10000.0}),
            "rope_parameters.rope_theta",
        ),
        ("hidden_size", Value::from(0), "hidden_size"),
        ("hidden_size", Value::from(-256), "hidden_size"),
        ("intermediate_size", Value::from(0), "intermediate_size"),
        ("num_attention_heads", Value::from(12), "hidden_size"),
        ("num_attention_heads", Value::from(7), "num_key_value_heads"),
        ("num_key_value_heads", Value::from(3), "num_key_value_heads"),
        ("num_key_value_heads", Value::from(0), "num_key_value_heads"),
        ("vocab_size", Value::from(1u64 << 40), "vocab_size"),
        ("max_position_embeddings", Value::from(1u64 << 40), "max_position_embeddings"),
        ("head_dim", Value::from(1u64 << 30), "head_dim"),
        ("num_hidden_layers", Value::from(0), "num_hidden_layers"),
        ("num_hidden_layers", Value::from(-4), "num_hidden_layers"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": -8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            "rope_parameters.factor",
        ),
    ];
    for (key, value, named) in cases {
        std::fs::write(&config, &pristine_config).unwrap();
        edit_json(&config, |c| {
            c.insert(key.to_string(), value.clone());
            // With head_dim set, heads need not divide hidden_size (a legitimate layout).
            if *key == "num_attention_heads" {
                c.remove("head_dim");
            }
        });
        let text = convert_fails(tmp.path(), &dir);
        assert!(text.contains(&format!("`{named}`")) && text.contains("config.json"), "{key} = {value}: {text}");
    }
    // JSON cannot spell NaN or infinity; a number too large for f64 is not valid JSON to serde.
    std::fs::write(
        &config,
        String::from_utf8(pristine_config.clone()).unwrap().replacen('{', "{\"rope_theta\": 1e999,", 1),
    )
    .unwrap();
    let text = convert_fails(tmp.path(), &dir);
    assert!(text.contains("config.json"), "{text}");
}

#[test]
fn fifos_in_place_of_files_are_refused_without_blocking() {
    for name in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"] {
        let (tmp, dir) = copy_of("hf");
        let _ = std::fs::remove_file(dir.join(name));
        assert!(Command::new("mkfifo").arg(dir.join(name)).status().unwrap().success());
        let text = convert_fails(tmp.path(), &dir);
        assert!(text.contains(&format!("[TMP]/hf/{name}")) && text.contains("FIFO"), "{name}: {text}");
        // The crate's own CLI entry behaves the same.
        let args = cli::ConvertArgs { src: dir.clone(), dst: tmp.path().join("out2"), tp: 1, pp: 1, dtype: None };
        let err = within(30, move || cli::convert(&args).unwrap_err());
        assert!(err.to_string().contains("FIFO"), "{name}: {err}");
        assert!(!tmp.path().join("out2").exists());
    }
    // In a shards directory too (the manifest and a rank file).
    for name in ["mflow-checkpoint.json", "model_tp00_pp001.safetensors", "hf_config.json"] {
        let (tmp, dir) = copy_of("shards");
        std::fs::remove_file(dir.join(name)).unwrap();
        assert!(Command::new("mkfifo").arg(dir.join(name)).status().unwrap().success());
        let (d, dst) = (dir.clone(), tmp.path().join("back"));
        let err = within(30, move || export(&d, &dst).unwrap_err());
        let text = render(&err, tmp.path());
        assert!(text.contains(&format!("[TMP]/shards/{name}")) && text.contains("FIFO"), "{name}: {text}");
    }
}

#[test]
fn links_out_of_the_model_directory_are_refused_naming_the_link() {
    let outside = |tmp: &Path| {
        let secret = tmp.join("secret.txt");
        std::fs::write(&secret, "root:$6$not-for-the-output").unwrap();
        secret
    };
    for name in
        ["special_tokens_map.json", "tokenizer.json", "config.json", "model.safetensors", "generation_config.json"]
    {
        let (tmp, dir) = copy_of("hf");
        let _ = std::fs::remove_file(dir.join(name));
        std::os::unix::fs::symlink(outside(tmp.path()), dir.join(name)).unwrap();
        let text = convert_fails(tmp.path(), &dir);
        assert!(
            text.starts_with("mflow::ckpt::file::escapes") && text.contains(&format!("[TMP]/hf/{name}: resolves to")),
            "{name}: {text}"
        );
        // `mflow model path:DIR` copies the same files.
        let args = cli::ModelArgs { source: format!("path:{}", dir.display()), dst: tmp.path().join("copy"), seed: 0 };
        let err = cli::model(&args).unwrap_err();
        assert!(err.to_string().contains("resolves to"), "{name}: {err}");
        assert!(!tmp.path().join("copy").exists());
    }
    // A linked tokenizer/ directory of a shards directory is held to the same rule.
    let (tmp, dir) = copy_of("shards");
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::rename(dir.join("tokenizer"), &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.join("tokenizer")).unwrap();
    let err = export(&dir, &tmp.path().join("back")).unwrap_err();
    assert!(render(&err, tmp.path()).contains("[TMP]/shards/tokenizer/"), "{err}");
    // A link that stays inside the directory is fine.
    let (tmp, dir) = copy_of("hf");
    std::fs::create_dir(dir.join("sub")).unwrap();
    std::fs::rename(dir.join("tokenizer.json"), dir.join("sub/tokenizer.json")).unwrap();
    std::os::unix::fs::symlink("sub/tokenizer.json", dir.join("tokenizer.json")).unwrap();
    convert(&dir, &tmp.path().join("out"), 1, 1, None).unwrap();
    assert!(tmp.path().join("out/tokenizer/tokenizer.json").is_file());
}

#[test]
fn huge_strings_from_files_are_quoted_as_short_excerpts() {
    let big = "x".repeat(10 << 20);
    let (tmp, dir) = copy_of("hf");
    let config = dir.join("config.json");
    let pristine_config = std::fs::read(&config).unwrap();
    for key in ["model_type", "hidden_act", "rms_norm_eps", "num_hidden_layers"] {
        std::fs::write(&config, &pristine_config).unwrap();
        edit_json(&config, |c| {
            c.insert(key.into(), big.clone().into());
        });
        let text = convert_fails(tmp.path(), &dir);
        assert!(text.contains("bytes in all"), "{key}: {text}");
    }
    // A tensor name of 10 MB in the weights.
    std::fs::write(&config, &pristine_config).unwrap();
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let v = header.remove("model.layers.3.mlp.up_proj.weight").unwrap();
    header.insert(big.clone(), v);
    let mut json = serde_json::to_vec(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let text = convert_fails(tmp.path(), &dir);
    assert!(text.contains("unexpected tensor") && text.contains("bytes in all"), "{text}");
}
