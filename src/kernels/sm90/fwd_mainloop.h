// The sm90a forward for one (query tile, head, batch): the sm80 algorithm with wgmma. Two
// warpgroups own 64 query rows each; per active key tile, in descending order:
//   S = Q·Kᵀ  ->  z = softcap(scale·S) + bias, -inf where hidden  ->  P = exp(z - max)  ->  O += P·V
// where the P·V wgmma of the previous tile runs while this tile's mask, bias and softmax do
// (the MMA reads P from registers, so this tile's P goes to other registers, and the output is
// rescaled once the MMA is done). K of the next tile and V of this one load by cp.async behind
// the math into two stages each.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/forward_epilogue.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_fragments.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// The host runs this kernel without GQA packing (pack_group = 1): a CTA serves one query head
// (only the gather forward packs heads).
template <typename Traits>
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
  auto [mma_s, mma_o, tSrQ, tSrK, tOrV, acc_s, acc_o, tOrP, tScS, tOcO] = forward_fragments<Traits>(tid, smem_q, smem_k, smem_v);
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
  typename Traits::Policy::TileInputs inputs;  // bias and mask bits of a tile, loaded while its S computes
  SplitTileWalk<typename Traits::Policy> tiles(policy, (p.seqlen_k + kBlockN - 1) / kBlockN, p.num_splits, split);
  OnlineSoftmax<Traits::kRows> softmax;
  softmax.init();
  float correction[Traits::kRows];

  auto load = [&](auto& src, auto& dst, int n_block, int stage) {
    copy_rows_async(src(_, _, _, n_block), dst(_, _, _, stage), tKVcKV, p.seqlen_k - n_block * kBlockN,
                    p.head_dim);
  };

  copy_rows_async(tQgQ, tQsQ, tQcQ, p.seqlen_q - row0, p.head_dim);
  int n_block = tiles.first();
  if (n_block >= 0) load(tKgK, tKsK, n_block, 0);
  cp_async_fence();

  if (n_block >= 0) {
    // The first tile: nothing to overlap its softmax with.
    int stage = 0;
    bool elementwise = tiles.needs_elementwise(n_block);
    await_tiles();
    wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
    int next = tiles.at_or_below(n_block - 1);
    load(tVgV, tVsV, n_block, stage);
    if (next >= 0) load(tKgK, tKsK, next, stage ^ 1);
    cp_async_fence();
    policy.load_inputs(inputs, tScS, n_block, elementwise);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    policy.apply(acc_s, tScS, n_block, elementwise, inputs);
    softmax.fold(acc_s_rows, correction);
    convert_fragment_into(acc_s, tOrP);

    while (next >= 0) {
      n_block = next;
      stage ^= 1;
      elementwise = tiles.needs_elementwise(n_block);
      // K of this tile and V of the last one landed; every warpgroup is done with the stages
      // that the next loads overwrite (its MMAs of the last iteration completed).
      await_tiles();
      // The MMAs first, so that the tensor cores start while this thread issues the loads: they
      // write the other stages (V of this tile, K of the next).
      wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
      wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, stage ^ 1), acc_o);
      next = tiles.at_or_below(n_block - 1);
      load(tVgV, tVsV, n_block, stage);
      if (next >= 0) load(tKgK, tKsK, next, stage ^ 1);
      cp_async_fence();
      policy.load_inputs(inputs, tScS, n_block, elementwise);
      warpgroup_wait<1>();  // S of this tile; the last tile's P·V may still run
      warpgroup_fence_operand(acc_s);
      policy.apply(acc_s, tScS, n_block, elementwise, inputs);
      const bool rescale_o = softmax.fold(acc_s_rows, correction);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      if (rescale_o) softmax.rescale(acc_o_rows, correction);
      convert_fragment_into(acc_s, tOrP);
    }

    await_tiles();  // V of the last tile
    wgmma_issue<false>(mma_o, tOrP, tOrV(_, _, _, stage), acc_o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
  }

  // Epilogue. Q's shared memory becomes O's once every copy into it has landed and every
  // warpgroup is past its last read of Q.
  cp_async_wait<0>();
  __syncthreads();
  write_forward_output<Traits>(p, smem, mma_o, acc_o, tOcO, softmax, rows, row0, b, split);
}

}  // namespace flash_dmattn::kernels::sm90
