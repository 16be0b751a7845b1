// Tile shapes, shared-memory layouts and MMA atoms of the sm90a dQ kernel (bwd_dq_mainloop.h): a
// CTA per query tile of 128 rows, walking key tiles of 64.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>
#include <cstdint>

#include "kernels/common/mask_bias.h"
#include "kernels/sm90/smem_atom.h"
#include "kernels/sm90/tma_rows.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Element_, int kHeadDim_>
struct DqTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // Two consumer warpgroups of 64 rows. A thread holds 64 x D / 128 dQ accumulators, S and dP of
  // 64 keys (32 each) and dS as the A operand of the next dQ GEMM (16): 64-key tiles leave room
  // for the mask/bias state under the consumers' 240 registers, 128 would not.
  static constexpr int kBlockM = 128, kBlockN = 64;
  static constexpr int kNThreads = 3 * 128;  // a producer and two consumers (warp_specialization.h)
  static constexpr int kStages = 2;
  static constexpr int kRows = 2, kCols = kBlockN / 4;  // a thread's part of a 64 x kBlockN accumulator
  using Policy = MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols>;

  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;
  // S = Q·Kᵀ and dP = dO·Vᵀ, (queries, keys) over D: both operands from shared memory.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      WarpgroupsAlongM{}));
  // dQ += dS·K, (queries, D) over keys: dS from registers (S's accumulator layout, converted), K
  // from shared memory as stored, keys by head dim, which for the B operand is MN-major.
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpgroupsAlongM{}));

  // Q and dO: (kBlockM, D), the K-major A operands of S and dP.
  using SmemLayoutQ = decltype(cute::tile_to_shape(smem_atom<Element, kHeadDim, cute::GMMA::Major::K>(),
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  // K and V: (kBlockN, D, stage), the K-major B operands of S and dP; K viewed as (D, kBlockN,
  // stage) is the MN-major B operand of dQ.
  using SmemLayoutK = decltype(cute::tile_to_shape(
      smem_atom<Element, kHeadDim, cute::GMMA::Major::K>(),
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                                       cute::make_stride(cute::Int<kBlockN>{}, cute::_1{},
                                                         cute::Int<kBlockN * kHeadDim>{}))));

  using TmaQ = TmaRows<Element, SmemLayoutQ, kBlockM, kHeadDim>;  // Q and dO
  using TmaK = TmaRows<Element, decltype(cute::take<0, 2>(SmemLayoutK{})), kBlockN, kHeadDim>;
  using TmaV = TmaK;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr std::uint32_t kTileBytes = kBlockN * kHeadDim * sizeof(Element);  // one K or V stage
  static constexpr std::uint32_t kRowsBytes = 2 * kBlockM * kHeadDim * sizeof(Element);  // Q and dO

  struct SharedStorage {
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array<Element, cute::cosize_v<SmemLayoutV>> v;
    alignas(16) cute::array<std::uint16_t, 8> bias;  // never staged here (KvLoadSource::bias_row is null)
    typename Pipeline::SharedStorage pipeline_k, pipeline_v;
    cutlass::arch::ClusterTransactionBarrier q_loaded;  // Q and dO
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
};

}  // namespace flash_dmattn::kernels::sm90
