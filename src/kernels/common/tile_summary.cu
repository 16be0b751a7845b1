// One CTA per kSummaryBlock x kSummaryBlock block of the mask: OR of "some key visible" and "some
// key hidden" over the block's elements inside the mask, one byte out; and the block's elements
// as bits, gathered in shared memory and written as whole words.
#include "kernels/common/tile_summary.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kBlockWords = kSummaryBlock / 32;

std::int64_t blocks_of(std::int64_t n) { return (n + kSummaryBlock - 1) / kSummaryBlock; }
__host__ __device__ std::int64_t words_of(std::int64_t cols) { return (cols + 31) / 32; }
std::size_t classes_bytes(const MaskExtent& mask) {
  return static_cast<std::size_t>(mask.batches * mask.heads * blocks_of(mask.rows) * blocks_of(mask.cols));
}
// The bits start 16-byte aligned after the classes.
std::size_t bits_offset(const MaskExtent& mask) { return (classes_bytes(mask) + 15) / 16 * 16; }

__global__ void __launch_bounds__(kThreads) tile_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                 std::uint32_t* bits_out) {
  __shared__ std::uint32_t words[kSummaryBlock][kBlockWords];
  for (int i = threadIdx.x; i < kSummaryBlock * kBlockWords; i += kThreads) words[i / kBlockWords][i % kBlockWords] = 0;
  __syncthreads();
  const std::int64_t col_blocks = gridDim.x, row_blocks = gridDim.y;
  const std::int64_t bh = blockIdx.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::int64_t r0 = std::int64_t(blockIdx.y) * kSummaryBlock, c0 = std::int64_t(blockIdx.x) * kSummaryBlock;
  const int rows = static_cast<int>(mask.rows - r0 < kSummaryBlock ? mask.rows - r0 : kSummaryBlock);
  const int cols = static_cast<int>(mask.cols - c0 < kSummaryBlock ? mask.cols - c0 : kSummaryBlock);
  const std::uint8_t* base =
      mask.ptr + b * mask.batch_stride + h * mask.head_stride + r0 * mask.row_stride + c0 * mask.col_stride;

  bool any_visible = false, any_hidden = false;
  // A full block of 16-byte-aligned rows is read as one uint4 per thread (64 rows x 4 vectors).
  const bool vectorized = cols == kSummaryBlock && mask.col_stride == 1 && mask.row_stride % 16 == 0 &&
                          reinterpret_cast<std::uintptr_t>(base) % 16 == 0;
  if (vectorized) {
    const int row = threadIdx.x / 4, vec = threadIdx.x % 4;
    if (row < rows) {
      const uint4 v = *reinterpret_cast<const uint4*>(base + row * mask.row_stride + vec * 16);
      std::uint32_t keep_bits = 0;  // bit i: byte i of the 16
      int i = 0;
      for (const std::uint32_t word : {v.x, v.y, v.z, v.w}) {
        // A byte is zero iff its bit pattern has no set bit: test the four bytes of the word.
        for (int byte = 0; byte < 4; ++byte, ++i) keep_bits |= std::uint32_t(((word >> (8 * byte)) & 0xffu) != 0) << i;
      }
      any_visible = keep_bits != 0;
      any_hidden = keep_bits != 0xffffu;
      atomicOr(&words[row][vec / 2], keep_bits << (16 * (vec % 2)));
    }
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += kThreads) {
      const int row = e / cols, col = e % cols;
      const bool keep = base[row * mask.row_stride + col * mask.col_stride] != 0;
      any_visible |= keep;
      any_hidden |= !keep;
      if (keep) atomicOr(&words[row][col / 32], 1u << (col % 32));
    }
  }
  any_visible = __syncthreads_or(any_visible);
  any_hidden = __syncthreads_or(any_hidden);
  if (threadIdx.x == 0) {
    out[(bh * row_blocks + blockIdx.y) * col_blocks + blockIdx.x] =
        (any_visible ? kTileHasVisible : 0) | (any_hidden ? kTileHasHidden : 0);
  }
  const int block_words = static_cast<int>(words_of(cols));
  const std::int64_t row_words = words_of(mask.cols);
  for (int i = threadIdx.x; i < rows * block_words; i += kThreads) {
    const int row = i / block_words, w = i % block_words;
    bits_out[(bh * mask.rows + r0 + row) * row_words + c0 / 32 + w] = words[row][w];
  }
}

}  // namespace

std::size_t tile_summary_bytes(const MaskExtent& mask) {
  const std::int64_t bit_words = mask.batches * mask.heads * mask.rows * words_of(mask.cols);
  return bit_words == 0 ? 0 : bits_offset(mask) + static_cast<std::size_t>(bit_words) * sizeof(std::uint32_t);
}

cudaError_t build_tile_summary(const MaskExtent& mask, void* workspace, cudaStream_t stream, TileSummary* summary) {
  const std::int64_t row_blocks = blocks_of(mask.rows), col_blocks = blocks_of(mask.cols);
  auto* out = static_cast<std::uint8_t*>(workspace);
  summary->classes = out;
  summary->batch_stride = mask.batches == 1 ? 0 : mask.heads * row_blocks * col_blocks;
  summary->head_stride = row_blocks * col_blocks;
  summary->row_stride = mask.rows == 1 ? 0 : col_blocks;
  summary->col_stride = mask.cols == 1 ? 0 : 1;
  summary->head_divisor = mask.head_divisor;
  const std::int64_t row_words = words_of(mask.cols);
  auto* bits = reinterpret_cast<std::uint32_t*>(out + bits_offset(mask));
  summary->bits = bits;
  summary->bits_batch_stride = mask.batches == 1 ? 0 : mask.heads * mask.rows * row_words;
  summary->bits_head_stride = mask.rows * row_words;
  summary->bits_row_stride = mask.rows == 1 ? 0 : row_words;
  summary->bits_row_words = static_cast<int>(row_words);
  summary->key_broadcast = mask.cols == 1;
  if (tile_summary_bytes(mask) == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks),
                  static_cast<unsigned>(mask.batches * mask.heads));
  tile_summary_kernel<<<grid, kThreads, 0, stream>>>(mask, out, bits);
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels
