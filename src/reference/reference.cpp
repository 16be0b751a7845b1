// Notation (docs/semantics.md): b batch, h query head, g = H/Hk, kv(h) = floor(h/g), i query row,
// j key, d head-dim index, s scale, c softcap.
//   z[i,j]   = c·tanh(s·<q[b,i,h,:], k[b,j,kv(h),:]>/c) + bias(b,h,i,j)   (no tanh when c = 0)
//   vis[i,j] = mask(b,h,i,j) and j in indices(b,h,i,:) and (not causal or j <= i + Sk - Sq)
//   LSE[i]   = log sum_{vis j} exp(z[i,j])           (+inf when no key is visible)
//   P[i,j]   = exp(z[i,j] - LSE[i]) on visible keys, 0 elsewhere
//   O[i,:]   = sum_j P[i,j]·v[b,j,kv(h),:]
#include "reference.h"

#include <cmath>
#include <limits>

#include "../host_numeric.h"
#include "../parallel.h"

namespace flash_dmattn::reference {
namespace {

using host::load;
using host::offset4;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Dims {
  std::int64_t B, Sq, Sk, H, Hk, D;
  double flops() const { return 4.0 * B * H * Sq * Sk * D; }
  explicit Dims(const Inputs& in)
      : B(in.q.shape[0]), Sq(in.q.shape[1]), Sk(in.k.shape[1]), H(in.q.shape[2]), Hk(in.k.shape[2]),
        D(in.q.shape[3]) {}
};

// Index of the mask or bias element that query head h, row i, key j of batch b reads. A size-1
// dimension is read at index 0; a head dimension of size Hm serves query head h with floor(h / (H/Hm)).
struct Broadcast {
  std::int64_t b, h, i, j;
  Broadcast(const TensorView& t, const Dims& n, std::int64_t b_, std::int64_t h_, std::int64_t i_, std::int64_t j_)
      : b(t.shape[0] == 1 ? 0 : b_), h(h_ / (n.H / t.shape[1])), i(t.shape[2] == 1 ? 0 : i_),
        j(t.shape[3] == 1 ? 0 : j_) {}
  std::int64_t view_offset(const TensorView& t) const { return offset4(t, b, h, i, j); }
  // Offset in a contiguous buffer of t's shape (used for dbias).
  std::int64_t dense_offset(const TensorView& t) const {
    return ((b * t.shape[1] + h) * t.shape[2] + i) * t.shape[3] + j;
  }
};

// Whether the mask keeps key j of row (b, h, i): a nonzero element, or in a bit-packed (uint8)
// mask, bit j % 8 of byte j / 8 (its key dim holds bytes, never broadcast).
bool mask_keeps(const TensorView& mask, const Dims& n, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  if (mask.dtype != DType::uint8) return load(mask, Broadcast(mask, n, b, h, i, j).view_offset(mask)) != 0.0;
  const Broadcast at(mask, n, b, h, i, 0);
  const auto byte = static_cast<std::uint32_t>(load(mask, offset4(mask, at.b, at.h, at.i, j / 8)));
  return ((byte >> (j % 8)) & 1u) != 0;
}

// Everything the forward and the backward need about one query row (b, h, i).
struct Row {
  std::vector<double> dot;      // <q_i, k_j>, unscaled
  std::vector<double> z;        // final logits
  std::vector<char> visible;
  std::vector<char> listed;     // with indices: the keys row i lists
  double lse = kInf;

