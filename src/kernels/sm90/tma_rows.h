// TMA loads of (rows, head dim) tiles of a (rows, head dim, heads, batch) tensor whose head dim is
// contiguous (Q, K, V, dO): whether TMA can address such a tensor, and the descriptor the host
// builds for it. Rows past the tensor's end and head-dim columns past its head dim arrive as
// zeros, and still count in the bytes an mbarrier expects.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

namespace flash_dmattn::kernels::sm90 {

// One operand as TMA sees it.
struct TmaOperand {
  const void* ptr;
  int rows, heads;
  std::int64_t row_stride, head_stride, batch_stride;
};

// 16-bit elements in the 16 bytes that TMA and bulk copies align bases and strides to.
inline constexpr std::int64_t kTmaVector = 8;

// A dimension of extent 1 has no stride to speak of: it gets the one a packed tensor would have,
// so that the check below does not turn away, say, a single head with an arbitrary head stride.
inline void pack_unit_strides(TmaOperand& t, int head_dim, int batch) {
  if (t.rows == 1) t.row_stride = (head_dim + kTmaVector - 1) / kTmaVector * kTmaVector;
  if (t.heads == 1) t.head_stride = t.row_stride * t.rows;
  if (batch == 1) t.batch_stride = t.head_stride * t.heads;
}

// TMA reads a tensor through a 16-byte aligned base and strides that are positive multiples of 16
// bytes (below 2^40 bytes).
inline bool tma_addressable(const TmaOperand& t) {
  auto usable = [](std::int64_t stride) {
    return stride > 0 && stride % kTmaVector == 0 && stride < (std::int64_t(1) << 39);
  };
  return reinterpret_cast<std::uintptr_t>(t.ptr) % 16 == 0 && usable(t.row_stride) && usable(t.head_stride) &&
         usable(t.batch_stride);
}

template <typename Element>
using HeadRowsTensor = decltype(cute::make_tensor(
    cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
    cute::Shape<std::int32_t, std::int32_t, std::int32_t, std::int32_t>{},
    cute::Stride<std::int64_t, cute::_1, std::int64_t, std::int64_t>{}));

// The descriptor of kRows x kHeadDim tiles landing in shared memory laid out as SmemLayout.
template <typename Element, typename SmemLayout, int kRows, int kHeadDim>
using TmaRows = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, HeadRowsTensor<Element>{}, SmemLayout{},
                                             cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>>{}, cute::_1{}));

template <typename Element, typename SmemLayout, int kRows, int kHeadDim>
TmaRows<Element, SmemLayout, kRows, kHeadDim> make_tma_rows(const TmaOperand& t, int head_dim, int batch) {
  using namespace cute;
  const auto tensor = make_tensor(make_gmem_ptr(static_cast<const Element*>(t.ptr)),
                                  make_shape(t.rows, head_dim, t.heads, batch),
                                  make_stride(t.row_stride, _1{}, t.head_stride, t.batch_stride));
  return make_tma_copy(SM90_TMA_LOAD{}, tensor, SmemLayout{}, Shape<Int<kRows>, Int<kHeadDim>>{}, _1{});
}

}  // namespace flash_dmattn::kernels::sm90
