// Argument checks through the public API. Every rejected call differs from a valid one in exactly
// one thing, and the contract (docs/semantics.md §1) asks three things of it: the right status
// code, a message that names the argument with the expected and the actual value, and no write to
// any buffer, since validation runs before any work starts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <list>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "test_util.h"

namespace flash_dmattn::test {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// 0xFF bytes read as NaN in every floating dtype, so a poisoned output stays NaN until written.
constexpr unsigned char kPoison = 0xFF;
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

// The sizes of a valid call; a test changes one of them to make the call invalid.
struct Dims {
  std::int64_t batch = 2, seqlen_q = 5, seqlen_k = 7, heads = 4, kv_heads = 2, head_dim = 16;
  DType dtype = DType::bfloat16;

  Shape q() const { return {batch, seqlen_q, heads, head_dim}; }
  Shape kv() const { return {batch, seqlen_k, kv_heads, head_dim}; }
  Shape lse() const { return {batch, heads, seqlen_q}; }
  Shape mask() const { return {batch, kv_heads, 1, seqlen_k}; }
  Shape bias() const { return {1, heads, seqlen_q, seqlen_k}; }
};

std::vector<double> values_of(const TensorView& view) {
  HostTensor borrowed;  // only for its element walk; the memory stays the caller's
  borrowed.view = view;
  return borrowed.values();
}

bool has_nan(const TensorView& view) {
  const std::vector<double> values = values_of(view);
  return std::any_of(values.begin(), values.end(), [](double x) { return std::isnan(x); });
}

bool is_poisoned(const HostTensor& t) {
  return std::all_of(t.bytes.begin(), t.bytes.end(), [](unsigned char b) { return b == kPoison; });
}

class ValidationTest : public ::testing::Test {
 protected:
  // Fresh random contents; masks keep most keys so that valid calls compute something.
  TensorView input(DType dtype, const Shape& shape) {
    const double lo = dtype == DType::boolean ? 0.7 : -1.0;
    return inputs_.emplace_back(HostTensor::random(dtype, shape, rng_, lo)).view;
  }

  TensorView output(DType dtype, const Shape& shape) {
    HostTensor& t = outputs_.emplace_back(HostTensor::empty(dtype, shape));
    std::fill(t.bytes.begin(), t.bytes.end(), kPoison);
    return t.view;
  }

  ForwardArgs valid_forward(const Dims& d = {}) {
    ForwardArgs a = operands(d);
    a.out = output(d.dtype, d.q());
    a.lse = output(DType::float32, d.lse());
    return a;
  }

  // out and lse come from a real forward, as a caller's would.
  BackwardArgs valid_backward(const Dims& d = {}) {
    ForwardArgs f = operands(d);
    f.out = inputs_.emplace_back(HostTensor::empty(d.dtype, d.q())).view;
    f.lse = inputs_.emplace_back(HostTensor::empty(DType::float32, d.lse())).view;
    const Status status = flash_dmattn::forward(f);
    EXPECT_TRUE(status.ok()) << status.message();

    BackwardArgs a;
    a.q = f.q;
    a.k = f.k;
    a.v = f.v;
    a.mask = f.mask;
    a.bias = f.bias;
    a.out = f.out;
    a.lse = f.lse;
    a.dout = input(d.dtype, d.q());
    a.dq = output(d.dtype, d.q());
    a.dk = output(d.dtype, d.kv());
    a.dv = output(d.dtype, d.kv());
    a.dbias = output(d.dtype, d.bias());
    return a;
  }

  // Two views of `shape` into one buffer, the second one batch further on, so that they share a
  // batch. The buffer holds both, so a call that wrongly accepted them would stay in bounds.
  std::pair<TensorView, TensorView> overlapping(DType dtype, Shape shape, bool outputs) {
    const std::int64_t batch = shape[0];
    shape[0] = batch + 1;
    TensorView first = outputs ? output(dtype, shape) : input(dtype, shape);
    first.shape[0] = batch;
    TensorView second = first;
    second.data = static_cast<unsigned char*>(first.data) + first.stride[0] * dtype_size(dtype);
    return {first, second};
  }

