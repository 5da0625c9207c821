//! A command that writes an output directory on its own (`mflow model`, `convert`, `export`,
//! `dataset`, `output --download`) writes it in a staging directory beside it. Stopped by SIGINT
//! or SIGTERM, it removes that directory and exits as `mflow run` does (130, 143), and what was
//! at the destination stays as it was; what a killed one left (SIGKILL) goes with the next
//! command that writes the same destination. Through the real binary, on inputs large enough to
//! be still written when the signal comes: each test waits until the staging directory holds
//! written bytes.

mod common;

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{code, stderr, Project};
use serde_json::{json, Value};

/// A command started as a shell starts a foreground job, its stderr read on the side.
struct Started {
    child: Child,
    stderr: Option<std::thread::JoinHandle<String>>,
}

fn start(mut cmd: Command) -> Started {
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    // The harness may have been started ignoring SIGINT (a background job of a script), which
    // the command would inherit and keep ignoring, as it should.
    // SAFETY: runs in the child before exec; signal(2) is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            Ok(())
        })
    };
    let mut child = cmd.spawn().unwrap();
    let mut err = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    Started { child, stderr: Some(stderr) }
}

impl Started {
    /// Waits until a staging directory of destination `name` in `dir` has bytes written in it.
    fn writing(&mut self, dir: &Path, name: &str) {
        let t = Instant::now();
        while !staging_of(dir, name).iter().any(|s| written(&dir.join(s))) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("it ended ({status}) before it was signalled: {}", self.stderr.take().unwrap().join().unwrap());
            }
            assert!(t.elapsed() < Duration::from_secs(120), "nothing was written in a staging directory of {name}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signals the process this test started.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits for the exit, at most 30 s; its code (none when a signal ended it) and its stderr.
    fn exit(mut self) -> (Option<i32>, String) {
        let t = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("it did not exit within 30 s of the signal");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        (status.code(), self.stderr.take().unwrap().join().unwrap())
    }
}

/// The names of the staging directories of destination `name` in `dir`.
fn staging_of(dir: &Path, name: &str) -> Vec<String> {
    let prefix = format!(".{name}.staging-");
    let names = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string());
    names.filter(|n| n.starts_with(&prefix)).collect()
}

/// Whether a file under `dir` has something in it.
fn written(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.flatten().any(|e| match e.file_type() {
        Ok(t) if t.is_dir() => written(&e.path()),
        Ok(t) if t.is_file() => e.metadata().is_ok_and(|m| m.len() > 0),
        _ => false,
    })
}

/// Starts `args` in the project, signals it with `sig` while it writes `dest`, and checks that
/// it exits `expected` leaving no staging directory of `dest`.
fn stop_while_writing(p: &Project, args: &[&str], dest: &str, sig: i32, expected: i32) -> String {
    let mut started = start(p.cmd(args));
    started.writing(p.path(), dest);
    started.signal(sig);
    let (exit, err) = started.exit();
    assert_eq!(exit, Some(expected), "{args:?}: {err}");
    assert_eq!(staging_of(p.path(), dest), Vec::<String>::new(), "{args:?} left its staging: {err}");
    assert!(err.contains(&format!(".{dest}.staging-")), "it says what it removed: {err}");
    err
}

fn mflow_ok(p: &Project, args: &[&str]) {
    let o = p.mflow(args);
    assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
}

/// The vocabulary of [`large_model`]: 2 GiB of embedding at a hidden size of 256.
const VOCAB: u64 = 1 << 21;

