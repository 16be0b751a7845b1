// Where a forward CTA sits in its grid, for every kernel family: x walks the query tiles in
// reverse (under causal masking the last tiles see the most keys, so they start first and the
// short ones fill the tail of the grid), y is the query head (the KV head with GQA packing), z
// the batch and the split-KV share; all folded into grid.x (launch.h).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/launch.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

struct ForwardCta {
  int m_block, head, batch, split;
};

__host__ __device__ inline GridShape forward_grid_shape(const ForwardParams& p, int block_m) {
  const std::int64_t rows = std::int64_t(p.seqlen_q) * p.pack_group;
  // y: a query head, or the pack_group query heads a CTA packs (all of a KV head's in a decode,
  // two in the sm90a gather forward).
  return {(rows + block_m - 1) / block_m, p.heads / p.pack_group, std::int64_t(p.batch) * p.num_splits};
}

// The CTA's place in the grid of query tiles of block_m rows (launch_forward's).
__device__ __forceinline__ ForwardCta forward_cta(const ForwardParams& p, int block_m) {
  const GridShape shape = forward_grid_shape(p, block_m);
  const GridCoords c = unfold_block(shape);
  return {static_cast<int>(shape.x) - 1 - c.x, c.y, c.z / p.num_splits, c.z % p.num_splits};
}

// Whether a forward kernel of the gather path (`gather`) or of the tile path runs: unless the
// device chose the other path (ForwardParams::gather_chosen). A kernel launched early
// (StreamOrder::early) asks after wait_for_previous_grid(), since the choice is made before it.
__device__ __forceinline__ bool runs_chosen_path(const ForwardParams& p, bool gather) {
  return p.gather_chosen == nullptr || (*p.gather_chosen != 0) == gather;
}

// Launches `kernel(args)` over the grid of query tiles of block_m rows, with kSmem bytes of
// dynamic shared memory, in `order` against the stream's previous kernel (launch.h).
template <int kSmem, typename KernelArgs>
cudaError_t launch_query_tiles(void (*kernel)(KernelArgs), const KernelArgs& args, const ForwardParams& p, int block_m,
                               unsigned threads, cudaStream_t stream, StreamOrder order = StreamOrder::serial) {
  return launch_folded<kSmem>(kernel, forward_grid_shape(p, block_m), threads, stream, order, args);
}

// Launches a forward kernel of Traits over that grid on `stream`, with the dynamic shared memory
// its tiles take.
template <typename Traits>
cudaError_t launch_forward(void (*kernel)(ForwardParams), const ForwardParams& p, cudaStream_t stream,
                           StreamOrder order = StreamOrder::serial) {
  return launch_query_tiles<Traits::kSmemBytes>(kernel, p, p, Traits::kBlockM, Traits::kNThreads, stream, order);
}

}  // namespace flash_dmattn::kernels
