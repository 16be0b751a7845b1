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

// Tile `tile` of kRows rows of a (B, rows, heads, D) tensor's (b, head) slice: (kRows, kHeadDim),
// over `length` rows and `head_dim` columns (the copies predicate the rest).
template <typename Element, int kRows, int kHeadDim>
__device__ __forceinline__ auto head_rows_tile(const void* base, std::int64_t batch_stride, std::int64_t head_stride,
                                               std::int64_t row_stride, int b, int head, int length, int head_dim,
                                               int tile) {
  using namespace cute;
  const Element* ptr = static_cast<const Element*>(base) + b * batch_stride + head * head_stride;
  Tensor rows = make_tensor(make_gmem_ptr(ptr), make_shape(length, head_dim), make_stride(row_stride, _1{}));
  return local_tile(rows, Shape<Int<kRows>, Int<kHeadDim>>{}, make_coord(tile, 0));
}

// Q and dO of query tile m_block of query head h -> dst_q, dst_do; coords: the (row, col) of
// every vector in a (kBlockM, kHeadDim) tile.
template <typename Element, int kBlockM, int kHeadDim, typename TiledCopy, typename ThrCopy, typename DstQ,
          typename DstDO, typename Coords>
__device__ __forceinline__ void copy_q_do_async(const BackwardParams& p, int b, int h, int m_block,
                                                const TiledCopy& copy, const ThrCopy& thr, DstQ&& dst_q,
                                                DstDO&& dst_do, const Coords& coords) {
  const ForwardParams& f = p.fwd;
  const int valid = f.seqlen_q - m_block * kBlockM;
  copy_rows_async(copy,
                  thr.partition_S(head_rows_tile<Element, kBlockM, kHeadDim>(
                      f.q, f.q_batch_stride, f.q_head_stride, f.q_row_stride, b, h, f.seqlen_q, f.head_dim, m_block)),
                  dst_q, coords, valid, f.head_dim);
  copy_rows_async(copy,
                  thr.partition_S(head_rows_tile<Element, kBlockM, kHeadDim>(
                      p.dout, p.dout_batch_stride, p.dout_head_stride, p.dout_row_stride, b, h, f.seqlen_q, f.head_dim,
                      m_block)),
                  dst_do, coords, valid, f.head_dim);
}

// K and V of key tile n_block of KV head kv_h -> dst_k, dst_v; coords: the (row, col) of every
// vector in a (kBlockN, kHeadDim) tile.
template <typename Element, int kBlockN, int kHeadDim, typename TiledCopy, typename ThrCopy, typename DstK,
          typename DstV, typename Coords>
__device__ __forceinline__ void copy_k_v_async(const BackwardParams& p, int b, int kv_h, int n_block,
                                               const TiledCopy& copy, const ThrCopy& thr, DstK&& dst_k, DstV&& dst_v,
                                               const Coords& coords) {
  const ForwardParams& f = p.fwd;
  const int valid = f.seqlen_k - n_block * kBlockN;
  copy_rows_async(copy,
                  thr.partition_S(head_rows_tile<Element, kBlockN, kHeadDim>(
                      f.k, f.k_batch_stride, f.k_head_stride, f.k_row_stride, b, kv_h, f.seqlen_k, f.head_dim, n_block)),
                  dst_k, coords, valid, f.head_dim);
  copy_rows_async(copy,
                  thr.partition_S(head_rows_tile<Element, kBlockN, kHeadDim>(
                      f.v, f.v_batch_stride, f.v_head_stride, f.v_row_stride, b, kv_h, f.seqlen_k, f.head_dim, n_block)),
                  dst_v, coords, valid, f.head_dim);
}

}  // namespace flash_dmattn::kernels
