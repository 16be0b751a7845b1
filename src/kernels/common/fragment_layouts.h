// Views of mma.sync accumulator fragments. An m16n8 accumulator holds, per thread, 4 values:
// (row r, cols c, c+1) and (row r+8, cols c, c+1). Softmax wants them by (row, col); the P·V
// product wants the same registers as an A operand of an m16n8k16 MMA.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flash_dmattn::kernels {

// (4, MMA_M, MMA_N) -> ((2 row halves, MMA_M), (2 cols, MMA_N)): mode 0 indexes rows, mode 1 columns.
template <typename Layout>
__host__ __device__ constexpr auto accumulator_as_rows_cols(Layout acc) {
  using namespace cute;
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3);
  auto split = logical_divide(acc, Shape<_2>{});  // ((2 cols, 2 row halves), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(split), get<1>(split)), make_layout(get<0, 0>(split), get<2>(split)));
}

// (4, MMA_M, MMA_N) accumulator of an m16n8 MMA -> (8, MMA_M, MMA_N/2) A operand of an m16n8k16
// MMA: two neighbouring n8 accumulator tiles form one k16 slice.
template <typename Layout>
__host__ __device__ constexpr auto accumulator_as_a_operand(Layout acc) {
  using namespace cute;
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3);
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

// A copy of a float fragment converted to Element, with the same layout. Pairs convert with one
// packed instruction (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename Element, typename Tensor>
__device__ __forceinline__ auto convert_fragment(const Tensor& src) {
  using namespace cute;
  static_assert(decltype(size(src))::value % 2 == 0);
  auto dst = make_tensor<Element>(src.layout());
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int e = 0; e < size(src); e += 2) {
    cutlass::Array<float, 2> pair;
    pair[0] = src(e);
    pair[1] = src(e + 1);
    const cutlass::Array<Element, 2> converted = convert(pair);
    dst(e) = converted[0];
    dst(e + 1) = converted[1];
  }
  return dst;
}

}  // namespace flash_dmattn::kernels
