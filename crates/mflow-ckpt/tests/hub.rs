//! Hub downloads against a local server on 127.0.0.1 that imitates the two Hub endpoints mflow
//! uses: `api/models/{repo}/revision/{rev}?blobs=true` and `{repo}/resolve/{rev}/{file}`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use mflow_ckpt::hub::{download_with, resolve_with, Backoff, HubConfig};
use mflow_ckpt::{presets, CkptError};
use mflow_untrusted::budget::Budget;
use miette::Diagnostic;
use sha2::{Digest, Sha256};

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_test_secret_token";

#[derive(Debug, Clone)]
struct Seen {
    path: String,
    at: std::time::Instant,
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
    /// List this many more files, of names mflow does not fetch.
    extra_files: usize,
    /// Answer this status to the first requests whose path contains the key, as many times as
    /// its count says.
    fail: Mutex<BTreeMap<String, (u16, usize)>>,
}

impl Hub {
    fn new(files: BTreeMap<String, Vec<u8>>) -> Hub {
        Hub {
            files,
            wrong_sha: None,
            truncate_once: Mutex::new(None),
            seen: Mutex::new(Vec::new()),
            unsized_file: None,
            extra_files: 0,
            fail: Mutex::new(BTreeMap::new()),
        }
    }

    fn fetched(&self) -> Vec<String> {
        self.seen.lock().unwrap().iter().filter(|s| s.path.contains("/resolve/")).map(|s| s.path.clone()).collect()
    }
}

