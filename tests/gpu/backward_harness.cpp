// The GPU backward harness: problem construction, the device run (forward, then backward), and the
// comparison with the fp64 reference and the same-precision baseline (see the header).
#include "backward_harness.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "lowp_emulation.h"
#include "parallel.h"
#include "tolerance.h"

namespace flash_dmattn::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A view of rows [first, first + rows) of dimension `dim` (the rest unchanged).
TensorView slice(TensorView t, int dim, std::int64_t first, std::int64_t rows) {
  t.data = static_cast<char*>(t.data) + first * t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
  t.shape[dim] = rows;
  return t;
}

std::optional<DeviceTensor> upload_optional(const std::optional<HostTensor>& t) {
  return t ? std::optional<DeviceTensor>(DeviceTensor::upload(*t)) : std::nullopt;
}

// Which positions (b, h, i, j) are live: visible (mask and causal) with a finite logit, which
// for finite q and k means a bias other than -inf. Only live positions may give a nonzero
// gradient (docs/semantics.md §6). Costs one mask and one bias read per position, no dot products.
struct Liveness {
  std::vector<char> row;   // (B, H, Sq): the row has a live key
  std::vector<char> key;   // (B, Sk, Hk): some row of the KV head's group reads the key live
  std::vector<char> bias;  // the bias's shape, contiguous: some live position reads the element

  explicit Liveness(const reference::Inputs& in) {
    const std::int64_t B = in.q.shape[0], Sq = in.q.shape[1], H = in.q.shape[2];
    const std::int64_t Sk = in.k.shape[1], Hk = in.k.shape[2];
    row.assign(B * H * Sq, 0);
    std::vector<std::atomic<unsigned char>> key_live(B * Sk * Hk);
    std::vector<std::atomic<unsigned char>> bias_live(in.bias ? in.bias->numel() : 0);
    const std::int64_t items = B * H;
    host::parallel_for(items, host::worker_count(items, 8.0 * B * H * Sq * Sk), [&](std::int64_t item, int) {
      const std::int64_t b = item / H, h = item % H, m = h / (H / Hk);
      for (std::int64_t i = 0; i < Sq; ++i) {
        // Element (b, h, i, j) of a broadcast operand: size-1 dimensions read index 0.
        std::int64_t mask_base = 0, mask_step = 0, bias_base = 0, bias_step = 0, bias_dense = 0, bias_dense_step = 0;
        if (in.mask) {
          const TensorView& t = *in.mask;
          mask_base = host::offset4(t, t.shape[0] == 1 ? 0 : b, h / (H / t.shape[1]), t.shape[2] == 1 ? 0 : i, 0);
          mask_step = t.shape[3] == 1 ? 0 : t.stride[3];
        }
        if (in.bias) {
          const TensorView& t = *in.bias;
          const std::int64_t bb = t.shape[0] == 1 ? 0 : b, hh = h / (H / t.shape[1]), ii = t.shape[2] == 1 ? 0 : i;
          bias_base = host::offset4(t, bb, hh, ii, 0);
          bias_step = t.shape[3] == 1 ? 0 : t.stride[3];
          bias_dense = ((bb * t.shape[1] + hh) * t.shape[2] + ii) * t.shape[3];
          bias_dense_step = t.shape[3] == 1 ? 0 : 1;
        }
        bool any = false;
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (in.causal && j > i + Sk - Sq) break;
          if (in.mask && host::load(*in.mask, mask_base + j * mask_step) == 0.0) continue;
          if (in.bias && host::load(*in.bias, bias_base + j * bias_step) == -kInf) continue;
          any = true;
          key_live[(b * Sk + j) * Hk + m].store(1, std::memory_order_relaxed);
          if (in.bias) bias_live[bias_dense + j * bias_dense_step].store(1, std::memory_order_relaxed);
        }
        row[(b * H + h) * Sq + i] = any;
      }
    });
    key.resize(key_live.size());
    for (std::size_t e = 0; e < key.size(); ++e) key[e] = static_cast<char>(key_live[e].load());
    bias.resize(bias_live.size());
    for (std::size_t e = 0; e < bias.size(); ++e) bias[e] = static_cast<char>(bias_live[e].load());
  }
};

