// GPU forward on the masks and biases that exercise tile skipping and empty rows: very sparse
// masks (most tiles empty), rows with exactly one visible key or none, whole 128x64 and 128x128
// tiles empty, masks all False and all True; -inf in the bias at visible keys and over whole
// rows, bias values at hidden positions that must never be read (NaN, +inf), and a large finite
// negative bias that must not hide keys; the gather path over more query tiles than SMs.
#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "forward_harness.h"
#include "mask_bias_edits.h"

namespace flash_dmattn::test {
namespace {

class SparseMasks : public GpuTest {};

TEST_F(SparseMasks, DensityTwoPerThousandLeavesMostTilesAndManyRowsEmpty) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{2, 300, 517, 4, 2, 64};
  c.mask = OperandShape{true, c.n.H, true, true};
  c.density = 0.002;  // about one key per row: a third of the rows see none
  c.bias = OperandShape{true, c.n.Hk, false, true};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

TEST_F(SparseMasks, RowsWithExactlyOneVisibleKeyOrNone) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{2, 200, 333, 4, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 0.0;
  c.bias = OperandShape{true, c.n.H, true, true};
  ForwardProblem p = ForwardProblem::random(c, rng);
  // Every fourth row stays empty; the others keep one key, so their output is that key's v row.
  std::uniform_int_distribution<std::int64_t> key(0, c.n.Sk - 1);
  for (std::int64_t b = 0; b < c.n.B; ++b)
    for (std::int64_t h = 0; h < c.n.Hk; ++h)
      for (std::int64_t i = 0; i < c.n.Sq; ++i)
        if (i % 4 != 0) p.mask->set(host::offset4(p.mask->view, b, h, i, key(rng)), 1.0);
  expect_forward_matches_reference(p, stream());
}

TEST_F(SparseMasks, WholeTilesEmpty) {
  auto rng = test_rng();
  // D = 64 runs 128x128 tiles, D = 128 runs 128x64 ones (src/kernels/sm80/fwd_traits.h); Sq and
  // Sk are not tile multiples, so partial tail tiles are emptied too.
  for (const std::int64_t head_dim : {64, 128}) {
    ForwardCase c;
    c.n = Sizes{2, 390, 450, 4, 2, head_dim};
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.density = 0.6;
    c.bias = OperandShape{true, c.n.Hk, false, true};
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(std::string("D=") + std::to_string(head_dim) + (causal ? ", causal" : ", non-causal"));
      c.causal = causal;
      ForwardProblem p = ForwardProblem::random(c, rng);
      empty_tiles_in_a_checkerboard(p);
      expect_forward_matches_reference(p, stream());
      if (test_stopped()) return;
    }
  }
}

TEST_F(SparseMasks, AllFalseGivesZeroOutputAndInfiniteLseEverywhere) {
  auto rng = test_rng();
  for (const bool broadcast : {false, true}) {
    SCOPED_TRACE(broadcast ? "mask (1, 1, 1, 1)" : "mask (B, H, Sq, Sk)");
    ForwardCase c;
    c.n = Sizes{2, 130, 260, 4, 2, 64};
    c.mask = broadcast ? OperandShape{false, 1, false, false} : OperandShape{true, c.n.H, true, true};
    c.density = 0.0;
    c.bias = OperandShape{true, c.n.Hk, false, true};
    const ForwardProblem p = ForwardProblem::random(c, rng);
    GpuForward gpu(p, stream());
    gpu.prepare();
    if (test_stopped()) return;
    const Status status = gpu.run();
    ASSERT_TRUE(status.ok()) << status.message();
    const GpuOutputs outputs = gpu.finish();
    for (const double x : outputs.out.values()) ASSERT_EQ(x, 0.0);
    for (const double x : outputs.lse.values()) ASSERT_EQ(x, kInfinity);
    expect_outputs_match_reference(p, outputs);
  }
}

// The gather path over more query tiles than any GPU has SMs (4 x 9 x 8 of 128 rows, and as many
// of two paired heads): a persistent sm90a forward would carry its pipelines and the list staging
// from tile to tile here. Three operand forms: a mask per KV head with a bias row (paired heads,
// the row staged), with a bias per KV head and query row (paired heads, read per element), and
// both per query head (one head per CTA).
TEST_F(SparseMasks, GatherPathWithSeveralQueryTilesPerCta) {
  auto rng = test_rng();
  const ScopedEnv gather("FLASH_DMATTN_SPARSE_PATH", "gather");
  ForwardCase c;
  c.n = Sizes{4, 1100, 700, 8, 2, 64};
  c.density = 0.3;
  const char* names[3] = {"mask per KV head, bias row", "mask and bias per KV head", "mask and bias per query head"};
  for (const int form : {0, 1, 2}) {
    const std::int64_t heads = form == 2 ? c.n.H : c.n.Hk;
    c.mask = OperandShape{true, heads, true, true};
    c.bias = OperandShape{true, heads, form != 0, true};
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(std::string(names[form]) + (causal ? ", causal" : ""));
      c.causal = causal;
      expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
      if (test_stopped()) return;
    }
  }
}

TEST_F(SparseMasks, AllTrueMakesEveryTileFull) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{2, 257, 385, 4, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 1.0;
  c.bias = OperandShape{true, c.n.Hk, false, true};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

class BiasEdges : public GpuTest {};

TEST_F(BiasEdges, NegativeInfinityAtSomeVisibleKeys) {
  auto rng = test_rng();
  for (const DType bias_dtype : {DType::bfloat16, DType::float32}) {
    SCOPED_TRACE(dtype_name(bias_dtype));
    ForwardProblem p = ForwardProblem::random(full_mask_and_bias<ForwardCase>(bias_dtype, 0.7), rng);
    negative_infinity_at_random(p, rng);
    expect_forward_matches_reference(p, stream());
    if (test_stopped()) return;
  }
}

TEST_F(BiasEdges, RowsWhoseVisibleLogitsAreAllNegativeInfinityAreEmpty) {
  auto rng = test_rng();
  ForwardProblem p = ForwardProblem::random(full_mask_and_bias<ForwardCase>(DType::float32, 0.6), rng);
  empty_rows_through_negative_infinity(p);
  expect_forward_matches_reference(p, stream());
}

TEST_F(BiasEdges, BiasAtHiddenPositionsIsNeverRead) {
  auto rng = test_rng();
  ForwardCase c = full_mask_and_bias<ForwardCase>(DType::bfloat16, 0.5);
  c.causal = true;
  ForwardProblem p = ForwardProblem::random(c, rng);
  garbage_at_hidden_positions(p);
  expect_forward_matches_reference(p, stream());
}

TEST_F(BiasEdges, LargeFiniteNegativeBiasDoesNotHideKeys) {
  auto rng = test_rng();
  ForwardProblem p = ForwardProblem::random(full_mask_and_bias<ForwardCase>(DType::float32, 0.6), rng);
  large_negative_bias_rows(p);
  expect_forward_matches_reference(p, stream());
}

}  // namespace
}  // namespace flash_dmattn::test
