//! Streams planned tensors from source safetensors files into safetensors files, a bounded step
//! at a time, hashing as it writes; and the staging directory that makes outputs all-or-nothing.
//!
//! Tensors made of whole source rows (embeddings, fused QKV, fc1, norms: most of the bytes) are
//! copied with positioned reads into one small buffer that is hashed and written while it is still
//! in the CPU cache. Tensors that gather columns, transpose or change dtype are assembled from the
//! memory maps.

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

/// Bytes read, hashed and written per step: small enough to stay in cache between the three.
const STEP_BYTES: usize = 1 << 20;

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

/// The output file, its running digest and size.
struct Out<'a> {
    file: File,
    path: &'a Path,
    hasher: blake3::Hasher,
    bytes: u64,
    progress: &'a Reporter,
}

impl Out<'_> {
    /// Tensor bytes: what the progress counts (its total is the tensors' size).
    fn put(&mut self, data: &[u8]) -> Result<(), CkptError> {
        self.put_header(data)?;
        self.progress.inc(data.len() as u64);
        Ok(())
    }

    fn put_header(&mut self, data: &[u8]) -> Result<(), CkptError> {
        self.file.write_all(data).map_err(io(self.path))?;
        self.hasher.update(data);
        self.bytes += data.len() as u64;
        Ok(())
    }
}

/// A byte run of an output tensor: zeros, or a contiguous range of a source file.
enum Run<'a> {
    Zeros(u64),
    File { src: &'a StFile, offset: u64, len: u64 },
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
    let entries: Vec<HeaderEntry> =
        tensors.iter().map(|t| HeaderEntry { name: &t.name, dtype, shape: &t.shape }).collect();
    let (header, _) = build_header(&entries, metadata);
    let file = File::create(path).map_err(io(path))?;
    let mut out = Out { file, path, hasher: blake3::Hasher::new(), bytes: 0, progress };
    out.put_header(&header)?;
    // One buffer for the whole file; zero only where a gather leaves holes.
    let mut buf = vec![0u8; STEP_BYTES];
    let zeros = vec![0u8; STEP_BYTES];
    let prefetch = |t: Option<&TensorPlan>| {
        for p in t.map(|t| &t.pieces[..]).unwrap_or(&[]) {
            if let Some((f, m)) = p.src.as_deref().and_then(|k| sources.get(k)) {
                f.prefetch(m);
            }
        }
    };
    prefetch(tensors.first());
    for (i, t) in tensors.iter().enumerate() {
        // Keep the disk busy with the next tensor while this one is written.
        prefetch(tensors.get(i + 1));
        match row_runs(t, dtype, sources) {
            Some(runs) => {
                for run in runs {
                    copy_run(&run, &mut buf, &zeros, &mut out)?;
                }
            }
            None => gather(t, dtype, sources, &mut buf, &mut out)?,
        }
        for p in &t.pieces {
            if let Some((f, m)) = p.src.as_deref().and_then(|k| sources.get(k)) {
                f.release(m);
            }
        }
    }
    out.file.flush().map_err(io(path))?;
    Ok((out.bytes, out.hasher.finalize().to_hex().to_string()))
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

fn copy_run(run: &Run, buf: &mut [u8], zeros: &[u8], out: &mut Out) -> Result<(), CkptError> {
    match *run {
        Run::Zeros(mut left) => {
            while left > 0 {
                let n = left.min(zeros.len() as u64);
                out.put(&zeros[..n as usize])?;
                left -= n;
            }
        }
        Run::File { src, mut offset, len } => {
            let end = offset + len;
            while offset < end {
                let n = (end - offset).min(buf.len() as u64) as usize;
                src.read_at(offset, &mut buf[..n]).map_err(io(&src.path))?;
                out.put(&buf[..n])?;
                offset += n as u64;
            }
        }
    }
    Ok(())
}

/// Writes `t` a block of rows at a time, assembling each block from the memory maps.
fn gather(t: &TensorPlan, dtype: Dtype, sources: &Sources, buf: &mut Vec<u8>, out: &mut Out) -> Result<(), CkptError> {
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
        out.put(&buf[..n])?;
        r = end;
    }
    Ok(())
}

