#!/usr/bin/env bash
# Issue 44 items 1, 2, 5 on a machine with 2+ GPUs (NCCL, symmetric memory; not run on a GPU yet):
#   1. rl_engine.harness.tp_exchange_check under torchrun at TP 2 (and TP 4 with 4+ GPUs): the
#      one-launch subtree == per-group launches, one-shot exchange == NCCL exchange == TP 1 (CUDA
#      graphs too), a down_proj layer == TP 1; timings by message size -> $OUT/tp_exchange_check_tp<t>.json
#   2. benchmarks/bench_tp_exchange.py (every power-of-two degree up to the GPU count) with the
#      one-shot rows -> $OUT/bench/tp_exchange.json (+ .png)
# Usage (the package on PYTHONPATH or installed): OUT=/tmp/out bash scripts/gpu_tp_exchange.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/bench"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 2 ] || { echo "need 2+ GPUs, $NGPU visible"; exit 2; }
status=0
for t in 2 4; do
  [ "$t" -le "$NGPU" ] || continue
  echo "-- tp_exchange_check, TP $t"
  timeout "${STEP_TIMEOUT:-540}" $PY -m torch.distributed.run --standalone --nproc-per-node "$t" \
    -m rl_engine.harness.tp_exchange_check --out "$OUT" "$@" || status=1
done
echo "-- bench_tp_exchange"
timeout "${STEP_TIMEOUT:-540}" $PY benchmarks/bench_tp_exchange.py --out "$OUT/bench" "$@" || status=1
exit $status
