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
