// det_gemm on SM90 (wgmma + TMA through CUTLASS 3 collectives): the det_gemm/cuda-sm90 family.
//
// Numerics (every kernel instantiated here, whatever its tile shape or schedule):
//   acc(i, j) = 0; for k-block kb = 0, 64, 128, ... (in order):
//       for k16 = kb, kb+16, kb+32, kb+48 (in order): acc = wgmma_k16(acc, A[i, k16:k16+16], B[k16:k16+16, j])
//   out(i, j) = round_to_nearest(1 * acc + bias[j])          (16-bit output; bias 0 when absent)
//   wgrad:      out(i, j) = 1 * acc                              (fp32 output)
// One fp32 accumulator per output element, K walked sequentially from column 0, k-block 64,
// no split-K / stream-K, K tail and rows / columns past the matrix zero-filled by TMA. The
// tile shape along M and N, the schedule (cooperative / ping-pong), the persistent grid, the
// raster order, the cluster shape (a cluster's CTAs share an operand tile through TMA multicast:
// the same bytes in shared memory) and the staging depth along K (a pipeline stage of 64 columns,
// or of 128 = two 64-blocks whose k16 steps issue in the same order, only where K is a multiple
// of 128 so that both stagings walk the same blocks) are launch choices: they never change which
// products go into acc or in which order, so an element depends on row i of A, column j of B and
// K only (row / batch and column invariance). The GPU tests prove every shipped config bitwise
// equal.
//
// Split-K (rle_det_gemm_sm90_batched + rle_splitk_reduce; used only where the caller's split
// table says S > 1, and none does yet): the same kernels run as a batched product over S
// contiguous K slices (batch l reads A and B from slice l's first column, K = the slice), each
// slice accumulated exactly as above from its own first column, fp32 out without rounding; the
// reduction kernel then adds the S partials in slice order, adds the bias, rounds once.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

#include "det_gemm_internal.h"
#include "det_gemm_sm90.h"

