#!/usr/bin/env python3
"""Turns the runs of benches/tokenize/run.sh into a markdown table: medians over the alternating
rounds, the per-round wall-time ratio of mflow to gigatoken, and the documents whose ids differ
from the Python tokenizers library's.

usage: report.py RUNS_DIR REPS
"""
import json
import os
import re
import statistics
import sys


def gnu_time(path):
    text = open(path).read()
    m = re.search(r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)', text)
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    rss = int(re.search(r'Maximum resident set size \(kbytes\): (\d+)', text).group(1))
    user = float(re.search(r'User time \(seconds\): ([\d.]+)', text).group(1))
    sys_ = float(re.search(r'System time \(seconds\): ([\d.]+)', text).group(1))
    return wall, rss / 1024, user + sys_


def load(d, name):
    return ' → '.join(l.split()[0] for l in open(os.path.join(d, f'{name}.load')).read().splitlines() if l.strip())


ROWS = [('mflow', '**mflow dataset**, 2 threads'),
        ('gigatoken', 'gigatoken 0.10 (JSONL source, numpy .bin/.idx), 2 threads'),
        ('mflow-1thread', '**mflow dataset**, 1 thread'),
        ('python', 'HF tokenizers `encode_batch_fast` + numpy (the reference ids)'),
        ('ceiling', '`tokenizers` crate `encode_fast`, encode only (corpus preloaded)'),
        ('mflow-crate-pretokenizer', 'mflow `--word-memo-mib 0` (the crate\'s own encode)')]


def main():
    d, reps = sys.argv[1], int(sys.argv[2])
    stats = json.load(open(os.path.join(d, 'mflow.1-out', 'stats.json')))
    text = stats['text_bytes']
    print(f"corpus: {stats['documents']:,} documents, {text:,} bytes of text, {stats['tokens']:,} tokens with EOD\n")
    print('| run | wall s (median) | runs | text MB/s | CPU s | peak RSS MiB | documents differing from HF | load avg (1 min) |')
    print('|---|---|---|---|---|---|---|---|')
    walls = {}
    for name, label in ROWS:
        names = [f'{name}.{r}' for r in range(1, reps + 1)] if os.path.exists(os.path.join(d, f'{name}.1.time')) else [name]
        if not os.path.exists(os.path.join(d, f'{names[0]}.time')):
            continue
        runs = [gnu_time(os.path.join(d, f'{n}.time')) for n in names]
        if name == 'ceiling':  # the encode phase only, as the example reports it
            enc = json.loads(open(os.path.join(d, 'ceiling.out')).read().strip().splitlines()[-1])
            runs = [(enc['encode_s'], runs[0][1], enc['encode_cpu_s'])]
        walls[name] = [r[0] for r in runs]
        wall = statistics.median(r[0] for r in runs)
        diff_path = os.path.join(d, f'{name}.diff')
        differ = json.load(open(diff_path))['differing'] if os.path.exists(diff_path) else ('reference' if name == 'python' else '–')
        print(f"| {label} | {wall:.2f} | {', '.join(f'{r[0]:.2f}' for r in runs)} | {text / 1e6 / wall:.1f} | "
              f"{statistics.median(r[2] for r in runs):.2f} | {statistics.median(r[1] for r in runs):,.0f} | {differ} | "
              f"{load(d, names[0])} |")
    if 'gigatoken' in walls:
        ratios = [m / g for m, g in zip(walls['mflow'], walls['gigatoken'])]
        print(f"\nmflow / gigatoken wall time, round by round: {', '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f})")
    for name in ('python', 'ceiling', 'mflow-crate-pretokenizer'):
        if name in walls:
            print(f"{name} / mflow wall time: {statistics.median(walls[name]) / statistics.median(walls['mflow']):.1f}x")


if __name__ == '__main__':
    main()
