//! Writes planned tensors from source safetensors files into safetensors files, spread over all
//! threads, then hashes each file; and the staging directory that makes outputs all-or-nothing.
//!
//! Every tensor's place in its file is known from the header, so the work is cut into items that
//! write at fixed offsets in any order: tensors made of whole source rows (embeddings, fused QKV,
//! fc1, norms: most of the bytes) are copied inside the kernel in slices of at most
//! [`COPY_ITEM_BYTES`]; zero rows are left as holes of the pre-sized file; tensors that gather
//! columns, transpose or change dtype are assembled a bounded step at a time. Each file is then
//! hashed through a moving memory-map window, in parallel inside the window.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::MmapOptions;
use mflow_progress::Reporter;
use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{io, CkptError};
use crate::layout::{matrix, Piece, TensorPlan};
use crate::st::{build_header, HeaderEntry, StFile, TensorMeta};

/// Rows assembled per step of a gathered tensor: small enough to stay in cache.
const STEP_BYTES: usize = 1 << 20;
/// The largest slice of a row run copied as one work item: big enough that the kernel copies in
/// long runs, small enough that threads share the largest tensors evenly. Tiny in unit tests, so
/// that their small tensors are split too.
const COPY_ITEM_BYTES: u64 = if cfg!(test) { 16 } else { 32 << 20 };
/// Bytes of an output file mapped at a time while hashing (bounds the resident set).
const HASH_WINDOW: u64 = 64 << 20;

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

/// One safetensors file to write: `tensors` in file order.
pub struct OutFile<'a> {
    pub path: PathBuf,
    pub tensors: &'a [TensorPlan],
}

/// A byte run of an output tensor: zeros, or a contiguous range of a source file.
enum Run<'a> {
    Zeros(u64),
    File { src: &'a StFile, offset: u64, len: u64 },
}

/// A piece of work that writes at a fixed offset of output file `out`.
enum Item<'a> {
    Copy { out: usize, at: u64, src: &'a StFile, offset: u64, len: u64 },
    Gather { out: usize, at: u64, tensor: &'a TensorPlan },
}

/// Writes every file of `files` (their tensors converted to `dtype`, with `metadata` in each
/// header). Returns each file's size and blake3 hex digest, in order.
pub fn write_files(
    files: &[OutFile],
    dtype: Dtype,
    metadata: &BTreeMap<String, String>,
    sources: &Sources,
    progress: &Reporter,
) -> Result<Vec<(u64, String)>, CkptError> {
    let mut outs = Vec::with_capacity(files.len());
    let mut items = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let entries: Vec<HeaderEntry> = f.tensors.iter().map(|t| HeaderEntry { name: &t.name, dtype, shape: &t.shape }).collect();
        let (header, sizes) = build_header(&entries, metadata);
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&f.path).map_err(io(&f.path))?;
        file.write_all_at(&header, 0).map_err(io(&f.path))?;
        let mut at = header.len() as u64;
        for (t, size) in f.tensors.iter().zip(sizes) {
            plan_items(i, at, t, dtype, sources, &mut items);
            at += size;
        }
        // Zero runs stay holes of this length and read back as zeros.
        file.set_len(at).map_err(io(&f.path))?;
        outs.push((file, at));
    }
    items.par_iter().try_for_each_init(Vec::new, |buf, item| -> Result<(), CkptError> {
        match *item {
            Item::Copy { out, at, src, offset, len } => {
                src.prefetch_range(offset, len);
                src.copy_to(offset, &outs[out].0, at, len, buf).map_err(io(&files[out].path))?;
                progress.inc(len);
            }
            Item::Gather { out, at, tensor } => gather(tensor, dtype, sources, buf, &outs[out].0, at, &files[out].path, progress)?,
        }
        Ok(())
    })?;
    progress.inc(files.iter().flat_map(|f| f.tensors).map(|t| zero_bytes(t, dtype, sources)).sum());
    outs.iter().zip(files).map(|((file, len), f)| Ok((*len, digest(file, *len).map_err(io(&f.path))?))).collect()
}

/// Writes one file; see [`write_files`].
pub fn write_file(
    path: &Path,
    tensors: &[TensorPlan],
    dtype: Dtype,
    metadata: &BTreeMap<String, String>,
    sources: &Sources,
    progress: &Reporter,
) -> Result<(u64, String), CkptError> {
    let file = OutFile { path: path.to_path_buf(), tensors };
    Ok(write_files(std::slice::from_ref(&file), dtype, metadata, sources, progress)?.remove(0))
}

