//! `hf://ORG/NAME[@REV]`: downloads from the Hugging Face Hub.
//!
//! Only safetensors, JSON and tokenizer files are fetched, in parallel, pinned to the commit
//! the revision resolves to. Partial files are kept in a resume directory (under
//! `MFLOW_SCRATCH` when the engine provides one) and continued with HTTP Range requests; LFS
//! files are checked against the sha256 the Hub publishes. The finished files are validated as
//! a Hugging Face model and then renamed into place. The token is sent, never printed.
//!
//! Every file is downloaded against the size the Hub lists for it: a file listed without a
//! size is refused, and so is one larger than `MFLOW_HUB_MAX_FILE_BYTES` (default
//! [`DEFAULT_MAX_FILE_BYTES`]), so a hostile or broken mirror cannot fill the disk.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use miette::Diagnostic;
use mflow_progress::Reporter;
use rayon::prelude::*;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::error::{io, CkptError};
use crate::hf::{is_plain_name, TOKENIZER_FILES};
use crate::writer::Staging;

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Largest API response accepted (the file list of a model repository).
const MAX_API_BYTES: u64 = 32 << 20;
const ATTEMPTS: usize = 4;
/// Largest single file downloaded unless `MFLOW_HUB_MAX_FILE_BYTES` says otherwise; the Hub's
/// safetensors shards are usually 5 GB or less.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 100_000_000_000;
const PARALLEL: usize = 8;

#[derive(Debug, Error, Diagnostic)]
pub enum HubError {
    #[error("`{source_spec}` is not a Hub model reference")]
    #[diagnostic(code(mflow::ckpt::hub::source), help("write hf://ORG/NAME or hf://ORG/NAME@REVISION (letters, digits, '.', '_', '-')"))]
    BadSource { source_spec: String },

    #[error("{url}: {reason}")]
    #[diagnostic(code(mflow::ckpt::hub::http), help("check the network, HF_ENDPOINT, and that the model and revision exist; gated or private models need HF_TOKEN"))]
    Http { url: String, reason: String },

    #[error("{url}: the Hub answered {status}")]
    #[diagnostic(code(mflow::ckpt::hub::status), help("401/403: set HF_TOKEN to a token that can read this model; 404: check the name and revision"))]
    Status { url: String, status: u16 },

    #[error("{url}: unexpected answer: {reason}")]
    #[diagnostic(code(mflow::ckpt::hub::api), help("HF_ENDPOINT must point at a Hugging Face Hub (or a compatible mirror)"))]
    Api { url: String, reason: String },

    #[error("{file}: sha256 is {found} but the Hub lists {expected}")]
    #[diagnostic(code(mflow::ckpt::hub::sha256), help("the download was corrupted or the mirror serves other bytes; run again to download the file afresh"))]
    Sha256 { file: String, expected: String, found: String },

    #[error("{file}: received {found} bytes but the Hub lists {expected}")]
    #[diagnostic(code(mflow::ckpt::hub::size), help("run again; the partial file is resumed"))]
    Size { file: String, expected: u64, found: u64 },

    #[error("{file}: the Hub lists no size for it")]
    #[diagnostic(code(mflow::ckpt::hub::no_size), help("mflow downloads only files of known size, so that a download cannot grow without bound; check HF_ENDPOINT points at a Hugging Face Hub (its API lists every size)"))]
    NoSize { file: String },

    #[error("{file}: the Hub lists {size} bytes, more than the {limit} accepted")]
    #[diagnostic(code(mflow::ckpt::hub::too_large), help("raise MFLOW_HUB_MAX_FILE_BYTES if this file is really wanted"))]
    FileTooLarge { file: String, size: u64, limit: u64 },

    #[error("MFLOW_HUB_MAX_FILE_BYTES = {value:?} is not a number of bytes")]
    #[diagnostic(code(mflow::ckpt::hub::max_file_bytes), help("set it to a positive integer, e.g. 200000000000, or unset it for the default"))]
    MaxFileBytes { value: String },

    #[error("{repo}@{revision} has no *.safetensors files")]
    #[diagnostic(code(mflow::ckpt::hub::no_safetensors), help("mflow only accepts safetensors weights; choose a repository or revision that has them"))]
    NoSafetensors { repo: String, revision: String },
}

