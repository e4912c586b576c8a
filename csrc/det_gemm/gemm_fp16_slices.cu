// fp16 instantiations of the split-K slice products (fp32 out, batched over K slices; see
// det_gemm_sm90.cuh). Their own translation unit: they build in parallel with gemm_fp16.cu.
#include "det_gemm_sm90.cuh"

namespace rle {

RLE_DEFINE_SLICE_PRODUCTS(fp16, cutlass::half_t)

}  // namespace rle
