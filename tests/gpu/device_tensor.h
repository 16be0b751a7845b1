// Device memory for the GPU suites: tensors between NaN guard regions, raw buffers (workspaces),
// streams, and the check that decides whether a machine can run the suites at all.
//
// A DeviceTensor holds a HostTensor's whole storage (padding between rows included) with
// kGuardBytes of 0xFF before and after it. 0xFF bytes read as NaN in fp16, bf16 and fp32 and as
// "true" in a bool mask, so a kernel that reads outside a view picks up values that the comparison
// with the reference cannot miss, and a kernel that writes outside a view changes bytes that
// check_untouched() compares afterwards.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "test_util.h"

namespace flash_dmattn::test {

// Throws std::runtime_error naming the call and the CUDA error; gtest reports it as a failure.
void cuda_check(cudaError_t error, const char* what);

// Number of CUDA devices, 0 when the driver or the runtime cannot report any.
int cuda_device_count();

// cudaMalloc'd bytes, freed on destruction. cudaMalloc aligns to at least 256 bytes, which is
// what kWorkspaceAlignment asks of a workspace.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Workspace workspace() const { return Workspace{data_, bytes_}; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// A non-blocking stream: it does not synchronize with the legacy default stream, so work the
// library wrongly launches on the default stream is not ordered before our reads.
class Stream {
 public:
  Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  cudaStream_t get() const { return stream_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
};

class DeviceTensor {
 public:
  // Guard size on each side: at least 256 bytes, and a multiple of 256 so that the view's first
  // element keeps cudaMalloc's alignment.
  static constexpr std::size_t kGuardBytes = 256;

  // An input: the view's elements as `host` holds them; every other byte of the storage
  // (row padding) and both guards are 0xFF. Nothing may change any byte of it.
  static DeviceTensor upload(const HostTensor& host);
  // An output laid out like `layout` (its shape and strides; its values are not used), with every
  // byte 0xFF. Only the bytes of the view's elements may change.
  static DeviceTensor poisoned(const HostTensor& layout);

  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&&) = default;
  DeviceTensor& operator=(DeviceTensor&&) = default;
  ~DeviceTensor() = default;

  // The view on the device (the device current when the tensor was made).
  const TensorView& view() const { return view_; }
  // Sets every byte back to 0xFF on `stream` (an output before a rerun).
  void poison_async(cudaStream_t stream) const;
  // The storage, padding included, copied into a host tensor with the same shape and strides.
  // Call after the stream that wrote it has been synchronized.
  HostTensor download() const;
  // Checks the bytes that nothing may change: the guards, the padding, and for an input its elements.
  ::testing::AssertionResult untouched_outside_view(const char* name) const;

 private:
  DeviceTensor(const HostTensor& layout, std::vector<unsigned char> image, bool writable);

  DeviceBuffer buffer_;                // guard, storage, guard
  std::vector<unsigned char> image_;   // the whole buffer as uploaded
  std::vector<char> element_byte_;     // per storage byte: nonzero where the view has an element
  bool writable_ = false;
  TensorView view_{};
};

}  // namespace flash_dmattn::test
