//! TP=2 shards load into a real Megatron-Core GPTModel (local spec) with
//! `load_state_dict(strict=True)` on both ranks; where CUDA is present the script also compares
//! Megatron's logits with transformers.
//!
//! Needs `MFLOW_PYTHON` with torch, transformers, safetensors and megatron-core.

use std::path::Path;
use std::process::Command;

use mflow_ckpt::convert::convert;
use mflow_ckpt::presets;

fn check(name: &str) {
    let python = std::env::var("MFLOW_PYTHON").unwrap_or_else(|_| {
        panic!("MFLOW_PYTHON is not set: point it at a Python with torch, transformers and megatron-core")
    });
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python");
    let tmp = tempfile::tempdir().unwrap();
    let (hf, shards) = (tmp.path().join("hf"), tmp.path().join("tp2"));
    presets::write(&presets::preset(name).unwrap(), &hf, 2).unwrap();
    convert(&hf, &shards, 2, 1, None).unwrap();
    // A free port for the rendezvous (torch's port 0 does not work with this launcher).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = Command::new(&python)
        .args([
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            &format!("--master_port={port}"),
        ])
        .arg(scripts.join("mcore_load.py"))
        .args([&hf, &shards])
        .output()
        .expect("run MFLOW_PYTHON");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{name}: Megatron-Core refused the shards:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).expect("a JSON line");
    let r: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(r["load"], "<All keys matched successfully>", "{name}: {r}");
    if let Some(d) = r["max_abs_diff"].as_f64() {
        assert!(d <= 1e-4, "{name}: Megatron-Core logits differ from transformers by {d}");
    }
}

#[test]
fn llama_tiny_tp2_loads_strictly_into_megatron_core() {
    check("llama-tiny");
}

#[test]
fn qwen2_tiny_tp2_loads_strictly_into_megatron_core() {
    check("qwen2-tiny");
}

#[test]
fn gpt2_tiny_tp2_loads_strictly_into_megatron_core() {
    check("gpt2-tiny");
}
