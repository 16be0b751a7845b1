// How the GPU backward runs rather than what it computes, and the layouts it accepts:
//   BackwardRuntime  the query names a CUDA backend; deterministic mode gives bitwise-equal dq, dk,
//       dv and dbias over reruns (on problems whose reductions a kernel would do with atomics: dk
//       and dv over a GQA group, dbias over rows, heads and batch; also on masks that empty whole
//       tiles or most of them); the default mode stays within
//       tolerance on every rerun; the backward can be captured in a CUDA graph and replayed; the
//       workspace is sized by the query, required and checked, and may hold garbage on entry; a
//       bias without dbias.
//   BackwardLayouts  padded rows in every tensor, head-major storage.
//   BackwardEmptySizes  Sq = 0 (dk, dv and dbias are zeros), Sk = 0 (dq is zero), B = 0.
#include <cuda_runtime_api.h>

#include <optional>
#include <string>
#include <utility>

#include "backward_harness.h"
#include "mask_bias_edits.h"

namespace flash_dmattn::test {
namespace {

// A mid-sized masked, biased, causal GQA problem. D = 64 by default, the head dim every build is
// likeliest to include, so that these checks of how the call runs skip in as few builds as possible.
BackwardCase runtime_case(OperandShape bias, bool deterministic, int head_dim = 64) {
  BackwardCase c;
  c.n = Sizes{2, 300, 700, 8, 2, head_dim};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = bias;
  c.causal = true;
  c.deterministic = deterministic;
  return c;
}

// dbias reductions a kernel may do with atomics: over rows and the group's heads; over batch and
// all heads; over batch and rows.
struct NamedBias {
  const char* name;
  OperandShape shape;
};
const NamedBias kReducingBiases[] = {
    {"bias (B, Hk, 1, Sk)", OperandShape{true, 2, false, true}},
    {"bias (1, 1, Sq, Sk)", OperandShape{false, 1, true, true}},
    {"bias (1, H, 1, Sk)", OperandShape{false, 0, false, true}},
};

bool same_bytes(const HostTensor& a, const HostTensor& b) { return a.bytes == b.bytes; }

void expect_bitwise_equal(const GpuGradients& a, const GpuGradients& b, const std::string& what) {
  EXPECT_TRUE(same_bytes(a.dq, b.dq)) << "dq differs " << what;
  EXPECT_TRUE(same_bytes(a.dk, b.dk)) << "dk differs " << what;
  EXPECT_TRUE(same_bytes(a.dv, b.dv)) << "dv differs " << what;
  ASSERT_EQ(a.dbias.has_value(), b.dbias.has_value());
  if (a.dbias) {
    EXPECT_TRUE(same_bytes(*a.dbias, *b.dbias)) << "dbias differs " << what;
  }
}

class BackwardRuntime : public GpuTest {};

TEST_F(BackwardRuntime, QueryNamesACudaBackend) {
  auto rng = test_rng();
  const BackwardProblem p = BackwardProblem::random(runtime_case(kReducingBiases[0].shape, false), rng);
  GpuBackward gpu(p, stream());
  gpu.prepare();
  if (test_stopped()) return;
  Capability capability;
  ASSERT_TRUE(query_backward(gpu.args(), &capability).ok());
  EXPECT_TRUE(capability.backend == Backend::cuda_sm80 || capability.backend == Backend::cuda_sm90)
      << backend_name(capability.backend);
  EXPECT_GE(capability.arch, 80);
  EXPECT_FALSE(capability.description.empty());
}

// Three more deterministic runs of p give bitwise-equal gradients, which match the reference.
void expect_reruns_bitwise_equal(const BackwardProblem& p, cudaStream_t stream) {
  GpuBackward gpu(p, stream);
  gpu.prepare();
  if (test_stopped()) return;
  ASSERT_TRUE(gpu.run().ok());
  const GpuGradients first = gpu.finish();
  for (int rerun = 1; rerun <= 3; ++rerun) {
    gpu.poison_outputs();
    ASSERT_TRUE(gpu.run().ok());
    expect_bitwise_equal(first, gpu.finish(), "between run 0 and run " + std::to_string(rerun));
    if (test_stopped()) return;
  }
  expect_gradients_match_reference(p, first);
}

void expect_deterministic_runs_bitwise_equal(int head_dim, cudaStream_t stream) {
  auto rng = test_rng();
  for (const NamedBias& bias : kReducingBiases) {
    SCOPED_TRACE(bias.name);
    expect_reruns_bitwise_equal(BackwardProblem::random(runtime_case(bias.shape, true, head_dim), rng), stream);
    if (test_stopped()) return;
  }
}

TEST_F(BackwardRuntime, DeterministicRunsAreBitwiseEqual) { expect_deterministic_runs_bitwise_equal(64, stream()); }

// On sm_90, D = 128 runs a kernel that splits its work by query rows where D = 64 splits by keys,
// and a dQ kernel of its own after it (sm90/tile_size.h).
TEST_F(BackwardRuntime, DeterministicRunsAreBitwiseEqualAtHeadDim128) {
  expect_deterministic_runs_bitwise_equal(128, stream());
}

// Masks that empty whole tiles, or most of them, with a mask head per query head so that the
// heads of a GQA group skip different tiles: the key-split CTAs skip different query tiles of
// each key tile they visit. Both sm_90 warpgroup splits (D = 64 and 128); a dBias summed per KV
// head and one summed per query head.
TEST_F(BackwardRuntime, DeterministicRunsOnSparseMasksAreBitwiseEqual) {
  auto rng = test_rng();
  for (const int head_dim : {64, 128}) {
    for (const NamedBias& bias : {kReducingBiases[0], kReducingBiases[2]}) {
      for (const bool checkerboard : {true, false}) {
        SCOPED_TRACE(std::string(bias.name) + (checkerboard ? ", checkerboard" : ", density 0.002") +
                     ", D = " + std::to_string(head_dim));
        BackwardCase c = runtime_case(bias.shape, true, head_dim);
        c.mask = OperandShape{true, c.n.H, true, true};
        c.density = checkerboard ? 0.5 : 0.002;
        BackwardProblem p = BackwardProblem::random(c, rng);
        if (checkerboard) empty_tiles_in_a_checkerboard(p);
        expect_reruns_bitwise_equal(p, stream());
        if (test_stopped()) return;
      }
    }
  }
}

TEST_F(BackwardRuntime, DefaultModeRerunsStayWithinTolerance) {
  auto rng = test_rng();
  for (const NamedBias& bias : kReducingBiases) {
    SCOPED_TRACE(bias.name);
    const BackwardProblem p = BackwardProblem::random(runtime_case(bias.shape, false), rng);
    GpuBackward gpu(p, stream());
    gpu.prepare();
    if (test_stopped()) return;
    for (int run = 0; run < 2; ++run) {
      SCOPED_TRACE("run " + std::to_string(run));
      gpu.poison_outputs();
      ASSERT_TRUE(gpu.run().ok());
      expect_gradients_match_reference(p, gpu.finish());
      if (test_stopped()) return;
    }
  }
}

// Graph handles, destroyed even when an assertion leaves the test early.
struct CapturedGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

// Captures one backward call on the test's stream. The workspace was allocated by prepare(),
// before the capture: cudaMalloc may not be captured.
void capture_backward(const GpuBackward& gpu, cudaStream_t stream, CapturedGraph* captured) {
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  const Status status = gpu.run();
  const cudaError_t end = cudaStreamEndCapture(stream, &captured->graph);
  ASSERT_TRUE(status.ok()) << "backward during capture: " << status.message();
  ASSERT_EQ(end, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(end);
  cuda_check(cudaGraphInstantiate(&captured->exec, captured->graph, 0), "cudaGraphInstantiate");
}

TEST_F(BackwardRuntime, DeterministicCudaGraphReplaysMatchTheDirectCallBitwise) {
  auto rng = test_rng();
  const BackwardProblem p = BackwardProblem::random(runtime_case(kReducingBiases[0].shape, true), rng);
  GpuBackward direct(p, stream());
  direct.prepare();
  if (test_stopped()) return;
  ASSERT_TRUE(direct.run().ok());
  const GpuGradients expected = direct.finish();
  expect_gradients_match_reference(p, expected);

  GpuBackward graphed(p, stream());
  graphed.prepare();
  if (test_stopped()) return;
  CapturedGraph captured;
  capture_backward(graphed, stream(), &captured);
  if (test_stopped()) return;
  for (int replay = 0; replay < 2; ++replay) {
    graphed.poison_outputs();
    cuda_check(cudaGraphLaunch(captured.exec, stream()), "cudaGraphLaunch");
    expect_bitwise_equal(graphed.finish(), expected, "between the direct call and replay " + std::to_string(replay));
    if (test_stopped()) return;
  }
}

TEST_F(BackwardRuntime, DefaultModeCudaGraphReplaysMatchTheReference) {
  auto rng = test_rng();
  const BackwardProblem p = BackwardProblem::random(runtime_case(kReducingBiases[1].shape, false), rng);
  GpuBackward graphed(p, stream());
  graphed.prepare();
  if (test_stopped()) return;
  CapturedGraph captured;
  capture_backward(graphed, stream(), &captured);
  if (test_stopped()) return;
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    graphed.poison_outputs();
    cuda_check(cudaGraphLaunch(captured.exec, stream()), "cudaGraphLaunch");
    expect_gradients_match_reference(p, graphed.finish());
    if (test_stopped()) return;
  }
}

TEST_F(BackwardRuntime, WorkspaceIsSizedByTheQueryRequiredAndChecked) {
  auto rng = test_rng();
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "default mode");
    const BackwardProblem p = BackwardProblem::random(runtime_case(kReducingBiases[0].shape, deterministic), rng);
    GpuBackward gpu(p, stream());
    gpu.prepare();
    if (test_stopped()) return;
    std::size_t required = 0;
    ASSERT_TRUE(backward_workspace_size(gpu.args(), &required).ok());
    ASSERT_GT(required, 0u) << "the backward keeps its dq accumulators and row sums in the workspace";
    ASSERT_EQ(gpu.args().workspace.bytes, required);
    std::size_t again = 0;
    ASSERT_TRUE(backward_workspace_size(gpu.args(), &again).ok());
    EXPECT_EQ(again, required) << "two queries of the same call disagree";

