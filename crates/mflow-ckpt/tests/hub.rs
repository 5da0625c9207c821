//! Hub downloads against a local server on 127.0.0.1 that imitates the two Hub endpoints mflow
//! uses: `api/models/{repo}/revision/{rev}?blobs=true` and `{repo}/resolve/{rev}/{file}`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use miette::Diagnostic;
use mflow_ckpt::hub::{download_with, resolve_with, HubConfig};
use mflow_ckpt::{presets, CkptError};
use sha2::{Digest, Sha256};

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_test_secret_token";

#[derive(Debug, Clone)]
struct Seen {
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

struct Hub {
    files: BTreeMap<String, Vec<u8>>,
    /// sha256 to advertise instead of the real one.
    wrong_sha: Option<String>,
    /// Cut the first response for this file in half.
    truncate_once: Mutex<Option<String>>,
    seen: Mutex<Vec<Seen>>,
    /// List this file without any size.
    unsized_file: Option<String>,
}

fn serve(hub: Arc<Hub>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let hub = hub.clone();
            std::thread::spawn(move || handle(&hub, stream.unwrap()));
        }
    });
    addr
}

fn handle(hub: &Hub, mut stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let path = line.split(' ').nth(1).unwrap_or("").to_string();
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
            break;
        }
        let (k, v) = h.trim_end().split_once(": ").unwrap_or(("", ""));
        match k.to_ascii_lowercase().as_str() {
            "range" => range = Some(v.to_string()),
            "authorization" => auth = Some(v.to_string()),
            _ => {}
        }
    }
    hub.seen.lock().unwrap().push(Seen { path: path.clone(), range: range.clone(), auth });
    let respond = |stream: &mut TcpStream, status: &str, headers: &str, body: &[u8], send: usize| {
        let head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n", body.len());
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(&body[..send]);
    };
    if path == "/api/models/org/tiny/revision/main?blobs=true" {
        let siblings: Vec<_> = hub
            .files
            .iter()
            .map(|(name, data)| {
                let sha = hub.wrong_sha.clone().filter(|_| name == "model.safetensors").unwrap_or_else(|| hex::encode(Sha256::digest(data)));
                let lfs = name.ends_with(".safetensors") || name.ends_with(".bin");
                let mut s = serde_json::json!({"rfilename": name, "size": data.len()});
                if lfs {
                    s["lfs"] = serde_json::json!({"sha256": sha, "size": data.len(), "pointerSize": 134});
                }
                if hub.unsized_file.as_deref() == Some(name) {
                    s = serde_json::json!({"rfilename": name});
                }
                s
            })
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({"id": "org/tiny", "sha": SHA, "siblings": siblings})).unwrap();
        respond(&mut stream, "200 OK", "Content-Type: application/json\r\n", &body, body.len());
        return;
    }
    let Some(file) = path.strip_prefix(&format!("/org/tiny/resolve/{SHA}/")) else {
        respond(&mut stream, "404 Not Found", "", b"", 0);
        return;
    };
    let Some(data) = hub.files.get(file) else {
        respond(&mut stream, "404 Not Found", "", b"", 0);
        return;
    };
    if let Some(r) = range {
        let start: usize = r.trim_start_matches("bytes=").trim_end_matches('-').parse().unwrap();
        let body = &data[start..];
        let cr = format!("Content-Range: bytes {start}-{}/{}\r\n", data.len() - 1, data.len());
        respond(&mut stream, "206 Partial Content", &cr, body, body.len());
        return;
    }
    let mut cut = hub.truncate_once.lock().unwrap();
    if cut.as_deref() == Some(file) {
        *cut = None;
        // Promise the whole file, send half, hang up.
        respond(&mut stream, "200 OK", "", data, data.len() / 2);
        return;
    }
    respond(&mut stream, "200 OK", "", data, data.len());
}

fn repo_files(tmp: &Path) -> BTreeMap<String, Vec<u8>> {
    let dir = tmp.join("origin");
    presets::write(&presets::preset("llama-tiny").unwrap(), &dir, 4).unwrap();
    let mut files: BTreeMap<String, Vec<u8>> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap()).map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())).collect();
    files.insert("pytorch_model.bin".into(), b"pickle: must not be fetched".to_vec());
    files.insert("README.md".into(), b"# tiny".to_vec());
    files
}

fn config(endpoint: String) -> HubConfig {
    HubConfig { endpoint, token: Some(TOKEN.into()), resume_root: None, max_file_bytes: mflow_ckpt::hub::DEFAULT_MAX_FILE_BYTES }
}

