//! The report page. Everything is inline (styles, SVG charts), so the file can be attached to a
//! CI run or mailed and still open anywhere.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::Chart;
use crate::ci::run_data::{human_duration, stage_duration, status_word, RunData};
use crate::ci::summary::num;
use crate::record::StageStatus;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2rem;color:#222;max-width:1100px}\
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ddd;padding:.25rem .6rem;text-align:left;vertical-align:top}\
th{background:#f5f5f5}.succeeded,.cached{color:#2e8b57}.failed{color:#cd3737}.skipped,.cancelled,.pending{color:#888}\
.charts svg{display:block;margin:.5rem 0;max-width:100%;height:auto}code{font-size:.9em}pre{white-space:pre-wrap;margin:0}\
#render-check{display:none;background:#fee;border:1px solid #cd3737;padding:.5rem}";

/// Marks the page when a chart did not render (zero-size SVG), so a broken report is visible.
const RENDER_CHECK: &str = "(function(){var n=0,bad=0;document.querySelectorAll('.charts svg').forEach(function(s){var b=s.getBBox();if(b.width>0&&b.height>0){n++}else{bad++}});\
document.body.setAttribute('data-charts-rendered',String(n));if(bad>0){var e=document.getElementById('render-check');e.textContent=bad+' chart(s) did not render';e.style.display='block'}})();";

pub fn page(run: &RunData, charts: &[Chart]) -> String {
    let r = &run.record;
    let mut h = String::new();
    let status = format!("{:?}", r.status).to_lowercase();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>mflow report: {p} {id}</title><style>{STYLE}</style></head><body>\n\
         <div id=\"render-check\"></div>\n<h1>{p} <span class=\"{status}\">{status}</span></h1>\n\
         <table><tr><th>run</th><td><code>{id}</code></td></tr><tr><th>spec</th><td><code>{spec}</code></td></tr>\
         <tr><th>started</th><td>{start}</td></tr><tr><th>finished</th><td>{fin}</td></tr><tr><th>exit code</th><td>{code}</td></tr><tr><th>mflow</th><td>{ver}</td></tr></table>\n",
        p = esc(&r.pipeline),
        id = esc(&r.id),
        spec = esc(&r.spec),
        start = esc(&r.started),
        fin = esc(r.finished.as_deref().unwrap_or("-")),
        code = r.exit_code.map(|c| c.to_string()).unwrap_or("-".into()),
        ver = esc(&r.mflow_version),
    );

    let cached = run.stages().filter(|(_, s)| s.status == StageStatus::Cached).count();
    let _ = write!(h, "<h2>Stages</h2>\n<p>{} stages, {cached} cache hits.</p>\n<table><tr><th>stage</th><th>kind</th><th>status</th><th>cached</th><th>duration</th><th>attempts</th><th>key</th><th>message</th></tr>\n", run.record.order.len());
    for (name, s) in run.stages() {
        let st = status_word(s.status);
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td class=\"{st}\">{st}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td></tr>",
            esc(name),
            esc(&s.kind),
            if s.status == StageStatus::Cached { "yes" } else { "no" },
            human_duration(stage_duration(s)),
            s.attempts.len(),
            esc(s.key.as_deref().map(crate::cache::key::short).unwrap_or("-")),
            esc(&s.failure().unwrap_or_default()),
        );
    }
    h.push_str("</table>\n");

    h.push_str("<h2>Charts</h2>\n<div class=\"charts\">\n");
    if charts.is_empty() {
        h.push_str("<p>No stage recorded metrics.</p>\n");
    }
    for c in charts {
        let _ = writeln!(h, "<figure id=\"chart-{}\">{}</figure>", c.name, strip_xml_decl(&c.svg));
    }
    h.push_str("</div>\n");

    let gates: Vec<_> = run.stages().flat_map(|(n, s)| s.gates.iter().map(move |g| (n, g))).collect();
    if !gates.is_empty() {
        h.push_str("<h2>Gates</h2>\n<table><tr><th>stage</th><th>metric</th><th>condition</th><th>value</th><th>result</th></tr>\n");
        for (n, g) in gates {
            let (class, word) = if g.passed { ("succeeded", "pass") } else { ("failed", "FAIL") };
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"{class}\">{word}</td></tr>",
                esc(n),
                esc(&g.metric),
                esc(&g.condition),
                g.value.map(num).unwrap_or("missing".into())
            );
        }
        h.push_str("</table>\n");
    }

    let finals = run.final_metrics();
    if !finals.is_empty() {
        h.push_str(
            "<h2>Metrics</h2>\n<p>Final values: the stage's metrics.json and the last value of each series.</p>\n",
        );
        for (stage, m) in &finals {
            let _ = write!(h, "<h3>{}</h3>\n<table><tr><th>metric</th><th>value</th></tr>\n", esc(stage));
            for (k, v) in m {
                let _ = writeln!(h, "<tr><td>{}</td><td>{}</td></tr>", esc(k), num(*v));
            }
            h.push_str("</table>\n");
        }
    }

    for (stage, s) in run.stages() {
        let samples = s.metrics.as_ref().map(super::samples).unwrap_or_default();
        if samples.is_empty() {
            continue;
        }
        let _ = write!(h, "<h2>Samples: {}</h2>\n<table><tr><th>prompt</th><th>generated</th></tr>\n", esc(stage));
        for (p, t) in samples {
            let _ = writeln!(h, "<tr><td><pre>{}</pre></td><td><pre>{}</pre></td></tr>", esc(&p), esc(&t));
        }
        h.push_str("</table>\n");
    }

    h.push_str(&lockfile(run));
    let _ = write!(h, "<script>{RENDER_CHECK}</script>\n</body></html>\n");
    h
}

fn lockfile(run: &RunData) -> String {
    let mut h = String::from("<h2>Lockfile</h2>\n");
    let Some(l) = &run.lock else {
        h.push_str("<p>This run has no mflow.lock.</p>\n");
        return h;
    };
    let env: BTreeMap<&String, &String> = l.environment.iter().collect();
    let _ = write!(
        h,
        "<table><tr><th>spec digest</th><td><code>{}</code></td></tr><tr><th>git commit</th><td><code>{}</code></td></tr><tr><th>overrides</th><td>{}</td></tr>",
        esc(crate::cache::key::short(&l.spec_digest)),
        esc(l.git_commit.as_deref().unwrap_or("-")),
        esc(&if l.overrides.is_empty() { "none".to_string() } else { l.overrides.join(" ") }),
    );
    for (k, v) in env {
        let _ = write!(h, "<tr><th>{}</th><td><code>{}</code></td></tr>", esc(k), esc(v));
    }
    h.push_str(
        "</table>\n<table><tr><th>stage</th><th>kind</th><th>key</th><th>output digest</th><th>input files</th></tr>\n",
    );
    for (name, s) in &l.stages {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td><code>{}</code></td><td><code>{}</code></td><td>{}</td></tr>",
            esc(name),
            esc(&s.kind),
            esc(crate::cache::key::short(&s.key)),
            esc(s.output_digest.as_deref().map(crate::cache::key::short).unwrap_or("-")),
            s.parts.inputs.len()
        );
    }
    h.push_str("</table>\n");
    h
}

fn strip_xml_decl(svg: &str) -> &str {
    match svg.find("<svg") {
        Some(i) => &svg[i..],
        None => svg,
    }
}

pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}
