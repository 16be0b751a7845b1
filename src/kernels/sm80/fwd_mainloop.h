// The sm80 forward for one (query tile, head, batch): stream the key tiles that have visible keys,
// keep an online softmax, write O and the LSE. The loop body is the algorithm:
//   S = Q·Kᵀ  ->  z = softcap(scale·S) + bias, -inf where hidden  ->  P = exp(z - max)  ->  O += P·V
// with K of the next active tile and V of the current one loaded by cp.async behind the math, or
// for a decode, whose few rows leave little math to hide a load behind, with a ring of K and V
// stages several tiles ahead (KvPipeline). The gather path runs the same steps over chunks of the CTA's key list (gathered_keys.h) instead
// of key tiles, a split over its share of the chunks, with the next chunk's K and V rows gathered
// into a second buffer behind the math.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/forward_epilogue.h"
#include "kernels/common/gathered_keys.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm80/fwd_traits.h"
#include "kernels/sm80/gemm.h"

namespace flash_dmattn::kernels::sm80 {

// The gather path's shared memory past the tiles' [Q][K][V]: a second K/V buffer [K'][V'], then
// the list's staged keys and row bits (kForwardGatherStages chunks of them).

template <typename Traits>
constexpr int gather_staging_offset() {
  return Traits::kSmemBytes + 2 * static_cast<int>(cute::cosize(typename Traits::SmemLayoutKV{}) *
                                                   sizeof(typename Traits::Element));
}

template <typename Traits>
constexpr int gather_smem_bytes() {
  return gather_staging_offset<Traits>() + GatheredKeys<Traits::kBlockM, Traits::kBlockN, kForwardGatherStages>::kSmemBytes;
}

// The end of the ring whose warps split the keys (KvPipeline::ring_split_keys): warps 1.. hand
// their part of the slab's rows (reference max, sum and output, each over the warp's keys) to warp
// 0 through `exchange` (shared memory free once every K/V stage has been read), which rescales
// every part to the largest reference and sums them. All warps hold the slab in one fragment
// layout (the one-warp MMA's), so a thread reads what the threads of its lane wrote. o: the (rows,
// cols) view of the output accumulator.
template <int kWarps, int kRows, typename TensorO>
__device__ __forceinline__ void merge_key_shares(float* exchange, TensorO& o, OnlineSoftmax<kRows>& softmax) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(o))::value;
  constexpr int kFloats = kRows * (kCols + 2);  // what a thread hands over
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto slot = [&](int from_warp, int i) -> float& { return exchange[((from_warp - 1) * kFloats + i) * 32 + lane]; };
  if (warp > 0) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      slot(warp, r) = softmax.row_max[r];
      slot(warp, kRows + r) = softmax.row_sum[r];
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) slot(warp, 2 * kRows + r * kCols + c) = o(r, c);
    }
  }
  __syncthreads();
  if (warp != 0) return;
  // A part whose reference is -inf saw no visible key: it weighs 0 (its sum and output are 0).
  auto weight = [](float part_max, float merged_max) {
    return part_max == -INFINITY ? 0.f : exp2f((part_max - merged_max) * kLog2e);
  };
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float merged = softmax.row_max[r];
    CUTE_UNROLL
    for (int w = 1; w < kWarps; ++w) merged = fmaxf(merged, slot(w, r));
    const float own = weight(softmax.row_max[r], merged);
    softmax.row_max[r] = merged;
    softmax.row_sum[r] *= own;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) o(r, c) *= own;
    CUTE_UNROLL
    for (int w = 1; w < kWarps; ++w) {
      const float part = weight(slot(w, r), merged);
      softmax.row_sum[r] += part * slot(w, kRows + r);
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) o(r, c) += part * slot(w, 2 * kRows + r * kCols + c);
    }
  }
}

