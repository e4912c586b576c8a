#!/usr/bin/env bash
# The one script run on a GPU test machine (H100 / H200): GPU tests of every op, then every
# benchmark, results under $OUT and benchmarks/results/<gpu>/, a short table last.
#
#   OUT=/tmp/out bash scripts/gpu_check.sh            # everything
#   SKIP_TESTS=1 bash scripts/gpu_check.sh            # benchmarks only
#   SKIP_BENCH=1 bash scripts/gpu_check.sh            # tests (and fuzzing) only
#   BENCH_ARGS=--quick bash scripts/gpu_check.sh      # shorter benchmarks
#   TESTS="tests/ops/test_attention.py" BENCHES="attention trainer" bash scripts/gpu_check.sh
#   SKIP_FUZZ=1 / FUZZ_CASES=10000 / FUZZ_BUDGET=480 / FUZZ_WORKERS=1 / FUZZ_SEED=0 /
#   FUZZ_EXTRAS=1: the invariance fuzzing step (FUZZ_WORKERS processes share the GPU; a
#   different FUZZ_SEED draws a different case list)
#   REQUIRE="vllm megatron liger": components the run must have; one that does not import fails
#   the run at once (and a test skipped for lack of one fails: pytest --require), no silent skip
#   (PYTEST_ARGS: extra pytest arguments, e.g. -k rms; PYTEST_WORKERS: xdist processes, default 8; CPU_SHARE: gpu_check.sh runs sharing the machine's cores, default 1; TESTS: pytest paths, default tests/ops tests/invariance tests/adapters tests/audit/test_drift_monitor.py; BENCHES: names of
#   benchmarks/bench_<name>.py, default all; TEST_TIMEOUT / BENCH_TIMEOUT: seconds per step)
#
# megatron-core is not on the GPU image: wheels in .whl/ (carried) are installed to /tmp/site.
#
# No install needed: the checkout goes on PYTHONPATH. What comes back from $OUT: pytest.log,
# tests.json (exit status and counts), failures.txt (each failure as it happens), bench.log, results.tgz (benchmarks/results/<gpu>/) and
# summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/_run_group.sh
. scripts/_run_group.sh
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# device-side asserts on index inputs (write_kv_cache slots) while testing
export RL_ENGINE_DEVICE_CHECKS=${RL_ENGINE_DEVICE_CHECKS:-1}
unset TRITON_INTERPRET
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

$PY - <<'PYEOF'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PYEOF
REQ_ARGS=()
if [ -n "${REQUIRE:-}" ]; then
  # every component named must import here (megatron-core from .whl/ above, vLLM from
  # /tmp/vllm_site when PYTHONPATH has it), before any test or benchmark runs
  $PY - ${REQUIRE} <<'PYEOF' || { echo "REQUIRE=\"$REQUIRE\": a required component is missing"; exit 3; }
import importlib, sys
sys.path.insert(0, "tests")
from conftest import COMPONENTS
bad = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(COMPONENTS[name])
    except (ImportError, KeyError) as exc:
        bad.append(f"{name}: {exc!r}")
print("required components:", ", ".join(sys.argv[1:]), "- missing:" if bad else "- all import")
for b in bad:
    print("  ", b)
sys.exit(1 if bad else 0)
PYEOF
  REQ_ARGS=(--require "${REQUIRE// /,}")
fi
GPU=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import common; print(common.gpu_slug())")
RES="$ROOT/benchmarks/results/$GPU"
mkdir -p "$RES"

