// The mask and bias policy: classify a (query tile, key tile) pair, walk the tiles that have
// visible keys, and turn raw q·k products into final logits (scale, softcap, bias, -inf where hidden).
//
// Emptiness comes from the tile summary (src/kernels/common/tile_summary.cu), built once per call;
// causal and sequence-end limits come from index arithmetic and never from reading the mask.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>
#include <type_traits>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

struct TileClass {
  bool skip;         // no visible key: no loads, no MMA, no softmax
  bool elementwise;  // some key may be hidden: apply mask, causal and length limits per element
};

template <int kBlockM, int kBlockN>
struct MaskBiasPolicy {
  static_assert(kBlockM % kSummaryBlock == 0 && kBlockN % kSummaryBlock == 0, "tiles are whole summary blocks");

  // Plain copies of what the policy reads: holding a reference to the __grid_constant__
  // parameters would take their address and move every access to generic memory.
  int seqlen_q, seqlen_k;
  bool causal;
  float scale, softcap;
  int m_begin, m_end;  // query rows [m_begin, m_end) of this CTA that exist
  int diagonal;        // causal: row i sees keys j <= i + diagonal
  const std::uint8_t* summary = nullptr;  // this (batch, mask head)'s summary, or nullptr without a mask
  std::int64_t summary_row_stride = 0, summary_col_stride = 0;
  const std::uint8_t* mask = nullptr;  // this (batch, mask head)'s mask
  std::int64_t mask_row_stride = 0, mask_col_stride = 0;
  const void* bias = nullptr;  // this (batch, bias head)'s bias
  ElementType bias_type = ElementType::float16;
  std::int64_t bias_row_stride = 0, bias_col_stride = 0;

