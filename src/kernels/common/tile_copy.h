// Predicated global -> shared tile copies with cp.async (sm_80 and newer), shared by every main
// loop that loads its tiles with the threads that compute on them.
#pragma once

#include <cute/tensor.hpp>
#include <type_traits>

namespace flash_dmattn::kernels {

// The same shared-memory tensor (or a partition of it) one stage further on: stage_elems must be a
// whole number of the layout's swizzle periods, as a whole tile is.
template <typename Tensor>
__device__ __forceinline__ auto at_stage(const Tensor& t, int stage, int stage_elems) {
  return cute::make_tensor(t.data() + stage * stage_elems, t.layout());
}

// Tiled copies of (rows, head dim) tiles between global memory and shared or registers:
// 16-byte vectors, kThreadsPerRow threads across kRowElems elements of a row.
template <typename Element, int kThreads, int kRowElems>
struct GmemRowCopies {
  static constexpr int kElemsPerVector = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = kRowElems / kElemsPerVector;
  using ThreadLayout = cute::Layout<cute::Shape<cute::Int<kThreads / kThreadsPerRow>, cute::Int<kThreadsPerRow>>,
                                    cute::Stride<cute::Int<kThreadsPerRow>, cute::_1>>;
  using VectorLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kElemsPerVector>>>;
  // global -> shared with cp.async
  using Async = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, ThreadLayout{}, VectorLayout{}));
  // shared -> registers, for the 16-byte stores that follow
  using Vectors = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, ThreadLayout{}, VectorLayout{}));
};

// Copies a (rows, head dim) tile from global to shared memory with cp.async. Rows at or past
// `valid_rows` and head-dim columns at or past `head_dim` are zero-filled instead: zero K rows
// and columns add nothing to Q·Kᵀ, and zero V rows keep P·V finite where P is 0. One cp.async
// per vector either way: a vector outside the tile copies 0 source bytes (src-size 0 reads
// nothing) and zero-fills its 16. Zeroing them with separate stores instead put 7 more
// instructions per vector into the sm90a backward's loop (ncu, D = 128), where every issue slot counts.
// src, dst, coords: a thread's vectors as a tiled copy partitions them, (vector, rows, cols).
template <typename TensorS, typename TensorD, typename TensorC>
__device__ __forceinline__ void copy_rows_async(const TensorS& src, TensorD&& dst, const TensorC& coords, int valid_rows,
                                                int head_dim) {
  using namespace cute;
  using Element = typename std::decay_t<TensorS>::value_type;
  static_assert(sizeof(Element) * decltype(size<0>(src))::value == 16, "one 16-byte vector per copy");
  const Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element> zfill;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = get<0>(coords(0, m, 0)) < valid_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      copy(zfill.with(row_ok && get<1>(coords(0, m, k)) < head_dim), src(_, m, k), dst(_, m, k));
    }
  }
}

// Copies rows global -> shared with cp.async, each row's address from row_pointer(row): query
// rows of a packed tile belong to different heads, and the gather path's K and V rows are the
// keys of a list. Rows at or past `valid_rows` and head-dim columns at or past `head_dim` are
// zero-filled (src-size 0, from row 0's address, which every caller has). The copy atom writes
// through dst's layout, swizzled ones included: a position-independent swizzle tensor (sm90a)
// swizzles its pointer, which raw_pointer_cast would drop.
template <typename Element, typename TensorD, typename TensorC, typename RowPointer>
__device__ __forceinline__ void copy_rows_by_pointer_async(TensorD&& dst, const TensorC& coords, int valid_rows, int head_dim,
                                                  RowPointer row_pointer) {
  using namespace cute;
  const Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element> zfill;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    const int row = get<0>(coords(0, m, 0));
    const bool row_ok = row < valid_rows;
    const Element* src = row_pointer(row_ok ? row : 0);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      const int col = get<1>(coords(0, m, k));
      const bool ok = row_ok && col < head_dim;
      Tensor vector = make_tensor(make_gmem_ptr(src + (ok ? col : 0)), make_layout(shape(dst(_, m, k))));
      copy(zfill.with(ok), vector, dst(_, m, k));
    }
  }
}

}  // namespace flash_dmattn::kernels
