// Packed sequences (ForwardArgs::sequences, BackwardArgs::sequences) on the CUDA backend: the
// forward of a packed batch, each sequence's rows of out and lse against the fp64 reference of that
// sequence alone; the backward likewise for dq, dk, dv and dbias (whose positions that no sequence
// reads must be 0). The mask
// and bias lie in the (B, H|Hk|1, max_q|1, max_k) layout with random values at the positions no
// sequence reads, q, k and v with padded rows; lengths 1, odd, equal, longer keys than queries
// and the reverse, a sequence without keys; causal (each sequence's own diagonal) or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "device_tensor.h"
#include "forward_harness.h"
#include "test_util.h"

namespace flash_dmattn::test {
namespace {

struct PackedCase {
  std::vector<std::int64_t> lengths_q, lengths_k;
  std::int64_t H, Hk, D;
  OperandShape mask, bias;  // batch full; heads, rows and keys as given
  bool causal;
  double softcap = 0.0;
};

// The sequences of a case, each a problem of its own (a batch of one), and the packed tensors
// that hold them all: rows back to back, mask and bias at [b, :, :Lq, :Lk] of (B, .., max_q|1,
// max_k) with random values elsewhere.
struct PackedBatch {
  std::int64_t B = 0, max_q = 0, max_k = 0;
  std::vector<std::int64_t> first_q, first_k;  // B + 1 offsets each
  HostTensor q, k, v, mask, bias, cu_q, cu_k;

  // Sequence b's rows of a packed (total, heads, D) tensor into `one` (1, L, heads, D), and back.
  static void unpack_rows(const HostTensor& packed, std::int64_t first, HostTensor& one) {
    const TensorView& o = one.view;
    for (std::int64_t i = 0; i < o.shape[1]; ++i)
      for (std::int64_t h = 0; h < o.shape[2]; ++h)
        for (std::int64_t d = 0; d < o.shape[3]; ++d)
          one.set(host::offset4(o, 0, i, h, d), packed.get((first + i) * packed.view.stride[0] + h * packed.view.stride[1] + d));
  }
  static void pack_rows(HostTensor& packed, std::int64_t first, const HostTensor& one) {
    const TensorView& o = one.view;
    for (std::int64_t i = 0; i < o.shape[1]; ++i)
      for (std::int64_t h = 0; h < o.shape[2]; ++h)
        for (std::int64_t d = 0; d < o.shape[3]; ++d)
          packed.set((first + i) * packed.view.stride[0] + h * packed.view.stride[1] + d, one.get(host::offset4(o, 0, i, h, d)));
  }

