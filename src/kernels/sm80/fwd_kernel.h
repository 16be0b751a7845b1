// The sm80 forward kernel entry and its launch: one CTA per (query tile, head, batch, split).
// With GQA packing the head index is the KV head and a query tile holds packed rows.
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"
#include "kernels/sm80/fwd_mainloop.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kTile.ctas_per_sm) forward_kernel(const __grid_constant__ ForwardParams params) {
  extern __shared__ __align__(128) char smem[];
  // Under causal masking the last query tiles see the most keys: start them first so that the
  // short ones fill the tail of the grid.
  const int m_block = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int b = static_cast<int>(blockIdx.z) / params.num_splits, split = static_cast<int>(blockIdx.z) % params.num_splits;
  forward_tile<Traits>(params, smem, m_block, blockIdx.y, b, split);
}

template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream) {
  using Traits = ForwardTraits<Element, kHeadDim>;
  constexpr int kSmem = Traits::kSmemBytes;
  auto* kernel = &forward_kernel<Traits>;
  if constexpr (kSmem >= 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (status != cudaSuccess) return status;
  }
  const int rows = params.seqlen_q * params.pack_group;
  const dim3 grid((rows + Traits::kBlockM - 1) / Traits::kBlockM, params.pack_group > 1 ? params.kv_heads : params.heads,
                  params.batch * params.num_splits);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels::sm80
