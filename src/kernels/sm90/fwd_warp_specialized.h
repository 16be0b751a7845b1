// The sm90a forward with TMA loads and warp specialization, for Q, K and V that TMA can address
// (fwd_kernel.h checks). Three warpgroups per CTA (warp_specialization.h):
//  - the producer (warpgroup 0) walks the active key tiles exactly as the consumers do, and loads
//    Q once and the K and V tiles by TMA into two-stage mbarrier pipelines (CUTLASS's
//    PipelineTmaAsync), K one tile ahead of V; it gives its registers away;
//  - two consumers of 64 query rows each run the algorithm of fwd_mainloop.h on those tiles, with
//    no CTA-wide barrier per tile. They take turns issuing their wgmmas (two named barriers), so
//    that one's softmax runs while the other's GEMMs do.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/forward_epilogue.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_fragments.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/warp_specialization.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// What the kernel takes: the plain parameters and a TMA descriptor for each of Q, K and V.
// stage_bias: the bias is one 16-bit row per (batch, head) shared by every query row, with keys
// contiguous and 16-byte aligned rows and lengths (Sk % 8 == 0); the producer then copies each K
// tile's bias values next to it (a bulk copy on K's barrier), and the consumers read them from
// shared memory instead of global memory.
template <typename Traits>
struct ForwardTmaParams {
  ForwardParams p;
  typename Traits::TmaQ q;
  typename Traits::TmaK k;
  typename Traits::TmaV v;
  bool stage_bias;
};

// A consumer: warpgroup 1 or 2, query rows 64·(warpgroup - 1) of the tile. Per active key tile, in
// descending order:
//   S = Q·Kᵀ  ->  z = softcap(scale·S) + bias, -inf where hidden  ->  P = exp(z - max)  ->  O += P·V
// where the P·V wgmma of the previous tile runs while this tile's mask, bias and softmax do.
template <typename Traits>
__device__ __forceinline__ void consume_tiles(const ForwardParams& p, bool stage_bias,
                                              typename Traits::SharedStorage& storage,
                                              typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                              int m_block, int h, int b, int split) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  const ConsumerThreads threads;
  const int tid = threads.index();
  const WgmmaTurns turns{tid / 128};
  const RowMap rows{1, h, p.seqlen_q};
  const int row0 = m_block * kBlockM;

  auto fragments = forward_fragments<Traits>(tid, storage.q.data(), storage.k.data(), storage.v.data());
  FDMA_NAME_FORWARD_FRAGMENTS(fragments);
  Tensor acc_s_rows = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
  Tensor acc_o_rows = make_tensor(acc_o.data(), accumulator_as_rows_cols(acc_o.layout()));

  const typename Traits::Policy policy(p, b, rows, row0, tScS);
  typename Traits::Policy::TileInputs inputs;
  SplitTileWalk<typename Traits::Policy> tiles(policy, (p.seqlen_k + kBlockN - 1) / kBlockN, p.num_splits, split);
  auto staged_bias = [&](int stage) { return stage_bias ? storage.bias.data() + stage * kBlockN : nullptr; };
  OnlineSoftmax<Traits::kRows> softmax;
  softmax.init();
  float correction[Traits::kRows];
  bool rescale_o = false;  // the last fold moved some row's reference max: O needs correction[]

  int n_block = tiles.first();
  // The loop is compiled once per logit kind (LogitKind in mask_bias.h), each copy needing the
  // registers of its kind alone.
  if (n_block >= 0) policy.template with_logit_kind<BiasStaging::sixteen_bit>([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE {
    typename Traits::Pipeline::PipelineState state_k, state_v;
    // The first consumer takes the first turn.
    if (turns.self == 1) turns.pass();
    storage.q_loaded.wait(0);

    // The first tile: nothing to overlap its softmax with.
    bool elementwise = tiles.needs_elementwise(n_block);
    pipe_k.consumer_wait(state_k);
    turns.wait();
    wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), acc_s);
    turns.pass();
    policy.load_inputs(kind, inputs, tScS, n_block, elementwise, staged_bias(state_k.index()));
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    policy.apply(kind, acc_s, tScS, n_block, elementwise, inputs);
    pipe_k.consumer_release(state_k);  // after apply(): a staged bias row shares K's stage
    ++state_k;
    rescale_o = softmax.fold(acc_s_rows, correction);
    convert_fragment_into(acc_s, tOrP);

    for (int next = tiles.at_or_below(n_block - 1); next >= 0; next = tiles.at_or_below(n_block - 1)) {
      n_block = next;
      elementwise = tiles.needs_elementwise(n_block);
      pipe_k.consumer_wait(state_k);
      turns.wait();
      wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), acc_s);
      // No MMA writes O between S's issue and P·V's: the last tile's rescale goes here.
      if (rescale_o) softmax.rescale(acc_o_rows, correction);
      pipe_v.consumer_wait(state_v);
      wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
      turns.pass();
      policy.load_inputs(kind, inputs, tScS, n_block, elementwise, staged_bias(state_k.index()));
      warpgroup_wait<1>();  // S of this tile; the last tile's P·V may still run
      warpgroup_fence_operand(acc_s);
      policy.apply(kind, acc_s, tScS, n_block, elementwise, inputs);
      pipe_k.consumer_release(state_k);
      ++state_k;
      rescale_o = softmax.fold(acc_s_rows, correction);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      pipe_v.consumer_release(state_v);
      ++state_v;
      convert_fragment_into(acc_s, tOrP);
    }

    if (rescale_o) softmax.rescale(acc_o_rows, correction);
    pipe_v.consumer_wait(state_v);
    wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    pipe_v.consumer_release(state_v);
  }, stage_bias);

  // Each consumer's output rows overlay only its own rows of Q, which its last S = Q·Kᵀ has read.
  write_forward_output<Traits>(p, reinterpret_cast<char*>(storage.q.data()), mma_o, acc_o, tOcO, softmax, rows, row0,
                               b, split, threads);
}

