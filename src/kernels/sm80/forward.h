// The sm80 forward as host code sees it: no CuTe or CUTLASS types.
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"

namespace flash_dmattn::kernels::sm80 {

// The head-dim bucket whose compiled kernel runs `head_dim` (the smallest of 32, 64, 96, 128, 192,
// 256 that holds it), or 0 when this build does not include it for `element`.
int forward_head_dim_bucket(ElementType element, int head_dim);

// The bucket `head_dim` needs, compiled or not.
int head_dim_bucket(int head_dim);

cudaError_t forward(const ForwardParams& params, cudaStream_t stream);

}  // namespace flash_dmattn::kernels::sm80
