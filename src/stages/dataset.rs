//! `dataset`: text or JSONL (gz and zst too) tokenized into Megatron's indexed dataset, split
//! into train, valid and test by document.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::job::{literal_path, JobContext, JobPlan};
use super::Check;
use crate::spec::error::{to_span, SpecError};
use crate::spec::schema::{def, opt, req, Field, Ty, COUNT, NATURAL};

pub const DOC: &str = "text/JSONL -> Megatron indexed dataset";

pub const FIELDS: &[Field] = &[
    req("tokenizer", Ty::Str, "\"${stages.MODEL.output}\", a tokenizer.json path, or \"byte-level\""),
    def("format", Ty::Enum(&["auto", "text", "jsonl"]), "\"auto\"", "input format"),
    def("split_by", Ty::Enum(&["file", "line", "blank-line"]), "\"file\"", "how plain text splits into documents"),
    def("text_key", Ty::Str, "\"text\"", "JSONL key holding the text"),
    def("splits", Ty::Str, "\"98,1,1\"", "train,valid,test ratios by document"),
    def("seed", NATURAL, "1234", "seed of the split"),
    opt("max_doc_tokens", COUNT, "truncate longer documents"),
    def("dtype", Ty::Enum(&["auto", "uint16", "int32"]), "\"auto\"", "token dtype"),
    def("on_invalid_utf8", Ty::Enum(&["skip", "fail"]), "\"skip\"", "skip and count, or fail"),
    opt("eod", Ty::Str, "end-of-document token (default: the tokenizer's)"),
];

/// The byte-level tokenizer, which no file describes.
const BYTE_LEVEL: &str = "byte-level";

/// Files beside a tokenizer that decide what it does: `tokenizer_config.json` names the
/// end-of-document token, `special_tokens_map.json` the special tokens.
const TOKENIZER_COMPANIONS: [&str; 2] = ["tokenizer_config.json", "special_tokens_map.json"];

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub tokenizer: String,
    pub format: String,
    pub split_by: String,
    pub text_key: String,
    pub splits: String,
    pub seed: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_doc_tokens: Option<i64>,
    pub dtype: String,
    pub on_invalid_utf8: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eod: Option<String>,
}

impl Params {
    pub fn check(&self, cx: &mut Check<'_>) {
        if cx.node.get("inputs").is_none() {
            cx.errors.push(SpecError::MissingKey {
                src: cx.src.clone(),
                span: to_span(cx.node.span().map(|r| r.start..r.start + 1)),
                key: "inputs".into(),
                table: "this dataset stage".into(),
                help: "add `inputs = [\"corpus/*.jsonl\"]`: the text or JSONL files to tokenize".into(),
            });
        }
        let parts: Vec<Option<f64>> =
            self.splits.split(',').map(|x| x.trim().parse::<f64>().ok().filter(|v| *v >= 0.0)).collect();
        if parts.len() != 3 || parts.iter().any(Option::is_none) || parts.iter().flatten().sum::<f64>() <= 0.0 {
            cx.invalid(
                "splits",
                "expected three non-negative ratios",
                "write train,valid,test ratios, e.g. \"98,1,1\"",
            );
        }
    }

    /// The files a tokenizer given as a path is read from: tokenizer.json (the path itself, or
    /// in the directory it names) and the companions beside it that exist.
    pub fn tokenizer_files(&self, spec_dir: &Path) -> Vec<String> {
        let Some(tok) = literal_path(&self.tokenizer).filter(|t| t != BYTE_LEVEL) else { return Vec::new() };
        let dir_named = std::fs::metadata(spec_dir.join(&tok)).is_ok_and(|m| m.is_dir());
        let (dir, main) = if dir_named {
            (Path::new(&tok).to_path_buf(), Path::new(&tok).join("tokenizer.json"))
        } else {
            (Path::new(&tok).parent().map(Path::to_path_buf).unwrap_or_default(), PathBuf::from(&tok))
        };
        let mut files = vec![main.to_string_lossy().to_string()];
        for name in TOKENIZER_COMPANIONS {
            let f = dir.join(name);
            if std::fs::symlink_metadata(spec_dir.join(&f)).is_ok() {
                files.push(f.to_string_lossy().to_string());
            }
        }
        files
    }

    pub fn job(&self, cx: &JobContext<'_>) -> Result<JobPlan, String> {
        let mut argv = vec![cx.mflow()?, "dataset".into()];
        argv.extend(cx.stage.inputs.iter().map(|i| cx.absolute(i)));
        let tok = cx.resolve(&self.tokenizer);
        let tok = if tok == BYTE_LEVEL { tok } else { cx.absolute(&tok) };
        argv.extend(["--tokenizer".into(), tok, "--out".into(), cx.output()]);
        for (flag, value) in [
            ("--format", &self.format),
            ("--split-by", &self.split_by),
            ("--text-key", &self.text_key),
            ("--splits", &self.splits),
            ("--dtype", &self.dtype),
            ("--on-invalid-utf8", &self.on_invalid_utf8),
        ] {
            argv.extend([flag.to_string(), value.clone()]);
        }
        if let Some(eod) = &self.eod {
            argv.extend(["--eod".into(), eod.clone()]);
        }
        argv.extend(["--seed".into(), self.seed.to_string()]);
        if let Some(n) = self.max_doc_tokens {
            argv.extend(["--max-doc-tokens".into(), n.to_string()]);
        }
        argv.extend(["--threads".into(), (cx.cpus.round() as usize).max(1).to_string()]);
        Ok(cx.plan(vec![argv], true))
    }
}
