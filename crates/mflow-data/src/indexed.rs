//! Writer for Megatron-Core's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), the layout read by
//! `megatron.core.datasets.indexed_dataset.IndexedDataset`.
//!
//! The `.bin` is the concatenated token ids of every document in one integer dtype. The `.idx` is
//! `b"MMIDIDX\0\0"`, `<Q` version 1, `<B` dtype code, `<Q` sequence count, `<Q` document-index
//! count, then int32 sequence lengths, int64 byte offsets and int64 document indices. mflow
//! writes one sequence per document, so the document indices are simply `0..=n`.
//!
//! Tokens go to the `.bin` as they arrive and per-document lengths are spilled to a side file,
//! so memory stays flat whatever the corpus size.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use miette::Diagnostic;
use serde::Serialize;
use thiserror::Error;

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const IO_BUFFER: usize = 4 << 20;
/// The `.bin` is handed to the kernel's writeback every this many bytes while it is written, so
/// that the `fsync` at the end (before the dataset is committed) has little left to wait for.
const WRITE_BEHIND: u64 = 32 << 20;

#[derive(Debug, Error, Diagnostic)]
pub enum IndexedError {
    #[error("cannot write {path}: {source}")]
    #[diagnostic(code(mflow::data::indexed::io), help("check that the output filesystem is writable and not full"))]
    Io { path: PathBuf, source: std::io::Error },

    #[error("document of {tokens} tokens is too long for the index of {path} (at most {max} tokens per document)")]
    #[diagnostic(code(mflow::data::indexed::doc_too_long), help("limit document length with --max-doc-tokens"))]
    DocTooLong { path: PathBuf, tokens: u64, max: u64 },
}

/// Token dtype of a `.bin` file, with Megatron's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Uint16,
    Int32,
}

impl Dtype {
    /// Megatron's own choice (`DType.optimal_dtype`): uint16 when the vocabulary has fewer than
    /// 65,500 entries, int32 otherwise.
    pub fn optimal(vocab_size: u64) -> Dtype {
        if vocab_size < 65_500 {
            Dtype::Uint16
        } else {
            Dtype::Int32
        }
    }

    /// Code stored in the `.idx` header (`DType` enum of indexed_dataset.py).
    pub fn code(self) -> u8 {
        match self {
            Dtype::Uint16 => 8,
            Dtype::Int32 => 4,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::Uint16 => 2,
            Dtype::Int32 => 4,
        }
    }

    /// One more than the largest token id the dtype can hold.
    pub fn id_limit(self) -> u64 {
        match self {
            Dtype::Uint16 => 1 << 16,
            Dtype::Int32 => 1 << 31,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Uint16 => "uint16",
            Dtype::Int32 => "int32",
        }
    }

    /// Appends `ids` to `out` as little-endian values of this dtype. Ids were checked against
    /// [`Dtype::id_limit`] when the tokenizer was chosen.
    pub fn extend_bytes(self, ids: &[u32], out: &mut Vec<u8>) {
        // sized first, then filled in place: a loop the compiler vectorizes, where pushing each
        // id checked the capacity every time
        let start = out.len();
        out.resize(start + ids.len() * self.size(), 0);
        let added = &mut out[start..];
        match self {
            Dtype::Uint16 => {
                for (bytes, &id) in added.chunks_exact_mut(2).zip(ids) {
                    bytes.copy_from_slice(&(id as u16).to_le_bytes());
                }
            }
            Dtype::Int32 => {
                for (bytes, &id) in added.chunks_exact_mut(4).zip(ids) {
                    bytes.copy_from_slice(&(id as i32).to_le_bytes());
                }
            }
        }
    }
}

/// Starts writing `len` bytes of `file` from `offset` to disk, without waiting for it; a hint, so
/// a failure is left to the `fsync` that follows.
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: sync_file_range only reads the descriptor, which `file` keeps open.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