  void expect_forward_rejected(const ForwardArgs& args, const std::vector<std::string>& parts,
                               StatusCode code = StatusCode::invalid_argument) {
    expect_rejected(args, "forward", &flash_dmattn::forward, &query_forward, &forward_workspace_size, code, parts);
  }

  void expect_backward_rejected(const BackwardArgs& args, const std::vector<std::string>& parts,
                                StatusCode code = StatusCode::invalid_argument) {
    expect_rejected(args, "backward", &flash_dmattn::backward, &query_backward, &backward_workspace_size, code,
                    parts);
  }

  void expect_forward_ok(const ForwardArgs& args) {
    const std::vector<std::vector<unsigned char>> before = input_bytes();
    const Status status = flash_dmattn::forward(args);
    ASSERT_TRUE(status.ok()) << status.message();
    EXPECT_FALSE(has_nan(args.out)) << "out not written";
    EXPECT_FALSE(has_nan(args.lse)) << "lse not written";
    EXPECT_TRUE(input_bytes() == before) << "the forward wrote to an input";
  }

 private:
  ForwardArgs operands(const Dims& d) {
    ForwardArgs a;
    a.q = input(d.dtype, d.q());
    a.k = input(d.dtype, d.kv());
    a.v = input(d.dtype, d.kv());
    a.mask = input(DType::boolean, d.mask());
    a.bias = input(d.dtype, d.bias());
    return a;
  }

  std::vector<std::vector<unsigned char>> input_bytes() const {
    std::vector<std::vector<unsigned char>> bytes;
    for (const HostTensor& t : inputs_) bytes.push_back(t.bytes);
    return bytes;
  }

  // The queries share the entry points' validation, so they must fail alike and report nothing.
  template <typename Args>
  void expect_rejected(const Args& args, const char* call, Status (*run)(const Args&),
                       Status (*query)(const Args&, Capability*), Status (*workspace_size)(const Args&, std::size_t*),
                       StatusCode code, const std::vector<std::string>& parts) {
    const std::vector<std::vector<unsigned char>> before = input_bytes();
    const Status status = run(args);
    EXPECT_EQ(status.code(), code) << "got " << status_code_name(status.code()) << ": " << status.message();
    EXPECT_THAT(status.message(), StartsWith(std::string("flash_dmattn.") + call + ": "));
    for (const std::string& part : parts) EXPECT_THAT(status.message(), HasSubstr(part));
    EXPECT_TRUE(input_bytes() == before) << "a rejected call wrote to an input";
    for (const HostTensor& t : outputs_) {
      EXPECT_TRUE(is_poisoned(t)) << "a rejected call wrote to an output of shape " << t.view.shape_string();
    }

    Capability capability;
    capability.description = "untouched";
    const Status queried = query(args, &capability);
    EXPECT_EQ(queried.code(), code);
    EXPECT_EQ(queried.message(), status.message());
    EXPECT_EQ(capability.description, "untouched");

    const std::size_t sentinel = 12345;
    std::size_t bytes = sentinel;
    const Status sized = workspace_size(args, &bytes);
    EXPECT_EQ(sized.code(), code);
    EXPECT_EQ(sized.message(), status.message());
    EXPECT_EQ(bytes, sentinel);
  }

  std::mt19937_64 rng_ = test_rng();
  // std::list: tests add tensors after taking views of earlier ones, which must stay valid.
  std::list<HostTensor> inputs_, outputs_;
};

// Valid calls: the baselines that every rejected call below differs from in one thing.

TEST_F(ValidationTest, ForwardAcceptsValidCall) {
  const ForwardArgs a = valid_forward();
  expect_forward_ok(a);

  Capability capability;
  const Status queried = query_forward(a, &capability);
  ASSERT_TRUE(queried.ok()) << queried.message();
  EXPECT_EQ(capability.backend, Backend::cpu_reference);
}

TEST_F(ValidationTest, BackwardAcceptsValidCall) {
  const BackwardArgs a = valid_backward();
  const Status status = flash_dmattn::backward(a);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_FALSE(has_nan(a.dq));
  EXPECT_FALSE(has_nan(a.dk));
  EXPECT_FALSE(has_nan(a.dv));
  EXPECT_FALSE(has_nan(*a.dbias));

  Capability capability;
  const Status queried = query_backward(a, &capability);
  ASSERT_TRUE(queried.ok()) << queried.message();
  EXPECT_EQ(capability.backend, Backend::cpu_reference);
}

// 1. Rank and shape.

TEST_F(ValidationTest, ForwardRejectsQWrongRank) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.q = input(d.dtype, {d.batch, d.seqlen_q, d.heads * d.head_dim});
  expect_forward_rejected(a, {"argument 'q'", "expected rank 4", "got rank 3", "(2, 5, 64)"});
}