#[test]
fn interrupted_download_is_resumed_with_a_range_request() {
    let tmp = tempfile::tempdir().unwrap();
    let files = repo_files(tmp.path());
    let hub = Arc::new(Hub {
        files: files.clone(),
        wrong_sha: None,
        truncate_once: Mutex::new(Some("model.safetensors".into())),
        seen: Mutex::new(Vec::new()),
        unsized_file: None,
    });
    let cfg = config(serve(hub.clone()));
    assert_eq!(resolve_with(&cfg, "hf://org/tiny").unwrap(), SHA);
    let dst = tmp.path().join("model");
    download_with(&cfg, "hf://org/tiny", &dst).unwrap();

    for name in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(std::fs::read(dst.join(name)).unwrap() == files[name], "{name}");
    }
    assert!(!dst.join("pytorch_model.bin").exists() && !dst.join("README.md").exists());
    let seen = hub.seen.lock().unwrap().clone();
    let ranged: Vec<&Seen> = seen.iter().filter(|s| s.path.ends_with("/model.safetensors") && s.range.is_some()).collect();
    let half = files["model.safetensors"].len() / 2;
    assert_eq!(ranged.len(), 1, "{seen:?}");
    assert_eq!(ranged[0].range.as_deref(), Some(format!("bytes={half}-").as_str()));
    assert!(seen.iter().all(|s| !s.path.ends_with("pytorch_model.bin")));
    assert!(seen.iter().all(|s| s.auth.as_deref() == Some(&format!("Bearer {TOKEN}"))));
    // The resume directory is cleaned up after success.
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().contains("download")), "{left:?}");
}

#[test]
fn sha256_mismatch_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Arc::new(Hub {
        files: repo_files(tmp.path()),
        wrong_sha: Some("ab".repeat(32)),
        truncate_once: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        unsized_file: None,
    });
    let cfg = config(serve(hub));
    let dst = tmp.path().join("model");
    let err = download_with(&cfg, "hf://org/tiny", &dst).unwrap_err();
    assert!(!dst.exists());
    let text = format!("{}\n{err}\nhelp: {}", err.code().unwrap(), err.help().unwrap());
    assert!(!text.contains(TOKEN) && !format!("{err:?}").contains(TOKEN));
    assert!(matches!(err, CkptError::Hub(_)));
    let found = hex::encode(Sha256::digest(std::fs::read(tmp.path().join("origin/model.safetensors")).unwrap()));
    insta::assert_snapshot!(text.replace(&found, "[SHA256 OF THE FILE]"));
}

#[test]
fn unknown_model_and_bad_references_are_refused() {
    let hub = Arc::new(Hub { files: BTreeMap::new(), wrong_sha: None, truncate_once: Mutex::new(None), seen: Mutex::new(Vec::new()), unsized_file: None });
    let cfg = config(serve(hub));
    let err = resolve_with(&cfg, "hf://org/missing@v1").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("404") && text.contains("/api/models/org/missing/revision/v1"), "{text}");
    for bad in ["hf://../etc", "hf://org/name/extra", "hf://org/na me", "hf://org/x@../../main"] {
        assert!(resolve_with(&cfg, bad).is_err(), "{bad}");
    }
}

#[test]
fn a_pinned_commit_needs_no_network_and_an_outage_is_told_apart_from_a_wrong_name() {
    // Nothing listens here: a request would fail.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let cfg = config(format!("http://{closed}"));
    let pinned = format!("hf://org/tiny@{}", SHA.to_uppercase());
    assert_eq!(resolve_with(&cfg, &pinned).unwrap(), SHA);
    let outage = resolve_with(&cfg, "hf://org/tiny").unwrap_err();
    assert!(mflow_ckpt::hub_unavailable(&outage), "{outage}");

    let hub = Arc::new(Hub { files: BTreeMap::new(), wrong_sha: None, truncate_once: Mutex::new(None), seen: Mutex::new(Vec::new()), unsized_file: None });
    let missing = resolve_with(&config(serve(hub)), "hf://org/missing@v1").unwrap_err();
    assert!(!mflow_ckpt::hub_unavailable(&missing), "a 404 is the spec's fault: {missing}");
}

/// Files are fetched only against a listed size within the configured maximum, so a mirror
/// cannot stream without end into the resume directory.
#[test]
fn files_without_a_size_or_over_the_maximum_are_not_downloaded() {
    let tmp = tempfile::tempdir().unwrap();
    let files = repo_files(tmp.path());
    let fetched = |hub: &Hub| hub.seen.lock().unwrap().iter().filter(|s| s.path.contains("/resolve/")).count();

    let hub = Arc::new(Hub {
        files: files.clone(),
        wrong_sha: None,
        truncate_once: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        unsized_file: Some("tokenizer.json".into()),
    });
    let dst = tmp.path().join("model");
    let err = download_with(&config(serve(hub.clone())), "hf://org/tiny", &dst).unwrap_err();
    assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::hub::no_size", "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    assert_eq!(fetched(&hub), 0);
    assert!(!dst.exists());

    let hub = Arc::new(Hub { files, wrong_sha: None, truncate_once: Mutex::new(None), seen: Mutex::new(Vec::new()), unsized_file: None });
    let cfg = HubConfig { max_file_bytes: 1000, ..config(serve(hub.clone())) };
    let err = download_with(&cfg, "hf://org/tiny", &dst).unwrap_err();
    assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::hub::too_large", "{err}");
    assert!(err.to_string().contains("more than the 1000 accepted"), "{err}");
    assert_eq!(fetched(&hub), 0);
    assert!(!dst.exists());
}
