//! What a run started outside the cluster sends to the artifact volume: the spec and the local
//! files it names, content-addressed, so that an unchanged file is sent once.
//!
//! On the volume, below `/mflow/.mflow-uploads/`:
//! - `blobs/<blake3>`: one file per content, read-only;
//! - `projects/<tree>/<path>`: the project as the run sees it, hard links to the blobs, named by
//!   the digest of its (path, content) list, so an unchanged project is not sent at all.
//!
//! One tar stream carries the new blobs into `incoming/<nonce>/` and the tree as hard links into
//! `projects/<tree>.<nonce>/`; a shell step then moves both into place with renames.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use miette::Diagnostic;
use thiserror::Error;

use crate::plan::Plan;

/// Below the mount of the artifact volume.
pub const UPLOADS: &str = ".mflow-uploads";
/// A run sends at most this much (`MFLOW_UPLOAD_MAX_BYTES` changes it).
pub const DEFAULT_MAX_BYTES: u64 = 2 << 30;
/// And at most this many files.
pub const MAX_FILES: usize = 100_000;

#[derive(Debug, Error, Diagnostic)]
pub enum UploadError {
    #[error("the run would upload {} in {files} file(s), more than the limit of {}; the largest is {largest} ({})", human(*total), human(*max), human(*largest_size))]
    #[diagnostic(
        code(mflow::remote::upload_too_large),
        help("large data belongs on the artifact volume already (an absolute /mflow/... path in the spec) or in the spec as an hf:// source; MFLOW_UPLOAD_MAX_BYTES raises the limit")
    )]
    TooLarge { total: u64, files: usize, max: u64, largest: String, largest_size: u64 },
    #[error("the run names {count} local files, more than {MAX_FILES}")]
    #[diagnostic(
        code(mflow::remote::upload_too_many),
        help("put the data set on the artifact volume and name it by its /mflow/... path")
    )]
    TooMany { count: usize },
    #[error("`{path}` is outside the project directory {}", root.display())]
    #[diagnostic(code(mflow::remote::upload_outside), help("a run started outside the cluster sends only files inside the project (the git work tree, else the spec's directory)"))]
    Outside { path: String, root: PathBuf },
    #[error("stage `{stage}` reads {path}, which the cluster cannot see")]
    #[diagnostic(code(mflow::remote::upload_absolute), help("make the path relative to the spec so that it is uploaded, or put the file on the artifact volume and name it by its /mflow/... path"))]
    Absolute { stage: String, path: String },
    #[error("cannot read {}", path.display())]
    #[diagnostic(code(mflow::remote::upload_io))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One local file of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct File {
    /// Relative to the project root, `/`-separated.
    pub path: String,
    pub digest: String,
    pub size: u64,
    pub local: PathBuf,
}

/// Everything a run sends, with the tree it lays out on the volume.
#[derive(Debug, Clone)]
pub struct Bundle {
    pub files: Vec<File>,
    /// The spec, relative to the project root.
    pub spec: String,
    /// Digest of the (path, digest) list.
    pub tree: String,
}

impl Bundle {
    /// The spec and every input file the plan hashed (its keys are relative to the spec's
    /// directory). Inputs already on the volume (`/mflow/...`) stay where they are.
    pub fn of(plan: &Plan) -> Result<Bundle, UploadError> {
        let root = &plan.root;
        let spec_dir = std::fs::canonicalize(&plan.spec.dir).unwrap_or_else(|_| plan.spec.dir.clone());
        let mut by_path: BTreeMap<String, (String, PathBuf)> = BTreeMap::new();
        for st in &plan.stages {
            for (rel, digest) in st.parts.inputs.iter() {
                let p = Path::new(rel);
                if p.is_absolute() {
                    if p.starts_with(mflow_kube::ARTIFACT_MOUNT) {
                        continue;
                    }
                    return Err(UploadError::Absolute { stage: st.spec.name.clone(), path: rel.clone() });
                }
                let local = spec_dir.join(p);
                let path = relative_to(&local, root)
                    .ok_or_else(|| UploadError::Outside { path: rel.clone(), root: root.clone() })?;
                by_path.insert(path, (digest.clone(), local));
            }
        }
        let spec_local = std::fs::canonicalize(&plan.spec.path)
            .map_err(|source| UploadError::Io { path: plan.spec.path.clone(), source })?;
        let spec = relative_to(&spec_local, root)
            .ok_or_else(|| UploadError::Outside { path: plan.spec.path.display().to_string(), root: root.clone() })?;
        let spec_digest = crate::cache::hash_file(&spec_local)
            .map_err(|source| UploadError::Io { path: spec_local.clone(), source })?;
        by_path.insert(spec.clone(), (spec_digest, spec_local));
        if by_path.len() > MAX_FILES {
            return Err(UploadError::TooMany { count: by_path.len() });
        }
        let mut files = Vec::with_capacity(by_path.len());
        for (path, (digest, local)) in by_path {
            let size =
                std::fs::metadata(&local).map_err(|source| UploadError::Io { path: local.clone(), source })?.len();
            files.push(File { path, digest, size, local });
        }
        Ok(Bundle::new(files, spec))
    }

