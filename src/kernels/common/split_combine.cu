#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/common/launch.h"
#include "kernels/common/rounding_store.h"
#include "kernels/common/split_combine.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;

// One row's running merge over its splits: the largest LSE seen, the splits' weights summed
// against it and their partial rows weighed the same, rescaled when it grows (as the forward's
// online softmax does over key tiles). Each thread holds kVectors 4-float column vectors.
template <int kVectors>
struct RowMerge {
  float max_lse = -INFINITY, sum = 0.f;
  float4 acc[kVectors];

  __device__ __forceinline__ RowMerge() {
#pragma unroll
    for (int v = 0; v < kVectors; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  __device__ __forceinline__ void add(float lse, const float4 (&x)[kVectors]) {
    if (lse == -INFINITY) return;  // the split saw no visible key of this row
    const float new_max = fmaxf(max_lse, lse);
    const float keep = expf(max_lse - new_max), weight = expf(lse - new_max);  // keep: 0 from -inf
    max_lse = new_max;
    sum = sum * keep + weight;
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
      acc[v].x = acc[v].x * keep + weight * x[v].x;
      acc[v].y = acc[v].y * keep + weight * x[v].y;
      acc[v].z = acc[v].z * keep + weight * x[v].z;
      acc[v].w = acc[v].w * keep + weight * x[v].w;
    }
  }

  // Adds split s of row `row` (of `rows`): its LSE and the column vectors lane, lane + stride, ...
  // of its partial row. head_dim is a multiple of 8, and every partial row starts 16-byte aligned.
  __device__ __forceinline__ void add_split(const ForwardParams& p, int s, std::int64_t rows, std::int64_t row, int lane,
                                            int stride) {
    const float lse = p.partial_lse[s * rows + row];
    const float4* partial = reinterpret_cast<const float4*>(p.partial_out + (s * rows + row) * p.head_dim);
    const int vectors = p.head_dim / 4;
    float4 x[kVectors];
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
      x[v] = lane + stride * v < vectors ? partial[lane + stride * v] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    add(lse, x);
  }
};

// One CTA per (batch, head, query row). Warp w takes splits w, w + kWarps, ...: it loads their
// LSEs and partial rows together (each lane 4-float column vectors), weighs them against the
// largest LSE it has seen (rescaling its sums when that grows, as the forward's online softmax
// does), and the warps' sums meet in shared memory, rescaled to the largest LSE of all. A decode
// waits for this kernel after its forward, so it is built for latency: one round trip to memory
// and one barrier. Measured under Nsight Compute on an H200 (the 32 rows of a 66-split decode):
// a thread per column walking all splits in turn, waiting on each load, took 21 us; warps over
// splits with the LSEs read first and two block reductions 7.9 us, and its tail behind a decode
// forward of 16 splits (torch profiler, H200) about 3 us.
template <typename Element>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ ForwardParams p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kLaneVectors = kMaxHeadDim / 4 / 32;  // column vectors a lane may hold
  __shared__ float warp_max[kWarps], warp_sum[kWarps];
  __shared__ float4 warp_out[kWarps][kMaxHeadDim / 4];
  // Launched early: its CTAs start during the split forward's tail and wait here for its partials.
  wait_for_previous_grid();
  let_next_grid_start();
  const std::int64_t rows = std::int64_t(p.batch) * p.heads * p.seqlen_q, row = blockIdx.x;
  const int i = static_cast<int>(row % p.seqlen_q), h = static_cast<int>((row / p.seqlen_q) % p.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.seqlen_q) * p.heads));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, vectors = p.head_dim / 4;

  RowMerge<kLaneVectors> merge;
#pragma unroll 4
  for (int s = warp; s < p.num_splits; s += kWarps) merge.add_split(p, s, rows, row, lane, 32);
  if (lane == 0) {
    warp_max[warp] = merge.max_lse;
    warp_sum[warp] = merge.sum;
  }
#pragma unroll
  for (int v = 0; v < kLaneVectors; ++v) {
    if (lane + 32 * v < vectors) warp_out[warp][lane + 32 * v] = merge.acc[v];
  }
  __syncthreads();

  float merged_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) merged_max = fmaxf(merged_max, warp_max[w]);
  // Every split empty: the row has no visible key (O = 0, LSE = +inf).
  const bool empty = merged_max == -INFINITY;
  float scale[kWarps], total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    scale[w] = empty ? 0.f : expf(warp_max[w] - merged_max);
    total += scale[w] * warp_sum[w];
  }
  const float inv = empty ? 0.f : 1.f / total;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride + h * p.out_head_stride;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += scale[w] * reinterpret_cast<const float*>(&warp_out[w][d / 4])[d % 4];
    store_rounded(out + d, o * inv);
  }
  if (threadIdx.x == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = empty ? INFINITY : merged_max + logf(total);
}