namespace rle {

using namespace cute;

constexpr int kBlockK = 64;  // part of the numerics: every config walks K in blocks of 64
// A pipeline stage of the *_K128 configs: two k-blocks (launch shape only, K % 128 == 0)
constexpr int kStageK128 = 2 * kBlockK;

// Launch configurations (performance only; see the numerics above): an output tile of
// kM x kN with kK K columns a pipeline stage, clusters of kClusterM CTAs along M, and the
// schedule: cooperative (two consumer warp groups share a tile) or ping-pong (they alternate
// tiles, one computing while the other runs its epilogue).
enum class Sched { kCooperative, kPingpong };

template <int kM, int kN, int kK, int kClusterM, Sched kSched>
struct Cfg {
  using Tile = Shape<Int<kM>, Int<kN>, Int<kK>>;
  using Cluster = Shape<Int<kClusterM>, _1, _1>;
  static constexpr bool kCooperative = kSched == Sched::kCooperative;
  using Mainloop =
      std::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Epilogue =
      std::conditional_t<kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecialized>;
};
constexpr Sched kCoop = Sched::kCooperative;
constexpr Sched kPing = Sched::kPingpong;

// 128 x 256 tiles, cooperative
using CfgLarge = Cfg<128, 256, kBlockK, 1, kCoop>;
// 64 x 128 tiles, ping-pong
using CfgMid = Cfg<64, 128, kBlockK, 1, kPing>;
// 128 x 128 tiles, cooperative: twice the CTAs of CfgLarge where its grid leaves SMs idle
// (M 257-1024 over N 4096-6144)
using CfgSquare = Cfg<128, 128, kBlockK, 1, kCoop>;
// 64 x 64 tiles, ping-pong: more CTAs to stream the weight at decode sizes
using CfgSmall = Cfg<64, 64, kBlockK, 1, kPing>;
// 64 x 32 tiles, ping-pong: twice CfgSmall's CTAs where N / 64 leaves SMs idle (the down / o
// projections at decode sizes: N 4096 is 64 small tiles on 132 SMs)
using CfgNarrow = Cfg<64, 32, kBlockK, 1, kPing>;
// Decode and short prefill stream the weight through few k16 steps per stage: half the pipeline
// stages (barrier round trips, TMA issues) per column of K, and 256-byte rows per TMA box.
using CfgMidK128 = Cfg<64, 128, kStageK128, 1, kPing>;    // CfgMid's tiles, 128 K columns a stage
using CfgSmallK128 = Cfg<64, 64, kStageK128, 1, kPing>;   // CfgSmall's, 128 K columns a stage
// Tiles whose grid fits the SMs where 128- and 256-column tiles leave a wave part empty: N 6,144
// (the qkv projection) is 32 tiles of 192 columns, so M 512 is 128 `large192` tiles and M 256 is
// 128 `mid192` tiles on 132 SMs, against 96 `large` / 192 `mid` tiles.
using CfgLarge192 = Cfg<128, 192, kBlockK, 1, kCoop>;
using CfgMid192 = Cfg<64, 192, kBlockK, 1, kPing>;
// CfgLarge's tiles in clusters of two along M: the two CTAs of a cluster share the B (weight)
// tile, loaded once and multicast by TMA to both (half the weight traffic from L2 at long M).
using CfgLargeC2 = Cfg<128, 256, kBlockK, 2, kCoop>;

template <class Elem, class LayoutA, class LayoutB, class ElemD, class Cfg>
struct GemmDef {
  static constexpr bool kBias = !std::is_same_v<ElemD, float>;  // 16-bit out: + bias epilogue
  using Fusion = std::conditional_t<
      kBias,
      cutlass::epilogue::fusion::LinCombPerColBias<ElemD, float, ElemD, void, float>,
      cutlass::epilogue::fusion::LinearCombination<ElemD, float, void, float>>;
  static constexpr int kAlignAB = 16 / sizeof(Elem);
  static constexpr int kAlignD = 16 / sizeof(ElemD);
  using ClusterShape = typename Cfg::Cluster;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignD, ElemD, cutlass::layout::RowMajor, kAlignD,
      typename Cfg::Epilogue, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, LayoutA, kAlignAB, Elem, LayoutB,
      kAlignAB, float, typename Cfg::Tile, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// A packed 2-D stride of CUTLASS's (rows, cols, batch) convention with leading dimension ld:
// the mode that is not the static unit stride gets ld, the batch mode 0 (one batch).
template <class S>
S ld_stride(int64_t ld) {
  S s{};
  if constexpr (is_static_v<std::remove_cv_t<std::remove_reference_t<decltype(get<0>(s))>>>) {
    get<1>(s) = ld;
  } else {
    get<0>(s) = ld;
  }
  if constexpr (!is_static_v<std::remove_cv_t<std::remove_reference_t<decltype(get<2>(s))>>>) {
    get<2>(s) = 0;
  }
  return s;
}

// ld_stride with batch stride `batch` (elements) instead of 0: batch l of the operand starts
// `l * batch` elements after the first.
template <class S>
S batch_stride(int64_t ld, int64_t batch) {
  S s = ld_stride<S>(ld);
  static_assert(!is_static_v<std::remove_cv_t<std::remove_reference_t<decltype(get<2>(s))>>>,
                "a batched operand needs a dynamic batch stride");
  get<2>(s) = batch;
  return s;
}

// Runs one GEMM of the definition `Def` (see det_gemm_sm90.h for the argument meaning), or
// `bt.count` of them in one batched launch.
// ws == nullptr with ws_bytes < 0: returns the workspace size in bytes instead of running.
template <class Def>
int64_t run_gemm(const rle_gemm_args* p, const Batch& bt = Batch{}) {
  using Gemm = typename Def::Gemm;
  using Kernel = typename Def::Kernel;
  using ElemIn = typename Kernel::ElementA;
  using ElemD = typename Kernel::ElementD;
  cutlass::KernelHardwareInfo hw;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    set_error("cudaGetDevice failed");
    return -1;
  }
  hw.device_id = dev;
  hw.sm_count = sm_count(dev);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p->m), static_cast<int>(p->n), static_cast<int>(p->k), 1},
      {static_cast<const ElemIn*>(p->a), ld_stride<typename Kernel::StrideA>(p->lda),
       static_cast<const ElemIn*>(p->b), ld_stride<typename Kernel::StrideB>(p->ldb)},
      {{},
       nullptr,
       ld_stride<typename Kernel::StrideC>(p->ldd),
       static_cast<ElemD*>(p->d),
       ld_stride<typename Kernel::StrideD>(p->ldd)},
      hw};
  if (bt.count != 1) {
    args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
    get<3>(args.problem_shape) = static_cast<int>(bt.count);
    args.mainloop.dA = batch_stride<typename Kernel::StrideA>(p->lda, bt.a);
    args.mainloop.dB = batch_stride<typename Kernel::StrideB>(p->ldb, bt.b);
    args.epilogue.dC = batch_stride<typename Kernel::StrideC>(p->ldd, bt.d);
    args.epilogue.dD = batch_stride<typename Kernel::StrideD>(p->ldd, bt.d);
  }
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  if constexpr (Def::kBias) {
    args.epilogue.thread.bias_ptr = static_cast<const ElemD*>(p->bias);
  }
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    set_error("CUTLASS cannot implement this problem (m=%lld n=%lld k=%lld lda=%lld ldb=%lld "
              "ldd=%lld): %s",
              (long long)p->m, (long long)p->n, (long long)p->k, (long long)p->lda,
              (long long)p->ldb, (long long)p->ldd, cutlass::cutlassGetStatusString(st));
    return -1;
  }
  size_t need = Gemm::get_workspace_size(args);
  if (p->workspace_bytes < 0) {
    return static_cast<int64_t>(need);
  }
  if (static_cast<size_t>(p->workspace_bytes) < need) {
    set_error("workspace of %lld bytes, need %zu", (long long)p->workspace_bytes, need);
    return -1;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(p->stream);
  st = gemm.initialize(args, p->workspace, stream);
  if (st != cutlass::Status::kSuccess) {
    set_error("CUTLASS initialize failed: %s (%s)", cutlass::cutlassGetStatusString(st),
              cudaGetErrorString(cudaGetLastError()));
    return -1;
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    set_error("CUTLASS run failed: %s (%s)", cutlass::cutlassGetStatusString(st),
              cudaGetErrorString(cudaGetLastError()));
    return -1;
  }
  return 0;
}