    pub fn new(files: Vec<File>, spec: String) -> Bundle {
        let mut h = blake3::Hasher::new();
        for f in &files {
            h.update(f.path.as_bytes());
            h.update(&[0]);
            h.update(f.digest.as_bytes());
            h.update(&[0]);
        }
        Bundle { files, spec, tree: h.finalize().to_hex()[..32].to_string() }
    }

    /// Where the project lies on the volume.
    pub fn tree_dir(&self) -> String {
        format!("{}/{UPLOADS}/projects/{}", mflow_kube::ARTIFACT_MOUNT, self.tree)
    }

    /// The files whose content the volume lacks, each content once.
    pub fn missing(&self, present: &HashSet<String>) -> Vec<&File> {
        let mut seen = HashSet::new();
        self.files.iter().filter(|f| !present.contains(&f.digest) && seen.insert(f.digest.as_str())).collect()
    }

    /// Refuses an upload above `max` bytes before anything is sent.
    pub fn check_size(missing: &[&File], max: u64) -> Result<u64, UploadError> {
        let total: u64 = missing.iter().map(|f| f.size).sum();
        if total > max {
            let largest = missing.iter().max_by_key(|f| f.size).expect("a total above the limit has a file");
            return Err(UploadError::TooLarge {
                total,
                files: missing.len(),
                max,
                largest: largest.path.clone(),
                largest_size: largest.size,
            });
        }
        Ok(total)
    }

    /// The tar stream: new blobs into `incoming/<nonce>/`, the tree as hard links into
    /// `projects/<tree>.<nonce>/`. Sizes are those measured when the bundle was made: a file
    /// that changed since fails the upload instead of sending other content than was hashed.
    pub fn write_tar(&self, missing: &[&File], nonce: &str, w: impl Write) -> Result<(), UploadError> {
        let mut tar = tar::Builder::new(w);
        fn io(path: &Path) -> impl FnOnce(std::io::Error) -> UploadError + '_ {
            move |source| UploadError::Io { path: path.to_path_buf(), source }
        }
        let new: HashSet<&str> = missing.iter().map(|f| f.digest.as_str()).collect();
        for f in missing {
            let file = std::fs::File::open(&f.local).map_err(io(&f.local))?;
            let mut header = tar::Header::new_gnu();
            header.set_size(f.size);
            header.set_mode(0o444);
            header.set_entry_type(tar::EntryType::Regular);
            tar.append_data(&mut header, format!("incoming/{nonce}/{}", f.digest), Exact { inner: file, left: f.size })
                .map_err(io(&f.local))?;
        }
        for f in &self.files {
            let target = if new.contains(f.digest.as_str()) {
                format!("incoming/{nonce}/{}", f.digest)
            } else {
                format!("blobs/{}", f.digest)
            };
            let mut header = tar::Header::new_gnu();
            header.set_size(0);
            header.set_mode(0o444);
            header.set_entry_type(tar::EntryType::Link);
            tar.append_link(&mut header, format!("projects/{}.{nonce}/{}", self.tree, f.path), &target)
                .map_err(io(&f.local))?;
        }
        tar.into_inner().map_err(io(Path::new("upload stream")))?.flush().map_err(io(Path::new("upload stream")))?;
        Ok(())
    }

    /// The shell step that receives the stream on the volume and moves it into place. Only
    /// hex digests and the nonce are spliced in; paths travel inside the tar stream. Two
    /// uploads of one tree at once both complete: when the other's `mv` came first, this one's
    /// lands inside the tree, and is removed.
    pub fn receive_script(&self, nonce: &str) -> String {
        let tree = &self.tree;
        format!(
            "set -eu\nmkdir -p {mount}/{UPLOADS}\ncd {mount}/{UPLOADS}\nmkdir -p blobs projects incoming/{nonce}\ntar -x -f -\n\
             for f in incoming/{nonce}/*; do [ -e \"$f\" ] && mv -f \"$f\" blobs/; done\nrmdir incoming/{nonce}\n\
             if [ -d projects/{tree} ]; then rm -rf projects/{tree}.{nonce}; else mkdir -p projects/{tree}.{nonce} && mv projects/{tree}.{nonce} projects/{tree}; fi\n\
             rm -rf projects/{tree}/{tree}.{nonce}\n",
            mount = mflow_kube::ARTIFACT_MOUNT,
        )
    }

    /// The shell step that says what the volume has: `tree` when the project is there, then
    /// the blobs present.
    pub fn probe_script(&self) -> String {
        format!(
            "cd {mount}/{UPLOADS} 2>/dev/null || exit 0\n[ -d projects/{tree} ] && echo tree\nls blobs 2>/dev/null || true\n",
            mount = mflow_kube::ARTIFACT_MOUNT,
            tree = self.tree
        )
    }
}

