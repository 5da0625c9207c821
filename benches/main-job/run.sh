#!/usr/bin/env bash
# The CPU main job from an empty workdir, its stages' times, and the floor of its training's
# matrix products (floor.py) on the same machine right after.
#
#   benches/main-job/run.sh WORKDIR [ROUNDS]
#
# MFLOW (default: mflow on PATH) runs specs/gpt-tp2.toml; MFLOW_PYTHON (default: the Python
# environment mflow provisions, as `mflow doctor` names it) runs floor.py.
set -euo pipefail
work=${1:?usage: benches/main-job/run.sh WORKDIR [ROUNDS]}
rounds=${2:-1}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
mflow=${MFLOW:-mflow}

for round in $(seq "$rounds"); do
    dir="$work/round-$round"
    rm -rf "$dir"
    /usr/bin/time -f "round $round: wall %e s, CPU %U + %S s" \
        "$mflow" run "$repo/specs/gpt-tp2.toml" --set "pipeline.workdir=\"$dir\"" --quiet
    python3 - "$dir" <<'EOF'
import glob, json, sys
run = json.load(open(sorted(glob.glob(f"{sys.argv[1]}/runs/*/run.json"))[-1]))
print("  " + ", ".join(f"{name} {run['stages'][name]['duration_s']:.1f} s" for name in run["order"]))
EOF
done

python=${MFLOW_PYTHON:-$("$mflow" doctor | sed -n 's/^python: //p')}
shards=$(python3 - "$work/round-1" <<'EOF'
import glob, json, sys
run = json.load(open(sorted(glob.glob(f"{sys.argv[1]}/runs/*/run.json"))[-1]))
print(run["stages"]["convert"]["output"])
EOF
)
"$python" "$here/floor.py" "$shards"
