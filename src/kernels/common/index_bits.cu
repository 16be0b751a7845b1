// Key indices to the gather path's key lists, two ways.
// - Straight from the entries (up to 2^18 keys; tiles of several rows up to 256 entries a row,
//   lists_direct): one CTA per list (query tile, head, batch) marks
//   its rows' entries in a bitmap in shared memory (a key listed twice, or by two rows, is marked
//   once), compacts it into the ascending list, keeping each word's rank (the keys before it), and
//   then sets each row's bit at the rank of each of its keys. One query row (decode) keeps every
//   listed key, so its row bits are ones up to the count and the last pass is skipped. On an
//   H200 (decode B1 H32/8 Sk131072 D128, top-4096 by bias), the decode went from 0.116 ms with
//   the two launches below to 0.071.
// - Otherwise: one CTA per (query row, head, batch) sets one bit of its row's Sk bits per valid
//   entry with an atomic OR (entries of one row may name keys in one word), in shared memory where
//   the row fits (then stored whole), else in global memory; build_key_lists then ORs and compacts
//   each query tile's rows. A row of bits is 8x smaller than the bool mask row it stands for. On
//   an H100 (B2 Hk4 Sq8192, 2048 entries a row), the global atomics took 1.146 ms for 537 MB of
//   indices.
#include "kernels/common/index_bits.h"

#include "kernels/common/cta_prefix_sum.h"
#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kBitsThreads = 256;
constexpr int kListThreads = 1024;
constexpr int kListWarps = kListThreads / 32;
// The longest key span whose lists are built straight from the entries: 2^18 keys, a bitmap of
// 32 KiB and the words' ranks as much again (shared memory past the default 48 KiB: launch.h
// raises the limit once).
constexpr int kListBitmapBytes = 32 * 1024;
constexpr int kListSmemBytes = 2 * kListBitmapBytes;

__host__ __device__ int row_words(const KeyListExtent& e) { return (e.seqlen_k + 31) / 32; }

// Keys query row i may see: all of them, or up to its causal limit (none where it is negative).
__host__ __device__ int key_end(const KeyListExtent& e, int i) {
  return e.causal ? max(0, min(e.seqlen_k, i + e.diagonal + 1)) : e.seqlen_k;
}

// Whether a list is built straight from the entries: where its bitmap fits, and for tiles of
// several rows only with short lists. Each entry of such a tile sets its row's bit with an
// atomic OR in global memory; on an H200 (seed B1 H2/1 S16384 D32 causal, forward with the
// lists, bench CLI, against the bits below in an earlier run) top-256 took 0.215 ms against
// 0.262, but top-1024 0.526 against 0.406.
constexpr int kDirectMaxEntries = 256;
bool lists_direct(const KeyListExtent& e, int entries) {
  const bool one_row = e.seqlen_q == 1 || e.block_m == 1;
  return std::int64_t(row_words(e)) * 4 <= kListBitmapBytes && (one_row || entries <= kDirectMaxEntries);
}

// The longest row whose bits the bits pass sets in shared memory: 2^16 keys.
constexpr int kBitsSmemBytes = 8 * 1024;
bool bits_in_smem(const KeyListExtent& e) { return std::int64_t(row_words(e)) * 4 <= kBitsSmemBytes; }

template <bool kInSmem>
__global__ void __launch_bounds__(kBitsThreads) index_bits_kernel(const KeyListExtent e, const IndexRows in,
                                                                  std::uint32_t* bits) {
  const GridCoords c = unfold_block(GridShape{e.seqlen_q, e.heads, e.batches});
  const int words = row_words(e);
  std::uint32_t* row = bits + ((std::int64_t(c.z) * e.heads + c.y) * e.seqlen_q + c.x) * words;
  extern __shared__ std::uint32_t smem_row[];
  std::uint32_t* marks = kInSmem ? smem_row : row;
  for (int w = threadIdx.x; w < words; w += kBitsThreads) marks[w] = 0;
  __syncthreads();  // the zeroes land before any bit is set
  const std::int32_t* list = in.data + c.z * in.batch_stride + c.y * in.head_stride + c.x * in.row_stride;
  for (int t = threadIdx.x; t < in.entries; t += kBitsThreads) {
    const int key = list[t * in.entry_stride];
    if (key >= 0 && key < e.seqlen_k) atomicOr(&marks[key / 32], 1u << (key % 32));
  }
  if constexpr (kInSmem) {
    __syncthreads();
    for (int w = threadIdx.x; w < words; w += kBitsThreads) row[w] = marks[w];
  }
}

