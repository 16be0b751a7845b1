// Shared by the CPU and GPU test suites: owning host tensors filled with fresh random data,
// broadcast shapes, the seed every run prints so that a failure can be replayed
// (FDMA_TEST_SEED=...), and environment variables set for a scope (ScopedEnv).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "flash_dmattn/flash_dmattn.h"
#include "host_numeric.h"

namespace flash_dmattn {
// gtest prints parameters through this.
inline void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }
}  // namespace flash_dmattn

namespace flash_dmattn::test {

// A fresh seed per process unless FDMA_TEST_SEED is set; printed once.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    const char* env = std::getenv("FDMA_TEST_SEED");
    const std::uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("[flash_dmattn tests] FDMA_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// A generator per test, derived from the run's seed and the test's name.
inline std::mt19937_64 test_rng() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

using Shape = std::vector<std::int64_t>;

// Owns its bytes; `view` describes them. Storage may be padded (larger strides than contiguous).
struct HostTensor {
  std::vector<unsigned char> bytes;
  TensorView view;

  HostTensor() = default;
  // Copies own their bytes, so the copy's view points at the copy.
  HostTensor(const HostTensor& other) : bytes(other.bytes), view(other.view) { view.data = bytes.data(); }
  HostTensor& operator=(const HostTensor& other) {
    bytes = other.bytes;
    view = other.view;
    view.data = bytes.data();
    return *this;
  }
  HostTensor(HostTensor&&) = default;  // a moved vector keeps its buffer, so the view stays valid
  HostTensor& operator=(HostTensor&&) = default;

  static HostTensor empty(DType dtype, const Shape& shape, std::int64_t row_pad = 0) {
    // Row-major strides; each dimension above the last gets `row_pad` extra elements per step,
    // so that padded views exercise non-contiguous strides.
    HostTensor t;
    t.view.dtype = dtype;
    t.view.rank = static_cast<int>(shape.size());
    std::int64_t running = 1;
    for (int d = t.view.rank - 1; d >= 0; --d) {
      t.view.shape[d] = shape[d];
      t.view.stride[d] = running;
      running = running * shape[d] + (d == t.view.rank - 1 ? row_pad : 0);
    }
    t.bytes.assign(static_cast<std::size_t>(std::max<std::int64_t>(running, 1)) * dtype_size(dtype), 0);
    t.view.data = t.bytes.data();
    return t;
  }

  // Uniform in [lo, hi), rounded to the dtype; booleans true with probability `lo`.
  static HostTensor random(DType dtype, const Shape& shape, std::mt19937_64& rng, double lo = -1.0, double hi = 1.0,
                           std::int64_t row_pad = 0) {
    HostTensor t = empty(dtype, shape, row_pad);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    t.for_each([&](std::int64_t offset) {
      const double x = dtype == DType::boolean ? (u(rng) < lo ? 1.0 : 0.0) : lo + (hi - lo) * u(rng);
      host::store(t.view, offset, x);
    });
    return t;
  }

  template <typename Fn>
  void for_each(Fn fn) const {  // fn(element offset), in row-major index order
    std::int64_t s[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
    const int pad = 4 - view.rank;
    for (int d = 0; d < view.rank; ++d) {
      s[pad + d] = view.shape[d];
      st[pad + d] = view.stride[d];
    }
    for (std::int64_t a = 0; a < s[0]; ++a)
      for (std::int64_t b = 0; b < s[1]; ++b)
        for (std::int64_t c = 0; c < s[2]; ++c)
          for (std::int64_t d = 0; d < s[3]; ++d) fn(a * st[0] + b * st[1] + c * st[2] + d * st[3]);
  }

  double get(std::int64_t offset) const { return host::load(view, offset); }
  void set(std::int64_t offset, double x) { host::store(view, offset, x); }

  // Every element in row-major index order.
  std::vector<double> values() const {
    std::vector<double> out;
    out.reserve(view.numel());
    for_each([&](std::int64_t o) { out.push_back(get(o)); });
    return out;
  }
};

// Fills with 0x7fff.. bytes: NaN in fp16, bf16 and fp32, so that an element a call does not write
// is seen.
inline void poison(HostTensor& t) {
  for (size_t b = 0; b + 1 < t.bytes.size(); b += 2) {
    t.bytes[b] = 0xff;
    t.bytes[b + 1] = 0x7f;
  }
}

// Batch b's part of a (B|1, heads, Sq|1, Sk|1) operand, copied into (1, heads, rows|1, keys|1): the
// operand of sequence b run alone (packed sequences, KV caches).
inline HostTensor operand_of(const HostTensor& full, std::int64_t b, std::int64_t rows, std::int64_t keys) {
  const TensorView& f = full.view;
  HostTensor t = HostTensor::empty(f.dtype, {1, f.shape[1], f.shape[2] == 1 ? 1 : rows, f.shape[3] == 1 ? 1 : keys});
  const std::int64_t batch = f.shape[0] == 1 ? 0 : b;
  for (std::int64_t h = 0; h < t.view.shape[1]; ++h)
    for (std::int64_t i = 0; i < t.view.shape[2]; ++i)
      for (std::int64_t j = 0; j < t.view.shape[3]; ++j)
        t.set(host::offset4(t.view, 0, h, i, j), full.get(host::offset4(f, batch, h, i, j)));
  return t;
}

// The bool mask (.., Sk) packed into (.., ceil(Sk/8)) bytes, key j at bit j % 8 of byte j / 8,
// rows padded by `row_pad` bytes; the bits past Sk are random.
inline HostTensor pack(const HostTensor& mask, std::mt19937_64& rng, std::int64_t row_pad = 3) {
  const TensorView& m = mask.view;
  const std::int64_t keys = m.shape[3], bytes = (keys + 7) / 8;
  HostTensor packed = HostTensor::empty(DType::uint8, {m.shape[0], m.shape[1], m.shape[2], bytes}, row_pad);
  std::uniform_int_distribution<int> coin(0, 1);
  for (std::int64_t a = 0; a < m.shape[0]; ++a)
    for (std::int64_t h = 0; h < m.shape[1]; ++h)
      for (std::int64_t i = 0; i < m.shape[2]; ++i)
        for (std::int64_t byte = 0; byte < bytes; ++byte) {
          unsigned value = 0;
          for (int bit = 0; bit < 8; ++bit) {
            const std::int64_t j = 8 * byte + bit;
            const bool keep = j < keys ? mask.get(host::offset4(m, a, h, i, j)) != 0.0 : coin(rng) != 0;
            value |= static_cast<unsigned>(keep) << bit;
          }
          packed.set(host::offset4(packed.view, a, h, i, byte), value);
        }
  return packed;
}

// A forward the library refuses before any work, with a message that holds `fragment`.
inline void expect_refused(const ForwardArgs& a, const std::string& fragment) {
  const Status s = forward(a);
  ASSERT_FALSE(s.ok()) << "expected an error containing: " << fragment;
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Sets an environment variable for a scope, and puts back what it was.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* previous = std::getenv(name);
    if (previous) previous_ = previous;
    had_ = previous != nullptr;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, previous_.c_str(), 1); else unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string previous_;
  bool had_ = false;
};

}  // namespace flash_dmattn::test
