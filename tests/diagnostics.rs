//! Every kind of spec mistake, rendered as users see it (no colour), pinned by snapshots.

use miette::{GraphicalReportHandler, GraphicalTheme};

fn render(path: &std::path::Path, overrides: &[String]) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let name = std::path::Path::new("spec.toml");
    let err = mflow::spec::parse(name, &text, overrides).expect_err("the spec must be rejected");
    let mut out = String::new();
    GraphicalReportHandler::new_themed(GraphicalTheme::unicode_nocolor())
        .with_width(100)
        .render_report(&mut out, &err)
        .unwrap();
    out
}

#[test]
fn bad_specs() {
    insta::glob!("fixtures/bad/*.toml", |path| {
        let text = render(path, &[]);
        // A credential's value is never shown, not even in the excerpt of its line.
        assert!(!text.contains("do-not-show") && !text.contains("DoNotShow"), "{text}");
        insta::assert_snapshot!(text);
    });
}

#[test]
fn bad_overrides() {
    let ok = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad/01-unknown-key.toml");
    let good = std::fs::read_to_string(&ok).unwrap().replace("retires", "retries");
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("spec.toml");
    std::fs::write(&p, good).unwrap();
    for set in [
        "stages.zz.run=1",
        "nokey",
        "stages.a.timeout=5",
        "vars.nope=1",
        "vars.x.y=1",
        "stages.a.env.HF_TOKEN=hf_DoNotShowThisValue",
        "stages.zz.env.GITHUB_TOKEN=ghp_DoNotShowThisValue",
        "stages.a.salt=99999999999999999999",
    ] {
        let text = render(&p, &[set.to_string()]);
        assert!(!text.contains("DoNotShow"), "{text}");
        insta::assert_snapshot!(mflow::spec::secret::shown_override(set).replace(['<', '>'], ""), text);
    }
}
