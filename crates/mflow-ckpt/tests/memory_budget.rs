//! Sizes that are each within bounds but multiply past the memory budget: a model of 4096
//! layers of 16,384 one-channel KV groups (a sparse weights file of 0.94 GB, 4.1 MB on disk), the
//! same numbers in a shards directory, a manifest of 65,536 ranks, headers of many tiny tensors,
//! an index of a million entries, nested arrays in a JSON file. Each is refused before the
//! allocation with a message that gives the figure, the budget and how to raise it; the tests
//! run in a child process whose address space is limited, so an allocation of what the old
//! behaviour planned would abort it, and they check how far the child's resident set rises. Real
//! models pass under a budget of 16 MiB, and a huge vocabulary (which multiplies into no
//! plan) streams through in bounded memory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use mflow_ckpt::convert::{convert, export};
use mflow_ckpt::layout::hf_tensors;
use mflow_ckpt::presets::{self, Preset};
use mflow_ckpt::shape::ModelShape;
use mflow_ckpt::shards::{self, FileEntry};
use mflow_ckpt::st::{build_header, HeaderEntry};
use mflow_ckpt::{cli, CkptError};
use miette::Diagnostic;
use safetensors::Dtype;

/// Runs this test binary on test `name` in a child whose address space is limited to `mib` and
/// whose MFLOW_MEMORY_BUDGET is `budget`; true in the child, which does the work. The parent
/// checks that the child passed.
fn in_child(name: &str, mib: u64, budget: &str) -> bool {
    if std::env::var_os("MFLOW_TEST_CHILD").is_some() {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let script = format!("ulimit -v {} && exec \"$0\" --exact {name} --nocapture --test-threads 1", mib * 1024);
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(&exe)
        .env("MFLOW_TEST_CHILD", "1")
        .env("MFLOW_MEMORY_BUDGET", budget)
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("1 passed"), "child under a {mib} MiB limit failed:\n{log}");
    eprintln!("{log}");
    false
}

fn status_mib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// What `f` returns, and how far the resident set rose above where it was while `f` ran, in
/// MiB: the peak (VmHWM) is reset first (`clear_refs` 5), so that what building the input
/// took does not count.
fn rss_rise<T>(f: impl FnOnce() -> T) -> (T, u64) {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = status_mib("VmRSS:");
    let value = f();
    let rise = status_mib("VmHWM:").saturating_sub(before);
    eprintln!("resident set: {before} MiB before, {rise} MiB more at the most");
    (value, rise)
}

/// Code, message and help of an error, with the temp dir masked.
fn render(err: &CkptError, tmp: &Path) -> String {
    let code = err.code().map(|c| c.to_string()).unwrap_or_default();
    let help = err.help().map(|h| h.to_string()).unwrap_or_default();
    format!("{code}: {err}\nhelp: {help}").replace(&tmp.display().to_string(), "[TMP]")
}

/// The hostile shape of the report: 4096 layers x 16384 heads in 16384 KV groups of one
/// channel, hidden size 1, FFN 16384, one token: 0.94 GB of weights. Each size is within its bound.
fn hostile() -> ModelShape {
    ModelShape {
        num_layers: 4096,
        hidden_size: 1,
        num_attention_heads: 16384,
        num_query_groups: 16384,
        kv_channels: 1,
        ffn_hidden_size: 16384,
        vocab_size: 1,
        ..presets::shape("llama-tiny").unwrap()
    }
}

/// Writes a safetensors file of `tensors` in `dtype` whose data area is a hole: the header is
/// all that takes room on disk. Returns its size.
fn sparse_safetensors(path: &Path, tensors: &[(String, Vec<u64>)], dtype: Dtype) -> u64 {
    let entries: Vec<HeaderEntry> = tensors.iter().map(|(n, s)| HeaderEntry { name: n, dtype, shape: s }).collect();
    let (header, sizes) = build_header(&entries, &BTreeMap::new());
    std::fs::write(path, &header).unwrap();
    let size = header.len() as u64 + sizes.iter().sum::<u64>();
    std::fs::File::options().write(true).open(path).unwrap().set_len(size).unwrap();
    size
}