    const DeviceBuffer roomy(required + kWorkspaceAlignment);
    const Workspace rejected[] = {
        {gpu.args().workspace.data, required - 1},                   // one byte short
        {nullptr, required},                                         // no memory
        {static_cast<char*>(roomy.data()) + 16, required},           // misaligned
    };
    for (const Workspace& workspace : rejected) {
      BackwardArgs args = gpu.args();
      args.workspace = workspace;
      const Status status = backward(args);
      EXPECT_EQ(status.code(), StatusCode::invalid_argument) << status.message();
      EXPECT_NE(status.message().find("'workspace'"), std::string::npos) << status.message();
    }
    // The rejected calls wrote nothing: the outputs still hold only the poison.
    const GpuGradients untouched = gpu.finish();
    for (const unsigned char byte : untouched.dq.bytes) ASSERT_EQ(byte, 0xFF);
    for (const unsigned char byte : untouched.dk.bytes) ASSERT_EQ(byte, 0xFF);
    for (const unsigned char byte : untouched.dv.bytes) ASSERT_EQ(byte, 0xFF);
    for (const unsigned char byte : untouched.dbias->bytes) ASSERT_EQ(byte, 0xFF);

    // A larger workspace, at a 256-byte-aligned offset inside a buffer full of 0xFF bytes, works
    // as well: the library may not count on zeroed scratch or on the exact size.
    const DeviceBuffer larger(required + 3 * kWorkspaceAlignment);
    cuda_check(cudaMemsetAsync(larger.data(), 0xFF, larger.bytes(), stream()), "cudaMemsetAsync (workspace)");
    gpu.args().workspace = Workspace{static_cast<char*>(larger.data()) + kWorkspaceAlignment, required + 512};
    ASSERT_TRUE(gpu.run().ok());
    expect_gradients_match_reference(p, gpu.finish());
    if (test_stopped()) return;
  }
}

