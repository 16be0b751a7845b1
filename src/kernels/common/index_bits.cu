// Key indices to per-row key bits: one CTA per (query row, head, batch) of the bits. It zeroes its
// row's Sk bits, then sets one bit per valid entry with an atomic OR (entries of one row may name
// keys in one word). A row of bits is 8x smaller than the bool mask row it stands for.
#include "kernels/common/index_bits.h"

#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;

__host__ __device__ int row_words(const KeyListExtent& e) { return (e.seqlen_k + 31) / 32; }

__global__ void __launch_bounds__(kThreads) index_bits_kernel(const KeyListExtent e, const IndexRows in,
                                                              std::uint32_t* bits) {
  const GridCoords c = unfold_block(GridShape{e.seqlen_q, e.heads, e.batches});
  const int words = row_words(e);
  std::uint32_t* row = bits + ((std::int64_t(c.z) * e.heads + c.y) * e.seqlen_q + c.x) * words;
  for (int w = threadIdx.x; w < words; w += kThreads) row[w] = 0;
  __syncthreads();  // the zeroes land before any bit is set (global memory, one CTA)
  const std::int32_t* list = in.data + c.z * in.batch_stride + c.y * in.head_stride + c.x * in.row_stride;
  for (int t = threadIdx.x; t < in.entries; t += kThreads) {
    const int key = list[t * in.entry_stride];
    if (key >= 0 && key < e.seqlen_k) atomicOr(&row[key / 32], 1u << (key % 32));
  }
}

}  // namespace

std::size_t index_bits_bytes(const KeyListExtent& e) {
  return static_cast<std::size_t>(e.batches * e.heads * e.seqlen_q) * static_cast<std::size_t>(row_words(e)) *
         sizeof(std::uint32_t);
}

cudaError_t build_index_bits(const KeyListExtent& e, const IndexRows& in, void* workspace, cudaStream_t stream,
                             TileSummary* summary) {
  auto* bits = static_cast<std::uint32_t*>(workspace);
  const int words = row_words(e);
  *summary = TileSummary{};
  summary->col_stride = 1;  // a key per column: build_key_lists refuses a mask whose key dim broadcasts
  summary->head_divisor = e.head_divisor;
  summary->bits = bits;
  summary->bits_row_stride = words;
  summary->bits_head_stride = e.seqlen_q * std::int64_t(words);
  summary->bits_batch_stride = e.batches == 1 ? 0 : e.heads * e.seqlen_q * std::int64_t(words);
  summary->bits_row_words = words;
  if (e.batches * e.heads * e.seqlen_q == 0 || words == 0) return cudaSuccess;
  return launch_folded<0>(&index_bits_kernel, GridShape{e.seqlen_q, e.heads, e.batches}, kThreads, stream, e, in,
                          bits);
}

}  // namespace flash_dmattn::kernels
