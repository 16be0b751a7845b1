#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/common/rounding_store.h"
#include "kernels/common/split_combine.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 128;

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

// One CTA per (batch, head, query row).
template <typename Element>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ ForwardParams p) {
  __shared__ float weight[kMaxSplits];
  __shared__ float scratch[kThreads / 32];
  const std::int64_t rows = std::int64_t(p.batch) * p.heads * p.seqlen_q, row = blockIdx.x;
  const int i = static_cast<int>(row % p.seqlen_q), h = static_cast<int>((row / p.seqlen_q) % p.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.seqlen_q) * p.heads));

  float max_lse = -INFINITY;
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) max_lse = fmaxf(max_lse, p.partial_lse[s * rows + row]);
  max_lse = block_reduce(max_lse, [](float a, float c) { return fmaxf(a, c); }, scratch);
  // Every split empty: the row has no visible key.
  const bool empty = max_lse == -INFINITY;
  float sum = 0.f;
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) {
    sum += empty ? 0.f : expf(p.partial_lse[s * rows + row] - max_lse);
  }
  sum = block_reduce(sum, [](float a, float c) { return a + c; }, scratch);
  const float lse = empty ? INFINITY : max_lse + logf(sum);
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) {
    weight[s] = empty ? 0.f : expf(p.partial_lse[s * rows + row] - lse);
  }
  __syncthreads();

  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + i * p.out_row_stride + h * p.out_head_stride;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float o = 0.f;
    for (int s = 0; s < p.num_splits; ++s) o += weight[s] * p.partial_out[(s * rows + row) * p.head_dim + d];
    store_rounded(out + d, o);
  }
  if (threadIdx.x == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = lse;
}

}  // namespace

cudaError_t combine_split_partials(const ForwardParams& params, cudaStream_t stream) {
  const unsigned rows = static_cast<unsigned>(std::int64_t(params.batch) * params.heads * params.seqlen_q);
  if (params.element == ElementType::bfloat16) {
    combine_kernel<__nv_bfloat16><<<rows, kThreads, 0, stream>>>(params);
  } else {
    combine_kernel<__half><<<rows, kThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels
