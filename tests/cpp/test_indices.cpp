// Key lists (ForwardArgs::indices, BackwardArgs::indices) through the public API on CPU tensors:
// the same results, byte for byte, as the bool mask they stand for (docs/semantics.md §2), with
// -1 padding, duplicates, every broadcast of the rows, and a mask beside them; and named errors.
#include "reference_problem.h"

namespace flash_dmattn::test {
namespace {

struct Outputs {
  HostTensor out, lse, dq, dk, dv, dbias;
};

// Forward and backward of `p` (bf16, causal per `p.causal`) with the given mask and key lists.
Outputs run(const RefProblem& p, const HostTensor* mask, const HostTensor* indices) {
  const Sizes& n = p.n;
  Outputs o{HostTensor::empty(DType::bfloat16, {n.B, n.Sq, n.H, n.D}), HostTensor::empty(DType::float32, {n.B, n.H, n.Sq}),
            HostTensor::empty(DType::bfloat16, {n.B, n.Sq, n.H, n.D}), HostTensor::empty(DType::bfloat16, {n.B, n.Sk, n.Hk, n.D}),
            HostTensor::empty(DType::bfloat16, {n.B, n.Sk, n.Hk, n.D}),
            HostTensor::empty(DType::bfloat16, Shape(p.bias->view.shape, p.bias->view.shape + 4))};
  ForwardArgs f;
  f.q = p.q.view;
  f.k = p.k.view;
  f.v = p.v.view;
  if (mask) f.mask = mask->view;
  if (indices) f.indices = indices->view;
  f.bias = p.bias->view;
  f.out = o.out.view;
  f.lse = o.lse.view;
  f.options.causal = p.causal;
  EXPECT_TRUE(forward(f).ok());
  BackwardArgs b;
  b.q = p.q.view;
  b.k = p.k.view;
  b.v = p.v.view;
  b.mask = f.mask;
  b.indices = f.indices;
  b.bias = p.bias->view;
  b.out = o.out.view;
  b.lse = o.lse.view;
  b.dout = p.dout.view;
  b.dq = o.dq.view;
  b.dk = o.dk.view;
  b.dv = o.dv.view;
  b.dbias = o.dbias.view;
  b.options.causal = p.causal;
  const Status status = backward(b);
  EXPECT_TRUE(status.ok()) << status.message();
  return o;
}

void expect_same_bytes(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(a.out.bytes == b.out.bytes) << "out";
  EXPECT_TRUE(a.lse.bytes == b.lse.bytes) << "lse";
  EXPECT_TRUE(a.dq.bytes == b.dq.bytes) << "dq";
  EXPECT_TRUE(a.dk.bytes == b.dk.bytes) << "dk";
  EXPECT_TRUE(a.dv.bytes == b.dv.bytes) << "dv";
  EXPECT_TRUE(a.dbias.bytes == b.dbias.bytes) << "dbias";
}

RefProblem bf16_problem(std::mt19937_64& rng, bool causal) {
  RefProblem p = RefProblem::random(Sizes{2, 9, 13, 4, 2, 16}, rng, std::nullopt,
                                    OperandShape{true, 2, false, true}, 0.7, DType::bfloat16);
  p.causal = causal;
  return p;
}

TEST(KeyLists, MatchTheMaskTheyStandFor) {
  auto rng = test_rng();
  for (const bool causal : {false, true}) {
    const RefProblem p = bf16_problem(rng, causal);
    for (const Shape& rows : {Shape{2, 4, 9}, Shape{1, 2, 9}, Shape{2, 1, 1}}) {
      for (const std::int64_t keep : {std::int64_t(5), std::int64_t(0)}) {
        SCOPED_TRACE(::testing::Message() << "causal " << causal << ", rows " << rows[0] << "x" << rows[1] << "x"
                                          << rows[2] << ", keep " << keep);
        const RandomKeyLists lists(rows, 13, keep, rng);
        expect_same_bytes(run(p, &lists.mask, nullptr), run(p, nullptr, &lists.indices));
      }
    }
  }
}

TEST(KeyLists, WithAMaskKeepWhatBothKeep) {
  auto rng = test_rng();
  const RefProblem p = bf16_problem(rng, true);
  const RandomKeyLists lists(Shape{2, 4, 9}, 13, 6, rng);
  const HostTensor mask = HostTensor::random(DType::boolean, {2, 2, 9, 13}, rng, 0.6);  // per KV head
  HostTensor both = HostTensor::empty(DType::boolean, {2, 4, 9, 13});
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t i = 0; i < 9; ++i)
        for (std::int64_t j = 0; j < 13; ++j) {
          const double keep = mask.get(host::offset4(mask.view, b, h / 2, i, j)) *
                              lists.mask.get(host::offset4(lists.mask.view, b, h, i, j));
          both.set(host::offset4(both.view, b, h, i, j), keep);
        }
  expect_same_bytes(run(p, &both, nullptr), run(p, &mask, &lists.indices));
}

TEST(KeyLists, BadListsAreNamed) {
  auto rng = test_rng();
  const RefProblem p = bf16_problem(rng, false);
  auto forward_message = [&](const HostTensor& indices) {
    ForwardArgs f;
    f.q = p.q.view;
    f.k = p.k.view;
    f.v = p.v.view;
    f.indices = indices.view;
    const HostTensor out = HostTensor::empty(DType::bfloat16, {2, 9, 4, 16});
    const HostTensor lse = HostTensor::empty(DType::float32, {2, 4, 9});
    f.out = out.view;
    f.lse = lse.view;
    const Status status = forward(f);
    EXPECT_EQ(status.code(), StatusCode::invalid_argument);
    return status.message();
  };
  EXPECT_NE(forward_message(HostTensor::empty(DType::float32, {2, 4, 9, 3})).find(
                "argument 'indices': expected dtype int32 (key indices, -1 pads), got float32"),
            std::string::npos);
  EXPECT_NE(forward_message(HostTensor::empty(DType::int32, {2, 3, 9, 3})).find(
                "argument 'indices': expected heads (dim 1) in {1, Hk=2, H=4}, got 3"),
            std::string::npos);
  HostTensor out_of_range = HostTensor::empty(DType::int32, {1, 1, 1, 2});
  out_of_range.set(0, 4.0);
  out_of_range.set(1, 13.0);
  EXPECT_NE(forward_message(out_of_range).find(
                "flash_dmattn.forward: argument 'indices': expected key indices in [0, 13) or -1 (padding), got 13 at "
                "(0, 0, 0, 1)"),
            std::string::npos);
}

}  // namespace
}  // namespace flash_dmattn::test
