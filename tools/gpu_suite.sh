#!/usr/bin/env bash
# The whole GPU suite in one device call: tests (CPU and GPU), the examples on CUDA,
# and the benchmarks. Run from the repository root on the GPU machine:
#   bash tools/gpu_suite.sh            (results under $OUT, or ./gpu-out without it)
#   FXKERN_SUITE="tests" bash tools/gpu_suite.sh    (only some parts: tests examples demo bench multi long-rows edges-tests odd-rows sink-rows f32-rows;
#                                                    tests-gpu and tests-rest split the tests in two calls;
#                                                    three with tests-models and FXKERN_SPLIT_MODELS=1 on tests-rest)
# "multi" needs two GPUs (the nvidia-h200-x2 kind): torchrun over the demo's rewritten model.
# The project is used in place (PYTHONPATH), with the machine's own torch and CUDA packages.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
export FXKERN_CACHE_DIR=${FXKERN_CACHE_DIR:-/tmp/fxkern-gpu-cache}
parts=${FXKERN_SUITE:-"tests examples demo bench"}
status=0

nvidia-smi -L
python3 - <<'PY'
import importlib.metadata as md, torch
names = ["torch", "cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "triton", "transformers"]
vers = {}
for n in names:
    try:
        vers[n] = md.version(n)
    except md.PackageNotFoundError:
        vers[n] = "-"
print("versions:", vers, "| cuda devices:", torch.cuda.device_count())
PY

# The whole suite took 554 s on a slow host, near a device call's 600 s: "tests-gpu" and "tests-rest"
# split it in two calls (the GPU-heavy files, then the others), "tests" runs it whole. By 2026-11-27 the
# others took 580 s on an H200 (the library's tests export a dozen transformers models on the host's
# CPU): "tests-models" runs those two files on their own, and "tests-rest" then leaves them out too.
GPU_FILES="tests/test_library_gpu.py tests/test_gpu.py tests/test_ops.py tests/test_tensorrt_replay.py
  tests/test_compiler.py tests/test_region.py tests/test_rewrite.py tests/test_tensorrt.py tests/test_multi_gpu.py"
MODEL_FILES="tests/test_library.py tests/test_hf_models.py"
selection=""
if [[ " $parts " == *" tests-gpu "* ]]; then
  selection=$GPU_FILES
elif [[ " $parts " == *" tests-models "* ]]; then
  selection=$MODEL_FILES
elif [[ " $parts " == *" tests-rest "* ]]; then
  # without tests-models in the same call's plan, the model files stay in (the two-call split)
  rest=$GPU_FILES
  [[ ${FXKERN_SPLIT_MODELS:-0} == 1 ]] && rest="$rest $MODEL_FILES"
  selection="tests $(for f in $rest; do printf -- '--ignore=%s ' "$f"; done)"
elif [[ " $parts " == *" tests "* ]]; then
  selection=tests
fi
if [[ -n $selection ]]; then
  # shellcheck disable=SC2086  # the selection is a list of paths and options
  python3 -m pytest $selection -q -p no:cacheprovider --junitxml="$OUT/junit.xml" ${FXKERN_PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" || status=1
fi
if [[ $parts == *examples* ]]; then
  python3 examples/seven_cases.py --device cuda 2>&1 | tee "$OUT/examples.log" || status=1
  python3 examples/llama_rmsnorm.py --device cuda 2>&1 | tee -a "$OUT/examples.log" || status=1
fi
if [[ $parts == *demo* ]]; then
  python3 -m fxkern demo 2>&1 | tee "$OUT/demo.log" || status=1
  python3 -m fxkern demo --dtype float32 --no-compile 2>&1 | tee -a "$OUT/demo.log" || status=1
fi
if [[ $parts == *multi* ]]; then
  FXKERN_CACHE_DIR=$(mktemp -d) python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
    examples/ddp_demo.py --size small 2>&1 | tee "$OUT/multi.log" || status=1
fi
if [[ $parts == *bench* ]]; then
  python3 benchmarks/library.py --section-out "$OUT/library.md" 2>&1 | tee "$OUT/library.log" || status=1
  python3 benchmarks/demo_model.py --profile --section-out "$OUT/demo_model.md" 2>&1 | tee "$OUT/demo_model.log" || status=1
  python3 benchmarks/row_tuning.py --section-out "$OUT/row_tuning.md" 2>&1 | tee "$OUT/row_tuning.log" || status=1
  python3 benchmarks/ew_tuning.py --section-out "$OUT/ew_tuning.md" 2>&1 | tee "$OUT/ew_tuning.log" || status=1
  python3 benchmarks/kernel_ops.py --section-out "$OUT/kernel_ops.md" 2>&1 | tee "$OUT/bench.log" || status=1
  python3 benchmarks/compile_backend.py --section-out "$OUT/compile_backend.md" 2>&1 | tee -a "$OUT/bench.log" || status=1
  python3 benchmarks/past_int32.py --section-out "$OUT/past_int32.md" 2>&1 | tee -a "$OUT/bench.log" || status=1
fi
if [[ $parts == *long-rows* ]]; then
  # rows past 2048 keys: the scaled, masked kernel's long-row grids against the ones shipped before,
  # at the 8192-key pieces fxkern.split cuts a 1x32x8192x8192 call into and at 4096 and 16384 keys;
  # the library's 8192-key rows; the calls past 2^31 elements themselves. Each bounded in time.
  timeout 200 python3 benchmarks/masked_tuning.py --rounds 2 --shape 2,16,4096 --shape 1,16,8192 --shape 1,4,16384 \
    --only "until 2026-11-28" --section-out "$OUT/masked_long.md" > "$OUT/masked_long.log" 2>&1 || status=1
  timeout 150 python3 benchmarks/library.py --rounds 3 --only 8192 --section-out "$OUT/library_8192.md" \
    > "$OUT/library_8192.log" 2>&1 || status=1
  timeout 120 python3 benchmarks/past_int32.py --rounds 3 --section-out "$OUT/past_int32.md" > "$OUT/past_int32.log" 2>&1 || status=1
fi
if [[ $parts == *edges-tests* ]]; then
  # the GPU tests of the softmax kernels' grids and rows only (the EDGES kernels among them): a change to
  # the row code checked in about a minute, before its timing (odd-rows) in the same call
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_library_gpu.py \
    -k "edges or every_grid or special_values or unscaled or several_rows or expanded" > "$OUT/edges_tests.log" 2>&1 \
    || status=1
  tail -1 "$OUT/edges_tests.log"
  grep -E "^(FAILED|ERROR)" "$OUT/edges_tests.log" | head -20
fi

if [[ $parts == *odd-rows* ]]; then
  # attention rows of an odd length (not whole 16-byte packs): the EDGES kernels against the scalar path
  # they took until 2026-11-28 (4 and 16 scalars a thread), and the library's odd-length rows (masked, sink,
  # soft-capped and plain softmax). FXKERN_ODD_ONLY: the masked variants to time (masked_tuning's --only).
  timeout 200 python3 benchmarks/masked_tuning.py --rounds 2 --shape 4,32,1001 --shape 1,32,4001 \
    --only "${FXKERN_ODD_ONLY:-rows not in whole packs}" --section-out "$OUT/masked_odd.md" > "$OUT/masked_odd.log" 2>&1 || status=1
  timeout 150 python3 benchmarks/softcap_tuning.py --rounds 2 --shape 4,16,1001 --only "rows not in whole packs" \
    --section-out "$OUT/softcap_odd.md" > "$OUT/softcap_odd.log" 2>&1 || status=1
  timeout 300 python3 benchmarks/library.py --rounds 3 --only "odd length" --section-out "$OUT/library_odd.md" \
    > "$OUT/library_odd.log" 2>&1 || status=1
fi
if [[ $parts == *f32-rows* ]]; then
  # float32 rows of 8192 keys in 512- and 1024-thread blocks (twice the warps an SM of "_32bit"'s), the
  # soft-capped kernel first (53% of copy there, level with inductor), then the masked one
  timeout 150 python3 benchmarks/softcap_tuning.py --rounds 2 --shape 1,16,8192 --only "float32 rows of 8192" \
    --section-out "$OUT/softcap_f32.md" > "$OUT/softcap_f32.log" 2>&1 || status=1
  timeout 150 python3 benchmarks/masked_tuning.py --rounds 2 --shape 1,16,8192 --only "float32 rows of 8192" \
    --section-out "$OUT/masked_f32.md" > "$OUT/masked_f32.log" 2>&1 || status=1
fi
if [[ $parts == *sink-rows* ]]; then
  # GPT-OSS's attention with sinks at 8192 and 1001 keys against the scaled, masked kernel's tuning
  timeout 240 python3 benchmarks/sink_tuning.py --rounds 2 --section-out "$OUT/sink.md" > "$OUT/sink.log" 2>&1 || status=1
fi

echo "gpu suite exit status: $status"
exit $status
