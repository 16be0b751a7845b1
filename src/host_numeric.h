// Host-side fp16/bf16 <-> float conversions, round-to-nearest-even, with no CUDA headers, and
// typed element access through a TensorView's dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flash_dmattn/tensor.h"

namespace flash_dmattn::host {

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // keep NaN a quiet NaN
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest, ties to even
  return static_cast<std::uint16_t>(u >> 16);
}

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1f;
  const std::uint32_t mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000 | (mantissa << 13));  // inf or NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline std::uint16_t float_to_half(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (a < 6.103515625e-05f) {               // subnormal range: quantize to multiples of 2^-24
    const float scaled = std::nearbyint(a * 16777216.0f);  // default rounding mode is to nearest even
    return sign | static_cast<std::uint16_t>(scaled);
  }
  std::uint32_t m = float_bits(a);
  m += 0xfff + ((m >> 13) & 1);  // round the 23-bit mantissa to 10 bits, ties to even
  const std::uint32_t exponent = (m >> 23) - 112;
  return sign | static_cast<std::uint16_t>((exponent << 10) | ((m >> 13) & 0x3ff));
}

// Rounds a value to what the dtype can hold (for building inputs and same-precision baselines).
inline double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::float16: return half_to_float(float_to_half(static_cast<float>(x)));
    case DType::bfloat16: return bf16_to_float(float_to_bf16(static_cast<float>(x)));
    case DType::float32: return static_cast<float>(x);
    default: return x;
  }
}

// Element `offset` (in elements) of a view, as a double. Booleans read as 0 or 1.
inline double load(const TensorView& v, std::int64_t offset) {
  const char* base = static_cast<const char*>(v.data);
  switch (v.dtype) {
    case DType::float16: return half_to_float(reinterpret_cast<const std::uint16_t*>(base)[offset]);
    case DType::bfloat16: return bf16_to_float(reinterpret_cast<const std::uint16_t*>(base)[offset]);
    case DType::float32: return reinterpret_cast<const float*>(base)[offset];
    case DType::float64: return reinterpret_cast<const double*>(base)[offset];
    case DType::boolean: return base[offset] != 0 ? 1.0 : 0.0;
    case DType::int32: return reinterpret_cast<const std::int32_t*>(base)[offset];
    case DType::uint8: return reinterpret_cast<const std::uint8_t*>(base)[offset];
  }
  return 0.0;
}

inline void store(const TensorView& v, std::int64_t offset, double x) {
  char* base = static_cast<char*>(v.data);
  switch (v.dtype) {
    case DType::float16: reinterpret_cast<std::uint16_t*>(base)[offset] = float_to_half(static_cast<float>(x)); break;
    case DType::bfloat16: reinterpret_cast<std::uint16_t*>(base)[offset] = float_to_bf16(static_cast<float>(x)); break;
    case DType::float32: reinterpret_cast<float*>(base)[offset] = static_cast<float>(x); break;
    case DType::float64: reinterpret_cast<double*>(base)[offset] = x; break;
    case DType::boolean: base[offset] = x != 0.0; break;
    case DType::int32: reinterpret_cast<std::int32_t*>(base)[offset] = static_cast<std::int32_t>(x); break;
    case DType::uint8: reinterpret_cast<std::uint8_t*>(base)[offset] = static_cast<std::uint8_t>(x); break;
  }
}

inline std::int64_t offset4(const TensorView& v, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return a * v.stride[0] + b * v.stride[1] + c * v.stride[2] + d * v.stride[3];
}

}  // namespace flash_dmattn::host
