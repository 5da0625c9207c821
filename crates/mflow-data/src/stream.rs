//! The bytes of one input file as the documents are read from them: counted for progress,
//! decompressed (gzip or zstd, told by their magic bytes) and past a byte order mark.

use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const READ_BUFFER: usize = 1 << 20;
/// The UTF-8 byte order mark some editors put at the start of a file.
const BOM: &[u8] = b"\xef\xbb\xbf";

/// Opens the regular file `path`, listed at `listed` bytes; `count` adds up the raw (possibly
/// compressed) bytes read from it.
pub(crate) fn open(path: &Path, listed: u64, count: Arc<AtomicU64>) -> io::Result<Box<dyn BufRead + Send>> {
    let file = crate::untrusted::open_regular(path)?;
    let mut raw = BufReader::with_capacity(READ_BUFFER, Counting { inner: file, count, left: listed });
    let magic = raw.fill_buf()?;
    let reader: Box<dyn BufRead + Send> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(READ_BUFFER, flate2::bufread::MultiGzDecoder::new(raw)))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(BufReader::with_capacity(READ_BUFFER, zstd::stream::read::Decoder::with_buffer(raw)?))
    } else {
        Box::new(raw)
    };
    skip_bom(reader)
}

/// `reader` past a byte order mark at its start, which is no part of the text (as Python's
/// utf-8-sig reads it); one further on is left as it is.
fn skip_bom(mut reader: Box<dyn BufRead + Send>) -> io::Result<Box<dyn BufRead + Send>> {
    // Read rather than peeked: a decoder may hand out fewer bytes than the mark at first.
    let mut head = Vec::with_capacity(BOM.len());
    (&mut reader).take(BOM.len() as u64).read_to_end(&mut head)?;
    if head == BOM {
        return Ok(reader);
    }
    Ok(Box::new(io::Cursor::new(head).chain(reader)))
}

/// Counts bytes read up to the file's listed size (the progress total), should it grow meanwhile.
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
    left: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let counted = self.left.min(n as u64);
        self.left -= counted;
        self.count.fetch_add(counted, Ordering::Relaxed);
        Ok(n)
    }
}