  template <typename Problem>
  PackedBatch(const PackedCase& c, const std::vector<Problem>& alone, std::mt19937_64& rng)
      : B(static_cast<std::int64_t>(alone.size())), first_q(B + 1, 0), first_k(B + 1, 0) {
    max_q = *std::max_element(c.lengths_q.begin(), c.lengths_q.end()) + 3;
    max_k = *std::max_element(c.lengths_k.begin(), c.lengths_k.end()) + 5;
    for (std::int64_t b = 0; b < B; ++b) {
      first_q[b + 1] = first_q[b] + c.lengths_q[b];
      first_k[b + 1] = first_k[b] + c.lengths_k[b];
    }
    const std::int64_t mask_heads = c.mask.heads == 0 ? c.H : c.mask.heads, bias_heads = c.bias.heads == 0 ? c.H : c.bias.heads;
    q = HostTensor::empty(DType::bfloat16, {first_q[B], c.H, c.D}, 8);
    k = HostTensor::empty(DType::bfloat16, {first_k[B], c.Hk, c.D}, 8);
    v = HostTensor::empty(DType::bfloat16, {first_k[B], c.Hk, c.D});
    mask = HostTensor::random(DType::boolean, {B, mask_heads, c.mask.query ? max_q : 1, max_k}, rng, 0.5);
    bias = HostTensor::random(DType::bfloat16, {B, bias_heads, c.bias.query ? max_q : 1, max_k}, rng);
    cu_q = HostTensor::empty(DType::int32, {B + 1});
    cu_k = HostTensor::empty(DType::int32, {B + 1});
    for (std::int64_t b = 0; b <= B; ++b) {
      cu_q.set(b, static_cast<double>(first_q[b]));
      cu_k.set(b, static_cast<double>(first_k[b]));
    }
    auto place_operand = [&](HostTensor& packed, const HostTensor& one, std::int64_t b) {
      const TensorView& o = one.view;
      for (std::int64_t h = 0; h < o.shape[1]; ++h)
        for (std::int64_t i = 0; i < o.shape[2]; ++i)
          for (std::int64_t j = 0; j < o.shape[3]; ++j)
            packed.set(host::offset4(packed.view, b, h, i, j), one.get(host::offset4(o, 0, h, i, j)));
    };
    for (std::int64_t b = 0; b < B; ++b) {
      pack_rows(q, first_q[b], alone[b].q);
      pack_rows(k, first_k[b], alone[b].k);
      pack_rows(v, first_k[b], alone[b].v);
      place_operand(mask, *alone[b].mask, b);
      place_operand(bias, *alone[b].bias, b);
    }
  }
};

ForwardCase sequence_case(const PackedCase& c, std::int64_t b) {
  ForwardCase fc;
  fc.n = Sizes{1, c.lengths_q[b], c.lengths_k[b], c.H, c.Hk, c.D};
  fc.mask = OperandShape{true, c.mask.heads, c.mask.query, true};
  fc.bias = OperandShape{true, c.bias.heads, c.bias.query, true};
  fc.causal = c.causal;
  fc.softcap = c.softcap;
  return fc;
}

// The packed call's device tensors and its forward; `forward_done` false where the build skips.
struct PackedCall {
  DeviceTensor q, k, v, mask, bias, cu_q, cu_k, out, lse;
  ForwardArgs args;
  DeviceBuffer workspace;

  PackedCall(const PackedBatch& p, const PackedCase& c, cudaStream_t stream)
      : q(DeviceTensor::upload(p.q)), k(DeviceTensor::upload(p.k)), v(DeviceTensor::upload(p.v)),
        mask(DeviceTensor::upload(p.mask)), bias(DeviceTensor::upload(p.bias)), cu_q(DeviceTensor::upload(p.cu_q)),
        cu_k(DeviceTensor::upload(p.cu_k)),
        out(DeviceTensor::poisoned(HostTensor::empty(DType::bfloat16, {p.first_q[p.B], c.H, c.D}))),
        lse(DeviceTensor::poisoned(HostTensor::empty(DType::float32, {c.H, p.first_q[p.B]}))) {
    args.q = q.view(), args.k = k.view(), args.v = v.view(), args.mask = mask.view(), args.bias = bias.view();
    args.out = out.view(), args.lse = lse.view();
    args.sequences = PackedSequences{cu_q.view(), cu_k.view(), p.max_q, p.max_k};
    args.options.causal = c.causal;
    args.options.softcap = c.softcap;
    args.options.stream = stream;
  }

  // Runs the forward: false where it failed, or where the build did not compile the head dim (the
  // test is then skipped).
  bool forward_ran() {
    std::size_t bytes = 0;
    Status status = forward_workspace_size(args, &bytes);
    if (head_dim_not_compiled(status)) {
      [&] { GTEST_SKIP() << status.message(); }();  // (test_stopped() is then true)
      return false;
    }
    EXPECT_TRUE(status.ok()) << status.message();
    if (!status.ok()) return false;
    workspace = DeviceBuffer(bytes);
    args.workspace = workspace.workspace();
    // The uploads above are synchronous copies from pageable memory that the call's stream does
    // not wait for: finish them first (as the harnesses do).
    cuda_check(cudaDeviceSynchronize(), "uploads");
    status = forward(args);
    EXPECT_TRUE(status.ok()) << status.message();
    return status.ok();
  }
};

class PackedSequencesForward : public GpuParamTest<PackedCase> {};

TEST_P(PackedSequencesForward, EachSequenceMatchesItsReference) {
  const PackedCase& c = GetParam();
  auto rng = test_rng();
  std::vector<ForwardProblem> alone;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(c.lengths_q.size()); ++b) {
    alone.push_back(ForwardProblem::random(sequence_case(c, b), rng));
  }
  const PackedBatch p(c, alone, rng);
  PackedCall call(p, c, stream());
  if (!call.forward_ran() || test_stopped()) return;
  cuda_check(cudaStreamSynchronize(stream()), "synchronize");
  const HostTensor packed_out = call.out.download(), packed_lse = call.lse.download();
  EXPECT_TRUE(call.out.untouched_outside_view("out"));
  EXPECT_TRUE(call.lse.untouched_outside_view("lse"));

