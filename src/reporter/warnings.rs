//! Python warnings in stage output, shown once on the console.
//!
//! A Megatron-Core training stage prints about fifteen warnings per rank (Transformer Engine
//! missing, deprecations) before its first useful line, each followed by the source line Python
//! quotes under it. The attempt log keeps all of them; the console shows each distinct warning
//! once per run, as one short line, and drops the quoted source lines.

use std::borrow::Cow;
use std::collections::HashSet;

/// Most characters of a warning's `Category: message` shown on the console.
const SHOWN: usize = 120;

/// Longest bracketed rank prefix taken off a line (`[rank0]:`, `[default12]:`, `[rank 3] `).
const PREFIX: usize = 32;

#[derive(Default)]
pub struct Warnings {
    /// `Category: message` of every warning shown so far in this run.
    seen: HashSet<String>,
    /// (stage, rank prefix, count): warnings whose quoted source line may come next. Entries
    /// exist only between a warning and its source line, so a normal line seldom looks here.
    pending: Vec<(String, String, u32)>,
}

impl Warnings {
    /// What the console shows for one line of a stage's output: the line as it is, a short line
    /// for a warning not shown before, or nothing (a repeated warning, a quoted source line).
    pub fn filter<'a>(&mut self, stage: &str, line: &'a str) -> Option<Cow<'a, str>> {
        let (prefix, rest) = split_prefix(line);
        // A library's own progress bar (tqdm: transformers loading weights, a download): the
        // stage's progress is mflow's to show, and the attempt log keeps the bar.
        if is_progress_bar(rest) {
            return None;
        }
        if let Some((category, message)) = parse_warning(rest) {
            self.expect_source(stage, prefix);
            let key = if message.is_empty() { category.to_string() } else { format!("{category}: {message}") };
            return self
                .seen
                .insert(key)
                .then(|| Cow::Owned(format!("warning (shown once): {}", shorten(category, message))));
        }
        if is_source(rest) && self.take_source(stage, prefix) {
            return None;
        }
        // Any other line from this rank ends what its last warning printed: an indented line
        // after it is the stage's own and is shown.
        if !self.pending.is_empty() {
            self.pending.retain(|(s, p, _)| !(s == stage && p == prefix));
        }
        Some(Cow::Borrowed(line))
    }

    fn expect_source(&mut self, stage: &str, prefix: &str) {
        match self.pending.iter_mut().find(|(s, p, _)| s == stage && p == prefix) {
            Some((_, _, n)) => *n += 1,
            None => self.pending.push((stage.to_string(), prefix.to_string(), 1)),
        }
    }

    /// Whether a warning of this stage and rank still waits for its source line (and takes it).
    fn take_source(&mut self, stage: &str, prefix: &str) -> bool {
        let Some(i) = self.pending.iter().position(|(s, p, _)| s == stage && p == prefix) else { return false };
        self.pending[i].2 -= 1;
        if self.pending[i].2 == 0 {
            self.pending.swap_remove(i);
        }
        true
    }
}

/// Splits the rank prefixes off a line: torchrun's `[rank0]:` and the Kubernetes backend's
/// `[rank 0] ` (a TrainJob's lines carry both, in that order). Ranks print the same warnings,
/// and each rank's source line follows its own warning, so both are read without the prefix.
/// A line drawn by a progress-bar library: tqdm's `desc: 42%|####  | 5/12 [00:01<00:02, 3.2it/s]`
/// (its redraws joined by carriage returns), or a bare `desc: 42%` redraw.
fn is_progress_bar(line: &str) -> bool {
    let last = line.rsplit('\r').find(|s| !s.trim().is_empty()).unwrap_or(line).trim();
    let Some(pct) = last.find('%') else { return false };
    let before = last[..pct].rsplit(|c: char| !c.is_ascii_digit()).next().unwrap_or_default();
    let number = !before.is_empty() && before.len() <= 3;
    let after = &last[pct + 1..];
    number && (after.starts_with('|') || after.trim().is_empty() || line.contains('\r'))
}

