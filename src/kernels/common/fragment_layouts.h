// Views of MMA accumulator fragments. An mma.sync m16n8 accumulator holds, per thread, 4 values:
// (row r, cols c, c+1) and (row r+8, cols c, c+1), as (4, MMA_M, MMA_N). A wgmma m64nN
// accumulator holds the same pattern for each of its N/8 column groups, as ((2, 2, N/8), MMA_M,
// MMA_N). Softmax wants them by (row, col); the P·V product wants the same registers as an A
// operand of a k16 MMA.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flash_dmattn::kernels {

// Accumulator -> ((2 row halves, MMA_M), (2 cols, column groups..., MMA_N)): mode 0 indexes
// rows, mode 1 columns.
template <typename Layout>
__host__ __device__ constexpr auto accumulator_as_rows_cols(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  if constexpr (decltype(rank<0>(acc))::value == 3) {  // wgmma: ((2 cols, 2 row halves, N/8), MMA_M, MMA_N)
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                       make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
  } else {  // mma.sync: (4, MMA_M, MMA_N)
    static_assert(decltype(size<0>(acc))::value == 4);
    auto split = logical_divide(acc, Shape<_2>{});  // ((2 cols, 2 row halves), MMA_M, MMA_N)
    return make_layout(make_layout(get<0, 1>(split), get<1>(split)), make_layout(get<0, 0>(split), get<2>(split)));
  }
}

// Accumulator -> A operand of a k16 MMA over the same columns: two neighbouring n8 column groups
// form one k16 slice. mma.sync: (4, MMA_M, MMA_N) -> (8, MMA_M, MMA_N/2). wgmma (16-bit A):
// ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, N/16 · MMA_N).
template <typename Layout>
__host__ __device__ constexpr auto accumulator_as_a_operand(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    auto groups = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N/16))
    return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(groups)), get<1>(acc),
                       coalesce(make_layout(get<0, 1>(groups), get<2>(acc))));
  } else {
    static_assert(decltype(size<0>(acc))::value == 4);
    auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N/2))
    return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
  }
}

// Converts a float fragment into `dst`'s registers, element e of src to register e of dst
// (whatever view of them dst's layout gives). Pairs convert with one packed instruction
// (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename SrcTensor, typename DstTensor>
__device__ __forceinline__ void convert_fragment_into(const SrcTensor& src, DstTensor& dst) {
  using namespace cute;
  using Element = typename DstTensor::value_type;
  static_assert(decltype(size(src))::value % 2 == 0 && decltype(size(src))::value == decltype(size(dst))::value);
  Tensor out = make_tensor(dst.data(), src.layout());
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int e = 0; e < size(src); e += 2) {
    cutlass::Array<float, 2> pair;
    pair[0] = src(e);
    pair[1] = src(e + 1);
    const cutlass::Array<Element, 2> converted = convert(pair);
    out(e) = converted[0];
    out(e + 1) = converted[1];
  }
}

// A copy of a float fragment converted to Element, with the same layout.
template <typename Element, typename Tensor>
__device__ __forceinline__ auto convert_fragment(const Tensor& src) {
  auto dst = cute::make_tensor<Element>(src.layout());
  convert_fragment_into(src, dst);
  return dst;
}

}  // namespace flash_dmattn::kernels
