// The sm90a forward with TMA loads and warp specialization, for Q, K and V that TMA can address
// (fwd_kernel.h checks). Three warpgroups per CTA:
//  - the producer (warpgroup 0) walks the active key tiles exactly as the consumers do, and loads
//    Q once and the K and V tiles by TMA into two-stage mbarrier pipelines (CUTLASS's
//    PipelineTmaAsync); it gives its registers away;
//  - two consumers of 64 query rows each run the algorithm of fwd_mainloop.h on those tiles, with
//    no CTA-wide barrier per tile. They take turns issuing their wgmmas (two named barriers), so
//    that one's softmax runs while the other's GEMMs do.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "kernels/common/forward_epilogue.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_fragments.h"
#include "kernels/sm90/fwd_traits.h"
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

// Named barriers (ids past CUTLASS's reserved ones): the consumers' turns, and their meeting
// before the output leaves shared memory.
enum class ConsumerBarrier : std::uint32_t { turn_of_first = 0, turn_of_second = 1, output_staged = 2 };
inline constexpr int kConsumerThreads = 256;
inline constexpr int kProducerRegisters = 24;   // the producer's warpgroup after it gives registers away
inline constexpr int kConsumerRegisters = 240;  // 24·128 + 2·240·128 fits the 64K registers of an SM

// The consumers' epilogue threads: indexed from 0, meeting at a named barrier.
struct ConsumerThreads {
  __device__ __forceinline__ int index() const { return threadIdx.x - 128; }
  __device__ __forceinline__ void sync() const {
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, static_cast<std::uint32_t>(ConsumerBarrier::output_staged));
  }
};

// The consumers take turns issuing their GEMMs of a key tile: wait for this warpgroup's turn,
// issue, then hand the turn to the other.
struct WgmmaTurns {
  int self;  // 0 or 1: which consumer
  __device__ __forceinline__ void wait() const {
    cutlass::arch::NamedBarrier::sync(2 * 128, static_cast<std::uint32_t>(self));
  }
  __device__ __forceinline__ void pass() const {
    cutlass::arch::NamedBarrier::arrive(2 * 128, static_cast<std::uint32_t>(1 - self));
  }
};

template <typename Traits>
using KeyTiles = KeyTileClassifier<Traits::kBlockM, Traits::kBlockN>;

