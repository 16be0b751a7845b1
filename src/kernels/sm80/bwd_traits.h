// Tile shapes, shared-memory layouts and copy/MMA atoms of the sm80 (mma.sync) backward.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/common/gradient_stores.h"
#include "kernels/common/tile_copy.h"
#include "kernels/sm80/tile_size.h"

namespace flash_dmattn::kernels::sm80 {

// kPackedHeads > 1: the gather backward's tile of that many query heads' rows (gather_backward_tile).
template <typename Element_, int kHeadDim_, int kPackedHeads_ = 1>
struct BackwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kPackedHeads = kPackedHeads_;
  static constexpr BackwardTile kTile = kPackedHeads == 1 ? backward_tile(kHeadDim)
                                                          : gather_backward_tile(kHeadDim, kPackedHeads);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStages = kTile.double_buffer ? 2 : 1;

  using MmaAtom = cute::MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                                    cute::SM80_16x8x16_F32F16F16F32_TN,
                                                    cute::SM80_16x8x16_F32BF16BF16F32_TN>>;
  // A warp grid (rows x cols) per GEMM; every warp covers 16 x 16 of the output per step.
  template <int kWarpsRows>
  using WarpGridMma = cute::TiledMMA<MmaAtom,
                                     cute::Layout<cute::Shape<cute::Int<kWarpsRows>, cute::Int<kNWarps / kWarpsRows>, cute::_1>>,
                                     cute::Tile<cute::Int<16 * kWarpsRows>, cute::Int<16 * (kNWarps / kWarpsRows)>, cute::_16>>;
  using TiledMmaSdP = WarpGridMma<kTile.sdp_warps_m>;  // S = Q·Kᵀ and dP = dO·Vᵀ: (kBlockM, kBlockN)
  using TiledMmadKV = WarpGridMma<kTile.dkv_warps_n>;  // dV = Pᵀ·dO and dK = dSᵀ·Q: (kBlockN, D)
  using TiledMmadQ = WarpGridMma<kTile.dq_warps_m>;    // dQ = dS·K: (kBlockM, D)
  static_assert(kBlockM % (16 * kTile.sdp_warps_m) == 0 && kBlockN % (16 * (kNWarps / kTile.sdp_warps_m)) == 0,
                "the S/dP warp grid tiles (kBlockM, kBlockN) exactly");
  static_assert(kBlockN % (16 * kTile.dkv_warps_n) == 0 && kHeadDim % (16 * (kNWarps / kTile.dkv_warps_n)) == 0,
                "the dK/dV warp grid tiles (kBlockN, D) exactly");
  static_assert(kBlockM % (16 * kTile.dq_warps_m) == 0 && kHeadDim % (16 * (kNWarps / kTile.dq_warps_m)) == 0,
                "the dQ warp grid tiles (kBlockM, D) exactly");
  static constexpr int kSdpWarpsM = kTile.sdp_warps_m;
  static constexpr int kSdpWarpsN = kNWarps / kSdpWarpsM;

  // Shared-memory rows of 64 (or 32) elements with a swizzle that makes ldmatrix conflict-free.
  template <int kCols>
  using SwizzledAtom = decltype(cute::composition(
      cute::Swizzle<kCols % 64 == 0 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kCols % 64 == 0 ? 64 : 32>>,
                   cute::Stride<cute::Int<kCols % 64 == 0 ? 64 : 32>, cute::_1>>{}));
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;

  // Q and dO: (kBlockM, D) per stage; K and V: (kBlockN, D); P and dS: (kBlockM, kBlockN).
  using SmemLayoutQ = decltype(cute::tile_to_shape(SwizzledAtom<kHeadDim>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SwizzledAtom<kHeadDim>{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutPdS = decltype(cute::tile_to_shape(SwizzledAtom<kBlockN>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // Transposed views of the same bytes, the operands of the dK, dV and dQ GEMMs.
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutQtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutQt{}));
  using SmemLayoutKtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPdStNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutPdSt{}));

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomPdS = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global -> shared: 16-byte vectors across kBlockKSmem-element rows.
  using GmemTiledCopy = typename GmemRowCopies<Element, kNThreads, kBlockKSmem>::Async;

  static constexpr int kQElems = static_cast<int>(cute::cosize(SmemLayoutQ{}));
  static constexpr int kKVElems = static_cast<int>(cute::cosize(SmemLayoutKV{}));
  static constexpr int kPdSElems = static_cast<int>(cute::cosize(SmemLayoutPdS{}));
  // The CTA-wide reduction of dbias column sums: one float per (key, warp row).
  static constexpr int kReduceFloats = kBlockN * kSdpWarpsM;
  // dQ of a query tile staged in fp32 for bulk row reductions (StagedDqReduction), where the GPU
  // has the bulk-copy unit. Measured on an H200 against per-element reductions (dense-equivalent
  // with dbias): D = 128 8.65 against 9.25 ms, D = 64 6.19 against 6.29, but the D = 32 seed shape
  // 2.01 against 1.78 (128-byte rows). D > 128 would take the shared memory past an A100's 163 KB
  // per CTA (where the buffer goes unused).
  static constexpr bool kStagedDq = kHeadDim >= 64 && kHeadDim <= 128;
  static constexpr int kDqStagingFloats = kStagedDq ? StagedDqReduction<kBlockM, kHeadDim>::kFloats : 0;
  static constexpr int kSmemBytes =
      static_cast<int>((2 * kStages * kQElems + 2 * kKVElems + 2 * kPdSElems) * sizeof(Element)) +
      (kReduceFloats + kDqStagingFloats) * static_cast<int>(sizeof(float));
};

}  // namespace flash_dmattn::kernels::sm80
