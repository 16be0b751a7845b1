// Whether TMA can address a (rows, head dim, heads, batch) tensor whose head dim is contiguous
// (Q, K, V, dO). Plain C++: the host plans with it too (a deterministic backward whose operands
// TMA cannot address keeps its dQ in the key-tile kernel).
#pragma once

#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels::sm90 {

// One operand as TMA sees it.
struct TmaOperand {
  const void* ptr;
  int rows, heads;
  std::int64_t row_stride, head_stride, batch_stride;
};

// 16-bit elements in the 16 bytes that TMA and bulk copies align bases and strides to.
inline constexpr std::int64_t kTmaVector = 8;

// A dimension of extent 1 has no stride to speak of: it gets the one a packed tensor would have,
// so that the check below does not turn away, say, a single head with an arbitrary head stride.
inline void pack_unit_strides(TmaOperand& t, int head_dim, int batch) {
  if (t.rows == 1) t.row_stride = (head_dim + kTmaVector - 1) / kTmaVector * kTmaVector;
  if (t.heads == 1) t.head_stride = t.row_stride * t.rows;
  if (batch == 1) t.batch_stride = t.head_stride * t.heads;
}

// TMA reads a tensor through a 16-byte aligned base and strides that are positive multiples of 16
// bytes (below 2^40 bytes).
inline bool tma_addressable(const TmaOperand& t) {
  auto usable = [](std::int64_t stride) {
    return stride > 0 && stride % kTmaVector == 0 && stride < (std::int64_t(1) << 39);
  };
  return reinterpret_cast<std::uintptr_t>(t.ptr) % 16 == 0 && usable(t.row_stride) && usable(t.head_stride) &&
         usable(t.batch_stride);
}

// A (batch, rows, heads, head dim) tensor as TMA sees it, with the strides of unit dims packed.
inline TmaOperand tma_operand(const void* ptr, int rows, int heads, std::int64_t row_stride, std::int64_t head_stride,
                              std::int64_t batch_stride, int head_dim, int batch) {
  TmaOperand t{ptr, rows, heads, row_stride, head_stride, batch_stride};
  pack_unit_strides(t, head_dim, batch);
  return t;
}

struct QkvOperands {
  TmaOperand q, k, v;
  bool addressable() const { return tma_addressable(q) && tma_addressable(k) && tma_addressable(v); }
};

// The batches TMA sees: packed sequences are one batch of all their rows.
inline int tma_batches(const ForwardParams& p) { return p.cu_seqlens_q ? 1 : p.batch; }

inline QkvOperands qkv_operands(const ForwardParams& p) {
  const int batch = tma_batches(p);
  const int rows_q = p.cu_seqlens_q ? p.total_q : p.seqlen_q, rows_k = p.cu_seqlens_q ? p.total_k : p.seqlen_k;
  return {tma_operand(p.q, rows_q, p.heads, p.q_row_stride, p.q_head_stride, p.q_batch_stride, p.head_dim, batch),
          tma_operand(p.k, rows_k, p.kv_heads, p.k_row_stride, p.k_head_stride, p.k_batch_stride, p.head_dim, batch),
          tma_operand(p.v, rows_k, p.kv_heads, p.v_row_stride, p.v_head_stride, p.v_batch_stride, p.head_dim, batch)};
}

// dO of a backward, as TMA sees it.
inline TmaOperand dout_operand(const BackwardParams& p) {
  const ForwardParams& f = p.fwd;
  return tma_operand(p.dout, f.cu_seqlens_q ? f.total_q : f.seqlen_q, f.heads, p.dout_row_stride,
                     p.dout_head_stride, p.dout_batch_stride, f.head_dim, tma_batches(f));
}

}  // namespace flash_dmattn::kernels::sm90
