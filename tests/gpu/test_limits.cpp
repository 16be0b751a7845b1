// The edges of the shape space and of the runtime: grids past CUDA's 65,535 CTAs in grid.y and
// grid.z (batch x heads of batched short sequences), the smallest problem, a million and two
// million keys, calls from several host threads on streams of their own at once, and tensors on a
// device that is not the current one (where the machine has two GPUs).
#include <cuda_runtime_api.h>

#include <memory>
#include <thread>
#include <vector>

#include "backward_harness.h"
#include "forward_harness.h"

namespace flash_dmattn::test {
namespace {

class Limits : public GpuTest {};

// Runs the forward of a problem too large for a whole reference, and checks its first and last
// `rows` query rows.
void expect_end_rows_match_reference(const ForwardProblem& p, std::int64_t rows, cudaStream_t stream) {
  GpuForward gpu(p, stream);
  gpu.prepare();
  if (test_stopped()) return;
  const Status status = gpu.run();
  ASSERT_TRUE(status.ok()) << status.message();
  const GpuOutputs out = gpu.finish();
  expect_rows_match_reference(p, out, 0, rows);
  expect_rows_match_reference(p, out, p.n.Sq - rows, rows);
}

// 1250 sequences of 16 tokens with 80 query heads (B·H = 100,000, the tried case that failed
// with "the tile summary launch failed"): a mask per query head gives the summary 100,000
// (batch, head) pairs, and the forward grid 1250 batches of 80 heads.
TEST_F(Limits, ManyShortSequencesForward) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{1250, 16, 16, 80, 8, 64};
  c.mask = OperandShape{true, 0, true, true};
  c.bias = OperandShape{true, c.n.Hk, false, true};
  expect_forward_matches_reference(ForwardProblem::random(c, rng), stream());
}

// 66,000 sequences of one head, causal, with dBias: the backward grid's batch and, at D = 128 on
// sm90a, the dQ kernel's, past 65,535.
TEST_F(Limits, ManyShortSequencesBackward) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{66000, 16, 16, 1, 1, 128};
  c.mask = OperandShape{true, 1, true, true};
  c.bias = OperandShape{true, 1, false, true};
  c.causal = true;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

TEST_F(Limits, OneOfEverything) {
  auto rng = test_rng();
  BackwardCase c;
  c.n = Sizes{1, 1, 1, 1, 1, 64};
  c.mask = OperandShape{true, 1, true, true};
  c.density = 1.0;
  c.bias = OperandShape{true, 1, true, true};
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
  c.causal = true;
  expect_backward_matches_reference(BackwardProblem::random(c, rng), stream());
}

// A million queries and keys at D = 32, causal, with a key mask and a bias row: checked on the
// first and last 64 query rows (the last see every key), which the reference can afford.
TEST_F(Limits, MillionTokenForward) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{1, 1 << 20, 1 << 20, 2, 1, 32};
  c.mask = OperandShape{false, 1, false, true};
  c.density = 0.7;
  c.bias = OperandShape{false, 1, false, true};
  c.causal = true;
  expect_end_rows_match_reference(ForwardProblem::random(c, rng), 64, stream());
}

// Two million keys for a few hundred queries (long-context prefill of a chunk), a mask per query
// row: split-KV partials and the summary over 2^21 keys; checked on its first and last 8 rows.
TEST_F(Limits, TwoMillionKeysForward) {
  auto rng = test_rng();
  ForwardCase c;
  c.n = Sizes{1, 200, 1 << 21, 2, 1, 64};
  c.mask = OperandShape{false, 1, true, true};
  c.density = 0.3;
  c.bias = OperandShape{false, 1, false, true};
  expect_end_rows_match_reference(ForwardProblem::random(c, rng), 8, stream());
}