// The list of one query tile of a (head, batch): its keys ascending, each row's bits at them and
// its count, laid out as build_key_lists lays them out.
__global__ void __launch_bounds__(kListThreads) index_lists_kernel(const KeyListExtent e, const IndexRows in,
                                                                   int* keys_out, std::uint32_t* row_bits_out,
                                                                   int* counts) {
  extern __shared__ std::uint32_t bitmap[];  // [words] the marks, then [words] each word's rank
  __shared__ int warp_totals[kListWarps];
  const GridCoords c = unfold_block(GridShape{e.query_tiles(), e.heads, e.batches});
  let_next_grid_start();  // the forward, launched early, waits for this kernel to finish
  const std::int64_t list = (std::int64_t(c.z) * e.heads + c.y) * e.query_tiles() + c.x;
  const int m_begin = c.x * e.block_m, rows = min(e.block_m, e.seqlen_q - m_begin);
  // Keys past the last row's causal limit are seen by no row of the tile.
  const int words = (key_end(e, m_begin + rows - 1) + 31) / 32;
  int* rank = reinterpret_cast<int*>(bitmap + words);
  for (int w = threadIdx.x; w < words; w += kListThreads) bitmap[w] = 0;
  __syncthreads();
  // Entry t of row r (the rows' entries strided over the CTA): its key, or -1 where the row does
  // not keep it (padding, out of range, past the row's causal limit).
  const std::int32_t* entries = in.data + c.z * in.batch_stride + c.y * in.head_stride;
  auto entry_key = [&](int r, int t) {
    const int key = entries[std::int64_t(m_begin + r) * in.row_stride + std::int64_t(t) * in.entry_stride];
    return key >= 0 && key < key_end(e, m_begin + r) ? key : -1;
  };
  const std::int64_t marks = std::int64_t(rows) * in.entries;
  for (std::int64_t u = threadIdx.x; u < marks; u += kListThreads) {
    const int key = entry_key(static_cast<int>(u / in.entries), static_cast<int>(u % in.entries));
    if (key >= 0) atomicOr(&bitmap[key / 32], 1u << (key % 32));
  }
  __syncthreads();

  // Each thread compacts a run of consecutive words, so that a prefix sum of the runs' popcounts
  // over the threads places the keys in ascending order.
  const int per_thread = (words + kListThreads - 1) / kListThreads;
  const int w_begin = min(words, int(threadIdx.x) * per_thread), w_end = min(words, w_begin + per_thread);
  int n = 0;
  for (int w = w_begin; w < w_end; ++w) n += __popc(bitmap[w]);
  const CtaPrefix prefix = cta_exclusive_sum<kListWarps>(n, warp_totals);
  int at = prefix.before;
  const int total = prefix.total;
  int* keys = keys_out + list * e.capacity();
  for (int w = w_begin; w < w_end; ++w) {
    rank[w] = at;
    for (std::uint32_t m = bitmap[w]; m; m &= m - 1u) keys[at++] = w * 32 + __ffs(m) - 1;
  }
  if (threadIdx.x == 0) counts[list] = total;

  // Row r's bit of list position q lies in word q / 32 of the row's compacted bits, which chunks of
  // block_n positions keep for all block_m rows together. Positions past the count are never read
  // as kept (gathered_keys.h), so only the used words are written.
  std::uint32_t* row_bits = row_bits_out + list * e.row_bits_words();
  const int words_per_chunk_row = e.block_n / 32, used = (total + 31) / 32;
  auto row_word = [&](int r, int q) -> std::uint32_t& {
    return row_bits[(std::int64_t(q / words_per_chunk_row) * e.block_m + r) * words_per_chunk_row +
                    q % words_per_chunk_row];
  };
  if (rows == 1) {  // (one row keeps every listed key)
    for (int q = threadIdx.x; q < used; q += kListThreads) {
      const int left = total - q * 32;
      row_word(0, q) = left >= 32 ? ~0u : (1u << left) - 1u;
    }
    return;
  }
  for (std::int64_t u = threadIdx.x; u < std::int64_t(rows) * used; u += kListThreads) {
    row_word(static_cast<int>(u / used), static_cast<int>(u % used)) = 0;
  }
  __syncthreads();  // (the zeroes land before any bit is set: global memory, one CTA)
  for (std::int64_t u = threadIdx.x; u < marks; u += kListThreads) {
    const int r = static_cast<int>(u / in.entries), key = entry_key(r, static_cast<int>(u % in.entries));
    if (key < 0) continue;
    const int w = key / 32, position = rank[w] + __popc(bitmap[w] & ((1u << (key % 32)) - 1u));
    atomicOr(&row_word(r, position / 32), 1u << (position % 32));
  }
}

}  // namespace

