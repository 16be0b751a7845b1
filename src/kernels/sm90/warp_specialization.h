// The roles of a warp-specialized sm90a CTA, shared by the forward (fwd_warp_specialized.h) and the
// backward's dQ kernel (bwd_dq_mainloop.h): a producer warpgroup that walks the active key tiles
// and loads the query tile's rows once and K and V tiles by TMA into two-stage mbarrier pipelines
// (CUTLASS's PipelineTmaAsync), and two consumer warpgroups of 64 query rows that take turns
// issuing their GEMMs. Traits provide kBlockM, kBlockN, kHeadDim, Element, the K and V layouts and
// TMA types, Pipeline, kTileBytes, and a SharedStorage with k, v, bias, pipeline_k, pipeline_v and
// q_loaded.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cstdint>

#include "kernels/common/mask_bias.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels::sm90 {

// Named barriers (ids past CUTLASS's reserved ones): the consumers' turns, and their meeting
// before the output leaves shared memory.
enum class ConsumerBarrier : std::uint32_t { turn_of_first = 0, turn_of_second = 1, output_staged = 2 };
inline constexpr int kConsumerThreads = 256;
// The producer's warpgroup after it gives registers away, and the consumers'. setmaxnreg moves
// registers within what the CTA launched with, 168 per thread (384 threads, one CTA per SM):
// 24·128 + 2·240·128 = 168·384. A producer of 32 asks 1024 more, and a build with it hung (its
// GPU suite and bench did not finish; session 23, one H200), though ptxas spilled less there
// (D128 bf16: the TMA forward's stack 120 -> 96 bytes, the dQ kernel's 104 -> 72).
inline constexpr int kProducerRegisters = 24;
inline constexpr int kConsumerRegisters = 240;

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

// How the producer orders the K and V loads of the walk. The forward reads K of a tile and then V
// of the tile before, so K runs one tile ahead. The dQ kernel reads both of a tile at once and
// holds K until its dQ GEMM, issued with the next tile's: there K one tile ahead would wait for a
// stage that only the consumers' next tile frees, and that tile's V would queue behind it.
enum class KvOrder { k_ahead, together };

// What the producer loads K and V with; bias_row: the shared bias row whose values of each K tile
// go next to it (ForwardTmaParams::stage_bias), or null.
template <typename Traits>
struct KvLoadSource {
  const typename Traits::TmaK& k;
  const typename Traits::TmaV& v;
  const std::uint16_t* bias_row;
};

