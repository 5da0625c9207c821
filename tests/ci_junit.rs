//! `mflow run --junit` and the GitHub step summary, on a run with succeeded, cached, failed and
//! skipped stages.

mod common;

use common::{code, stderr, Project};

fn project() -> Project {
    Project::new(include_str!("fixtures/ci/mixed.toml"))
}

/// Times, run ids and keys change from run to run.
fn stable() -> insta::Settings {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.add_filter(r#"time="[0-9.]+""#, r#"time="[s]""#);
    settings.add_filter(r#"timestamp="[^"]+""#, r#"timestamp="[t]""#);
    settings.add_filter(r"\d{8}-\d{6}-\d{3}-[0-9a-f]{2}", "[run]");
    settings.add_filter(r"output [0-9a-f]{12}", "output [key]");
    settings.add_filter(r"\| \d+(\.\d+)?s \|", "| [d] |");
    settings.add_filter(r#"(name="mflow_version" value=")[^"]+"#, "${1}[v]");
    settings
}

#[test]
fn junit_has_one_testcase_per_stage() {
    let p = project();
    let o = p.run(&["--junit", "out/junit.xml"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let first = std::fs::read_to_string(p.file("out/junit.xml")).unwrap();
    assert!(first.contains("ran in 1 attempt(s)"), "{first}");
    // The second run finds `prepare` cached.
    let summary = p.file("summary.md");
    let o =
        p.cmd(&["run", "spec.toml", "--junit", "out/junit.xml"]).env("GITHUB_STEP_SUMMARY", &summary).output().unwrap();
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let xml = std::fs::read_to_string(p.file("out/junit.xml")).unwrap();
    let md = std::fs::read_to_string(&summary).unwrap();
    stable().bind(|| {
        insta::assert_snapshot!("ci_junit", checked_xml(&xml));
        insta::assert_snapshot!("ci_step_summary", md);
    });
}

fn checked_xml(xml: &str) -> String {
    // The XML must parse: every element closed, text escaped.
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut cases = 0;
    loop {
        match reader.read_event().unwrap_or_else(|e| panic!("invalid XML at {}: {e}\n{xml}", reader.buffer_position()))
        {
            quick_xml::events::Event::Start(e) | quick_xml::events::Event::Empty(e)
                if e.name().as_ref() == b"testcase" =>
            {
                cases += 1
            }
            quick_xml::events::Event::Eof => break,
            _ => {}
        }
    }
    assert_eq!(cases, 3);
    xml.to_string()
}

#[test]
fn summary_is_appended_to_what_earlier_steps_wrote() {
    let p = project();
    let summary = p.file("summary.md");
    std::fs::write(&summary, "## Build\nok\n").unwrap();
    let o = p.cmd(&["run", "spec.toml"]).env("GITHUB_STEP_SUMMARY", &summary).output().unwrap();
    assert_eq!(code(&o), 1);
    let md = std::fs::read_to_string(&summary).unwrap();
    assert!(md.starts_with("## Build\nok\n### mflow run `nightly`: failed"), "{md}");
    assert!(md.contains("| train | ❌ failed: user:"), "{md}");
}

/// GitHub renders the summary's Markdown with inline HTML: what a stage says (its failure
/// message, its metric names) is escaped, and control characters are dropped.
#[test]
fn summary_escapes_html_and_drops_control_characters() {
    let p = Project::new(
        r#"
[pipeline]
name = "nasty"

[stages.metrics]
kind = "command"
run = ["sh", "-c", '''cat > "$MFLOW_OUTPUT/metrics.json" <<'J'
{"<img src=x onerror=alert(1)>": 1, "a<!--": {"b\u001b[31m\u0000c": 2}}
J''']

[stages.fails]
kind = "command"
run = ["sh", "-c", '''cat > "$MFLOW_STATUS" <<'J'
{"class": "user", "message": "x</td><script>alert(1)</script> & \u001b[31mred\u0000 <!-- |"}
J
exit 1''']
"#,
    );
    let summary = p.file("summary.md");
    let o = p.cmd(&["run", "spec.toml"]).env("GITHUB_STEP_SUMMARY", &summary).output().unwrap();
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let md = std::fs::read_to_string(&summary).unwrap();
    for raw in ["<script", "</td>", "<img", "<!--", "\u{1b}", "\0"] {
        assert!(!md.contains(raw), "{raw:?} is in the summary:\n{md}");
    }
    assert!(md.contains("&lt;img src=x onerror=alert(1)&gt;=1"), "{md}");
    assert!(md.contains("a&lt;!--.bc=2"), "{md}");
    assert!(md.contains("x&lt;/td&gt;&lt;script&gt;alert(1)&lt;/script&gt; &amp; red &lt;!-- \\|"), "{md}");
}