/// A Hugging Face directory of `shape` with sparse weights.
fn hf_model(dir: &Path, shape: &ModelShape) {
    std::fs::create_dir_all(dir).unwrap();
    let preset = Preset { shape: shape.clone(), dtype: Dtype::BF16 };
    std::fs::write(dir.join("config.json"), presets::hf_config(&preset).to_string()).unwrap();
    sparse_safetensors(&dir.join("model.safetensors"), &hf_tensors(shape), Dtype::BF16);
}

/// The tensors of the one rank file of a llama `shape` at tp = pp = 1, written here rather
/// than planned (planning it is what the test must not do).
fn rank_tensors(s: &ModelShape) -> Vec<(String, Vec<u64>)> {
    let h = s.hidden_size;
    let q = s.num_attention_heads * s.kv_channels;
    let mut out = vec![("embedding.word_embeddings.weight".to_string(), vec![s.padded_vocab(1), h])];
    for i in 0..s.num_layers {
        let p = format!("decoder.layers.{i}.");
        out.push((format!("{p}input_layernorm.weight"), vec![h]));
        out.push((format!("{p}self_attention.linear_qkv.weight"), vec![s.qkv_rows(), h]));
        out.push((format!("{p}self_attention.linear_proj.weight"), vec![h, q]));
        out.push((format!("{p}pre_mlp_layernorm.weight"), vec![h]));
        out.push((format!("{p}mlp.linear_fc1.weight"), vec![2 * s.ffn_hidden_size, h]));
        out.push((format!("{p}mlp.linear_fc2.weight"), vec![h, s.ffn_hidden_size]));
    }
    out.push(("decoder.final_layernorm.weight".to_string(), vec![h]));
    out
}

/// A valid shards directory (sizes and digests right) of a llama `shape` at tp = pp = 1.
fn shards_dir(dir: &Path, s: &ModelShape) {
    std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
    let name = mflow_ckpt::layout::rank_file_name(0, 0);
    let path = dir.join(&name);
    let bytes = sparse_safetensors(&path, &rank_tensors(s), Dtype::BF16);
    let mut h = blake3::Hasher::new();
    h.update_reader(std::fs::File::open(&path).unwrap()).unwrap();
    let files = vec![FileEntry { tp: 0, pp: 0, path: name, bytes, blake3: h.finalize().to_hex().to_string() }];
    let manifest = shards::manifest(s, 1, 1, Dtype::BF16, files);
    std::fs::write(dir.join(shards::MANIFEST), serde_json::to_string(&manifest).unwrap()).unwrap();
    let preset = Preset { shape: s.clone(), dtype: Dtype::BF16 };
    std::fs::write(dir.join(shards::HF_CONFIG), presets::hf_config(&preset).to_string()).unwrap();
}

fn disk_kib(dir: &Path) -> u64 {
    let out = Command::new("du").arg("-sk").arg(dir).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().parse().unwrap()
}

