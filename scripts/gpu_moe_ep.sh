#!/usr/bin/env bash
# Expert-parallel degree invariance of a Qwen3-MoE-shaped model on GPUs (issue 43), NCCL, CUDA
# graphs on:
#   * vLLM at TP t with enable_expert_parallel (EP = t) == TP 1 == the HF trainer, bitwise
#     (rl_engine.harness.vllm_tp_check --ep), with the stock control (plugin off: TP t + EP vs 1);
#   * the Megatron trainer, EP 1 vs EP 2 (and 4) (rl_engine.harness.ep_check); with
#     MEGATRON_TP=t (and MEGATRON_ETP=e, default t) every EP degree at TP t / ETP e against
#     TP 1 EP 1, plus the plain-partial-sum control (expected to differ). Ranks: t x the
#     largest EP degree x ETP / t (at least t), e.g. MEGATRON_TP=2 MEGATRON_EP=1,2: 4 GPUs.
# Needs CUDA vLLM 0.24 with its MoE kernels (the --moe payload, for the stock control) in
# /tmp/vllm_site and megatron-core in /tmp/site (scripts/gpu_vllm.sh installs both).
#   EP_DEGREES="2" MEGATRON_EP=1,2 OUT=/tmp/out bash scripts/gpu_moe_ep.sh
#   EP_DEGREES="" MEGATRON_TP=2 MEGATRON_EP=1,2 OUT=/tmp/out bash scripts/gpu_moe_ep.sh  (Megatron only)
# FIRST_GPU=2 starts the vLLM check at GPU 2 (another job on GPUs 0-1).
# CONTROL=0 skips the stock rollouts; VLLM_ARGS adds arguments to vllm_tp_check (bisection:
#   VLLM_ARGS="--variant per-group:RL_ENGINE_TP_SUBTREE=per-group --variant eager:enforce_eager=True").
# The vLLM check of the first degree runs on GPUs 0..t-1 while the Megatron check runs on the
# next GPUs (4 GPUs: vLLM TP 2 on 0-1, Megatron EP 1,2 on 2-3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/vllm_site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
unset TRITON_INTERPRET
MODEL=/tmp/ep_qwen3_moe
# Qwen3-30B-A3B widths, 4 layers, 64 experts top-8, a 32k vocabulary (the shape the check needs,
# smaller to load); every TP-sharded size splits into the 8 groups of the TP reduction
[ -f $MODEL/config.json ] || $PY -c "from rl_engine.testing.tiny_models import make_tiny_model as m; m('$MODEL', arch='qwen3_moe', dtype='bfloat16', seed=0, initializer_range=0.02, num_hidden_layers=4, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, vocab_size=32768, max_position_embeddings=2048)" || exit 2
CTRL=--control
[ "${CONTROL:-1}" = 0 ] && CTRL=""
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
status=0
pids=()
first=1
MTP=${MEGATRON_TP:-1}
MARGS=""
[ "$MTP" -gt 1 ] && MARGS="--tp $MTP ${MEGATRON_ETP:+--etp $MEGATRON_ETP} --control"
# the Megatron check's ranks: TP x DP, DP = ETP x EP / TP when whole (ep_check.layout)
megatron_ranks() {
  local need=$1 etp=${MEGATRON_ETP:-$MTP} dp=1
  [ $(((etp * need) % MTP)) = 0 ] && dp=$((etp * need / MTP))
  [ "$dp" -lt 1 ] && dp=1
  echo $((MTP * dp))
}
if [ -z "${EP_DEGREES-2}" ] && [ -n "${MEGATRON_EP:-}" ]; then  # the Megatron check alone
  need=$(megatron_ranks "$(echo "$MEGATRON_EP" | tr , '\n' | sort -n | tail -1)")
  mdevs=$(seq -s, 0 $((need - 1)))
  echo "-- Megatron EP $MEGATRON_EP (TP $MTP) on GPUs $mdevs"
  CUDA_VISIBLE_DEVICES=$mdevs timeout "${STEP_TIMEOUT:-540}" $PY -m rl_engine.harness.ep_check \
    --model $MODEL --ep "$MEGATRON_EP" $MARGS --device cuda --dtype bfloat16 > "$OUT/megatron_ep.log" 2>&1 || status=1
fi
for t in ${EP_DEGREES-2}; do
  devs=$(seq -s, "${FIRST_GPU:-0}" $((${FIRST_GPU:-0} + t - 1)))
  echo "-- vLLM TP $t + EP on GPUs $devs"
  CUDA_VISIBLE_DEVICES=$devs timeout "${STEP_TIMEOUT:-540}" $PY -m rl_engine.harness.vllm_tp_check \
    --model $MODEL --tp "$t" --ep $CTRL ${VLLM_ARGS:-} --json "$OUT/vllm_ep$t.json" > "$OUT/vllm_ep$t.log" 2>&1 &
  pids+=($!)
  if [ "$first" = 1 ] && [ -n "${MEGATRON_EP:-}" ]; then
    first=0
    need=$(megatron_ranks "$(echo "$MEGATRON_EP" | tr , '\n' | sort -n | tail -1)")
    if [ $((t + need)) -le "$NGPU" ]; then
      mdevs=$(seq -s, "$t" $((t + need - 1)))
      echo "-- Megatron EP $MEGATRON_EP (TP $MTP) on GPUs $mdevs"
      CUDA_VISIBLE_DEVICES=$mdevs timeout "${STEP_TIMEOUT:-540}" $PY -m rl_engine.harness.ep_check \
        --model $MODEL --ep "$MEGATRON_EP" $MARGS --device cuda --dtype bfloat16 > "$OUT/megatron_ep.log" 2>&1 &
      pids+=($!)
    else
      echo "-- Megatron EP $MEGATRON_EP: not enough GPUs beside vLLM ($NGPU)"
    fi
  fi
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  pids=()
done
for f in "$OUT"/vllm_ep*.log "$OUT"/megatron_ep.log; do
  [ -f "$f" ] && { echo "== $f"; grep -v "^INFO\|^WARNING\|^(EngineCore\|^\[W\|warnings.warn\|UserWarning" "$f" | tail -15; }
done
exit $status
