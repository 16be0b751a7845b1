// Online softmax over the key tiles of the query rows one thread holds.
//
// Logits arrive in natural units (scale, softcap and bias applied) with -inf on hidden keys.
// Exponentials run in base 2 as exp2(x·log2 e - max·log2 e), one FFMA and one MUFU op each.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>

namespace flash_dmattn::kernels {

inline constexpr float kLog2e = 1.4426950408889634f;

// Max and sum across the 4 threads of a quad, which together hold one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// How far a tile's logits may rise above a row's reference max before the reference moves: P
// stays below 2^8, harmless in fp32 sums and in 16-bit P (relative rounding does not depend on
// magnitude), and once a row has seen its largest logits the output is rarely rescaled again.
// The output then needs rescaling only on the tiles where some reference moved (FlashAttention-4).
inline constexpr float kMaxGrowth = 8.f / kLog2e;  // 8 powers of two, in natural units

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // the reference max of the row, -inf while no visible key was seen
  float row_sum[kRows];  // this thread's part of sum exp(logit - row_max); quad-reduced in finalize

  __device__ __forceinline__ void init() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // s: (rows, cols) logits of one key tile, replaced by P = exp(s - reference max). o: (rows, cols)
  // output accumulator, rescaled where the reference moved.
  template <typename TensorS, typename TensorO>
  __device__ __forceinline__ void update(TensorS& s, TensorO& o) {
    float correction[kRows];
    if (fold(s, correction)) rescale(o, correction);
  }

  // update() in two halves, for a main loop whose P·V MMA of the previous tile is still writing
  // the output while this tile's softmax runs: fold() replaces s by P and returns each row's
  // factor exp(old reference - new reference); rescale() applies it to the output once the MMA is
  // done. fold() returns false when every factor of the warp is 1: the references stay unless a
  // row of the warp would exceed its own by more than kMaxGrowth (the decision is warp-uniform, so
  // the caller's skip of rescale() is too; every lane of the warp must call fold()).
  template <typename TensorS>
  __device__ __forceinline__ bool fold(TensorS& s, float (&correction)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    float tile_max[kRows];
    bool keep = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_max[r] = -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) tile_max[r] = fmaxf(tile_max[r], s(r, c));
      tile_max[r] = quad_max(tile_max[r]);
      // A row that has seen no visible key (reference -inf) keeps it only while it still sees none.
      keep &= tile_max[r] <= row_max[r] + kMaxGrowth;
    }
    keep = __all_sync(0xffffffffu, keep);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float new_max = keep ? row_max[r] : fmaxf(row_max[r], tile_max[r]);
      // The one place -inf - (-inf) can arise: a row that has seen no visible key keeps max -inf.
      // Subtracting 0 instead makes every exp2(-inf) = 0 and leaves sum and output at 0.
      const float base = new_max == -INFINITY ? 0.f : new_max * kLog2e;
      correction[r] = keep ? 1.f : exp2f(row_max[r] * kLog2e - base);
      row_max[r] = new_max;
      row_sum[r] *= correction[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(fmaf(s(r, c), kLog2e, -base));
        row_sum[r] += s(r, c);
      }
    }
    return !keep;
  }

  template <typename TensorO>
  __device__ __forceinline__ static void rescale(TensorO& o, const float (&correction)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
    }
  }

  // Divides the output by the softmax denominator and returns the natural-log LSE of each row.
  // A row whose denominator is 0 (no visible key, or only -inf logits) gets O = 0, LSE = +inf.
  template <typename TensorO>
  __device__ __forceinline__ void finalize(TensorO& o, float (&lse)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? INFINITY : row_max[r] + logf(sum);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    }
  }
};

}  // namespace flash_dmattn::kernels
