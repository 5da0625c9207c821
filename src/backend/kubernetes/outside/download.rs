//! `mflow output SPEC STAGE --download DIR` where the volume is not mounted: the image's mflow
//! finds the stage's committed output on the volume and lists it with its digests, the
//! output comes back as a tar stream, and every file is checked against that list while it
//! is written. Nothing but the listed regular files is unpacked, nothing outside the
//! directory, and the directory appears only when all of it arrived.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use mflow_untrusted::staging::create_dir_below;
use serde::Deserialize;

use super::volume::Reader;
use super::RemoteError;

/// Largest output brought back unless `MFLOW_DOWNLOAD_MAX_BYTES` says otherwise.
pub const DEFAULT_MAX_BYTES: u64 = 64 << 30;
/// Most files one output may have: a manifest is read whole.
const MAX_FILES: usize = 1_000_000;

/// What `mflow --log-format json output` prints.
#[derive(Debug, Clone, Deserialize)]
pub struct Listed {
    pub path: String,
    pub digest: String,
    pub files: Vec<crate::cache::FileEntry>,
}

impl Listed {
    /// The listing, checked before a byte of the output is fetched: a path on the volume, the
    /// files' names inside the output, their sizes within `max`.
    pub fn parse(text: &str, max: u64) -> Result<Listed, RemoteError> {
        let bad = |m: String| RemoteError::Stream { message: m };
        let l: Listed = serde_json::from_str(text.trim())
            .map_err(|e| bad(format!("the output's listing is not what mflow prints: {e}")))?;
        let path = Path::new(&l.path);
        if !path.is_absolute()
            || !path.starts_with(mflow_kube::ARTIFACT_MOUNT)
            || path.components().any(|c| matches!(c, Component::ParentDir))
        {
            return Err(bad(format!("the output is not on the volume: {}", crate::spec::error::excerpt(&l.path))));
        }
        if crate::cache::digest_of(&l.files) != l.digest {
            return Err(bad("the output's file list does not match its digest".into()));
        }
        if l.files.len() > MAX_FILES {
            return Err(bad(format!("the output lists {} files, more than {MAX_FILES}", l.files.len())));
        }
        for f in &l.files {
            relative(&f.path).ok_or_else(|| {
                bad(format!("the output lists a file outside it: {}", crate::spec::error::excerpt(&f.path)))
            })?;
        }
        let total = l.files.iter().try_fold(0u64, |a, f| a.checked_add(f.size)).unwrap_or(u64::MAX);
        if total > max {
            return Err(RemoteError::TooLarge { size: super::upload::human(total), max: super::upload::human(max) });
        }
        Ok(l)
    }

    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A `/`-separated name of plain components, as a relative path.
pub fn relative(name: &str) -> Option<PathBuf> {
    let p = Path::new(name);
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Unpacks a tar stream of the output into `staging` (a directory that exists), accepting exactly
/// the listed files with their sizes and digests, and directories; anything else (a link, a
/// device, a file not listed, one that differs) fails the download. Directories are made below
/// `staging`, never `staging` itself: removed on a signal, it is not made again.
pub fn unpack(
    listed: &Listed,
    staging: &Path,
    stream: &mut dyn Read,
    mut progress: impl FnMut(u64),
) -> std::io::Result<()> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let mut want: BTreeMap<PathBuf, &crate::cache::FileEntry> =
        listed.files.iter().filter_map(|f| Some((relative(&f.path)?, f))).collect();
    let mut archive = tar::Archive::new(stream);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let raw = entry.path()?.into_owned();
        let Some(rel) =
            raw.to_str().and_then(|s| if s == "." || s == "./" { Some(PathBuf::new()) } else { relative(s) })
        else {
            return Err(bad(format!("the stream names a path outside the output: {}", raw.display())));
        };
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                create_dir_below(staging, &rel)?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let Some(f) = want.remove(&rel) else {
                    return Err(bad(format!(
                        "the stream holds {}, which the output's manifest does not list",
                        rel.display()
                    )));
                };
                if entry.header().size()? != f.size {
                    return Err(bad(format!(
                        "{} is {} bytes in the stream and {} in the manifest",
                        rel.display(),
                        entry.header().size()?,
                        f.size
                    )));
                }
                let target = staging.join(&rel);
                if let Some(dir) = rel.parent() {
                    create_dir_below(staging, dir)?;
                }
                let mut w = std::io::BufWriter::new(std::fs::File::create(&target)?);
                let mut h = blake3::Hasher::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = entry.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                    w.write_all(&buf[..n])?;
                    progress(n as u64);
                }
                w.flush()?;
                if h.finalize().to_hex().as_str() != f.blake3 {
                    return Err(bad(format!("{} differs from the digest its manifest records", rel.display())));
                }
            }
            other => {
                return Err(bad(format!(
                    "the stream holds {} of type {other:?}; an output has only files and directories",
                    rel.display()
                )))
            }
        }
    }
    if let Some(missing) = want.keys().next() {
        return Err(bad(format!("the stream lacks {} ({} files missing)", missing.display(), want.len())));
    }
    Ok(())
}