  void compute(const Inputs& in, const Dims& n, std::int64_t b, std::int64_t h, std::int64_t i) {
    const std::int64_t kvh = h / (n.H / n.Hk);
    dot.assign(n.Sk, 0.0);
    z.assign(n.Sk, 0.0);
    visible.assign(n.Sk, 0);
    if (in.indices) {
      const TensorView& list = *in.indices;
      listed.assign(n.Sk, 0);
      const Broadcast at(list, n, b, h, i, 0);
      for (std::int64_t t = 0; t < list.shape[3]; ++t) {
        const double key = load(list, offset4(list, at.b, at.h, at.i, t));
        if (key >= 0 && key < static_cast<double>(n.Sk)) listed[static_cast<std::size_t>(key)] = 1;
      }
    }
    double zmax = -kInf;
    for (std::int64_t j = 0; j < n.Sk; ++j) {
      // vis = mask ∧ listed ∧ causal-limit; the causal diagonal is aligned to the bottom-right corner.
      bool vis = !in.causal || j <= i + n.Sk - n.Sq;
      if (vis && in.mask) vis = mask_keeps(*in.mask, n, b, h, i, j);
      if (vis && in.indices) vis = listed[j] != 0;
      if (!vis) continue;
      double acc = 0.0;
      for (std::int64_t d = 0; d < n.D; ++d) {
        acc += load(in.q, offset4(in.q, b, i, h, d)) * load(in.k, offset4(in.k, b, j, kvh, d));
      }
      double logit = in.scale * acc;
      if (in.softcap > 0.0) logit = in.softcap * std::tanh(logit / in.softcap);
      if (in.bias) logit += load(*in.bias, Broadcast(*in.bias, n, b, h, i, j).view_offset(*in.bias));
      dot[j] = acc;
      z[j] = logit;
      visible[j] = 1;
      zmax = std::max(zmax, logit);
    }
    // No visible key, or only keys whose logit is -inf (a -inf bias masks too): the softmax
    // denominator is 0, so the row is empty by definition: O = 0, LSE = +inf, P = 0.
    if (zmax == -kInf) {
      lse = kInf;
      return;
    }
    double sum = 0.0;
    for (std::int64_t j = 0; j < n.Sk; ++j)
      if (visible[j]) sum += std::exp(z[j] - zmax);
    lse = zmax + std::log(sum);
  }

