// fp16 instantiations of the SM90 det_gemm kernels (see det_gemm_sm90.cuh for the numerics).
#include "det_gemm_sm90.cuh"

namespace rle {

RLE_DEFINE_PRODUCTS(fp16, cutlass::half_t)

}  // namespace rle
