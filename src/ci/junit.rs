//! `mflow run --junit FILE`: one JUnit testcase per stage, so CI systems show stages as tests.

use std::io::Cursor;

use quick_xml::events::BytesText;
use quick_xml::Writer;

use super::run_data::{stage_duration, tail, RunData};
use crate::record::StageStatus;

/// Lines of a failed stage's log carried into its <failure> element.
const LOG_TAIL_LINES: usize = 40;
const LOG_TAIL_BYTES: u64 = 64 * 1024;

pub fn render(run: &RunData) -> String {
    let r = &run.record;
    let count = |f: &dyn Fn(StageStatus) -> bool| r.stages.values().filter(|s| f(s.status)).count();
    let failures = count(&|s| s == StageStatus::Failed);
    let skipped = count(&|s| {
        matches!(s, StageStatus::Skipped | StageStatus::Cancelled | StageStatus::Interrupted | StageStatus::Pending)
    });
    let total = r.stages.values().filter_map(stage_duration).fold(0.0, |a, b| a + b);
    let mut w = Writer::new_with_indent(Cursor::new(Vec::new()), b' ', 2);
    let tests = r.order.len().to_string();
    let (failures, skipped, time) = (failures.to_string(), skipped.to_string(), secs(total));
    let suites = w.create_element("testsuites").with_attributes([
        ("name", "mflow"),
        ("tests", tests.as_str()),
        ("failures", failures.as_str()),
        ("errors", "0"),
        ("skipped", skipped.as_str()),
        ("time", time.as_str()),
    ]);
    suites
        .write_inner_content(|w| {
            w.create_element("testsuite")
                .with_attributes([
                    ("name", r.pipeline.as_str()),
                    ("tests", tests.as_str()),
                    ("failures", failures.as_str()),
                    ("errors", "0"),
                    ("skipped", skipped.as_str()),
                    ("time", time.as_str()),
                    ("timestamp", r.started.as_str()),
                ])
                .write_inner_content(|w| {
                    w.create_element("properties").write_inner_content(|w| {
                        for (k, v) in [
                            ("run", r.id.as_str()),
                            ("spec", r.spec.as_str()),
                            ("mflow_version", r.mflow_version.as_str()),
                        ] {
                            w.create_element("property")
                                .with_attributes([("name", k), ("value", &clean(v) as &str)])
                                .write_empty()?;
                        }
                        Ok(())
                    })?;
                    for (name, s) in run.stages() {
                        let time = secs(stage_duration(s).unwrap_or(0.0));
                        let classname = format!("{}.{}", r.pipeline, s.kind);
                        let case = w.create_element("testcase").with_attributes([
                            ("name", name.as_str()),
                            ("classname", classname.as_str()),
                            ("time", time.as_str()),
                        ]);
                        let message = clean(&s.failure().unwrap_or_default());
                        match s.status {
                            StageStatus::Succeeded => {
                                let note = format!("ran in {} attempt(s); output {}", s.attempts.len(), short_key(s));
                                case.write_inner_content(|w| {
                                    w.create_element("system-out").write_text_content(BytesText::new(&note)).map(|_| ())
                                })?;
                            }
                            StageStatus::Cached => {
                                let note = format!("cached: output {} reused, the stage did not run", short_key(s));
                                case.write_inner_content(|w| {
                                    w.create_element("system-out").write_text_content(BytesText::new(&note)).map(|_| ())
                                })?;
                            }
                            StageStatus::Failed => {
                                let class = s.class.map_or("failure", |c| c.as_str()).to_string();
                                let log = run
                                    .log_path(name)
                                    .map(|p| clean(&tail(&p, LOG_TAIL_LINES, LOG_TAIL_BYTES)))
                                    .unwrap_or_default();
                                let body = if log.is_empty() {
                                    message.clone()
                                } else {
                                    format!("{message}\n--- last lines of the log ---\n{log}")
                                };
                                case.write_inner_content(|w| {
                                    w.create_element("failure")
                                        .with_attributes([("message", message.as_str()), ("type", class.as_str())])
                                        .write_text_content(BytesText::new(&body))?;
                                    Ok(())
                                })?;
                            }
                            _ => {
                                let why = if message.is_empty() {
                                    format!("stage {}", super::run_data::status_word(s.status))
                                } else {
                                    message.clone()
                                };
                                case.write_inner_content(|w| {
                                    w.create_element("skipped")
                                        .with_attribute(("message", why.as_str()))
                                        .write_empty()
                                        .map(|_| ())
                                })?;
                            }
                        }
                    }
                    Ok(())
                })?;
            Ok(())
        })
        .expect("writing to memory");
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    out.push_str(&String::from_utf8(w.into_inner().into_inner()).expect("utf-8 in, utf-8 out"));
    out.push('\n');
    out
}

fn secs(s: f64) -> String {
    format!("{s:.3}")
}

fn short_key(s: &crate::record::StageRecord) -> String {
    s.key.as_deref().map(|k| crate::cache::key::short(k).to_string()).unwrap_or_else(|| "-".into())
}

/// XML 1.0 cannot carry most control characters (logs have ANSI colours): drop them.
pub(super) fn clean(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // Skip an ANSI escape sequence: ESC [ ... final byte in @..~
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            }
            continue;
        }
        if c == '\t' || c == '\n' || c == '\r' || !c.is_control() {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_and_colours_are_removed() {
        assert_eq!(super::clean("\u{1b}[31mred\u{1b}[0m\u{7} ok\tx"), "red ok\tx");
    }
}