  __device__ __forceinline__ MaskBiasPolicy(const ForwardParams& p, int b, int h, int m_block)
      : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k), causal(p.causal), scale(p.scale), softcap(p.softcap),
        m_begin(m_block * kBlockM), m_end(min(m_block * kBlockM + kBlockM, p.seqlen_q)),
        diagonal(p.seqlen_k - p.seqlen_q) {
    if (p.summary.classes) {
      summary = p.summary.classes + b * p.summary.batch_stride + (h / p.summary.head_divisor) * p.summary.head_stride;
      summary_row_stride = p.summary.row_stride;
      summary_col_stride = p.summary.col_stride;
    }
    if (p.mask.ptr) {
      mask = static_cast<const std::uint8_t*>(p.mask.ptr) + b * p.mask.batch_stride +
             (h / p.mask.head_divisor) * p.mask.head_stride;
      mask_row_stride = p.mask.row_stride;
      mask_col_stride = p.mask.col_stride;
    }
    if (p.bias.ptr) {
      const int bytes = p.bias.type == ElementType::float32 ? 4 : 2;
      bias = static_cast<const char*>(p.bias.ptr) +
             bytes * (b * p.bias.batch_stride + (h / p.bias.head_divisor) * p.bias.head_stride);
      bias_type = p.bias.type;
      bias_row_stride = p.bias.row_stride;
      bias_col_stride = p.bias.col_stride;
    }
  }

  // One past the last key tile any row of this CTA can see.
  __device__ __forceinline__ int n_block_end() const {
    int keys = seqlen_k;
    if (causal) keys = min(keys, max(0, m_end - 1 + diagonal + 1));
    return (keys + kBlockN - 1) / kBlockN;
  }

  __device__ __forceinline__ TileClass classify(int n_block) const {
    const int n_begin = n_block * kBlockN, n_last = min(n_begin + kBlockN, seqlen_k) - 1;
    TileClass c{false, n_begin + kBlockN > seqlen_k || (causal && n_last > m_begin + diagonal)};
    if (summary) {
      std::uint8_t bits = 0;
      for (int r = m_begin / kSummaryBlock; r <= (m_end - 1) / kSummaryBlock; ++r)
        for (int k = n_begin / kSummaryBlock; k <= n_last / kSummaryBlock; ++k)
          bits |= summary[r * summary_row_stride + k * summary_col_stride];
      c.skip = !(bits & kTileHasVisible);
      c.elementwise |= (bits & kTileHasHidden) != 0;
    }
    return c;
  }

  // s: raw q·k products of key tile n_block; coords: the (row, col) of each element in the tile.
  // Writes z = softcap(scale·qk) + bias, or -inf where the key is hidden. The flags are uniform,
  // so they pick one specialized loop per tile instead of being tested per element.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& s, const TensorC& coords, int n_block, bool elementwise) const {
    if (softcap > 0.f) {
      apply_bias_kind<true>(s, coords, n_block, elementwise);
    } else {
      apply_bias_kind<false>(s, coords, n_block, elementwise);
    }
  }

 private:
  struct NoBias {};

  template <bool kSoftcap, typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_bias_kind(TensorS& s, const TensorC& coords, int n_block, bool elementwise) const {
    if (!bias) {
      apply_elementwise<kSoftcap, NoBias>(s, coords, n_block, elementwise);
    } else if (bias_type == ElementType::float32) {
      apply_elementwise<kSoftcap, float>(s, coords, n_block, elementwise);
    } else if (bias_type == ElementType::bfloat16) {
      apply_elementwise<kSoftcap, cute::bfloat16_t>(s, coords, n_block, elementwise);
    } else {
      apply_elementwise<kSoftcap, cute::half_t>(s, coords, n_block, elementwise);
    }
  }

  template <bool kSoftcap, typename BiasElement, typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_elementwise(TensorS& s, const TensorC& coords, int n_block, bool elementwise) const {
    if (elementwise) {
      apply_tile<kSoftcap, BiasElement, true>(s, coords, n_block);
    } else {
      apply_tile<kSoftcap, BiasElement, false>(s, coords, n_block);
    }
  }

  template <bool kSoftcap, typename BiasElement, bool kElementwise, typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_tile(TensorS& s, const TensorC& coords, int n_block) const {
    using namespace cute;
    constexpr bool kBias = !std::is_same_v<BiasElement, NoBias>;
    const float logit_scale = kSoftcap ? scale / softcap : scale;
    const int n_begin = n_block * kBlockN;
    CUTE_UNROLL
    for (int e = 0; e < size(s); ++e) {
      const int i = m_begin + get<0>(coords(e));
      const int j = n_begin + get<1>(coords(e));
      float z = s(e) * logit_scale;
      if constexpr (kSoftcap) z = softcap * tanhf(z);
      if constexpr (kBias) {
        // Rows past Sq (the last query tile) and keys past Sk (the last key tile) read the last
        // existing element instead: always in bounds, no predicate; those logits are discarded.
        const std::int64_t bias_i = min(i, seqlen_q - 1), bias_j = min(j, seqlen_k - 1);
        z += static_cast<float>(
            static_cast<const BiasElement*>(bias)[bias_i * bias_row_stride + bias_j * bias_col_stride]);
      }
      if constexpr (kElementwise) {
        bool visible = i < seqlen_q && j < seqlen_k && (!causal || j <= i + diagonal);
        if (visible && mask) visible = mask[i * mask_row_stride + j * mask_col_stride] != 0;
        if (!visible) z = -INFINITY;
      }
      s(e) = z;
    }
  }
};

// Walks the key tiles with visible keys in descending order. Each warp classifies 32 tiles at
// once, one per lane, and keeps the answers as ballots, so no tile needs a second summary read
// and the walk costs no shared memory or barrier. Every warp computes the same ballots, so the
// walk is uniform across the CTA.
struct ActiveTileWalk {
  int chunk_top = -1;  // lane l holds tile chunk_top - l
  std::uint32_t active = 0, elementwise = 0;

  // The first tile at or below n that has a visible key, or -1.
  template <typename Policy>
  __device__ __forceinline__ int next_at_or_below(int n, const Policy& policy) {
    while (n >= 0) {
      if (n > chunk_top || n <= chunk_top - 32) load(n, policy);
      const int lane = chunk_top - n;
      const std::uint32_t candidates = active & (~0u << lane);
      if (candidates) return chunk_top - (__ffs(candidates) - 1);
      n = chunk_top - 32;
    }
    return -1;
  }

  // Valid for the tile last returned by next_at_or_below, until the next call.
  __device__ __forceinline__ bool needs_elementwise(int n) const { return (elementwise >> (chunk_top - n)) & 1u; }

 private:
  template <typename Policy>
  __device__ __forceinline__ void load(int top, const Policy& policy) {
    const int lane = threadIdx.x % 32, n = top - lane;
    const TileClass c = n >= 0 ? policy.classify(n) : TileClass{true, false};
    chunk_top = top;
    active = __ballot_sync(0xffffffffu, !c.skip);
    elementwise = __ballot_sync(0xffffffffu, c.elementwise);
  }
};

}  // namespace flash_dmattn::kernels
