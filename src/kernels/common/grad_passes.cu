#include "kernels/common/grad_passes.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common/rounding_store.h"
#include "kernels/common/sequences.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const __nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(const float x) { return x; }

unsigned blocks_for(std::int64_t items, int per_block) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, (items + per_block - 1) / per_block));
}

// The passes touch kVec consecutive head-dim elements per thread: 8 (16-byte accesses of 16-bit
// elements, two of floats) where every row they touch starts on 16 bytes (rows_aligned), else 1.
// Element by element, with three 64-bit divisions per element to place it, the gather path's
// dK/dV pass took 68 us and the Δ pass 73 us of its 2.4 ms backward (training top-2048, D128,
// H200); by vectors, 26 and 49 us.
constexpr int kVector = 8;

template <int kVec, typename T>
__device__ __forceinline__ void load_vector(const T* src, float (&out)[kVec]) {
  if constexpr (kVec == 8) {
    constexpr int kPerAccess = 16 / sizeof(T);
#pragma unroll
    for (int a = 0; a < kVec / kPerAccess; ++a) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[a];
      const T* values = reinterpret_cast<const T*>(&raw);
      for (int i = 0; i < kPerAccess; ++i) out[a * kPerAccess + i] = to_float(values[i]);
    }
  } else {
    for (int i = 0; i < kVec; ++i) out[i] = to_float(src[i]);
  }
}

