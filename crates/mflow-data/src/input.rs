//! Finding the input files and streaming documents out of them: plain text (one document per
//! file, per line or per paragraph) and JSONL, each optionally gzip- or zstd-compressed.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::sync::{atomic::AtomicU64, Arc};

use miette::Diagnostic;
use serde::Serialize;
use thiserror::Error;

use crate::options::{InputFormat, InvalidUtf8, SplitBy};
use crate::text_field::{self, Found};

#[derive(Debug, Error, Diagnostic)]
pub enum InputError {
    #[error("input pattern {pattern:?} matches no file")]
    #[diagnostic(
        code(mflow::data::input::no_match),
        help("check the pattern; it is expanded by mflow, relative to the working directory")
    )]
    NoMatch { pattern: String },

    #[error("input pattern {pattern:?} is not a valid glob: {message}")]
    #[diagnostic(code(mflow::data::input::bad_pattern), help("use *, ? and [..] wildcards, and ** for any depth"))]
    BadPattern { pattern: String, message: String },

    #[error("input {path} does not exist")]
    #[diagnostic(
        code(mflow::data::input::not_found),
        help("check the path, or quote a glob so that it reaches mflow unexpanded")
    )]
    NotFound { path: PathBuf },

    #[error("input {path} is a directory")]
    #[diagnostic(
        code(mflow::data::input::is_dir),
        help("name the files inside it with a quoted glob, e.g. 'DIR/**/*.txt'")
    )]
    IsDir { path: PathBuf },

    #[error("cannot read {path} (line {line}): {source}")]
    #[diagnostic(
        code(mflow::data::input::read),
        help("check that the file is readable and, if compressed, not truncated or corrupt")
    )]
    Read { path: PathBuf, line: u64, source: std::io::Error },

    #[error("{path}:{line}: malformed JSON: {message}")]
    #[diagnostic(
        code(mflow::data::input::malformed_json),
        help("every non-blank line of a JSONL file must be one JSON object; fix or remove this line")
    )]
    MalformedJson { path: PathBuf, line: u64, message: String },

    #[error("{path}:{line}: the JSON object has no {key:?} field")]
    #[diagnostic(
        code(mflow::data::input::missing_key),
        help(
            "name the field holding the text with --text-key (fields on this line: {})",
            crate::untrusted::excerpt(fields)
        )
    )]
    MissingKey { path: PathBuf, line: u64, key: String, fields: String },

    #[error("{path}:{line}: field {key:?} is {found}, not a string")]
    #[diagnostic(
        code(mflow::data::input::not_a_string),
        help("the document text must be a JSON string; choose another field with --text-key")
    )]
    NotAString { path: PathBuf, line: u64, key: String, found: &'static str },

    #[error("{path}:{line}: a lone surrogate escape (column {column}) is not valid Unicode")]
    #[diagnostic(code(mflow::data::input::lone_surrogate), help("a \\uD800-\\uDFFF escape must be one half of a pair; fix the line, or pass --on-invalid-utf8 skip to drop such documents (they are counted as invalid_utf8 in stats.json)"))]
    LoneSurrogate { path: PathBuf, line: u64, column: usize },

    #[error(
        "--split-by {split_by} applies to text input only, but no input is text: {path} is read as JSONL (by its name)"
    )]
    #[diagnostic(
        code(mflow::data::input::split_by_jsonl),
        help("JSONL has one document per line; drop --split-by, or pass --format text to read the inputs as text")
    )]
    SplitByWithJsonl { path: PathBuf, split_by: String },

    #[error("{path}:{line}: invalid UTF-8")]
    #[diagnostic(code(mflow::data::input::invalid_utf8), help("re-encode the file as UTF-8, or pass --on-invalid-utf8 skip to drop such documents (they are counted in stats.json)"))]
    InvalidUtf8 { path: PathBuf, line: u64 },

    #[error("{path}:{line}: document longer than {limit} bytes")]
    #[diagnostic(
        code(mflow::data::input::doc_too_large),
        help("raise the limit with --max-doc-bytes, or split the input with --split-by line / blank-line")
    )]
    DocTooLarge { path: PathBuf, line: u64, limit: u64 },
}

