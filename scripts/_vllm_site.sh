# shellcheck shell=bash
# Sourced by the GPU scripts that need CUDA vLLM 0.24 (scripts/gpu_vllm.sh, scripts/gpu_trl.sh):
# `vllm_site_install` installs the carried payload into /tmp/vllm_site once per warm lease, with
# the project's dist-info (its vllm.general_plugins entry point) beside it. The payload's last
# part holds install.sh: .vllm_gpu/2 (three parts) or, built with --moe (vLLM's MoE kernels kept,
# for stock MoE models), .vllm_gpu/3 (four parts). Needs $PY. Returns 3 when it cannot.
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