TEST_F(BackwardRuntime, BiasWithoutDbias) {
  auto rng = test_rng();
  BackwardCase c = runtime_case(kReducingBiases[0].shape, false);
  c.dbias = false;
  const BackwardProblem p = BackwardProblem::random(c, rng);
  ASSERT_FALSE(p.dbias.has_value());
  expect_backward_matches_reference(p, stream());
}

// ---- layouts ----

class BackwardLayouts : public GpuTest {};

TEST_F(BackwardLayouts, PaddedRowsInEveryTensor) {
  auto rng = test_rng();
  for (const std::int64_t head_dim : {64, 96, 128}) {
    SCOPED_TRACE("D=" + std::to_string(head_dim));
    BackwardCase c;
    c.n = Sizes{2, 150, 270, 4, 2, head_dim};
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.bias = OperandShape{true, c.n.H, false, true};
    c.bias_dtype = DType::float32;
    c.causal = true;
    c.layout.qkv_row_pad = 8;  // 16 bytes after each head row: strides stay multiples of 8 elements
    c.layout.out_row_pad = 24;
    c.layout.lse_row_pad = 3;   // lse head stride Sq + 3
    c.layout.mask_row_pad = 1;  // key-row strides 271 and 273: odd
    c.layout.bias_row_pad = 3;
    c.gradients.dout_row_pad = 16;
    c.gradients.dq_row_pad = 8;
    c.gradients.dkv_row_pad = 24;
    c.gradients.dbias_row_pad = 1;  // dbias key-row stride 271
    expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
    if (test_stopped()) return;
  }
}

