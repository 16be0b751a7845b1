// The sm80 kernels as host code sees them: no CuTe or CUTLASS types.
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"

namespace flash_dmattn::kernels::sm80 {

// The bucket `head_dim` needs, compiled or not: the smallest of 32, 64, 96, 128, 192, 256 that holds it.
int head_dim_bucket(int head_dim);

// head_dim_bucket(head_dim), or 0 when this build does not include its kernels for `element`.
// A build compiles the forward and the backward of a (dtype, head dim) together.
int compiled_head_dim_bucket(ElementType element, int head_dim);

// Dynamic shared memory of the backward kernel (0 when not compiled): more than the per-block
// limit of GPUs such as sm_86 and sm_89 for the larger head dims.
int backward_smem_bytes(ElementType element, int head_dim);

// The same for the forward's and the backward's gather paths (0 when not compiled, or past the
// backward's head dims). The gather forward keeps a second K/V buffer: 196 KB at head dim 256.
int gather_forward_smem_bytes(ElementType element, int head_dim);
// packed_heads 2: with two query heads per CTA (BackwardParams::pair_heads), 0 at the head dims
// that keep one head per CTA (tile_size.h gather_backward_pairs_heads_at).
int gather_backward_smem_bytes(ElementType element, int head_dim, int packed_heads = 1);

cudaError_t forward(const ForwardParams& params, cudaStream_t stream);
// The main backward kernel only; the host runs the passes around it (grad_passes.h).
cudaError_t backward(const BackwardParams& params, cudaStream_t stream);

}  // namespace flash_dmattn::kernels::sm80
