#!/usr/bin/env bash
# The masked softmax's study in one device call: Nsight Compute on fxkern's masked kernel, the plain
# softmax on the same scores and inductor's masked kernel (tools/ncu_softmax.py) at the library
# benchmark's shapes, then benchmarks/masked_tuning.py for the variants named by ONLY (substrings of
# their labels, comma-separated; empty: all). Results under $OUT (or ./gpu-out):
#   ONLY="hints,memory order" bash tools/masked_study.sh
# NCU=0 leaves out Nsight Compute; LIBRARY=1 adds the library benchmark's masked rows, measured
# against the device-to-device copy; SOFTCAP=1 runs softcap_tuning.py for the same ONLY after it.
# VARIANT=TEXT adds masked_tuning.py's variant whose label contains TEXT to the Nsight Compute runs.
source "$(dirname "$0")/device_env.sh"
cases=("bfloat16 8x32x512" "bfloat16 2x16x2048" "float32 2x16x2048" "float32 8x32x512")
[[ ${NCU:-1} == 0 ]] && cases=()
for case in "${cases[@]}"; do
  set -- $case
  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats \
      python3 tools/ncu_softmax.py --dtype "$1" --shape "$2" ${VARIANT:+--variant "$VARIANT"} > "$OUT/ncu_$1_$2.txt" 2>&1
  echo "== ncu $1 $2 (rc $?)"
  grep -E "^  [a-z_]+.*\(|Stall|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Theoretical Occupancy|Block Limit Reg" "$OUT/ncu_$1_$2.txt"
done
only=()
IFS=, read -ra parts <<< "${ONLY:-}"
for p in "${parts[@]}"; do only+=(--only "$p"); done
python3 benchmarks/masked_tuning.py --rounds 3 "${only[@]}" --section-out "$OUT/masked_tuning.md" 2>&1 | tail -30
if [[ ${SOFTCAP:-0} == 1 ]]; then
  python3 benchmarks/softcap_tuning.py --rounds 3 "${only[@]}" --section-out "$OUT/softcap_tuning.md" 2>&1 | tail -30
fi
if [[ ${LIBRARY:-0} == 1 ]]; then
  python3 benchmarks/library.py --rounds 3 --only masked --section-out "$OUT/library_masked.md" 2>&1 | tail -12
fi
