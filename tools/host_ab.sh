#!/usr/bin/env bash
# Host-time A/B on the GPU machine: the demo's eager timing and the rewritten forward's host
# profile, for a base tree (unpacked beside this one, e.g. `git archive BASE | tar -x -C ab_base`)
# and this tree, alternating runs so both see the same machine:
#   bash tools/host_ab.sh ab_base [rounds]
set -u -o pipefail
base=${1:?usage: bash tools/host_ab.sh BASE_DIR [rounds]}
rounds=${2:-3}
export PYTHONUNBUFFERED=1 FXKERN_CACHE_DIR=${FXKERN_CACHE_DIR:-/tmp/fxkern-gpu-cache}
for tree in "$base" .; do  # warm the kernel cache for both trees
  (cd "$tree" && PYTHONPATH=$PWD python3 -m fxkern demo --no-compile --size tiny >/dev/null 2>&1)
done
for i in $(seq "$rounds"); do
  for tree in "$base" .; do
    echo "== round $i: $tree"
    (cd "$tree" && PYTHONPATH=$PWD python3 -m fxkern demo --no-compile 2>&1 | grep -E "^eager")
  done
done
for tree in "$base" .; do
  echo "== host profile: $tree"
  (cd "$tree" && PYTHONPATH=$PWD python3 benchmarks/host_profile.py --model 2>&1 | grep -v Warning | sed -n 1,40p)
done