// The producer: warp 0 of warpgroup 0 walks the tiles (the walk needs a whole warp for its
// ballots); its lane 0 (the pipelines' leader) issues every TMA load.
template <typename Traits>
__device__ __forceinline__ void produce_tiles(const ForwardTmaParams<Traits>& params, typename Traits::SharedStorage& storage,
                                              typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                              int m_block, int h, int b, int split) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const ForwardParams& p = params.p;
  if (threadIdx.x >= 32) return;
  const bool leader = threadIdx.x == 0;
  const int kv_h = h / (p.heads / p.kv_heads);

  const KeyTiles<Traits> classifier(p, b, RowMap{1, h, p.seqlen_q}, m_block * kBlockM);
  SplitTileWalk<KeyTiles<Traits>> tiles(classifier, (p.seqlen_k + kBlockN - 1) / kBlockN, p.num_splits, split);
  int n_block = tiles.first();
  if (n_block < 0) return;

  Tensor mQ = params.q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads, p.batch));
  Tensor mK = params.k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.kv_heads, p.batch));
  Tensor mV = params.v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.kv_heads, p.batch));
  Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
  Tensor gK = local_tile(mK(_, _, kv_h, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
  Tensor gV = local_tile(mV(_, _, kv_h, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutV{});
  auto [tQgQ, tQsQ] = tma_partition(params.q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  // Plain variables, not structured bindings: the loads below are lambdas that capture them.
  auto k_slices = tma_partition(params.k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto v_slices = tma_partition(params.v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
  auto& tKgK = get<0>(k_slices);
  auto& tKsK = get<1>(k_slices);
  auto& tVgV = get<0>(v_slices);
  auto& tVsV = get<1>(v_slices);

  const std::uint16_t* bias_row = params.stage_bias ? static_cast<const std::uint16_t*>(p.bias.ptr) +
                                                          b * p.bias.batch_stride +
                                                          (h / p.bias.head_divisor) * p.bias.head_stride
                                                    : nullptr;
  auto state_k = cutlass::make_producer_start_state<typename Traits::Pipeline>();
  auto state_v = state_k;
  auto load_k = [&](int n) {
    if (leader) {
      pipe_k.producer_acquire(state_k);
      std::uint64_t* loaded = pipe_k.producer_get_barrier(state_k);
      copy(params.k.with(*loaded, 0), tKgK(_, n), tKsK(_, state_k.index()));
      if (params.stage_bias) {
        // The last tile copies only the keys before Sk and completes the rest of the bytes its
        // barrier expects itself; the consumers mask those keys.
        const int keys = min(kBlockN, p.seqlen_k - n * kBlockN);
        SM90_BULK_COPY_G2S::copy(bias_row + n * kBlockN, loaded, storage.bias.data() + state_k.index() * kBlockN,
                                 keys * 2);
        if (keys < kBlockN) {
          cutlass::arch::ClusterTransactionBarrier::complete_transaction(loaded, 0, (kBlockN - keys) * 2, 1);
        }
      }
    }
    ++state_k;
  };
  auto load_v = [&](int n) {
    if (leader) {
      pipe_v.producer_acquire(state_v);
      copy(params.v.with(*pipe_v.producer_get_barrier(state_v), 0), tVgV(_, n), tVsV(_, state_v.index()));
    }
    ++state_v;
  };

  if (leader) {
    storage.q_loaded.arrive_and_expect_tx(Traits::kBlockM * kHeadDim * sizeof(typename Traits::Element));
    copy(params.q.with(reinterpret_cast<std::uint64_t&>(storage.q_loaded), 0), tQgQ, tQsQ);
  }
  // The consumers read K of a tile, then V of the one before: K runs one tile ahead.
  load_k(n_block);
  while (n_block >= 0) {
    const int next = tiles.at_or_below(n_block - 1);
    if (next >= 0) load_k(next);
    load_v(n_block);
    n_block = next;
  }
}

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

  // Named references rather than a structured binding: the main loop below is a lambda, and
  // C++17 lambdas cannot capture structured bindings.
  auto fragments = forward_fragments<Traits>(tid, storage.q.data(), storage.k.data(), storage.v.data());
  auto& mma_s = get<0>(fragments);
  auto& mma_o = get<1>(fragments);
  auto& tSrQ = get<2>(fragments);
  auto& tSrK = get<3>(fragments);
  auto& tOrV = get<4>(fragments);
  auto& acc_s = get<5>(fragments);
  auto& acc_o = get<6>(fragments);
  auto& tOrP = get<7>(fragments);
  auto& tScS = get<8>(fragments);
  auto& tOcO = get<9>(fragments);
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
  if (n_block >= 0) policy.with_logit_kind([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE {
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
__device__ __forceinline__ void forward_tile_warp_specialized(const ForwardTmaParams<Traits>& params, char* smem,
                                                              int m_block, int h, int b, int split) {
  using Pipeline = typename Traits::Pipeline;
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const int warpgroup = threadIdx.x / 128;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kTileBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kConsumerThreads;
  Pipeline pipe_v(storage.pipeline_v, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  if (params.stage_bias) pipe_params.transaction_bytes += Traits::kBlockN * sizeof(std::uint16_t);
  Pipeline pipe_k(storage.pipeline_k, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  if (threadIdx.x == 0) {
    storage.q_loaded.init(1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // every barrier initialized before anyone waits on or arrives at one

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    produce_tiles<Traits>(params, storage, pipe_k, pipe_v, m_block, h, b, split);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    consume_tiles<Traits>(params.p, params.stage_bias, storage, pipe_k, pipe_v, m_block, h, b, split);
  }
}

}  // namespace flash_dmattn::kernels::sm90
