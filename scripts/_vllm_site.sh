# shellcheck shell=bash
# Sourced by the GPU scripts that need CUDA vLLM 0.24 (scripts/gpu_vllm.sh, scripts/gpu_trl.sh):
# `vllm_site_install` installs the carried payload into /tmp/vllm_site once per warm lease, with
# the project's dist-info (its vllm.general_plugins entry point) beside it. The payload's last
# part holds install.sh: .vllm_gpu/2 (three parts) or, built with --moe (vLLM's MoE kernels kept,
# for stock MoE models), .vllm_gpu/3 (four parts). Returns 3 when it cannot.
# Sourced from the project root, it also sets what every such script starts with: ROOT, OUT
# (created), PY, run_group (scripts/_run_group.sh) and the environment below.
ROOT=$PWD
# shellcheck source=scripts/_run_group.sh
. scripts/_run_group.sh
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
# the trimmed vLLM payload has no FlashInfer; vLLM's V2 model runner (Llama on 0.24) would
# import it for top-k/top-p sampling (the rollouts here use neither)
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
vllm_site_install() {
  [ -f /tmp/vllm_site/.rl_engine_ok ] && return 0
  local install="" part
  for part in 3 2; do
    [ -x .vllm_gpu/$part/install.sh ] && { install=.vllm_gpu/$part/install.sh; break; }
  done
  [ -n "$install" ] || { echo "no /tmp/vllm_site and no .vllm_gpu/2 or /3 carried"; return 3; }
  bash "$install" || return 3
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/vllm_site . \
    || { echo "installing the project's entry point failed"; return 3; }
  touch /tmp/vllm_site/.rl_engine_ok
}
