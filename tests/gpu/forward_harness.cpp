// The GPU forward harness: problem construction, the device run, and the comparison with the
// fp64 reference and the same-precision baseline (see the header).
#include "forward_harness.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>
#include <thread>

#include "lowp_emulation.h"
#include "parallel.h"
#include "tolerance.h"

namespace flash_dmattn::test {
namespace {

std::optional<HostTensor> random_operand(const std::optional<OperandShape>& shape, const Sizes& n, DType dtype,
                                         double lo, double hi, std::int64_t row_pad, bool zero_broadcast_strides,
                                         std::mt19937_64& rng) {
  if (!shape) return std::nullopt;
  HostTensor t = HostTensor::random(dtype, operand_shape(n, *shape), rng, lo, hi, row_pad);
  if (zero_broadcast_strides) {
    for (int d = 0; d < 4; ++d)
      if (t.view.shape[d] == 1) t.view.stride[d] = 0;
  }
  return t;
}

// A view of rows [first, first + rows) of dimension `dim` (the rest unchanged).
TensorView slice(TensorView t, int dim, std::int64_t first, std::int64_t rows) {
  t.data = static_cast<char*>(t.data) + first * t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
  t.shape[dim] = rows;
  return t;
}

}  // namespace

bool head_dim_not_compiled(const Status& status) {
  if (status.code() != StatusCode::unsupported) return false;
  std::string message = status.message();
  std::transform(message.begin(), message.end(), message.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  const auto has = [&](const char* words) { return message.find(words) != std::string::npos; };
  return has("head dim") && (has("not compiled") || has("does not include"));
}

ForwardProblem ForwardProblem::random(const ForwardCase& c, std::mt19937_64& rng) {
  const Sizes& n = c.n;
  const Layout& l = c.layout;
  ForwardProblem p;
  p.n = n;
  p.q = HostTensor::random(c.dtype, {n.B, n.Sq, n.H, n.D}, rng, -1.0, 1.0, l.qkv_row_pad);
  p.k = HostTensor::random(c.dtype, {n.B, n.Sk, n.Hk, n.D}, rng, -1.0, 1.0, l.qkv_row_pad);
  p.v = HostTensor::random(c.dtype, {n.B, n.Sk, n.Hk, n.D}, rng, -1.0, 1.0, l.qkv_row_pad);
  p.mask = random_operand(c.mask, n, DType::boolean, c.density, 1.0, l.mask_row_pad, l.zero_broadcast_strides, rng);
  p.bias = random_operand(c.bias, n, c.bias_dtype.value_or(c.dtype), -2.0, 2.0, l.bias_row_pad,
                          l.zero_broadcast_strides, rng);
  p.out = HostTensor::empty(c.dtype, {n.B, n.Sq, n.H, n.D}, l.out_row_pad);
  p.lse = HostTensor::empty(DType::float32, {n.B, n.H, n.Sq}, l.lse_row_pad);
  p.options.causal = c.causal;
  p.options.softcap = c.softcap;
  p.options.softmax_scale = c.scale;
  return p;
}

reference::Inputs ForwardProblem::inputs() const {
  reference::Inputs in;
  in.q = q.view;
  in.k = k.view;
  in.v = v.view;
  in.mask = mask ? &mask->view : nullptr;
  in.bias = bias ? &bias->view : nullptr;
  in.scale = options.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(n.D)));
  in.causal = options.causal;
  in.softcap = options.softcap;
  return in;
}

GpuForward::GpuForward(const ForwardProblem& p, cudaStream_t stream)
    : stream_(stream),
      q_(DeviceTensor::upload(p.q)),
      k_(DeviceTensor::upload(p.k)),
      v_(DeviceTensor::upload(p.v)),
      mask_(p.mask ? std::optional<DeviceTensor>(DeviceTensor::upload(*p.mask)) : std::nullopt),
      bias_(p.bias ? std::optional<DeviceTensor>(DeviceTensor::upload(*p.bias)) : std::nullopt),
      out_(DeviceTensor::poisoned(p.out)),
      lse_(DeviceTensor::poisoned(p.lse)) {
  // Copies from pageable memory may still be in flight when cudaMemcpy returns, and our stream
  // does not wait for the legacy default stream.
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (after the uploads)");
  args_.q = q_.view();
  args_.k = k_.view();
  args_.v = v_.view();
  if (mask_) args_.mask = mask_->view();
  if (bias_) args_.bias = bias_->view();
  args_.out = out_.view();
  args_.lse = lse_.view();
  args_.options = p.options;
  args_.options.stream = stream;
}

