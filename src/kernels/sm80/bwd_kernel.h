// The sm80 backward kernel entries and their launches: one CTA per (key tile, KV head, batch), or
// head_splits of them each walking a share of the KV head's query heads where the grid is small
// (BackwardParams::head_splits), or in deterministic mode key_splits CTAs per (KV head, batch)
// that share out the key tiles; on the gather path one CTA per (query tile, query head, batch).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/backward_grid.h"
#include "kernels/common/sequences.h"
#include "kernels/params.h"
#include "kernels/sm80/bwd_gather_mainloop.h"
#include "kernels/sm80/bwd_mainloop.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Traits, Sequences kSequences>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kTile.ctas_per_sm) backward_kernel(const __grid_constant__ BackwardParams params) {
  extern __shared__ __align__(128) char smem[];
  static_assert(kSequences == Sequences::batched || Traits::kSmemBytes + sizeof(BackwardParams) <= 163 * 1024,
                "a packed call's params (for_sequence_key_tile) and the tiles exceed an A100 CTA's shared memory");
  for_each_key_tile<Traits::kBlockN>(params, [&](int n_block, const WalkHeads& heads, int batch, int split) CUTLASS_LAMBDA_FUNC_INLINE {
    auto key_tile = [&](const BackwardParams& p) CUTLASS_LAMBDA_FUNC_INLINE {
      backward_key_tile<Traits>(p, smem, n_block, heads, batch, split);
    };
    for_sequence_key_tile<kSequences, Traits::kBlockN>(params, batch, n_block, key_tile);
  });
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kTile.ctas_per_sm) backward_gather_kernel(const __grid_constant__ BackwardParams params) {
  extern __shared__ __align__(128) char smem[];
  const GridShape shape = gather_backward_grid(params, GatherBackwardSmem<Traits>::kListRows, Traits::kPackedHeads);
  const GridCoords cta = unfold_block(shape);
  backward_gathered_query_tile<Traits>(params, smem, static_cast<int>(shape.x) - 1 - cta.x,
                                       cta.y * Traits::kPackedHeads, cta.z);
}

template <typename Traits>
cudaError_t launch_gather_backward(const BackwardParams& params, cudaStream_t stream) {
  using Smem = GatherBackwardSmem<Traits>;
  const GridShape grid = gather_backward_grid(params, Smem::kListRows, Traits::kPackedHeads);
  if (grid.x * grid.y * grid.z == 0) return cudaSuccess;
  return launch_folded<Smem::kBytes>(&backward_gather_kernel<Traits>, grid, Traits::kNThreads, stream, params);
}

// The gather path runs head dims up to 128 (sm80/tile_size.h kMaxGatherBackwardHeadDim): past
// them its two K/V buffers would not fit an A100's shared memory.
template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  using Traits = BackwardTraits<Element, kHeadDim>;
  if (!params.fwd.lists.keys) {
    const auto kernel = params.fwd.cu_seqlens_q ? &backward_kernel<Traits, Sequences::packed>
                                                : &backward_kernel<Traits, Sequences::batched>;
    return launch_backward<Traits>(kernel, params, params, stream);
  }
  if constexpr (kHeadDim <= kMaxGatherBackwardHeadDim) {
    // Lists built for another tile would have their row bits read at the wrong places.
    if (params.fwd.lists.block_m != Traits::kBlockM || params.fwd.lists.block_n != Traits::kBlockN) {
      return cudaErrorInvalidValue;
    }
    // Two heads per CTA where the host found that they share their list, bias head and dbias
    // accumulator, and that the device has the shared memory (BackwardParams::pair_heads).
    if constexpr (gather_backward_pairs_heads_at(kHeadDim)) {
      if (params.pair_heads) return launch_gather_backward<BackwardTraits<Element, kHeadDim, 2>>(params, stream);
    }
    return launch_gather_backward<Traits>(params, stream);
  } else {
    return cudaErrorNotSupported;
  }
}

}  // namespace flash_dmattn::kernels::sm80
