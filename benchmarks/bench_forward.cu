// flash_dmattn_bench_forward: times flash_dmattn::forward, and the backward (with dbias; default
// and deterministic mode) where a workload has one, on the workloads of
// ../shared/reference/anchors.md with CUDA events (warm-up, then the median of many runs), and
// reports dense-equivalent and visited-tile TFLOP/s separately.
//
//   flash_dmattn_bench_forward [--runs 30] [--json PATH] [--only NAME] [--forward-only] [--no-dbias]
//
// --no-dbias times the backward of a bias that takes no gradient (a frozen bias): what the bias
// costs the backward apart from its gradient.
//
// On an sm_90 GPU the forward runs the sm90a kernels where they apply; FLASH_DMATTN_KERNELS=sm80
// times the sm80 ones instead.
//
// Dense-equivalent FLOPs follow the anchors' convention: 4·B·H·Sq·Sk·D, halved when causal
// (10·B·H·Sq·Sk·D for the backward's five GEMMs).
// Visited-tile FLOPs count 4·kBlockM·kBlockN·D for every (query tile, key tile) the kernel
// computes: tiles with a visible key under the mask and the causal limit.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "flash_dmattn/flash_dmattn.h"
#include "kernels/sm80/tile_size.h"
#include "kernels/sm90/tile_size.h"

namespace fd = flash_dmattn;

namespace {

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// scattered: a pseudo-random subset of `window` keys of every Sk (per head), kept by every row
// that may see them: scattered keys like the seed's top-k of one bias row, which leave almost
// every tile partly visible (FLASH_DMATTN_SPARSE_PATH=gather computes only the kept keys).
enum class MaskKind { none, all_true, sliding_window, scattered };

struct Workload {
  const char* name;
  int B, H, Hk, Sq, Sk, D;
  bool causal;
  MaskKind mask;
  int window;         // sliding_window: row i keeps keys (i - window, i]; scattered: keys kept
  bool bias = true;   // (B, Hk, 1, Sk)
  bool backward = true;
};

const Workload kWorkloads[] = {
    {"train_dense_d128", 2, 16, 4, 8192, 8192, 128, true, MaskKind::all_true, 0},
    // Where the time of the dense-equivalent case goes: the same shape without mask or bias,
    // with the bias alone, and with the mask alone.
    {"train_plain_d128", 2, 16, 4, 8192, 8192, 128, true, MaskKind::none, 0, false},
    {"train_bias_only_d128", 2, 16, 4, 8192, 8192, 128, true, MaskKind::none, 0, true},
    {"train_mask_only_d128", 2, 16, 4, 8192, 8192, 128, true, MaskKind::all_true, 0, false},
    {"train_window1024_d128", 2, 16, 4, 8192, 8192, 128, true, MaskKind::sliding_window, 1024},
    {"train_dense_d64", 2, 16, 4, 8192, 8192, 64, true, MaskKind::all_true, 0},
    {"seed_dense_d32_s16k", 1, 2, 1, 16384, 16384, 32, true, MaskKind::all_true, 0},
    {"seed_scatter1024_d32_s16k", 1, 2, 1, 16384, 16384, 32, true, MaskKind::scattered, 1024},
    {"train_scatter2048_d128", 2, 16, 4, 8192, 8192, 128, true, MaskKind::scattered, 2048},
    {"train_scatter2048_d64", 2, 16, 4, 8192, 8192, 64, true, MaskKind::scattered, 2048},
    // The seed's few heads at D128: the gather backward's grid of head pairs is two waves.
    {"seed_scatter1024_d128_s16k", 1, 2, 1, 16384, 16384, 128, true, MaskKind::scattered, 1024},
    {"decode_sk131072_d128", 1, 32, 8, 1, 131072, 128, false, MaskKind::all_true, 0, true, false},
};

// Fresh pseudo-random values in [-1, 1) from a hash of the index: no host round trip.
template <typename T>
__global__ void fill_random(T* data, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    data[i] = T(scale * (static_cast<float>(x >> 40) / float(1 << 23) - 1.f));
  }
}

__global__ void fill_mask(std::uint8_t* mask, int heads, int Sq, int Sk, MaskKind kind, int window) {
  const std::int64_t n = std::int64_t(heads) * Sq * Sk;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < n; e += std::int64_t(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(e % Sk), i = static_cast<int>((e / Sk) % Sq);
    const std::int64_t head = e / (std::int64_t(Sq) * Sk);
    const int diag = i + Sk - Sq;
    if (kind == MaskKind::scattered) {
      std::uint64_t x = (head * Sk + j + 1) * 0x9E3779B97F4A7C15ull;
      x ^= x >> 29;
      x *= 0xBF58476D1CE4E5B9ull;
      x ^= x >> 32;
      mask[e] = j <= diag && static_cast<int>(x % Sk) < window;
    } else {
      mask[e] = kind == MaskKind::all_true ? 1 : (j <= diag && j > diag - window);
    }
  }
}

