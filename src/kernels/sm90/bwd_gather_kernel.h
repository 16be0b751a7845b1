// The sm90a gather backward's kernel entry and launch: one CTA of two warpgroups per (query tile
// of the lists, pair of query heads of one KV head, batch).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/backward_grid.h"
#include "kernels/common/launch.h"
#include "kernels/params.h"
#include "kernels/sm90/bwd_gather_mainloop.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    backward_gather_kernel(const __grid_constant__ BackwardParams params) {
  // 1024-byte alignment: the period of the widest shared-memory swizzle that wgmma reads.
  extern __shared__ __align__(1024) char smem[];
  const GridShape shape = gather_backward_grid(params, Traits::kListRows, Traits::kPackedHeads);
  const GridCoords cta = unfold_block(shape);
  backward_gathered_query_tile<Traits>(params, smem, static_cast<int>(shape.x) - 1 - cta.x,
                                       cta.y * Traits::kPackedHeads, cta.z);
}

// Runs where the host paired the heads (BackwardParams::pair_heads) on the sm80 backward's lists.
template <typename Element, int kHeadDim>
cudaError_t run_gather_backward(const BackwardParams& params, cudaStream_t stream) {
  using Traits = GatherBackwardTraits<Element, kHeadDim>;
  const KeyLists& lists = params.fwd.lists;
  if (!params.pair_heads || lists.block_m != Traits::kListRows || lists.block_n != Traits::kBlockN ||
      !pairs_share_operands(lists, params.fwd.bias)) {
    return cudaErrorInvalidValue;
  }
  const GridShape grid = gather_backward_grid(params, Traits::kListRows, Traits::kPackedHeads);
  if (grid.x * grid.y * grid.z == 0) return cudaSuccess;
  return launch_folded<Traits::kSmemBytes>(&backward_gather_kernel<Traits>, grid, Traits::kNThreads, stream, params);
}

}  // namespace flash_dmattn::kernels::sm90
