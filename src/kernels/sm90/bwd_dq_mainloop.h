// The sm90a dQ kernel for one (query tile, query head, batch): dQ of the tile's 128 rows stays in
// the registers of two consumer warpgroups while they walk the key tiles the forward walks, so that
// each element of dQ is summed in one fixed order by one thread and written once, with no
// reduction through memory. The key-tile kernel (bwd_mainloop.h) then leaves dQ out: this is how
// the deterministic mode gets dQ without a slot per key split. Per active key tile, in descending
// order:
//   S = Q·Kᵀ, dP = dO·Vᵀ  ->  P = exp(z - LSE), dS = P∘(dP - Δ)·(1 - tanh²)  ->  dQ += dS·K
// where the dQ wgmma of a tile is issued with the next tile's S and dP and runs while the next
// tile's mask and bias values load. K, V, Q and dO arrive by TMA from a producer warpgroup
// (warp_specialization.h), K and V of a tile together; K's stage is released once the dQ wgmma
// that reads it completed.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/backward_scores.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/gradient_stores.h"
#include "kernels/common/mask_bias.h"
#include "kernels/params.h"
#include "kernels/sm90/bwd_dq_traits.h"
#include "kernels/sm90/warp_specialization.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// What the dQ kernel takes: the backward's parameters and TMA descriptors of Q, dO, K and V.
template <typename Traits>
struct DqTmaParams {
  BackwardParams p;
  typename Traits::TmaQ q, dout;
  typename Traits::TmaK k, v;
};

template <typename Traits>
__device__ __forceinline__ void consume_dq_tiles(const BackwardParams& p, typename Traits::SharedStorage& storage,
                                                 typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                                 int m_block, int h, int b) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
  using TileDq = Shape<Int<kBlockM>, Int<kHeadDim>>;
  const ForwardParams& f = p.fwd;
  const int tid = ConsumerThreads{}.index();
  const WgmmaTurns turns{tid / 128};
  const int row0 = m_block * kBlockM;

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  auto smem = [](Element* ptr, auto layout) { return make_tensor(make_smem_ptr(ptr), layout); };
  Tensor tSrQ = thr_sdp.partition_fragment_A(smem(storage.q.data(), typename Traits::SmemLayoutQ{}));
  Tensor tdPrdO = thr_sdp.partition_fragment_A(smem(storage.dout.data(), typename Traits::SmemLayoutQ{}));
  Tensor tSrK = thr_sdp.partition_fragment_B(smem(storage.k.data(), typename Traits::SmemLayoutK{}));    // (.., stage)
  Tensor tdPrV = thr_sdp.partition_fragment_B(smem(storage.v.data(), typename Traits::SmemLayoutV{}));   // (.., stage)
  Tensor tdQrKt = thr_dq.partition_fragment_B(smem(storage.k.data(), typename Traits::SmemLayoutKt{}));  // (.., stage)
  Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
  Tensor acc_dq = partition_fragment_C(mma_dq, TileDq{});
  clear(acc_dq);
  Tensor tdQrdS = make_tensor<Element>(accumulator_as_a_operand(acc_s.layout()));  // dS, the A operand of dQ
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(TileS{}));
  Tensor tScS_rc = make_tensor(tScS.data(), accumulator_as_rows_cols(tScS.layout()));

  const typename Traits::Policy policy(f, b, RowMap{1, h, f.seqlen_q}, row0, tScS);
  typename Traits::Policy::TileInputs inputs;
  SplitTileWalk<typename Traits::Policy> tiles(policy, (f.seqlen_k + kBlockN - 1) / kBlockN, 1, 0);
  BackwardRowStats<Traits::kRows> stats;
  stats.load(p, b, h, row0, tScS_rc);
  SoftcapGrads<Traits::kRows, Traits::kCols> cap;

  int n_block = tiles.first();
  if (n_block >= 0) {
    typename Traits::Pipeline::PipelineState state_k, state_v, previous_k;
    bool dq_pending = false;  // the last tile's dS waits in tdQrdS for its dQ wgmma
    if (turns.self == 1) turns.pass();  // the first consumer takes the first turn
    storage.q_loaded.wait(0);
    for (; n_block >= 0; n_block = tiles.at_or_below(n_block - 1)) {
      const bool elementwise = tiles.needs_elementwise(n_block);
      pipe_k.consumer_wait(state_k);
      pipe_v.consumer_wait(state_v);
      turns.wait();
      if (dq_pending) wgmma_issue<false>(mma_dq, tdQrdS, tdQrKt(_, _, _, previous_k.index()), acc_dq);
      wgmma_issue<true>(mma_sdp, tSrQ, tSrK(_, _, _, state_k.index()), acc_s);
      wgmma_issue<true>(mma_sdp, tdPrdO, tdPrV(_, _, _, state_v.index()), acc_dp);
      turns.pass();
      policy.load_inputs(inputs, tScS, n_block, elementwise);
      warpgroup_wait<1>();  // the last tile's dQ and this tile's S; dP may still run
      warpgroup_fence_operand(acc_s);
      if (dq_pending) pipe_k.consumer_release(previous_k);
      probabilities(policy, inputs, n_block, elementwise, stats, acc_s, tScS, cap);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dp);
      pipe_v.consumer_release(state_v);
      ++state_v;
      logit_gradients(stats, acc_s, acc_dp);
      apply_softcap_grads(f.softcap, acc_dp, cap);
      convert_fragment_into(acc_dp, tdQrdS);
      previous_k = state_k;
      ++state_k;
      dq_pending = true;
    }
    turns.wait();
    wgmma_issue<false>(mma_dq, tdQrdS, tdQrKt(_, _, _, previous_k.index()), acc_dq);
    turns.pass();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dq);
    pipe_k.consumer_release(previous_k);
  }

  // Rows with no visible key (no active tile at all included) write zeros.
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(TileDq{}));
  Element* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + row0 * p.dq_row_stride;
  store_rows<Element>(acc_dq, tdQcdQ, dq, p.dq_row_stride, f.seqlen_q - row0, f.head_dim, f.scale);
}

// `p`: the call's params, or for packed sequences batch b's (for_sequence), which the TMA loads
// offset by (load_query_tile, produce_tiles).
template <typename Traits>
__device__ __forceinline__ void dq_tile(const DqTmaParams<Traits>& params, const BackwardParams& p, char* smem,
                                        int m_block, int h, int b) {
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const ForwardParams& f = p.fwd;
  run_warp_specialized<Traits>(
      storage, 0,
      [&](typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v) CUTLASS_LAMBDA_FUNC_INLINE {
        auto load_q_do = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
          auto& loaded = reinterpret_cast<std::uint64_t&>(storage.q_loaded);
          storage.q_loaded.arrive_and_expect_tx(Traits::kRowsBytes);
          using Layout = typename Traits::SmemLayoutQ;
          load_query_tile<Layout, Traits::kBlockM, Traits::kHeadDim>(params.q, f, storage.q.data(), loaded, m_block, h, b);
          load_query_tile<Layout, Traits::kBlockM, Traits::kHeadDim>(params.dout, f, storage.dout.data(), loaded,
                                                                       m_block, h, b);
        };
        produce_tiles<Traits, KvOrder::together>(f, KvLoadSource<Traits>{params.k, params.v, nullptr}, storage, pipe_k,
                                                 pipe_v, m_block, h, b, 0, load_q_do);
      },
      [&](typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v) CUTLASS_LAMBDA_FUNC_INLINE {
        consume_dq_tiles<Traits>(p, storage, pipe_k, pipe_v, m_block, h, b);
      });
}

}  // namespace flash_dmattn::kernels::sm90
