#!/usr/bin/env python3
"""Time mflow against a plain shell script, make, ninja, Snakemake and DVC on the DAGs that
gen.py writes, side by side in one invocation (engines alternate within every repetition).

usage: measure.py WORK_DIR RESULTS_JSON
environment: MFLOW (binary, required), SNAKEMAKE, DVC (optional executables), SHAPES
(default "chain fan random tree"; chain5k fan5k random5k tree5k are the same kinds of DAG at about
5,000 stages), REPS (default 3), NOOP_REPS (no-op reruns, default REPS), SLOW_COLD_REPS (Snakemake cold runs of every
shape but the chain, default 1), DVC_TIMEOUT (seconds per DVC command, default 300).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MFLOW = os.environ["MFLOW"]
SNAKEMAKE = os.environ.get("SNAKEMAKE")
DVC = os.environ.get("DVC")
SHAPES = os.environ.get("SHAPES", "chain fan random tree").split()
REPS = int(os.environ.get("REPS", "3"))
NOOP_REPS = int(os.environ.get("NOOP_REPS", str(REPS)))  # no-op reruns: cheap, and the noisiest
SLOW_COLD_REPS = int(os.environ.get("SLOW_COLD_REPS", "1"))
DVC_TIMEOUT = int(os.environ.get("DVC_TIMEOUT", "300"))

# engine -> (run argv, plan argv or None, state paths removed before a cold run)
ENGINES = {
    "shell": (["sh", "run.sh"], None, ["out", "exec.log"]),
    "mflow": ([MFLOW, "run", "mflow.toml", "--jobs", "2"], [MFLOW, "plan", "mflow.toml"], [".mflow", "exec.log"]),
    "make": (["make", "-j2", "-s"], ["make", "-n"], ["out", "exec.log"]),
    "ninja": (["ninja", "-j2"], ["ninja", "-n"], ["out", "exec.log", ".ninja_log", ".ninja_deps"]),
}
if SNAKEMAKE:
    ENGINES["snakemake"] = ([SNAKEMAKE, "--cores", "2", "--quiet"], [SNAKEMAKE, "-n", "--cores", "2"],
                            ["out", "exec.log", ".snakemake"])
if DVC:
    ENGINES["dvc"] = ([DVC, "repro"], [DVC, "status"], None)  # cold: a fresh project each time


def executed(ws):
    p = os.path.join(ws, "exec.log")
    return sum(1 for _ in open(p)) if os.path.exists(p) else 0


def timed(ws, argv, log, timeout=None):
    """Run argv in ws; return wall seconds, peak RSS (MiB) of the largest process, exit code."""
    rss_file = os.path.join(ws, ".peak-rss")
    t0 = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        try:
            rc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_file] + argv, cwd=ws, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return time.perf_counter() - t0, None, "timeout"
    wall = time.perf_counter() - t0
    try:
        rss = int(open(rss_file).read().split()[-1]) / 1024
    except (OSError, ValueError, IndexError):
        rss = None
    return wall, rss, rc


def fresh(shape, ws, engine):
    if os.path.exists(ws):
        shutil.rmtree(ws)
    subprocess.run([sys.executable, os.path.join(HERE, "gen.py"), shape, ws] + (["--dvc"] if engine == "dvc" else []),
                   check=True)
    if engine == "dvc":
        env = dict(os.environ, DVC_NO_ANALYTICS="1")
        for argv in (["git", "init", "-q"], [DVC, "init", "-q"], [DVC, "config", "core.analytics", "false"],
                     ["git", "add", "-A"], ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init"]):
            subprocess.run(argv, cwd=ws, check=True, env=env, stdout=subprocess.DEVNULL)


def clean(ws, engine):
    for p in ENGINES[engine][2]:
        p = os.path.join(ws, p)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def main():
    work, results_path = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    results = []

    def record(shape, engine, phase, wall, rss, rc, ran, expected):
        results.append({"shape": shape, "engine": engine, "phase": phase, "wall_s": wall, "rss_mib": rss,
                        "rc": rc, "executed": ran, "expected": expected})
        print(f"{shape:7} {engine:10} {phase:7} {wall:8.3f} s  rss {rss if rss is None else round(rss, 1)} MiB"
              f"  rc {rc}  ran {ran}/{expected}", flush=True)

    for shape in SHAPES:
        engines = [e for e in ENGINES if e != "dvc" or shape == "chain"]
        ws = {e: os.path.join(work, shape, e) for e in engines}
        log = {e: os.path.join(work, shape, f"{e}.log") for e in engines}
        for e in engines:
            fresh(shape, ws[e], e)
            open(log[e], "w").close()
        meta = json.load(open(os.path.join(ws["shell"], "dag.json")))
        n, mid, mid_down = meta["stages"], meta["middle"], meta["middle_downstream"]

        def cold_reps(e):
            if e == "dvc" or (e == "snakemake" and shape != "chain"):
                return min(REPS, SLOW_COLD_REPS)
            return REPS

        for rep in range(REPS):  # cold, engines alternating
            for e in engines:
                if rep >= cold_reps(e):
                    continue
                if e == "dvc":
                    fresh(shape, ws[e], e)
                else:
                    clean(ws[e], e)
                timeout = DVC_TIMEOUT if e == "dvc" else None
                w, r, rc = timed(ws[e], ENGINES[e][0], log[e], timeout)
                record(shape, e, "cold", w, r, rc, executed(ws[e]), n)
        runnable = [e for e in engines if e != "shell"]
        for e in runnable:  # warm-up: up to date before the no-op runs
            timed(ws[e], ENGINES[e][0], log[e], DVC_TIMEOUT if e == "dvc" else None)
        for phase in ("noop", "change", "plan"):
            for rep in range(NOOP_REPS if phase == "noop" else REPS):
                for e in runnable:
                    if e == "dvc" and rep >= 1:
                        continue
                    before = executed(ws[e])
                    timeout = DVC_TIMEOUT if e == "dvc" else None
                    if phase == "change":
                        with open(os.path.join(ws[e], "src", f"{mid}.txt"), "a") as f:
                            f.write(f"change {rep}\n")
                    argv = ENGINES[e][1] if phase == "plan" else ENGINES[e][0]
                    w, r, rc = timed(ws[e], argv, log[e], timeout)
                    expected = {"noop": 0, "change": mid_down, "plan": 0}[phase]
                    record(shape, e, phase, w, r, rc, executed(ws[e]) - before, expected)
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
