// The sizes and options of one validated call, derived once from the argument views so that
// backends never re-read shapes from them.
#pragma once

#include <cstdint>

#include "flash_dmattn/tensor.h"

namespace flash_dmattn {

struct Problem {
  std::int64_t batch = 0;     // B (packed: the number of sequences)
  std::int64_t seqlen_q = 0;  // Sq (packed: max_seqlen_q)
  std::int64_t seqlen_k = 0;  // Sk (packed: max_seqlen_k)
  bool packed = false;        // packed sequences (ForwardArgs::sequences)
  std::int64_t total_q = 0, total_k = 0;  // packed: the rows of q and of k
  bool cached = false;        // a KV cache (ForwardArgs::cache): seqlen_k is its logical K
  std::int64_t page_size = 0, num_pages = 0;  // a paged cache's; 0 for a contiguous one
  std::int64_t heads = 0;     // H
  std::int64_t kv_heads = 0;  // Hk, divides H
  std::int64_t head_dim = 0;  // D
  DType dtype = DType::float16;
  Device device{};
  bool has_mask = false;
  bool mask_packed = false;  // a bit-packed mask (uint8, 8 keys a byte)
  bool has_indices = false;  // key lists per row (ForwardArgs::indices)
  std::int64_t indices_rows = 0, indices_entries = 0;  // their query dim (1 or Sq) and list length K
  bool has_bias = false;
  bool has_dbias = false;  // backward only
  double scale = 0.0;      // resolved: the default 1/sqrt(D) already applied
  bool causal = false;
  double softcap = 0.0;
  bool deterministic = false;  // backward only
  // q, k, v and out (and dout, dq, dk, dv in the backward) start on 16-byte boundaries and step
  // by whole 16-byte vectors in every dimension but the last, as vectorized kernels need.
  bool rows_aligned_16 = false;

  std::int64_t group_size() const { return heads / kv_heads; }  // query heads per KV head
  bool empty() const { return batch == 0 || (packed ? total_q : seqlen_q) == 0 || heads == 0; }
};

}  // namespace flash_dmattn