/// Git's id of a blob of these bytes.
fn git_blob_id(data: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", data.len()).as_bytes());
    h.update(data);
    hex::encode(h.finalize())
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
    hub.seen.lock().unwrap().push(Seen {
        path: path.clone(),
        at: std::time::Instant::now(),
        range: range.clone(),
        auth,
    });
    let respond = |stream: &mut TcpStream, status: &str, headers: &str, body: &[u8], send: usize| {
        let head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n", body.len());
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(&body[..send]);
    };
    let failing = hub.fail.lock().unwrap().iter_mut().find(|(k, (_, n))| path.contains(k.as_str()) && *n > 0).map(
        |(_, (status, n))| {
            *n -= 1;
            *status
        },
    );
    if let Some(status) = failing {
        respond(&mut stream, &format!("{status} Failing"), "", b"", 0);
        return;
    }
    if path == "/api/models/org/tiny/revision/main?blobs=true" {
        let siblings: Vec<_> = hub
            .files
            .iter()
            .map(|(name, data)| {
                let sha = hub
                    .wrong_sha
                    .clone()
                    .filter(|_| name == "model.safetensors")
                    .unwrap_or_else(|| hex::encode(Sha256::digest(data)));
                let lfs = name.ends_with(".safetensors") || name.ends_with(".bin");
                let mut s = serde_json::json!({"rfilename": name, "size": data.len(), "blobId": git_blob_id(data)});
                if lfs {
                    s["lfs"] = serde_json::json!({"sha256": sha, "size": data.len(), "pointerSize": 134});
                }
                if hub.unsized_file.as_deref() == Some(name) {
                    s = serde_json::json!({"rfilename": name});
                }
                s
            })
            .chain((0..hub.extra_files).map(|i| serde_json::json!({"rfilename": format!("x{i}.txt"), "size": 0})))
            .collect();
        let body =
            serde_json::to_vec(&serde_json::json!({"id": "org/tiny", "sha": SHA, "siblings": siblings})).unwrap();
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
    let mut files: BTreeMap<String, Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    files.insert("pytorch_model.bin".into(), b"pickle: must not be fetched".to_vec());
    files.insert("README.md".into(), b"# tiny".to_vec());
    files
}

fn config(endpoint: String, cache: &Path) -> HubConfig {
    HubConfig {
        endpoint,
        token: Some(TOKEN.into()),
        cache: cache.to_path_buf(),
        retry: Backoff {
            attempts: 4,
            base: std::time::Duration::from_millis(20),
            max: std::time::Duration::from_millis(200),
        },
        max_file_bytes: mflow_ckpt::hub::DEFAULT_MAX_FILE_BYTES,
        memory: Budget::parse("1GiB").unwrap(),
    }
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
        extra_files: 0,
        fail: Mutex::new(BTreeMap::new()),
    });
    let cfg = config(serve(hub.clone()), &tmp.path().join("cache"));
    assert_eq!(resolve_with(&cfg, "hf://org/tiny").unwrap(), SHA);
    let dst = tmp.path().join("model");
    // The only test of this binary that sets it: the bytes fetched twice count once.
    let progress = tmp.path().join("progress.jsonl");
    std::env::set_var(mflow_progress::ENV, &progress);
    download_with(&cfg, "hf://org/tiny", &dst).unwrap();
    std::env::remove_var(mflow_progress::ENV);
    let events: Vec<mflow_progress::Event> =
        std::fs::read_to_string(&progress).unwrap().lines().filter_map(mflow_progress::Event::parse).collect();
    let total = events[0].total.unwrap();
    assert!(events.iter().all(|e| e.done <= total) && events.last().unwrap().done == total, "{events:?}");

    for name in
        ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    {
        assert!(std::fs::read(dst.join(name)).unwrap() == files[name], "{name}");
    }
    assert!(!dst.join("pytorch_model.bin").exists() && !dst.join("README.md").exists());
    let seen = hub.seen.lock().unwrap().clone();
    let ranged: Vec<&Seen> =
        seen.iter().filter(|s| s.path.ends_with("/model.safetensors") && s.range.is_some()).collect();
    let half = files["model.safetensors"].len() / 2;
    assert_eq!(ranged.len(), 1, "{seen:?}");
    assert_eq!(ranged[0].range.as_deref(), Some(format!("bytes={half}-").as_str()));
    assert!(seen.iter().all(|s| !s.path.ends_with("pytorch_model.bin")));
    assert!(seen.iter().all(|s| s.auth.as_deref() == Some(&format!("Bearer {TOKEN}"))));
    // Nothing partial is left, in the cache or beside the model.
    let blobs = tmp.path().join("cache/models--org--tiny/blobs");
    let left: Vec<_> = std::fs::read_dir(&blobs).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().contains("incomplete")), "{left:?}");
    let beside: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(beside.iter().all(|n| !n.to_string_lossy().starts_with(".model")), "{beside:?}");
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
        extra_files: 0,
        fail: Mutex::new(BTreeMap::new()),
    });
    let cfg = config(serve(hub), &tmp.path().join("cache"));
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
    let tmp = tempfile::tempdir().unwrap();
    let hub = Arc::new(Hub {
        files: BTreeMap::new(),
        wrong_sha: None,
        truncate_once: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        unsized_file: None,
        extra_files: 0,
        fail: Mutex::new(BTreeMap::new()),
    });
    let cfg = config(serve(hub), &tmp.path().join("cache"));
    let err = resolve_with(&cfg, "hf://org/missing@v1").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("404") && text.contains("/api/models/org/missing/revision/v1"), "{text}");
    for bad in ["hf://../etc", "hf://org/name/extra", "hf://org/na me", "hf://org/x@../../main"] {
        assert!(resolve_with(&cfg, bad).is_err(), "{bad}");
    }
}

#[test]
fn a_pinned_commit_needs_no_network_and_an_outage_is_told_apart_from_a_wrong_name() {
    let tmp = tempfile::tempdir().unwrap();
    // Nothing listens here: a request would fail.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let cfg = config(format!("http://{closed}"), &tmp.path().join("cache"));
    let pinned = format!("hf://org/tiny@{}", SHA.to_uppercase());
    assert_eq!(resolve_with(&cfg, &pinned).unwrap(), SHA);
    let outage = resolve_with(&cfg, "hf://org/tiny").unwrap_err();
    assert!(mflow_ckpt::hub_unavailable(&outage), "{outage}");

    let hub = Arc::new(Hub {
        files: BTreeMap::new(),
        wrong_sha: None,
        truncate_once: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        unsized_file: None,
        extra_files: 0,
        fail: Mutex::new(BTreeMap::new()),
    });
    let missing = resolve_with(&config(serve(hub), &tmp.path().join("cache")), "hf://org/missing@v1").unwrap_err();
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
        extra_files: 0,
        fail: Mutex::new(BTreeMap::new()),
    });
    let dst = tmp.path().join("model");
    let err = download_with(&config(serve(hub.clone()), &tmp.path().join("cache")), "hf://org/tiny", &dst).unwrap_err();
    assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::hub::no_size", "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    assert_eq!(fetched(&hub), 0);
    assert!(!dst.exists());

    let hub = Arc::new(Hub {
        files,
        wrong_sha: None,
        truncate_once: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        unsized_file: None,
        extra_files: 0,
        fail: Mutex::new(BTreeMap::new()),
    });
    let cfg = HubConfig { max_file_bytes: 1000, ..config(serve(hub.clone()), &tmp.path().join("cache")) };
    let err = download_with(&cfg, "hf://org/tiny", &dst).unwrap_err();
    assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::hub::too_large", "{err}");
    assert!(err.to_string().contains("more than the 1000 accepted"), "{err}");
    assert_eq!(fetched(&hub), 0);
    assert!(!dst.exists());
}