TEST_F(ValidationTest, ForwardRejectsLseWrongRank) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.lse = output(DType::float32, {d.batch * d.heads, d.seqlen_q});
  expect_forward_rejected(a, {"argument 'lse'", "expected rank 3", "got rank 2", "(8, 5)"});
}

TEST_F(ValidationTest, ForwardRejectsKBatchDifferentFromQ) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.k = input(d.dtype, {3, d.seqlen_k, d.kv_heads, d.head_dim});
  expect_forward_rejected(a, {"argument 'k'", "expected shape (B=2, Sk, Hk, D=16)", "got (3, 7, 2, 16)"});
}

TEST_F(ValidationTest, ForwardRejectsVShapeDifferentFromK) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.v = input(d.dtype, {d.batch, 6, d.kv_heads, d.head_dim});
  expect_forward_rejected(a, {"argument 'v'", "expected shape (2, 7, 2, 16)", "got (2, 6, 2, 16)"});
}

TEST_F(ValidationTest, ForwardRejectsOutShapeDifferentFromQ) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.out = output(d.dtype, {d.batch, 4, d.heads, d.head_dim});
  expect_forward_rejected(a, {"argument 'out'", "expected shape (2, 5, 4, 16)", "got (2, 4, 4, 16)"});
}

TEST_F(ValidationTest, ForwardRejectsLseWrongShape) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.lse = output(DType::float32, {d.batch, d.seqlen_q, d.heads});
  expect_forward_rejected(a, {"argument 'lse'", "expected shape (2, 4, 5)", "got (2, 5, 4)"});
}

TEST_F(ValidationTest, BackwardRejectsDqWrongShape) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  a.dq = output(d.dtype, {d.batch, d.seqlen_q, d.kv_heads, d.head_dim});
  expect_backward_rejected(a, {"argument 'dq'", "expected shape (2, 5, 4, 16)", "got (2, 5, 2, 16)"});
}

TEST_F(ValidationTest, BackwardRejectsDkWrongShape) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  a.dk = output(d.dtype, {d.batch, d.seqlen_k, d.heads, d.head_dim});
  expect_backward_rejected(a, {"argument 'dk'", "expected shape (2, 7, 2, 16)", "got (2, 7, 4, 16)"});
}

TEST_F(ValidationTest, BackwardRejectsDvWrongShape) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  a.dv = output(d.dtype, {d.batch, d.seqlen_q, d.kv_heads, d.head_dim});
  expect_backward_rejected(a, {"argument 'dv'", "expected shape (2, 7, 2, 16)", "got (2, 5, 2, 16)"});
}

TEST_F(ValidationTest, BackwardRejectsDbiasShapeDifferentFromBias) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  a.dbias = output(d.dtype, {d.batch, d.heads, d.seqlen_q, d.seqlen_k});
  expect_backward_rejected(a, {"argument 'dbias'", "expected shape (1, 4, 5, 7)", "got (2, 4, 5, 7)"});
}

// 2. Dtypes.

TEST_F(ValidationTest, ForwardRejectsKDtypeDifferentFromQ) {
  Dims d;
  d.dtype = DType::float16;
  ForwardArgs a = valid_forward(d);
  a.k = input(DType::bfloat16, d.kv());
  expect_forward_rejected(a, {"argument 'k'", "expected dtype float16", "got bfloat16"});
}

