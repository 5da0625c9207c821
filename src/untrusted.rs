//! Files that someone else wrote, as the engine reads them: what a stage writes about itself
//! (status, progress, metrics, metrics.json, verification.json, scratch/progress.json), a run
//! record read back (`mflow report`, `mflow logs`), a `path:` model's config.json, the checked
//! specs under MFLOW_HOME. All go through the workspace's one reader (`mflow_untrusted`:
//! regular files only, never a blocking open, a cap per kind of file), and from async code
//! through a blocking thread, so that the runtime that handles signals and timeouts is never
//! held by a read.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

pub use mflow_untrusted::{copy_from, git, read_bounded, read_from, read_text, refusal};

/// A stage's status file, a checkpoint note, a config.json: small JSON documents.
pub const SMALL_JSON: u64 = 1 << 20;
/// A stage's metrics.json or verification.json (they may carry generated samples).
pub const RESULT_JSON: u64 = 64 << 20;
/// A stage's metrics.jsonl, read whole by `mflow report`.
pub const METRICS_LOG: u64 = 256 << 20;
/// Read at a time from a progress file that a stage appends to.
pub const PROGRESS_PIECE: u64 = 1 << 20;

/// The JSON document at `path`, if it is a regular file of at most `cap` bytes holding one that
/// the memory budget lets it hold as a value (64 MiB of nested arrays would be 8 GiB).
pub fn read_json(path: &Path, cap: u64) -> Option<Json> {
    mflow_untrusted::json::parse(&read_bounded(path, cap).ok()?).ok()
}

/// [`read_json`] on a blocking thread, for async code.
pub async fn read_json_async(path: PathBuf, cap: u64) -> Option<Json> {
    blocking(move || read_json(&path, cap)).await
}

/// Runs `f` on a blocking thread: file work from async code.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
