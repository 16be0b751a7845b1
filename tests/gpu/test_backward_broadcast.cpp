// GPU backward over every mask × bias broadcast combination: the 24 shapes (B|1, H|Hk|1, Sq|1,
// Sk|1) of each, or none, 625 pairs in all, each with dbias, so that every reduction of dbias
// (over batch, over the query heads of a bias head, over rows, over keys, and their combinations)
// is checked. Causal, dtype, zero strides on size-1 dimensions and the bias dtype (q's or fp32)
// rotate over the pairs; a second suite runs every bias shape in fp32 with and without causal.
//
// Sizes: B = 2, H = 6, Hk = 2 (groups of 3), Sq = 136 and Sk = 132, so that query rows and keys
// both span more than one 128-wide tile and end in partial tiles; mask, bias and dbias rows have
// odd strides.
#include <string>
#include <vector>

#include "backward_harness.h"

namespace flash_dmattn::test {
namespace {

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

const Sizes kBroadcastSizes{2, 136, 132, 6, 2, 64};

struct BroadcastCombo {
  int mask = -1;  // operand shape index; -1: no mask
  int bias = -1;  // -1: no bias
  bool causal = false;
  bool fp16 = false;      // q's dtype fp16 instead of bf16
  bool fp32_bias = false;
  bool expanded = false;  // size-1 dimensions read through stride 0 instead of their natural stride
};

// Every (mask, bias) pair, mask-major. The pair's position k rotates the other choices: causal on
// odd k, expanded on k / 2 odd, fp16 on k / 4 odd, fp32 bias on k / 8 odd. 25 is odd, so each
// mask shape meets both settings of each choice across the bias shapes and vice versa.
std::vector<BroadcastCombo> broadcast_combos() {
  std::vector<BroadcastCombo> combos;
  for (int m = -1; m < kOperandShapes; ++m)
    for (int b = -1; b < kOperandShapes; ++b) {
      const int k = static_cast<int>(combos.size());
      combos.push_back({m, b, k % 2 == 1, k / 4 % 2 == 1, b >= 0 && k / 8 % 2 == 1, k / 2 % 2 == 1});
    }
  return combos;
}

class BackwardBroadcast : public GpuParamTest<BroadcastCombo> {};

TEST_P(BackwardBroadcast, MatchesReference) {
  auto rng = test_rng();
  const BroadcastCombo combo = GetParam();
  BackwardCase c;
  c.n = kBroadcastSizes;
  c.dtype = combo.fp16 ? DType::float16 : DType::bfloat16;
  if (combo.mask >= 0) c.mask = operand_shape_at(combo.mask, c.n);
  if (combo.bias >= 0) c.bias = operand_shape_at(combo.bias, c.n);
  if (combo.fp32_bias) c.bias_dtype = DType::float32;
  c.causal = combo.causal;
  // Sk = 132: with these pads every key-row stride is odd (133, 135 and 137; 1, 3 and 5 for a key
  // dim of 1).
  c.layout.mask_row_pad = 1;
  c.layout.bias_row_pad = 3;
  c.gradients.dbias_row_pad = 5;
  c.layout.zero_broadcast_strides = combo.expanded;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

std::string broadcast_name(const ::testing::TestParamInfo<BroadcastCombo>& test) {
  const BroadcastCombo& c = test.param;
  std::string name = "mask_" + (c.mask >= 0 ? operand_name(c.mask, kBroadcastSizes) : std::string("none"));
  name += "_bias_" + (c.bias >= 0 ? operand_name(c.bias, kBroadcastSizes) + (c.fp32_bias ? "_f32" : "")
                                  : std::string("none"));
  return name + (c.fp16 ? "_fp16" : "_bf16") + (c.causal ? "_causal" : "") + (c.expanded ? "_expanded" : "");
}

INSTANTIATE_TEST_SUITE_P(Backward, BackwardBroadcast, ::testing::ValuesIn(broadcast_combos()), broadcast_name);

// ---- every bias shape as fp32, mask (B, H, Sq, Sk), non-causal and causal ----

// q's dtype alternates in a pattern that no single dimension of the bias shape follows.
bool fp16_q(int bias_shape) { return bias_shape / 3 % 2 == 1; }

class BackwardFp32Bias : public GpuParamTest<int> {};

TEST_P(BackwardFp32Bias, MatchesReference) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = kBroadcastSizes;
  c.dtype = fp16_q(GetParam()) ? DType::float16 : DType::bfloat16;
  c.mask = OperandShape{true, c.n.H, true, true};
  c.density = 0.6;
  c.bias = operand_shape_at(GetParam(), c.n);
  c.bias_dtype = DType::float32;
  c.layout.bias_row_pad = 1;
  c.gradients.dbias_row_pad = 2;
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

std::string fp32_bias_name(const ::testing::TestParamInfo<int>& test) {
  return "bias_" + operand_name(test.param, kBroadcastSizes) + (fp16_q(test.param) ? "_fp16" : "_bf16");
}

INSTANTIATE_TEST_SUITE_P(Backward, BackwardFp32Bias, ::testing::Range(0, kOperandShapes), fp32_bias_name);

}  // namespace
}  // namespace flash_dmattn::test
