// Packed sequences (ForwardArgs::sequences) on the CPU backend: each sequence's rows, lse and
// gradients equal those of the same sequence run alone as a batch of one, with its part of the
// mask and bias copied out; dbias sums over the sequences that read an element. And the offsets'
// checks.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend.h"
#include "test_util.h"

namespace flash_dmattn::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Sizes of an operand of (B|1, H|Hk|1, Mq|1, Mk|1): which dims are full.
struct OperandForm {
  bool batch;
  int heads;  // 1, Hk or H
  bool rows, keys;
};

struct Packed {
  std::vector<std::int32_t> lengths_q, lengths_k;
  std::int64_t H, Hk, D, max_q = 0, max_k = 0;
  DType dtype;
  HostTensor q, k, v, dout, mask, bias, cu_q, cu_k;
  std::int64_t total_q = 0, total_k = 0;
  bool causal = false;
  double softcap = 0.0;

  Packed(std::vector<std::int32_t> lq, std::vector<std::int32_t> lk, std::int64_t h, std::int64_t hk, std::int64_t d,
         DType t, OperandForm mask_form, OperandForm bias_form, std::mt19937_64& rng)
      : lengths_q(std::move(lq)), lengths_k(std::move(lk)), H(h), Hk(hk), D(d), dtype(t) {
    const auto B = static_cast<std::int64_t>(lengths_q.size());
    cu_q = HostTensor::empty(DType::int32, {B + 1});
    cu_k = HostTensor::empty(DType::int32, {B + 1});
    for (std::int64_t b = 0; b < B; ++b) {
      cu_q.set(b, static_cast<double>(total_q));
      cu_k.set(b, static_cast<double>(total_k));
      total_q += lengths_q[b];
      total_k += lengths_k[b];
      max_q = std::max<std::int64_t>(max_q, lengths_q[b]);
      max_k = std::max<std::int64_t>(max_k, lengths_k[b]);
    }
    cu_q.set(B, static_cast<double>(total_q));
    cu_k.set(B, static_cast<double>(total_k));
    max_q += 1;  // maxima above the longest lengths: positions past them are never read
    q = HostTensor::random(t, {total_q, H, D}, rng, -1.0, 1.0, /*row_pad=*/8);
    k = HostTensor::random(t, {total_k, Hk, D}, rng);
    v = HostTensor::random(t, {total_k, Hk, D}, rng);
    dout = HostTensor::random(t, {total_q, H, D}, rng);
    mask = HostTensor::random(DType::boolean, operand_shape(mask_form), rng, 0.7);
    bias = HostTensor::random(DType::float32, operand_shape(bias_form), rng, -2.0, 2.0);
  }

  Shape operand_shape(const OperandForm& f) const {
    return {f.batch ? static_cast<std::int64_t>(lengths_q.size()) : 1, f.heads, f.rows ? max_q : 1, f.keys ? max_k : 1};
  }
  std::int64_t first_q(std::int64_t b) const { return static_cast<std::int64_t>(cu_q.get(b)); }
  std::int64_t first_k(std::int64_t b) const { return static_cast<std::int64_t>(cu_k.get(b)); }

  PackedSequences sequences() const { return {cu_q.view, cu_k.view, max_q, max_k}; }
};

// Rows [first, first + length) of a packed (total, heads, D) tensor, copied into (1, length, heads, D).
HostTensor rows_of(const HostTensor& packed, std::int64_t first, std::int64_t length) {
  const TensorView& p = packed.view;
  HostTensor t = HostTensor::empty(p.dtype, {1, length, p.shape[1], p.shape[2]});
  for (std::int64_t i = 0; i < length; ++i)
    for (std::int64_t h = 0; h < p.shape[1]; ++h)
      for (std::int64_t d = 0; d < p.shape[2]; ++d)
        t.set(host::offset4(t.view, 0, i, h, d),
              packed.get((first + i) * p.stride[0] + h * p.stride[1] + d * p.stride[2]));
  return t;
}