/// A file list of 700,000 entries (26 MB, under the 32 MiB cap on the answer) would hold about
/// 260 MB as a JSON value: past the budget it is refused before it is read, with the figure;
/// within it, the download goes on.
#[test]
fn a_file_list_past_the_memory_budget_is_refused_before_it_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Arc::new(Hub {
        files: repo_files(tmp.path()),
        wrong_sha: None,
        truncate_once: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        unsized_file: None,
        extra_files: 700_000,
        fail: Mutex::new(BTreeMap::new()),
    });
    let endpoint = serve(hub.clone());
    let dst = tmp.path().join("model");
    let cfg =
        HubConfig { memory: Budget::parse("64MiB").unwrap(), ..config(endpoint.clone(), &tmp.path().join("cache")) };
    let err = download_with(&cfg, "hf://org/tiny", &dst).unwrap_err();
    assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::memory", "{err}");
    let text = err.to_string();
    eprintln!("{text}");
    assert!(
        text.starts_with(&format!(
            "{endpoint}/api/models/org/tiny/revision/main?blobs=true: reading it would need about "
        )) && text.contains("the file list: ")
            && text.ends_with("more than the memory budget of 64.0 MiB (MFLOW_MEMORY_BUDGET)"),
        "{text}"
    );
    assert!(err.help().unwrap().to_string().contains("MFLOW_MEMORY_BUDGET=64GiB"), "{err:?}");
    assert!(!hub.seen.lock().unwrap().iter().any(|s| s.path.contains("/resolve/")));
    assert!(!dst.exists());
    // The same list within the budget: the wanted files are fetched and the model checks out.
    download_with(&config(endpoint, &tmp.path().join("cache")), "hf://org/tiny", &dst).unwrap();
    assert!(dst.join("model.safetensors").is_file());
}

