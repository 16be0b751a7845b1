// A tensor as the library sees it: a pointer, a dtype, a shape and int64 strides counted in
// elements. Views never own memory; the caller keeps it alive for the duration of a call
// (until the stream reaches the end of the launched work, for CUDA tensors).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace flash_dmattn {

enum class DType : int {
  float16,
  bfloat16,
  float32,
  float64,  // accepted by the fp64 reference only (tests); the public API rejects it
  boolean,  // one byte per element, nonzero = true
  int32,    // key indices (ForwardArgs::indices)
  uint8,    // a bit-packed mask: 8 keys a byte (attention.h)
};

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

enum class DeviceType : int { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
};

bool operator==(const Device& a, const Device& b);
inline bool operator!=(const Device& a, const Device& b) { return !(a == b); }
std::string device_name(const Device& device);

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::float16;
  int rank = 0;
  std::int64_t shape[kMaxRank] = {};
  std::int64_t stride[kMaxRank] = {};  // in elements, not bytes
  Device device{};

  std::int64_t numel() const;
  std::string shape_string() const;   // "(2, 128, 8, 64)"
  std::string stride_string() const;  // "(65536, 512, 64, 1)"
};

// Whether the CUDA kernels can load the view's rows as 16-byte vectors: the last dim contiguous,
// and the base address and every other stride (of dims longer than 1) whole vectors. The CUDA
// backend refuses q, k, v and out (and the backward's gradients) without it; the torch front
// copies such tensors first. An empty view counts as aligned.
bool rows_aligned_16(const TensorView& view);

// A view with explicit strides; shape and stride must have the same length (at most kMaxRank).
TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     std::initializer_list<std::int64_t> stride, Device device = {});
// A view with row-major (C-contiguous) strides.
TensorView make_contiguous_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                Device device = {});

}  // namespace flash_dmattn
