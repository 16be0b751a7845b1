// GPU forward on storage layouts other than contiguous: padded rows in q, k, v and out, lse with
// a padded head stride, mask and bias at odd strides, q/k/v/out stored head-major (B, H, S, D)
// and viewed as (B, S, H, D); and the empty sizes Sq = 0, Sk = 0 and B = 0.
#include <limits>
#include <string>
#include <utility>

#include "forward_harness.h"

namespace flash_dmattn::test {
namespace {

class Layouts : public GpuTest {};

TEST_F(Layouts, PaddedRowsInEveryTensor) {
  auto rng = test_rng();
  for (const std::int64_t head_dim : {96, 128}) {
    SCOPED_TRACE("D=" + std::to_string(head_dim));
    ForwardCase c;
    c.n = Sizes{2, 150, 270, 4, 2, head_dim};
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.bias = OperandShape{true, c.n.H, false, true};
    c.bias_dtype = DType::float32;
    c.causal = true;
    c.layout.qkv_row_pad = 8;   // 16 bytes after each head row: strides stay multiples of 8 elements
    c.layout.out_row_pad = 24;
    c.layout.lse_row_pad = 3;   // lse head stride Sq + 3
    c.layout.mask_row_pad = 1;  // key-row strides 271 and 273: odd
    c.layout.bias_row_pad = 3;
    expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

// A (B, H, S, D) tensor viewed as (B, S, H, D): row stride D, head stride S·D.
HostTensor head_major(HostTensor t) {
  std::swap(t.view.shape[1], t.view.shape[2]);
  std::swap(t.view.stride[1], t.view.stride[2]);
  return t;
}

TEST_F(Layouts, HeadMajorStorage) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{2, 140, 230, 4, 2, 64};
  c.mask = OperandShape{false, 1, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  ForwardProblem p = ForwardProblem::random(c, rng);
  const Sizes& n = c.n;
  p.q = head_major(HostTensor::random(c.dtype, {n.B, n.H, n.Sq, n.D}, rng));
  p.k = head_major(HostTensor::random(c.dtype, {n.B, n.Hk, n.Sk, n.D}, rng));
  p.v = head_major(HostTensor::random(c.dtype, {n.B, n.Hk, n.Sk, n.D}, rng));
  p.out = head_major(HostTensor::empty(c.dtype, {n.B, n.H, n.Sq, n.D}));
  expect_forward_matches_reference(p, stream());
}

class EmptySizes : public GpuTest {
 protected:
  ForwardProblem problem(const Sizes& n) {
    auto rng = test_rng();
    ForwardCase c;
    c.n = n;
    c.mask = OperandShape{true, n.Hk, true, true};
    c.bias = OperandShape{true, n.Hk, false, true};
    return ForwardProblem::random(c, rng);
  }
};

// out and lse are empty: nothing is written, and the guards around them stay intact.
TEST_F(EmptySizes, NoQueryRows) { expect_forward_matches_reference(problem(Sizes{2, 0, 50, 4, 2, 64}), stream()); }

TEST_F(EmptySizes, NoBatch) { expect_forward_matches_reference(problem(Sizes{0, 40, 50, 4, 2, 64}), stream()); }

TEST_F(EmptySizes, NoKeysGiveZeroOutputAndInfiniteLse) {
  const ForwardProblem p = problem(Sizes{2, 40, 0, 4, 2, 64});
  GpuForward gpu(p, stream());
  gpu.prepare();
  if (test_stopped()) return;
  const Status status = gpu.run();
  ASSERT_TRUE(status.ok()) << status.message();
  const GpuOutputs outputs = gpu.finish();
  for (const double x : outputs.out.values()) ASSERT_EQ(x, 0.0);
  for (const double x : outputs.lse.values()) ASSERT_EQ(x, std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace flash_dmattn::test