fn assert_nothing_left(tmp: &Path) {
    let left: Vec<String> = std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("out") || n.contains("staging"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The report's case: `mflow convert` of the hostile model planned 32 GiB (28 GB projected in
/// the report) before any check could fail. Now it is refused before the plan, naming
/// config.json and the sizes that multiplied.
#[test]
fn a_plan_of_thousands_of_kv_groups_per_layer_is_refused_before_it_is_made() {
    if !in_child("a_plan_of_thousands_of_kv_groups_per_layer_is_refused_before_it_is_made", 3072, "1GiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    hf_model(&dir, &hostile());
    let weights = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    eprintln!("weights {weights} bytes, {} KiB on disk", disk_kib(&dir));
    let start = Instant::now();
    let (err, rise) = rss_rise(|| convert(&dir, &tmp.path().join("out"), 1, 1, None).unwrap_err());
    let text = render(&err, tmp.path());
    eprintln!("{text}\nrefused in {:?}", start.elapsed());
    assert!(
        text.starts_with(
            "mflow::ckpt::memory: [TMP]/hf/config.json: converting to tp = 1, pp = 1 (4096 layers, 16384 attention heads \
             in 16384 KV groups of 1 channels, vocabulary 1) would need about 32.1 GiB of memory (the plan (201351171 \
             pieces of 24578 tensors in 1 rank files): 32.0 GiB; "
        ) && text.contains("more than the memory budget of 1.0 GiB (MFLOW_MEMORY_BUDGET)\nhelp: ")
            && text.contains("set MFLOW_MEMORY_BUDGET to what this machine can hold"),
        "{text}"
    );
    assert_nothing_left(tmp.path());
    // Reading the 3.6 MB header of 36,866 tensors, and the list of the expected ones.
    assert!(rise < 128, "{rise} MiB");
    // The crate's command says the same, for other layouts too.
    let args = cli::ConvertArgs { src: dir, dst: tmp.path().join("out"), tp: 16, pp: 2, dtype: None };
    let err = cli::convert(&args).unwrap_err();
    assert!(err.to_string().contains("converting to tp = 16, pp = 2 (4096 layers"), "{err}");
    assert_nothing_left(tmp.path());
}

/// The same numbers in a valid shards directory drive `export` and resharding: both are refused
/// from the manifest, before a rank file is hashed or a plan made.
#[test]
fn the_same_sizes_in_a_shards_directory_are_refused_by_export_and_reshard() {
    if !in_child("the_same_sizes_in_a_shards_directory_are_refused_by_export_and_reshard", 3072, "1GiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shards");
    shards_dir(&dir, &hostile());
    eprintln!("shards directory: {} KiB on disk", disk_kib(&dir));
    let start = Instant::now();
    let (err, rise) = rss_rise(|| export(&dir, &tmp.path().join("out")).unwrap_err());
    let text = render(&err, tmp.path());
    eprintln!("{text}\nrefused in {:?}", start.elapsed());
    assert!(rise < 16, "{rise} MiB");
    assert!(
        text.starts_with(
            "mflow::ckpt::memory: [TMP]/shards/mflow-checkpoint.json: exporting shards of tp = 1, pp = 1 (4096 layers, \
             16384 attention heads in 16384 KV groups of 1 channels, vocabulary 1) would need about "
        ) && text.contains("more than the memory budget of 1.0 GiB (MFLOW_MEMORY_BUDGET)"),
        "{text}"
    );
    for (tp, pp) in [(1, 1), (2, 2), (16384, 1)] {
        let err = convert(&dir, &tmp.path().join("out"), tp, pp, None).unwrap_err();
        let text = render(&err, tmp.path());
        eprintln!("{text}");
        assert!(
            text.starts_with(&format!(
                "mflow::ckpt::memory: [TMP]/shards/mflow-checkpoint.json: resharding tp = 1, pp = 1 to tp = {tp}, pp = \
                 {pp} (4096 layers"
            )) && text.contains("more than the memory budget of 1.0 GiB"),
            "{text}"
        );
    }
    assert_nothing_left(tmp.path());
}

/// A manifest of 16384 x 4 ranks (each bound holds: heads, ranks, layers) lists 65,536 rank files
/// that are not there: refused by the size of its plans before any of them is looked for.
#[test]
fn a_manifest_of_sixty_five_thousand_ranks_is_refused_before_its_files_are_read() {
    if !in_child("a_manifest_of_sixty_five_thousand_ranks_is_refused_before_its_files_are_read", 2048, "1GiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shards");
    std::fs::create_dir(&dir).unwrap();
    let s = ModelShape { num_layers: 1024, ..hostile() };
    let (tp, pp) = (16384u32, 4u32);
    let files: Vec<FileEntry> = (0..pp)
        .flat_map(|p| (0..tp).map(move |t| (t, p)))
        .map(|(t, p)| FileEntry {
            tp: t,
            pp: p,
            path: mflow_ckpt::layout::rank_file_name(t, p),
            bytes: 0,
            blake3: "0".repeat(64),
        })
        .collect();
    let manifest = shards::manifest(&s, tp, pp, Dtype::BF16, files);
    std::fs::write(dir.join(shards::MANIFEST), serde_json::to_string(&manifest).unwrap()).unwrap();
    let (err, rise) = rss_rise(|| export(&dir, &tmp.path().join("out")).unwrap_err());
    let text = render(&err, tmp.path());
    eprintln!("{text}");
    assert!(
        text.starts_with(
            "mflow::ckpt::memory: [TMP]/shards/mflow-checkpoint.json: exporting shards of tp = 16384, pp = 4"
        ) && text.contains("in 65536 rank files"),
        "{text}"
    );
    // The 9 MB manifest, parsed.
    assert!(rise < 128, "{rise} MiB");
}

/// Four files of 65,536 empty tensors each (3.7 MB of header apiece) would hold up to 286 MiB parsed:
/// refused from their header lengths, before any is parsed.
#[test]
fn headers_of_many_tiny_tensors_are_refused_from_their_lengths() {
    if !in_child("headers_of_many_tiny_tensors_are_refused_from_their_lengths", 2048, "64MiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    presets::write(&presets::preset("llama-tiny").unwrap(), &dir, 0).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    for f in 0..4 {
        let name = format!("model-{:05}-of-00004.safetensors", f + 1);
        let tensors: Vec<(String, Vec<u64>)> = (0..65_536).map(|i| (format!("t{f}.{i}"), vec![0])).collect();
        sparse_safetensors(&dir.join(&name), &tensors, Dtype::F32);
        map.insert(format!("t{f}.0"), name.into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let (err, rise) = rss_rise(|| convert(&dir, &tmp.path().join("out"), 1, 1, None).unwrap_err());
    let text = render(&err, tmp.path());
    eprintln!("{text}");
    assert!(rise < 8, "{rise} MiB");
    assert!(
        text.starts_with(
            "mflow::ckpt::memory: [TMP]/hf/model.safetensors.index.json: reading [TMP]/hf/model.safetensors.index.json \
             would need about "
        ) && text.contains("(the headers of 4 safetensors files: ")
            && text.contains("more than the memory budget of 64.0 MiB"),
        "{text}"
    );
    assert_nothing_left(tmp.path());
}

/// An index of 1,000,000 entries (31 MB, under the 32 MiB cap on JSON files) and 20 MB of nested
/// arrays in config.json (2.5 GiB as a JSON value): both refused before they are parsed.
#[test]
fn json_files_that_would_hold_past_the_budget_are_refused_before_they_are_parsed() {
    if !in_child("json_files_that_would_hold_past_the_budget_are_refused_before_they_are_parsed", 2048, "64MiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    presets::write(&presets::preset("llama-tiny").unwrap(), &dir, 0).unwrap();
    let mut text = String::from(r#"{"metadata": {}, "weight_map": {"#);
    for i in 0..1_000_000 {
        text.push_str(&format!("\"t{i}\":\"model.safetensors\","));
    }
    text.push_str("\"x\":\"model.safetensors\"}}");
    std::fs::write(dir.join("model.safetensors.index.json"), &text).unwrap();
    drop(text);
    // An index beside a weights file is refused before either is read: the index alone here.
    std::fs::rename(dir.join("model.safetensors"), tmp.path().join("aside.safetensors")).unwrap();
    let (err, rise) = rss_rise(|| convert(&dir, &tmp.path().join("out"), 1, 1, None).unwrap_err());
    let text = render(&err, tmp.path());
    eprintln!("{text}");
    // Its 31 MB of text, read to be measured.
    assert!(rise < 48, "{rise} MiB");
    assert!(
        text.starts_with("mflow::ckpt::memory: [TMP]/hf/model.safetensors.index.json: parsing it would need about ")
            && text.contains("1000004 values in 0 arrays and 3 objects, 2 deep: ")
            && text.contains("more than the memory budget of 64.0 MiB"),
        "{text}"
    );
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    std::fs::rename(tmp.path().join("aside.safetensors"), dir.join("model.safetensors")).unwrap();
    let nested = format!("[{}[]]", "[[[[[[[[[[]]]]]]]]]],".repeat(1_000_000));
    std::fs::write(dir.join("config.json"), &nested).unwrap();
    drop(nested);
    let (err, rise) = rss_rise(|| convert(&dir, &tmp.path().join("out"), 1, 1, None).unwrap_err());
    let text = render(&err, tmp.path());
    eprintln!("{text}");
    assert!(rise < 48, "{rise} MiB");
    assert!(
        text.starts_with("mflow::ckpt::memory: [TMP]/hf/config.json: parsing it would need about 2.5 GiB of memory")
            && text.contains("10000002 values in 10000002 arrays and 0 objects, 11 deep"),
        "{text}"
    );
    assert_nothing_left(tmp.path());
}

/// A vocabulary of 2^26 rows multiplies into no plan: converted and exported (128 MiB of
/// weights each way) in a few MiB of budget and a bounded resident set.
#[test]
fn a_huge_vocabulary_streams_through_in_bounded_memory() {
    if !in_child("a_huge_vocabulary_streams_through_in_bounded_memory", 2048, "16MiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let s = ModelShape {
        num_layers: 1,
        hidden_size: 1,
        num_attention_heads: 1,
        num_query_groups: 1,
        kv_channels: 1,
        ffn_hidden_size: 1,
        vocab_size: 1 << 26,
        ..presets::shape("llama-tiny").unwrap()
    };
    hf_model(&tmp.path().join("hf"), &s);
    let ((), rise) = rss_rise(|| {
        convert(&tmp.path().join("hf"), &tmp.path().join("shards"), 1, 1, None).unwrap();
        export(&tmp.path().join("shards"), &tmp.path().join("back")).unwrap();
    });
    let back = std::fs::metadata(tmp.path().join("back/model.safetensors")).unwrap().len();
    assert!(back > 1 << 27, "{back}");
    // Steps of a MiB on each thread, and windows of 16 MiB while a rank file is hashed.
    assert!(rise < 64, "{rise} MiB");
}

/// The presets, converted, resharded and exported under a budget of 16 MiB: a real model's
/// plans are far below any budget (Llama-3.2-1B's shape: a few MiB, unit tests of memory.rs).
#[test]
fn real_models_convert_under_a_small_budget() {
    if !in_child("real_models_convert_under_a_small_budget", 4096, "16MiB") {
        return;
    }
    for name in ["llama-tiny", "qwen2-tiny", "gpt2-tiny"] {
        let tmp = tempfile::tempdir().unwrap();
        let p = |n: &str| -> PathBuf { tmp.path().join(n) };
        presets::write(&presets::preset(name).unwrap(), &p("hf"), 0).unwrap();
        convert(&p("hf"), &p("tp2"), 2, 1, None).unwrap();
        convert(&p("tp2"), &p("pp2"), 1, 2, None).unwrap();
        export(&p("pp2"), &p("back")).unwrap();
        let a = std::fs::read(p("hf/model.safetensors")).unwrap();
        let b = std::fs::read(p("back/model.safetensors")).unwrap();
        assert_eq!(a.len(), b.len(), "{name}");
    }
}

/// A budget that is not an amount of memory is an error naming it, not a silent default.
#[test]
fn a_budget_that_is_not_an_amount_is_an_error() {
    if !in_child("a_budget_that_is_not_an_amount_is_an_error", 2048, "lots") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    presets::write(&presets::preset("llama-tiny").unwrap(), &tmp.path().join("hf"), 0).unwrap();
    let err = convert(&tmp.path().join("hf"), &tmp.path().join("out"), 1, 1, None).unwrap_err();
    assert_eq!(
        render(&err, tmp.path()),
        "mflow::ckpt::memory_budget: MFLOW_MEMORY_BUDGET = \"lots\" is not an amount of memory\nhelp: set it to a \
         number of bytes, with a unit if you like (512MiB, 64GiB), or unset it for half of this machine's memory"
    );
}
