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

/// An environment a process could not be started with (Linux's 128 KiB per string), or one
/// that would swell every Kubernetes object of the stage, is refused at its place.
#[test]
fn environments_too_large_for_a_process_or_an_object_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("spec.toml");
    let spec = |env: &str| {
        format!("[pipeline]\nname = \"p\"\n\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\nenv = {{ {env} }}\n")
    };
    let fits = format!("BIG = \"{}\"", "x".repeat((128 << 10) - 6));
    std::fs::write(&p, spec(&fits)).unwrap();
    assert!(mflow::spec::parse(&p, &std::fs::read_to_string(&p).unwrap(), &[]).is_ok(), "BIG=value fits 128 KiB");

    std::fs::write(&p, spec(&format!("BIG = \"{}\"", "x".repeat(2 << 20)))).unwrap();
    let text = render(&p, &[]);
    assert!(text.contains("`[stages.a].env.BIG`: 2097157 bytes with its name"), "{text}");
    assert!(text.contains("at most 128 KiB per variable"), "{text}");
    assert!(text.contains("spec.toml:7:15"), "the value's place is shown: {text}");
    assert!(text.len() < 4000, "the value is not shown whole: {} bytes", text.len());

    let many: Vec<String> = (0..5).map(|i| format!("V{i} = \"{}\"", "x".repeat(120 << 10))).collect();
    std::fs::write(&p, spec(&many.join(", "))).unwrap();
    let text = render(&p, &[]);
    assert!(text.contains("`[stages.a].env`: 614420 bytes in all"), "{text}");
    assert!(text.contains("at most 512 KiB"), "{text}");

    // The driver's environment is held to the same bounds.
    let driver = format!("[pipeline.kubernetes.driver]\nenv = {{ BIG = \"{}\" }}\n", "x".repeat(200 << 10));
    std::fs::write(&p, spec("").replace("[stages.a]", &format!("{driver}\n[stages.a]"))).unwrap();
    let text = render(&p, &[]);
    assert!(text.contains("kubernetes.driver.env.BIG`: 204805 bytes with its name"), "{text}");
}
