// The key-list build: one CTA per list. In passes of a word a thread (256 or 512), each thread ORs
// one word over the tile's rows, a CTA-wide prefix sum of the words' popcounts places every set
// bit's key in the list, and then, 16 rows at a time, each thread compacts its word of each row
// against the OR and the CTA assembles the rows' compacted bits in shared memory before storing
// them. The seed's scatter workload (256 lists of 64 rows x 16k keys) took 106 us on an H100 one
// row at a time, a barrier each; 43 us on an H200 with 16 rows' loads issued together and the
// Compressor (docs/architecture.md, "The list build at latency's end").
#include "kernels/common/key_lists.h"

#include "kernels/common/cta_prefix_sum.h"
#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

// Threads of a list's CTA, a word of the mask's rows each per pass: 256, or 512 where the longest
// list passes 8192 keys (one pass where two would run one after the other: where lists are long,
// their CTAs are few, and the build waits on the longest).
constexpr int kListThreads = 256, kLongListThreads = 512;
constexpr int kGroupRows = 16;
constexpr int assembly_bytes(int threads) { return 2 * kGroupRows * (threads + 1) * 4; }

__host__ __device__ GridShape key_list_grid_shape(const KeyListExtent& e) { return {e.query_tiles(), e.heads, e.batches}; }

// Packs the bits of a word at the set bits of `mask` from bit 0 in ascending order (Hacker's
// Delight's compress, 7-4): its five shift masks depend on `mask` alone, so a word of the union
// computes them once and compacts each of its rows' words in 20 uniform operations, where a loop
// over the set bits diverges across the warp with the lanes' bit counts.
struct Compressor {
  std::uint32_t moves[5];
  __device__ __forceinline__ explicit Compressor(std::uint32_t mask) {
    std::uint32_t left = ~mask << 1;  // where a bit has zeros of the mask to its right
#pragma unroll
    for (int i = 0; i < 5; ++i) {
      std::uint32_t parity = left ^ (left << 1);
      parity ^= parity << 2;
      parity ^= parity << 4;
      parity ^= parity << 8;
      parity ^= parity << 16;
      moves[i] = parity & mask;
      mask = (mask ^ moves[i]) | (moves[i] >> (1 << i));
      left &= ~parity;
    }
  }
  // `v` must be a subset of the mask.
  __device__ __forceinline__ std::uint32_t operator()(std::uint32_t v) const {
#pragma unroll
    for (int i = 0; i < 5; ++i) {
      const std::uint32_t t = v & moves[i];
      v = (v ^ t) | (t >> (1 << i));
    }
    return v;
  }
};

struct ListOutput {
  int* keys;
  std::uint32_t* row_bits;
  int* counts;
  int* blocks;
  // The same lists' row bits and block counts in chunks of wider_words words a row (WiderChunks),
  // wider_row_bits_stride words a list; nullptr: none.
  std::uint32_t* wider_row_bits;
  int* wider_blocks;
  int wider_words;
  std::int64_t wider_row_bits_stride;
};

// Of a warp's 32 consecutive words (the first a multiple of 32), the blocks of `words_per_block`
// words (a divisor of 32, so that no block leaves the warp) that hold a set bit.
__device__ __forceinline__ int nonempty_blocks(std::uint32_t word, int words_per_block) {
  const std::uint32_t lanes = __ballot_sync(0xffffffffu, word != 0);
  std::uint32_t any = 0, firsts = 0;
  for (int s = 0; s < words_per_block; ++s) any |= lanes >> s;
  for (int lane = 0; lane < 32; lane += words_per_block) firsts |= 1u << lane;
  return __popc(any & firsts);
}

