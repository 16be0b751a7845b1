// Packed sequences (ForwardArgs::sequences) on the CUDA backend: the forward of a packed batch,
// each sequence's rows of out and lse against the fp64 reference of that sequence alone. The mask
// and bias lie in the (B, H|Hk|1, max_q|1, max_k) layout with random values at the positions no
// sequence reads, q, k and v with padded rows; lengths 1, odd, equal, longer keys than queries
// and the reverse, a sequence without keys; causal (each sequence's own diagonal) or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

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
};

class PackedSequencesForward : public GpuParamTest<PackedCase> {};

TEST_P(PackedSequencesForward, EachSequenceMatchesItsReference) {
  const PackedCase& c = GetParam();
  auto rng = test_rng();
  const auto B = static_cast<std::int64_t>(c.lengths_q.size());
  const std::int64_t max_q = *std::max_element(c.lengths_q.begin(), c.lengths_q.end()) + 3;
  const std::int64_t max_k = *std::max_element(c.lengths_k.begin(), c.lengths_k.end()) + 5;
  std::vector<ForwardProblem> alone;
  std::vector<std::int64_t> first_q(B + 1, 0), first_k(B + 1, 0);
  for (std::int64_t b = 0; b < B; ++b) {
    ForwardCase fc;
    fc.n = Sizes{1, c.lengths_q[b], c.lengths_k[b], c.H, c.Hk, c.D};
    fc.mask = OperandShape{true, c.mask.heads, c.mask.query, true};
    fc.bias = OperandShape{true, c.bias.heads, c.bias.query, true};
    fc.causal = c.causal;
    alone.push_back(ForwardProblem::random(fc, rng));
    first_q[b + 1] = first_q[b] + c.lengths_q[b];
    first_k[b + 1] = first_k[b] + c.lengths_k[b];
  }
  // The packed inputs: every sequence's rows back to back, its mask and bias at [b, :, :Lq, :Lk].
  const std::int64_t mask_heads = c.mask.heads == 0 ? c.H : c.mask.heads, bias_heads = c.bias.heads == 0 ? c.H : c.bias.heads;
  HostTensor q = HostTensor::empty(DType::bfloat16, {first_q[B], c.H, c.D}, 8);
  HostTensor k = HostTensor::empty(DType::bfloat16, {first_k[B], c.Hk, c.D}, 8);
  HostTensor v = HostTensor::empty(DType::bfloat16, {first_k[B], c.Hk, c.D});
  HostTensor mask = HostTensor::random(DType::boolean, {B, mask_heads, c.mask.query ? max_q : 1, max_k}, rng, 0.5);
  HostTensor bias = HostTensor::random(DType::bfloat16, {B, bias_heads, c.bias.query ? max_q : 1, max_k}, rng);
  HostTensor cu_q = HostTensor::empty(DType::int32, {B + 1}), cu_k = HostTensor::empty(DType::int32, {B + 1});
  for (std::int64_t b = 0; b <= B; ++b) {
    cu_q.set(b, static_cast<double>(first_q[b]));
    cu_k.set(b, static_cast<double>(first_k[b]));
  }
  for (std::int64_t b = 0; b < B; ++b) {
    const ForwardProblem& s = alone[b];
    auto place_rows = [&](HostTensor& packed, const HostTensor& one, std::int64_t first) {
      const TensorView& o = one.view;
      for (std::int64_t i = 0; i < o.shape[1]; ++i)
        for (std::int64_t h = 0; h < o.shape[2]; ++h)
          for (std::int64_t d = 0; d < o.shape[3]; ++d)
            packed.set((first + i) * packed.view.stride[0] + h * packed.view.stride[1] + d,
                       one.get(host::offset4(o, 0, i, h, d)));
    };
    place_rows(q, s.q, first_q[b]);
    place_rows(k, s.k, first_k[b]);
    place_rows(v, s.v, first_k[b]);
    auto place_operand = [&](HostTensor& packed, const HostTensor& one) {
      const TensorView& o = one.view;
      for (std::int64_t h = 0; h < o.shape[1]; ++h)
        for (std::int64_t i = 0; i < o.shape[2]; ++i)
          for (std::int64_t j = 0; j < o.shape[3]; ++j)
            packed.set(host::offset4(packed.view, b, h, i, j), one.get(host::offset4(o, 0, h, i, j)));
    };
    place_operand(mask, *s.mask);
    place_operand(bias, *s.bias);
  }

  const DeviceTensor dq = DeviceTensor::upload(q), dk = DeviceTensor::upload(k), dv = DeviceTensor::upload(v);
  const DeviceTensor dmask = DeviceTensor::upload(mask), dbias = DeviceTensor::upload(bias);
  const DeviceTensor dcu_q = DeviceTensor::upload(cu_q), dcu_k = DeviceTensor::upload(cu_k);
  const DeviceTensor out = DeviceTensor::poisoned(HostTensor::empty(DType::bfloat16, {first_q[B], c.H, c.D}));
  const DeviceTensor lse = DeviceTensor::poisoned(HostTensor::empty(DType::float32, {c.H, first_q[B]}));
  ForwardArgs a;
  a.q = dq.view(), a.k = dk.view(), a.v = dv.view(), a.mask = dmask.view(), a.bias = dbias.view();
  a.out = out.view(), a.lse = lse.view();
  a.sequences = PackedSequences{dcu_q.view(), dcu_k.view(), max_q, max_k};
  a.options.causal = c.causal;
  a.options.stream = stream();
  std::size_t bytes = 0;
  Status status = forward_workspace_size(a, &bytes);
  if (head_dim_not_compiled(status)) GTEST_SKIP() << status.message();
  ASSERT_TRUE(status.ok()) << status.message();
  DeviceBuffer workspace(bytes);
  a.workspace = workspace.workspace();
  status = forward(a);
  ASSERT_TRUE(status.ok()) << status.message();
  cuda_check(cudaStreamSynchronize(stream()), "synchronize");
  const HostTensor packed_out = out.download(), packed_lse = lse.download();
  EXPECT_TRUE(out.untouched_outside_view("out"));
  EXPECT_TRUE(lse.untouched_outside_view("lse"));

  for (std::int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " (" + std::to_string(c.lengths_q[b]) + " x " +
                 std::to_string(c.lengths_k[b]) + ")");
    const ForwardProblem& s = alone[b];
    GpuOutputs gpu{HostTensor::empty(DType::bfloat16, {1, c.lengths_q[b], c.H, c.D}),
                   HostTensor::empty(DType::float32, {1, c.H, c.lengths_q[b]})};
    for (std::int64_t i = 0; i < c.lengths_q[b]; ++i)
      for (std::int64_t h = 0; h < c.H; ++h) {
        for (std::int64_t d = 0; d < c.D; ++d) {
          gpu.out.set(host::offset4(gpu.out.view, 0, i, h, d),
                      packed_out.get((first_q[b] + i) * packed_out.view.stride[0] + h * packed_out.view.stride[1] + d));
        }
        gpu.lse.set(h * gpu.lse.view.stride[1] + i, packed_lse.get(h * packed_lse.view.stride[0] + first_q[b] + i));
      }
    expect_outputs_match_reference(s, gpu);
    if (test_stopped()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PackedSequencesForward,
    ::testing::Values(PackedCase{{5, 1, 130, 0, 64}, {5, 77, 130, 9, 0}, 4, 2, 64, {true, 2, true, true},
                                 {true, 4, false, true}, true},
                      PackedCase{{200, 33}, {64, 300}, 2, 2, 128, {true, 1, true, true}, {true, 2, true, true}, false},
                      PackedCase{{17, 17, 17}, {17, 17, 17}, 8, 1, 64, {true, 8, false, true}, {true, 1, true, true},
                                 true}));

}  // namespace
}  // namespace flash_dmattn::test
