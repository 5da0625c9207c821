//! Files generated from mflow's own types: the exit-code table in docs/exit-codes.md, the
//! environment reference docs/environment.md, and the JSON Schemas of the workload configs.
//! `UPDATE_GENERATED=1 cargo test --test generated` writes them; otherwise a difference fails.

use std::path::{Path, PathBuf};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn update() -> bool {
    std::env::var_os("UPDATE_GENERATED").is_some()
}

/// Holds `path` equal to `want` (or writes it).
fn check(path: &Path, want: &str) {
    if update() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        have == want,
        "{} is not what mflow generates: run `UPDATE_GENERATED=1 cargo test --test generated`",
        path.display()
    );
}

/// The start of a generated block in a hand-written document.
fn begin(source: &str) -> String {
    format!("<!-- generated from {source} by `UPDATE_GENERATED=1 cargo test --test generated`; do not edit -->\n")
}
const END: &str = "<!-- end of generated -->\n";

/// Holds the block generated from `source` in the document at `rel` equal to `want`.
fn check_block(rel: &str, source: &str, want: &str) {
    let path = repo(rel);
    let text = std::fs::read_to_string(&path).unwrap();
    let begin = begin(source);
    let a = text.find(&begin).unwrap_or_else(|| panic!("{rel}: the start of the block of {source}")) + begin.len();
    let b = a + text[a..].find(END).expect("the generated block's end");
    check(&path, &format!("{}{want}{}", &text[..a], &text[b..]));
}

#[test]
fn the_exit_code_table_is_the_contracts() {
    check_block("docs/exit-codes.md", "mflow_contract::exit::TABLE", &mflow_contract::exit::markdown());
}

#[test]
fn the_failure_class_rule_is_the_contracts() {
    check_block("docs/exit-codes.md", "mflow_contract::class::RULE", &mflow_contract::class::rule_markdown());
}

#[test]
fn the_environment_reference_is_the_contracts() {
    check(&repo("docs/environment.md"), &mflow_contract::vars::markdown());
}

#[test]
fn the_workload_schemas_are_the_contracts() {
    for (name, schema) in mflow_contract::workload::schemas() {
        let text = serde_json::to_string_pretty(&schema).unwrap() + "\n";
        check(&repo(&format!("workloads/schemas/{name}")), &text);
    }
}

#[test]
fn mflow_exit_codes_prints_the_table() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mflow")).arg("exit-codes").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), mflow_contract::exit::text());
}

/// One diagnostic code with the words around it in the source: what the error says and the help
/// it gives (templates: `{...}` is filled in when it happens).
struct Diagnostic {
    code: String,
    message: String,
    help: String,
}

/// Every `#[diagnostic(code(mflow::...))]` of the workspace's sources, by code.
fn diagnostics() -> Vec<Diagnostic> {
    let mut found: std::collections::BTreeMap<String, Diagnostic> = Default::default();
    let mut files = Vec::new();
    for dir in ["src", "crates"] {
        walk(&repo(dir), &mut files);
    }
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut at = 0;
        while let Some(i) = text[at..].find("code(mflow::") {
            let start = at + i + "code(".len();
            let end = start + text[start..].find(')').unwrap();
            let code = text[start..end].to_string();
            at = end;
            // The attribute block this code sits in: back to the `#[error` before it, on to the
            // end of its `#[diagnostic(...)]`.
            let block_start = text[..start].rfind("#[error").unwrap_or(start);
            let block_end = start + text[start..].find(")]").unwrap_or(0);
            let block = &text[block_start..block_end];
            let message = literal_after(block, "#[error(").unwrap_or_default();
            let help = literal_after(block, "help(").unwrap_or_default();
            let d =
                found.entry(code.clone()).or_insert(Diagnostic { code, message: String::new(), help: String::new() });
            if d.message.is_empty() {
                d.message = message;
            }
            if d.help.is_empty() || d.help == "{help}" {
                d.help = help;
            }
        }
    }
    found.into_values().collect()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() && !p.ends_with("tests") && !p.ends_with("testing") {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The first string literal after `what` in `text`, unescaped, with line continuations joined.
fn literal_after(text: &str, what: &str) -> Option<String> {
    let from = text.find(what)? + what.len();
    let open = from + text[from..].find('"')?;
    let mut out = String::new();
    let mut chars = text[open + 1..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out.split_whitespace().collect::<Vec<_>>().join(" ")),
            '\\' => match chars.next()? {
                'n' => out.push(' '),
                '\n' => {}
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

#[test]
fn every_diagnostic_code_is_explained() {
    let all = diagnostics();
    assert!(all.len() > 100, "found only {} codes", all.len());
    let mut md = String::from("# Diagnostics\n\nEvery diagnostic code mflow reports, with what it says and what to do; `mflow explain CODE` prints one. Generated from the sources by `UPDATE_GENERATED=1 cargo test --test generated`. `{...}` is filled in when it happens.\n\n| code | what it says | what to do |\n|---|---|---|\n");
    let mut rs = String::from("//! Every diagnostic code, with its message and help (templates). Generated from the sources\n//! by `UPDATE_GENERATED=1 cargo test --test generated`; do not edit.\n\npub const DIAGNOSTICS: &[(&str, &str, &str)] = &[\n");
    for d in &all {
        let help = if d.help == "{help}" { "depends on the case; the message gives it" } else { &d.help };
        md.push_str(&format!("| `{}` | {} | {} |\n", d.code, cell(&d.message), cell(help)));
        rs.push_str(&format!("    ({:?}, {:?}, {:?}),\n", d.code, d.message, help));
    }
    rs.push_str("];\n");
    check(&repo("docs/diagnostics.md"), &md);
    check(&repo("src/cli/diagnostics.rs"), &rs);
}

/// Each table of docs/spec.md's key reference is the one the field tables generate (the prose
/// between them is written by hand).
#[test]
fn the_spec_reference_tables_are_the_field_tables() {
    let doc = std::fs::read_to_string(repo("docs/spec.md")).unwrap();
    let generated = mflow::spec::reference_markdown();
    let mut sections = generated.split("\n### ").skip(1);
    assert!(sections.clone().count() > 5, "{generated}");
    for section in sections.by_ref() {
        let (heading, body) = section.split_once('\n').unwrap();
        let table: String = body
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .map(|l| format!("{l}\n"))
            .collect();
        let at =
            doc.find(&format!("### {heading}\n")).unwrap_or_else(|| panic!("docs/spec.md has no section {heading}"));
        let rest = &doc[at..];
        let next = rest[4..].find("\n### ").map_or(rest.len(), |n| n + 4);
        assert!(
            rest[..next].contains(&table),
            "docs/spec.md, section {heading}: the table is not what `mflow schema --format markdown` prints:\n{table}"
        );
    }
}
