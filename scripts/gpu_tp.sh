#!/usr/bin/env bash
# Tensor-parallel degree invariance on a GPU machine with 2+ GPUs (issue 18), NCCL between ranks:
#   1. Megatron trainer, TP 1 vs TP 2: log-probs and every gradient shard, bitwise; the negative
#      control (the plain det_gemm reduction at TP 1) printed next to it;
#   2. the same with sequence parallelism;
#   3. FSDP2 over 2 GPUs vs one process (patched HF trainer);
#   4. with VLLM_TP=1 (CUDA vLLM importable): vLLM rollout TP 2 vs TP 1 vs the HF trainer, CUDA
#      graphs on, and stock vLLM TP 2 vs TP 1 as the control.
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
step() {
  echo "-- $*"
  timeout "${TP_STEP_TIMEOUT:-300}" "$@"
  local rc=$?
  echo "exit status: $rc"
  [ "$rc" = 0 ] || status=1
}
if [ "${VLLM_TP:-0}" = "1" ]; then
  step $PY -m rl_engine.testing.vllm_tp_check --model $MODEL --tp 2 --control --json "$OUT/vllm_tp.json"
else
  step $PY -m rl_engine.testing.tp_check --model $MODEL --tp 1,2 --device cuda --control --out /tmp/tp_out
  step $PY -m rl_engine.testing.tp_check --model $MODEL --tp 1,2 --device cuda --sequence-parallel --out /tmp/tp_out_sp
  step $PY -m rl_engine.testing.fsdp_check --model $MODEL --ranks 2 --dtype bfloat16 --device cuda
fi
exit $status
