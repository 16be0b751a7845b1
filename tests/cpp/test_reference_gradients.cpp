// Gradients of the fp64 reference against central finite differences of L = sum(dO ∘ O).
#include <tuple>

#include "reference_problem.h"

namespace flash_dmattn::test {
namespace {

// Every broadcast shape of a mask or bias for (B, H, Hk) = (2, 4, 2): batch, query and key each
// 1 or full, heads 1, Hk or H; index 0 means "absent".
constexpr int kOperandShapes = 1 + 2 * 3 * 2 * 2;

std::optional<OperandShape> operand_shape_at(int index, const Sizes& n) {
  if (index == 0) return std::nullopt;
  const int c = index - 1;
  const std::int64_t heads[3] = {1, n.Hk, n.H};
  return OperandShape{(c & 1) != 0, heads[(c >> 1) % 3], (c / 6 & 1) != 0, (c / 12 & 1) != 0};
}

std::string operand_name(int index, const Sizes& n) {
  const auto s = operand_shape_at(index, n);
  if (!s) return "none";
  const std::string heads = s->heads == 1 ? "1" : s->heads == n.Hk ? "Hk" : "H";
  return std::string(s->batch ? "B" : "1") + heads + (s->query ? "Sq" : "1") + (s->key ? "Sk" : "1");
}

// Mask × bias over every broadcast combination (25 × 25), causal with Sq < Sk.
class BroadcastGradients : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(BroadcastGradients, MatchFiniteDifferences) {
  auto rng = test_rng();
  const Sizes n;  // B2 Sq3 Sk4 H4 Hk2 D2
  const auto [mask, bias] = GetParam();
  RefProblem p = RefProblem::random(n, rng, operand_shape_at(mask, n), operand_shape_at(bias, n));
  p.causal = true;
  expect_gradients_match_finite_differences(p, rng);
}

INSTANTIATE_TEST_SUITE_P(AllMaskAndBiasShapes, BroadcastGradients,
                         ::testing::Combine(::testing::Range(0, kOperandShapes), ::testing::Range(0, kOperandShapes)),
                         [](const auto& test) {
                           const Sizes n;
                           return "mask_" + operand_name(std::get<0>(test.param), n) + "_bias_" +
                                  operand_name(std::get<1>(test.param), n);
                         });

// The bias shapes users pass most, with softcap on and off, non-causal, with GQA 2.
struct NamedBias {
  const char* name;
  OperandShape shape;
};

class NamedBiasGradients : public ::testing::TestWithParam<std::tuple<NamedBias, double>> {};

TEST_P(NamedBiasGradients, MatchFiniteDifferences) {
  auto rng = test_rng();
  Sizes n;
  n.Sq = 5;
  n.Sk = 3;
  const auto& [bias, softcap] = GetParam();
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, n.Hk, false, true}, bias.shape);
  p.softcap = softcap;
  expect_gradients_match_finite_differences(p, rng);
}

INSTANTIATE_TEST_SUITE_P(
    BiasShapes, NamedBiasGradients,
    ::testing::Combine(::testing::Values(NamedBias{"B_H_Sq_Sk", {true, 0, true, true}},
                                         NamedBias{"B_Hk_1_Sk", {true, 2, false, true}},
                                         NamedBias{"1_1_Sq_Sk", {false, 1, true, true}},
                                         NamedBias{"B_1_1_1", {true, 1, false, false}},
                                         NamedBias{"B_H_Sq_1", {true, 0, true, false}}),
                       ::testing::Values(0.0, 1.5)),
    [](const auto& test) {
      return std::string(std::get<0>(test.param).name) + (std::get<1>(test.param) > 0 ? "_softcap" : "_nocap");
    });

// GQA ratios 1, 2, 4, 8 (H = 8) with mask heads 1, Hk and H, causal on and off.
class GqaGradients : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

std::string gqa_name(const ::testing::TestParamInfo<std::tuple<int, int, bool>>& test) {
  const char* mask_heads[3] = {"1", "Hk", "H"};
  return "ratio" + std::to_string(std::get<0>(test.param)) + "_maskheads_" + mask_heads[std::get<1>(test.param)] +
         (std::get<2>(test.param) ? "_causal" : "_full");
}

TEST_P(GqaGradients, MatchFiniteDifferences) {
  auto rng = test_rng();
  const auto [ratio, mask_heads_kind, causal] = GetParam();
  Sizes n;
  n.B = 1;
  n.H = 8;
  n.Hk = 8 / ratio;
  n.Sq = 3;
  n.Sk = 3;
  const std::int64_t mask_heads[3] = {1, n.Hk, n.H};
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, mask_heads[mask_heads_kind], true, true},
                                    OperandShape{true, n.Hk, false, true});
  p.causal = causal;
  expect_gradients_match_finite_differences(p, rng);
}

