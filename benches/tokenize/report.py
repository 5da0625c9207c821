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


def main():
    d = sys.argv[1]
    stats = json.load(open(os.path.join(d, 'mflow-out', 'stats.json')))
    text, tokens = stats['text_bytes'], stats['tokens']
    ceiling = json.loads(open(os.path.join(d, 'ceiling.out')).read().strip().splitlines()[-1])
    rows = []
    for name, label in [('ceiling', '(a) tokenizers crate, encode only (no I/O)'), ('mflow', 'mflow-data (release)'),
                        ('python', '(b) Python: encode_batch + numpy .bin/.idx')]:
        wall, rss, cpu = gnu_time(os.path.join(d, f'{name}.time'))
        secs = ceiling['encode_s'] if name == 'ceiling' else wall
        toks = ceiling['tokens'] if name == 'ceiling' else tokens
        if name == 'ceiling':
            cpu = ceiling.get('encode_cpu_s', float('nan'))
        rows.append((label, secs, wall, text / 1e6 / secs, toks / 1e6 / secs, rss / 1024, cpu))
    print(f"corpus: {stats['documents']} documents, {text:,} bytes of text, {tokens:,} tokens (with EOD)\n")
    print('| run | seconds | whole-process wall s | text MB/s | M tokens/s | peak RSS MiB | CPU s | text MB per CPU-s |')
    print('|---|---|---|---|---|---|---|---|')
    for label, secs, wall, mbps, mtps, rss, cpu in rows:
        print(f'| {label} | {secs:.1f} | {wall:.1f} | {mbps:.2f} | {mtps:.3f} | {rss:.0f} | {cpu:.1f} | {text / 1e6 / cpu:.2f} |')
    a, m, b = rows[0], rows[1], rows[2]
    print(f'\nwall: mflow / (a) = {m[1] / a[1]:.2f} (target <= 1.3); (b) / mflow = {b[1] / m[1]:.2f}x (target >= 3)')
    print(f'CPU:  mflow / (a) = {m[6] / a[6]:.2f}; (b) / mflow = {b[6] / m[6]:.2f}x')
    print('(a) = encode phase only (corpus preloaded in memory); other rows: whole process incl. start-up and I/O.')


if __name__ == '__main__':
    main()