/// The cache is the one transformers uses: `models--ORG--NAME/blobs/<sha256 or git blob id>`,
/// `snapshots/<commit>/<file>` linking to `../../blobs/<etag>`, `refs/main` holding the commit.
#[test]
fn downloads_land_in_the_hugging_face_cache_layout_and_are_taken_from_it_next_time() {
    let tmp = tempfile::tempdir().unwrap();
    let files = repo_files(tmp.path());
    let hub = Arc::new(Hub::new(files.clone()));
    let cache = tmp.path().join("cache");
    let cfg = config(serve(hub.clone()), &cache);
    download_with(&cfg, "hf://org/tiny", &tmp.path().join("model")).unwrap();
    let repo = cache.join("models--org--tiny");
    assert_eq!(std::fs::read_to_string(repo.join("refs/main")).unwrap(), SHA);
    let wanted =
        ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"];
    for name in wanted {
        let data = &files[name];
        let etag = if name.ends_with(".safetensors") { hex::encode(Sha256::digest(data)) } else { git_blob_id(data) };
        let pointer = repo.join("snapshots").join(SHA).join(name);
        assert_eq!(std::fs::read_link(&pointer).unwrap(), Path::new("../../blobs").join(&etag), "{name}");
        assert!(std::fs::read(repo.join("blobs").join(&etag)).unwrap() == *data, "{name}");
        assert!(std::fs::read(&pointer).unwrap() == *data, "{name}");
    }
    // Every file fetched (not the pickle, not the README) has its link, and each was fetched once.
    let mut snapshot: Vec<String> = std::fs::read_dir(repo.join("snapshots").join(SHA))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    snapshot.sort();
    let fetchable: Vec<String> =
        files.keys().filter(|n| !["pytorch_model.bin", "README.md"].contains(&n.as_str())).cloned().collect();
    assert_eq!(snapshot, fetchable);
    assert_eq!(hub.fetched().len(), fetchable.len(), "{:?}", hub.fetched());
    // The token goes into no file of the cache.
    for e in std::fs::read_dir(repo.join("blobs")).unwrap() {
        assert!(!String::from_utf8_lossy(&std::fs::read(e.unwrap().path()).unwrap()).contains(TOKEN));
    }

    // A second model from the same cache fetches nothing but the file list.
    let again = Arc::new(Hub::new(files.clone()));
    download_with(&config(serve(again.clone()), &cache), "hf://org/tiny", &tmp.path().join("model2")).unwrap();
    assert_eq!(again.fetched(), Vec::<String>::new());
    for name in wanted {
        assert!(std::fs::read(tmp.path().join("model2").join(name)).unwrap() == files[name], "{name}");
    }

    // A blob changed in place (same size) is not trusted: it is fetched again and mended.
    let etag = hex::encode(Sha256::digest(&files["model.safetensors"]));
    let blob = repo.join("blobs").join(&etag);
    let mut bytes = std::fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::remove_file(&blob).unwrap();
    std::fs::write(&blob, &bytes).unwrap();
    let third = Arc::new(Hub::new(files.clone()));
    download_with(&config(serve(third.clone()), &cache), "hf://org/tiny", &tmp.path().join("model3")).unwrap();
    assert_eq!(third.fetched(), vec![format!("/org/tiny/resolve/{SHA}/model.safetensors")]);
    assert!(std::fs::read(&blob).unwrap() == files["model.safetensors"]);
    assert!(std::fs::read(tmp.path().join("model3/model.safetensors")).unwrap() == files["model.safetensors"]);
}

/// A cache filled by another program in the same layout (as transformers leaves it) is used,
/// and a hash that is not a hash is refused before it can name a path.
#[test]
fn a_cache_another_program_filled_is_used_and_hashes_must_be_hashes() {
    let tmp = tempfile::tempdir().unwrap();
    let files = repo_files(tmp.path());
    let cache = tmp.path().join("cache");
    let repo = cache.join("models--org--tiny");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots").join(SHA)).unwrap();
    for (name, data) in &files {
        let etag = if name.ends_with(".safetensors") || name.ends_with(".bin") {
            hex::encode(Sha256::digest(data))
        } else {
            git_blob_id(data)
        };
        std::fs::write(repo.join("blobs").join(&etag), data).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&etag), repo.join("snapshots").join(SHA).join(name))
            .unwrap();
    }
    let hub = Arc::new(Hub::new(files.clone()));
    download_with(&config(serve(hub.clone()), &cache), "hf://org/tiny", &tmp.path().join("model")).unwrap();
    assert_eq!(hub.fetched(), Vec::<String>::new());

    let hub = Arc::new(Hub { wrong_sha: Some("../../../../etc/passwd".into()), ..Hub::new(files) });
    let err = download_with(&config(serve(hub.clone()), &cache), "hf://org/tiny", &tmp.path().join("bad")).unwrap_err();
    assert_eq!(err.code().unwrap().to_string(), "mflow::ckpt::hub::etag", "{err}");
    assert!(
        err.to_string().contains("model.safetensors: the Hub lists ../../../../etc/passwd as its lfs.sha256"),
        "{err}"
    );
    assert_eq!(hub.fetched(), Vec::<String>::new());
}

