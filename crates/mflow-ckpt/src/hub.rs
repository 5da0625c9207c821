//! `hf://ORG/NAME[@REV]`: downloads from the Hugging Face Hub.
//!
//! Only safetensors, JSON and tokenizer files are fetched, in parallel, pinned to the commit
//! the revision resolves to, into the Hugging Face cache ([`cache`]: `HF_HUB_CACHE`, else
//! `HF_HOME/hub`, else `~/.cache/huggingface/hub`) in the layout transformers uses, so that a
//! model either downloaded is not downloaded again. A partial blob is continued with HTTP Range
//! requests; every blob, downloaded or found, is checked against the sha256 (LFS files) or git
//! blob id the Hub lists. The files are then placed in the destination (hard links where the
//! file system allows), validated as a Hugging Face model, and renamed into place. A request
//! that fails in a way that may pass is tried again after a growing, jittered wait ([`retry`]).
//! The token is sent, never printed.
//!
//! Every file is downloaded against the size the Hub lists for it: a file listed without a
//! size is refused, and so is one larger than `MFLOW_HUB_MAX_FILE_BYTES` (default
//! [`DEFAULT_MAX_FILE_BYTES`]), so a hostile or broken mirror cannot fill the disk.

pub mod cache;
pub mod retry;

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use mflow_progress::Reporter;
use mflow_untrusted::budget::{Budget, Need};
use mflow_untrusted::json;
use miette::Diagnostic;
use rayon::prelude::*;
use serde::Deserialize;
use thiserror::Error;

use self::cache::{Check, RepoCache};
pub use self::retry::Backoff;

use crate::error::{io, CkptError};
use crate::hf::{is_plain_name, TOKENIZER_FILES};
use crate::writer::Staging;

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Largest API response accepted (the file list of a model repository).
const MAX_API_BYTES: u64 = 32 << 20;
/// Largest single file downloaded unless `MFLOW_HUB_MAX_FILE_BYTES` says otherwise; the Hub's
/// safetensors shards are usually 5 GB or less.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 100_000_000_000;
const PARALLEL: usize = 8;

#[derive(Debug, Error, Diagnostic)]
pub enum HubError {
    #[error("`{source_spec}` is not a Hub model reference")]
    #[diagnostic(
        code(mflow::ckpt::hub::source),
        help("write hf://ORG/NAME or hf://ORG/NAME@REVISION (letters, digits, '.', '_', '-')")
    )]
    BadSource { source_spec: String },

    #[error("{url}: {reason}")]
    #[diagnostic(code(mflow::ckpt::hub::http), help("check the network, HF_ENDPOINT, and that the model and revision exist; gated or private models need HF_TOKEN"))]
    Http { url: String, reason: String },

    #[error("{url}: the Hub answered {status}")]
    #[diagnostic(
        code(mflow::ckpt::hub::status),
        help("401/403: set HF_TOKEN to a token that can read this model; 404: check the name and revision")
    )]
    Status { url: String, status: u16 },

    #[error("{url}: unexpected answer: {reason}")]
    #[diagnostic(
        code(mflow::ckpt::hub::api),
        help("HF_ENDPOINT must point at a Hugging Face Hub (or a compatible mirror)")
    )]
    Api { url: String, reason: String },

    #[error("{file}: sha256 is {found} but the Hub lists {expected}")]
    #[diagnostic(
        code(mflow::ckpt::hub::sha256),
        help("the download was corrupted or the mirror serves other bytes; run again to download the file afresh")
    )]
    Sha256 { file: String, expected: String, found: String },

    #[error("{file}: git blob id is {found} but the Hub lists {expected}")]
    #[diagnostic(
        code(mflow::ckpt::hub::blob_id),
        help("the download was corrupted or the mirror serves other bytes; run again to download the file afresh")
    )]
    BlobId { file: String, expected: String, found: String },

    #[error("{file}: the Hub lists {} as its {what}, which is not a hash", crate::untrusted::excerpt(.value))]
    #[diagnostic(
        code(mflow::ckpt::hub::etag),
        help("HF_ENDPOINT must point at a Hugging Face Hub (or a compatible mirror)")
    )]
    BadHash { file: String, what: &'static str, value: String },

    #[error("{file}: received {found} bytes but the Hub lists {expected}")]
    #[diagnostic(code(mflow::ckpt::hub::size), help("run again; the partial file is resumed"))]
    Size { file: String, expected: u64, found: u64 },

    #[error("{file}: the Hub lists no size for it")]
    #[diagnostic(code(mflow::ckpt::hub::no_size), help("mflow downloads only files of known size, so that a download cannot grow without bound; check HF_ENDPOINT points at a Hugging Face Hub (its API lists every size)"))]
    NoSize { file: String },

    #[error("{file}: the Hub lists {size} bytes, more than the {limit} accepted")]
    #[diagnostic(
        code(mflow::ckpt::hub::too_large),
        help("raise MFLOW_HUB_MAX_FILE_BYTES if this file is really wanted")
    )]
    FileTooLarge { file: String, size: u64, limit: u64 },

    #[error("MFLOW_HUB_MAX_FILE_BYTES = {value:?} is not a number of bytes")]
    #[diagnostic(
        code(mflow::ckpt::hub::max_file_bytes),
        help("set it to a positive integer, e.g. 200000000000, or unset it for the default")
    )]
    MaxFileBytes { value: String },

    #[error("{repo}@{revision} has no *.safetensors files")]
    #[diagnostic(
        code(mflow::ckpt::hub::no_safetensors),
        help("mflow only accepts safetensors weights; choose a repository or revision that has them")
    )]
    NoSafetensors { repo: String, revision: String },
}

