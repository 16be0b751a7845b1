// Properties of the reference forward that hold for any data: broadcasting equals
// materializing, strides do not matter, softmax invariances, empty rows, and the edge lengths.
#include <cmath>
#include <limits>

#include "reference_problem.h"

namespace flash_dmattn::test {
namespace {

const double kInf = std::numeric_limits<double>::infinity();

// The test's own expansion of a broadcast mask or bias to (B, H, Sq, Sk), written with explicit
// loops rather than the reference's indexing.
HostTensor materialize(const HostTensor& t, const Sizes& n) {
  HostTensor full = HostTensor::empty(t.view.dtype, {n.B, n.H, n.Sq, n.Sk});
  const std::int64_t heads = t.view.shape[1], group = n.H / heads;
  for (std::int64_t b = 0; b < n.B; ++b)
    for (std::int64_t h = 0; h < n.H; ++h)
      for (std::int64_t i = 0; i < n.Sq; ++i)
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          const std::int64_t src = (t.view.shape[0] == 1 ? 0 : b) * t.view.stride[0] + (h / group) * t.view.stride[1] +
                                   (t.view.shape[2] == 1 ? 0 : i) * t.view.stride[2] +
                                   (t.view.shape[3] == 1 ? 0 : j) * t.view.stride[3];
          full.set(((b * n.H + h) * n.Sq + i) * n.Sk + j, t.get(src));
        }
  return full;
}

// Sums a full (B, H, Sq, Sk) gradient down to the broadcast shape `like`.
std::vector<double> reduce_to(const std::vector<double>& full, const Sizes& n, const TensorView& like) {
  std::vector<double> out(like.numel(), 0.0);
  const std::int64_t group = n.H / like.shape[1];
  for (std::int64_t b = 0; b < n.B; ++b)
    for (std::int64_t h = 0; h < n.H; ++h)
      for (std::int64_t i = 0; i < n.Sq; ++i)
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          const std::int64_t dst =
              (((like.shape[0] == 1 ? 0 : b) * like.shape[1] + h / group) * like.shape[2] + (like.shape[2] == 1 ? 0 : i)) *
                  like.shape[3] +
              (like.shape[3] == 1 ? 0 : j);
          out[dst] += full[((b * n.H + h) * n.Sq + i) * n.Sk + j];
        }
  return out;
}

class BroadcastEqualsMaterialized : public ::testing::TestWithParam<int> {};

TEST_P(BroadcastEqualsMaterialized, ForwardAndBiasGradient) {
  auto rng = test_rng();
  Sizes n;
  n.B = 2;
  n.H = 6;
  n.Hk = 3;
  n.Sq = 5;
  n.Sk = 7;
  n.D = 4;
  const int c = GetParam();
  const std::int64_t heads[3] = {1, n.Hk, n.H};
  const OperandShape shape{(c & 1) != 0, heads[(c >> 1) % 3], (c / 6 & 1) != 0, (c / 12 & 1) != 0};
  RefProblem p = RefProblem::random(n, rng, shape, shape);
  p.causal = c % 5 == 0;
  RefProblem full = p;
  full.mask = materialize(*p.mask, n);
  full.bias = materialize(*p.bias, n);
  const auto a = reference::forward(p.inputs());
  const auto b = reference::forward(full.inputs());
  EXPECT_EQ(a.out, b.out);  // same arithmetic in the same order: bitwise equal
  EXPECT_EQ(a.lse, b.lse);
  const auto ga = reference::backward(p.inputs(), p.dout.view);
  const auto gb = reference::backward(full.inputs(), full.dout.view);
  EXPECT_EQ(ga.dq, gb.dq);
  EXPECT_EQ(ga.dk, gb.dk);
  EXPECT_EQ(ga.dv, gb.dv);
  EXPECT_LT(max_abs_diff(ga.dbias, reduce_to(gb.dbias, n, p.bias->view)), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(AllShapes, BroadcastEqualsMaterialized, ::testing::Range(0, 24));

TEST(ReferenceProperties, StridesDoNotChangeResults) {
  auto rng = test_rng();
  Sizes n;
  n.Sq = 6;
  n.Sk = 9;
  n.D = 8;
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, n.Hk, true, true}, OperandShape{false, n.H, true, true});
  RefProblem padded = p;
  // Same values in buffers whose rows are padded by 3 elements.
  for (auto [src, dst] : {std::pair{&p.q, &padded.q}, {&p.k, &padded.k}, {&p.v, &padded.v}, {&p.dout, &padded.dout},
                          {&*p.mask, &*padded.mask}, {&*p.bias, &*padded.bias}}) {
    Shape shape(src->view.shape, src->view.shape + 4);
    *dst = HostTensor::empty(src->view.dtype, shape, /*row_pad=*/3);
    const auto values = src->values();
    size_t e = 0;
    dst->for_each([&](std::int64_t o) { dst->set(o, values[e++]); });
  }
  const auto a = reference::forward(p.inputs());
  const auto b = reference::forward(padded.inputs());
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  const auto ga = reference::backward(p.inputs(), p.dout.view);
  const auto gb = reference::backward(padded.inputs(), padded.dout.view);
  EXPECT_EQ(ga.dq, gb.dq);
  EXPECT_EQ(ga.dk, gb.dk);
  EXPECT_EQ(ga.dbias, gb.dbias);
}

