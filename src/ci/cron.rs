//! Cron expressions as the CronJob controller reads them: Kubernetes validates a schedule with
//! robfig/cron's standard parser, so `schedule render` refuses here what the API server would
//! refuse at `schedule apply`.

/// Each field's name, bounds, and the names it takes for numbers (from the lowest bound on).
const FIELDS: [(&str, u32, u32, &[&str]); 5] = [
    ("minute", 0, 59, &[]),
    ("hour", 0, 23, &[]),
    ("day of month", 1, 31, &[]),
    ("month", 1, 12, &["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]),
    ("day of week", 0, 6, &["sun", "mon", "tue", "wed", "thu", "fri", "sat"]),
];

const DESCRIPTORS: [&str; 7] = ["@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"];

/// Why `cron` is not a schedule the CronJob controller takes, if it is not.
pub fn problem(cron: &str) -> Option<String> {
    if let Some(every) = cron.strip_prefix("@every ") {
        return (!go_duration(every.trim())).then(|| format!("`{}` is not a duration such as 1h30m", every.trim()));
    }
    if cron.starts_with('@') {
        return (!DESCRIPTORS.contains(&cron)).then(|| "unknown descriptor".into());
    }
    let fields: Vec<&str> = cron.split_whitespace().collect();
    if fields.len() != 5 {
        return Some(format!("{} fields, expected 5", fields.len()));
    }
    fields.iter().zip(FIELDS).find_map(|(f, field)| f.split(',').find_map(|part| part_problem(part, field)))
}

fn part_problem(part: &str, (what, lo, hi, names): (&str, u32, u32, &[&str])) -> Option<String> {
    let (range, step) = match part.split_once('/') {
        Some((r, s)) => (r, Some(s)),
        None => (part, None),
    };
    if let Some(s) = step {
        if s.parse::<u32>().map_or(true, |s| s == 0) {
            return Some(format!("{what}: step `{s}` is not a positive number"));
        }
    }
    if range == "*" || range == "?" {
        return None;
    }
    let bounds: Vec<&str> = range.split('-').collect();
    if bounds.len() > 2 {
        return Some(format!("{what}: `{range}` has more than one `-`"));
    }
    let mut values = Vec::new();
    for v in &bounds {
        let n = v.parse::<u32>().ok().or_else(|| {
            let lower = v.to_ascii_lowercase();
            names.iter().position(|n| *n == lower).map(|i| lo + i as u32)
        });
        match n {
            Some(n) if (lo..=hi).contains(&n) => values.push(n),
            Some(_) => return Some(format!("{what}: `{v}` is outside {lo}-{hi}")),
            None => return Some(format!("{what}: `{v}` is not a number or a name")),
        }
    }
    match values[..] {
        [a, b] if a > b => Some(format!("{what}: the range `{range}` ends before it starts")),
        _ => None,
    }
}

/// A Go duration, as `@every` takes: numbers, each with a unit of ns, us, µs, ms, s, m or h.
fn go_duration(text: &str) -> bool {
    let mut rest = text;
    let mut any = false;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if digits == 0 || rest[..digits].parse::<f64>().is_err() {
            return false;
        }
        rest = &rest[digits..];
        let Some(unit) = ["ns", "us", "µs", "ms", "s", "m", "h"].iter().find(|u| rest.starts_with(**u)) else {
            return false;
        };
        rest = &rest[unit.len()..];
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_controller_takes_and_what_it_refuses() {
        for ok in [
            "0 3 * * *",
            "*/15 * * * 1-5",
            "0 0 1 JAN,jul MON-fri",
            "0 3 ? * sun",
            "5 4 * * 0-6",
            "@daily",
            "@every 1h30m",
            "0 0 1-31/2 * *",
        ] {
            assert_eq!(problem(ok), None, "{ok}");
        }
        for (bad, says) in [
            ("0 3 * * 7", "outside 0-6"),
            ("0 3 * * 0-7", "outside 0-6"),
            ("0 3 * * XYZ", "not a number or a name"),
            ("0 3 * FOO *", "not a number or a name"),
            ("0 3 * * JAN", "not a number or a name"),
            ("0 5-3 * * *", "ends before it starts"),
            ("1-2-3 * * * *", "more than one"),
            ("*/0 * * * *", "not a positive number"),
            ("60 * * * *", "outside 0-59"),
            ("0 3 * *", "4 fields"),
            ("@often", "unknown descriptor"),
            ("@every 1 hour", "not a duration"),
        ] {
            let p = problem(bad).unwrap_or_else(|| panic!("{bad} was taken"));
            assert!(p.contains(says), "{bad}: {p}");
        }
    }
}