// The tensors of a call, in BackwardArgs' order.
struct CallTensors {
  const HostTensor *q, *k, *v, *mask, *bias, *out, *lse, *dout, *dq, *dk, *dv, *dbias;
};

// A backward's arguments on these tensors; the forward's are its first part (forward_view).
BackwardArgs call_args(const CallTensors& t, const AttentionOptions& options, std::optional<PackedSequences> sequences) {
  BackwardArgs a;
  a.q = t.q->view;
  a.k = t.k->view;
  a.v = t.v->view;
  a.sequences = sequences;
  a.mask = t.mask->view;
  a.bias = t.bias->view;
  a.out = t.out->view;
  a.lse = t.lse->view;
  a.dout = t.dout->view;
  a.dq = t.dq->view;
  a.dk = t.dk->view;
  a.dv = t.dv->view;
  a.dbias = t.dbias->view;
  a.options = options;
  return a;
}

struct Case {
  std::vector<std::int32_t> lengths_q, lengths_k;
  std::int64_t H, Hk;
  OperandForm mask, bias;
  bool causal;
  double softcap;
};

// The packed call against each sequence run alone.
void expect_packed_matches_alone(const Case& c, DType dtype) {
  auto rng = test_rng();
  Packed p(c.lengths_q, c.lengths_k, c.H, c.Hk, 16, dtype, c.mask, c.bias, rng);
  p.causal = c.causal;
  p.softcap = c.softcap;
  HostTensor out = HostTensor::empty(dtype, {p.total_q, p.H, p.D}), lse = HostTensor::empty(DType::float32, {p.H, p.total_q});
  HostTensor dq = HostTensor::empty(dtype, {p.total_q, p.H, p.D}), dk = HostTensor::empty(dtype, {p.total_k, p.Hk, p.D});
  HostTensor dv = HostTensor::empty(dtype, {p.total_k, p.Hk, p.D});
  HostTensor dbias = HostTensor::empty(DType::float32, Shape(p.bias.view.shape, p.bias.view.shape + 4));
  for (HostTensor* t : {&out, &lse, &dq, &dk, &dv, &dbias}) poison(*t);

  AttentionOptions options;
  options.causal = p.causal;
  options.softcap = p.softcap;
  const BackwardArgs g = call_args({&p.q, &p.k, &p.v, &p.mask, &p.bias, &out, &lse, &p.dout, &dq, &dk, &dv, &dbias},
                                   options, p.sequences());
  const Status forward_status = forward(forward_view(g));
  ASSERT_TRUE(forward_status.ok()) << forward_status.message();
  const Status status = backward(g);
  ASSERT_TRUE(status.ok()) << status.message();

  std::vector<double> expected_dbias(static_cast<size_t>(p.bias.view.numel()), 0.0);
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(c.lengths_q.size()); ++b) {
    const std::int64_t lq = c.lengths_q[b], lk = c.lengths_k[b], fq = p.first_q(b), fk = p.first_k(b);
    SCOPED_TRACE("sequence " + std::to_string(b) + " (" + std::to_string(lq) + " x " + std::to_string(lk) + ")");
    // Alone: a batch of one with the sequence's rows and its part of the mask and bias.
    HostTensor q1 = rows_of(p.q, fq, lq), k1 = rows_of(p.k, fk, lk), v1 = rows_of(p.v, fk, lk);
    HostTensor dout1 = rows_of(p.dout, fq, lq), mask1 = operand_of(p.mask, b, lq, lk), bias1 = operand_of(p.bias, b, lq, lk);
    HostTensor out1 = HostTensor::empty(dtype, {1, lq, p.H, p.D}), lse1 = HostTensor::empty(DType::float32, {1, p.H, lq});
    HostTensor dq1 = HostTensor::empty(dtype, {1, lq, p.H, p.D}), dk1 = HostTensor::empty(dtype, {1, lk, p.Hk, p.D});
    HostTensor dv1 = HostTensor::empty(dtype, {1, lk, p.Hk, p.D});
    HostTensor dbias1 = HostTensor::empty(DType::float32, Shape(bias1.view.shape, bias1.view.shape + 4));
    const BackwardArgs g1 =
        call_args({&q1, &k1, &v1, &mask1, &bias1, &out1, &lse1, &dout1, &dq1, &dk1, &dv1, &dbias1}, options, std::nullopt);
    ASSERT_TRUE(forward(forward_view(g1)).ok());
    ASSERT_TRUE(backward(g1).ok());

    EXPECT_EQ(rows_of(out, fq, lq).values(), out1.values()) << "out";
    EXPECT_EQ(rows_of(dq, fq, lq).values(), dq1.values()) << "dq";
    EXPECT_EQ(rows_of(dk, fk, lk).values(), dk1.values()) << "dk";
    EXPECT_EQ(rows_of(dv, fk, lk).values(), dv1.values()) << "dv";
    for (std::int64_t h = 0; h < p.H; ++h)
      for (std::int64_t i = 0; i < lq; ++i) {
        const double got = lse.get(h * lse.view.stride[0] + (fq + i) * lse.view.stride[1]);
        const double want = lse1.get(h * lse1.view.stride[1] + i * lse1.view.stride[2]);
        ASSERT_EQ(got, want) << "lse head " << h << " row " << i;
        if (lk == 0) {
          ASSERT_EQ(got, kInf) << "a sequence without keys: empty rows";
        }
      }
    const TensorView& full = p.bias.view;
    const std::int64_t batch = full.shape[0] == 1 ? 0 : b;
    for (std::int64_t h = 0; h < dbias1.view.shape[1]; ++h)
      for (std::int64_t i = 0; i < dbias1.view.shape[2]; ++i)
        for (std::int64_t j = 0; j < dbias1.view.shape[3]; ++j)
          expected_dbias[((batch * full.shape[1] + h) * full.shape[2] + i) * full.shape[3] + j] +=
              dbias1.get(host::offset4(dbias1.view, 0, h, i, j));
  }
  // Positions no sequence reads hold 0; shared ones the sum (in fp32 here, each term rounded).
  const std::vector<double> got = dbias.values();
  for (size_t e = 0; e < got.size(); ++e) {
    ASSERT_NEAR(got[e], expected_dbias[e], 1e-5 * (1.0 + std::abs(expected_dbias[e]))) << "dbias element " << e;
  }
}

