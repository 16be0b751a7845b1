// What every kernel launch needs: its grid folded into grid.x, and dynamic shared memory above
// 48 KB allowed first.
#pragma once

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include <cuda_runtime.h>

namespace flash_dmattn::kernels {

// Raises `kernel`'s dynamic shared memory limit on `device` to `bytes`, once: the limit stays
// raised, and raising it again costs the host a few microseconds per launch (torch's profiler on
// an H200 host). A failed raise is not remembered, so the next launch tries again.
inline cudaError_t raise_smem_limit_once(const void* kernel, int device, int bytes) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> raised;
  const std::lock_guard<std::mutex> lock(mutex);
  if (raised.count({kernel, device}) > 0) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (status == cudaSuccess) raised.emplace(kernel, device);
  return status;
}

// Lets `kernel` take kSmem bytes of dynamic shared memory: above 48 KB only after raising its
// limit, once per kernel and device.
template <int kSmem, typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel) {
  if constexpr (kSmem >= 48 * 1024) {
    int device = 0;
    const cudaError_t status = cudaGetDevice(&device);
    if (status != cudaSuccess) return status;
    return raise_smem_limit_once(reinterpret_cast<const void*>(kernel), device, kSmem);
  }
  return cudaSuccess;
}

// A kernel's CTAs as (x, y, z), x varying fastest. CUDA caps grid.y and grid.z at 65,535 and
// grid.x at 2^31 - 1, and batch x heads alone passes 65,535 in batched short-sequence work (1024
// sequences of 80 heads), so every grid is launched along x alone and a CTA unfolds its (x, y, z)
// from blockIdx.x. The hardware starts CTAs in the order of that index: the order of the 3-D grid
// this replaces.
struct GridShape {
  std::int64_t x, y, z;
};

struct GridCoords {
  int x, y, z;
};

#ifdef __CUDACC__
// Launches kernel(args...) on `stream` over the grid of `shape` folded into grid.x, with kSmem
// bytes of dynamic shared memory; cudaErrorInvalidConfiguration past 2^31 - 1 CTAs (the CUDA
// backend refuses such problems before any launch, cannot_run in cuda_backend.cpp).
template <int kSmem, typename... Params, typename... Args>
cudaError_t launch_folded(void (*kernel)(Params...), const GridShape& shape, unsigned threads, cudaStream_t stream,
                          const Args&... args) {
  const std::int64_t ctas = shape.x * shape.y * shape.z;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const cudaError_t status = allow_dynamic_smem<kSmem>(kernel);
  if (status != cudaSuccess) return status;
  kernel<<<static_cast<unsigned>(ctas), threads, kSmem, stream>>>(args...);
  return cudaGetLastError();
}

// This CTA's (x, y, z) in a grid of `shape` launched by launch_folded.
__device__ __forceinline__ GridCoords unfold_block(const GridShape& shape) {
  const unsigned cta = blockIdx.x, nx = static_cast<unsigned>(shape.x), ny = static_cast<unsigned>(shape.y);
  const unsigned xy = cta / nx;
  return {static_cast<int>(cta - xy * nx), static_cast<int>(xy % ny), static_cast<int>(xy / ny)};
}
#endif

}  // namespace flash_dmattn::kernels
