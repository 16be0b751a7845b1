// What every kernel launch with dynamic shared memory needs first.
#pragma once

#include <cuda_runtime.h>

namespace flash_dmattn::kernels {

// Lets `kernel` take kSmem bytes of dynamic shared memory: above 48 KB only after raising its limit.
template <int kSmem, typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel) {
  if constexpr (kSmem >= 48 * 1024) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  }
  return cudaSuccess;
}

}  // namespace flash_dmattn::kernels