  for (std::int64_t b = 0; b < p.B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " (" + std::to_string(c.lengths_q[b]) + " x " +
                 std::to_string(c.lengths_k[b]) + ")");
    GpuOutputs gpu{HostTensor::empty(DType::bfloat16, {1, c.lengths_q[b], c.H, c.D}),
                   HostTensor::empty(DType::float32, {1, c.H, c.lengths_q[b]})};
    PackedBatch::unpack_rows(packed_out, p.first_q[b], gpu.out);
    for (std::int64_t i = 0; i < c.lengths_q[b]; ++i)
      for (std::int64_t h = 0; h < c.H; ++h)
        gpu.lse.set(h * gpu.lse.view.stride[1] + i, packed_lse.get(h * packed_lse.view.stride[0] + p.first_q[b] + i));
    expect_outputs_match_reference(alone[b], gpu);
    if (test_stopped()) return;
  }
}

// The backward of the packed forward's out and lse: each sequence's gradients against its own
// reference (whose forward recomputes out; the packed call's Δ reads the packed out, as the
// backward harness's GPU calls read theirs), and dbias 0 where no sequence reads the bias.
class PackedSequencesBackward : public GpuParamTest<PackedCase> {};

TEST_P(PackedSequencesBackward, EachSequenceMatchesItsReference) {
  const PackedCase& c = GetParam();
  auto rng = test_rng();
  std::vector<BackwardProblem> alone;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(c.lengths_q.size()); ++b) {
    BackwardCase bc;
    static_cast<ForwardCase&>(bc) = sequence_case(c, b);
    alone.push_back(BackwardProblem::random(bc, rng));
  }
  const PackedBatch p(c, alone, rng);
  HostTensor dout = HostTensor::empty(DType::bfloat16, {p.first_q[p.B], c.H, c.D});
  for (std::int64_t b = 0; b < p.B; ++b) PackedBatch::pack_rows(dout, p.first_q[b], alone[b].dout);
  PackedCall call(p, c, stream());
  if (!call.forward_ran() || test_stopped()) return;
  const DeviceTensor ddout = DeviceTensor::upload(dout);
  const DeviceTensor dq = DeviceTensor::poisoned(p.q), dk = DeviceTensor::poisoned(p.k), dv = DeviceTensor::poisoned(p.v);
  const DeviceTensor dbias = DeviceTensor::poisoned(p.bias);
  BackwardArgs a;
  a.q = call.args.q, a.k = call.args.k, a.v = call.args.v, a.mask = call.args.mask, a.bias = call.args.bias;
  a.out = call.args.out, a.lse = call.args.lse, a.dout = ddout.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view(), a.dbias = dbias.view();
  a.sequences = call.args.sequences;
  a.options = call.args.options;
  a.deterministic = alone[0].deterministic;  // (FLASH_DMATTN_TEST_DETERMINISTIC=1)
  std::size_t bytes = 0;
  Status status = backward_workspace_size(a, &bytes);
  if (head_dim_not_compiled(status)) GTEST_SKIP() << status.message();
  ASSERT_TRUE(status.ok()) << status.message();
  DeviceBuffer workspace(bytes);
  a.workspace = workspace.workspace();
  // Scratch full of 0xFF, as the backward harness gives it: the accumulators must be zeroed by the call.
  if (bytes > 0) cuda_check(cudaMemsetAsync(workspace.data(), 0xFF, bytes, stream()), "cudaMemsetAsync (workspace)");
  cuda_check(cudaDeviceSynchronize(), "uploads");
  status = backward(a);
  ASSERT_TRUE(status.ok()) << status.message();
  cuda_check(cudaStreamSynchronize(stream()), "synchronize");
  const HostTensor got_dq = dq.download(), got_dk = dk.download(), got_dv = dv.download();
  const HostTensor got_dbias = dbias.download(), packed_out = call.out.download();
  for (const DeviceTensor* t : {&dq, &dk, &dv, &dbias}) EXPECT_TRUE(t->untouched_outside_view("gradient"));

  for (std::int64_t b = 0; b < p.B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " (" + std::to_string(c.lengths_q[b]) + " x " +
                 std::to_string(c.lengths_k[b]) + ")");
    const BackwardProblem& s = alone[b];
    GpuGradients gpu{s.dq, s.dk, s.dv, s.dbias, s.out};
    PackedBatch::unpack_rows(got_dq, p.first_q[b], gpu.dq);
    PackedBatch::unpack_rows(got_dk, p.first_k[b], gpu.dk);
    PackedBatch::unpack_rows(got_dv, p.first_k[b], gpu.dv);
    PackedBatch::unpack_rows(packed_out, p.first_q[b], gpu.out);
    const TensorView& o = gpu.dbias->view;
    for (std::int64_t h = 0; h < o.shape[1]; ++h)
      for (std::int64_t i = 0; i < o.shape[2]; ++i)
        for (std::int64_t j = 0; j < o.shape[3]; ++j)
          gpu.dbias->set(host::offset4(o, 0, h, i, j), got_dbias.get(host::offset4(got_dbias.view, b, h, i, j)));
    expect_gradients_match_reference(s, gpu);
    if (test_stopped()) return;
    // Bias positions past the sequence's lengths: no sequence reads them.
    const TensorView& g = got_dbias.view;
    for (std::int64_t h = 0; h < g.shape[1]; ++h)
      for (std::int64_t i = 0; i < g.shape[2]; ++i)
        for (std::int64_t j = 0; j < g.shape[3]; ++j) {
          if ((g.shape[2] == 1 || i < c.lengths_q[b]) && j < c.lengths_k[b]) continue;
          ASSERT_EQ(got_dbias.get(host::offset4(g, b, h, i, j)), 0.0) << "dbias[" << b << ", " << h << ", " << i << ", " << j << "]";
        }
  }
}

