//! How much memory the sizes in a file someone else wrote may make mflow allocate.
//!
//! Each size in a config.json, a safetensors header or a shards manifest is bounded on its own,
//! but what mflow holds is their product: layers x heads x tensor names, a tokenizer's vocabulary
//! x what the tokenizer library keeps per entry. Every reader computes what an operation will
//! hold from those sizes *before* it allocates any of it (a [`Need`]) and asks the [`Budget`],
//! which refuses past its figure with a message that gives both.
//!
//! The budget is `MFLOW_MEMORY_BUDGET` when set (bytes, or a number with a unit: `512MiB`,
//! `64GiB`, `2TB`), else half of the memory this process may use: the smaller of the
//! machine's memory (`MemTotal`) and its cgroup's limit (a container's or a pod's), else 8 GiB
//! where neither can be read. Half, because what is estimated is metadata (plans, names,
//! vocabularies) while the tensors themselves stream through the page cache beside it, and a
//! stage shares its machine with the other stages of a run. A real model needs a small part of
//! it (docs/validation.md gives the figures), so the default only decides where a hostile file
//! is stopped.

use std::fmt;

/// The environment variable that sets the budget.
pub const VAR: &str = "MFLOW_MEMORY_BUDGET";
/// The budget where the memory of the machine cannot be read.
pub const FALLBACK: u64 = 8 << 30;

/// The memory budget and where its figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    pub origin: Origin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `MFLOW_MEMORY_BUDGET`.
    Set,
    /// Half of `memory` bytes, read from `from`.
    Default { memory: u64, from: &'static str },
    /// [`FALLBACK`]: the machine's memory could not be read.
    Fallback,
}

/// A value of `MFLOW_MEMORY_BUDGET` that is not an amount of memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSetting {
    pub value: String,
}

impl fmt::Display for BadSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{VAR} = {:?} is not an amount of memory", crate::excerpt(&self.value))
    }
}

impl std::error::Error for BadSetting {}

/// What an operation will hold, in parts that the message can name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Need {
    parts: Vec<(String, u64)>,
}

impl Need {
    pub fn new() -> Need {
        Need::default()
    }

    /// Adds a part; sums saturate, so that sizes multiplied from a file cannot wrap around.
    pub fn add(&mut self, what: impl Into<String>, bytes: u64) -> &mut Need {
        self.parts.push((what.into(), bytes));
        self
    }

    /// Adds every part of `other`.
    pub fn extend(&mut self, other: Need) -> &mut Need {
        self.parts.extend(other.parts);
        self
    }

    pub fn total(&self) -> u64 {
        self.parts.iter().fold(0u64, |sum, (_, b)| sum.saturating_add(*b))
    }

    pub fn parts(&self) -> &[(String, u64)] {
        &self.parts
    }
}

/// An operation that would need more than the budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    /// What would need it, e.g. "converting to tp = 1, pp = 1".
    pub what: String,
    pub need: Need,
    pub budget: Budget,
}

impl fmt::Display for OverBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} would need about {} of memory", self.what, bytes(self.need.total()))?;
        // The largest parts, which say which sizes multiplied.
        let mut parts: Vec<&(String, u64)> = self.need.parts.iter().filter(|(_, b)| *b > 0).collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        if !parts.is_empty() {
            let shown: Vec<String> = parts.iter().take(3).map(|(w, b)| format!("{w}: {}", bytes(*b))).collect();
            write!(f, " ({}{})", shown.join("; "), if parts.len() > 3 { "; ..." } else { "" })?;
        }
        write!(f, ", more than the memory budget of {} ({})", bytes(self.budget.bytes), self.budget.origin)
    }
}

impl std::error::Error for OverBudget {}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Set => write!(f, "{VAR}"),
            Origin::Default { memory, from } => {
                write!(f, "half of the {} this process may use, from {from}", bytes(*memory))
            }
            Origin::Fallback => write!(f, "the default where the machine's memory cannot be read"),
        }
    }
}

impl Budget {
    /// The budget of this process: `MFLOW_MEMORY_BUDGET`, else half of its memory.
    pub fn from_env() -> Result<Budget, BadSetting> {
        match std::env::var(VAR) {
            Ok(v) if !v.trim().is_empty() => Budget::parse(&v),
            _ => Ok(Budget::default_for_machine()),
        }
    }

    /// A budget set to `value` (as `MFLOW_MEMORY_BUDGET` would be).
    pub fn parse(value: &str) -> Result<Budget, BadSetting> {
        match parse_bytes(value) {
            Some(bytes) if bytes > 0 => Ok(Budget { bytes, origin: Origin::Set }),
            _ => Err(BadSetting { value: value.to_string() }),
        }
    }

    /// Half of the memory this process may use; [`FALLBACK`] where it cannot be read. Read once
    /// per process.
    pub fn default_for_machine() -> Budget {
        static DEFAULT: std::sync::OnceLock<Budget> = std::sync::OnceLock::new();
        *DEFAULT.get_or_init(|| match usable_memory() {
            Some((memory, from)) => Budget { bytes: memory / 2, origin: Origin::Default { memory, from } },
            None => Budget { bytes: FALLBACK, origin: Origin::Fallback },
        })
    }

