// Per-row key bits from key indices (ForwardArgs::indices), in the tile summary's bit layout, so
// that build_key_lists (key_lists.h) builds the gather path's lists from them as from a mask.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/key_lists.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Each row's list of keys: int32 entries, -1 (or any value outside [0, Sk)) for none. Strides in
// elements; 0 where the indices broadcast (batch, head or query row).
struct IndexRows {
  const std::int32_t* data = nullptr;
  std::int64_t batch_stride = 0, head_stride = 0, row_stride = 0, entry_stride = 1;
  int entries = 0;  // K, the list length
};

// Bytes of workspace the bits of `extent` take: a row of Sk bits per query row, per (batch, head)
// of the extent (its batches and heads are the indices').
std::size_t index_bits_bytes(const KeyListExtent& extent);

// Launches on `stream` a pass that writes into `workspace` every row's bits (key j kept iff some
// entry of its list is j; a key listed twice counts once) and describes them in *summary: bits
// only, no tile classes (the gather path reads no classes).
cudaError_t build_index_bits(const KeyListExtent& extent, const IndexRows& indices, void* workspace,
                             cudaStream_t stream, TileSummary* summary);

}  // namespace flash_dmattn::kernels
