//! `mflow metrics diff RUN_A RUN_B`: final metrics of two runs side by side, per stage, and
//! `--fail-if` conditions that turn a regression into a failing exit code.

use std::collections::{BTreeMap, BTreeSet};

use super::summary::num;
use super::CiError;

pub type Finals = BTreeMap<String, BTreeMap<String, f64>>;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Gt,
    Ge,
    Lt,
    Le,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Threshold {
    /// Change from A to B in percent of |A|.
    Relative(f64),
    /// Change from A to B.
    Absolute(f64),
    /// B's value itself.
    Value(f64),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub text: String,
    /// `STAGE.METRIC` or a metric looked up in every stage.
    metric: String,
    op: Op,
    threshold: Threshold,
}

impl Condition {
    pub fn parse(text: &str) -> Result<Condition, CiError> {
        let bad = |message: &str| CiError::Condition { condition: text.to_string(), message: message.to_string() };
        let at = text.find(['<', '>']).ok_or_else(|| bad("no comparison: use > or <"))?;
        let metric = text[..at].trim().to_string();
        if metric.is_empty() {
            return Err(bad("no metric before the comparison"));
        }
        let rest = &text[at..];
        let (op, value) = if let Some(v) = rest.strip_prefix(">=") {
            (Op::Ge, v)
        } else if let Some(v) = rest.strip_prefix("<=") {
            (Op::Le, v)
        } else if let Some(v) = rest.strip_prefix('>') {
            (Op::Gt, v)
        } else {
            (Op::Lt, &rest[1..])
        };
        let value = value.trim();
        let number = |s: &str| {
            s.trim().parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| bad(&format!("`{s}` is not a number")))
        };
        let threshold = if let Some(p) = value.strip_suffix('%') {
            if !(p.starts_with('+') || p.starts_with('-')) {
                return Err(bad("a relative change needs a sign, e.g. +2% or -5%"));
            }
            Threshold::Relative(number(p)?)
        } else if value.starts_with('+') || value.starts_with('-') {
            Threshold::Absolute(number(value)?)
        } else {
            Threshold::Value(number(value)?)
        };
        Ok(Condition { text: text.to_string(), metric, op, threshold })
    }

    fn holds(&self, a: f64, b: f64) -> bool {
        let x = match self.threshold {
            Threshold::Relative(_) => {
                if a == 0.0 {
                    if b == 0.0 {
                        0.0
                    } else {
                        f64::INFINITY.copysign(b)
                    }
                } else {
                    (b - a) / a.abs() * 100.0
                }
            }
            Threshold::Absolute(_) => b - a,
            Threshold::Value(_) => b,
        };
        let t = match self.threshold {
            Threshold::Relative(t) | Threshold::Absolute(t) | Threshold::Value(t) => t,
        };
        match self.op {
            Op::Gt => x > t,
            Op::Ge => x >= t,
            Op::Lt => x < t,
            Op::Le => x <= t,
        }
    }

    /// (stage, metric) pairs this condition applies to.
    fn targets(&self, a: &Finals, b: &Finals) -> Vec<(String, String)> {
        if let Some((stage, m)) = self.metric.split_once('.') {
            if a.contains_key(stage) || b.contains_key(stage) {
                return vec![(stage.to_string(), m.to_string())];
            }
        }
        let stages: BTreeSet<&String> =
            a.iter().chain(b.iter()).filter(|(_, m)| m.contains_key(&self.metric)).map(|(s, _)| s).collect();
        stages.into_iter().map(|s| (s.clone(), self.metric.clone())).collect()
    }
}

/// One metric of one stage in both runs.
pub struct Row {
    pub stage: String,
    pub metric: String,
    pub a: Option<f64>,
    pub b: Option<f64>,
}

impl Row {
    fn change(&self) -> Option<f64> {
        Some(self.b? - self.a?)
    }

    /// The change in percent of |A|; none from 0.
    fn change_percent(&self) -> Option<f64> {
        let a = self.a.filter(|a| *a != 0.0)?;
        Some((self.b? - a) / a.abs() * 100.0)
    }
}

pub struct Outcome {
    pub rows: Vec<Row>,
    /// Each condition with its violations, or why it could not be checked (one line each).
    pub conditions: Vec<(String, Vec<String>)>,
}

impl Outcome {
    /// One line per violated or unevaluable condition.
    pub fn failures(&self) -> impl Iterator<Item = &String> {
        self.conditions.iter().flat_map(|(_, f)| f)
    }

    pub fn table(&self) -> String {
        let mut rows =
            vec![["stage".to_string(), "metric".into(), "A".into(), "B".into(), "change".into(), "change %".into()]];
        let show = |v: Option<f64>| v.map(num).unwrap_or("-".into());
        for r in &self.rows {
            let d = r.change().map(signed).unwrap_or("-".into());
            let p = r.change_percent().map(|p| format!("{p:+.2}%")).unwrap_or("-".into());
            rows.push([r.stage.clone(), r.metric.clone(), show(r.a), show(r.b), d, p]);
        }
        table(&rows)
    }