template <int kVec, typename Element>
__device__ __forceinline__ void store_vector(Element* dst, const float (&in)[kVec], float factor) {
  if constexpr (kVec == 8) {
    static_assert(sizeof(Element) == 2, "8 16-bit elements are one 16-byte store");
    union {
      uint4 raw;
      Element values[kVec];
    } v;
    for (int i = 0; i < kVec; ++i) store_rounded(&v.values[i], in[i] * factor);
    *reinterpret_cast<uint4*>(dst) = v.raw;
  } else {
    for (int i = 0; i < kVec; ++i) store_rounded(dst + i, in[i] * factor);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether rows of `head_dim` 16-bit elements at `base` + batch, row and head strides (in
// elements) all start on 16 bytes.
bool rows_aligned(const void* base, std::int64_t batch_stride, std::int64_t row_stride, std::int64_t head_stride) {
  return aligned16(base) && batch_stride % kVector == 0 && row_stride % kVector == 0 && head_stride % kVector == 0;
}

// A group of `lanes` threads (a power of two up to 32) per (b, h, i) row of the workspace's
// layout (accum_rows rows per batch and head), striding over the row's vectors, then a butterfly
// sum inside the group. Rows past a packed sequence's length are left.
template <typename Element, int kVec>
__global__ void __launch_bounds__(kThreads) dsum_kernel(const __grid_constant__ BackwardParams p, int lanes) {
  const ForwardParams& f = p.fwd;
  const std::int64_t rows = std::int64_t(f.batch) * f.heads * p.accum_rows;
  const std::int64_t row = (std::int64_t(blockIdx.x) * kThreads + threadIdx.x) / lanes;
  const int lane = threadIdx.x % lanes;
  float sum = 0.f;
  bool exists = false;
  if (row < rows) {
    const int i = static_cast<int>(row % p.accum_rows), h = static_cast<int>(row / p.accum_rows % f.heads);
    const int b = static_cast<int>(row / (std::int64_t(p.accum_rows) * f.heads));
    const QueryRow q = query_row(f, b, i);
    exists = q.exists;
    if (exists) {
      const auto* o = static_cast<const Element*>(f.out) + b * f.out_batch_stride + q.row * f.out_row_stride +
                      h * f.out_head_stride;
      const auto* d = static_cast<const Element*>(p.dout) + b * p.dout_batch_stride + q.row * p.dout_row_stride +
                      h * p.dout_head_stride;
      for (int c = lane * kVec; c < f.head_dim; c += lanes * kVec) {
        float ov[kVec], dv[kVec];
        load_vector<kVec>(o + c, ov);
        load_vector<kVec>(d + c, dv);
        for (int k = 0; k < kVec; ++k) sum += ov[k] * dv[k];
      }
    }
  }
  // Every lane of the warp takes part in the shuffles; a group's lanes share its row.
  for (int offset = lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0 && exists) p.dsum[row] = sum;
}

// One thread per kVec elements of dq.
template <typename Element, int kVec>
__global__ void __launch_bounds__(kThreads) reduce_dq_kernel(const __grid_constant__ BackwardParams p) {
  const ForwardParams& f = p.fwd;
  const std::int64_t slot_stride = std::int64_t(f.batch) * f.heads * p.accum_rows * f.head_dim;
  const std::int64_t e = (std::int64_t(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  if (e >= slot_stride) return;
  // accum layout (b, h, i, d)
  const int d = static_cast<int>(e % f.head_dim);
  const std::int64_t row = e / f.head_dim;
  const int i = static_cast<int>(row % p.accum_rows), h = static_cast<int>(row / p.accum_rows % f.heads);
  const int b = static_cast<int>(row / (std::int64_t(p.accum_rows) * f.heads));
  const QueryRow q = query_row(f, b, i);
  if (!q.exists) return;
  float sum[kVec] = {};
  for (int s = 0; s < p.dq_slots; ++s) {
    float part[kVec];
    load_vector<kVec>(p.dq_accum + s * slot_stride + e, part);
    for (int k = 0; k < kVec; ++k) sum[k] += part[k];
  }
  store_vector<kVec>(static_cast<Element*>(p.dq) + b * p.dq_batch_stride + q.row * p.dq_row_stride +
                         h * p.dq_head_stride + d,
                     sum, f.scale);
}

// One thread per kVec elements of dK and dV, (b, kv head, key, d): the sums over the accumulator
// slots (BackwardParams::dk_accum), in slot order.
template <typename Element, int kVec>
__global__ void __launch_bounds__(kThreads) reduce_dk_dv_kernel(const __grid_constant__ BackwardParams p) {
  const ForwardParams& f = p.fwd;
  const std::int64_t slot_stride = std::int64_t(f.batch) * f.kv_heads * f.seqlen_k * f.head_dim;
  const std::int64_t e = (std::int64_t(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  if (e >= slot_stride) return;
  const int d = static_cast<int>(e % f.head_dim);
  const std::int64_t row = e / f.head_dim;
  const int j = static_cast<int>(row % f.seqlen_k), h = static_cast<int>(row / f.seqlen_k % f.kv_heads);
  const int b = static_cast<int>(row / (std::int64_t(f.seqlen_k) * f.kv_heads));
  auto sum_slots = [&](const float* accum, float (&sum)[kVec]) {
    load_vector<kVec>(accum + e, sum);
    for (int s = 1; s < p.head_splits; ++s) {
      float part[kVec];
      load_vector<kVec>(accum + s * slot_stride + e, part);
      for (int k = 0; k < kVec; ++k) sum[k] += part[k];
    }
  };
  float values[kVec];
  sum_slots(p.dk_accum, values);
  store_vector<kVec>(static_cast<Element*>(p.dk) + b * p.dk_batch_stride + j * p.dk_row_stride + h * p.dk_head_stride + d,
                     values, f.scale);
  sum_slots(p.dv_accum, values);
  store_vector<kVec>(static_cast<Element*>(p.dv) + b * p.dv_batch_stride + j * p.dv_row_stride + h * p.dv_head_stride + d,
                     values, 1.f);
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

// launch(element, vector): the kernels' template arguments as values, a 16-bit element type and
// kVector where `vectors` holds, else 1.
template <typename Launch>
void with_element_and_vector(ElementType element, bool vectors, Launch&& launch) {
  auto by_vector = [&](auto e) {
    if (vectors) {
      launch(e, std::integral_constant<int, kVector>{});
    } else {
      launch(e, std::integral_constant<int, 1>{});
    }
  };
  if (element == ElementType::bfloat16) {
    by_vector(__nv_bfloat16{});
  } else {
    by_vector(__half{});
  }
}

}  // namespace

cudaError_t compute_dsum(const BackwardParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  const std::int64_t rows = std::int64_t(f.batch) * f.heads * p.accum_rows;
  if (rows == 0) return cudaSuccess;
  const bool vectors = f.head_dim % kVector == 0 &&
                       rows_aligned(f.out, f.out_batch_stride, f.out_row_stride, f.out_head_stride) &&
                       rows_aligned(p.dout, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride);
  const int per_row = vectors ? f.head_dim / kVector : f.head_dim;
  int lanes = 1;
  while (lanes < per_row && lanes < 32) lanes *= 2;
  with_element_and_vector(f.element, vectors, [&](auto element, auto vector) {
    dsum_kernel<decltype(element), decltype(vector)::value>
        <<<blocks_for(rows * lanes, kThreads), kThreads, 0, stream>>>(p, lanes);
  });
  return cudaGetLastError();
}

cudaError_t reduce_dq(const BackwardParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  const std::int64_t n = std::int64_t(f.batch) * f.heads * p.accum_rows * f.head_dim;
  if (n == 0) return cudaSuccess;
  const bool vectors = f.head_dim % kVector == 0 && aligned16(p.dq_accum) &&
                       rows_aligned(p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  with_element_and_vector(f.element, vectors, [&](auto element, auto vector) {
    constexpr int kV = decltype(vector)::value;
    reduce_dq_kernel<decltype(element), kV><<<blocks_for(n / kV, kThreads), kThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

cudaError_t reduce_dk_dv(const BackwardParams& p, cudaStream_t stream) {
  const ForwardParams& f = p.fwd;
  const std::int64_t n = std::int64_t(f.batch) * f.kv_heads * f.seqlen_k * f.head_dim;
  if (n == 0) return cudaSuccess;
  const bool vectors = f.head_dim % kVector == 0 && aligned16(p.dk_accum) && aligned16(p.dv_accum) &&
                       rows_aligned(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) &&
                       rows_aligned(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  with_element_and_vector(f.element, vectors, [&](auto element, auto vector) {
    constexpr int kV = decltype(vector)::value;
    reduce_dk_dv_kernel<decltype(element), kV><<<blocks_for(n / kV, kThreads), kThreads, 0, stream>>>(p);
  });
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
