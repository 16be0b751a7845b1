// Views the reference's packed and cached calls run each sequence on: a batch of one over a
// sequence's rows, and a sequence's part of a broadcast mask, bias or key-index operand.
#pragma once

#include <cstdint>

#include "flash_dmattn/tensor.h"

namespace flash_dmattn::reference {

// Element b of a (B + 1,) or (B,) int32 view.
inline std::int64_t int_at(const TensorView& t, std::int64_t b) {
  return static_cast<const std::int32_t*>(t.data)[b * t.stride[0]];
}

inline char* element_address(const TensorView& t, std::int64_t offset) {
  return static_cast<char*>(t.data) + offset * static_cast<std::int64_t>(dtype_size(t.dtype));
}

// Rows [first, first + length) of a packed (total, heads, D) view, as a batch of one.
inline TensorView batch_of_one(const TensorView& packed, std::int64_t first, std::int64_t length) {
  TensorView v = packed;
  v.rank = 4;
  v.data = element_address(packed, first * packed.stride[0]);
  const std::int64_t shape[4] = {1, length, packed.shape[1], packed.shape[2]};
  const std::int64_t stride[4] = {0, packed.stride[0], packed.stride[1], packed.stride[2]};
  for (int d = 0; d < 4; ++d) {
    v.shape[d] = shape[d];
    v.stride[d] = stride[d];
  }
  return v;
}

// Sequence b's part of a (B|1, heads, Sq|1, Sk|1) operand: its batch, its first `rows` query rows
// and `keys` keys (a broadcast dimension stays one; a bit-packed mask keeps the bytes of its
// keys). Key indices (B|1, heads, Sq|1, K) keep their list: pass keys < 0.
inline TensorView sequence_operand(const TensorView& t, std::int64_t b, std::int64_t rows, std::int64_t keys) {
  TensorView v = t;
  if (t.shape[0] != 1) {
    v.data = element_address(t, b * t.stride[0]);
    v.shape[0] = 1;
  }
  if (t.shape[2] != 1) v.shape[2] = rows;
  if (keys >= 0 && t.shape[3] != 1) v.shape[3] = t.dtype == DType::uint8 ? (keys + 7) / 8 : keys;
  return v;
}

}  // namespace flash_dmattn::reference