INSTANTIATE_TEST_SUITE_P(Ratios, GqaGradients,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Values(0, 1, 2),
                                            ::testing::Bool()),
                         gqa_name);

// Causal with Sq < Sk, Sq = Sk and Sq > Sk, softcap on and off.
class CausalGradients : public ::testing::TestWithParam<std::tuple<std::tuple<int, int>, double>> {};

std::string causal_name(const ::testing::TestParamInfo<std::tuple<std::tuple<int, int>, double>>& test) {
  const auto [sq, sk] = std::get<0>(test.param);
  return "Sq" + std::to_string(sq) + "_Sk" + std::to_string(sk) + (std::get<1>(test.param) > 0 ? "_softcap" : "_nocap");
}

TEST_P(CausalGradients, MatchFiniteDifferences) {
  auto rng = test_rng();
  const auto [lengths, softcap] = GetParam();
  Sizes n;
  n.Sq = std::get<0>(lengths);
  n.Sk = std::get<1>(lengths);
  RefProblem p = RefProblem::random(n, rng, std::nullopt, OperandShape{true, n.H, true, true});
  p.causal = true;
  p.softcap = softcap;
  expect_gradients_match_finite_differences(p, rng);
}

INSTANTIATE_TEST_SUITE_P(Lengths, CausalGradients,
                         ::testing::Combine(::testing::Values(std::make_tuple(3, 6), std::make_tuple(5, 5),
                                                              std::make_tuple(6, 3)),
                                            ::testing::Values(0.0, 0.8)),
                         causal_name);

// A mask that empties whole rows and a whole block of keys: gradients are exactly zero there.
TEST(EmptiedGradients, RowsAndBlocksTheMaskEmpties) {
  auto rng = test_rng();
  Sizes n;
  n.B = 1;
  n.Sq = 6;
  n.Sk = 8;
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, n.H, true, true}, OperandShape{true, n.H, true, true});
  auto& mask = *p.mask;
  for (std::int64_t h = 0; h < n.H; ++h) {
    for (std::int64_t j = 0; j < n.Sk; ++j) mask.set(host::offset4(mask.view, 0, h, 2, j), 0.0);  // row 2 empty
    for (std::int64_t i = 3; i < n.Sq; ++i)
      for (std::int64_t j = 4; j < n.Sk; ++j) mask.set(host::offset4(mask.view, 0, h, i, j), 0.0);  // block
  }
  expect_gradients_match_finite_differences(p, rng);

  const reference::Gradients g = reference::backward(p.inputs(), p.dout.view);
  for (std::int64_t h = 0; h < n.H; ++h) {
    for (std::int64_t d = 0; d < n.D; ++d) EXPECT_EQ(g.dq[(2 * n.H + h) * n.D + d], 0.0) << "head " << h;
    for (std::int64_t j = 0; j < n.Sk; ++j) EXPECT_EQ(g.dbias[(h * n.Sq + 2) * n.Sk + j], 0.0);
    for (std::int64_t i = 3; i < n.Sq; ++i)
      for (std::int64_t j = 4; j < n.Sk; ++j) EXPECT_EQ(g.dbias[(h * n.Sq + i) * n.Sk + j], 0.0);
  }
  const auto out = reference::forward(p.inputs());
  for (std::int64_t h = 0; h < n.H; ++h) EXPECT_EQ(out.lse[h * n.Sq + 2], std::numeric_limits<double>::infinity());
}

// Lengths 0, 1, 17, 63, 65, 127 for Sq and Sk (equal and unequal), mask and bias, causal:
// central differences on a random sample of elements of each tensor.
class LengthGradients : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(LengthGradients, MatchFiniteDifferencesOnSamples) {
  auto rng = test_rng();
  Sizes n;
  n.B = 1;
  n.H = 2;
  n.Hk = 1;
  n.D = 8;
  n.Sq = std::get<0>(GetParam());
  n.Sk = std::get<1>(GetParam());
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, 1, true, true}, OperandShape{true, n.Hk, false, true});
  p.causal = true;
  expect_gradients_match_finite_differences(p, rng, /*samples=*/12);
}

INSTANTIATE_TEST_SUITE_P(Lengths, LengthGradients,
                         ::testing::Values(std::make_tuple(0, 17), std::make_tuple(17, 0), std::make_tuple(1, 1),
                                           std::make_tuple(1, 127), std::make_tuple(17, 17), std::make_tuple(63, 65),
                                           std::make_tuple(65, 63), std::make_tuple(127, 127),
                                           std::make_tuple(127, 17)),
                         [](const auto& test) {
                           return "Sq" + std::to_string(std::get<0>(test.param)) + "_Sk" +
                                  std::to_string(std::get<1>(test.param));
                         });

}  // namespace
}  // namespace flash_dmattn::test