void GpuForward::prepare() {
  Capability capability;
  const Status query = query_forward(args_, &capability);
  if (head_dim_not_compiled(query)) GTEST_SKIP() << query.message();
  ASSERT_TRUE(query.ok()) << status_code_name(query.code()) << ": " << query.message();
  std::size_t bytes = 0;
  const Status size = forward_workspace_size(args_, &bytes);
  ASSERT_TRUE(size.ok()) << status_code_name(size.code()) << ": " << size.message();
  workspace_ = DeviceBuffer(bytes);
  args_.workspace = workspace_.workspace();
}

void GpuForward::poison_outputs() const {
  out_.poison_async(stream_);
  lse_.poison_async(stream_);
}

GpuOutputs GpuForward::finish() const {
  cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (after the forward)");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error the library did not report";
  GpuOutputs result{out_.download(), lse_.download()};
  EXPECT_TRUE(q_.untouched_outside_view("q"));
  EXPECT_TRUE(k_.untouched_outside_view("k"));
  EXPECT_TRUE(v_.untouched_outside_view("v"));
  if (mask_) {
    EXPECT_TRUE(mask_->untouched_outside_view("mask"));
  }
  if (bias_) {
    EXPECT_TRUE(bias_->untouched_outside_view("bias"));
  }
  EXPECT_TRUE(out_.untouched_outside_view("out"));
  EXPECT_TRUE(lse_.untouched_outside_view("lse"));
  return result;
}

reference::Inputs query_rows(const reference::Inputs& in, std::int64_t first, std::int64_t rows, QueryRowViews& views) {
  const std::int64_t Sq = in.q.shape[1], Sk = in.k.shape[1];
  // Causal visibility j <= i + Sk - Sq is aligned to the last row: rows ending at row
  // first + rows keep that alignment over the first Sk - (Sq - first - rows) keys, and the keys
  // after those are hidden from all of them anyway.
  const std::int64_t keys = in.causal ? std::max<std::int64_t>(0, Sk - (Sq - first - rows)) : Sk;
  reference::Inputs part = in;
  part.q = slice(in.q, 1, first, rows);
  part.k = slice(in.k, 1, 0, keys);
  part.v = slice(in.v, 1, 0, keys);
  for (auto [operand, view] : {std::make_pair(in.mask, &views.mask), std::make_pair(in.bias, &views.bias)}) {
    if (!operand) continue;
    *view = operand->shape[2] == 1 ? *operand : slice(*operand, 2, first, rows);
    if (view->shape[3] != 1) view->shape[3] = keys;
  }
  part.mask = in.mask ? &views.mask : nullptr;
  part.bias = in.bias ? &views.bias : nullptr;
  return part;
}

reference::ForwardResult reference_forward(const reference::Inputs& in) {
  const std::int64_t B = in.q.shape[0], Sq = in.q.shape[1], H = in.q.shape[2], D = in.q.shape[3];
  const std::int64_t Sk = in.k.shape[1];
  const double flops = 4.0 * B * H * Sq * Sk * D;
  const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  // reference::forward runs one (b, h) per thread; blocks of rows run side by side to fill the rest.
  const std::int64_t lanes = B * H > 0 ? std::max<std::int64_t>(1, hw / (B * H)) : 1;
  if (lanes == 1 || flops < (1 << 26)) return reference::forward(in);

  reference::ForwardResult r;
  r.out.assign(B * Sq * H * D, 0.0);
  r.lse.assign(B * H * Sq, 0.0);
  // More blocks than lanes: with causal, later rows see more keys.
  const std::int64_t blocks = std::min(Sq, 4 * lanes), rows_per_block = (Sq + blocks - 1) / blocks;
  host::parallel_for(blocks, static_cast<int>(lanes), [&](std::int64_t block, int) {
    const std::int64_t first = block * rows_per_block, rows = std::min(rows_per_block, Sq - first);
    if (rows <= 0) return;
    QueryRowViews views;
    const reference::Inputs part = query_rows(in, first, rows, views);
    const reference::ForwardResult r_part = reference::forward(part);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < rows; ++i) {
        std::copy_n(&r_part.out[(b * rows + i) * H * D], H * D, &r.out[(b * Sq + first + i) * H * D]);
        for (std::int64_t h = 0; h < H; ++h) r.lse[(b * H + h) * Sq + first + i] = r_part.lse[(b * H + h) * rows + i];
      }
  });
  return r;
}

