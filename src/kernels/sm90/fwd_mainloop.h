// The sm90a forward for one (query tile, head, batch): the sm80 algorithm with wgmma. Two
// warpgroups own 64 query rows each; per active key tile, in descending order:
//   S = Q·Kᵀ  ->  z = softcap(scale·S) + bias, -inf where hidden  ->  P = exp(z - max)  ->  O += P·V
// where the P·V wgmma of the previous tile runs while this tile's mask, bias and softmax do
// (the MMA reads P from registers, so this tile's P goes to other registers, and the output is
// rescaled once the MMA is done). K of the next tile and V of this one load by cp.async behind
// the math into two stages each. The gather path runs the same loop over chunks of the CTA's
// key list (gathered_keys.h): the K and V rows of a chunk are gathered by cp.async, and each
// row's keep bits, staged with the chunk's keys, mask its logits.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/forward_epilogue.h"
#include "kernels/common/gathered_keys.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_fragments.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// The gather kernel's shared memory: the tiles' [Q][K][V], then the list's staged chunks.
template <typename Traits>
constexpr int gather_smem_bytes() {
  return Traits::kSmemBytes + GatheredKeys<Traits::kBlockM, Traits::kBlockN, kForwardGatherStages>::kSmemBytes;
}

// The host runs this kernel without GQA packing (pack_group = 1): a CTA serves one query head.
template <typename Traits, KeySource kSource>
__device__ __forceinline__ void forward_tile(const ForwardParams& p, char* smem, int m_block, int h, int b, int split) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x;
  const int kv_h = h / (p.heads / p.kv_heads);
  const RowMap rows{1, h, p.seqlen_q};
  const int row0 = m_block * kBlockM;

  auto global_rows = [&](const void* base, std::int64_t batch_stride, std::int64_t head_stride, std::int64_t row_stride,
                         int head, int length) {
    const Element* ptr = static_cast<const Element*>(base) + b * batch_stride + head * head_stride;
    return make_tensor(make_gmem_ptr(ptr), make_shape(length, p.head_dim), make_stride(row_stride, _1{}));
  };
  Tensor gQ = local_tile(global_rows(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, h, p.seqlen_q),
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(global_rows(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, kv_h, p.seqlen_k),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (kBlockN, D, key tiles)
  Tensor gV = local_tile(global_rows(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, kv_h, p.seqlen_k),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));

  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_q + cosize(typename Traits::SmemLayoutQ{});
  Element* smem_v = smem_k + cosize(typename Traits::SmemLayoutK{});
  auto fragments = forward_fragments<Traits>(tid, smem_q, smem_k, smem_v);
  FDMA_NAME_FORWARD_FRAGMENTS(fragments);
  Tensor acc_s_rows = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
  Tensor acc_o_rows = make_tensor(acc_o.data(), accumulator_as_rows_cols(acc_o.layout()));

  // Global -> shared copies, with the (row, column) of every vector for predication.
  typename Traits::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(
      as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{})));
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKsK = gmem_thr.partition_D(  // (CPY, rows, cols, stage)
      as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutK{})));
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(
      as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{})));
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  const typename Traits::Policy policy(p, b, rows, row0, tScS);
  copy_rows_async(tQgQ, tQsQ, tQcQ, p.seqlen_q - row0, p.head_dim);  // fenced with the first K
  OnlineSoftmax<Traits::kRows> softmax;
  softmax.init();
  float correction[Traits::kRows];

  // The loop over a key source, given as: the first key block (tile or chunk; -1: none),
  // after(n) (the next one, -1 past the last), load_k / load_v(n, stage) (cp.async, unfenced),
  // prepare(n) (issues the loads that logits() of n reads) and logits(acc_s, n).
  auto main_loop = [&](int n_block, auto&& after, auto&& load_k, auto&& load_v, auto&& prepare,
                       auto&& logits) CUTLASS_LAMBDA_FUNC_INLINE {
    if (n_block >= 0) load_k(n_block, 0);
    cp_async_fence();
    if (n_block < 0) return;
    // The first block: nothing to overlap its softmax with.
    int stage = 0;
    await_tiles();
    wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
    int next = after(n_block);
    load_v(n_block, stage);
    if (next >= 0) load_k(next, stage ^ 1);
    cp_async_fence();
    prepare(n_block);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    logits(acc_s, n_block);
    softmax.fold(acc_s_rows, correction);
    convert_fragment_into(acc_s, tOrP);

    while (next >= 0) {
      n_block = next;
      stage ^= 1;
      // K of this block and V of the last one landed; every warpgroup is done with the stages
      // that the next loads overwrite (its MMAs of the last iteration completed).
      await_tiles();
      // The MMAs first, so that the tensor cores start while this thread issues the loads: they
      // write the other stages (V of this block, K of the next).
      wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
      wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, stage ^ 1), acc_o);
      next = after(n_block);
      load_v(n_block, stage);
      if (next >= 0) load_k(next, stage ^ 1);
      cp_async_fence();
      prepare(n_block);
      warpgroup_wait<1>();  // S of this block; the last block's P·V may still run
      warpgroup_fence_operand(acc_s);
      logits(acc_s, n_block);
      const bool rescale_o = softmax.fold(acc_s_rows, correction);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      if (rescale_o) softmax.rescale(acc_o_rows, correction);
      convert_fragment_into(acc_s, tOrP);
    }

    await_tiles();  // V of the last block
    wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, stage), acc_o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
  };

  if constexpr (kSource == KeySource::lists) {
    // A split takes an equal share of the list's chunks, [begin, end). Chunk c's keys are staged
    // with the gather of chunk c - 1's K rows (slot c % 3: the slot of chunk c - 3, whose last
    // reader, chunk c - 3's V gather and logits, finished before chunk c - 2 began), so they have
    // landed by the barrier before chunk c - 1's iteration gathers K of chunk c.
    GatheredKeys<kBlockM, kBlockN, kForwardGatherStages> list(p.lists, b, h, row0, smem + Traits::kSmemBytes);
    const int per_split = (list.chunks() + p.num_splits - 1) / p.num_splits;
    const int begin = min(list.chunks(), split * per_split), end = min(list.chunks(), begin + per_split);
    const Element* k_rows = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
    const Element* v_rows = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;
    if (begin < end) {
      list.stage(begin, tid, Traits::kMmaThreads);
      cp_async_fence();
      cp_async_wait<0>();
      __syncthreads();
    }
    main_loop(
        begin < end ? begin : -1, [&](int c) CUTLASS_LAMBDA_FUNC_INLINE { return c + 1 < end ? c + 1 : -1; },
        [&](int c, int stage) CUTLASS_LAMBDA_FUNC_INLINE {
          list.load(tKsK(_, _, _, stage), tKVcKV, c, k_rows, p.k_row_stride, p.head_dim);
          if (c + 1 < end) list.stage(c + 1, tid, Traits::kMmaThreads);
        },
        [&](int c, int stage) CUTLASS_LAMBDA_FUNC_INLINE {
          list.load(tVsV(_, _, _, stage), tKVcKV, c, v_rows, p.v_row_stride, p.head_dim);
        },
        [](int) {},
        [&](auto& s, int c) CUTLASS_LAMBDA_FUNC_INLINE {
          policy.with_logit_kind([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE { list.apply(kind, policy, s, tScS, c); });
        });
  } else {
    typename Traits::Policy::TileInputs inputs;  // bias and mask bits of a tile, loaded while its S computes
    SplitTileWalk<typename Traits::Policy> tiles(policy, (p.seqlen_k + kBlockN - 1) / kBlockN, p.num_splits, split);
    bool elementwise = false;
    auto load = [&](auto& src, auto& dst, int n_block, int stage) CUTLASS_LAMBDA_FUNC_INLINE {
      copy_rows_async(src(_, _, _, n_block), dst(_, _, _, stage), tKVcKV, p.seqlen_k - n_block * kBlockN,
                      p.head_dim);
    };
    main_loop(
        tiles.first(), [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE { return tiles.at_or_below(n_block - 1); },
        [&](int n_block, int stage) CUTLASS_LAMBDA_FUNC_INLINE { load(tKgK, tKsK, n_block, stage); },
        [&](int n_block, int stage) CUTLASS_LAMBDA_FUNC_INLINE { load(tVgV, tVsV, n_block, stage); },
        [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
          elementwise = tiles.needs_elementwise(n_block);
          policy.load_inputs(inputs, tScS, n_block, elementwise);
        },
        [&](auto& s, int n_block) CUTLASS_LAMBDA_FUNC_INLINE { policy.apply(s, tScS, n_block, elementwise, inputs); });
  }

  // Epilogue. Q's shared memory becomes O's once every copy into it has landed and every
  // warpgroup is past its last read of Q.
  cp_async_wait<0>();
  __syncthreads();
  write_forward_output<Traits>(p, smem, mma_o, acc_o, tOcO, softmax, rows, row0, b, split);
}

}  // namespace flash_dmattn::kernels::sm90