/// The work items of tensor `t`, which starts at byte `at` of output file `out`.
fn plan_items<'a>(out: usize, mut at: u64, t: &'a TensorPlan, dtype: Dtype, sources: &'a Sources, items: &mut Vec<Item<'a>>) {
    let Some(runs) = row_runs(t, dtype, sources) else {
        items.push(Item::Gather { out, at, tensor: t });
        return;
    };
    for run in runs {
        match run {
            Run::Zeros(len) => at += len,
            Run::File { src, mut offset, len } => {
                let end = offset + len;
                while offset < end {
                    let n = (end - offset).min(COPY_ITEM_BYTES);
                    items.push(Item::Copy { out, at, src, offset, len: n });
                    (offset, at) = (offset + n, at + n);
                }
            }
        }
    }
}

/// Bytes of `t` left as holes (zero runs of a row-run tensor), counted for progress.
fn zero_bytes(t: &TensorPlan, dtype: Dtype, sources: &Sources) -> u64 {
    row_runs(t, dtype, sources)
        .map(|runs| runs.iter().map(|r| if let Run::Zeros(n) = r { *n } else { 0 }).sum())
        .unwrap_or(0)
}

/// The blake3 digest of the first `len` bytes of `file`, mapped a window at a time.
fn digest(file: &File, len: u64) -> std::io::Result<String> {
    let mut hasher = blake3::Hasher::new();
    let mut at = 0;
    while at < len {
        let n = (len - at).min(HASH_WINDOW);
        // SAFETY: the file is ours, in a staging directory, and every write to it has finished.
        let window = unsafe { MmapOptions::new().offset(at).len(n as usize).populate().map(file)? };
        hasher.update_rayon(&window);
        at += n;
    }
    Ok(hasher.finalize().to_hex().to_string())
}

/// When `t` is made of whole rows of sources already in `dtype` (and zero rows), those runs in
/// output order; `None` when some piece needs gathering, transposing or converting.
fn row_runs<'a>(t: &TensorPlan, dtype: Dtype, sources: &'a Sources) -> Option<Vec<Run<'a>>> {
    let (rows, cols) = matrix(&t.shape);
    let e = dtype.size() as u64;
    let mut pieces: Vec<&Piece> = t.pieces.iter().collect();
    pieces.sort_by_key(|p| p.dst_row);
    let mut runs = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for p in pieces {
        if p.dst_row != at || p.dst_col != 0 || p.src_col != 0 || p.cols != cols || p.transpose {
            return None;
        }
        let len = p.rows * cols * e;
        match p.src.as_deref() {
            None => runs.push(Run::Zeros(len)),
            Some(key) => {
                let (src, m) = sources.get(key)?;
                if m.dtype != dtype || matrix(&m.shape).1 != cols {
                    return None;
                }
                runs.push(Run::File { src, offset: m.start as u64 + p.src_row * cols * e, len });
            }
        }
        at += p.rows;
    }
    (at == rows).then_some(runs)
}

/// Writes `t` at byte `at` of `file`, a block of rows at a time, assembling each block from the
/// sources; then lets go of the source pages it mapped.
#[allow(clippy::too_many_arguments)]
fn gather(
    t: &TensorPlan,
    dtype: Dtype,
    sources: &Sources,
    buf: &mut Vec<u8>,
    file: &File,
    mut at: u64,
    path: &Path,
    progress: &Reporter,
) -> Result<(), CkptError> {
    let srcs: Vec<_> = t.pieces.iter().filter_map(|p| p.src.as_deref().and_then(|k| sources.get(k))).collect();
    for (f, m) in &srcs {
        f.prefetch(m);
    }
    let (rows, cols) = matrix(&t.shape);
    let row_bytes = cols * dtype.size() as u64;
    let step = (STEP_BYTES as u64 / row_bytes.max(1)).max(1);
    // Plans tile their tensors; should one not, the uncovered elements are written as zeros.
    let tiled = t.pieces.iter().map(|p| p.rows * p.cols).sum::<u64>() == rows * cols;
    let mut r = 0;
    while r < rows {
        let end = (r + step).min(rows);
        let n = ((end - r) * row_bytes) as usize;
        if buf.len() < n {
            buf.resize(n, 0);
        }
        if !tiled {
            buf[..n].fill(0);
        }
        fill(&mut buf[..n], t, r, end, cols, dtype, sources)?;
        file.write_all_at(&buf[..n], at).map_err(io(path))?;
        progress.inc(n as u64);
        at += n as u64;
        r = end;
    }
    for (f, m) in &srcs {
        f.release(m);
    }
    Ok(())
}

