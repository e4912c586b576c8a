#!/usr/bin/env bash
# The single-op benchmarks on one H100 / H200, in one device call: benchmarks/bench_<op>.py for
# each op of BENCHES (in that order), one after the other on the same GPU (never two at once),
# each under its own timeout, until BUDGET seconds of the call are spent (the ops left are
# named as not run). Results (<op>.json, <op>.png, <op>.log) under $OUT, a table last.
#   BENCHES="poly_norm det_gemm rms_norm"  which ops (default: the list below)
#   BUDGET=400  STEP_TIMEOUT=150          seconds for the whole call / one op
#   BENCH_ARGS_<op>="--quick"             arguments for one op's script
# linear_logp's benchmark times Liger's fused linear cross-entropy beside it: carry .whl
# (liger-kernel) and it is installed to /tmp/site first; without it that row says why.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/_run_group.sh
. scripts/_run_group.sh
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/liger_kernel ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/liger_kernel-*.whl
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET RL_ENGINE_BACKEND
BENCHES=${BENCHES:-"poly_norm det_gemm rms_norm silu_and_mul grpo_loss linear_logp"}
BUDGET=${BUDGET:-400}
start=$(date +%s)
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
: > "$OUT/steps.txt"
for op in $BENCHES; do
  script="benchmarks/bench_$op.py"
  if [ ! -f "$script" ]; then
    echo "$op: no $script" | tee -a "$OUT/steps.txt"
    continue
  fi
  left=$((BUDGET - ($(date +%s) - start)))
  limit=${STEP_TIMEOUT:-150}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "$op: not run (the call's budget of ${BUDGET}s is spent)" | tee -a "$OUT/steps.txt"
    continue
  fi
  var="BENCH_ARGS_$op"
  echo "== $op ${!var:-} (limit ${limit}s, $(date -u +%H:%M:%SZ))"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  run_group "$limit" "$OUT/$op.log" $PY "$script" --out "$OUT" ${!var:-} > /dev/null
  rc=$?
  echo "$op: exit $rc in $(($(date +%s) - t0))s" | tee -a "$OUT/steps.txt"
done
echo
cat "$OUT/steps.txt"