TEST_F(ValidationTest, ForwardRejectsQFloat32) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.q = input(DType::float32, d.q());
  expect_forward_rejected(a, {"argument 'q'", "expected dtype float16 or bfloat16", "got float32"});
}

TEST_F(ValidationTest, ForwardRejectsOutDtypeDifferentFromQ) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.out = output(DType::float16, d.q());
  expect_forward_rejected(a, {"argument 'out'", "expected dtype bfloat16", "got float16"});
}

TEST_F(ValidationTest, ForwardRejectsLseNotFloat32) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.lse = output(DType::bfloat16, d.lse());
  expect_forward_rejected(a, {"argument 'lse'", "expected dtype float32", "got bfloat16"});
}

TEST_F(ValidationTest, ForwardRejectsMaskNotBool) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.mask = input(DType::float32, d.mask());
  expect_forward_rejected(a, {"argument 'mask'", "expected dtype bool", "got float32"});
}

TEST_F(ValidationTest, ForwardRejectsBiasFloat64) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.bias = input(DType::float64, d.bias());
  expect_forward_rejected(a, {"argument 'bias'", "expected dtype bfloat16 (the dtype of q) or float32", "got float64"});
}

TEST_F(ValidationTest, ForwardAcceptsBiasInQDtypeOrFloat32) {
  for (DType dtype : {DType::float16, DType::bfloat16}) {
    for (DType bias_dtype : {dtype, DType::float32}) {
      SCOPED_TRACE(std::string("q ") + dtype_name(dtype) + ", bias " + dtype_name(bias_dtype));
      Dims d;
      d.dtype = dtype;
      ForwardArgs a = valid_forward(d);
      a.bias = input(bias_dtype, d.bias());
      expect_forward_ok(a);
    }
  }
}

TEST_F(ValidationTest, BackwardRejectsDbiasDtypeDifferentFromBias) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  a.dbias = output(DType::float32, d.bias());
  expect_backward_rejected(a, {"argument 'dbias'", "expected dtype bfloat16 (the dtype of bias)", "got float32"});
}

// 3. Heads.

TEST_F(ValidationTest, ForwardRejectsHeadsNotDivisibleByKvHeads) {
  Dims d;
  d.heads = 6;
  d.kv_heads = 4;
  expect_forward_rejected(valid_forward(d), {"argument 'k'", "divides q's H=6", "got Hk=4"});
}

TEST_F(ValidationTest, ForwardRejectsQWithZeroHeads) {
  ForwardArgs a = valid_forward();
  a.q.shape[2] = 0;
  expect_forward_rejected(a, {"argument 'q'", "expected at least one head (dim 2)", "got shape (2, 5, 0, 16)"});
}

// 4. Mask and bias dimensions that are neither 1 nor full.

TEST_F(ValidationTest, ForwardRejectsMaskQueryDimNeitherOneNorSq) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.mask = input(DType::boolean, {d.batch, d.kv_heads, 3, d.seqlen_k});
  expect_forward_rejected(a, {"argument 'mask'", "expected query size (dim 2) 1 or 5", "got 3"});
}

TEST_F(ValidationTest, ForwardRejectsBiasBatchDimNeitherOneNorB) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.bias = input(d.dtype, {3, d.heads, d.seqlen_q, d.seqlen_k});
  expect_forward_rejected(a, {"argument 'bias'", "expected batch size (dim 0) 1 or 2", "got 3"});
}

TEST_F(ValidationTest, ForwardRejectsBiasKeyDimNeitherOneNorSk) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.bias = input(d.dtype, {1, d.heads, d.seqlen_q, 6});
  expect_forward_rejected(a, {"argument 'bias'", "expected key size (dim 3) 1 or 7", "got 6"});
}

// 5. Mask and bias heads outside {1, Hk, H}.

TEST_F(ValidationTest, ForwardRejectsMaskHeadsNotOneOrHkOrH) {
  Dims d;
  d.heads = 8;
  ForwardArgs a = valid_forward(d);
  a.mask = input(DType::boolean, {d.batch, 4, 1, d.seqlen_k});
  expect_forward_rejected(a, {"argument 'mask'", "expected heads (dim 1) in {1, Hk=2, H=8}", "got 4"});
}