    /// Refuses `need` past the budget.
    pub fn check(&self, what: impl Into<String>, need: Need) -> Result<(), OverBudget> {
        if need.total() <= self.bytes {
            Ok(())
        } else {
            Err(OverBudget { what: what.into(), need, budget: *self })
        }
    }
}

/// Bytes for people: `512 B`, `3.5 KiB`, `28.1 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// `1234`, `512MiB`, `64 GiB`, `2TB`, `1.5G` (K, M, G, T alone are binary, as in `ulimit`).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    if number.is_empty() {
        return None;
    }
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(scale);
    }
    let x: f64 = number.parse().ok()?;
    let v = x * scale as f64;
    (x.is_finite() && v < u64::MAX as f64).then_some(v as u64)
}

/// The memory this process may use and where that figure came from: the smaller of the
/// machine's memory and the limit of the cgroups it is in.
pub fn usable_memory() -> Option<(u64, &'static str)> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| mem_total(&m));
    let limit = cgroup_limit();
    match (total, limit) {
        (Some(t), Some(l)) if l < t => Some((l, "the cgroup's memory limit")),
        (Some(t), _) => Some((t, "MemTotal in /proc/meminfo")),
        (None, Some(l)) => Some((l, "the cgroup's memory limit")),
        (None, None) => None,
    }
}

fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The smallest memory limit among this process's cgroups and their parents (cgroup v2's
/// `memory.max`, v1's `memory.limit_in_bytes`); `None` when there is none.
fn cgroup_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<u64> = None;
    let mut consider = |file: String| {
        let Ok(text) = std::fs::read_to_string(&file) else { return };
        // "max" (v2) or a figure near 2^63 (v1) mean no limit.
        if let Ok(n) = text.trim().parse::<u64>() {
            if n < 1 << 60 {
                best = Some(best.map_or(n, |b| b.min(n)));
            }
        }
    };
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let (root, file) = match controllers {
            "" => ("/sys/fs/cgroup", "memory.max"),
            c if c.split(',').any(|c| c == "memory") => ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
            _ => continue,
        };
        // The cgroup and each parent up to the root of the mount (inside a container, the
        // mount's root is the container's own cgroup).
        let mut dir = std::path::PathBuf::from(path.trim_start_matches('/'));
        loop {
            consider(format!("{root}/{}/{file}", dir.display()).replace("//", "/"));
            if !dir.pop() {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_parse_with_and_without_units() {
        for (text, want) in [
            ("1234", Some(1234)),
            ("512MiB", Some(512 << 20)),
            ("64 GiB", Some(64 << 30)),
            ("2TB", Some(2_000_000_000_000)),
            ("1.5G", Some(3 << 29)),
            ("8g", Some(8 << 30)),
            ("100KB", Some(100_000)),
            ("", None),
            ("GiB", None),
            ("-1", None),
            ("12 parsecs", None),
            ("99999999999999999999", None),
            ("1e3", None),
            ("99999999999T", None),
        ] {
            assert_eq!(parse_bytes(text), want, "{text}");
        }
        assert!(Budget::parse("0").is_err());
        assert_eq!(Budget::parse("1GiB").unwrap(), Budget { bytes: 1 << 30, origin: Origin::Set });
        assert_eq!(
            Budget::parse("lots").unwrap_err().to_string(),
            "MFLOW_MEMORY_BUDGET = \"lots\" is not an amount of memory"
        );
    }

    #[test]
    fn figures_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3584), "3.5 KiB");
        assert_eq!(bytes(30_172_553_216), "28.1 GiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn a_need_past_the_budget_is_refused_with_both_figures_and_its_largest_parts() {
        let budget = Budget::parse("1GiB").unwrap();
        let mut need = Need::new();
        need.add("plan", 20 << 30).add("names", 8 << 30).add("buffers", 2 << 20).add("header", 1 << 20).add("none", 0);
        let e = budget.check("converting to tp = 1, pp = 1", need.clone()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "converting to tp = 1, pp = 1 would need about 28.0 GiB of memory (plan: 20.0 GiB; names: 8.0 GiB; \
             buffers: 2.0 MiB; ...), more than the memory budget of 1.0 GiB (MFLOW_MEMORY_BUDGET)"
        );
        assert!(Budget { bytes: 29 << 30, origin: Origin::Set }.check("x", need).is_ok());
        // Saturating: sizes multiplied from a file cannot wrap around to a small total.
        let mut huge = Need::new();
        huge.add("a", u64::MAX).add("b", u64::MAX);
        assert_eq!(huge.total(), u64::MAX);
        assert!(budget.check("x", huge).is_err());
    }

    #[test]
    fn the_default_is_half_of_the_memory_this_process_may_use() {
        let b = Budget::default_for_machine();
        match b.origin {
            Origin::Default { memory, .. } => {
                assert_eq!(b.bytes, memory / 2);
                let total = mem_total(&std::fs::read_to_string("/proc/meminfo").unwrap()).unwrap();
                assert!(memory <= total && memory > 0);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(mem_total("MemFree: 1 kB\nMemTotal:       24683784 kB\n"), Some(24683784 * 1024));
    }
}