fn split_prefix(line: &str) -> (&str, &str) {
    let mut rest = line;
    for _ in 0..2 {
        let Some(inner) = rest.strip_prefix('[') else { break };
        let Some(close) = inner.find(']').filter(|&c| c <= PREFIX) else { break };
        let after = &inner[close + 1..];
        // No space is taken after `:`: the two spaces of a source line must stay.
        match after.strip_prefix(':').or_else(|| after.strip_prefix(' ')) {
            Some(r) => rest = r,
            None => break,
        }
    }
    (&line[..line.len() - rest.len()], rest)
}

/// A line in the format of Python's `warnings.formatwarning`, `path:line: Category: message`:
/// its category and message. The shape is strict (a location without spaces, a line number, a
/// category named `...Warning`), so that a line that only says "warning" is not taken for one.
fn parse_warning(rest: &str) -> Option<(&str, &str)> {
    let (head, tail) = rest.split_once(": ")?;
    let (location, lineno) = head.rsplit_once(':')?;
    if lineno.is_empty() || !lineno.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // `<frozen importlib._bootstrap>` and `<string>` are the locations with a space Python uses.
    let framed = location.starts_with('<') && location.ends_with('>');
    if location.is_empty() || (!framed && location.contains(char::is_whitespace)) {
        return None;
    }
    let (category, message) = tail.split_once(": ").unwrap_or((tail.trim_end().trim_end_matches(':'), ""));
    let named = category.ends_with("Warning")
        && category.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && category.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    named.then(|| (category, message.trim()))
}

/// The line Python quotes under a warning: two spaces, then the stripped source line.
fn is_source(rest: &str) -> bool {
    rest.strip_prefix("  ").is_some_and(|s| s.starts_with(|c: char| !c.is_whitespace()))
}

