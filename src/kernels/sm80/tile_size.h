// Tile shape of the sm80 forward per head dim; plain C++ so that host code (benchmarks counting
// visited tiles) can read it too.
#pragma once

namespace flash_dmattn::kernels::sm80 {

struct ForwardTile {
  int block_m, block_n, warps;
  int ctas_per_sm;  // the occupancy the kernel's register budget is sized for (launch bounds)
};

// Each warp owns 16 query rows, so a thread holds two rows of S (block_n wide) and of O (D wide).
// Measured on an H200 (bench_forward, B2 H16 Hk4 S8192 causal, mask + bias):
// - D = 128 as 128 x 64 with 4 warps (FlashAttention-2's shape) needs the accumulators of two
//   16-row slabs per thread: 255 registers and 888 bytes of spills with our mask/bias state.
// - 128 x 64 with 8 warps: no spills, but one 8-warp CTA per SM whose warps all wait at the same
//   barriers: 2.99 ms.
// - 64 x 64 with 4 warps, two CTAs per SM (independent barriers overlap one CTA's softmax with
//   the other's MMAs): 2.74 ms. D <= 64 likewise went from 2.12 to 2.04 ms (64 x 128).
// D > 128 keeps 128 x 64 with 8 warps: its O accumulator would not fit a 4-warp CTA.
constexpr ForwardTile forward_tile(int head_dim) {
  if (head_dim <= 64) return {64, 128, 4, 2};
  if (head_dim <= 128) return {64, 64, 4, 2};
  return {128, 64, 8, 1};
}

}  // namespace flash_dmattn::kernels::sm80