// A rank-4 view's elements in row-major order.
std::vector<double> view_values(const TensorView& t) {
  std::vector<double> values;
  values.reserve(t.numel());
  for (std::int64_t a = 0; a < t.shape[0]; ++a)
    for (std::int64_t b = 0; b < t.shape[1]; ++b)
      for (std::int64_t c = 0; c < t.shape[2]; ++c)
        for (std::int64_t d = 0; d < t.shape[3]; ++d) values.push_back(host::load(t, host::offset4(t, a, b, c, d)));
  return values;
}

// What the `out` a kernel is given does to dq, dk and dbias (see expect_gradients_match_reference
// in the header): every dZ = P·(dP − Δ) carries −P·δ with δ = <dO, out − O> of its row. Per
// dbias element, shift = −Σ P·δ and allowance = Σ P·γ_D·Σ_d|dO·out| over the positions (b, h, i,
// j) that read it; dq and dk get the same terms through the logits' derivative (scale, and
// softcap's 1 − tanh²) times k and q. P, LSE and O are recomputed here in fp64 from the inputs
// (own code, sharing nothing with the reference).
struct DeltaShift {
  std::vector<double> shift, allowance;         // dbias, where the inputs have a bias
  std::vector<double> dq_shift, dq_allowance;   // (B, Sq, H, D)
  std::vector<double> dk_shift, dk_allowance;   // (B, Sk, Hk, D)

  DeltaShift(const reference::Inputs& in, const HostTensor& dout_tensor, const HostTensor& out_tensor) {
    const std::int64_t B = in.q.shape[0], Sq = in.q.shape[1], H = in.q.shape[2], D = in.q.shape[3];
    const std::int64_t Sk = in.k.shape[1], Hk = in.k.shape[2];
    const TensorView* bias = in.bias ? &*in.bias : nullptr;
    const std::int64_t Bx = bias ? bias->shape[0] : 1, Hx = bias ? bias->shape[1] : 1;
    const std::int64_t Sqx = bias ? bias->shape[2] : 1, Skx = bias ? bias->shape[3] : 1;
    if (bias) {
      shift.assign(bias->numel(), 0.0);
      allowance.assign(bias->numel(), 0.0);
    }
    dq_shift.assign(B * Sq * H * D, 0.0);
    dq_allowance.assign(B * Sq * H * D, 0.0);
    dk_shift.assign(B * Sk * Hk * D, 0.0);
    dk_allowance.assign(B * Sk * Hk * D, 0.0);
    if (B == 0 || Sq == 0 || Sk == 0 || H == 0) return;
    // (The problems here hold bool masks and no key indices; anything else keeps no shift.)
    if (in.indices || (in.mask && in.mask->dtype == DType::uint8)) return;
    const double gamma = static_cast<double>(D) * std::ldexp(1.0, -24);

    // Operands as doubles: q, dout and out (B, Sq, H, D), k and v (B, Hk, Sk, D).
    const std::vector<double> q = view_values(in.q), dout = dout_tensor.values(), out = out_tensor.values();
    std::vector<double> k(B * Hk * Sk * D), v(B * Hk * Sk * D);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < Sk; ++j)
        for (std::int64_t m = 0; m < Hk; ++m)
          for (std::int64_t d = 0; d < D; ++d) {
            k[((b * Hk + m) * Sk + j) * D + d] = host::load(in.k, host::offset4(in.k, b, j, m, d));
            v[((b * Hk + m) * Sk + j) * D + d] = host::load(in.v, host::offset4(in.v, b, j, m, d));
          }

