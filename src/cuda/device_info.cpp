#include "cuda/device_info.h"

#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

namespace flash_dmattn {

DeviceInfo device_info(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceInfo> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(device); it != known.end()) return it->second;
  int major = 0, minor = 0;
  DeviceInfo info;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.smem_per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();  // consume it, so that the caller's next cudaGetLastError does not see it
    return DeviceInfo{};
  }
  info.arch = major * 10 + minor;
  known.emplace(device, info);
  return info;
}

}  // namespace flash_dmattn
