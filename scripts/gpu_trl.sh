#!/usr/bin/env bash
# TRL 1.16 GRPOTrainer + colocated CUDA vLLM 0.24 on one GPU of the device machine: TRL's own
# importance-sampling ratio exactly 1.0 with rl_engine, and the stock control
# (python -m rl_engine.harness.trl_check --device cuda --control).
#
# Here (the CPU machine): bash ../shared/tools/vllm-gpu-payload.sh && bash scripts/trl_wheels.sh
# On the device, back-to-back calls (PLATFORMS.md, "GPU vLLM on the device"):
#   1. carry .vllm_gpu/0:  mkdir -p /tmp/vllm_parts && cp .vllm_gpu/0/part.0 /tmp/vllm_parts/
#   2. carry .vllm_gpu/1:  cp .vllm_gpu/1/part.1 /tmp/vllm_parts/
#   3. carry .vllm_gpu/2 .whl_trl:  bash scripts/gpu_trl.sh
#      (installs vLLM into /tmp/vllm_site as scripts/gpu_vllm.sh does, unless a call of this warm
#      lease already did; a later call needs only `carry .whl_trl`)
# With a --moe payload (four parts) the last call carries .vllm_gpu/3 instead of .vllm_gpu/2.
# Only if the image's pyarrow is older than datasets 5.2.0's >= 24 (this script prints it):
# PYARROW=1 bash scripts/trl_wheels.sh writes .whl_trl_pyarrow/ (~55 MB), carried in a call of
# its own (with .whl_trl, without any .vllm_gpu part); this script installs it too.
#
# Writes under $OUT: trl_imports.txt (each import TRL's path needs: version or the error; every
# unmet Requires-Dist of trl / datasets / accelerate), trl_check.log, trl_gpu.json.
# TRL_CHECK_ARGS (e.g. "--steps 3" or "--model /tmp/m") is passed on to the check.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_vllm_site.sh
. scripts/_vllm_site.sh

vllm_site_install || exit 3
for dir in .whl_trl .whl_trl_pyarrow; do
  if ls $dir/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl_site $dir/*.whl \
      || { echo "installing $dir/*.whl into /tmp/trl_site failed"; exit 3; }
  fi
done
[ -d /tmp/trl_site ] || { echo "no /tmp/trl_site and no .whl_trl carried (bash scripts/trl_wheels.sh)"; exit 3; }
# the checkout first (its code, not the copy pip put next to the entry point), then TRL's wheels
# (ahead of the image's accelerate / fsspec), then vLLM
export PYTHONPATH="$ROOT:/tmp/trl_site:/tmp/vllm_site${PYTHONPATH:+:$PYTHONPATH}"

# what imports and what does not: the exact obstacle, if one remains
$PY - <<'PYEOF' 2>&1 | tee "$OUT/trl_imports.txt"
import importlib, importlib.metadata as md, traceback
from packaging.requirements import Requirement

mods = ["torch", "transformers", "vllm", "accelerate", "datasets", "pyarrow", "pandas", "dill",
        "multiprocess", "fsspec", "xxhash", "huggingface_hub", "trl",
        "trl.generation.vllm_generation", "trl.trainer.grpo_trainer",
        "rl_engine.adapters.vllm", "rl_engine.integrations.trl", "rl_engine.harness.trl_check"]
failed = []
for name in mods:
    try:
        m = importlib.import_module(name)
        print(f"ok    {name} {getattr(m, '__version__', '')} ({getattr(m, '__file__', '')})")
    except Exception as exc:  # noqa: BLE001
        failed.append(name)
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print(f"FAIL  {name}: {last}")
for dist in ("trl", "datasets", "accelerate"):
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        print(f"FAIL  {dist}: not installed"); continue
    for r in map(Requirement, reqs):
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            print(f"UNMET {dist} needs {r}: not installed"); continue
        if not r.specifier.contains(have, prereleases=True):
            print(f"UNMET {dist} needs {r}: {have} installed")
print("imports failing:", ", ".join(failed) or "none")
PYEOF

run_group "${STEP_TIMEOUT:-560}" "$OUT/trl_check.log" \
  $PY -m rl_engine.harness.trl_check --device cuda --control --json "$OUT/trl_gpu.json" \
  ${TRL_CHECK_ARGS:-}
rc=$?
echo "trl_check exit status: $rc"
exit $rc