/// Exactly `left` bytes of `inner`: a file that shrank since it was hashed is an error, not a
/// short entry that shifts the rest of the stream.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: std::io::Read> std::io::Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let max = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..max])?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file changed since it was hashed"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// `path` (lexically normalised) relative to `root`, `/`-separated, or `None` outside it.
fn relative_to(path: &Path, root: &Path) -> Option<String> {
    let mut parts: Vec<String> = Vec::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                parts.pop();
            }
            Component::CurDir => {}
            Component::Normal(s) => parts.push(s.to_str()?.to_string()),
            Component::RootDir | Component::Prefix(_) => parts.clear(),
        }
    }
    let root: Vec<String> = root
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str().map(str::to_string),
            _ => None,
        })
        .collect();
    if parts.len() <= root.len() || parts[..root.len()] != root[..] {
        return None;
    }
    Some(parts[root.len()..].join("/"))
}

pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, digest: &str, size: u64) -> File {
        File { path: path.into(), digest: digest.into(), size, local: PathBuf::from(path) }
    }

    #[test]
    fn the_tree_digest_follows_paths_and_contents() {
        let a = Bundle::new(vec![file("spec.toml", "d1", 1), file("data/x", "d2", 2)], "spec.toml".into());
        let same = Bundle::new(vec![file("spec.toml", "d1", 5), file("data/x", "d2", 7)], "spec.toml".into());
        let moved = Bundle::new(vec![file("spec.toml", "d1", 1), file("data/y", "d2", 2)], "spec.toml".into());
        let changed = Bundle::new(vec![file("spec.toml", "d1", 1), file("data/x", "d3", 2)], "spec.toml".into());
        assert_eq!(a.tree, same.tree, "sizes are not content");
        assert_ne!(a.tree, moved.tree);
        assert_ne!(a.tree, changed.tree);
        assert!(a.tree.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn only_contents_the_volume_lacks_are_sent_once_each() {
        let b = Bundle::new(
            vec![file("a", "d1", 1), file("b", "d1", 1), file("c", "d2", 3), file("s", "d3", 1)],
            "s".into(),
        );
        let present: HashSet<String> = ["d3".to_string()].into();
        let missing: Vec<&str> = b.missing(&present).iter().map(|f| f.digest.as_str()).collect();
        assert_eq!(missing, ["d1", "d2"]);
        assert!(b.missing(&["d1", "d2", "d3"].map(String::from).into()).is_empty());
    }

    #[test]
    fn the_size_bound_is_checked_before_sending_and_names_the_largest() {
        let b = Bundle::new(vec![file("small", "d1", 10), file("big/corpus.jsonl", "d2", 3000)], "small".into());
        let missing = b.missing(&HashSet::new());
        assert_eq!(Bundle::check_size(&missing, 4096).unwrap(), 3010);
        let e = Bundle::check_size(&missing, 3000).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("big/corpus.jsonl") && msg.contains("2.9 KiB") && msg.contains("2 file(s)"), "{msg}");
    }

    #[test]
    fn paths_stay_inside_the_root() {
        let root = Path::new("/p/proj");
        assert_eq!(relative_to(Path::new("/p/proj/specs/../data/x.txt"), root).as_deref(), Some("data/x.txt"));
        assert_eq!(relative_to(Path::new("/p/proj/specs/../../other/x"), root), None);
        assert_eq!(relative_to(Path::new("/p/proj"), root), None);
        assert_eq!(relative_to(Path::new("/p/projx/a"), root), None);
    }

    #[test]
    fn the_stream_holds_new_blobs_and_the_tree_as_links() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.txt");
        std::fs::write(&a, "hello").unwrap();
        let s = dir.path().join("spec.toml");
        std::fs::write(&s, "x").unwrap();
        let files = vec![
            File { path: "a.txt".into(), digest: "da".into(), size: 5, local: a },
            File { path: "spec.toml".into(), digest: "ds".into(), size: 1, local: s },
        ];
        let b = Bundle::new(files, "spec.toml".into());
        let present: HashSet<String> = ["ds".to_string()].into();
        let missing = b.missing(&present);
        let mut out = Vec::new();
        b.write_tar(&missing, "n1", &mut out).unwrap();
        let mut ar = tar::Archive::new(&out[..]);
        let entries: Vec<(String, Option<String>, u64)> = ar
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let link = e.link_name().unwrap().map(|l| l.to_string_lossy().to_string());
                (e.path().unwrap().to_string_lossy().to_string(), link, e.size())
            })
            .collect();
        let tree = &b.tree;
        assert_eq!(
            entries,
            vec![
                ("incoming/n1/da".to_string(), None, 5),
                (format!("projects/{tree}.n1/a.txt"), Some("incoming/n1/da".to_string()), 0),
                (format!("projects/{tree}.n1/spec.toml"), Some("blobs/ds".to_string()), 0),
            ]
        );
    }

    #[test]
    fn a_file_that_shrank_since_hashing_fails_the_stream() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.txt");
        std::fs::write(&a, "hi").unwrap();
        let b =
            Bundle::new(vec![File { path: "a.txt".into(), digest: "da".into(), size: 5, local: a }], "a.txt".into());
        let missing = b.missing(&HashSet::new());
        assert!(b.write_tar(&missing, "n", Vec::new()).is_err());
    }
}
