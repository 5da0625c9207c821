//! The engine's `--log-format json` events, turned back into the display of a local run.

use std::time::Duration;

use serde_json::Value as Json;

use crate::exec::display::Display;

/// One line of the driver's log: an event is shown as the local display shows it; anything
/// else (the summary, a diagnostic) is printed as it is.
pub fn render(display: &mut Display, line: &str) {
    let Some(ev) = serde_json::from_str::<Json>(line).ok().filter(Json::is_object) else {
        display.flush();
        eprintln!("{line}");
        return;
    };
    let s = |k: &str| ev.get(k).and_then(Json::as_str).unwrap_or_default().to_string();
    let (event, stage) = (s("event"), s("stage"));
    match event.as_str() {
        "" => eprintln!("{line}"),
        "output" => display.line(&stage, &s("line")),
        "progress" => {
            let p = mflow_progress::Event {
                label: s("label"),
                done: ev.get("done").and_then(Json::as_u64).unwrap_or(0),
                total: ev.get("total").and_then(Json::as_u64),
                unit: s("unit"),
                message: ev.get("message").and_then(Json::as_str).map(str::to_string),
            };
            let elapsed = ev.get("elapsed_s").and_then(Json::as_f64).filter(|e| e.is_finite() && *e >= 0.0).unwrap_or(0.0);
            display.progress(&stage, &p, Duration::from_secs_f64(elapsed.min(1e9)));
        }
        _ => display.status(&stage, &event, &s("detail")),
    }
}
