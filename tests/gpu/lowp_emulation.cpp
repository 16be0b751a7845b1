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
// key is hidden. `acc` is scratch of Sk floats. With softcap, `tanh_out` (when given, Sk floats)
// receives t = round(tanh(s / cap)) of every visible key, the value the softcap's backward uses.
void row_logits(const reference::Inputs& in, const Dims& n, const FloatOperands& ops, std::int64_t b,
                std::int64_t h, std::int64_t i, std::vector<float>& z, std::vector<float>& acc,
                float* tanh_out = nullptr) {
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
    if (cap > 0.0f) {
      if (tanh_out) tanh_out[j] = round_to(dtype, std::tanh(s / cap));
      s = round_to(dtype, cap * std::tanh(s / cap));
    }
    if (bias.present()) s = round_to(dtype, s + static_cast<float>(bias.at(j)));
    z[j] = s;
  }
}

// What only the backward reads: k as (B, Hk, Sk, D), so that dq = Σ_j dS_j·k_j accumulates all d
// side by side; v transposed to (B, Hk, D, Sk) for dP (like kt for the logits); dout as (B, Sq, H, D).
struct BackwardOperands {
  std::vector<float> k, vt, dout;

  BackwardOperands(const reference::Inputs& in, const TensorView& dout_view, const Dims& n)
      : k(n.B * n.Hk * n.Sk * n.D), vt(n.B * n.Hk * n.D * n.Sk), dout(n.B * n.Sq * n.H * n.D) {
    for (std::int64_t b = 0; b < n.B; ++b) {
      for (std::int64_t i = 0; i < n.Sq; ++i)
        for (std::int64_t h = 0; h < n.H; ++h)
          for (std::int64_t d = 0; d < n.D; ++d)
            dout[((b * n.Sq + i) * n.H + h) * n.D + d] =
                static_cast<float>(host::load(dout_view, host::offset4(dout_view, b, i, h, d)));
      for (std::int64_t j = 0; j < n.Sk; ++j)
        for (std::int64_t m = 0; m < n.Hk; ++m)
          for (std::int64_t d = 0; d < n.D; ++d) {
            k[((b * n.Hk + m) * n.Sk + j) * n.D + d] = static_cast<float>(host::load(in.k, host::offset4(in.k, b, j, m, d)));
            vt[((b * n.Hk + m) * n.D + d) * n.Sk + j] = static_cast<float>(host::load(in.v, host::offset4(in.v, b, j, m, d)));
          }
    }
  }
};

// Keys per work item of the dk/dv pass, and per item of the dbias pass when the bias has a key dim.
constexpr std::int64_t kKeysPerItem = 16;
constexpr std::int64_t kBiasKeysPerItem = 512;

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

