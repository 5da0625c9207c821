#!/usr/bin/env python3
"""Turns the outputs of benches/tokenize/run.sh into a markdown table with ratios."""
import json
import os
import re
import sys


def gnu_time(path):
    text = open(path).read()
    m = re.search(r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)', text)
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    rss = int(re.search(r'Maximum resident set size \(kbytes\): (\d+)', text).group(1))
    user = float(re.search(r'User time \(seconds\): ([\d.]+)', text).group(1))
    sys_ = float(re.search(r'System time \(seconds\): ([\d.]+)', text).group(1))
    return wall, rss, user + sys_


def load(d, name):
    path = os.path.join(d, f'{name}.load')
    if not os.path.exists(path):
        return '?'
    return ' → '.join(l.split()[0] for l in open(path).read().split('\n') if l.strip())


RUNS = [('ceiling', "(a) tokenizers crate default path (`encode_fast`), encode only"),
        ('ceiling-memo', "(a') mflow's encode path (word memo + lean splitter), encode only"),
        ('mflow', '**mflow-data** (whole stage)'),
        ('python', '(b) Python: encode_batch + numpy .bin/.idx'),
        ('mflow-nomemo', 'mflow-data `--word-memo-mib 0` (before: crate path)')]


def main():
    d = sys.argv[1]
    stats = json.load(open(os.path.join(d, 'mflow-out', 'stats.json')))
    text, tokens = stats['text_bytes'], stats['tokens']
    rows = {}
    for name, label in RUNS:
        if not os.path.exists(os.path.join(d, f'{name}.time')):
            continue
        wall, rss, cpu = gnu_time(os.path.join(d, f'{name}.time'))
        secs, toks = wall, tokens
        if name.startswith('ceiling'):
            # encode phase only; its tokens exclude the EOD ids
            enc = json.loads(open(os.path.join(d, f'{name}.out')).read().strip().splitlines()[-1])
            secs, cpu, toks = enc['encode_s'], enc['encode_cpu_s'], enc['tokens']
        rows[name] = (label, secs, wall, text / 1e6 / secs, toks / 1e6 / secs, rss / 1024, cpu, load(d, name))
    print(f"corpus: {stats['documents']} documents, {text:,} bytes of text, {tokens:,} tokens (with EOD)\n")
    print('| run | seconds | whole-process wall s | text MB/s | M tokens/s | peak RSS MiB | CPU s (user+sys) | text MB per CPU-s | load avg (1 min, before → after) |')
    print('|---|---|---|---|---|---|---|---|---|')
    for label, secs, wall, mbps, mtps, rss, cpu, la in rows.values():
        print(f'| {label} | {secs:.1f} | {wall:.1f} | {mbps:.2f} | {mtps:.3f} | {rss:,.0f} | {cpu:.1f} | {text / 1e6 / cpu:.2f} | {la} |')
    m = rows['mflow']
    for key, what in [('ceiling', '(a)'), ('ceiling-memo', "(a')"), ('python', '(b)'), ('mflow-nomemo', 'mflow --word-memo-mib 0')]:
        if key in rows:
            r = rows[key]
            print(f'\n{what} / mflow: wall {r[1] / m[1]:.2f}x, CPU {r[6] / m[6]:.2f}x', end='')
    print('\n\n(a), (a\'): encode phase only (corpus preloaded); other rows: whole process incl. start-up and I/O.')
    print('targets: mflow within 1.3x of (a), i.e. (a)/mflow >= 0.77; (b)/mflow >= 3.')


if __name__ == '__main__':
    main()
