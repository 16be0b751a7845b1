// What every kernel launch needs: its grid folded into grid.x, dynamic shared memory above 48 KB
// allowed first, and its order against the kernel before it on the stream.
#pragma once

#include <atomic>
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

// Lets `kernel` take kSmem bytes of dynamic shared memory on `device`: above 48 KB only after
// raising its limit, once per kernel and device.
template <int kSmem, typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int device) {
  if constexpr (kSmem >= 48 * 1024) return raise_smem_limit_once(reinterpret_cast<const void*>(kernel), device, kSmem);
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

// How a launch orders against the kernel before it on the stream. serial: it starts once that
// kernel has finished. early: on sm_90 and later (programmatic dependent launch) its CTAs may start
// as soon as every CTA of that kernel has called let_next_grid_start() (or finished), so its launch
// and CTA start overlap that kernel's tail; the kernel must call wait_for_previous_grid() before
// it reads or writes any memory but its parameters. A decode's three kernels (summary, split
// forward, combine) are short enough for those gaps to count.
enum class StreamOrder { serial, early };

// Whether `device` honours StreamOrder::early (compute capability 9.0 or newer), looked up once
// per device: a launch path pays no attribute query.
inline bool early_launch_supported(int device) {
  constexpr int kDevices = 64;
  static std::atomic<signed char> known[kDevices];  // 0: not looked up, 1: supported, -1: not
  if (device < 0 || device >= kDevices) return false;
  signed char state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    state = major >= 9 ? 1 : -1;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state > 0;
}

#ifdef __CUDACC__
// Launches kernel(args...) on `stream` over the grid of `shape` folded into grid.x, with kSmem
// bytes of dynamic shared memory, in the given order against the stream's previous kernel;
// cudaErrorInvalidConfiguration past 2^31 - 1 CTAs (the CUDA backend refuses such problems before
// any launch, cannot_run in cuda_backend.cpp).
template <int kSmem, typename... Params, typename... Args>
cudaError_t launch_folded(void (*kernel)(Params...), const GridShape& shape, unsigned threads, cudaStream_t stream,
                          StreamOrder order, const Args&... args) {
  const std::int64_t ctas = shape.x * shape.y * shape.z;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  status = allow_dynamic_smem<kSmem>(kernel, device);
  if (status != cudaSuccess) return status;
  if (order == StreamOrder::early && early_launch_supported(device)) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(ctas));
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = kSmem;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args...);
  }
  kernel<<<static_cast<unsigned>(ctas), threads, kSmem, stream>>>(args...);
  return cudaGetLastError();
}

template <int kSmem, typename... Params, typename... Args>
cudaError_t launch_folded(void (*kernel)(Params...), const GridShape& shape, unsigned threads, cudaStream_t stream,
                          const Args&... args) {
  return launch_folded<kSmem>(kernel, shape, threads, stream, StreamOrder::serial, args...);
}

// In a kernel launched with StreamOrder::early: blocks until the stream's previous kernel has
// finished and its writes are visible. Elsewhere (a serial launch, or before sm_90) it returns at
// once.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream, where it was launched with StreamOrder::early, start its CTAs
// (they wait in wait_for_previous_grid() until this kernel has finished). A kernel itself started
// early calls it after its own wait, so that an early kernel only ever overlaps the one before it.
__device__ __forceinline__ void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// This CTA's (x, y, z) in a grid of `shape` launched by launch_folded.
__device__ __forceinline__ GridCoords unfold_block(const GridShape& shape) {
  const unsigned cta = blockIdx.x, nx = static_cast<unsigned>(shape.x), ny = static_cast<unsigned>(shape.y);
  const unsigned xy = cta / nx;
  return {static_cast<int>(cta - xy * nx), static_cast<int>(xy % ny), static_cast<int>(xy / ny)};
}
#endif

}  // namespace flash_dmattn::kernels
