// Building the gather path's key lists (KeyLists in params.h) from the tile summary's mask bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// What the lists are built for: the mask's batches and heads (1 where it broadcasts), the
// sequence lengths, the query rows per list (the forward kernel's query tile) and causal
// alignment (row i sees keys j <= i + diagonal).
struct KeyListExtent {
  std::int64_t batches = 0, heads = 0;
  int seqlen_q = 0, seqlen_k = 0, block_m = 0;
  int head_divisor = 1;
  bool causal = false;
  int diagonal = 0;

  __host__ __device__ std::int64_t query_tiles() const { return (seqlen_q + block_m - 1) / block_m; }
  __host__ __device__ std::int64_t lists() const { return batches * heads * query_tiles(); }
};

// Bytes of workspace the lists take: a count per list, then Sk keys of room per list.
std::size_t key_lists_bytes(const KeyListExtent& extent);

// Launches the build on `stream` into `workspace`, from the bits of a summary built earlier on the
// same stream, and describes the lists in *lists. The mask must have a key per column (not a key
// dim of 1). One read of the bits: each list ORs its rows' words and compacts the set bits.
cudaError_t build_key_lists(const KeyListExtent& extent, const TileSummary& summary, void* workspace,
                            cudaStream_t stream, KeyLists* lists);

}  // namespace flash_dmattn::kernels
