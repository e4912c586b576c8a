// C entry points of librl_engine_sm90.so: errors, device checks, dispatch, the fp32 kernel, the
// split-K reduction.
#include <cstdarg>
#include <cstdio>
#include <mutex>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "det_gemm_internal.h"
#include "det_gemm_sm90.h"

namespace rle {

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

// The split-K reduction (rle_splitk_reduce): each thread owns V consecutive columns of a row
// (V = 4: float4 loads where the partials' strides allow it) and computes, per column,
//   acc = p_0; acc = acc + p_s for s = 1 .. S-1 (in order); acc = acc + bias; round once.
// __fadd_rn: IEEE fp32 adds in that order (never contracted, never reassociated).
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16* d) {
  *d = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void from_float(float x, __half* d) { *d = __float2half_rn(x); }

template <int V>
__device__ __forceinline__ void load_v(const float* src, float (&x)[V]) {
  if constexpr (V == 4) {
    float4 q = *reinterpret_cast<const float4*>(src);
    x[0] = q.x, x[1] = q.y, x[2] = q.z, x[3] = q.w;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) x[v] = src[v];
  }
}

template <class Out, int V>
__global__ void __launch_bounds__(256)
    splitk_reduce_kernel(int64_t m, int64_t n, int64_t splits, const float* __restrict__ p,
                         int64_t ldp, int64_t sp, const Out* __restrict__ bias,
                         Out* __restrict__ d, int64_t ldd) {
  const int64_t nv = n / V;  // V divides n
  const int64_t total = m * nv;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / nv;
    const int64_t j = (idx - i * nv) * V;
    const float* src = p + i * ldp + j;
    float acc[V];
    load_v<V>(src, acc);
#pragma unroll 4
    for (int64_t s = 1; s < splits; ++s) {
      float x[V];
      load_v<V>(src + s * sp, x);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = __fadd_rn(acc[v], x[v]);
    }
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float r = acc[v];
      if (bias != nullptr) r = __fadd_rn(r, to_float(bias[j + v]));
      from_float(r, d + i * ldd + j + v);
    }
  }
}

template <class Out>
int launch_reduce(int64_t m, int64_t n, int64_t splits, const float* p, int64_t ldp, int64_t sp,
                  const void* bias, void* d, int64_t ldd, cudaStream_t stream) {
  const bool vec = n % 4 == 0 && ldp % 4 == 0 && sp % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const int64_t total = m * (vec ? n / 4 : n);
  int dev = 0;
  cudaGetDevice(&dev);
  const int64_t cap = static_cast<int64_t>(sm_count(dev) > 0 ? sm_count(dev) : 132) * 16;
  int64_t blocks = (total + 255) / 256;
  if (blocks > cap) blocks = cap;  // grid-stride loop beyond
  const Out* b = static_cast<const Out*>(bias);
  Out* o = static_cast<Out*>(d);
  if (vec) {
    splitk_reduce_kernel<Out, 4><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        m, n, splits, p, ldp, sp, b, o, ldd);
  } else {
    splitk_reduce_kernel<Out, 1><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        m, n, splits, p, ldp, sp, b, o, ldd);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    set_error("split-K reduction launch: %s", cudaGetErrorString(err));
    return -1;
  }
  return 0;
}

}  // namespace rle

// The *_K128 configs stage two 64-blocks at a time: they walk the same blocks as the others only
// where K is a multiple of 128 (a K tail past it would add a zero-filled 64-block more).
static bool k_fits_config(int cfg, int64_t k) {
  if ((cfg == RLE_CFG_MID_K128 || cfg == RLE_CFG_SMALL_K128) && k % 128 != 0) {
    rle::set_error("config %d stages 128 K columns: K (%lld) must be a multiple of 128", cfg,
                   (long long)k);
    return false;
  }
  return true;
}

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
  if (!k_fits_config(cfg, p->k)) return -1;
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

int64_t rle_det_gemm_sm90_batched(int dtype, int product, int cfg, int64_t batch,
                                  int64_t stride_a, int64_t stride_b, int64_t stride_d,
                                  const rle_gemm_args* p) {
  if (p == nullptr) {
    rle::set_error("null arguments");
    return -1;
  }
  if (p->m <= 0 || p->n <= 0 || p->k <= 0 || p->m > INT32_MAX || p->n > INT32_MAX ||
      p->k > INT32_MAX || batch <= 0 || batch > INT32_MAX) {
    rle::set_error("m, n, k and batch must be in [1, 2^31): %lld %lld %lld %lld",
                   (long long)p->m, (long long)p->n, (long long)p->k, (long long)batch);
    return -1;
  }
  if (p->bias != nullptr) {
    rle::set_error("the batched product takes no bias (the split-K reduction adds it)");
    return -1;
  }
  if (!k_fits_config(cfg, p->k)) return -1;
  // TMA: byte strides are multiples of 16 (8 elements of A / B, 4 fp32 of D); the batches of D
  // must not overlap (each element written once)
  if (stride_a < 0 || stride_b < 0 || stride_a % 8 != 0 || stride_b % 8 != 0 ||
      stride_d % 4 != 0 || (batch > 1 && stride_d < p->m * p->ldd)) {
    rle::set_error("batch strides a=%lld b=%lld d=%lld: A / B need multiples of 8 elements, D "
                   "a multiple of 4 and >= m * ldd = %lld",
                   (long long)stride_a, (long long)stride_b, (long long)stride_d,
                   (long long)(p->m * p->ldd));
    return -1;
  }
  const rle::Batch bt{batch, stride_a, stride_b, stride_d};
  if (dtype == RLE_BF16) {
    if (product == RLE_NT) return rle::gemm_bf16_nt_slices(p, cfg, bt);
    if (product == RLE_NN) return rle::gemm_bf16_nn_slices(p, cfg, bt);
  } else if (dtype == RLE_FP16) {
    if (product == RLE_NT) return rle::gemm_fp16_nt_slices(p, cfg, bt);
    if (product == RLE_NN) return rle::gemm_fp16_nn_slices(p, cfg, bt);
  } else {
    rle::set_error("dtype %d: the SM90 kernels take bf16 (0) or fp16 (1)", dtype);
    return -1;
  }
  rle::set_error("product %d: the batched product is RLE_NT (0) or RLE_NN (1)", product);
  return -1;
}

int rle_splitk_reduce(int dtype, int64_t m, int64_t n, int64_t splits, const float* partials,
                      int64_t ldp, int64_t stride_p, const void* bias, void* d, int64_t ldd,
                      void* stream) {
  if (m <= 0 || n <= 0 || splits <= 0 || ldp < n || ldd < n ||
      (splits > 1 && stride_p < m * ldp)) {
    rle::set_error("split-K reduction: m=%lld n=%lld splits=%lld ldp=%lld stride_p=%lld "
                   "ldd=%lld (need m, n, splits >= 1, ldp, ldd >= n, stride_p >= m * ldp)",
                   (long long)m, (long long)n, (long long)splits, (long long)ldp,
                   (long long)stride_p, (long long)ldd);
    return -1;
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dtype == RLE_BF16) {
    return rle::launch_reduce<__nv_bfloat16>(m, n, splits, partials, ldp, stride_p, bias, d, ldd,
                                             st);
  }
  if (dtype == RLE_FP16) {
    return rle::launch_reduce<__half>(m, n, splits, partials, ldp, stride_p, bias, d, ldd, st);
  }
  rle::set_error("dtype %d: the split-K reduction writes bf16 (0) or fp16 (1)", dtype);
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
