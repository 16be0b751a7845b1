// The sm90a gather forward, warp-specialized: the keys of a CTA come from its key list (the gather
// path, gathered_keys.h), whose rows TMA cannot gather before Blackwell. Three warpgroups:
//  - the producer (warpgroup 0): all 128 threads gather each chunk's K rows, and a chunk later its
//    V rows, with 16-byte cp.async into mbarrier pipelines (CUTLASS's PipelineAsync, 3 K stages;
//    each thread's arrival, cp.async.mbarrier.arrive.noinc, fires when its copies have landed),
//    staging each chunk's keys and row keep bits with its K rows, and for a shared bias row its
//    values at the chunk's keys, released on a barrier of their own;
//  - two consumers of 64 query rows each, sharing the list and its gathered rows: the loop of
//    fwd_warp_specialized.h, with each chunk's logits masked by the staged row bits.
// Q is loaded by the consumers themselves, once.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>
#include <cstdint>
#include <type_traits>

#include "kernels/common/forward_epilogue.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/gathered_keys.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_fragments.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/warp_specialization.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// The dense warp-specialized kernel's tiles, MMAs and layouts (128 x 128 tiles at every head dim),
// with cp.async pipelines and the lists' staging in place of TMA and the bias row. kPackedHeads_
// = 2: the tile's 128 rows are 64 query rows of two query heads of one KV head (RowMap packing,
// ForwardParams::pack_group), which read one list of 64 rows, so each gathered K and V row serves
// twice the rows it serves with one head.
template <typename Element_, int kHeadDim_, int kPackedHeads_ = 1>
struct GatherForwardTraits : ForwardTraits<Element_, kHeadDim_, KvLoads::tma_producer> {
  using Base = ForwardTraits<Element_, kHeadDim_, KvLoads::tma_producer>;
  static constexpr int kPackedHeads = kPackedHeads_;
  static constexpr int kListRows = Base::kBlockM / kPackedHeads;
  // Gathers take longer to land than TMA tiles: K stages the producer can run ahead by, within
  // the SM's 227 KB (D128: Q 32 KB, K 3 x 32, V 2 x 32, staging 9).
  static constexpr int kStagesK = 3, kStagesV = kHeadDim_ <= 96 ? 3 : 2;
  using SmemLayoutK = typename Base::template SmemLayoutKOf<kStagesK>;
  using SmemLayoutVt = typename Base::template SmemLayoutVtOf<kStagesV>;
  using SmemLayoutV = typename Base::template SmemLayoutVOf<kStagesV>;
  using PipelineK = cutlass::PipelineAsync<kStagesK>;
  using PipelineV = cutlass::PipelineAsync<kStagesV>;
  // The bias values staged too: read from global memory after S, a chunk's values would wait on
  // their keys and then on L2 with the MMAs idle.
  using Keys = GatheredKeys<kListRows, Base::kBlockN, kStagesK, /*kStagesBias=*/true>;
  // The producer's copies: its 128 threads across rows of up to 64 elements.
  using GmemTiledCopyKV = typename GmemRowCopies<Element_, 128, Base::kGmemRowElems>::Async;
  // A producer thread holds row addresses and copy coordinates: more than the dense kernel's 24
  // registers (56 · 128 + 224 · 2 · 128 = 168 · 384, what the CTA launched with; see
  // warp_specialization.h). ptxas spilled less with the consumers at 224 than at 232 (producer
  // 40): D128 paired stack 80 -> 32 bytes, one head 72 -> 16, and the training top-2048 forward
  // took 7% less time (docs/architecture.md).
  static constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;

