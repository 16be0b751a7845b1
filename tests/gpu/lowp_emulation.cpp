// The same-precision baseline (see the header for the formulas). Speed matters: the length suite
// runs it at 4095 x 4095, so the operands are converted to float once, in layouts whose inner
// loops vectorize without changing the order of any fp32 sum.
#include "lowp_emulation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "host_numeric.h"
#include "parallel.h"

namespace flash_dmattn::test::lowp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// Query rows per work item: enough items to keep every thread busy even when B·H is 1.
constexpr std::int64_t kRowsPerItem = 16;

struct Dims {
  std::int64_t B, Sq, Sk, H, Hk, D;
  explicit Dims(const reference::Inputs& in)
      : B(in.q.shape[0]), Sq(in.q.shape[1]), Sk(in.k.shape[1]), H(in.q.shape[2]), Hk(in.k.shape[2]),
        D(in.q.shape[3]) {}
  std::int64_t kv_head(std::int64_t h) const { return h / (H / Hk); }
};

float round_to(DType dtype, float x) { return static_cast<float>(host::round_to(dtype, x)); }

// q as (B, Sq, H, D); k transposed to (B, Hk, D, Sk), so that a row's logits accumulate over d with
// all keys side by side while each dot product still sums d = 0, 1, ... in order; v as (B, Hk, Sk, D).
struct FloatOperands {
  std::vector<float> q, kt, v;

  FloatOperands(const reference::Inputs& in, const Dims& n)
      : q(n.B * n.Sq * n.H * n.D), kt(n.B * n.Hk * n.D * n.Sk), v(n.B * n.Hk * n.Sk * n.D) {
    for (std::int64_t b = 0; b < n.B; ++b) {
      for (std::int64_t i = 0; i < n.Sq; ++i)
        for (std::int64_t h = 0; h < n.H; ++h)
          for (std::int64_t d = 0; d < n.D; ++d)
            q[((b * n.Sq + i) * n.H + h) * n.D + d] = static_cast<float>(host::load(in.q, host::offset4(in.q, b, i, h, d)));
      for (std::int64_t j = 0; j < n.Sk; ++j)
        for (std::int64_t m = 0; m < n.Hk; ++m)
          for (std::int64_t d = 0; d < n.D; ++d) {
            kt[((b * n.Hk + m) * n.D + d) * n.Sk + j] = static_cast<float>(host::load(in.k, host::offset4(in.k, b, j, m, d)));
            v[((b * n.Hk + m) * n.Sk + j) * n.D + d] = static_cast<float>(host::load(in.v, host::offset4(in.v, b, j, m, d)));
          }
    }
  }
};

// The elements of a broadcast mask or bias (B|1, H|Hk|1, Sq|1, Sk|1) that one query row reads:
// a size-1 dimension stays at index 0 whatever its stride, and query head h reads head
// h / (H / heads).
class BroadcastRow {
 public:
  BroadcastRow(const TensorView* t, const Dims& n, std::int64_t b, std::int64_t h, std::int64_t i) : t_(t) {
    if (!t) return;
    const std::int64_t* s = t->shape;
    const std::int64_t* st = t->stride;
    base_ = (s[0] == 1 ? 0 : b) * st[0] + h / (n.H / s[1]) * st[1] + (s[2] == 1 ? 0 : i) * st[2];
    key_stride_ = s[3] == 1 ? 0 : st[3];
  }
  bool present() const { return t_ != nullptr; }
  double at(std::int64_t j) const { return host::load(*t_, base_ + j * key_stride_); }

 private:
  const TensorView* t_;
  std::int64_t base_ = 0, key_stride_ = 0;
};

