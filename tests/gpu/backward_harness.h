// What every GPU backward test does: build a problem on the host from fresh random data (q, k, v
// and dout uniform in [-1, 1), mask Bernoulli, bias uniform in [-2, 2)), run the library's own
// forward on the GPU for out and lse, run flash_dmattn::backward on guard-framed device copies
// through the public API, and compare dq, dk, dv and dbias with the fp64 reference under the rule
// of tolerance.h, the same-precision baseline being lowp::backward.
//
// The GPU backward consumes the GPU forward's out and lse (docs/semantics.md §7: Δ = <dO, O> comes
// from out), while the reference and the baseline recompute the forward themselves from the same
// rounded inputs.
//
// Beyond the tolerance rule, every comparison checks exact zeros where the contract demands them
// (docs/semantics.md §6): dq of a row with no visible key (or only -inf logits), dk and dv of a
// key that no row sees with a finite logit, and dbias elements that no such position reads. A NaN
// or infinity in any gradient fails (every reference gradient is finite).
//
// Skips, as in the forward: every test skips without a CUDA device, and a configuration skips
// when the library reports that the build did not compile its head dim (for the forward or the
// backward). Any other refusal fails the test.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <random>

#include "device_tensor.h"
#include "forward_harness.h"

namespace flash_dmattn::test {

// Layouts of the tensors that only the backward has. dout, dq, dk and dv follow the rule of
// Layout for q, k, v and out (pads that are multiples of 8 elements keep rows 16-byte aligned);
// dbias takes any padding.
struct GradientLayout {
  std::int64_t dout_row_pad = 0;   // extra elements after each head row of dout
  std::int64_t dq_row_pad = 0;     // the same for dq
  std::int64_t dkv_row_pad = 0;    // the same for dk and dv
  std::int64_t dbias_row_pad = 0;  // extra elements after each key row of dbias
};

struct BackwardCase : ForwardCase {
  GradientLayout gradients;
  bool dbias = true;           // ask for dbias whenever there is a bias
  bool deterministic = false;  // BackwardArgs::deterministic
};

// Host tensors of one backward call. Tests may edit the inputs (mask, bias, dout) before running
// it; out and lse come from the GPU forward at run time, so they always match the edited inputs.
// dq, dk, dv and dbias only carry the layouts of the outputs.
struct BackwardProblem : ForwardProblem {
  HostTensor dout;
  HostTensor dq, dk, dv;
  std::optional<HostTensor> dbias;  // absent: no bias, or no bias gradient asked for
  bool deterministic = false;

  // deterministic: c.deterministic, or every_backward_deterministic().
  static BackwardProblem random(const BackwardCase& c, std::mt19937_64& rng);
};

// FLASH_DMATTN_TEST_DETERMINISTIC=1 runs every backward problem in deterministic mode, so that the
// kernels of that mode see the whole suite (scripts/gpu_check.sh runs it so once more).
bool every_backward_deterministic();

// The gradients the GPU wrote, copied back with their storage layout (padding included), and the
// forward output the backward was given.
struct GpuGradients {
  HostTensor dq, dk, dv;
  std::optional<HostTensor> dbias;
  HostTensor out;  // the `out` argument of the backward (the GPU forward's output)
};

// Device copies of a problem and the BackwardArgs that point at them, for tests that run a call
// more than once or in a CUDA graph. The problem must outlive this object.
class GpuBackward {
 public:
  GpuBackward(const BackwardProblem& problem, cudaStream_t stream);

  BackwardArgs& args() { return args_; }
  // Runs the library's forward on the device inputs (skipping the test when the build did not
  // compile the head dim, failing on any other refusal), checks its guards and uploads out and lse
  // as guard-framed inputs of the backward. Then queries the backward (same skip rule), allocates
  // the workspace it asks for, fills it with 0xFF bytes (the library may not expect zeroed
  // scratch) and passes it in the arguments.
  void prepare();
  Status run() const { return backward(args_); }
  // Sets dq, dk, dv and dbias back to NaN (asynchronously on the stream).
  void poison_outputs() const;
  // Synchronizes the stream, copies the gradients back and checks that no byte outside the
  // outputs' elements changed, in any tensor (inputs, out and lse included).
  GpuGradients finish() const;
  // out and lse as the GPU forward wrote them (valid after prepare()).
  const GpuOutputs& forward_outputs() const { return *forward_; }

 private:
  const BackwardProblem& problem_;
  cudaStream_t stream_;
  DeviceTensor q_, k_, v_;
  std::optional<DeviceTensor> mask_, bias_;
  DeviceTensor dout_;
  std::optional<DeviceTensor> out_, lse_;
  DeviceTensor dq_, dk_, dv_;
  std::optional<DeviceTensor> dbias_;
  std::optional<GpuOutputs> forward_;
  DeviceBuffer workspace_;
  BackwardArgs args_;
};

// reference::backward, split into blocks of query rows that run side by side when B·Hk alone
// cannot keep the host's threads busy; dk, dv and shared dbias elements are summed over the blocks
// in a fixed order.
reference::Gradients reference_backward(const reference::Inputs& inputs, const TensorView& dout);

// dq, dk, dv and dbias (when asked for) against the reference under the tolerance rule, plus the
// exact zeros described at the top of this file.
//
// dbias of a bias with key dim 1 (shapes (·, ·, ·, 1)) cancels in the softmax: it must be exactly
// 0 (docs/semantics.md §6), and is checked for exactly that.
//
// One refinement for dq, dk and the other dbias shapes. A kernel computes Δ as the contract says
// (docs/semantics.md §7), from the `out` it is given, which holds O rounded to the input dtype
// (after the forward's own rounding of P): every dZ[b,h,i,j] then carries −P·δ with
// δ = <dO, out − O> of the row, where the same-precision baseline (PyTorch's softmax backward)
// takes Δ = Σ_j P·dP and carries none. Usually that is far below the baseline's error, but in a
// small problem whose rows hold a few keys it is as large, and both are random samples, so
// "2 × the baseline" would fail a correct kernel at random (dk of a 5 x 5 D32 packed sequence did,
// one seed in sixty: 8.0e-4 against a bound of 5.6e-4). So the reference and the baseline of
// dbias, dq and dk are all shifted by that term (−Σ P·δ over the positions a dbias element sums;
// times the logit's derivative and k or q for dq and dk; the baseline's error is unchanged), and
// the noise term admits the same sums of P·γ_D·Σ_d|dO·out| (γ_D = D·2⁻²⁴, the fp32 error bound of
// the dot product Δ; it covers a row with one key, whose dZ is exactly 0 in the baseline and fp32
// noise in a kernel). dv does not depend on Δ.
void expect_gradients_match_reference(const BackwardProblem& problem, const GpuGradients& gpu);

// The whole check: run once on the GPU, then expect_gradients_match_reference.
void expect_backward_matches_reference(const BackwardProblem& problem, cudaStream_t stream);

}  // namespace flash_dmattn::test