  struct SharedStorage {
    alignas(1024) cute::array<Element_, cute::cosize_v<typename Base::SmemLayoutQ>> q;
    alignas(1024) cute::array<Element_, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array<Element_, cute::cosize_v<SmemLayoutVt>> v;
    alignas(16) cute::array<std::uint32_t, Keys::kSmemBytes / 4> staging;  // a chunk's per K stage
    typename PipelineK::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
    // Per K stage: the producer's plain stores of the bias values are released by a plain arrival
    // here. On K's full barrier a thread arrives once, by its copies (.noinc); a second, plain
    // arrival of the same thread in the same phase is what compute-sanitizer's synccheck reports
    // as a missing wait.
    cutlass::arch::ClusterBarrier bias_full[kStagesK];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an SM offers a CTA");
};

// The chunks [begin, end) of the CTA's list that split `split` takes: an equal share.
struct ChunkShare {
  int begin, end;
  __device__ __forceinline__ ChunkShare(int chunks, int splits, int split) {
    const int per_split = (chunks + splits - 1) / splits;
    begin = min(chunks, split * per_split);
    end = min(chunks, begin + per_split);
  }
};

// The producer: per chunk c, K rows and staging of c, then V rows of c - 1 (the consumers read K
// of a chunk with V of the one before).
template <typename Traits>
__device__ __forceinline__ void produce_chunks(const ForwardParams& p, typename Traits::SharedStorage& storage,
                                               typename Traits::PipelineK& pipe_k, typename Traits::PipelineV& pipe_v,
                                               const typename Traits::Keys& list, ChunkShare share, int b, int h) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x;  // 0..127
  const int kv_h = h / (p.heads / p.kv_heads);
  typename Traits::GmemTiledCopyKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tKsK = gmem_thr.partition_D(  // (CPY, rows, cols, stage)
      as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{})));
  Tensor tVsV = gmem_thr.partition_D(
      as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutV{})));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  const Element* k_rows = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
  const Element* v_rows = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;

  auto state_k = cutlass::make_producer_start_state<typename Traits::PipelineK>();
  auto state_v = cutlass::make_producer_start_state<typename Traits::PipelineV>();
  // Rows of chunk c: the list's keys read from global memory (the staging is for the consumers).
  auto gather = [&](auto&& dst, int c, const Element* rows, std::int64_t row_stride) CUTLASS_LAMBDA_FUNC_INLINE {
    const int* keys = list.keys + c * kBlockN;
    copy_rows_by_pointer_async<Element>(dst, tKVcKV, list.count - c * kBlockN, p.head_dim,
                                        [&](int row) { return rows + __ldg(keys + row) * row_stride; });
  };
  auto load_v = [&](int c) CUTLASS_LAMBDA_FUNC_INLINE {
    pipe_v.producer_acquire(state_v);
    gather(tVsV(_, _, _, state_v.index()), c, v_rows, p.v_row_stride);
    cutlass::arch::cpasync_barrier_arrive_noinc(pipe_v.producer_get_barrier(state_v));
    ++state_v;
  };
  // A shared bias row's values at the chunks' keys go to the staging by plain loads and stores
  // (cp.async cannot copy 2 bytes, nor convert). Thread j takes key j of each chunk, and chunk c's
  // value is stored from a load issued during chunk c - 1, from the key loaded during chunk c - 2,
  // so that no store waits on a load: loading the key and the value and storing in a row held the
  // producer's next copies behind two waits (6% of the training top-2048 forward).
  static_assert(kBlockN == 128, "a key of each chunk per producer thread");
  const bool bias = list.bias_row != nullptr;
  auto key_at = [&](int c) CUTLASS_LAMBDA_FUNC_INLINE {  // key 0 past the list: loaded, never stored
    const int j = c * kBlockN + tid;
    return j < list.count ? __ldg(list.keys + j) : 0;
  };
  std::uint32_t bias_bits = bias && share.begin < share.end ? list.bias_bits_at(key_at(share.begin)) : 0;
  int next_key = bias ? key_at(share.begin + 1) : 0;
  for (int c = share.begin; c < share.end; ++c) {
    pipe_k.producer_acquire(state_k);
    gather(tKsK(_, _, _, state_k.index()), c, k_rows, p.k_row_stride);
    list.stage(c, tid, 128);  // into slot state_k.index(): list.first_chunk is share.begin
    cutlass::arch::cpasync_barrier_arrive_noinc(pipe_k.producer_get_barrier(state_k));
    if (bias) {
      if (c * kBlockN + tid < list.count) list.put_bias(c, tid, list.bias_from_bits(bias_bits));
      storage.bias_full[state_k.index()].arrive();
      bias_bits = list.bias_bits_at(next_key);  // chunk c + 1's
      next_key = key_at(c + 2);
    }
    ++state_k;
    if (c > share.begin) load_v(c - 1);
  }
  if (share.begin < share.end) load_v(share.end - 1);
}