TEST_F(ValidationTest, ForwardRejectsBiasHeadsNotOneOrHkOrH) {
  Dims d;
  d.heads = 8;
  ForwardArgs a = valid_forward(d);
  a.bias = input(d.dtype, {1, 4, d.seqlen_q, d.seqlen_k});
  expect_forward_rejected(a, {"argument 'bias'", "expected heads (dim 1) in {1, Hk=2, H=8}", "got 4"});
}

// 6. Head dim.

TEST_F(ValidationTest, ForwardRejectsHeadDimAbove256) {
  Dims d;
  d.head_dim = 260;
  expect_forward_rejected(valid_forward(d),
                          {"argument 'q'", "expected head dim (dim 3) a multiple of 8 in [8, 256]", "got 260"});
}

TEST_F(ValidationTest, ForwardRejectsHeadDimNotMultipleOf8) {
  Dims d;
  d.head_dim = 12;
  expect_forward_rejected(valid_forward(d),
                          {"argument 'q'", "expected head dim (dim 3) a multiple of 8 in [8, 256]", "got 12"});
}

TEST_F(ValidationTest, ForwardRejectsHeadDimZero) {
  Dims d;
  d.head_dim = 0;
  expect_forward_rejected(valid_forward(d),
                          {"argument 'q'", "expected head dim (dim 3) a multiple of 8 in [8, 256]", "got 0"});
}

// 7. Null pointers.

TEST_F(ValidationTest, ForwardRejectsNullQ) {
  ForwardArgs a = valid_forward();
  a.q.data = nullptr;
  expect_forward_rejected(a, {"argument 'q'", "expected a non-null pointer for shape (2, 5, 4, 16)", "got null"});
}

TEST_F(ValidationTest, ForwardAcceptsNullPointersForEmptyTensors) {
  Dims d;
  d.seqlen_q = 0;
  ForwardArgs a = valid_forward(d);
  a.q.data = nullptr;
  a.out.data = nullptr;
  a.lse.data = nullptr;
  expect_forward_ok(a);
}

// 8. Strides.

TEST_F(ValidationTest, ForwardRejectsQLastStrideNotOne) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.q = input(d.dtype, {d.batch, d.seqlen_q, d.heads, 2 * d.head_dim});
  a.q.shape[3] = d.head_dim;
  a.q.stride[3] = 2;
  expect_forward_rejected(a, {"argument 'q'", "expected a contiguous last dimension (stride 1)",
                              "got strides (640, 128, 32, 2) for shape (2, 5, 4, 16)"});
}

TEST_F(ValidationTest, ForwardRejectsMaskLastStrideNotOne) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  TensorView mask = input(DType::boolean, {d.batch, d.kv_heads, 1, 2 * d.seqlen_k});
  mask.shape[3] = d.seqlen_k;
  mask.stride[3] = 2;
  a.mask = mask;
  expect_forward_rejected(a, {"argument 'mask'", "expected a contiguous last dimension (stride 1)",
                              "got strides (28, 14, 14, 2) for shape (2, 2, 1, 7)"});
}

TEST_F(ValidationTest, ForwardAcceptsAnyStrideOnSizeOneLastDim) {
  const Dims d;
  for (std::int64_t stride : {0, 3}) {
    SCOPED_TRACE("bias stride[3] = " + std::to_string(stride));
    ForwardArgs a = valid_forward(d);
    TensorView bias = input(d.dtype, {d.batch, d.heads, d.seqlen_q, 1});
    bias.stride[3] = stride;
    a.bias = bias;
    expect_forward_ok(a);
  }
}

TEST_F(ValidationTest, ForwardRejectsNegativeStride) {
  ForwardArgs a = valid_forward();
  a.q.stride[0] = -a.q.stride[0];
  expect_forward_rejected(a, {"argument 'q'", "expected non-negative strides", "got strides (-320, 64, 16, 1)"});
}

TEST_F(ValidationTest, ForwardRejectsNegativeSize) {
  ForwardArgs a = valid_forward();
  a.q.shape[1] = -5;
  expect_forward_rejected(a, {"argument 'q'", "expected non-negative sizes", "got shape (2, -5, 4, 16)"});
}