/// How one file is parsed, after `--format auto` is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileFormat {
    Text,
    Jsonl,
}

#[derive(Debug, Clone, Serialize)]
pub struct InputFile {
    pub path: PathBuf,
    pub format: FileFormat,
    pub bytes: u64,
}

/// Expands files and globs into a sorted list with each file once, however it was named.
pub fn expand(patterns: &[String], format: InputFormat) -> Result<Vec<InputFile>, InputError> {
    let mut paths = Vec::new();
    for pattern in patterns {
        if pattern.contains(['*', '?', '[']) {
            let matches = glob::glob(pattern)
                .map_err(|e| InputError::BadPattern { pattern: pattern.clone(), message: e.to_string() })?;
            let before = paths.len();
            for m in matches {
                let path =
                    m.map_err(|e| InputError::Read { path: e.path().to_path_buf(), line: 0, source: e.into() })?;
                if path.is_file() {
                    paths.push(path);
                }
            }
            if paths.len() == before {
                return Err(InputError::NoMatch { pattern: pattern.clone() });
            }
        } else {
            let path = PathBuf::from(pattern);
            if path.is_dir() {
                return Err(InputError::IsDir { path });
            }
            match std::fs::metadata(&path) {
                Err(_) => return Err(InputError::NotFound { path }),
                // A FIFO or device would block the build or never end; say so instead.
                Ok(m) if !m.is_file() => {
                    return Err(InputError::Read {
                        path,
                        line: 0,
                        source: crate::untrusted::not_regular(m.file_type()),
                    })
                }
                Ok(_) => {}
            }
            paths.push(path);
        }
    }
    paths.sort();
    // The same file named twice (`data/*.jsonl` and `./data/a.jsonl`, or a link) is read once:
    // its documents would otherwise land in train and in valid or test.
    let mut seen = std::collections::HashSet::new();
    paths.retain(|p| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).map_or(true, |m| seen.insert((m.dev(), m.ino())))
    });
    paths
        .into_iter()
        .map(|path| {
            let bytes = std::fs::metadata(&path)
                .map_err(|source| InputError::Read { path: path.clone(), line: 0, source })?
                .len();
            let format = match format {
                InputFormat::Text => FileFormat::Text,
                InputFormat::Jsonl => FileFormat::Jsonl,
                InputFormat::Auto => detect_format(&path),
            };
            Ok(InputFile { path, format, bytes })
        })
        .collect()
}

fn detect_format(path: &Path) -> FileFormat {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let name = [".gz", ".zst", ".zstd"].iter().find_map(|c| name.strip_suffix(c)).unwrap_or(&name);
    if [".jsonl", ".json", ".ndjson"].iter().any(|e| name.ends_with(e)) {
        FileFormat::Jsonl
    } else {
        FileFormat::Text
    }
}

/// One document and where it starts.
pub struct Doc {
    pub text: String,
    pub file: u32,
    pub line: u64,
}

/// Documents dropped while reading.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Skipped {
    pub invalid_utf8: u64,
    pub empty: u64,
}

pub struct ReaderOptions {
    pub split_by: SplitBy,
    pub text_key: String,
    pub on_invalid_utf8: InvalidUtf8,
    pub max_doc_bytes: u64,
}

struct OpenFile {
    index: usize,
    reader: Box<dyn BufRead + Send>,
    line: u64,
    done: bool,
}

/// Streams the documents of all files in order.
pub struct DocReader {
    files: Vec<InputFile>,
    opts: ReaderOptions,
    bytes_read: Arc<AtomicU64>,
    next_file: usize,
    current: Option<OpenFile>,
    line_buf: Vec<u8>,
    pub skipped: Skipped,
}

impl DocReader {
    /// `bytes_read` counts raw (possibly compressed) input bytes, for progress.
    pub fn new(files: Vec<InputFile>, opts: ReaderOptions, bytes_read: Arc<AtomicU64>) -> DocReader {
        DocReader {
            files,
            opts,
            bytes_read,
            next_file: 0,
            current: None,
            line_buf: Vec::new(),
            skipped: Skipped::default(),
        }
    }

