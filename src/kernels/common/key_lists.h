// Building the gather path's key lists (KeyLists in params.h) from the tile summary's mask bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"

namespace flash_dmattn::kernels {

// What the lists are built for: the mask's batches and heads (1 where it broadcasts), the
// sequence lengths, the forward kernel's tile (query rows per list, keys per chunk of a list) and
// causal alignment (row i sees keys j <= i + diagonal).
struct KeyListExtent {
  std::int64_t batches = 0, heads = 0;
  int seqlen_q = 0, seqlen_k = 0, block_m = 0, block_n = 0;
  int head_divisor = 1;
  bool causal = false;
  int diagonal = 0;

  __host__ __device__ std::int64_t query_tiles() const { return (seqlen_q + block_m - 1) / block_m; }
  __host__ __device__ std::int64_t lists() const { return batches * heads * query_tiles(); }
  // Keys of room per list: Sk, rounded up so that every list's row bits start 16-byte aligned.
  __host__ __device__ int capacity() const { return (seqlen_k + 3) / 4 * 4; }
  __host__ __device__ std::int64_t row_bits_words() const {
    return std::int64_t((seqlen_k + block_n - 1) / block_n) * block_m * (block_n / 32);
  }
};

// The largest block_m the build takes.
inline constexpr int kMaxListRows = 128;

// Bytes of workspace the lists take: Sk keys of room and the row bits of Sk keys per list, then a
// count per list, then per list its blocks of block_n keys that hold a listed key
// (KeyLists::blocks).
std::size_t key_lists_bytes(const KeyListExtent& extent);

// The lists of this extent as they lie in `memory` (key_lists_bytes of it), built there earlier.
KeyLists describe_key_lists(const KeyListExtent& extent, void* memory);

// Launches the build on `stream` into `workspace`, from the bits of a summary built earlier on the
// same stream, and describes the lists in *lists. The mask must have a key per column and a row
// per query (cudaErrorInvalidValue otherwise), block_m <= kMaxListRows and block_n 32 times a
// divisor of 32. Each list reads its rows' words twice: once to OR them, once to compact each row's bits.
cudaError_t build_key_lists(const KeyListExtent& extent, const TileSummary& summary, void* workspace,
                            cudaStream_t stream, KeyLists* lists);

}  // namespace flash_dmattn::kernels
