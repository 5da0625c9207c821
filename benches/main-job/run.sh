#!/usr/bin/env bash
# The CPU main job from an empty workdir, its stages' times, and the floor of its training's
# matrix products (floor.py) on the same machine right after.
#
#   benches/main-job/run.sh WORKDIR [ROUNDS]
#
# MFLOW (default: mflow on PATH) runs specs/gpt-tp2.toml; MFLOW_PYTHON (default: the Python
# environment mflow provisions, as `mflow env` prints it) runs floor.py.
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
    "$mflow" status --workdir "$dir"
done

python=${MFLOW_PYTHON:-$("$mflow" env)}
shards=$("$mflow" output "$repo/specs/gpt-tp2.toml" convert --set "pipeline.workdir=\"$work/round-1\"")
"$python" "$here/floor.py" "$shards"
