// The key-list build: one CTA per list, each thread ORing one 32-key word over the tile's rows,
// then a CTA-wide prefix sum of the words' popcounts that places every set bit's key.
#include "kernels/common/key_lists.h"

#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

__host__ __device__ GridShape key_list_grid_shape(const KeyListExtent& e) { return {e.query_tiles(), e.heads, e.batches}; }

__global__ void __launch_bounds__(kThreads) key_lists_kernel(const KeyListExtent e, const TileSummary s, int* keys,
                                                             int* counts) {
  const GridCoords c = unfold_block(key_list_grid_shape(e));
  const int m_begin = c.x * e.block_m, m_end = min(m_begin + e.block_m, e.seqlen_q);
  const std::int64_t list = (std::int64_t(c.z) * e.heads + c.y) * e.query_tiles() + c.x;
  const std::uint32_t* bits = s.bits + c.z * s.bits_batch_stride + c.y * s.bits_head_stride;
  int* out = keys + list * e.seqlen_k;
  // Keys past the last row's causal limit are seen by no row of the tile; the summary did not
  // write their bits.
  int key_end = e.seqlen_k;
  if (e.causal) key_end = max(0, min(key_end, m_end - 1 + e.diagonal + 1));
  const int words = (key_end + 31) / 32;
  // A mask with query dim 1 has one row for every query: read it once, up to key_end.
  const bool shared_row = s.bits_row_stride == 0;
  const int rows = shared_row ? 1 : m_end - m_begin;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ int warp_totals[kWarps];
  int total = 0;
  for (int base = 0; base < words; base += kThreads) {
    const int w = base + threadIdx.x;
    std::uint32_t word = 0;
    if (w < words) {
      for (int r = 0; r < rows; ++r) {
        const int i = m_begin + r;
        // Keys [0, limit) are the ones row i may see; the bits past a row's own causal limit
        // may be unwritten.
        const int limit = shared_row || !e.causal ? key_end : min(key_end, i + e.diagonal + 1);
        const int valid = limit - w * 32;
        if (valid <= 0) continue;
        std::uint32_t v = bits[std::int64_t(i) * s.bits_row_stride + w];
        if (valid < 32) v &= (1u << valid) - 1u;
        word |= v;
      }
    }
    const int n = __popc(word);
    int inclusive = n;
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += up;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    int before = 0, chunk_total = 0;
    for (int k = 0; k < kWarps; ++k) {
      before += k < warp ? warp_totals[k] : 0;
      chunk_total += warp_totals[k];
    }
    int at = total + before + inclusive - n;
    for (; word; word &= word - 1u) out[at++] = w * 32 + __ffs(word) - 1;
    total += chunk_total;
    __syncthreads();  // every warp has read warp_totals before the next chunk writes them
  }
  if (threadIdx.x == 0) counts[list] = total;
}

}  // namespace

std::size_t key_lists_bytes(const KeyListExtent& e) {
  const std::size_t lists = static_cast<std::size_t>(e.lists());
  if (lists == 0) return 0;
  return align_up(lists * sizeof(int)) + lists * static_cast<std::size_t>(e.seqlen_k) * sizeof(int);
}

cudaError_t build_key_lists(const KeyListExtent& e, const TileSummary& summary, void* workspace, cudaStream_t stream,
                            KeyLists* lists) {
  int* counts = static_cast<int*>(workspace);
  int* keys = reinterpret_cast<int*>(static_cast<char*>(workspace) + align_up(e.lists() * sizeof(int)));
  lists->keys = keys;
  lists->counts = counts;
  lists->head_stride = e.query_tiles();
  lists->batch_stride = e.batches == 1 ? 0 : e.heads * e.query_tiles();
  lists->head_divisor = e.head_divisor;
  lists->block_m = e.block_m;
  lists->capacity = e.seqlen_k;
  if (e.lists() == 0) return cudaSuccess;
  return launch_folded<0>(&key_lists_kernel, key_list_grid_shape(e), kThreads, stream, e, summary, keys, counts);
}

}  // namespace flash_dmattn::kernels
