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

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // max logit seen so far in the row, -inf while no visible key was seen
  float row_sum[kRows];  // this thread's part of sum exp(logit - row_max); quad-reduced in finalize

  __device__ __forceinline__ void init() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // s: (rows, cols) logits of one key tile, replaced by P = exp(s - new max). o: (rows, cols)
  // output accumulator, rescaled by exp(old max - new max).
  template <typename TensorS, typename TensorO>
  __device__ __forceinline__ void update(TensorS& s, TensorO& o) {
    float correction[kRows];
    fold(s, correction);
    rescale(o, correction);
  }

  // update() in two halves, for a main loop whose P·V MMA of the previous tile is still writing
  // the output while this tile's softmax runs: fold() replaces s by P and returns each row's
  // factor exp(old max - new max); rescale() applies it to the output once the MMA is done.
  template <typename TensorS>
  __device__ __forceinline__ void fold(TensorS& s, float (&correction)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float new_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) new_max = fmaxf(new_max, s(r, c));
      new_max = quad_max(new_max);
      // The one place -inf - (-inf) can arise: a row that has seen no visible key keeps max -inf.
      // Subtracting 0 instead makes every exp2(-inf) = 0 and leaves sum and output at 0.
      const float base = new_max == -INFINITY ? 0.f : new_max * kLog2e;
      correction[r] = exp2f(row_max[r] * kLog2e - base);
      row_max[r] = new_max;
      row_sum[r] *= correction[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(fmaf(s(r, c), kLog2e, -base));
        row_sum[r] += s(r, c);
      }
    }
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
