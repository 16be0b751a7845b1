// The sm90a kernels as host code sees them: no CuTe or CUTLASS types.
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"

namespace flash_dmattn::kernels::sm90 {

// Whether this build includes the sm90a forward (backward) for `element` at head_dim's bucket.
bool has_forward(ElementType element, int head_dim);
bool has_backward(ElementType element, int head_dim);
// Whether it includes the sm90a gather forward there (the sm90a forward's head dims up to 128).
bool has_gather_forward(ElementType element, int head_dim);
// Whether it includes the sm90a gather backward there (head dim 128, two query heads per CTA).
bool has_gather_backward(ElementType element, int head_dim);

// Split-KV as planned by the host. Without key lists, no GQA packing (params.pack_group = 1).
// With key lists (params.lists.keys) the gather forward, whose lists the host built for
// sm90::forward_tile(head_dim, KvLoads::tma_producer), or with pack_group 2 for two query heads
// per CTA (lists of half its rows).
cudaError_t forward(const ForwardParams& params, cudaStream_t stream);
// The main backward kernel only, on the grid of sm90::backward_tile, or with key lists the gather
// backward (paired heads, on the sm80 backward's lists); the host runs the passes around it
// (grad_passes.h).
cudaError_t backward(const BackwardParams& params, cudaStream_t stream);

}  // namespace flash_dmattn::kernels::sm90