// A consumer: warpgroup 1 or 2, query rows 64·(warpgroup - 1) of the tile, over the chunks of
// the share, in list order.
template <typename Traits>
__device__ __forceinline__ void consume_chunks(const ForwardParams& p, typename Traits::SharedStorage& storage,
                                               typename Traits::PipelineK& pipe_k, typename Traits::PipelineV& pipe_v,
                                               const typename Traits::Keys& list, ChunkShare share, int m_block,
                                               int h, int b, int split) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const ConsumerThreads threads;
  const int tid = threads.index();
  const WgmmaTurns turns{tid / 128};
  constexpr int kPacked = Traits::kPackedHeads;
  const RowMap rows{kPacked, h, p.seqlen_q * kPacked};  // h: the first of the tile's heads
  const int row0 = m_block * kBlockM;                     // in packed rows

  // Q by cp.async from both consumers, visible to wgmma once every consumer thread's copies have
  // landed and been fenced.
  {
    typename Traits::GmemTiledCopyQKV gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tid);
    Tensor tQsQ = gmem_thr.partition_D(as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{})));
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    if constexpr (kPacked == 1) {
      const Element* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      Tensor gQ = local_tile(make_tensor(make_gmem_ptr(q), make_shape(p.seqlen_q, p.head_dim), make_stride(p.q_row_stride, _1{})),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
      copy_rows_async(gmem_thr.partition_S(gQ), tQsQ, tQcQ, p.seqlen_q - row0, p.head_dim);
    } else {  // packed rows interleave the heads: a pointer per row
      copy_rows_by_pointer_async<Element>(tQsQ, tQcQ, rows.rows - row0, p.head_dim,
                                          rows.row_pointers<Element>(p.q, b * p.q_batch_stride, row0, p.q_row_stride,
                                                                     p.q_head_stride));
    }
    cp_async_fence();
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    threads.sync();
  }

  auto fragments = forward_fragments<Traits>(tid, storage.q.data(), storage.k.data(), storage.v.data());
  FDMA_NAME_FORWARD_FRAGMENTS(fragments);
  Tensor acc_s_rows = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
  Tensor acc_o_rows = make_tensor(acc_o.data(), accumulator_as_rows_cols(acc_o.layout()));

  const typename Traits::Policy policy(p, b, rows, row0, tScS);
  OnlineSoftmax<Traits::kRows> softmax;
  softmax.init();
  float correction[Traits::kRows];
  bool rescale_o = false;  // the last fold moved some row's reference max: O needs correction[]

  // Gathered rows are written by cp.async, through the generic proxy; wgmma reads through the
  // async proxy: a full barrier's completion orders the copies before this thread, and the
  // fence then orders them before its wgmmas.
  auto wait_full = [](auto& pipe, auto& state) CUTLASS_LAMBDA_FUNC_INLINE {
    pipe.consumer_wait(state);
    cutlass::arch::fence_view_async_shared();
  };
  // The chunk's logits, once its staged bias values (if any) are there; then K's stage goes back.
  auto apply = [&](auto kind, auto& state_k, int c) CUTLASS_LAMBDA_FUNC_INLINE {
    if (list.bias_row) storage.bias_full[state_k.index()].wait(state_k.phase());
    list.apply(kind, policy, acc_s, tScS, c);
    pipe_k.consumer_release(state_k);  // after apply(): the staged keys and bits share K's stage
    ++state_k;
  };

  // The loop is compiled once per logit kind, as the dense kernel's; a staged bias row is a kind.
  if (share.begin < share.end) policy.template with_logit_kind<BiasStaging::as_float>([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE {
    typename Traits::PipelineK::PipelineState state_k;
    typename Traits::PipelineV::PipelineState state_v;
    if (turns.self == 1) turns.pass();  // the first consumer takes the first turn

    int c = share.begin;
    wait_full(pipe_k, state_k);
    turns.wait();
    wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), acc_s);
    turns.pass();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    apply(kind, state_k, c);
    rescale_o = softmax.fold(acc_s_rows, correction);
    convert_fragment_into(acc_s, tOrP);

    for (++c; c < share.end; ++c) {
      wait_full(pipe_k, state_k);
      turns.wait();
      wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), acc_s);
      // No MMA writes O between S's issue and P·V's: the last chunk's rescale goes here.
      if (rescale_o) softmax.rescale(acc_o_rows, correction);
      wait_full(pipe_v, state_v);
      wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
      turns.pass();
      warpgroup_wait<1>();  // S of this chunk; the last chunk's P·V may still run
      warpgroup_fence_operand(acc_s);
      apply(kind, state_k, c);
      rescale_o = softmax.fold(acc_s_rows, correction);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      pipe_v.consumer_release(state_v);
      ++state_v;
      convert_fragment_into(acc_s, tOrP);
    }

    if (rescale_o) softmax.rescale(acc_o_rows, correction);
    wait_full(pipe_v, state_v);
    wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    pipe_v.consumer_release(state_v);
  }, list.bias_row != nullptr);

  // Each consumer's output rows overlay only its own rows of Q, which its last S = Q·Kᵀ has read.
  write_forward_output<Traits>(p, reinterpret_cast<char*>(storage.q.data()), mma_o, acc_o, tOcO, softmax, rows, row0,
                               b, split, threads);
}