    pub fn next_doc(&mut self) -> Result<Option<Doc>, InputError> {
        if self.next_file == 0 {
            self.check_split_by()?;
        }
        loop {
            if self.current.as_ref().is_none_or(|f| f.done) {
                if self.next_file == self.files.len() {
                    return Ok(None);
                }
                self.current = Some(self.open(self.next_file)?);
                self.next_file += 1;
            }
            let format = self.files[self.current.as_ref().map_or(0, |f| f.index)].format;
            let doc = match (format, self.opts.split_by) {
                (FileFormat::Jsonl, _) => self.next_jsonl()?,
                (FileFormat::Text, SplitBy::File) => self.next_whole_file()?,
                (FileFormat::Text, SplitBy::Line) => self.next_line_doc()?,
                (FileFormat::Text, SplitBy::BlankLine) => self.next_paragraph()?,
            };
            if doc.is_some() {
                return Ok(doc);
            }
        }
    }

    /// `--split-by` cuts the text files; JSONL (here by its name, with `--format auto`) has one
    /// document per line. Where no input is text it would be ignored, so it is refused, as with
    /// `--format jsonl`; beside text files it applies to them.
    fn check_split_by(&self) -> Result<(), InputError> {
        let split_by = self.opts.split_by;
        match self.files.first() {
            Some(f) if split_by != SplitBy::File && self.files.iter().all(|f| f.format == FileFormat::Jsonl) => {
                Err(InputError::SplitByWithJsonl { path: f.path.clone(), split_by: split_by.name() })
            }
            _ => Ok(()),
        }
    }

    fn open(&self, index: usize) -> Result<OpenFile, InputError> {
        let InputFile { path, bytes, .. } = &self.files[index];
        let read_err = |source| InputError::Read { path: path.clone(), line: 0, source };
        let reader = crate::stream::open(path, *bytes, self.bytes_read.clone()).map_err(read_err)?;
        Ok(OpenFile { index, reader, line: 0, done: false })
    }

    /// Reads one line (without its `\n` / `\r\n`) into `line_buf`; `false` at end of file.
    fn read_line(&mut self) -> Result<bool, InputError> {
        let f = self.current.as_mut().expect("a file is open");
        let limit = self.opts.max_doc_bytes;
        self.line_buf.clear();
        f.line += 1;
        let path = &self.files[f.index].path;
        let n = (&mut f.reader)
            .take(limit + 2)
            .read_until(b'\n', &mut self.line_buf)
            .map_err(|source| InputError::Read { path: path.clone(), line: f.line, source })?;
        if n == 0 {
            f.done = true;
            return Ok(false);
        }
        if self.line_buf.last() == Some(&b'\n') {
            self.line_buf.pop();
            if self.line_buf.last() == Some(&b'\r') {
                self.line_buf.pop();
            }
        }
        if self.line_buf.len() as u64 > limit {
            return Err(InputError::DocTooLarge { path: path.clone(), line: f.line, limit });
        }
        Ok(true)
    }

    fn location(&self) -> (u32, u64, &Path) {
        let f = self.current.as_ref().expect("a file is open");
        (f.index as u32, f.line, &self.files[f.index].path)
    }

    /// Applies the invalid-UTF-8 policy; `Ok(None)` means skip.
    fn utf8(&mut self, bytes: Vec<u8>, line: u64) -> Result<Option<String>, InputError> {
        match String::from_utf8(bytes) {
            Ok(s) => Ok(Some(s)),
            Err(_) if self.opts.on_invalid_utf8 == InvalidUtf8::Skip => {
                self.skipped.invalid_utf8 += 1;
                Ok(None)
            }
            Err(_) => Err(InputError::InvalidUtf8 { path: self.location().2.to_path_buf(), line }),
        }
    }

