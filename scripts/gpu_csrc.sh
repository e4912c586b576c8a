#!/usr/bin/env bash
# The GPU run of det_gemm's CUDA C++ provider (issue 47), on an H100 / H200: a smoke call, the
# GPU tests (tests/ops/test_det_gemm_cuda.py), then the benchmark vs cuBLAS; results under $OUT.
#
# The library is built on the CPU machine (CUTLASS_DIR=... bash scripts/build_csrc.sh) and
# carried: from the device tool, run `bash scripts/gpu_csrc.sh` with carry=["build/csrc"].
#   BENCH_ARGS="--quick" / "--triton" / "--configs"   shorter benchmark / also time the Triton
#                                       provider / every tile configuration (then the choice
#                                       fitted from them: fit.log, cuda_config_fit.json)
#   BENCH_ARGS="--split-k 2,4,8"        also time those split-K counts (forced; the table is
#                                       off) on the rows with M <= 256 (--split-k-max-m)
#   SKIP_TESTS=1 / SKIP_BENCH=1         one half only
#   RL_ENGINE_CSRC_LIB=/path/lib.so     another library (default: build/csrc/ of this checkout)
# The checkout goes first on PYTHONPATH (an installed copy, e.g. /tmp/site, stays after it).
# What comes back from $OUT: env.txt, smoke.log, pytest.log, pytest.xml, bench.log,
# det_gemm_cuda.json, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/_run_group.sh
. scripts/_run_group.sh
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET RL_ENGINE_BACKEND RL_ENGINE_BACKEND_DET_GEMM
LIB="$ROOT/build/csrc/librl_engine_sm90.so"
if [ -z "${RL_ENGINE_CSRC_LIB:-}" ] && [ -f "$LIB" ]; then export RL_ENGINE_CSRC_LIB="$LIB"; fi
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "library: ${RL_ENGINE_CSRC_LIB:-<none found>}"
  [ -n "${RL_ENGINE_CSRC_LIB:-}" ] && cat "${RL_ENGINE_CSRC_LIB%.so}.txt" 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/env.txt"

echo "== smoke: one call per product =="
run_group 120 "$OUT/smoke.log" $PY - <<'PYEOF'
import torch
from rl_engine.ops.det_gemm import cuda as c

print("library:", c.library_info())
reason = c.PROVIDER.why_not("cuda", triton_interpret=False)
print("why_not:", reason)
if reason is not None:
    raise SystemExit(1)
g = torch.Generator(device="cuda").manual_seed(0)
a = torch.randn(300, 4096, device="cuda", generator=g).bfloat16()
w = (torch.randn(1024, 4096, device="cuda", generator=g) / 64).bfloat16()
bias = torch.randn(1024, device="cuda", generator=g).bfloat16()
gr = torch.randn(300, 1024, device="cuda", generator=g).bfloat16()
for name, got, ref in (
    ("NT a @ w.t() + bias", c.det_gemm(a, w.t(), bias), torch.addmm(bias, a, w.t())),
    ("NN grad @ w", c.det_gemm(gr, w), gr @ w),
    ("wgrad a.t() @ grad", c.det_gemm_wgrad(a, gr), a.float().t() @ gr.float()),
    ("fp32", c.det_gemm(a.float(), w.t().float()), a.float() @ w.t().float()),
):
    torch.cuda.synchronize()
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{name:24s} rel err vs torch {rel:.2e}")
    assert rel < 1e-2, name
print("SMOKE OK")
PYEOF
smoke=$?

tests=skipped
if [ "${SKIP_TESTS:-0}" = "0" ]; then
  echo "== pytest tests/ops/test_det_gemm_cuda.py =="
  run_group "${TEST_TIMEOUT:-300}" "$OUT/pytest.log" $PY -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml" tests/ops/test_det_gemm_cuda.py
  tests=$?
  # on a machine where the smoke call ran, a skipped GPU test is a failure (no silent skips)
  if [ "$smoke" = 0 ] && grep -q "^SKIPPED.*det_gemm\[cuda\]" "$OUT/pytest.log"; then
    echo "GPU tests skipped although the provider runs here" | tee -a "$OUT/pytest.log"
    tests=skipped-on-gpu
  fi
fi

bench=skipped
if [ "${SKIP_BENCH:-0}" = "0" ] && [ "$smoke" = 0 ]; then
  echo "== benchmarks/bench_det_gemm_cuda.py ${BENCH_ARGS:-} =="
  # shellcheck disable=SC2086
  run_group "${BENCH_TIMEOUT:-330}" "$OUT/bench.log" $PY benchmarks/bench_det_gemm_cuda.py \
    --out "$OUT" ${BENCH_ARGS:-}
  bench=$?
  # with the per-config times: the tile choice fitted from them (reads times only)
  case " ${BENCH_ARGS:-} " in
    *" --configs "*) [ "$bench" = 0 ] && $PY benchmarks/fit_cuda_configs.py "$OUT/det_gemm_cuda.json" \
      --out "$OUT" > "$OUT/fit.log" 2>&1 ;;
  esac
fi

{
  echo "smoke exit $smoke, pytest exit $tests, bench exit $bench"
  tail -n 3 "$OUT/pytest.log" 2>/dev/null
  grep "summary:" "$OUT/bench.log" 2>/dev/null
  head -n 7 "$OUT/fit.log" 2>/dev/null
} | tee "$OUT/summary.txt"
[ "$smoke" = 0 ] && { [ "$tests" = 0 ] || [ "$tests" = skipped ]; } \
  && { [ "$bench" = 0 ] || [ "$bench" = skipped ]; }
