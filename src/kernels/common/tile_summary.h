// Building the per-tile mask summary that lets kernels skip empty tiles without reading them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// The mask as the summary builder reads it: (batches, heads, rows, cols) with its strides, where
// rows is 1 or Sq and cols is 1 or Sk (a broadcast dimension is summarized once).
struct MaskExtent {
  const std::uint8_t* ptr = nullptr;
  std::int64_t batches = 0, heads = 0, rows = 0, cols = 0;
  std::int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;
  int head_divisor = 1;  // query heads per mask head
  // Causal, with a row per query: row i sees keys j <= i + diagonal. The kernels never read the
  // summary or bits of keys that no row of a block can see, so the build skips them: half the
  // mask's bytes under causal masking. Their classes are written as 0, their bits not at all.
  bool causal = false;
  std::int64_t diagonal = 0;
  // Bit-packed (attention.h): cols keys in ceil(cols / 8) bytes a row, key j at bit j % 8 of byte
  // j / 8; col_stride is 1 (bytes), row_stride counts bytes.
  bool packed = false;
};

// Bytes of workspace the summary of this mask needs.
std::size_t tile_summary_bytes(const MaskExtent& mask);

// The summary of this mask as it lies in `memory` (tile_summary_bytes of it), built there earlier.
TileSummary describe_tile_summary(const MaskExtent& mask, void* memory);

// Launches the summary build on `stream` into `workspace` and returns the summary's description.
cudaError_t build_tile_summary(const MaskExtent& mask, void* workspace, cudaStream_t stream, TileSummary* summary);

}  // namespace flash_dmattn::kernels
