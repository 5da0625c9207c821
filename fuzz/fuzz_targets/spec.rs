//! Feeds arbitrary bytes, as the TOML text of a spec, to `mflow::spec::parse`: the parse and
//! checks that `spec::load` (what `mflow run` calls) runs on a file's text, without the file and
//! without its cache of checked specs. It must return errors whose messages quote only excerpts,
//! or a spec that keeps the invariants below, and never panic.
//!
//! Seeds: the repository's specs, and the test fixtures for the errors, one file each:
//!   mkdir -p fuzz/corpus/spec
//!   for f in $(find specs examples tests/fixtures -name '*.toml'); do
//!     cp "$f" "fuzz/corpus/spec/$(echo "$f" | tr / _)"; done
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use miette::Diagnostic;
use mflow::spec::{self, Spec};

/// Longest message (or help) one spec error may have: they quote excerpts of the spec.
const MAX_MESSAGE: usize = 4096;

/// The spec's place: a fixed, empty directory, made once. The parse only reads there
/// (the workdir checks); nothing is written per input.
fn spec_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("mflow-fuzz-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory for the fuzzed spec");
        std::fs::canonicalize(&dir).unwrap_or(dir).join("spec.toml")
    })
}

fuzz_target!(|data: &[u8]| {
    // `load` refuses bytes that are not UTF-8 before parsing.
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = spec_path();
    match spec::parse(path, text, &[]) {
        Ok(s) => check_spec(path, text, &s),
        Err(e) => {
            assert!(!e.errors.is_empty(), "an error without problems");
            assert!(e.to_string().len() < MAX_MESSAGE, "{} bytes", e.to_string().len());
            for err in &e.errors {
                let message = err.to_string();
                assert!(message.len() < MAX_MESSAGE, "message of {} bytes: {}", message.len(), excerpt(&message));
                if let Some(help) = err.help() {
                    let help = help.to_string();
                    assert!(help.len() < MAX_MESSAGE, "help of {} bytes: {}", help.len(), excerpt(&help));
                }
            }
        }
    }
});

fn excerpt(s: &str) -> &str {
    let mut end = s.len().min(200);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn check_spec(path: &Path, text: &str, s: &Spec) {
    assert_eq!(&*s.source, text);
    assert_eq!(s.path, path);
    assert_eq!(Some(s.dir.as_path()), path.parent());
    assert!(spec::valid_name(&s.pipeline.name), "pipeline name {:?}", s.pipeline.name);
    assert!(s.pipeline.jobs.is_none_or(|j| j >= 1));
    assert!(!s.stages.is_empty());

    let names: BTreeSet<&str> = s.stages.iter().map(|st| st.name.as_str()).collect();
    assert_eq!(names.len(), s.stages.len(), "stage names repeat");
    let vars: BTreeSet<String> = s.stages.iter().map(|st| spec::input_var(&st.name)).collect();
    assert_eq!(vars.len(), s.stages.len(), "two stages share an input variable");
    for st in &s.stages {
        assert!(spec::valid_name(&st.name), "stage name {:?}", st.name);
        assert!(s.stage(&st.name).is_some());
        // Needs: sorted, distinct, existing stages, not the stage itself.
        assert!(st.needs.windows(2).all(|w| w[0] < w[1]), "needs of {} not sorted: {:?}", st.name, st.needs);
        for n in &st.needs {
            assert!(names.contains(n.as_str()), "{} needs unknown {n}", st.name);
            assert_ne!(n, &st.name, "{} needs itself", st.name);
        }
        assert!(st.resources.cpus.is_finite() && st.resources.cpus > 0.0 && st.resources.cpus <= 4096.0, "cpus {}", st.resources.cpus);
        assert!(st.resources.gpus <= 1024, "gpus {}", st.resources.gpus);
        for cond in st.gates.values() {
            assert!(mflow::exec::gates::Condition::parse(cond).is_ok(), "gate {cond:?}");
        }
    }
    assert!(acyclic(s), "the stages form a cycle");

    // `load` stores a checked spec as JSON and reads it back on the next run (spec/checked.rs):
    // it must serialize, and read back as it was.
    let json = serde_json::to_string(s).expect("a checked spec serializes");
    let back: Spec = serde_json::from_str(&json).expect("a checked spec reads back");
    assert_eq!(format!("{:?}", Spec { source: s.source.clone(), ..back }), format!("{s:?}"));
}

/// Kahn's algorithm over `needs`: every stage can be ordered after the stages it needs.
fn acyclic(s: &Spec) -> bool {
    let mut left: BTreeMap<&str, usize> = s.stages.iter().map(|st| (st.name.as_str(), st.needs.len())).collect();
    let mut ready: Vec<&str> = left.iter().filter(|(_, n)| **n == 0).map(|(k, _)| *k).collect();
    let mut done = 0;
    while let Some(n) = ready.pop() {
        done += 1;
        for st in s.stages.iter().filter(|st| st.needs.iter().any(|x| x == n)) {
            let c = left.get_mut(st.name.as_str()).unwrap();
            *c -= 1;
            if *c == 0 {
                ready.push(&st.name);
            }
        }
    }
    done == s.stages.len()
}