    fn next_jsonl(&mut self) -> Result<Option<Doc>, InputError> {
        while self.read_line()? {
            if self.line_buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let (file, line, path) = self.location();
            let Ok(json) = std::str::from_utf8(&self.line_buf) else {
                if self.opts.on_invalid_utf8 == InvalidUtf8::Skip {
                    self.skipped.invalid_utf8 += 1;
                    continue;
                }
                return Err(InputError::InvalidUtf8 { path: path.to_path_buf(), line });
            };
            let found = match text_field::parse(json, &self.opts.text_key) {
                Ok(found) => found,
                // A string with no UTF-8 form: the policy for invalid UTF-8 applies.
                Err(e) if text_field::lone_surrogate(&e) => {
                    if self.opts.on_invalid_utf8 == InvalidUtf8::Skip {
                        self.skipped.invalid_utf8 += 1;
                        continue;
                    }
                    return Err(InputError::LoneSurrogate { path: path.to_path_buf(), line, column: e.column() });
                }
                Err(e) => {
                    let message = text_field::message(&e);
                    return Err(InputError::MalformedJson { path: path.to_path_buf(), line, message });
                }
            };
            let text = match found {
                Found::Text(t) => t,
                Found::NotString(found) => {
                    return Err(InputError::NotAString {
                        path: path.to_path_buf(),
                        line,
                        key: self.opts.text_key.clone(),
                        found,
                    })
                }
                Found::Missing(fields) => {
                    let fields = if fields.is_empty() { "none".to_string() } else { fields.join(", ") };
                    return Err(InputError::MissingKey {
                        path: path.to_path_buf(),
                        line,
                        key: self.opts.text_key.clone(),
                        fields,
                    });
                }
            };
            if text.is_empty() {
                self.skipped.empty += 1;
                continue;
            }
            return Ok(Some(Doc { text, file, line }));
        }
        Ok(None)
    }

    fn next_whole_file(&mut self) -> Result<Option<Doc>, InputError> {
        let limit = self.opts.max_doc_bytes;
        let f = self.current.as_mut().expect("a file is open");
        f.done = true;
        f.line = 1;
        let path = &self.files[f.index].path;
        let mut bytes = Vec::new();
        (&mut f.reader).take(limit + 1).read_to_end(&mut bytes).map_err(|source| InputError::Read {
            path: path.clone(),
            line: 1,
            source,
        })?;
        if bytes.len() as u64 > limit {
            return Err(InputError::DocTooLarge { path: path.clone(), line: 1, limit });
        }
        let file = f.index as u32;
        if bytes.is_empty() {
            self.skipped.empty += 1;
            return Ok(None);
        }
        Ok(self.utf8(bytes, 1)?.map(|text| Doc { text, file, line: 1 }))
    }

    fn next_line_doc(&mut self) -> Result<Option<Doc>, InputError> {
        while self.read_line()? {
            if self.line_buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let (file, line, _) = self.location();
            let bytes = std::mem::take(&mut self.line_buf);
            if let Some(text) = self.utf8(bytes, line)? {
                return Ok(Some(Doc { text, file, line }));
            }
        }
        Ok(None)
    }

    fn next_paragraph(&mut self) -> Result<Option<Doc>, InputError> {
        let mut para: Vec<u8> = Vec::new();
        let mut start = 0;
        loop {
            let more = self.read_line()?;
            let blank = !more || self.line_buf.iter().all(u8::is_ascii_whitespace);
            if blank {
                if !para.is_empty() {
                    let file = self.location().0;
                    if let Some(text) = self.utf8(para, start)? {
                        return Ok(Some(Doc { text, file, line: start }));
                    }
                    para = Vec::new();
                }
                if !more {
                    return Ok(None);
                }
                continue;
            }
            if para.is_empty() {
                start = self.location().1;
            } else {
                para.push(b'\n');
            }
            para.extend_from_slice(&self.line_buf);
            if para.len() as u64 > self.opts.max_doc_bytes {
                let path = self.location().2.to_path_buf();
                return Err(InputError::DocTooLarge { path, line: start, limit: self.opts.max_doc_bytes });
            }
        }
    }

    pub fn path(&self, file: u32) -> &Path {
        &self.files[file as usize].path
    }
}
