// A KV cache in the fp64 reference: each sequence is the batched forward on its own cached keys
// (docs/semantics.md §12), a batch of one whose K and V rows are gathered from the pages (or
// viewed in the contiguous cache) and whose mask, bias and indices are its part of theirs.
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "reference.h"
#include "views.h"

namespace flash_dmattn::reference {
namespace {

// Element b of a batched view's first dim, as a batch of one.
TensorView batch_element(const TensorView& t, std::int64_t b) {
  TensorView v = t;
  v.data = element_address(t, b * t.stride[0]);
  v.shape[0] = 1;
  return v;
}

// Sequence b's first `length` logical keys of a cache, as (1, length, Hk, D): a view of a
// contiguous cache, or the rows of its pages copied into `rows`.
TensorView sequence_keys(const TensorView& cache, const Cache& c, std::int64_t b, std::int64_t length,
                         std::vector<unsigned char>* rows) {
  if (!c.block_table) {
    TensorView v = batch_element(cache, b);
    v.shape[1] = length;
    return v;
  }
  const std::int64_t heads = cache.shape[2], dim = cache.shape[3], page_size = cache.shape[1];
  const std::size_t row_bytes = static_cast<std::size_t>(dim) * dtype_size(cache.dtype);
  rows->assign(static_cast<std::size_t>(length * heads) * row_bytes, 0);
  const TensorView& table = *c.block_table;
  for (std::int64_t j = 0; j < length; ++j) {
    const std::int64_t page = static_cast<const std::int32_t*>(table.data)[b * table.stride[0] + (j / page_size) * table.stride[1]];
    for (std::int64_t h = 0; h < heads; ++h) {
      const char* src = element_address(cache, page * cache.stride[0] + (j % page_size) * cache.stride[1] + h * cache.stride[2]);
      std::memcpy(rows->data() + static_cast<std::size_t>(j * heads + h) * row_bytes, src, row_bytes);
    }
  }
  TensorView v = cache;
  v.data = rows->data();
  const std::int64_t shape[4] = {1, length, heads, dim}, stride[4] = {0, heads * dim, dim, 1};
  for (int d = 0; d < 4; ++d) {
    v.shape[d] = shape[d];
    v.stride[d] = stride[d];
  }
  return v;
}

}  // namespace

ForwardResult forward(const Inputs& in, const Cache& c) {
  const std::int64_t B = in.q.shape[0], Sq = in.q.shape[1], H = in.q.shape[2], D = in.q.shape[3];
  ForwardResult r;
  r.out.assign(B * Sq * H * D, 0.0);
  r.lse.assign(B * H * Sq, std::numeric_limits<double>::infinity());
  std::vector<unsigned char> k_rows, v_rows;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t length = int_at(*c.seqlens_k, b);
    if (length == 0 || Sq == 0) continue;  // no keys: its rows stay empty (O = 0, LSE = +inf)
    Inputs one = in;
    TensorView mask, bias, indices;
    one.q = batch_element(in.q, b);
    one.k = sequence_keys(in.k, c, b, length, &k_rows);
    one.v = sequence_keys(in.v, c, b, length, &v_rows);
    if (in.mask) one.mask = &(mask = sequence_operand(*in.mask, b, Sq, length));
    if (in.bias) one.bias = &(bias = sequence_operand(*in.bias, b, Sq, length));
    if (in.indices) one.indices = &(indices = sequence_operand(*in.indices, b, Sq, -1));
    const ForwardResult part = forward(one);  // out (1, Sq, H, D), lse (1, H, Sq)
    std::memcpy(&r.out[b * Sq * H * D], part.out.data(), part.out.size() * sizeof(double));
    std::memcpy(&r.lse[b * H * Sq], part.lse.data(), part.lse.size() * sizeof(double));
  }
  return r;
}

}  // namespace flash_dmattn::reference
