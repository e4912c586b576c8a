// C ABI of librl_engine_sm90.so (loaded with ctypes by rl_engine/ops/det_gemm/cuda.py; no torch
// headers, no C++ ABI across the boundary). All pointers are device pointers; `stream` is a
// cudaStream_t. Every function returns 0 (or a size) on success and -1 on error, with the reason
// in rle_last_error() (thread local).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RLE_ABI_VERSION 1

// dtype of the inputs
#define RLE_BF16 0
#define RLE_FP16 1
#define RLE_FP32 2

// products (CUTLASS layout names: A is M x K, B is K x N, D is M x N row-major)
#define RLE_NT 0     // A row-major (K contiguous), B K contiguous (a @ w.t()), 16-bit D (+ bias)
#define RLE_NN 1     // A row-major, B N contiguous (grad @ w), 16-bit D (+ bias)
#define RLE_WGRAD 2  // A M contiguous (x.t()), B N contiguous (grad), fp32 D

// tile configurations of the 16-bit products (launch shape only: equal bits)
#define RLE_CFG_LARGE 0  // 128 x 256 x 64, cooperative
#define RLE_CFG_MID 1    // 64 x 128 x 64, ping-pong
#define RLE_CFG_SMALL 2  // 64 x 64 x 64, ping-pong
#define RLE_CFG_SQUARE 3  // 128 x 128 x 64, cooperative

typedef struct {
  int64_t m, n, k;
  const void* a;
  int64_t lda;  // leading dimension of A in its layout (elements)
  const void* b;
  int64_t ldb;
  const void* bias;  // [n] in the input dtype, or NULL (NT / NN only)
  void* d;
  int64_t ldd;
  void* workspace;
  int64_t workspace_bytes;  // < 0: rle_det_gemm_sm90 returns the workspace size, runs nothing
  void* stream;
} rle_gemm_args;

int rle_abi_version(void);
const char* rle_last_error(void);
// Whether the current device can run the SM90 kernels (0) or not (-1, reason in rle_last_error).
int rle_check_device(void);
// 16-bit products (SM90 wgmma): D = A @ B (+ bias) or the fp32 weight gradient.
int64_t rle_det_gemm_sm90(int dtype, int product, int cfg, const rle_gemm_args* args);
// fp32 products (CUDA cores, IEEE fp32 FMA, k in order from 0): D[i, j] = sum_k A[i, k] B[k, j]
// (+ bias[j]), any strides: A[i, k] = a[i * sam + k * sak], B[k, j] = b[k * sbk + j * sbn],
// D[i, j] = d[i * sdm + j * sdn] (fp32).
int rle_det_gemm_fp32(int64_t m, int64_t n, int64_t k, const float* a, int64_t sam, int64_t sak,
                      const float* b, int64_t sbk, int64_t sbn, const float* bias, float* d,
                      int64_t sdm, int64_t sdn, void* stream);

#ifdef __cplusplus
}
#endif