/// Where the Hub is and how to authenticate.
#[derive(Clone)]
pub struct HubConfig {
    pub endpoint: String,
    pub token: Option<String>,
    /// The Hugging Face cache directory (`cache::dir_from_env`).
    pub cache: PathBuf,
    /// How failed requests are tried again.
    pub retry: Backoff,
    /// Largest file downloaded; larger ones are refused before the download starts.
    pub max_file_bytes: u64,
    /// What reading the file list may hold (MFLOW_MEMORY_BUDGET).
    pub memory: Budget,
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token must never reach logs.
        f.debug_struct("HubConfig")
            .field("endpoint", &self.endpoint)
            .field("cache", &self.cache)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish()
    }
}

impl HubConfig {
    /// HF_ENDPOINT, HF_TOKEN, the cache (HF_HUB_CACHE, HF_HOME, else MFLOW_SCRATCH),
    /// MFLOW_HUB_MAX_FILE_BYTES and MFLOW_MEMORY_BUDGET from the environment.
    pub fn from_env() -> Result<HubConfig, CkptError> {
        let var = |k| std::env::var(k).ok().filter(|v: &String| !v.is_empty());
        let max_file_bytes = match var("MFLOW_HUB_MAX_FILE_BYTES") {
            None => DEFAULT_MAX_FILE_BYTES,
            Some(v) => v.parse().ok().filter(|&n: &u64| n > 0).ok_or(HubError::MaxFileBytes { value: v })?,
        };
        let memory = Budget::from_env()?;
        Ok(HubConfig {
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string(),
            token: var("HF_TOKEN"),
            cache: cache::dir_from_env()
                .or_else(|| var("MFLOW_SCRATCH").map(|s| PathBuf::from(s).join("huggingface").join("hub")))
                .unwrap_or_else(|| std::env::temp_dir().join("huggingface").join("hub")),
            retry: Backoff::default(),
            max_file_bytes,
            memory,
        })
    }
}

/// A full 40-hex-digit commit id.
pub fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit())
}

/// Whether an error means the Hub could not be reached or answered with a server error (worth
/// trying again later), rather than a wrong name, revision or token.
pub fn is_unavailable(e: &CkptError) -> bool {
    match e {
        CkptError::Hub(HubError::Http { .. }) => true,
        CkptError::Hub(HubError::Status { status, .. }) => *status == 429 || *status >= 500,
        _ => false,
    }
}

