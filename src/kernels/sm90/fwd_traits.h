// Tile shapes, shared-memory layouts and MMA/copy atoms of the sm90a (wgmma) forward.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernels/common/mask_bias.h"
#include "kernels/common/tile_copy.h"
#include "kernels/sm90/smem_atom.h"
#include "kernels/sm90/tile_size.h"
#include "kernels/sm90/tma_rows.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Element_, int kHeadDim_, KvLoads kLoads_>
struct ForwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr KvLoads kLoads = kLoads_;
  static constexpr sm80::ForwardTile kTile = forward_tile(kHeadDim, kLoads);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kMmaThreads = kTile.warps * 32;  // the warpgroups that compute
  // With TMA, one more warpgroup issues the loads.
  static constexpr int kNThreads = kMmaThreads + (kLoads == KvLoads::tma_producer ? 128 : 0);
  static constexpr int kStages = 2;  // K and V tiles in flight: the next one loads while this one computes
  static_assert(kBlockM == 64 * (kMmaThreads / 128), "one warpgroup per 64 query rows");
  // A thread's part of a warpgroup's 64 x kBlockN accumulator: 2 rows, kBlockN / 4 columns.
  static constexpr int kRows = 2, kCols = kBlockN / 4;
  using Policy = MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols>;

  using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;  // S = Q·Kᵀ (M, N, K)
  using TileO = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;  // O += P·V (M, N, K)
  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kBlockM / 64>, cute::_1, cute::_1>>;
  // S: both operands from shared memory. O: P from registers (the accumulator of S, converted),
  // V from shared memory as stored, keys by head dim: for the B operand (head dim x keys) that is
  // MN-major.
  using TiledMmaS = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<Element, Element, float, TileS>(),
                                                  WarpgroupsAlongM{}));
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileO, cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpgroupsAlongM{}));

  using SmemLayoutQ = decltype(cute::tile_to_shape(smem_atom<Element, kHeadDim, cute::GMMA::Major::K>(),
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  // K and V tiles in shared memory, `stages` of each (the gather forward keeps more of K).
  template <int kStagesOf>
  using SmemLayoutKOf = decltype(cute::tile_to_shape(
      smem_atom<Element, kHeadDim, cute::GMMA::Major::K>(),
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStagesOf>>{}));
  // V as the P·V product reads it, (D, kBlockN, stage), and the same bytes as the loads write
  // them, (kBlockN, D, stage).
  template <int kStagesOf>
  using SmemLayoutVtOf = decltype(cute::tile_to_shape(
      smem_atom<Element, kHeadDim, cute::GMMA::Major::MN>(),
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStagesOf>>{}, cute::Step<cute::_2, cute::_1, cute::_3>{}));
  template <int kStagesOf>
  using SmemLayoutVOf = decltype(cute::composition(
      SmemLayoutVtOf<kStagesOf>{}, cute::Layout<cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStagesOf>>,
                                                cute::Stride<cute::Int<kHeadDim>, cute::_1, cute::Int<kHeadDim * kBlockN>>>{}));
  using SmemLayoutK = SmemLayoutKOf<kStages>;
  using SmemLayoutVt = SmemLayoutVtOf<kStages>;
  using SmemLayoutV = SmemLayoutVOf<kStages>;
  using SmemLayoutO = SmemLayoutQ;  // the output tile reuses Q's shared memory

  using SmemCopyAtomO = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: 16-byte vectors across rows of up to 64 elements.
  static constexpr int kGmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  using GmemTiledCopyQKV = typename GmemRowCopies<Element, kMmaThreads, kGmemRowElems>::Async;
  using GmemTiledCopyO = typename GmemRowCopies<Element, kMmaThreads, kGmemRowElems>::Vectors;

  // TMA loads of Q, K and V tiles; one descriptor each, built on the host (fwd_kernel.h).
  using TmaQ = TmaRows<Element, SmemLayoutQ, kBlockM, kHeadDim>;
  using TmaK = TmaRows<Element, decltype(cute::take<0, 2>(SmemLayoutK{})), kBlockN, kHeadDim>;
  using TmaV = TmaRows<Element, decltype(cute::take<0, 2>(SmemLayoutV{})), kBlockN, kHeadDim>;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr std::uint32_t kTileBytes = kBlockN * kHeadDim * sizeof(Element);  // one K or V stage

  struct SharedStorage {
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutVt>> v;
    // A shared bias row's values of each K stage's keys, where the producer stages them.
    alignas(128) cute::array<std::uint16_t, kBlockN * kStages> bias;
    typename Pipeline::SharedStorage pipeline_k, pipeline_v;
    cutlass::arch::ClusterTransactionBarrier q_loaded;
  };

  static constexpr int kSmemBytes =
      kLoads == KvLoads::tma_producer
          ? static_cast<int>(sizeof(SharedStorage))
          : static_cast<int>((cute::cosize(SmemLayoutQ{}) + cute::cosize(SmemLayoutK{}) + cute::cosize(SmemLayoutVt{})) *
                             sizeof(Element));
};

}  // namespace flash_dmattn::kernels::sm90
