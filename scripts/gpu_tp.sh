#!/usr/bin/env bash
# Tensor-parallel degree invariance on a GPU machine with 2+ GPUs (issue 18), NCCL between ranks:
#   1. Megatron trainer, TP 1 vs TP 2 (vs 4, 8 where the GPUs are there): log-probs and every
#      gradient shard, bitwise; the negative control (the plain det_gemm reduction at TP 1)
#      printed next to it;
#   2. the same with sequence parallelism;
#   3. FSDP2 over every GPU vs one process (patched HF trainer);
#   4. with VLLM_TP=1 (CUDA vLLM importable): vLLM rollout at each TP degree > 1 vs TP 1 vs the
#      HF trainer, CUDA graphs on, and stock vLLM TP t vs TP 1 as the control.
# TP_DEGREES=1,2,4 picks the degrees (default: powers of two up to the GPU count, at most 8).
# VLLM_ARGS: more vllm_tp_check arguments (--variant NAME:KEY=VAL,...: bisection).
# Run by scripts/gpu_vllm.sh (steps tp, tp-vllm) or alone: OUT=/tmp/out bash scripts/gpu_tp.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
MODEL=/tmp/tp_qwen2
# Qwen2-shaped (QKV bias), untied (FSDP2 check), bf16; every TP-sharded size splits into 8 groups
$PY -c "from rl_engine.testing.tiny_models import make_tiny_model as m; m('$MODEL', arch='qwen2', dtype='bfloat16', seed=0, num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=64, intermediate_size=2816, vocab_size=32768)" || exit 2
status=0
# degrees: TP_DEGREES (comma separated, the first is the base) or every power of two up to the
# GPU count (1,2 on two GPUs; 1,2,4 on four; 1,2,4,8 on eight)
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ -z "${TP_DEGREES:-}" ]; then
  TP_DEGREES=1; d=2
  while [ "$d" -le "$NGPU" ] && [ "$d" -le 8 ]; do TP_DEGREES="$TP_DEGREES,$d"; d=$((d * 2)); done
fi
echo "GPUs: $NGPU; TP degrees: $TP_DEGREES"
[ "$TP_DEGREES" != 1 ] || { echo "need 2+ GPUs"; exit 2; }
step() {
  echo "-- $*"
  timeout "${TP_STEP_TIMEOUT:-300}" "$@"
  local rc=$?
  echo "exit status: $rc"
  [ "$rc" = 0 ] || status=1
}
if [ "${VLLM_TP:-0}" = "1" ]; then
  for t in ${TP_DEGREES//,/ }; do
    [ "$t" = 1 ] && continue
    # shellcheck disable=SC2086
    step $PY -m rl_engine.harness.vllm_tp_check --model $MODEL --tp "$t" --control ${VLLM_ARGS:-} --json "$OUT/vllm_tp$t.json"
  done
else
  step $PY -m rl_engine.harness.tp_check --model $MODEL --tp "$TP_DEGREES" --device cuda --control --out /tmp/tp_out
  step $PY -m rl_engine.harness.tp_check --model $MODEL --tp "$TP_DEGREES" --device cuda --sequence-parallel --out /tmp/tp_out_sp
  step $PY -m rl_engine.harness.fsdp_check --model $MODEL --ranks "$NGPU" --dtype bfloat16 --device cuda
fi
exit $status
