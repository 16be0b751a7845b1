// Mask and bias edits shared by the forward and backward GPU suites: the same hand-made cases
// (emptied tiles, -inf and huge negative biases, garbage at hidden positions) run through both
// passes. Each edit works on a ForwardProblem, the base of BackwardProblem.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "forward_harness.h"

namespace flash_dmattn::test {

inline constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Calls fn(b, h, i, j, offset) for every element of a (B, H, Sq, Sk)-shaped host tensor.
template <typename Fn>
void for_each_index(const HostTensor& t, Fn fn) {
  const TensorView& v = t.view;
  for (std::int64_t b = 0; b < v.shape[0]; ++b)
    for (std::int64_t h = 0; h < v.shape[1]; ++h)
      for (std::int64_t i = 0; i < v.shape[2]; ++i)
        for (std::int64_t j = 0; j < v.shape[3]; ++j) fn(b, h, i, j, host::offset4(v, b, h, i, j));
}

// Mask and bias both (B, H, Sq, Sk), so one index names the same position in each.
template <typename Case>
Case full_mask_and_bias(DType bias_dtype, double density) {
  Case c;
  c.n = Sizes{2, 150, 300, 4, 2, 64};
  c.mask = OperandShape{true, c.n.H, true, true};
  c.density = density;
  c.bias = OperandShape{true, c.n.H, true, true};
  c.bias_dtype = bias_dtype;
  return c;
}

// Empties 128-row x 64-key tiles of the mask: pairs of them (128x128 blocks) in a checkerboard,
// plus scattered single ones.
inline void empty_tiles_in_a_checkerboard(ForwardProblem& p) {
  for_each_index(*p.mask, [&](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j, std::int64_t offset) {
    const std::int64_t ti = i / 128, tj = j / 64;
    if ((ti + tj / 2) % 2 == 0 || (7 * ti + tj) % 5 == 0) p.mask->set(offset, 0.0);
  });
}

// -inf at about one bias element in ten.
inline void negative_infinity_at_random(ForwardProblem& p, std::mt19937_64& rng) {
  std::bernoulli_distribution hide(0.1);
  for_each_index(*p.bias, [&](std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t offset) {
    if (hide(rng)) p.bias->set(offset, -kInfinity);
  });
}

// With full_mask_and_bias: rows i % 5 == 0 get -inf everywhere; rows i % 5 == 2 get -inf at the
// visible keys only, finite at the hidden ones, which must not revive the row.
inline void empty_rows_through_negative_infinity(ForwardProblem& p) {
  for_each_index(*p.bias, [&](std::int64_t, std::int64_t, std::int64_t i, std::int64_t, std::int64_t offset) {
    const bool visible = p.mask->get(offset) != 0.0;
    if (i % 5 == 0 || (i % 5 == 2 && visible)) p.bias->set(offset, -kInfinity);
  });
}

// With full_mask_and_bias: NaN and +inf wherever the mask or causality hides the key, values
// docs/semantics.md §3 says are never read.
inline void garbage_at_hidden_positions(ForwardProblem& p) {
  const double garbage[2] = {std::numeric_limits<double>::quiet_NaN(), kInfinity};
  const bool causal = p.options.causal;
  for_each_index(*p.bias, [&](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j, std::int64_t offset) {
    const bool visible = p.mask->get(offset) != 0.0 && (!causal || j <= i + p.n.Sk - p.n.Sq);
    if (!visible) p.bias->set(offset, garbage[(i + j) % 2]);
  });
}

// -30000 at every key of rows i % 3 == 0: finite logits, so the rows are not empty (§5).
inline void large_negative_bias_rows(ForwardProblem& p) {
  for_each_index(*p.bias, [&](std::int64_t, std::int64_t, std::int64_t i, std::int64_t, std::int64_t offset) {
    if (i % 3 == 0) p.bias->set(offset, -30000.0);
  });
}

}  // namespace flash_dmattn::test
