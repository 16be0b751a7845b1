// Tile shapes, shared-memory layouts and MMA/copy atoms of the sm90a (wgmma) backward.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>
#include <cstdint>
#include <type_traits>

#include "kernels/common/tile_copy.h"
#include "kernels/sm90/smem_atom.h"
#include "kernels/sm90/tile_size.h"
#include "kernels/sm90/tma_rows.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Element_, int kHeadDim_, DqBy kDqBy_ = DqBy::key_tiles>
struct BackwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr DqBy kDqBy = kDqBy_;
  static constexpr BackwardTile kTile = backward_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarpgroups = kTile.warpgroups;
  static constexpr int kNThreads = kWarpgroups * 128;
  static constexpr int kStages = 2;  // Q and dO of the next query tile load while this one computes
  static constexpr bool kSplitKeys = kTile.split == WarpgroupSplit::keys;
  static_assert(kSplitKeys ? kBlockM == 64 && kBlockN == 64 * kWarpgroups : kBlockM == 64 * kWarpgroups && kBlockN == 64,
                "a warpgroup per 64 keys (keys split) or per 64 query rows (query-rows split)");
  // The head-dim columns of one warpgroup's dK and dV, and of its dQ.
  static constexpr int kDkvCols = kSplitKeys ? kHeadDim : kHeadDim / kWarpgroups;
  static constexpr int kDqCols = kSplitKeys ? kHeadDim / kWarpgroups : kHeadDim;

  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kWarpgroups>, cute::_1, cute::_1>>;
  using WarpgroupsAlongN = cute::Layout<cute::Shape<cute::_1, cute::Int<kWarpgroups>, cute::_1>>;
  // S and dP (queries, keys) and dQ (queries, D): the warpgroups take different keys or head-dim
  // columns (keys split), or different query rows.
  using ByQueryTile = std::conditional_t<kSplitKeys, WarpgroupsAlongN, WarpgroupsAlongM>;
  // dK and dV (keys, D): different keys, or different head-dim columns (query-rows split).
  using ByKeyTile = std::conditional_t<kSplitKeys, WarpgroupsAlongM, WarpgroupsAlongN>;
  // S = Q·Kᵀ and dP = dO·Vᵀ, (queries, keys) over D: 64 x 64 per warpgroup.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_64, cute::Int<kHeadDim>>>(),
      ByQueryTile{}));
  // dV += Pᵀ·dO and dK += dSᵀ·Q, (keys, D) over queries. Both operands are read transposed from
  // shared memory (MN-major).
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kDkvCols>, cute::Int<kBlockM>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      ByKeyTile{}));
  // dQ = dS·K, (queries, D) over keys; K is read transposed (MN-major).
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kDqCols>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      ByQueryTile{}));

  // dBias sums of a bias shared by the query rows (bias_grad_mma.h): (64 keys, 8) over a
  // warpgroup's 64 query rows, dZᵀ by ones, one warpgroup per MMA.
  using TiledMmadBias = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_8, cute::_64>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::K>()));

  // Q and dO: (kBlockM, D, stage), the K-major A operands of S and dP; the same bytes viewed as
  // (D, kBlockM, stage) are the MN-major B operands of dK and dV, of which a warpgroup may read
  // some of the head-dim columns: the swizzle atom is at most that wide, so that they start on one.
  using SmemLayoutQ = decltype(cute::tile_to_shape(smem_atom<Element, kDkvCols, cute::GMMA::Major::K>(),
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                                       cute::make_stride(cute::Int<kBlockM>{}, cute::_1{}, cute::Int<kBlockM * kHeadDim>{}))));
  // K: (kBlockN, D), the K-major B operand of S; viewed as (D, kBlockN), the MN-major B operand
  // of dQ, whose head-dim columns a warpgroup reads (the same rule for the swizzle atom).
  using SmemLayoutK = decltype(cute::tile_to_shape(smem_atom<Element, kDqCols, cute::GMMA::Major::K>(),
                                                   cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                       cute::make_stride(cute::Int<kBlockN>{}, cute::_1{}))));
  using SmemLayoutV = decltype(cute::tile_to_shape(smem_atom<Element, kHeadDim, cute::GMMA::Major::K>(),
                                                   cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // P and dS: stored as (kBlockN, kBlockM), the MN-major A operands of dV and dK (a warpgroup
  // reads 64 keys); viewed as (kBlockM, kBlockN), what the softmax writes and dS's K-major A
  // operand of dQ.
  using SmemLayoutPdSt = decltype(cute::tile_to_shape(smem_atom<Element, 64, cute::GMMA::Major::MN>(),
                                                      cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}));
  using SmemLayoutPdS = decltype(cute::composition(
      SmemLayoutPdSt{}, cute::make_layout(cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{},
                                          cute::make_stride(cute::Int<kBlockN>{}, cute::_1{}))));

  // The ones of the dBias MMA: (8, 64), K-major.
  using SmemLayoutOnes = decltype(cute::tile_to_shape(smem_atom<Element, 64, cute::GMMA::Major::K>(),
                                                      cute::Shape<cute::_8, cute::_64>{}));

  // P and dS go to shared memory by stmatrix: four 8 x 8 blocks per instruction.
  using SmemCopyAtomPdS = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;
  // Global -> shared: 16-byte vectors across rows of up to 64 elements.
  static constexpr int kGmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  using GmemTiledCopy = typename GmemRowCopies<Element, kNThreads, kGmemRowElems>::Async;

  static constexpr int kQElems = static_cast<int>(cute::cosize(SmemLayoutQ{}));  // both stages
  static constexpr int kKElems = static_cast<int>(cute::cosize(SmemLayoutK{}));
  static constexpr int kVElems = static_cast<int>(cute::cosize(SmemLayoutV{}));
  static constexpr int kPdSElems = static_cast<int>(cute::cosize(SmemLayoutPdSt{}));  // also dZ's, under softcap
  static constexpr int kOnesElems = static_cast<int>(cute::cosize(SmemLayoutOnes{}));
  // The per-key dBias sums (bias_grad_mma.h) leave one partial per warpgroup that sums the same
  // keys: one (keys split), or one per warpgroup (query-rows split). The CTA-wide reduction of
  // them takes one float per (key, partial).
  static constexpr int kColumnPartials = kSplitKeys ? 1 : kWarpgroups;
  static constexpr int kReduceFloats = kBlockN * kColumnPartials;
  // Then an mbarrier per Q/dO stage (bwd_q_do_loads.h).
  static constexpr int kBarrierOffset =
      static_cast<int>((2 * kQElems + kKElems + kVElems + 3 * kPdSElems + kOnesElems) * sizeof(Element)) +
      kReduceFloats * static_cast<int>(sizeof(float));
  static_assert(kBarrierOffset % 8 == 0, "mbarriers are 8-byte aligned");
  static constexpr int kSmemBytes = kBarrierOffset + kStages * static_cast<int>(sizeof(std::uint64_t));

  // TMA loads of one Q or dO stage, when TMA can address both (bwd_kernel.h).
  using TmaQdO = TmaRows<Element, decltype(cute::take<0, 2>(SmemLayoutQ{})), kBlockM, kHeadDim>;
};

}  // namespace flash_dmattn::kernels::sm90