fn shorten(category: &str, message: &str) -> String {
    let text = if message.is_empty() { category.to_string() } else { format!("{category}: {message}") };
    match text.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}…", text[..cut].trim_end()),
        None => text,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn third_party_progress_bars_are_left_to_the_attempt_log() {
        let mut w = Warnings::default();
        for bar in [
            "Loading weights: 100%|##########| 3/3 [00:00<00:00, 120.5it/s]",
            "Loading weights:   0%|          | 0/3 [00:00<?, ?it/s]\rLoading weights:  33%|###3      | 1/3",
            "[rank0]: Downloading: 42%|####2     | 5.1M/12.0M [00:01<00:02, 3.2MB/s]",
            "Loading weights: 0%",
        ] {
            assert_eq!(w.filter("s", bar), None, "{bar}");
        }
        for line in ["iteration 5/10 loss 3.2", "accuracy 42% of the tokens", "50% done, next: valid", "100"] {
            assert!(w.filter("s", line).is_some(), "{line}");
        }
    }

    use super::*;

    fn console(w: &mut Warnings, stage: &str, text: &str) -> Vec<String> {
        text.lines().filter_map(|l| w.filter(stage, l).map(Cow::into_owned)).collect()
    }

    /// What two torchrun ranks of a Megatron-Core stage print before their first step.
    const TWO_RANKS: &str = "\
[rank0]:/usr/lib/python3/dist-packages/megatron/core/transformer/transformer_config.py:123: UserWarning: Transformer Engine is not installed. Falling back to the local implementation.
[rank0]:  warnings.warn(\"Transformer Engine is not installed. Falling back to the local implementation.\")
[rank1]:/usr/lib/python3/dist-packages/megatron/core/transformer/transformer_config.py:123: UserWarning: Transformer Engine is not installed. Falling back to the local implementation.
[rank0]:/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py:4321: FutureWarning: `torch.distributed._all_gather_base` is a private function and will be deprecated.
[rank1]:  warnings.warn(\"Transformer Engine is not installed. Falling back to the local implementation.\")
[rank0]:  warnings.warn(
[rank1]:/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py:4321: FutureWarning: `torch.distributed._all_gather_base` is a private function and will be deprecated.
[rank1]:  warnings.warn(
[rank0]:<frozen importlib._bootstrap>:241: DeprecationWarning: builtin type SwigPyPacked has no __module__ attribute
[rank1]:<frozen importlib._bootstrap>:241: DeprecationWarning: builtin type SwigPyPacked has no __module__ attribute
[rank0]:/usr/lib/python3/dist-packages/apex/normalization/fused_layer_norm.py:7: SyntaxWarning: invalid escape sequence '\\s'
[rank0]:  \"\"\"Fused layer norm \\s\"\"\"
[rank1]:/usr/lib/python3/dist-packages/apex/normalization/fused_layer_norm.py:7: SyntaxWarning: invalid escape sequence '\\s'
[rank1]:  \"\"\"Fused layer norm \\s\"\"\"
[rank0]:iteration 1/200 | loss 10.93
[rank1]:iteration 1/200 | loss 10.93
";

    #[test]
    fn each_distinct_warning_of_two_ranks_is_shown_once() {
        let mut w = Warnings::default();
        assert_eq!(
            console(&mut w, "train", TWO_RANKS),
            [
                "warning (shown once): UserWarning: Transformer Engine is not installed. Falling back to the local implementation.",
                "warning (shown once): FutureWarning: `torch.distributed._all_gather_base` is a private function and will be deprecated.",
                "warning (shown once): DeprecationWarning: builtin type SwigPyPacked has no __module__ attribute",
                "warning (shown once): SyntaxWarning: invalid escape sequence '\\s'",
                "[rank0]:iteration 1/200 | loss 10.93",
                "[rank1]:iteration 1/200 | loss 10.93",
            ]
        );
        // Once per run: a retry, or another stage, shows none of them again.
        let again = console(&mut w, "evaluate", TWO_RANKS);
        assert_eq!(again, ["[rank0]:iteration 1/200 | loss 10.93", "[rank1]:iteration 1/200 | loss 10.93"]);
    }

    #[test]
    fn kubernetes_and_unprefixed_lines_are_read_the_same() {
        let mut w = Warnings::default();
        let text = "\
[rank 0] [rank0]:/opt/megatron/core/utils.py:9: UserWarning: apex is not installed
[rank 0] [rank0]:  warnings.warn('apex is not installed')
/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1762: DeprecationWarning: `np.float` is a deprecated alias
  return forward_call(*args, **kwargs)
/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1762: DeprecationWarning: `np.float` is a deprecated alias
  return forward_call(*args, **kwargs)
WARNING:py.warnings:/opt/megatron/core/utils.py:9: UserWarning: apex is not installed
done
";
        assert_eq!(
            console(&mut w, "train", text),
            [
                "warning (shown once): UserWarning: apex is not installed",
                "warning (shown once): DeprecationWarning: `np.float` is a deprecated alias",
                "done"
            ]
        );
    }

    #[test]
    fn other_lines_pass_unchanged() {
        let mut w = Warnings::default();
        let text = "\
step 10: loss 2.31
warning: the learning rate is very high
UserWarning: this is not in Python's format
Warning: grad norm 1e4 at step 12
[W socket.cpp:464] [c10d] The server socket has failed to bind. Warning: retrying
config.py:12: note: UserWarning is what the docs call it
validation: 3 warnings, 0 errors
  an indented line of a table
    a deeper one
/data/corpus.txt:12: 4096 tokens
";
        assert_eq!(console(&mut w, "s", text), text.lines().collect::<Vec<_>>());
    }

    #[test]
    fn only_the_source_line_under_a_warning_is_dropped() {
        let mut w = Warnings::default();
        let text = "\
/x/a.py:1: UserWarning: no source line follows this one
results:
  accuracy 0.91
/x/b.py:2: RuntimeWarning: overflow in exp
  y = np.exp(x)
  loss 3.2
";
        assert_eq!(
            console(&mut w, "s", text),
            [
                "warning (shown once): UserWarning: no source line follows this one",
                "results:",
                "  accuracy 0.91",
                "warning (shown once): RuntimeWarning: overflow in exp",
                "  loss 3.2"
            ]
        );
    }

    #[test]
    fn a_long_warning_is_cut_on_the_console() {
        let mut w = Warnings::default();
        let message = "é".repeat(300);
        let shown = console(&mut w, "s", &format!("/x/a.py:1: UserWarning: {message}"));
        let text = shown[0].strip_prefix("warning (shown once): ").unwrap();
        assert_eq!(text.chars().count(), SHOWN + 1, "{text}");
        assert!(text.starts_with("UserWarning: éé") && text.ends_with('…'), "{text}");
        // A warning with no message is its category.
        assert_eq!(console(&mut w, "s", "/x/a.py:2: UserWarning: "), ["warning (shown once): UserWarning"]);
    }
}
