// A reference problem with owning fp64 (or any dtype) tensors, and the central-difference
// gradient check used by the reference suites.
#pragma once

#include <algorithm>
#include <numeric>
#include <optional>
#include <random>
#include <string>

#include "reference/reference.h"
#include "test_util.h"

namespace flash_dmattn::test {

// A broadcast shape for a mask or bias: each flag keeps the full size of that dimension;
// `heads` is 1, Hk or H.
struct OperandShape {
  bool batch = true;
  std::int64_t heads = 0;  // 0 means H
  bool query = true;
  bool key = true;
};

struct Sizes {
  std::int64_t B = 2, Sq = 3, Sk = 4, H = 4, Hk = 2, D = 2;
};

inline Shape operand_shape(const Sizes& n, const OperandShape& s) {
  return {s.batch ? n.B : 1, s.heads == 0 ? n.H : s.heads, s.query ? n.Sq : 1, s.key ? n.Sk : 1};
}

struct RefProblem {
  Sizes n;
  HostTensor q, k, v, dout;
  std::optional<HostTensor> mask, bias;
  double scale = 0.5;
  bool causal = false;
  double softcap = 0.0;

  // Fresh random fp64 data; the mask keeps each key with probability `density`.
  static RefProblem random(const Sizes& n, std::mt19937_64& rng, std::optional<OperandShape> mask,
                           std::optional<OperandShape> bias, double density = 0.7, DType dtype = DType::float64) {
    RefProblem p;
    p.n = n;
    p.q = HostTensor::random(dtype, {n.B, n.Sq, n.H, n.D}, rng);
    p.k = HostTensor::random(dtype, {n.B, n.Sk, n.Hk, n.D}, rng);
    p.v = HostTensor::random(dtype, {n.B, n.Sk, n.Hk, n.D}, rng);
    p.dout = HostTensor::random(dtype, {n.B, n.Sq, n.H, n.D}, rng);
    if (mask) p.mask = HostTensor::random(DType::boolean, operand_shape(n, *mask), rng, density);
    if (bias) p.bias = HostTensor::random(dtype, operand_shape(n, *bias), rng, -2.0, 2.0);
    return p;
  }

  reference::Inputs inputs() const {
    reference::Inputs in;
    in.q = q.view;
    in.k = k.view;
    in.v = v.view;
    in.mask = mask ? &mask->view : nullptr;
    in.bias = bias ? &bias->view : nullptr;
    in.scale = scale;
    in.causal = causal;
    in.softcap = softcap;
    return in;
  }

  // L = sum(dout * O), the loss whose gradients reference::backward returns.
  double loss() const {
    const reference::ForwardResult r = reference::forward(inputs());
    const std::vector<double> w = dout.values();
    double l = 0.0;
    for (size_t e = 0; e < w.size(); ++e) l += w[e] * r.out[e];
    return l;
  }
};

// Compares reference::backward with central differences of the loss, on every element of q, k,
// v and bias, or on `samples` random elements of each when samples > 0. All tensors are
// contiguous, so the element offset is also the index into the analytic gradient.
inline void expect_gradients_match_finite_differences(RefProblem& p, std::mt19937_64& rng, int samples = 0) {
  const reference::Gradients g = reference::backward(p.inputs(), p.dout.view);
  const double h = 1e-5;
  auto check = [&](const char* name, HostTensor& t, const std::vector<double>& analytic) {
    const std::int64_t count = t.view.numel();
    ASSERT_EQ(static_cast<std::int64_t>(analytic.size()), count) << name;
    std::uniform_int_distribution<std::int64_t> pick(0, std::max<std::int64_t>(count - 1, 0));
    const std::int64_t checks = samples > 0 ? std::min<std::int64_t>(samples, count) : count;
    for (std::int64_t c = 0; c < checks; ++c) {
      const std::int64_t e = samples > 0 ? pick(rng) : c;
      const double x = t.get(e);
      t.set(e, x + h);
      const double up = p.loss();
      t.set(e, x - h);
      const double down = p.loss();
      t.set(e, x);
      const double fd = (up - down) / (2 * h);
      ASSERT_NEAR(analytic[e], fd, 1e-7 + 1e-6 * std::abs(fd)) << "d" << name << " at element " << e;
    }
  };
  check("q", p.q, g.dq);
  check("k", p.k, g.dk);
  check("v", p.v, g.dv);
  if (p.bias) check("bias", *p.bias, g.dbias);
}

// Lists of `keep` distinct random keys per row of `rows` (.., K = keep + 2): then one key listed
// twice and one -1, shuffled; and the bool (.., Sk) mask they stand for.
struct RandomKeyLists {
  HostTensor indices, mask;

  RandomKeyLists(const Shape& rows, std::int64_t seqlen_k, std::int64_t keep, std::mt19937_64& rng) {
    indices = HostTensor::empty(DType::int32, {rows[0], rows[1], rows[2], keep + 2});
    mask = HostTensor::empty(DType::boolean, {rows[0], rows[1], rows[2], seqlen_k});
    std::vector<std::int64_t> keys(static_cast<std::size_t>(seqlen_k));
    for (std::int64_t b = 0; b < rows[0]; ++b)
      for (std::int64_t h = 0; h < rows[1]; ++h)
        for (std::int64_t i = 0; i < rows[2]; ++i) {
          std::iota(keys.begin(), keys.end(), 0);
          std::shuffle(keys.begin(), keys.end(), rng);
          std::vector<std::int64_t> list(keys.begin(), keys.begin() + keep);
          list.push_back(keep > 0 ? list.front() : -1);
          list.push_back(-1);
          std::shuffle(list.begin(), list.end(), rng);
          for (std::int64_t j = 0; j < seqlen_k; ++j) mask.set(host::offset4(mask.view, b, h, i, j), 0.0);
          for (std::size_t e = 0; e < list.size(); ++e) {
            indices.set(host::offset4(indices.view, b, h, i, static_cast<std::int64_t>(e)),
                        static_cast<double>(list[e]));
            if (list[e] >= 0) mask.set(host::offset4(mask.view, b, h, i, list[e]), 1.0);
          }
        }
  }
};

}  // namespace flash_dmattn::test
