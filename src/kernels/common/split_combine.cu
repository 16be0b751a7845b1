#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/common/launch.h"
#include "kernels/common/rounding_store.h"
#include "kernels/common/split_combine.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;

template <typename Op>
__device__ float block_reduce(float x, Op op, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) x = op(x, scratch[w]);
  __syncthreads();
  return x;
}

// One CTA per (batch, head, query row). The weighted sum over splits reads num_splits partial
// rows: warp w takes every kWarps-th split and each lane a 4-float column vector, so a thread
// has its loads of several splits in flight. Measured under Nsight Compute on an H200 (the 32
// rows of a 66-split decode): a thread per column walking all splits in turn, waiting on each
// load, took 21 us; this order with 4 warps 7.9 us.
template <typename Element>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ ForwardParams p) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float weight[kMaxSplits];
  __shared__ float scratch[kWarps];
  __shared__ float4 warp_sums[kWarps][kMaxHeadDim / 4];
  // Launched early: its CTAs start during the split forward's tail and wait here for its partials.
  wait_for_previous_grid();
  let_next_grid_start();
  const std::int64_t rows = std::int64_t(p.batch) * p.heads * p.seqlen_q, row = blockIdx.x;
  const int i = static_cast<int>(row % p.seqlen_q), h = static_cast<int>((row / p.seqlen_q) % p.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.seqlen_q) * p.heads));

  // The splits' LSEs are read once; weight[s] holds split s's LSE until it becomes its weight
  // (each thread only touches its own entries until the barrier).
  float max_lse = -INFINITY;
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) {
    weight[s] = p.partial_lse[s * rows + row];
    max_lse = fmaxf(max_lse, weight[s]);
  }
  max_lse = block_reduce(max_lse, [](float a, float c) { return fmaxf(a, c); }, scratch);
  // Every split empty: the row has no visible key.
  const bool empty = max_lse == -INFINITY;
  float sum = 0.f;
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) sum += empty ? 0.f : expf(weight[s] - max_lse);
  sum = block_reduce(sum, [](float a, float c) { return a + c; }, scratch);
  const float lse = empty ? INFINITY : max_lse + logf(sum);
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) weight[s] = empty ? 0.f : expf(weight[s] - lse);
  __syncthreads();

  // head_dim is a multiple of 8, and every partial row starts 16-byte aligned.
  const int warp = threadIdx.x / 32, vectors = p.head_dim / 4;
  for (int v = threadIdx.x % 32; v < vectors; v += 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = warp; s < p.num_splits; s += kWarps) {
      const float4 x = reinterpret_cast<const float4*>(p.partial_out + (s * rows + row) * p.head_dim)[v];
      const float w = weight[s];
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    warp_sums[warp][v] = acc;
  }
  __syncthreads();

  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride + h * p.out_head_stride;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += reinterpret_cast<const float*>(&warp_sums[w][d / 4])[d % 4];
    store_rounded(out + d, o);
  }
  if (threadIdx.x == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = lse;
}

}  // namespace

cudaError_t combine_split_partials(const ForwardParams& params, cudaStream_t stream) {
  const GridShape rows{std::int64_t(params.batch) * params.heads * params.seqlen_q, 1, 1};  // a CTA per row
  return params.element == ElementType::bfloat16
             ? launch_folded<0>(&combine_kernel<__nv_bfloat16>, rows, kThreads, stream, StreamOrder::early, params)
             : launch_folded<0>(&combine_kernel<__half>, rows, kThreads, stream, StreamOrder::early, params);
}

}  // namespace flash_dmattn::kernels
