// TMA loads of (rows, head dim) tiles of a (rows, head dim, heads, batch) tensor whose head dim is
// contiguous (Q, K, V, dO): the descriptor the host builds for one (tma_operand.h says whether
// TMA can address it). Rows past the tensor's end and head-dim columns past its head dim arrive as
// zeros, and still count in the bytes an mbarrier expects.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

#include "kernels/sm90/tma_operand.h"

namespace flash_dmattn::kernels::sm90 {

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
