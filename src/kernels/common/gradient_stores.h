// How the backward kernels write their results: dK and dV once per key tile, from registers;
// dQ by reductions into the fp32 accumulator in the workspace, once per (query tile, key tile).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cstdint>

#include "kernels/common/backward_grid.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Writes an accumulator (rows, D) to global memory in Element, times `factor`: pairs of
// neighbouring columns as one 4-byte store, rows at or past `valid_rows` and columns at or past
// `head_dim` skipped. row_pointer(row): where the row goes (rows of packed heads go to their heads).
template <typename Element, typename Acc, typename TensorC, typename RowPointer>
__device__ __forceinline__ void store_rows_at(const Acc& acc, const TensorC& coords, RowPointer row_pointer,
                                              int valid_rows, int head_dim, float factor) {
  using namespace cute;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) {
    const int row = get<0>(coords(e)), col = get<1>(coords(e));
    if (row < valid_rows && col < head_dim) {
      cutlass::NumericArrayConverter<Element, float, 2> convert;
      cutlass::Array<float, 2> pair;
      pair[0] = acc(e) * factor;
      pair[1] = acc(e + 1) * factor;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(row_pointer(row) + col) = convert(pair);
    }
  }
}

template <typename Element, typename Acc, typename TensorC>
__device__ __forceinline__ void store_rows(const Acc& acc, const TensorC& coords, Element* base, std::int64_t row_stride,
                                           int valid_rows, int head_dim, float factor) {
  store_rows_at<Element>(acc, coords, [&](int row) { return base + row * row_stride; }, valid_rows, head_dim, factor);
}

// dq_accum += dQ of one query tile, by fire-and-forget reductions. This is also what makes
// deterministic mode reproducible: there every CTA owns its dq slot and every element of it
// belongs to one thread, and reductions by one thread to one address take effect in program
// order, so each element's additions happen in the CTA's loop order.
//
// coords(e) is the thread's first (row, col) plus an offset that the layout fixes at compile
// time: the thread forms one 64-bit address, a row's elements add constant columns to their
// row's address (one multiply-add per row), and a tile wholly inside Sq and head_dim reduces
// without a test per element. Forming each address in 64 bits from its (row, col), and
// branching around each reduction, took about 13 instructions per reduction, 400 per tile and
// thread in the sm90a backward at D = 128 (ncu), whose loop is bound by issue slots; the
// reductions also waited to be read out of registers that the next address overwrote.
template <typename Acc, typename TensorC>
__device__ __forceinline__ void accumulate_dq(const Acc& acc, const TensorC& coords, float* rows, int row0, int seqlen_q,
                                              int head_dim) {
  using namespace cute;
  constexpr int kElems = decltype(size(acc))::value;
  const int row = get<0>(coords(0)), col = get<1>(coords(0));
  std::int64_t first = std::int64_t(row0 + row) * head_dim + col;
  // Kept as computed: otherwise the compiler folds it back into every element's 64-bit index.
  // (The offset, not the pointer: a pointer through asm loses its address space, and the
  // reductions became generic atomics.)
  asm volatile("" : "+l"(first));
  float* const base = rows + first;
  const int rows_left = seqlen_q - row0 - row, cols_left = head_dim - col;
  // (row, col) of element e relative to element 0: constants once the loop is unrolled.
  auto row_offset = [&](int e) { return get<0>(coords(e)) - row; };
  auto col_offset = [&](int e) { return get<1>(coords(e)) - col; };
  int last_row = 0, last_col = 0;
  CUTE_UNROLL
  for (int e = 0; e < kElems; ++e) {
    last_row = max(last_row, row_offset(e));
    last_col = max(last_col, col_offset(e));
  }
  const bool whole = last_row < rows_left && last_col < cols_left;
  auto exists = [&](int e) { return whole || (row_offset(e) < rows_left && col_offset(e) < cols_left); };
#if __CUDA_ARCH__ >= 900
  // Elements e and e + 1 are neighbouring columns of one row (head_dim is even): one 8-byte
  // vector reduction fills whole L2 sectors where two scalar ones would each fill half.
  if (whole) {
    CUTE_UNROLL
    for (int e = 0; e < kElems; e += 2) {
      float* const row_at = base + row_offset(e) * head_dim;
      atomicAdd(reinterpret_cast<float2*>(row_at + col_offset(e)), make_float2(acc(e), acc(e + 1)));
    }
  } else {
    CUTE_UNROLL
    for (int e = 0; e < kElems; e += 2) {
      float* const row_at = base + row_offset(e) * head_dim;
      if (exists(e)) atomicAdd(reinterpret_cast<float2*>(row_at + col_offset(e)), make_float2(acc(e), acc(e + 1)));
    }
  }
#else
  CUTE_UNROLL
  for (int e = 0; e < kElems; ++e) {
    float* const row_at = base + row_offset(e) * head_dim;
    if (exists(e)) atomicAdd(row_at + col_offset(e), acc(e));
  }
#endif
}