reference::Gradients backward(const reference::Inputs& in, const TensorView& dout_view) {
  const Dims n(in);
  reference::Gradients g;
  g.dq.assign(n.B * n.Sq * n.H * n.D, 0.0);
  g.dk.assign(n.B * n.Sk * n.Hk * n.D, 0.0);
  g.dv.assign(n.B * n.Sk * n.Hk * n.D, 0.0);
  g.dbias.assign(in.bias ? in.bias->numel() : 0, 0.0);
  if (n.B == 0 || n.Sq == 0 || n.Sk == 0 || n.H == 0) return g;  // every sum is empty: zeros

  const FloatOperands ops(in, n);
  const BackwardOperands bops(in, dout_view, n);
  const DType dtype = in.q.dtype;
  const float scale = static_cast<float>(in.scale);
  const float cap = static_cast<float>(in.softcap);
  const double multiply_adds = static_cast<double>(n.B) * n.H * n.Sq * n.Sk * n.D;

  // Pass 1, over (batch, head, block of query rows): the row's forward, dP, Δ, dZ, dS and dq.
  // p, dS and dZ of every (b, h, i, j) stay for the passes over keys and over the bias.
  const std::int64_t rows = n.B * n.H * n.Sq;
  std::vector<float> p_all(rows * n.Sk, 0.0f), ds_all(rows * n.Sk, 0.0f);
  std::vector<float> dz_all(in.bias ? rows * n.Sk : 0, 0.0f);
  {
    const std::int64_t blocks = (n.Sq + kRowsPerItem - 1) / kRowsPerItem;
    const std::int64_t items = n.B * n.H * blocks;
    const int workers = host::worker_count(items, 6.0 * multiply_adds);
    struct Scratch {
      std::vector<float> z, acc, t, dp, dz, dq;
    };
    std::vector<Scratch> scratch(workers, Scratch{std::vector<float>(n.Sk), std::vector<float>(n.Sk),
                                                  std::vector<float>(n.Sk, 0.0f), std::vector<float>(n.Sk),
                                                  std::vector<float>(n.Sk), std::vector<float>(n.D)});
    host::parallel_for(items, workers, [&](std::int64_t item, int worker) {
      const std::int64_t bh = item / blocks, b = bh / n.H, h = bh % n.H, m = n.kv_head(h);
      const std::int64_t first = item % blocks * kRowsPerItem, last = std::min(first + kRowsPerItem, n.Sq);
      const float* vt = &bops.vt[(b * n.Hk + m) * n.D * n.Sk];
      const float* k = &bops.k[(b * n.Hk + m) * n.Sk * n.D];
      Scratch& sc = scratch[worker];
      for (std::int64_t i = first; i < last; ++i) {
        const std::int64_t row = (b * n.H + h) * n.Sq + i;
        row_logits(in, n, ops, b, h, i, sc.z, sc.acc, cap > 0.0f ? sc.t.data() : nullptr);
        float zmax = -kInf;
        for (float x : sc.z) zmax = std::max(zmax, x);
        if (zmax == -kInf) continue;  // no visible key or only -inf logits: p, dS, dZ and dq stay 0
        float sum = 0.0f;
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          sc.acc[j] = std::exp(sc.z[j] - zmax);
          sum += sc.acc[j];
        }
        float* p = &p_all[row * n.Sk];
        for (std::int64_t j = 0; j < n.Sk; ++j) p[j] = round_to(dtype, sc.acc[j] / sum);

        // dP = dO·vᵀ, then softmax's backward: Δ = Σ_j p·dP in fp32, dZ = p·(dP − Δ).
        const float* dout = &bops.dout[((b * n.Sq + i) * n.H + h) * n.D];
        std::fill(sc.dp.begin(), sc.dp.end(), 0.0f);
        for (std::int64_t d = 0; d < n.D; ++d) {
          const float od = dout[d];
          const float* vrow = vt + d * n.Sk;
          for (std::int64_t j = 0; j < n.Sk; ++j) sc.dp[j] += od * vrow[j];
        }
        float delta = 0.0f;
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          sc.dp[j] = round_to(dtype, sc.dp[j]);
          delta += p[j] * sc.dp[j];
        }
        float* dz = dz_all.empty() ? sc.dz.data() : &dz_all[row * n.Sk];
        float* ds = &ds_all[row * n.Sk];
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          dz[j] = round_to(dtype, p[j] * (sc.dp[j] - delta));  // exactly 0 where p = 0
          const float factor = cap > 0.0f ? 1.0f - sc.t[j] * sc.t[j] : 1.0f;
          ds[j] = round_to(dtype, dz[j] * scale * factor);
        }

        std::fill(sc.dq.begin(), sc.dq.end(), 0.0f);
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          const float s = ds[j];
          if (s == 0.0f) continue;  // adds exactly 0 (k is finite)
          const float* kj = k + j * n.D;
          for (std::int64_t d = 0; d < n.D; ++d) sc.dq[d] += s * kj[d];
        }
        double* dq = &g.dq[((b * n.Sq + i) * n.H + h) * n.D];
        for (std::int64_t d = 0; d < n.D; ++d) dq[d] = round_to(dtype, sc.dq[d]);
      }
    });
  }

  // Pass 2, over (batch, KV head, block of keys): dk = Σ dSᵀ·q and dv = Σ pᵀ·dO over the group's
  // heads and all rows, in fp32, rounded once.
  {
    const std::int64_t group = n.H / n.Hk;
    const std::int64_t blocks = (n.Sk + kKeysPerItem - 1) / kKeysPerItem;
    const std::int64_t items = n.B * n.Hk * blocks;
    const int workers = host::worker_count(items, 4.0 * multiply_adds);
    struct Scratch {
      std::vector<float> dk, dv;
    };
    std::vector<Scratch> scratch(
        workers, Scratch{std::vector<float>(kKeysPerItem * n.D), std::vector<float>(kKeysPerItem * n.D)});
    host::parallel_for(items, workers, [&](std::int64_t item, int worker) {
      const std::int64_t bm = item / blocks, b = bm / n.Hk, m = bm % n.Hk;
      const std::int64_t first = item % blocks * kKeysPerItem, width = std::min(kKeysPerItem, n.Sk - first);
      Scratch& sc = scratch[worker];
      std::fill(sc.dk.begin(), sc.dk.end(), 0.0f);
      std::fill(sc.dv.begin(), sc.dv.end(), 0.0f);
      for (std::int64_t h = m * group; h < (m + 1) * group; ++h) {
        for (std::int64_t i = 0; i < n.Sq; ++i) {
          const std::int64_t row = (b * n.H + h) * n.Sq + i;
          const float* p = &p_all[row * n.Sk + first];
          const float* ds = &ds_all[row * n.Sk + first];
          const float* q = &ops.q[((b * n.Sq + i) * n.H + h) * n.D];
          const float* dout = &bops.dout[((b * n.Sq + i) * n.H + h) * n.D];
          for (std::int64_t jj = 0; jj < width; ++jj) {
            if (const float s = ds[jj]; s != 0.0f) {
              float* acc = &sc.dk[jj * n.D];
              for (std::int64_t d = 0; d < n.D; ++d) acc[d] += s * q[d];
            }
            if (const float pj = p[jj]; pj != 0.0f) {
              float* acc = &sc.dv[jj * n.D];
              for (std::int64_t d = 0; d < n.D; ++d) acc[d] += pj * dout[d];
            }
          }
        }
      }
      for (std::int64_t jj = 0; jj < width; ++jj) {
        const std::int64_t at = ((b * n.Sk + first + jj) * n.Hk + m) * n.D;
        for (std::int64_t d = 0; d < n.D; ++d) {
          g.dk[at + d] = round_to(dtype, sc.dk[jj * n.D + d]);
          g.dv[at + d] = round_to(dtype, sc.dv[jj * n.D + d]);
        }
      }
    });
  }

  // Pass 3, over (dbias row, block of keys): the fp32 sum of dZ over every (b, h, i, j) that
  // reads the element, in that index order, rounded once into the bias's dtype.
  if (in.bias) {
    const TensorView& bias = *in.bias;
    const std::int64_t Bx = bias.shape[0], Hx = bias.shape[1], Sqx = bias.shape[2], Skx = bias.shape[3];
    const std::int64_t heads_per_bias_head = n.H / Hx;
    const std::int64_t blocks = (Skx + kBiasKeysPerItem - 1) / kBiasKeysPerItem;
    const std::int64_t items = Bx * Hx * Sqx * blocks;
    const int workers = host::worker_count(items, static_cast<double>(rows) * n.Sk);
    std::vector<std::vector<float>> scratch(workers, std::vector<float>(kBiasKeysPerItem));
    host::parallel_for(items, workers, [&](std::int64_t item, int worker) {
      const std::int64_t bias_row = item / blocks;
      const std::int64_t bb = bias_row / (Hx * Sqx), hh = bias_row / Sqx % Hx, ii = bias_row % Sqx;
      const std::int64_t first = item % blocks * kBiasKeysPerItem, width = std::min(kBiasKeysPerItem, Skx - first);
      std::vector<float>& acc = scratch[worker];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t b = Bx == 1 ? 0 : bb; b < (Bx == 1 ? n.B : bb + 1); ++b)
        for (std::int64_t h = hh * heads_per_bias_head; h < (hh + 1) * heads_per_bias_head; ++h)
          for (std::int64_t i = Sqx == 1 ? 0 : ii; i < (Sqx == 1 ? n.Sq : ii + 1); ++i) {
            const float* dz = &dz_all[((b * n.H + h) * n.Sq + i) * n.Sk];
            if (Skx == 1) {
              for (std::int64_t j = 0; j < n.Sk; ++j) acc[0] += dz[j];
            } else {
              for (std::int64_t jj = 0; jj < width; ++jj) acc[jj] += dz[first + jj];
            }
          }
      for (std::int64_t jj = 0; jj < width; ++jj) {
        g.dbias[bias_row * Skx + first + jj] = host::round_to(bias.dtype, acc[jj]);
      }
    });
  }
  return g;
}

}  // namespace flash_dmattn::test::lowp
