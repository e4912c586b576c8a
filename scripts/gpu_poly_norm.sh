#!/usr/bin/env bash
# One device call for the poly_norm Triton provider: the launch-setup sweep (with an A/B against
# an earlier provider file when OLD names one), the poly_norm GPU tests, and poly_norm-only
# invariance fuzzing. Everything under $OUT; each step bounded so a short call returns results.
#   OLD=.ab/poly_norm_v2.py OUT=/tmp/out bash scripts/gpu_poly_norm.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
old=(); [ -n "${OLD:-}" ] && old=(--old "$OLD")
timeout "${SWEEP_TIMEOUT:-170}" python3 benchmarks/sweep_poly_norm.py --out "$OUT" --quick "${old[@]}" 2>&1 | tee "$OUT/sweep.log"
xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 4)
RL_ENGINE_CHECK_LAUNCH=1 timeout "${TEST_TIMEOUT:-70}" python3 -m pytest -q -p no:cacheprovider \
  tests/ops/test_poly_norm.py tests/test_fuzz.py -k "poly" "${xdist[@]}" -rfEs > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; tail -3 "$OUT/pytest.log"
timeout "${FUZZ_TIMEOUT:-60}" python3 -m rl_engine.harness.fuzz --device cuda --ops poly_norm \
  --cases 400 --budget 40 --workers 8 --json "$OUT/fuzz_poly_norm.json" > "$OUT/fuzz.log" 2>&1
echo "fuzz exit $?"; tail -4 "$OUT/fuzz.log"