template <typename Traits, KeySource kSource, KvPipeline kPipeline = KvPipeline::two_phase>
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
  Tensor acc_o_rows = make_tensor(acc_o.data(), accumulator_as_rows_cols(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rows))::value;
  // With the warps splitting the keys, warp w's one-warp MMA computes the slab's rows over its
  // share of each tile's keys, [w, w + 1) · kWarpKeys: its S elements sit there in the tile.
  [[maybe_unused]] typename Traits::SlabMma slab_mma;
  [[maybe_unused]] auto slab_thr = slab_mma.get_thread_slice(tid % 32);
  const auto tScS_policy = [&] {
    if constexpr (kPipeline == KvPipeline::ring_split_keys) {
      return slab_thr.partition_C(
          local_tile(make_identity_tensor(Shape<_16, Int<kBlockN>>{}), Shape<_16, Int<Traits::kWarpKeys>>{},
                     make_coord(0, tid / 32)));
    } else {
      return tScS;
    }
  }();
  constexpr int kCols =
      decltype(size<1>(make_tensor(tScS_policy.data(), accumulator_as_rows_cols(tScS_policy.layout()))))::value;

  // The decode ring reads a bool mask's bytes where the host built no summary (MaskReads). Not
  // the row ring: the branch cost it 80 bytes of spills (ptxas, D128 bf16).
  constexpr MaskReads kMaskReads =
      kPipeline == KvPipeline::ring_split_keys ? MaskReads::bytes_or_summary : MaskReads::summary;
  using Policy = MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols, kMaskReads>;
  const Policy policy(p, b, rows, row0, tScS_policy);
  SplitTileWalk<Policy> tiles(policy, (p.seqlen_k + kBlockN - 1) / kBlockN, p.num_splits, split);
  OnlineSoftmax<kRows> softmax;
  softmax.init();

  copy_rows_by_pointer_async<Element>(tQsQ, tQcQ, tile_rows, p.head_dim, [&](int row) {
    const int packed = row0 + row;
    return static_cast<const Element*>(p.q) + b * p.q_batch_stride + rows.offset(packed, p.q_row_stride, p.q_head_stride);
  });
  // K or V rows of key tile n_block into dst: rows past the keys zero-filled; in the ring, a paged
  // cache's rows each from its page (every visible tile's first key lies in a page the block table
  // names). Only the ring reads pages: the branch cost the two-phase kernel stack (ptxas, D128
  // bf16: 16 -> 80 bytes).
  auto load_kv = [&](const auto& tiles_g, const void* base, std::int64_t page_stride, std::int64_t row_stride,
                     std::int64_t head_stride, auto&& dst, int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
    const int valid_rows = p.seqlen_k - n_block * kBlockN;
    if constexpr (kPipeline != KvPipeline::two_phase) {
      if (p.block_table != nullptr) {
        const int* pages = p.block_table + b * p.block_table_stride;
        const Element* rows_h = static_cast<const Element*>(base) + kv_h * head_stride;
        // Serving engines' pages hold a power of two of keys: a shift and a mask then place a row,
        // where an integer division per row sat on the ring's issue path.
        if ((p.page_size & (p.page_size - 1)) == 0) {
          const int shift = __ffs(p.page_size) - 1;
          copy_rows_by_pointer_async<Element>(dst, tKVcKV, valid_rows, p.head_dim, [&](int row) {
            const int key = n_block * kBlockN + row;
            return rows_h + pages[key >> shift] * page_stride + (key & (p.page_size - 1)) * row_stride;
          });
        } else {
          copy_rows_by_pointer_async<Element>(dst, tKVcKV, valid_rows, p.head_dim, [&](int row) {
            const int key = n_block * kBlockN + row;
            return rows_h + pages[key / p.page_size] * page_stride + (key % p.page_size) * row_stride;
          });
        }
        return;
      }
    }
    copy_rows_async(tiles_g(_, _, _, n_block), dst, tKVcKV, valid_rows, p.head_dim);
  };
  auto load_k = [&](int n_block, auto&& dst) CUTLASS_LAMBDA_FUNC_INLINE {
    load_kv(tKgK, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, dst, n_block);
  };
  auto load_v = [&](int n_block, auto&& dst) CUTLASS_LAMBDA_FUNC_INLINE {
    load_kv(tVgV, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, dst, n_block);
  };

  // Warp w owns rows 16w..16w+15. A warp whose rows are all past the tile's end (a packed decode
  // tile holds a handful of rows) skips the MMAs and the softmax but keeps loading and meeting
  // the barriers: the MMAs of the padding rows were half of the decode time.
  static_assert(kBlockM == 16 * Traits::kNWarps, "one 16-row slab per warp");
  const bool warp_has_rows = kPipeline == KvPipeline::ring_split_keys || threadIdx.x / 32 * 16 < tile_rows;

  // The two halves of a step, on the K and V tiles in shared memory that tSsK_ and tOsVt_ read.
  // S = Q·Kᵀ, turned into logits by mask_logits(acc_s):
  auto scores = [&](auto& acc_s, const auto& tSsK_, auto&& mask_logits) CUTLASS_LAMBDA_FUNC_INLINE {
    clear(acc_s);
    gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK_, tiled_mma, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);
    mask_logits(acc_s);
  };
  // The online softmax over them, and O += P·V by pv(P):
  auto accumulate_by = [&](auto& acc_s, auto&& pv) CUTLASS_LAMBDA_FUNC_INLINE {
    Tensor acc_s_rows = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
    softmax.update(acc_s_rows, acc_o_rows);
    Tensor probabilities = convert_fragment<Element>(acc_s);
    pv(make_tensor(probabilities.data(), accumulator_as_a_operand(probabilities.layout())));
  };
  // ... where P·V is the CTA's MMA over the whole tile:
  auto accumulate = [&](auto& acc_s, const auto& tOsVt_) CUTLASS_LAMBDA_FUNC_INLINE {
    accumulate_by(acc_s, [&](const auto& tOrP) CUTLASS_LAMBDA_FUNC_INLINE {
      gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt_, tiled_mma, smem_copy_v, smem_thr_v);
    });
  };

  if constexpr (kSource == KeySource::lists) {
    // Chunks of the CTA's key list. A split takes an equal share of them, [begin, end): splitting
    // the kept keys, not the key span, is what spreads a decode over the GPU. Gathered rows come
    // from anywhere in K and V, so each chunk would wait a full memory latency for its K rows and
    // another for its V rows: instead chunk c + 1's K and V rows are gathered into the second
    // K/V buffer while chunk c computes (its keys were staged a chunk earlier still), and each
    // chunk waits once, behind the previous one's math.
    GatheredKeys<kBlockM, kBlockN, kForwardGatherStages> list(p.lists, b, rows.head(row0), rows.query(row0),
                                                       smem + gather_staging_offset<Traits>());
    const int per_split = (list.chunks() + p.num_splits - 1) / p.num_splits;
    const int begin = min(list.chunks(), split * per_split), end = min(list.chunks(), begin + per_split);
    const Element* k_rows = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
    const Element* v_rows = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;
    // Chunk c's K and V tiles: the second buffer lies 2 * size(sK) elements past the first.
    constexpr int kBuffer = 2 * decltype(size(sK))::value;
    auto gather_kv = [&](int c) CUTLASS_LAMBDA_FUNC_INLINE {
      auto k_dst = at_stage(tKsK, c % 2, kBuffer);
      auto v_dst = at_stage(tVsV, c % 2, kBuffer);
      list.load(k_dst, tKVcKV, c, k_rows, p.k_row_stride, p.head_dim);
      list.load(v_dst, tKVcKV, c, v_rows, p.v_row_stride, p.head_dim);
    };
    if (begin < end) {
      list.stage(begin, tid, Traits::kNThreads);  // a chunk's keys land before its rows are gathered
      cp_async_fence();
      cp_async_wait<0>();
      __syncthreads();
      gather_kv(begin);
      if (begin + 1 < end) list.stage(begin + 1, tid, Traits::kNThreads);
      cp_async_fence();
      cp_async_wait<0>();
      __syncthreads();
    }
    for (int c = begin; c < end; ++c) {
      // Buffer (c + 1) % 2 and staging slot (c + 2) % 3 were last read by chunk c - 1, before the
      // barrier that ended it; chunk c + 1's keys landed at that barrier.
      if (c + 1 < end) gather_kv(c + 1);
      if (c + 2 < end) list.stage(c + 2, tid, Traits::kNThreads);
      cp_async_fence();
      if (warp_has_rows) {
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        scores(acc_s, at_stage(tSsK, c % 2, kBuffer), [&](auto& s) CUTLASS_LAMBDA_FUNC_INLINE {
          policy.with_logit_kind([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE { list.apply(kind, policy, s, tScS, c); });
        });
        accumulate(acc_s, at_stage(tOsVt, c % 2, kBuffer));
      }
      cp_async_wait<0>();
      __syncthreads();  // chunk c + 1's rows and chunk c + 2's keys have landed; chunk c is read
    }
  } else if constexpr (kPipeline != KvPipeline::two_phase) {
    // Tile i of the walk lands in stage i % kStages; the loop's step i waits for it and then
    // issues tile i + kStages - 1 into the stage step i - 1 read. step(stage, n_block,
    // elementwise, inputs) computes the tile in `stage`.
    constexpr int kStages = Traits::kRingStages;
    constexpr int kStageElems = 2 * decltype(size(sK))::value;  // from one stage's K (and V) to the next's
    auto run_ring = [&](auto&& step) CUTLASS_LAMBDA_FUNC_INLINE {
      struct Pending {
        int n_block;  // -1: past the walk's end
        bool elementwise;
      };
      Pending pending[kStages - 1];
      int next = tiles.first(), issued = 0;
      auto issue_next = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        const Pending tile{next, next >= 0 && tiles.needs_elementwise(next)};  // (valid until the walk moves)
        if (next >= 0) {
          const int stage = issued % kStages;
          load_k(next, at_stage(tKsK, stage, kStageElems));
          load_v(next, at_stage(tVsV, stage, kStageElems));
          next = tiles.at_or_below(next - 1);
        }
        cp_async_fence();  // an empty group too: the waits below count groups
        ++issued;
        return tile;
      };
      CUTE_UNROLL
      for (int s = 0; s < kStages - 1; ++s) pending[s] = issue_next();
      for (int stage = 0; pending[0].n_block >= 0; stage = stage + 1 == kStages ? 0 : stage + 1) {
        const Pending tile = pending[0];
        typename Policy::TileInputs inputs;
        if (warp_has_rows) policy.load_inputs(inputs, tScS_policy, tile.n_block, tile.elementwise);
        cp_async_wait<kStages - 2>();
        __syncthreads();  // this tile's K and V have landed; every warp is done reading the stage refilled next
        CUTE_UNROLL
        for (int s = 0; s + 2 < kStages; ++s) pending[s] = pending[s + 1];
        pending[kStages - 2] = issue_next();
        if (warp_has_rows) step(stage, tile.n_block, tile.elementwise, inputs);
      }
    };
    if constexpr (kPipeline == KvPipeline::ring) {
      run_ring([&](int stage, int n_block, bool elementwise, const auto& inputs) CUTLASS_LAMBDA_FUNC_INLINE {
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        scores(acc_s, at_stage(tSsK, stage, kStageElems), [&](auto& s) CUTLASS_LAMBDA_FUNC_INLINE {
          policy.apply(s, tScS, n_block, elementwise, inputs);
        });
        accumulate(acc_s, at_stage(tOsVt, stage, kStageElems));
      });
    } else {
      // Warp w computes the slab (packed rows 0..15) over keys [w, w + 1) · kWarpKeys of each tile.
      constexpr int kWarpKeys = Traits::kWarpKeys;
      static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole MMA k-steps of P·V");
      const int warp = tid / 32, lane = tid % 32;
      Tensor sQ_slab = local_tile(sQ, Shape<_16, Int<kHeadDim>>{}, make_coord(0, 0));
      Tensor sK_warp = local_tile(sK, Shape<Int<kWarpKeys>, Int<kHeadDim>>{}, make_coord(warp, 0));
      Tensor sVt_warp = local_tile(sVt, Shape<Int<kHeadDim>, Int<kWarpKeys>>{}, make_coord(0, warp));
      Tensor rQ = slab_thr.partition_fragment_A(sQ_slab);
      Tensor rK = slab_thr.partition_fragment_B(sK_warp);
      Tensor rVt = slab_thr.partition_fragment_B(
          local_tile(sVtNoSwizzle, Shape<Int<kHeadDim>, Int<kWarpKeys>>{}, make_coord(0, warp)));
      auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, slab_mma);
      auto thr_q = copy_q.get_thread_slice(lane);
      auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, slab_mma);
      auto thr_k = copy_k.get_thread_slice(lane);
      auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, slab_mma);
      auto thr_v = copy_v.get_thread_slice(lane);
      Tensor sQ_src = thr_q.partition_S(sQ_slab);
      Tensor sK_src = thr_k.partition_S(sK_warp);
      Tensor sVt_src = thr_v.partition_S(sVt_warp);
      // Warp 0's rows of the CTA's output fragment are the slab's: the same registers serve as
      // the one-warp MMA's accumulator and as the epilogue's.
      Tensor acc_o_slab = make_tensor(acc_o.data(), partition_fragment_C(slab_mma, Shape<_16, Int<kHeadDim>>{}).layout());
      static_assert(decltype(size(acc_o_slab))::value == decltype(size(acc_o))::value);
      run_ring([&](int stage, int n_block, bool elementwise, const auto& inputs) CUTLASS_LAMBDA_FUNC_INLINE {
        Tensor acc_s = partition_fragment_C(slab_mma, Shape<_16, Int<kWarpKeys>>{});
        clear(acc_s);
        gemm_smem_smem(acc_s, rQ, rK, sQ_src, at_stage(sK_src, stage, kStageElems), slab_mma, copy_q, copy_k, thr_q,
                       thr_k);
        policy.apply(acc_s, tScS_policy, n_block, elementwise, inputs);
        accumulate_by(acc_s, [&](const auto& tOrP) CUTLASS_LAMBDA_FUNC_INLINE {
          gemm_reg_smem(acc_o_slab, tOrP, rVt, at_stage(sVt_src, stage, kStageElems), slab_mma, copy_v, thr_v);
        });
      });
      cp_async_wait<0>();
      __syncthreads();  // every stage has been read: the stages' memory carries the warps' parts
      static_assert(Traits::kRingStages * Traits::kKVTileBytes * 2 >=
                        (Traits::kNWarps - 1) * 32 * kRows * (decltype(size<1>(acc_o_rows))::value + 2) * 4,
                    "the warps' parts fit the K/V stages");
      merge_key_shares<Traits::kNWarps>(reinterpret_cast<float*>(smem + Traits::kQBytes), acc_o_rows, softmax);
    }
  } else {
    // Key tiles, last first. K of the next active tile loads while this one's softmax and P·V
    // run, V of this tile while its S is computed.
    int n_block = tiles.first();
    if (n_block >= 0) load_k(n_block, tKsK);
    cp_async_fence();
    while (n_block >= 0) {
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      cp_async_wait<0>();
      __syncthreads();  // K of this tile has landed, and every warp is done reading the last V
      load_v(n_block, tVsV);
      cp_async_fence();
      if (warp_has_rows) {
        scores(acc_s, tSsK, [&](auto& s) CUTLASS_LAMBDA_FUNC_INLINE { policy.apply(s, tScS, n_block, tiles.needs_elementwise(n_block)); });
      }
      const int next = tiles.at_or_below(n_block - 1);
      cp_async_wait<0>();
      __syncthreads();  // V of this tile has landed, and every warp is done reading K
      if (next >= 0) load_k(next, tKsK);
      cp_async_fence();
      if (warp_has_rows) accumulate(acc_s, tOsVt);
      n_block = next;
    }
  }

  // Epilogue. Q's shared memory becomes O's once every copy into it has landed and every warp is
  // past its last read of Q (the loop's barriers, or this one when no tile was active).
  cp_async_wait<0>();
  __syncthreads();

  write_forward_output<Traits>(p, smem, tiled_mma, acc_o, tOcO, softmax, rows, row0, b, split);
}

}  // namespace flash_dmattn::kernels::sm80