// The keys of a thread's rows of a gathered (kBlockN, D) accumulator tile (row n adds to
// rows[keys[n]]), -1 for rows at or past the chunk's valid_rows. Read while the chunk's keys are
// staged, they let its reductions go out after the staging slot is reused: the sm90a gather
// backward sends a chunk's dK while the next chunk's S and dP run.
template <int kRows>
struct GatheredRowKeys {
  int key[kRows];
  __device__ __forceinline__ GatheredRowKeys() {  // no rows: nothing is added
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) key[r] = -1;
  }
  template <typename CoordsRC>
  __device__ __forceinline__ GatheredRowKeys(const CoordsRC& coords_rc, const int* keys, int valid_rows) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = cute::get<0>(coords_rc(r, 0));
      key[r] = row < valid_rows ? keys[row] : -1;
    }
  }
};

// The row keys of an accumulator whose coordinates (flat, as the MMA partitions them) are `coords`;
// without keys, none.
template <typename TensorC>
__device__ __forceinline__ auto gathered_row_keys(const TensorC& coords, const int* keys, int valid_rows) {
  using namespace cute;
  Tensor coords_rc = make_tensor(coords.data(), accumulator_as_rows_cols(coords.layout()));
  return GatheredRowKeys<decltype(size<0>(coords_rc))::value>(coords_rc, keys, valid_rows);
}
template <typename TensorC>
__device__ __forceinline__ auto gathered_row_keys(const TensorC& coords) {
  using namespace cute;
  return GatheredRowKeys<decltype(size<0>(accumulator_as_rows_cols(coords.layout())))::value>();
}

#if __CUDA_ARCH__ >= 900
// rows[keys[row]] += acc as accumulate_gathered_rows below, by 16-byte reductions: where the lanes
// of a pair (lane, lane ^ 1) hold neighbouring column pairs of one row (columns 4k, 4k + 1 and
// 4k + 2, 4k + 3 of every group of 8, as the mma and wgmma accumulators do), each lane gives its
// partner one of two column pairs and sends one float4 reduction for the two, half the reduction
// instructions of float2 ones. ncu (H200, sm90a gather backward, train_scatter2048_d128): about a
// quarter of the warps' stall samples were registers waiting for float2 reductions to drain them.
// False, with nothing done, where the layout, a partial column tile or the alignment does not
// allow it (the whole warp decides alike: the exchange needs every lane).
template <typename AccRC, typename CoordsRC, typename RowKeys>
__device__ __forceinline__ bool add_rows_by_quads(const AccRC& acc_rc, const CoordsRC& coords_rc, float* rows,
                                                  const RowKeys& row_keys, int head_dim, bool whole) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(acc_rc))::value;
  constexpr int kCols = decltype(size<1>(acc_rc))::value;
  constexpr unsigned kWarp = 0xffffffffu;
  const int col0 = get<1>(coords_rc(0, 0));
  const bool odd = threadIdx.x & 1;
  auto col_offset = [&](int c) { return get<1>(coords_rc(0, c)) - col0; };
  bool quads = whole && head_dim % 4 == 0 && __shfl_xor_sync(kWarp, col0, 1) == col0 + (odd ? -2 : 2) &&
               col0 % 4 == (odd ? 2 : 0);
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 4) {
    quads = quads && col_offset(c + 1) == col_offset(c) + 1 && col_offset(c + 2) == col_offset(c) + 8 &&
            col_offset(c + 3) == col_offset(c) + 9;
  }
  if (!__all_sync(kWarp, quads)) return false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const bool exists = row_keys.key[r] >= 0;
    // The even lane keeps group c's pair and sends group c + 2's; the odd lane the other way round.
    // Its float4 starts 2 columns before its own pair of group c + 2.
    std::int64_t offset = std::int64_t(exists ? row_keys.key[r] : 0) * head_dim + col0 + (odd ? 6 : 0);
    asm volatile("" : "+l"(offset));  // (kept as computed, as in accumulate_gathered_rows)
    float* const at = rows + offset;
    CUTE_UNROLL
    for (int c = 0; c < kCols; c += 4) {
      const float given0 = __shfl_xor_sync(kWarp, odd ? acc_rc(r, c) : acc_rc(r, c + 2), 1);
      const float given1 = __shfl_xor_sync(kWarp, odd ? acc_rc(r, c + 1) : acc_rc(r, c + 3), 1);
      if (!exists) continue;
      const float4 v = odd ? make_float4(given0, given1, acc_rc(r, c + 2), acc_rc(r, c + 3))
                           : make_float4(acc_rc(r, c), acc_rc(r, c + 1), given0, given1);
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at + col_offset(c)), "f"(v.x), "f"(v.y),
                   "f"(v.z), "f"(v.w)
                   : "memory");
    }
  }
  return true;
}
#endif