    // Pass 1, over rows: P of every position (0 where hidden or -inf) and P times the logit's
    // derivative by q·k, δ and Σ_d|dO·out| of the row, and the row's dq terms.
    std::vector<float> p_all(B * H * Sq * Sk, 0.0f), slope_all(B * H * Sq * Sk, 0.0f);
    std::vector<double> delta(B * H * Sq, 0.0), magnitude(B * H * Sq, 0.0);
    const std::int64_t rows = B * H * Sq;
    host::parallel_for(rows, host::worker_count(rows, 6.0 * rows * Sk * D), [&](std::int64_t row, int) {
      const std::int64_t b = row / (H * Sq), h = row / Sq % H, i = row % Sq, m = h / (H / Hk);
      const double* qi = &q[((b * Sq + i) * H + h) * D];
      std::vector<double> z(Sk, -kInf), slope(Sk, in.scale);
      double zmax = -kInf;
      for (std::int64_t j = 0; j < Sk; ++j) {
        if (in.causal && j > i + Sk - Sq) break;
        if (in.mask) {
          const TensorView& t = *in.mask;
          const std::int64_t at = host::offset4(t, t.shape[0] == 1 ? 0 : b, h / (H / t.shape[1]),
                                                t.shape[2] == 1 ? 0 : i, t.shape[3] == 1 ? 0 : j);
          if (host::load(t, at) == 0.0) continue;
        }
        const double* kj = &k[((b * Hk + m) * Sk + j) * D];
        double dot = 0.0;
        for (std::int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
        double logit = in.scale * dot;
        if (in.softcap > 0.0) {
          const double t = std::tanh(logit / in.softcap);
          logit = in.softcap * t;
          slope[j] = in.scale * (1.0 - t * t);
        }
        if (bias) {
          logit += host::load(*bias, host::offset4(*bias, Bx == 1 ? 0 : b, h / (H / Hx), Sqx == 1 ? 0 : i,
                                                    Skx == 1 ? 0 : j));
        }
        z[j] = logit;
        zmax = std::max(zmax, logit);
      }
      if (zmax == -kInf) return;  // an empty row: P = 0 everywhere
      double sum = 0.0;
      for (std::int64_t j = 0; j < Sk; ++j) sum += std::exp(z[j] - zmax);
      const double lse = zmax + std::log(sum);
      std::vector<double> o(D, 0.0);
      float* p = &p_all[row * Sk];
      float* p_slope = &slope_all[row * Sk];
      for (std::int64_t j = 0; j < Sk; ++j) {
        if (z[j] == -kInf) continue;
        const double pj = std::exp(z[j] - lse);
        p[j] = static_cast<float>(pj);
        p_slope[j] = static_cast<float>(pj * slope[j]);
        const double* vj = &v[((b * Hk + m) * Sk + j) * D];
        for (std::int64_t d = 0; d < D; ++d) o[d] += pj * vj[d];
      }
      const std::int64_t at = ((b * Sq + i) * H + h) * D;
      for (std::int64_t d = 0; d < D; ++d) {
        delta[row] += dout[at + d] * (out[at + d] - o[d]);
        magnitude[row] += std::abs(dout[at + d] * out[at + d]);
      }
      for (std::int64_t j = 0; j < Sk; ++j) {
        if (p_slope[j] == 0.0f) continue;
        const double* kj = &k[((b * Hk + m) * Sk + j) * D];
        for (std::int64_t d = 0; d < D; ++d) {
          dq_shift[at + d] -= p_slope[j] * delta[row] * kj[d];
          dq_allowance[at + d] += p_slope[j] * gamma * magnitude[row] * std::abs(kj[d]);
        }
      }
    });

    // Pass 2, over (batch, KV head, key): dk's terms, summed over the rows of the head's group.
    const std::int64_t group = H / Hk, keys = B * Hk * Sk;
    host::parallel_for(keys, host::worker_count(keys, 2.0 * rows * Sk * D), [&](std::int64_t key, int) {
      const std::int64_t b = key / (Hk * Sk), m = key / Sk % Hk, j = key % Sk;
      double* dk_at = &dk_shift[((b * Sk + j) * Hk + m) * D];
      double* allowance_at = &dk_allowance[((b * Sk + j) * Hk + m) * D];
      for (std::int64_t h = m * group; h < (m + 1) * group; ++h)
        for (std::int64_t i = 0; i < Sq; ++i) {
          const std::int64_t row = (b * H + h) * Sq + i;
          const double w = slope_all[row * Sk + j];
          if (w == 0.0) continue;
          const double* qi = &q[((b * Sq + i) * H + h) * D];
          for (std::int64_t d = 0; d < D; ++d) {
            dk_at[d] -= w * delta[row] * qi[d];
            allowance_at[d] += w * gamma * magnitude[row] * std::abs(qi[d]);
          }
        }
    });
    if (!bias) return;

    // Pass 3, over (dbias row, block of keys): sum over the rows that read the dbias row. Each
    // query row (b, h, i) reads exactly one dbias row.
    constexpr std::int64_t kKeys = 512;
    const std::int64_t blocks = (Skx + kKeys - 1) / kKeys, items = Bx * Hx * Sqx * blocks;
    const std::int64_t heads_per_bias_head = H / Hx;
    host::parallel_for(items, host::worker_count(items, 2.0 * rows * Sk), [&](std::int64_t item, int) {
      const std::int64_t bias_row = item / blocks;
      const std::int64_t bb = bias_row / (Hx * Sqx), hh = bias_row / Sqx % Hx, ii = bias_row % Sqx;
      const std::int64_t first = item % blocks * kKeys, last = std::min(first + kKeys, Skx);
      for (std::int64_t b = Bx == 1 ? 0 : bb; b < (Bx == 1 ? B : bb + 1); ++b)
        for (std::int64_t h = hh * heads_per_bias_head; h < (hh + 1) * heads_per_bias_head; ++h)
          for (std::int64_t i = Sqx == 1 ? 0 : ii; i < (Sqx == 1 ? Sq : ii + 1); ++i) {
            const std::int64_t row = (b * H + h) * Sq + i;
            const float* p = &p_all[row * Sk];
            for (std::int64_t c = first; c < last; ++c) {
              // A bias with key dim 1 sums the whole row into its one column.
              const std::int64_t j_first = Skx == 1 ? 0 : c, j_last = Skx == 1 ? Sk : c + 1;
              double mass = 0.0;
              for (std::int64_t j = j_first; j < j_last; ++j) mass += p[j];
              shift[bias_row * Skx + c] -= mass * delta[row];
              allowance[bias_row * Skx + c] += mass * gamma * magnitude[row];
            }
          }
    });
  }
};