// Sequences: lengths 0, 1, odd and long; keys longer than queries and the reverse; GQA and MQA;
// head dims 32, 64 and 128.
const auto kCases =
    ::testing::Values(PackedCase{{5, 1, 130, 0, 64}, {5, 77, 130, 9, 0}, 4, 2, 64, {true, 2, true, true},
                                 {true, 4, false, true}, true},
                      PackedCase{{200, 33}, {64, 300}, 2, 2, 128, {true, 1, true, true}, {true, 2, true, true}, false},
                      PackedCase{{17, 17, 17}, {17, 17, 17}, 8, 1, 64, {true, 8, false, true}, {true, 1, true, true},
                                 true, 5.0},
                      // A bias row per (batch, head) of max_k = 136 keys: the sm90a TMA forward stages it by
                      // bulk copies, whose sizes a sequence's key count (100, 45) must not break.
                      PackedCase{{77, 20, 131}, {100, 131, 45}, 4, 2, 64, {true, 2, true, true}, {true, 2, false, true},
                                 true},
                      // D32: its own sm90a backward tiles (128 keys, as at D64).
                      PackedCase{{5, 1, 260, 0, 64}, {5, 77, 130, 9, 200}, 4, 2, 32, {true, 2, true, true},
                                 {true, 4, false, true}, true});

INSTANTIATE_TEST_SUITE_P(Cases, PackedSequencesForward, kCases);
INSTANTIATE_TEST_SUITE_P(Cases, PackedSequencesBackward, kCases);

}  // namespace
}  // namespace flash_dmattn::test
