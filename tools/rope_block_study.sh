#!/usr/bin/env bash
# The rotary kernels' blocks and stores in one device call. Default: the rotary GPU tests,
# rope_tuning's shipped kernel (4096 elements a block, repeats in rotary_strided_repeat) against
# 2048 a block and against repeats stored as any other, and the library benchmark's RoPE rows.
# REPEAT=1: rope_tuning's repeat_kv variants (repeats stored as any other, two packs a thread when
# repeating), the rotary GPU tests and the library's repeat_kv rows. REPEAT=2: every
# norm_rope_tuning variant (rows a thread group and elements a block were chosen on an H100) and
# the norm+rotary GPU tests. LAYOUT=1: the results in eager's layout against contiguous ones
# (rope_tuning and norm_rope_tuning), the rotary and norm+rotary GPU tests, and the library's RoPE
# rows. Results under $OUT (or ./gpu-out).
source "$(dirname "$0")/device_env.sh"
if [[ ${LAYOUT:-0} == 1 ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "rotary or repeat_kv" 2>&1 | tail -4
  python3 benchmarks/rope_tuning.py --rounds 3 --only 'contiguous results' --section-out "$OUT/rope_layout.md" 2>&1 | tail -8
  python3 benchmarks/norm_rope_tuning.py --rounds 3 --only 'contiguous results' --section-out "$OUT/norm_rope_layout.md" 2>&1 | tail -8
  python3 benchmarks/library.py --rounds 3 --only RoPE --section-out "$OUT/library_rope.md" 2>&1 | grep -v "^|" | tail -16
  exit
fi
if [[ ${REPEAT:-0} == 2 ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "norm_rotary" 2>&1 | tail -2
  python3 benchmarks/norm_rope_tuning.py --rounds 3 --section-out "$OUT/norm_rope_tuning.md" 2>&1 | tail -10
  exit
fi
if [[ ${REPEAT:-0} == 1 ]]; then
  python3 benchmarks/rope_tuning.py --rounds 3 --only 'stored as any other' --only repeating --section-out "$OUT/rope_repeat.md" 2>&1 | tail -8
  python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "rotary or repeat_kv" 2>&1 | tail -3
  python3 benchmarks/library.py --rounds 3 --only repeat_kv --section-out "$OUT/library_repeat.md" 2>&1 | tail -6
  exit
fi
python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "rotary or repeat_kv" 2>&1 | tail -6
python3 benchmarks/rope_tuning.py --rounds 3 --only 2048 --only 'stored as any other' --section-out "$OUT/rope_tuning.md" 2>&1 | tail -8
python3 benchmarks/library.py --rounds 3 --only RoPE --section-out "$OUT/library_rope.md" 2>&1 | grep -v "^|" | tail -16
