// Stores of an fp32 result into the element types the kernels write, rounding to nearest even:
// one definition for the passes (split combine, dq and dbias reductions) and the backward's
// direct dbias writes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

__device__ __forceinline__ void store_rounded(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_rounded(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_rounded(float* p, float x) { *p = x; }

// The same where the type is known only at run time (a bias gradient has the bias's dtype).
__device__ __forceinline__ void store_rounded(ElementType type, void* base, std::int64_t offset, float x) {
  switch (type) {
    case ElementType::float32: store_rounded(static_cast<float*>(base) + offset, x); break;
    case ElementType::bfloat16: store_rounded(static_cast<__nv_bfloat16*>(base) + offset, x); break;
    default: store_rounded(static_cast<__half*>(base) + offset, x); break;
  }
}

}  // namespace flash_dmattn::kernels