/// `hf://ORG/NAME[@REV]` split into repository and revision (default `main`).
pub fn parse_source(source: &str) -> Result<(String, String), HubError> {
    let bad = || HubError::BadSource { source_spec: source.into() };
    let rest = source.strip_prefix("hf://").ok_or_else(bad)?;
    let (repo, rev) = rest.split_once('@').unwrap_or((rest, "main"));
    let ok = |s: &str| {
        !s.is_empty() && s != "." && s != ".." && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    };
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 || !parts.iter().all(|p| ok(p)) || !ok(rev) {
        return Err(bad());
    }
    Ok((repo.into(), rev.into()))
}

#[derive(Debug, Deserialize)]
struct RepoInfo {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize)]
struct Sibling {
    rfilename: String,
    /// The git blob id: a file's etag in the cache unless it is stored with LFS.
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    size: Option<u64>,
    lfs: Option<Lfs>,
}

impl Sibling {
    fn listed_size(&self) -> Option<u64> {
        self.lfs.as_ref().map(|l| l.size).or(self.size)
    }
}

#[derive(Debug, Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

fn client(cfg: &HubConfig) -> Result<reqwest::blocking::Client, HubError> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(t) = &cfg.token {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| HubError::Api {
            url: cfg.endpoint.clone(),
            reason: "HF_TOKEN is not a valid header value".into(),
        })?;
        v.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    reqwest::blocking::Client::builder()
        .user_agent(concat!("mflow/", env!("CARGO_PKG_VERSION")))
        .default_headers(headers)
        .connect_timeout(std::time::Duration::from_secs(30))
        .timeout(None)
        .build()
        .map_err(|e| HubError::Http { url: cfg.endpoint.clone(), reason: e.to_string() })
}

fn repo_info(cfg: &HubConfig, http: &reqwest::blocking::Client, repo: &str, rev: &str) -> Result<RepoInfo, CkptError> {
    cfg.retry.run(|| repo_info_once(cfg, http, repo, rev))
}

fn repo_info_once(
    cfg: &HubConfig,
    http: &reqwest::blocking::Client,
    repo: &str,
    rev: &str,
) -> Result<RepoInfo, CkptError> {
    let url = format!("{}/api/models/{repo}/revision/{rev}?blobs=true", cfg.endpoint);
    let resp =
        http.get(&url).send().map_err(|e| HubError::Http { url: url.clone(), reason: e.without_url().to_string() })?;
    if !resp.status().is_success() {
        return Err(HubError::Status { url, status: resp.status().as_u16() }.into());
    }
    let mut body = Vec::new();
    resp.take(MAX_API_BYTES + 1)
        .read_to_end(&mut body)
        .map_err(|e| HubError::Http { url: url.clone(), reason: e.to_string() })?;
    if body.len() as u64 > MAX_API_BYTES {
        return Err(HubError::Api { url, reason: format!("response larger than {MAX_API_BYTES} bytes") }.into());
    }
    // Only the file list is kept, in typed entries that hold less than a JSON value of the same
    // text: the value's figure bounds them, and is asked for before they are made.
    let (_, parts) = json::shape_at(&body, &[&["siblings"]])
        .map_err(|e| HubError::Api { url: url.clone(), reason: e.to_string() })?;
    let mut need = Need::new();
    need.add("its text", body.len() as u64);
    need.add(format!("the file list: {} values", parts[0].values()), parts[0].value_bytes);
    cfg.memory
        .check("reading it", need)
        .map_err(|over| CkptError::OverBudget { file: url.clone(), over: Box::new(over) })?;
    let info: RepoInfo =
        serde_json::from_slice(&body).map_err(|e| HubError::Api { url: url.clone(), reason: e.to_string() })?;
    if info.sha.len() != 40 || !info.sha.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(HubError::Api { url, reason: format!("`sha` {:?} is not a commit id", info.sha) }.into());
    }
    Ok(info)
}

/// The commit sha `source` (hf://ORG/NAME[@REV]) resolves to now; the engine's cache key.
pub fn resolve_hf_revision(source: &str) -> Result<String, CkptError> {
    resolve_with(&HubConfig::from_env()?, source)
}

