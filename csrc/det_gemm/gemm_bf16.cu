// bf16 instantiations of the SM90 det_gemm kernels (see det_gemm_sm90.cuh for the numerics).
#include "det_gemm_sm90.cuh"

namespace rle {

using E = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;

int64_t gemm_bf16_nt(const rle_gemm_args* p, int cfg) {
  switch (cfg) {
    case RLE_CFG_LARGE: return run_gemm<GemmDef<E, RM, CM, E, CfgLarge>>(p);
    case RLE_CFG_MID: return run_gemm<GemmDef<E, RM, CM, E, CfgMid>>(p);
    case RLE_CFG_SMALL: return run_gemm<GemmDef<E, RM, CM, E, CfgSmall>>(p);
  }
  set_error("unknown config %d", cfg);
  return -1;
}

int64_t gemm_bf16_nn(const rle_gemm_args* p, int cfg) {
  switch (cfg) {
    case RLE_CFG_LARGE: return run_gemm<GemmDef<E, RM, RM, E, CfgLarge>>(p);
    case RLE_CFG_MID: return run_gemm<GemmDef<E, RM, RM, E, CfgMid>>(p);
    case RLE_CFG_SMALL: return run_gemm<GemmDef<E, RM, RM, E, CfgSmall>>(p);
  }
  set_error("unknown config %d", cfg);
  return -1;
}

int64_t gemm_bf16_wgrad(const rle_gemm_args* p, int cfg) {
  switch (cfg) {
    case RLE_CFG_LARGE: return run_gemm<GemmDef<E, CM, RM, float, CfgLarge>>(p);
    case RLE_CFG_MID: return run_gemm<GemmDef<E, CM, RM, float, CfgMid>>(p);
  }
  set_error("unknown wgrad config %d", cfg);
  return -1;
}

}  // namespace rle
