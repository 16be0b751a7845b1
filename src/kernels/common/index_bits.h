// The gather path's key lists (key_lists.h) from key indices (ForwardArgs::indices): straight from
// the entries up to 2^18 keys; past that through per-row key bits in the tile summary's bit
// layout, from which build_key_lists builds them as from a mask.
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

// Bytes of workspace the per-row bits of `extent` take (a row of Sk bits per query row, per
// (batch, head) of the extent: its batches and heads are the indices'), for lists of `entries`
// (IndexRows::entries); 0 where the lists are built straight from the entries.
std::size_t index_bits_bytes(const KeyListExtent& extent, int entries);

// Launches on `stream` the build of the extent's lists into `lists_memory` (key_lists_bytes) from
// `indices` (key j kept in a row iff some entry of its list is j; a key listed twice counts once),
// through the bits in `bits_workspace` (index_bits_bytes) where needed, and describes them in
// *lists. *summary describes the bits (or nothing): the gather kernels read no tile classes.
cudaError_t build_index_lists(const KeyListExtent& extent, const IndexRows& indices, void* bits_workspace,
                              void* lists_memory, cudaStream_t stream, TileSummary* summary, KeyLists* lists);

}  // namespace flash_dmattn::kernels
