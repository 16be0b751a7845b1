// Packed sequences in the fp64 reference: each sequence is its own problem (docs/semantics.md §11),
// so each runs through the batched reference as a batch of one, on views of its rows and of its
// mask and bias positions, and the results are placed at its packed rows.
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "reference.h"
#include "views.h"

namespace flash_dmattn::reference {
namespace {

// One sequence's problem: its rows, lengths and operand views (which `inputs` points at).
struct Sequence {
  std::int64_t first_q, first_k, length_q, length_k;
  TensorView mask, bias;
  Inputs inputs;

  Sequence(const Inputs& packed, const Sequences& s, std::int64_t b)
      : first_q(int_at(*s.cu_seqlens_q, b)),
        first_k(int_at(*s.cu_seqlens_k, b)),
        length_q(int_at(*s.cu_seqlens_q, b + 1) - first_q),
        length_k(int_at(*s.cu_seqlens_k, b + 1) - first_k),
        inputs(packed) {
    inputs.q = batch_of_one(packed.q, first_q, length_q);
    inputs.k = batch_of_one(packed.k, first_k, length_k);
    inputs.v = batch_of_one(packed.v, first_k, length_k);
    if (packed.mask) {
      mask = sequence_operand(*packed.mask, b, length_q, length_k);
      inputs.mask = &mask;
    }
    if (packed.bias) {
      bias = sequence_operand(*packed.bias, b, length_q, length_k);
      inputs.bias = &bias;
    }
    inputs.indices = nullptr;  // not taken with packed sequences (validate.cpp)
  }
  // A sequence without queries has nothing to compute; one without keys leaves its rows empty
  // (O = 0, LSE = +inf) and every gradient 0, which the results start as.
  bool has_work() const { return length_q > 0 && length_k > 0; }
};

std::int64_t sequence_count(const Sequences& s) { return s.cu_seqlens_q->shape[0] - 1; }

// Copies `values`, contiguous rows of `row_size` elements, to rows [first, ...) of `packed`.
void place_rows(std::vector<double>& packed, const std::vector<double>& values, std::int64_t first,
                std::int64_t row_size) {
  if (!values.empty()) std::memcpy(&packed[first * row_size], values.data(), values.size() * sizeof(double));
}

}  // namespace

ForwardResult forward(const Inputs& in, const Sequences& s) {
  const std::int64_t total_q = in.q.shape[0], H = in.q.shape[1], D = in.q.shape[2];
  ForwardResult r;
  r.out.assign(total_q * H * D, 0.0);
  r.lse.assign(H * total_q, std::numeric_limits<double>::infinity());
  for (std::int64_t b = 0; b < sequence_count(s); ++b) {
    const Sequence seq(in, s, b);
    if (!seq.has_work()) continue;
    const ForwardResult one = forward(seq.inputs);  // out (1, Lq, H, D), lse (1, H, Lq)
    place_rows(r.out, one.out, seq.first_q, H * D);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < seq.length_q; ++i) r.lse[h * total_q + seq.first_q + i] = one.lse[h * seq.length_q + i];
  }
  return r;
}

Gradients backward(const Inputs& in, const Sequences& s, const TensorView& dout, const GivenRows& given) {
  const std::int64_t total_q = in.q.shape[0], H = in.q.shape[1], D = in.q.shape[2];
  const std::int64_t total_k = in.k.shape[0], Hk = in.k.shape[1];
  Gradients g;
  g.dq.assign(total_q * H * D, 0.0);
  g.dk.assign(total_k * Hk * D, 0.0);
  g.dv.assign(total_k * Hk * D, 0.0);
  if (in.bias) g.dbias.assign(in.bias->numel(), 0.0);
  for (std::int64_t b = 0; b < sequence_count(s); ++b) {
    const Sequence seq(in, s, b);
    if (!seq.has_work()) continue;
    const TensorView seq_dout = batch_of_one(dout, seq.first_q, seq.length_q);
    TensorView out, lse;
    GivenRows rows;
    if (given.out) {
      out = batch_of_one(*given.out, seq.first_q, seq.length_q);
      rows.out = &out;
    }
    if (given.lse) {  // (H, total_q) -> (1, H, Lq)
      const TensorView& packed = *given.lse;
      lse = packed;
      lse.rank = 3;
      lse.data = element_address(packed, seq.first_q * packed.stride[1]);
      const std::int64_t shape[3] = {1, packed.shape[0], seq.length_q}, stride[3] = {0, packed.stride[0], packed.stride[1]};
      for (int d = 0; d < 3; ++d) {
        lse.shape[d] = shape[d];
        lse.stride[d] = stride[d];
      }
      rows.lse = &lse;
    }
    const Gradients one = backward(seq.inputs, seq_dout, rows);
    place_rows(g.dq, one.dq, seq.first_q, H * D);
    place_rows(g.dk, one.dk, seq.first_k, Hk * D);
    place_rows(g.dv, one.dv, seq.first_k, Hk * D);
    if (!in.bias) continue;
    // The sequence's dbias (its operand view's shape, contiguous) adds into the bias's positions:
    // a bias shared by several sequences sums their gradients.
    const TensorView& full = *in.bias;
    const TensorView& part = seq.bias;
    const std::int64_t batch = full.shape[0] == 1 ? 0 : b;
    std::int64_t e = 0;
    for (std::int64_t h = 0; h < part.shape[1]; ++h)
      for (std::int64_t i = 0; i < part.shape[2]; ++i)
        for (std::int64_t j = 0; j < part.shape[3]; ++j)
          g.dbias[((batch * full.shape[1] + h) * full.shape[2] + i) * full.shape[3] + j] += one.dbias[e++];
  }
  return g;
}

}  // namespace flash_dmattn::reference
