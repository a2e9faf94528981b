#!/usr/bin/env bash
# One device call for the elementwise kernels' work: their GPU tests, the tuning sweep against
# inductor, and the library table (results under $OUT).
#   bash tools/ew_session.sh [library rounds, default 3]
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
export FXKERN_CACHE_DIR=${FXKERN_CACHE_DIR:-/tmp/fxkern-gpu-cache}
status=0
timeout 240 python3 -m pytest tests/test_library_gpu.py -q -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/pytest.log" || status=1
timeout 200 python3 benchmarks/ew_tuning.py --section-out "$OUT/ew_tuning.md" 2>&1 | grep -v Warn | tee "$OUT/ew_tuning.log" || status=1
timeout 280 python3 benchmarks/library.py --rounds "${1:-3}" --section-out "$OUT/library.md" > "$OUT/library.log" 2>&1 || status=1
grep -E "^\| (bias|gelu|SwiGLU|GEGLU)" "$OUT/library.md"
echo "ew session exit status: $status"
exit $status