using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

// Calls f(C{}) with C the launch configuration RLE_CFG_* `cfg` names (an empty tag object; f
// takes it as `auto` and instantiates its GEMM for that type) and returns what f returns; an
// unknown `cfg`: -1 with the reason.
template <class F>
int64_t with_cfg(int cfg, F&& f) {
  switch (cfg) {
    case RLE_CFG_LARGE: return f(CfgLarge{});
    case RLE_CFG_MID: return f(CfgMid{});
    case RLE_CFG_SMALL: return f(CfgSmall{});
    case RLE_CFG_SQUARE: return f(CfgSquare{});
    case RLE_CFG_NARROW: return f(CfgNarrow{});
    case RLE_CFG_MID_K128: return f(CfgMidK128{});
    case RLE_CFG_SMALL_K128: return f(CfgSmallK128{});
    case RLE_CFG_LARGE192: return f(CfgLarge192{});
    case RLE_CFG_MID192: return f(CfgMid192{});
    case RLE_CFG_LARGE_C2: return f(CfgLargeC2{});
  }
  set_error("unknown config %d", cfg);
  return -1;
}

// One product (operand layouts, output element) of element type `E` at the launch config `cfg`
// (RLE_CFG_*); kSmall: whether the configs other than RLE_CFG_LARGE / _MID are built for it (not
// for the fp32 weight gradient).
template <class E, class LayoutA, class LayoutB, class ElemD, bool kSmall>
int64_t run_gemm_cfg(const rle_gemm_args* p, int cfg) {
  return with_cfg(cfg, [&](auto c) -> int64_t {
    using C = decltype(c);
    if constexpr (kSmall || std::is_same_v<C, CfgLarge> || std::is_same_v<C, CfgMid>) {
      return run_gemm<GemmDef<E, LayoutA, LayoutB, ElemD, C>>(p);
    } else {
      set_error("config %d is not built for the weight gradient (large, mid are)", cfg);
      return -1;
    }
  });
}

// The K slices of split-K: product `LayoutB` (ColMajor: RLE_NT, RowMajor: RLE_NN) with fp32
// output and no bias, batched over the slices, at the launch config `cfg` (every RLE_CFG_*).
template <class E, class LayoutB>
int64_t run_slices_cfg(const rle_gemm_args* p, int cfg, const Batch& bt) {
  return with_cfg(cfg, [&](auto c) -> int64_t {
    return run_gemm<GemmDef<E, RowMajor, LayoutB, float, decltype(c)>>(p, bt);
  });
}

// Defines gemm_<NAME>_nt_slices and _nn_slices (rle_det_gemm_sm90_batched's products) for the
// element type ELEM: gemm_bf16_slices.cu and gemm_fp16_slices.cu (their own translation units,
// built in parallel with the plain products).
#define RLE_DEFINE_SLICE_PRODUCTS(NAME, ELEM)                                            \
  int64_t gemm_##NAME##_nt_slices(const rle_gemm_args* p, int cfg, const Batch& bt) {   \
    return run_slices_cfg<ELEM, ColMajor>(p, cfg, bt);                                   \
  }                                                                                      \
  int64_t gemm_##NAME##_nn_slices(const rle_gemm_args* p, int cfg, const Batch& bt) {   \
    return run_slices_cfg<ELEM, RowMajor>(p, cfg, bt);                                   \
  }

// Defines gemm_<NAME>_nt, _nn and _wgrad (the products RLE_NT, RLE_NN, RLE_WGRAD of
// det_gemm_sm90.h, declared in det_gemm_internal.h) for the element type ELEM. gemm_bf16.cu and
// gemm_fp16.cu hold one each: one translation unit per element type, so that the two build in
// parallel.
#define RLE_DEFINE_PRODUCTS(NAME, ELEM)                                  \
  int64_t gemm_##NAME##_nt(const rle_gemm_args* p, int cfg) {            \
    return run_gemm_cfg<ELEM, RowMajor, ColMajor, ELEM, true>(p, cfg);   \
  }                                                                      \
  int64_t gemm_##NAME##_nn(const rle_gemm_args* p, int cfg) {            \
    return run_gemm_cfg<ELEM, RowMajor, RowMajor, ELEM, true>(p, cfg);   \
  }                                                                      \
  int64_t gemm_##NAME##_wgrad(const rle_gemm_args* p, int cfg) {         \
    return run_gemm_cfg<ELEM, ColMajor, RowMajor, float, false>(p, cfg); \
  }

}  // namespace rle
