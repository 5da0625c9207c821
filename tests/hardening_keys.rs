//! Every file a stage reads is in its cache key: for each kind, each path-valued parameter
//! given as a path (not an upstream output) is digested as `inputs` are, and held to the
//! project as they are. Changing any file a stage reads changes its key.

mod common;

use std::collections::BTreeMap;
use std::process::Output;

use common::{code, stderr, stdout, Project};

/// stderr as one line of words: messages are wrapped to the width of a terminal, and the
/// frame of a diagnostic is not part of what it says.
fn said(o: &Output) -> String {
    let frame = |w: &str| w.chars().all(|c| "│╰─▶×├╭╮╯┆·⚠☓".contains(c));
    stderr(o).split_whitespace().filter(|w| !frame(w)).collect::<Vec<_>>().join(" ")
}

/// Each stage's key as `mflow plan` computes it.
fn keys(p: &Project) -> BTreeMap<String, String> {
    let o = p.mflow(&["plan", "spec.toml", "--format", "json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["stage"].as_str().unwrap().to_string(),
                d["key"].as_str().unwrap_or_else(|| panic!("no key: {d}")).to_string(),
            )
        })
        .collect()
}

fn write(p: &Project, name: &str, text: &str) {
    let f = p.file(name);
    std::fs::create_dir_all(f.parent().unwrap()).unwrap();
    std::fs::write(f, text).unwrap();
}

/// One stage of every kind, each reading files named by path.
const SPEC: &str = r#"[pipeline]
name = "keys"

[stages.cmd]
kind = "command"
inputs = ["in.txt"]
run = ["true"]

[stages.model]
kind = "model"
source = "path:m"

[stages.convert]
kind = "convert"
model = "hf"

[stages.data]
kind = "dataset"
inputs = ["corpus.txt"]
tokenizer = "tok/tokenizer.json"

[stages.datadir]
kind = "dataset"
inputs = ["corpus.txt"]
tokenizer = "tokdir"

[stages.train]
kind = "train"
model = "shards"
data = "ds"

[stages.evaluate]
kind = "evaluate"
model = "shards"
data = "ds"

[stages.export]
kind = "export"
model = "shards"
"#;

/// Stage -> the files it reads.
const READS: &[(&str, &[&str])] = &[
    ("cmd", &["in.txt"]),
    ("model", &["m/config.json", "m/model.safetensors", "m/tokenizer.json"]),
    ("convert", &["hf/config.json", "hf/model.safetensors"]),
    ("data", &["corpus.txt", "tok/tokenizer.json", "tok/tokenizer_config.json", "tok/special_tokens_map.json"]),
    ("datadir", &["corpus.txt", "tokdir/tokenizer.json", "tokdir/tokenizer_config.json"]),
    ("train", &[SHARD, SHARD_INDEX, "ds/train.bin", "ds/train.idx", "ds/valid.bin"]),
    ("evaluate", &[SHARD, SHARD_INDEX, "ds/train.bin", "ds/train.idx", "ds/valid.bin"]),
    ("export", &[SHARD, SHARD_INDEX]),
];

const SHARD: &str = "shards/mp_rank_00/model.safetensors";
const SHARD_INDEX: &str = "shards/mflow_shards.json";

fn project() -> Project {
    let p = Project::new(SPEC);
    for (_, files) in READS {
        for f in *files {
            write(&p, f, &format!("{{\"file\": \"{f}\"}}"));
        }
    }
    p
}

#[test]
fn hardening_every_file_a_stage_of_each_kind_reads_changes_its_key() {
    let p = project();
    let before = keys(&p);
    for (stage, files) in READS {
        for f in *files {
            let old = std::fs::read_to_string(p.file(f)).unwrap();
            write(&p, f, &format!("{old} "));
            let after = keys(&p);
            assert_ne!(before[*stage], after[*stage], "stage `{stage}`: changing {f} left its key as it was");
            // Stages that do not read the file keep their keys.
            for (other, reads) in READS {
                if !reads.contains(f) {
                    assert_eq!(before[*other], after[*other], "stage `{other}` does not read {f}, yet its key changed");
                }
            }
            write(&p, f, &old);
            assert_eq!(keys(&p), before, "{f} is as it was, and so must every key be");
        }
    }
}

#[test]
fn hardening_a_tokenizer_companion_that_appears_or_goes_changes_the_key() {
    let p = project();
    let before = keys(&p)["data"].clone();
    std::fs::remove_file(p.file("tok/special_tokens_map.json")).unwrap();
    let without = keys(&p)["data"].clone();
    assert_ne!(before, without);
    write(&p, "tokdir/special_tokens_map.json", "{}");
    let k = keys(&p);
    assert_eq!(k["data"], without);
    assert_ne!(k["datadir"], before);
}

#[test]
fn hardening_a_tokenizer_path_out_of_the_project_is_refused_as_inputs_are() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("tokenizer.json"), "{}").unwrap();
    let p = project();
    let rel = format!("../{}/tokenizer.json", outside.path().file_name().unwrap().to_string_lossy());
    p.write_spec(&SPEC.replace("tok/tokenizer.json", &rel));
    let o = p.mflow(&["plan", "spec.toml"]);
    let err = said(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("mflow::plan::input_escapes") && err.contains(&rel), "{err}");
    // A link in the project that leads out is refused the same way.
    std::os::unix::fs::symlink(outside.path().join("tokenizer.json"), p.file("tok/linked.json")).unwrap();
    p.write_spec(&SPEC.replace("tok/tokenizer.json", "tok/linked.json"));
    let o = p.mflow(&["plan", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(said(&o).contains("mflow::plan::input_link_escapes"), "{}", stderr(&o));
}

/// A word-level tokenizer small enough to write here.
fn tokenizer(hello: u32) -> String {
    format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{{"id":0,"content":"<eos>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}],"normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{{"<eos>":0,"hello":{hello},"world":2,"[UNK]":3,"other":4,"x":5}},"unk_token":"[UNK]"}}}}"#
    )
}

/// The case of the report: a dataset is tokenized, then an id in its tokenizer file is edited.
/// The plan must say the dataset runs again.
#[test]
fn hardening_editing_a_tokenizer_file_reruns_the_dataset() {
    let spec = "[pipeline]\nname = \"tok\"\n\n[stages.data]\nkind = \"dataset\"\ninputs = [\"corpus.txt\"]\ntokenizer = \"tok/tokenizer.json\"\neod = \"<eos>\"\nsplits = \"1,0,0\"\n";
    let p = Project::new(spec);
    write(&p, "corpus.txt", "hello world\n");
    write(&p, "tok/tokenizer.json", &tokenizer(1));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let plan = stdout(&p.mflow(&["plan", "spec.toml"]));
    assert!(plan.contains("cached"), "{plan}");
    write(&p, "tok/tokenizer.json", &tokenizer(4));
    let plan = stdout(&p.mflow(&["plan", "spec.toml"]));
    assert!(!plan.contains("cached") && plan.contains("run"), "{plan}");
    let why = stdout(&p.mflow(&["why", "spec.toml", "data"]));
    assert!(why.contains("tok/tokenizer.json"), "{why}");
}