// Logits of query row (b, h, i) as PyTorch would hold them in the input dtype, -inf where the
// key is hidden. `acc` is scratch of Sk floats.
void row_logits(const reference::Inputs& in, const Dims& n, const FloatOperands& ops, std::int64_t b,
                std::int64_t h, std::int64_t i, std::vector<float>& z, std::vector<float>& acc) {
  const DType dtype = in.q.dtype;
  const float scale = static_cast<float>(in.scale);
  const float cap = static_cast<float>(in.softcap);
  const float* q = &ops.q[((b * n.Sq + i) * n.H + h) * n.D];
  const float* kt = &ops.kt[(b * n.Hk + n.kv_head(h)) * n.D * n.Sk];
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (std::int64_t d = 0; d < n.D; ++d) {
    const float qd = q[d];
    const float* krow = kt + d * n.Sk;
    for (std::int64_t j = 0; j < n.Sk; ++j) acc[j] += qd * krow[j];
  }
  const BroadcastRow mask(in.mask, n, b, h, i), bias(in.bias, n, b, h, i);
  const std::int64_t causal_limit = i + n.Sk - n.Sq;  // bottom-right aligned: key j visible iff j <= limit
  for (std::int64_t j = 0; j < n.Sk; ++j) {
    const bool visible = (!in.causal || j <= causal_limit) && (!mask.present() || mask.at(j) != 0.0);
    if (!visible) {
      z[j] = -kInf;
      continue;
    }
    float s = round_to(dtype, round_to(dtype, acc[j]) * scale);
    if (cap > 0.0f) s = round_to(dtype, cap * std::tanh(s / cap));
    if (bias.present()) s = round_to(dtype, s + static_cast<float>(bias.at(j)));
    z[j] = s;
  }
}

}  // namespace

reference::ForwardResult forward(const reference::Inputs& in) {
  const Dims n(in);
  reference::ForwardResult r;
  r.out.assign(n.B * n.Sq * n.H * n.D, 0.0);
  r.lse.assign(n.B * n.H * n.Sq, std::numeric_limits<double>::infinity());
  if (r.out.empty() || n.Sk == 0) return r;

  const FloatOperands ops(in, n);
  const DType dtype = in.q.dtype;
  const std::int64_t blocks = (n.Sq + kRowsPerItem - 1) / kRowsPerItem;
  const std::int64_t items = n.B * n.H * blocks;
  const int workers = host::worker_count(items, 4.0 * n.B * n.H * n.Sq * n.Sk * n.D);
  struct Scratch {
    std::vector<float> z, acc, o;
  };
  std::vector<Scratch> scratch(workers, Scratch{std::vector<float>(n.Sk), std::vector<float>(n.Sk),
                                                std::vector<float>(n.D)});

  host::parallel_for(items, workers, [&](std::int64_t item, int worker) {
    const std::int64_t bh = item / blocks, b = bh / n.H, h = bh % n.H;
    const std::int64_t first = item % blocks * kRowsPerItem, last = std::min(first + kRowsPerItem, n.Sq);
    const float* v = &ops.v[(b * n.Hk + n.kv_head(h)) * n.Sk * n.D];
    auto& [z, acc, o] = scratch[worker];
    for (std::int64_t i = first; i < last; ++i) {
      row_logits(in, n, ops, b, h, i, z, acc);
      float zmax = -kInf;
      for (float x : z) zmax = std::max(zmax, x);
      if (zmax == -kInf) continue;  // no visible key or only -inf logits: out stays 0, lse +inf
      float sum = 0.0f;
      for (std::int64_t j = 0; j < n.Sk; ++j) {
        acc[j] = std::exp(z[j] - zmax);  // exp(-inf) = 0 for hidden keys
        sum += acc[j];
      }
      r.lse[(b * n.H + h) * n.Sq + i] = zmax + std::log(sum);
      std::fill(o.begin(), o.end(), 0.0f);
      for (std::int64_t j = 0; j < n.Sk; ++j) {
        const float p = round_to(dtype, acc[j] / sum);
        if (p == 0.0f) continue;  // adds exactly 0 (v is finite)
        const float* vj = v + j * n.D;
        for (std::int64_t d = 0; d < n.D; ++d) o[d] += p * vj[d];
      }
      double* out = &r.out[((b * n.Sq + i) * n.H + h) * n.D];
      for (std::int64_t d = 0; d < n.D; ++d) out[d] = round_to(dtype, o[d]);
    }
  });
  return r;
}

}  // namespace flash_dmattn::test::lowp
