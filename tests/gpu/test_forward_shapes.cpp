// GPU forward against the reference over the shape space: every head dim (the odd buckets 40 and
// 80 included) in fp16 and bf16; mask and bias broadcast shapes and bias dtypes; GQA ratios with
// mask heads 1, Hk and H; causal with Sq < Sk, Sq = Sk and Sq > Sk, softcap on and off; and
// sequence lengths from 1 to 4095 around the tile sizes, with mask and bias at odd strides.
#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "forward_harness.h"

namespace flash_dmattn::test {
namespace {

// ---- head dims × dtypes: mask (B, Hk, Sq, Sk) + bias (B, Hk, 1, Sk), causal ----

using HeadDimParam = std::tuple<int, DType>;

class HeadDims : public GpuParamTest<HeadDimParam> {};

TEST_P(HeadDims, MaskedBiasedCausalMatchesReference) {
  auto rng = test_rng();
  const auto [head_dim, dtype] = GetParam();
  ForwardCase c;
  c.n = Sizes{2, 113, 203, 4, 2, head_dim};
  c.dtype = dtype;
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
}

std::string head_dim_name(const ::testing::TestParamInfo<HeadDimParam>& test) {
  return "D" + std::to_string(std::get<0>(test.param)) + "_" + dtype_name(std::get<1>(test.param));
}

INSTANTIATE_TEST_SUITE_P(Forward, HeadDims,
                         ::testing::Combine(::testing::Values(32, 40, 64, 80, 96, 128, 192, 256),
                                            ::testing::Values(DType::float16, DType::bfloat16)),
                         head_dim_name);

// ---- mask × bias broadcast shapes, non-causal and causal ----

// The 24 broadcast shapes of a mask or bias: batch 1|B, heads 1|Hk|H, rows 1|Sq, keys 1|Sk.
constexpr int kOperandShapes = 24;

OperandShape operand_shape_at(int index, const Sizes& n) {
  const std::int64_t heads[3] = {1, n.Hk, n.H};
  return OperandShape{(index & 1) != 0, heads[(index >> 1) % 3], (index / 6 & 1) != 0, (index / 12 & 1) != 0};
}

std::string operand_name(int index, const Sizes& n) {
  const OperandShape s = operand_shape_at(index, n);
  const std::string heads = s.heads == 1 ? "1" : s.heads == n.Hk ? "Hk" : "H";
  return std::string(s.batch ? "B" : "1") + heads + (s.query ? "Sq" : "1") + (s.key ? "Sk" : "1");
}

struct BroadcastCombo {
  int mask = -1;  // operand shape index; -1: no mask
  int bias = -1;  // -1: no bias
  bool fp32_bias = false;
  bool expanded = false;  // size-1 dimensions read through stride 0 instead of their natural stride
};

const Sizes kBroadcastSizes{2, 65, 129, 6, 2, 64};

// No mask or bias; every mask alone; every bias alone in both dtypes; and 60 mask × bias pairs
// drawn with a fixed seed (test names must not change between runs). Alternate combos use
// zero strides for their size-1 dimensions.
std::vector<BroadcastCombo> broadcast_combos() {
  std::vector<BroadcastCombo> combos = {BroadcastCombo{}};
  for (int m = 0; m < kOperandShapes; ++m) combos.push_back({m, -1, false, false});
  for (int b = 0; b < 2 * kOperandShapes; ++b) combos.push_back({-1, b / 2, b % 2 == 1, false});
  std::mt19937 pick(20240611);
  std::set<std::tuple<int, int, bool>> drawn;
  while (drawn.size() < 60) {
    const int m = static_cast<int>(pick() % kOperandShapes), b = static_cast<int>(pick() % kOperandShapes);
    const bool fp32 = pick() % 2 == 1;
    if (drawn.insert({m, b, fp32}).second) combos.push_back({m, b, fp32, false});
  }
  for (std::size_t i = 0; i < combos.size(); ++i) combos[i].expanded = i % 2 == 1;
  return combos;
}

class BroadcastShapes : public GpuParamTest<BroadcastCombo> {};

TEST_P(BroadcastShapes, MatchReferenceNonCausalAndCausal) {
  auto rng = test_rng();
  const BroadcastCombo combo = GetParam();
  ForwardCase c;
  c.n = kBroadcastSizes;
  c.dtype = DType::bfloat16;
  if (combo.mask >= 0) c.mask = operand_shape_at(combo.mask, c.n);
  if (combo.bias >= 0) c.bias = operand_shape_at(combo.bias, c.n);
  c.bias_dtype = combo.fp32_bias ? DType::float32 : DType::bfloat16;
  // Sk = 129: with these pads every key-row stride is odd (131 and 133; 3 and 5 for a key dim of 1).
  c.layout.mask_row_pad = 2;
  c.layout.bias_row_pad = 4;
  c.layout.zero_broadcast_strides = combo.expanded;
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

std::string broadcast_name(const ::testing::TestParamInfo<BroadcastCombo>& test) {
  const BroadcastCombo& c = test.param;
  std::string name = "mask_" + (c.mask >= 0 ? operand_name(c.mask, kBroadcastSizes) : std::string("none"));
  name += "_bias_" + (c.bias >= 0 ? operand_name(c.bias, kBroadcastSizes) + (c.fp32_bias ? "_f32" : "_bf16")
                                  : std::string("none"));
  return name + (c.expanded ? "_expanded" : "");
}

INSTANTIATE_TEST_SUITE_P(Forward, BroadcastShapes, ::testing::ValuesIn(broadcast_combos()), broadcast_name);

// ---- GQA: ratios 1, 2, 4, 8 with H = 8, mask heads 1, Hk, H ----

using GqaParam = std::tuple<int, int>;  // H / Hk, mask heads (0: 1, 1: Hk, 2: H)

class Gqa : public GpuParamTest<GqaParam> {};

TEST_P(Gqa, MatchesReference) {
  auto rng = test_rng();
  const auto [ratio, mask_heads] = GetParam();
  ForwardCase c;
  c.n = Sizes{2, 97, 150, 8, 8 / ratio, 64};
  c.dtype = DType::float16;
  const std::int64_t heads[3] = {1, c.n.Hk, c.n.H};
  c.mask = OperandShape{true, heads[mask_heads], true, true};
  // The bias takes the head count the mask does not, so both operands see every head mapping.
  c.bias = OperandShape{true, heads[(mask_heads + 2) % 3], false, true};
  c.causal = true;
  expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
}

std::string gqa_name(const ::testing::TestParamInfo<GqaParam>& test) {
  const char* mask_heads[3] = {"1", "Hk", "H"};
  return "ratio" + std::to_string(std::get<0>(test.param)) + "_maskheads_" + mask_heads[std::get<1>(test.param)];
}

INSTANTIATE_TEST_SUITE_P(Forward, Gqa, ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Values(0, 1, 2)),
                         gqa_name);

// ---- causal alignment with Sq < Sk, Sq = Sk, Sq > Sk; softcap off and on ----

using CausalParam = std::tuple<std::tuple<int, int>, double>;  // (Sq, Sk), softcap

class Causal : public GpuParamTest<CausalParam> {};

TEST_P(Causal, MatchesReference) {
  auto rng = test_rng();
  const auto [lengths, softcap] = GetParam();
  ForwardCase c;
  c.n = Sizes{2, std::get<0>(lengths), std::get<1>(lengths), 4, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 0.7;
  c.bias = OperandShape{true, c.n.H, true, true};
  c.causal = true;
  c.softcap = softcap;
  // Scale 1 puts the logits (std ≈ 3.8 at D = 128) where a cap of 5 bends them.
  c.scale = 1.0;
  expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
}

std::string causal_name(const ::testing::TestParamInfo<CausalParam>& test) {
  const auto [lengths, softcap] = test.param;
  return "Sq" + std::to_string(std::get<0>(lengths)) + "_Sk" + std::to_string(std::get<1>(lengths)) +
         (softcap > 0 ? "_softcap" : "_nocap");
}

INSTANTIATE_TEST_SUITE_P(Forward, Causal,
                         ::testing::Combine(::testing::Values(std::make_tuple(77, 250), std::make_tuple(160, 160),
                                                              std::make_tuple(250, 77)),
                                            ::testing::Values(0.0, 5.0)),
                         causal_name);

// ---- a bias row shared by the query rows, 16-byte aligned: on Hopper the producer stages each
// key tile's values in shared memory; Sk = 1000 ends in a partial tile ----

using StagedBiasParam = std::tuple<int, DType, bool>;  // bias heads (1 or Hk), dtype, causal

class StagedBias : public GpuParamTest<StagedBiasParam> {};

TEST_P(StagedBias, MatchesReference) {
  auto rng = test_rng();
  const auto [bias_heads, dtype, causal] = GetParam();
  ForwardCase c;
  c.n = Sizes{2, 150, 1000, 4, 2, 128};
  c.dtype = dtype;
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 0.8;
  c.bias = OperandShape{bias_heads > 1, bias_heads, false, true};
  c.causal = causal;
  expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
}

std::string staged_bias_name(const ::testing::TestParamInfo<StagedBiasParam>& test) {
  const auto [bias_heads, dtype, causal] = test.param;
  return "BiasHeads" + std::to_string(bias_heads) + "_" + dtype_name(dtype) + (causal ? "_causal" : "_full");
}

INSTANTIATE_TEST_SUITE_P(Forward, StagedBias,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values(DType::float16, DType::bfloat16),
                                            ::testing::Values(false, true)),
                         staged_bias_name);

// ---- lengths 1 ... 4095 for Sq and Sk ----

struct LengthCase {
  int sq, sk;
  bool causal;
};

// (L, L) non-causal in bf16; (L, 2L+3) and (2L+3, L), capped at 4095, causal in fp16.
std::vector<LengthCase> length_cases() {
  std::vector<LengthCase> cases;
  for (const int l : {1, 17, 63, 65, 127, 128, 129, 1000, 4095}) {
    const int longer = std::min(2 * l + 3, 4095);
    cases.push_back({l, l, false});
    if (longer == l) continue;
    cases.push_back({l, longer, true});
    cases.push_back({longer, l, true});
  }
  return cases;
}

class Lengths : public GpuParamTest<LengthCase> {};

TEST_P(Lengths, MatchReference) {
  auto rng = test_rng();
  const LengthCase length = GetParam();
  ForwardCase c;
  c.n = Sizes{1, length.sq, length.sk, 2, 1, 128};
  c.dtype = length.causal ? DType::float16 : DType::bfloat16;
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = length.causal;
  // Odd row strides (Sk + pad odd) leave the mask and bias rows without any alignment.
  c.layout.mask_row_pad = 1 + length.sk % 2;
  c.layout.bias_row_pad = 3 + length.sk % 2;
  expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
}

std::string length_name(const ::testing::TestParamInfo<LengthCase>& test) {
  return "Sq" + std::to_string(test.param.sq) + "_Sk" + std::to_string(test.param.sk) +
         (test.param.causal ? "_causal" : "_full");
}

INSTANTIATE_TEST_SUITE_P(Forward, Lengths, ::testing::ValuesIn(length_cases()), length_name);

// ---- a prefill of few query tiles, split over the keys: thousands of rows to combine ----

// Two heads of 1500 query rows fill a few dozen CTAs, so the keys are split to fill the GPU and
// 3000 rows are merged by the combine's kernel for many rows (split_combine.cu), a few lanes a row
// at every head dim. Causal with Sq > Sk: the first 300 rows see no key (O = 0, LSE = +inf).
class SplitPrefill : public GpuParamTest<HeadDimParam> {};

TEST_P(SplitPrefill, MatchesReference) {
  auto rng = test_rng();
  const auto [head_dim, dtype] = GetParam();
  for (const bool causal : {false, true}) {
    ForwardCase c;
    c.n = Sizes{1, 1500, 1200, 2, 1, head_dim};
    c.dtype = dtype;
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.bias = OperandShape{true, c.n.Hk, false, true};
    c.causal = causal;
    SCOPED_TRACE(causal ? "causal" : "full");
    expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
  }
}

INSTANTIATE_TEST_SUITE_P(Forward, SplitPrefill,
                         ::testing::Combine(::testing::Values(32, 40, 64, 128, 256),
                                            ::testing::Values(DType::float16, DType::bfloat16)),
                         head_dim_name);

}  // namespace
}  // namespace flash_dmattn::test
