// The sm80 backward kernel entry and its launch: one CTA per (key tile, KV head, batch), or in
// deterministic mode key_splits CTAs per (KV head, batch) that share out the key tiles.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/backward_grid.h"
#include "kernels/params.h"
#include "kernels/sm80/bwd_mainloop.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kTile.ctas_per_sm) backward_kernel(const __grid_constant__ BackwardParams params) {
  extern __shared__ __align__(128) char smem[];
  for_each_key_tile<Traits::kBlockN>(params, [&](int n_block, int kv_head, int batch, int split) CUTLASS_LAMBDA_FUNC_INLINE {
    backward_key_tile<Traits>(params, smem, n_block, kv_head, batch, split);
  });
}

template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  using Traits = BackwardTraits<Element, kHeadDim>;
  return launch_backward<Traits>(&backward_kernel<Traits>, params, params, stream);
}

}  // namespace flash_dmattn::kernels::sm80
