//! Reading untrusted safetensors files and writing safetensors headers.
//!
//! Every size in a header is checked against the file before anything is allocated or sliced,
//! and every error names the file and, where there is one, the tensor. The `safetensors` crate
//! then validates the same header again as a second opinion.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use miette::Diagnostic;
use safetensors::Dtype;
use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use thiserror::Error;

use crate::untrusted::{excerpt, open_regular, FileError};

/// Largest header accepted, as in the safetensors reference implementation.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Most tensors accepted in one file. The largest supported models (4096 layers of a dozen
/// tensors) stay below it; a header of a million tiny entries would otherwise cost gigabytes
/// of memory before any other check could fail.
pub const MAX_TENSORS: usize = 65_536;
/// Most `__metadata__` entries accepted (writers put one or two there).
pub const MAX_METADATA: usize = 1024;
/// Most dimensions of one tensor (mflow moves 1-D and 2-D tensors).
pub const MAX_DIMS: usize = 8;

#[derive(Debug, Error, Diagnostic)]
pub enum StError {
    #[error("{file}: cannot read")]
    #[diagnostic(code(mflow::ckpt::safetensors::io), help("check that the file exists and is readable"))]
    Io { file: String, source: std::io::Error },

    #[error(transparent)]
    #[diagnostic(transparent)]
    File(#[from] FileError),

    #[error("{file}: header lists more than {limit} {what}")]
    #[diagnostic(
        code(mflow::ckpt::safetensors::too_many),
        help("the file is corrupt or hostile; mflow's models have far fewer; split it or write it again")
    )]
    TooMany { file: String, what: &'static str, limit: usize },

    #[error("{file}: tensor `{}` is listed twice in the header", excerpt(.tensor))]
    #[diagnostic(
        code(mflow::ckpt::safetensors::duplicate),
        help("the header is ambiguous (which entry holds the weights?); write the file again")
    )]
    Duplicate { file: String, tensor: String },

    #[error("{file}: file is {len} bytes, too short to hold a safetensors header")]
    #[diagnostic(
        code(mflow::ckpt::safetensors::truncated),
        help("the file is truncated; download or convert it again")
    )]
    TooShort { file: String, len: u64 },

    #[error("{file}: header length {header} is larger than the {limit}-byte limit or the {len}-byte file")]
    #[diagnostic(
        code(mflow::ckpt::safetensors::header_length),
        help("the file is truncated or is not a safetensors file; only .safetensors checkpoints are accepted")
    )]
    HeaderLength { file: String, header: u64, limit: u64, len: u64 },

    #[error("{file}: header is not valid JSON: {}", excerpt(.reason))]
    #[diagnostic(
        code(mflow::ckpt::safetensors::header_json),
        help("the file is corrupt or is not a safetensors file")
    )]
    HeaderJson { file: String, reason: String },

    #[error("{file}: tensor `{}`: {}", excerpt(.tensor), excerpt(.reason))]
    #[diagnostic(
        code(mflow::ckpt::safetensors::tensor),
        help("the header disagrees with itself or with the file size; the file is corrupt or truncated")
    )]
    BadTensor { file: String, tensor: String, reason: String },

    #[error("{file}: data area is {data} bytes but the tensors cover {covered} bytes")]
    #[diagnostic(
        code(mflow::ckpt::safetensors::truncated_data),
        help("the file is truncated or has trailing bytes; download or convert it again")
    )]
    DataSize { file: String, data: u64, covered: u64 },

    #[error("{file}: rejected by the safetensors validator: {}", excerpt(.reason))]
    #[diagnostic(code(mflow::ckpt::safetensors::invalid), help("the file is corrupt"))]
    Invalid { file: String, reason: String },
}

/// Where one tensor lives in a file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the file.
    pub start: usize,
    pub end: usize,
}

/// The parsed header of a safetensors buffer.
#[derive(Debug, Clone)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorMeta>,
    pub metadata: Option<BTreeMap<String, String>>,
}

