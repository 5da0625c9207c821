//! Streams planned tensors from memory-mapped sources into safetensors files, a bounded chunk
//! at a time, hashing as it writes; and the staging directory that makes outputs all-or-nothing.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use mflow_progress::Reporter;
use safetensors::Dtype;

use crate::error::{io, CkptError};
use crate::layout::{matrix, Piece, TensorPlan};
use crate::st::{build_header, HeaderEntry, StFile, TensorMeta};

/// Largest buffer used to assemble one chunk of an output tensor.
const CHUNK_BYTES: u64 = 8 << 20;

/// Memory-mapped source files and the logical key of every tensor in them.
#[derive(Default)]
pub struct Sources {
    pub files: Vec<StFile>,
    pub index: HashMap<String, (usize, String)>,
}

impl Sources {
    pub fn get(&self, key: &str) -> Option<(&StFile, &TensorMeta)> {
        let (f, name) = self.index.get(key)?;
        let file = &self.files[*f];
        Some((file, &file.header.tensors[name]))
    }
}

/// Writes one safetensors file holding `tensors` (in that order) converted to `dtype`.
/// Returns the file's size and blake3 hex digest.
pub fn write_file(
    path: &Path,
    tensors: &[TensorPlan],
    dtype: Dtype,
    metadata: &BTreeMap<String, String>,
    sources: &Sources,
    progress: &Reporter,
) -> Result<(u64, String), CkptError> {
    let entries: Vec<HeaderEntry> = tensors.iter().map(|t| HeaderEntry { name: &t.name, dtype, shape: &t.shape }).collect();
    let (header, _) = build_header(&entries, metadata);
    let mut file = File::create(path).map_err(io(path))?;
    let mut hasher = blake3::Hasher::new();
    let mut total = header.len() as u64;
    file.write_all(&header).map_err(io(path))?;
    hasher.update(&header);
    let mut buf = Vec::new();
    let prefetch = |t: Option<&TensorPlan>| {
        for p in t.map(|t| &t.pieces[..]).unwrap_or(&[]) {
            if let Some((f, m)) = p.src.as_deref().and_then(|k| sources.get(k)) {
                f.prefetch(m);
            }
        }
    };
    prefetch(tensors.first());
    for (i, t) in tensors.iter().enumerate() {
        // Keep the disk busy with the next tensor while this one is assembled.
        prefetch(tensors.get(i + 1));
        let (rows, cols) = matrix(&t.shape);
        let row_bytes = cols * dtype.size() as u64;
        let step = (CHUNK_BYTES / row_bytes.max(1)).max(1);
        let mut r = 0;
        while r < rows {
            let end = (r + step).min(rows);
            let bytes = match direct_slice(t, r, end, cols, dtype, sources) {
                Some(slice) => slice,
                None => {
                    buf.clear();
                    buf.resize(((end - r) * row_bytes) as usize, 0);
                    fill(&mut buf, t, r, end, cols, dtype, sources);
                    &buf[..]
                }
            };
            file.write_all(bytes).map_err(io(path))?;
            hasher.update(bytes);
            progress.inc(bytes.len() as u64);
            total += bytes.len() as u64;
            r = end;
        }
        for p in &t.pieces {
            if let Some((f, m)) = p.src.as_deref().and_then(|k| sources.get(k)) {
                f.release(m);
            }
        }
    }
    file.flush().map_err(io(path))?;
    Ok((total, hasher.finalize().to_hex().to_string()))
}

/// When rows `r0..r1` are one contiguous run of a source in the output dtype, that run.
fn direct_slice<'a>(t: &TensorPlan, r0: u64, r1: u64, cols: u64, dtype: Dtype, sources: &'a Sources) -> Option<&'a [u8]> {
    let p = t.pieces.iter().find(|p| p.dst_row <= r0 && p.dst_row + p.rows >= r1)?;
    if p.transpose || p.cols != cols || p.dst_col != 0 || p.src_col != 0 {
        return None;
    }
    let (f, m) = sources.get(p.src.as_deref()?)?;
    let (_, src_cols) = matrix(&m.shape);
    if m.dtype != dtype || src_cols != cols {
        return None;
    }
    let e = dtype.size() as u64;
    let first = p.src_row + (r0 - p.dst_row);
    let start = (first * cols * e) as usize;
    let len = ((r1 - r0) * cols * e) as usize;
    Some(&f.bytes(m)[start..start + len])
}

