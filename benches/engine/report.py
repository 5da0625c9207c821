#!/usr/bin/env python3
"""Summarize measure.py's results as the markdown tables of docs/benchmarks.md.

usage: report.py RESULTS_JSON
"""
import json
import statistics
import sys

PHASES = [("cold", "cold run"), ("noop", "no-op rerun"), ("change", "one middle stage changed"), ("plan", "plan / dry-run")]
ENGINES = ["shell", "mflow", "make", "ninja", "snakemake", "dvc"]


def main():
    rows = json.load(open(sys.argv[1]))
    cell = {}
    for r in rows:
        cell.setdefault((r["shape"], r["engine"], r["phase"]), []).append(r)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    engines = [e for e in ENGINES if any(r["engine"] == e for r in rows)]

    def med(shape, engine, phase):
        rs = [r for r in cell.get((shape, engine, phase), []) if r["rc"] == 0]
        return statistics.median(r["wall_s"] for r in rs) if rs else None

    def fmt(s):
        if s is None:
            return "–"
        return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"

    print("| shape | phase | " + " | ".join(engines) + " | mflow / shell | mflow / ninja | snakemake / mflow |")
    print("|---|---|" + "---|" * (len(engines) + 3))
    for shape in shapes:
        for phase, title in PHASES:
            vals = {e: med(shape, e, phase) for e in engines}
            if all(v is None for v in vals.values()):
                continue
            parts = []
            for e in engines:
                rs = cell.get((shape, e, phase), [])
                v = vals[e]
                bad = [r for r in rs if r["rc"] != 0]
                txt = fmt(v)
                if rs:
                    txt += f" ({len(rs) - len(bad)})"
                if bad:
                    txt += f" {len(bad)}x rc {bad[0]['rc']}"
                parts.append(txt)
            m = vals.get("mflow")

            def ratio(a, b):
                return f"{a / b:.2f}x" if a and b else "–"
            print(f"| {shape} | {title} | " + " | ".join(parts) + f" | {ratio(m, vals.get('shell')) if phase == 'cold' else '–'}"
                  f" | {ratio(m, vals.get('ninja'))} | {ratio(vals.get('snakemake'), m)} |")
    print()
    print("| shape | mflow peak RSS (MiB): cold / no-op / change / plan | stages executed (expected), mflow | all engines ran the expected stages |")
    print("|---|---|---|---|")
    for shape in shapes:
        rss = []
        for phase, _ in PHASES:
            vs = [r["rss_mib"] for r in cell.get((shape, "mflow", phase), []) if r["rss_mib"]]
            rss.append(f"{max(vs):.1f}" if vs else "–")
        ran = []
        for phase, _ in PHASES[:3]:
            rs = cell.get((shape, "mflow", phase), [])
            ran.append(",".join(str(r["executed"]) for r in rs) + f" ({rs[0]['expected']})" if rs else "–")
        wrong = [f"{r['engine']} {r['phase']} {r['executed']}/{r['expected']}" for r in rows
                 if r["shape"] == shape and r["phase"] != "plan" and r["rc"] == 0 and r["executed"] != r["expected"]]
        print(f"| {shape} | {' / '.join(rss)} | {'; '.join(ran)} | {'yes' if not wrong else ', '.join(wrong)} |")


if __name__ == "__main__":
    main()