// Fails (the first element named, then a count) when an element that must be exactly zero is
// not: element e of `values` (row-major in `shape`) must be 0 when dead(e / unit) holds.
template <typename Dead>
void expect_exact_zeros(const char* name, const char* why, const std::vector<double>& values, std::int64_t unit,
                        const std::vector<std::int64_t>& shape, Dead dead) {
  std::int64_t wrong = 0;
  for (std::size_t e = 0; e < values.size(); ++e) {
    if (values[e] == 0.0 || !dead(static_cast<std::int64_t>(e) / unit)) continue;
    if (wrong++ == 0) {
      ADD_FAILURE() << name << " at " << coordinates(static_cast<std::int64_t>(e), shape) << " is " << values[e]
                    << ", expected exactly 0 (" << why << ")";
    }
  }
  EXPECT_EQ(wrong, 0) << name << ": elements that must be exactly 0 are not (" << why << ")";
}

}  // namespace

bool every_backward_deterministic() {
  const char* value = std::getenv("FLASH_DMATTN_TEST_DETERMINISTIC");
  return value && std::string(value) == "1";
}

BackwardProblem BackwardProblem::random(const BackwardCase& c, std::mt19937_64& rng) {
  BackwardProblem p;
  static_cast<ForwardProblem&>(p) = ForwardProblem::random(c, rng);
  const Sizes& n = c.n;
  const GradientLayout& l = c.gradients;
  p.dout = HostTensor::random(c.dtype, {n.B, n.Sq, n.H, n.D}, rng, -1.0, 1.0, l.dout_row_pad);
  p.dq = HostTensor::empty(c.dtype, {n.B, n.Sq, n.H, n.D}, l.dq_row_pad);
  p.dk = HostTensor::empty(c.dtype, {n.B, n.Sk, n.Hk, n.D}, l.dkv_row_pad);
  p.dv = HostTensor::empty(c.dtype, {n.B, n.Sk, n.Hk, n.D}, l.dkv_row_pad);
  if (p.bias && c.dbias) {
    const TensorView& b = p.bias->view;
    p.dbias = HostTensor::empty(b.dtype, {b.shape[0], b.shape[1], b.shape[2], b.shape[3]}, l.dbias_row_pad);
  }
  p.deterministic = c.deterministic || every_backward_deterministic();
  return p;
}