  double p(std::int64_t j) const { return visible[j] && lse != kInf ? std::exp(z[j] - lse) : 0.0; }
};

}  // namespace

ForwardResult forward(const Inputs& in) {
  const Dims n(in);
  ForwardResult r;
  r.out.assign(n.B * n.Sq * n.H * n.D, 0.0);
  r.lse.assign(n.B * n.H * n.Sq, kInf);
  const std::int64_t items = n.B * n.H;  // one (b, h) per item; items write disjoint rows
  host::parallel_for(items, host::worker_count(items, n.flops()), [&](std::int64_t item, int) {
    const std::int64_t b = item / n.H, h = item % n.H, kvh = h / (n.H / n.Hk);
    Row row;
    for (std::int64_t i = 0; i < n.Sq; ++i) {
      row.compute(in, n, b, h, i);
      r.lse[(b * n.H + h) * n.Sq + i] = row.lse;
      double* o = &r.out[((b * n.Sq + i) * n.H + h) * n.D];
      for (std::int64_t j = 0; j < n.Sk; ++j) {
        const double p = row.p(j);
        if (p == 0.0) continue;
        for (std::int64_t d = 0; d < n.D; ++d) o[d] += p * load(in.v, offset4(in.v, b, j, kvh, d));
      }
    }
  });
  return r;
}

// With dO = dout and D_i = sum_j P[i,j]·dP[i,j] (= <dO_i, O_i>):
//   dP[i,j] = <dO_i, v_j>
//   dZ[i,j] = P[i,j]·(dP[i,j] - D_i)                          gradient of the logits
//   dS[i,j] = dZ[i,j]·s·(1 - tanh²(s·<q_i,k_j>/c))            gradient of <q_i,k_j> (factor 1 without softcap)
//   dq_i   += sum_j dS[i,j]·k_j;  dk_j += dS[i,j]·q_i;  dv_j += P[i,j]·dO_i   (dk, dv over the GQA group)
//   dbias  += dZ[i,j] at the bias element (b,h,i,j) reads, i.e. summed over every broadcast dimension
Gradients backward(const Inputs& in, const TensorView& dout, const GivenRows& given) {
  const Dims n(in);
  Gradients g;
  g.dq.assign(n.B * n.Sq * n.H * n.D, 0.0);
  g.dk.assign(n.B * n.Sk * n.Hk * n.D, 0.0);
  g.dv.assign(n.B * n.Sk * n.Hk * n.D, 0.0);
  const TensorView* bias = in.bias;
  const std::int64_t bias_size = bias ? bias->numel() : 0;
  g.dbias.assign(bias_size, 0.0);

  // One (b, kv head) per item: the item owns dk and dv of its KV head and dq of its query heads.
  // It owns its dbias elements too, unless the bias broadcasts over batch or over all heads while
  // there are several KV heads; then each worker sums into a private buffer, and the buffers are
  // added in worker order (deterministic).
  const std::int64_t items = n.B * n.Hk;
  const int workers = host::worker_count(items, 2.5 * n.flops());
  const bool shared_dbias = bias && ((bias->shape[0] == 1 && n.B > 1) || (bias->shape[1] == 1 && n.Hk > 1));
  std::vector<std::vector<double>> private_dbias(shared_dbias ? workers : 0, std::vector<double>(bias_size, 0.0));

  host::parallel_for(items, workers, [&](std::int64_t item, int worker) {
    const std::int64_t b = item / n.Hk, kvh = item % n.Hk, group = n.H / n.Hk;
    double* dbias = shared_dbias ? private_dbias[worker].data() : g.dbias.data();
    Row row;
    std::vector<double> dp(n.Sk);
    for (std::int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      for (std::int64_t i = 0; i < n.Sq; ++i) {
        row.compute(in, n, b, h, i);
        if (row.lse == kInf) continue;  // no visible key: every gradient of this row is 0
        const double given_lse = given.lse ? load(*given.lse, b * given.lse->stride[0] + h * given.lse->stride[1] +
                                                                   i * given.lse->stride[2])
                                           : std::nan("");
        const bool outer = !std::isnan(given_lse) && static_cast<float>(given_lse) != static_cast<float>(row.lse);
        if (outer) row.lse = given_lse;  // P = exp(z - LSE) from the given statistic from here on
        double d_i = 0.0;
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          dp[j] = 0.0;
          if (!row.visible[j]) continue;
          for (std::int64_t d = 0; d < n.D; ++d) {
            dp[j] += load(dout, offset4(dout, b, i, h, d)) * load(in.v, offset4(in.v, b, j, kvh, d));
          }
          if (!outer) d_i += row.p(j) * dp[j];
        }
        if (outer) {
          d_i = 0.0;
          for (std::int64_t d = 0; d < n.D; ++d) {
            d_i += load(dout, offset4(dout, b, i, h, d)) * load(*given.out, offset4(*given.out, b, i, h, d));
          }
        }
        double* dq = &g.dq[((b * n.Sq + i) * n.H + h) * n.D];
        for (std::int64_t j = 0; j < n.Sk; ++j) {
          if (!row.visible[j]) continue;
          const double p = row.p(j);
          const double dz = p * (dp[j] - d_i);
          double ds = dz * in.scale;
          if (in.softcap > 0.0) {
            const double t = std::tanh(in.scale * row.dot[j] / in.softcap);
            ds *= 1.0 - t * t;
          }
          double* dk = &g.dk[((b * n.Sk + j) * n.Hk + kvh) * n.D];
          double* dv = &g.dv[((b * n.Sk + j) * n.Hk + kvh) * n.D];
          for (std::int64_t d = 0; d < n.D; ++d) {
            dq[d] += ds * load(in.k, offset4(in.k, b, j, kvh, d));
            dk[d] += ds * load(in.q, offset4(in.q, b, i, h, d));
            dv[d] += p * load(dout, offset4(dout, b, i, h, d));
          }
          if (bias) dbias[Broadcast(*bias, n, b, h, i, j).dense_offset(*bias)] += dz;
        }
      }
    }
  });
  for (const auto& partial : private_dbias)
    for (std::int64_t e = 0; e < bias_size; ++e) g.dbias[e] += partial[e];
  return g;
}

}  // namespace flash_dmattn::reference
