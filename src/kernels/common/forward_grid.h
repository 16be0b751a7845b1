// Where a forward CTA sits in its grid, for every kernel family: x walks the query tiles in
// reverse (under causal masking the last tiles see the most keys, so they start first and the
// short ones fill the tail of the grid), y is the query head (the KV head with GQA packing), z
// the batch and the split-KV share.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/launch.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

struct ForwardCta {
  int m_block, head, batch, split;
};

__device__ __forceinline__ ForwardCta forward_cta(const ForwardParams& p) {
  return {static_cast<int>(gridDim.x - 1 - blockIdx.x), static_cast<int>(blockIdx.y),
          static_cast<int>(blockIdx.z) / p.num_splits, static_cast<int>(blockIdx.z) % p.num_splits};
}

inline dim3 forward_grid(const ForwardParams& p, int block_m) {
  const int rows = p.seqlen_q * p.pack_group;
  return dim3((rows + block_m - 1) / block_m, p.pack_group > 1 ? p.kv_heads : p.heads, p.batch * p.num_splits);
}

// Launches a forward kernel of Traits over that grid on `stream`, with the dynamic shared memory
// its tiles take.
template <typename Traits>
cudaError_t launch_forward(void (*kernel)(ForwardParams), const ForwardParams& p, cudaStream_t stream) {
  constexpr int kSmem = Traits::kSmemBytes;
  const cudaError_t status = allow_dynamic_smem<kSmem>(kernel);
  if (status != cudaSuccess) return status;
  kernel<<<forward_grid(p, Traits::kBlockM), Traits::kNThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels
