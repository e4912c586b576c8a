// C ABI of librl_engine_sm90.so (loaded with ctypes by rl_engine/ops/det_gemm/cuda.py; no torch
// headers, no C++ ABI across the boundary). All pointers are device pointers; `stream` is a
// cudaStream_t. Every function returns 0 (or a size) on success and -1 on error, with the reason
// in rle_last_error() (thread local).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RLE_ABI_VERSION 5  // 2: rle_det_gemm_sm90_batched, rle_splitk_reduce; 3: RLE_CFG_NARROW;
                           // 4: RLE_CFG_MID_K128, RLE_CFG_SMALL_K128; 5: RLE_CFG_LARGE192,
                           // RLE_CFG_MID192, RLE_CFG_LARGE_C2

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
#define RLE_CFG_NARROW 4  // 64 x 32 x 64, ping-pong (decode over a narrow N)
// the same tiles as MID / SMALL staging K 128 columns at a time: two 64-blocks per pipeline stage,
// the same wgmma k16 steps in the same order (equal bits); K must be a multiple of 128
#define RLE_CFG_MID_K128 5    // 64 x 128 x 128, ping-pong
#define RLE_CFG_SMALL_K128 6  // 64 x 64 x 128, ping-pong
// 192-column tiles (grids that fit the SMs where 128 / 256 columns leave a wave part empty)
#define RLE_CFG_LARGE192 7  // 128 x 192 x 64, cooperative
#define RLE_CFG_MID192 8    // 64 x 192 x 64, ping-pong
#define RLE_CFG_LARGE_C2 9  // 128 x 256 x 64, cooperative, clusters of 2 along M (B multicast)

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
// Batched 16-bit product with fp32 output and no bias (the K slices of split-K): for
// l = 0 .. batch-1, D_l = A_l @ B_l with A_l = a + l * stride_a, B_l = b + l * stride_b (elements
// of the input dtype) and D_l = d + l * stride_d (fp32 elements), each an ordinary product of
// rle_det_gemm_sm90's numerics (one fp32 accumulator walking its own K = args->k from its first
// column in 64-blocks), written in fp32 without rounding. One launch: the persistent grid runs
// the tiles of every batch. product: RLE_NT or RLE_NN; cfg: RLE_CFG_*; args->bias must be NULL;
// args->d is fp32 with leading dimension args->ldd. Strides: 16-byte multiples, stride_d >=
// m * ldd (batches do not overlap). workspace_bytes < 0: returns the workspace size.
int64_t rle_det_gemm_sm90_batched(int dtype, int product, int cfg, int64_t batch,
                                  int64_t stride_a, int64_t stride_b, int64_t stride_d,
                                  const rle_gemm_args* args);
// The split-K reduction: d[i, j] = round(((p_0 + p_1) + ... + p_{S-1}) + bias[j]) with
// p_s = partials[s * stride_p + i * ldp + j] (fp32), added in the order s = 0, 1, ..., S-1 in
// fp32 (IEEE round to nearest, no FMA), bias (dtype, or NULL: nothing added) added last, one
// rounding to dtype (RLE_BF16 / RLE_FP16, round to nearest even). d has leading dimension ldd.
int rle_splitk_reduce(int dtype, int64_t m, int64_t n, int64_t splits, const float* partials,
                      int64_t ldp, int64_t stride_p, const void* bias, void* d, int64_t ldd,
                      void* stream);
int rle_det_gemm_fp32(int64_t m, int64_t n, int64_t k, const float* a, int64_t sam, int64_t sak,
                      const float* b, int64_t sbk, int64_t sbn, const float* bias, float* d,
                      int64_t sdm, int64_t sdn, void* stream);

#ifdef __cplusplus
}
#endif
