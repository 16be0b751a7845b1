// Device allocations of the GPU suites: guard-framed tensors, buffers and streams (see the header).
#include "device_tensor.h"

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace flash_dmattn::test {

void cuda_check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(error) + ": " +
                             cudaGetErrorString(error));
  }
}

int cuda_device_count() {
  static const int count = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }();
  return count;
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes > 0) cuda_check(cudaMalloc(&data_, bytes), "cudaMalloc");
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  // Freeing synchronizes the device, so no launched work still uses the memory.
  if (data_) cudaFree(data_);
}

Stream::Stream() { cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }

Stream::~Stream() {
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

void Stream::synchronize() const { cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

namespace {

constexpr unsigned char kPoison = 0xFF;

std::vector<char> element_bytes(const HostTensor& t) {
  std::vector<char> covered(t.bytes.size(), 0);
  const std::size_t size = dtype_size(t.view.dtype);
  t.for_each([&](std::int64_t offset) {
    for (std::size_t b = 0; b < size; ++b) covered[static_cast<std::size_t>(offset) * size + b] = 1;
  });
  return covered;
}

}  // namespace

DeviceTensor DeviceTensor::upload(const HostTensor& host) {
  std::vector<unsigned char> image(kGuardBytes + host.bytes.size() + kGuardBytes, kPoison);
  const std::vector<char> covered = element_bytes(host);
  for (std::size_t b = 0; b < host.bytes.size(); ++b) {
    if (covered[b]) image[kGuardBytes + b] = host.bytes[b];
  }
  return DeviceTensor(host, std::move(image), /*writable=*/false);
}

DeviceTensor DeviceTensor::poisoned(const HostTensor& layout) {
  return DeviceTensor(layout, std::vector<unsigned char>(kGuardBytes + layout.bytes.size() + kGuardBytes, kPoison),
                      /*writable=*/true);
}

DeviceTensor::DeviceTensor(const HostTensor& layout, std::vector<unsigned char> image, bool writable)
    : buffer_(image.size()), image_(std::move(image)), element_byte_(element_bytes(layout)), writable_(writable),
      view_(layout.view) {
  cuda_check(cudaMemcpy(buffer_.data(), image_.data(), image_.size(), cudaMemcpyHostToDevice), "cudaMemcpy (upload)");
  view_.data = static_cast<unsigned char*>(buffer_.data()) + kGuardBytes;
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  view_.device = Device{DeviceType::cuda, device};
}

void DeviceTensor::poison_async(cudaStream_t stream) const {
  cuda_check(cudaMemsetAsync(buffer_.data(), kPoison, buffer_.bytes(), stream), "cudaMemsetAsync (poison)");
}

HostTensor DeviceTensor::download() const {
  HostTensor t;
  t.bytes.resize(element_byte_.size());
  t.view = view_;
  t.view.data = t.bytes.data();
  t.view.device = Device{};
  cuda_check(cudaMemcpy(t.bytes.data(), view_.data, t.bytes.size(), cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
  return t;
}

::testing::AssertionResult DeviceTensor::untouched_outside_view(const char* name) const {
  std::vector<unsigned char> now(image_.size());
  cuda_check(cudaMemcpy(now.data(), buffer_.data(), now.size(), cudaMemcpyDeviceToHost), "cudaMemcpy (guards)");
  const std::size_t storage = element_byte_.size();
  for (std::size_t b = 0; b < now.size(); ++b) {
    if (now[b] == image_[b]) continue;
    const bool in_storage = b >= kGuardBytes && b < kGuardBytes + storage;
    if (in_storage && writable_ && element_byte_[b - kGuardBytes]) continue;
    const char* where = b < kGuardBytes                 ? "in the guard before the first element"
                        : !in_storage                   ? "in the guard after the storage"
                        : element_byte_[b - kGuardBytes] ? "inside an input element"
                                                        : "in the padding between elements";
    // AssertionResult streams each value into a fresh Message, so std::hex would not carry over.
    std::ostringstream change;
    change << std::hex << "0x" << int{image_[b]} << " to 0x" << int{now[b]};
    const long long offset = static_cast<long long>(b) - static_cast<long long>(kGuardBytes);
    return ::testing::AssertionFailure() << name << ": byte " << offset << " (relative to the first element) " << where
                                         << " changed from " << change.str() << "; storage is " << storage << " bytes";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace flash_dmattn::test
