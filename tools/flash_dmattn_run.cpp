// flash_dmattn_run: one forward and one backward on fresh random data with the best backend
// present, then the error of every output against the fp64 reference.
//
//   flash_dmattn_run [--batch 1] [--heads 4] [--kv-heads 2] [--seqlen-q 256] [--seqlen-k 256]
//                    [--head-dim 64] [--dtype bf16|fp16] [--causal] [--softcap 0]
//                    [--mask-density 0.5] [--no-mask] [--no-bias] [--seed N]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flash_dmattn/flash_dmattn.h"
#include "host_numeric.h"
#include "reference/reference.h"

namespace fd = flash_dmattn;

namespace {

struct Options {
  std::int64_t batch = 1, heads = 4, kv_heads = 2, seqlen_q = 256, seqlen_k = 256, head_dim = 64;
  fd::DType dtype = fd::DType::bfloat16;
  bool causal = false, mask = true, bias = true;
  double softcap = 0.0, mask_density = 0.5;
  std::uint64_t seed = std::random_device{}();
};

[[noreturn]] void usage(const char* problem) {
  std::fprintf(stderr,
               "flash_dmattn_run: %s\nusage: flash_dmattn_run [--batch N] [--heads N] [--kv-heads N] [--seqlen-q N] "
               "[--seqlen-k N] [--head-dim N] [--dtype bf16|fp16] [--causal] [--softcap X] [--mask-density X] "
               "[--no-mask] [--no-bias] [--seed N]\n",
               problem);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int a = 1; a < argc; ++a) {
    const std::string flag = argv[a];
    auto value = [&]() -> const char* {
      if (a + 1 >= argc) usage(("missing value after " + flag).c_str());
      return argv[++a];
    };
    if (flag == "--batch") o.batch = std::atoll(value());
    else if (flag == "--heads") o.heads = std::atoll(value());
    else if (flag == "--kv-heads") o.kv_heads = std::atoll(value());
    else if (flag == "--seqlen-q") o.seqlen_q = std::atoll(value());
    else if (flag == "--seqlen-k") o.seqlen_k = std::atoll(value());
    else if (flag == "--head-dim") o.head_dim = std::atoll(value());
    else if (flag == "--softcap") o.softcap = std::atof(value());
    else if (flag == "--mask-density") o.mask_density = std::atof(value());
    else if (flag == "--seed") o.seed = std::strtoull(value(), nullptr, 10);
    else if (flag == "--causal") o.causal = true;
    else if (flag == "--no-mask") o.mask = false;
    else if (flag == "--no-bias") o.bias = false;
    else if (flag == "--dtype") {
      const std::string d = value();
      if (d == "bf16") o.dtype = fd::DType::bfloat16;
      else if (d == "fp16") o.dtype = fd::DType::float16;
      else usage(("--dtype takes bf16 or fp16, got " + d).c_str());
    } else usage(("unknown flag " + flag).c_str());
  }
  return o;
}

// A contiguous host tensor with its bytes.
struct Buffer {
  std::vector<unsigned char> bytes;
  fd::TensorView view;
  Buffer(fd::DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    bytes.assign(static_cast<size_t>(std::max<std::int64_t>(n, 1)) * fd::dtype_size(dtype), 0);
    view = fd::make_contiguous_view(bytes.data(), dtype, shape);
  }
  void fill(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    for (std::int64_t e = 0; e < view.numel(); ++e) fd::host::store(view, e, u(rng));
  }
  void fill_mask(std::mt19937_64& rng, double density) {
    std::bernoulli_distribution keep(density);
    for (std::int64_t e = 0; e < view.numel(); ++e) fd::host::store(view, e, keep(rng) ? 1.0 : 0.0);
  }
};

// max |got - want| and ||got - want|| / ||want|| over the finite entries of want; infinities must match.
void report(const char* name, const Buffer& got, const std::vector<double>& want) {
  double max_err = 0.0, num = 0.0, den = 0.0;
  std::int64_t mismatched_inf = 0;
  for (std::int64_t e = 0; e < got.view.numel(); ++e) {
    const double g = fd::host::load(got.view, e), w = want[e];
    if (std::isinf(w) || std::isinf(g)) {
      mismatched_inf += g != w;
      continue;
    }
    max_err = std::max(max_err, std::abs(g - w));
    num += (g - w) * (g - w);
    den += w * w;
  }
  std::printf("  %-6s max abs err %.3e   rel err %.3e%s\n", name, max_err, den > 0 ? std::sqrt(num / den) : 0.0,
              mismatched_inf ? ("   INF MISMATCHES: " + std::to_string(mismatched_inf)).c_str() : "");
}