pub fn resolve_with(cfg: &HubConfig, source: &str) -> Result<String, CkptError> {
    let (repo, rev) = parse_source(source)?;
    // A commit id is its own answer: a pinned source never needs the network to be planned.
    if is_commit(&rev) {
        return Ok(rev.to_ascii_lowercase());
    }
    let http = client(cfg)?;
    Ok(repo_info(cfg, &http, &repo, &rev)?.sha)
}

/// Downloads `source` into `dst` using HF_ENDPOINT, HF_TOKEN and MFLOW_SCRATCH.
pub fn download(source: &str, dst: &Path) -> Result<(), CkptError> {
    download_with(&HubConfig::from_env()?, source, dst)
}

fn wanted(name: &str) -> bool {
    is_plain_name(name)
        && (name.ends_with(".safetensors") || name.ends_with(".json") || TOKENIZER_FILES.contains(&name))
}

pub fn download_with(cfg: &HubConfig, source: &str, dst: &Path) -> Result<(), CkptError> {
    let (repo, rev) = parse_source(source)?;
    let http = client(cfg)?;
    let info = repo_info(cfg, &http, &repo, &rev)?;
    let files: Vec<&Sibling> = info.siblings.iter().filter(|s| wanted(&s.rfilename)).collect();
    if !files.iter().any(|s| s.rfilename.ends_with(".safetensors")) {
        return Err(HubError::NoSafetensors { repo, revision: rev }.into());
    }
    // Sizes are known and bounded, and hashes are hashes, before any byte is fetched.
    let mut wants = Vec::new();
    for s in &files {
        let size = s.listed_size().ok_or_else(|| HubError::NoSize { file: s.rfilename.clone() })?;
        if size > cfg.max_file_bytes {
            return Err(HubError::FileTooLarge { file: s.rfilename.clone(), size, limit: cfg.max_file_bytes }.into());
        }
        wants.push(Want { s, size, etag: etag(s)? });
    }
    let cache = RepoCache::new(&cfg.cache, &repo);
    let total: u64 = wants.iter().map(|w| w.size).sum();
    let progress = Reporter::new("download", Some(total), "bytes");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(PARALLEL).build().expect("thread pool");
    let blobs: Vec<PathBuf> = pool.install(|| {
        wants
            .par_iter()
            .map(|w| {
                let url = format!("{}/{repo}/resolve/{}/{}", cfg.endpoint, info.sha, w.s.rfilename);
                fetch(cfg, &http, &url, &cache, &info.sha, w, &progress)
            })
            .collect::<Result<_, CkptError>>()
    })?;
    progress.finish();
    cache.set_ref(&rev, &info.sha).map_err(io(&cfg.cache))?;
    // Validate the model before it becomes visible.
    let staging = Staging::new(dst)?;
    for (w, blob) in wants.iter().zip(&blobs) {
        cache::place(blob, &staging.dir().join(&w.s.rfilename)).map_err(io(blob))?;
    }
    crate::hf::open(staging.dir())?;
    staging.commit()
}

/// A file to fetch: its listing, its size, and its etag with how to check it.
struct Want<'a> {
    s: &'a Sibling,
    size: u64,
    etag: (Option<String>, Check),
}

/// The blob name and check of a listed file: an LFS file's sha256, else its git blob id (a
/// mirror that lists none leaves it to be computed once the file is here).
fn etag(s: &Sibling) -> Result<(Option<String>, Check), CkptError> {
    let (value, what, check) = match (&s.lfs, &s.blob_id) {
        (Some(l), _) => (&l.sha256, "lfs.sha256", Check::Sha256),
        (None, Some(b)) => (b, "blobId", Check::GitBlob),
        (None, None) => return Ok((None, Check::GitBlob)),
    };
    let lower = value.to_ascii_lowercase();
    let fits = if check == Check::Sha256 { lower.len() == 64 } else { lower.len() == 40 };
    if !fits || !cache::is_etag(&lower) {
        return Err(HubError::BadHash { file: s.rfilename.clone(), what, value: value.clone() }.into());
    }
    Ok((Some(lower), check))
}