/// Parses and validates a whole safetensors buffer (header plus data). Never panics.
pub fn parse(file: &str, buf: &[u8]) -> Result<Header, StError> {
    let len = buf.len() as u64;
    if len < 8 {
        return Err(StError::TooShort { file: file.into(), len });
    }
    let header = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    if header > MAX_HEADER_BYTES || header > len - 8 {
        return Err(StError::HeaderLength { file: file.into(), header, limit: MAX_HEADER_BYTES, len });
    }
    let data_start = 8 + header as usize;
    let text = std::str::from_utf8(&buf[8..data_start])
        .map_err(|e| StError::HeaderJson { file: file.into(), reason: e.to_string() })?;
    let mut slot = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = HeaderSeed { file, slot: &mut slot }.deserialize(&mut de).and_then(|h| de.end().map(|()| h));
    let raw = match (parsed, slot) {
        (_, Some(e)) => return Err(e),
        (Ok(raw), None) => raw,
        (Err(e), None) => return Err(StError::HeaderJson { file: file.into(), reason: e.to_string() }),
    };
    let data_len = len - data_start as u64;
    let mut tensors = BTreeMap::new();
    let metadata = raw.metadata;
    for (name, info) in raw.tensors {
        let bad = |reason: String| StError::BadTensor { file: file.into(), tensor: name.clone(), reason };
        let (s, e) = info.data_offsets;
        if s > e || e as u64 > data_len {
            return Err(bad(format!("data offsets [{s}, {e}) fall outside the {data_len}-byte data area")));
        }
        let elements = info.shape.0.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let bytes = elements.and_then(|n| n.checked_mul(info.dtype.size() as u64));
        match bytes {
            Some(b) if b == (e - s) as u64 => {}
            Some(b) => {
                return Err(bad(format!(
                    "shape {:?} of {:?} needs {b} bytes but data offsets [{s}, {e}) hold {}",
                    info.shape.0,
                    info.dtype,
                    e - s
                )))
            }
            None => return Err(bad(format!("shape {:?} overflows", info.shape.0))),
        }
        let meta = TensorMeta { dtype: info.dtype, shape: info.shape.0, start: data_start + s, end: data_start + e };
        tensors.insert(name, meta);
    }
    check_layout(file, &tensors, data_start, data_len)?;
    // Second opinion from the reference implementation.
    safetensors::SafeTensors::read_metadata(buf)
        .map_err(|e| StError::Invalid { file: file.into(), reason: format!("{e:?}") })?;
    Ok(Header { tensors, metadata })
}

/// A header as read: tensor entries in file order, and the metadata.
struct RawHeader {
    tensors: Vec<(String, RawInfo)>,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: Dtype,
    shape: Dims,
    data_offsets: (usize, usize),
}

/// A shape of at most [`MAX_DIMS`] dimensions, refused as soon as it has more.
struct Dims(Vec<u64>);

impl<'de> Deserialize<'de> for Dims {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dims, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Dims;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "a list of at most {MAX_DIMS} dimensions")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dims, A::Error> {
                let mut dims = Vec::new();
                while let Some(d) = seq.next_element::<u64>()? {
                    if dims.len() == MAX_DIMS {
                        return Err(A::Error::custom(format!("more than {MAX_DIMS} dimensions")));
                    }
                    dims.push(d);
                }
                Ok(Dims(dims))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Reads the header map entry by entry, so that a count past the limits or a repeated name
/// stops the read before more is allocated. The precise error goes to `slot`.
struct HeaderSeed<'a> {
    file: &'a str,
    slot: &'a mut Option<StError>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = RawHeader;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawHeader, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = RawHeader;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let file = self.file;
        let mut names = std::collections::BTreeSet::new();
        let mut tensors = Vec::new();
        let mut metadata: Option<BTreeMap<String, String>> = None;
        while let Some(name) = map.next_key::<String>()? {
            let fail = |slot: &mut Option<StError>, e: StError| {
                let msg = e.to_string();
                *slot = Some(e);
                A::Error::custom(msg)
            };
            if !names.insert(name.clone()) {
                return Err(fail(self.slot, StError::Duplicate { file: file.into(), tensor: name }));
            }
            if name == "__metadata__" {
                let m = map.next_value::<Metadata>().map_err(|e| {
                    let reason = format!("__metadata__: {e}");
                    fail(self.slot, StError::HeaderJson { file: file.into(), reason })
                })?;
                metadata = Some(m.0);
                continue;
            }
            if tensors.len() == MAX_TENSORS {
                return Err(fail(
                    self.slot,
                    StError::TooMany { file: file.into(), what: "tensors", limit: MAX_TENSORS },
                ));
            }
            let info = map.next_value::<RawInfo>().map_err(|e| {
                let reason = e.to_string();
                fail(self.slot, StError::BadTensor { file: file.into(), tensor: name.clone(), reason })
            })?;
            tensors.push((name, info));
        }
        Ok(RawHeader { tensors, metadata })
    }
}

/// `__metadata__`: string values only, at most [`MAX_METADATA`] of them.
struct Metadata(BTreeMap<String, String>);