// rows += acc at gathered rows (the gather path's dK and dV): row n of the accumulator's tile
// adds to row keys[n] of `rows` (head_dim floats each), for the rows that row_keys names.
//
// A thread's elements lie on a few rows (4 of a 64-row dK/dV tile at D = 128) at columns that the
// layout fixes at compile time: each row's key is read and its address formed once, and the row's
// reductions add constant offsets to it. Per element, the key's shared-memory load and the 64-bit
// address (about 14 instructions per reduction, a branch around each) were about half of the
// kernel's instructions per chunk at D = 128 (SASS), with a load-use wait before every reduction.
template <typename Acc, typename TensorC, int kKeyRows>
__device__ __forceinline__ void accumulate_gathered_rows(const Acc& acc, const TensorC& coords, float* rows,
                                                         const GatheredRowKeys<kKeyRows>& row_keys, int head_dim) {
  using namespace cute;
  Tensor acc_rc = make_tensor(acc.data(), accumulator_as_rows_cols(acc.layout()));
  Tensor coords_rc = make_tensor(coords.data(), accumulator_as_rows_cols(coords.layout()));
  constexpr int kRows = decltype(size<0>(acc_rc))::value;
  constexpr int kCols = decltype(size<1>(acc_rc))::value;
  static_assert(kKeyRows == kRows, "row keys of this accumulator's rows");
  const int col0 = get<1>(coords_rc(0, 0));
  // Column c's offset from col0: a constant once the loops are unrolled.
  auto col_offset = [&](int c) { return get<1>(coords_rc(0, c)) - col0; };
  int last_col = 0;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) last_col = max(last_col, col_offset(c));
  const bool whole = last_col < head_dim - col0;
#if __CUDA_ARCH__ >= 900
  if constexpr (kCols % 4 == 0) {
    if (add_rows_by_quads(acc_rc, coords_rc, rows, row_keys, head_dim, whole)) return;
  }
#endif
  auto add_row = [&](int r, float* at, auto all_columns) CUTLASS_LAMBDA_FUNC_INLINE {
    CUTE_UNROLL
    for (int c = 0; c < kCols; c += 2) {  // columns c and c + 1 are neighbours (head_dim is even)
      if (!decltype(all_columns)::value && col_offset(c) >= head_dim - col0) continue;
#if __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float2*>(at + col_offset(c)), make_float2(acc_rc(r, c), acc_rc(r, c + 1)));
#else
      atomicAdd(at + col_offset(c), acc_rc(r, c));
      atomicAdd(at + col_offset(c) + 1, acc_rc(r, c + 1));
#endif
    }
  };
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    if (row_keys.key[r] < 0) continue;
    std::int64_t offset = std::int64_t(row_keys.key[r]) * head_dim + col0;
    // Kept as computed, or the compiler folds it back into every element's address (as in
    // accumulate_dq).
    asm volatile("" : "+l"(offset));
    if (whole) {
      add_row(r, rows + offset, cute::true_type{});
    } else {
      add_row(r, rows + offset, cute::false_type{});
    }
  }
}

// The same for the rows of a chunk whose keys are staged: rows n < valid_rows add to keys[n].
template <typename Acc, typename TensorC>
__device__ __forceinline__ void accumulate_gathered_rows(const Acc& acc, const TensorC& coords, float* rows,
                                                         const int* keys, int valid_rows, int head_dim) {
  accumulate_gathered_rows(acc, coords, rows, gathered_row_keys(coords, keys, valid_rows), head_dim);
}

// True where the bulk-asynchronous copy unit exists (sm_90 and newer): cp.reduce.async.bulk.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline constexpr bool kHasBulkReductions = true;
#else
inline constexpr bool kHasBulkReductions = false;
#endif