/// A 503 or 429 is tried again after waits that grow (with jitter); a 404 is not tried again.
#[test]
fn failures_that_may_pass_are_tried_again_after_growing_waits() {
    let tmp = tempfile::tempdir().unwrap();
    let files = repo_files(tmp.path());
    let hub = Arc::new(Hub::new(files));
    hub.fail.lock().unwrap().insert("/api/models/".into(), (503, 2));
    hub.fail.lock().unwrap().insert("/model.safetensors".into(), (429, 3));
    let mut cfg = config(serve(hub.clone()), &tmp.path().join("cache"));
    cfg.retry =
        Backoff { attempts: 4, base: std::time::Duration::from_millis(100), max: std::time::Duration::from_secs(1) };
    download_with(&cfg, "hf://org/tiny", &tmp.path().join("model")).unwrap();
    let seen = hub.seen.lock().unwrap().clone();
    let times = |key: &str| seen.iter().filter(|s| s.path.contains(key)).map(|s| s.at).collect::<Vec<_>>();
    let (api, st) = (times("/api/models/"), times("/model.safetensors"));
    assert_eq!((api.len(), st.len()), (3, 4), "{seen:?}");
    // Waits of [50, 100], [100, 200] and [200, 400] ms after the first, second and third failure.
    let gaps: Vec<u128> = st.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
    for (gap, (lo, hi)) in gaps.iter().zip([(50, 150), (100, 300), (200, 600)]) {
        assert!((lo..hi).contains(gap), "{gaps:?}");
    }

    // Tried four times in all, then the failure is told.
    let hub = Arc::new(Hub::new(BTreeMap::new()));
    hub.fail.lock().unwrap().insert("/api/models/".into(), (503, 10));
    let err = resolve_with(&config(serve(hub.clone()), &tmp.path().join("cache")), "hf://org/tiny").unwrap_err();
    assert!(err.to_string().ends_with("the Hub answered 503"), "{err}");
    assert_eq!(hub.seen.lock().unwrap().len(), 4);
    // A wrong name is asked once.
    let hub = Arc::new(Hub::new(BTreeMap::new()));
    resolve_with(&config(serve(hub.clone()), &tmp.path().join("cache")), "hf://org/missing@v1").unwrap_err();
    assert_eq!(hub.seen.lock().unwrap().len(), 1);
}

/// What mflow put in the cache is what transformers finds there offline, and huggingface_hub's
/// own scan of the cache reads it without a warning. Needs `MFLOW_PYTHON` (torch, transformers).
#[test]
fn transformers_loads_offline_what_mflow_downloaded() {
    let python = std::env::var("MFLOW_PYTHON").unwrap_or_else(|_| {
        panic!("MFLOW_PYTHON is not set: point it at a Python with torch and transformers to run the Hub cache test")
    });
    let tmp = tempfile::tempdir().unwrap();
    let files = repo_files(tmp.path());
    let cache = tmp.path().join("cache");
    download_with(&config(serve(Arc::new(Hub::new(files))), &cache), "hf://org/tiny", &tmp.path().join("model"))
        .unwrap();
    let script = r#"
import json, sys
from huggingface_hub import scan_cache_dir
from transformers import AutoModelForCausalLM, AutoTokenizer
cache = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained("org/tiny", cache_dir=cache, local_files_only=True)
tok = AutoTokenizer.from_pretrained("org/tiny", cache_dir=cache, local_files_only=True)
scan = scan_cache_dir(cache)
repo = next(iter(scan.repos))
print(json.dumps({
    "params": sum(p.numel() for p in model.parameters()),
    "ids": tok("hello world")["input_ids"],
    "warnings": [str(w) for w in scan.warnings],
    "repo": repo.repo_id,
    "refs": sorted(r for rev in repo.revisions for r in rev.refs),
    "commit": next(iter(repo.revisions)).commit_hash,
    "files": sorted(f.file_name for rev in repo.revisions for f in rev.files),
}))
"#;
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .arg(&cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run MFLOW_PYTHON");
    assert!(out.status.success(), "python failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert!(v["params"].as_u64().unwrap() > 0 && !v["ids"].as_array().unwrap().is_empty(), "{v}");
    assert_eq!(v["warnings"], serde_json::json!([]), "{v}");
    assert_eq!((v["repo"].as_str(), v["commit"].as_str()), (Some("org/tiny"), Some(SHA)), "{v}");
    assert_eq!(v["refs"], serde_json::json!(["main"]), "{v}");
    assert!(v["files"].as_array().unwrap().iter().any(|f| f == "model.safetensors"), "{v}");
}
