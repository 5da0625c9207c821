#!/usr/bin/env python3
"""Generate one DAG shape as an mflow spec, a plain shell script, a Makefile, a ninja file,
a Snakefile and (optionally) a DVC pipeline, all running the same commands.

Every stage n reads its own source file src/n.txt and the outputs of its upstream stages,
concatenates them into its output, appends its name, and appends its name to exec.log (so the
number of executed stages can be counted the same way for every engine).

usage: gen.py SHAPE DIR [--dvc]      SHAPE: chain | fan | random | tree, or the same with the
suffix 5k (chain5k, fan5k, random5k, tree5k): the same kind of DAG at about 5,000 stages.
"""
import json
import os
import random
import sys


def dag(shape):
    """Return (names, deps) with deps[name] = list of upstream names, in topological order."""
    big = shape.endswith("5k")
    if big:
        shape = shape[:-2]
    if shape == "chain":
        n = 5000 if big else 100
        deps = {0: []}
        for i in range(1, n):
            deps[i] = [i - 1]
    elif shape == "fan":
        deps = {0: []}
        w = 4998 if big else 500
        for i in range(1, w + 1):
            deps[i] = [0]
        deps[w + 1] = list(range(1, w + 1))
    elif shape == "random":
        rng = random.Random(42)
        deps = {0: []}
        for i in range(1, 5000 if big else 1000):
            k = rng.randint(1, min(3, i))
            deps[i] = sorted(rng.sample(range(i), k))
    elif shape == "tree":
        # A binary reduction tree: 512 leaves merged pairwise down to one root (1023 stages,
        # wide at the bottom, 10 levels deep). Numbered leaves first, so that every stage
        # comes after the two it reads.
        # At 5k: 4999 stages (2500 leaves), every inner stage still merging two.
        n = 4999 if big else 1023
        deps = {}
        for j in range(n):
            h = n - 1 - j  # heap index: the root is 0, the children of h are 2h+1 and 2h+2
            deps[j] = sorted(n - 1 - c for c in (2 * h + 1, 2 * h + 2) if c < n)
    else:
        raise SystemExit(f"unknown shape {shape!r}: use chain, fan, random or tree (or chain5k, ...)")
    names = {i: f"s{i:04d}" for i in deps}
    return [names[i] for i in sorted(deps)], {names[i]: [names[d] for d in ds] for i, ds in deps.items()}


def middle(shape, names):
    # The stage whose source changes in the "change one middle stage" measurement.
    return {"chain": "s0050", "fan": "s0250", "random": "s0500", "tree": "s0100",
            "chain5k": "s2500", "fan5k": "s2500", "random5k": "s2500", "tree5k": "s0500"}[shape]


def downstream(names, deps, start):
    hit = {start}
    for n in names:
        if any(d in hit for d in deps[n]):
            hit.add(n)
    return hit


def shell_cmd(n, ins, out):
    return f"cat src/{n}.txt {' '.join(ins)} > {out}; echo {n} >> {out}; echo {n} >> exec.log"


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        raise SystemExit(__doc__)
    shape, root = args
    names, deps = dag(shape)
    os.makedirs(os.path.join(root, "src"), exist_ok=True)
    for n in names:
        write(os.path.join(root, "src", f"{n}.txt"), f"source of {n}\n")
    used = {d for ds in deps.values() for d in ds}
    sinks = [n for n in names if n not in used]
    mid = middle(shape, names)
    write(os.path.join(root, "dag.json"), json.dumps({"deps": deps, "middle": mid,
          "middle_downstream": len(downstream(names, deps, mid)), "stages": len(names)}))

    # mflow
    lines = ["[pipeline]", 'name = "bench"', ""]
    for n in names:
        ins = [f"$MFLOW_INPUT_{d.upper()}/out" for d in deps[n]]
        cmd = shell_cmd(n, ins, "$MFLOW_OUTPUT/out")
        lines += [f"[stages.{n}]", 'kind = "command"', f"needs = {json.dumps(deps[n])}",
                  f'inputs = ["src/{n}.txt"]', f"run = {json.dumps(['sh', '-c', cmd])}", ""]
    write(os.path.join(root, "mflow.toml"), "\n".join(lines))

    # plain shell, serial, in topological order: the floor
    sh = ["set -e", "mkdir -p out"]
    for n in names:
        sh.append(shell_cmd(n, [f"out/{d}.txt" for d in deps[n]], f"out/{n}.txt"))
    write(os.path.join(root, "run.sh"), "\n".join(sh) + "\n")

    # GNU make
    mk = ["all: " + " ".join(f"out/{n}.txt" for n in sinks), ""]
    for n in names:
        ins = [f"out/{d}.txt" for d in deps[n]]
        mk.append(f"out/{n}.txt: src/{n}.txt {' '.join(ins)}")
        mk.append(f"\t@mkdir -p out; {shell_cmd(n, ins, '$@')}")
    write(os.path.join(root, "Makefile"), "\n".join(mk) + "\n")

    # ninja
    nj = ["rule step", "  command = $cmd", ""]
    for n in names:
        ins = [f"out/{d}.txt" for d in deps[n]]
        nj.append(f"build out/{n}.txt: step src/{n}.txt {' '.join(ins)}")
        nj.append(f"  cmd = {shell_cmd(n, ins, f'out/{n}.txt')}")
    nj.append("default " + " ".join(f"out/{n}.txt" for n in sinks))
    write(os.path.join(root, "build.ninja"), "\n".join(nj) + "\n")

    # Snakemake: one wildcard rule, deps looked up in dag.json (the idiomatic form)
    write(os.path.join(root, "Snakefile"), f'''import json
DEPS = json.load(open("dag.json"))["deps"]

rule all:
    input: {json.dumps([f"out/{n}.txt" for n in sinks])}

rule step:
    input: lambda w: ["src/" + w.n + ".txt"] + ["out/" + d + ".txt" for d in DEPS[w.n]]
    output: "out/{{n}}.txt"
    shell: "cat {{input}} > {{output}}; echo {{wildcards.n}} >> {{output}}; echo {{wildcards.n}} >> exec.log"
''')

    # DVC: one stage per node
    if "--dvc" in sys.argv:
        y = ["stages:"]
        for n in names:
            ins = [f"out/{d}.txt" for d in deps[n]]
            y.append(f"  {n}:")
            y.append(f"    cmd: mkdir -p out && {shell_cmd(n, ins, f'out/{n}.txt')}".replace("; ", " && "))
            y.append("    deps:")
            y += [f"    - {p}" for p in [f"src/{n}.txt"] + ins]
            y.append("    outs:")
            y.append(f"    - out/{n}.txt")
        write(os.path.join(root, "dvc.yaml"), "\n".join(y) + "\n")


if __name__ == "__main__":
    main()