// 64 registers a thread, 1024 threads a SM (at 256 a CTA, 80 registers, the compiler's own choice,
// fit 3 CTAs).
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) key_lists_kernel(const KeyListExtent e,
                                                                             const TileSummary s,
                                                                             const ListOutput out,
                                                                             const ListGate gate) {
  constexpr int kWarps = kThreads / 32;
  const GridCoords c = unfold_block(key_list_grid_shape(e));
  wait_for_previous_grid();  // launched early: the summary (and estimate) before it
  let_next_grid_start();     // the choice or the forward, launched early, waits for this kernel to finish
  if (gate.estimate && !lists_may_pay(*gate.estimate, gate.share_permille, gate.sparse_permille)) return;
  if (gate.gather_chosen && *gate.gather_chosen == 0) return;
  const int m_begin = c.x * e.block_m, m_end = min(m_begin + e.block_m, e.seqlen_q);
  const std::int64_t list = (std::int64_t(c.z) * e.heads + c.y) * e.query_tiles() + c.x;
  const std::uint32_t* bits = s.bits + c.z * s.bits_batch_stride + c.y * s.bits_head_stride;
  int* keys = out.keys + list * e.capacity();
  std::uint32_t* row_bits = out.row_bits + list * e.row_bits_words();
  std::uint32_t* wider_row_bits = out.wider_row_bits ? out.wider_row_bits + list * out.wider_row_bits_stride : nullptr;
  const int words_per_chunk_row = e.block_n / 32;
  // Keys past the last row's causal limit are seen by no row of the tile; the summary did not
  // write their bits.
  const int key_end = e.span_keys(c.x);
  const int words = (key_end + 31) / 32;
  const int rows = m_end - m_begin;
  // Whether some row block of the tile sees a key of 64-key summary block b (its class): the OR
  // skips the words of the blocks that no row sees, most of a window's or a causal corner's.
  const std::uint8_t* classes = s.classes ? s.classes + c.z * s.batch_stride + c.y * s.head_stride : nullptr;
  const int row_block_begin = m_begin / kSummaryBlock, row_block_end = (m_end - 1) / kSummaryBlock + 1;
  auto block_seen = [&](int b) {
    if (!classes) return true;  // bits without classes: a key-indices build (index_bits.cu)
    std::uint8_t any = 0;
    for (int rb = row_block_begin; rb < row_block_end; ++rb) any |= classes[rb * s.row_stride + b * s.col_stride];
    return (any & kTileHasVisible) != 0;
  };
  // Word w (< words) of rows r0 .. r0 + kGroupRows - 1 (0 past the tile's rows), without the
  // bits past each row's own causal limit. A row loads the word only where it sees some key of
  // it: the summary leaves a row block's words past its last seen key unwritten, and a tile may
  // span row blocks. The loads issue together: where lists are long their CTAs are few, and each
  // waits on its own loads.
  const int first_limit = e.causal ? min(key_end, m_begin + e.diagonal + 1) : key_end;
  auto load_group = [&](int r0, int w, std::uint32_t(&v)[kGroupRows]) {
    const std::uint32_t* column = bits + std::int64_t(m_begin + r0) * s.bits_row_stride + w;
    const int seeing_from = e.causal ? w * 32 - (m_begin + r0 + e.diagonal) : 0;  // the first row that sees w
#pragma unroll
    for (int g = 0; g < kGroupRows; ++g) {
      v[g] = r0 + g < rows && g >= seeing_from ? column[g * s.bits_row_stride] : 0u;
    }
    if ((w + 1) * 32 <= first_limit) return;  // every row of the tile may see all of the word
#pragma unroll
    for (int g = 0; g < kGroupRows; ++g) {
      const int limit = e.causal ? min(key_end, m_begin + r0 + g + e.diagonal + 1) : key_end;
      const int valid = limit - w * 32;
      v[g] = valid <= 0 ? 0u : valid < 32 ? v[g] & ((1u << valid) - 1u) : v[g];
    }
  };

  // The row bits are stored chunk by chunk, a chunk's rows one after another: its words of the
  // rows of a group are contiguous, and consecutive threads store consecutive words. With wider
  // chunks the stores walk the wider layout and write each word to both.
  const int narrow_shift = __ffs(words_per_chunk_row) - 1;  // words a chunk row: a power of two
  const int store_words = wider_row_bits ? out.wider_words : words_per_chunk_row;
  const int store_shift = __ffs(store_words) - 1;
  constexpr int kGroupShift = 4;
  static_assert(kGroupRows == 1 << kGroupShift);

  __shared__ int warp_totals[kWarps];
  __shared__ int blocks, wider_blocks;
  // A pass's compacted bits (at most 32 x kThreads positions, starting anywhere in a word) of a
  // group of kGroupRows rows, two groups alternating: one barrier per group separates filling
  // from storing, and the rows of a group load their words independently of each other.
  extern __shared__ std::uint32_t dynamic_smem[];
  auto* assembly = reinterpret_cast<std::uint32_t(*)[kGroupRows][kThreads + 1]>(dynamic_smem);
  // Per row, the stored value of the word a pass ended inside, which the next pass completes;
  // read from one array and written to the other within a pass.
  __shared__ std::uint32_t carry[2][kMaxListRows];
  for (int t = threadIdx.x; t < 2 * kGroupRows * (kThreads + 1); t += kThreads) (&assembly[0][0][0])[t] = 0;
  for (int r = threadIdx.x; r < kMaxListRows; r += kThreads) carry[0][r] = 0;
  int carry_in = 0;
  if (threadIdx.x == 0) blocks = wider_blocks = 0;
  __syncthreads();

  int total = 0;
  for (int base = 0; base < words; base += kThreads) {
    const int w = base + threadIdx.x;
    std::uint32_t word = 0;
    if (w < words && block_seen(w * 32 / kSummaryBlock)) {
      for (int r0 = 0; r0 < rows; r0 += kGroupRows) {
        std::uint32_t v[kGroupRows];
        load_group(r0, w, v);
#pragma unroll
        for (int g = 0; g < kGroupRows; ++g) word |= v[g];
      }
    }
    const int n = __popc(word);
    // A pass's words hold whole blocks, and so do a warp's 32 (block_n / 32 divides 32).
    const int warp_blocks = nonempty_blocks(word, words_per_chunk_row);
    if (threadIdx.x % 32 == 0 && warp_blocks > 0) atomicAdd(&blocks, warp_blocks);
    if (out.wider_row_bits) {
      const int wider = nonempty_blocks(word, out.wider_words);
      if (threadIdx.x % 32 == 0 && wider > 0) atomicAdd(&wider_blocks, wider);
    }
    const CtaPrefix prefix = cta_exclusive_sum<kWarps>(n, warp_totals);
    const int pass_total = prefix.total;
    const int first = total + prefix.before;  // this word's first position in the list
    int at = first;
    for (std::uint32_t m = word; m; m &= m - 1u) keys[at++] = w * 32 + __ffs(m) - 1;

    if (pass_total > 0) {
      const int first_word = total / 32, stored_words = (total + pass_total - 1) / 32 - first_word + 1;
      const int offset = first - first_word * 32, shift = offset % 32;
      const Compressor compress(word);
      // The stored words as (chunk, row of the group, word of the chunk row) from the chunk
      // holding the first one, rows padded to kGroupRows.
      const int first_chunk = first_word >> store_shift;
      const int slots = (((first_word + stored_words - 1) >> store_shift) - first_chunk + 1)
                        << (kGroupShift + store_shift);
      for (int r0 = 0, group = 0; r0 < rows; r0 += kGroupRows, group ^= 1) {
        const int group_rows = min(kGroupRows, rows - r0);
        auto& buffer = assembly[group];
        if (n > 0) {
          std::uint32_t v[kGroupRows];
          load_group(r0, w, v);
#pragma unroll
          for (int g = 0; g < kGroupRows; ++g) {
            const std::uint32_t compacted = compress(v[g]);
            if (compacted == 0) continue;
            atomicOr(&buffer[g][offset / 32], compacted << shift);
            if (shift + n > 32) atomicOr(&buffer[g][offset / 32 + 1], compacted >> (32 - shift));
          }
        }
        __syncthreads();
        for (int t = threadIdx.x; t < slots; t += kThreads) {
          const int g = (t >> store_shift) & (kGroupRows - 1), r = r0 + g;
          const int q = ((first_chunk + (t >> (kGroupShift + store_shift))) << store_shift) + (t & (store_words - 1));
          const int u = q - first_word;  // the word's place in this pass's compacted bits
          if (g >= group_rows || u < 0 || u >= stored_words) continue;
          std::uint32_t value = buffer[g][u];
          buffer[g][u] = 0;
          if (u == 0) value |= carry[carry_in][r];
          if (u == stored_words - 1) carry[carry_in ^ 1][r] = (total + pass_total) % 32 ? value : 0;
          row_bits[(std::int64_t(q >> narrow_shift) * e.block_m + r) * words_per_chunk_row +
                   (q & (words_per_chunk_row - 1))] = value;
          if (wider_row_bits) {  // the same bit stream, grouped into wider chunks
            wider_row_bits[(std::int64_t(q >> store_shift) * e.block_m + r) * store_words + (q & (store_words - 1))] =
                value;
          }
        }
      }
      carry_in ^= 1;
    }
    total += pass_total;
    __syncthreads();  // warp_totals, the buffers and the carries are ready for the next pass
  }
  if (threadIdx.x == 0) {
    out.counts[list] = total;
    out.blocks[list] = blocks;  // every pass ended with a barrier after its additions
    if (out.wider_row_bits) out.wider_blocks[list] = wider_blocks;
  }
}