template <typename Traits>
__device__ __forceinline__ void forward_tile_warp_specialized(const ForwardTmaParams<Traits>& params,
                                                              const ForwardParams& p, char* smem, int m_block, int h,
                                                              int b, int split) {
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const std::uint32_t bias_bytes = params.stage_bias ? Traits::kBlockN * sizeof(std::uint16_t) : 0;
  run_warp_specialized<Traits>(
      storage, bias_bytes,
      [&](typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v) CUTLASS_LAMBDA_FUNC_INLINE {
        const std::uint16_t* bias_row =
            params.stage_bias ? static_cast<const std::uint16_t*>(p.bias.ptr) + b * p.bias.batch_stride +
                                    (h / p.bias.head_divisor) * p.bias.head_stride
                              : nullptr;
        auto load_q = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
          auto& loaded = reinterpret_cast<std::uint64_t&>(storage.q_loaded);
          storage.q_loaded.arrive_and_expect_tx(Traits::kBlockM * Traits::kHeadDim * sizeof(typename Traits::Element));
          load_query_tile<typename Traits::SmemLayoutQ, Traits::kBlockM, Traits::kHeadDim>(
              params.q, p, storage.q.data(), loaded, m_block, h, b);
        };
        produce_tiles<Traits, KvOrder::k_ahead>(p, KvLoadSource<Traits>{params.k, params.v, bias_row}, storage, pipe_k,
                                                pipe_v, m_block, h, b, split, load_q);
      },
      [&](typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v) CUTLASS_LAMBDA_FUNC_INLINE {
        consume_tiles<Traits>(p, params.stage_bias, storage, pipe_k, pipe_v, m_block, h, b, split);
      });
}

}  // namespace flash_dmattn::kernels::sm90