// A (B, H, S, D) tensor viewed as (B, S, H, D): row stride D, head stride S·D.
HostTensor head_major(HostTensor t) {
  std::swap(t.view.shape[1], t.view.shape[2]);
  std::swap(t.view.stride[1], t.view.stride[2]);
  return t;
}

TEST_F(BackwardLayouts, HeadMajorStorage) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{2, 140, 230, 4, 2, 64};
  c.mask = OperandShape{false, 1, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  BackwardProblem p = BackwardProblem::random(c, rng);
  const Sizes& n = c.n;
  p.q = head_major(HostTensor::random(c.dtype, {n.B, n.H, n.Sq, n.D}, rng));
  p.k = head_major(HostTensor::random(c.dtype, {n.B, n.Hk, n.Sk, n.D}, rng));
  p.v = head_major(HostTensor::random(c.dtype, {n.B, n.Hk, n.Sk, n.D}, rng));
  p.out = head_major(HostTensor::empty(c.dtype, {n.B, n.H, n.Sq, n.D}));
  p.dout = head_major(HostTensor::random(c.dtype, {n.B, n.H, n.Sq, n.D}, rng));
  p.dq = head_major(HostTensor::empty(c.dtype, {n.B, n.H, n.Sq, n.D}));
  p.dk = head_major(HostTensor::empty(c.dtype, {n.B, n.Hk, n.Sk, n.D}));
  p.dv = head_major(HostTensor::empty(c.dtype, {n.B, n.Hk, n.Sk, n.D}));
  expect_backward_matches_reference(p, stream());
}

