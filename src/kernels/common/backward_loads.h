// The global-memory tiles a backward CTA reads, and their predicated cp.async copies into shared
// memory, shared by the kernel families: K and V of the CTA's key tile (once), Q and dO of each
// query tile it visits. Destinations come partitioned by the same tiled copy (its thread slice
// `thr`), in whatever shared-memory layout the family uses.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/tile_copy.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// One (B, rows, heads, D) tensor with a contiguous head dim, as the copies read it.
struct HeadRows {
  const void* ptr;
  std::int64_t batch_stride, head_stride, row_stride;
  int length;  // rows
};

// Tile `tile` of kRows rows of src's (b, head) slice -> dst, predicated to the rows before
// src.length and the first head_dim columns; coords: the (row, col) of every vector in a
// (kRows, kHeadDim) tile.
template <typename Element, int kRows, int kHeadDim, typename ThrCopy, typename Dst,
          typename Coords>
__device__ __forceinline__ void copy_head_rows_async(const HeadRows& src, int b, int head, int tile, int head_dim,
                                                     const ThrCopy& thr, Dst&& dst, const Coords& coords) {
  using namespace cute;
  const Element* ptr = static_cast<const Element*>(src.ptr) + b * src.batch_stride + head * src.head_stride;
  Tensor rows = make_tensor(make_gmem_ptr(ptr), make_shape(src.length, head_dim), make_stride(src.row_stride, _1{}));
  copy_rows_async(thr.partition_S(local_tile(rows, Shape<Int<kRows>, Int<kHeadDim>>{}, make_coord(tile, 0))), dst,
                  coords, src.length - tile * kRows, head_dim);
}

// Q and dO of query tile m_block of query head h -> dst_q, dst_do; coords: the (row, col) of
// every vector in a (kBlockM, kHeadDim) tile.
template <typename Element, int kBlockM, int kHeadDim, typename ThrCopy, typename DstQ,
          typename DstDO, typename Coords>
__device__ __forceinline__ void copy_q_do_async(const BackwardParams& p, int b, int h, int m_block,
                                                const ThrCopy& thr, DstQ&& dst_q, DstDO&& dst_do,
                                                const Coords& coords) {
  const ForwardParams& f = p.fwd;
  const HeadRows q{f.q, f.q_batch_stride, f.q_head_stride, f.q_row_stride, f.seqlen_q};
  const HeadRows dout{p.dout, p.dout_batch_stride, p.dout_head_stride, p.dout_row_stride, f.seqlen_q};
  copy_head_rows_async<Element, kBlockM, kHeadDim>(q, b, h, m_block, f.head_dim, thr, dst_q, coords);
  copy_head_rows_async<Element, kBlockM, kHeadDim>(dout, b, h, m_block, f.head_dim, thr, dst_do, coords);
}

// K and V of key tile n_block of KV head kv_h -> dst_k, dst_v; coords: the (row, col) of every
// vector in a (kBlockN, kHeadDim) tile.
template <typename Element, int kBlockN, int kHeadDim, typename ThrCopy, typename DstK,
          typename DstV, typename Coords>
__device__ __forceinline__ void copy_k_v_async(const BackwardParams& p, int b, int kv_h, int n_block,
                                               const ThrCopy& thr, DstK&& dst_k, DstV&& dst_v, const Coords& coords) {
  const ForwardParams& f = p.fwd;
  const HeadRows k{f.k, f.k_batch_stride, f.k_head_stride, f.k_row_stride, f.seqlen_k};
  const HeadRows v{f.v, f.v_batch_stride, f.v_head_stride, f.v_row_stride, f.seqlen_k};
  copy_head_rows_async<Element, kBlockN, kHeadDim>(k, b, kv_h, n_block, f.head_dim, thr, dst_k, coords);
  copy_head_rows_async<Element, kBlockN, kHeadDim>(v, b, kv_h, n_block, f.head_dim, thr, dst_v, coords);
}

}  // namespace flash_dmattn::kernels
