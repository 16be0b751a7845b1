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

// Whether the forward has its ring of K/V stages (KvPipeline::ring in fwd_mainloop.h), which runs
// decodes and KV caches: where two stages fit an A100's 163 KB per CTA beside Q (fwd_traits.h
// checks it), not at D = 256 (192 KB).
constexpr bool has_ring(int head_dim) { return head_dim <= 192; }

// Whether the ring's warps can split each tile's keys (KvPipeline::ring_split_keys): where a
// warp's share, block_n / warps keys, is whole 16-key MMA steps (not at D = 192: 8 keys).
constexpr bool has_split_keys_ring(int head_dim) {
  const ForwardTile t = forward_tile(head_dim);
  return has_ring(head_dim) && (t.block_n / t.warps) % 16 == 0;
}

// The ring's K/V stages at a compiled head dim: as many as fit beside Q in 112 KB, so that two
// CTAs share an H100's SM, from 2 to 4 (D = 64 and 128: 3; D = 192: 2, 144 KB). And its shared
// memory (16-bit elements; fwd_traits.h asserts it equals the layouts'), which the host checks
// against the device: sm_86 and sm_89 GPUs offer a CTA 99 KB, less than the ring takes at D >= 64.
constexpr int ring_stages(int head_dim) {
  const ForwardTile t = forward_tile(head_dim);
  const int stages = (112 * 1024 - t.block_m * head_dim * 2) / (2 * t.block_n * head_dim * 2);
  return stages < 2 ? 2 : stages > 4 ? 4 : stages;
}
constexpr int ring_smem_bytes(int head_dim) {
  const ForwardTile t = forward_tile(head_dim);
  return t.block_m * head_dim * 2 + ring_stages(head_dim) * 2 * t.block_n * head_dim * 2;
}

// The backward: a CTA owns one key tile of block_n keys (its dK and dV stay in registers) and
// walks the query tiles of block_m rows. Its three GEMM shapes spread 8 warps differently:
//   S = Q·Kᵀ and dP = dO·Vᵀ   (block_m x block_n): sdp_warps_m x (8 / sdp_warps_m)
//   dV += Pᵀ·dO, dK += dSᵀ·Q  (block_n x D):       dkv_warps_n x (8 / dkv_warps_n)
//   dQ = dS·K                 (block_m x D):       dq_warps_m x (8 / dq_warps_m)
// D <= 128 uses block_n = 64, half of FlashAttention-2's 128: measured on an H100 (bench_forward,
// train_dense_d128 backward with dbias), 64 x 128 ran 10.9 ms with 183 spill loads against 9.0 ms
// for 64 x 64 (8.9 ms with softcap compiled out, which frees the 64 x 128 shape's dS scale
// registers but still spills); a 2 x 4 warp grid for S at 64 x 64 ran 9.4 ms. D > 128 halves
// block_n for the same reason: dK and dV must fit in registers.
struct BackwardTile {
  int block_m, block_n, warps;
  int sdp_warps_m, dkv_warps_n, dq_warps_m;
  int ctas_per_sm;
  bool double_buffer;  // Q and dO of the next query tile load while the current one computes
};

// Every GEMM's warp grid must tile its output exactly: a column tile that overhangs D would make
// the MMA read (and racecheck flag) shared memory past the operand's end. D = 96 therefore gives
// dK/dV a 4 x 2 grid (32-column steps) where D = 128 uses 2 x 4 (64-column steps).
constexpr BackwardTile backward_tile(int head_dim) {
  if (head_dim <= 64) return {64, 128, 8, 2, 4, 4, 1, true};
  if (head_dim <= 96) return {64, 64, 8, 4, 4, 4, 1, true};
  if (head_dim <= 128) return {64, 64, 8, 4, 2, 4, 1, true};
  return {64, 64, 8, 4, 2, 4, 1, false};
}

// The backward's gather path (bwd_gather_mainloop.h) runs head dims up to this one.
inline constexpr int kMaxGatherBackwardHeadDim = 128;

// The gather backward with the rows of `heads` query heads of one KV head stacked in one tile
// (they read one key list): block_m rows of each head, so that dK = dSᵀ·Q and dV = Pᵀ·dO sum the
// heads inside the MMA and each chunk's fp32 reductions serve them all. S and dP take one warp per
// 16 rows: the 4 x 2 grid's per-row state (four rows a thread) spilled 160 bytes at D = 128
// against 112.
constexpr BackwardTile gather_backward_tile(int head_dim, int heads) {
  BackwardTile tile = backward_tile(head_dim);
  tile.block_m *= heads;
  tile.sdp_warps_m = 8;
  return tile;
}

// The head dims whose gather backward takes two heads per CTA. Measured on an H200 (bench CLI,
// B2 H16/4 S8192 causal, top-2048 scattered keys, prepared mask, gpu ms): D128 4.66 -> 3.55;
// D64 2.77 -> 2.70, with 304 bytes of spills; the seed's D32 slower (top-1024 0.168 -> 0.175,
// top-4096 0.495 -> 0.531, its 64-key-block mask 0.086 -> 0.138). D96 is not measured.
constexpr bool gather_backward_pairs_heads_at(int head_dim) { return head_dim > 96 && head_dim <= 128; }

}  // namespace flash_dmattn::kernels::sm80