constexpr int kEstimateWarps = 8;

// A warp per list: its lanes walk the list's 64-key summary blocks, then its blocks of block_n
// keys, reading the classes of the tile's row blocks, and one lane adds the list's bounds.
__global__ void __launch_bounds__(kEstimateWarps * 32) estimate_kernel(const KeyListExtent e, const TileSummary s,
                                                                      ListEstimate* estimate) {
  let_next_grid_start();  // the list build, launched early, waits for this kernel to finish
  const std::int64_t list = std::int64_t(blockIdx.x) * kEstimateWarps + threadIdx.x / 32;
  if (list >= e.lists()) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t tiles = e.query_tiles();
  const int tile = static_cast<int>(list % tiles), head = static_cast<int>(list / tiles % e.heads);
  const int batch = static_cast<int>(list / tiles / e.heads);
  const int m_begin = tile * e.block_m, m_end = min(m_begin + e.block_m, e.seqlen_q);
  const int key_end = e.span_keys(tile);  // keys past the last row's limit
  int seen_by_all = e.seqlen_k;            // keys up to the first row's
  if (e.causal) seen_by_all = max(0, min(seen_by_all, m_begin + e.diagonal + 1));
  const std::uint8_t* classes = s.classes + batch * s.batch_stride + head * s.head_stride;
  const int row_block_begin = m_begin / kSummaryBlock, row_block_end = (m_end - 1) / kSummaryBlock + 1;
  // Block c of 64 keys: whether some row block sees a key of it (visible), and whether some row
  // block sees all of it and every row of the tile may (full).
  auto flags = [&](int c, bool* visible, bool* full) {
    std::uint8_t any = 0;
    bool whole = false;
    for (int rb = row_block_begin; rb < row_block_end; ++rb) {
      const std::uint8_t k = classes[rb * s.row_stride + c * s.col_stride];
      any |= k;
      whole |= k == kTileHasVisible;
    }
    *visible = (any & kTileHasVisible) && c * kSummaryBlock < key_end;
    *full = whole && (c + 1) * kSummaryBlock <= seen_by_all;
  };
  // A visible block that every row of the tile may see in whole (left of the first row's causal
  // limit) holds at least one listed key: its visible class comes from a row of the tile where
  // the tile holds whole row blocks. A sliding window's first block is such a one.
  const bool whole_row_blocks = e.block_m % kSummaryBlock == 0;
  unsigned long long full_blocks = 0, partial_keys = 0, visible_lo = 0, visible_hi = 0;
  const int summary_blocks = (key_end + kSummaryBlock - 1) / kSummaryBlock;
  for (int c = lane; c < summary_blocks; c += 32) {
    bool visible, full;
    flags(c, &visible, &full);
    full_blocks += full;
    partial_keys += visible && !full && whole_row_blocks && (c + 1) * kSummaryBlock <= seen_by_all;
  }
  // A chunk of block_n keys covers summary blocks [first, last]: one or several (block_n >= 64),
  // or part of one (block_n = 32).
  const int chunks = (key_end + e.block_n - 1) / e.block_n;
  for (int n = lane; n < chunks; n += 32) {
    const int first = n * e.block_n / kSummaryBlock, last = ((n + 1) * e.block_n - 1) / kSummaryBlock;
    bool any_visible = false, any_full = false;
    for (int c = first; c <= last && c < summary_blocks; ++c) {
      bool visible, full;
      flags(c, &visible, &full);
      any_visible |= visible;
      any_full |= full;
    }
    visible_hi += any_visible;
    visible_lo += any_full;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    full_blocks += __shfl_xor_sync(0xffffffffu, full_blocks, offset);
    partial_keys += __shfl_xor_sync(0xffffffffu, partial_keys, offset);
    visible_lo += __shfl_xor_sync(0xffffffffu, visible_lo, offset);
    visible_hi += __shfl_xor_sync(0xffffffffu, visible_hi, offset);
  }
  if (lane == 0) {
    const unsigned long long listed_keys = full_blocks * kSummaryBlock + partial_keys;
    atomicAdd(&estimate->listed_at_least, (listed_keys + e.block_n - 1) / e.block_n);
    atomicAdd(&estimate->visible_at_least, visible_lo);
    atomicAdd(&estimate->visible_at_most, visible_hi);
    atomicAdd(&estimate->span, static_cast<unsigned long long>(chunks));
  }
}