// dq_accum += dQ of one query tile by bulk reductions in L2: the CTA stages dQ in shared memory,
// and thread r hands row r (head_dim floats, contiguous in the accumulator) to the bulk-copy
// unit. Staged rows are kDqStagingPad floats apart so that the accumulator fragments' stores
// do not conflict on banks. Measured on an H200 (sm80 backward, D = 128 dense-equivalent with
// dbias): per-element reductions 9.25 ms (7.00 with the dQ reductions left out, so they cost a
// quarter), this 8.65 ms; one bulk reduction of the whole tile from unpadded rows (8-way bank
// conflicts on staging, one issuing thread) was slower than either, 9.50 ms.
// The protocol, around the main loop's barriers:
//   stage()                 every thread, once its tile's dQ is in registers
//   (barrier) issue()       the staged rows go out; the staging buffer stays busy until...
//   await_staging_read()    ...this, before the barrier after which stage() may write again
//   (barrier) drain()       at the end: every reduction has completed
// Reductions from one CTA that complete before the next key tile starts keep deterministic mode
// bitwise reproducible: its slot's elements still receive their additions in loop order.
inline constexpr int kDqStagingPad = 8;

template <int kTileRows, int kHeadDim>
class StagedDqReduction {
 public:
  static constexpr int kRowStride = kHeadDim + kDqStagingPad;
  static constexpr int kFloats = kTileRows * kRowStride;

  __device__ __forceinline__ explicit StagedDqReduction(float* staging) : staging_(staging) {}

  // acc: the (kTileRows, kHeadDim) dQ accumulator, coords its elements' (row, col) in the tile;
  // rows: the accumulator rows of the tile's head.
  template <typename Acc, typename TensorC>
  __device__ __forceinline__ void stage(const Acc& acc, const TensorC& coords, float* rows, int row0, int seqlen_q,
                                        int head_dim) {
    using namespace cute;
    CUTE_UNROLL
    for (int e = 0; e < size(acc); e += 2) {
      const int row = get<0>(coords(e)), col = get<1>(coords(e));
      *reinterpret_cast<float2*>(staging_ + row * kRowStride + col) = make_float2(acc(e), acc(e + 1));
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the bulk-copy unit
    const int r = threadIdx.x;
    pending_bytes_ = r < kTileRows && row0 + r < seqlen_q ? head_dim * static_cast<int>(sizeof(float)) : 0;
    pending_ = rows + std::int64_t(row0 + r) * head_dim;
  }

  __device__ __forceinline__ void issue() {
    if (pending_bytes_ > 0) {
      const auto src = static_cast<std::uint32_t>(__cvta_generic_to_shared(staging_ + threadIdx.x * kRowStride));
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                   :
                   : "l"(pending_), "r"(src), "r"(pending_bytes_)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    pending_bytes_ = 0;
  }

  __device__ __forceinline__ void await_staging_read() const {
    if (threadIdx.x < kTileRows) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }

  __device__ __forceinline__ void drain() const {
    if (threadIdx.x < kTileRows) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }

 private:
  float* staging_;
  float* pending_ = nullptr;
  int pending_bytes_ = 0;
};

// dK = scale·Σ dSᵀ·Q and dV = Σ Pᵀ·dO of key tile n_block, summed over the query tiles of the
// walked heads: written once, in Element; or, where head splits share the GQA group out
// (BackwardParams::head_splits), as this split's fp32 partial sums into its slot of the dK and dV
// accumulators, which reduce_dk_dv() adds up in slot order and scales.
template <typename Element, typename Acc, typename TensorC>
__device__ __forceinline__ void store_dk_dv(const BackwardParams& p, int b, const WalkHeads& heads, int n_begin,
                                            const Acc& acc_dk, const Acc& acc_dv, const TensorC& coords) {
  const ForwardParams& f = p.fwd;
  if (p.head_splits > 1) {
    const std::int64_t rows =
        ((std::int64_t(heads.split) * f.batch + b) * f.kv_heads + heads.kv_head) * f.seqlen_k + n_begin;
    store_rows(acc_dk, coords, p.dk_accum + rows * f.head_dim, f.head_dim, f.seqlen_k - n_begin, f.head_dim, 1.f);
    store_rows(acc_dv, coords, p.dv_accum + rows * f.head_dim, f.head_dim, f.seqlen_k - n_begin, f.head_dim, 1.f);
    return;
  }
  auto kv_rows = [&](void* base, std::int64_t batch_stride, std::int64_t head_stride, std::int64_t row_stride) {
    return static_cast<Element*>(base) + b * batch_stride + heads.kv_head * head_stride + n_begin * row_stride;
  };
  store_rows(acc_dk, coords, kv_rows(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride), p.dk_row_stride,
             f.seqlen_k - n_begin, f.head_dim, f.scale);
  store_rows(acc_dv, coords, kv_rows(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride), p.dv_row_stride,
             f.seqlen_k - n_begin, f.head_dim, 1.f);
}

}  // namespace flash_dmattn::kernels