std::size_t index_bits_bytes(const KeyListExtent& e, int entries) {
  if (lists_direct(e, entries)) return 0;
  return static_cast<std::size_t>(e.batches * e.heads * e.seqlen_q) * static_cast<std::size_t>(row_words(e)) *
         sizeof(std::uint32_t);
}

cudaError_t build_index_lists(const KeyListExtent& e, const IndexRows& in, void* bits_workspace, void* lists_memory,
                              cudaStream_t stream, TileSummary* summary, KeyLists* lists) {
  *summary = TileSummary{};
  // (build_key_lists's own bounds: the row bits are whole words per chunk row)
  if (e.block_m > kMaxListRows || e.block_n % 32 != 0) return cudaErrorInvalidValue;
  if (lists_direct(e, in.entries)) {
    *lists = describe_key_lists(e, lists_memory);
    if (e.lists() == 0) return cudaSuccess;
    // (describe_key_lists hands the kernels read-only views of the memory this launch fills)
    return launch_folded<kListSmemBytes>(&index_lists_kernel, GridShape{e.query_tiles(), e.heads, e.batches},
                                         kListThreads, stream, e, in, const_cast<int*>(lists->keys),
                                         const_cast<std::uint32_t*>(lists->row_bits),
                                         const_cast<int*>(lists->counts));
  }
  auto* bits = static_cast<std::uint32_t*>(bits_workspace);
  const int words = row_words(e);
  summary->col_stride = 1;  // a key per column: build_key_lists refuses a mask whose key dim broadcasts
  summary->head_divisor = e.head_divisor;
  summary->bits = bits;
  summary->bits_row_stride = words;
  summary->bits_head_stride = e.seqlen_q * std::int64_t(words);
  summary->bits_batch_stride = e.batches == 1 ? 0 : e.heads * e.seqlen_q * std::int64_t(words);
  summary->bits_row_words = words;
  if (e.batches * e.heads * e.seqlen_q > 0 && words > 0) {
    const GridShape grid{e.seqlen_q, e.heads, e.batches};
    const cudaError_t status =
        bits_in_smem(e) ? launch_folded<kBitsSmemBytes>(&index_bits_kernel<true>, grid, kBitsThreads, stream, e, in, bits)
                        : launch_folded<0>(&index_bits_kernel<false>, grid, kBitsThreads, stream, e, in, bits);
    if (status != cudaSuccess) return status;
  }
  return build_key_lists(e, *summary, lists_memory, stream, lists);
}

}  // namespace flash_dmattn::kernels
