// The end of a forward query tile, shared by the kernel families: with split-KV, this split's fp32
// partial output and LSE; otherwise O in the output dtype and the LSE.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>
#include <cstdint>

#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// The threads that hold a tile's output and write it: every thread of the CTA, unless a kernel
// has threads that only load (then it passes its own index and barrier over the others).
struct AllCtaThreads {
  __device__ __forceinline__ int index() const { return threadIdx.x; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};

// acc_o: the output accumulator of this thread, normalized here by the softmax's denominators;
// tOcO: its (row, col) in the tile.
// Traits name the element type and how O goes out: through shared memory (SmemLayoutO over
// `smem`, which the caller has made free: every copy into it landed and every warp done reading
// it) and then as 16-byte row vectors (GmemTiledCopyO), each to its packed row's address.
template <typename Traits, typename TiledMma, typename AccO, typename CoordsO, int kRows,
          typename Threads = AllCtaThreads>
__device__ __forceinline__ void write_forward_output(const ForwardParams& p, char* smem, const TiledMma& tiled_mma,
                                                     AccO& acc_o, const CoordsO& tOcO, OnlineSoftmax<kRows>& softmax,
                                                     const RowMap& rows, int row0, int b, int split,
                                                     Threads threads = {}) {
  using namespace cute;
  using Element = typename Traits::Element;
  const int tid = threads.index();
  Tensor tOcO_rows = make_tensor(tOcO.data(), accumulator_as_rows_cols(tOcO.layout()));
  Tensor acc_o_rows = make_tensor(acc_o.data(), accumulator_as_rows_cols(acc_o.layout()));
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

  Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutO{});
  Tensor o_values = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
  copy(smem_copy_o, smem_thr_o.retile_S(o_values), smem_thr_o.partition_D(sO));
  threads.sync();

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

// The output of a tile whose rows see no key (an empty key list of the gather path): O = 0 and
// LSE = +inf, stored by every thread of the CTA in 16-byte vectors, with no pipeline, no load and
// no barrier. The seed's 64-key block mask lists nothing for 203 of its 256 query tiles, and
// such a CTA running the whole forward took about 4.5 us (docs/architecture.md).
template <typename Element, int kTileRows>
__device__ __forceinline__ void write_empty_output(const ForwardParams& p, const RowMap& rows, int row0, int b) {
  const int vectors = p.head_dim * static_cast<int>(sizeof(Element)) / 16;  // head_dim: a multiple of 8
  for (int t = threadIdx.x; t < kTileRows * vectors; t += blockDim.x) {
    const int packed = row0 + t / vectors, v = t % vectors;
    if (packed >= rows.rows) continue;
    Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                   rows.offset(packed, p.out_row_stride, p.out_head_stride);
    reinterpret_cast<uint4*>(out)[v] = make_uint4(0u, 0u, 0u, 0u);
    if (v == 0) p.lse[b * p.lse_batch_stride + rows.offset(packed, 1, p.lse_head_stride)] = INFINITY;
  }
}

}  // namespace flash_dmattn::kernels
