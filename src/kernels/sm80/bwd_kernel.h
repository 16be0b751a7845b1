// The sm80 backward kernel entry and its launch: one CTA per (key tile, KV head, batch), or in
// deterministic mode key_splits CTAs per (KV head, batch) that share out the key tiles.
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"
#include "kernels/sm80/bwd_mainloop.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kTile.ctas_per_sm) backward_kernel(const __grid_constant__ BackwardParams params) {
  extern __shared__ __align__(128) char smem[];
  const int key_tiles = (params.fwd.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // Key tile 0 sees the most query tiles under causal masking: the lowest indices start first.
  // In deterministic mode (gridDim.x < key_tiles) CTA s takes one key tile of every group of
  // gridDim.x, s-th from the front in even groups and from the back in odd ones: under causal
  // masking every CTA then gets about the same number of query tiles (with a plain stride over
  // 128 key tiles, CTA 0 of 16 had 26% more than CTA 15, and the whole grid waited for it).
  for (int group = 0; group * gridDim.x < key_tiles; ++group) {
    const int n_block = group % 2 == 0 ? group * gridDim.x + blockIdx.x : (group + 1) * gridDim.x - 1 - blockIdx.x;
    if (n_block < key_tiles) backward_key_tile<Traits>(params, smem, n_block, blockIdx.y, blockIdx.z, blockIdx.x);
  }
}

template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  using Traits = BackwardTraits<Element, kHeadDim>;
  constexpr int kSmem = Traits::kSmemBytes;
  auto* kernel = &backward_kernel<Traits>;
  if constexpr (kSmem >= 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (status != cudaSuccess) return status;
  }
  const int key_tiles = (params.fwd.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  if (key_tiles == 0) return cudaSuccess;
  const dim3 grid(params.deterministic ? params.key_splits : key_tiles, params.fwd.kv_heads, params.fwd.batch);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels::sm80
