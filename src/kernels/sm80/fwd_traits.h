// Tile shapes, shared-memory layouts and copy/MMA atoms of the sm80 (mma.sync) forward.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/common/tile_copy.h"
#include "kernels/sm80/tile_size.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Element_, int kHeadDim_>
struct ForwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr ForwardTile kTile = forward_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kNThreads = kNWarps * 32;

  // Shared-memory rows of 64 (or 32) elements with a swizzle that makes ldmatrix conflict-free.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;

  using MmaAtom = cute::MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                                    cute::SM80_16x8x16_F32F16F16F32_TN,
                                                    cute::SM80_16x8x16_F32BF16BF16F32_TN>>;
  // Warps split the query rows: warp w owns rows 16w..16w+15 of every 16·kNWarps-row slab.
  using TiledMma = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V read as (D, kBlockN) for P·V: the same bytes, viewed transposed.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;  // the output tile reuses Q's shared memory

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: 16-byte vectors across kBlockKSmem-element rows.
  using GmemTiledCopyQKV = typename GmemRowCopies<Element, kNThreads, kBlockKSmem>::Async;
  using GmemTiledCopyO = typename GmemRowCopies<Element, kNThreads, kBlockKSmem>::Vectors;

  static constexpr int kQBytes = static_cast<int>(cute::cosize(SmemLayoutQ{}) * sizeof(Element));
  static constexpr int kKVTileBytes = static_cast<int>(cute::cosize(SmemLayoutKV{}) * sizeof(Element));
  static constexpr int kSmemBytes = kQBytes + 2 * kKVTileBytes;

  // The decode loop's ring of K and V stages (KvPipeline::ring in fwd_mainloop.h; tile_size.h).
  static constexpr int kRingStages = ring_stages(kHeadDim);
  static constexpr int kRingSmemBytes = kQBytes + kRingStages * 2 * kKVTileBytes;
  static_assert(kRingSmemBytes == ring_smem_bytes(kHeadDim), "the host's count of the ring's shared memory");
  static constexpr bool kHasRing = has_ring(kHeadDim);
  static_assert(!kHasRing || kRingSmemBytes <= 163 * 1024, "the ring's stages exceed an A100 CTA's shared memory");

  // The ring whose warps split the keys (KvPipeline::ring_split_keys): every warp computes the one
  // 16-row slab of packed rows over its kWarpKeys keys of each tile, with a one-warp MMA; the
  // warps' partial outputs meet in shared memory at the end.
  static constexpr int kWarpKeys = kBlockN / kNWarps;
  static constexpr bool kHasSplitKeysRing = has_split_keys_ring(kHeadDim);
  using SlabMma = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>,
                                 cute::Tile<cute::_16, cute::_16, cute::_16>>;
};

}  // namespace flash_dmattn::kernels::sm80