constexpr int kChoiceThreads = 512;

// One CTA: its threads sum the lists' sizes as listed_work does, thread 0 applies lists_pay.
__global__ void __launch_bounds__(kChoiceThreads) choice_kernel(const KeyListExtent e, const int* counts,
                                                                const ListGate gate, double share, double sparse_share,
                                                                int* gather_chosen) {
  wait_for_previous_grid();  // launched early: the lists before it
  let_next_grid_start();     // the forward, launched early, waits for this kernel to finish
  // Where the estimate rules the gather path out, the gated build wrote no sizes.
  if (gate.estimate && !lists_may_pay(*gate.estimate, gate.share_permille, gate.sparse_permille)) {
    if (threadIdx.x == 0) *gather_chosen = 0;
    return;
  }
  const std::int64_t n = e.lists();
  long long sums[3] = {0, 0, 0};  // listed chunks, visible blocks, span
  for (std::int64_t list = threadIdx.x; list < n; list += kChoiceThreads) {
    sums[0] += e.chunks(counts[list]);
    sums[1] += counts[n + list];  // KeyLists::blocks follow the counts
    sums[2] += e.chunks(e.span_keys(list % e.query_tiles()));
  }
  __shared__ long long warp_sums[kChoiceThreads / 32][3];
  for (int k = 0; k < 3; ++k) {
    for (int offset = 16; offset > 0; offset /= 2) sums[k] += __shfl_xor_sync(0xffffffffu, sums[k], offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32][k] = sums[k];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int k = 0; k < 3; ++k) {
    sums[k] = 0;
    for (int w = 0; w < kChoiceThreads / 32; ++w) sums[k] += warp_sums[w][k];
  }
  *gather_chosen = lists_pay(sums[0], sums[1], sums[2], share, sparse_share) ? 1 : 0;
}

}  // namespace

