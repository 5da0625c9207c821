//! `mflow report`: one self-contained HTML file per run (no external resources): curves of loss,
//! learning rate and throughput, the stage timeline, evaluation metrics and samples, cache hits
//! and the lockfile. `--png DIR` writes the charts as PNG files for CI artifacts.

pub(crate) mod html;
pub mod plots;

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::run_data::RunData;
use super::CiError;
use plots::{Bar, Series};

/// A chart in the report: a file stem for its PNG and its SVG text.
pub struct Chart {
    pub name: &'static str,
    pub svg: String,
}

/// The charts of a run, in report order.
pub fn charts(run: &RunData) -> Result<Vec<Chart>, CiError> {
    let curve = |keys: &[&str]| -> Vec<Series> {
        let mut out = Vec::new();
        for (stage, lines) in &run.series {
            for key in keys {
                let points: Vec<(f64, f64)> = lines
                    .iter()
                    .filter_map(|l| Some((l.get("iteration")?.as_f64()?, l.get(*key)?.as_f64()?)))
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .collect();
                if !points.is_empty() {
                    out.push(Series { label: format!("{stage} {key}"), points });
                }
            }
        }
        out
    };
    let mut charts = Vec::new();
    let specs: [(&'static str, &str, &str, &[&str]); 3] = [
        ("loss", "Loss", "loss", &["loss", "val_loss"]),
        ("lr", "Learning rate", "lr", &["lr"]),
        ("throughput", "Throughput", "tokens/s", &["tokens_per_s"]),
    ];
    for (name, title, y, keys) in specs {
        if let Some(svg) = plots::line_chart(title, "iteration", y, &curve(keys))? {
            charts.push(Chart { name, svg });
        }
    }
    if let Some(svg) = plots::timeline(&bars(run))? {
        charts.push(Chart { name: "timeline", svg });
    }
    Ok(charts)
}

fn bars(run: &RunData) -> Vec<Bar> {
    let t0 = ts(Some(&run.record.started)).unwrap_or(0.0);
    run.stages()
        .map(|(name, s)| {
            let start = ts(s.started.as_deref()).map(|t| t - t0);
            let end = ts(s.finished.as_deref()).map(|t| t - t0);
            let (start, end) = match (start, end) {
                (Some(a), Some(b)) => (a.max(0.0), b.max(a)),
                (Some(a), None) => (a.max(0.0), a.max(0.0)),
                // Cached and skipped stages have no times of their own; place them at the start.
                _ => (0.0, 0.0),
            };
            Bar { stage: name.clone(), start, end, status: s.status }
        })
        .collect()
}

fn ts(s: Option<&str>) -> Option<f64> {
    let t: jiff::Timestamp = s?.parse().ok()?;
    Some(t.as_millisecond() as f64 / 1000.0)
}

pub struct Written {
    pub html: PathBuf,
    pub pngs: Vec<PathBuf>,
}

/// Where the report goes: a path the user named (written as `crate::user_output` writes, never
/// into what mflow owns), or the run's own record.
pub enum Out<'a> {
    User(&'a Path, &'a crate::user_output::Owned),
    Record(PathBuf),
}

/// Writes the report (and PNGs when a directory the user named is given).
pub fn write(
    run: &RunData,
    out: Out<'_>,
    png_dir: Option<(&Path, &crate::user_output::Owned)>,
) -> Result<Written, CiError> {
    if let Out::User(path, owned) = &out {
        owned.check(path)?;
    }
    if let Some((dir, owned)) = png_dir {
        crate::user_output::check_dir(dir, owned)?;
    }
    let charts = charts(run)?;
    let page = html::page(run, &charts);
    let path = match &out {
        Out::User(p, _) => p.to_path_buf(),
        Out::Record(p) => p.clone(),
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| match &out {
            Out::User(..) => {
                CiError::Output(crate::user_output::OutputError::Io { path: parent.to_path_buf(), source: e })
            }
            Out::Record(_) => CiError::write(parent, e),
        })?;
    }
    match out {
        Out::User(p, owned) => crate::user_output::write(p, page.as_bytes(), owned)?,
        Out::Record(p) => crate::record::write_atomic(&p, page.as_bytes()).map_err(|e| CiError::write(&p, e))?,
    }
    let mut pngs = Vec::new();
    if let Some((dir, owned)) = png_dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| CiError::Output(crate::user_output::OutputError::Io { path: dir.to_path_buf(), source: e }))?;
        let fonts = plots::system_fonts();
        for c in &charts {
            let p = dir.join(format!("{}.png", c.name));
            plots::write_png(&c.svg, &p, &fonts, owned)?;
            pngs.push(p);
        }
    }
    Ok(Written { html: path, pngs })
}

/// Samples an evaluation stage recorded (`metrics.samples`), as (prompt, text) pairs.
pub fn samples(metrics: &Json) -> Vec<(String, String)> {
    let Some(list) = metrics.get("samples").and_then(Json::as_array) else { return vec![] };
    list.iter()
        .map(|s| match s {
            Json::Object(o) => {
                let prompt = o.get("prompt").and_then(Json::as_str).unwrap_or("").to_string();
                let text = ["completion", "generated", "text", "output"]
                    .iter()
                    .find_map(|k| o.get(*k).and_then(Json::as_str))
                    .map(str::to_string);
                (prompt, text.unwrap_or_else(|| s.to_string()))
            }
            Json::String(t) => (String::new(), t.clone()),
            other => (String::new(), other.to_string()),
        })
        .collect()
}
