// Bit-packed masks (uint8, 8 keys a byte): the reference and the CPU backend give bitwise the
// results of the bool mask they pack, in every broadcast form, with padded rows and bits past Sk
// that are set (never read), packed sequences and KV caches included; and the checks.
#include <string>
#include <vector>

#include "reference_problem.h"

namespace flash_dmattn::test {
namespace {

void expect_same(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t e = 0; e < got.size(); ++e) {
    // Both are the same fp64 computation: equal, or both empty rows (+inf lse).
    ASSERT_EQ(got[e], want[e]) << what << " element " << e;
  }
}

// A reference forward (`run`, over packed sequences or a cache) gives the same out and lse with
// the bool mask and with its packing.
template <typename Run>
void expect_packing_changes_nothing(const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& mask,
                                    std::mt19937_64& rng, Run run) {
  const HostTensor bits = pack(mask, rng);
  reference::Inputs in;
  in.q = q.view;
  in.k = k.view;
  in.v = v.view;
  in.scale = 0.3;
  in.causal = true;
  in.mask = &mask.view;
  const reference::ForwardResult want = run(in);
  in.mask = &bits.view;
  const reference::ForwardResult got = run(in);
  expect_same(got.out, want.out, "out");
  expect_same(got.lse, want.lse, "lse");
}

TEST(PackedMask, ReferenceMatchesTheBoolMaskItPacks) {
  auto rng = test_rng();
  const Sizes n{2, 5, 19, 4, 2, 8};  // 19 keys: the last byte holds three
  const std::vector<OperandShape> forms = {
      {true, 0, true, true}, {false, 2, true, true}, {true, 1, false, true}, {false, 1, true, true}};
  for (size_t f = 0; f < forms.size(); ++f) {
    SCOPED_TRACE("mask form " + std::to_string(f));
    RefProblem p = RefProblem::random(n, rng, forms[f], OperandShape{true, 2, false, true}, 0.5);
    p.causal = f % 2 == 0;
    p.softcap = f == 3 ? 4.0 : 0.0;
    const HostTensor bits = pack(*p.mask, rng);
    reference::Inputs packed = p.inputs();
    packed.mask = &bits.view;
    const reference::ForwardResult want = reference::forward(p.inputs()), got = reference::forward(packed);
    expect_same(got.out, want.out, "out");
    expect_same(got.lse, want.lse, "lse");
    const reference::Gradients gw = reference::backward(p.inputs(), p.dout.view);
    const reference::Gradients gg = reference::backward(packed, p.dout.view);
    expect_same(gg.dq, gw.dq, "dq");
    expect_same(gg.dk, gw.dk, "dk");
    expect_same(gg.dv, gw.dv, "dv");
    expect_same(gg.dbias, gw.dbias, "dbias");
  }
}

TEST(PackedMask, PackedSequencesAndCachesReadTheirSequencesBytes) {
  auto rng = test_rng();
  // Packed sequences of 3, 9 and 6 queries over 5, 12 and 6 keys; maxima 9 and 13 (two bytes).
  const std::vector<std::int32_t> cu_q = {0, 3, 12, 18}, cu_k = {0, 5, 17, 23};
  HostTensor offsets_q = HostTensor::empty(DType::int32, {4}), offsets_k = HostTensor::empty(DType::int32, {4});
  for (int b = 0; b < 4; ++b) {
    offsets_q.set(b, cu_q[b]);
    offsets_k.set(b, cu_k[b]);
  }
  const HostTensor q = HostTensor::random(DType::float64, {18, 2, 8}, rng);
  const HostTensor k = HostTensor::random(DType::float64, {23, 1, 8}, rng), v = HostTensor::random(DType::float64, {23, 1, 8}, rng);
  const reference::Sequences sequences{&offsets_q.view, &offsets_k.view};
  expect_packing_changes_nothing(q, k, v, HostTensor::random(DType::boolean, {3, 1, 9, 13}, rng, 0.5), rng,
                                 [&](const reference::Inputs& in) { return reference::forward(in, sequences); });

  // A contiguous cache of 20 logical keys (three bytes), lengths 20, 7 and 0.
  HostTensor lengths = HostTensor::empty(DType::int32, {3});
  lengths.set(0, 20), lengths.set(1, 7), lengths.set(2, 0);
  const HostTensor cq = HostTensor::random(DType::float64, {3, 2, 2, 8}, rng);
  const HostTensor ck = HostTensor::random(DType::float64, {3, 20, 1, 8}, rng);
  expect_packing_changes_nothing(cq, ck, ck, HostTensor::random(DType::boolean, {3, 2, 2, 20}, rng, 0.6), rng,
                                 [&](const reference::Inputs& in) {
                                   return reference::forward(in, reference::Cache{&lengths.view, nullptr});
                                 });
}

TEST(PackedMask, ChecksNameTheMaskAndItsBytes) {
  auto rng = test_rng();
  const Sizes n{1, 4, 20, 2, 1, 8};
  RefProblem p = RefProblem::random(n, rng, OperandShape{true, 1, true, true}, std::nullopt, 0.5, DType::float16);
  HostTensor out = HostTensor::empty(DType::float16, {1, 4, 2, 8}), lse = HostTensor::empty(DType::float32, {1, 2, 4});
  ForwardArgs a;
  a.q = p.q.view;
  a.k = p.k.view;
  a.v = p.v.view;
  a.out = out.view;
  a.lse = lse.view;
  const HostTensor bits = pack(*p.mask, rng);
  a.mask = bits.view;
  ASSERT_TRUE(forward(a).ok());
  const std::vector<double> packed_out = out.values();
  a.mask = p.mask->view;
  ASSERT_TRUE(forward(a).ok());
  EXPECT_EQ(out.values(), packed_out) << "the CPU backend: packed and bool masks differ";

  const HostTensor short_row = HostTensor::empty(DType::uint8, {1, 1, 4, 2});  // 20 keys need 3 bytes
  a.mask = short_row.view;
  expect_refused(a, "argument 'mask': expected ceil(Sk/8)=3 bytes of key bits (dim 3) in a bit-packed mask");
  const HostTensor key_broadcast = HostTensor::empty(DType::uint8, {1, 1, 4, 1});
  a.mask = key_broadcast.view;
  expect_refused(a, "argument 'mask': expected ceil(Sk/8)=3 bytes of key bits (dim 3)");
  const HostTensor ints = HostTensor::empty(DType::int32, {1, 1, 4, 20});
  a.mask = ints.view;
  expect_refused(a, "argument 'mask': expected dtype bool (True keeps a key; uint8: bit-packed), got int32");
  const HostTensor rows = HostTensor::empty(DType::uint8, {1, 1, 3, 3});
  a.mask = rows.view;
  expect_refused(a, "argument 'mask': expected query size (dim 2) 1 or 4, got 3");
}

}  // namespace
}  // namespace flash_dmattn::test
