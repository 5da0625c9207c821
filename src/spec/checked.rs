//! The checked form of a spec, kept after it passed every check. A rerun of an unchanged spec
//! reads it back instead of parsing and checking the TOML again, which was most of a no-op's
//! work for a large spec. It is found by the spec's place and used only when its key matches:
//! the spec's bytes, the `--set` overrides, the spec's canonical place, and the mflow binary
//! itself. Anything else (a missing, stale or unreadable file) means the spec is parsed as usual.

use std::path::{Path, PathBuf};

use super::Spec;

/// Bumped when the stored layout changes; the binary's identity covers every other change.
const FORMAT: &[u8] = b"mflow-checked-spec-1";
/// A checked spec is a few hundred bytes per stage; anything larger is not ours.
const MAX_BYTES: u64 = 64 << 20;
/// Kept per machine: one file per spec, the oldest removed past this many.
const MAX_FILES: usize = 256;

/// The key of a spec's checked form, or `None` when the binary cannot be identified.
pub(super) fn key(path: &Path, dir: &Path, text: &str, overrides: &[String]) -> Option<String> {
    let mut h = crate::cache::key::PartsHasher::default();
    h.part(FORMAT).part(crate::env::binary_identity()?);
    h.part(path.as_os_str().as_encoded_bytes()).part(dir.as_os_str().as_encoded_bytes()).part(text.as_bytes());
    for o in overrides {
        h.part(o.as_bytes());
    }
    Some(h.hex())
}

/// Where the checked form of the spec at `dir/file` is kept.
fn location(dir: &Path, path: &Path) -> PathBuf {
    let file = path.file_name().map(|f| f.as_encoded_bytes()).unwrap_or_default();
    let mut h = blake3::Hasher::new();
    h.update(dir.as_os_str().as_encoded_bytes());
    h.update(b"/");
    h.update(file);
    crate::env::home().join("specs").join(format!("{}.json", &h.finalize().to_hex()[..32]))
}

/// The stored checked form, when it exists and was stored under `key`. `source` is left empty.
pub(super) fn read(dir: &Path, path: &Path, key: &str) -> Option<Spec> {
    // MFLOW_HOME may be shared or damaged: a FIFO or a huge file there means a parse.
    decode(&crate::untrusted::read_bounded(&location(dir, path), MAX_BYTES).ok()?, key)
}

/// Stores the checked form. Failing to store it only costs the next run a parse.
pub(super) fn write(dir: &Path, path: &Path, key: &str, spec: &Spec) {
    let file = location(dir, path);
    if let Err(e) = try_write(&file, &encode(key, spec)) {
        tracing::debug!(file = %file.display(), error = %e, "checked spec not stored");
    }
}

/// The key on the first line, the spec as JSON after it.
fn encode(key: &str, spec: &Spec) -> Vec<u8> {
    let mut out = format!("{key}\n").into_bytes();
    serde_json::to_writer(&mut out, spec).expect("a checked spec serializes");
    out
}

fn decode(bytes: &[u8], key: &str) -> Option<Spec> {
    let body = bytes.strip_prefix(key.as_bytes())?.strip_prefix(b"\n")?;
    // Checked once as a whole, so that serde_json need not check every string it reads.
    let body = std::str::from_utf8(body).ok()?;
    let mut spec: Spec = serde_json::from_str(body)
        .map_err(|e| tracing::debug!(error = %e, "checked spec unreadable; parsing the spec"))
        .ok()?;
    // The typed parameters are not stored: they follow from the checked ones.
    for st in &mut spec.stages {
        st.typed = crate::stages::Params::of(st.kind, &st.params).ok()?;
    }
    Some(spec)
}

fn try_write(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let parent = file.parent().expect("a file under the specs directory");
    std::fs::create_dir_all(parent)?;
    let fresh = !file.exists();
    let staging = file.with_extension(format!("{}.tmp", std::process::id()));
    let result = std::fs::write(&staging, bytes).and_then(|()| std::fs::rename(&staging, file));
    if result.is_err() {
        let _ = std::fs::remove_file(&staging);
    }
    result?;
    if fresh {
        prune(parent);
    }
    Ok(())
}

/// Keeps the newest `MAX_FILES` checked specs: every spec ever run leaves one.
fn prune(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> =
        entries.flatten().filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path()))).collect();
    if files.len() <= MAX_FILES {
        return;
    }
    files.sort();
    for (_, f) in &files[..files.len() - MAX_FILES] {
        let _ = std::fs::remove_file(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every spec in the repository reads back from its checked form as it was checked.
    #[test]
    fn a_checked_spec_reads_back_unchanged() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dirs = [root.join("specs"), root.join("specs/examples"), root.join("tests/fixtures/ci")];
        let mut seen = 0;
        for file in dirs.iter().flat_map(|d| std::fs::read_dir(d).unwrap()).map(|e| e.unwrap().path()) {
            if file.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let spec = super::super::parse(&file, &text, &[]).unwrap_or_else(|e| panic!("{}: {e:?}", file.display()));
            let back =
                decode(&encode("k", &spec), "k").unwrap_or_else(|| panic!("{} did not read back", file.display()));
            assert_eq!(
                format!("{:?}", Spec { source: spec.source.clone(), ..back }),
                format!("{spec:?}"),
                "{}",
                file.display()
            );
            seen += 1;
        }
        assert!(seen >= 5, "only {seen} specs found");
    }

    #[test]
    fn a_checked_spec_under_another_key_or_damaged_is_not_used() {
        let text = "[pipeline]\nname = \"p\"\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\ntimeout = \"5s\"\n";
        let spec = super::super::parse(Path::new("p.toml"), text, &[]).unwrap();
        let bytes = encode("k1", &spec);
        assert!(decode(&bytes, "k1").is_some());
        assert!(decode(&bytes, "k2").is_none());
        assert!(decode(&bytes[..bytes.len() - 3], "k1").is_none());
    }
}
