//! Builds a small tree from arbitrary bytes (directories, files, and links to `.`, `..`, to
//! other entries, or to nothing) and walks it as mflow walks a directory input. The walk must
//! end, within its bounds, with the paths under the start or an error, and never panic; a
//! cycle it reports must be a link back into a directory above it.
#![no_main]

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use mflow_untrusted::walk::{stat, walk, Limits, Node, WalkError};

const NAMES: [&str; 6] = ["a", "b", "c", "l1", "l2", ".h"];
const LIMITS: Limits = Limits { entries: 20_000, depth: 24 };

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("mflow-fuzz-walk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("root")).unwrap();
    d.join("root")
}

fuzz_target!(|data: &[u8]| {
    let root = scratch();
    let mut dirs = vec![root.clone()];
    let mut all = vec![root.clone()];
    for op in data.chunks(3).take(64) {
        let [what, parent, name] = [op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0)];
        let parent = dirs[parent as usize % dirs.len()].clone();
        let path = parent.join(NAMES[name as usize % NAMES.len()]);
        if std::fs::symlink_metadata(&path).is_ok() {
            continue;
        }
        let made = match what % 6 {
            0 => std::fs::create_dir(&path).map(|()| dirs.push(path.clone())),
            1 => std::fs::write(&path, [what]),
            2 => symlink(".", &path),
            // `..` from the top would leave the tree.
            3 if parent != root => symlink("..", &path),
            3 => symlink("missing", &path),
            _ => symlink(&all[what as usize / 6 % all.len()], &path),
        };
        if made.is_ok() {
            all.push(path);
        }
    }
    let t0 = Instant::now();
    let mut seen = 0usize;
    let result = walk(&root, LIMITS, &stat, &mut |p: &Path, _: &Node, _| -> Result<bool, ()> {
        seen += 1;
        assert!(p.starts_with(&root), "{}", p.display());
        Ok(true)
    });
    assert!(seen <= LIMITS.entries);
    match result {
        Err(WalkError::Cycle { path }) => {
            // It leads to a directory on the way from the start to it.
            let target = stat(&path).unwrap();
            let above = path.ancestors().skip(1).take_while(|a| a.starts_with(&root));
            assert!(above.filter_map(stat).any(|a| (a.dev, a.ino) == (target.dev, target.ino)), "{}", path.display());
        }
        Err(WalkError::Visit(())) => unreachable!(),
        _ => {}
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
});