// Four host threads, each with its own stream and problem, calling the (deterministic) backward
// at once: every result equals the same call made alone, byte for byte.
TEST_F(Limits, ConcurrentCallsFromThreadsMatchSerialCalls) {
  constexpr int kThreads = 4, kRounds = 3;
  auto rng = test_rng();
  std::vector<BackwardProblem> problems;
  for (int t = 0; t < kThreads; ++t) {
    BackwardCase c;
    c.n = Sizes{2, 200 + 37 * t, 333 + 64 * t, 4, t % 2 ? 2 : 4, t % 2 ? 64 : 128};
    c.mask = OperandShape{true, c.n.Hk, true, true};
    c.bias = OperandShape{true, c.n.Hk, false, true};
    c.causal = t % 2 == 0;
    c.deterministic = true;  // the default mode's dQ sums may land in any order
    problems.push_back(BackwardProblem::random(c, rng));
  }
  std::vector<Stream> streams(kThreads);
  std::vector<std::unique_ptr<GpuBackward>> gpus;
  std::vector<GpuGradients> alone;
  for (int t = 0; t < kThreads; ++t) {
    gpus.push_back(std::make_unique<GpuBackward>(problems[t], streams[t].get()));
    gpus[t]->prepare();
    if (test_stopped()) return;
    const Status status = gpus[t]->run();
    ASSERT_TRUE(status.ok()) << status.message();
    alone.push_back(gpus[t]->finish());
    expect_gradients_match_reference(problems[t], alone[t]);
  }
  std::vector<Status> statuses(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds && statuses[t].ok(); ++r) statuses[t] = gpus[t]->run();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(statuses[t].ok()) << "thread " << t << ": " << statuses[t].message();
    const GpuGradients together = gpus[t]->finish();
    EXPECT_TRUE(together.dq.bytes == alone[t].dq.bytes) << "thread " << t << ": dq differs from the call alone";
    EXPECT_TRUE(together.dk.bytes == alone[t].dk.bytes) << "thread " << t << ": dk differs from the call alone";
    EXPECT_TRUE(together.dv.bytes == alone[t].dv.bytes) << "thread " << t << ": dv differs from the call alone";
    if (alone[t].dbias) {
      EXPECT_TRUE(together.dbias->bytes == alone[t].dbias->bytes) << "thread " << t << ": dbias differs";
    }
  }
}

// Tensors and stream on cuda:1 while cuda:0 is current: the library launches on the tensors'
// device (a launch on the current one would fault or read another device's memory) and leaves
// cuda:0 current. Forward and backward, on the sm90a path where it applies.
TEST_F(Limits, TensorsOnADeviceThatIsNotCurrent) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  auto rng = test_rng();
  ForwardCase f;
  f.n = Sizes{2, 300, 517, 8, 2, 128};
  f.mask = OperandShape{true, f.n.Hk, true, true};
  f.bias = OperandShape{true, f.n.Hk, false, true};
  f.causal = true;
  const ForwardProblem forward_problem = ForwardProblem::random(f, rng);
  BackwardCase b;
  b.n = f.n;
  b.mask = f.mask;
  b.bias = f.bias;
  b.causal = true;
  const BackwardProblem backward_problem = BackwardProblem::random(b, rng);
  // Everything the calls read or write is made on cuda:1.
  cuda_check(cudaSetDevice(1), "cudaSetDevice");
  Stream stream_1;
  GpuForward forward_gpu(forward_problem, stream_1.get());
  forward_gpu.prepare();
  GpuBackward backward_gpu(backward_problem, stream_1.get());
  if (!test_stopped()) backward_gpu.prepare();
  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  if (test_stopped()) return;
  Status status = forward_gpu.run();
  ASSERT_TRUE(status.ok()) << "forward: " << status.message();
  status = backward_gpu.run();
  ASSERT_TRUE(status.ok()) << "backward: " << status.message();
  int current = -1;
  cuda_check(cudaGetDevice(&current), "cudaGetDevice");
  EXPECT_EQ(current, 0) << "the calls left another device current";
  expect_outputs_match_reference(forward_problem, forward_gpu.finish());
  expect_gradients_match_reference(backward_problem, backward_gpu.finish());
}

}  // namespace
}  // namespace flash_dmattn::test
