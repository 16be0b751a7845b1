// The key-list build: one CTA per list. In passes of 256 mask words (8192 keys), each thread ORs
// one word over the tile's rows, a CTA-wide prefix sum of the words' popcounts places every set
// bit's key in the list, and then, 16 rows at a time, each thread compacts its word of each row
// against the OR and the CTA assembles the rows' compacted bits in shared memory before storing
// them. Measured on an H100 (seed scatter workload, 256 lists of 64 rows x 16k keys): one row at a
// time, a barrier each, took 106 us.
#include "kernels/common/key_lists.h"

#include "kernels/common/cta_prefix_sum.h"
#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroupRows = 16;

__host__ __device__ GridShape key_list_grid_shape(const KeyListExtent& e) { return {e.query_tiles(), e.heads, e.batches}; }

// The bits of `v` at the set bits of `u`, packed from bit 0 in ascending order (v is a subset of u).
__device__ __forceinline__ std::uint32_t compact_bits(std::uint32_t v, std::uint32_t u) {
  if (u == ~0u || v == 0) return v;
  std::uint32_t out = 0;
  int k = 0;
  for (std::uint32_t m = u; m; m &= m - 1u, ++k) out |= ((v >> (__ffs(m) - 1)) & 1u) << k;
  return out;
}

struct ListOutput {
  int* keys;
  std::uint32_t* row_bits;
  int* counts;
  int* blocks;
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

__global__ void __launch_bounds__(kThreads) key_lists_kernel(const KeyListExtent e, const TileSummary s,
                                                             const ListOutput out) {
  const GridCoords c = unfold_block(key_list_grid_shape(e));
  let_next_grid_start();  // the forward, launched early, waits for this kernel to finish
  const int m_begin = c.x * e.block_m, m_end = min(m_begin + e.block_m, e.seqlen_q);
  const std::int64_t list = (std::int64_t(c.z) * e.heads + c.y) * e.query_tiles() + c.x;
  const std::uint32_t* bits = s.bits + c.z * s.bits_batch_stride + c.y * s.bits_head_stride;
  int* keys = out.keys + list * e.capacity();
  std::uint32_t* row_bits = out.row_bits + list * e.row_bits_words();
  const int words_per_chunk_row = e.block_n / 32;
  // Keys past the last row's causal limit are seen by no row of the tile; the summary did not
  // write their bits.
  int key_end = e.seqlen_k;
  if (e.causal) key_end = max(0, min(key_end, m_end - 1 + e.diagonal + 1));
  const int words = (key_end + 31) / 32;
  const int rows = m_end - m_begin;
  // Word w of row r, without the bits past the row's own causal limit (they may be unwritten).
  auto row_word = [&](int r, int w) -> std::uint32_t {
    const int i = m_begin + r;
    const int limit = e.causal ? min(key_end, i + e.diagonal + 1) : key_end;
    const int valid = limit - w * 32;
    if (w >= words || valid <= 0) return 0;
    const std::uint32_t v = bits[std::int64_t(i) * s.bits_row_stride + w];
    return valid < 32 ? v & ((1u << valid) - 1u) : v;
  };

  __shared__ int warp_totals[kWarps];
  __shared__ int blocks;
  // A pass's compacted bits (at most 8192 positions, starting anywhere in a word) of a group of
  // kGroupRows rows, two groups alternating: one barrier per group separates filling from storing,
  // and the rows of a group load their words independently of each other.
  __shared__ std::uint32_t assembly[2][kGroupRows][kThreads + 1];
  // Per row, the stored value of the word a pass ended inside, which the next pass completes;
  // read from one array and written to the other within a pass.
  __shared__ std::uint32_t carry[2][kMaxListRows];
  for (int t = threadIdx.x; t < 2 * kGroupRows * (kThreads + 1); t += kThreads) (&assembly[0][0][0])[t] = 0;
  for (int r = threadIdx.x; r < kMaxListRows; r += kThreads) carry[0][r] = 0;
  int carry_in = 0;
  if (threadIdx.x == 0) blocks = 0;
  __syncthreads();

  int total = 0;
  for (int base = 0; base < words; base += kThreads) {
    const int w = base + threadIdx.x;
    std::uint32_t word = 0;
#pragma unroll 8
    for (int r = 0; r < rows; ++r) word |= row_word(r, w);
    const int n = __popc(word);
    // A pass's 256 words hold whole blocks, and so do a warp's 32 (block_n / 32 divides 32).
    const int warp_blocks = nonempty_blocks(word, words_per_chunk_row);
    if (threadIdx.x % 32 == 0 && warp_blocks > 0) atomicAdd(&blocks, warp_blocks);
    const CtaPrefix prefix = cta_exclusive_sum<kWarps>(n, warp_totals);
    const int pass_total = prefix.total;
    const int first = total + prefix.before;  // this word's first position in the list
    int at = first;
    for (std::uint32_t m = word; m; m &= m - 1u) keys[at++] = w * 32 + __ffs(m) - 1;

    if (pass_total > 0) {
      const int first_word = total / 32, stored_words = (total + pass_total - 1) / 32 - first_word + 1;
      const int offset = first - first_word * 32, shift = offset % 32;
      for (int r0 = 0, group = 0; r0 < rows; r0 += kGroupRows, group ^= 1) {
        const int group_rows = min(kGroupRows, rows - r0);
        auto& buffer = assembly[group];
        if (n > 0) {
#pragma unroll 4
          for (int g = 0; g < group_rows; ++g) {
            const std::uint32_t compacted = compact_bits(row_word(r0 + g, w), word);
            if (compacted == 0) continue;
            atomicOr(&buffer[g][offset / 32], compacted << shift);
            if (shift + n > 32) atomicOr(&buffer[g][offset / 32 + 1], compacted >> (32 - shift));
          }
        }
        __syncthreads();
        for (int t = threadIdx.x; t < group_rows * stored_words; t += kThreads) {
          const int g = t / stored_words, u = t % stored_words, r = r0 + g;
          std::uint32_t value = buffer[g][u];
          buffer[g][u] = 0;
          if (u == 0) value |= carry[carry_in][r];
          if (u == stored_words - 1) carry[carry_in ^ 1][r] = (total + pass_total) % 32 ? value : 0;
          const int q = first_word + u;  // the word's place in the row's compacted bits
          row_bits[(std::int64_t(q / words_per_chunk_row) * e.block_m + r) * words_per_chunk_row +
                   q % words_per_chunk_row] = value;
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
  }
}

}  // namespace

std::size_t key_lists_bytes(const KeyListExtent& e) {
  const std::size_t lists = static_cast<std::size_t>(e.lists());
  return lists * (static_cast<std::size_t>(e.capacity()) * sizeof(int) +
                  static_cast<std::size_t>(e.row_bits_words()) * sizeof(std::uint32_t) + 2 * sizeof(int));
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

cudaError_t build_key_lists(const KeyListExtent& e, const TileSummary& summary, void* workspace, cudaStream_t stream,
                            KeyLists* lists) {
  // A mask that broadcasts over queries or keys has no per-row choice of keys to list. (With no
  // keys at all, the summary's rows are 0 words long and their stride 0: every list is empty.)
  if ((summary.bits_row_stride == 0 && e.seqlen_q > 1 && e.seqlen_k > 0) ||
      (summary.col_stride == 0 && e.seqlen_k > 1) || e.block_m > kMaxListRows || e.block_n % 32 != 0 ||
      32 % (e.block_n / 32) != 0) {
    return cudaErrorInvalidValue;
  }
  *lists = describe_key_lists(e, workspace);
  const std::int64_t n = e.lists();
  ListOutput out;
  out.keys = static_cast<int*>(workspace);
  out.row_bits = reinterpret_cast<std::uint32_t*>(out.keys + n * e.capacity());
  out.counts = reinterpret_cast<int*>(out.row_bits + n * e.row_bits_words());
  out.blocks = out.counts + n;
  if (n == 0) return cudaSuccess;
  return launch_folded<0>(&key_lists_kernel, key_list_grid_shape(e), kThreads, stream, e, summary, out);
}

}  // namespace flash_dmattn::kernels