cudaError_t choose_gather_path(const KeyListExtent& e, const KeyLists& lists, const ListGate& gate, double share,
                               double sparse_share, int* gather_chosen, cudaStream_t stream) {
  return launch_folded<0>(&choice_kernel, GridShape{1, 1, 1}, kChoiceThreads, stream, StreamOrder::early, e,
                          lists.counts, gate, share, sparse_share, gather_chosen);
}

cudaError_t estimate_key_lists(const KeyListExtent& e, const TileSummary& summary, ListEstimate* estimate,
                               cudaStream_t stream) {
  cudaError_t error = cudaMemsetAsync(estimate, 0, sizeof(ListEstimate), stream);
  const std::int64_t ctas = (e.lists() + kEstimateWarps - 1) / kEstimateWarps;
  if (error != cudaSuccess || ctas == 0) return error;
  return launch_folded<0>(&estimate_kernel, GridShape{ctas, 1, 1}, kEstimateWarps * 32, stream, e, summary, estimate);
}

std::size_t key_list_counts_offset(const KeyListExtent& e) {
  const std::size_t lists = static_cast<std::size_t>(e.lists());
  return lists * (static_cast<std::size_t>(e.capacity()) * sizeof(int) +
                  static_cast<std::size_t>(e.row_bits_words()) * sizeof(std::uint32_t));
}

std::size_t key_lists_bytes(const KeyListExtent& e) {
  return key_list_counts_offset(e) + static_cast<std::size_t>(e.lists()) * 2 * sizeof(int);
}