TEST(ReferenceProperties, OnesForValuesGiveOnesOnVisibleRows) {
  auto rng = test_rng();
  Sizes n;
  n.Sq = 9;
  n.Sk = 5;
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, n.H, true, true}, OperandShape{true, 1, true, true}, 0.4);
  p.causal = true;
  p.v.for_each([&](std::int64_t o) { p.v.set(o, 1.0); });
  const auto r = reference::forward(p.inputs());
  for (std::int64_t b = 0; b < n.B; ++b)
    for (std::int64_t i = 0; i < n.Sq; ++i)
      for (std::int64_t h = 0; h < n.H; ++h) {
        const bool empty = r.lse[(b * n.H + h) * n.Sq + i] == kInf;
        for (std::int64_t d = 0; d < n.D; ++d)
          EXPECT_NEAR(r.out[((b * n.Sq + i) * n.H + h) * n.D + d], empty ? 0.0 : 1.0, 1e-14);
      }
}

TEST(ReferenceProperties, RowConstantBiasShiftsOnlyTheLse) {
  auto rng = test_rng();
  Sizes n;
  RefProblem p = RefProblem::random(n, rng, std::nullopt, OperandShape{true, n.H, true, true});
  const auto before = reference::forward(p.inputs());
  p.bias->for_each([&](std::int64_t o) { p.bias->set(o, p.bias->get(o) + 3.0); });
  const auto after = reference::forward(p.inputs());
  EXPECT_LT(max_abs_diff(before.out, after.out), 1e-13);
  for (size_t e = 0; e < before.lse.size(); ++e) EXPECT_NEAR(after.lse[e], before.lse[e] + 3.0, 1e-13);
}

TEST(ReferenceProperties, OneVisibleKeyCopiesItsValue) {
  auto rng = test_rng();
  Sizes n;
  n.Sq = 3;
  n.Sk = 6;
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, n.H, true, true}, OperandShape{true, n.H, true, true});
  auto& mask = *p.mask;
  mask.for_each([&](std::int64_t o) { mask.set(o, 0.0); });
  for (std::int64_t b = 0; b < n.B; ++b)
    for (std::int64_t h = 0; h < n.H; ++h)
      for (std::int64_t i = 0; i < n.Sq; ++i) mask.set(host::offset4(mask.view, b, h, i, (i + h) % n.Sk), 1.0);
  const auto r = reference::forward(p.inputs());
  for (std::int64_t b = 0; b < n.B; ++b)
    for (std::int64_t h = 0; h < n.H; ++h)
      for (std::int64_t i = 0; i < n.Sq; ++i) {
        const std::int64_t j = (i + h) % n.Sk, kvh = h / (n.H / n.Hk);
        for (std::int64_t d = 0; d < n.D; ++d)
          EXPECT_EQ(r.out[((b * n.Sq + i) * n.H + h) * n.D + d], p.v.get(host::offset4(p.v.view, b, j, kvh, d)));
      }
}

class EdgeLengths : public ::testing::TestWithParam<int> {};

TEST_P(EdgeLengths, ForwardIsFiniteAndEmptyRowsAreDefined) {
  auto rng = test_rng();
  const int length = GetParam();
  for (const auto& [sq, sk] : {std::pair{length, length}, {length, 2 * length + 1}, {2 * length + 1, length}}) {
    Sizes n;
    n.B = 1;
    n.H = 2;
    n.Hk = 1;
    n.D = 8;
    n.Sq = sq;
    n.Sk = sk;
    RefProblem p = RefProblem::random(n, rng, OperandShape{true, 1, true, true}, OperandShape{true, 1, false, true}, 0.05);
    p.causal = true;
    const auto r = reference::forward(p.inputs());
    ASSERT_EQ(r.lse.size(), static_cast<size_t>(n.H * n.Sq));
    for (std::int64_t h = 0; h < n.H; ++h)
      for (std::int64_t i = 0; i < n.Sq; ++i) {
        const double lse = r.lse[h * n.Sq + i];
        bool any = false;
        for (std::int64_t j = 0; j < n.Sk; ++j)
          any |= j <= i + n.Sk - n.Sq && p.mask->get(host::offset4(p.mask->view, 0, 0, i, j)) != 0.0;
        EXPECT_EQ(lse == kInf, !any) << "Sq " << sq << " Sk " << sk << " row " << i;
        for (std::int64_t d = 0; d < n.D; ++d) {
          const double o = r.out[(i * n.H + h) * n.D + d];
          EXPECT_TRUE(std::isfinite(o));
          if (!any) {
            EXPECT_EQ(o, 0.0);
          }
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, EdgeLengths, ::testing::Values(0, 1, 17, 63, 65, 127));

}  // namespace
}  // namespace flash_dmattn::test
