//! `mflow doctor` probes the environment the stages get: a module that only the user's
//! PYTHONPATH provides (megatron-core from a checkout, blake3 from a site of wheels) is found
//! and reported with its version. (That its PYTHONPATH is a stage's, variable for variable, is
//! checked against a real stage in tests/engine_choice.rs.)

mod common;

use common::{code, stderr, stdout, Project};
use serde_json::Value;

#[test]
fn doctor_finds_modules_on_the_pythonpath_the_stages_get() {
    let Ok(python) = which("python3") else {
        eprintln!("skipped: no python3 on PATH");
        return;
    };
    let p = Project::new("");
    let site = p.file("site");
    for (dir, version) in
        [("megatron", None), ("megatron/core", Some("0.13.0rc0+fake")), ("blake3", Some("9.9.9+fake"))]
    {
        std::fs::create_dir_all(site.join(dir)).unwrap();
        let init = version.map(|v| format!("__version__ = \"{v}\"\n")).unwrap_or_default();
        std::fs::write(site.join(dir).join("__init__.py"), init).unwrap();
    }
    let o = p
        .cmd(&["doctor"])
        .env("MFLOW_PYTHON", &python)
        .env("MFLOW_HOME", p.file("home"))
        .env("PYTHONPATH", &site)
        .env("CUDA_VISIBLE_DEVICES", "0")
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    let report: Value =
        out.lines().find_map(|l| serde_json::from_str(l).ok()).unwrap_or_else(|| panic!("no JSON report in {out}"));
    assert_eq!(report["megatron_core"], "0.13.0rc0+fake", "{report}");
    assert_eq!(report["blake3"], "9.9.9+fake", "{report}");
    // One GPU by index; a name and memory too where torch or nvidia-smi knows them.
    assert!(out.lines().any(|l| l.starts_with("gpus: 1 visible (index 0")), "{out}");
    assert!(!out.contains("gpus visible:"), "{out}");
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file()))
        .ok_or(())
}