KeyLists describe_key_lists(const KeyListExtent& e, void* memory) {
  const std::int64_t n = e.lists();
  KeyLists lists;
  lists.keys = static_cast<const int*>(memory);
  lists.row_bits = reinterpret_cast<const std::uint32_t*>(lists.keys + n * e.capacity());
  lists.counts = reinterpret_cast<const int*>(lists.row_bits + n * e.row_bits_words());
  lists.blocks = lists.counts + n;
  lists.row_bits_stride = e.row_bits_words();
  lists.head_stride = e.query_tiles();
  lists.batch_stride = e.batches == 1 ? 0 : e.heads * e.query_tiles();
  lists.head_divisor = e.head_divisor;
  lists.capacity = e.capacity();
  lists.block_m = e.block_m;
  lists.block_n = e.block_n;
  return lists;
}

std::size_t wider_lists_bytes(const KeyListExtent& e, int block_n) {
  KeyListExtent wider = e;
  wider.block_n = block_n;
  return static_cast<std::size_t>(e.lists()) *
         (static_cast<std::size_t>(wider.row_bits_words()) * sizeof(std::uint32_t) + sizeof(int));
}

KeyLists describe_wider_key_lists(const KeyListExtent& e, void* memory, int block_n, void* wider_memory) {
  KeyListExtent wider = e;
  wider.block_n = block_n;
  KeyLists lists = describe_key_lists(e, memory);  // the keys and counts
  lists.row_bits = static_cast<const std::uint32_t*>(wider_memory);
  lists.blocks = reinterpret_cast<const int*>(lists.row_bits + e.lists() * wider.row_bits_words());
  lists.row_bits_stride = wider.row_bits_words();
  lists.block_n = block_n;
  return lists;
}

cudaError_t build_key_lists(const KeyListExtent& e, const TileSummary& summary, void* workspace, cudaStream_t stream,
                            KeyLists* lists, const ListGate& gate, const WiderChunks& wider) {
  // A mask that broadcasts over queries or keys has no per-row choice of keys to list. (With no
  // keys at all, the summary's rows are 0 words long and their stride 0: every list is empty.)
  if ((summary.bits_row_stride == 0 && e.seqlen_q > 1 && e.seqlen_k > 0) ||
      (summary.col_stride == 0 && e.seqlen_k > 1) || e.block_m > kMaxListRows || e.block_n % 32 != 0 ||
      32 % (e.block_n / 32) != 0) {
    return cudaErrorInvalidValue;
  }
  if (wider.memory && !wider_chunks_fit(e, wider.block_n)) return cudaErrorInvalidValue;
  *lists = describe_key_lists(e, workspace);
  const std::int64_t n = e.lists();
  ListOutput out;
  out.keys = static_cast<int*>(workspace);
  out.row_bits = reinterpret_cast<std::uint32_t*>(out.keys + n * e.capacity());
  out.counts = reinterpret_cast<int*>(out.row_bits + n * e.row_bits_words());
  out.blocks = out.counts + n;
  out.wider_row_bits = nullptr;
  out.wider_blocks = nullptr;
  out.wider_words = 0;
  out.wider_row_bits_stride = 0;
  if (wider.memory) {
    const KeyLists w = describe_wider_key_lists(e, workspace, wider.block_n, wider.memory);
    out.wider_row_bits = const_cast<std::uint32_t*>(w.row_bits);
    out.wider_blocks = const_cast<int*>(w.blocks);
    out.wider_words = wider.block_n / 32;
    out.wider_row_bits_stride = w.row_bits_stride;
  }
  if (n == 0) return cudaSuccess;
  const int longest_list = e.span_keys(e.query_tiles() - 1);  // the span grows with the tile
  if (longest_list > 32 * kListThreads) {
    return launch_folded<assembly_bytes(kLongListThreads)>(&key_lists_kernel<kLongListThreads>, key_list_grid_shape(e),
                                                           kLongListThreads, stream, StreamOrder::early, e, summary,
                                                           out, gate);
  }
  return launch_folded<assembly_bytes(kListThreads)>(&key_lists_kernel<kListThreads>, key_list_grid_shape(e),
                                                     kListThreads, stream, StreamOrder::early, e, summary, out,
                                                     gate);
}

}  // namespace flash_dmattn::kernels