template <typename Fn>
double time_ms(Fn fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::mt19937_64 rng(o.seed);
  const auto B = o.batch, Sq = o.seqlen_q, Sk = o.seqlen_k, H = o.heads, Hk = o.kv_heads, D = o.head_dim;

  Buffer q(o.dtype, {B, Sq, H, D}), k(o.dtype, {B, Sk, Hk, D}), v(o.dtype, {B, Sk, Hk, D});
  Buffer dout(o.dtype, {B, Sq, H, D}), out(o.dtype, {B, Sq, H, D}), lse(fd::DType::float32, {B, H, Sq});
  Buffer dq(o.dtype, {B, Sq, H, D}), dk(o.dtype, {B, Sk, Hk, D}), dv(o.dtype, {B, Sk, Hk, D});
  Buffer mask(fd::DType::boolean, {B, Hk, Sq, Sk}), bias(o.dtype, {B, Hk, 1, Sk}), dbias(o.dtype, {B, Hk, 1, Sk});
  for (Buffer* t : {&q, &k, &v, &dout}) t->fill(rng, -1.0, 1.0);
  bias.fill(rng, -2.0, 2.0);
  mask.fill_mask(rng, o.mask_density);

  fd::ForwardArgs fa;
  fa.q = q.view;
  fa.k = k.view;
  fa.v = v.view;
  if (o.mask) fa.mask = mask.view;
  if (o.bias) fa.bias = bias.view;
  fa.out = out.view;
  fa.lse = lse.view;
  fa.options.causal = o.causal;
  fa.options.softcap = o.softcap;

  fd::BackwardArgs ba;
  ba.q = q.view;
  ba.k = k.view;
  ba.v = v.view;
  ba.mask = fa.mask;
  ba.bias = fa.bias;
  ba.out = out.view;
  ba.lse = lse.view;
  ba.dout = dout.view;
  ba.dq = dq.view;
  ba.dk = dk.view;
  ba.dv = dv.view;
  if (o.bias) ba.dbias = dbias.view;
  ba.options = fa.options;

  fd::Capability cap;
  fd::Status status = fd::query_forward(fa, &cap);
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.message().c_str());
    return 1;
  }
  std::printf("flash_dmattn %s  backend %s\n", fd::version(), cap.description.c_str());
  std::printf("  q %s  k,v %s  mask %s  bias %s  %s  causal %d  softcap %g  seed %llu\n", q.view.shape_string().c_str(),
              k.view.shape_string().c_str(), o.mask ? mask.view.shape_string().c_str() : "none",
              o.bias ? bias.view.shape_string().c_str() : "none", fd::dtype_name(o.dtype), o.causal, o.softcap,
              static_cast<unsigned long long>(o.seed));

  const double forward_ms = time_ms([&] { status = fd::forward(fa); });
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.message().c_str());
    return 1;
  }
  const double backward_ms = time_ms([&] { status = fd::backward(ba); });
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.message().c_str());
    return 1;
  }
  std::printf("  forward %.3f ms   backward %.3f ms\n", forward_ms, backward_ms);

  fd::reference::Inputs in;
  in.q = q.view;
  in.k = k.view;
  in.v = v.view;
  in.mask = o.mask ? &mask.view : nullptr;
  in.bias = o.bias ? &bias.view : nullptr;
  in.scale = 1.0 / std::sqrt(static_cast<double>(D));
  in.causal = o.causal;
  in.softcap = o.softcap;
  const auto ref = fd::reference::forward(in);
  const auto grads = fd::reference::backward(in, dout.view);
  std::printf("error against the fp64 reference:\n");
  report("out", out, ref.out);
  report("lse", lse, ref.lse);
  report("dq", dq, grads.dq);
  report("dk", dk, grads.dk);
  report("dv", dv, grads.dv);
  if (o.bias) report("dbias", dbias, grads.dbias);
  return 0;
}
