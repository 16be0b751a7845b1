// One CTA per strip of kStripBlocks summary blocks along the keys (kSummaryBlock rows x
// kStripBlocks · kSummaryBlock keys): per block, the OR of "some key visible" and "some key
// hidden" over its elements inside the mask, one byte out; and the strip's elements as bits,
// written as whole words. A strip rather than a block per CTA: every thread has several 16-byte
// loads in flight, which the mask's read (as large as the attention's K and V on long sequences)
// needs to run at memory bandwidth.
#include "kernels/common/tile_summary.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kStripBlocks = 4;
constexpr int kStripCols = kStripBlocks * kSummaryBlock;
constexpr int kStripWords = kStripCols / 32;
constexpr int kVectorsPerRow = kSummaryBlock / 16;  // 16-byte vectors per row of a block
static_assert(kThreads == kSummaryBlock * kVectorsPerRow, "the vectorized path gives a thread one vector per block");
static_assert(kStripBlocks <= 4, "a block's flags are one byte of a 32-bit word");

__host__ __device__ std::int64_t blocks_of(std::int64_t n) { return (n + kSummaryBlock - 1) / kSummaryBlock; }
__host__ __device__ std::int64_t words_of(std::int64_t cols) { return (cols + 31) / 32; }
std::size_t classes_bytes(const MaskExtent& mask) {
  return static_cast<std::size_t>(mask.batches * mask.heads * blocks_of(mask.rows) * blocks_of(mask.cols));
}
// The bits start 16-byte aligned after the classes.
std::size_t bits_offset(const MaskExtent& mask) { return (classes_bytes(mask) + 15) / 16 * 16; }

// Bit i set where byte i of the 16 is nonzero.
__device__ __forceinline__ std::uint32_t nonzero_bytes(const uint4& v) {
  std::uint32_t bits = 0;
  int i = 0;
  for (const std::uint32_t word : {v.x, v.y, v.z, v.w}) {
    for (int byte = 0; byte < 4; ++byte, ++i) bits |= std::uint32_t(((word >> (8 * byte)) & 0xffu) != 0) << i;
  }
  return bits;
}

__global__ void __launch_bounds__(kThreads) tile_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                 std::uint32_t* bits_out) {
  __shared__ std::uint32_t words[kSummaryBlock][kStripWords];
  __shared__ __align__(4) std::uint8_t flags[kStripBlocks];
  const std::int64_t col_blocks = blocks_of(mask.cols), row_blocks = gridDim.y;
  const std::int64_t bh = blockIdx.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::int64_t r0 = std::int64_t(blockIdx.y) * kSummaryBlock, c0 = std::int64_t(blockIdx.x) * kStripCols;
  const int rows = static_cast<int>(mask.rows - r0 < kSummaryBlock ? mask.rows - r0 : kSummaryBlock);
  const int cols = static_cast<int>(mask.cols - c0 < kStripCols ? mask.cols - c0 : kStripCols);
  const std::uint8_t* base =
      mask.ptr + b * mask.batch_stride + h * mask.head_stride + r0 * mask.row_stride + c0 * mask.col_stride;
  std::uint32_t* bits_row0 = bits_out + (bh * mask.rows + r0) * words_of(mask.cols) + c0 / 32;
  if (threadIdx.x < kStripBlocks) flags[threadIdx.x] = 0;
  // Keys of the strip at or past `seen` are causally hidden from every one of its rows.
  int seen = cols;
  if (mask.causal) {
    const std::int64_t last_key = r0 + rows - 1 + mask.diagonal;
    seen = static_cast<int>(last_key < c0 ? 0 : (last_key - c0 + 1 < cols ? last_key - c0 + 1 : cols));
  }

  for (int i = threadIdx.x; i < kSummaryBlock * kStripWords; i += kThreads) words[i / kStripWords][i % kStripWords] = 0;
  __syncthreads();  // flags and words cleared

  // Whole blocks of 16-byte-aligned rows: thread t reads vector t % 4 of row t / 4 in each
  // block, all loads issued before the first is used; the 16 bits of a vector pair up across
  // neighbouring lanes into the row's words, and warp votes give each block's flags.
  const bool aligned = mask.col_stride == 1 && mask.row_stride % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(base) % 16 == 0;
  const int vector_blocks = aligned ? cols / kSummaryBlock : 0;
  {
    const int row = threadIdx.x / kVectorsPerRow, vec = threadIdx.x % kVectorsPerRow;
    uint4 v[kStripBlocks];
    bool read[kStripBlocks];
#pragma unroll
    for (int k = 0; k < kStripBlocks; ++k) {
      read[k] = row < rows && k < vector_blocks && k * kSummaryBlock < seen;
      v[k] = read[k] ? *reinterpret_cast<const uint4*>(base + row * mask.row_stride + k * kSummaryBlock + vec * 16)
                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kStripBlocks; ++k) {
      if (k >= vector_blocks) break;  // uniform: every lane takes part in the shuffles and votes
      const std::uint32_t keep = nonzero_bytes(v[k]);
      const std::uint32_t pair = keep | (__shfl_down_sync(0xffffffffu, keep, 1) << 16);
      if (read[k] && vec % 2 == 0) bits_row0[row * words_of(mask.cols) + k * (kSummaryBlock / 32) + vec / 2] = pair;
      const bool visible = __any_sync(0xffffffffu, read[k] && keep != 0);
      const bool hidden = __any_sync(0xffffffffu, read[k] && keep != 0xffffu);
      if (threadIdx.x % 32 == 0 && (visible || hidden)) {
        atomicOr(reinterpret_cast<unsigned int*>(flags),
                 unsigned((visible ? kTileHasVisible : 0) | (hidden ? kTileHasHidden : 0)) << (8 * k));
      }
    }
  }

  // The rest of the strip element by element: a block cut by the end of the keys, or every
  // block of a mask whose rows are not 16-byte aligned.
  const int first_col = vector_blocks * kSummaryBlock;
  const int scalar_cols = seen > first_col ? seen - first_col : 0;
  unsigned my_flags = 0;  // byte k: block k's flags
  for (int e = threadIdx.x; e < rows * scalar_cols; e += kThreads) {
    const int row = e / scalar_cols, col = first_col + e % scalar_cols;
    const bool keep = base[row * mask.row_stride + col * mask.col_stride] != 0;
    my_flags |= unsigned(keep ? kTileHasVisible : kTileHasHidden) << (8 * (col / kSummaryBlock));
    if (keep) atomicOr(&words[row][col / 32], 1u << (col % 32));
  }
  if (my_flags) atomicOr(reinterpret_cast<unsigned int*>(flags), my_flags);
  __syncthreads();
  const int first_word = first_col / 32, scalar_words = static_cast<int>(words_of(cols)) - first_word;
  for (int i = threadIdx.x; i < rows * scalar_words; i += kThreads) {
    const int row = i / scalar_words, w = first_word + i % scalar_words;
    bits_row0[row * words_of(mask.cols) + w] = words[row][w];
  }
  const std::int64_t first_block = std::int64_t(blockIdx.x) * kStripBlocks;
  if (threadIdx.x < kStripBlocks && first_block + threadIdx.x < col_blocks) {
    out[(bh * row_blocks + blockIdx.y) * col_blocks + first_block + threadIdx.x] = flags[threadIdx.x];
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
  if (tile_summary_bytes(mask) == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((col_blocks + kStripBlocks - 1) / kStripBlocks), static_cast<unsigned>(row_blocks),
                  static_cast<unsigned>(mask.batches * mask.heads));
  tile_summary_kernel<<<grid, kThreads, 0, stream>>>(mask, out, bits);
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels
