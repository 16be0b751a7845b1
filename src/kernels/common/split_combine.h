// Merging the partial results of a split-KV forward (ForwardParams::num_splits > 1).
#pragma once

#include <cuda_runtime.h>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// The most splits the combine handles; the host never plans more.
inline constexpr int kMaxSplits = 128;

// For every (batch, head, query row): lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse)·out_s,
// with out = 0 and lse = +inf where no split saw a visible key.
cudaError_t combine_split_partials(const ForwardParams& params, cudaStream_t stream);

}  // namespace flash_dmattn::kernels