impl<'de> Deserialize<'de> for Metadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Metadata, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Metadata;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "an object of at most {MAX_METADATA} string values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Metadata, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((k, v)) = map.next_entry::<String, String>()? {
                    if out.len() == MAX_METADATA {
                        return Err(A::Error::custom(format!("more than {MAX_METADATA} entries")));
                    }
                    if out.insert(k, v).is_some() {
                        return Err(A::Error::custom("a key is listed twice"));
                    }
                }
                Ok(Metadata(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Tensors must tile the data area exactly: no overlap, no gap, nothing past the end.
fn check_layout(
    file: &str,
    tensors: &BTreeMap<String, TensorMeta>,
    data_start: usize,
    data_len: u64,
) -> Result<(), StError> {
    let mut spans: Vec<(&String, &TensorMeta)> = tensors.iter().collect();
    spans.sort_by_key(|(_, m)| (m.start, m.end));
    let mut pos = data_start;
    for (name, m) in spans {
        if m.start < pos {
            return Err(StError::BadTensor {
                file: file.into(),
                tensor: name.clone(),
                reason: format!(
                    "data offsets overlap the previous tensor (starts at {}, previous ends at {})",
                    m.start - data_start,
                    pos - data_start
                ),
            });
        }
        if m.start > pos {
            return Err(StError::BadTensor {
                file: file.into(),
                tensor: name.clone(),
                reason: format!("{} unused bytes before this tensor's data", m.start - pos),
            });
        }
        pos = m.end;
    }
    let covered = (pos - data_start) as u64;
    if covered != data_len {
        return Err(StError::DataSize { file: file.into(), data: data_len, covered });
    }
    Ok(())
}

/// A memory-mapped, validated safetensors file.
pub struct StFile {
    pub path: PathBuf,
    /// For positioned reads of whole row runs (no page faults, nothing added to our resident set).
    file: File,
    pub mmap: Mmap,
    pub header: Header,
}

impl StFile {
    pub fn open(path: &Path) -> Result<StFile, StError> {
        let name = path.display().to_string();
        let io = |source| StError::Io { file: name.clone(), source };
        let f = open_regular(path)?;
        let len = f.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(StError::TooShort { file: name, len });
        }
        // SAFETY: the map is read-only; mflow never writes its inputs while reading them.
        let mmap = unsafe { Mmap::map(&f) }.map_err(io)?;
        let header = parse(&name, &mmap)?;
        Ok(StFile { path: path.to_path_buf(), file: f, mmap, header })
    }

    /// Reads `buf.len()` bytes at byte `offset` of the file (offsets as in [`TensorMeta`]).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, offset)
    }

    pub fn bytes(&self, meta: &TensorMeta) -> &[u8] {
        &self.mmap[meta.start..meta.end]
    }

    /// Asks the kernel to start reading this range now, in large requests, instead of page by
    /// page as faults arrive (much faster on disks that do badly with small reads).
    pub fn prefetch(&self, meta: &TensorMeta) {
        let page = 4096;
        let start = meta.start / page * page;
        if meta.end > start {
            let _ = self.mmap.advise_range(memmap2::Advice::WillNeed, start, meta.end - start);
        }
    }

    /// Lets the kernel drop this range from our resident set; the page cache keeps it.
    pub fn release(&self, meta: &TensorMeta) {
        let page = 4096;
        let start = meta.start / page * page;
        let len = meta.end - start;
        if len > 0 {
            // SAFETY: DontNeed on a private read-only file map only drops our page-table
            // entries; later reads fault the same bytes back in from the file.
            let _ = unsafe { self.mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
        }
    }
}

/// One entry of a header to write.
pub struct HeaderEntry<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
}

/// Builds the bytes (length prefix plus padded JSON) of a safetensors header whose tensors are
/// laid out in the given order. Returns the bytes and each tensor's data byte length.
pub fn build_header(entries: &[HeaderEntry], metadata: &BTreeMap<String, String>) -> (Vec<u8>, Vec<u64>) {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::to_value(metadata).expect("string map"));
    }
    let mut offset = 0u64;
    let mut sizes = Vec::with_capacity(entries.len());
    for e in entries {
        let bytes = e.shape.iter().product::<u64>() * e.dtype.size() as u64;
        map.insert(
            e.name.to_string(),
            serde_json::json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
        sizes.push(bytes);
    }
    let mut json = serde_json::to_vec(&map).expect("json");
    // Data must start 8-byte aligned; pad the header with spaces as the reference writer does.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    (out, sizes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(header: &str, data: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data));
        v
    }

    #[test]
    fn written_headers_parse_back() {
        let shape = [2u64, 3];
        let (h, sizes) = build_header(&[HeaderEntry { name: "a", dtype: Dtype::F32, shape: &shape }], &BTreeMap::new());
        let mut buf = h.clone();
        buf.extend(vec![0u8; sizes[0] as usize]);
        let parsed = parse("x", &buf).unwrap();
        assert_eq!(parsed.tensors["a"].shape, vec![2, 3]);
        assert_eq!(parsed.tensors["a"].start, h.len());
    }

    #[test]
    fn gaps_overlaps_and_huge_headers_are_refused() {
        let gap = file_with(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, 8);
        assert!(matches!(parse("x", &gap), Err(StError::BadTensor { .. })));
        let overlap = file_with(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        );
        assert!(matches!(parse("x", &overlap), Err(StError::BadTensor { .. })));
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(matches!(parse("x", &huge), Err(StError::HeaderLength { .. })));
    }
}