GpuBackward::GpuBackward(const BackwardProblem& p, cudaStream_t stream)
    : problem_(p),
      stream_(stream),
      q_(DeviceTensor::upload(p.q)),
      k_(DeviceTensor::upload(p.k)),
      v_(DeviceTensor::upload(p.v)),
      mask_(upload_optional(p.mask)),
      bias_(upload_optional(p.bias)),
      dout_(DeviceTensor::upload(p.dout)),
      dq_(DeviceTensor::poisoned(p.dq)),
      dk_(DeviceTensor::poisoned(p.dk)),
      dv_(DeviceTensor::poisoned(p.dv)),
      dbias_(p.dbias ? std::optional<DeviceTensor>(DeviceTensor::poisoned(*p.dbias)) : std::nullopt) {
  // Copies from pageable memory may still be in flight when cudaMemcpy returns, and our stream
  // does not wait for the legacy default stream.
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (after the uploads)");
  args_.q = q_.view();
  args_.k = k_.view();
  args_.v = v_.view();
  if (mask_) args_.mask = mask_->view();
  if (bias_) args_.bias = bias_->view();
  args_.dout = dout_.view();
  args_.dq = dq_.view();
  args_.dk = dk_.view();
  args_.dv = dv_.view();
  if (dbias_) args_.dbias = dbias_->view();
  args_.options = p.options;
  args_.options.stream = stream;
  args_.deterministic = p.deterministic;
}

void GpuBackward::prepare() {
  // The forward, on the same device inputs, into guard-framed outputs.
  {
    const DeviceTensor out = DeviceTensor::poisoned(problem_.out), lse = DeviceTensor::poisoned(problem_.lse);
    ForwardArgs f;
    f.q = args_.q;
    f.k = args_.k;
    f.v = args_.v;
    f.mask = args_.mask;
    f.bias = args_.bias;
    f.out = out.view();
    f.lse = lse.view();
    f.options = args_.options;
    Capability capability;
    const Status query = query_forward(f, &capability);
    if (head_dim_not_compiled(query)) GTEST_SKIP() << "forward: " << query.message();
    ASSERT_TRUE(query.ok()) << "forward: " << status_code_name(query.code()) << ": " << query.message();
    std::size_t bytes = 0;
    const Status size = forward_workspace_size(f, &bytes);
    ASSERT_TRUE(size.ok()) << "forward: " << status_code_name(size.code()) << ": " << size.message();
    const DeviceBuffer workspace(bytes);
    f.workspace = workspace.workspace();
    const Status status = forward(f);
    ASSERT_TRUE(status.ok()) << "forward: " << status_code_name(status.code()) << ": " << status.message();
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (after the forward)");
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error the library's forward did not report";
    EXPECT_TRUE(out.untouched_outside_view("out (written by the forward)"));
    EXPECT_TRUE(lse.untouched_outside_view("lse (written by the forward)"));
    forward_.emplace(GpuOutputs{out.download(), lse.download()});
  }
  out_.emplace(DeviceTensor::upload(forward_->out));
  lse_.emplace(DeviceTensor::upload(forward_->lse));
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (after uploading out and lse)");
  args_.out = out_->view();
  args_.lse = lse_->view();

  Capability capability;
  const Status query = query_backward(args_, &capability);
  if (head_dim_not_compiled(query)) GTEST_SKIP() << query.message();
  ASSERT_TRUE(query.ok()) << status_code_name(query.code()) << ": " << query.message();
  std::size_t bytes = 0;
  const Status size = backward_workspace_size(args_, &bytes);
  ASSERT_TRUE(size.ok()) << status_code_name(size.code()) << ": " << size.message();
  workspace_ = DeviceBuffer(bytes);
  // On our stream: a cudaMemset (legacy stream) could land after the call's own zeroing.
  if (bytes > 0) cuda_check(cudaMemsetAsync(workspace_.data(), 0xFF, bytes, stream_), "cudaMemsetAsync (workspace)");
  args_.workspace = workspace_.workspace();
}