class PackedSequencesMatch : public ::testing::TestWithParam<DType> {};

TEST_P(PackedSequencesMatch, EachSequenceAsIfAlone) {
  const std::int64_t H = 4, Hk = 2;
  // lengths: 1, odd, equal, a sequence without queries, one without keys, more keys than queries
  const std::vector<Case> cases = {
      {{5, 1, 7, 0, 3}, {5, 4, 9, 2, 0}, H, Hk, {true, (int)Hk, true, true}, {true, (int)H, true, true}, true, 0.0},
      {{3, 6, 2}, {7, 6, 2}, H, Hk, {false, 1, true, true}, {false, 1, false, true}, true, 0.0},
      {{4, 4}, {6, 3}, H, 1, {true, (int)H, false, true}, {true, 1, true, false}, false, 5.0},
      {{2, 9, 1}, {8, 9, 5}, H, H, {false, (int)H, true, false}, {false, (int)H, true, true}, false, 0.0},
      {{6, 5, 3}, {6, 5, 3}, H, Hk, {true, 1, true, true}, {false, (int)Hk, true, true}, true, 3.0},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    expect_packed_matches_alone(cases[i], GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PackedSequencesMatch, ::testing::Values(DType::float16, DType::bfloat16));

// A valid packed problem whose arguments the checks below break one at a time.
struct PackedCall {
  std::mt19937_64 rng = test_rng();
  Packed p{{3, 2}, {4, 2}, 2, 1, 16, DType::float16, {true, 1, true, true}, {false, 1, false, true}, rng};
  HostTensor out = HostTensor::empty(DType::float16, {p.total_q, p.H, p.D});
  HostTensor lse = HostTensor::empty(DType::float32, {p.H, p.total_q});

  ForwardArgs args() const {
    ForwardArgs f;
    f.q = p.q.view;
    f.k = p.k.view;
    f.v = p.v.view;
    f.sequences = p.sequences();
    f.mask = p.mask.view;
    f.bias = p.bias.view;
    f.out = out.view;
    f.lse = lse.view;
    return f;
  }
};

TEST(PackedSequencesChecks, OffsetsAndLayoutsAreNamed) {
  PackedCall call;
  ASSERT_TRUE(forward(call.args()).ok());
  {
    ForwardArgs a = call.args();
    HostTensor bad = call.p.cu_q;
    bad.set(0, 1);
    a.sequences->cu_seqlens_q = bad.view;
    expect_refused(a, "argument 'cu_seqlens_q': expected offsets that start at 0, got cu_seqlens_q[0] = 1");
  }
  {
    ForwardArgs a = call.args();
    HostTensor bad = call.p.cu_k;
    bad.set(1, 5);  // lengths 5 and 1
    a.sequences->cu_seqlens_k = bad.view;
    expect_refused(a, "argument 'cu_seqlens_k': expected sequence lengths in [0, max_seqlen_k=4], got cu_seqlens_k[1] - cu_seqlens_k[0] = 5");
  }
  {
    ForwardArgs a = call.args();
    a.sequences->max_seqlen_q = 2;  // the first sequence has 3 queries
    expect_refused(a, "argument 'mask'");  // the mask's rows no longer match max_seqlen_q
    a.mask.reset();
    a.bias.reset();
    expect_refused(a, "argument 'cu_seqlens_q': expected sequence lengths in [0, max_seqlen_q=2]");
  }
  {
    ForwardArgs a = call.args();
    HostTensor bad = call.p.cu_q;
    bad.set(2, 4);  // the packed rows are 5
    a.sequences->cu_seqlens_q = bad.view;
    expect_refused(a, "expected offsets that end at total_q=5 (the packed rows), got cu_seqlens_q[2] = 4");
  }
  {
    ForwardArgs a = call.args();
    HostTensor wide = HostTensor::empty(DType::int32, {4});
    a.sequences->cu_seqlens_k = wide.view;
    expect_refused(a, "argument 'cu_seqlens_k': expected shape (3) (the shape of cu_seqlens_q), got (4)");
  }
  {
    ForwardArgs a = call.args();
    a.sequences->max_seqlen_k = -1;
    expect_refused(a, "argument 'max_seqlen_k': expected a length in [0, 2^31 - 1], got -1");
    a.sequences->max_seqlen_k = std::int64_t(1) << 40;
    expect_refused(a, "argument 'max_seqlen_k': expected a length in [0, 2^31 - 1], got 1099511627776");
  }
  {
    ForwardArgs a = call.args();
    HostTensor batched = HostTensor::empty(DType::float16, {1, call.p.total_q, call.p.H, call.p.D});
    a.q = batched.view;
    expect_refused(a, "argument 'q': expected rank 3 (total_q, H, D)");
  }
  {
    ForwardArgs a = call.args();
    HostTensor batched = HostTensor::empty(DType::float32, {1, call.p.H, call.p.total_q});
    a.lse = batched.view;
    expect_refused(a, "argument 'lse': expected rank 2 (H, total_q)");
  }
  {
    ForwardArgs a = call.args();
    HostTensor indices = HostTensor::empty(DType::int32, {1, 1, 1, 2});
    a.indices = indices.view;
    expect_refused(a, "argument 'indices': expected no key indices with packed sequences");
  }
}

}  // namespace
}  // namespace flash_dmattn::test