/// The reader that unpacks into `staging`, with a progress bar.
pub fn unpacker(listed: Listed, staging: PathBuf, bar: indicatif::ProgressBar) -> Reader {
    Box::new(move |r: &mut dyn Read| unpack(&listed, &staging, r, |n| bar.inc(n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(files: &[(&str, &[u8])]) -> Listed {
        Listed {
            path: "/mflow/p/cache/ab/abcd/out".into(),
            digest: "d".into(),
            files: files
                .iter()
                .map(|(p, b)| crate::cache::FileEntry {
                    path: p.to_string(),
                    size: b.len() as u64,
                    blake3: blake3::hash(b).to_hex().to_string(),
                })
                .collect(),
        }
    }

    fn stream(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut t = tar::Builder::new(Vec::new());
        let mut dir = tar::Header::new_gnu();
        dir.set_entry_type(tar::EntryType::Directory);
        dir.set_size(0);
        dir.set_mode(0o755);
        t.append_data(&mut dir, ".", std::io::empty()).unwrap();
        for (p, b) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(b.len() as u64);
            h.set_mode(0o644);
            t.append_data(&mut h, p, *b).unwrap();
        }
        t.into_inner().unwrap()
    }

    /// A staging directory, as the caller makes it.
    fn fresh(d: &tempfile::TempDir, name: &str) -> PathBuf {
        let dir = d.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn the_listed_files_arrive_checked() {
        let d = tempfile::tempdir().unwrap();
        let files: &[(&str, &[u8])] = &[("model.safetensors", b"weights"), ("sub/config.json", b"{}")];
        let mut n = 0;
        unpack(&listing(files), &fresh(&d, "out"), &mut &stream(files)[..], |k| n += k).unwrap();
        assert_eq!(std::fs::read(d.path().join("out/sub/config.json")).unwrap(), b"{}");
        assert_eq!(n, 9);
    }

    #[test]
    fn anything_but_the_listed_files_fails() {
        let d = tempfile::tempdir().unwrap();
        let listed = listing(&[("a", b"aaa")]);
        let cases: [(&str, Vec<u8>); 4] = [
            ("not listed", stream(&[("a", b"aaa"), ("b", b"x")])),
            ("differs", stream(&[("a", b"aab")])),
            ("lacks", stream(&[])),
            ("size", stream(&[("a", b"aaaa")])),
        ];
        for (what, bytes) in cases {
            let e = unpack(&listed, &fresh(&d, &what.replace(' ', "_")), &mut &bytes[..], |_| ()).unwrap_err();
            assert!(e.to_string().contains(what) || e.to_string().contains("manifest"), "{what}: {e}");
        }
        // A link in the stream is refused, whatever it points at.
        let mut t = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        t.append_link(&mut h, "a", "/etc/passwd").unwrap();
        let bytes = t.into_inner().unwrap();
        let e = unpack(&listed, &fresh(&d, "link"), &mut &bytes[..], |_| ()).unwrap_err();
        assert!(e.to_string().contains("Symlink"), "{e}");
    }

    #[test]
    fn a_listing_is_checked_before_anything_is_fetched() {
        let doc = |path: &str, file: &str| {
            let files = vec![crate::cache::FileEntry { path: file.into(), size: 3, blake3: "h".into() }];
            serde_json::json!({"path": path, "digest": crate::cache::digest_of(&files), "files": files}).to_string()
        };
        let ok = doc("/mflow/p/cache/x/out", "a");
        assert_eq!(Listed::parse(&ok, 10).unwrap().bytes(), 3);
        assert!(matches!(Listed::parse(&ok, 2), Err(RemoteError::TooLarge { .. })));
        let forged = ok.replace("\"size\":3", "\"size\":2");
        for bad in [
            doc("/etc", "a"),
            doc("/mflow/../etc", "a"),
            doc("/mflow/x", "../a"),
            doc("/mflow/x", "/etc/a"),
            forged,
            "not json".into(),
        ] {
            assert!(Listed::parse(&bad, 10).is_err(), "{bad}");
        }
    }
}