status=0
if [ "${SKIP_TESTS:-0}" = "0" ]; then
  TESTS=${TESTS:-tests/ops tests/invariance tests/adapters tests/audit/test_drift_monitor.py}
  # pytest-xdist (when installed): N processes share the one GPU; compiling Triton kernels is
  # CPU-bound, so this is what keeps the whole suite inside one 10-minute device call
  XDIST=""
  workers=1
  if $PY -c "import xdist" 2>/dev/null; then workers=${PYTEST_WORKERS:-8}; XDIST="-n $workers"; fi
  # intra-op threads a process: the cores over every pytest process on the machine (CPU_SHARE:
  # how many gpu_check.sh runs share it). torch's default, every core in every process, made
  # the CPU-tensor tests ~50x slower with 24 workers on a 64-core 4 x H200 machine (one HF
  # adapter test 264 s, 2026-11-28); the native providers' bits do not depend on the count
  threads=$(( $(nproc) / (workers * ${CPU_SHARE:-1}) ))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads < 1 ? 1 : threads ))}
  echo "== pytest $TESTS -m 'not slow' (CUDA) $XDIST, OMP_NUM_THREADS=$OMP_NUM_THREADS, RL_ENGINE_CHECK_LAUNCH=1 =="
  # every cached kernel launch also asks Triton's own binding which kernel it picks (raises on
  # a difference); the benchmarks below run without it
  # pytest in a process group of its own (scripts/_run_group.sh): a timed-out run can leave
  # pytest-xdist workers behind, which must not share the GPU and the CPU with the benchmarks
  # at the time limit pytest is interrupted (SIGINT), so that its summary still comes back
  RL_ENGINE_CHECK_LAUNCH=1 RUN_GROUP_SIGNAL=INT run_group "${TEST_TIMEOUT:-3000}" "$OUT/pytest.log" \
    $PY -m pytest $TESTS -m "not slow" -q -p no:cacheprovider -p no:logging -p scripts.pytest_failures -rfEs --durations=40 --junitxml "$OUT/pytest.xml" $XDIST "${REQ_ARGS[@]}" ${PYTEST_ARGS:-}
  status=$?
  echo "pytest exit status: $status"
  # machine-readable result next to the log (counts from pytest's last line)
  $PY - "$OUT/pytest.log" "$status" "$OUT/tests.json" "$TESTS" <<'PYEOF'
import json, re, sys
log, status, out, tests = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
last = [ln for ln in open(log, errors="replace").read().splitlines() if ln.strip()][-1:] or [""]
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last[0])}
from rl_engine.run_info import environment  # code hash, versions, device, date
json.dump({"tests": tests.split(), "exit_status": status, "counts": counts, "summary": last[0],
           **environment("cuda")}, open(out, "w"), indent=1)
PYEOF
fi

if [ "${SKIP_FUZZ:-0}" = "0" ]; then
  # invariance fuzzing: FUZZ_CASES drawn cases over every op and provider (sizes up to 70,000
  # rows, a 151,936 + 7 vocabulary), the long inputs and 100 repeats of a patched model's
  # forward + backward; a failure prints its one-line reproducer
  echo "== fuzz: ${FUZZ_CASES:-10000} cases (budget ${FUZZ_BUDGET:-480} s, ${FUZZ_WORKERS:-1} workers, seed ${FUZZ_SEED:-0}) =="
  extras=(--extras); [ "${FUZZ_EXTRAS:-1}" = "1" ] || extras=()
  timeout "$(( ${FUZZ_BUDGET:-480} + 240 ))" $PY -m rl_engine.harness.fuzz --device cuda \
    --cases "${FUZZ_CASES:-10000}" --budget "${FUZZ_BUDGET:-480}" "${extras[@]}" \
    --workers "${FUZZ_WORKERS:-1}" --seed "${FUZZ_SEED:-0}" \
    --json "$OUT/fuzz.json" > "$OUT/fuzz.log" 2>&1
  fuzz_status=$?
  echo "fuzz exit status: $fuzz_status"
  [ "$fuzz_status" = 0 ] || status=1
  grep -v "^fuzz: [0-9]* cases" "$OUT/fuzz.log" | tail -n 40
fi

echo "== benchmarks =="
: > "$OUT/bench.log"
if [ "${SKIP_BENCH:-0}" != "0" ]; then
  LIST=""
elif [ -n "${BENCHES:-}" ]; then
  LIST=$(for n in $BENCHES; do echo "benchmarks/bench_$n.py"; done)
else
  $PY benchmarks/bench_limits.py --out "$RES" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
  LIST=$(ls benchmarks/bench_*.py)
fi
for b in $LIST; do
  [ "$b" = benchmarks/bench_limits.py ] && [ -z "${BENCHES:-}" ] && continue
  echo "-- $b" | tee -a "$OUT/bench.log"
  timeout "${BENCH_TIMEOUT:-900}" $PY "$b" --out "$RES" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" \
    || { echo "FAILED: $b" | tee -a "$OUT/bench.log"; status=1; }
done

tar -czf "$OUT/results.tgz" -C "$ROOT/benchmarks/results" "$GPU"
{
  [ -f "$OUT/pytest.log" ] && echo "pytest: $(tail -n 1 "$OUT/pytest.log")"
  $PY benchmarks/summary.py "$RES"
} | tee "$OUT/summary.txt"
exit $status
