// The sm90a forward kernel entry and its launch: one CTA of two warpgroups per (query tile, query
// head, batch, split).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/forward_grid.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_mainloop.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) forward_kernel(const __grid_constant__ ForwardParams params) {
  // 1024-byte alignment: the period of the widest shared-memory swizzle that wgmma reads.
  extern __shared__ __align__(1024) char smem[];
  const ForwardCta cta = forward_cta(params);
  forward_tile<Traits>(params, smem, cta.m_block, cta.head, cta.batch, cta.split);
}

template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream) {
  using Traits = ForwardTraits<Element, kHeadDim>;
  return launch_forward<Traits>(&forward_kernel<Traits>, params, stream);
}

}  // namespace flash_dmattn::kernels::sm90