void GpuBackward::poison_outputs() const {
  dq_.poison_async(stream_);
  dk_.poison_async(stream_);
  dv_.poison_async(stream_);
  if (dbias_) dbias_->poison_async(stream_);
}

GpuGradients GpuBackward::finish() const {
  cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (after the backward)");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error the library did not report";
  GpuGradients result{dq_.download(), dk_.download(), dv_.download(),
                      dbias_ ? std::optional<HostTensor>(dbias_->download()) : std::nullopt, forward_->out};
  EXPECT_TRUE(q_.untouched_outside_view("q"));
  EXPECT_TRUE(k_.untouched_outside_view("k"));
  EXPECT_TRUE(v_.untouched_outside_view("v"));
  if (mask_) {
    EXPECT_TRUE(mask_->untouched_outside_view("mask"));
  }
  if (bias_) {
    EXPECT_TRUE(bias_->untouched_outside_view("bias"));
  }
  EXPECT_TRUE(dout_.untouched_outside_view("dout"));
  if (out_) {
    EXPECT_TRUE(out_->untouched_outside_view("out"));
  }
  if (lse_) {
    EXPECT_TRUE(lse_->untouched_outside_view("lse"));
  }
  EXPECT_TRUE(dq_.untouched_outside_view("dq"));
  EXPECT_TRUE(dk_.untouched_outside_view("dk"));
  EXPECT_TRUE(dv_.untouched_outside_view("dv"));
  if (dbias_) {
    EXPECT_TRUE(dbias_->untouched_outside_view("dbias"));
  }
  return result;
}