/// An HF model of 2 GiB that takes almost no room and is made at once: llama-tiny with a
/// vocabulary of [`VOCAB`], its embedding a hole in the file (zeros).
fn large_model(p: &Project, name: &str) {
    mflow_ok(p, &["model", "init:llama-tiny", name]);
    let file = p.file(name).join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let (mut tensors, mut body) = (serde_json::Map::new(), Vec::new());
    for (tensor, t) in header.iter().filter(|(k, _)| *k != "model.embed_tokens.weight") {
        if tensor == "__metadata__" {
            tensors.insert(tensor.clone(), t.clone());
            continue;
        }
        let (s, e) = (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
        let offsets = [body.len(), body.len() + e - s];
        tensors.insert(tensor.clone(), json!({"dtype": t["dtype"], "shape": t["shape"], "data_offsets": offsets}));
        body.extend_from_slice(&data[s..e]);
    }
    let embed = &header["model.embed_tokens.weight"];
    assert_eq!(embed["dtype"], "F32");
    let hidden = embed["shape"][1].as_u64().unwrap();
    let size = VOCAB * hidden * 4;
    let offsets = [body.len() as u64, body.len() as u64 + size];
    tensors.insert(
        "model.embed_tokens.weight".into(),
        json!({"dtype": "F32", "shape": [VOCAB, hidden], "data_offsets": offsets}),
    );
    let mut head = serde_json::to_vec(&tensors).unwrap();
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut f = std::fs::File::create(&file).unwrap();
    f.write_all(&(head.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&head).unwrap();
    f.write_all(&body).unwrap();
    f.set_len(8 + head.len() as u64 + offsets[1]).unwrap();
    let config = p.file(name).join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    c["vocab_size"] = json!(VOCAB);
    std::fs::write(&config, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
}

#[test]
fn model_stopped_by_sigint_removes_its_staging_and_exits_130() {
    let p = Project::new("");
    let err = stop_while_writing(&p, &["model", "init:llama-1b", "big"], "big", libc::SIGINT, 130);
    assert!(err.contains("cancelled (SIGINT)"), "{err}");
    assert!(!p.file("big").exists());
}

/// An empty directory at the destination (as the engine makes one) is left as it was.
#[test]
fn convert_stopped_by_sigterm_leaves_the_destination_as_it_was_and_exits_143() {
    let p = Project::new("");
    large_model(&p, "hf");
    std::fs::create_dir(p.file("sh")).unwrap();
    let err = stop_while_writing(&p, &["convert", "hf", "sh", "--tp", "2"], "sh", libc::SIGTERM, 143);
    assert!(err.contains("interrupted (SIGTERM)"), "{err}");
    assert_eq!(std::fs::read_dir(p.file("sh")).unwrap().count(), 0, "the destination is untouched");
}

#[test]
fn export_stopped_by_sigint_removes_its_staging() {
    let p = Project::new("");
    large_model(&p, "hf");
    mflow_ok(&p, &["convert", "hf", "sh", "--tp", "2"]);
    std::fs::remove_dir_all(p.file("hf")).unwrap();
    stop_while_writing(&p, &["export", "sh", "back"], "back", libc::SIGINT, 130);
    assert!(!p.file("back").exists());
}

/// Lines of words from a few hundred, pseudo-random: a corpus the tokenizer takes seconds on.
fn corpus(path: &Path, bytes: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut text = String::with_capacity(bytes + 100);
    while text.len() < bytes {
        for _ in 0..40 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            text.push_str(&format!("w{}x{} ", x % 97, (x >> 8) % 7));
        }
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// Stopped, it removes its staging; killed, the next run to the same `--out` removes it.
#[test]
fn dataset_stopped_removes_its_staging_and_the_next_run_sweeps_a_killed_ones() {
    let p = Project::new("");
    mflow_ok(&p, &["model", "init:llama-tiny", "tok"]);
    corpus(&p.file("corpus.txt"), 24 << 20);
    let args = |input: &'static str| {
        [
            "dataset",
            input,
            "--tokenizer",
            "tok/tokenizer.json",
            "--out",
            "out",
            "--split-by",
            "line",
            "--word-memo-mib",
            "0",
        ]
    };
    stop_while_writing(&p, &args("corpus.txt"), "out", libc::SIGTERM, 143);
    stop_while_writing(&p, &args("corpus.txt"), "out", libc::SIGINT, 130);
    assert!(!p.file("out").exists());

    let mut killed = start(p.cmd(&args("corpus.txt")));
    killed.writing(p.path(), "out");
    killed.signal(libc::SIGKILL);
    assert_eq!(killed.exit().0, None);
    let left = staging_of(p.path(), "out");
    assert_eq!(left.len(), 1, "SIGKILL leaves it: {left:?}");
    std::fs::write(p.file("small.txt"), "a few words\nand a few more\n").unwrap();
    mflow_ok(&p, &args("small.txt"));
    assert!(p.file("out/train.bin").is_file());
    assert_eq!(staging_of(p.path(), "out"), Vec::<String>::new(), "the next run removes what the killed one left");
}

#[test]
fn output_download_stopped_by_sigint_removes_its_staging() {
    let p = Project::new(
        "[pipeline]\nname = \"outs\"\n\n[stages.big]\nkind = \"command\"\n\
         run = [\"sh\", \"-c\", \"echo ok > $MFLOW_OUTPUT/a-small && truncate -s 1G $MFLOW_OUTPUT/zeros\"]\n",
    );
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    stop_while_writing(&p, &["output", "spec.toml", "big", "--download", "got"], "got", libc::SIGINT, 130);
    assert!(!p.file("got").exists());
}
