//! `mflow report`: the HTML file, its charts, PNGs, and rendering in headless Chromium.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{code, stderr, stdout, Project};

fn run_project() -> Project {
    let p = Project::new(include_str!("fixtures/ci/curves.toml"));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    p
}

#[test]
fn report_has_every_section_and_png_charts() {
    let p = run_project();
    let o = p.mflow(&["report", "--out", "r/report.html", "--png", "r/png"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let html = std::fs::read_to_string(p.file("r/report.html")).unwrap();
    for id in ["chart-loss", "chart-lr", "chart-throughput", "chart-timeline"] {
        assert!(html.contains(&format!("id=\"{id}\"")), "missing {id}");
    }
    assert_eq!(html.matches("<svg").count(), 4);
    // Evaluation metrics, samples (escaped), cache hits and the lockfile.
    assert!(html.contains("val_ppl") && html.contains("9.5"));
    assert!(html.contains("The &lt;b&gt;") && html.contains("quick brown fox &amp; friends"));
    assert!(html.contains("0 cache hits") && html.contains("<h2>Lockfile</h2>") && html.contains("spec digest"));
    // Self-contained: nothing is fetched.
    assert!(!html.contains("src=\"http") && !html.contains("href=\"http"));
    for name in ["loss", "lr", "throughput", "timeline"] {
        let png = std::fs::read(p.file(&format!("r/png/{name}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}.png");
        assert!(png.len() > 5_000, "{name}.png is suspiciously small ({} bytes)", png.len());
    }
    let out = stdout(&o);
    assert!(out.contains("report.html") && out.contains("loss.png"));

    // A second run is all cache hits, reported as such.
    assert_eq!(code(&p.run(&[])), 0);
    let o = p.mflow(&["report"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let html = std::fs::read_to_string(p.file(stdout(&o).trim())).unwrap();
    assert!(html.contains("2 cache hits"), "report of the cached run");
}

#[test]
fn unknown_run_is_a_clear_error() {
    let p = run_project();
    let o = p.mflow(&["report", "nope"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("no run `nope`"), "{}", stderr(&o));
}

/// Debian's chromium; CI installs it (.ci/run).
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("MFLOW_CHROMIUM") {
        return p.into();
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(o) = Command::new("sh").args(["-c", &format!("command -v {name}")]).output() {
            if o.status.success() {
                return PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            }
        }
    }
    panic!("headless Chromium is required for this test and was not found: install Debian's `chromium` package (apt-get install -y chromium) or set MFLOW_CHROMIUM to its binary");
}

fn headless(profile: &Path) -> Command {
    let mut c = Command::new(chromium());
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=3000",
    ]);
    c.arg(format!("--user-data-dir={}", profile.display()));
    c
}

#[test]
fn report_renders_in_headless_chromium() {
    let p = run_project();
    assert_eq!(code(&p.mflow(&["report", "--out", "report.html"])), 0);
    let page = format!("file://{}", p.file("report.html").display());
    let profile = tempfile::tempdir().unwrap();
    let o = headless(profile.path()).arg("--dump-dom").arg(&page).output().expect("start chromium");
    let dom = stdout(&o);
    let log = stderr(&o);
    assert!(o.status.success(), "chromium failed: {log}");
    // The page's own check ran and found every chart drawn with a non-empty box.
    assert!(
        dom.contains("data-charts-rendered=\"4\""),
        "charts did not render:\n{log}\n{}",
        &dom[..dom.len().min(2000)]
    );
    assert!(
        dom.matches("<svg").count() >= 4 && dom.contains("<polyline") && dom.contains("<rect"),
        "no SVG plot elements in the DOM"
    );
    let console: Vec<&str> = log.lines().filter(|l| l.contains("CONSOLE") || l.contains("Uncaught")).collect();
    assert!(console.is_empty(), "console messages: {console:#?}");

    // The screenshot for the docs: set MFLOW_REPORT_SCREENSHOT to a path to keep it.
    let shot = std::env::var_os("MFLOW_REPORT_SCREENSHOT").map(PathBuf::from).unwrap_or_else(|| p.file("shot.png"));
    let profile = tempfile::tempdir().unwrap();
    let o = headless(profile.path())
        .arg(format!("--screenshot={}", shot.display()))
        .arg("--window-size=1200,2400")
        .arg(&page)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
}