reference::Gradients reference_backward(const reference::Inputs& in, const TensorView& dout) {
  const std::int64_t B = in.q.shape[0], Sq = in.q.shape[1], H = in.q.shape[2], D = in.q.shape[3];
  const std::int64_t Sk = in.k.shape[1], Hk = in.k.shape[2];
  const double flops = 10.0 * B * H * Sq * Sk * D;
  const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  // reference::backward runs one (b, KV head) per thread; blocks of rows run side by side to fill the rest.
  const std::int64_t lanes = B * Hk > 0 ? std::max<std::int64_t>(1, hw / (B * Hk)) : 1;
  if (lanes == 1 || flops < (1 << 26) || Sq < 2 || Sk == 0) return reference::backward(in, dout);

  const TensorView* bias = in.bias;
  reference::Gradients g;
  g.dq.assign(B * Sq * H * D, 0.0);
  g.dk.assign(B * Sk * Hk * D, 0.0);
  g.dv.assign(B * Sk * Hk * D, 0.0);
  g.dbias.assign(bias ? bias->numel() : 0, 0.0);
  // A bias with a row dimension gives each block its own dbias rows; otherwise the blocks' dbias
  // sums add up, like dk and dv, in per-lane buffers summed in lane order. parallel_for hands the
  // blocks out round-robin, so every run adds the same numbers in the same order.
  const bool bias_rows = bias && bias->shape[2] != 1;
  struct LaneSums {
    std::vector<double> dk, dv, dbias;
  };
  std::vector<LaneSums> lane_sums(lanes, LaneSums{std::vector<double>(g.dk.size(), 0.0),
                                                  std::vector<double>(g.dv.size(), 0.0),
                                                  std::vector<double>(bias && !bias_rows ? g.dbias.size() : 0, 0.0)});
  // More blocks than lanes: with causal, later rows see more keys.
  const std::int64_t rows_per_block = (Sq + std::min(Sq, 4 * lanes) - 1) / std::min(Sq, 4 * lanes);
  const std::int64_t blocks = (Sq + rows_per_block - 1) / rows_per_block;
  host::parallel_for(blocks, static_cast<int>(lanes), [&](std::int64_t block, int lane) {
    const std::int64_t first = block * rows_per_block, rows = std::min(rows_per_block, Sq - first);
    // Causal visibility j <= i + Sk - Sq is aligned to the last row: a block ending at row
    // first + rows keeps that alignment over the first Sk - (Sq - first - rows) keys, and the
    // keys after those are hidden from all of its rows anyway.
    const std::int64_t keys = in.causal ? std::max<std::int64_t>(0, Sk - (Sq - first - rows)) : Sk;
    reference::Inputs part = in;
    part.q = slice(in.q, 1, first, rows);
    part.k = slice(in.k, 1, 0, keys);
    part.v = slice(in.v, 1, 0, keys);
    TensorView mask_part, bias_part;
    for (auto [operand, view] : {std::make_pair(in.mask, &mask_part), std::make_pair(in.bias, &bias_part)}) {
      if (!operand) continue;
      *view = operand->shape[2] == 1 ? *operand : slice(*operand, 2, first, rows);
      if (view->shape[3] != 1) view->shape[3] = keys;
    }
    part.mask = in.mask ? &mask_part : nullptr;
    part.bias = in.bias ? &bias_part : nullptr;
    const reference::Gradients r = reference::backward(part, slice(dout, 1, first, rows));

    for (std::int64_t b = 0; b < B; ++b)
      std::copy_n(&r.dq[b * rows * H * D], rows * H * D, &g.dq[(b * Sq + first) * H * D]);
    LaneSums& sums = lane_sums[lane];
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t e = 0; e < keys * Hk * D; ++e) {
        sums.dk[b * Sk * Hk * D + e] += r.dk[b * keys * Hk * D + e];
        sums.dv[b * Sk * Hk * D + e] += r.dv[b * keys * Hk * D + e];
      }
    if (bias) {
      const std::int64_t Bx = bias->shape[0], Hx = bias->shape[1], Sqx = bias->shape[2], Skx = bias->shape[3];
      const std::int64_t part_rows = bias_rows ? rows : 1, part_keys = Skx == 1 ? 1 : keys;
      for (std::int64_t bh = 0; bh < Bx * Hx; ++bh)
        for (std::int64_t i = 0; i < part_rows; ++i)
          for (std::int64_t j = 0; j < part_keys; ++j) {
            const double x = r.dbias[(bh * part_rows + i) * part_keys + j];
            if (bias_rows) {
              g.dbias[(bh * Sqx + first + i) * Skx + j] = x;
            } else {
              sums.dbias[bh * Skx + j] += x;
            }
          }
    }
  });
  for (const LaneSums& sums : lane_sums) {
    for (std::size_t e = 0; e < g.dk.size(); ++e) {
      g.dk[e] += sums.dk[e];
      g.dv[e] += sums.dv[e];
    }
    for (std::size_t e = 0; e < sums.dbias.size(); ++e) g.dbias[e] += sums.dbias[e];
  }
  return g;
}