// A split prefill has thousands of rows and a few splits (the host splits grids of under a
// wave, so rows x splits is about a wave of query tiles' rows): there a CTA per row leaves most
// of its warps without a split, and the launch of one small CTA per row is what the kernel costs.
// Here `lanes` lanes (head_dim / 4 of them, at least 8, a power of two) take a row and walk all of
// its splits. Measured on an H200 (torch profiler): 95.8 us for the 32768 rows of 3 splits at D32
// with a CTA per row; at D64 (B1 H2/1, mask + bias) 8.8 / 14.8 / 26.9 / 50.5 us at Sq 1024 / 2048 /
// 4096 / 8192 against 4.0 / 3.4 / 3.8 / 5.4 with lanes per row.
template <typename Element>
__global__ void __launch_bounds__(kThreads) combine_rows_kernel(const __grid_constant__ ForwardParams p, int lanes) {
  // Column vectors a lane may hold: lanes >= head_dim / 4 up to 32 lanes, so 2 at head dim 256.
  constexpr int kLaneVectors = kMaxHeadDim / 4 / 32;
  wait_for_previous_grid();
  let_next_grid_start();
  const std::int64_t rows = std::int64_t(p.batch) * p.heads * p.seqlen_q;
  const std::int64_t row = std::int64_t(blockIdx.x) * (kThreads / lanes) + threadIdx.x / lanes;
  if (row >= rows) return;
  const int i = static_cast<int>(row % p.seqlen_q), h = static_cast<int>((row / p.seqlen_q) % p.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.seqlen_q) * p.heads));
  const int lane = threadIdx.x % lanes, vectors = p.head_dim / 4;

  RowMerge<kLaneVectors> merge;
#pragma unroll 2
  for (int s = 0; s < p.num_splits; ++s) merge.add_split(p, s, rows, row, lane, lanes);
  // Every split empty: the row has no visible key (O = 0, LSE = +inf).
  const bool empty = merge.max_lse == -INFINITY;
  const float inv = empty ? 0.f : 1.f / merge.sum;
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride + h * p.out_head_stride;
#pragma unroll
  for (int v = 0; v < kLaneVectors; ++v) {
    const int c = lane + lanes * v;
    if (c >= vectors) continue;
    store_rounded(out + 4 * c, merge.acc[v].x * inv);
    store_rounded(out + 4 * c + 1, merge.acc[v].y * inv);
    store_rounded(out + 4 * c + 2, merge.acc[v].z * inv);
    store_rounded(out + 4 * c + 3, merge.acc[v].w * inv);
  }
  if (lane == 0) {
    p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = empty ? INFINITY : merge.max_lse + logf(merge.sum);
  }
}

// Rows from which a row takes a few lanes instead of a CTA: a decode's rows (B x H of them, one
// query row each) keep a CTA each, whose warps share out their many splits.
constexpr std::int64_t kRowsForLanes = 2048;

}  // namespace

cudaError_t combine_split_partials(const ForwardParams& params, cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(params.batch) * params.heads * params.seqlen_q;
  const bool bf16 = params.element == ElementType::bfloat16;
  if (rows < kRowsForLanes) {
    const GridShape grid{rows, 1, 1};  // a CTA per row
    return bf16 ? launch_folded<0>(&combine_kernel<__nv_bfloat16>, grid, kThreads, stream, StreamOrder::early, params)
                : launch_folded<0>(&combine_kernel<__half>, grid, kThreads, stream, StreamOrder::early, params);
  }
  int lanes = 8;
  while (lanes < 32 && lanes * 4 < params.head_dim) lanes *= 2;
  const GridShape grid{(rows * lanes + kThreads - 1) / kThreads, 1, 1};
  return bf16 ? launch_folded<0>(&combine_rows_kernel<__nv_bfloat16>, grid, kThreads, stream, StreamOrder::early,
                                 params, lanes)
              : launch_folded<0>(&combine_rows_kernel<__half>, grid, kThreads, stream, StreamOrder::early, params,
                                 lanes);
}

}  // namespace flash_dmattn::kernels