// One TMA load of query tile m_block of head h and batch b of a (B, Sq, H, D) tensor (Q or dO),
// or of packed sequences' (total_q, H, D) from the sequence's row q_row0, into `smem`, laid out
// as SmemLayout, on barrier `loaded`.
template <typename SmemLayout, int kBlockM, int kHeadDim, typename Tma, typename Element>
__device__ __forceinline__ void load_query_tile(const Tma& tma, const ForwardParams& p, Element* smem,
                                                std::uint64_t& loaded, int m_block, int h, int b) {
  using namespace cute;
  // Packed sequences: the packed rows as batch 0, the sequence's from q_row0 (for_sequence).
  const bool packed = p.cu_seqlens_q != nullptr;
  Tensor m = tma.get_tma_tensor(make_shape(packed ? p.total_q : p.seqlen_q, p.head_dim, p.heads, packed ? 1 : p.batch));
  Tensor g = local_tile(domain_offset(make_coord(p.q_row0, _0{}), m(_, _, h, packed ? 0 : b)),
                        Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
  Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
  auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  copy(tma.with(loaded, 0), tg, ts);
}

// The producer: warp 0 of warpgroup 0 walks the tiles (the walk needs a whole warp for its
// ballots); its lane 0 (the pipelines' leader) issues every TMA load: load_rows() once, when the
// walk has a tile (the query tile's rows on storage.q_loaded), then K and V in kOrder.
template <typename Traits, KvOrder kOrder, typename LoadRows>
__device__ __forceinline__ void produce_tiles(const ForwardParams& p, const KvLoadSource<Traits>& source,
                                              typename Traits::SharedStorage& storage,
                                              typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                              int m_block, int h, int b, int split, LoadRows&& load_rows) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  if (threadIdx.x >= 32) return;
  const bool leader = threadIdx.x == 0;
  const int kv_h = h / (p.heads / p.kv_heads);

  const KeyTiles<Traits> classifier(p, b, RowMap{1, h, p.seqlen_q}, m_block * kBlockM);
  SplitTileWalk<KeyTiles<Traits>> tiles(classifier, (p.seqlen_k + kBlockN - 1) / kBlockN, p.num_splits, split);
  int n_block = tiles.first();
  if (n_block < 0) return;

  const bool packed = p.cu_seqlens_q != nullptr;  // (as in load_query_tile, from k_row0)
  const int rows_k = packed ? p.total_k : p.seqlen_k, batches = packed ? 1 : p.batch, tma_b = packed ? 0 : b;
  Tensor mK = source.k.get_tma_tensor(make_shape(rows_k, p.head_dim, p.kv_heads, batches));
  Tensor mV = source.v.get_tma_tensor(make_shape(rows_k, p.head_dim, p.kv_heads, batches));
  Tensor gK = local_tile(domain_offset(make_coord(p.k_row0, _0{}), mK(_, _, kv_h, tma_b)),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
  Tensor gV = local_tile(domain_offset(make_coord(p.k_row0, _0{}), mV(_, _, kv_h, tma_b)),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutV{});
  // Plain variables, not structured bindings: the loads below are lambdas that capture them.
  auto k_slices = tma_partition(source.k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto v_slices = tma_partition(source.v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
  auto& tKgK = get<0>(k_slices);
  auto& tKsK = get<1>(k_slices);
  auto& tVgV = get<0>(v_slices);
  auto& tVsV = get<1>(v_slices);

  auto state_k = cutlass::make_producer_start_state<typename Traits::Pipeline>();
  auto state_v = state_k;
  auto load_k = [&](int n) {
    if (leader) {
      pipe_k.producer_acquire(state_k);
      std::uint64_t* loaded = pipe_k.producer_get_barrier(state_k);
      copy(source.k.with(*loaded, 0), tKgK(_, n), tKsK(_, state_k.index()));
      if (source.bias_row) {
        // The last tile copies only the keys before Sk and completes the rest of the bytes its
        // barrier expects itself; the consumers mask those keys. A bulk copy moves whole 16 bytes:
        // a packed sequence's Sk need not be a multiple of 8 keys, so its count is rounded up
        // (inside the bias row, whose length, the maximum, is: stageable_bias).
        const int keys = min(kBlockN, (p.seqlen_k - n * kBlockN + 7) / 8 * 8);
        SM90_BULK_COPY_G2S::copy(source.bias_row + n * kBlockN, loaded,
                                 storage.bias.data() + state_k.index() * kBlockN, keys * 2);
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
      copy(source.v.with(*pipe_v.producer_get_barrier(state_v), 0), tVgV(_, n), tVsV(_, state_v.index()));
    }
    ++state_v;
  };

  if (leader) load_rows();
  if constexpr (kOrder == KvOrder::k_ahead) load_k(n_block);
  while (n_block >= 0) {
    const int next = tiles.at_or_below(n_block - 1);
    if constexpr (kOrder == KvOrder::k_ahead) {
      if (next >= 0) load_k(next);
    } else {
      load_k(n_block);
    }
    load_v(n_block);
    n_block = next;
  }
}

// The CTA of a warp-specialized kernel: sets up the K and V pipelines (K's stages carry
// k_extra_bytes more than a tile, a staged bias row) and the query rows' barrier, then runs
// produce(pipe_k, pipe_v) in warpgroup 0, which gives its registers away, and consume(pipe_k,
// pipe_v) in the two others, which take them.
template <typename Traits, typename Produce, typename Consume>
__device__ __forceinline__ void run_warp_specialized(typename Traits::SharedStorage& storage,
                                                     std::uint32_t k_extra_bytes, Produce&& produce,
                                                     Consume&& consume) {
  using Pipeline = typename Traits::Pipeline;
  const int warpgroup = threadIdx.x / 128;
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kTileBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kConsumerThreads;
  Pipeline pipe_v(storage.pipeline_v, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  pipe_params.transaction_bytes += k_extra_bytes;
  Pipeline pipe_k(storage.pipeline_k, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  if (threadIdx.x == 0) {
    storage.q_loaded.init(1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // every barrier initialized before anyone waits on or arrives at one

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    produce(pipe_k, pipe_v);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    consume(pipe_k, pipe_v);
  }
}

}  // namespace flash_dmattn::kernels::sm90
