// C entry points of librl_engine_sm90.so: errors, device checks, dispatch, the fp32 kernel.
#include <cstdarg>
#include <cstdio>
#include <mutex>

#include <cuda_runtime.h>

#include "det_gemm_sm90.h"

namespace rle {

int64_t gemm_bf16_nt(const rle_gemm_args* p, int cfg);
int64_t gemm_bf16_nn(const rle_gemm_args* p, int cfg);
int64_t gemm_bf16_wgrad(const rle_gemm_args* p, int cfg);
int64_t gemm_fp16_nt(const rle_gemm_args* p, int cfg);
int64_t gemm_fp16_nn(const rle_gemm_args* p, int cfg);
int64_t gemm_fp16_wgrad(const rle_gemm_args* p, int cfg);

thread_local char g_error[1024] = "";

void set_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, ap);
  va_end(ap);
}

constexpr int kMaxDevices = 64;
std::mutex g_mutex;
int g_sm_count[kMaxDevices] = {0};

int sm_count(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;  // CUTLASS queries it itself
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_sm_count[device] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    g_sm_count[device] = n;
  }
  return g_sm_count[device];
}

// fp32: 64 x 64 output tile per block of 256 threads, 4 x 4 outputs per thread, K through
// shared memory 16 at a time. Every output element is acc = fmaf(A[i, k], B[k, j], acc) for
// k = 0, 1, ..., K-1 in order, starting from acc = 0: the order depends on K only.
constexpr int kT = 64, kTK = 16;

__global__ void __launch_bounds__(256) fp32_kernel(int64_t M, int64_t N, int64_t K,
                                                   const float* __restrict__ a, int64_t sam,
                                                   int64_t sak, const float* __restrict__ b,
                                                   int64_t sbk, int64_t sbn,
                                                   const float* __restrict__ bias, float* d,
                                                   int64_t sdm, int64_t sdn) {
  __shared__ float As[kTK][kT];
  __shared__ float Bs[kTK][kT];
  const int tid = threadIdx.x;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kT;  // rows on x: up to 2^31 - 1 tiles
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kT;
  const int tr = (tid / 16) * 4;  // thread's 4 rows / columns within the tile
  const int tc = (tid % 16) * 4;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTK) {
    for (int e = tid; e < kT * kTK; e += 256) {
      int r = e / kTK, kk = e % kTK;  // A tile: row r, k kk
      int64_t gi = m0 + r, gk = k0 + kk;
      As[kk][r] = (gi < M && gk < K) ? a[gi * sam + gk * sak] : 0.0f;
      int c = e % kT, kb = e / kT;  // B tile: k kb, column c
      int64_t gj = n0 + c, gkb = k0 + kb;
      Bs[kb][c] = (gj < N && gkb < K) ? b[gkb * sbk + gj * sbn] : 0.0f;
    }
    __syncthreads();
    const int kn = static_cast<int>(K - k0 < kTK ? K - k0 : kTK);  // no steps past K
    for (int kk = 0; kk < kn; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(As[kk][tr + i], Bs[kk][tc + j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int64_t gi = m0 + tr + i, gj = n0 + tc + j;
      if (gi < M && gj < N) {
        float v = acc[i][j];
        if (bias != nullptr) v = v + bias[gj];
        d[gi * sdm + gj * sdn] = v;
      }
    }
  }
}

}  // namespace rle

extern "C" {

int rle_abi_version(void) { return RLE_ABI_VERSION; }

const char* rle_last_error(void) { return rle::g_error; }

int rle_check_device(void) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) {
    rle::set_error("no CUDA device: %s", cudaGetErrorString(err));
    return -1;
  }
  cudaDeviceProp prop;
  err = cudaGetDeviceProperties(&prop, dev);
  if (err != cudaSuccess) {
    rle::set_error("cudaGetDeviceProperties: %s", cudaGetErrorString(err));
    return -1;
  }
  if (prop.major != 9 || prop.minor != 0) {
    rle::set_error("device %d (%s) is sm_%d%d; the kernels are built for sm_90a only", dev,
                   prop.name, prop.major, prop.minor);
    return -1;
  }
  return 0;
}

int64_t rle_det_gemm_sm90(int dtype, int product, int cfg, const rle_gemm_args* p) {
  if (p == nullptr) {
    rle::set_error("null arguments");
    return -1;
  }
  if (p->m <= 0 || p->n <= 0 || p->k <= 0 || p->m > INT32_MAX || p->n > INT32_MAX ||
      p->k > INT32_MAX) {
    rle::set_error("m, n, k must be in [1, 2^31): %lld %lld %lld", (long long)p->m,
                   (long long)p->n, (long long)p->k);
    return -1;
  }
  if (dtype == RLE_BF16) {
    if (product == RLE_NT) return rle::gemm_bf16_nt(p, cfg);
    if (product == RLE_NN) return rle::gemm_bf16_nn(p, cfg);
    if (product == RLE_WGRAD) return rle::gemm_bf16_wgrad(p, cfg);
  } else if (dtype == RLE_FP16) {
    if (product == RLE_NT) return rle::gemm_fp16_nt(p, cfg);
    if (product == RLE_NN) return rle::gemm_fp16_nn(p, cfg);
    if (product == RLE_WGRAD) return rle::gemm_fp16_wgrad(p, cfg);
  } else {
    rle::set_error("dtype %d: the SM90 kernels take bf16 (0) or fp16 (1)", dtype);
    return -1;
  }
  rle::set_error("unknown product %d", product);
  return -1;
}

int rle_det_gemm_fp32(int64_t m, int64_t n, int64_t k, const float* a, int64_t sam, int64_t sak,
                      const float* b, int64_t sbk, int64_t sbn, const float* bias, float* d,
                      int64_t sdm, int64_t sdn, void* stream) {
  if (m <= 0 || n <= 0 || k <= 0) {
    rle::set_error("m, n, k must be positive: %lld %lld %lld", (long long)m, (long long)n,
                   (long long)k);
    return -1;
  }
  int64_t gx = (m + rle::kT - 1) / rle::kT, gy = (n + rle::kT - 1) / rle::kT;
  if (gy > 65535 || gx > INT32_MAX) {
    rle::set_error("fp32 product too large for the grid (m=%lld n=%lld)", (long long)m,
                   (long long)n);
    return -1;
  }
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  rle::fp32_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      m, n, k, a, sam, sak, b, sbk, sbn, bias, d, sdm, sdn);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    rle::set_error("fp32 kernel launch: %s", cudaGetErrorString(err));
    return -1;
  }
  return 0;
}

}  // extern "C"
