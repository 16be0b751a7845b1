// A CTA-wide exclusive prefix sum of one int per thread, for the key-list builds (key_lists.cu,
// index_bits.cu): each thread's count of keys places them in a list.
#pragma once

namespace flash_dmattn::kernels {

struct CtaPrefix {
  int before;  // the sum over the threads before this one
  int total;   // the sum over the CTA
};

// Every thread of a CTA of kWarps full warps must call it with its `n`. `warp_totals` is kWarps
// ints of shared memory, written here and read after one barrier: the caller must not write it
// again before the CTA's next barrier.
template <int kWarps>
__device__ __forceinline__ CtaPrefix cta_exclusive_sum(int n, int* warp_totals) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = n;
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  CtaPrefix prefix{inclusive - n, 0};
  for (int k = 0; k < kWarps; ++k) {
    prefix.before += k < warp ? warp_totals[k] : 0;
    prefix.total += warp_totals[k];
  }
  return prefix;
}

}  // namespace flash_dmattn::kernels