/// The bytes of one file counted once however often it is tried: progress moves by what a
/// file holds beyond the most it held before, so it never reads above its total.
struct Counted<'a> {
    progress: &'a Reporter,
    most: AtomicU64,
}

impl Counted<'_> {
    fn at(&self, bytes: u64) {
        let before = self.most.fetch_max(bytes, Ordering::Relaxed);
        if bytes > before {
            self.progress.inc(bytes - before);
        }
    }
}

/// The blob of `w` in the cache, from the cache when it is there and checks out, else
/// downloaded into it (continuing its `.incomplete` file); its snapshot link made.
fn fetch(
    cfg: &HubConfig,
    http: &reqwest::blocking::Client,
    url: &str,
    cache: &RepoCache,
    commit: &str,
    w: &Want,
    progress: &Reporter,
) -> Result<PathBuf, CkptError> {
    let name = &w.s.rfilename;
    let (etag, check) = (&w.etag.0, w.etag.1);
    // A file without a listed hash is fetched under a name of its own and named by its hash after.
    let key = etag.clone().unwrap_or_else(|| format!("{commit}.{name}"));
    let _lock = cache.lock(&key).map_err(io(&cfg.cache))?;
    let counted = Counted { progress, most: AtomicU64::new(0) };
    if let Some(etag) = etag {
        let blob = cache.blob(etag);
        if std::fs::symlink_metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == w.size) {
            if cache::digest(&blob, check).map_err(io(&blob))? == *etag {
                counted.at(w.size);
                cache.link(commit, name, etag).map_err(io(&blob))?;
                return Ok(blob);
            }
            // Someone else's bytes under this name: download it afresh.
            std::fs::remove_file(&blob).map_err(io(&blob))?;
        }
    }
    let part = cache.incomplete(&key);
    cfg.retry.run(|| fetch_once(http, url, &part, w.size, &counted))?;
    let found = cache::digest(&part, check).map_err(io(&part))?;
    if let Some(expected) = etag.clone().filter(|e| *e != found) {
        let _ = std::fs::remove_file(&part);
        let file = name.clone();
        return Err(match check {
            Check::Sha256 => HubError::Sha256 { file, expected, found },
            Check::GitBlob => HubError::BlobId { file, expected, found },
        }
        .into());
    }
    let blob = cache.blob(&found);
    std::fs::rename(&part, &blob).map_err(io(&blob))?;
    cache.link(commit, name, &found).map_err(io(&blob))?;
    Ok(blob)
}

/// One request for the rest of `part`, up to `expected` bytes.
fn fetch_once(
    http: &reqwest::blocking::Client,
    url: &str,
    part: &Path,
    expected: u64,
    counted: &Counted,
) -> Result<(), CkptError> {
    let have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
    counted.at(have.min(expected));
    if have == expected {
        return Ok(());
    }
    let mut req = http.get(url);
    if have > 0 && have < expected {
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let http_err = |e: reqwest::Error| HubError::Http { url: url.into(), reason: e.without_url().to_string() };
    let mut resp = req.send().map_err(http_err)?;
    let status = resp.status();
    let append = status == reqwest::StatusCode::PARTIAL_CONTENT && have < expected;
    if !status.is_success() {
        return Err(HubError::Status { url: url.into(), status: status.as_u16() }.into());
    }
    // A 200 to a Range request means the server sends the whole file again.
    let mut out =
        OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(part).map_err(io(part))?;
    let mut written = if append { have } else { 0 };
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = resp.read(&mut buf).map_err(|e| HubError::Http { url: url.into(), reason: e.to_string() })?;
        if n == 0 {
            break;
        }
        written += n as u64;
        if written > expected {
            return Err(HubError::Size { file: url.into(), expected, found: written }.into());
        }
        out.write_all(&buf[..n]).map_err(io(part))?;
        counted.at(written);
    }
    out.flush().map_err(io(part))?;
    if written != expected {
        return Err(HubError::Size { file: url.into(), expected, found: written }.into());
    }
    Ok(())
}