// Visible keys of row i form one interval [first, last] for every mask kind here.
bool tile_visited(const Workload& w, int m0, int m1, int n0, int n1) {
  for (int i = m0; i < std::min(m1, w.Sq); ++i) {
    const int diag = i + w.Sk - w.Sq;
    int last = w.causal || w.mask == MaskKind::sliding_window ? std::min(diag, w.Sk - 1) : w.Sk - 1;
    int first = w.mask == MaskKind::sliding_window ? std::max(0, diag - w.window + 1) : 0;
    if (first <= std::min(last, n1 - 1) && std::max(first, n0) <= last) return true;
  }
  return false;
}

// Whether the library runs the sm90a forward here: an sm_90 GPU, FLASH_DMATTN_KERNELS not set to
// sm80, a head dim of the sm90a family (32 to 128, src/kernels/manifest.cmake) and Sq > 16
// (decode runs on sm80), and not on the gather path: choose_family and plan_forward in
// src/cuda/cuda_backend.cpp for these workloads. The
// backward's family follows at D = 64 and 128 (deterministic mode included). The build is assumed
// to include the sm90a family, as it does by default for sm_90.
bool g_sm90_device = false;
bool runs_sm90a(const Workload& w) {
  const char* forced = std::getenv("FLASH_DMATTN_KERNELS");
  const char* path = std::getenv("FLASH_DMATTN_SPARSE_PATH");  // the gather path runs sm80 kernels
  const bool gather = path && std::strcmp(path, "gather") == 0 && w.mask != MaskKind::none;
  return g_sm90_device && !(forced && std::strcmp(forced, "sm80") == 0) && !gather && w.D <= 128 && w.Sq > 16;
}

// The benchmark's tensors are contiguous: the sm90a forward runs its TMA kernel.
fd::kernels::sm80::ForwardTile forward_tile(const Workload& w) {
  return runs_sm90a(w) ? fd::kernels::sm90::forward_tile(w.D, fd::kernels::sm90::KvLoads::tma_producer)
                       : fd::kernels::sm80::forward_tile(w.D);
}

double visited_tile_flops(const Workload& w) {
  const auto tile = forward_tile(w);
  std::int64_t tiles = 0;
  for (int m0 = 0; m0 < w.Sq; m0 += tile.block_m)
    for (int n0 = 0; n0 < w.Sk; n0 += tile.block_n) tiles += tile_visited(w, m0, m0 + tile.block_m, n0, n0 + tile.block_n);
  return 4.0 * tiles * tile.block_m * tile.block_n * w.D * w.B * w.H;
}

struct Result {
  std::string name;
  std::string kernels;  // the forward's kernel family
  double ms, dense_tflops, visited_tflops, tile_density;
  double kv_gbps;  // K and V bytes read once, over the time: the decode figure of merit
  double bwd_ms = 0, bwd_dense_tflops = 0, bwd_deterministic_ms = 0;  // 0: no backward
};

