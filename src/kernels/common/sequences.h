// Packed sequences and KV caches in the kernels: a CTA of sequence b rebases the call's params to
// its sequence, so that a main loop written for a batch of equal lengths runs it unchanged.
#pragma once

#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// q, k, v, out and their gradients are fp16 or bf16 (validate.cpp).
constexpr std::int64_t kElementBytes = 2;

// A length the caller gave (the host cannot read it without waiting for the GPU) held to [0, limit]:
// a length past the layout's maximum would read mask, bias and summary past their rows, and a
// negative one (decreasing offsets) makes an empty sequence.
__device__ __forceinline__ int clamp_length(std::int64_t length, int limit) {
  return static_cast<int>(max(std::int64_t(0), min(length, std::int64_t(limit))));
}

// The params of batch b as the main loops read them: for packed sequences (whose batch strides
// the host sets to 0, so the loops' b·stride adds nothing), q, k, v, out and lse advanced to the
// sequence's first rows, and its own lengths, while mask, bias and their summary keep indexing batch b of
// their (B|1, .., max_q|1, max_k|1) layout, whose positions count from the sequence's start. A
// KV cache's batch b keeps its rows and gets its own key count; a batched call's params come back
// unchanged.
__device__ __forceinline__ ForwardParams for_sequence(const ForwardParams& params, int b) {
  ForwardParams p = params;
  // A KV cache's batch b: its cached keys. The front validates the lengths except under CUDA-graph
  // capture or when told not to (validate=False), so they are clamped to [0, seqlen_k] here.
  if (params.seqlens_k != nullptr) p.seqlen_k = clamp_length(params.seqlens_k[b], params.seqlen_k);
  if (params.cu_seqlens_q == nullptr) return p;
  const std::int64_t q0 = params.cu_seqlens_q[b], k0 = params.cu_seqlens_k[b];
  // The offsets are the caller's, clamped to the maxima (the torch front checks them).
  p.seqlen_q = clamp_length(params.cu_seqlens_q[b + 1] - q0, params.seqlen_q);
  p.seqlen_k = clamp_length(params.cu_seqlens_k[b + 1] - k0, params.seqlen_k);
  p.q = static_cast<const char*>(params.q) + kElementBytes * q0 * params.q_row_stride;
  p.k = static_cast<const char*>(params.k) + kElementBytes * k0 * params.k_row_stride;
  p.v = static_cast<const char*>(params.v) + kElementBytes * k0 * params.v_row_stride;
  p.out = static_cast<char*>(params.out) + kElementBytes * q0 * params.out_row_stride;
  p.lse = params.lse + q0;  // lse: (H, total_q), rows contiguous
  p.q_row0 = static_cast<int>(q0);
  p.k_row0 = static_cast<int>(k0);
  return p;
}

// Where query i of batch b lies in q (and out, dO, dQ), and whether it exists: row i of batch b,
// or for packed sequences the sequence's first row plus i, below the sequence's length.
struct QueryRow {
  std::int64_t row;
  bool exists;
};
__device__ __forceinline__ QueryRow query_row(const ForwardParams& f, int b, int i) {
  if (f.cu_seqlens_q == nullptr) return {i, i < f.seqlen_q};
  const std::int64_t q0 = f.cu_seqlens_q[b], length = f.cu_seqlens_q[b + 1] - q0;
  return {q0 + i, i < length && i < f.seqlen_q};
}

// The backward's params of batch b: the forward's as above, and dO, dQ, dK and dV at the
// sequence's first rows. The workspace (dsum, dq_accum and the dbias accumulators) keeps the
// padded layout (batch b, accum_rows rows), which the lengths index from the sequence's start.
__device__ __forceinline__ BackwardParams for_sequence(const BackwardParams& params, int b) {
  BackwardParams p = params;
  if (params.fwd.cu_seqlens_q == nullptr) return p;
  p.fwd = for_sequence(params.fwd, b);
  const std::int64_t q0 = p.fwd.q_row0, k0 = p.fwd.k_row0;
  p.dout = static_cast<const char*>(params.dout) + kElementBytes * q0 * params.dout_row_stride;
  p.dq = static_cast<char*>(params.dq) + kElementBytes * q0 * params.dq_row_stride;
  p.dk = static_cast<char*>(params.dk) + kElementBytes * k0 * params.dk_row_stride;
  p.dv = static_cast<char*>(params.dv) + kElementBytes * k0 * params.dv_row_stride;
  return p;
}

// A backward kernel of its own for each: a batched call's keeps reading its params where the launch
// put them (the constant bank), and so does no other work a packed call needs.
enum class Sequences { batched, packed };

// body(p) on key tile n_block of batch b: p the call's params, or for packed sequences batch b's
// (above), unless the tile lies past the sequence's keys (the grid covers the longest's; the
// skipped tile's dBias elements come from the zeroed accumulators, which the host reduces for every
// packed call).
//
// The rebased params live in shared memory, written by one thread. As a local copy (ptxas, sm90a
// bf16 D128: a 608-byte stack frame against 40 batched) ncu counted 82.7 M local-memory requests
// against 0.46 M for the batched kernel on the same work, and 2.9 long-scoreboard stall cycles per
// instruction against 0.5: the main loop reread its fields and spilled its walk state beside them.
template <Sequences kSequences, int kBlockN, typename Body>
__device__ __forceinline__ void for_sequence_key_tile(const BackwardParams& params, int b, int n_block, Body&& body) {
  if constexpr (kSequences == Sequences::batched) {
    body(params);
  } else {
    __shared__ BackwardParams sequence;
    __syncthreads();  // the CTA's previous key tile (deterministic mode walks several) is done with it
    if (threadIdx.x == 0) sequence = for_sequence(params, b);
    __syncthreads();
    if (n_block * kBlockN < sequence.fwd.seqlen_k) body(sequence);
  }
}

}  // namespace flash_dmattn::kernels
