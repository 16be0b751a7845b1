// Tile shape of the sm80 forward per head dim; plain C++ so that host code (benchmarks counting
// visited tiles) can read it too.
#pragma once

namespace flash_dmattn::kernels::sm80 {

struct ForwardTile {
  int block_m, block_n, warps;
};

// 128 query rows per CTA amortize the K/V loads. Eight warps keep the S (128 x block_n) and
// O (128 x D) accumulators in registers: with four warps the D = 128 kernel used 255 registers
// and spilled 436 bytes (ptxas, sm_90); with eight it uses 216 and spills nothing.
constexpr ForwardTile forward_tile(int head_dim) {
  if (head_dim <= 64) return {128, 128, 8};
  return {128, 64, 8};
}

}  // namespace flash_dmattn::kernels::sm80
