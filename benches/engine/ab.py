"""Two mflow builds side by side on the random 1000-stage DAG: each repetition, alternating the
builds, a cold run, a pause of 1 s, then three no-op runs; prints medians and their ratio.

usage: OLD=mflow-before NEW=mflow-after python3 benches/engine/ab.py WORK_DIR [REPS]
"""
import subprocess, time, statistics, sys, os, shutil
here = os.path.dirname(os.path.abspath(__file__))
bins = {"old": os.path.abspath(os.environ["OLD"]), "new": os.path.abspath(os.environ["NEW"])}
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
ws = {k: os.path.join(sys.argv[1], k) for k in bins}
for k, d in ws.items():
    shutil.rmtree(d, ignore_errors=True)
    subprocess.run([sys.executable, os.path.join(here, "gen.py"), "random", d], check=True, stdout=subprocess.DEVNULL)
def run(k):
    t = time.perf_counter()
    subprocess.run([bins[k], "run", "mflow.toml", "--jobs", "2"], cwd=ws[k], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t
def cold(k):
    shutil.rmtree(os.path.join(ws[k], ".mflow"), ignore_errors=True)
    try: os.remove(os.path.join(ws[k], "exec.log"))
    except FileNotFoundError: pass
    return run(k)
res = {(k, p): [] for k in bins for p in ("cold", "noop")}
for i in range(reps):
    for k in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
        res[(k, "cold")].append(cold(k))
        time.sleep(1)
        for _ in range(3):
            res[(k, "noop")].append(run(k))
for p in ("cold", "noop"):
    o = statistics.median(res[("old", p)]); n = statistics.median(res[("new", p)])
    print(f"{p}: old {o*1000:.0f} ms, new {n*1000:.0f} ms, new/old {n/o:.2f}  (old {[round(x*1000) for x in res[('old',p)]]}, new {[round(x*1000) for x in res[('new',p)]]})")