// 9. Outputs that alias.

TEST_F(ValidationTest, ForwardRejectsOutOverlappingQ) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  std::tie(a.q, a.out) = overlapping(d.dtype, d.q(), /*outputs=*/false);
  expect_forward_rejected(a, {"argument 'out'", "expected memory disjoint from input 'q'", "got overlapping memory"});
}

TEST_F(ValidationTest, BackwardRejectsDqOverlappingDout) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  std::tie(a.dout, a.dq) = overlapping(d.dtype, d.q(), /*outputs=*/false);
  expect_backward_rejected(a,
                           {"argument 'dq'", "expected memory disjoint from input 'dout'", "got overlapping memory"});
}

TEST_F(ValidationTest, BackwardRejectsDkOverlappingDv) {
  const Dims d;
  BackwardArgs a = valid_backward(d);
  std::tie(a.dk, a.dv) = overlapping(d.dtype, d.kv(), /*outputs=*/true);
  expect_backward_rejected(a,
                           {"argument 'dv'", "expected memory disjoint from output 'dk'", "got overlapping memory"});
}

TEST_F(ValidationTest, ForwardRejectsOutWithInternalOverlap) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.out = output(d.dtype, {d.batch, d.seqlen_q, 1, d.head_dim});
  a.out.shape[2] = d.heads;
  a.out.stride[2] = 0;
  expect_forward_rejected(a, {"argument 'out'", "expected an output whose elements do not alias each other",
                              "got shape (2, 5, 4, 16) with strides (80, 16, 0, 1)"});
}

// 10. Sizes that overflow int64.

TEST_F(ValidationTest, ForwardRejectsByteOffsetsOverflowingInt64) {
  Dims d;
  d.batch = 1;
  d.seqlen_q = 2;
  d.heads = 1;
  d.kv_heads = 1;
  d.head_dim = 8;
  ForwardArgs a = valid_forward(d);
  // The last element offset, kInt64Max/2 + 7, still fits; its byte offset does not.
  a.q.stride[1] = kInt64Max / 2;
  expect_forward_rejected(a, {"argument 'q'", "expected byte offsets that fit in int64",
                              "got shape (1, 2, 1, 8) with strides (16, 4611686018427387903, 8, 1)"});
}

TEST_F(ValidationTest, ForwardRejectsElementOffsetsOverflowingInt64) {
  ForwardArgs a = valid_forward();
  a.q.stride[1] = kInt64Max / 2;
  expect_forward_rejected(a, {"argument 'q'", "expected element offsets that fit in int64",
                              "got shape (2, 5, 4, 16) with strides (320, 4611686018427387903, 16, 1)"});
}

TEST_F(ValidationTest, ForwardRejectsElementCountOverflowingInt64) {
  ForwardArgs a = valid_forward();
  a.q.shape[0] = std::int64_t{1} << 62;
  expect_forward_rejected(a, {"argument 'q'", "expected an element count that fits in int64",
                              "got shape (4611686018427387904, 5, 4, 16)"});
}

// 11. Softcap.

TEST_F(ValidationTest, ForwardRejectsNegativeSoftcap) {
  ForwardArgs a = valid_forward();
  a.options.softcap = -1.0;
  expect_forward_rejected(a, {"argument 'softcap'", "expected a finite value >= 0", "got -1"});
}

TEST_F(ValidationTest, ForwardRejectsNanSoftcap) {
  ForwardArgs a = valid_forward();
  a.options.softcap = std::numeric_limits<double>::quiet_NaN();
  expect_forward_rejected(a, {"argument 'softcap'", "expected a finite value >= 0", "got nan"});
}

// 12. Softmax scale.

TEST_F(ValidationTest, ForwardRejectsZeroScale) {
  ForwardArgs a = valid_forward();
  a.options.softmax_scale = 0.0;
  expect_forward_rejected(a, {"argument 'softmax_scale'", "expected a finite value > 0", "got 0"});
}