    /// The diff as one JSON document: the runs, per stage and metric both values and the
    /// change, and each condition with whether it held (a condition that cannot be checked
    /// counts as held: it fails the diff too).
    pub fn json(&self, run_a: &str, run_b: &str) -> serde_json::Value {
        let mut stages = serde_json::Map::new();
        for r in &self.rows {
            let stage = stages.entry(r.stage.clone()).or_insert_with(|| serde_json::json!({}));
            stage[r.metric.as_str()] = serde_json::json!({
                "a": r.a, "b": r.b, "change": r.change(), "change_percent": r.change_percent(),
            });
        }
        let conditions: Vec<serde_json::Value> = self
            .conditions
            .iter()
            .map(|(c, f)| serde_json::json!({"condition": c, "held": !f.is_empty(), "failures": f}))
            .collect();
        serde_json::json!({
            "run_a": run_a,
            "run_b": run_b,
            "stages": stages,
            "conditions": conditions,
            "failed": self.failures().next().is_some(),
        })
    }
}

pub fn compare(a: &Finals, b: &Finals, conditions: &[Condition]) -> Outcome {
    let mut rows = Vec::new();
    let stages: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for stage in stages {
        let keys: BTreeSet<&String> = a.get(stage).into_iter().chain(b.get(stage)).flat_map(|m| m.keys()).collect();
        for k in keys {
            let va = a.get(stage).and_then(|m| m.get(k)).copied();
            let vb = b.get(stage).and_then(|m| m.get(k)).copied();
            rows.push(Row { stage: stage.clone(), metric: k.clone(), a: va, b: vb });
        }
    }
    let conditions = conditions.iter().map(|c| (c.text.clone(), check(c, a, b))).collect();
    Outcome { rows, conditions }
}

/// Where `c` holds, or why it cannot be checked.
fn check(c: &Condition, a: &Finals, b: &Finals) -> Vec<String> {
    let mut failures = Vec::new();
    let targets = c.targets(a, b);
    if targets.is_empty() {
        failures.push(format!("{}: no stage has metric `{}` in either run", c.text, c.metric));
    }
    for (stage, m) in targets {
        match (a.get(&stage).and_then(|x| x.get(&m)), b.get(&stage).and_then(|x| x.get(&m))) {
            (Some(&va), Some(&vb)) => {
                if c.holds(va, vb) {
                    failures.push(format!("{}: {stage}.{m} {} -> {}", c.text, num(va), num(vb)));
                }
            }
            (va, vb) => failures.push(format!(
                "{}: {stage}.{m} is missing in run {}",
                c.text,
                if va.is_none() {
                    "A"
                } else if vb.is_none() {
                    "B"
                } else {
                    "A and B"
                }
            )),
        }
    }
    failures
}

fn signed(x: f64) -> String {
    if x >= 0.0 {
        format!("+{}", num(x))
    } else {
        num(x)
    }
}

fn table(rows: &[[String; 6]]) -> String {
    let mut widths = [0usize; 6];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| if i < 2 { format!("{c:<w$}") } else { format!("{c:>w$}") })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finals(v: f64) -> Finals {
        [("train".to_string(), [("val_loss".to_string(), v)].into_iter().collect())].into_iter().collect()
    }

    #[test]
    fn relative_absolute_and_value_thresholds() {
        let (a, b) = (finals(2.0), finals(2.1));
        let fails = |c: &str| compare(&a, &b, &[Condition::parse(c).unwrap()]).failures().next().is_some();
        assert!(fails("val_loss>+2%"));
        assert!(!fails("val_loss>+10%"));
        assert!(fails("train.val_loss>+0.05"));
        assert!(!fails("val_loss>+0.2"));
        assert!(fails("val_loss>2.05"));
        assert!(!fails("val_loss<-1%"));
        assert!(fails("nope>+1%"));
    }

    #[test]
    fn json_has_both_values_the_change_and_each_condition() {
        let conditions = [Condition::parse("val_loss>+2%").unwrap(), Condition::parse("val_loss>+10%").unwrap()];
        let j = compare(&finals(2.0), &finals(2.5), &conditions).json("A", "B");
        let m = &j["stages"]["train"]["val_loss"];
        assert_eq!((m["a"].as_f64(), m["b"].as_f64(), m["change"].as_f64()), (Some(2.0), Some(2.5), Some(0.5)));
        assert_eq!(m["change_percent"].as_f64(), Some(25.0));
        assert_eq!(j["conditions"][0]["held"], true);
        assert_eq!(j["conditions"][1]["held"], true);
        let j = compare(&finals(0.0), &BTreeMap::new(), &[]).json("A", "B");
        assert!(
            j["stages"]["train"]["val_loss"]["b"].is_null() && j["stages"]["train"]["val_loss"]["change"].is_null()
        );
        assert_eq!(j["failed"], false);
    }

    #[test]
    fn malformed_conditions_are_rejected() {
        for c in ["val_loss", ">+2%", "val_loss>2%", "val_loss>abc"] {
            assert!(Condition::parse(c).is_err(), "{c}");
        }
    }
}
