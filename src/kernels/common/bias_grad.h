// dBias in the backward: dZ summed over every position that reads a bias element, in fp32.
//
// Each thread adds the dZ of the accumulator elements it holds, in the shape the bias asks for
// (BiasGradKind): a whole element, or a per-key column sum (bias query dim 1). Column sums are
// kept by a ColumnSums policy (RegisterColumnSums below, or the sm90a kernel's tensor-core sums)
// and reduced across the CTA through shared memory in a fixed order, so the result is bitwise
// reproducible. Accumulation across CTAs uses reductions, into one shared slot by default or
// into a slot per CTA in deterministic mode. (The sm90a gather backward, never deterministic,
// sends each warpgroup's sums by reductions instead: add_gathered_sums.) A bias with key dim 1
// never gets here: its gradient is exactly 0.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/rounding_store.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Per-key sums of dZ in the registers of the threads that hold the elements. kCols: the columns
// of the accumulator's rows/cols view that a thread holds. kWarpsM: the warp rows of the
// S = Q·Kᵀ GEMM (warp w sits at row w % kWarpsM), each of which leaves one partial per key.
template <int kBlockN, int kCols, int kWarpsM>
struct RegisterColumnSums {
  static constexpr int kPartials = kWarpsM;
  float col_sum[kCols];  // this thread's part of the current bias head's key sums

  __device__ __forceinline__ RegisterColumnSums() { clear(); }

  __device__ __forceinline__ void clear() {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) col_sum[c] = 0.f;
  }

  // dz: the thread's accumulator in its (rows, cols) view.
  template <typename TensorZ>
  __device__ __forceinline__ void add(const TensorZ& dz) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < decltype(size<0>(dz))::value; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) col_sum[c] += dz(r, c);
    }
  }

  // Writes partial w of key j to reduce[w * kBlockN + j] and starts over. coords_rc: the (row,
  // col) in the tile of the thread's elements, in the rows/cols view.
  template <typename TensorC>
  __device__ __forceinline__ void deposit(const TensorC& coords_rc, float* reduce) {
    const int lane = threadIdx.x % 32, warp_m = threadIdx.x / 32 % kWarpsM;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      float x = col_sum[c];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (lane / 4 == 0) reduce[warp_m * kBlockN + cute::get<1>(coords_rc(0, c))] = x;
    }
    clear();
  }
};

// ColumnSums: how the per-key sums of a bias with query dim 1 are kept, with kPartials,
// add(dz) (what a tile's elements contribute from registers) and deposit(coords_rc, reduce);
// add_gathered_sums() also needs for_each_sum(f).
template <int kBlockM, int kBlockN, int kThreads, typename ColumnSums>
struct BiasGradTile {
  // A plain copy: taking the address of the __grid_constant__ parameters would move every access
  // to generic memory (fields used only on rare paths are re-read from parameter space).
  BiasGrad g;
  std::int64_t slot_base;  // this CTA's accumulator slot
  int batch;
  ColumnSums columns;

  __device__ __forceinline__ BiasGradTile(const BackwardParams& p, int b, int kv_head)
      : g(p.dbias), batch(b) {
    const int batch_slot = g.batch_slots > 1 ? b : 0;
    const int kv_slot = kv_head % g.kv_slots;
    slot_base = (std::int64_t(batch_slot) * g.kv_slots + kv_slot) * g.accum_slot_stride;
  }

  __device__ __forceinline__ std::int64_t accum_offset(int head, int i, int j) const {
    return slot_base + batch * g.accum_batch_stride + (head / g.head_divisor) * g.accum_head_stride +
           i * g.accum_row_stride + j;
  }

  // A reduction in either mode: in deterministic mode this CTA owns its slot, and one thread's
  // reductions to one address take effect in program order.
  __device__ __forceinline__ void accumulate(std::int64_t offset, float x) const { atomicAdd(g.accum + offset, x); }