void expect_outputs_match_reference(const ForwardProblem& p, const GpuOutputs& gpu) {
  const Sizes& n = p.n;
  const reference::Inputs in = p.inputs();
  const reference::ForwardResult ref = reference_forward(in);
  const reference::ForwardResult lowp = lowp::forward(in);
  const std::vector<double> out = gpu.out.values(), lse = gpu.lse.values();
  EXPECT_TRUE(within_tolerance("out", out, lowp.out, ref.out, p.out.view.dtype, {n.B, n.Sq, n.H, n.D}));
  EXPECT_TRUE(within_tolerance("lse", lse, lowp.lse, ref.lse, DType::float32, {n.B, n.H, n.Sq}));

  // An empty row's output is exactly zero, not merely close (lse is checked above: +inf == +inf).
  std::int64_t nonzero = 0;
  for (std::int64_t b = 0; b < n.B; ++b)
    for (std::int64_t h = 0; h < n.H; ++h)
      for (std::int64_t i = 0; i < n.Sq; ++i) {
        if (!std::isinf(ref.lse[(b * n.H + h) * n.Sq + i])) continue;
        for (std::int64_t d = 0; d < n.D; ++d) {
          const double x = out[((b * n.Sq + i) * n.H + h) * n.D + d];
          if (x != 0.0 && nonzero++ == 0) {
            ADD_FAILURE() << "out at (b, i, h, d) = (" << b << ", " << i << ", " << h << ", " << d << ") is " << x
                          << " in a row with no visible key (expected exactly 0)";
          }
        }
      }
  EXPECT_EQ(nonzero, 0) << "nonzero out elements in rows with no visible key";
}

void expect_rows_match_reference(const ForwardProblem& p, const GpuOutputs& gpu, std::int64_t first, std::int64_t rows) {
  const Sizes& n = p.n;
  QueryRowViews views;
  const reference::Inputs in = query_rows(p.inputs(), first, rows, views);
  const reference::ForwardResult ref = reference_forward(in);
  const reference::ForwardResult lowp = lowp::forward(in);
  const std::vector<double> all_out = gpu.out.values(), all_lse = gpu.lse.values();
  std::vector<double> out, lse;
  for (std::int64_t b = 0; b < n.B; ++b) {
    const auto row0 = all_out.begin() + ((b * n.Sq + first) * n.H) * n.D;
    out.insert(out.end(), row0, row0 + rows * n.H * n.D);
    for (std::int64_t h = 0; h < n.H; ++h) {
      const auto lse0 = all_lse.begin() + (b * n.H + h) * n.Sq + first;
      lse.insert(lse.end(), lse0, lse0 + rows);
    }
  }
  EXPECT_TRUE(within_tolerance("out", out, lowp.out, ref.out, p.out.view.dtype, {n.B, rows, n.H, n.D}));
  EXPECT_TRUE(within_tolerance("lse", lse, lowp.lse, ref.lse, DType::float32, {n.B, n.H, rows}));
}

void expect_forward_matches_reference(const ForwardProblem& p, cudaStream_t stream) {
  GpuForward gpu(p, stream);
  gpu.prepare();
  if (test_stopped()) return;
  const Status status = gpu.run();
  ASSERT_TRUE(status.ok()) << status_code_name(status.code()) << ": " << status.message();
  expect_outputs_match_reference(p, gpu.finish());
}

void GpuTest::SetUp() {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  stream_.emplace();
}

}  // namespace flash_dmattn::test
