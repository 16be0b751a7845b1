// The backward's passes around its main kernel: Δ = rowsum(dO∘O) before it, and after it the
// fp32 accumulators (dQ, dK and dV on the gather path, and dBias where CTAs share elements)
// summed over their slots in a fixed order and written in the outputs' dtypes and strides.
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// dsum[b, h, i] = Σ_d dO[b, i, h, d]·O[b, i, h, d], in fp32.
cudaError_t compute_dsum(const BackwardParams& params, cudaStream_t stream);

// dq = scale · Σ_slots dq_accum.
cudaError_t reduce_dq(const BackwardParams& params, cudaStream_t stream);

// dk = scale · Σ_slots dk_accum, dv = Σ_slots dv_accum (BackwardParams::dk_accum).
cudaError_t reduce_dk_dv(const BackwardParams& params, cudaStream_t stream);

// dbias = Σ_slots dbias accum, for a BiasGrad that is not `direct`.
cudaError_t reduce_bias_grad(const BackwardParams& params, cudaStream_t stream);

}  // namespace flash_dmattn::kernels
