// Tile shapes of the sm90a forward and backward; plain C++ so that host code (planning split-KV, benchmarks
// counting visited tiles) can read it too.
#pragma once

#include "kernels/sm80/tile_size.h"

namespace flash_dmattn::kernels::sm90 {

// Two warpgroups of 64 query rows each (a wgmma is 64 rows tall), one CTA per SM. A thread holds
// 64 x block_n / 128 logits, the 16-bit P of the previous key tile (its P·V wgmma runs while this
// tile's softmax does) and 64 x D / 128 output accumulators. At D = 128, block_n = 128 needed
// 2.3 KB of spills per thread (ptxas, sm_90a), and at D = 64 196 bytes; block_n = 64 fits (255
// registers, 20 bytes of spills at D = 128 with the bias and mask loads issued ahead of S).
//
// How the forward's K and V tiles arrive: by cp.async from every thread, which then meet at a
// barrier per tile (any strides), or by TMA from a producer warpgroup on mbarrier pipelines, which
// needs 16-byte aligned bases and strides. The producer gives its registers to the two computing
// warpgroups (240 each).
enum class KvLoads { cp_async, tma_producer };

constexpr sm80::ForwardTile forward_tile(int /*head_dim*/, KvLoads /*loads*/ = KvLoads::tma_producer) {
  return {128, 64, 8, 1};
}

// The backward: a CTA owns block_n = 128 keys, 64 per warpgroup (a wgmma is 64 rows tall, and
// dK = dSᵀ·Q and dV = Pᵀ·dO have the keys as rows), and walks query tiles of block_m = 64 rows.
// A thread holds 64 x D / 128 accumulators each of dK and dV, and 64 x 64 / 128 each of S and dP.
struct BackwardTile {
  int block_m, block_n, warpgroups;
  int ctas_per_sm;
};

constexpr BackwardTile backward_tile(int /*head_dim*/) { return {64, 128, 2, 1}; }

}  // namespace flash_dmattn::kernels::sm90
