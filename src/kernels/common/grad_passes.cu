#include "kernels/common/grad_passes.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/rounding_store.h"
#include "kernels/common/sequences.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const __nv_bfloat16 x) { return __bfloat162float(x); }

unsigned blocks_for(std::int64_t items, int per_block) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, (items + per_block - 1) / per_block));
}

// One warp per (b, h, i) row of the workspace's layout (accum_rows rows per batch and head): lanes
// stride over the head dim, then a butterfly sum. Rows past a packed sequence's length are left.
template <typename Element>
__global__ void __launch_bounds__(kThreads) dsum_kernel(const __grid_constant__ BackwardParams p) {
  const ForwardParams& f = p.fwd;
  const std::int64_t rows = std::int64_t(f.batch) * f.heads * p.accum_rows;
  const std::int64_t row = std::int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int i = static_cast<int>(row % p.accum_rows), h = static_cast<int>(row / p.accum_rows % f.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.accum_rows) * f.heads));
  const QueryRow q = query_row(f, b, i);
  if (!q.exists) return;
  const auto* o = static_cast<const Element*>(f.out) + b * f.out_batch_stride + q.row * f.out_row_stride +
                  h * f.out_head_stride;
  const auto* d = static_cast<const Element*>(p.dout) + b * p.dout_batch_stride + q.row * p.dout_row_stride +
                  h * p.dout_head_stride;
  float sum = 0.f;
  for (int c = threadIdx.x % 32; c < f.head_dim; c += 32) sum += to_float(o[c]) * to_float(d[c]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) p.dsum[row] = sum;
}

// One thread per dq element.
template <typename Element>
__global__ void __launch_bounds__(kThreads) reduce_dq_kernel(const __grid_constant__ BackwardParams p) {
  const ForwardParams& f = p.fwd;
  const std::int64_t slot_stride = std::int64_t(f.batch) * f.heads * p.accum_rows * f.head_dim;
  const std::int64_t e = std::int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= slot_stride) return;
  float sum = 0.f;
  for (int s = 0; s < p.dq_slots; ++s) sum += p.dq_accum[s * slot_stride + e];
  // accum layout (b, h, i, d)
  const int d = static_cast<int>(e % f.head_dim);
  const std::int64_t row = e / f.head_dim;
  const int i = static_cast<int>(row % p.accum_rows), h = static_cast<int>(row / p.accum_rows % f.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.accum_rows) * f.heads));
  const QueryRow q = query_row(f, b, i);
  if (!q.exists) return;
  store_rounded(static_cast<Element*>(p.dq) + b * p.dq_batch_stride + q.row * p.dq_row_stride + h * p.dq_head_stride + d,
        sum * f.scale);
}

// One thread per (b, kv head, key, d) element of the gather path's dK and dV accumulators.
template <typename Element>
__global__ void __launch_bounds__(kThreads) reduce_dk_dv_kernel(const __grid_constant__ BackwardParams p) {
  const ForwardParams& f = p.fwd;
  const std::int64_t e = std::int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= std::int64_t(f.batch) * f.kv_heads * f.seqlen_k * f.head_dim) return;
  // accum layout (b, kv head, j, d)
  const int d = static_cast<int>(e % f.head_dim);
  const std::int64_t row = e / f.head_dim;
  const int j = static_cast<int>(row % f.seqlen_k), h = static_cast<int>(row / f.seqlen_k % f.kv_heads);
  const int b = static_cast<int>(row / (std::int64_t(f.seqlen_k) * f.kv_heads));
  store_rounded(static_cast<Element*>(p.dk) + b * p.dk_batch_stride + j * p.dk_row_stride + h * p.dk_head_stride + d,
                p.dk_accum[e] * f.scale);
  store_rounded(static_cast<Element*>(p.dv) + b * p.dv_batch_stride + j * p.dv_row_stride + h * p.dv_head_stride + d,
                p.dv_accum[e]);
}

// One thread per dbias element.
template <typename Out>
__global__ void __launch_bounds__(kThreads) reduce_bias_grad_kernel(const __grid_constant__ BackwardParams p) {
  const BiasGrad& g = p.dbias;
  const std::int64_t e = std::int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= g.accum_slot_stride) return;
  const int slots = g.batch_slots * g.kv_slots;
  float sum = 0.f;
  for (int s = 0; s < slots; ++s) sum += g.accum[s * g.accum_slot_stride + e];
  const std::int64_t c = e % g.cols, r = e / g.cols % g.rows, h = e / (g.cols * g.rows) % g.heads;
  const std::int64_t b = e / (g.cols * g.rows * g.heads);
  // The bias's own strides: the row and key strides of a size-1 dim are never used (index 0).
  store_rounded(static_cast<Out*>(g.out) + b * g.batch_stride + h * g.head_stride + r * g.row_stride + c, sum);
}

}  // namespace

cudaError_t compute_dsum(const BackwardParams& p, cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(p.fwd.batch) * p.fwd.heads * p.accum_rows;
  if (rows == 0) return cudaSuccess;
  const unsigned grid = blocks_for(rows, kThreads / 32);
  if (p.fwd.element == ElementType::bfloat16) {
    dsum_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  } else {
    dsum_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t reduce_dq(const BackwardParams& p, cudaStream_t stream) {
  const std::int64_t n = std::int64_t(p.fwd.batch) * p.fwd.heads * p.accum_rows * p.fwd.head_dim;
  if (n == 0) return cudaSuccess;
  if (p.fwd.element == ElementType::bfloat16) {
    reduce_dq_kernel<__nv_bfloat16><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p);
  } else {
    reduce_dq_kernel<__half><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t reduce_dk_dv(const BackwardParams& p, cudaStream_t stream) {
  const std::int64_t n = std::int64_t(p.fwd.batch) * p.fwd.kv_heads * p.fwd.seqlen_k * p.fwd.head_dim;
  if (n == 0) return cudaSuccess;
  if (p.fwd.element == ElementType::bfloat16) {
    reduce_dk_dv_kernel<__nv_bfloat16><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p);
  } else {
    reduce_dk_dv_kernel<__half><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t reduce_bias_grad(const BackwardParams& p, cudaStream_t stream) {
  const std::int64_t n = p.dbias.accum_slot_stride;
  if (n == 0) return cudaSuccess;
  switch (p.dbias.type) {
    case ElementType::float32: reduce_bias_grad_kernel<float><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p); break;
    case ElementType::bfloat16:
      reduce_bias_grad_kernel<__nv_bfloat16><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p);
      break;
    default: reduce_bias_grad_kernel<__half><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels
