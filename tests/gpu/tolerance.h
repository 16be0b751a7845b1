// The pass rule of the GPU suites, in one place (docs/semantics.md §8).
//
// For each output X (out, lse, dq, dk, dv, dbias) the kernel is compared with two CPU
// computations on the same rounded inputs:
//   X_ref  the fp64 reference (src/reference), the truth;
//   X_lp   lowp_emulation.h: the same formulas evaluated the way a plain PyTorch implementation in
//          the input dtype would, rounding every intermediate tensor to that dtype.
// Over the elements whose reference is finite,
//   err_gpu  = max |X_gpu - X_ref|
//   err_base = max |X_lp  - X_ref|          what an honest same-precision implementation errs by
//   noise    = max |round(X_ref) - X_ref|   one rounding into X's dtype (fp32 for lse)
// and the kernel passes iff
//   err_gpu <= 2 * err_base + 2 * noise + 1e-6.
// The factor 2 lets a kernel be twice as inaccurate as the baseline; the noise term covers the
// final rounding of an output whose baseline error happens to be tiny; 1e-6 only keeps the rule
// from demanding bitwise equality where every term is exactly zero (a row with one visible key
// reproduces v exactly). No "fraction of elements close" rule: one bad element fails the test.
//
// Where the contract itself fixes an fp32 computation whose rounding survives in an output that
// may cancel to about 0 (dbias: dZ with Δ = <dO, out> evaluated in fp32; backward_harness.h
// explains), the caller may pass `extra_noise`, one value per element; noise is then the max over
// the elements of max(|round(X_ref) - X_ref|, extra_noise[e]). Nothing else changes.
//
// Non-finite references (lse = +inf of a row with no visible key) are never subtracted: the GPU
// value must be the same infinity. A non-finite GPU value where the reference is finite (a NaN
// left by the poisoned output, an overflow) fails outright, whatever the bound.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "host_numeric.h"

namespace flash_dmattn::test {

inline constexpr double kBaselineFactor = 2.0;
inline constexpr double kNoiseFactor = 2.0;
inline constexpr double kAbsoluteFloor = 1e-6;

struct Comparison {
  double err_gpu = 0.0, err_base = 0.0, noise = 0.0;
  std::int64_t worst = -1;       // element with the largest err_gpu
  std::int64_t bad_special = 0;  // elements whose GPU value is non-finite or misses an infinite reference
  std::int64_t first_special = -1;
  std::int64_t bad_baseline = 0;  // elements where the emulation is non-finite but the reference is not

  double bound() const { return kBaselineFactor * err_base + kNoiseFactor * noise + kAbsoluteFloor; }
  bool passes() const { return bad_special == 0 && bad_baseline == 0 && err_gpu <= bound(); }
};

// All three vectors hold the output's elements in the same (row-major) order; `dtype` is the
// output's dtype.
inline Comparison compare_output(const std::vector<double>& gpu, const std::vector<double>& lowp,
                                 const std::vector<double>& ref, DType dtype,
                                 const std::vector<double>* extra_noise = nullptr) {
  Comparison c;
  for (std::size_t e = 0; e < ref.size(); ++e) {
    const auto index = static_cast<std::int64_t>(e);
    if (!std::isfinite(ref[e])) {
      if (!(gpu[e] == ref[e])) {  // also false for NaN
        if (c.bad_special++ == 0) c.first_special = index;
      }
      continue;
    }
    if (!std::isfinite(gpu[e])) {
      if (c.bad_special++ == 0) c.first_special = index;
      continue;
    }
    if (!std::isfinite(lowp[e])) {
      ++c.bad_baseline;
      continue;
    }
    const double err = std::abs(gpu[e] - ref[e]);
    if (err > c.err_gpu || c.worst < 0) {
      c.err_gpu = std::max(c.err_gpu, err);
      c.worst = index;
    }
    c.err_base = std::max(c.err_base, std::abs(lowp[e] - ref[e]));
    c.noise = std::max(c.noise, std::abs(host::round_to(dtype, ref[e]) - ref[e]));
    if (extra_noise) c.noise = std::max(c.noise, (*extra_noise)[e]);
  }
  return c;
}

// "(b, i, h, d)"-style coordinates of a row-major element index, for failure messages.
inline std::string coordinates(std::int64_t index, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> at(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const std::int64_t size = std::max<std::int64_t>(shape[d], 1);
    at[d] = index % size;
    index /= size;
  }
  std::ostringstream os;
  os << '(';
  for (std::size_t d = 0; d < at.size(); ++d) os << (d ? ", " : "") << at[d];
  os << ')';
  return os.str();
}

// Applies the rule to one output; `shape` only names elements in the message.
inline ::testing::AssertionResult within_tolerance(const char* name, const std::vector<double>& gpu,
                                                   const std::vector<double>& lowp, const std::vector<double>& ref,
                                                   DType dtype, const std::vector<std::int64_t>& shape,
                                                   const std::vector<double>* extra_noise = nullptr) {
  const Comparison c = compare_output(gpu, lowp, ref, dtype, extra_noise);
  // The margin goes to the XML report (--gtest_output=xml) so that it can be followed across
  // kernel changes; a test that checks several problems keeps the last one's.
  std::ostringstream margin;
  margin << c.err_gpu / c.bound();
  ::testing::Test::RecordProperty(std::string(name) + "_err_over_bound", margin.str());
  if (c.passes()) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  failure << name << ": ";
  if (c.bad_special > 0) {
    const auto e = static_cast<std::size_t>(c.first_special);
    failure << c.bad_special << " element(s) non-finite or not matching an infinite reference, first at "
            << coordinates(c.first_special, shape) << ": gpu " << gpu[e] << ", reference " << ref[e] << "; ";
  }
  if (c.bad_baseline > 0) {
    failure << c.bad_baseline << " element(s) where the same-precision emulation is non-finite (a test bug); ";
  }
  failure << "err_gpu " << c.err_gpu << " vs bound " << c.bound() << " = " << kBaselineFactor << " * err_base "
          << c.err_base << " + " << kNoiseFactor << " * noise " << c.noise << " + " << kAbsoluteFloor;
  if (c.worst >= 0) {
    const auto e = static_cast<std::size_t>(c.worst);
    failure << "; worst at " << coordinates(c.worst, shape) << ": gpu " << gpu[e] << ", reference " << ref[e]
            << ", emulation " << lowp[e];
  }
  return failure;
}

}  // namespace flash_dmattn::test
