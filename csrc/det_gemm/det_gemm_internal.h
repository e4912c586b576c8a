// Internal declarations shared by api.cu (no CUTLASS) and the kernel translation units
// (det_gemm_sm90.cuh): errors, the SM count, the batched-launch description and the products.
#pragma once

#include <cstdint>

#include "det_gemm_sm90.h"

namespace rle {

void set_error(const char* fmt, ...);
int sm_count(int device);

// A batched launch: `count` batches, batch l of A / B / D at l * a / b / d elements. The plain
// products run with Batch{} (one batch: the problem, strides and mode of a single GEMM).
struct Batch {
  int64_t count = 1;
  int64_t a = 0, b = 0, d = 0;
};

// The products of det_gemm_sm90.h at a launch config (RLE_CFG_*): RLE_NT, RLE_NN, RLE_WGRAD per
// element type (gemm_bf16.cu, gemm_fp16.cu) ...
#define RLE_DECLARE(NAME) int64_t NAME(const rle_gemm_args* p, int cfg);
RLE_DECLARE(gemm_bf16_nt)
RLE_DECLARE(gemm_bf16_nn)
RLE_DECLARE(gemm_bf16_wgrad)
RLE_DECLARE(gemm_fp16_nt)
RLE_DECLARE(gemm_fp16_nn)
RLE_DECLARE(gemm_fp16_wgrad)
#undef RLE_DECLARE
// ... and the split-K slice products (RLE_NT / RLE_NN, fp32 out, no bias, batched;
// gemm_bf16_slices.cu, gemm_fp16_slices.cu)
#define RLE_DECLARE(NAME) int64_t NAME(const rle_gemm_args* p, int cfg, const Batch& bt);
RLE_DECLARE(gemm_bf16_nt_slices)
RLE_DECLARE(gemm_bf16_nn_slices)
RLE_DECLARE(gemm_fp16_nt_slices)
RLE_DECLARE(gemm_fp16_nn_slices)
#undef RLE_DECLARE

}  // namespace rle
