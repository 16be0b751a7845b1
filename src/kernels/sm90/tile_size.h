// Tile shapes of the sm90a forward and backward; plain C++ so that host code (planning split-KV, benchmarks
// counting visited tiles) can read it too.
#pragma once

#include "kernels/sm80/tile_size.h"

namespace flash_dmattn::kernels::sm90 {

// Two warpgroups of 64 query rows each (a wgmma is 64 rows tall), one CTA per SM. A thread holds
// 64 x block_n / 128 logits, the 16-bit P of the previous key tile (its P·V wgmma runs while this
// tile's softmax does) and 64 x D / 128 output accumulators. In the cp.async kernel below, at
// D = 128, block_n = 128 needed 2.3 KB of spills per thread (ptxas, sm_90a), and at D = 64 196
// bytes; block_n = 64 fits (255 registers, 20 bytes of spills at D = 128 with the bias and mask
// loads issued ahead of S).
//
// How the forward's K and V tiles arrive: by cp.async from every thread, which then meet at a
// barrier per tile (any strides), or by TMA from a producer warpgroup on mbarrier pipelines, which
// needs 16-byte aligned bases and strides. The producer gives its registers to the two computing
// warpgroups (240 each).
enum class KvLoads { cp_async, tma_producer };

// The cp.async kernel holds 64-key tiles at D > 32 (above). The warp-specialized kernel's consumers hold 128-key tiles at every head dim,
// which halves the barriers, waits and row reductions per key. They have 240 registers, and their
// main loop is compiled once per logit kind (LogitKind in mask_bias.h): with every kind in one
// loop they spilled 1.8 KB per thread at D = 128. Per kind (ptxas, sm_90a, bf16): no spill
// instruction in the loops of a staged bias row (the common (B, Hk, 1, Sk) 16-bit bias) at
// D = 64 and 128, nor without bias at D = 64; 5 at D = 128 without bias; 10 to 14 per loop with a
// bias row read from global memory or a bias per query row at D = 128, and up to 52 with a bias
// per query row at D = 64. On an H200 (B2 H16 Hk4 S8192 causal, one run, with the spills of the
// single loop): 1.35 -> 1.11 ms at D = 128 without mask or bias, 1.63 -> 1.19 ms at D = 64 with
// mask and bias.
// At D <= 32 the output takes 16 registers and both kernels fit 128 keys (B1 H2 S16384 D32 causal,
// mask + bias, H200, one run: 0.333 ms against 0.400 with 64-key tiles and 0.358 for sm80).
constexpr sm80::ForwardTile forward_tile(int head_dim, KvLoads loads) {
  return head_dim <= 32 || loads == KvLoads::tma_producer ? sm80::ForwardTile{128, 128, 8, 1}
                                                          : sm80::ForwardTile{128, 64, 8, 1};
}

// The backward: a CTA of two warpgroups owns a tile of block_n keys, whose dK and dV stay in
// registers, and walks query tiles of block_m rows. A wgmma is 64 rows tall, and dK = dSᵀ·Q and
// dV = Pᵀ·dO have the keys as rows. The warpgroups split the work one of two ways:
//  - keys: 128-key tiles, 64 keys per warpgroup, 64-row query tiles. A thread holds 64 x D / 128
//    accumulators each of dK and dV, and 32 each of S and dP; each warpgroup computes dQ for half
//    the head dim.
//  - query_rows: 64-key tiles, 128-row query tiles, 64 rows per warpgroup for S, dP and dQ; dK
//    and dV split by head dim, 64 x D / 256 accumulators each per thread. Twice the dQ reductions
//    and Q/dO loads of the other split per key, but half its dK/dV registers: at D = 128 the
//    keys split needs more than a thread's 255 (ptxas: 5.3 KB of spill stores).
enum class WarpgroupSplit { keys, query_rows };

struct BackwardTile {
  int block_m, block_n, warpgroups;
  int ctas_per_sm;
  WarpgroupSplit split;
};

constexpr BackwardTile backward_tile(int head_dim) {
  if (head_dim <= 64) return {64, 128, 2, 1, WarpgroupSplit::keys};
  return {128, 64, 2, 1, WarpgroupSplit::query_rows};
}

// Where dQ comes from: reductions of every (query tile, key tile) pair by the key-tile kernel, or
// a kernel of its own after it (bwd_dq_mainloop.h), for which the key-tile kernel is compiled
// without its dQ GEMM (a run-time branch around a wgmma serializes all of them: ptxas C7514).
enum class DqBy { key_tiles, dq_kernel };

// Whether the dQ kernel exists for a head dim: where the key-tile kernel splits by query rows,
// whose dQ reductions per key are twice the keys split's. Measured on an H200 (B2 H16 Hk4 8192
// causal, all-true mask, bias (B,Hk,1,Sk)): D128 backward 5.84 -> 5.35 ms, deterministic 9.70 ->
// 5.33; D64 (keys split) 4.65 -> 5.42 in a first version (docs/architecture.md).
constexpr bool has_dq_kernel(int head_dim) { return backward_tile(head_dim).split == WarpgroupSplit::query_rows; }

}  // namespace flash_dmattn::kernels::sm90
