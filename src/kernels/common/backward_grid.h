// Where a backward CTA sits in its grid, for every kernel family: one CTA per (key tile, KV
// head, batch), or head_splits of them, each walking a share of the KV head's query heads; or in
// deterministic mode key_splits CTAs per (KV head, batch) that share out the key tiles.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/detail/helper_macros.hpp>

#include "kernels/common/mask_bias.h"
#include "kernels/common/launch.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// The gather path's grid (either kernel family): x the query tiles of the lists, the last first
// (under causal masking they keep the most keys), y the query heads in groups of `packed_heads`,
// z the batch.
__host__ __device__ inline GridShape gather_backward_grid(const BackwardParams& p, int list_rows, int packed_heads) {
  return {(p.fwd.seqlen_q + list_rows - 1) / list_rows, p.fwd.heads / packed_heads, p.fwd.batch};
}

__host__ __device__ inline int key_tile_count(const BackwardParams& p, int block_n) {
  return (p.fwd.seqlen_k + block_n - 1) / block_n;
}

// The grid: x the key tiles of kBlockN keys (key_splits in deterministic mode), y the KV head's
// head splits, z the batch; folded into grid.x (launch.h).
__host__ __device__ inline GridShape backward_grid_shape(const BackwardParams& p, int block_n) {
  return {p.deterministic ? p.key_splits : key_tile_count(p, block_n), std::int64_t(p.fwd.kv_heads) * p.head_splits,
          p.fwd.batch};
}

// The query heads a key-tile CTA walks, [first, end), all of KV head kv_head's GQA group or, with
// BackwardParams::head_splits, the split-th share of it (whose dK and dV go to accumulator slot
// split: store_dk_dv).
struct WalkHeads {
  int kv_head, first, end, split;
};

// Calls tile(n_block, heads, batch, split) for every key tile of this CTA (heads: WalkHeads). Key tile 0 sees the
// most query tiles under causal masking: the lowest indices start first. In deterministic mode
// (fewer CTAs than key tiles) CTA s takes one key tile of every group of that many, s-th from the
// front in even groups and from the back in odd ones: under causal masking every CTA then gets
// about the same number of query tiles (with a plain stride over 128 key tiles, CTA 0 of 16 had
// 26% more than CTA 15, and the whole grid waited for it).
template <int kBlockN, typename TileFn>
__device__ __forceinline__ void for_each_key_tile(const BackwardParams& p, TileFn&& tile) {
  const int key_tiles = key_tile_count(p, kBlockN);
  const GridShape shape = backward_grid_shape(p, kBlockN);
  const GridCoords cta = unfold_block(shape);
  const int ctas = static_cast<int>(shape.x);
  for (int group = 0; group * ctas < key_tiles; ++group) {
    const int n_block = group % 2 == 0 ? group * ctas + cta.x : (group + 1) * ctas - 1 - cta.x;
    if (n_block >= key_tiles) continue;
    const int kv_head = cta.y / p.head_splits, share = p.fwd.heads / p.fwd.kv_heads / p.head_splits;
    const int first = kv_head * share * p.head_splits + cta.y % p.head_splits * share;
    tile(n_block, WalkHeads{kv_head, first, first + share, cta.y % p.head_splits}, cta.z, cta.x);
  }
}

// For every query head h of `heads`, in turn: calls load(h, m_block) for the first query
// tile of h that has a row seeing a key of key tile n_block, then tile(h, m_block, next,
// elementwise) for each such tile in descending order (next: the one after it, or -1), so that
// tile() can load next behind its math. dBias elements of query tiles the walk skips are zeroed
// (a dBias written directly owns them), and the per-key dBias sums are flushed once the last
// query head that reads their bias head is done (coords_rc and reduce as BiasGradTile takes them).
template <int kBlockM, int kBlockN, typename DBias, typename CoordsRC, typename Load, typename Tile>
__device__ __forceinline__ void for_each_query_tile(const BackwardParams& p, int b, const WalkHeads& heads, int n_block,
                                                    DBias& dbias, const CoordsRC& coords_rc, float* reduce, Load&& load,
                                                    Tile&& tile) {
  const ForwardParams& f = p.fwd;
  const int n_begin = n_block * kBlockN;
  const int m_tiles = (f.seqlen_q + kBlockM - 1) / kBlockM;
  for (int h = heads.first; h < heads.end; ++h) {
    const QueryTileClassifier<kBlockM, kBlockN> classifier(f, b, h, n_block);
    const int m_first = classifier.first_m_block();
    ActiveTileWalk walk;
    auto next_active = [&](int m) {
      const int next = walk.next_at_or_below(m, classifier);
      return next >= m_first ? next : -1;
    };
    int m_block = next_active(m_tiles - 1);
    int zero_top = m_tiles;  // query tiles at or above this one are done (for dbias zero-filling)
    if (m_block >= 0) load(h, m_block);
    while (m_block >= 0) {
      const bool elementwise = walk.needs_elementwise(m_block);
      const int next = next_active(m_block - 1);
      dbias.zero_tiles(h, m_block + 1, zero_top, n_begin, f.seqlen_q, f.seqlen_k);
      zero_top = m_block;
      tile(h, m_block, next, elementwise);
      m_block = next;
    }
    dbias.zero_tiles(h, 0, zero_top, n_begin, f.seqlen_q, f.seqlen_k);
    if (h + 1 == heads.end || (h + 1) / p.dbias.head_divisor != h / p.dbias.head_divisor) {
      dbias.flush_columns(coords_rc, reduce, h, n_begin, f.seqlen_k);
    }
  }
}

// The fp32 dQ accumulator rows of query head h: slot 0, or in deterministic mode the CTA's own.
__device__ __forceinline__ float* dq_accum_rows(const BackwardParams& p, int b, int h, int split) {
  const ForwardParams& f = p.fwd;
  return p.dq_accum + ((std::int64_t(p.deterministic ? split : 0) * f.batch + b) * f.heads + h) *
                          std::int64_t(p.accum_rows) * f.head_dim;
}

// Launches a backward kernel of Traits for `p` over that grid on `stream`, with the dynamic shared
// memory its tiles take; the kernel takes `args` (p, or p and more).
template <typename Traits, typename KernelArgs>
cudaError_t launch_backward(void (*kernel)(KernelArgs), const KernelArgs& args, const BackwardParams& p,
                            cudaStream_t stream) {
  if (key_tile_count(p, Traits::kBlockN) == 0) return cudaSuccess;
  return launch_folded<Traits::kSmemBytes>(kernel, backward_grid_shape(p, Traits::kBlockN), Traits::kNThreads, stream,
                                           args);
}

}  // namespace flash_dmattn::kernels