TEST_F(ValidationTest, ForwardRejectsNegativeScale) {
  ForwardArgs a = valid_forward();
  a.options.softmax_scale = -1.0;
  expect_forward_rejected(a, {"argument 'softmax_scale'", "expected a finite value > 0", "got -1"});
}

TEST_F(ValidationTest, ForwardRejectsInfiniteScale) {
  ForwardArgs a = valid_forward();
  a.options.softmax_scale = std::numeric_limits<double>::infinity();
  expect_forward_rejected(a, {"argument 'softmax_scale'", "expected a finite value > 0", "got inf"});
}

TEST_F(ValidationTest, ForwardRejectsNanScale) {
  ForwardArgs a = valid_forward();
  a.options.softmax_scale = std::numeric_limits<double>::quiet_NaN();
  expect_forward_rejected(a, {"argument 'softmax_scale'", "expected a finite value > 0", "got nan"});
}

// Devices, optional arguments, workspace and backends.

TEST_F(ValidationTest, ForwardRejectsKOnAnotherDevice) {
  ForwardArgs a = valid_forward();
  a.k.device = Device{DeviceType::cuda, 0};
  expect_forward_rejected(a, {"argument 'k'", "expected device cpu (the device of 'q')", "got cuda:0"});
}

TEST_F(ValidationTest, BackwardRejectsDbiasWithoutBias) {
  BackwardArgs a = valid_backward();
  a.bias.reset();
  expect_backward_rejected(a, {"argument 'dbias'", "expected no dbias when no bias is given",
                               "got shape (1, 4, 5, 7)"});
}

TEST_F(ValidationTest, ForwardAcceptsNullWorkspaceWhenNoneIsRequired) {
  ForwardArgs a = valid_forward();
  std::size_t bytes = 1;
  const Status sized = forward_workspace_size(a, &bytes);
  ASSERT_TRUE(sized.ok()) << sized.message();
  ASSERT_EQ(bytes, 0u);
  a.workspace = Workspace{nullptr, 0};
  expect_forward_ok(a);
}

TEST_F(ValidationTest, ForwardRejectsCudaBackendForCpuTensors) {
  ForwardArgs a = valid_forward();
  a.options.backend = Backend::cuda_sm80;
  // Without CUDA the backend is not compiled in; with it, it cannot run CPU tensors. Both are
  // unsupported rather than invalid: the call itself is well formed.
  expect_forward_rejected(a, {"cuda_sm80"}, StatusCode::unsupported);
}

// Broadcast shapes that must be accepted.

TEST_F(ValidationTest, ForwardAcceptsMaskBroadcastOverBatchHeadsAndRows) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.mask = input(DType::boolean, {1, 1, 1, d.seqlen_k});
  expect_forward_ok(a);
}

TEST_F(ValidationTest, ForwardAcceptsMaskBroadcastOverKeys) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.mask = input(DType::boolean, {d.batch, d.kv_heads, d.seqlen_q, 1});
  expect_forward_ok(a);
}

TEST_F(ValidationTest, ForwardAcceptsFullFloat32Bias) {
  const Dims d;
  ForwardArgs a = valid_forward(d);
  a.bias = input(DType::float32, {d.batch, d.heads, d.seqlen_q, d.seqlen_k});
  expect_forward_ok(a);
}

TEST_F(ValidationTest, ForwardAcceptsEveryBroadcastShapeOfMaskAndBias) {
  const Dims d;
  for (std::int64_t b : {std::int64_t{1}, d.batch}) {
    for (std::int64_t h : {std::int64_t{1}, d.kv_heads, d.heads}) {
      for (std::int64_t i : {std::int64_t{1}, d.seqlen_q}) {
        for (std::int64_t j : {std::int64_t{1}, d.seqlen_k}) {
          const Shape shape{b, h, i, j};
          SCOPED_TRACE(::testing::PrintToString(shape));
          ForwardArgs masked = valid_forward(d);
          masked.mask = input(DType::boolean, shape);
          expect_forward_ok(masked);
          ForwardArgs biased = valid_forward(d);
          biased.bias = input(d.dtype, shape);
          expect_forward_ok(biased);
        }
      }
    }
  }
}

}  // namespace
}  // namespace flash_dmattn::test
