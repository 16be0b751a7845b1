// What the gather backward kernels of both families share (sm80/bwd_gather_mainloop.h and
// sm90/bwd_gather_mainloop.h): the K and V rows they gather and the dK and dV accumulator rows
// they reduce into, Q and dO of their packed rows, the prologue of their chunk loop, and the dQ
// store. Each CTA holds the packed rows row0.. of a RowMap (query heads of one KV head that read
// one list).
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/gradient_stores.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Row 0 (key 0) of the (batch, KV head)'s K and V, and of its dK and dV accumulators (fp32, head_dim wide).
template <typename Element>
struct GatheredRows {
  const Element* k;
  const Element* v;
  float* dk;
  float* dv;
  __device__ __forceinline__ GatheredRows(const BackwardParams& p, int b, int kv_h) {
    const ForwardParams& f = p.fwd;
    k = static_cast<const Element*>(f.k) + b * f.k_batch_stride + kv_h * f.k_head_stride;
    v = static_cast<const Element*>(f.v) + b * f.v_batch_stride + kv_h * f.v_head_stride;
    const std::int64_t key0 = (std::int64_t(b) * f.kv_heads + kv_h) * f.seqlen_k;
    dk = p.dk_accum + key0 * f.head_dim;
    dv = p.dv_accum + key0 * f.head_dim;
  }
};

// Issues the cp.async copies of Q and dO of the CTA's packed rows (valid_rows of them before Sq),
// and of the list's first two chunks of keys and row bits, then waits for all but the second and
// gathers chunk 0's K and V (gather_k_v(0)), one commit group per step: the loop then waits for
// everything before its first chunk. q_dst, do_dst: the thread's vectors of the Q and dO tiles
// as the tiled copy partitions them; coords: their (row, column).
template <typename Element, typename List, typename TensorQ, typename TensorDO, typename TensorC, typename GatherKV>
__device__ __forceinline__ void start_gathered_chunks(const BackwardParams& p, int b, const RowMap& rows, int row0,
                                                      int valid_rows, TensorQ&& q_dst, TensorDO&& do_dst,
                                                      const TensorC& coords, const List& list, int threads,
                                                      GatherKV&& gather_k_v) {
  const ForwardParams& f = p.fwd;
  const int tid = threadIdx.x, chunks = list.chunks();
  copy_rows_by_pointer_async<Element>(
      q_dst, coords, valid_rows, f.head_dim,
      rows.row_pointers<Element>(f.q, b * f.q_batch_stride, row0, f.q_row_stride, f.q_head_stride));
  copy_rows_by_pointer_async<Element>(
      do_dst, coords, valid_rows, f.head_dim,
      rows.row_pointers<Element>(p.dout, b * p.dout_batch_stride, row0, p.dout_row_stride, p.dout_head_stride));
  if (chunks > 0) list.stage(0, tid, threads);
  cute::cp_async_fence();
  if (chunks > 1) list.stage(1, tid, threads);
  cute::cp_async_fence();
  cute::cp_async_wait<1>();
  __syncthreads();  // Q, dO and chunk 0's keys have landed
  if (chunks > 0) gather_k_v(0);
  cute::cp_async_fence();
}

// Δ = rowsum(dO∘O) of a CTA's kBlockM packed rows (FlashAttention's D), computed by the CTA
// that uses it instead of by a pass before the kernel (compute_dsum: 49 us of the 2.4 ms training
// top-2048 backward, H200). kLanes threads per row, each over every kLanes-th 16-byte vector of
// the row (a lane pair reads 32 contiguous bytes, a whole sector). The constructor issues the
// loads of O, which land while the prologue waits for its copies; store() reads dO from its
// shared tile once that wait is over (holding dO's vectors too across the wait spilled). Rows
// are 16-byte aligned and head dims multiples of 8: the CUDA backend runs no call otherwise
// (cannot_run in cuda_backend.cpp, validate.cpp).
template <typename Element, int kHeadDim, int kBlockM, int kThreads>
struct RowDeltas {
  static_assert(sizeof(Element) == 2 && kThreads % kBlockM == 0, "16-bit elements, whole rows per thread group");
  static constexpr int kLanes = kThreads / kBlockM, kVec = 8;
  static constexpr int kPerLane = (kHeadDim / kVec + kLanes - 1) / kLanes;
  uint4 o[kPerLane];

  __device__ __forceinline__ RowDeltas(const BackwardParams& p, int b, const RowMap& rows, int row0, int valid_rows) {
    const ForwardParams& f = p.fwd;
    const int r = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
    const bool exists = r < valid_rows;
    const std::int64_t at = exists ? b * f.out_batch_stride + rows.offset(row0 + r, f.out_row_stride, f.out_head_stride) : 0;
    const Element* const out = static_cast<const Element*>(f.out) + at;
    CUTE_UNROLL
    for (int v = 0; v < kPerLane; ++v) {
      const int col = (v * kLanes + lane) * kVec;
      o[v] = make_uint4(0, 0, 0, 0);
      if (exists && col < f.head_dim) o[v] = __ldg(reinterpret_cast<const uint4*>(out + col));
    }
  }

  // Row r's Δ into delta[r], r = 0 .. kBlockM - 1 (rows past Sq: 0, never read), with dO from
  // sdO, the CTA's (kBlockM, kHeadDim) tile in shared memory (zero past Sq and head_dim), landed
  // and visible to every thread. The order is fixed: reruns are bitwise equal.
  template <typename TensorDO>
  __device__ __forceinline__ void store(float* delta, const TensorDO& sdO) const {
    const int r = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
    float total = 0.f;
    CUTE_UNROLL
    for (int v = 0; v < kPerLane; ++v) {
      const int col = (v * kLanes + lane) * kVec;
      if (col >= kHeadDim) continue;
      // A swizzle moves whole 16-byte vectors: the 8 elements from col lie together.
      const uint4 d = *reinterpret_cast<const uint4*>(&sdO(r, col));
      const Element* const ov = reinterpret_cast<const Element*>(&o[v]);
      const Element* const dv = reinterpret_cast<const Element*>(&d);
      CUTE_UNROLL
      for (int k = 0; k < kVec; ++k) total += static_cast<float>(ov[k]) * static_cast<float>(dv[k]);
    }
    CUTE_UNROLL
    for (int offset = kLanes / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (lane == 0) delta[r] = total;
  }
};

// dQ = scale·Σ dS·K over the whole list, for the CTA's packed rows: the CTA is its only writer.
template <typename Element, typename Acc, typename TensorC>
__device__ __forceinline__ void store_gathered_dq(const Acc& acc_dq, const TensorC& coords, const BackwardParams& p,
                                                  int b, const RowMap& rows, int row0, int valid_rows) {
  Element* const dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride;
  store_rows_at<Element>(
      acc_dq, coords, [&](int r) { return dq + rows.offset(row0 + r, p.dq_row_stride, p.dq_head_stride); },
      valid_rows, p.fwd.head_dim, p.fwd.scale);
}

}  // namespace flash_dmattn::kernels
