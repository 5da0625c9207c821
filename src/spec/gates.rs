//! Metric gates: `val_ppl = "< 40"` in a stage's `gates` table, checked against the
//! `metrics.json` the stage wrote into its output.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub op: Op,
    pub value: f64,
}

impl Condition {
    pub fn parse(s: &str) -> Result<Condition, String> {
        let s = s.trim();
        let (op, rest) = [("<=", Op::Le), (">=", Op::Ge), ("==", Op::Eq), ("!=", Op::Ne), ("<", Op::Lt), (">", Op::Gt)]
            .iter()
            .find_map(|(p, op)| s.strip_prefix(p).map(|r| (*op, r)))
            .ok_or_else(|| format!("`{s}` does not start with <, <=, >, >=, == or !="))?;
        let value = rest.trim().parse::<f64>().map_err(|_| format!("`{}` is not a number", rest.trim()))?;
        // NaN compares false with everything: such a gate could never pass, or never fail.
        if !value.is_finite() {
            return Err(format!("`{}` is not a finite number", rest.trim()));
        }
        Ok(Condition { op, value })
    }

    pub fn holds(&self, x: f64) -> bool {
        match self.op {
            Op::Lt => x < self.value,
            Op::Le => x <= self.value,
            Op::Gt => x > self.value,
            Op::Ge => x >= self.value,
            Op::Eq => x == self.value,
            Op::Ne => x != self.value,
        }
    }
}

pub use mflow_contract::record::GateResult;

/// The value a gate's metric names in `metrics`: the top-level key of that name, else the path
/// of its dotted parts into nested objects (`valid.ppl`), as the summary and `metrics diff`
/// flatten them.
pub fn lookup<'a>(metrics: &'a serde_json::Value, metric: &str) -> Option<&'a serde_json::Value> {
    metrics.get(metric).or_else(|| {
        if !metric.contains('.') {
            return None;
        }
        metric.split('.').try_fold(metrics, |v, part| v.as_object()?.get(part))
    })
}

/// Evaluates every gate against `metrics` (a JSON object). A missing or non-numeric metric fails.
pub fn evaluate(gates: &BTreeMap<String, String>, metrics: &serde_json::Value) -> Vec<GateResult> {
    gates
        .iter()
        .map(|(metric, cond)| {
            let value = lookup(metrics, metric).and_then(serde_json::Value::as_f64);
            let passed = match (Condition::parse(cond), value) {
                (Ok(c), Some(v)) => c.holds(v),
                _ => false,
            };
            GateResult { metric: metric.clone(), condition: cond.clone(), value, passed }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks() {
        assert!(Condition::parse("< 40").unwrap().holds(39.0));
        assert!(!Condition::parse("<40").unwrap().holds(40.0));
        assert!(Condition::parse(">= -0.5").unwrap().holds(-0.5));
        assert!(Condition::parse("about 3").is_err());
        assert!(Condition::parse("< x").is_err());
        for odd in ["< nan", "!= NaN", "> inf", "<= -infinity"] {
            assert!(Condition::parse(odd).unwrap_err().contains("not a finite number"), "{odd}");
        }
    }

    #[test]
    fn missing_metric_fails() {
        let gates = BTreeMap::from([("val_ppl".to_string(), "< 40".to_string())]);
        let r = evaluate(&gates, &serde_json::json!({"val_loss": 2.0}));
        assert!(!r[0].passed);
        let r = evaluate(&gates, &serde_json::json!({"val_ppl": 12.5}));
        assert!(r[0].passed);
    }

    #[test]
    fn a_dotted_metric_is_a_top_level_key_first_then_a_nested_path() {
        let gates = BTreeMap::from([("valid.ppl".to_string(), "< 40".to_string())]);
        let r = evaluate(&gates, &serde_json::json!({"valid": {"ppl": 30}}));
        assert!(r[0].passed && r[0].value == Some(30.0), "{r:?}");
        let r = evaluate(&gates, &serde_json::json!({"valid.ppl": 50, "valid": {"ppl": 30}}));
        assert!(!r[0].passed && r[0].value == Some(50.0), "the exact key wins: {r:?}");
        for missing in
            [serde_json::json!({"valid": {"loss": 1}}), serde_json::json!({"valid": 30}), serde_json::json!([])]
        {
            assert_eq!(evaluate(&gates, &missing)[0].value, None, "{missing}");
        }
    }
}