// Median milliseconds of `launch` on `stream` after three warm-up calls.
template <typename Launch>
double median_ms(cudaStream_t stream, int runs, Launch launch) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> times;
  for (int i = 0; i < runs; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    launch();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The backward of the call `f` describes (its out and lse already computed), with dbias unless
// no_dbias, in default and deterministic mode: {default ms, deterministic ms}.
std::pair<double, double> time_backward(const Workload& w, const fd::ForwardArgs& f, int runs, bool no_dbias) {
  using bf16 = __nv_bfloat16;
  const std::int64_t nq = std::int64_t(w.B) * w.Sq * w.H * w.D, nk = std::int64_t(w.B) * w.Sk * w.Hk * w.D;
  bf16 *dout, *dq, *dk, *dv, *dbias;
  CHECK_CUDA(cudaMalloc(&dout, nq * 2));
  CHECK_CUDA(cudaMalloc(&dq, nq * 2));
  CHECK_CUDA(cudaMalloc(&dk, nk * 2));
  CHECK_CUDA(cudaMalloc(&dv, nk * 2));
  CHECK_CUDA(cudaMalloc(&dbias, std::int64_t(w.B) * w.Hk * w.Sk * 2));
  fill_random<<<1024, 256>>>(dout, nq, 5, 1.f);
  CHECK_CUDA(cudaGetLastError());
  const fd::Device dev{fd::DeviceType::cuda, 0};
  fd::BackwardArgs b;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.mask = f.mask;
  b.bias = f.bias;
  b.out = f.out;
  b.lse = f.lse;
  b.options = f.options;
  b.dout = fd::make_contiguous_view(dout, fd::DType::bfloat16, {w.B, w.Sq, w.H, w.D}, dev);
  b.dq = fd::make_contiguous_view(dq, fd::DType::bfloat16, {w.B, w.Sq, w.H, w.D}, dev);
  b.dk = fd::make_contiguous_view(dk, fd::DType::bfloat16, {w.B, w.Sk, w.Hk, w.D}, dev);
  b.dv = fd::make_contiguous_view(dv, fd::DType::bfloat16, {w.B, w.Sk, w.Hk, w.D}, dev);
  if (w.bias && !no_dbias) b.dbias = fd::make_contiguous_view(dbias, fd::DType::bfloat16, {w.B, w.Hk, 1, w.Sk}, dev);
  const auto stream = static_cast<cudaStream_t>(f.options.stream);
  double ms[2] = {0, 0};
  for (const bool deterministic : {false, true}) {
    b.deterministic = deterministic;
    std::size_t bytes = 0;
    fd::throw_if_error(fd::backward_workspace_size(b, &bytes));
    b.workspace = {nullptr, bytes};
    if (bytes) CHECK_CUDA(cudaMalloc(&b.workspace.data, bytes));
    ms[deterministic] = median_ms(stream, runs, [&] { fd::throw_if_error(fd::backward(b)); });
    cudaFree(b.workspace.data);
  }
  for (void* p : {(void*)dout, (void*)dq, (void*)dk, (void*)dv, (void*)dbias}) cudaFree(p);
  return {ms[0], ms[1]};
}

Result run(const Workload& w, int runs, bool forward_only, bool no_dbias) {
  using bf16 = __nv_bfloat16;
  const std::int64_t nq = std::int64_t(w.B) * w.Sq * w.H * w.D, nk = std::int64_t(w.B) * w.Sk * w.Hk * w.D;
  bf16 *q, *k, *v, *out, *bias;
  float* lse;
  std::uint8_t* mask = nullptr;
  CHECK_CUDA(cudaMalloc(&q, nq * 2));
  CHECK_CUDA(cudaMalloc(&k, nk * 2));
  CHECK_CUDA(cudaMalloc(&v, nk * 2));
  CHECK_CUDA(cudaMalloc(&out, nq * 2));
  CHECK_CUDA(cudaMalloc(&bias, std::int64_t(w.B) * w.Hk * w.Sk * 2));
  CHECK_CUDA(cudaMalloc(&lse, std::int64_t(w.B) * w.H * w.Sq * 4));
  fill_random<<<1024, 256>>>(q, nq, 1, 1.f);
  fill_random<<<1024, 256>>>(k, nk, 2, 1.f);
  fill_random<<<1024, 256>>>(v, nk, 3, 1.f);
  fill_random<<<1024, 256>>>(bias, std::int64_t(w.B) * w.Hk * w.Sk, 4, 2.f);
  const std::int64_t mask_elems = std::int64_t(w.B) * w.Hk * w.Sq * w.Sk;
  if (w.mask != MaskKind::none) {
    CHECK_CUDA(cudaMalloc(&mask, mask_elems));
    fill_mask<<<4096, 256>>>(mask, w.B * w.Hk, w.Sq, w.Sk, w.mask, w.window);
  }
  CHECK_CUDA(cudaGetLastError());

  const fd::Device dev{fd::DeviceType::cuda, 0};
  fd::ForwardArgs a;
  a.q = fd::make_contiguous_view(q, fd::DType::bfloat16, {w.B, w.Sq, w.H, w.D}, dev);
  a.k = fd::make_contiguous_view(k, fd::DType::bfloat16, {w.B, w.Sk, w.Hk, w.D}, dev);
  a.v = fd::make_contiguous_view(v, fd::DType::bfloat16, {w.B, w.Sk, w.Hk, w.D}, dev);
  if (mask) a.mask = fd::make_contiguous_view(mask, fd::DType::boolean, {w.B, w.Hk, w.Sq, w.Sk}, dev);
  if (w.bias) a.bias = fd::make_contiguous_view(bias, fd::DType::bfloat16, {w.B, w.Hk, 1, w.Sk}, dev);
  a.out = fd::make_contiguous_view(out, fd::DType::bfloat16, {w.B, w.Sq, w.H, w.D}, dev);
  a.lse = fd::make_contiguous_view(lse, fd::DType::float32, {w.B, w.H, w.Sq}, dev);
  a.options.causal = w.causal;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  a.options.stream = stream;
  std::size_t ws_bytes = 0;
  fd::throw_if_error(fd::forward_workspace_size(a, &ws_bytes));
  if (ws_bytes) CHECK_CUDA(cudaMalloc(&a.workspace.data, ws_bytes));
  a.workspace.bytes = ws_bytes;

  const double ms = median_ms(stream, runs, [&] { fd::throw_if_error(fd::forward(a)); });
  const auto [bwd_ms, bwd_deterministic_ms] = w.backward && !forward_only ? time_backward(w, a, runs, no_dbias) : std::pair<double, double>{0, 0};
  const double dense = 4.0 * w.B * w.H * double(w.Sq) * w.Sk * w.D * (w.causal ? 0.5 : 1.0);
  const double visited = visited_tile_flops(w);
  const auto tile = forward_tile(w);
  const double all_tiles = 4.0 * w.B * w.H * double((w.Sq + tile.block_m - 1) / tile.block_m) * tile.block_m *
                           double((w.Sk + tile.block_n - 1) / tile.block_n) * tile.block_n * w.D;
  for (void* p : {(void*)q, (void*)k, (void*)v, (void*)out, (void*)bias, (void*)lse, (void*)mask, a.workspace.data}) cudaFree(p);
  cudaStreamDestroy(stream);
  const double kv_bytes = 2.0 * w.B * double(w.Sk) * w.Hk * w.D * 2;
  return {w.name, runs_sm90a(w) ? "sm90a" : "sm80", ms, dense / ms / 1e9, visited / ms / 1e9, visited / all_tiles, kv_bytes / ms / 1e6,
          bwd_ms, bwd_ms > 0 ? 2.5 * dense / bwd_ms / 1e9 : 0.0, bwd_deterministic_ms};
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 30;
  const char* json = nullptr;
  const char* only = nullptr;
  bool forward_only = false, no_dbias = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--forward-only")) forward_only = true;
    else if (!std::strcmp(argv[i], "--no-dbias")) no_dbias = true;
    else {
      std::fprintf(stderr,
                   "usage: flash_dmattn_bench_forward [--runs N] [--json PATH] [--only NAME] [--forward-only] [--no-dbias]\n");
      return 2;
    }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  g_sm90_device = prop.major == 9 && prop.minor == 0;
  std::vector<Result> results;
  for (const Workload& w : kWorkloads) {
    if (only && std::strcmp(only, w.name) != 0) continue;
    results.push_back(run(w, runs, forward_only, no_dbias));
  }
  std::printf("flash_dmattn forward, %s, bf16, median of %d runs (CUDA events)\n", prop.name, runs);
  std::printf("%-24s %7s %10s %14s %16s %12s %10s %10s %10s %10s\n", "workload", "kernels", "fwd ms", "dense TFLOP/s",
              "visited TFLOP/s", "tile density", "K/V GB/s", "bwd ms", "bwd TFLOP/s", "det bwd ms");
  for (const Result& r : results) {
    std::printf("%-24s %7s %10.3f %14.1f %16.1f %12.3f %10.0f %10.3f %10.1f %10.3f\n", r.name.c_str(), r.kernels.c_str(), r.ms,
                r.dense_tflops, r.visited_tflops, r.tile_density, r.kv_gbps, r.bwd_ms, r.bwd_dense_tflops,
                r.bwd_deterministic_ms);
  }
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) return 1;
    std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"dtype\": \"bfloat16\",\n  \"runs\": %d,\n  \"forward\": [\n", prop.name, runs);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f, "    {\"workload\": \"%s\", \"kernels\": \"%s\", \"ms\": %.4f, \"dense_tflops\": %.2f, \"visited_tflops\": %.2f, \"tile_density\": %.4f, \"kv_gbps\": %.1f, \"bwd_ms\": %.4f, \"bwd_dense_tflops\": %.2f, \"bwd_deterministic_ms\": %.4f}%s\n",
                   r.name.c_str(), r.kernels.c_str(), r.ms, r.dense_tflops, r.visited_tflops, r.tile_density, r.kv_gbps, r.bwd_ms,
                   r.bwd_dense_tflops, r.bwd_deterministic_ms, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
