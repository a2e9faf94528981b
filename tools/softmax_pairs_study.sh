#!/usr/bin/env bash
# The 16-bit softmax kernels' pair arithmetic in device calls (2026-11-25). PART=1: how bfloat16
# tanh through the SFU compares with eager (tools/tanh_bf16.py), the softmax kernels' GPU tests, and
# softcap_tuning for the pair variants against the float ones they replace. PART=2: the soft-capped
# and masked GPU tests, the write pass's exp2 variant in softcap_tuning and masked_tuning, and the
# library's softmax rows. TESTS=0 leaves out the tests (and tanh_bf16). Results under $OUT (or ./gpu-out).
source "$(dirname "$0")/device_env.sh"
if [[ ${PART:-1} == 1 ]]; then
  [[ ${TESTS:-1} == 1 ]] && python3 tools/tanh_bf16.py
  [[ ${TESTS:-1} == 1 ]] && python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k softmax 2>&1 | tail -8
  python3 benchmarks/softcap_tuning.py --rounds 3 --only pairs --only bf16x2 --only "float prologue" \
      --section-out "$OUT/softcap_tuning.md" 2>&1 | tail -25
fi
if [[ ${PART:-1} == 2 ]]; then
  [[ ${TESTS:-1} == 1 ]] && python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py -k "softcap or masked" 2>&1 | tail -8
  python3 benchmarks/softcap_tuning.py --rounds 3 --only "16-bit write" --only "float prologue" \
      --section-out "$OUT/softcap_tuning.md" 2>&1 | tail -12
  python3 benchmarks/masked_tuning.py --rounds 3 --only "16-bit write" --section-out "$OUT/masked_tuning.md" 2>&1 | tail -12
  python3 benchmarks/library.py --rounds 3 --only softmax --section-out "$OUT/library_softmax.md" 2>&1 | tail -25
fi
