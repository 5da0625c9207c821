//! Progress never reads above its total, and a finished operation reads as all of it: init,
//! convert, reshard (to bfloat16) and export, each through the progress file a stage
//! reports to. Debug builds also stop at the first count past a total (mflow_progress), so any
//! test of a producer holds its count to its total.

use std::collections::BTreeMap;
use std::path::Path;

use mflow_ckpt::convert::{convert, export, parse_dtype};
use mflow_ckpt::presets;
use mflow_progress::Event;

fn events(path: &Path) -> BTreeMap<String, Vec<Event>> {
    let mut by_label: BTreeMap<String, Vec<Event>> = BTreeMap::new();
    for e in std::fs::read_to_string(path).unwrap().lines().filter_map(Event::parse) {
        by_label.entry(e.label.clone()).or_default().push(e);
    }
    by_label
}

#[test]
fn every_checkpoint_producer_ends_at_its_total_and_never_reads_above_it() {
    let tmp = tempfile::tempdir().unwrap();
    for preset in ["llama-tiny", "qwen2-tiny", "gpt2-tiny"] {
        let dir = tmp.path().join(preset);
        let path = dir.join("progress.jsonl");
        std::fs::create_dir_all(&dir).unwrap();
        // One test in this binary sets it; each operation reads it when it starts.
        std::env::set_var(mflow_progress::ENV, &path);
        presets::write(&presets::preset(preset).unwrap(), &dir.join("hf"), 3).unwrap();
        convert(&dir.join("hf"), &dir.join("tp2pp2"), 2, 2, None).unwrap();
        let bf16 = parse_dtype(Some("bfloat16")).unwrap();
        convert(&dir.join("tp2pp2"), &dir.join("tp1pp2"), 1, 2, bf16).unwrap();
        export(&dir.join("tp1pp2"), &dir.join("back")).unwrap();
        std::env::remove_var(mflow_progress::ENV);
        let by_label = events(&path);
        assert_eq!(by_label.keys().collect::<Vec<_>>(), ["convert", "export", "init"], "{preset}");
        for (label, evs) in &by_label {
            assert!(evs.iter().all(|e| e.done <= e.total.unwrap()), "{preset} {label}: {evs:?}");
            let last = evs.last().unwrap();
            assert_eq!(last.done, last.total.unwrap(), "{preset} {label}: finished short of its total: {evs:?}");
        }
        // Two conversions (a fresh one and a reshard), each finished at its own total.
        let finished = by_label["convert"].iter().filter(|e| Some(e.done) == e.total).count();
        assert!(finished >= 2, "{preset}: {:?}", by_label["convert"]);
    }
}