void expect_gradients_match_reference(const BackwardProblem& p, const GpuGradients& gpu) {
  const Sizes& n = p.n;
  const reference::Inputs in = p.inputs();
  const reference::Gradients ref = reference_backward(in, p.dout.view);
  const reference::Gradients lowp = lowp::backward(in, p.dout.view);
  const DType dtype = p.q.view.dtype;
  const std::vector<std::int64_t> q_shape = {n.B, n.Sq, n.H, n.D}, k_shape = {n.B, n.Sk, n.Hk, n.D};
  const std::vector<double> dq = gpu.dq.values(), dk = gpu.dk.values(), dv = gpu.dv.values();
  const DeltaShift shift(in, p.dout, gpu.out);
  // values + by, element by element (the reference's and the emulation's, shifted alike).
  const auto shifted = [](std::vector<double> values, const std::vector<double>& by) {
    for (std::size_t e = 0; e < values.size(); ++e) values[e] += by[e];
    return values;
  };
  {
    SCOPED_TRACE("dq, dk: reference and emulation shifted by the out the backward was given (Δ)");
    EXPECT_TRUE(within_tolerance("dq", dq, shifted(lowp.dq, shift.dq_shift), shifted(ref.dq, shift.dq_shift), dtype,
                                 q_shape, &shift.dq_allowance));
    EXPECT_TRUE(within_tolerance("dk", dk, shifted(lowp.dk, shift.dk_shift), shifted(ref.dk, shift.dk_shift), dtype,
                                 k_shape, &shift.dk_allowance));
  }
  EXPECT_TRUE(within_tolerance("dv", dv, lowp.dv, ref.dv, dtype, k_shape));
  std::vector<double> dbias;
  std::vector<std::int64_t> bias_shape;
  if (p.dbias) {
    ASSERT_TRUE(gpu.dbias.has_value()) << "the problem asks for dbias but no dbias came back";
    const TensorView& b = p.bias->view;
    bias_shape = {b.shape[0], b.shape[1], b.shape[2], b.shape[3]};
    dbias = gpu.dbias->values();
    if (b.shape[3] == 1) {
      // A bias with key dim 1 cancels in the softmax: its gradient is exactly 0 (docs/semantics.md
      // §6), and the CUDA backend returns that exact value.
      std::int64_t nonzero = 0;
      for (double x : dbias) nonzero += x != 0.0;
      EXPECT_EQ(nonzero, 0) << "dbias of a bias with key dim 1 must be exactly 0";
    } else {
      SCOPED_TRACE("dbias: reference and emulation shifted by -sum P * <dO, out - O> (the out the backward was given)");
      EXPECT_TRUE(within_tolerance("dbias", dbias, shifted(lowp.dbias, shift.shift), shifted(ref.dbias, shift.shift),
                                   b.dtype, bias_shape, &shift.allowance));
    }
  }

  // Exact zeros (docs/semantics.md §6): nothing is added where no live position contributes.
  const Liveness live(in);
  // dq (B, Sq, H, D): one row per (b, i, h); the liveness row index is (b, h, i).
  expect_exact_zeros("dq", "a row with no visible key or only -inf logits", dq, n.D, q_shape,
                     [&](std::int64_t bih) {
                       const std::int64_t h = bih % n.H, i = bih / n.H % n.Sq, b = bih / (n.H * n.Sq);
                       return !live.row[(b * n.H + h) * n.Sq + i];
                     });
  const auto dead_key = [&](std::int64_t bjm) { return !live.key[bjm]; };
  expect_exact_zeros("dk", "a key that no row sees with a finite logit", dk, n.D, k_shape, dead_key);
  expect_exact_zeros("dv", "a key that no row sees with a finite logit", dv, n.D, k_shape, dead_key);
  if (p.dbias) {
    expect_exact_zeros("dbias", "no visible position with a finite logit reads the element", dbias, 1, bias_shape,
                       [&](std::int64_t e) { return !live.bias[e]; });
  }
}

void expect_backward_matches_reference(const BackwardProblem& p, cudaStream_t stream) {
  GpuBackward gpu(p, stream);
  gpu.prepare();
  if (test_stopped()) return;
  const Status status = gpu.run();
  ASSERT_TRUE(status.ok()) << status_code_name(status.code()) << ": " << status.message();
  expect_gradients_match_reference(p, gpu.finish());
}

}  // namespace flash_dmattn::test
