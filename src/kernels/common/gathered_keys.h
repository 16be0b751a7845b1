// The gather path's part of a forward main loop: the CTA's key list (KeyLists, built by
// key_lists.cu), walked in chunks of kBlockN keys. A chunk's K and V rows are gathered by cp.async
// into the tile the dense loop would load, and its logits take each row's mask bit and bias value
// at the gathered keys' own columns.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

template <int kBlockN>
struct GatheredKeys {
  const int* keys;  // this CTA's list, ascending
  int count;

  __device__ __forceinline__ GatheredKeys(const KeyLists& lists, int b, int query_head, int m_block) {
    const std::int64_t list = b * lists.batch_stride + (query_head / lists.head_divisor) * lists.head_stride + m_block;
    keys = lists.keys + list * lists.capacity;
    count = lists.counts[list];
  }

  __device__ __forceinline__ int chunks() const { return (count + kBlockN - 1) / kBlockN; }

  // Gathers the K or V rows of chunk c into a (kBlockN, D) tile; base: row 0 of this (batch, KV
  // head). Rows past the list's end are zero-filled: zero V rows keep P·V finite where P is 0.
  // dst, coords: the thread's vectors as the tiled copy partitions them, (vector, rows, cols).
  template <typename Element, typename TensorD, typename TensorC>
  __device__ __forceinline__ void load(TensorD& dst, const TensorC& coords, int c, const Element* base,
                                       std::int64_t row_stride, int head_dim) const {
    const int* chunk = keys + c * kBlockN;
    copy_q_rows_async<Element>(dst, coords, count - c * kBlockN, head_dim,
                               [&](int row) { return base + chunk[row] * row_stride; });
  }

  // Turns the raw q·k products of chunk c into logits, as MaskBiasPolicy::apply does for a key
  // tile: z = softcap(scale·qk) + bias, -inf where the row does not see the key (its mask bit,
  // causal alignment, past Sq, or past the list's end). Every element is tested: a chunk's keys
  // are scattered, so no chunk is known to be wholly visible.
  template <typename Kind, typename Policy, typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(Kind, const Policy& policy, TensorS& s_flat, const TensorC& coords_flat,
                                        int c) const {
    using namespace cute;
    using T = typename Kind::BiasElement;
    Tensor s = make_tensor(s_flat.data(), accumulator_as_rows_cols(s_flat.layout()));
    Tensor coords = make_tensor(coords_flat.data(), accumulator_as_rows_cols(coords_flat.layout()));
    constexpr int kRows = decltype(size<0>(s))::value, kCols = decltype(size<1>(s))::value;
    int key[kCols];  // the key at each of the thread's columns, -1 past the list's end
    CUTE_UNROLL
    for (int col = 0; col < kCols; ++col) {
      const int at = c * kBlockN + get<1>(coords(0, col));
      key[col] = at < count ? keys[at] : -1;
    }
    const float logit_scale = Kind::kSoftcap ? policy.scale / policy.softcap : policy.scale;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int i = policy.row_index[r];
      CUTE_UNROLL
      for (int col = 0; col < kCols; ++col) {
        const int j = key[col], in_bounds = max(j, 0);
        float z;
        if constexpr (Kind::kSoftcap) {
          z = policy.softcap * tanhf(s(r, col) * logit_scale);
        } else {
          z = s(r, col) * logit_scale;
        }
        if constexpr (Kind::kBias != BiasSource::none) {
          z += static_cast<float>(reinterpret_cast<const T*>(policy.bias_row[r])[policy.bias_key_broadcast ? 0 : in_bounds]);
        }
        bool visible = j >= 0 && i < policy.seqlen_q && (!policy.causal || j <= i + policy.diagonal);
        if (policy.has_mask) {
          const int bit = policy.mask_key_broadcast ? 0 : in_bounds;
          visible = visible && ((policy.mask_bits[r][bit / 32] >> (bit % 32)) & 1u);
        }
        s(r, col) = visible ? z : -INFINITY;
      }
    }
  }
};

}  // namespace flash_dmattn::kernels