/// Assembles rows `r0..r1` of `t` into `buf` (`(r1 - r0) * cols` elements); zero-source and
/// missing-source pieces become zeros.
fn fill(buf: &mut [u8], t: &TensorPlan, r0: u64, r1: u64, cols: u64, dtype: Dtype, sources: &Sources) -> Result<(), CkptError> {
    let e = dtype.size();
    for p in &t.pieces {
        let lo = p.dst_row.max(r0);
        let hi = (p.dst_row + p.rows).min(r1);
        if lo >= hi {
            continue;
        }
        let Some((f, m)) = p.src.as_deref().and_then(|k| sources.get(k)) else {
            for row in lo..hi {
                let at = (((row - r0) * cols + p.dst_col) as usize) * e;
                buf[at..at + p.cols as usize * e].fill(0);
            }
            continue;
        };
        let (_, src_cols) = matrix(&m.shape);
        let se = m.dtype.size();
        if !p.transpose && m.dtype == dtype {
            // A column slice: one positioned read per row, straight into place.
            for row in lo..hi {
                let dst_at = (((row - r0) * cols + p.dst_col) as usize) * e;
                let at = ((p.src_row + row - p.dst_row) * src_cols + p.src_col) * se as u64;
                f.read_at(m.start as u64 + at, &mut buf[dst_at..dst_at + p.cols as usize * e]).map_err(io(&f.path))?;
            }
            continue;
        }
        let src = f.bytes(m);
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
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(src: Option<&str>, src_row: u64, src_col: u64, dst_row: u64, rows: u64, cols: u64, transpose: bool) -> Piece {
        Piece { src: src.map(String::from), src_row, src_col, dst_row, dst_col: 0, rows, cols, transpose }
    }

    /// Whole-row runs (kernel copies, split into several items), zero rows (holes), column
    /// slices (one read per row) and a transposed gather (memory map) land where the plan says.
    #[test]
    fn every_copy_path_writes_the_planned_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.safetensors");
        let shape = [4u64, 3];
        let (mut bytes, _) = build_header(&[HeaderEntry { name: "a", dtype: Dtype::F32, shape: &shape }], &BTreeMap::new());
        let a: Vec<f32> = (0..12).map(|v| v as f32).collect();
        bytes.extend(a.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(&src, bytes).unwrap();
        let sources = Sources {
            files: vec![StFile::open(&src).unwrap()],
            index: HashMap::from([("a".to_string(), (0, "a".to_string()))]),
        };
        let plan = |name: &str, shape: Vec<u64>, pieces| TensorPlan { name: name.into(), shape, pieces };
        let tensors = [
            plan("rows", vec![5, 3], vec![piece(Some("a"), 2, 0, 0, 2, 3, false), piece(None, 0, 0, 2, 1, 3, false), piece(Some("a"), 0, 0, 3, 2, 3, false)]),
            plan("cols", vec![4, 2], vec![piece(Some("a"), 0, 1, 0, 4, 2, false)]),
            plan("transposed", vec![3, 4], vec![piece(Some("a"), 0, 0, 0, 3, 4, true)]),
        ];
        let out = dir.path().join("out.safetensors");
        let progress = Reporter::new("test", None, "bytes");
        let (size, digest) = write_file(&out, &tensors, Dtype::F32, &BTreeMap::new(), &sources, &progress).unwrap();
        let written = std::fs::read(&out).unwrap();
        assert_eq!(size, written.len() as u64);
        assert_eq!(digest, blake3::hash(&written).to_hex().to_string());
        let st = safetensors::SafeTensors::deserialize(&written).unwrap();
        let values = |name: &str| -> Vec<f32> {
            st.tensor(name).unwrap().data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
        };
        assert_eq!(values("rows"), [6., 7., 8., 9., 10., 11., 0., 0., 0., 0., 1., 2., 3., 4., 5.]);
        assert_eq!(values("cols"), [1., 2., 4., 5., 7., 8., 10., 11.]);
        assert_eq!(values("transposed"), [0., 3., 6., 9., 1., 4., 7., 10., 2., 5., 8., 11.]);

        // Another output dtype sends every tensor through the converting gather.
        let out16 = dir.path().join("out16.safetensors");
        write_file(&out16, &tensors, Dtype::BF16, &BTreeMap::new(), &sources, &progress).unwrap();
        let written = std::fs::read(&out16).unwrap();
        let st = safetensors::SafeTensors::deserialize(&written).unwrap();
        let values16 = |name: &str| -> Vec<f32> {
            st.tensor(name).unwrap().data().chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        };
        assert_eq!(values16("rows"), [6., 7., 8., 9., 10., 11., 0., 0., 0., 0., 1., 2., 3., 4., 5.]);
        assert_eq!(values16("cols"), [1., 2., 4., 5., 7., 8., 10., 11.]);
        assert_eq!(values16("transposed"), [0., 3., 6., 9., 1., 4., 7., 10., 2., 5., 8., 11.]);
    }
}
