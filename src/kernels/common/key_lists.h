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
  // Chunks of block_n keys that `keys` keys fill.
  __host__ __device__ std::int64_t chunks(std::int64_t keys) const { return (keys + block_n - 1) / block_n; }
  // The keys query tile `tile`'s rows may see: under causal masking up to its last row's limit,
  // j <= rows_end - 1 + diagonal.
  __host__ __device__ int span_keys(std::int64_t tile) const {
    if (!causal) return seqlen_k;
    const std::int64_t rows_end = (tile + 1) * block_m < seqlen_q ? (tile + 1) * block_m : seqlen_q;
    const std::int64_t keys = rows_end + diagonal;
    return static_cast<int>(keys < 0 ? 0 : keys < seqlen_k ? keys : seqlen_k);
  }
};

// The largest block_m the build takes.
inline constexpr int kMaxListRows = 128;

// Bytes of workspace the lists take: Sk keys of room and the row bits of Sk keys per list, then a
// count per list, then per list its blocks of block_n keys that hold a listed key
// (KeyLists::blocks).
std::size_t key_lists_bytes(const KeyListExtent& extent);
// Where in those bytes the counts begin (KeyLists::counts; the block counts follow them).
std::size_t key_list_counts_offset(const KeyListExtent& extent);

// The lists of this extent as they lie in `memory` (key_lists_bytes of it), built there earlier.
KeyLists describe_key_lists(const KeyListExtent& extent, void* memory);

// Bounds on the work of the lists of an extent, from the summary's classes alone
// (estimate_key_lists), summed over the lists as listed_work sums their sizes (chunks of block_n
// keys): the listed keys are at least those of the 64-key blocks some row block of a tile sees
// in full and every row of it may see under causal masking, and one key of each other block that
// every row may see and some row block sees in part; the blocks of block_n keys that hold
// a listed key are at least those holding such a block and at most those holding a block with a
// visible key; and the causal span. A summary pass cheap enough to run before every build.
struct ListEstimate {
  unsigned long long listed_at_least, visible_at_least, visible_at_most, span;
};

// The gather path's rule (gather_pays in sparse_path.h) as shares in thousandths: the gather pays
// where the visible blocks are at most sparse_permille of the span or the listed keys at most
// share_permille of the visible blocks. Whether lists so estimated may make it pay: false only
// where they cannot, so that a build gated by it skips no lists that would have paid.
struct ListGate {
  const ListEstimate* estimate = nullptr;  // on the device; nullptr: build whatever the estimate
  int share_permille = 0, sparse_permille = 0;
  // On the device, set by choose_gather_path: where set, a build for that choice's forward writes
  // nothing where it chose the tile path (0).
  const int* gather_chosen = nullptr;
};
__host__ __device__ inline bool lists_may_pay(const ListEstimate& e, int share_permille, int sparse_permille) {
  const bool sparse = e.visible_at_least * 1000 <= e.span * static_cast<unsigned long long>(sparse_permille);
  return sparse || e.listed_at_least * 1000 <= e.visible_at_most * static_cast<unsigned long long>(share_permille);
}

// The gather path's rule on the lists' summed sizes (listed_work in sparse_path.h: listed chunks,
// visible blocks, span): it pays where nothing is visible (the gather path launches less), where
// the visible blocks are at most sparse_share of the span, or the listed chunks at most `share`
// of the visible blocks.
__host__ __device__ inline bool lists_pay(std::int64_t listed, std::int64_t visible, std::int64_t span, double share,
                                          double sparse_share) {
  if (visible == 0) return true;
  if (static_cast<double>(visible) <= sparse_share * static_cast<double>(span)) return true;
  return static_cast<double>(listed) <= share * static_cast<double>(visible);
}

// Launches the estimate of the lists of this extent on `stream` into *estimate (device memory),
// from a summary built earlier on the same stream: a memset and one kernel (a warp per list).
cudaError_t estimate_key_lists(const KeyListExtent& extent, const TileSummary& summary, ListEstimate* estimate,
                               cudaStream_t stream);

// The same lists in chunks of wider keys, for a kernel whose tile has the same rows and wider
// key chunks (the sm90a gather forward's 64 x 128 lists of paired heads beside the D128
// backward's 64 x 64): block_n a multiple of the build's and 32 times a divisor of 32, and
// wider_lists_bytes(extent, block_n) bytes of memory for their own row bits and block counts; they
// share the build's keys and counts. One build writes both, reading the mask bits once.
struct WiderChunks {
  int block_n = 0;
  void* memory = nullptr;  // nullptr: none
};
// Whether lists of `extent` can be written beside in chunks of block_n keys (the bounds above).
inline bool wider_chunks_fit(const KeyListExtent& extent, int block_n) {
  return block_n > extent.block_n && block_n % extent.block_n == 0 && 32 % (block_n / 32) == 0;
}
std::size_t wider_lists_bytes(const KeyListExtent& extent, int block_n);
// The wider lists built beside the lists of `extent` in `memory` (describe_key_lists), their own
// part in `wider_memory`.
KeyLists describe_wider_key_lists(const KeyListExtent& extent, void* memory, int block_n, void* wider_memory);

// Launches the build on `stream` into `workspace`, from the bits of a summary built earlier on the
// same stream, and describes the lists in *lists. The mask must have a key per column and a row
// per query (cudaErrorInvalidValue otherwise), block_m <= kMaxListRows and block_n 32 times a
// divisor of 32. Each list reads its rows' words twice: once to OR them, once to compact each row's
// bits. With a gate, the build (on the device) writes nothing where its estimate says the lists
// cannot pay: their sizes are then undefined, and the estimate says so. With `wider`, it also
// writes the lists in wider chunks (above).
cudaError_t build_key_lists(const KeyListExtent& extent, const TileSummary& summary, void* workspace,
                            cudaStream_t stream, KeyLists* lists, const ListGate& gate = {},
                            const WiderChunks& wider = {});

// The path of a forward whose preparation left the choice to the device (a deferred one,
// MaskPreparation::deferred_choice): one CTA reads the sizes of `lists` (built earlier on the same
// stream, gated by `gate`'s estimate) and sets *gather_chosen (device memory) to 1 where they pay
// for the gather path at `share` (lists_pay with `sparse_share`), else 0. The host chooses so
// from the same sizes where it can read them (choose_mask_paths): this is that choice, made
// without waiting for them.
cudaError_t choose_gather_path(const KeyListExtent& extent, const KeyLists& lists, const ListGate& gate, double share,
                               double sparse_share, int* gather_chosen, cudaStream_t stream);

}  // namespace flash_dmattn::kernels
