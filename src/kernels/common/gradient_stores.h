// How the backward kernels write their results: dK and dV once per key tile, from registers;
// dQ by reductions into the fp32 accumulator in the workspace, once per (query tile, key tile).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Writes an accumulator (rows, D) to global memory in Element, times `factor`: pairs of
// neighbouring columns as one 4-byte store, rows at or past `valid_rows` and columns at or past
// `head_dim` skipped.
template <typename Element, typename Acc, typename TensorC>
__device__ __forceinline__ void store_rows(const Acc& acc, const TensorC& coords, Element* base, std::int64_t row_stride,
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
      *reinterpret_cast<cutlass::Array<Element, 2>*>(base + row * row_stride + col) = convert(pair);
    }
  }
}

// dq_accum += dQ of one query tile, by fire-and-forget reductions. This is also what makes
// deterministic mode reproducible: there every CTA owns its dq slot and every element of it
// belongs to one thread, and reductions by one thread to one address take effect in program
// order, so each element's additions happen in the CTA's loop order.
template <typename Acc, typename TensorC>
__device__ __forceinline__ void accumulate_dq(const Acc& acc, const TensorC& coords, float* rows, int row0, int seqlen_q,
                                              int head_dim) {
  using namespace cute;
  constexpr int kElems = decltype(size(acc))::value;
  auto in_bounds = [&](int e) { return row0 + get<0>(coords(e)) < seqlen_q && get<1>(coords(e)) < head_dim; };
  auto address = [&](int e) { return rows + std::int64_t(row0 + get<0>(coords(e))) * head_dim + get<1>(coords(e)); };
#if __CUDA_ARCH__ >= 900
  // Elements e and e + 1 are neighbouring columns of one row (head_dim is even): one 8-byte
  // vector reduction fills whole L2 sectors where two scalar ones would each fill half.
  CUTE_UNROLL
  for (int e = 0; e < kElems; e += 2)
    if (in_bounds(e)) atomicAdd(reinterpret_cast<float2*>(address(e)), make_float2(acc(e), acc(e + 1)));
#else
  CUTE_UNROLL
  for (int e = 0; e < kElems; ++e)
    if (in_bounds(e)) atomicAdd(address(e), acc(e));
#endif
}

// dK = scale·Σ dSᵀ·Q and dV = Σ Pᵀ·dO of key tile n_block, summed over every query tile of the
// GQA group's heads: written once, in Element.
template <typename Element, typename Acc, typename TensorC>
__device__ __forceinline__ void store_dk_dv(const BackwardParams& p, int b, int kv_h, int n_begin, const Acc& acc_dk,
                                            const Acc& acc_dv, const TensorC& coords) {
  const ForwardParams& f = p.fwd;
  auto kv_rows = [&](void* base, std::int64_t batch_stride, std::int64_t head_stride, std::int64_t row_stride) {
    return static_cast<Element*>(base) + b * batch_stride + kv_h * head_stride + n_begin * row_stride;
  };
  store_rows(acc_dk, coords, kv_rows(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride), p.dk_row_stride,
             f.seqlen_k - n_begin, f.head_dim, f.scale);
  store_rows(acc_dv, coords, kv_rows(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride), p.dv_row_stride,
             f.seqlen_k - n_begin, f.head_dim, 1.f);
}

}  // namespace flash_dmattn::kernels