/// Assembles rows `r0..r1` of `t` into `buf` (`(r1 - r0) * cols` elements); zero-source and
/// missing-source pieces become zeros.
fn fill(
    buf: &mut [u8],
    t: &TensorPlan,
    r0: u64,
    r1: u64,
    cols: u64,
    dtype: Dtype,
    sources: &Sources,
) -> Result<(), CkptError> {
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
/// is removed if dropped before that: the one every command that writes an output directory
/// uses ([`mflow_untrusted::staging`]), which also removes what killed processes left beside
/// the destination, and what is being written when the process is asked to stop.
pub struct Staging {
    dst: PathBuf,
    inner: mflow_untrusted::staging::Staging,
}

impl Staging {
    pub fn new(dst: &Path) -> Result<Staging, CkptError> {
        check_free(dst)?;
        let inner = mflow_untrusted::staging::Staging::create(dst).map_err(staging_error)?;
        Ok(Staging { dst: dst.to_path_buf(), inner })
    }

    pub fn dir(&self) -> &Path {
        self.inner.path()
    }

    /// Renames the staging directory onto the destination (an empty directory there, handed to
    /// us by the engine, is replaced).
    pub fn commit(self) -> Result<(), CkptError> {
        // Again: what was put there meanwhile is said, not left to rename(2)'s errno.
        check_free(&self.dst)?;
        self.inner.commit().map_err(staging_error)
    }
}

/// Refuses a destination that is not free ([`mflow_untrusted::staging::taken`]), saying why.
fn check_free(dst: &Path) -> Result<(), CkptError> {
    use mflow_untrusted::staging::Taken;
    let path = dst.display().to_string();
    match mflow_untrusted::staging::taken(dst).map_err(io(dst))? {
        None => Ok(()),
        Some(Taken::Link) => Err(CkptError::DestinationLink { path }),
        Some(Taken::NotEmpty) => Err(CkptError::DestinationExists { path }),
    }
}

fn staging_error(e: mflow_untrusted::staging::StagingError) -> CkptError {
    CkptError::Io { path: e.path.display().to_string(), source: e.source }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(
        src: Option<&str>,
        src_row: u64,
        src_col: u64,
        dst_row: u64,
        rows: u64,
        cols: u64,
        transpose: bool,
    ) -> Piece {
        Piece { src: src.map(String::from), src_row, src_col, dst_row, dst_col: 0, rows, cols, transpose }
    }

    /// Whole-row runs (positioned reads), zero rows, column slices (one read per row) and a
    /// transposed gather (memory map) land where the plan says.
    #[test]
    fn every_copy_path_writes_the_planned_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.safetensors");
        let shape = [4u64, 3];
        let (mut bytes, _) =
            build_header(&[HeaderEntry { name: "a", dtype: Dtype::F32, shape: &shape }], &BTreeMap::new());
        let a: Vec<f32> = (0..12).map(|v| v as f32).collect();
        bytes.extend(a.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(&src, bytes).unwrap();
        let sources = Sources {
            files: vec![StFile::open(&src).unwrap()],
            index: HashMap::from([("a".to_string(), (0, "a".to_string()))]),
        };
        let plan = |name: &str, shape: Vec<u64>, pieces| TensorPlan { name: name.into(), shape, pieces };
        let tensors = [
            plan(
                "rows",
                vec![5, 3],
                vec![
                    piece(Some("a"), 2, 0, 0, 2, 3, false),
                    piece(None, 0, 0, 2, 1, 3, false),
                    piece(Some("a"), 0, 0, 3, 2, 3, false),
                ],
            ),
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
