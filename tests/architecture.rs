//! The shape of the code, held by tests rather than by hope: the imports follow the flow
//! (spec -> plan -> exec -> backend -> cache, record), the failure class is never parsed out of
//! text, no backend is named by a string, the workdir's layout is spelled in one place, and no
//! module or function outgrows a reading. docs/architecture.md names each rule and its grep.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Every `.rs` file under `dirs` (relative to the repository), with its text; integration tests
/// (a crate's `tests/`) aside.
fn sources(dirs: &[&str]) -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && p.file_name().is_some_and(|n| n == "tests") {
                continue;
            } else if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push((p.clone(), std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    for d in dirs {
        walk(&root().join(d), &mut out);
    }
    out
}

/// The code of a file without its unit tests (`#[cfg(test)] mod tests` to the end).
fn code(text: &str) -> &str {
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    }
}

/// `(file, line number, line)` of every line of code under `dirs` that contains one of `needles`.
fn lines_with(dirs: &[&str], needles: &[&str]) -> Vec<String> {
    let mut hits = Vec::new();
    for (path, text) in sources(dirs) {
        for (i, line) in code(&text).lines().enumerate() {
            if needles.iter().any(|n| line.contains(n)) {
                hits.push(format!("{}:{}: {}", path.strip_prefix(root()).unwrap().display(), i + 1, line.trim()));
            }
        }
    }
    hits
}

#[test]
fn the_early_modules_import_nothing_of_exec_or_cli() {
    let hits = lines_with(
        &["src/spec", "src/plan", "src/record", "src/cache", "src/backend", "src/workdir", "src/stages"],
        &["crate::exec", "crate::cli", "super::exec", "super::cli"],
    );
    assert!(hits.is_empty(), "imports against the flow:\n{}", hits.join("\n"));
}

#[test]
fn only_the_commands_start_runs_outside_the_cluster() {
    let hits: Vec<String> =
        lines_with(&["src"], &["kubernetes::outside::", "kubernetes::outside;", "kubernetes::{outside"])
            .into_iter()
            .filter(|h| !h.starts_with("src/cli/") && !h.starts_with("src/backend/kubernetes/"))
            .collect();
    assert!(hits.is_empty(), "the laptop side of Kubernetes used outside the commands:\n{}", hits.join("\n"));
}

#[test]
fn no_failure_class_is_parsed_out_of_a_message() {
    let hits = lines_with(&["src", "crates"], &[".split(':')"]);
    assert!(hits.is_empty(), "{}", hits.join("\n"));
}

#[test]
fn no_backend_is_named_by_a_string() {
    let hits = lines_with(
        &["src"],
        &[
            "== \"kubernetes\"",
            "!= \"kubernetes\"",
            "== \"local\"",
            "!= \"local\"",
            "\"kubernetes\" =>",
            "\"local\" =>",
        ],
    );
    assert!(hits.is_empty(), "{}", hits.join("\n"));
}

#[test]
fn the_workdir_layout_is_spelled_only_by_the_workdir_type() {
    let layout = ["cache", "scratch", "runs", "stages", "state", ".staging", ".unverified", ".trash", ".kube"];
    let needles: Vec<String> = layout.iter().map(|d| format!("join(\"{d}\")")).collect();
    let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
    let hits: Vec<String> =
        lines_with(&["src"], &needles).into_iter().filter(|h| !h.starts_with("src/workdir/")).collect();
    assert!(hits.is_empty(), "{}", hits.join("\n"));
}

/// `println!` and `eprintln!` panic when their stream is gone (`mflow run SPEC 2>&1 | head`):
/// the run would end there, without its JUnit file, report, webhook or exit code. The printer
/// and `stdio` write without panicking. The crates of the native stage commands (ckpt, data) run
/// in a stage's own process, whose output mflow reads.
#[test]
fn nothing_prints_with_a_macro_that_panics() {
    let dirs = ["src", "crates/mflow-contract", "crates/mflow-kube", "crates/mflow-progress", "crates/mflow-untrusted"];
    let hits: Vec<String> = lines_with(&dirs, &["println!(", "print!(", "eprintln!(", "eprint!(", "dbg!("])
        .into_iter()
        .filter(|h| !h.split_once(": ").is_some_and(|(_, line)| line.starts_with("//")))
        .collect();
    assert!(hits.is_empty(), "use crate::outln! / crate::errln! (src/stdio.rs) or the printer:\n{}", hits.join("\n"));
}

/// Files longer than a module should be, with the reason each is.
const LONG_FILES: &[(&str, &str)] = &[(
    "crates/mflow-data/src/pretokenize/unicode.rs",
    "a table of code point ranges read off the tokenizer's regex engine, generated and checked by a test",
)];

const MAX_MODULE_LINES: usize = 500;
const MAX_FUNCTION_LINES: usize = 120;

#[test]
fn no_module_outgrows_a_reading() {
    let mut long = Vec::new();
    for (path, text) in sources(&["src", "crates"]) {
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        let n = text.lines().count();
        if n > MAX_MODULE_LINES && !LONG_FILES.iter().any(|(f, _)| *f == rel) {
            long.push(format!("{rel}: {n} lines"));
        }
    }
    assert!(long.is_empty(), "modules over {MAX_MODULE_LINES} lines:\n{}", long.join("\n"));
}

#[test]
fn no_function_outgrows_a_reading() {
    let mut long = Vec::new();
    for (path, text) in sources(&["src", "crates"]) {
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        for (name, line, n) in functions(code(&text)) {
            if n > MAX_FUNCTION_LINES {
                long.push(format!("{rel}:{line}: fn {name}: {n} lines"));
            }
        }
    }
    assert!(long.is_empty(), "functions over {MAX_FUNCTION_LINES} lines:\n{}", long.join("\n"));
}

/// `(name, first line, lines)` of each function with a body, counted by its braces (those in
/// strings, characters and comments aside).
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<String> = text.lines().map(strip).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(name) = fn_name(&lines[i]) else {
            i += 1;
            continue;
        };
        let (mut depth, mut opened, mut j) = (0i64, false, i);
        'body: while j < lines.len() {
            for c in lines[j].chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened => break 'body,
                    _ => {}
                }
                if opened && depth == 0 {
                    break 'body;
                }
            }
            j += 1;
        }
        if opened {
            out.push((name, i + 1, j - i + 1));
        }
        i = j + 1;
    }
    out
}

fn fn_name(line: &str) -> Option<String> {
    let at = line.find("fn ")?;
    let before = line[..at].trim();
    let words_ok = before
        .split_whitespace()
        .all(|w| matches!(w, "pub" | "async" | "const" | "unsafe" | "extern" | "\"C\"") || w.starts_with("pub("));
    if !words_ok {
        return None;
    }
    let name: String = line[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// A line without its comment, its string and character literals.
fn strip(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => break,
            '"' => {
                while let Some(d) = chars.next() {
                    match d {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '\'' => {
                // A character literal ('x', '\n', '{'); a lifetime ('a) has no closing quote.
                let rest: String = chars.clone().take(4).collect();
                if let Some(end) = rest.find('\'').filter(|&e| e > 0) {
                    for _ in 0..=end {
                        chars.next();
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}
