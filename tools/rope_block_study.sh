#!/usr/bin/env bash
# The rotary kernel's blocks and stores in one device call (2026-11-25). Default: the rotary GPU
# tests, rope_tuning's shipped 2048-element blocks against 4096, and the library benchmark's
# transformers rows. REPEAT=1: rope_tuning's repeat_kv variants (repeated rows stored without the
# evict-first hint, two packs a thread when repeating), the rotary GPU tests and the library's
# repeat_kv rows. REPEAT=2: norm_rope_tuning's evict-first variant (not yet run) and the norm+rotary
# GPU tests. Results under $OUT (or ./gpu-out).
source "$(dirname "$0")/device_env.sh"
if [[ ${REPEAT:-0} == 2 ]]; then
  python3 benchmarks/norm_rope_tuning.py --rounds 3 --only 'evict-first' --section-out "$OUT/norm_rope_repeat.md" 2>&1 | tail -6
  python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "norm_rotary" 2>&1 | tail -2
  exit
fi
if [[ ${REPEAT:-0} == 1 ]]; then
  python3 benchmarks/rope_tuning.py --rounds 3 --only 'stored as any other' --only repeating --section-out "$OUT/rope_repeat.md" 2>&1 | tail -8
  python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "rotary or repeat_kv" 2>&1 | tail -3
  python3 benchmarks/library.py --rounds 3 --only repeat_kv --section-out "$OUT/library_repeat.md" 2>&1 | tail -6
  exit
fi
python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "rotary or repeat_kv" 2>&1 | tail -6
python3 benchmarks/rope_tuning.py --rounds 3 --only 4096 --section-out "$OUT/rope_tuning.md" 2>&1 | tail -8
python3 benchmarks/library.py --rounds 3 --only transformers --section-out "$OUT/library_rope.md" 2>&1 | tail -14
