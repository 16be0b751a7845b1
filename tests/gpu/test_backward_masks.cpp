// GPU backward on the masks and biases that exercise tile skipping and empty rows: very sparse
// masks (most tiles empty), rows with exactly one visible key or none, whole 128x64 and 128x128
// tiles empty, key ranges that no row sees, masks all False and all True; -inf in the bias at
// visible keys and over whole rows, bias values at hidden positions that must never be read (NaN,
// +inf), and a large finite negative bias that must not hide keys. The harness checks the exact
// zeros every time: dq of empty rows, dk and dv of keys nobody sees, dbias nobody reads.
#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "backward_harness.h"
#include "mask_bias_edits.h"

namespace flash_dmattn::test {
namespace {

class BackwardSparseMasks : public GpuTest {};

TEST_F(BackwardSparseMasks, DensityTwoPerThousandLeavesMostTilesAndManyRowsEmpty) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{2, 300, 517, 4, 2, 64};
  c.mask = OperandShape{true, c.n.H, true, true};
  c.density = 0.002;  // about one key per row: a third of the rows see none, most keys are seen by no row
  c.bias = OperandShape{true, c.n.Hk, false, true};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

TEST_F(BackwardSparseMasks, RowsWithExactlyOneVisibleKeyOrNone) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{2, 200, 333, 4, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 0.0;
  c.bias = OperandShape{true, c.n.H, true, true};
  BackwardProblem p = BackwardProblem::random(c, rng);
  // Rows i % 4 == 0 stay empty; rows 1 and 2 keep one key, so their P is 1 there and their dZ,
  // dq and dbias are 0 in exact arithmetic (a kernel gets fp32 rounding noise: Δ = <dO, O> and dP
  // are summed in different orders); rows 3 see half of the keys, as ordinary rows whose
  // same-precision error sets the scale of the tolerance.
  std::uniform_int_distribution<std::int64_t> key(0, c.n.Sk - 1);
  std::bernoulli_distribution half(0.5);
  for (std::int64_t b = 0; b < c.n.B; ++b)
    for (std::int64_t h = 0; h < c.n.Hk; ++h)
      for (std::int64_t i = 0; i < c.n.Sq; ++i) {
        if (i % 4 == 1 || i % 4 == 2) p.mask->set(host::offset4(p.mask->view, b, h, i, key(rng)), 1.0);
        if (i % 4 != 3) continue;
        for (std::int64_t j = 0; j < c.n.Sk; ++j) p.mask->set(host::offset4(p.mask->view, b, h, i, j), half(rng));
      }
  expect_backward_matches_reference(p, stream());
}

TEST_F(BackwardSparseMasks, WholeTilesEmpty) {
  auto rng = test_rng();
  // Sq and Sk are not tile multiples, so partial tail tiles are emptied too.
  for (const std::int64_t head_dim : {64, 128}) {
    BackwardCase c;
    c.n = Sizes{2, 390, 450, 4, 2, head_dim};
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.density = 0.6;
    c.bias = OperandShape{true, c.n.Hk, false, true};
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(std::string("D=") + std::to_string(head_dim) + (causal ? ", causal" : ", non-causal"));
      c.causal = causal;
      BackwardProblem p = BackwardProblem::random(c, rng);
      empty_tiles_in_a_checkerboard(p);
      expect_backward_matches_reference(p, stream());
      if (test_stopped()) return;
    }
  }
}

TEST_F(BackwardSparseMasks, KeyRangesThatNoRowSees) {
  auto rng = test_rng();
  // A per-KV-head key selection (B, Hk, 1, Sk) that drops whole 64- and 128-key ranges for every
  // row, and a few single keys: their dk, dv and dbias must stay exactly 0.
  BackwardCase c;
  c.n = Sizes{2, 260, 600, 8, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, false, true};
  c.density = 1.0;
  c.bias = OperandShape{true, c.n.Hk, false, true};
  BackwardProblem p = BackwardProblem::random(c, rng);
  for_each_index(*p.mask, [&](std::int64_t, std::int64_t h, std::int64_t, std::int64_t j, std::int64_t offset) {
    const bool dropped = (j >= 64 && j < 192 + 64 * h) || (j >= 448 && j < 512) || j % 37 == 5;
    if (dropped) p.mask->set(offset, 0.0);
  });
  expect_backward_matches_reference(p, stream());
}

TEST_F(BackwardSparseMasks, AllFalseGivesZeroGradientsEverywhere) {
  auto rng = test_rng();
  for (const bool broadcast : {false, true}) {
    SCOPED_TRACE(broadcast ? "mask (1, 1, 1, 1)" : "mask (B, H, Sq, Sk)");
    BackwardCase c;
    c.n = Sizes{2, 130, 260, 4, 2, 64};
    c.mask = broadcast ? OperandShape{false, 1, false, false} : OperandShape{true, c.n.H, true, true};
    c.density = 0.0;
    c.bias = OperandShape{true, c.n.Hk, false, true};
    const BackwardProblem p = BackwardProblem::random(c, rng);
    GpuBackward gpu(p, stream());
    gpu.prepare();
    if (test_stopped()) return;
    const Status status = gpu.run();
    ASSERT_TRUE(status.ok()) << status.message();
    const GpuGradients g = gpu.finish();
    for (const double x : g.dq.values()) ASSERT_EQ(x, 0.0);
    for (const double x : g.dk.values()) ASSERT_EQ(x, 0.0);
    for (const double x : g.dv.values()) ASSERT_EQ(x, 0.0);
    for (const double x : g.dbias->values()) ASSERT_EQ(x, 0.0);
    expect_gradients_match_reference(p, g);
  }
}

TEST_F(BackwardSparseMasks, AllTrueMakesEveryTileFull) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{2, 257, 385, 4, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.density = 1.0;
  c.bias = OperandShape{true, c.n.Hk, false, true};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

TEST_F(BackwardSparseMasks, NoMaskNoBias) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{2, 200, 300, 4, 2, 128};
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    c.causal = causal;
    expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

class BackwardBiasEdges : public GpuTest {};

TEST_F(BackwardBiasEdges, NegativeInfinityAtSomeVisibleKeys) {
  auto rng = test_rng();
  for (const DType bias_dtype : {DType::bfloat16, DType::float32}) {
    SCOPED_TRACE(dtype_name(bias_dtype));
    BackwardProblem p = BackwardProblem::random(full_mask_and_bias<BackwardCase>(bias_dtype, 0.7), rng);
    negative_infinity_at_random(p, rng);
    expect_backward_matches_reference(p, stream());
    if (test_stopped()) return;
  }
}

TEST_F(BackwardBiasEdges, NegativeInfinityInASharedBias) {
  auto rng = test_rng();
  // A per-KV-head key bias (B, Hk, 1, Sk) with -inf at some keys: those keys are dead for every
  // row of the group, so their dk, dv and dbias are exactly 0.
  BackwardCase c;
  c.n = Sizes{2, 180, 270, 4, 2, 64};
  c.mask = OperandShape{true, c.n.H, true, true};
  c.density = 0.8;
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  BackwardProblem p = BackwardProblem::random(c, rng);
  for_each_index(*p.bias, [&](std::int64_t, std::int64_t, std::int64_t, std::int64_t j, std::int64_t offset) {
    if (j % 7 == 3 || (j >= 128 && j < 192)) p.bias->set(offset, -kInfinity);
  });
  expect_backward_matches_reference(p, stream());
}

TEST_F(BackwardBiasEdges, RowsWhoseVisibleLogitsAreAllNegativeInfinityAreEmpty) {
  auto rng = test_rng();
  BackwardProblem p = BackwardProblem::random(full_mask_and_bias<BackwardCase>(DType::float32, 0.6), rng);
  empty_rows_through_negative_infinity(p);
  expect_backward_matches_reference(p, stream());
}

TEST_F(BackwardBiasEdges, BiasAtHiddenPositionsIsNeverRead) {
  auto rng = test_rng();
  BackwardCase c = full_mask_and_bias<BackwardCase>(DType::bfloat16, 0.5);
  c.causal = true;
  BackwardProblem p = BackwardProblem::random(c, rng);
  garbage_at_hidden_positions(p);
  expect_backward_matches_reference(p, stream());
}

TEST_F(BackwardBiasEdges, LargeFiniteNegativeBiasDoesNotHideKeys) {
  auto rng = test_rng();
  BackwardProblem p = BackwardProblem::random(full_mask_and_bias<BackwardCase>(DType::float32, 0.6), rng);
  large_negative_bias_rows(p);
  expect_backward_matches_reference(p, stream());
}

}  // namespace
}  // namespace flash_dmattn::test