// dO read through a zero row stride, as autograd hands out the gradient of a sum over rows: TMA
// cannot address it, so the sm90a kernel loads Q and dO with cp.async (bwd_q_do_loads.h), and a
// deterministic backward keeps dQ in the key-tile kernel, in a slot per key split, where it
// would otherwise run the dQ kernel (D = 128).
TEST_F(BackwardLayouts, RowBroadcastDout) {
  auto rng = test_rng();
  for (const auto& [head_dim, deterministic] :
       {std::pair<std::int64_t, bool>{64, false}, {128, false}, {128, true}}) {
    SCOPED_TRACE("D=" + std::to_string(head_dim) + (deterministic ? ", deterministic" : ""));
    BackwardCase c;
    c.deterministic = deterministic;
    c.n = Sizes{2, 150, 270, 4, 2, head_dim};
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.bias = OperandShape{true, c.n.Hk, false, true};
    c.causal = true;
    BackwardProblem p = BackwardProblem::random(c, rng);
    const Sizes& n = c.n;
    p.dout = HostTensor::random(c.dtype, {n.B, 1, n.H, n.D}, rng);
    p.dout.view.shape[1] = n.Sq;
    p.dout.view.stride[1] = 0;
    expect_backward_matches_reference(p, stream());
    if (test_stopped()) return;
  }
}

// ---- empty sizes ----

class BackwardEmptySizes : public GpuTest {
 protected:
  // bias_keys: the bias has a key dimension (B, Hk, 1, Sk); otherwise a row dimension (B, Hk, Sq, 1).
  BackwardProblem problem(const Sizes& n, bool bias_keys) {
    auto rng = test_rng();
    BackwardCase c;
    c.n = n;
    c.mask = OperandShape{true, n.Hk, true, true};
    c.bias = OperandShape{true, n.Hk, !bias_keys, bias_keys};
    return BackwardProblem::random(c, rng);
  }

  // The gradients of one run, or nothing when the test was skipped or the call failed.
  std::optional<GpuGradients> run(const BackwardProblem& p) {
    GpuBackward gpu(p, stream());
    gpu.prepare();
    if (test_stopped()) return std::nullopt;
    const Status status = gpu.run();
    EXPECT_TRUE(status.ok()) << status_code_name(status.code()) << ": " << status.message();
    if (!status.ok()) return std::nullopt;
    return gpu.finish();
  }
};

// No query rows: dk, dv and dbias are empty sums, so zeros (docs/semantics.md §6).
TEST_F(BackwardEmptySizes, NoQueryRowsGiveZeroDkDvDbias) {
  const BackwardProblem p = problem(Sizes{2, 0, 50, 4, 2, 64}, true);
  const std::optional<GpuGradients> g = run(p);
  if (!g) return;
  for (const double x : g->dk.values()) ASSERT_EQ(x, 0.0);
  for (const double x : g->dv.values()) ASSERT_EQ(x, 0.0);
  ASSERT_EQ(g->dbias->view.numel(), 2 * 2 * 50);
  for (const double x : g->dbias->values()) ASSERT_EQ(x, 0.0);
  expect_gradients_match_reference(p, *g);
}

// No keys: every row is empty, so dq and dbias are zeros.
TEST_F(BackwardEmptySizes, NoKeysGiveZeroDqAndDbias) {
  const BackwardProblem p = problem(Sizes{2, 40, 0, 4, 2, 64}, false);
  const std::optional<GpuGradients> g = run(p);
  if (!g) return;
  for (const double x : g->dq.values()) ASSERT_EQ(x, 0.0);
  ASSERT_EQ(g->dbias->view.numel(), 2 * 2 * 40);
  for (const double x : g->dbias->values()) ASSERT_EQ(x, 0.0);
  expect_gradients_match_reference(p, *g);
}

// No batch: every tensor is empty; nothing is written and the guards stay intact.
TEST_F(BackwardEmptySizes, NoBatch) {
  const BackwardProblem p = problem(Sizes{0, 40, 50, 4, 2, 64}, true);
  const std::optional<GpuGradients> g = run(p);
  if (!g) return;
  expect_gradients_match_reference(p, *g);
}

}  // namespace
}  // namespace flash_dmattn::test
