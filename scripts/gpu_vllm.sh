#!/usr/bin/env bash
# GPU steps that need the real CUDA vLLM (0.24.0), on an H100 / H200 device machine.
#
# vLLM travels in three back-to-back device calls (PLATFORMS.md, "GPU vLLM on the device"):
#   1. carry .vllm_gpu/0:  mkdir -p /tmp/vllm_parts && cp .vllm_gpu/0/part.0 /tmp/vllm_parts/
#   2. carry .vllm_gpu/1:  cp .vllm_gpu/1/part.1 /tmp/vllm_parts/
#   3. carry .vllm_gpu/2 .whl:  STEPS="e2e" bash scripts/gpu_vllm.sh
# A payload built with --moe (stock MoE models need vLLM's MoE kernels) has four parts: copy
# parts 0, 1 and 2 as above (three calls), then carry .vllm_gpu/3 .whl in the fourth.
# Later calls of the same warm lease reuse /tmp/vllm_site (no carry of .vllm_gpu needed).
#
# STEPS (space separated, in order): e2e (scripts/gpu_vllm_e2e.py), e2e-quick, rollout
# (benchmarks/bench_rollout.py), trainer (benchmarks/bench_trainer_hf.py), audit (rl-engine audit
# on the GPU), grpo / grpo-megatron (rl-engine grpo with CUDA graphs on a Qwen2.5-0.5B-shaped
# model, HF / Megatron trainer; results under benchmarks/results/<gpu>/grpo_*), tp / tp-vllm
# (scripts/gpu_tp.sh, 2+ GPUs; tp alone needs no vLLM);
# moe-tests (the MoE ops' tests on CUDA), moe-bench (benchmarks/bench_moe.py vs vLLM's fused_moe;
# needs the --moe payload), moe-sweep (benchmarks/sweep_moe_experts.py), moe-train
# (benchmarks/bench_moe_train.py); e2e with STEP_ARGS_e2e="--archs qwen3_moe" checks the MoE model.
# STEP_ARGS_<step> (e.g. STEP_ARGS_rollout=--quick) are passed to that step.
# Writes under $OUT: <step>.log, the JSON each step writes, results.tgz and a short table.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_vllm_site.sh
. scripts/_vllm_site.sh

NEEDS_VLLM=0
for step in ${STEPS:-e2e}; do [ "$step" = tp ] || NEEDS_VLLM=1; done
if [ "$NEEDS_VLLM" = 1 ]; then vllm_site_install || exit 3; fi
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.rl_engine_ok ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.rl_engine_ok
fi
# the checkout first (its code, not the copy pip put next to the entry point)
export PYTHONPATH="$ROOT:/tmp/vllm_site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
$PY - <<'PYEOF'
import torch, triton
try:
    import vllm
except ImportError:  # the tp step alone needs no vLLM
    vllm = None
print("torch", torch.__version__, "triton", triton.__version__, "vllm", getattr(vllm, "__version__", None))
print("device", torch.cuda.get_device_name())
PYEOF
GPU=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.gpu_slug())")
RES="$ROOT/benchmarks/results/$GPU"
mkdir -p "$RES"

status=0
for step in ${STEPS:-e2e}; do
  var="STEP_ARGS_${step//-/_}"
  extra=${!var:-}
  echo "== $step $extra ($(date -u +%H:%M:%SZ))"
  case $step in
    e2e) cmd=($PY scripts/gpu_vllm_e2e.py --out "$OUT") ;;
    e2e-quick) cmd=($PY scripts/gpu_vllm_e2e.py --quick --out "$OUT") ;;
    rollout) cmd=($PY benchmarks/bench_rollout.py --out "$RES") ;;
    trainer) cmd=($PY benchmarks/bench_trainer_hf.py --out "$RES") ;;
    moe-tests)  # the MoE ops on CUDA (bf16, CUDA graphs): Triton grouped experts + references
      cmd=($PY -m pytest -q -p no:logging tests/ops/test_moe_experts_triton.py tests/ops/test_moe_experts_subtree_triton.py tests/ops/test_moe_triton.py tests/ops/test_moe.py) ;;
    moe-bench) cmd=($PY benchmarks/bench_moe.py --out "$RES") ;;  # vs vLLM's fused_moe
    moe-sweep) cmd=($PY benchmarks/sweep_moe_experts.py --out "$RES") ;;  # experts tile sweep
    moe-train) cmd=($PY benchmarks/bench_moe_train.py --out "$RES") ;;  # fwd+bwd vs HF, megatron-core
    tp) cmd=(env VLLM_TP=0 bash scripts/gpu_tp.sh) ;;  # Megatron + FSDP2 over 2 GPUs
    tp-vllm) cmd=(env VLLM_TP=1 bash scripts/gpu_tp.sh) ;;  # vLLM TP 2 with CUDA graphs
    audit)  # a Qwen2-shaped checkpoint (QKV bias, tied), bf16, both sides on the GPU
      $PY -c "from rl_engine.testing.tiny_models import make_tiny_model as m; m('/tmp/audit_qwen2', arch='qwen2', dtype='bfloat16', seed=0, tie_word_embeddings=True, num_hidden_layers=4, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936)" || status=1
      cmd=($PY -m rl_engine.cli audit --model /tmp/audit_qwen2 --device cuda --temperature 0.7 --configurations stock,vllm-batch-invariant,rl_engine --localize --gate --no-progress --out "$RES/audit_qwen2") ;;
    grpo|grpo-megatron)  # Qwen2.5-0.5B shape (tied, QKV bias), random weights, bf16
      [ -f /tmp/grpo_qwen2/config.json ] || $PY -c "from rl_engine.testing.tiny_models import make_tiny_model as m; m('/tmp/grpo_qwen2', arch='qwen2', dtype='bfloat16', seed=0, tie_word_embeddings=True, num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936)" || status=1
      trainer=hf; [ "$step" = grpo-megatron ] && trainer=megatron
      cmd=($PY -m rl_engine.cli grpo --model /tmp/grpo_qwen2 --trainer "$trainer" --device cuda --steps 8 --num-prompts 16 --group-size 8 --max-tokens 64 --lr 1e-3 --gate --no-progress --out "$RES/grpo_qwen2_0.5b_$trainer") ;;
    *) echo "unknown step $step"; status=2; continue ;;
  esac
  # each step in a process group of its own (scripts/_run_group.sh): what a timed-out step leaves
  # behind (an audit's vLLM worker) once slowed a rollout benchmark that followed
  # shellcheck disable=SC2086
  run_group "${STEP_TIMEOUT:-560}" "$OUT/$step.log" "${cmd[@]}" $extra
  rc=$?
  echo "$step exit status: $rc" | tee -a "$OUT/steps.txt"
  [ "$rc" = 0 ] || status=1
done
# results.tgz: the benchmark results, and the e2e step's result files and logs (not its model
# checkpoints): a device call returns few files, and a step cut off by its limit writes no summary,
# but `scripts/gpu_vllm_e2e.py --summarize` recomputes it from these files
work=()
[ -d "$OUT/gpu_vllm_e2e" ] && work=(-C "$OUT" --exclude='model_*' gpu_vllm_e2e)
tar -czf "$OUT/results.tgz" -C "$ROOT/benchmarks/results" "$GPU" "${work[@]}" 2>/dev/null
cat "$OUT/steps.txt"
exit $status