// grid_head: the query head, or with packed heads the pair (its heads 2·grid_head and the next).
template <typename Traits>
__device__ __forceinline__ void forward_tile_gathered(const ForwardParams& p, char* smem, int m_block, int grid_head,
                                                      int b, int split) {
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const int warpgroup = threadIdx.x / 128;
  const int h = grid_head * Traits::kPackedHeads;  // the tile's first query head
  typename Traits::Keys list(p.lists, b, h, m_block * Traits::kListRows, reinterpret_cast<char*>(storage.staging.data()));
  const ChunkShare share(list.chunks(), p.num_splits, split);
  if (share.begin == share.end && p.num_splits == 1) {  // (an empty split writes a partial, below)
    const RowMap rows{Traits::kPackedHeads, h, p.seqlen_q * Traits::kPackedHeads};
    write_empty_output<typename Traits::Element, Traits::kBlockM>(p, rows, m_block * Traits::kBlockM, b);
    return;
  }
  list.first_chunk = share.begin;
  list.stage_bias_row(p, b, h);
  auto params = [&](auto* pipeline) {  // a null pointer names the pipeline type
    using Pipeline = std::remove_pointer_t<decltype(pipeline)>;
    typename Pipeline::Params pipe_params;
    pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.producer_arv_count = 128;
    pipe_params.consumer_arv_count = kConsumerThreads;
    return pipe_params;
  };
  typename Traits::PipelineK pipe_k(storage.pipeline_k, params(static_cast<typename Traits::PipelineK*>(nullptr)));
  typename Traits::PipelineV pipe_v(storage.pipeline_v, params(static_cast<typename Traits::PipelineV*>(nullptr)));
  if (list.bias_row && threadIdx.x == 0) {
    for (auto& barrier : storage.bias_full) barrier.init(128);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // every barrier initialized before anyone waits on or arrives at one

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    produce_chunks<Traits>(p, storage, pipe_k, pipe_v, list, share, b, h);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    consume_chunks<Traits>(p, storage, pipe_k, pipe_v, list, share, m_block, h, b, split);
  }
}

}  // namespace flash_dmattn::kernels::sm90