/// Where the Hub is and how to authenticate.
#[derive(Clone)]
pub struct HubConfig {
    pub endpoint: String,
    pub token: Option<String>,
    /// Directory for partial downloads; `None` puts it next to the destination.
    pub resume_root: Option<PathBuf>,
    /// Largest file downloaded; larger ones are refused before the download starts.
    pub max_file_bytes: u64,
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token must never reach logs.
        f.debug_struct("HubConfig").field("endpoint", &self.endpoint).field("token", &self.token.as_ref().map(|_| "***")).finish()
    }
}

impl HubConfig {
    /// HF_ENDPOINT, HF_TOKEN, MFLOW_SCRATCH and MFLOW_HUB_MAX_FILE_BYTES from the environment.
    pub fn from_env() -> Result<HubConfig, HubError> {
        let var = |k| std::env::var(k).ok().filter(|v: &String| !v.is_empty());
        let max_file_bytes = match var("MFLOW_HUB_MAX_FILE_BYTES") {
            None => DEFAULT_MAX_FILE_BYTES,
            Some(v) => v.parse().ok().filter(|&n: &u64| n > 0).ok_or(HubError::MaxFileBytes { value: v })?,
        };
        Ok(HubConfig {
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string(),
            token: var("HF_TOKEN"),
            resume_root: var("MFLOW_SCRATCH").map(PathBuf::from),
            max_file_bytes,
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
    let ok = |s: &str| !s.is_empty() && s != "." && s != ".." && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
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
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}"))
            .map_err(|_| HubError::Api { url: cfg.endpoint.clone(), reason: "HF_TOKEN is not a valid header value".into() })?;
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

fn repo_info(cfg: &HubConfig, http: &reqwest::blocking::Client, repo: &str, rev: &str) -> Result<RepoInfo, HubError> {
    let url = format!("{}/api/models/{repo}/revision/{rev}?blobs=true", cfg.endpoint);
    let resp = http.get(&url).send().map_err(|e| HubError::Http { url: url.clone(), reason: e.without_url().to_string() })?;
    if !resp.status().is_success() {
        return Err(HubError::Status { url, status: resp.status().as_u16() });
    }
    let mut body = Vec::new();
    resp.take(MAX_API_BYTES + 1).read_to_end(&mut body).map_err(|e| HubError::Http { url: url.clone(), reason: e.to_string() })?;
    if body.len() as u64 > MAX_API_BYTES {
        return Err(HubError::Api { url, reason: format!("response larger than {MAX_API_BYTES} bytes") });
    }
    let info: RepoInfo = serde_json::from_slice(&body).map_err(|e| HubError::Api { url: url.clone(), reason: e.to_string() })?;
    if info.sha.len() != 40 || !info.sha.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(HubError::Api { url, reason: format!("`sha` {:?} is not a commit id", info.sha) });
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
    is_plain_name(name) && (name.ends_with(".safetensors") || name.ends_with(".json") || TOKENIZER_FILES.contains(&name))
}

pub fn download_with(cfg: &HubConfig, source: &str, dst: &Path) -> Result<(), CkptError> {
    let (repo, rev) = parse_source(source)?;
    let http = client(cfg)?;
    let info = repo_info(cfg, &http, &repo, &rev)?;
    let files: Vec<&Sibling> = info.siblings.iter().filter(|s| wanted(&s.rfilename)).collect();
    if !files.iter().any(|s| s.rfilename.ends_with(".safetensors")) {
        return Err(HubError::NoSafetensors { repo, revision: rev }.into());
    }
    // Sizes are known and bounded before any byte is fetched.
    for s in &files {
        let size = s.listed_size().ok_or_else(|| HubError::NoSize { file: s.rfilename.clone() })?;
        if size > cfg.max_file_bytes {
            return Err(HubError::FileTooLarge { file: s.rfilename.clone(), size, limit: cfg.max_file_bytes }.into());
        }
    }
    let name = dst.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let resume = match &cfg.resume_root {
        Some(root) => root.join(format!("hf-download-{}", info.sha)),
        None => dst.parent().unwrap_or(Path::new(".")).join(format!(".{name}.download-{}", info.sha)),
    };
    std::fs::create_dir_all(&resume).map_err(io(&resume))?;
    let total: u64 = files.iter().filter_map(|s| s.listed_size()).sum();
    let progress = Reporter::new("download", Some(total), "bytes");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(PARALLEL).build().expect("thread pool");
    pool.install(|| {
        files.par_iter().try_for_each(|s| {
            let url = format!("{}/{repo}/resolve/{}/{}", cfg.endpoint, info.sha, s.rfilename);
            fetch(&http, &url, &resume, s, &progress)
        })
    })?;
    progress.finish();
    // Validate the model before it becomes visible.
    let staging = Staging::new(dst)?;
    for s in &files {
        let from = resume.join(&s.rfilename);
        std::fs::rename(&from, staging.dir.join(&s.rfilename)).map_err(io(&from))?;
    }
    crate::hf::open(&staging.dir)?;
    staging.commit()?;
    let _ = std::fs::remove_dir_all(&resume);
    Ok(())
}

/// Downloads one file into `resume/NAME`, continuing `resume/NAME.part` if present.
fn fetch(http: &reqwest::blocking::Client, url: &str, resume: &Path, s: &Sibling, progress: &Reporter) -> Result<(), CkptError> {
    let done = resume.join(&s.rfilename);
    // download_with refused every file without a size.
    let expected = s.listed_size();
    if expected.is_none() {
        return Err(HubError::NoSize { file: s.rfilename.clone() }.into());
    }
    if done.exists() {
        progress.inc(expected.unwrap_or(0));
        return Ok(());
    }
    let part = resume.join(format!("{}.part", s.rfilename));
    let mut last_err = None;
    for _ in 0..ATTEMPTS {
        match fetch_once(http, url, &part, expected, progress) {
            Ok(()) => {
                last_err = None;
                break;
            }
            Err(e) => last_err = Some(e),
        }
    }
    if let Some(e) = last_err {
        return Err(e);
    }
    let got = std::fs::metadata(&part).map_err(io(&part))?.len();
    if let Some(n) = expected {
        if got != n {
            return Err(HubError::Size { file: s.rfilename.clone(), expected: n, found: got }.into());
        }
    }
    if let Some(lfs) = &s.lfs {
        let mut h = Sha256::new();
        let mut f = std::fs::File::open(&part).map_err(io(&part))?;
        std::io::copy(&mut f, &mut h).map_err(io(&part))?;
        let found = hex::encode(h.finalize());
        if !found.eq_ignore_ascii_case(&lfs.sha256) {
            let _ = std::fs::remove_file(&part);
            return Err(HubError::Sha256 { file: s.rfilename.clone(), expected: lfs.sha256.clone(), found }.into());
        }
    }
    std::fs::rename(&part, &done).map_err(io(&done))
}

fn fetch_once(http: &reqwest::blocking::Client, url: &str, part: &Path, expected: Option<u64>, progress: &Reporter) -> Result<(), CkptError> {
    let have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
    if Some(have) == expected {
        return Ok(());
    }
    let mut req = http.get(url);
    if have > 0 {
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let http_err = |e: reqwest::Error| HubError::Http { url: url.into(), reason: e.without_url().to_string() };
    let mut resp = req.send().map_err(http_err)?;
    let status = resp.status();
    let append = status == reqwest::StatusCode::PARTIAL_CONTENT;
    if !status.is_success() {
        return Err(HubError::Status { url: url.into(), status: status.as_u16() }.into());
    }
    // A 200 to a Range request means the server sends the whole file again.
    let mut out = OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(part).map_err(io(part))?;
    let mut written = if append { have } else { 0 };
    if append {
        progress.inc(have);
    }
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = resp.read(&mut buf).map_err(|e| HubError::Http { url: url.into(), reason: e.to_string() })?;
        if n == 0 {
            break;
        }
        written += n as u64;
        if expected.is_some_and(|e| written > e) {
            return Err(HubError::Size { file: url.into(), expected: expected.unwrap_or(0), found: written }.into());
        }
        out.write_all(&buf[..n]).map_err(io(part))?;
        progress.inc(n as u64);
    }
    out.flush().map_err(io(part))?;
    match expected {
        Some(e) if written != e => Err(HubError::Size { file: url.into(), expected: e, found: written }.into()),
        _ => Ok(()),
    }
}
