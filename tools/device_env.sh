# Sourced by the device study scripts (tools/*_study.sh): results under $OUT (or ./gpu-out), the
# project in place on PYTHONPATH, one kernel cache for the machine, and the GPUs it has.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FXKERN_CACHE_DIR=${FXKERN_CACHE_DIR:-/tmp/fxkern-gpu-cache}
nvidia-smi -L
