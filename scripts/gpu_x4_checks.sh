#!/usr/bin/env bash
# The GPU checks of issues 43 / 44 / 47 that need no vLLM, on a 4-GPU H100 / H200 machine, in one
# device call (after scripts/gpu_vllm.sh or gpu_moe_ep.sh installed megatron-core in /tmp/site):
#   1. Megatron EP 1 / 2 / 4 of the Qwen3-MoE-shaped model (rl_engine.harness.ep_check, NCCL);
#   2. at once, on separate GPUs: the TP exchange self-check at TP 2 (GPUs 0-1), the CUDA C++
#      det_gemm GPU tests (GPU 2, build/csrc carried), the TP Triton tests (GPU 3);
#   3. the TP exchange self-check at TP 4, then benchmarks/bench_tp_exchange.py --quick.
# Logs and JSON under $OUT; a short table last. Each part has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/vllm_site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
MODEL=/tmp/ep_qwen3_moe
[ -f $MODEL/config.json ] || $PY -c "from rl_engine.testing.tiny_models import make_tiny_model as m; m('$MODEL', arch='qwen3_moe', dtype='bfloat16', seed=0, initializer_range=0.02, num_hidden_layers=4, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, vocab_size=32768, max_position_embeddings=2048)"
declare -A rc
timeout "${T_MEGATRON:-150}" $PY -m rl_engine.harness.ep_check --model $MODEL --ep 1,2,4 \
  --device cuda --dtype bfloat16 > "$OUT/megatron_ep.log" 2>&1; rc[megatron_ep]=$?
CUDA_VISIBLE_DEVICES=0,1 timeout "${T_PAR:-200}" $PY -m torch.distributed.run --standalone \
  --nproc-per-node 2 -m rl_engine.harness.tp_exchange_check --out "$OUT" > "$OUT/tp2.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=2 SKIP_BENCH=1 OUT="$OUT/csrc" timeout "${T_PAR:-200}" bash scripts/gpu_csrc.sh \
  > "$OUT/csrc.log" 2>&1 &
p2=$!
CUDA_VISIBLE_DEVICES=3 timeout "${T_PAR:-200}" $PY -m pytest -q -p no:logging \
  tests/ops/test_det_gemm_tp_triton.py tests/ops/test_det_gemm_tp.py > "$OUT/tp_tests.log" 2>&1 &
p3=$!
wait $p1; rc[tp2_check]=$?; wait $p2; rc[csrc_tests]=$?; wait $p3; rc[tp_tests]=$?
timeout "${T_TP4:-150}" $PY -m torch.distributed.run --standalone --nproc-per-node 4 \
  -m rl_engine.harness.tp_exchange_check --out "$OUT" > "$OUT/tp4.log" 2>&1; rc[tp4_check]=$?
timeout "${T_BENCH:-120}" $PY benchmarks/bench_tp_exchange.py --quick --out "$OUT/bench" \
  > "$OUT/bench_tp_exchange.log" 2>&1; rc[bench_tp_exchange]=$?
for f in megatron_ep tp2 csrc tp_tests tp4 bench_tp_exchange; do
  echo "== $f"; grep -v "^INFO\|^WARNING\|UserWarning\|warnings.warn" "$OUT/$f.log" | tail -8
done
echo; for k in megatron_ep tp2_check csrc_tests tp_tests tp4_check bench_tp_exchange; do
  printf '%-18s exit %s\n' "$k" "${rc[$k]}"; done
