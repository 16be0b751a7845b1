// The sm80 forward for one (query tile, head, batch): stream the key tiles that have visible keys,
// keep an online softmax, write O and the LSE. The loop body is the algorithm:
//   S = Q·Kᵀ  ->  z = softcap(scale·S) + bias, -inf where hidden  ->  P = exp(z - max)  ->  O += P·V
// with K of the next active tile and V of the current one loaded by cp.async behind the math.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/params.h"
#include "kernels/sm80/fwd_traits.h"
#include "kernels/sm80/gemm.h"

namespace flash_dmattn::kernels::sm80 {

// Copies query rows global -> shared with cp.async; each row's address comes from the row map
// (packed rows of one tile belong to different heads). Rows past the end and head-dim columns
// at or past `head_dim` are zero-filled.
template <typename Element, typename TensorD, typename TensorC, typename RowPointer>
__device__ __forceinline__ void copy_q_rows_async(TensorD& dst, const TensorC& coords, int valid_rows, int head_dim,
                                                  RowPointer row_pointer) {
  using namespace cute;
  using Vector = cute::uint128_t;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    const int row = get<0>(coords(0, m, 0));
    const Element* src = row < valid_rows ? row_pointer(row) : nullptr;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      const int col = get<1>(coords(0, m, k));
      if (src && col < head_dim) {
        auto& dst_vector = *reinterpret_cast<Vector*>(raw_pointer_cast(dst(_, m, k).data()));
        SM80_CP_ASYNC_CACHEGLOBAL<Vector>::copy(*reinterpret_cast<const Vector*>(src + col), dst_vector);
      } else {
        clear(dst(_, m, k));
      }
    }
  }
}