/// Assembles rows `r0..r1` of `t` into `buf` (zeroed, `(r1 - r0) * cols` elements).
fn fill(buf: &mut [u8], t: &TensorPlan, r0: u64, r1: u64, cols: u64, dtype: Dtype, sources: &Sources) {
    let e = dtype.size();
    for p in &t.pieces {
        let lo = p.dst_row.max(r0);
        let hi = (p.dst_row + p.rows).min(r1);
        if lo >= hi {
            continue;
        }
        let Some((f, m)) = p.src.as_deref().and_then(|k| sources.get(k)) else { continue };
        let src = f.bytes(m);
        let (_, src_cols) = matrix(&m.shape);
        let se = m.dtype.size();
        for row in lo..hi {
            let i = row - p.dst_row;
            let dst_at = (((row - r0) * cols + p.dst_col) as usize) * e;
            let dst = &mut buf[dst_at..dst_at + p.cols as usize * e];
            if !p.transpose {
                let at = (((p.src_row + i) * src_cols + p.src_col) as usize) * se;
                convert(&src[at..at + p.cols as usize * se], m.dtype, dst, dtype);
            } else {
                for j in 0..p.cols as usize {
                    let at = (((p.src_row + j as u64) * src_cols + p.src_col + i) as usize) * se;
                    convert(&src[at..at + se], m.dtype, &mut dst[j * e..(j + 1) * e], dtype);
                }
            }
        }
    }
}

/// Copies elements, converting between float32, bfloat16 and float16.
fn convert(src: &[u8], from: Dtype, dst: &mut [u8], to: Dtype) {
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    let n = dst.len() / to.size();
    for k in 0..n {
        let x = match from {
            Dtype::F32 => f32::from_le_bytes(src[4 * k..4 * k + 4].try_into().unwrap()),
            Dtype::BF16 => bf16::from_le_bytes([src[2 * k], src[2 * k + 1]]).to_f32(),
            Dtype::F16 => f16::from_le_bytes([src[2 * k], src[2 * k + 1]]).to_f32(),
            _ => unreachable!("only float dtypes are accepted"),
        };
        match to {
            Dtype::F32 => dst[4 * k..4 * k + 4].copy_from_slice(&x.to_le_bytes()),
            Dtype::BF16 => dst[2 * k..2 * k + 2].copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
            Dtype::F16 => dst[2 * k..2 * k + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes()),
            _ => unreachable!("only float dtypes are written"),
        }
    }
}

/// Pieces kept for a tensor after dropping empty ones; used by callers composing plans.
pub fn non_empty(pieces: Vec<Piece>) -> Vec<Piece> {
    pieces.into_iter().filter(|p| p.rows > 0 && p.cols > 0).collect()
}

/// A directory next to the destination that becomes the destination on [`Staging::commit`] and
/// is removed if dropped before that.
pub struct Staging {
    pub dir: PathBuf,
    dst: PathBuf,
    committed: bool,
}

impl Staging {
    pub fn new(dst: &Path) -> Result<Staging, CkptError> {
        if dst.exists() {
            let empty = dst.is_dir() && std::fs::read_dir(dst).map_err(io(dst))?.next().is_none();
            if !empty {
                return Err(CkptError::DestinationExists { path: dst.display().to_string() });
            }
        }
        let name = dst.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
        let parent = dst.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(io(parent))?;
        remove_abandoned(parent, &name);
        let dir = parent.join(format!(".{name}.staging-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        std::fs::create_dir(&dir).map_err(io(&dir))?;
        Ok(Staging { dir, dst: dst.to_path_buf(), committed: false })
    }

    pub fn commit(mut self) -> Result<(), CkptError> {
        if self.dst.is_dir() {
            // An empty directory handed to us by the engine; replace it.
            std::fs::remove_dir(&self.dst).map_err(io(&self.dst))?;
        }
        std::fs::rename(&self.dir, &self.dst).map_err(io(&self.dst))?;
        self.committed = true;
        Ok(())
    }
}

/// Removes staging directories for `name` left by processes that were killed (their pid is
/// gone), so interrupted runs do not pile up next to the destination.
fn remove_abandoned(parent: &Path, name: &str) {
    if !Path::new("/proc/self").exists() {
        return; // no way to tell live processes from dead ones here
    }
    let prefix = format!(".{name}.staging-");
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = file.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
