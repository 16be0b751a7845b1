#include <cstdint>
#include <sstream>

#include "flash_dmattn/attention.h"
#include "flash_dmattn/status.h"
#include "flash_dmattn/tensor.h"

namespace flash_dmattn {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float32: return "float32";
    case DType::float64: return "float64";
    case DType::boolean: return "bool";
    case DType::int32: return "int32";
    case DType::uint8: return "uint8";
  }
  return "unknown dtype";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::float16:
    case DType::bfloat16: return 2;
    case DType::float32: return 4;
    case DType::float64: return 8;
    case DType::boolean: return 1;
    case DType::int32: return 4;
    case DType::uint8: return 1;
  }
  return 0;
}

bool operator==(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }

std::string device_name(const Device& device) {
  return device.type == DeviceType::cpu ? std::string("cpu") : "cuda:" + std::to_string(device.index);
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool rows_aligned_16(const TensorView& view) {
  if (view.numel() == 0) return true;
  if (reinterpret_cast<std::uintptr_t>(view.data) % 16 != 0) return false;
  if (view.rank > 0 && view.shape[view.rank - 1] > 1 && view.stride[view.rank - 1] != 1) return false;
  const auto elements = static_cast<std::int64_t>(16 / dtype_size(view.dtype));
  for (int d = 0; d + 1 < view.rank; ++d) {
    if (view.shape[d] > 1 && view.stride[d] % elements != 0) return false;
  }
  return true;
}

static std::string tuple_string(const std::int64_t* values, int rank) {
  std::ostringstream os;
  os << '(';
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << values[d];
  os << ')';
  return os.str();
}

std::string TensorView::shape_string() const { return tuple_string(shape, rank); }
std::string TensorView::stride_string() const { return tuple_string(stride, rank); }

TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     std::initializer_list<std::int64_t> stride, Device device) {
  if (shape.size() != stride.size() || shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw Error(Status::error(StatusCode::invalid_argument,
                              "make_view: shape and stride must have the same length, at most 4; got " +
                                  std::to_string(shape.size()) + " and " + std::to_string(stride.size())));
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.rank = static_cast<int>(shape.size());
  view.device = device;
  int d = 0;
  for (auto s : shape) view.shape[d++] = s;
  d = 0;
  for (auto s : stride) view.stride[d++] = s;
  return view;
}

TensorView make_contiguous_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                Device device) {
  TensorView view = make_view(data, dtype, shape, shape, device);
  std::int64_t running = 1;
  for (int d = view.rank - 1; d >= 0; --d) {
    view.stride[d] = running;
    running *= view.shape[d];
  }
  return view;
}

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok: return "ok";
    case StatusCode::invalid_argument: return "invalid_argument";
    case StatusCode::unsupported: return "unsupported";
    case StatusCode::backend_error: return "backend_error";
  }
  return "unknown status";
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "automatic";
    case Backend::cpu_reference: return "cpu_reference";
    case Backend::cuda_sm80: return "cuda_sm80";
    case Backend::cuda_sm90: return "cuda_sm90";
  }
  return "unknown backend";
}

const char* version() { return "0.1.0"; }

}  // namespace flash_dmattn
