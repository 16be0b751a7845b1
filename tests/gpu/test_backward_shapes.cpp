// GPU backward against the reference over the shape space: every head dim (the odd buckets 40
// and 80 included) in fp16 and bf16; GQA ratios 1, 2, 4, 8 and MQA with mask heads 1, Hk and H;
// causal with Sq < Sk, Sq = Sk and Sq > Sk, softcap off and on; and sequence lengths from 1 to
// 1000 both ways (and 4095 once), with mask, bias and dbias at odd strides. Every case asks for
// dbias and checks dq, dk, dv and dbias.
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "backward_harness.h"

namespace flash_dmattn::test {
namespace {

std::string dtype_tag(DType dtype) { return dtype == DType::float16 ? "fp16" : "bf16"; }

// ---- head dims × dtypes: mask (B, Hk, Sq, Sk) + bias (B, Hk, 1, Sk), causal ----

using HeadDimParam = std::tuple<int, DType>;

class BackwardHeadDims : public GpuParamTest<HeadDimParam> {};

TEST_P(BackwardHeadDims, MaskedBiasedCausalMatchesReference) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{2, 113, 203, 4, 2, std::get<0>(GetParam())};
  c.dtype = std::get<1>(GetParam());
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

std::string head_dim_name(const ::testing::TestParamInfo<HeadDimParam>& test) {
  return "D" + std::to_string(std::get<0>(test.param)) + "_" + dtype_tag(std::get<1>(test.param));
}

INSTANTIATE_TEST_SUITE_P(Backward, BackwardHeadDims,
                         ::testing::Combine(::testing::Values(32, 40, 64, 80, 96, 128, 192, 256),
                                            ::testing::Values(DType::float16, DType::bfloat16)),
                         head_dim_name);

// ---- GQA: ratios 1, 2, 4, 8 and MQA, mask heads 1, Hk, H ----

struct HeadPair {
  int H, Hk;
};

using GqaParam = std::tuple<HeadPair, int>;  // heads, mask heads (0: 1, 1: Hk, 2: H)

class BackwardGqa : public GpuParamTest<GqaParam> {};

TEST_P(BackwardGqa, MatchesReference) {
  auto rng = test_rng();
  const HeadPair heads = std::get<0>(GetParam());
  const int mask_heads = std::get<1>(GetParam());
  BackwardCase c;
  c.n = Sizes{2, 97, 150, heads.H, heads.Hk, 64};
  c.dtype = DType::float16;
  const std::int64_t counts[3] = {1, c.n.Hk, c.n.H};
  c.mask = OperandShape{true, counts[mask_heads], true, true};
  // The bias takes the head count the mask does not, so both operands see every head mapping;
  // dbias then sums over the query heads that share a bias head. Its row dimension alternates.
  c.bias = OperandShape{true, counts[(mask_heads + 2) % 3], mask_heads != 1, true};
  c.causal = true;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

std::string gqa_name(const ::testing::TestParamInfo<GqaParam>& test) {
  const HeadPair heads = std::get<0>(test.param);
  const char* mask_heads[3] = {"1", "Hk", "H"};
  return "H" + std::to_string(heads.H) + "_Hk" + std::to_string(heads.Hk) + "_maskheads_" +
         mask_heads[std::get<1>(test.param)];
}

// Ratios 1, 2, 4 and 8, and MQA (Hk = 1) with groups of 8 and of 12.
INSTANTIATE_TEST_SUITE_P(Backward, BackwardGqa,
                         ::testing::Combine(::testing::Values(HeadPair{8, 8}, HeadPair{8, 4}, HeadPair{8, 2},
                                                              HeadPair{16, 2}, HeadPair{8, 1}, HeadPair{12, 1}),
                                            ::testing::Values(0, 1, 2)),
                         gqa_name);

// Small grids (under two waves of key-tile CTAs) share each KV head's query heads out among CTAs
// (head splits, plan_backward in src/cuda/cuda_backend.cpp), which every case above is. A grid
// of 17 key tiles x 4 KV heads x 4 batches (272 CTAs, two waves of a 132-SM device's single CTA
// per SM) keeps the whole group in one CTA instead, with dBias per key written directly.
class BackwardGqaWideGrid : public GpuTest {};

TEST_F(BackwardGqaWideGrid, MatchesReference) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{4, 40, 17 * 128, 8, 4, 64};
  c.dtype = DType::float16;
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

// ---- the gather backward's paired heads ----
// Where two query heads of a KV head read one mask head, bias head and dbias accumulator, the
// gather backward stacks both heads' rows in one tile (gather_backward_pairs in
// src/cuda/cuda_backend.cpp), whose dK and dV sum them in the MMA, at the head dims that
// take it (D128; D64 and D32 run one head per CTA, as controls). Groups of 2, 4 and 8 (one, two and
// four pairs per KV head, whose CTAs add to the same dK and dV rows), mask heads 1 and
// Hk, bias (B, Hk, 1, Sk)
// (dbias per key, summed over rows), (1, 1, Sq, Sk) (dbias per element, summed over heads) or
// none; softcap on the odd cases. Odd lengths, so that the last query tile holds rows past Sq.
using PairedParam = std::tuple<int, int, int, int>;  // head dim, group, mask heads (0: 1, 1: Hk), bias

class BackwardPairedHeads : public GpuParamTest<PairedParam> {};

TEST_P(BackwardPairedHeads, MatchesReference) {
  auto rng = test_rng();
  const auto [head_dim, group, mask_heads, bias] = GetParam();
  BackwardCase c;
  c.n = Sizes{2, 97, 150, 2 * group, 2, head_dim};
  c.dtype = DType::bfloat16;
  c.mask = OperandShape{true, mask_heads == 0 ? 1 : c.n.Hk, true, true};
  c.density = 0.3;
  if (bias == 1) c.bias = OperandShape{true, c.n.Hk, false, true};
  if (bias == 2) c.bias = OperandShape{false, 1, true, true};
  c.causal = true;
  if ((group + mask_heads + bias) % 2 == 1) {
    c.softcap = 5.0;
    c.scale = 1.0;
  }
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

std::string paired_name(const ::testing::TestParamInfo<PairedParam>& test) {
  const auto [head_dim, group, mask_heads, bias] = test.param;
  const char* biases[3] = {"none", "BHk1Sk", "11SqSk"};
  return "D" + std::to_string(head_dim) + "_G" + std::to_string(group) + "_maskheads_" + (mask_heads == 0 ? "1" : "Hk") +
         "_bias_" + biases[bias];
}

INSTANTIATE_TEST_SUITE_P(Backward, BackwardPairedHeads,
                         ::testing::Combine(::testing::Values(32, 64, 128), ::testing::Values(2, 4, 8),
                                            ::testing::Values(0, 1), ::testing::Values(0, 1, 2)),
                         paired_name);

// ---- causal alignment with Sq < Sk, Sq = Sk, Sq > Sk; softcap off and on ----

using CausalParam = std::tuple<std::tuple<int, int>, double>;  // (Sq, Sk), softcap

class BackwardCausal : public GpuParamTest<CausalParam> {};

TEST_P(BackwardCausal, MatchesReference) {
  auto rng = test_rng();
  const std::tuple<int, int> lengths = std::get<0>(GetParam());
  const double softcap = std::get<1>(GetParam());
  BackwardCase c;
  c.n = Sizes{2, std::get<0>(lengths), std::get<1>(lengths), 4, 2, 128};
  c.dtype = softcap > 0 ? DType::float16 : DType::bfloat16;
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 0.7;
  c.bias = OperandShape{true, c.n.H, true, true};
  c.causal = true;
  c.softcap = softcap;
  // Scale 1 puts the logits (std ≈ 3.8 at D = 128) where a cap of 5 bends them: the softcap's
  // factor 1 - tanh² ranges over (0, 1].
  c.scale = 1.0;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

std::string causal_name(const ::testing::TestParamInfo<CausalParam>& test) {
  const std::tuple<int, int> lengths = std::get<0>(test.param);
  return "Sq" + std::to_string(std::get<0>(lengths)) + "_Sk" + std::to_string(std::get<1>(lengths)) +
         (std::get<1>(test.param) > 0 ? "_softcap" : "_nocap");
}

INSTANTIATE_TEST_SUITE_P(Backward, BackwardCausal,
                         ::testing::Combine(::testing::Values(std::make_tuple(77, 250), std::make_tuple(160, 160),
                                                              std::make_tuple(250, 77)),
                                            ::testing::Values(0.0, 5.0)),
                         causal_name);

// Softcap without causal, with GQA, a per-key bias (dbias summed over rows and heads) and the
// library's default scale.
class BackwardSoftcap : public GpuTest {};

TEST_F(BackwardSoftcap, NonCausalGqaWithDefaultScale) {
  auto rng = test_rng();
  for (const DType dtype : {DType::bfloat16, DType::float16}) {
    SCOPED_TRACE(dtype_name(dtype));
    BackwardCase c;
    c.n = Sizes{2, 140, 230, 8, 2, 64};
    c.dtype = dtype;
    c.mask = OperandShape{true, 1, true, true};
    c.bias = OperandShape{true, c.n.Hk, false, true};
    c.softcap = 0.5;  // logits of std ≈ 0.33 at the default scale, up to about 1.3: the cap bends them
    expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

// ---- lengths 1 ... 1000 for Sq and Sk, and 4095 once ----

struct LengthCase {
  int sq, sk;
  bool causal;
  int head_dim;
};

// (L, L) non-causal in bf16; (L, 2L+3) and (2L+3, L) causal in fp16; then (4095, 4095) causal;
// D128 but for that one (D64) and three lengths at D32.
std::vector<LengthCase> length_cases() {
  std::vector<LengthCase> cases;
  for (const int l : {1, 17, 63, 65, 127, 128, 129, 1000}) {
    cases.push_back({l, l, false, 128});
    cases.push_back({l, 2 * l + 3, true, 128});
    cases.push_back({2 * l + 3, l, true, 128});
  }
  cases.push_back({4095, 4095, true, 64});
  // D32 (the sm90a key-tile backward's 128-key tiles, as at D64) around and past its tiles.
  for (const int l : {17, 129, 1000}) {
    cases.push_back({l, l, false, 32});
    cases.push_back({l, 2 * l + 3, true, 32});
    cases.push_back({2 * l + 3, l, true, 32});
  }
  return cases;
}

// Short sequences get more batches and heads: a problem of a handful of rows and keys leaves too
// few independent errors for the max-error comparison to be stable. The long ones stay small in
// B·H to bound the host's reference work.
Sizes length_sizes(const LengthCase& length) {
  const int longest = std::max(length.sq, length.sk);
  if (longest < 64) return Sizes{4, length.sq, length.sk, 8, 2, length.head_dim};
  if (longest < 1000) return Sizes{2, length.sq, length.sk, 4, 2, length.head_dim};
  return Sizes{1, length.sq, length.sk, longest < 4000 ? 2 : 1, 1, length.head_dim};
}

class BackwardLengths : public GpuParamTest<LengthCase> {};

TEST_P(BackwardLengths, MatchReference) {
  auto rng = test_rng();
  const LengthCase length = GetParam();
  BackwardCase c;
  c.n = length_sizes(length);
  c.dtype = length.causal ? DType::float16 : DType::bfloat16;
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = length.causal;
  // Odd row strides (Sk + pad odd) leave the mask, bias and dbias rows without any alignment.
  c.layout.mask_row_pad = 1 + length.sk % 2;
  c.layout.bias_row_pad = 3 + length.sk % 2;
  c.gradients.dbias_row_pad = 5 + length.sk % 2;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

std::string length_name(const ::testing::TestParamInfo<LengthCase>& test) {
  return "Sq" + std::to_string(test.param.sq) + "_Sk" + std::to_string(test.param.sk) +
         (test.param.causal ? "_causal" : "_full") + (test.param.head_dim == 32 ? "_D32" : "");
}

INSTANTIATE_TEST_SUITE_P(Backward, BackwardLengths, ::testing::ValuesIn(length_cases()), length_name);

}  // namespace
}  // namespace flash_dmattn::test