/// Streams one indexed dataset to disk.
pub struct IndexedWriter {
    prefix: PathBuf,
    dtype: Dtype,
    bin: BufWriter<File>,
    lengths: BufWriter<File>,
    documents: u64,
    tokens: u64,
    /// Bytes appended to the `.bin`, and how many of them writeback was started for.
    written: u64,
    behind: u64,
}

impl IndexedWriter {
    /// Creates `PREFIX.bin` and a length spill file `PREFIX.lengths.tmp`.
    pub fn create(prefix: &Path, dtype: Dtype) -> Result<IndexedWriter, IndexedError> {
        let bin_path = with_ext(prefix, "bin");
        let bin = File::create(&bin_path).map_err(|source| IndexedError::Io { path: bin_path, source })?;
        let len_path = with_ext(prefix, "lengths.tmp");
        let lengths = File::create(&len_path).map_err(|source| IndexedError::Io { path: len_path, source })?;
        Ok(IndexedWriter {
            prefix: prefix.to_path_buf(),
            dtype,
            bin: BufWriter::with_capacity(IO_BUFFER, bin),
            lengths: BufWriter::with_capacity(1 << 16, lengths),
            documents: 0,
            tokens: 0,
            written: 0,
            behind: 0,
        })
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    pub fn documents(&self) -> u64 {
        self.documents
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Appends several documents at once: `bytes` holds their tokens already encoded in this
    /// writer's dtype, `lengths` their token counts.
    pub fn append(&mut self, bytes: &[u8], lengths: &[u32]) -> Result<(), IndexedError> {
        debug_assert_eq!(lengths.iter().map(|&n| n as usize).sum::<usize>() * self.dtype.size(), bytes.len());
        let mut encoded = Vec::with_capacity(lengths.len() * 4);
        for &n in lengths {
            if n as u64 > i32::MAX as u64 {
                return Err(IndexedError::DocTooLong { path: self.bin_path(), tokens: n as u64, max: i32::MAX as u64 });
            }
            encoded.extend_from_slice(&(n as i32).to_le_bytes());
        }
        self.bin.write_all(bytes).map_err(|source| IndexedError::Io { path: self.bin_path(), source })?;
        self.lengths
            .write_all(&encoded)
            .map_err(|source| IndexedError::Io { path: with_ext(&self.prefix, "lengths.tmp"), source })?;
        self.documents += lengths.len() as u64;
        self.tokens += (bytes.len() / self.dtype.size()) as u64;
        self.written += bytes.len() as u64;
        if self.written - self.behind >= WRITE_BEHIND {
            self.bin.flush().map_err(|source| IndexedError::Io { path: self.bin_path(), source })?;
            start_writeback(self.bin.get_ref(), self.behind, self.written - self.behind);
            self.behind = self.written;
        }
        Ok(())
    }

    /// Flushes the `.bin`, writes the `.idx` from the spilled lengths and removes the spill file.
    pub fn finish(self) -> Result<(), IndexedError> {
        let IndexedWriter { prefix, dtype, bin, lengths, documents, .. } = self;
        let bin_path = with_ext(&prefix, "bin");
        let len_path = with_ext(&prefix, "lengths.tmp");
        let idx_path = with_ext(&prefix, "idx");
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| IndexedError::Io { path, source }
        };
        bin.into_inner().map_err(|e| e.into_error()).and_then(|f| f.sync_all()).map_err(io(&bin_path))?;
        lengths.into_inner().map_err(|e| e.into_error()).map_err(io(&len_path))?;

        let idx = File::create(&idx_path).map_err(io(&idx_path))?;
        let mut idx = BufWriter::with_capacity(IO_BUFFER, idx);
        let mut header = Vec::with_capacity(34);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&1u64.to_le_bytes());
        header.push(dtype.code());
        header.extend_from_slice(&documents.to_le_bytes()); // sequences: one per document
        header.extend_from_slice(&(documents + 1).to_le_bytes()); // document indices incl. the leading 0
        idx.write_all(&header).map_err(io(&idx_path))?;

        // int32 lengths, copied from the spill file
        let mut spill = File::open(&len_path).map_err(io(&len_path))?;
        std::io::copy(&mut spill, &mut idx).map_err(io(&idx_path))?;

        // int64 byte offsets, recomputed from the lengths
        let mut spill = BufReader::with_capacity(1 << 16, File::open(&len_path).map_err(io(&len_path))?);
        let mut offset: i64 = 0;
        let mut buf = [0u8; 4];
        for _ in 0..documents {
            spill.read_exact(&mut buf).map_err(io(&len_path))?;
            idx.write_all(&offset.to_le_bytes()).map_err(io(&idx_path))?;
            offset += i32::from_le_bytes(buf) as i64 * dtype.size() as i64;
        }
        for doc in 0..=documents {
            idx.write_all(&(doc as i64).to_le_bytes()).map_err(io(&idx_path))?;
        }
        idx.into_inner().map_err(|e| e.into_error()).and_then(|f| f.sync_all()).map_err(io(&idx_path))?;
        std::fs::remove_file(&len_path).map_err(io(&len_path))?;
        Ok(())
    }

