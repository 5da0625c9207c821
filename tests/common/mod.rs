//! Helpers for tests that run the real `mflow` binary on fixture specs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct Project {
    pub dir: tempfile::TempDir,
}

impl Project {
    pub fn new(spec: &str) -> Project {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("spec.toml"), spec).unwrap();
        Project { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write_spec(&self, spec: &str) {
        std::fs::write(self.file("spec.toml"), spec).unwrap();
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_mflow"));
        c.args(args).current_dir(self.path()).env("CI", "true").env("MFLOW_KILL_GRACE", "1").env_remove("RUST_LOG");
        c
    }

    pub fn mflow(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    pub fn run(&self, extra: &[&str]) -> Output {
        let mut args = vec!["run", "spec.toml"];
        args.extend_from_slice(extra);
        self.mflow(&args)
    }

    /// Lines appended to a counter file by stages (one line per execution).
    pub fn count(&self, name: &str) -> usize {
        std::fs::read_to_string(self.file(name)).map(|s| s.lines().count()).unwrap_or(0)
    }

    pub fn latest_record(&self) -> serde_json::Value {
        let runs = self.file(".mflow/runs");
        let mut ids: Vec<String> =
            std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
        ids.sort();
        let text = std::fs::read_to_string(runs.join(ids.last().unwrap()).join("run.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    pub fn cache_keys(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.file(".mflow/cache"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

pub fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}
