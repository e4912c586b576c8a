#!/usr/bin/env bash
# Builds build/csrc/librl_engine_sm90.so (the det_gemm/cuda-sm90 kernels, sm_90a) with nvcc.
# Needs no GPU and no CUDA build of torch: the library has a C ABI that
# rl_engine/ops/det_gemm/cuda.py loads with ctypes.
#
# CUTLASS (headers only, not vendored): CUTLASS_DIR must point at a CUTLASS checkout (or any
# folder with its include/ tree), e.g.
#   git clone --depth 1 --branch v4.7.0 https://github.com/NVIDIA/cutlass /tmp/cutlass
#   CUTLASS_DIR=/tmp/cutlass bash scripts/build_csrc.sh
# Options (environment): NVCC (default: nvcc on PATH), OUT_DIR (default build/csrc),
# JOBS (parallel compiles, default: number of CPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
OUT_DIR=${OUT_DIR:-build/csrc}
JOBS=${JOBS:-$(nproc)}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "build_csrc: nvcc not found (set NVCC or put the CUDA toolkit on PATH)" >&2
  exit 1
fi
if [ -z "${CUTLASS_DIR:-}" ] || [ ! -f "$CUTLASS_DIR/include/cutlass/cutlass.h" ]; then
  echo "build_csrc: set CUTLASS_DIR to a CUTLASS checkout (with include/cutlass/cutlass.h);" \
    "see the top of this script" >&2
  exit 1
fi
mkdir -p "$OUT_DIR/obj"
FLAGS=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC
  --expt-relaxed-constexpr -DNDEBUG -diag-suppress 20012 -I csrc/det_gemm -I "$CUTLASS_DIR/include")
# the CUTLASS units (minutes each) before api.cu (seconds): with JOBS < 5 the long ones start first
SOURCES=(csrc/det_gemm/gemm_bf16.cu csrc/det_gemm/gemm_fp16.cu csrc/det_gemm/gemm_bf16_slices.cu
  csrc/det_gemm/gemm_fp16_slices.cu csrc/det_gemm/api.cu)
echo "build_csrc: $("$NVCC" --version | tail -1)"
echo "build_csrc: CUTLASS $(grep -m3 -E 'define CUTLASS_(MAJOR|MINOR|PATCH) ' \
  "$CUTLASS_DIR/include/cutlass/version.h" | awk '{print $3}' | paste -sd.)"
start=$(date +%s)
pids=()
for src in "${SOURCES[@]}"; do
  obj="$OUT_DIR/obj/$(basename "${src%.cu}").o"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  echo "build_csrc: $src"
  "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" &
  pids+=($!)
done
fail=0
for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
if [ "$fail" != 0 ]; then
  echo "build_csrc: compilation failed" >&2
  exit 1
fi
"$NVCC" -shared -gencode=arch=compute_90a,code=sm_90a -o "$OUT_DIR/librl_engine_sm90.so" \
  "$OUT_DIR"/obj/*.o
# record what was built from (the provider reports it)
{
  echo "sources_sha256=$(cat csrc/det_gemm/* | sha256sum | cut -c1-16)"
  echo "nvcc=$("$NVCC" --version | tail -1)"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$OUT_DIR/librl_engine_sm90.txt"
echo "build_csrc: $OUT_DIR/librl_engine_sm90.so ($(du -h "$OUT_DIR/librl_engine_sm90.so" | cut -f1)," \
  "$(($(date +%s) - start)) s)"
