#!/usr/bin/env bash
# The GPU suite's two halves side by side on a two-GPU machine (the nvidia-h200-x2 kind), in one device
# call of about the longer half's time rather than two calls one after another:
#   GPU 0: the GPU-heavy test files, the backend/views/split tests and the demo (gpu_suite.sh "tests-gpu demo")
#   GPU 1: the other tests and the examples ("tests-rest examples"; the model files stay out, as
#          FXKERN_SPLIT_MODELS=1 leaves them: run "tests-models" in a call of its own)
# Each half writes under $OUT/g0 and $OUT/g1; the summary lines are printed at the end. On 2026-11-28 the
# first half took 423 s on GPU 0 of an H200 pair. The multi-GPU test skips (each half sees one GPU).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT/g0" "$OUT/g1"
export FXKERN_CACHE_DIR=${FXKERN_CACHE_DIR:-/tmp/fxkern-gpu-cache}  # shared: each kernel compiles once
first="tests/test_backend.py tests/test_views.py tests/test_split.py"
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 FXKERN_SUITE="tests-gpu demo" FXKERN_PYTEST_ARGS="$first" \
  bash "$here/gpu_suite.sh" > "$OUT/g0/suite.log" 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 FXKERN_SUITE="tests-rest examples" FXKERN_SPLIT_MODELS=1 \
  FXKERN_PYTEST_ARGS="$(for f in $first; do printf -- '--ignore=%s ' "$f"; done)" \
  bash "$here/gpu_suite.sh" > "$OUT/g1/suite.log" 2>&1
s1=$?
wait $p0
s0=$?
for g in g0 g1; do
  echo "== $g: $(tail -1 "$OUT/$g/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/$g/pytest.log" | head -20
done
grep -E "ok in|^eager|^torch.compile|^CUDA" "$OUT/g0/demo.log"
tail -1 "$OUT/g1/examples.log"
echo "gpu suite x2 exit status: $s0 $s1"
exit $((s0 || s1))
