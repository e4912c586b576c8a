#!/usr/bin/env bash
# The single-op benchmarks on one H100 / H200, in one device call: benchmarks/bench_<op>.py for
# each op of BENCHES (in that order), one after the other on the same GPU (never two at once),
# each under its own timeout, until BUDGET seconds of the call are spent (the ops left are
# named as not run). The device returns at most 8 files from $OUT: each op's <op>.json lands
# there, everything else (<op>.log, <op>.png, limits.json, env.txt, steps.txt) in
# $OUT/op_benches.tgz; the table of steps last on stdout.
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
WORK="$OUT/work"  # the benchmarks write here; packed into $OUT at the end
mkdir -p "$WORK"
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
  | tee "$WORK/env.txt"
: > "$WORK/steps.txt"
for op in $BENCHES; do
  script="benchmarks/bench_$op.py"
  if [ ! -f "$script" ]; then
    echo "$op: no $script" | tee -a "$WORK/steps.txt"
    continue
  fi
  left=$((BUDGET - ($(date +%s) - start)))
  limit=${STEP_TIMEOUT:-150}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "$op: not run (the call's budget of ${BUDGET}s is spent)" | tee -a "$WORK/steps.txt"
    continue
  fi
  var="BENCH_ARGS_$op"
  echo "== $op ${!var:-} (limit ${limit}s, $(date -u +%H:%M:%SZ))"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  run_group "$limit" "$WORK/$op.log" $PY "$script" --out "$WORK" ${!var:-} > /dev/null
  rc=$?
  echo "$op: exit $rc in $(($(date +%s) - t0))s" | tee -a "$WORK/steps.txt"
done
for op in $BENCHES; do
  if [ -f "$WORK/$op.json" ]; then cp "$WORK/$op.json" "$OUT/"; fi
done
tar czf "$OUT/op_benches.tgz" -C "$WORK" .
echo
cat "$WORK/steps.txt"
rm -rf "$WORK"
