// What every GPU forward test does: build a problem on the host from fresh random data, run
// flash_dmattn::forward on guard-framed device copies through the public API, and compare out and
// lse with the fp64 reference under the rule of tolerance.h.
//
// Skips: every test skips when the machine has no CUDA device (CI), and a configuration skips
// when the library reports `unsupported` because the build did not compile its head dim (the
// message names a "head dim" that is "not compiled"). Any other refusal fails the test.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <random>
#include <vector>

#include "device_tensor.h"
#include "reference_problem.h"

namespace flash_dmattn::test {

// Storage layouts. q, k, v and out keep contiguous head rows whose starts stay 16-byte aligned
// (pads that are multiples of 8 elements), as the kernels' vector loads need; mask and bias take
// any padding, odd included, and so any alignment.
struct Layout {
  std::int64_t qkv_row_pad = 0;   // extra elements after each head row of q, k and v
  std::int64_t out_row_pad = 0;   // the same for out
  std::int64_t lse_row_pad = 0;   // extra elements after each (b, h) row of lse: a padded head stride
  std::int64_t mask_row_pad = 0;  // extra elements after each key row of the mask
  std::int64_t bias_row_pad = 0;  // the same for the bias
  bool zero_broadcast_strides = false;  // size-1 mask/bias dimensions get stride 0, as torch's expand() gives
};

struct ForwardCase {
  Sizes n;
  DType dtype = DType::bfloat16;
  std::optional<OperandShape> mask;  // absent: no mask
  double density = 0.5;              // probability that the mask keeps a key
  std::optional<OperandShape> bias;  // absent: no bias
  std::optional<DType> bias_dtype;   // absent: q's dtype
  bool causal = false;
  double softcap = 0.0;
  std::optional<double> scale;  // absent: the library's default 1/sqrt(D)
  Layout layout;
};

// Host tensors of one call. Tests edit the inputs (a row of the mask, a -inf in the bias) before
// running it; out and lse only carry the layout of the outputs.
struct ForwardProblem {
  Sizes n;
  HostTensor q, k, v;
  std::optional<HostTensor> mask, bias;
  HostTensor out, lse;
  AttentionOptions options;

  // q, k, v uniform in [-1, 1), bias in [-2, 2), mask Bernoulli(density), all rounded to their dtypes.
  static ForwardProblem random(const ForwardCase& c, std::mt19937_64& rng);
  // The reference's view of the same inputs; valid while the problem lives.
  reference::Inputs inputs() const;
};

// The outputs the GPU wrote, copied back with their storage layout.
struct GpuOutputs {
  HostTensor out, lse;
};

// The library's way of saying that the build left out a kernel (FLASH_DMATTN_HEAD_DIMS and
// FLASH_DMATTN_DTYPES pick subsets): `unsupported`, with a message naming the head dim as not
// compiled ("... not compiled", or the sm80 backend's "... which this build does not include").
// Shared with the backward harness.
bool head_dim_not_compiled(const Status& status);

// True once the current test has been skipped or has failed fatally; helpers that may skip or
// assert are followed by `if (test_stopped()) return;`.
inline bool test_stopped() { return ::testing::Test::IsSkipped() || ::testing::Test::HasFatalFailure(); }

// Device copies of a problem (inputs uploaded, outputs poisoned) and the ForwardArgs that point
// at them, for tests that run a call more than once or in a CUDA graph.
class GpuForward {
 public:
  GpuForward(const ForwardProblem& problem, cudaStream_t stream);

  ForwardArgs& args() { return args_; }
  // Skips the test when the build did not compile the head dim; fails on any other refusal.
  // Then allocates the workspace the library asks for and passes it in the arguments.
  void prepare();
  Status run() const { return forward(args_); }
  // Sets the outputs back to NaN (asynchronously on the stream).
  void poison_outputs() const;
  // Synchronizes the stream, copies out and lse back and checks that no byte outside the
  // outputs' elements changed, in any tensor.
  GpuOutputs finish() const;

 private:
  cudaStream_t stream_;
  DeviceTensor q_, k_, v_;
  std::optional<DeviceTensor> mask_, bias_;
  DeviceTensor out_, lse_;
  DeviceBuffer workspace_;
  ForwardArgs args_;
};

// reference::forward, split into blocks of query rows that run side by side when B·H alone
// cannot keep the host's threads busy.
reference::ForwardResult reference_forward(const reference::Inputs& inputs);

// Query rows [first, first + rows) of a problem as a problem of their own, causal alignment kept
// (for a reference of a few rows where the whole problem is too large); the mask and bias views
// it points at live in `views`.
struct QueryRowViews {
  TensorView mask, bias;
};
reference::Inputs query_rows(const reference::Inputs& inputs, std::int64_t first, std::int64_t rows,
                             QueryRowViews& views);

// out and lse of query rows [first, first + rows) against their reference.
void expect_rows_match_reference(const ForwardProblem& problem, const GpuOutputs& gpu, std::int64_t first,
                                 std::int64_t rows);

// out and lse against the reference under the tolerance rule; rows with no visible key must
// hold exactly out = 0 and lse = +inf.
void expect_outputs_match_reference(const ForwardProblem& problem, const GpuOutputs& gpu);

// The whole check: run once on the GPU, then expect_outputs_match_reference.
void expect_forward_matches_reference(const ForwardProblem& problem, cudaStream_t stream);

// Every GPU test: skipped without a CUDA device, otherwise given a stream of its own.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override;
  cudaStream_t stream() const { return stream_->get(); }

 private:
  std::optional<Stream> stream_;
};

template <typename Param>
class GpuParamTest : public GpuTest, public ::testing::WithParamInterface<Param> {};

}  // namespace flash_dmattn::test
