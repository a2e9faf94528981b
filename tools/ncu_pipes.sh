#!/usr/bin/env bash
# Which pipes the softmax kernels keep busy (the masked softmax's study, docs/benchmarks.md
# "masked_pipes_h200"): Nsight Compute's per-pipe utilisation (the XU pipe runs ex2 and tanh),
# issue-slot use and DRAM throughput for fxkern's masked, plain and soft-capped kernels and
# inductor's masked one (tools/ncu_softmax.py --softcap) at the library benchmark's shapes.
#   bash tools/ncu_pipes.sh          (results under $OUT, or ./gpu-out)
source "$(dirname "$0")/device_env.sh"
ncu --query-metrics --chip gh100 > "$OUT/metrics.txt" 2>&1
metrics=$(grep -oE "^(sm__inst_executed_pipe_[a-z0-9_]+|sm__pipe_[a-z0-9_]+_cycles_active)" "$OUT/metrics.txt" \
  | grep -E "xu|fma|alu|fp16|lsu|shared|fmaheavy" | grep -v "pred_on" | sort -u \
  | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
metrics="$metrics,sm__inst_executed.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum"
echo "metrics: $metrics"
for case in "bfloat16 8x32x512" "bfloat16 2x16x2048" "float32 2x16x2048"; do
  set -- $case
  ncu --clock-control none --profile-from-start off --metrics "$metrics" \
      python3 tools/ncu_softmax.py --softcap --dtype "$1" --shape "$2" > "$OUT/pipes_$1_$2.txt" 2>&1
  echo "== $1 $2 (rc $?)"
  grep -E "^  [a-zA-Z_]+.*\(|pipe|inst_executed|dram__|gpu__time" "$OUT/pipes_$1_$2.txt" | grep -vE " 0(\.00)?$| 0$" | sed 's/  */ /g'
done
