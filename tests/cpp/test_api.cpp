// The public API on CPU tensors: dispatch, rounding of results into the caller's dtypes,
// strided outputs, empty sizes, and the queries.
#include <cmath>
#include <limits>

#include "reference_problem.h"

namespace flash_dmattn::test {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();

// A bf16/fp16 problem with owning tensors and the matching public-API arguments.
struct ApiProblem {
  RefProblem in;
  HostTensor out, lse, dq, dk, dv, dbias;

  ApiProblem(const Sizes& n, DType dtype, DType bias_dtype, std::mt19937_64& rng, std::int64_t out_row_pad = 0) {
    in = RefProblem::random(n, rng, OperandShape{true, n.Hk, true, true}, OperandShape{false, n.H, false, true}, 0.6,
                            dtype);
    if (bias_dtype != dtype) in.bias = HostTensor::random(bias_dtype, operand_shape(n, {false, n.H, false, true}), rng);
    in.causal = true;
    out = HostTensor::empty(dtype, {n.B, n.Sq, n.H, n.D}, out_row_pad);
    lse = HostTensor::empty(DType::float32, {n.B, n.H, n.Sq});
    dq = HostTensor::empty(dtype, {n.B, n.Sq, n.H, n.D}, out_row_pad);
    dk = HostTensor::empty(dtype, {n.B, n.Sk, n.Hk, n.D});
    dv = HostTensor::empty(dtype, {n.B, n.Sk, n.Hk, n.D});
    dbias = HostTensor::empty(bias_dtype, Shape(in.bias->view.shape, in.bias->view.shape + 4));
    for (HostTensor* t : {&out, &lse, &dq, &dk, &dv, &dbias}) poison(*t);
  }

  ForwardArgs forward_args() const {
    ForwardArgs a;
    a.q = in.q.view;
    a.k = in.k.view;
    a.v = in.v.view;
    a.mask = in.mask->view;
    a.bias = in.bias->view;
    a.out = out.view;
    a.lse = lse.view;
    a.options.softmax_scale = in.scale;
    a.options.causal = in.causal;
    return a;
  }