  // Adds the dZ of one (query tile, key tile) pair: dz and coords are the thread's accumulator
  // in its (rows, cols) view and the (row, col) in the tile of each element. A pass of its own
  // after the per-element work, not inside it: there it would hold this state's registers across
  // every specialization of the mask/bias loop, where the backward spilled.
  template <typename TensorZ, typename TensorC>
  __device__ __forceinline__ void add_tile(const TensorZ& dz, const TensorC& coords, int head, int row0, int n_begin,
                                           int seqlen_q, int seqlen_k) {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(dz))::value;
    constexpr int kCols = decltype(size<1>(dz))::value;
    if (g.kind == BiasGradKind::columns) {
      columns.add(dz);
      return;
    }
    if (g.kind != BiasGradKind::elements) return;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int i = row0 + get<0>(coords(r, 0));
      if (i >= seqlen_q) continue;
      const std::int64_t row = g.direct ? batch * g.batch_stride + (head / g.head_divisor) * g.head_stride +
                                            i * g.row_stride + n_begin
                                      : accum_offset(head, i, n_begin);
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int j = get<1>(coords(r, c));
        if (n_begin + j >= seqlen_k) continue;
        if (g.direct) {
          store_rounded(g.type, g.out, row + j, dz(r, c));
        } else if (dz(r, c) != 0.f) {
          accumulate(row + j, dz(r, c));
        }
      }
    }
  }

  // elements, direct: a query tile that the walk skipped still owns its dbias elements, which are 0.
  __device__ __forceinline__ void zero_tiles(int head, int m_block_begin, int m_block_end, int n_begin, int seqlen_q,
                                             int seqlen_k) const {
    if (g.kind != BiasGradKind::elements || !g.direct || m_block_begin >= m_block_end) return;
    const int row_begin = m_block_begin * kBlockM, rows = min(m_block_end * kBlockM, seqlen_q) - row_begin;
    const int cols = min(kBlockN, seqlen_k - n_begin);
    const std::int64_t base = batch * g.batch_stride + (head / g.head_divisor) * g.head_stride;
    // In 64 bits: the skipped tiles may span all of Sq, and rows · kBlockN passes 2^31 from Sq = 2^31 / kBlockN.
    const std::int64_t elems = std::int64_t(rows) * kBlockN;
    for (std::int64_t e = threadIdx.x; e < elems; e += kThreads) {
      const int i = row_begin + static_cast<int>(e / kBlockN), j = static_cast<int>(e % kBlockN);
      if (j < cols) store_rounded(g.type, g.out, base + i * g.row_stride + n_begin + j, 0.f);
    }
  }

  // The gather path's (bwd_gather_mainloop.h): the dZ of one chunk of a query tile's key list,
  // whose column k is key keys[k] (k < valid); queries[r]: the query row of the thread's row r
  // (with packed heads, every row's head reads bias head head / head_divisor). Elements go out
  // by reductions at once; per-key sums are kept (columns) until deposit_columns() and
  // flush_gathered_columns(), or add_gathered_sums(). Every reduction: other query tiles (and
  // heads) share the keys.
  template <typename TensorZ, typename TensorC, int kQueryRows>
  __device__ __forceinline__ void add_gathered(const TensorZ& dz, const TensorC& coords, int head,
                                               const int (&queries)[kQueryRows], const int* keys, int valid,
                                               int seqlen_q) {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(dz))::value;
    constexpr int kCols = decltype(size<1>(dz))::value;
    if (g.kind == BiasGradKind::columns) {
      columns.add(dz);
      return;
    }
    if (g.kind != BiasGradKind::elements) return;
    static_assert(kQueryRows == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int i = queries[r];
      if (i >= seqlen_q) continue;
      const std::int64_t row = accum_offset(head, i, 0);
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int k = get<1>(coords(r, c));
        if (k < valid && dz(r, c) != 0.f) accumulate(row + keys[k], dz(r, c));
      }
    }
  }

  // columns: this chunk's per-key partial sums into reduce (then a barrier, then the flush).
  template <typename TensorC>
  __device__ __forceinline__ void deposit_columns(const TensorC& coords_rc, float* reduce) {
    if (g.kind == BiasGradKind::columns) columns.deposit(coords_rc, reduce);
  }

  __device__ __forceinline__ void flush_gathered_columns(const float* reduce, int head, const int* keys,
                                                         int valid) const {
    if (g.kind != BiasGradKind::columns) return;
    for (int k = threadIdx.x; k < min(valid, kBlockN); k += kThreads) {
      float x = 0.f;
      for (int w = 0; w < ColumnSums::kPartials; ++w) x += reduce[w * kBlockN + k];
      if (x != 0.f) accumulate(accum_offset(head, 0, keys[k]), x);
    }
  }

  // columns, where each thread holds whole sums of a chunk's keys (ColumnSums::for_each_sum: the
  // sm90a gather backward's tensor-core sums): each goes out by a reduction from the thread that
  // holds it, with no pass through shared memory and no barrier. A key's partials (one per
  // warpgroup of query rows) are separate reductions, as other query tiles' are.
  __device__ __forceinline__ void add_gathered_sums(int head, const int* keys, int valid) {
    if (g.kind != BiasGradKind::columns) return;
    columns.for_each_sum([&](int k, float x) {
      if (k < valid && x != 0.f) accumulate(accum_offset(head, 0, keys[k]), x);
    });
  }

  // columns: the key sums of one bias head over every query tile the CTA visited, reduced across
  // the CTA and written once (or accumulated, when other CTAs share the elements). Contains
  // barriers: every thread calls it.
  template <typename TensorC>
  __device__ __forceinline__ void flush_columns(const TensorC& coords_rc, float* reduce, int head, int n_begin,
                                                int seqlen_k) {
    if (g.kind != BiasGradKind::columns) return;
    __syncthreads();  // the reduce buffer is free
    columns.deposit(coords_rc, reduce);
    __syncthreads();
    for (int j = threadIdx.x; j < kBlockN; j += kThreads) {
      if (n_begin + j >= seqlen_k) continue;
      float x = 0.f;
      for (int w = 0; w < ColumnSums::kPartials; ++w) x += reduce[w * kBlockN + j];
      if (g.direct) {
        store_rounded(g.type, g.out, batch * g.batch_stride + (head / g.head_divisor) * g.head_stride + n_begin + j, x);
      } else if (x != 0.f) {
        accumulate(accum_offset(head, 0, n_begin + j), x);
      }
    }
  }
};

}  // namespace flash_dmattn::kernels
