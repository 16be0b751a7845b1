// How the GPU forward runs rather than what it computes: the queries name a CUDA backend, two
// runs are bitwise equal, the call can be captured in a CUDA graph on a non-default stream and
// replayed, and the workspace is required (with a mask), checked and left to the caller to
// allocate before any capture.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

#include "forward_harness.h"

namespace flash_dmattn::test {
namespace {

// A mid-sized masked, biased, causal problem used by every test here.
ForwardProblem runtime_problem(std::mt19937_64& rng) {
  ForwardCase c;
  c.n = Sizes{2, 300, 700, 4, 2, 128};
  c.mask = OperandShape{true, c.n.Hk, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  c.causal = true;
  return ForwardProblem::random(c, rng);
}

class Runtime : public GpuTest {};

TEST_F(Runtime, QueryNamesACudaBackend) {
  auto rng = test_rng();
  const ForwardProblem p = runtime_problem(rng);
  GpuForward gpu(p, stream());
  gpu.prepare();
  if (test_stopped()) return;
  Capability capability;
  ASSERT_TRUE(query_forward(gpu.args(), &capability).ok());
  EXPECT_TRUE(capability.backend == Backend::cuda_sm80 || capability.backend == Backend::cuda_sm90)
      << backend_name(capability.backend);
  EXPECT_GE(capability.arch, 80);
  EXPECT_FALSE(capability.description.empty());
}

TEST_F(Runtime, TwoRunsAreBitwiseEqual) {
  auto rng = test_rng();
  const ForwardProblem p = runtime_problem(rng);
  GpuForward gpu(p, stream());
  gpu.prepare();
  if (test_stopped()) return;
  ASSERT_TRUE(gpu.run().ok());
  const GpuOutputs first = gpu.finish();
  gpu.poison_outputs();
  ASSERT_TRUE(gpu.run().ok());
  const GpuOutputs second = gpu.finish();
  EXPECT_TRUE(first.out.bytes == second.out.bytes) << "out differs between two runs";
  EXPECT_TRUE(first.lse.bytes == second.lse.bytes) << "lse differs between two runs";
  expect_outputs_match_reference(p, first);
}

// FLASH_DMATTN_KERNELS picks the forward's kernel family (to test both on a Hopper GPU); a value
// it does not know is an error that names the variable and the value, before any launch.
TEST_F(Runtime, KernelsVariableIsValidated) {
  auto rng = test_rng();
  const ForwardProblem p = runtime_problem(rng);
  GpuForward gpu(p, stream());
  gpu.prepare();
  if (test_stopped()) return;
  constexpr const char* kVariable = "FLASH_DMATTN_KERNELS";
  const char* saved = std::getenv(kVariable);
  const std::string previous = saved ? saved : "";
  setenv(kVariable, "sm70", 1);
  const Status status = gpu.run();
  if (saved) {
    setenv(kVariable, previous.c_str(), 1);
  } else {
    unsetenv(kVariable);
  }
  EXPECT_EQ(status.code(), StatusCode::invalid_argument) << status.message();
  EXPECT_NE(status.message().find(kVariable), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("'sm70'"), std::string::npos) << status.message();
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

TEST_F(Runtime, CudaGraphReplaysMatchTheDirectCall) {
  auto rng = test_rng();
  const ForwardProblem p = runtime_problem(rng);
  GpuForward direct(p, stream());
  direct.prepare();
  if (test_stopped()) return;
  ASSERT_TRUE(direct.run().ok());
  const GpuOutputs expected = direct.finish();
  expect_outputs_match_reference(p, expected);

  // The workspace is allocated by prepare(), before the capture: cudaMalloc may not be captured.
  GpuForward graphed(p, stream());
  graphed.prepare();
  if (test_stopped()) return;
  CapturedGraph captured;
  cuda_check(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  const Status status = graphed.run();
  const cudaError_t end = cudaStreamEndCapture(stream(), &captured.graph);
  ASSERT_TRUE(status.ok()) << "forward during capture: " << status.message();
  ASSERT_EQ(end, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(end);
  cuda_check(cudaGraphInstantiate(&captured.exec, captured.graph, 0), "cudaGraphInstantiate");
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    graphed.poison_outputs();
    cuda_check(cudaGraphLaunch(captured.exec, stream()), "cudaGraphLaunch");
    const GpuOutputs replayed = graphed.finish();
    EXPECT_TRUE(replayed.out.bytes == expected.out.bytes) << "out of the replay differs from the direct call";
    EXPECT_TRUE(replayed.lse.bytes == expected.lse.bytes) << "lse of the replay differs from the direct call";
  }
}

TEST_F(Runtime, WorkspaceIsRequiredAndChecked) {
  auto rng = test_rng();
  const ForwardProblem p = runtime_problem(rng);
  GpuForward gpu(p, stream());
  gpu.prepare();
  if (test_stopped()) return;
  std::size_t required = 0;
  ASSERT_TRUE(forward_workspace_size(gpu.args(), &required).ok());
  ASSERT_GT(required, 0u) << "a masked forward keeps its tile summary in the workspace";
  ASSERT_EQ(gpu.args().workspace.bytes, required);

  const DeviceBuffer roomy(required + kWorkspaceAlignment);
  const Workspace rejected[] = {
      {gpu.args().workspace.data, required - 1},                              // one byte short
      {nullptr, required},                                                    // no memory
      {static_cast<char*>(roomy.data()) + 16, required},                     // misaligned
  };
  for (const Workspace& workspace : rejected) {
    ForwardArgs args = gpu.args();
    args.workspace = workspace;
    const Status status = forward(args);
    EXPECT_EQ(status.code(), StatusCode::invalid_argument) << status.message();
    EXPECT_NE(status.message().find("'workspace'"), std::string::npos) << status.message();
  }
  // The rejected calls wrote nothing: the outputs still hold only the poison.
  const GpuOutputs untouched = gpu.finish();
  for (const unsigned char byte : untouched.out.bytes) ASSERT_EQ(byte, 0xFF);
  for (const unsigned char byte : untouched.lse.bytes) ASSERT_EQ(byte, 0xFF);

  ASSERT_TRUE(gpu.run().ok());
  expect_outputs_match_reference(p, gpu.finish());
}

}  // namespace
}  // namespace flash_dmattn::test