  BackwardArgs backward_args() const {
    BackwardArgs a;
    a.q = in.q.view;
    a.k = in.k.view;
    a.v = in.v.view;
    a.mask = in.mask->view;
    a.bias = in.bias->view;
    a.out = out.view;
    a.lse = lse.view;
    a.dout = in.dout.view;
    a.dq = dq.view;
    a.dk = dk.view;
    a.dv = dv.view;
    a.dbias = dbias.view;
    a.options.softmax_scale = in.scale;
    a.options.causal = in.causal;
    return a;
  }
};

void expect_rounded(const HostTensor& got, const std::vector<double>& exact, const char* name) {
  const auto values = got.values();
  ASSERT_EQ(values.size(), exact.size()) << name;
  for (size_t e = 0; e < exact.size(); ++e) {
    ASSERT_EQ(values[e], host::round_to(got.view.dtype, exact[e])) << name << " element " << e;
  }
}

class ApiDtypes : public ::testing::TestWithParam<std::tuple<DType, DType>> {};

TEST_P(ApiDtypes, ForwardAndBackwardWriteTheRoundedReference) {
  auto rng = test_rng();
  Sizes n;
  n.Sq = 7;
  n.Sk = 9;
  n.D = 16;
  const auto [dtype, bias_dtype] = GetParam();
  ApiProblem p(n, dtype, bias_dtype, rng, /*out_row_pad=*/5);
  ASSERT_TRUE(forward(p.forward_args()).ok());
  const auto r = reference::forward(p.in.inputs());
  expect_rounded(p.out, r.out, "out");
  expect_rounded(p.lse, r.lse, "lse");

  const Status status = backward(p.backward_args());
  ASSERT_TRUE(status.ok()) << status.message();
  const auto g = reference::backward(p.in.inputs(), p.in.dout.view);
  expect_rounded(p.dq, g.dq, "dq");
  expect_rounded(p.dk, g.dk, "dk");
  expect_rounded(p.dv, g.dv, "dv");
  expect_rounded(p.dbias, g.dbias, "dbias");

  // The padding between the rows of the strided outputs is never written.
  for (const HostTensor* t : {&p.out, &p.dq}) {
    std::vector<bool> touched(t->bytes.size() / 2, false);
    t->for_each([&](std::int64_t o) { touched[o] = true; });
    for (size_t e = 0; e < touched.size(); ++e) {
      if (!touched[e]) {
        ASSERT_TRUE(std::isnan(host::load(t->view, e))) << "padding element " << e << " was written";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ApiDtypes,
                         ::testing::Values(std::make_tuple(DType::bfloat16, DType::bfloat16),
                                           std::make_tuple(DType::float16, DType::float16),
                                           std::make_tuple(DType::bfloat16, DType::float32),
                                           std::make_tuple(DType::float16, DType::float32)),
                         [](const auto& test) {
                           return std::string(dtype_name(std::get<0>(test.param))) + "_bias_" +
                                  dtype_name(std::get<1>(test.param));
                         });

TEST(Api, EmptyQueryDoesNothingInTheForwardAndZeroesKeyGradients) {
  auto rng = test_rng();
  Sizes n;
  n.Sq = 0;
  n.D = 8;
  ApiProblem p(n, DType::bfloat16, DType::bfloat16, rng);
  ASSERT_TRUE(forward(p.forward_args()).ok());
  ASSERT_TRUE(backward(p.backward_args()).ok());
  for (const HostTensor* t : {&p.dk, &p.dv, &p.dbias})
    for (double x : t->values()) EXPECT_EQ(x, 0.0);
}

TEST(Api, EmptyKeysGiveZeroOutputAndInfiniteLse) {
  auto rng = test_rng();
  Sizes n;
  n.Sk = 0;
  n.D = 8;
  ApiProblem p(n, DType::float16, DType::float32, rng);
  ASSERT_TRUE(forward(p.forward_args()).ok());
  for (double x : p.out.values()) EXPECT_EQ(x, 0.0);
  for (double x : p.lse.values()) EXPECT_EQ(x, std::numeric_limits<double>::infinity());
  ASSERT_TRUE(backward(p.backward_args()).ok());
  for (double x : p.dq.values()) EXPECT_EQ(x, 0.0);
}

TEST(Api, DefaultScaleIsOneOverSqrtHeadDim) {
  auto rng = test_rng();
  Sizes n;
  n.D = 32;
  ApiProblem p(n, DType::bfloat16, DType::float32, rng);
  ForwardArgs a = p.forward_args();
  a.options.softmax_scale.reset();
  ASSERT_TRUE(forward(a).ok());
  p.in.scale = 1.0 / std::sqrt(32.0);
  expect_rounded(p.out, reference::forward(p.in.inputs()).out, "out");
}

TEST(Api, DeterministicBackwardIsBitwiseRepeatable) {
  auto rng = test_rng();
  Sizes n;
  n.B = 3;
  n.D = 8;
  ApiProblem p(n, DType::bfloat16, DType::float32, rng);
  BackwardArgs a = p.backward_args();
  a.deterministic = true;
  ASSERT_TRUE(backward(a).ok());
  const auto first = p.dbias.bytes;
  const auto first_dk = p.dk.bytes;
  ASSERT_TRUE(backward(a).ok());
  EXPECT_EQ(first, p.dbias.bytes);
  EXPECT_EQ(first_dk, p.dk.bytes);
}

TEST(Api, QueriesReportTheCpuReference) {
  auto rng = test_rng();
  ApiProblem p(Sizes{2, 3, 4, 4, 2, 8}, DType::bfloat16, DType::bfloat16, rng);
  Capability cap;
  ASSERT_TRUE(query_forward(p.forward_args(), &cap).ok());
  EXPECT_EQ(cap.backend, Backend::cpu_reference);
  EXPECT_EQ(cap.arch, 0);
  EXPECT_NE(cap.description.find("cpu_reference"), std::string::npos);
  ASSERT_TRUE(query_backward(p.backward_args(), &cap).ok());
  EXPECT_EQ(cap.backend, Backend::cpu_reference);
  std::size_t bytes = 1;
  ASSERT_TRUE(forward_workspace_size(p.forward_args(), &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  bytes = 1;
  ASSERT_TRUE(backward_workspace_size(p.backward_args(), &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  const auto backends = available_backends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends.back(), Backend::cpu_reference);
}

TEST(Api, PreparedMaskIsCheckedAgainstEveryCallThatReadsIt) {
  auto rng = test_rng();
  ApiProblem p(Sizes{2, 5, 7, 4, 2, 8}, DType::bfloat16, DType::bfloat16, rng);
  std::size_t bytes = 1;
  ASSERT_TRUE(prepared_mask_size(p.forward_args(), &bytes).ok());
  EXPECT_EQ(bytes, 0u);  // the CPU reference reads the mask itself
  bytes = 1;
  ASSERT_TRUE(prepared_mask_size(p.forward_args(), &bytes, MaskPreparation::tile_summary).ok());
  EXPECT_EQ(bytes, 0u);
  PreparedMask summary_only;
  ASSERT_TRUE(prepare_mask(p.forward_args(), &summary_only, MaskPreparation::tile_summary).ok());
  EXPECT_FALSE(summary_only.lists());
  PreparedMask prepared;
  Status status = prepare_mask(p.forward_args(), &prepared);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_NE(prepared.fingerprint, 0u);
  EXPECT_EQ(summary_only.fingerprint, prepared.fingerprint);  // of the same call either way

  ForwardArgs f = p.forward_args();
  f.prepared_mask = &prepared;
  ASSERT_TRUE(forward(f).ok());
  expect_rounded(p.out, reference::forward(p.in.inputs()).out, "out");
  BackwardArgs b = p.backward_args();
  b.prepared_mask = &prepared;
  status = backward(b);
  ASSERT_TRUE(status.ok()) << status.message();
  expect_rounded(p.dq, reference::backward(p.in.inputs(), p.in.dout.view).dq, "dq");

  // Another causal flag, another mask view, no mask, a preparation never made: refused, named.
  auto refused = [](const Status& s, const char* what) {
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << what;
    EXPECT_NE(s.message().find("'prepared_mask'"), std::string::npos) << what << ": " << s.message();
  };
  ForwardArgs other = f;
  other.options.causal = false;
  refused(forward(other), "causal");
  other = f;
  other.mask->shape[2] = 1;
  other.mask->stride[2] = 0;
  refused(forward(other), "mask view");
  other = f;
  other.mask.reset();
  refused(forward(other), "no mask");
  PreparedMask never;
  other = f;
  other.prepared_mask = &never;
  refused(forward(other), "never prepared");
  EXPECT_NE(forward(other).message().find("prepare_mask"), std::string::npos);
  BackwardArgs other_b = b;
  other_b.options.causal = false;
  refused(backward(other_b), "backward causal");

  ForwardArgs unmasked = p.forward_args();
  unmasked.mask.reset();
  EXPECT_EQ(prepare_mask(unmasked, &prepared).code(), StatusCode::invalid_argument);
  EXPECT_EQ(prepare_mask(p.forward_args(), nullptr).code(), StatusCode::invalid_argument);
}

TEST(Api, DeferredChoiceOfPathsIsCheckedAgainstItsPreparation) {
  auto rng = test_rng();
  ApiProblem p(Sizes{2, 5, 7, 4, 2, 8}, DType::bfloat16, DType::bfloat16, rng);
  std::size_t bytes = 1;
  ASSERT_TRUE(prepared_mask_size(p.forward_args(), &bytes, MaskPreparation::deferred_choice).ok());
  EXPECT_EQ(bytes, 0u);
  PreparedMask deferred;
  ASSERT_TRUE(prepare_mask(p.forward_args(), &deferred, MaskPreparation::deferred_choice).ok());
  EXPECT_NE(deferred.fingerprint, 0u);
  EXPECT_FALSE(deferred.choice_pending);  // the CPU reference builds nothing, so chooses nothing later
  std::size_t offset = 1;
  bytes = 1;
  ASSERT_TRUE(prepared_list_sizes(p.forward_args(), deferred, &offset, &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  Status status = choose_mask_paths(p.forward_args(), &deferred, nullptr, 0);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_FALSE(deferred.lists());

  // Sizes of another length, another call's arguments, no preparation: refused, named.
  const int sizes[2] = {0, 0};
  status = choose_mask_paths(p.forward_args(), &deferred, sizes, sizeof(sizes));
  EXPECT_EQ(status.code(), StatusCode::invalid_argument);
  EXPECT_NE(status.message().find("'sizes'"), std::string::npos) << status.message();
  ForwardArgs other = p.forward_args();
  other.options.causal = !other.options.causal;
  status = choose_mask_paths(other, &deferred, nullptr, 0);
  EXPECT_EQ(status.code(), StatusCode::invalid_argument);
  EXPECT_NE(status.message().find("'prepared'"), std::string::npos) << status.message();
  EXPECT_EQ(prepared_list_sizes(other, deferred, &offset, &bytes).code(), StatusCode::invalid_argument);
  EXPECT_EQ(choose_mask_paths(p.forward_args(), nullptr, nullptr, 0).code(), StatusCode::invalid_argument);
}

TEST(Api, RowsAlignedNeedsWholeVectorsAndAContiguousLastDim) {
  alignas(16) static std::uint16_t memory[4096];
  void* base = memory;
  EXPECT_TRUE(rows_aligned_16(make_contiguous_view(base, DType::bfloat16, {2, 3, 4, 64})));
  EXPECT_FALSE(rows_aligned_16(make_contiguous_view(memory + 1, DType::bfloat16, {2, 3, 4, 64})));
  EXPECT_FALSE(rows_aligned_16(make_view(base, DType::bfloat16, {2, 3, 4, 60}, {720, 240, 60, 1})));
  EXPECT_TRUE(rows_aligned_16(make_view(base, DType::bfloat16, {1, 3, 1, 60}, {7, 64, 3, 1})));  // unit dims
  EXPECT_FALSE(rows_aligned_16(make_view(base, DType::bfloat16, {2, 3, 4, 64}, {1536, 512, 128, 2})));
  EXPECT_TRUE(rows_aligned_16(make_view(memory + 1, DType::bfloat16, {2, 0, 4, 64}, {0, 0, 0, 1})));  // empty
}

TEST(Api, ThrowIfErrorCarriesTheMessage) {
  auto rng = test_rng();
  ApiProblem p(Sizes{2, 3, 4, 4, 2, 8}, DType::bfloat16, DType::bfloat16, rng);
  ForwardArgs a = p.forward_args();
  a.options.softcap = -1.0;
  try {
    throw_if_error(forward(a));
    FAIL() << "expected an exception";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), StatusCode::invalid_argument);
    EXPECT_NE(std::string(error.what()).find("softcap"), std::string::npos);
  }
}

}  // namespace
}  // namespace flash_dmattn::test