    /// Removes the files of a dataset that received no document (Megatron cannot map an
    /// empty `.bin`).
    pub fn discard(self) -> Result<(), IndexedError> {
        let IndexedWriter { prefix, bin, lengths, .. } = self;
        drop((bin, lengths));
        for ext in ["bin", "lengths.tmp"] {
            let path = with_ext(&prefix, ext);
            std::fs::remove_file(&path).map_err(|source| IndexedError::Io { path, source })?;
        }
        Ok(())
    }

    fn bin_path(&self) -> PathBuf {
        with_ext(&self.prefix, "bin")
    }
}

/// `PREFIX.ext` without treating dots inside PREFIX's file name as an extension.
pub fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idx_layout_matches_megatron() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("train");
        let mut w = IndexedWriter::create(&prefix, Dtype::Uint16).unwrap();
        let mut bytes = Vec::new();
        Dtype::Uint16.extend_bytes(&[5, 6, 0, 7, 0], &mut bytes);
        w.append(&bytes, &[3, 2]).unwrap();
        w.finish().unwrap();
        assert_eq!(std::fs::read(dir.path().join("train.bin")).unwrap(), [5, 0, 6, 0, 0, 0, 7, 0, 0, 0]);
        let idx = std::fs::read(dir.path().join("train.idx")).unwrap();
        let mut want = b"MMIDIDX\x00\x00".to_vec();
        want.extend_from_slice(&1u64.to_le_bytes());
        want.push(8);
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice(&3u64.to_le_bytes());
        for n in [3i32, 2] {
            want.extend_from_slice(&n.to_le_bytes());
        }
        for p in [0i64, 6] {
            want.extend_from_slice(&p.to_le_bytes());
        }
        for d in [0i64, 1, 2] {
            want.extend_from_slice(&d.to_le_bytes());
        }
        assert_eq!(idx, want);
        assert!(!dir.path().join("train.lengths.tmp").exists());
    }

    #[test]
    fn ids_are_appended_little_endian_after_what_is_there() {
        let ids = [1u32, 0x1234, 65_535, 0x0102_0304];
        for (dtype, want) in [
            (Dtype::Uint16, vec![9, 1, 0, 0x34, 0x12, 0xff, 0xff, 0x04, 0x03]),
            (Dtype::Int32, vec![9, 1, 0, 0, 0, 0x34, 0x12, 0, 0, 0xff, 0xff, 0, 0, 0x04, 0x03, 0x02, 0x01]),
        ] {
            let mut bytes = vec![9];
            dtype.extend_bytes(&ids, &mut bytes);
            assert_eq!(bytes, want, "{dtype:?}");
        }
    }

    #[test]
    fn megatron_dtype_threshold() {
        assert_eq!(Dtype::optimal(65_499), Dtype::Uint16);
        assert_eq!(Dtype::optimal(65_500), Dtype::Int32);
    }
}
