// Packed sequences in the kernels: a CTA of sequence b rebases the call's params to its sequence,
// so that a main loop written for a batch of equal lengths runs it unchanged.
#pragma once

#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// The params of batch b as the main loops read them: for packed sequences (whose batch strides
// the host sets to 0, so the loops' b·stride adds nothing), q, k, v, out and lse advanced to the
// sequence's first rows, and its own lengths, while mask, bias and their summary keep indexing batch b of
// their (B|1, .., max_q|1, max_k|1) layout, whose positions count from the sequence's start. A
// batched call's params come back unchanged.
__device__ __forceinline__ ForwardParams for_sequence(const ForwardParams& params, int b) {
  ForwardParams p = params;
  if (params.cu_seqlens_q == nullptr) return p;
  const std::int64_t q0 = params.cu_seqlens_q[b], k0 = params.cu_seqlens_k[b];
  // The offsets are the caller's (the host cannot read them without waiting): a sequence longer
  // than the maxima would read mask, bias and summary past its rows of their layout, so its
  // lengths are clamped to them (the torch front checks the offsets).
  p.seqlen_q = static_cast<int>(min(std::int64_t(params.cu_seqlens_q[b + 1]) - q0, std::int64_t(params.seqlen_q)));
  p.seqlen_k = static_cast<int>(min(std::int64_t(params.cu_seqlens_k[b + 1]) - k0, std::int64_t(params.seqlen_k)));
  constexpr std::int64_t kBytes = 2;  // q, k, v and out are fp16 or bf16 (validate.cpp)
  p.q = static_cast<const char*>(params.q) + kBytes * q0 * params.q_row_stride;
  p.k = static_cast<const char*>(params.k) + kBytes * k0 * params.k_row_stride;
  p.v = static_cast<const char*>(params.v) + kBytes * k0 * params.v_row_stride;
  p.out = static_cast<char*>(params.out) + kBytes * q0 * params.out_row_stride;
  p.lse = params.lse + q0;  // lse: (H, total_q), rows contiguous
  return p;
}

}  // namespace flash_dmattn::kernels