template <typename Traits>
__device__ __forceinline__ void forward_tile(const ForwardParams& p, char* smem, int m_block, int grid_head, int b,
                                             int split) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x;
  const int group = p.heads / p.kv_heads;
  // With packing the grid's head index is the KV head; without, it is the query head.
  const int kv_h = p.pack_group > 1 ? grid_head : grid_head / group;
  const RowMap rows{p.pack_group, p.pack_group > 1 ? grid_head * p.pack_group : grid_head, p.seqlen_q * p.pack_group};
  const int row0 = m_block * kBlockM;        // first packed row of this tile
  const int tile_rows = rows.rows - row0;    // packed rows of this tile that exist (may exceed kBlockM)

  auto kv_global = [&](const void* base, std::int64_t batch_stride, std::int64_t head_stride, std::int64_t row_stride) {
    const Element* ptr = static_cast<const Element*>(base) + b * batch_stride + kv_h * head_stride;
    return make_tensor(make_gmem_ptr(ptr), make_shape(p.seqlen_k, p.head_dim), make_stride(row_stride, _1{}));
  };
  Tensor gK = local_tile(kv_global(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (kBlockN, D, key tiles)
  Tensor gV = local_tile(kv_global(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});

  // Global -> shared copies, with the (row, column) of every vector for predication.
  typename Traits::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(make_shape(size<0>(sQ), size<1>(sQ))));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(make_shape(size<0>(sK), size<1>(sK))));

  // MMA fragments and the shared -> register copies that feed them.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_v.partition_S(sVt);

  // (row, col) inside the tile of every element of S and O this thread holds.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rows = make_tensor(tOcO.data(), accumulator_as_rows_cols(tOcO.layout()));
  Tensor acc_o_rows = make_tensor(acc_o.data(), accumulator_as_rows_cols(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rows))::value;

  const MaskBiasPolicy<kBlockM, kBlockN, kRows> policy(p, b, rows, row0, tScS);
  ActiveTileWalk walk;
  OnlineSoftmax<kRows> softmax;
  softmax.init();

  // This split's share of the key tiles: [n_split_begin, n_split_end).
  const int n_tiles = (p.seqlen_k + kBlockN - 1) / kBlockN;
  const int tiles_per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int n_split_begin = split * tiles_per_split;
  const int n_split_end = min(n_tiles, n_split_begin + tiles_per_split);
  auto next_active = [&](int n) {
    const int next = walk.next_at_or_below(n, policy);
    return next >= n_split_begin ? next : -1;
  };
  auto load_kv = [&](auto& src, auto& dst, int n_block) {
    copy_rows_async(gmem_copy, src(_, _, _, n_block), dst, tKVcKV, p.seqlen_k - n_block * kBlockN, p.head_dim);
  };

  copy_q_rows_async<Element>(tQsQ, tQcQ, tile_rows, p.head_dim, [&](int row) {
    const int packed = row0 + row;
    return static_cast<const Element*>(p.q) + b * p.q_batch_stride + rows.offset(packed, p.q_row_stride, p.q_head_stride);
  });
  int n_block = next_active(min(policy.n_block_end(), n_split_end) - 1);
  if (n_block >= 0) load_kv(tKgK, tKsK, n_block);
  cp_async_fence();

  while (n_block >= 0) {
    const bool elementwise = walk.needs_elementwise(n_block);
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K of this tile has landed, and every warp is done reading the last V
    load_kv(tVgV, tVsV, n_block);
    cp_async_fence();

    gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);
    policy.apply(acc_s, tScS, n_block, elementwise);

    const int next = next_active(n_block - 1);
    cp_async_wait<0>();
    __syncthreads();  // V of this tile has landed, and every warp is done reading K
    if (next >= 0) load_kv(tKgK, tKsK, next);
    cp_async_fence();

    Tensor acc_s_rows = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
    softmax.update(acc_s_rows, acc_o_rows);
    Tensor probabilities = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(probabilities.data(), accumulator_as_a_operand(probabilities.layout()));
    gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_copy_v, smem_thr_v);
    n_block = next;
  }

  // Epilogue. Q's shared memory becomes O's once every copy into it has landed and every warp is
  // past its last read of Q (the loop's barriers, or this one when no tile was active).
  cp_async_wait<0>();
  __syncthreads();
  float lse[kRows];
  softmax.finalize(acc_o_rows, lse);

  if (p.num_splits > 1) {
    // A partial result: fp32 output straight from the accumulators, and LSE -inf for rows that
    // saw no visible key in this split, so that they weigh nothing in the combine.
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int packed = row0 + get<0>(tOcO_rows(r, 0));
      if (packed >= rows.rows) continue;
      const std::int64_t row = (std::int64_t(split) * p.batch + b) * p.heads * p.seqlen_q +
                               rows.offset(packed, 1, p.seqlen_q);
      if (get<1>(tOcO_rows(0, 0)) == 0) p.partial_lse[row] = lse[r] == INFINITY ? -INFINITY : lse[r];
      float* out = p.partial_out + row * p.head_dim;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o_rows); ++c) {
        const int col = get<1>(tOcO_rows(r, c));
        if (col < p.head_dim) out[col] = acc_o_rows(r, c);
      }
    }
    return;
  }

  // The quad's first thread (the one holding column 0) writes each row's LSE.
  if (get<1>(tOcO_rows(0, 0)) == 0) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int packed = row0 + get<0>(tOcO_rows(r, 0));
      if (packed < rows.rows) {
        p.lse[b * p.lse_batch_stride + rows.offset(packed, 1, p.lse_head_stride)] = lse[r];
      }
    }
  }

  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
  Tensor o_values = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
  copy(smem_copy_o, smem_thr_o.retile_S(o_values), smem_thr_o.partition_D(sO));
  __syncthreads();

  // Shared -> registers in 16-byte vectors, then each vector to its row's address.
  typename Traits::GmemTiledCopyO gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(tid);
  Tensor tOsO = gmem_thr_o.partition_S(sO);
  Tensor tOrO = make_tensor<Element>(shape(tOsO));
  copy(gmem_copy_o, tOsO, tOrO);
  Tensor tOcO_gmem = gmem_thr_o.partition_S(make_identity_tensor(make_shape(size<0>(sO), size<1>(sO))));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOrO); ++m) {
    const int packed = row0 + get<0>(tOcO_gmem(0, m, 0));
    if (packed >= rows.rows) continue;
    Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                   rows.offset(packed, p.out_row_stride, p.out_head_stride);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOrO); ++k) {
      const int col = get<1>(tOcO_gmem(0, m, k));
      if (col < p.head_dim) {
        *reinterpret_cast<cute::uint128_t*>(out + col) = *reinterpret_cast<const cute::uint128_t*>(&tOrO(0, m, k));
      }
    }
  }
}

}  // namespace flash_dmattn::kernels::sm80
